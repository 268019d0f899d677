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


@pytest.mark.parametrize("cfg", [None, {}], ids=["none", "empty"])
def test_no_quantization_config_is_none_without_notes(cfg):
    assert scheme_from_config(cfg, WHERE) == (None, [])


# --------------------------------------------------------------------------- each method's tensors

D = "model.layers.3.mlp.down_proj."

# (config, tensors() keywords, the tensors a checkpoint of that method stores), each layout
# worked out by hand from the method's format.
LAYOUTS = {
    "fp8-block-scales-round-up": (FP8_BLOCK, {"shape": (300, 200)}, {
        DOWN: ("F8_E4M3", (300, 200), 60000), D + "weight_scale_inv": ("F32", (3, 2), 24)}),
    "fp8-static-weight-and-input-scales": (FP8_STATIC, {"shape": (64, 32)}, {
        DOWN: ("F8_E4M3", (64, 32), 2048), D + "weight_scale": ("F32", (), 4), D + "input_scale": ("F32", (), 4)}),
    "fp8-dynamic-no-input-scale": ({"quant_method": "fp8", "activation_scheme": "dynamic"}, {"shape": (64, 32)}, {
        DOWN: ("F8_E4M3", (64, 32), 2048), D + "weight_scale": ("F32", (), 4)}),
    "fp8-experts-block-scales-per-expert": (
        FP8_BLOCK, {"name": EXPERTS, "shape": (4, 256, 200), "kind": "experts"},
        {EXPERTS: ("F8_E4M3", (4, 256, 200), 4 * 256 * 200), EXPERTS + "_scale_inv": ("F32", (4, 2, 2), 64)}),
    # gpt-oss keeps gate_up_proj as [experts, in, out] (is_transposed): in=64, out=96.
    "mxfp4-experts-blocks-and-scales": (
        MXFP4, {"name": EXPERTS, "shape": (2, 64, 96), "kind": "experts", "transposed": True},
        {EXPERTS + "_blocks": ("U8", (2, 96, 2, 16), 2 * 96 * 2 * 16),
         EXPERTS + "_scales": ("U8", (2, 96, 2), 2 * 96 * 2)}),
    # not excluded: MXFP4 quantizes experts only
    "mxfp4-leaves-linear-weights": (MXFP4, {"name": "model.layers.3.mlp.shared.weight"}, {
        "model.layers.3.mlp.shared.weight": ("BF16", (64, 256), 64 * 256 * 2)}),
    "nvfp4-modelopt": (NVFP4, {"shape": (32, 64)}, {
        DOWN: ("U8", (32, 32), 1024), D + "weight_scale": ("F8_E4M3", (32, 4), 128),
        D + "weight_scale_2": ("F32", (), 4), D + "input_scale": ("F32", (), 4)}),
    # out=64, in=256, group 128: qweight [in, out/8], qzeros [groups, out/8], scales [groups, out].
    "awq-gemm": (AWQ, {}, {
        D + "qweight": ("I32", (256, 8), 8192), D + "qzeros": ("I32", (2, 8), 64),
        D + "scales": ("F16", (2, 64), 256)}),
    # qweight [in/8, out], qzeros [groups, out/8], scales [groups, out], g_idx [in].
    "gptq-with-g-idx": (GPTQ, {}, {
        D + "qweight": ("I32", (32, 64), 8192), D + "qzeros": ("I32", (2, 8), 64),
        D + "scales": ("F16", (2, 64), 256), D + "g_idx": ("I32", (256,), 1024)}),
    "bnb-int8": (BNB8, {"shape": (64, 100)}, {
        DOWN: ("I8", (64, 100), 6400), D + "SCB": ("F32", (64,), 256), D + "weight_format": ("U8", (), 1)}),
    # out=96, in=256: 8 int4 per int32; zero points packed along out.
    "ct-pack-quantized-asym-group-actorder": (
        ct({"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 32,
            "actorder": "group"}, fmt="pack-quantized"), {"shape": (96, 256)},
        {D + "weight_packed": ("I32", (96, 32), 12288), D + "weight_scale": ("BF16", (96, 8), 1536),
         D + "weight_shape": ("I64", (2,), 16), D + "weight_zero_point": ("I32", (12, 8), 384),
         D + "weight_g_idx": ("I32", (256,), 1024)}),
    "ct-fp8-dynamic-per-channel": (CT_FP8_DYNAMIC, {"shape": (96, 256)}, {
        DOWN: ("F8_E4M3", (96, 256), 96 * 256), D + "weight_scale": ("BF16", (96, 1), 192)}),
    "ct-static-int8-input-scale": (
        ct({"num_bits": 8, "type": "int", "symmetric": True, "strategy": "tensor"},
           {"num_bits": 8, "type": "int", "strategy": "tensor", "dynamic": False}, fmt="int-quantized"),
        {"shape": (96, 256)},
        {DOWN: ("I8", (96, 256), 96 * 256), D + "weight_scale": ("BF16", (1,), 2), D + "input_scale": ("BF16", (1,), 2)}),
    "ct-nvfp4": (CT_NVFP4, {"shape": (96, 256)}, {
        D + "weight_packed": ("U8", (96, 128), 12288), D + "weight_scale": ("F8_E4M3", (96, 16), 1536),
        D + "weight_global_scale": ("F32", (1,), 4), D + "input_global_scale": ("F32", (1,), 4)}),
    "ct-group-without-matching-target": (
        ct({"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}, targets=["re:.*mlp.*"],
           fmt="pack-quantized"), {"name": "model.layers.3.self_attn.o_proj.weight"},
        {"model.layers.3.self_attn.o_proj.weight": ("BF16", (64, 256), 64 * 256 * 2)}),
}


@pytest.mark.parametrize("case", list(LAYOUTS))
def test_each_methods_tensors(case):
    cfg, kw, expected = LAYOUTS[case]
    assert tensors(cfg, **kw) == expected


# (config, tensors() keywords, {tensor: what it must be}): one tensor of a layout, or
# "missing"; "total" is the sum of the bytes of all.
PARTS = {
    "nvfp4-hf-quant-config-layout": (
        {"producer": {"name": "modelopt"},
         "quantization": {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head"]}},
        {"shape": (32, 64)}, {"total": 1160}),
    "nvfp4-w4a16-no-input-scale": ({**NVFP4, "quant_algo": "W4A16_NVFP4"}, {"shape": (32, 64)},
                                   {D + "input_scale": "missing", "total": 1156}),
    "nvfp4-experts-stack-per-expert-scalars": (
        NVFP4, {"name": EXPERTS, "shape": (4, 32, 64), "kind": "experts"},
        {EXPERTS + "_scale_2": ("F32", (4,), 16), "total": 4 * 1160}),
    "gptq-per-channel-group-is-one-group": ({**GPTQ, "group_size": -1}, {}, {D + "scales": ("F16", (1, 64), 128)}),
    "gptq-3bit": ({**GPTQ, "bits": 3}, {}, {D + "qweight": ("I32", (24, 64), 24 * 64 * 4)}),
    "gptq-lm-head-true-quantizes-the-head": (
        {**GPTQ, "lm_head": True}, {"name": "lm_head.weight"}, {"lm_head.qweight": ("I32", (32, 64), 8192)}),
    "awq-experts": (AWQ, {"name": EXPERTS, "shape": (4, 64, 256), "kind": "experts"},
                    {EXPERTS + "_qweight": ("I32", (4, 256, 8), 4 * 8192)}),
    "bnb-nf4-double-quant-8bit-absmax-and-nested-statistics": (
        BNB4_DQ, {"shape": (64, 100)},
        {DOWN + ".absmax": ("U8", (100,), 100), DOWN + ".nested_absmax": ("F32", (1,), 4),
         DOWN + ".nested_quant_map": ("F32", (256,), 1024)}),
    "ct-format-inferred-when-absent": (
        ct({"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128}), {},
        {D + "weight_packed": ("I32", (64, 32), 8192)}),
}


@pytest.mark.parametrize("case", list(PARTS))
def test_parts_of_a_methods_tensors(case):
    cfg, kw, expected = PARTS[case]
    got = tensors(cfg, **kw)
    for name, want in expected.items():
        if name == "total":
            assert sum(v[2] for v in got.values()) == want
        elif want == "missing":
            assert name not in got
        else:
            assert got[name] == want


def test_bnb_nf4_tensors():
    state = len(b'{"quant_type": "nf4", "blocksize": 64, "dtype": "bfloat16", "shape": [64, 100]}')
    assert tensors(BNB4, shape=(64, 100)) == {
        DOWN: ("U8", (3200, 1), 3200), DOWN + ".absmax": ("F32", (100,), 400),
        DOWN + ".quant_map": ("F32", (16,), 64), DOWN + ".quant_state.bitsandbytes__nf4": ("U8", (state,), state)}


def test_fp8_without_activation_scheme_notes_the_assumption():
    _, notes = scheme_from_config({"quant_method": "fp8"}, WHERE)
    assert len(notes) == 1 and "dynamic" in notes[0] and notes[0].startswith(WHERE)


def test_fp8_description():
    assert scheme(FP8_BLOCK).description == "FP8 e4m3, 128x128 block scales"


def test_awq_without_group_size_notes_the_default():
    s, notes = scheme_from_config({"quant_method": "awq", "bits": 4}, WHERE)
    assert s.group_size == 128 and any("group_size" in n for n in notes)


def test_bnb_config_without_quant_method_is_recognised():
    assert scheme({"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}).method == "bitsandbytes-4bit"


@pytest.mark.parametrize("cfg,word", [
    ({**FP8_BLOCK, "weight_block_size": "128"}, "weight_block_size"),
    ({"quant_method": "bitsandbytes"}, "load_in_4bit"),
    (ct({"num_bits": "four", "type": "int"}), "num_bits"),
], ids=["fp8-bad-block-size", "bnb-without-4bit-or-8bit", "ct-bad-num-bits"])
def test_a_bad_field_is_one_line_error(cfg, word):
    with pytest.raises(CheckpointError) as err:
        scheme_from_config(cfg, WHERE)
    assert word in str(err.value) and "\n" not in str(err.value)


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


CT_IGNORE_GATE = ct({"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128},
                    fmt="pack-quantized", ignore=["lm_head", r"re:.*mlp\.gate$"])
MODELOPT_NOT_LAYER_0 = {"quant_method": "modelopt",
                        "quantization": {"quant_algo": "FP8", "exclude_modules": ["model.layers.0.*"]}}


@pytest.mark.parametrize("cfg,name,kw,excluded", [
    ({**FP8_BLOCK, "modules_to_not_convert": ["model.visual"]}, "model.visual.blocks.0.attn.qkv.weight", {}, True),
    # a prefix does not match a longer segment
    ({**FP8_BLOCK, "modules_to_not_convert": ["model.visual"]}, "model.visualise.blocks.0.attn.qkv.weight", {}, False),
    ({**FP8_BLOCK, "ignored_layers": ["visual"]}, "model.language.visual.blocks.0.attn.qkv.weight", {}, True),
    ({**FP8_BLOCK, "ignored_layers": ["model.layers.3.mlp.down_proj"]}, DOWN, {}, True),
    ({**FP8_BLOCK, "ignored_layers": ["model.layers.3.mlp.down_proj"]}, "model.layers.3.mlp.up_proj.weight", {},
     False),
    (CT_IGNORE_GATE, "model.layers.3.mlp.gate.weight", {"shape": (8, 256)}, True),
    (CT_IGNORE_GATE, "model.layers.3.mlp.gate_proj.weight", {}, False),
    (MXFP4, "model.layers.5.mlp.router.weight", {"shape": (32, 64)}, True),
    (MODELOPT_NOT_LAYER_0, "model.layers.0.self_attn.q_proj.weight", {}, True),
    (MODELOPT_NOT_LAYER_0, "model.layers.1.self_attn.q_proj.weight", {}, False),
    ({**BNB8, "llm_int8_skip_modules": ["mlp"]}, DOWN, {}, True),
    ({**FP8_BLOCK, "modules_to_not_convert": ["model.layers.3.mlp.experts.0.gate_proj"]}, EXPERTS,
     {"shape": (4, 64, 256), "kind": "experts"}, True),
    (FP8_BLOCK, "lm_head.weight", {}, True),
    (FP8_BLOCK, "model.embed_tokens.weight", {}, True),
    (FP8_BLOCK, "model.language_model.lm_head.weight", {}, True),
    (FP8_BLOCK, "model.layers.3.input_layernorm.weight", {"shape": (1, 256), "kind": "other"}, True),
], ids=["module-prefix", "prefix-not-a-longer-segment", "bare-segment-anywhere", "exact-module-name",
        "exact-module-name-only", "regex", "regex-only", "wildcard", "modelopt-exclude-modules",
        "modelopt-exclude-modules-only", "bnb-llm-int8-skip-modules", "fused-experts-by-per-expert-name",
        "lm-head", "embed-tokens", "nested-lm-head", "other-kind"])
def test_exclusions(cfg, name, kw, excluded):
    assert unchanged(cfg, name, **kw) is excluded


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


@pytest.mark.parametrize("cfg,kw,expected,tolerance", [
    (FP8_BLOCK, {}, 8 + 32 * 32 * 32 / 4096**2, 0),              # 8.00195
    (FP8_STATIC, {}, 8 + 2 * 32 / 4096**2, 0),
    (NVFP4, {}, 4.5 + 2 * 32 / 4096**2, 0),                      # e2m1 + e4m3 per 16
    (AWQ, {}, 4 + 16 / 128 + 4 / 128, 0),                        # 4.15625: F16 scale + int4 zero per 128
    (GPTQ, {}, 4 + 16 / 128 + 4 / 128 + 32 / 4096, 0),           # + g_idx
    (CT_W4A16, {}, 4 + 16 / 128 + 128 / 4096**2, 0),             # 4.125: BF16 scales, no zeros
    (CT_FP8_DYNAMIC, {}, 8 + 16 / 4096, 0),
    (CT_NVFP4, {}, 4.5 + 2 * 32 / 4096**2, 0),
    (CT_W8A8, {}, 8 + 16 / 4096, 0),
    (BNB8, {}, 8 + 32 / 4096 + 8 / 4096**2, 0),                  # int8 + F32 SCB per row
    (MXFP4, {"kind": "experts", "shape": (1, 4096, 4096), "name": EXPERTS}, 4.25, 0),
    # 4 bits + an F32 absmax per 64 = 4.5, plus 64 bytes of quant map and ~80 of state.
    (BNB4, {}, 4.5, 1e-4),
    # 4 bits + an 8-bit absmax per 64 + an F32 per 256 absmax blocks = 4.127, plus 1 KB of
    # nested quant map and the quant state.
    (BNB4_DQ, {}, 4 + 8 / 64 + 32 / (64 * 256), 1e-3),
], ids=["fp8-block", "fp8-tensor", "nvfp4", "awq", "gptq", "ct-w4a16", "ct-fp8", "ct-nvfp4",
        "ct-w8a8", "bnb-int8", "mxfp4-experts", "bnb-nf4", "bnb-nf4-double-quant"])
def test_bits_per_weight_of_a_4096_square_weight(cfg, kw, expected, tolerance):
    assert bits_per_weight(cfg, **kw) == pytest.approx(expected, rel=1e-12, abs=tolerance)


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


def per_module(params, stored):
    """The layout of ``params``' modules, each storing ``stored(out, in)`` (suffix -> (dtype, shape))."""
    return {name.removesuffix(".weight") + suffix: entry
            for name, ((out, inp), _) in params.items() for suffix, entry in stored(out, inp).items()}


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
    layout = per_module(params, lambda out, inp: {
        ".weight": ("float8_e4m3fn", (out, inp)),
        ".weight_scale_inv": ("float32", (ceil_div(out, 128), ceil_div(inp, 128)))})
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
    layout = per_module(LINEARS, lambda out, inp: {
        ".weight": ("uint8", (out, inp * E2M1_BITS // 8)), ".weight_scale": ("float8_e4m3fn", (out, inp // 16)),
        ".weight_scale_2": ("float32", ()), ".input_scale": ("float32", ())})
    assert planned(cfg, LINEARS) == exported(tmp_path, layout)


def test_modelopt_fp8_is_to_the_byte_what_modelopt_exports(tmp_path):
    # ModelOpt's per-tensor FP8 export (nvidia/Llama-3.1-8B-Instruct-FP8 and the like): weight
    # F8_E4M3 [out, in] with 0-d F32 weight_scale and input_scale (static activation scales).
    layout = per_module(LINEARS, lambda out, inp: {
        ".weight": ("float8_e4m3fn", (out, inp)), ".weight_scale": ("float32", ()), ".input_scale": ("float32", ())})
    cfg = {"quant_method": "modelopt", "quant_algo": "FP8", "exclude_modules": ["lm_head"]}
    assert planned(cfg, LINEARS) == exported(tmp_path, layout)


def test_modelopt_mxfp8_is_to_the_byte_what_the_mx_format_stores(tmp_path):
    # ModelOpt MXFP8 (vLLM's ModelOpt MXFP8 method, block 1 x 32): weight F8_E4M3 [out, in];
    # one E8M0 scale byte per 32 elements of a row, weight_scale U8 [out, in/32].
    params = {Q + ".weight": ((384, 256), "linear"), O + ".weight": ((288, 96), "linear")}
    layout = per_module(params, lambda out, inp: {
        ".weight": ("float8_e4m3fn", (out, inp)), ".weight_scale": ("uint8", (out, inp // MX_K))})
    assert planned({"quant_method": "modelopt", "quant_algo": "MXFP8"}, params) == exported(tmp_path, layout)


# int4 packed into int32: eight values a word.
INT4_PER_I32 = 32 // 4


INT4_LINEARS = {Q + ".weight": ((384, 256), "linear"), O + ".weight": ((512, 384), "linear")}


# AutoGPTQ / GPTQModel QuantLinear (vLLM's GPTQ linear method loads the same): qweight I32
# [in/8, out] (packed along the input), g_idx I32 [in]. AutoAWQ WQLinear_GEMM (`version:
# gemm`; vLLM's AWQ linear method loads the same): qweight I32 [in, out/8] (packed along
# the output). Both: qzeros I32 [in/group, out/8] (packed along the output), scales F16
# [in/group, out].
@pytest.mark.parametrize("cfg", [GPTQ, AWQ], ids=["autogptq", "autoawq"])
def test_int4_is_to_the_byte_what_autogptq_and_autoawq_write(tmp_path, cfg):
    layout = {}
    for name, ((out, inp), _) in INT4_LINEARS.items():
        module = name.removesuffix(".weight")
        layout[module + ".qweight"] = ("int32", (inp // INT4_PER_I32, out) if cfg is GPTQ
                                       else (inp, out // INT4_PER_I32))
        layout[module + ".qzeros"] = ("int32", (inp // 128, out // INT4_PER_I32))
        layout[module + ".scales"] = ("float16", (inp // 128, out))
        if cfg is GPTQ:
            layout[module + ".g_idx"] = ("int32", (inp,))
    assert planned(cfg, INT4_LINEARS) == exported(tmp_path, layout)


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
