"""compressed-tensors (``quant_method: compressed-tensors``, what llm-compressor writes):
config groups that each target modules and name a weight format, and the tensors each
format stores.

The config and the layout are one thing here more than anywhere: the ``format`` (given, or
inferred the way compressed-tensors infers it) decides which tensors exist, and each group
may pick another. So this module parses every group into its own ``ct`` scheme and holds
the ``ct`` layout; the top-level scheme is a ``groups`` scheme the dispatcher resolves per
parameter with :mod:`.exclusion`'s target rules.

Approximated: weight scales take the model's dtype (``BF16``) unless the group names a
``scale_dtype``; sparsity compression (2:4 bitmask, ``marlin-24``) is not modelled (sizes
as if dense-quantized, with a note); KV-cache scales are not listed.
"""

from __future__ import annotations

from typing import Any, Mapping

from .base import Builder, QuantScheme, cdiv, scale_shape
from .reader import ConfigReader

_CT_FORMATS = ("dense", "int-quantized", "float-quantized", "naive-quantized", "pack-quantized",
               "nvfp4-pack-quantized", "mxfp4-pack-quantized", "mxfp8-quantized")
_CT_STRATEGIES = ("tensor", "channel", "group", "block", "tensor_group", "token")
_TORCH_TO_ST = {
    "float32": "F32", "float16": "F16", "bfloat16": "BF16", "float8_e4m3fn": "F8_E4M3",
    "uint8": "U8", "int8": "I8", "float8_e8m0fnu": "F8_E8M0",
}


def _ct_infer_format(weights: Mapping[str, Any], bits: int, wtype: str, group: int | None,
                     has_inputs: bool, scale_dtype: str | None) -> str:
    """compressed-tensors' own format choice (``infer_module_format``'s priority order)."""
    if wtype == "float" and bits == 4:
        return "mxfp4-pack-quantized" if group == 32 else "nvfp4-pack-quantized"
    if wtype == "float" and bits == 8 and group == 32 and scale_dtype == "U8":
        return "mxfp8-quantized"
    if wtype == "int" and not has_inputs:
        return "pack-quantized"
    if wtype == "int":
        return "int-quantized"
    return "float-quantized"


def _ct_group(g: ConfigReader, top_format: str | None,
              notes: list[str]) -> tuple[tuple[str, ...], QuantScheme | None]:
    """One of ``config_groups``, read by ``g`` (whose messages name the group's path)."""
    targets = g.names("targets")
    if not targets:
        raise g.fail("has no targets")
    if g.get("weights") is None:
        return targets, None  # activations only: weights stay as they are
    w = g.sub(g.get("weights"), "weights")
    weights = w.cfg
    bits = w.get_int("num_bits")
    if bits is None or bits > 16:
        raise w.fail("needs num_bits between 1 and 16")
    wtype = (w.get_str("type", default="int") or "int").lower()
    if wtype not in ("int", "float"):
        raise w.fail(f"type {wtype!r} is neither int nor float")
    group_size = w.get_int("group_size", allow=(-1,))
    strategy = w.get_str("strategy")
    if strategy is None:
        strategy = "tensor" if group_size is None else ("channel" if group_size == -1 else "group")
    strategy = strategy.lower()
    if strategy not in _CT_STRATEGIES:
        raise w.fail(f"strategy {strategy!r} is not one of {', '.join(_CT_STRATEGIES)}")
    if strategy in ("group", "tensor_group") and not (group_size and group_size > 0):
        raise w.fail(f"has strategy {strategy} but no group_size")
    block = None
    if strategy == "block":
        raw = w.get_ints("block_structure", length=2)
        if raw is None:
            raise w.fail("has strategy block but no block_structure")
        block = (raw[0], raw[1])
    raw_scale = w.get_str("scale_dtype")
    scale_dtype = _TORCH_TO_ST.get(raw_scale.removeprefix("torch.")) if raw_scale else None
    inputs = g.get("input_activations")
    has_inputs = isinstance(inputs, Mapping)
    fmt = g.get_str("format") or top_format
    if fmt in (None, "mixed-precision"):
        fmt = _ct_infer_format(weights, bits, wtype, group_size, has_inputs, scale_dtype)
    if fmt not in _CT_FORMATS:
        note = (f"{g.where}quantization_config (compressed-tensors): format {fmt!r} is not modelled; "
                f"{wtype}{bits} weights counted as {bits}-bit packed with their scales")
        if note not in notes:
            notes.append(note)
        fmt = "pack-quantized" if wtype == "int" and bits <= 8 else "naive-quantized"
    if fmt == "pack-quantized" and (wtype != "int" or bits > 8):
        raise g.fail(f"is pack-quantized but its weights are {wtype}{bits}")
    weight_dtype = None
    if fmt not in ("pack-quantized", "nvfp4-pack-quantized", "mxfp4-pack-quantized", "dense"):
        weight_dtype = "F8_E4M3" if wtype == "float" and bits == 8 else ("I8" if bits <= 8 else "I16")
    if not has_inputs:
        static_inputs = False
    elif fmt in ("nvfp4-pack-quantized", "mxfp4-pack-quantized"):
        static_inputs = inputs.get("strategy") == "tensor_group"  # input_global_scale
    else:
        static_inputs = inputs.get("dynamic", False) is False  # input_scale
    actorder = weights.get("actorder")
    desc = _ct_description(fmt, wtype, bits, strategy, group_size, block)
    return targets, QuantScheme(
        method="compressed-tensors", description=desc, layout="ct", bits=bits, strategy=strategy,
        group_size=group_size if group_size and group_size > 0 else None, block_size=block,
        weight_dtype=weight_dtype, scale_dtype=scale_dtype,
        symmetric=w.get_bool("symmetric", default=True),
        static_input_scale=bool(static_inputs), g_idx=actorder in ("group", True), format=fmt,
        dynamic_weights=weights.get("dynamic") is True,
    )


def _ct_description(fmt: str, wtype: str, bits: int, strategy: str, group: int | None,
                    block: tuple[int, int] | None) -> str:
    if fmt == "nvfp4-pack-quantized":
        return "NVFP4 e2m1 (compressed-tensors), FP8 scale per 16 + FP32 global scale"
    if fmt == "mxfp4-pack-quantized":
        return "MXFP4 e2m1 (compressed-tensors), e8m0 scale per 32"
    if fmt == "mxfp8-quantized":
        return "MXFP8 e4m3 (compressed-tensors), e8m0 scale per 32"
    per = {"tensor": "per-tensor", "channel": "per-channel", "group": f"group {group}",
           "tensor_group": f"group {group} + global", "token": "per-token"}.get(strategy, "")
    if strategy == "block" and block:
        per = f"{block[0]}x{block[1]} block"
    kind = {"float": "fp", "int": "int"}[wtype]
    return f"compressed-tensors {fmt} {kind}{bits}, {per} scales"


def parse_compressed_tensors(r: ConfigReader) -> tuple[QuantScheme, list[str]]:
    notes: list[str] = []
    top_format = r.get_str("format")
    groups_cfg = r.get("config_groups")
    exclude = r.names("ignore")
    sparsity = r.get("sparsity_config")
    if isinstance(sparsity, Mapping) and sparsity.get("format") not in (None, "dense"):
        notes.append(f"{r.where}quantization_config (compressed-tensors): sparsity format "
                     f"{sparsity.get('format')!r} is not modelled; weights counted as dense")
    if groups_cfg is None or (isinstance(groups_cfg, Mapping) and not groups_cfg):
        return QuantScheme(
            method="compressed-tensors", description="compressed-tensors without quantization groups (weights unchanged)",
            layout="groups", exclude=exclude,
        ), notes
    config_groups = r.sub(groups_cfg, "config_groups")
    groups = tuple(_ct_group(config_groups.sub(group, str(name)), top_format, notes)
                   for name, group in groups_cfg.items())
    descriptions = list(dict.fromkeys(sub.description for _, sub in groups if sub is not None))
    description = "; ".join(descriptions) or "compressed-tensors, activations only (weights unchanged)"
    return QuantScheme(
        method="compressed-tensors", description=description, layout="groups",
        exclude=exclude, groups=groups,
    ), notes


def ct_tensors(b: Builder, s: QuantScheme, out: int, inp: int, dtype: str) -> None:
    fmt = s.format or "naive-quantized"
    scale_dtype = s.scale_dtype or (dtype if dtype in ("BF16", "F16", "F32") else "F16")
    shape = scale_shape(s, out, inp)
    if s.strategy == "tensor":
        shape = (1,)
    if fmt in ("nvfp4-pack-quantized", "mxfp4-pack-quantized"):
        b.add("weight_packed", "U8", (out, cdiv(inp, 2)))
        if fmt == "nvfp4-pack-quantized":
            b.add("weight_scale", s.scale_dtype or "F8_E4M3", shape)
            b.add("weight_global_scale", "F32", (1,))
        else:
            b.add("weight_scale", s.scale_dtype or "U8", shape)
        if s.static_input_scale:
            b.add("input_global_scale", "F32", (1,))
        return
    if fmt == "pack-quantized":
        pack = 32 // s.bits
        b.add("weight_packed", "I32", (out, cdiv(inp, pack)))
        if not s.dynamic_weights:
            b.add("weight_scale", scale_dtype, shape)
        b.add("weight_shape", "I64", (2,))
        if not s.symmetric:
            if s.strategy in ("group", "channel"):
                b.add("weight_zero_point", "I32", (cdiv(out, pack), shape[1]))
            else:
                b.add("weight_zero_point", "I8", shape)
    else:  # naive-quantized, int-quantized, float-quantized, mxfp8-quantized, dense
        if fmt == "dense":
            b.add("weight", dtype, (out, inp))
        elif s.weight_dtype:
            b.add("weight", s.weight_dtype, (out, inp))
        if not s.dynamic_weights:
            mx = fmt == "mxfp8-quantized"
            b.add("weight_scale", s.scale_dtype or ("U8" if mx else scale_dtype), shape)
        if not s.symmetric:
            b.add("weight_zero_point", "I8" if s.weight_dtype != "F8_E4M3" else "F8_E4M3", shape)
    if s.g_idx:
        b.add("weight_g_idx", "I32", (inp,))
    if s.static_input_scale:
        b.add("input_scale", dtype if dtype in ("BF16", "F16", "F32") else "F16", (1,))
