"""A method this package does not know, estimated from the bit width its config gives
(``bits``, ``num_bits``, ``weight_bits`` or ``w_bit``).

Kept apart from the known methods so that an estimate is never mistaken for a layout: the
scheme says "assumed" in its description and the parser returns a note that says how the
sizes were made and where exact ones come from. The ``packed`` layout is weights packed at
that width plus one F16 scale per ``group_size`` inputs (per output row without one).
Without a bit width there is nothing to estimate from, and the config is refused.
"""

from __future__ import annotations

from ..errors import CheckpointError
from .base import Builder, QuantScheme, cdiv, group_count
from .reader import ACTION, ConfigReader


def parse_unknown(r: ConfigReader, method: str) -> tuple[QuantScheme, list[str]]:
    bits = r.get("bits", "num_bits", "weight_bits", "w_bit")
    if bits is None:
        raise CheckpointError(
            f"{r.where}quantization_config: quant_method {method!r} is not supported, so the "
            f"quantized checkpoint's size cannot be estimated from config.json; {ACTION}"
        )
    bits = r.get_int("bits", "num_bits", "weight_bits", "w_bit")
    if bits > 32:
        raise r.fail(f"bit width {bits} is not a weight bit width")
    group = r.get_int("group_size", "q_group_size", minimum=1, allow=(-1,))
    per = f"one F16 scale per {group} inputs" if group and group > 0 else "one F16 scale per output row"
    scheme = QuantScheme(
        method=method,
        description=f"{method}: assumed {bits}-bit packed weights, {per}",
        layout="packed", bits=bits, strategy="group" if group and group > 0 else "channel",
        group_size=group if group and group > 0 else None,
        exclude=r.names("modules_to_not_convert", "ignore", "ignored_layers"),
    )
    note = (
        f"{r.where}quantization_config: method {method!r} is not modelled; its linear and "
        f"expert weights are estimated as {bits}-bit ({per}), everything else unchanged; "
        f"for exact sizes {ACTION}"
    )
    return scheme, [note]


def packed_tensors(b: Builder, s: QuantScheme, out: int, inp: int, dtype: str) -> None:
    b.add("weight", "U8", (out, cdiv(inp * s.bits, 8)))
    b.add("weight_scale", "F16", (out, group_count(s, inp)))
