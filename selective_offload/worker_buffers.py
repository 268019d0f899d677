"""The buffers a worker allocates to compute on the host, by formula (no torch, no vLLM).

One page-locked staging slot and one kernel workspace serve every host-compute unit of a
process (its routed-experts layers, dense MLPs and the split LM head), sized for the
largest step the plan computes on the host: its crossover (``host_compute.crossover_tokens``,
the head's own ``head_crossover_tokens``). Smaller steps use the first bytes of the same
buffers (:mod:`selective_offload.wrappers.host_buffers` says why that is safe).

These formulas are the allocation sites': ``wrappers.host_buffers`` allocates exactly
:func:`staging_bytes` and :func:`workspace_bytes` of what its units reserve, and the plan's
ledger (``plan_format.contents``) prices the same from the plan's groups, so the two agree
by construction. :func:`moe_workspace_bytes` mirrors ``so_moe_workspace_bytes`` of
``cpu_kernels/moe.c`` (a test compares them on many shapes); :func:`rows_workspace_bytes`
the rows walk's tokens (``rows_head.h``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

#: Every region of the staging slot and of the kernel's workspace starts on this boundary.
ALIGN = 64
#: Bytes per 128 elements of an int8 vector on the MXFP4 and int4 path (``Q8_CHUNK``, moe.c).
Q8_CHUNK = 256
#: The staging slot holds every token, id, weight and sum as 4 bytes (the widest dtype a
#: step's hidden states come in: float32), so one slot serves a bf16 and a float32 engine.
ELEMENT_BYTES = 4


def align(n: int) -> int:
    return (int(n) + ALIGN - 1) // ALIGN * ALIGN


def q8_bytes(n: int) -> int:
    return (int(n) + 127) // 128 * Q8_CHUNK


def moe_workspace_bytes(tokens: int, picks: int, experts: int, hidden: int, intermediate: int) -> int:
    """``so_moe_workspace_bytes(T, K, E, H, I)`` of moe.c: the kernel's scratch for one call."""
    T, K, E, H, I = (int(v) for v in (tokens, picks, experts, hidden, intermediate))
    P = T * K
    return (align(T * H * 4) + align(P * I * 4) + align(P * 8) + align(P * 4) + align((E + 1) * 8) * 3
            + align(T * q8_bytes(H)) + align(P * q8_bytes(I)))


def rows_workspace_bytes(tokens: int, columns: int) -> int:
    """The rows walk's scratch (its tokens, reordered, at most 4 bytes each, and 64 spare)."""
    return int(tokens) * int(columns) * 4 + ALIGN


@dataclass(frozen=True)
class Unit:
    """One host-compute unit's largest host step: ``tokens`` [T, ``hidden``] hidden states,
    ``picks`` ids and weights per token (0 for the head), ``out_width`` sums per token (H for
    experts and MLPs, the host's vocabulary rows for the head), and its kernel's workspace."""

    tokens: int
    hidden: int
    picks: int
    out_width: int
    workspace: int

    @classmethod
    def experts(cls, tokens: int, picks: int, experts: int, hidden: int, intermediate: int) -> "Unit":
        return cls(tokens, hidden, picks, hidden, moe_workspace_bytes(tokens, picks, experts, hidden, intermediate))

    @classmethod
    def rows(cls, tokens: int, hidden: int, rows: int) -> "Unit":
        return cls(tokens, hidden, 0, rows, rows_workspace_bytes(tokens, hidden))


@dataclass(frozen=True)
class Staging:
    """The staging slot's four regions, in elements of 4 bytes: hidden states, ids, weights
    (as many as ids) and sums; each region starts on :data:`ALIGN`."""

    x: int = 0
    picks: int = 0
    out: int = 0

    @classmethod
    def of(cls, units: Iterable[Unit]) -> "Staging":
        units = list(units)
        return cls(x=max((u.tokens * u.hidden for u in units), default=0),
                   picks=max((u.tokens * u.picks for u in units), default=0),
                   out=max((u.tokens * u.out_width for u in units), default=0))

    def offsets(self) -> tuple[int, int, int, int]:
        """Byte offsets of the hidden states, ids, weights and sums."""
        ids = align(self.x * ELEMENT_BYTES)
        weights = ids + align(self.picks * ELEMENT_BYTES)
        out = weights + align(self.picks * ELEMENT_BYTES)
        return 0, ids, weights, out

    @property
    def nbytes(self) -> int:
        return self.offsets()[3] + align(self.out * ELEMENT_BYTES) if (self.x or self.out) else 0

    def covers(self, other: "Staging") -> bool:
        return self.x >= other.x and self.picks >= other.picks and self.out >= other.out


def staging_bytes(units: Iterable[Unit]) -> int:
    """The one staging slot's bytes for ``units``."""
    return Staging.of(units).nbytes


def workspace_bytes(units: Iterable[Unit]) -> int:
    """The one kernel workspace's bytes for ``units`` (the largest any of them needs)."""
    return max((u.workspace for u in units), default=0)
