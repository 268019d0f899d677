"""The one naming rule the planner, construction routing and the report share."""

from __future__ import annotations

from selective_offload.names import cold_prefix, cold_segment, group_key, layer_of

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
