"""Quantized checkpoints' tensors from a config's quantization_config: names, dtypes and
hand-computed byte counts per method, exclusions, one-line errors for configs whose size
cannot be estimated, and, for every method whose format fixes its layout, the config-only
list compared to the byte with the tensors that format's exporter writes."""

from __future__ import annotations

import json

import pytest

from selective_offload.errors import CheckpointError
from selective_offload.quantization import QuantScheme, quantized_tensors, scheme_from_config

WHERE = "model/config.json"
DOWN = "model.layers.3.mlp.down_proj.weight"
EXPERTS = "model.layers.3.mlp.experts.gate_up_proj"


def scheme(cfg) -> QuantScheme:
    s, _ = scheme_from_config(cfg, WHERE)
    assert s is not None
    return s


def tensors(cfg, name=DOWN, shape=(64, 256), kind="linear", dtype="BF16", **kw):
    return {t.name: (t.dtype, t.shape, t.nbytes)
            for t in quantized_tensors(scheme(cfg), name, shape, dtype, kind, **kw)}


def total(cfg, **kw) -> int:
    return sum(nbytes for _, _, nbytes in tensors(cfg, **kw).values())


def bits_per_weight(cfg, kind="linear", shape=(4096, 4096), name=DOWN, **kw) -> float:
    numel = 1
    for d in shape:
        numel *= d
    return total(cfg, kind=kind, shape=shape, name=name, **kw) * 8 / numel


FP8_BLOCK = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
             "weight_block_size": [128, 128]}
FP8_STATIC = {"quant_method": "fp8", "activation_scheme": "static"}
MXFP4 = {"quant_method": "mxfp4",
         "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                    "model.embed_tokens", "lm_head"]}
NVFP4 = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
         "ignore": ["lm_head"]}
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}
BNB4 = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
        "bnb_4bit_use_double_quant": False, "bnb_4bit_quant_storage": "uint8"}
BNB4_DQ = {**BNB4, "bnb_4bit_use_double_quant": True}
BNB8 = {"quant_method": "bitsandbytes", "load_in_8bit": True}


def ct(weights, inputs=None, fmt=None, ignore=("lm_head",), targets=("Linear",)):
    group = {"targets": list(targets), "weights": weights, "input_activations": inputs}
    cfg = {"quant_method": "compressed-tensors", "config_groups": {"group_0": group},
           "ignore": list(ignore)}
    if fmt:
        cfg["format"] = fmt
    return cfg


CT_W4A16 = ct({"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
               "group_size": 128}, fmt="pack-quantized")
CT_FP8_DYNAMIC = ct({"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"},
                    {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True},
                    fmt="float-quantized")
CT_W8A8 = ct({"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
             {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True},
             fmt="int-quantized")
CT_NVFP4 = ct({"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group",
               "group_size": 16},
              {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16,
               "dynamic": "local"}, fmt="nvfp4-pack-quantized")


# --------------------------------------------------------------------------- no config


def test_no_quantization_config_is_none_without_notes():
    assert scheme_from_config(None, WHERE) == (None, [])


def test_empty_quantization_config_is_none():
    assert scheme_from_config({}, WHERE) == (None, [])


# --------------------------------------------------------------------------- fp8


def test_fp8_block_scales_round_up_for_sizes_not_divisible_by_128():
    got = tensors(FP8_BLOCK, shape=(300, 200))
    assert got == {
        DOWN: ("F8_E4M3", (300, 200), 60000),
        "model.layers.3.mlp.down_proj.weight_scale_inv": ("F32", (3, 2), 24),
    }


def test_fp8_per_tensor_static_stores_weight_and_input_scales():
    got = tensors(FP8_STATIC, shape=(64, 32))
    assert got == {
        DOWN: ("F8_E4M3", (64, 32), 2048),
        "model.layers.3.mlp.down_proj.weight_scale": ("F32", (), 4),
        "model.layers.3.mlp.down_proj.input_scale": ("F32", (), 4),
    }


def test_fp8_dynamic_per_tensor_has_no_input_scale():
    got = tensors({"quant_method": "fp8", "activation_scheme": "dynamic"}, shape=(64, 32))
    assert set(got) == {DOWN, "model.layers.3.mlp.down_proj.weight_scale"}


def test_fp8_experts_block_scales_per_expert():
    got = tensors(FP8_BLOCK, name=EXPERTS, shape=(4, 256, 200), kind="experts")
    assert got == {
        EXPERTS: ("F8_E4M3", (4, 256, 200), 4 * 256 * 200),
        EXPERTS + "_scale_inv": ("F32", (4, 2, 2), 64),
    }


def test_fp8_without_activation_scheme_notes_the_assumption():
    _, notes = scheme_from_config({"quant_method": "fp8"}, WHERE)
    assert len(notes) == 1 and "dynamic" in notes[0] and notes[0].startswith(WHERE)


def test_fp8_description():
    assert scheme(FP8_BLOCK).description == "FP8 e4m3, 128x128 block scales"


def test_fp8_bad_block_size_is_one_line_error():
    with pytest.raises(CheckpointError) as err:
        scheme_from_config({**FP8_BLOCK, "weight_block_size": "128"}, WHERE)
    assert "weight_block_size" in str(err.value) and "\n" not in str(err.value)


# --------------------------------------------------------------------------- mxfp4


def test_mxfp4_experts_stored_as_blocks_and_scales():
    # gpt-oss keeps gate_up_proj as [experts, in, out] (is_transposed): in=64, out=96.
    got = tensors(MXFP4, name=EXPERTS, shape=(2, 64, 96), kind="experts", transposed=True)
    assert got == {
        EXPERTS + "_blocks": ("U8", (2, 96, 2, 16), 2 * 96 * 2 * 16),
        EXPERTS + "_scales": ("U8", (2, 96, 2), 2 * 96 * 2),
    }


def test_mxfp4_leaves_linear_weights_unchanged():
    name = "model.layers.3.mlp.shared.weight"  # not excluded: MXFP4 quantizes experts only
    assert tensors(MXFP4, name=name, shape=(64, 256)) == {name: ("BF16", (64, 256), 64 * 256 * 2)}


# --------------------------------------------------------------------------- nvfp4


def test_nvfp4_modelopt_tensors():
    got = tensors(NVFP4, shape=(32, 64))
    assert got == {
        DOWN: ("U8", (32, 32), 1024),
        "model.layers.3.mlp.down_proj.weight_scale": ("F8_E4M3", (32, 4), 128),
        "model.layers.3.mlp.down_proj.weight_scale_2": ("F32", (), 4),
        "model.layers.3.mlp.down_proj.input_scale": ("F32", (), 4),
    }


def test_nvfp4_hf_quant_config_layout_is_read():
    cfg = {"producer": {"name": "modelopt"},
           "quantization": {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head"]}}
    assert total(cfg, shape=(32, 64)) == 1160


def test_nvfp4_w4a16_has_no_input_scale():
    got = tensors({**NVFP4, "quant_algo": "W4A16_NVFP4"}, shape=(32, 64))
    assert "model.layers.3.mlp.down_proj.input_scale" not in got and sum(v[2] for v in got.values()) == 1156


def test_nvfp4_experts_stack_per_expert_scalars():
    got = tensors(NVFP4, name=EXPERTS, shape=(4, 32, 64), kind="experts")
    assert got[EXPERTS + "_scale_2"] == ("F32", (4,), 16)
    assert sum(v[2] for v in got.values()) == 4 * 1160


# --------------------------------------------------------------------------- awq / gptq


def test_awq_gemm_tensors():
    # out=64, in=256, group 128: qweight [in, out/8], qzeros [groups, out/8], scales [groups, out].
    assert tensors(AWQ) == {
        "model.layers.3.mlp.down_proj.qweight": ("I32", (256, 8), 8192),
        "model.layers.3.mlp.down_proj.qzeros": ("I32", (2, 8), 64),
        "model.layers.3.mlp.down_proj.scales": ("F16", (2, 64), 256),
    }


def test_gptq_tensors_include_g_idx():
    # qweight [in/8, out], qzeros [groups, out/8], scales [groups, out], g_idx [in].
    assert tensors(GPTQ) == {
        "model.layers.3.mlp.down_proj.qweight": ("I32", (32, 64), 8192),
        "model.layers.3.mlp.down_proj.qzeros": ("I32", (2, 8), 64),
        "model.layers.3.mlp.down_proj.scales": ("F16", (2, 64), 256),
        "model.layers.3.mlp.down_proj.g_idx": ("I32", (256,), 1024),
    }


def test_gptq_per_channel_group_is_one_group():
    got = tensors({**GPTQ, "group_size": -1})
    assert got["model.layers.3.mlp.down_proj.scales"] == ("F16", (1, 64), 128)


def test_gptq_3bit_packs_three_bits_per_weight():
    got = tensors({**GPTQ, "bits": 3})
    assert got["model.layers.3.mlp.down_proj.qweight"] == ("I32", (24, 64), 24 * 64 * 4)


def test_gptq_lm_head_true_quantizes_the_head():
    got = tensors({**GPTQ, "lm_head": True}, name="lm_head.weight")
    assert "lm_head.qweight" in got


def test_awq_experts_are_quantized():
    got = tensors(AWQ, name=EXPERTS, shape=(4, 64, 256), kind="experts")
    assert got[EXPERTS + "_qweight"] == ("I32", (4, 256, 8), 4 * 8192)


def test_awq_without_group_size_notes_the_default():
    s, notes = scheme_from_config({"quant_method": "awq", "bits": 4}, WHERE)
    assert s.group_size == 128 and any("group_size" in n for n in notes)


# --------------------------------------------------------------------------- bitsandbytes


def test_bnb_nf4_tensors():
    state = len(b'{"quant_type": "nf4", "blocksize": 64, "dtype": "bfloat16", "shape": [64, 100]}')
    got = tensors(BNB4, shape=(64, 100))
    assert got == {
        DOWN: ("U8", (3200, 1), 3200),
        DOWN + ".absmax": ("F32", (100,), 400),
        DOWN + ".quant_map": ("F32", (16,), 64),
        DOWN + ".quant_state.bitsandbytes__nf4": ("U8", (state,), state),
    }


def test_bnb_nf4_double_quant_stores_8bit_absmax_and_nested_statistics():
    got = tensors(BNB4_DQ, shape=(64, 100))
    assert got[DOWN + ".absmax"] == ("U8", (100,), 100)
    assert got[DOWN + ".nested_absmax"] == ("F32", (1,), 4)
    assert got[DOWN + ".nested_quant_map"] == ("F32", (256,), 1024)


def test_bnb_8bit_tensors():
    assert tensors(BNB8, shape=(64, 100)) == {
        DOWN: ("I8", (64, 100), 6400),
        "model.layers.3.mlp.down_proj.SCB": ("F32", (64,), 256),
        "model.layers.3.mlp.down_proj.weight_format": ("U8", (), 1),
    }


def test_bnb_without_4bit_or_8bit_is_one_line_error():
    with pytest.raises(CheckpointError) as err:
        scheme_from_config({"quant_method": "bitsandbytes"}, WHERE)
    assert "load_in_4bit" in str(err.value) and "\n" not in str(err.value)


def test_bnb_config_without_quant_method_is_recognised():
    assert scheme({"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}).method == "bitsandbytes-4bit"


# --------------------------------------------------------------------------- compressed-tensors


def test_ct_pack_quantized_asymmetric_group_with_actorder():
    cfg = ct({"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group",
              "group_size": 32, "actorder": "group"}, fmt="pack-quantized")
    # out=96, in=256: 8 int4 per int32; zero points packed along out.
    assert tensors(cfg, shape=(96, 256)) == {
        "model.layers.3.mlp.down_proj.weight_packed": ("I32", (96, 32), 12288),
        "model.layers.3.mlp.down_proj.weight_scale": ("BF16", (96, 8), 1536),
        "model.layers.3.mlp.down_proj.weight_shape": ("I64", (2,), 16),
        "model.layers.3.mlp.down_proj.weight_zero_point": ("I32", (12, 8), 384),
        "model.layers.3.mlp.down_proj.weight_g_idx": ("I32", (256,), 1024),
    }


def test_ct_fp8_dynamic_per_channel():
    assert tensors(CT_FP8_DYNAMIC, shape=(96, 256)) == {
        DOWN: ("F8_E4M3", (96, 256), 96 * 256),
        "model.layers.3.mlp.down_proj.weight_scale": ("BF16", (96, 1), 192),
    }


def test_ct_static_int8_stores_input_scale():
    cfg = ct({"num_bits": 8, "type": "int", "symmetric": True, "strategy": "tensor"},
             {"num_bits": 8, "type": "int", "strategy": "tensor", "dynamic": False},
             fmt="int-quantized")
    assert tensors(cfg, shape=(96, 256)) == {
        DOWN: ("I8", (96, 256), 96 * 256),
        "model.layers.3.mlp.down_proj.weight_scale": ("BF16", (1,), 2),
        "model.layers.3.mlp.down_proj.input_scale": ("BF16", (1,), 2),
    }


def test_ct_nvfp4_tensors():
    assert tensors(CT_NVFP4, shape=(96, 256)) == {
        "model.layers.3.mlp.down_proj.weight_packed": ("U8", (96, 128), 12288),
        "model.layers.3.mlp.down_proj.weight_scale": ("F8_E4M3", (96, 16), 1536),
        "model.layers.3.mlp.down_proj.weight_global_scale": ("F32", (1,), 4),
        "model.layers.3.mlp.down_proj.input_global_scale": ("F32", (1,), 4),
    }


def test_ct_format_inferred_when_absent():
    cfg = ct({"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128})
    assert "model.layers.3.mlp.down_proj.weight_packed" in tensors(cfg)


def test_ct_expert_group_named_by_regex_wins_over_linear_group():
    cfg = {"quant_method": "compressed-tensors", "format": "mixed-precision", "ignore": ["lm_head"],
           "config_groups": {
               "fp8": {"targets": ["Linear"],
                       "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
                       "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                             "dynamic": True}},
               "int4": {"targets": [r"re:.*mlp\.experts\.\d+\.(gate|up|down)_proj$"],
                        "weights": {"num_bits": 4, "type": "int", "strategy": "group",
                                    "group_size": 128}}}}
    experts = tensors(cfg, name=EXPERTS, shape=(4, 64, 256), kind="experts")
    attn = tensors(cfg, name="model.layers.3.self_attn.q_proj.weight", shape=(64, 256))
    assert EXPERTS + "_packed" in experts and attn["model.layers.3.self_attn.q_proj.weight"][0] == "F8_E4M3"


def test_ct_group_without_matching_target_leaves_weight_unchanged():
    cfg = ct({"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128},
             targets=["re:.*mlp.*"], fmt="pack-quantized")
    name = "model.layers.3.self_attn.o_proj.weight"
    assert tensors(cfg, name=name) == {name: ("BF16", (64, 256), 64 * 256 * 2)}


def test_ct_bad_num_bits_is_one_line_error():
    with pytest.raises(CheckpointError) as err:
        scheme_from_config(ct({"num_bits": "four", "type": "int"}), WHERE)
    assert "num_bits" in str(err.value) and "\n" not in str(err.value)


CT_CASES = {
    "w4a16-asym-group-actorder": ct({"num_bits": 4, "type": "int", "symmetric": False,
                                     "strategy": "group", "group_size": 32, "actorder": "group"},
                                    fmt="pack-quantized"),
    "w3-asym-channel": ct({"num_bits": 3, "type": "int", "symmetric": False, "strategy": "channel"},
                          fmt="pack-quantized"),
    "w4-asym-tensor": ct({"num_bits": 4, "type": "int", "symmetric": False, "strategy": "tensor"},
                         fmt="pack-quantized"),
    "fp8-dynamic": CT_FP8_DYNAMIC,
    "w8a8-asym": ct({"num_bits": 8, "type": "int", "symmetric": False, "strategy": "channel"},
                    {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True},
                    fmt="int-quantized"),
    "fp8-block": ct({"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128]},
                    {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 128,
                     "dynamic": True}, fmt="float-quantized"),
    "nvfp4": CT_NVFP4,
    "mxfp4": ct({"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32,
                 "scale_dtype": "torch.uint8"}, fmt="mxfp4-pack-quantized"),
    "mxfp8": ct({"num_bits": 8, "type": "float", "strategy": "group", "group_size": 32,
                 "scale_dtype": "torch.uint8"}, fmt="mxfp8-quantized"),
}


@pytest.mark.parametrize("case", sorted(CT_CASES))
def test_ct_matches_what_compressed_tensors_writes(case):
    torch = pytest.importorskip("torch")
    ct_quant = pytest.importorskip("compressed_tensors.quantization")
    ct_comp = pytest.importorskip("compressed_tensors.compressors")
    cfg = CT_CASES[case]
    qc = ct_quant.QuantizationConfig.model_validate(cfg)
    model = torch.nn.Sequential(torch.nn.Linear(256, 96, bias=False)).to(torch.bfloat16)
    ct_quant.apply_quantization_config(model, qc)
    for p in model.parameters():
        p.data.fill_(0.5 if p.dtype.is_floating_point else 0)
    ct_comp.ModelCompressor(quantization_config=qc).compress_model(model)
    real = {n: (tuple(v.shape), v.numel() * v.element_size()) for n, v in model.state_dict().items()}
    mine = {t.name: (t.shape, t.nbytes)
            for t in quantized_tensors(scheme(cfg), "0.weight", (96, 256), "BF16", "linear")}
    assert mine == real


# --------------------------------------------------------------------------- exclusions


def unchanged(cfg, name, shape=(64, 256), kind="linear") -> bool:
    return tensors(cfg, name=name, shape=shape, kind=kind) == {
        name: ("BF16", shape, 2 * shape[0] * shape[1] * (shape[2] if len(shape) > 2 else 1))}


def test_exclusion_by_module_prefix():
    cfg = {**FP8_BLOCK, "modules_to_not_convert": ["model.visual"]}
    assert unchanged(cfg, "model.visual.blocks.0.attn.qkv.weight")


def test_exclusion_prefix_does_not_match_a_longer_segment():
    cfg = {**FP8_BLOCK, "modules_to_not_convert": ["model.visual"]}
    assert not unchanged(cfg, "model.visualise.blocks.0.attn.qkv.weight")


def test_exclusion_by_bare_segment_anywhere():
    cfg = {**FP8_BLOCK, "ignored_layers": ["visual"]}
    assert unchanged(cfg, "model.language.visual.blocks.0.attn.qkv.weight")


def test_exclusion_by_exact_module_name():
    cfg = {**FP8_BLOCK, "ignored_layers": ["model.layers.3.mlp.down_proj"]}
    assert unchanged(cfg, DOWN) and not unchanged(cfg, "model.layers.3.mlp.up_proj.weight")


def test_exclusion_by_regex():
    cfg = ct({"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128},
             fmt="pack-quantized", ignore=["lm_head", r"re:.*mlp\.gate$"])
    assert unchanged(cfg, "model.layers.3.mlp.gate.weight", shape=(8, 256))
    assert not unchanged(cfg, "model.layers.3.mlp.gate_proj.weight")


def test_exclusion_by_wildcard():
    assert unchanged(MXFP4, "model.layers.5.mlp.router.weight", shape=(32, 64))


def test_modelopt_exclude_modules():
    cfg = {"quant_method": "modelopt", "quantization": {"quant_algo": "FP8",
                                                       "exclude_modules": ["model.layers.0.*"]}}
    assert unchanged(cfg, "model.layers.0.self_attn.q_proj.weight")
    assert not unchanged(cfg, "model.layers.1.self_attn.q_proj.weight")


def test_bnb_llm_int8_skip_modules():
    assert unchanged({**BNB8, "llm_int8_skip_modules": ["mlp"]}, DOWN)


def test_fused_experts_excluded_by_per_expert_name():
    cfg = {**FP8_BLOCK, "modules_to_not_convert": ["model.layers.3.mlp.experts.0.gate_proj"]}
    assert unchanged(cfg, EXPERTS, shape=(4, 64, 256), kind="experts")


@pytest.mark.parametrize("name", ["lm_head.weight", "model.embed_tokens.weight",
                                  "model.language_model.lm_head.weight"])
def test_lm_head_and_embeddings_never_quantized(name):
    assert unchanged(FP8_BLOCK, name)


def test_other_kind_unchanged():
    assert unchanged(FP8_BLOCK, "model.layers.3.input_layernorm.weight", shape=(1, 256), kind="other")


def test_wrong_rank_for_kind_is_a_caller_error():
    with pytest.raises(ValueError):
        quantized_tensors(scheme(FP8_BLOCK), EXPERTS, (64, 256), "BF16", "experts")


# --------------------------------------------------------------------------- unknown / garbage


def test_unknown_method_with_bits_is_noted_and_estimated():
    s, notes = scheme_from_config({"quant_method": "superquant", "bits": 3, "group_size": 64}, WHERE)
    assert len(notes) == 1 and "superquant" in notes[0] and "3-bit" in notes[0]
    # [64, 256] at 3 bits: 64 * 96 bytes, plus an F16 scale per 64 inputs per row.
    got = {t.name: t.nbytes for t in quantized_tensors(s, DOWN, (64, 256), "BF16", "linear")}
    assert sum(got.values()) == 64 * 96 + 64 * 4 * 2


def test_unknown_method_without_bits_is_one_line_error():
    with pytest.raises(CheckpointError) as err:
        scheme_from_config({"quant_method": "superquant"}, WHERE)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(WHERE)
    assert "superquant" in msg and "cannot be estimated" in msg
    assert "safetensors headers" in msg and "manifest" in msg


@pytest.mark.parametrize("garbage", ["fp8", ["fp8"], 8, True])
def test_non_object_quantization_config_is_one_line_error(garbage):
    with pytest.raises(CheckpointError) as err:
        scheme_from_config(garbage, WHERE)
    msg = str(err.value)
    assert "\n" not in msg and "quantization_config" in msg and "manifest" in msg


@pytest.mark.parametrize("method", [None, 7, ["fp8"], ""])
def test_quantization_config_without_a_method_name_is_one_line_error(method):
    with pytest.raises(CheckpointError) as err:
        scheme_from_config({"quant_method": method, "foo": 1}, WHERE)
    assert "\n" not in str(err.value)


# --------------------------------------------------------------------------- realistic sanity


@pytest.mark.parametrize("cfg,expected", [
    (FP8_BLOCK, 8 + 32 * 32 * 32 / 4096**2),              # 8.00195
    (FP8_STATIC, 8 + 2 * 32 / 4096**2),
    (NVFP4, 4.5 + 2 * 32 / 4096**2),                      # e2m1 + e4m3 per 16
    (AWQ, 4 + 16 / 128 + 4 / 128),                        # 4.15625: F16 scale + int4 zero per 128
    (GPTQ, 4 + 16 / 128 + 4 / 128 + 32 / 4096),           # + g_idx
    (CT_W4A16, 4 + 16 / 128 + 128 / 4096**2),             # 4.125: BF16 scales, no zeros
    (CT_FP8_DYNAMIC, 8 + 16 / 4096),
    (CT_NVFP4, 4.5 + 2 * 32 / 4096**2),
    (CT_W8A8, 8 + 16 / 4096),
    (BNB8, 8 + 32 / 4096 + 8 / 4096**2),                  # int8 + F32 SCB per row
], ids=["fp8-block", "fp8-tensor", "nvfp4", "awq", "gptq", "ct-w4a16", "ct-fp8", "ct-nvfp4",
        "ct-w8a8", "bnb-int8"])
def test_bits_per_weight_of_a_4096_square_linear(cfg, expected):
    assert bits_per_weight(cfg) == pytest.approx(expected, rel=1e-12)


def test_bits_per_weight_mxfp4_experts():
    assert bits_per_weight(MXFP4, kind="experts", shape=(1, 4096, 4096), name=EXPERTS) == 4.25


def test_bits_per_weight_bnb_nf4():
    # 4 bits + an F32 absmax per 64 = 4.5, plus 64 bytes of quant map and ~80 of state.
    assert bits_per_weight(BNB4) == pytest.approx(4.5, abs=1e-4)


def test_bits_per_weight_bnb_nf4_double_quant():
    # 4 bits + an 8-bit absmax per 64 + an F32 per 256 absmax blocks = 4.127, plus 1 KB of
    # nested quant map and the quant state.
    assert bits_per_weight(BNB4_DQ) == pytest.approx(4 + 8 / 64 + 32 / (64 * 256), abs=1e-3)


def test_descriptions_are_one_line():
    for cfg in (FP8_BLOCK, FP8_STATIC, MXFP4, NVFP4, AWQ, GPTQ, BNB4, BNB8, CT_W4A16, CT_NVFP4):
        desc = scheme(cfg).description
        assert desc and "\n" not in desc


# --------------------------------------------------------------------------- exact layouts
#
# Where a method's format fixes what a checkpoint stores, the config-only list must be that
# list to the byte: names, dtypes, shapes and bytes. Each test below writes the tensors a
# real exporter writes (the exporter and the format named at each) into a safetensors file
# and reads them back from that file's own header, bytes from its data offsets; the layout
# is computed here from the format's definition, never from the code under test.


ST_DTYPE = {"uint8": "U8", "int32": "I32", "int64": "I64", "float16": "F16", "bfloat16": "BF16",
            "float32": "F32", "float8_e4m3fn": "F8_E4M3"}


def exported(tmp_path, layout):
    """``layout`` (name -> (torch dtype, shape)) saved as an exporter saves it, and read back
    from the file's header: name -> (dtype, shape, bytes the file gives its data)."""
    import torch
    from safetensors.torch import save_file

    path = tmp_path / "model.safetensors"
    save_file({n: torch.zeros(shape, dtype=getattr(torch, dt)) for n, (dt, shape) in layout.items()}, str(path))
    raw = path.read_bytes()
    header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
    header.pop("__metadata__", None)
    assert {n: ST_DTYPE[dt] for n, (dt, _) in layout.items()} == {n: e["dtype"] for n, e in header.items()}
    return {n: (e["dtype"], tuple(e["shape"]), e["data_offsets"][1] - e["data_offsets"][0])
            for n, e in header.items()}


def planned(cfg, params, dtype="BF16"):
    """The config-only tensors of ``params`` (name -> (shape, kind) or (shape, kind, transposed))."""
    s = scheme(cfg)
    out = {}
    for name, (shape, kind, *transposed) in params.items():
        for t in quantized_tensors(s, name, shape, dtype, kind, transposed=bool(transposed and transposed[0])):
            out[t.name] = (t.dtype, t.shape, t.nbytes)
    return out


def ceil_div(a, b):
    return -(-a // b)


LAYER = "model.layers.0."
Q, O = LAYER + "self_attn.q_proj", LAYER + "mlp.down_proj"
LINEARS = {Q + ".weight": ((384, 256), "linear"), O + ".weight": ((320, 384), "linear")}

# OCP Microscaling Formats (MX) v1.0: a block of k = 32 elements shares one E8M0 scale (a
# byte); an MXFP4 element is E2M1, 4 bits, so two share a byte.
MX_K, E2M1_BITS = 32, 4


def test_mxfp4_gpt_oss_experts_are_to_the_byte_what_gpt_oss_ships(tmp_path):
    # gpt-oss as OpenAI published it (openai/gpt-oss-20b and -120b shards; transformers'
    # Mxfp4GptOssExperts declares the same): per layer and projection, every expert's
    # [out, in] matrix as <proj>_blocks U8 [experts, out, in/32, 16] and <proj>_scales U8
    # [experts, out, in/32]. gate_up_proj is [2 * intermediate, hidden], down_proj
    # [hidden, intermediate]; transformers builds both transposed ([experts, in, out]).
    experts, hidden, inter = 4, 96, 64
    block_bytes = MX_K * E2M1_BITS // 8
    x = LAYER + "mlp.experts."
    layout = {
        x + "gate_up_proj_blocks": ("uint8", (experts, 2 * inter, hidden // MX_K, block_bytes)),
        x + "gate_up_proj_scales": ("uint8", (experts, 2 * inter, hidden // MX_K)),
        x + "down_proj_blocks": ("uint8", (experts, hidden, inter // MX_K, block_bytes)),
        x + "down_proj_scales": ("uint8", (experts, hidden, inter // MX_K)),
    }
    params = {x + "gate_up_proj": ((experts, hidden, 2 * inter), "experts", True),
              x + "down_proj": ((experts, inter, hidden), "experts", True)}
    assert planned(MXFP4, params) == exported(tmp_path, layout)


def test_mxfp4_config_only_gpt_oss_experts_are_what_gpt_oss_ships(tmp_path):
    # The same layout reached the way a plan reaches it: transformers' own gpt-oss model
    # built from a config.json (its experts transposed), with the bf16 expert biases the
    # shipped checkpoint keeps beside the blocks ([experts, 2 * intermediate], [experts, hidden]).
    transformers = pytest.importorskip("transformers")
    from helpers import write_config
    from selective_offload.checkpoint import load_checkpoint

    experts, hidden, inter = 4, 96, 64
    config = transformers.GptOssConfig(num_hidden_layers=1, num_local_experts=experts, num_experts_per_tok=2,
                                       hidden_size=hidden, intermediate_size=inter, num_attention_heads=4,
                                       num_key_value_heads=2, head_dim=24, vocab_size=128)
    path = write_config(tmp_path, config, "GptOssForCausalLM", quantization_config=MXFP4)
    x = LAYER + "mlp.experts."
    mine = {n: (t.dtype, t.shape, t.nbytes) for n, t in load_checkpoint(path).tensors.items() if n.startswith(x)}
    block_bytes = MX_K * E2M1_BITS // 8
    shipped = exported(tmp_path, {
        x + "gate_up_proj_blocks": ("uint8", (experts, 2 * inter, hidden // MX_K, block_bytes)),
        x + "gate_up_proj_scales": ("uint8", (experts, 2 * inter, hidden // MX_K)),
        x + "gate_up_proj_bias": ("bfloat16", (experts, 2 * inter)),
        x + "down_proj_blocks": ("uint8", (experts, hidden, inter // MX_K, block_bytes)),
        x + "down_proj_scales": ("uint8", (experts, hidden, inter // MX_K)),
        x + "down_proj_bias": ("bfloat16", (experts, hidden)),
    })
    assert mine == shipped


def test_block_fp8_is_to_the_byte_what_deepseek_style_checkpoints_store(tmp_path):
    # DeepSeek-V3 and Qwen3-*-FP8 (`weight_block_size: [128, 128]`; transformers' FP8Linear
    # declares the same): weight F8_E4M3 [out, in]; weight_scale_inv F32, one per 128 x 128
    # block, the last row and column of blocks partial: [ceil(out/128), ceil(in/128)]
    # (DeepSeek-V3's kv_a_proj_with_mqa has 576 outputs: 4.5 blocks, stored as 5).
    params = {LAYER + "self_attn.kv_a_proj_with_mqa.weight": ((576, 256), "linear"),
              O + ".weight": ((300, 200), "linear")}
    layout = {}
    for name, ((out, inp), _) in params.items():
        module = name.removesuffix(".weight")
        layout[module + ".weight"] = ("float8_e4m3fn", (out, inp))
        layout[module + ".weight_scale_inv"] = ("float32", (ceil_div(out, 128), ceil_div(inp, 128)))
    assert planned(FP8_BLOCK, params) == exported(tmp_path, layout)


@pytest.mark.parametrize("cfg", [
    NVFP4,
    {"quant_method": "modelopt", "quant_algo": "NVFP4"},  # no group_size: the format's 16
    {"quant_method": "modelopt_fp4"},
], ids=["group-16", "no-group-size", "modelopt_fp4"])
def test_nvfp4_is_to_the_byte_what_modelopt_exports(tmp_path, cfg):
    # NVIDIA ModelOpt's NVFP4 export (nvidia/*-FP4 checkpoints; vLLM's ModelOpt NVFP4 linear
    # method loads them, defaulting group_size to 16): E2M1 two a byte, weight U8 [out, in/2];
    # one E4M3 scale per 16 elements, weight_scale F8_E4M3 [out, in/16]; the FP32 per-tensor
    # weight_scale_2 and input_scale are 0-d.
    layout = {}
    for module, ((out, inp), _) in zip((Q, O), LINEARS.values()):
        layout[module + ".weight"] = ("uint8", (out, inp * E2M1_BITS // 8))
        layout[module + ".weight_scale"] = ("float8_e4m3fn", (out, inp // 16))
        layout[module + ".weight_scale_2"] = ("float32", ())
        layout[module + ".input_scale"] = ("float32", ())
    assert planned(cfg, LINEARS) == exported(tmp_path, layout)


def test_modelopt_fp8_is_to_the_byte_what_modelopt_exports(tmp_path):
    # ModelOpt's per-tensor FP8 export (nvidia/Llama-3.1-8B-Instruct-FP8 and the like): weight
    # F8_E4M3 [out, in] with 0-d F32 weight_scale and input_scale (static activation scales).
    layout = {}
    for module, ((out, inp), _) in zip((Q, O), LINEARS.values()):
        layout[module + ".weight"] = ("float8_e4m3fn", (out, inp))
        layout[module + ".weight_scale"] = ("float32", ())
        layout[module + ".input_scale"] = ("float32", ())
    cfg = {"quant_method": "modelopt", "quant_algo": "FP8", "exclude_modules": ["lm_head"]}
    assert planned(cfg, LINEARS) == exported(tmp_path, layout)


def test_modelopt_mxfp8_is_to_the_byte_what_the_mx_format_stores(tmp_path):
    # ModelOpt MXFP8 (vLLM's ModelOpt MXFP8 method, block 1 x 32): weight F8_E4M3 [out, in];
    # one E8M0 scale byte per 32 elements of a row, weight_scale U8 [out, in/32].
    params = {Q + ".weight": ((384, 256), "linear"), O + ".weight": ((288, 96), "linear")}
    layout = {}
    for name, ((out, inp), _) in params.items():
        module = name.removesuffix(".weight")
        layout[module + ".weight"] = ("float8_e4m3fn", (out, inp))
        layout[module + ".weight_scale"] = ("uint8", (out, inp // MX_K))
    assert planned({"quant_method": "modelopt", "quant_algo": "MXFP8"}, params) == exported(tmp_path, layout)


# int4 packed into int32: eight values a word.
INT4_PER_I32 = 32 // 4


def test_gptq_int4_is_to_the_byte_what_autogptq_writes(tmp_path):
    # AutoGPTQ / GPTQModel QuantLinear (vLLM's GPTQ linear method loads the same): qweight I32
    # [in/8, out] (packed along the input), qzeros I32 [in/group, out/8] (packed along the
    # output), scales F16 [in/group, out], g_idx I32 [in].
    params = {Q + ".weight": ((384, 256), "linear"), O + ".weight": ((512, 384), "linear")}
    layout = {}
    for name, ((out, inp), _) in params.items():
        module = name.removesuffix(".weight")
        layout[module + ".qweight"] = ("int32", (inp // INT4_PER_I32, out))
        layout[module + ".qzeros"] = ("int32", (inp // 128, out // INT4_PER_I32))
        layout[module + ".scales"] = ("float16", (inp // 128, out))
        layout[module + ".g_idx"] = ("int32", (inp,))
    assert planned(GPTQ, params) == exported(tmp_path, layout)


def test_awq_int4_is_to_the_byte_what_autoawq_writes(tmp_path):
    # AutoAWQ WQLinear_GEMM (`version: gemm`; vLLM's AWQ linear method loads the same):
    # qweight I32 [in, out/8] and qzeros I32 [in/group, out/8], both packed along the output,
    # scales F16 [in/group, out].
    params = {Q + ".weight": ((384, 256), "linear"), O + ".weight": ((512, 384), "linear")}
    layout = {}
    for name, ((out, inp), _) in params.items():
        module = name.removesuffix(".weight")
        layout[module + ".qweight"] = ("int32", (inp, out // INT4_PER_I32))
        layout[module + ".qzeros"] = ("int32", (inp // 128, out // INT4_PER_I32))
        layout[module + ".scales"] = ("float16", (inp // 128, out))
    assert planned(AWQ, params) == exported(tmp_path, layout)


CT_PACKED = {
    # llm-compressor's presets, as its config.json states them.
    "W4A16": ct({"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128},
                fmt="pack-quantized"),
    "W4A16_ASYM": ct({"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group",
                      "group_size": 128}, fmt="pack-quantized"),
    "W8A16": ct({"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
                fmt="pack-quantized"),
}


@pytest.mark.parametrize("preset", sorted(CT_PACKED))
def test_ct_pack_quantized_is_to_the_byte_what_llm_compressor_writes(tmp_path, preset):
    # compressed-tensors' pack-quantized format (PackedQuantizationCompressor, what
    # llm-compressor saves): int values packed into int32 along the input, 32/bits a word,
    # weight_packed I32 [out, in/(32/bits)]; weight_scale in the model's dtype (BF16), per
    # group [out, in/group] or per channel [out, 1]; the original shape as weight_shape I64
    # [2]; asymmetric zero points I32, packed along the output: [out/(32/bits), in/group].
    weights = CT_PACKED[preset]["config_groups"]["group_0"]["weights"]
    per_word = 32 // weights["num_bits"]
    layout = {}
    for module, ((out, inp), _) in zip((Q, O), LINEARS.values()):
        groups = ceil_div(inp, weights["group_size"]) if weights["strategy"] == "group" else 1
        layout[module + ".weight_packed"] = ("int32", (out, ceil_div(inp, per_word)))
        layout[module + ".weight_scale"] = ("bfloat16", (out, groups))
        layout[module + ".weight_shape"] = ("int64", (2,))
        if not weights["symmetric"]:
            layout[module + ".weight_zero_point"] = ("int32", (ceil_div(out, per_word), groups))
    assert planned(CT_PACKED[preset], LINEARS) == exported(tmp_path, layout)
