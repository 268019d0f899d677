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
    with pytest.raises(PlanError, match=rf"graphs of up to 512 tokens.*--max-cudagraph-capture-size {crossover}"):
        host_compute.refuse_graphs_above_crossover(plan, config(sizes=(1, 512)), cuda)


def test_an_activation_the_kernels_do_not_compute_is_refused():
    module = SimpleNamespace(activation=SimpleNamespace(value="gelu"))
    with pytest.raises(PlanError, match="do not compute the gelu activation"):
        host_compute.activation_of("model.layers.0.mlp.experts", module)
    assert host_compute.activation_of("g", SimpleNamespace(activation=SimpleNamespace(value="silu"))).kind == "silu"
    oai = host_compute.activation_of("g", SimpleNamespace(activation=SimpleNamespace(value="swigluoai"),
                                                          moe_config=SimpleNamespace(swiglu_alpha=1.5, swiglu_limit=6.0)))
    assert (oai.kind, oai.alpha, oai.limit) == ("swigluoai", 1.5, 6.0)
