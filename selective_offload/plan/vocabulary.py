"""The plan contract's words: the format's name, the enums a plan's fields take, and the
per-kind rules as tables.

Everything else in :mod:`selective_offload.plan` speaks these words: the records
(:mod:`.inputs`, :mod:`.parts`, :mod:`.contents`) hold them, :mod:`.checks` applies the
tables, :mod:`.io` reads and writes them. The rules that depend on a group's kind or class
are tables (``KIND_CLASS``, ``CLASS_PLACEMENTS``, ``PLACEMENT_KINDS``,
``LAYER_INDEX_KINDS``, ``PARTIAL_READ_KINDS``), so a new kind (or placement) states its
rules here, in one place. This module imports nothing of the project but sizes.
"""

from __future__ import annotations

from enum import Enum

from ..sizes import MAX_BYTES, GiB

FORMAT_PREFIX = "selective-offload/plan-v"
#: The format this release writes, and the oldest one it still reads.
FORMAT_VERSION = 3
OLDEST_READABLE_VERSION = 1
PLAN_FORMAT = f"{FORMAT_PREFIX}{FORMAT_VERSION}"
REPLAN = "make the plan again with `selective-offload plan MODEL --device-memory SIZE -o plan.json`"

REFERENCE_LINK_GBPS = 13.9
REFERENCE_VRAM_GBPS = 472.0
#: Device memory kept back from weights unless the plan says otherwise.
DEFAULT_KV_CACHE_BYTES = 1 * GiB
#: CUDA context, activations, CUDA graphs and allocator slack.
DEFAULT_RESERVE_BYTES = 2 * GiB
#: The largest integer a plan holds (bytes, counts, tokens); see sizes.MAX_BYTES.
MAX_PLAN_INT = MAX_BYTES
#: The largest other number a plan holds (estimates, GiB).
MAX_PLAN_NUMBER = 1e18


class _Choice(str, Enum):
    """A string enum that prints and serialises as its value (``host-cold``)."""

    __str__ = str.__str__
    __format__ = str.__format__

    @classmethod
    def values(cls) -> tuple[str, ...]:
        return tuple(m.value for m in cls)


class Placement(_Choice):
    """Where a group's bytes live during decode."""

    DEVICE = "device"
    HOST_COLD = "host-cold"   # host memory; a decode step does not read it (or one row per token)
    HOST_HOT = "host-hot"     # host memory; read every step, prefetched layer by layer
    ABSENT = "absent"         # not loaded for this run (an MTP head without MTP decoding)
    HOST_UVA = "host-uva"     # host memory, read in place through UVA: only the routed experts a step uses


class GroupClass(_Choice):
    COLD = "cold"
    HOT = "hot"
    ABSENT = "absent"


class GroupKind(_Choice):
    LAYER = "layer"    # one decoder layer of the main stack
    COLD = "cold"      # a whole cold module (embedding, tower, projector, MTP head)
    MODULE = "module"  # any other parameters, by module path
    EXPERTS = "experts"  # the routed experts of one MoE decoder layer (the layer group holds the rest)


class Strategy(_Choice):
    RESIDENT = "resident"
    COLD_OFFLOAD = "cold_offload"
    HOT_OFFLOAD = "hot_offload"
    INFEASIBLE = "infeasible"


HOST_PLACEMENTS = (Placement.HOST_COLD, Placement.HOST_HOT, Placement.HOST_UVA)
#: Kinds of group that belong to one decoder layer (and carry its ``layer_index``).
LAYER_KINDS = (GroupKind.LAYER, GroupKind.EXPERTS)

# Per-kind rules, as tables, so a new kind (or placement) states its rules in one place.
#: Kinds whose groups carry a ``layer_index`` (the decoder layer their name is in).
LAYER_INDEX_KINDS: frozenset[GroupKind] = frozenset(LAYER_KINDS)
#: Kinds whose class is fixed (a cold-kind group's class depends on its name: see
#: :meth:`Plan.expected_class`).
KIND_CLASS: dict[GroupKind, GroupClass] = {GroupKind.LAYER: GroupClass.HOT, GroupKind.EXPERTS: GroupClass.HOT,
                                          GroupKind.MODULE: GroupClass.HOT}
#: Placements allowed for each class, and the kinds a placement is limited to.
CLASS_PLACEMENTS: dict[GroupClass, frozenset[Placement]] = {
    GroupClass.COLD: frozenset({Placement.DEVICE, Placement.HOST_COLD}),
    GroupClass.HOT: frozenset({Placement.DEVICE, Placement.HOST_HOT, Placement.HOST_UVA}),
    GroupClass.ABSENT: frozenset({Placement.ABSENT}),
}
PLACEMENT_KINDS: dict[Placement, frozenset[GroupKind]] = {Placement.HOST_HOT: frozenset(LAYER_KINDS),
                                                          Placement.HOST_UVA: frozenset({GroupKind.EXPERTS})}
#: Kinds of hot groups a decode step reads only in part (their ``est_read_bytes_per_step``
#: is bounded by their bytes, not equal to them). Every other hot group is read in full.
PARTIAL_READ_KINDS: frozenset[GroupKind] = frozenset({GroupKind.EXPERTS})
