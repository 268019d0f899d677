"""The host-compute glue's refusals before anything is built, against vLLM's own config
classes: a plan priced for another number of ranks, CUDA graphs captured above the
crossover, and what the CPU kernels cannot compute."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from helpers import compute_experts_plan, save_tiny_qwen3_moe
from selective_offload.errors import PlanError
from selective_offload.vllm_glue import host_compute
from vllm.config import CompilationConfig, ParallelConfig


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    return compute_experts_plan(save_tiny_qwen3_moe(tmp_path_factory.mktemp("moe"), seed=3))


def config(tp: int = 1, sizes=(1, 2, 4), eager: bool = False):
    return SimpleNamespace(parallel_config=ParallelConfig(tensor_parallel_size=tp),
                           compilation_config=CompilationConfig(cudagraph_capture_sizes=list(sizes)),
                           model_config=SimpleNamespace(enforce_eager=eager))


def test_a_plan_for_another_number_of_ranks_is_refused(plan):
    host_compute.refuse_other_ranks(plan, config(tp=1))
    with pytest.raises(PlanError, match=r"for 1 rank\(s\) .* this engine runs 2; .*plan --ranks 2"):
        host_compute.refuse_other_ranks(plan, config(tp=2))


def test_graphs_above_the_crossover_are_refused_on_cuda_naming_the_cap(plan):
    crossover = plan.host_compute.crossover_tokens
    cuda = torch.device("cuda", 0)
    host_compute.refuse_graphs_above_crossover(plan, config(sizes=(1, crossover)), cuda)
    host_compute.refuse_graphs_above_crossover(plan, config(sizes=(1, 512), eager=True), cuda)
    host_compute.refuse_graphs_above_crossover(plan, config(sizes=(1, 512)), torch.device("cpu"))
    with pytest.raises(PlanError, match=rf"graphs of up to 512 tokens, and the plan computes routed experts on the "
                                        rf"host.*--max-cudagraph-capture-size {crossover}"):
        host_compute.refuse_graphs_above_crossover(plan, config(sizes=(1, 512)), cuda)


def test_a_dense_plan_refused_the_same_says_it_computes_dense_mlps(tmp_path):
    from helpers import TINY_HOST_COMPUTE, save_tiny_qwen3
    from selective_offload.checkpoint import load_checkpoint
    from selective_offload.planner import PlanInputs, make_plan

    ckpt = load_checkpoint(save_tiny_qwen3(tmp_path / "dense", seed=3))
    dense = make_plan(ckpt, PlanInputs(device_memory_bytes=ckpt.total_bytes * 7 // 10, kv_cache_bytes=0,
                                       reserve_bytes=0, **TINY_HOST_COMPUTE))
    assert dense.host_compute is not None and not any(g.kind == "experts" for g in dense.groups)
    with pytest.raises(PlanError, match="the plan computes dense MLPs on the host"):
        host_compute.refuse_graphs_above_crossover(dense, config(sizes=(1, 512)), torch.device("cuda", 0))


def test_an_activation_the_kernels_do_not_compute_is_refused():
    module = SimpleNamespace(activation=SimpleNamespace(value="gelu"))
    with pytest.raises(PlanError, match="do not compute the gelu activation"):
        host_compute.activation_of("model.layers.0.mlp.experts", module)
    assert host_compute.activation_of("g", SimpleNamespace(activation=SimpleNamespace(value="silu"))).kind == "silu"
    oai = host_compute.activation_of("g", SimpleNamespace(activation=SimpleNamespace(value="swigluoai"),
                                                          moe_config=SimpleNamespace(swiglu_alpha=1.5, swiglu_limit=6.0)))
    assert (oai.kind, oai.alpha, oai.limit) == ("swigluoai", 1.5, 6.0)


def test_the_serve_command_a_host_compute_plan_prints_caps_graphs_where_the_worker_accepts_them(plan, tmp_path):
    """``plan``'s ``next:`` serve command, parsed by vLLM's own engine arguments, caps CUDA
    graphs at the plan's crossover: the size the worker's refusal accepts (vLLM's default
    captures up to 512 tokens, which it refuses)."""
    from selective_offload.planner.serving import vllm_default_graph_tokens
    from test_serving import served

    engine = served(plan)
    crossover = plan.host_compute.crossover_tokens
    assert engine.max_cudagraph_capture_size == crossover < vllm_default_graph_tokens(plan.inputs.card)
    host_compute.refuse_graphs_above_crossover(plan, config(sizes=(1, engine.max_cudagraph_capture_size)),
                                               torch.device("cuda", 0))
    # a plan computing nothing on the host leaves vLLM's default alone
    uva = compute_experts_plan(save_tiny_qwen3_moe(tmp_path / "moe", seed=3), required=False, host_compute=False)
    assert uva.host_compute is None and served(uva).max_cudagraph_capture_size is None
