"""Planning from a config alone, on the families users bring, built with transformers' own
config classes (no downloads): classes, tie, towers, MTP heads, and bytes checked against
parameter-count arithmetic done here by hand (or a published checkpoint size, said so)."""

from __future__ import annotations

import json
import time

import pytest
import transformers

from helpers import write_config
from selective_offload.checkpoint import load_checkpoint
from selective_offload.errors import CheckpointError
from selective_offload.planner import PlanInputs, make_plan
from selective_offload.sizes import GB, GiB


def plan_of(path, **inputs):
    return make_plan(load_checkpoint(path), PlanInputs(**{"device_memory_bytes": 24 * GiB, **inputs}))


def groups(plan):
    return {g.group: g for g in plan.groups}


# ---- Llama 3.1 8B: the arithmetic, and every quantization method on it

H, I, L, V, KV = 4096, 14336, 32, 128256, 1024  # hidden, intermediate, layers, vocab, kv heads x head dim
LINEAR = L * (2 * H * H + 2 * H * KV + 3 * H * I)            # q, o, k, v, gate, up, down
OTHER = 2 * V * H + L * 2 * H + H                             # embedding, LM head, norms


def llama3(tmp_path, **extra):
    config = transformers.LlamaConfig(hidden_size=H, intermediate_size=I, num_hidden_layers=L, num_attention_heads=32,
                                      num_key_value_heads=8, vocab_size=V, tie_word_embeddings=False)
    return write_config(tmp_path, config, "LlamaForCausalLM", **extra)


def test_llama3_8b_bf16_is_its_parameter_count_in_bytes(tmp_path):
    plan = plan_of(llama3(tmp_path))
    assert plan.model.total_bytes == pytest.approx(2 * (LINEAR + OTHER), rel=0.001)  # 8.03 B parameters
    g = groups(plan)
    assert g["model.embed_tokens"].role == "cold" and g["lm_head"].role == "hot"
    assert plan.model.num_hidden_layers == 32 and len([x for x in g.values() if x.kind == "layer"]) == 32


# Bits per weight of each method's linear weights (scales, zeros, packing included).
QUANT = {
    "fp8-block": ({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
                  8 + 32 / (128 * 128)),
    "awq": ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
            4 + 16 / 128 + 4 / 128),
    "gptq": ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True},
             4 + 16 / 128 + 4 / 128),
    "nvfp4": ({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head"]},
              4 + 8 / 16),
    "bnb-nf4": ({"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
                 "bnb_4bit_use_double_quant": False}, 4 + 32 / 64),
    "compressed-tensors-w4a16": ({"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
                                  "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                                      "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                      "group_size": 128}}}}, 4 + 16 / 128),
    "bnb-int8": ({"quant_method": "bitsandbytes", "load_in_8bit": True}, 8),
}


@pytest.mark.parametrize("method", QUANT)
def test_quantized_llama3_bytes_within_3_percent_of_the_arithmetic(tmp_path, method):
    quant, bits = QUANT[method]
    plan = plan_of(llama3(tmp_path, quantization_config=quant))
    expected = LINEAR * bits / 8 + 2 * OTHER  # the embedding, head and norms stay bf16
    assert plan.model.total_bytes == pytest.approx(expected, rel=0.03)
    assert any("quantized sizes estimated for" in n for n in plan.notes)


def test_an_unknown_method_without_a_bit_width_is_one_line(tmp_path):
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(llama3(tmp_path, quantization_config={"quant_method": "mystery"}))
    assert "\n" not in str(info.value) and "mystery" in str(info.value)


# ---- DeepSeek-V3 (FP8, fused MoE experts, a declared MTP layer) and a large MoE's speed

def deepseek_v3(tmp_path):
    config = transformers.DeepseekV3Config(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1,
        n_routed_experts=256, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128,
        qk_nope_head_dim=128, first_k_dense_replace=3, num_nextn_predict_layers=1, tie_word_embeddings=False)
    return write_config(tmp_path, config, "DeepseekV3ForCausalLM", quantization_config={
        "quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]})


def test_deepseek_v3_fp8_counts_its_experts_and_plans_fast(tmp_path):
    """The published checkpoint is 688 GB, of which ~3.7 GB are the MTP layer's own copies
    of the embedding and LM head, which vLLM shares with the target and the plan does not
    count. A 671 B-parameter MoE builds on the meta device and plans in seconds: the bound
    guards against a search that grows out of hand, with room for a shared, slow box; how
    fast planning is, is benchmarks/planning/timing.py's to measure."""
    path = deepseek_v3(tmp_path)
    # this process's CPU time, not wall time: another process on a shared box does not count
    started = time.process_time()
    plan = plan_of(path, device_memory_bytes=80 * GiB)
    elapsed = time.process_time() - started
    assert elapsed < 10.0
    assert plan.model.total_bytes == pytest.approx(688e9 - 3.7e9, rel=0.03)
    mtp = groups(plan)["model.layers.61"]
    assert (mtp.mtp, mtp.role, mtp.serving) == (True, "absent", "none")
    assert 10 * GB < mtp.bytes < 13 * GB  # one FP8 MoE layer
    assert any("num_nextn_predict_layers=1" in n and "estimate" in n for n in plan.notes)
    assert groups(plan_of(path, device_memory_bytes=80 * GiB, speculative="mtp"))["model.layers.61"].role == "hot"


def test_a_plan_that_needs_more_host_memory_than_there_is_is_infeasible(tmp_path):
    plan = plan_of(deepseek_v3(tmp_path), device_memory_bytes=80 * GiB, host_memory_bytes=64 * GiB)
    assert plan.strategy == "infeasible" and plan.shortfall_bytes == 0
    # the host keeps its stated headroom for the system and vLLM's processes beside the plan's bytes
    assert plan.host_shortfall_bytes == plan.host_bytes + plan.inputs.host_headroom_bytes - 64 * GiB
    assert any("GB more than the 62.277 GB the 68.719 GB of RAM (--host-memory) leaves beside the 6.442 GB kept"
               in n for n in plan.notes)


# ---- gpt-oss-20b: MXFP4 experts

def test_gpt_oss_20b_mxfp4_is_about_14_gb_and_fits_a_24_gib_card(tmp_path):
    config = transformers.GptOssConfig(num_hidden_layers=24, num_local_experts=32, hidden_size=2880,
                                       intermediate_size=2880, num_attention_heads=64, num_key_value_heads=8,
                                       head_dim=64, vocab_size=201088, tie_word_embeddings=False)
    path = write_config(tmp_path, config, "GptOssForCausalLM", quantization_config={
        "quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                            "model.embed_tokens", "lm_head"]})
    experts = 24 * 32 * (2880 * 2 * 2880 + 2880 * 2880)
    attention = 24 * (2880 * 64 * 64 * 2 + 2880 * 8 * 64 * 2)
    expected = experts * 4.25 / 8 + 2 * (attention + 2 * 201088 * 2880)
    assert load_checkpoint(path).total_bytes == pytest.approx(expected, rel=0.03)  # ~13.8 GB, as published
    plan = plan_of(path)  # its experts priced as vLLM allocates them on SM 8.9 (tests/unit/planner/test_allocation.py)
    assert plan.strategy in ("resident", "cold_offload") and not plan.hot_layer_indices


# ---- ties resolved per architecture; towers found under their real names

def test_voxtral_states_no_tie_flag_and_keeps_its_lm_head(tmp_path):
    data = transformers.VoxtralConfig().to_dict()
    data.pop("tie_word_embeddings", None)
    data.get("text_config", {}).pop("tie_word_embeddings", None)
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**data, "architectures": ["VoxtralForConditionalGeneration"]}))
    plan = plan_of(path)
    g = groups(plan)
    assert any(name.endswith("lm_head") and x.role == "hot" for name, x in g.items())
    assert [x.role for name, x in g.items() if name.endswith("embed_tokens")] == ["cold"]
    assert [x.role for name, x in g.items() if "audio_tower" in name.split(".")] == ["cold"]


def test_llama4_scout_keeps_its_lm_head_and_builds_fast(tmp_path):
    data = transformers.Llama4Config().to_dict()
    data.pop("tie_word_embeddings", None)
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**data, "architectures": ["Llama4ForConditionalGeneration"]}))
    started = time.perf_counter()
    plan = plan_of(path)
    assert time.perf_counter() - started < 3.0  # buffers on meta: no GBs of real buffers
    g = groups(plan)
    assert g["language_model.lm_head"].role == "hot" and g["language_model.lm_head"].bytes > 2 * GB
    assert g["vision_model"].role == "cold"


def test_gemma3_is_tied_so_its_embedding_is_hot(tmp_path):
    plan = plan_of(write_config(tmp_path, transformers.Gemma3Config(), "Gemma3ForConditionalGeneration"))
    g = groups(plan)
    embed = next(x for n, x in g.items() if n.endswith("embed_tokens"))
    assert embed.role == "hot" and not any(n.endswith("lm_head") for n in g)
    assert next(x for n, x in g.items() if n.endswith("vision_tower")).role == "cold"


def test_gemma4_vision_and_audio_embedders_are_cold(tmp_path):
    """Gemma 4's embed_vision / embed_audio project tower output into the language model,
    once per image or clip (Gemma 3n has the same modules; its vision tower needs timm,
    which needs torchvision, which cannot load beside this machine's CPU torch)."""
    config = transformers.Gemma4Config(vision_config={}, audio_config={})
    plan = plan_of(write_config(tmp_path, config, "Gemma4ForConditionalGeneration"))
    cold = {n.split(".")[-1]: x.role for n, x in groups(plan).items()
            if n.split(".")[-1] in ("embed_vision", "embed_audio", "vision_tower", "audio_tower")}
    assert cold == dict.fromkeys(("embed_vision", "embed_audio", "vision_tower", "audio_tower"), "cold")


def test_llava_layer_count_comes_from_its_text_config(tmp_path):
    data = transformers.LlavaConfig().to_dict()
    data["text_config"].pop("num_hidden_layers", None)
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**data, "architectures": ["LlavaForConditionalGeneration"]}))
    plan = plan_of(path)
    assert plan.model.num_hidden_layers == 32
    assert {n.split(".")[-1]: x.role for n, x in groups(plan).items()
            if n.split(".")[-1] in ("vision_tower", "multi_modal_projector")} == {
        "vision_tower": "cold", "multi_modal_projector": "cold"}


def test_qwen2_5_vl_tower_is_cold_and_layers_are_indexed(tmp_path):
    config = transformers.Qwen2_5_VLConfig(
        text_config={"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                     "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064},
        vision_config={"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
                       "out_hidden_size": 3584})
    plan = plan_of(write_config(tmp_path, config, "Qwen2_5_VLForConditionalGeneration"))
    g = groups(plan)
    assert next(x for n, x in g.items() if n.split(".")[-1] == "visual").role == "cold"
    assert sorted(x.layer_index for x in g.values() if x.kind == "layer") == list(range(28))
    assert plan.model.total_bytes == pytest.approx(2 * 8.29e9, rel=0.03)  # Qwen2.5-VL-7B: 8.29 B parameters


def test_devstral_vision_tower_excluded_from_fp8_stays_bf16(tmp_path):
    config = transformers.Mistral3Config()
    path = write_config(tmp_path, config, "Mistral3ForConditionalGeneration", quantization_config={
        "quant_method": "fp8", "activation_scheme": "static",
        "modules_to_not_convert": ["vision_tower", "multi_modal_projector", "lm_head"]})
    plan = plan_of(path)
    tower = next(x for n, x in groups(plan).items() if n.split(".")[-1] == "vision_tower")
    assert set(tower.dtype_bytes) == {"BF16"}  # not F8_E4M3: excluded
    layer = next(x for x in plan.groups if x.kind == "layer")
    assert "F8_E4M3" in layer.dtype_bytes


def test_qwen3_5_declared_mtp_head_is_estimated(tmp_path):
    data = transformers.Qwen3_5Config().to_dict()
    data["text_config"]["mtp_num_hidden_layers"] = 1
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**data, "architectures": ["Qwen3_5ForConditionalGeneration"]}))
    g = groups(plan_of(path))
    assert (g["mtp"].mtp, g["mtp"].role) == (True, "absent") and g["mtp"].bytes > 0


def test_glm4_moe_declared_mtp_layer_is_estimated(tmp_path):
    config = transformers.Glm4MoeConfig(num_nextn_predict_layers=1)
    g = groups(plan_of(write_config(tmp_path, config, "Glm4MoeForCausalLM")))
    assert g[f"model.layers.{config.num_hidden_layers}"].mtp


def test_an_architecture_transformers_does_not_know_is_one_line(tmp_path):
    """MiMo without auto_map: transformers would print three lines of upgrade advice."""
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["MiMoForCausalLM"], "model_type": "mimo",
                                                      "hidden_size": 64}))
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(tmp_path / "config.json")
    message = str(info.value)
    assert "\n" not in message and "does not know the architecture 'MiMoForCausalLM' (model_type 'mimo')" in message
    assert "plan from the checkpoint's safetensors headers or a manifest instead" in message


def test_library_warnings_are_captured_not_leaked(tmp_path, capfd):
    plan_of(write_config(tmp_path, transformers.Llama4Config(), "Llama4ForConditionalGeneration"))
    out, err = capfd.readouterr()
    assert err == "" and out == ""


@pytest.mark.parametrize("config_class,arch,tower,tied", [
    ("Qwen3VLConfig", "Qwen3VLForConditionalGeneration", "visual", False),
    ("MllamaConfig", "MllamaForConditionalGeneration", "vision_model", False),
    ("Lfm2VlConfig", "Lfm2VlForConditionalGeneration", "vision_tower", True),
])
def test_more_vision_language_families(tmp_path, config_class, arch, tower, tied):
    plan = plan_of(write_config(tmp_path, getattr(transformers, config_class)(), arch))
    g = groups(plan)
    assert next(x for n, x in g.items() if n.split(".")[-1] == tower).role == "cold"
    embed = next(x for n, x in g.items() if n.split(".")[-1] == "embed_tokens")
    assert embed.role == ("hot" if tied else "cold")
    assert any(n.split(".")[-1] == "lm_head" for n in g) is not tied
    assert plan.model.num_hidden_layers and len([x for x in g.values() if x.kind == "layer"]) >= plan.model.num_hidden_layers
