"""The plan contract's words: the format's name, the enums a plan's fields take, and the
per-kind rules as tables.

Everything else in :mod:`selective_offload.plan_format` speaks these words: the records
(:mod:`.inputs`, :mod:`.parts`, :mod:`.contents`) hold them, :mod:`.checks` applies the
tables, :mod:`.io` reads and writes them. The rules that depend on a group's kind or role
are tables (``KIND_ROLE``, ``ROLE_PLACEMENTS``, ``PLACEMENT_KINDS``,
``LAYER_INDEX_KINDS``, ``PARTIAL_READ_KINDS``), so a new kind (or placement) states its
rules here, in one place. This module imports nothing of the project but sizes.
"""

from __future__ import annotations

from enum import Enum

from ..sizes import MAX_BYTES, GiB

FORMAT_PREFIX = "selective-offload/plan-v"
#: The format this release writes and the only one it reads (an older plan is made again).
FORMAT_VERSION = 4
PLAN_FORMAT = f"{FORMAT_PREFIX}{FORMAT_VERSION}"
REPLAN = "make the plan again with `selective-offload plan MODEL --device-memory SIZE -o plan.json`"

#: The planner's note when a plan computes none of its host experts on the CPU:
#: ``HOST_COMPUTE_NOTE + cause + ", " + SERVED_UVA`` (:attr:`Plan.host_compute_declined` reads it back).
HOST_COMPUTE_NOTE = "host-compute: "
SERVED_UVA = "so host experts are served uva"

REFERENCE_LINK_GBPS = 13.9
REFERENCE_VRAM_GBPS = 472.0
#: Device memory kept back from weights unless the plan says otherwise.
DEFAULT_KV_CACHE_BYTES = 1 * GiB
#: Activations, CUDA graphs and allocator slack (the CUDA context is in the card's figure:
#: ``planner.cards``).
DEFAULT_RESERVE_BYTES = 2 * GiB
#: Host RAM left to the operating system and vLLM's own processes (the API server, the
#: engine core and each worker: Python with torch, vLLM and the CUDA libraries loaded) when
#: the plan's host bytes are checked against the host's memory, est: 1.5 GiB for the system
#: and 1.5 GiB for each of three vLLM processes.
HOST_HEADROOM_BYTES = 6 * GiB
#: The largest integer a plan holds (bytes, counts, tokens); see sizes.MAX_BYTES.
MAX_PLAN_INT = MAX_BYTES
#: The largest other number a plan holds (estimates, GiB).
MAX_PLAN_NUMBER = 1e18


class _Choice(str, Enum):
    """A string enum that prints and serialises as its value (``on-demand``)."""

    __str__ = str.__str__
    __format__ = str.__format__

    @classmethod
    def values(cls) -> tuple[str, ...]:
        return tuple(m.value for m in cls)


class Placement(_Choice):
    """Where a group's bytes live during decode and how they are served, as one internal
    value (the v3 words); a v4 plan writes it as :class:`Location` and :class:`Serving`
    (see :data:`PLACEMENT_SERVING`), the host one splitting by group into gather and on-demand."""

    DEVICE = "device"
    HOST_COLD = "host-cold"   # host memory; a decode step does not read it (or one row per token)
    HOST_HOT = "host-hot"     # host memory; read every step, prefetched layer by layer
    ABSENT = "absent"         # not loaded for this run (an MTP head without MTP decoding)
    HOST_UVA = "host-uva"     # host memory, read in place through UVA: only the routed experts a step uses
    HOST_COMPUTE = "host-compute"  # host memory, computed there by the host CPU at decode (only activations cross)


class Location(_Choice):
    """Where a group's bytes live during decode."""

    DEVICE = "device"
    HOST = "host"
    ABSENT = "absent"


class Serving(_Choice):
    """How a decode step gets a group's bytes."""

    RESIDENT = "resident"    # on the device, read where they are
    GATHER = "gather"        # a host embedding (or n-gram table): the rows a step needs gathered on the host
    ON_DEMAND = "on-demand"  # a host tower, projector or other cold component: onloaded block by block when run
    PREFETCH = "prefetch"    # vLLM's prefetch offloader: copied to a device buffer layer by layer ahead of use
    UVA = "uva"              # read in place through UVA: only the routed experts a step uses
    COMPUTE = "compute"      # computed where they live by the host CPU (steps above the crossover read them from the device)
    NONE = "none"            # not loaded for this run (an MTP head without MTP decoding)


class Role(_Choice):
    """What a decode step does with a group."""

    COLD = "cold"      # not read by a decode step, or one row per token
    HOT = "hot"        # read every decode step
    ABSENT = "absent"  # not loaded


class GroupKind(_Choice):
    LAYER = "layer"    # one decoder layer of the main stack
    COMPONENT = "component"  # a whole embedding, tower, projector or MTP head (its role follows from its name)
    MODULE = "module"  # any other parameters, by module path
    EXPERTS = "experts"  # the routed experts of one MoE decoder layer (the layer group holds the rest)
    MLP = "mlp"  # the MLP of one dense decoder layer, split out only when computed on the host (the layer group holds the rest)


class Strategy(_Choice):
    RESIDENT = "resident"
    COLD_OFFLOAD = "cold_offload"
    HOT_OFFLOAD = "hot_offload"
    INFEASIBLE = "infeasible"


#: How each placement is served, and where it lives; a host placement of a cold group is
#: gather or on-demand by the group (see :attr:`GroupPlan.serving`).
PLACEMENT_SERVING: dict[Placement, Serving] = {Placement.DEVICE: Serving.RESIDENT, Placement.HOST_HOT: Serving.PREFETCH,
                                               Placement.HOST_UVA: Serving.UVA, Placement.HOST_COMPUTE: Serving.COMPUTE,
                                               Placement.ABSENT: Serving.NONE}
SERVING_PLACEMENT: dict[Serving, Placement] = {
    **{serving: placement for placement, serving in PLACEMENT_SERVING.items()},
    Serving.GATHER: Placement.HOST_COLD, Serving.ON_DEMAND: Placement.HOST_COLD}
SERVING_LOCATION: dict[Serving, Location] = {
    Serving.RESIDENT: Location.DEVICE, Serving.GATHER: Location.HOST, Serving.ON_DEMAND: Location.HOST,
    Serving.PREFETCH: Location.HOST, Serving.UVA: Location.HOST, Serving.COMPUTE: Location.HOST,
    Serving.NONE: Location.ABSENT}

HOST_PLACEMENTS = (Placement.HOST_COLD, Placement.HOST_HOT, Placement.HOST_UVA, Placement.HOST_COMPUTE)
#: Kinds of group that belong to one decoder layer (and carry its ``layer_index``).
LAYER_KINDS = (GroupKind.LAYER, GroupKind.EXPERTS, GroupKind.MLP)
#: Kinds the prefetch offloader copies with their layer (a host-compute MLP is never copied).
PREFETCH_KINDS = (GroupKind.LAYER, GroupKind.EXPERTS)

# Per-kind rules, as tables, so a new kind (or placement) states its rules in one place.
#: Kinds whose groups carry a ``layer_index`` (the decoder layer their name is in).
LAYER_INDEX_KINDS: frozenset[GroupKind] = frozenset(LAYER_KINDS)
#: Kinds whose role is fixed (a component's role depends on its name: see
#: :meth:`Plan.expected_role`).
KIND_ROLE: dict[GroupKind, Role] = {GroupKind.LAYER: Role.HOT, GroupKind.EXPERTS: Role.HOT,
                                    GroupKind.MLP: Role.HOT, GroupKind.MODULE: Role.HOT}
#: Placements allowed for each role, and the kinds a placement is limited to.
ROLE_PLACEMENTS: dict[Role, frozenset[Placement]] = {
    Role.COLD: frozenset({Placement.DEVICE, Placement.HOST_COLD}),
    Role.HOT: frozenset({Placement.DEVICE, Placement.HOST_HOT, Placement.HOST_UVA, Placement.HOST_COMPUTE}),
    Role.ABSENT: frozenset({Placement.ABSENT}),
}
PLACEMENT_KINDS: dict[Placement, frozenset[GroupKind]] = {
    Placement.HOST_HOT: frozenset(PREFETCH_KINDS),
    Placement.HOST_UVA: frozenset({GroupKind.EXPERTS}),
    # A module served compute is the LM head, its vocabulary rows split between the GPU and
    # the CPU (``checks.check_group`` holds it to that).
    Placement.HOST_COMPUTE: frozenset({GroupKind.EXPERTS, GroupKind.MLP, GroupKind.MODULE})}
#: Kinds that exist only under one placement: a dense layer's MLP is a group of its own only
#: when it is computed on the host (elsewhere it stays in its layer's group).
KIND_ONLY_PLACEMENT: dict[GroupKind, Placement] = {GroupKind.MLP: Placement.HOST_COMPUTE}
#: Kinds of hot groups a decode step reads only in part (their ``est_read_bytes_per_step``
#: is bounded by their bytes, not equal to them). Every other hot group is read in full.
PARTIAL_READ_KINDS: frozenset[GroupKind] = frozenset({GroupKind.EXPERTS})
