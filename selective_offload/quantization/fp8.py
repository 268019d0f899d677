"""FP8 weights with F32 scales: ``quant_method: fp8`` (per-tensor, or DeepSeek-style
``weight_block_size`` blocks with ``weight_scale_inv``) and ``fbgemm_fp8`` (per channel).

The config parsers and the ``fp8`` layout live together because the layout is what the
config means: ``weight_block_size`` decides both the scale's shape and its name. ModelOpt's
FP8 algorithms (:mod:`.modelopt`) build schemes with this layout too.

Approximated: ``scale_fmt: ue8m0`` checkpoints are counted with F32 scales; fused experts
are one stacked tensor per kind, their block scales along a fused output dimension
rounding up once where a per-expert checkpoint rounds up twice.
"""

from __future__ import annotations

from .base import Builder, QuantScheme, scale_shape
from .reader import ConfigReader

_FP8_DTYPES = {"e4m3": "F8_E4M3", "float8_e4m3fn": "F8_E4M3", "e5m2": "F8_E5M2", "float8_e5m2": "F8_E5M2"}


def parse_fp8(r: ConfigReader) -> tuple[QuantScheme, list[str]]:
    notes: list[str] = []
    fmt = r.get_str("fmt", default="e4m3").lower()
    weight_dtype = _FP8_DTYPES.get(fmt)
    if weight_dtype is None:
        raise r.fail(f"fmt {fmt!r} is not an FP8 format (e4m3 or e5m2)")
    activation = r.get_str("activation_scheme")
    if activation is None:
        activation = "dynamic"
        notes.append(f"{r.where}quantization_config (fp8) names no activation_scheme; "
                     "assumed dynamic (no input_scale tensors)")
    activation = activation.lower()
    if activation not in ("dynamic", "static"):
        raise r.fail(f"activation_scheme {activation!r} is neither dynamic nor static")
    block = r.get_ints("weight_block_size", length=2)
    exclude = r.names("ignored_layers", "modules_to_not_convert")
    e = weight_dtype.removeprefix("F8_").lower()
    if block is not None:
        bo, bi = block
        return QuantScheme(
            method="fp8", description=f"FP8 {e}, {bo}x{bi} block scales", layout="fp8", bits=8,
            strategy="block", block_size=(bo, bi), weight_dtype=weight_dtype,
            scale_name="weight_scale_inv", static_input_scale=activation == "static", exclude=exclude,
        ), notes
    static = activation == "static"
    return QuantScheme(
        method="fp8",
        description=f"FP8 {e}, per-tensor scales" + (", static activation scales" if static else ""),
        layout="fp8", bits=8, strategy="tensor", weight_dtype=weight_dtype,
        static_input_scale=static, exclude=exclude,
    ), notes


def parse_fbgemm_fp8(r: ConfigReader) -> tuple[QuantScheme, list[str]]:
    return QuantScheme(
        method="fp8", description="FP8 e4m3 (FBGEMM), per-channel scales", layout="fp8", bits=8,
        strategy="channel", weight_dtype="F8_E4M3", exclude=r.names("modules_to_not_convert"),
    ), []


def fp8_tensors(b: Builder, s: QuantScheme, out: int, inp: int, dtype: str) -> None:
    """An FP8 ``weight [out, in]``, its scale (per tensor ``[]``, per channel ``[out]``,
    blocks ``[out/bo, in/bi]``, rounded up) and, for static activations, ``input_scale``."""
    b.add("weight", s.weight_dtype or "F8_E4M3", (out, inp))
    shape = scale_shape(s, out, inp)
    if s.strategy == "channel":
        shape = (out,)
    b.add(s.scale_name, s.scale_dtype or "F32", shape)
    if s.static_input_scale:
        b.scalar("input_scale")
