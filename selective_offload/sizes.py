"""Byte sizes and bandwidths as people write them: ``24GiB``, ``3.5 GB``, ``13.9``.

Decimal units (kB, MB, GB, TB: powers of 1000) and binary units (KiB, MiB, GiB, TiB:
powers of 1024) are both accepted, because GPU cards are sold in GiB while link and
memory bandwidths are quoted in GB/s. A bare number is bytes; where a person gives a size
(an option, a variable), one below :data:`MIN_BARE_SIZE` other than 0 is refused
(:func:`read_size`): ``--device-memory 24`` means 24 GiB to a person.
"""

from __future__ import annotations

import math
import re

from .errors import UserError

GB = 1_000_000_000
GiB = 1 << 30
#: The largest size anything here takes: 2**53 bytes is 9 PB, and every integer up to it
#: is exact as a float, so no arithmetic on a size overflows or rounds.
MAX_BYTES = 2**53
#: Bandwidths outside this range (decimal GB/s) are typos, and would make estimates of 0 or
#: infinite seconds (which strict JSON cannot even write).
MIN_GBPS, MAX_GBPS = 1e-3, 1e6
#: A compute rate above this (TFLOP/s) is no real card's: a typo or a hand-edited plan.
MAX_TFLOPS = 1e6

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_size(text: str | int | float, what: str = "size") -> int:
    """Parse ``text`` as a non-negative number of bytes.

    ``what`` names the value in the error message (for example ``--device-memory``).
    """
    if isinstance(text, bool):
        raise UserError(f"{what}: {text!r} is not a size; write it like 24GiB or 3.5GB")
    if isinstance(text, (int, float)):
        value, unit = float(text), ""
    else:
        match = _SIZE_RE.match(str(text))
        if not match or match.group(2).lower() not in _UNITS:
            raise UserError(
                f"{what}: cannot read {text!r} as a size; write a number with one of the "
                "units B, kB, MB, GB, TB, KiB, MiB, GiB, TiB (for example 24GiB or 3.5GB)"
            )
        value, unit = float(match.group(1)), match.group(2).lower()
    if not math.isfinite(value) or value < 0 or value * _UNITS[unit] > MAX_BYTES:
        raise UserError(f"{what}: {text!r} must be a size from 0 bytes to {MAX_BYTES} bytes (8 PiB)")
    return int(round(value * _UNITS[unit]))


#: A bare number (no unit) below this is refused where a person gives a size.
MIN_BARE_SIZE = 1 << 20


def read_size(value: str | int | float, what: str) -> int:
    """:func:`parse_size` of a size a person gave (``what``: ``--device-memory``, ``device_memory=``
    or a variable's name): a bare number below :data:`MIN_BARE_SIZE` other than 0 is refused,
    naming the unit it lacks."""
    nbytes = parse_size(value, what)
    bare = isinstance(value, (int, float)) or not _SIZE_RE.match(str(value)).group(2)  # parsed: it matches
    if bare and 0 < float(value) < MIN_BARE_SIZE:
        text = str(value).strip()
        given = f"{what}{'' if what.endswith('=') else ' ' if what.startswith('-') else '='}{text}"
        raise UserError(f"{given}: give a unit, e.g. {text}GiB (a bare number is bytes)")
    return nbytes


def parse_bandwidth_gbps(text: str | float, what: str = "bandwidth") -> float:
    """Parse a bandwidth in GB/s (decimal, as links and memories are quoted); must be > 0."""
    try:
        value = float(str(text).strip().removesuffix("GB/s").removesuffix("gbps").strip())
    except ValueError:
        raise UserError(
            f"{what}: cannot read {text!r} as a bandwidth; give GB/s as a number, like 13.9"
        ) from None
    if not MIN_GBPS <= value <= MAX_GBPS:
        raise UserError(f"{what}: {text!r} GB/s must be a number of GB/s from {MIN_GBPS:g} to {MAX_GBPS:g}, "
                        "like 13.9")
    return value


def fmt_bytes(nbytes: int | float) -> str:
    """Bytes with a unit that keeps three significant figures readable (kB, MB, GB): the one
    formatter of sizes the plan, the landing report and the CLI print."""
    for unit, scale in (("GB", GB), ("MB", 10**6), ("kB", 10**3)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.3f} {unit}" if unit == "GB" else f"{nbytes / scale:.1f} {unit}"
    return f"{int(nbytes)} B"


def size_arg(nbytes: int) -> str:
    """``nbytes`` as a command-line size that reads back exactly (``24GiB``, or plain bytes)."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", GiB), ("MiB", 1 << 20)):
        if nbytes and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return str(int(nbytes))
