"""The layout catalogue (``builders.LAYOUT_CASES``) against vLLM 0.33's own functions.

Each catalogue entry with an ``oracle`` is a layout vLLM 0.33's post-processing code makes
on the CPU: tests/contract/vllm_layouts.py runs that code (the CUDA wheel's Python sources
first on ``sys.path``, as in test_vllm_contract.py) and the layout it returns must be the
catalogue's, so the layout property of tests/unit/wrappers/test_layout.py is tested over
what vLLM really produces. Entries without one are written down from the source line they
name (a GPU, ROCm or DeepGEMM's compiled library makes them).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from builders import LAYOUT_CASES
from helpers import REPO

pytestmark = pytest.mark.vllm

CUDA_RELEASE = "0.33.0"


def _vllm_sources():
    spec = importlib.util.spec_from_file_location("vllm_sources", REPO / "scripts" / "vllm_sources.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_catalogue_is_the_layout_vllm_033_leaves(tmp_path, capsys):
    with capsys.disabled():
        src, reason = _vllm_sources().ensure_vllm_sources(CUDA_RELEASE, log=print)
    if src is None:
        pytest.skip(f"vLLM {CUDA_RELEASE}'s sources could not be fetched: {reason}")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), str(REPO)]), "VLLM_TARGET_DEVICE": "cpu",
           "VLLM_LOGGING_LEVEL": "WARNING"}
    env.pop("SELECTIVE_OFFLOAD_PLAN", None)
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "contract" / "vllm_layouts.py")], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    cases = [c for c in LAYOUT_CASES if c.oracle]
    assert cases and set(got) == {c.oracle for c in cases}
    for case in cases:
        t = case.tensor()
        want = dict(dtype=str(t.dtype), shape=list(t.shape), stride=list(t.stride()), offset=t.storage_offset())
        assert got[case.oracle] == want, f"{case.name} ({case.where}): vLLM 0.33 leaves {got[case.oracle]}"
