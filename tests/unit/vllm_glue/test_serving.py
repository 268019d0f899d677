"""What ``plan``'s serve command and ``enable()`` tell vLLM so that the server runs the plan
as it was priced (``planner.serving``), read back by vLLM's own engine arguments."""

from __future__ import annotations

import shlex

import pytest
from vllm.engine.arg_utils import EngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser

import selective_offload
from helpers import save_tiny_qwen3
from selective_offload import cli
from selective_offload.checkpoint import load_checkpoint
from selective_offload.cpu_kernels import claimed
from selective_offload.plan_format.inputs import InputError
from selective_offload.plan_options import BUNDLED
from selective_offload.planner import PlanInputs, make_plan
from selective_offload.planner.serving import engine_settings, vllm_default_graph_tokens
from selective_offload.sizes import GiB

pytestmark = pytest.mark.usefixtures("nothing_enabled")


def served(plan, model="model-dir"):
    """``plan``'s serve command (after ``vllm serve MODEL``) as vLLM's EngineArgs read it."""
    args = cli.build_parser().parse_args(["plan", model, "--device-memory", "24GiB", "-o", "plan.json"])
    words = shlex.split(cli.next_commands(args, plan, type("C", (), {"kind": "safetensors"}))[0])
    at = words.index("vllm")  # after SELECTIVE_OFFLOAD_PLAN=..., or first when no plan is needed
    assert words[at:at + 3] == ["vllm", "serve", model]
    return EngineArgs.from_cli_args(EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(words[at + 3:]))


def test_a_plan_that_fills_its_budget_keeps_its_kv_cache_and_graph_cap_on_the_server(monkeypatch):
    """The bundled reference on 24 GiB moves weights off the device to fit card - KV - reserve:
    vLLM is told the plan's KV cache (else it would size one from 0.9 of the card less the
    weights and what its profile run holds, not the plan's) and, its MLPs computed on the
    host, the crossover as its largest CUDA graph."""
    monkeypatch.setitem(claimed.CLAIMED, "fp8-block", True)
    plan = make_plan(load_checkpoint(BUNDLED["qwen3.8-27b-fp8"]), PlanInputs(device_memory_bytes=24 * GiB))
    assert plan.deficit_bytes > 0 and plan.host_compute is not None
    crossover = plan.host_compute.crossover_tokens
    engine = served(plan)
    assert engine.kv_cache_memory_bytes == plan.inputs.kv_cache_bytes == GiB
    assert engine.max_cudagraph_capture_size == crossover < vllm_default_graph_tokens(plan.inputs.card)
    # planned without --max-model-len: vLLM fits the context to that KV cache (its auto-fit)
    assert plan.inputs.max_model_len is None and engine.max_model_len == -1
    # what vLLM would keep for the KV cache by its default: 0.9 of what the card reports (the
    # plan's usable memory and the CUDA context) less the weights, buffers and the profile
    # run's copy: another size than the plan's
    from selective_offload.planner.cards import CONTEXT_EST_BYTES

    default = (0.9 * (plan.inputs.card_bytes + CONTEXT_EST_BYTES) - plan.device_bytes - plan.prefetch_buffer_bytes
               - plan.est_transient_device_bytes)
    assert abs(default - plan.inputs.kv_cache_bytes) > 0.1 * GiB
    assert engine_settings(plan) == {"kv_cache_memory_bytes": GiB, "max_model_len": -1,
                                     "compilation_config": {"max_cudagraph_capture_size": crossover}}
    # with a context given, the KV cache is sized from it and the context stays the one given
    sized = make_plan(load_checkpoint(BUNDLED["qwen3.8-27b-fp8"]),
                      PlanInputs(device_memory_bytes=24 * GiB, max_model_len=8192, max_seqs=2))
    assert "max_model_len" not in engine_settings(sized)
    assert engine_settings(sized)["kv_cache_memory_bytes"] == sized.inputs.kv_cache_bytes > 0


def test_a_plan_whose_weights_all_fit_leaves_vllms_kv_sizing_and_graphs_alone(tmp_path):
    model = save_tiny_qwen3(tmp_path / "tiny", seed=3)
    ckpt = load_checkpoint(model)
    plan = make_plan(ckpt, PlanInputs(device_memory_bytes=ckpt.total_bytes * 4, kv_cache_bytes=ckpt.total_bytes,
                                      reserve_bytes=0))
    assert plan.deficit_bytes <= 0 and plan.host_compute is None
    engine = served(plan)
    assert engine.kv_cache_memory_bytes is None and engine.max_cudagraph_capture_size is None
    assert selective_offload.enable(plan) == {"model": str(model)}


def test_a_kv_length_without_its_sequence_count_is_refused_naming_the_one_given():
    """``max_model_len`` and ``max_seqs`` size the KV cache together: a plan given one of them
    from Python is refused with the typed error naming the one given, not a NameError."""
    checkpoint = load_checkpoint(BUNDLED["qwen3.8-27b-fp8"])
    for given in ({"max_model_len": 8192}, {"max_seqs": 2}):
        with pytest.raises(InputError, match="give both or neither") as caught:
            make_plan(checkpoint, PlanInputs(device_memory_bytes=24 * GiB, **given))
        assert caught.value.field == next(iter(given))
