"""NVIDIA ModelOpt checkpoints (``quant_method: modelopt``, ``modelopt_fp4``, ``nvfp4``,
``modelopt_mxfp8``, or an ``hf_quant_config`` layout with a ``quantization`` section):
NVFP4, FP8 in three granularities, MXFP8, and mixed precision by layer.

One ``quant_algo`` names both the numbers and the tensors, so the parser and the two
layouts only ModelOpt writes (``nvfp4``, ``mxfp8``) live here; its FP8 algorithms reuse
the ``fp8`` layout of :mod:`.fp8`, and ``MIXED_PRECISION`` becomes a ``groups`` scheme the
dispatcher resolves per layer with :mod:`.exclusion`'s rules.

NVFP4 stores per linear ``weight [out, in/2]`` (two E2M1 values a byte), ``weight_scale``
E4M3 ``[out, in/16]``, the F32 scalars ``weight_scale_2`` and (with 4-bit activations)
``input_scale``. MXFP8 stores ``weight`` E4M3 ``[out, in]`` and ``weight_scale`` E8M0 (as
``U8``) ``[out, in/32]``.
"""

from __future__ import annotations

from typing import Mapping

from ..errors import CheckpointError
from .base import Builder, QuantScheme, cdiv
from .reader import ACTION, ConfigReader

#: E2M1 values per E4M3 scale in NVFP4; the format's, used when the config names none.
NVFP4_GROUP = 16
#: E4M3 values per shared E8M0 scale in MXFP8 (the MX block size).
MXFP8_BLOCK = 32


def _modelopt_algo(r: ConfigReader, algo: str, group: int | None, exclude: tuple[str, ...]) -> QuantScheme:
    algo = algo.upper()
    if algo in ("NVFP4", "W4A16_NVFP4"):
        g = group or NVFP4_GROUP
        w4a16 = algo == "W4A16_NVFP4"
        return QuantScheme(
            method="nvfp4",
            description=f"NVFP4 e2m1 (ModelOpt), FP8 scale per {g} + FP32 global scale"
                        + (", 16-bit activations" if w4a16 else ""),
            layout="nvfp4", bits=4, strategy="tensor_group", group_size=g,
            static_input_scale=not w4a16, exclude=exclude,
        )
    if algo == "FP8":
        return QuantScheme(
            method="fp8", description="FP8 e4m3 (ModelOpt), per-tensor scales, static activation scales",
            layout="fp8", bits=8, strategy="tensor", weight_dtype="F8_E4M3",
            static_input_scale=True, exclude=exclude,
        )
    if algo == "FP8_PER_CHANNEL_PER_TOKEN":
        return QuantScheme(
            method="fp8", description="FP8 e4m3 (ModelOpt), per-channel scales",
            layout="fp8", bits=8, strategy="channel", weight_dtype="F8_E4M3", exclude=exclude,
        )
    if algo in ("FP8_PB_WO", "FP8_BLOCK_SCALES"):
        return QuantScheme(
            method="fp8", description="FP8 e4m3 (ModelOpt), 128x128 block scales",
            layout="fp8", bits=8, strategy="block", block_size=(128, 128),
            weight_dtype="F8_E4M3", exclude=exclude,
        )
    if algo == "MXFP8":
        return QuantScheme(
            method="mxfp8", description="MXFP8 e4m3 (ModelOpt), e8m0 scale per 32",
            layout="mxfp8", bits=8, strategy="group", group_size=MXFP8_BLOCK, exclude=exclude,
        )
    raise CheckpointError(
        f"{r.where}quantization_config: ModelOpt quant_algo {algo!r} is not supported, so the "
        f"quantized checkpoint's size cannot be estimated from config.json; {ACTION}"
    )


def parse_modelopt(r: ConfigReader) -> tuple[QuantScheme, list[str]]:
    inner = r.cfg.get("quantization")
    section = r.sub(inner, "quantization") if isinstance(inner, Mapping) else r
    algo = section.get_str("quant_algo") or r.get_str("quant_algo")
    if algo is None:
        method = r.method.lower().replace("_", "-")
        algo = {"modelopt-fp4": "NVFP4", "nvfp4": "NVFP4", "modelopt-mxfp8": "MXFP8"}.get(method)
    if algo is None:
        raise r.fail("names no quant_algo")
    group = section.get_int("group_size") or r.get_int("group_size")
    # vLLM never quantizes these vision modules of a ModelOpt checkpoint.
    exclude = section.names("exclude_modules", "ignore") + r.names("exclude_modules", "ignore") \
        + ("vision_tower", "vision_model")
    exclude = tuple(dict.fromkeys(exclude))
    if algo.upper() != "MIXED_PRECISION":
        return _modelopt_algo(r, algo, group, exclude), []
    layers_at = section if section.get("quantized_layers") else r
    layers = layers_at.get("quantized_layers")
    if not isinstance(layers, Mapping) or not layers:
        raise r.fail("quant_algo MIXED_PRECISION needs a quantized_layers object")
    groups = []
    for module, spec in layers.items():
        if not isinstance(spec, Mapping) or not isinstance(spec.get("quant_algo"), str):
            raise r.fail(f"quantized_layers[{module!r}] has no quant_algo")
        spec_group = layers_at.sub(spec, f"quantized_layers.{module}").get_int("group_size")
        sub = _modelopt_algo(r, spec["quant_algo"], spec_group or group, ())
        groups.append(((str(module),), sub))
    algos = sorted({sub.description.split(" (")[0] for _, sub in groups})
    return QuantScheme(
        method="modelopt", description=f"ModelOpt mixed precision ({', '.join(algos)} by layer)",
        layout="groups", exclude=exclude, groups=tuple(groups),
    ), []


def nvfp4_tensors(b: Builder, s: QuantScheme, out: int, inp: int, dtype: str) -> None:
    b.add("weight", "U8", (out, cdiv(inp, 2)))
    b.add("weight_scale", "F8_E4M3", (out, cdiv(inp, s.group_size or NVFP4_GROUP)))
    b.scalar("weight_scale_2")
    if s.static_input_scale:
        b.scalar("input_scale")


def mxfp8_tensors(b: Builder, s: QuantScheme, out: int, inp: int, dtype: str) -> None:
    b.add("weight", "F8_E4M3", (out, inp))
    b.add("weight_scale", "U8", (out, cdiv(inp, s.group_size or MXFP8_BLOCK)))
