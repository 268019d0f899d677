"""How the probe writes a rate and a size for people.

The few number formats the probe's lines share, kept in one place so that a rate reads the
same wherever it is printed: in the profile's own rendering and the planning flags it
names (:mod:`.profile`), in the one-line note a plan carries about its rates
(:mod:`.planning`), and in the sizes the measurements' errors name (:mod:`.measurements`).
Nothing here reads, measures or decides anything.
"""

from __future__ import annotations

from typing import Mapping

from ..sizes import GiB

MiB = 1 << 20


def largest_size(samples: Mapping[int, float]) -> int | None:
    return max(samples) if samples else None


def fmt_rate(gbps: float | None) -> str:
    if gbps is None:
        return "n/a"
    return f"{gbps:.0f}" if gbps >= 1000 else f"{gbps:.3g}" if gbps < 10 else f"{gbps:.1f}"


def fmt_size(nbytes: int) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def fmt_gib(nbytes: int) -> str:
    return f"{nbytes / GiB:.2f} GiB"
