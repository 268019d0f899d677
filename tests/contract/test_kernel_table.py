"""The kernel table (``selective_offload.planner.kernels``) is what vLLM 0.33's oracles say.

``check_kernel_table.py`` runs in a subprocess with 0.33.0's extracted sources first on
``sys.path`` (as test_vllm_contract.py runs its checks) and builds each row's quant method
with the row's compute capability and setting (stand-ins named in that script). Every row
must print ``ok``, or ``notrun`` for a row the table lists in ``NOT_RUN``; every advice line
(the setting a refusal names, applied to the oracle) must print ``ok``, and so must every pair
the table says post-processes on the host (0.33's own method run on host tensors). Every row
vLLM builds, on gpt-oss's and Qwen3-30B-A3B's shapes, must print ``ok sizes``: vLLM's own
round-up gives the planner's sizes and vLLM's ``create_weights`` allocates the bytes the
planner prices, for vLLM's own layout and, where a reference checkpoint has one, the
checkpoint's (or ``refused sizes`` where vLLM refuses the shape: gpt-oss's 2880 for the
128-blocked FP8 and WNA16 methods). On the cards vLLM can see with no column of their own
(``kernels.OFF_TABLE_CARDS``: 10.3, 12.1) every method either prints ``ok
off-table`` (the planner refuses the card, or vLLM's own selection and round-up there give
what the planner prices) or ``refused off-table`` (vLLM builds no kernel for the layer). The
pre-Ada columns (7.5, 8.0, 8.6, 8.7: an A100 among them) are rows like the others: MXFP4 is
priced there at Marlin's padded sizes, which vLLM's own round-up gives on each. vLLM's
fused-MoE workspace (``ok workspace ...``) is one buffer per process of the bytes the planner
prices, by 0.33's own modular kernel and workspace manager. What 0.33's post-processing
leaves of Marlin FP8 weights and scales (dense and routed experts) is what the planner prices
(``ok post-processing ...``, 0.33's own functions on host tensors, the CUDA repack a stand-in
of its shape), and so is the peak its Marlin FP8 MoE repack allocates beside a loaded layer
(torch's profiler on 0.33's own function); OAI triton_kernels' float32 expert biases are read
from its source.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from helpers import REPO
from selective_offload.planner import kernels

pytestmark = pytest.mark.vllm

SCRIPT = REPO / "tests" / "contract" / "check_kernel_table.py"


def _vllm_033():
    import importlib.util

    spec = importlib.util.spec_from_file_location("vllm_sources", REPO / "scripts" / "vllm_sources.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    src, reason = module.ensure_vllm_sources("0.33.0")
    if src is None:
        pytest.skip(f"vLLM 0.33.0's sources could not be fetched: {reason}")
    return src


def test_every_row_is_what_vllm_033_builds(tmp_path):
    src = _vllm_033()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), str(REPO)]), "VLLM_TARGET_DEVICE": "cpu",
           "VLLM_LOGGING_LEVEL": "ERROR"}
    proc = subprocess.run([sys.executable, str(SCRIPT)], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=600)
    lines = proc.stdout.splitlines()
    detail = f"\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr (tail)\n{proc.stderr[-3000:]}"
    failed = [line for line in lines if line.startswith("FAIL ")]
    assert not failed, "\n".join(failed) + detail
    ok = {line[3:] for line in lines if line.startswith("ok ") and not line.startswith(("ok advice ", "ok sizes ",
                                                                                       "ok host-post-processing ",
                                                                                       "ok off-table ", "ok workspace ",
                                                                                       "ok post-processing "))}
    notrun = {line[7:].split(":")[0] for line in lines if line.startswith("notrun ")}
    rows = {f"{m} | {s} | SM {c}" for (m, s) in kernels.KERNELS for c in kernels.CARDS}
    listed = {f"{m} | {s} | SM {c}" for (m, s, c) in kernels.NOT_RUN}
    assert notrun == listed, f"rows not run here: {sorted(notrun)}; the table lists {sorted(listed)}" + detail
    assert ok | notrun == rows, f"rows with no answer: {sorted(rows - ok - notrun)}" + detail
    advised = [line for line in lines if line.startswith("ok advice ")]
    refusals = [(m, c) for m in kernels.METHODS for c in kernels.CARDS
                if not kernels.reads_uva(kernels.kernel_for(m, c))]
    assert refusals and len(advised) == len(refusals), detail
    # the sizes vLLM allocates each row's experts at, on both shapes, are the planner's
    built = {f"{m} | {s} | SM {c}" for (m, s), row in kernels.KERNELS.items() for c, k in zip(kernels.CARDS, row)
             if k != kernels.REFUSED and (m, s, c) not in kernels.NOT_RUN}
    sized = {line[len("ok sizes "):].split(": ")[0] for line in lines if line.startswith("ok sizes ")}
    refused = {line[len("refused sizes "):].split(": ")[0] for line in lines if line.startswith("refused sizes ")}
    assert sized | refused == {f"{row} | {shape}" for row in built for shape in ("gpt-oss", "Qwen3-30B-A3B")}, detail
    # vLLM refuses only gpt-oss's 2880 for 128-blocked methods, never a reference shape of the method
    assert all(label.startswith(("fp8-block | ", "wna16 | ")) and label.endswith("| gpt-oss") for label in refused)
    # by hand: Marlin pads gpt-oss to hidden 3072, intermediate 2944; gate_up (2I x H) and down
    # (H x I) at 4.25 bits (codes and e8m0 scales of 32), bf16 biases of 2I and H
    per_expert = 3 * 3072 * 2944 * 17 // 32 + (2 * 2944 + 3072) * 2
    padded = [line for line in lines if line.startswith("ok sizes mxfp4 | auto | SM 8.6 | gpt-oss")]
    assert padded == [f"ok sizes mxfp4 | auto | SM 8.6 | gpt-oss: {per_expert} bytes per expert at (3072, 2944), "
                      "the checkpoint's layout too"], detail
    # the reference checkpoints' own layouts were priced on every row of their method
    layouts = [line for line in lines if line.startswith("ok sizes unquantized ")
               or (line.startswith("ok sizes mxfp4 ") and "| gpt-oss: " in line)]
    assert layouts and all(line.endswith(", the checkpoint's layout too") for line in layouts), detail
    # every method on every card vLLM can see with no column of its own: vLLM's round-up and
    # bytes are the planner's, or the planner refuses the card (MXFP4 below SM 9.0 among them)
    off = {line.split(" off-table ", 1)[1].split(": ")[0] for line in lines
           if line.startswith(("ok off-table ", "refused off-table "))}
    assert off == {f"{m} | SM {c} | {shape}" for m in kernels.METHODS for c in kernels.OFF_TABLE_CARDS
                   for shape in ("gpt-oss", "Qwen3-30B-A3B")}, detail
    # an A100 (8.0), a Turing (7.5) and a Jetson Orin (8.7) card: MXFP4 on Marlin at 8.6's padded sizes
    per_expert = 3 * 3072 * 2944 * 17 // 32 + (2 * 2944 + 3072) * 2
    for card in ("7.5", "8.0", "8.7"):
        assert (f"ok sizes mxfp4 | auto | SM {card} | gpt-oss: {per_expert} bytes per expert at (3072, 2944), "
                "the checkpoint's layout too") in lines, detail
    # vLLM's fused-MoE workspace: its own allocation, one buffer per process, of the bytes the planner prices
    from selective_offload.planner.allocation import WORKSPACE_KERNELS

    spaced = {line[len("ok workspace "):] for line in lines if line.startswith("ok workspace ")}
    assert spaced == {f"{k} | {shape}" for k in WORKSPACE_KERNELS for shape in ("gpt-oss", "Qwen3-30B-A3B")}, detail
    # what vLLM's post-processing leaves: Marlin FP8 by 0.33's own code, triton_kernels' and
    # FlashInfer TRT-LLM's float32 biases by its source
    post = [line for line in lines if line.startswith("ok post-processing ")]
    assert len(post) == 9 and any("triton-mxfp4 expert biases float32" in line for line in post), detail
    assert sum("marlin-fp8 experts repack transient" in line for line in post) == 2, detail
    assert any("trtllm-mxfp4 expert biases float32" in line for line in post), detail
    on_host = {line[len("ok host-post-processing "):] for line in lines if line.startswith("ok host-post-processing ")}
    assert on_host == {f"{m} | {k}" for m, k in kernels.HOST_POST_PROCESSING}, detail
    assert proc.returncode == 0, f"the script exited {proc.returncode}" + detail
