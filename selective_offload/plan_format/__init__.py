"""The plan as a contract: typed, validated when read, and consistent with itself.

A plan is what ``selective-offload plan -o plan.json`` writes and what
``selective_offload.enable()`` applies. Users edit plans by hand, and plans travel
between machines and releases, so reading one is a validation, not a deserialisation:
every field is checked for its type and range, roles, kinds, locations, servings and
the strategy are enums, and everything that can be derived from the groups (totals, the
deficit, the shortfall, each group's role, serving (gather or on-demand), MTP flag and
reads, the strategy, the hot layers) is derived, and a stated value that disagrees is an error. What the plan alone
can only bound (the prefetch buffers, the tower transient) is bounded here and compared
exactly against the checkpoint by :mod:`selective_offload.model_match`. The groups must
hold every byte of the model: a byte in no group would be placed by no one and counted
nowhere. A ``Plan`` object is checked by the same reader (:meth:`Plan.checked`). A plan
that would be silently misapplied is refused with one line naming the field and the fix.

The package, bottom up (each module imports only those above it in this list):

- :mod:`.vocabulary`: the format's name and versions, the enums, the per-kind rule tables.
- :mod:`.inputs`: :class:`PlanInputs`, what a plan is made for, and its own validation.
- :mod:`.parts`: the records a plan holds (groups, estimates, baselines, the model).
- :mod:`.contents`: the plan's fields and everything derived from its groups.
- :mod:`.checks`: stated against derived; refusals in one line.
- :mod:`.io`: JSON in (bounded; a plan of another format version refused) and out.
- :mod:`.document`: :class:`Plan`, the contents with the checks and the I/O as methods.

The words (format v5): each group has a ``kind`` (``layer``, ``experts``, ``component``:
a whole embedding, tower, projector or MTP head, ``module``), a ``role`` (``hot``: read
every decode step; ``cold``: not read by one, or one row per token; ``absent``: not
loaded), a ``location`` (``device``, ``host``, ``absent``) and a ``serving`` (``resident``;
``gather``: a host embedding's rows gathered on the host; ``on-demand``: a host component
onloaded block by block when it runs; ``prefetch``: vLLM's prefetch offloader; ``uva``:
routed experts read in place; ``compute``: routed experts computed where they live by the host
CPU, up to the plan's crossover; ``none``). The code speaks the same words: a group holds
its serving, its location follows from it, and a cold group kept on the host is gathered or
onloaded on demand by one rule (:func:`.parts.cold_serving`). vLLM's own offload is priced under its settings'
names (``vllm_cpu_offload_gb``,
``vllm_cpu_offload_params``). A plan of an older format is refused: plan again.

Derived totals are written under ``"totals"`` for readers and, when present, checked on
reading (an edited group with stale totals is caught); delete ``"totals"`` to accept the
groups as they are. Estimates are written for readers and recomputed on reading.
"""

from .document import Plan
from .inputs import PlanInputs
from .parts import (
    EST_IGNORES,
    EST_MODEL,
    Alternative,
    Estimate,
    GroupPlan,
    HostCompute,
    PlannedModel,
    VllmBaseline,
    cold_serving,
    experts_read_bytes,
    read_flops,
)
from .vocabulary import (
    COLD_SERVINGS,
    DEFAULT_RESERVE_BYTES,
    HOST_SERVINGS,
    LAYER_KINDS,
    MAX_PLAN_INT,
    PLAN_FORMAT,
    PREFETCH_KINDS,
    REFERENCE_LINK_GBPS,
    REFERENCE_VRAM_GBPS,
    REPLAN,
    GroupKind,
    Location,
    Role,
    Serving,
    Strategy,
)

__all__ = [
    "Alternative", "COLD_SERVINGS", "DEFAULT_RESERVE_BYTES", "EST_IGNORES", "EST_MODEL", "Estimate", "GroupKind",
    "GroupPlan", "HOST_SERVINGS", "HostCompute", "LAYER_KINDS", "Location", "MAX_PLAN_INT", "PLAN_FORMAT",
    "PREFETCH_KINDS", "Plan", "PlanInputs", "PlannedModel", "REFERENCE_LINK_GBPS", "REFERENCE_VRAM_GBPS", "REPLAN",
    "Role", "Serving", "Strategy", "VllmBaseline", "cold_serving", "experts_read_bytes", "read_flops",
]
