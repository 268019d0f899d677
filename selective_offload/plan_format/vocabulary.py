"""The plan contract's words: the format's name, the enums a plan's fields take, and the
per-kind rules as tables.

Everything else in :mod:`selective_offload.plan_format` speaks these words: the records
(:mod:`.inputs`, :mod:`.parts`, :mod:`.contents`) hold them, :mod:`.checks` applies the
tables, :mod:`.io` reads and writes them. A group is where it lives (:class:`Location`) and
how a decode step gets it (:class:`Serving`); the serving says the location
(:data:`SERVING_LOCATION`), so a group holds its serving and derives its location. The
rules that depend on a group's kind or role are tables (``KIND_ROLE``, ``ROLE_SERVINGS``,
``SERVING_KINDS``, ``LAYER_INDEX_KINDS``, ``PARTIAL_READ_KINDS``), so a new kind (or
serving) states its rules here, in one place. This module imports nothing of the project but sizes.
"""

from __future__ import annotations

from enum import Enum

from ..sizes import MAX_BYTES, GiB

FORMAT_PREFIX = "selective-offload/plan-v"
#: The format this release writes and the only one it reads (an older plan is made again).
FORMAT_VERSION = 5
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
#: The tokens of the largest step vLLM runs, for which its fused-MoE workspace is priced, when
#: the plan is not told (est): vLLM 0.33's ``max_num_batched_tokens`` for ``vllm serve`` on a
#: card under 70 GiB (``engine/arg_utils.py:2996-3002``); its profile run is a step of that
#: many tokens. The ``LLM`` class and ``vllm serve`` on a card of 70 GiB or more default to
#: 8192: a plan's serve command passes the figure it priced, and the worker's pre-flight
#: prices the workspace again at the engine's own figure.
ASSUMED_BATCHED_TOKENS = 2048
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


#: Where each serving keeps a group's bytes during decode.
SERVING_LOCATION: dict[Serving, Location] = {
    Serving.RESIDENT: Location.DEVICE, Serving.GATHER: Location.HOST, Serving.ON_DEMAND: Location.HOST,
    Serving.PREFETCH: Location.HOST, Serving.UVA: Location.HOST, Serving.COMPUTE: Location.HOST,
    Serving.NONE: Location.ABSENT}

#: Servings of a cold group on the host: gathered row by row (an embedding or table) or
#: onloaded block by block when run (a tower, projector or other component); which one
#: follows from the group (:func:`~.parts.cold_serving`).
COLD_SERVINGS = frozenset({Serving.GATHER, Serving.ON_DEMAND})
#: Servings that keep a group's bytes in host memory.
HOST_SERVINGS = frozenset(s for s, where in SERVING_LOCATION.items() if where == Location.HOST)
#: Kinds of group that belong to one decoder layer (and carry its ``layer_index``).
LAYER_KINDS = (GroupKind.LAYER, GroupKind.EXPERTS, GroupKind.MLP)
#: Kinds the prefetch offloader copies with their layer (a host-compute MLP is never copied).
PREFETCH_KINDS = (GroupKind.LAYER, GroupKind.EXPERTS)

# Per-kind rules, as tables, so a new kind (or serving) states its rules in one place.
#: Kinds whose groups carry a ``layer_index`` (the decoder layer their name is in).
LAYER_INDEX_KINDS: frozenset[GroupKind] = frozenset(LAYER_KINDS)
#: Kinds whose role is fixed (a component's role depends on its name: see
#: :meth:`Plan.expected_role`).
KIND_ROLE: dict[GroupKind, Role] = {GroupKind.LAYER: Role.HOT, GroupKind.EXPERTS: Role.HOT,
                                    GroupKind.MLP: Role.HOT, GroupKind.MODULE: Role.HOT}
#: Servings allowed for each role, and the kinds a serving is limited to.
ROLE_SERVINGS: dict[Role, frozenset[Serving]] = {
    Role.COLD: frozenset({Serving.RESIDENT, *COLD_SERVINGS}),
    Role.HOT: frozenset({Serving.RESIDENT, Serving.PREFETCH, Serving.UVA, Serving.COMPUTE}),
    Role.ABSENT: frozenset({Serving.NONE}),
}
SERVING_KINDS: dict[Serving, frozenset[GroupKind]] = {
    Serving.PREFETCH: frozenset(PREFETCH_KINDS),
    Serving.UVA: frozenset({GroupKind.EXPERTS}),
    # A module served compute is the LM head, its vocabulary rows split between the GPU and
    # the CPU (``checks.check_group`` holds it to that).
    Serving.COMPUTE: frozenset({GroupKind.EXPERTS, GroupKind.MLP, GroupKind.MODULE})}
#: Kinds that exist only under one serving: a dense layer's MLP is a group of its own only
#: when it is computed on the host (elsewhere it stays in its layer's group).
KIND_ONLY_SERVING: dict[GroupKind, Serving] = {GroupKind.MLP: Serving.COMPUTE}
#: Kinds of hot groups a decode step reads only in part (their ``est_read_bytes_per_step``
#: is bounded by their bytes, not equal to them). Every other hot group is read in full.
PARTIAL_READ_KINDS: frozenset[GroupKind] = frozenset({GroupKind.EXPERTS})
