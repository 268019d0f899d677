"""The plan's checkpoint names as vLLM's own model classes name them (no engine): each
class's ``hf_to_vllm_mapper`` applied to a tiny checkpoint of its family, and the one-line
refusal of a plan group the built model has no module for."""

from __future__ import annotations

import importlib

import pytest
from torch import nn

from helpers import TINY_MOE_FAMILIES, save_tiny_moe, save_tiny_qwen3_moe, uva_experts_plan
from selective_offload.checkpoint import load_checkpoint
from selective_offload.errors import PlanError
from selective_offload.names import FUSED_EXPERTS_RENAMES, ModelNames, experts_prefix, group_key, model_names
from selective_offload.vllm_glue.model_names import class_mapping, refuse_unnamed

pytestmark = pytest.mark.vllm

#: vLLM's model class of each tiny family (the architecture its config names).
CLASSES = {"gpt_oss": ("gpt_oss", "GptOssForCausalLM"), "mixtral": ("mixtral", "MixtralForCausalLM"),
           "qwen2_moe": ("qwen2_moe", "Qwen2MoeForCausalLM"), "glm4_moe": ("glm4_moe", "Glm4MoeForCausalLM"),
           "qwen3_moe": ("qwen3_moe", "Qwen3MoeForCausalLM"), "deepseek_v3": ("deepseek_v2", "DeepseekV3ForCausalLM"),
           "gemma4_moe": ("gemma4", "Gemma4ForCausalLM"), "granitemoe": ("granitemoe", "GraniteMoeForCausalLM")}


def vllm_class(family: str) -> type:
    module, name = CLASSES[family]
    return getattr(importlib.import_module(f"vllm.model_executor.models.{module}"), name)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """family -> (its tiny checkpoint directory, the planner's plan with experts served uva)."""
    out = {}
    for family in [*TINY_MOE_FAMILIES, "qwen3_moe"]:
        d = tmp_path_factory.mktemp(family)
        if family == "qwen3_moe":
            save_tiny_qwen3_moe(d, num_hidden_layers=2, num_experts=4)
        else:
            save_tiny_moe(d, family)
        out[family] = (d, uva_experts_plan(d))
    return out


def names_of(family, tiny) -> ModelNames:
    d, plan = tiny[family]
    mapping, source = class_mapping(vllm_class(family))
    return model_names([g.group for g in plan.groups], load_checkpoint(d).tensors, mapping,
                       plan.inputs.cold_segments, source)


def test_gpt_oss_names_its_embedding_through_its_own_mapper(tiny):
    """vLLM's GptOssForCausalLM says in its hf_to_vllm_mapper that the checkpoint's
    ``model.embed_tokens`` is its ``model.embedding``: the plan's embedding group is keyed
    by that name, and its routed experts (renamed inside: ``gate_up_proj`` ->
    ``w13_weight``) keep their layer's key."""
    _, plan = tiny["gpt_oss"]
    names = names_of("gpt_oss", tiny)
    cold = plan.inputs.cold_segments
    assert "hf_to_vllm_mapper" in names.source
    assert dict(names.renamed) == {"model.embed_tokens": "model.embedding"}
    assert names.key("model.embed_tokens", cold) == group_key("model.embedding.weight", names.segments(cold))
    assert names.key("model.layers.0.mlp.experts", cold) == ("experts", 0)
    assert "names model.embed_tokens as model.embedding" in names.describe()


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "glm4_moe", "qwen3_moe", "deepseek_v3", "gemma4_moe"])
def test_other_moe_families_keep_every_group_key(family, tiny):
    """Mixtral, Qwen2-MoE (shared expert), GLM-4-MoE (dense first layer), Qwen3-MoE,
    DeepSeek-V3 and Gemma 4 MoE: their mappers rename q/k/v and gate/up into stacked parameters, inside a layer, so
    every group keeps the key of its checkpoint name."""
    _, plan = tiny[family]
    names = names_of(family, tiny)
    cold = plan.inputs.cold_segments
    assert all(names.key(g.group, cold) == group_key(g.group, cold) for g in plan.groups)
    assert not names.segment_renames and not names.describe()


def test_fused_experts_are_the_groups_vllms_own_mapper_loads_them_into(tiny):
    """Granite-MoE stores each layer's experts fused in ``block_sparse_moe.input_linear`` /
    ``output_linear``; vLLM's GraniteMoeModel maps them (its hf_to_vllm_mapper) onto the
    fused-MoE layer ``block_sparse_moe.experts``: the project's table is that mapping, and
    the plan's experts groups are the modules the mapped names land in."""
    from vllm.model_executor.models.granitemoe import GraniteMoeModel

    mapper = GraniteMoeModel.hf_to_vllm_mapper
    assert FUSED_EXPERTS_RENAMES.items() <= mapper.orig_to_new_suffix.items()
    d, plan = tiny["granitemoe"]
    fused = [n for n in load_checkpoint(d).tensors if n.endswith(tuple(FUSED_EXPERTS_RENAMES))]
    assert len(fused) == 4 and all(experts_prefix(n) == experts_prefix(mapper.map_name(n)) for n in fused)
    experts = [g.group for g in plan.groups if g.kind == "experts"]
    assert experts == [f"model.layers.{i}.block_sparse_moe.experts" for i in range(2)]
    assert {experts_prefix(mapper.map_name(n)) for n in fused} == set(experts)


class _GptOssShaped(nn.Module):
    """The module tree vLLM builds for gpt-oss (model.embedding, layers, norm, lm_head),
    standing in for the built model: only its names are read."""

    def __init__(self):
        super().__init__()
        self.model = nn.Module()
        self.model.embedding = nn.Embedding(4, 2)
        self.model.layers = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])
        self.model.norm = nn.LayerNorm(2)
        self.lm_head = nn.Linear(2, 4)


def test_a_group_the_built_model_has_no_module_for_is_refused_in_one_line(tiny):
    """Without the model class's mapping (a rename made in load_weights alone would look
    the same), the plan's embedding names no module of the model built: refused with one
    line before any weight loads. Through the mapping it is found."""
    _, plan = tiny["gpt_oss"]
    model = _GptOssShaped()
    with pytest.raises(PlanError, match="builds no module for the plan's model.embed_tokens") as err:
        refuse_unnamed(model, ModelNames(source="vLLM's GptOssForCausalLM"), plan)
    assert "\n" not in str(err.value)
    refuse_unnamed(model, names_of("gpt_oss", tiny), plan)
