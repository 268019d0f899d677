"""MXFP4 as gpt-oss ships it (``quant_method: mxfp4``): routed experts only, every other
weight left in the model's dtype.

The format fixes the layout, so nothing in the config changes it: the OCP Microscaling
(MX) block of :data:`MXFP4_BLOCK` E2M1 values shares one E8M0 scale byte, and the values
pack two to a byte. gpt-oss stores a fused experts weight ``<proj>`` as
``<proj>_blocks [experts, out, in/32, 16]`` and ``<proj>_scales [experts, out, in/32]``,
both ``U8``, with ``in`` and ``out`` those of the transposed ``[experts, in, out]`` parameter
transformers builds. compressed-tensors' ``mxfp4-pack-quantized`` is another layout of the
same numbers (:mod:`.compressed_tensors`).
"""

from __future__ import annotations

from .base import Builder, QuantScheme, cdiv
from .reader import ConfigReader

#: E2M1 values per shared E8M0 scale (the MX block size).
MXFP4_BLOCK = 32


def parse_mxfp4(r: ConfigReader) -> tuple[QuantScheme, list[str]]:
    return QuantScheme(
        method="mxfp4", description="MXFP4 e2m1 MoE experts, e8m0 scale per 32; other weights unquantized",
        layout="mxfp4", bits=4, strategy="group", group_size=MXFP4_BLOCK, experts_only=True,
        exclude=r.names("modules_to_not_convert"),
    ), []


def mxfp4_tensors(b: Builder, s: QuantScheme, out: int, inp: int, dtype: str) -> None:
    block = s.group_size or MXFP4_BLOCK
    groups = cdiv(inp, block)
    b.add("weight_blocks", "U8", (out, groups, block // 2))
    b.add("weight_scales", "U8", (out, groups))
