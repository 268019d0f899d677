"""AWQ (``quant_method: awq``, ``awq_marlin``): int weights packed eight to an int32 along
the output dimension, with packed zero points and F16 scales per input group.

Parser and layout together: ``bits`` and ``group_size`` (or AutoAWQ's ``w_bit`` and
``q_group_size``) are all the layout needs. Approximated: the GEMM layout
(``qweight [in, out*bits/32]``) for every ``version``; GEMV and Marlin variants differ in
shape by padding only.
"""

from __future__ import annotations

from .base import Builder, QuantScheme, cdiv, group_count
from .reader import ConfigReader


def parse_awq(r: ConfigReader) -> tuple[QuantScheme, list[str]]:
    notes: list[str] = []
    bits = r.get_int("bits", "w_bit")
    if bits is None:
        bits = 4
        notes.append(f"{r.where}quantization_config (awq) names no bits; assumed 4")
    group = r.get_int("group_size", "q_group_size", allow=(-1,))
    if group is None:
        group = 128
        notes.append(f"{r.where}quantization_config (awq) names no group_size; assumed 128")
    if bits > 8:
        raise r.fail(f"bits {bits} is more than AWQ packs (at most 8)")
    g = f"group {group}" if group > 0 else "per channel"
    return QuantScheme(
        method="awq", description=f"AWQ int{bits}, {g}, F16 scales, packed zeros",
        layout="awq", bits=bits, strategy="group" if group > 0 else "channel",
        group_size=group if group > 0 else None, symmetric=False,
        exclude=r.names("modules_to_not_convert"),
    ), notes


def awq_tensors(b: Builder, s: QuantScheme, out: int, inp: int, dtype: str) -> None:
    packed_out = cdiv(out * s.bits, 32)
    groups = group_count(s, inp)
    b.add("qweight", "I32", (inp, packed_out))
    b.add("qzeros", "I32", (groups, packed_out))
    b.add("scales", "F16", (groups, out))
