"""The host-compute glue before anything is built, against vLLM's own config classes: a plan
priced for another number of ranks refused, CUDA graph sizes above the crossover capped,
and what the CPU kernels cannot compute refused."""

from __future__ import annotations

import re
import shlex
from types import SimpleNamespace

import pytest
import torch
from test_serving import served
from vllm.config import CompilationConfig, ParallelConfig, VllmConfig, set_current_vllm_config
from vllm.engine.arg_utils import EngineArgs
from vllm.model_executor.layers.activation import GeluAndMul, SiluAndMul
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.utils.argparse_utils import FlexibleArgumentParser

from helpers import (
    REPO,
    TINY_DENSE_STEP,
    TINY_HOST_COMPUTE,
    compute_experts_plan,
    copy_room,
    save_tiny_qwen3,
    save_tiny_qwen3_moe,
)
from selective_offload.checkpoint import load_checkpoint
from selective_offload.errors import PlanError
from selective_offload.planner import PlanInputs, make_plan
from selective_offload.planner.serving import vllm_default_graph_tokens
from selective_offload.vllm_glue import graphs, host_compute, host_mlp


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


def test_graphs_above_the_crossover_are_capped_in_the_workers_config_on_cuda(plan):
    """vLLM's default sizes (1 to 512) trimmed in place to those at or below the crossover,
    on vLLM's own CompilationConfig, so ``vllm serve`` with its defaults starts; the
    dispatcher reads them after loading (tests/contract: cudagraph_sizes_after_load)."""
    crossover = plan.host_compute.crossover_tokens
    cuda = torch.device("cuda", 0)
    assert graphs.cap_graphs_at_crossover(plan, config(sizes=(1, crossover)), cuda) is None
    assert graphs.cap_graphs_at_crossover(plan, config(sizes=(1, 512), eager=True), cuda) is None
    assert graphs.cap_graphs_at_crossover(plan, config(sizes=(1, 512)), torch.device("cpu")) is None
    defaults = config(sizes=[1, 2, 4] + list(range(8, 256, 8)) + list(range(256, 513, 16)))
    note = graphs.cap_graphs_at_crossover(plan, defaults, cuda)
    kept = defaults.compilation_config.cudagraph_capture_sizes
    assert kept and max(kept) <= crossover and kept == sorted(n for n in kept)
    assert kept == [n for n in [1, 2, 4] + list(range(8, 256, 8)) if n <= crossover]
    assert defaults.compilation_config.max_cudagraph_capture_size == kept[-1]
    assert f"up to {kept[-1]} tokens of vLLM's" in note and "routed experts" in note


def test_a_dense_plan_capped_the_same_says_it_computes_dense_mlps(tmp_path):
    ckpt = load_checkpoint(save_tiny_qwen3(tmp_path / "dense", seed=3))
    room = copy_room(ckpt, "mlp", TINY_DENSE_STEP)
    dense = make_plan(ckpt, PlanInputs(device_memory_bytes=ckpt.total_bytes * 6 // 10 + room, kv_cache_bytes=0,
                                       reserve_bytes=0,
                                       **{**TINY_HOST_COMPUTE, "max_num_batched_tokens": TINY_DENSE_STEP}))
    assert dense.host_compute is not None and not any(g.kind == "experts" for g in dense.groups)
    note = graphs.cap_graphs_at_crossover(dense, config(sizes=(1, 512)), torch.device("cuda", 0))
    assert "the plan computes dense MLPs on the host" in note
    # a crossover no graph size is at or below: refused, naming enforce_eager
    with pytest.raises(PlanError, match="--enforce-eager"):
        graphs.cap_graphs_at_crossover(dense, config(sizes=(dense.host_compute.crossover_tokens + 1, 512)),
                                             torch.device("cuda", 0))


def experts_layer(act: str, **extra):
    """What the glue reads of vLLM's ``RoutedExperts`` (a stand-in: building one needs a
    vLLM config and a TP group; its attributes are 0.33's, checked by tests/contract)."""
    return SimpleNamespace(activation=MoEActivation(act), top_k=extra.pop("top_k", 2), **extra)


def test_what_the_kernels_do_not_compute_is_refused_in_one_line():
    """The worker's check, the table the planner reads (cpu_kernels.capability): vLLM's
    activations, a clamped silu, the router weight on the input past top-1; and for dense
    MLPs vLLM's own act-and-mul modules."""
    refused = {"gelu": "its activation is gelu (GELU with erf", "relu2_no_mul": "relu2, ungated",
               "swiglustep": "SwiGLU-step"}
    for act, said in refused.items():
        with pytest.raises(PlanError, match=re.escape(said)) as err:
            host_compute.activation_of("model.layers.0.mlp.experts", experts_layer(act))
        assert str(err.value).startswith("model.layers.0.mlp.experts: the CPU kernels do not compute")
        assert str(err.value).endswith("plan them served uva or on the device") and "\n" not in str(err.value)
    with pytest.raises(PlanError, match="clamps its silu gate and up at 7"):
        host_compute.activation_of("g", experts_layer("silu", swiglu_limit=7.0))
    with pytest.raises(PlanError, match="router weight to the input.*routes 2 experts per token"):
        host_compute.activation_of("g", experts_layer("silu", apply_router_weight_on_input=True))
    llama4 = experts_layer("silu", apply_router_weight_on_input=True, top_k=1)
    assert host_compute.activation_of("g", llama4).kind == "silu"
    assert host_compute.activation_of("g", experts_layer("gelu_tanh")).kind == "gelu_tanh"
    oai = host_compute.activation_of("g", experts_layer("swigluoai",
                                                       moe_config=SimpleNamespace(swiglu_alpha=1.5, swiglu_limit=6.0)))
    assert (oai.kind, oai.alpha, oai.limit) == ("swigluoai", 1.5, 6.0)
    with set_current_vllm_config(VllmConfig()):  # vLLM's custom ops are made under a config
        tanh, erf, silu = GeluAndMul(approximate="tanh"), GeluAndMul(), SiluAndMul()
    mlp = SimpleNamespace(act_fn=tanh, gate_up_proj=SimpleNamespace(bias=None))
    assert host_mlp.mlp_activation("m", mlp).kind == "gelu_tanh"
    assert host_mlp.mlp_activation("m", SimpleNamespace(act_fn=silu)).kind == "silu"
    with pytest.raises(PlanError, match="do not compute this MLP: its activation is gelu .*plan it on the device"):
        host_mlp.mlp_activation("m", SimpleNamespace(act_fn=erf))
    with pytest.raises(PlanError, match="projections have biases"):
        host_mlp.mlp_activation("m", SimpleNamespace(act_fn=silu, down_proj=SimpleNamespace(bias=torch.ones(2))))


def test_the_serve_command_a_host_compute_plan_prints_caps_graphs_where_the_worker_accepts_them(plan, tmp_path):
    """``plan``'s ``next:`` serve command, parsed by vLLM's own engine arguments, caps CUDA
    graphs at the plan's crossover: the size the worker's refusal accepts (vLLM's default
    captures up to 512 tokens, which it refuses)."""

    engine = served(plan)
    crossover = plan.host_compute.crossover_tokens
    assert engine.max_cudagraph_capture_size == crossover < vllm_default_graph_tokens(plan.inputs.card)
    assert graphs.cap_graphs_at_crossover(plan, config(sizes=(1, engine.max_cudagraph_capture_size)),
                                                torch.device("cuda", 0)) is None  # nothing left to cap
    # a plan computing nothing on the host leaves vLLM's default alone
    uva = compute_experts_plan(save_tiny_qwen3_moe(tmp_path / "moe", seed=3), required=False, host_compute=False)
    assert uva.host_compute is None and served(uva).max_cudagraph_capture_size is None


def vllm_default_sizes(most: int) -> list[int]:
    """vLLM 0.33's default capture sizes up to ``most`` (``VllmConfig._set_cudagraph_sizes``:
    1, 2, 4, then every 8 below 256, then every 16 up to the most)."""
    return [n for n in [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, most + 1, 16)) if n <= most]


def test_the_readmes_auto_command_starts_a_host_compute_plan_with_vllms_default_graphs(plan):
    """``SELECTIVE_OFFLOAD_PLAN=auto vllm serve MODEL``, as the README prints it: no flag of
    the plan's, so vLLM captures its default sizes (up to 512 tokens), and the worker caps
    them at the plan's crossover instead of refusing to start."""


    readme = (REPO / "README.md").read_text()
    line = next(m.group(0) for m in re.finditer(r"^SELECTIVE_OFFLOAD_PLAN=auto vllm serve .*$", readme, re.MULTILINE))
    words = shlex.split(line)
    assert words[:3] == ["SELECTIVE_OFFLOAD_PLAN=auto", "vllm", "serve"] and len(words) == 4  # the model alone
    engine = EngineArgs.from_cli_args(EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(words[4:]))
    assert engine.max_cudagraph_capture_size is None  # vLLM's default stands
    most = vllm_default_graph_tokens(plan.inputs.card)
    assert plan.host_compute.crossover_tokens < most
    server = config(sizes=vllm_default_sizes(most))
    note = graphs.cap_graphs_at_crossover(plan, server, torch.device("cuda", 0))
    assert note and server.compilation_config.max_cudagraph_capture_size <= plan.host_compute.crossover_tokens
