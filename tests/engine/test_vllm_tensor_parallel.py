"""Tensor parallel on the CPU build: two ranks, one CPU core each, on a tiny Qwen3-MoE.

Each rank holds half of the vocabulary's rows, and half of each routed expert (vLLM
shards the intermediate dimension): each rank's share of the host-compute experts is its
own host-compute unit, computed by its own CPU kernel on its core, its partial sum
reduced by vLLM's all-reduce as for any MoE method. The host embedding must serve that rank's
shard through vLLM's own masking (on CUDA vLLM would take its fused lookup, which skips
the host gather: the glue turns it off; tests/unit/vllm_glue/test_glue_units.py drives that branch).
Every rank judges its own bytes and writes its own report file; the report read by the
caller merges them.
"""

from __future__ import annotations

import pytest

import selective_offload
from helpers import compute_experts_plan, generate_tokens, generate_with_plan, save_tiny_qwen3_moe
from selective_offload.plan_format import Serving

pytestmark = pytest.mark.vllm


def test_two_ranks_with_the_embedding_and_computed_experts_on_the_host(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    model = save_tiny_qwen3_moe(tmp_path / "m", seed=9)
    plan = compute_experts_plan(model, ranks=2, cpu_threads=2)  # the host's two cores, one per rank
    computed = [g.group for g in plan.groups if g.serving == Serving.COMPUTE]
    assert computed and (plan.host_compute.ranks, plan.host_compute.threads) == (2, 1)
    selective_offload.disable()
    plain = generate_tokens(model, tensor_parallel_size=2)
    tokens, report = generate_with_plan(plan, model, tensor_parallel_size=2)
    assert tokens == plain
    assert report.ok, report.problems
    shard = 1024 // 2 * 128 * 4  # half the vocabulary's rows, float32 in the engine
    embed = report.landing("model.embed_tokens")
    assert (embed.actual, embed.host_bytes, embed.routed_bytes, embed.device_bytes) == ("gather", shard, shard, 0)
    experts_shard = 8 * 3 * 64 * 128 * 4 // 2  # half of each expert's intermediate rows
    for name in computed:
        g = report.landing(name)
        assert (g.actual, g.host_bytes, g.routed_bytes, g.device_bytes) == ("compute", experts_shard,
                                                                           experts_shard, 0)
    assert report.ranks == {"rank1": {"ok": True, "landed_cold_on_host_bytes": shard, "landed_prefetch_bytes": 0,
                                      "landed_uva_bytes": 0,
                                      "landed_host_compute_bytes": len(computed) * experts_shard,
                                      "problems": [], "error": None}}


def two_rank_mlp_plan(model, monkeypatch, cpu_tflops: float, **inputs):
    """Two ranks on the host's two cores (one each, spawned workers), and the plan of a dense
    ``model`` whose budget its cold set cannot close, with its MLPs computed on the host by
    both ranks' shards at the CPU matmul rate given (which sets the crossover); the MLP groups."""
    from helpers import FALLBACK_FRACTIONS, TINY_HOST_COMPUTE, copy_room
    from selective_offload.checkpoint import load_checkpoint
    from selective_offload.planner import PlanInputs, make_plan

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    ckpt = load_checkpoint(model)
    room = copy_room(ckpt, tokens=inputs.get("max_num_batched_tokens"))
    for fraction in (0.6, *FALLBACK_FRACTIONS):  # beside the room a step above the crossover holds
        plan = make_plan(ckpt, PlanInputs(device_memory_bytes=int(ckpt.total_bytes * fraction) + room,
                                          kv_cache_bytes=0, reserve_bytes=0,
                                          **{**TINY_HOST_COMPUTE, "cpu_tflops": cpu_tflops, "ranks": 2,
                                             "cpu_threads": 2, **inputs}))
        if plan.host_compute is not None:
            break
    mlps = [g.group for g in plan.groups if g.kind == "mlp"]
    assert mlps and plan.host_compute is not None and plan.host_compute.ranks == 2
    return plan, mlps


def test_two_ranks_with_dense_mlps_computed_on_the_host(tmp_path, monkeypatch):
    """Each rank computes its shard of each host MLP (half its intermediate rows) and the
    partial sums are all-reduced, as ``down_proj`` would: tokens as plain vLLM's."""
    from helpers import save_tiny_qwen3

    model = save_tiny_qwen3(tmp_path / "dense", seed=9)
    plan, mlps = two_rank_mlp_plan(model, monkeypatch, cpu_tflops=0.1)
    selective_offload.disable()
    plain = generate_tokens(model, tensor_parallel_size=2)
    tokens, report = generate_with_plan(plan, model, tensor_parallel_size=2)
    assert tokens == plain
    assert report.ok, report.problems
    shard = 3 * 512 * 256 * 4 // 2  # half of each MLP's intermediate rows, float32 in the engine
    for name in mlps:
        g = report.landing(name)
        assert (g.actual, g.host_bytes, g.device_bytes) == ("compute", shard, 0)


def test_two_ranks_with_int4_mlps_computed_on_the_host(tmp_path, monkeypatch):
    """A GPTQ int4 Qwen3 over two ranks: each rank's shard of each MLP (half of gate_up's
    output rows, half of down_proj's input columns with their groups) is rewritten row-major
    and computed by its own int4 kernel, the partial sums all-reduced. The committed kernel
    benchmark does not claim int4, so the plan is made as after a probe of a host where the
    int4 kernel reads 0.75 of the host's read rate: claimed on that host, in the plan itself
    (``inputs.cpu_read_gbps``), which the spawned workers read and check against the
    plan's format against the same rule. The kernel rounds its tokens to int8, so the check is test_vllm_int4's:
    plain vLLM's greedy tokens fed back, every position's log-probability within its
    tolerance of plain vLLM's with the same two ranks."""
    from helpers import PROMPTS, assert_within_tolerance, prompt_logprobs, save_tiny_gptq_qwen3, with_plan

    model = save_tiny_gptq_qwen3(tmp_path / "gptq", seed=9)
    # a CPU fast enough that every step, prefill too, stays on the host kernel
    # the int4 replica's MLPs are planned for a short step (helpers.host_kernel_against_plain)
    plan, mlps = two_rank_mlp_plan(model, monkeypatch, cpu_tflops=100.0, cpu_gbps=30.0, cpu_gbps_source="measured",
                                   max_num_batched_tokens=16,
                                   cpu_read_gbps=40.0, link_gbps=0.01)
    assert plan.host_compute.format == "int4" and any("claimed on this host" in n for n in plan.notes)
    selective_offload.disable()
    engine = dict(tensor_parallel_size=2, dtype="bfloat16")
    plain = generate_tokens(model, dtype="bfloat16")  # only the sequences to feed back: one rank will do
    sequences = [list(p) + t for p, t in zip(PROMPTS, plain)]
    plain_lp = prompt_logprobs(model, sequences, **engine)
    host_lp, report = with_plan(plan, lambda args: prompt_logprobs(model, sequences, **{**args, **engine}))
    assert report.ok, report.problems
    for name in mlps:  # (a spawned engine's counters are as of its loading: no steps yet)
        assert report.landing(name).actual == "compute"
        served = report.transfers[name]
        assert (served["kernel"], served["threads"], served["crossover_tokens"]) == (
            "int4", 1, plan.host_compute.crossover_tokens), served
    assert_within_tolerance("int8 activations, int4 weights", plain_lp, host_lp)  # two ranks
