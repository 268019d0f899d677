"""The one naming rule the planner, construction routing and the report share."""

from __future__ import annotations

import pytest

from selective_offload.errors import PlanError
from selective_offload.names import (
    ModelNames,
    cold_prefix,
    cold_segment,
    group_key,
    layer_of,
    model_names,
    parameter_group_keys,
    unnamed_groups,
)

SEGS = ("embed_tokens", "visual")


def test_cold_prefix_matches_whole_segments_and_never_lm_head():
    assert cold_prefix("model.visual.blocks.0.attn", {"visual"}) == "model.visual"
    assert cold_prefix("model.visualise.proj", {"visual"}) is None
    assert cold_prefix("visual_proj", {"visual"}) is None
    assert cold_prefix("lm_head.embed_tokens", {"embed_tokens"}) is None
    assert cold_prefix("lm_head", {"lm_head"}) is None  # even when asked
    assert cold_segment("model.language_model.embed_tokens.weight", SEGS) == "embed_tokens"


def test_layer_of_names_the_stack_and_index():
    assert layer_of("model.layers.12.mlp.up_proj.weight") == ("model.layers", 12)
    assert layer_of("model.layers.3") == ("model.layers", 3)
    assert layer_of("model.layersx.3.w") is None and layer_of("model.norm.weight") is None


def test_group_keys_survive_vllm_renames():
    assert group_key("model.visual", SEGS) == group_key("visual.0", SEGS) == ("cold", "visual")
    assert group_key("model.layers.3", SEGS) == group_key("language_model.model.layers.3.qkv_proj", SEGS)
    assert group_key("model.norm", SEGS) == group_key("language_model.model.norm", SEGS)
    assert group_key("model.visualise", SEGS) == ("module", "visualise")


# ---- the plan's groups as the model names them (ModelNames)

COLD = ("embed_tokens", "visual")
#: A small model's checkpoint: embedding, a vision tower, two layers (the second with routed
#: experts as 3-D tensors, gpt-oss style), a final norm and the LM head.
TENSORS = ["model.embed_tokens.weight", "model.visual.blocks.0.attn.qkv.weight", "model.visual.merger.weight",
           "model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.up_proj.weight",
           "model.layers.1.self_attn.q_proj.weight", "model.layers.1.mlp.router.weight",
           "model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj_bias",
           "model.norm.weight", "lm_head.weight"]
GROUPS = ["model.embed_tokens", "model.visual", "model.layers.0", "model.layers.1", "model.layers.1.mlp.experts",
          "model.norm", "lm_head"]


def suffix_mapping(substr=(), prefix=(), suffix=()):
    """A tensor-name mapping applied as vLLM's WeightsMapper applies its rules (substring,
    then prefix, then suffix), written here so the core is tested without vLLM."""
    def mapping(name: str) -> str:
        for old, new in substr:
            name = name.replace(old, new, 1) if old in name else name
        for old, new in prefix:
            name = new + name[len(old):] if name.startswith(old) else name
        for old, new in suffix:
            name = new.join(name.rsplit(old, 1)) if name.endswith(old) else name
        return name
    return mapping


#: gpt-oss's renames in vLLM (its hf_to_vllm_mapper, in part).
GPT_OSS_LIKE = suffix_mapping(substr=[(".self_attn.", ".attn.")],
                              suffix=[(".embed_tokens.weight", ".embedding.weight"), (".gate_up_proj", ".w13_weight"),
                                      (".down_proj_bias", ".w2_bias")])


def test_a_renamed_embedding_is_found_by_its_name_in_the_model():
    """gpt-oss's vLLM model calls the checkpoint's ``model.embed_tokens`` ``model.embedding``
    (a rename of the leaf's module, by a suffix rule on ``.weight``): its group is keyed by
    that name, ``embedding`` becomes a cold segment in the model's spelling, and the
    renames inside layers and experts leave those groups' names alone."""
    names = model_names(GROUPS, TENSORS, GPT_OSS_LIKE, COLD, "gpt-oss")
    assert dict(names.renamed) == {"model.embed_tokens": "model.embedding"}
    assert names.segments(COLD) == {"embed_tokens", "embedding", "visual"}
    assert names.key("model.embed_tokens", COLD) == group_key("model.embedding.weight", names.segments(COLD))
    assert names.key("model.embed_tokens", COLD) == ("cold", "embedding") != group_key("model.embedding", COLD)
    assert names.key("model.layers.1.mlp.experts", COLD) == group_key("model.layers.1.mlp.experts.w13_weight", COLD)
    assert "names model.embed_tokens as model.embedding" in names.describe()


def test_renames_of_wrappers_keep_every_key():
    """A prefix rename (``model.visual.`` -> ``visual.``, Qwen2.5-VL's) renames the group,
    not its key; a model that loads the checkpoint's names as they are (no mapping) has
    no renames."""
    names = model_names(GROUPS, TENSORS, suffix_mapping(prefix=[("model.visual.", "visual.")]), COLD)
    assert dict(names.renamed) == {"model.visual": "visual"} and not names.segment_renames
    assert all(names.key(g, COLD) == group_key(g, COLD) for g in GROUPS) and not names.describe()
    assert model_names(GROUPS, TENSORS, None, COLD) == ModelNames(source="the model")
    leaf = model_names(GROUPS, TENSORS, suffix_mapping(suffix=[(".norm.weight", ".norm.scale")]), COLD)
    assert not leaf.renamed  # a leaf renamed inside its module: the module keeps its name


def test_names_that_cannot_be_mapped_are_refused_in_one_line():
    """A group split across modules of different keys, and a renamed cold segment that also
    names a module the plan keeps hot: the plan's groups cannot be found in the model, so
    the family is refused with one line (never a silent misplacement)."""
    split = suffix_mapping(substr=[("model.visual.merger", "model.projector")])
    with pytest.raises(PlanError, match="^vLLM's X puts the tensors of model.visual under .* cannot map") as err:
        model_names(GROUPS, TENSORS, split, COLD, "vLLM's X")
    assert "\n" not in str(err.value)
    onto_norm = suffix_mapping(suffix=[(".embed_tokens.weight", ".norm.weight")])
    with pytest.raises(PlanError, match="names model.norm.weight .* under norm, the model's name of a cold group") as err:
        model_names(GROUPS, TENSORS, onto_norm, COLD, "vLLM's X")
    assert "\n" not in str(err.value)


def test_groups_with_no_module_in_the_built_model_are_named():
    """A rename the mapping does not say shows in the model vLLM built: the group's name in
    the model names none of its modules (decoder layers are found by their index)."""
    built = ["model.embedding", "model.layers.0.attn", "model.layers.1.mlp.experts", "model.norm", "lm_head"]
    plain = ModelNames()
    assert unnamed_groups(plain, ["model.embed_tokens", "model.norm", "lm_head"], built, COLD) == ["model.embed_tokens"]
    mapped = model_names(GROUPS, TENSORS, GPT_OSS_LIKE, COLD)
    assert unnamed_groups(mapped, ["model.embed_tokens", "model.norm", "lm_head"], built, COLD) == []


def test_the_runners_copy_of_the_router_bias_keys_by_its_layer():
    """vLLM's MoE runner lists the router's score-correction bias again under ``experts.``
    (GLM-4-MoE, DeepSeek): a parameter of the layer, not a routed expert."""
    assert parameter_group_keys("model.layers.1.mlp.experts.e_score_correction_bias", COLD) == (("layer", 1),)
    assert parameter_group_keys("model.layers.1.mlp.experts.w13_weight", COLD) == (("experts", 1), ("layer", 1))
    assert parameter_group_keys("model.norm.weight", COLD) == (("module", "norm"),)
