"""The plan as a contract: typed, validated when read, and consistent with itself.

A plan is what ``selective-offload plan -o plan.json`` writes and what
``selective_offload.enable()`` applies. Users edit plans by hand, and plans travel
between machines and releases, so reading one is a validation, not a deserialisation:
every field is checked for its type and range, placements, classes, kinds and the
strategy are enums, and everything that can be derived from the groups (totals, the
deficit, the shortfall, each group's class, MTP flag and reads, the strategy, the hot
layers) is derived, and a stated value that disagrees is an error. What the plan alone
can only bound (the prefetch buffers, the tower transient) is bounded here and compared
exactly against the checkpoint by :mod:`.model_match`. The groups must hold every byte of
the model: a byte in no group would be placed by no one and counted nowhere. The rules
that depend on a group's kind or class are tables (``KIND_CLASS``, ``CLASS_PLACEMENTS``,
``PLACEMENT_KINDS``, ``LAYER_INDEX_KINDS``, ``PARTIAL_READ_KINDS``), so a new kind states
its rules in one place.
A ``Plan`` object is checked by the same reader (:meth:`Plan.checked`). A plan that would
be silently misapplied is refused with one line naming the field and the fix.

The JSON format (``"format": "selective-offload/plan-v3"``) is documented in the README.
v3 adds the routed experts of a MoE layer as a group of their own (kind ``experts``, with
``num_experts`` and ``experts_per_token``) and the placement ``host-uva``; v2 and v1 plans
are still read (they have no expert groups: a MoE layer is one group).
Derived totals are written under ``"totals"`` for readers and, when present, checked on
reading (an edited group with stale totals is caught); delete ``"totals"`` to accept the
groups as they are. Estimates (``"est"``, each group's ``est_link/vram_bytes_per_step``)
are written for readers and recomputed on reading. Fields this version does not know are
ignored with a note; a newer format version is refused with "upgrade or re-plan".
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import MISSING, dataclass, field, fields
from enum import Enum
from pathlib import Path
from typing import Any, Mapping

from . import jsonio
from .errors import PlanError
from .jsonio import FieldReader
from .estimate import (
    DEFAULT_ACCEPT_RATE,
    DEFAULT_UVA_READ_FACTOR,
    decode_read_rate,
    EXPERTS_DEVICE,
    EXPERTS_PREFETCHED,
    EXPERTS_UVA,
    KV_DTYPE_BYTES,
    ExpertsRead,
    KvModel,
    StepSettings,
    Traffic,
    expert_read_fraction,
    flops_per_token,
    step_cost,
)
from .names import (
    DEFAULT_COLD_SEGMENTS,
    EMBED_SEGMENTS,
    MTP_SEGMENTS,
    NEVER_COLD_SEGMENTS,
    cold_prefix,
    VLLM_HOST_TABLES,
    experts_prefix,
    has_segment,
    host_table_prefix,
    layer_of,
)
from .sizes import GB, MAX_BYTES, MAX_GBPS, MAX_TFLOPS, MIN_GBPS, GiB

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

EST_IGNORES: tuple[str, ...] = (
    "compute beyond a matmul's best rate: with --compute-tflops (or a probe of the GPU) a layer costs "
    "at least its FLOPs (2 per parameter per token, counted from stored bytes) at that rate; kernels "
    "that reach less at decode shapes (NVFP4 ran 4.7x slower than its bytes on the reference laptop) "
    "run slower than estimated, and without a rate compute is not priced at all",
    "attention compute, activations and sampling; KV reads are priced only with --max-model-len "
    "or --context, and spread evenly over the layers",
    "kernel launch, scheduling and Python overhead between kernels (the host gather's fixed host "
    "work per step among them)",
    "prefetch overlap: one slot ahead, copies and compute assumed not to slow each other (they "
    "share memory bandwidth); copies are priced at the pinned copy rate, which no published "
    "measurement of vLLM's prefetch offloader has checked",
    "UVA reads in kernels at one rate whatever the buffer size (0.86 of the copy rate unless probed; "
    "in-kernel host reads fall as buffers grow past GBs)",
    "VRAM read by decode kernels at one fraction of a datasheet or saturating-read rate (0.72 unless "
    "the probe measured decode reads or --decode-read-gbps gives them; published vLLM decode runs reach "
    "0.60-0.78 of a datasheet rate)",
    "speculative decoding: one acceptance rate for every draft position (measured accepted lengths fall "
    "1-11% below it at 2-4 drafts), and the drafts' KV",
    "routed experts (MoE): uniform routing assumed, a step of T tokens reading 1 - (1 - k/E)^T of a "
    "layer's expert bytes; real routers favour some experts, so at T > 1 fewer distinct experts are "
    "read than estimated",
)


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


# --------------------------------------------------------------------------- field reading


def _reader(data: Any, where: str, path: str = "") -> FieldReader:
    """The typed reader of one JSON object of a plan: its errors are :class:`PlanError`
    and say how to re-plan; integers and numbers are bounded as a plan's are."""
    return FieldReader(data, where, path, error=PlanError, fix=REPLAN, max_int=MAX_PLAN_INT,
                       max_number=MAX_PLAN_NUMBER)


def _int_list(value: Any, limit: int = MAX_PLAN_INT) -> bool:
    return isinstance(value, list) and all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i <= limit for i in value)


def format_version(data: Any, where: str) -> int:
    """The plan format version of ``data``, refusing what is not a plan or is too new."""
    fmt = data.get("format") if isinstance(data, Mapping) else None
    m = re.fullmatch(re.escape(FORMAT_PREFIX) + r"(\d+)", fmt) if isinstance(fmt, str) else None
    if m is None:
        raise PlanError(
            f"{where}: not a selective-offload plan (its \"format\" is {json.dumps(fmt)}, expected "
            f"\"{PLAN_FORMAT}\"); make one with `selective-offload plan MODEL --device-memory SIZE -o plan.json`"
        )
    version = int(m.group(1))
    if version > FORMAT_VERSION:
        raise PlanError(
            f"{where}: plan format v{version} is newer than this selective-offload (reads "
            f"v{OLDEST_READABLE_VERSION}..v{FORMAT_VERSION}): upgrade selective-offload or re-plan with this one"
        )
    if version < OLDEST_READABLE_VERSION:
        raise PlanError(f"{where}: plan format v{version} is too old for this selective-offload "
                        f"(reads v{OLDEST_READABLE_VERSION}..v{FORMAT_VERSION}); {REPLAN}")
    return version


# --------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class PlanInputs:
    """What the plan is made for. Bytes are bytes; bandwidths are decimal GB/s."""

    device_memory_bytes: int
    kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES
    #: CUDA context, activations, CUDA graphs and allocator slack.
    reserve_bytes: int = DEFAULT_RESERVE_BYTES
    link_gbps: float = REFERENCE_LINK_GBPS
    vram_gbps: float = REFERENCE_VRAM_GBPS
    #: ``None``, or ``"mtp"`` for MTP speculative decoding (loads the ``mtp.*`` head).
    speculative: str | None = None
    cold_segments: tuple[str, ...] = DEFAULT_COLD_SEGMENTS
    #: Device slots the prefetch offloader keeps per offloaded parameter.
    prefetch_step: int = 1
    #: vLLM's ``cpu_offload_gb`` (GiB) to price the bulk baseline at; ``None`` picks the
    #: smallest whole number that covers the deficit.
    bulk_cpu_offload_gb: float | None = None
    #: Put every cold module on the host even when fewer would close the deficit: cold
    #: bytes cost (almost) no link time, and what they free goes to the KV cache.
    all_cold: bool = False
    #: Host memory (RAM) the host bytes must fit in; ``None``: not checked.
    host_memory_bytes: int | None = None
    #: Concurrent decode sequences a step serves (they share one pass over the weights).
    batch: int = 1
    #: Draft tokens per step with speculative decoding; ``None``: the MTP head's layer count.
    spec_tokens: int | None = None
    #: Per-token acceptance rate of the drafts; ``None``: the published rate of the model's
    #: family (``estimate.acceptance_default``), which planning fills in.
    accept_rate: float | None = None
    #: With both, the KV cache is sized from the model (replacing ``kv_cache_bytes``).
    max_model_len: int | None = None
    max_seqs: int | None = None
    kv_cache_dtype: str = "auto"
    #: Average context of a sequence during decode, for KV reads per step; ``None``: half
    #: of ``max_model_len`` when given, else KV reads are not priced.
    context_tokens: int | None = None
    #: Kernels reading host memory in place through UVA (bulk ``cpu_offload_gb``, the UVA
    #: embedding, experts read in place), GB/s; ``None``: ``link_gbps`` x
    #: ``estimate.DEFAULT_UVA_READ_FACTOR`` (see :attr:`uva_read_gbps`).
    uva_gbps: float | None = None
    #: The card's dense matmul rate for the weights' format (TFLOP/s), so a layer costs at
    #: least its FLOPs; ``None``: compute is not priced (the plan says so).
    compute_tflops: float | None = None
    #: The rate decode kernels read VRAM at, measured the way decode reads (the probe's
    #: matrix-vector product, ``--decode-read-gbps``), GB/s; ``None``: ``vram_gbps`` (a
    #: datasheet or saturating-read figure) x ``estimate.DEFAULT_DECODE_READ_FACTOR``.
    decode_read_gbps: float | None = None

    @property
    def weight_budget_bytes(self) -> int:
        return self.device_memory_bytes - self.kv_cache_bytes - self.reserve_bytes

    @property
    def uva_read_gbps(self) -> float:
        """The UVA read rate the step model uses: given, else a published fraction of the link."""
        return self.uva_gbps if self.uva_gbps is not None else self.link_gbps * DEFAULT_UVA_READ_FACTOR

    @property
    def vram_read_gbps(self) -> float:
        """The VRAM rate the step model uses: decode reads measured, else a fraction of ``vram_gbps``."""
        return decode_read_rate(self.vram_gbps, self.decode_read_gbps)

    @property
    def context(self) -> int:
        """Tokens of context each sequence's KV read covers in a step (0: not priced)."""
        if self.context_tokens is not None:
            return self.context_tokens
        return self.max_model_len // 2 if self.max_model_len else 0

    def validate(self) -> None:
        self._check_types()
        if self.device_memory_bytes <= 0:
            raise PlanError("device memory must be more than 0 bytes; give it like --device-memory 24GiB")
        for label, value in (("link", self.link_gbps), ("VRAM", self.vram_gbps), ("UVA read", self.uva_gbps),
                             ("decode read", self.decode_read_gbps)):
            if value is None and label in ("UVA read", "decode read"):
                continue  # derived from the link / VRAM rate by their default factors
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not MIN_GBPS <= value <= MAX_GBPS:
                raise PlanError(f"{label} bandwidth {value!r} GB/s must be a number from {MIN_GBPS:g} to "
                                f"{MAX_GBPS:g} GB/s, like 13.9")
        tflops = self.compute_tflops
        if tflops is not None and (isinstance(tflops, bool) or not isinstance(tflops, (int, float))
                                   or not 0 < tflops <= MAX_TFLOPS):
            raise PlanError(f"compute rate {tflops!r} TFLOP/s must be a positive number of at most {MAX_TFLOPS:g}")
        if self.kv_cache_bytes < 0 or self.reserve_bytes < 0:
            raise PlanError("KV cache and reserve sizes must be zero or more bytes")
        if self.weight_budget_bytes <= 0:
            raise PlanError(
                f"KV cache ({self.kv_cache_bytes / GiB:.2f} GiB) and reserve ({self.reserve_bytes / GiB:.2f} GiB) "
                f"leave nothing of {self.device_memory_bytes / GiB:.2f} GiB of device memory for weights; "
                "lower --kv-cache or --reserve, or give the card's real memory"
            )
        if self.speculative not in (None, "mtp"):
            raise PlanError(f"speculative decoding {self.speculative!r} is not planned for; use 'mtp' or none")
        if self.prefetch_step < 1:
            raise PlanError(f"prefetch step {self.prefetch_step} must be 1 or more")
        if self.bulk_cpu_offload_gb is not None and not (
            self.bulk_cpu_offload_gb >= 0 and math.isfinite(self.bulk_cpu_offload_gb)
        ):
            raise PlanError(f"bulk cpu_offload_gb {self.bulk_cpu_offload_gb!r} must be 0 or more")
        if not self.cold_segments:
            raise PlanError("the cold segment list is empty; give at least one segment, or plan without offload")
        if self.batch < 1:
            raise PlanError(f"batch {self.batch} must be 1 or more concurrent sequences")
        if self.spec_tokens is not None and not 1 <= self.spec_tokens <= 16:
            raise PlanError(f"speculative draft tokens {self.spec_tokens} must be between 1 and 16, like mtp:2")
        if self.accept_rate is not None and not 0.0 <= self.accept_rate <= 1.0:
            raise PlanError(f"acceptance rate {self.accept_rate!r} must be between 0 and 1, like 0.85")
        for label, value in (("max model length", self.max_model_len), ("max sequences", self.max_seqs),
                             ("context tokens", self.context_tokens)):
            if value is not None and value < (0 if label == "context tokens" else 1):
                raise PlanError(f"{label} {value} must be a positive number of tokens or sequences")
        if self.kv_cache_dtype not in KV_DTYPE_BYTES:
            raise PlanError(f"KV cache dtype {self.kv_cache_dtype!r}: use one of {', '.join(KV_DTYPE_BYTES)}")
        if self.host_memory_bytes is not None and self.host_memory_bytes <= 0:
            raise PlanError(f"host memory {self.host_memory_bytes} must be more than 0 bytes, like --host-memory 64GiB")
        bad = [s for s in self.cold_segments if not s or "." in s]
        if bad:
            raise PlanError(f"cold segment {bad[0]!r} must be one name segment without dots, like visual")

    def _check_types(self) -> None:
        """Every integer field an integer in range, every number finite: a Plan built in
        Python gets the checks a plan file gets from its reader."""
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None or f.name in ("link_gbps", "vram_gbps"):
                continue
            if f.type in ("int", "int | None"):
                if isinstance(value, bool) or not isinstance(value, int) or abs(value) > MAX_PLAN_INT:
                    raise PlanError(f"{f.name} {value!r} must be an integer of at most {MAX_PLAN_INT}")
            elif f.type in ("float", "float | None"):
                if (isinstance(value, bool) or not isinstance(value, (int, float))
                        or not jsonio.finite_number(value, MAX_PLAN_NUMBER)):
                    raise PlanError(f"{f.name} {value!r} must be a finite number")
            elif f.type == "bool" and not isinstance(value, bool):
                raise PlanError(f"{f.name} {value!r} must be True or False")
            elif f.type == "str" and not isinstance(value, str):
                raise PlanError(f"{f.name} {value!r} must be a string")
        if not isinstance(self.cold_segments, (tuple, list)) or not all(isinstance(s, str) for s in self.cold_segments):
            raise PlanError(f"cold_segments {self.cold_segments!r} must be a list of name segments")

    def to_dict(self) -> dict[str, Any]:
        return {f.name: (list(v) if isinstance(v := getattr(self, f.name), tuple) else v) for f in fields(self)}

    @classmethod
    def read(cls, r: FieldReader) -> tuple["PlanInputs", list[str]]:
        speculative = r.raw("speculative", None)
        if speculative not in (None, "mtp"):
            r.bad("speculative", speculative, "null or \"mtp\"")
        inputs = cls(
            device_memory_bytes=r.int("device_memory_bytes", minimum=1),
            kv_cache_bytes=r.int("kv_cache_bytes"),
            reserve_bytes=r.int("reserve_bytes"),
            link_gbps=r.number("link_gbps", positive=True),
            vram_gbps=r.number("vram_gbps", positive=True),
            speculative=speculative,
            cold_segments=r.str_list("cold_segments"),
            prefetch_step=r.int("prefetch_step", minimum=1),
            bulk_cpu_offload_gb=r.number("bulk_cpu_offload_gb", positive=False, default=None),
            all_cold=r.bool("all_cold", default=False),
            host_memory_bytes=r.int("host_memory_bytes", minimum=1, default=None),
            batch=r.int("batch", minimum=1, default=1),
            spec_tokens=r.int("spec_tokens", minimum=1, default=None),
            accept_rate=r.number("accept_rate", positive=False, default=DEFAULT_ACCEPT_RATE),
            max_model_len=r.int("max_model_len", minimum=1, default=None),
            max_seqs=r.int("max_seqs", minimum=1, default=None),
            kv_cache_dtype=r.str("kv_cache_dtype", default="auto"),
            context_tokens=r.int("context_tokens", default=None),
            uva_gbps=r.number("uva_gbps", positive=True, default=None),
            compute_tflops=r.number("compute_tflops", positive=True, default=None),
            decode_read_gbps=r.number("decode_read_gbps", positive=True, default=None),
        )
        try:
            inputs.validate()
        except PlanError as exc:
            raise PlanError(f"{r.where}: inputs: {exc}") from None
        return inputs, r.unknown()


# --------------------------------------------------------------------------- groups


@dataclass(frozen=True)
class GroupPlan:
    """One group's class, placement and what identifies its tensors."""

    group: str
    kind: GroupKind
    cls: GroupClass
    placement: Placement
    reason: str
    bytes: int
    layer_index: int | None
    #: Bytes a decode step reads from this group at batch 1 (est): all of a layer, one row
    #: of an embedding, nothing of a tower, k/E of a layer's routed experts.
    est_read_bytes_per_step: int
    mtp: bool = False
    #: What the model check compares (rename-proof: names are relative to the group).
    num_tensors: int = 0
    dtype_bytes: Mapping[str, int] = field(default_factory=dict)
    shapes_digest: str | None = None
    #: Routed experts of the layer (E) and experts per token (k); 0 for every other kind.
    num_experts: int = 0
    experts_per_token: int = 0

    @property
    def on_host(self) -> bool:
        return self.placement in HOST_PLACEMENTS

    @property
    def est_link_bytes_per_step(self) -> int:
        """Bytes that cross the link per step at batch 1 (est): a prefetched layer whole
        (experts included), a cold group's reads, the routed experts read through UVA."""
        if self.placement == Placement.HOST_HOT:
            return self.bytes
        return self.est_read_bytes_per_step if self.on_host else 0

    @property
    def est_vram_bytes_per_step(self) -> int:
        """Device memory reads per step (est); a prefetched layer is read from its buffer too."""
        if self.placement in (Placement.DEVICE, Placement.HOST_HOT):
            return self.est_read_bytes_per_step
        return 0

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["dtype_bytes"] = dict(self.dtype_bytes)
        out["est_link_bytes_per_step"] = self.est_link_bytes_per_step
        out["est_vram_bytes_per_step"] = self.est_vram_bytes_per_step
        return out

    @classmethod
    def read(cls, r: FieldReader, version: int) -> tuple["GroupPlan", list[str]]:
        name = r.str("group", nonempty=True)
        r.context = f"group {name}"
        kind = r.choice("kind", GroupKind)
        layer_index = r.int("layer_index", default=None)
        if (kind in LAYER_INDEX_KINDS) != (layer_index is not None):
            r.fail(f"kind is {kind} but layer_index is {json.dumps(layer_index)}; a group of kind "
                   f"{' or '.join(sorted(LAYER_INDEX_KINDS))}, and only such a group, has a layer_index")
        if version == 1:
            # v1 wrote the per-step reads split by where they land; one of the two is the read.
            r.seen.update({"est_link_bytes_per_step", "est_vram_bytes_per_step"})
            read = r.int("est_link_bytes_per_step") + r.int("est_vram_bytes_per_step")
        else:
            r.seen.update({"est_link_bytes_per_step", "est_vram_bytes_per_step"})  # derived
            read = r.int("est_read_bytes_per_step")
        dtype_bytes = r.raw("dtype_bytes", {})
        if not isinstance(dtype_bytes, Mapping) or not all(
                isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 0
                for k, v in dtype_bytes.items()):
            r.bad("dtype_bytes", dtype_bytes, "an object of dtype -> bytes (integers >= 0)")
        digest = r.raw("shapes_digest", None)
        if digest is not None and not isinstance(digest, str):
            r.bad("shapes_digest", digest, "a string or null")
        group = cls(
            group=name, kind=kind, cls=r.choice("cls", GroupClass), placement=r.choice("placement", Placement),
            reason=r.str("reason", default=""), bytes=r.int("bytes"), layer_index=layer_index,
            est_read_bytes_per_step=read, mtp=r.bool("mtp", default=False),
            num_tensors=r.int("num_tensors", default=0), dtype_bytes=dict(dtype_bytes), shapes_digest=digest,
            num_experts=r.int("num_experts", default=0), experts_per_token=r.int("experts_per_token", default=0),
        )
        return group, r.unknown()

    def check(self, where: str) -> None:
        """Class, kind and placement must agree, the name must be the layer its index says;
        raise naming the group otherwise."""
        problem = None
        kinds = PLACEMENT_KINDS.get(self.placement)
        layer = layer_of(self.group)
        if self.placement not in CLASS_PLACEMENTS[self.cls]:
            allowed = ", ".join(sorted(CLASS_PLACEMENTS[self.cls]))
            problem = f"a group of class {self.cls} cannot be placed {self.placement} (only {allowed})"
        elif kinds is not None and self.kind not in kinds:
            problem = (f"placement {self.placement} is for groups of kind {' or '.join(sorted(kinds))}, "
                       f"and this one is {self.kind}")
        elif self.kind == GroupKind.EXPERTS and not 1 <= self.experts_per_token <= self.num_experts:
            problem = (f"routed experts need 1 <= experts_per_token <= num_experts, and these are "
                       f"{self.experts_per_token} of {self.num_experts}")
        elif self.kind != GroupKind.EXPERTS and (self.num_experts or self.experts_per_token):
            problem = f"num_experts and experts_per_token are for kind experts only, and this one is {self.kind}"
        elif self.kind == GroupKind.EXPERTS and experts_prefix(f"{self.group}.weight") != self.group:
            problem = "a group of kind experts is the routed experts module of one layer, named like " \
                      "model.layers.N.mlp.experts"
        elif self.dtype_bytes and sum(self.dtype_bytes.values()) != self.bytes:
            problem = f"bytes {self.bytes} is not the sum of dtype_bytes ({sum(self.dtype_bytes.values())})"
        # mutation: layer-index-vs-name-unchecked
        elif self.layer_index is not None and (layer is None or layer[1] != self.layer_index):
            problem = (f"layer_index {self.layer_index} is not the layer its name is in "
                       f"({'no layers.N in the name' if layer is None else f'layer {layer[1]}'})")
        elif (self.kind in LAYER_INDEX_KINDS) != (self.layer_index is not None):
            problem = f"kind is {self.kind} but layer_index is {self.layer_index}"
        elif self.kind == GroupKind.LAYER and self.group != f"{layer[0]}.{layer[1]}":
            problem = f"a group of kind layer is one whole decoder layer, named like {layer[0]}.{layer[1]}"
        elif not 0 <= self.est_read_bytes_per_step <= self.bytes:
            problem = f"est_read_bytes_per_step {self.est_read_bytes_per_step} is more than its {self.bytes} bytes"
        if problem:
            raise PlanError(f"{where}: group {self.group}: {problem}; fix it or {REPLAN}")


# --------------------------------------------------------------------------- estimates

#: Where the step model reads a placed experts group from.
_EXPERTS_READ = {Placement.DEVICE: EXPERTS_DEVICE, Placement.HOST_HOT: EXPERTS_PREFETCHED,
                 Placement.HOST_UVA: EXPERTS_UVA}


def experts_read_bytes(nbytes: int, num_experts: int, experts_per_token: int, tokens: int = 1) -> int:
    """Bytes of a layer's routed experts that a step of ``tokens`` tokens reads (est)."""
    return round(nbytes * expert_read_fraction(num_experts, experts_per_token, tokens))



def _read_flops(dtype_bytes: Mapping[str, int], read_bytes: int, nbytes: int) -> float:
    """FLOPs per token of a module a step reads ``read_bytes`` of: its FLOPs in that share
    (a module read whole every step computes whole; one read a row at a time, nothing)."""
    return flops_per_token(dtype_bytes) * (read_bytes / nbytes) if nbytes and read_bytes else 0.0


@dataclass(frozen=True)
class Estimate:
    """One decode step, estimated (:mod:`selective_offload.estimate`): link and VRAM time,
    the link time the prefetch overlap hides, the drafts' time, the step, and tokens."""

    est_link_s_per_step: float
    est_vram_s_per_step: float
    est_step_s: float
    est_tok_s: float
    est_tokens_per_step: float = 1.0
    est_tok_s_per_seq: float = 0.0
    est_hidden_link_s_per_step: float = 0.0
    est_draft_s_per_step: float = 0.0
    #: The step's FLOPs over the matmul rate (0 when no rate was given: not priced).
    est_compute_s_per_step: float = 0.0

    @classmethod
    def of(cls, traffic: Traffic, inputs: "PlanInputs", kv: KvModel | None, spec_tokens: int,
           *, pipelined: bool) -> "Estimate":
        accept = inputs.accept_rate if inputs.accept_rate is not None else DEFAULT_ACCEPT_RATE
        settings = StepSettings(inputs.link_gbps, inputs.vram_gbps, inputs.batch, spec_tokens,
                                accept, inputs.context, inputs.uva_read_gbps, inputs.compute_tflops,
                                inputs.decode_read_gbps)
        return cls(**step_cost(traffic, settings, kv, pipelined=pipelined))

    @classmethod
    def read(cls, r: FieldReader) -> "Estimate":
        values = {}
        for f in fields(cls):
            value = r.raw(f.name, f.default if f.default is not MISSING else ...)
            if (isinstance(value, bool) or not isinstance(value, (int, float))
                    or not jsonio.finite_number(value, MAX_PLAN_NUMBER) or value < 0):
                r.bad(f.name, value, f"a finite number >= 0 and at most {MAX_PLAN_NUMBER:g}")
            values[f.name] = float(value)
        return cls(**values)


@dataclass(frozen=True)
class BulkBaseline:
    """vLLM's own ``cpu_offload_gb``: parameters of the layer stack, in model order (with
    ``cpu_offload_params``, only those whose names hold one of its segments)."""

    cpu_offload_gb: float
    offloaded_bytes: int
    offloaded_tensors: int
    #: Decoder layers with at least one parameter on the host.
    layers_touched: tuple[int, ...]
    device_bytes: int
    fits: bool
    est: Estimate
    #: vLLM's ``cpu_offload_params`` (empty: every parameter is eligible).
    cpu_offload_params: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        """The vLLM setting, as a user would pass it."""
        return f"cpu_offload_gb={self.cpu_offload_gb:g}" + (
            f", cpu_offload_params={','.join(self.cpu_offload_params)}" if self.cpu_offload_params else "")

    def to_dict(self) -> dict[str, Any]:
        return {**{f.name: getattr(self, f.name) for f in fields(self)},
                "layers_touched": list(self.layers_touched), "est": self.est.__dict__.copy(),
                "cpu_offload_params": list(self.cpu_offload_params)}

    @classmethod
    def read(cls, r: FieldReader) -> "BulkBaseline":
        touched = r.raw("layers_touched")
        if not _int_list(touched):
            r.bad("layers_touched", touched, "a list of layer indices")
        return cls(cpu_offload_gb=r.number("cpu_offload_gb", positive=False), offloaded_bytes=r.int("offloaded_bytes"),
                   offloaded_tensors=r.int("offloaded_tensors"), layers_touched=tuple(touched),
                   device_bytes=r.int("device_bytes", minimum=None), fits=r.bool("fits"),
                   est=Estimate.read(r.child("est")),
                   cpu_offload_params=r.str_list("cpu_offload_params", default=[]))


# --------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class PlannedModel:
    """The model a plan was made for, and how it is recognised."""

    source: str
    #: ``safetensors`` (headers of a local checkpoint), ``hub`` (headers read from a hub id,
    #: which vLLM downloads), ``manifest``, or ``config`` (sizes estimated).
    kind: str
    architectures: tuple[str, ...]
    #: A hash of every tensor's name, dtype and shape (see :func:`planner.model_fingerprint`).
    fingerprint: str
    num_tensors: int
    total_bytes: int
    tie_word_embeddings: bool
    num_hidden_layers: int | None
    #: MTP layers the model declares (the default number of draft tokens).
    num_mtp_layers: int = 0
    #: KV-cache bytes per token and per sequence, from the config (None: unknown).
    kv: KvModel | None = None

    def to_dict(self) -> dict[str, Any]:
        return {**{f.name: getattr(self, f.name) for f in fields(self)}, "architectures": list(self.architectures),
                "kv": None if self.kv is None else self.kv.to_dict()}

    @classmethod
    def read(cls, r: FieldReader) -> tuple["PlannedModel", list[str]]:
        kv = r.raw("kv", None)
        if kv is not None:
            kr = r.child("kv")
            sliding = kr.raw("sliding", [])
            if not isinstance(sliding, list) or not all(_int_list(w) and len(w) == 2 for w in sliding):
                kr.bad("sliding", sliding, "a list of [window, bytes per token] pairs")
            kv = KvModel(kr.int("full_bytes_per_token", default=0), tuple(tuple(w) for w in sliding),
                         kr.int("fixed_bytes_per_seq", default=0), kr.str("description", default=""))
        model = cls(source=r.str("source"), kind=r.str("kind", default="safetensors"),
                    architectures=r.str_list("architectures", default=[]),
                    fingerprint=r.str("fingerprint", nonempty=True), num_tensors=r.int("num_tensors"),
                    total_bytes=r.int("total_bytes"), tie_word_embeddings=r.bool("tie_word_embeddings"),
                    num_hidden_layers=r.int("num_hidden_layers", default=None),
                    num_mtp_layers=r.int("num_mtp_layers", default=0),
                    kv=kv)
        return model, r.unknown()


#: Totals derived from the groups, written under "totals" and checked when read.
TOTALS = ("device_bytes", "host_cold_bytes", "host_hot_bytes", "host_uva_bytes", "absent_bytes", "cold_bytes",
          "weight_budget_bytes", "deficit_bytes", "shortfall_bytes", "host_shortfall_bytes")


@dataclass(frozen=True)
class Alternative:
    """Another placement priced on the same input (with or without speculative decoding)."""

    label: str
    strategy: Strategy
    host_cold_bytes: int
    host_hot_bytes: int
    hot_layer_indices: tuple[int, ...]
    est: Estimate
    host_uva_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {**{f.name: getattr(self, f.name) for f in fields(self)},
                "hot_layer_indices": list(self.hot_layer_indices), "est": self.est.__dict__.copy()}

    @classmethod
    def read(cls, r: FieldReader) -> "Alternative":
        hot = r.raw("hot_layer_indices")
        if not _int_list(hot):
            r.bad("hot_layer_indices", hot, "a list of layer indices")
        return cls(label=r.str("label"), strategy=r.choice("strategy", Strategy),
                   host_cold_bytes=r.int("host_cold_bytes"), host_hot_bytes=r.int("host_hot_bytes"),
                   hot_layer_indices=tuple(hot), est=Estimate.read(r.child("est")),
                   host_uva_bytes=r.int("host_uva_bytes", default=0))


@dataclass(frozen=True)
class Plan:
    model: PlannedModel
    inputs: PlanInputs
    strategy: Strategy
    groups: tuple[GroupPlan, ...]
    hot_layer_indices: tuple[int, ...]
    #: Device memory an on-demand tower holds while it runs (est: two blocks and the rest).
    est_transient_device_bytes: int
    bulk: BulkBaseline | None
    est_ignores: tuple[str, ...] = EST_IGNORES
    notes: tuple[str, ...] = ()
    #: Device bytes of vLLM's prefetch buffers (``prefetch_step`` slots of every parameter
    #: name the offloaded layers have, each as large as its largest); ``None``: derived as
    #: ``prefetch_step`` slots of the largest layer (plans before this field).
    stored_prefetch_buffer_bytes: int | None = None
    #: With speculative decoding asked for: the same input planned without it, to compare.
    alternative: Alternative | None = None
    #: MoE: vLLM's ``cpu_offload_gb`` with ``cpu_offload_params=experts`` (only routed experts).
    bulk_segments: BulkBaseline | None = None
    #: Notes from reading the plan (ignored unknown fields); not written back.
    load_notes: tuple[str, ...] = field(default=(), compare=False)

    # ---- derived from the groups (never stored as the truth)
    def _sum(self, placement: Placement) -> int:
        return sum(g.bytes for g in self.groups if g.placement == placement)

    @property
    def device_bytes(self) -> int:
        return self._sum(Placement.DEVICE)

    @property
    def host_cold_bytes(self) -> int:
        return self._sum(Placement.HOST_COLD)

    @property
    def host_hot_bytes(self) -> int:
        return self._sum(Placement.HOST_HOT)

    @property
    def host_uva_bytes(self) -> int:
        return self._sum(Placement.HOST_UVA)

    @property
    def absent_bytes(self) -> int:
        return self._sum(Placement.ABSENT)

    @property
    def host_bytes(self) -> int:
        """Every byte the plan puts in host memory: cold, hot layers and routed experts."""
        return self.host_cold_bytes + self.host_hot_bytes + self.host_uva_bytes

    @property
    def baselines(self) -> tuple[BulkBaseline, ...]:
        """vLLM's own offloads priced on the same input: bulk, then segment selection."""
        return tuple(b for b in (self.bulk, self.bulk_segments) if b is not None)

    @property
    def cold_bytes(self) -> int:
        return sum(g.bytes for g in self.groups if g.cls == GroupClass.COLD)

    @property
    def weight_budget_bytes(self) -> int:
        return self.inputs.weight_budget_bytes

    @property
    def deficit_bytes(self) -> int:
        """Bytes to load minus the weight budget (<= 0: everything fits on the device)."""
        return sum(g.bytes for g in self.groups if g.placement != Placement.ABSENT) - self.weight_budget_bytes

    @property
    def prefetch_buffer_bytes(self) -> int:
        """vLLM's prefetch offloader keeps ``prefetch_step`` device slots of every offloaded
        parameter name; in a uniform stack that is the largest layer per slot."""
        if not self.hot_layer_indices:
            return 0
        if self.stored_prefetch_buffer_bytes is not None:
            return self.stored_prefetch_buffer_bytes
        hot = set(self.hot_layer_indices)
        per_layer: dict[int, int] = {}
        for g in self.groups:
            if g.kind in LAYER_KINDS and g.layer_index in hot:  # a layer's experts are copied with it
                per_layer[g.layer_index] = per_layer.get(g.layer_index, 0) + g.bytes
        return self.inputs.prefetch_step * max(per_layer.values(), default=0)

    @property
    def shortfall_bytes(self) -> int:
        """Device memory missing for this placement (0 when it fits)."""
        need = self.device_bytes + self.est_transient_device_bytes + self.prefetch_buffer_bytes
        return max(0, need - self.weight_budget_bytes)

    @property
    def host_shortfall_bytes(self) -> int:
        """Host memory missing for the bytes placed on the host (0 when it fits, or unchecked)."""
        if self.inputs.host_memory_bytes is None:
            return 0
        return max(0, self.host_bytes - self.inputs.host_memory_bytes)

    @property
    def est(self) -> Estimate:
        """This placement's decode step (est): prefetch overlap, batch, drafts and KV priced."""
        return Estimate.of(self.traffic(), self.inputs, self.model.kv, self.spec_tokens, pipelined=True)

    @property
    def spec_tokens(self) -> int:
        """Draft tokens per step: 0 without speculative decoding."""
        if self.inputs.speculative != "mtp":
            return 0
        return self.inputs.spec_tokens or max(1, self.model.num_mtp_layers)

    def traffic(self) -> Traffic:
        """The bytes a decode pass of this placement reads, by where from."""
        stack = sorted((g for g in self.groups if g.kind == GroupKind.LAYER), key=lambda g: g.layer_index)
        layers = tuple((g.est_read_bytes_per_step, g.placement == Placement.HOST_HOT) for g in stack)
        position = {g.layer_index: i for i, g in enumerate(stack)}
        experts = tuple(
            ExpertsRead(position[g.layer_index], g.bytes, g.num_experts, g.experts_per_token, _EXPERTS_READ[g.placement],
                        flops_per_token(g.dtype_bytes) * expert_read_fraction(g.num_experts, g.experts_per_token, 1))
            for g in self.groups if g.kind == GroupKind.EXPERTS and g.layer_index in position)
        other = row_host = row_device = draft = 0
        other_flops = draft_flops = 0.0
        head = sum(g.est_read_bytes_per_step for g in self.groups
                   if has_segment(g.group, NEVER_COLD_SEGMENTS) and g.placement == Placement.DEVICE)
        for g in self.groups:
            if g.kind in LAYER_KINDS or g.placement == Placement.ABSENT:
                continue
            if g.mtp:
                draft += g.bytes
                draft_flops += flops_per_token(g.dtype_bytes)
            elif has_segment(g.group, EMBED_SEGMENTS) and g.cls == GroupClass.COLD:
                if g.placement == Placement.HOST_COLD:
                    row_host += g.est_read_bytes_per_step
                else:
                    row_device += g.est_read_bytes_per_step
            elif g.placement == Placement.DEVICE:
                other += g.est_read_bytes_per_step
                other_flops += _read_flops(g.dtype_bytes, g.est_read_bytes_per_step, g.bytes)
        head_flops = sum(flops_per_token(g.dtype_bytes) for g in self.groups
                         if has_segment(g.group, NEVER_COLD_SEGMENTS) and g.placement == Placement.DEVICE)
        speculating = bool(self.spec_tokens)
        return Traffic(layers, other, row_host, row_device, 0, (draft + head) if speculating else 0, experts,
                       tuple(flops_per_token(g.dtype_bytes) for g in stack), other_flops,
                       (draft_flops + head_flops) if speculating else 0.0)

    @property
    def host_cold_groups(self) -> list[str]:
        return [g.group for g in self.groups if g.placement == Placement.HOST_COLD]

    def placement_of(self, group: str) -> Placement | None:
        return next((g.placement for g in self.groups if g.group == group), None)

    def totals(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in TOTALS}

    # ---- consistency
    def validate(self, where: str = "plan") -> None:
        """Raise :class:`PlanError` (one line) when the plan contradicts itself: every
        derived quantity (class, MTP flag, coverage, hot layers, prefetch buffers, tower
        transient, strategy) is recomputed, and a stated value that disagrees is an error."""
        self.check_groups(where)
        self.check_derived(where)
        self.check_bulk(where)
        self.check_strategy(where)

    def check_groups(self, where: str = "plan") -> None:
        """Each group consistent in itself, unique, of the class its name and the inputs
        give it, inside the model; together they hold every tensor of the model."""
        self.inputs.validate()
        if not self.groups:
            raise PlanError(f"{where}: the plan has no groups; {REPLAN}")
        seen: set[str] = set()
        by_kind: dict[GroupKind, dict[int, GroupPlan]] = {kind: {} for kind in LAYER_KINDS}
        n_layers = self.model.num_hidden_layers
        for g in self.groups:
            if g.group in seen:
                raise PlanError(f"{where}: group {g.group} is listed twice; {REPLAN}")
            seen.add(g.group)
            g.check(where)
            self._check_never_cold(g, where)
            self._check_class(g, where)
            if g.kind not in LAYER_KINDS:
                continue
            if g.layer_index in by_kind[g.kind]:
                raise PlanError(f"{where}: group {g.group}: layer_index {g.layer_index} belongs to another "
                                f"{g.kind} group too; {REPLAN}")
            by_kind[g.kind][g.layer_index] = g
            if n_layers is not None and not 0 <= g.layer_index < n_layers:
                raise PlanError(f"{where}: group {g.group}: layer_index {g.layer_index} is outside the model's "
                                f"{n_layers} layers (0..{n_layers - 1}); {REPLAN}")
        self._check_experts_follow_layers(by_kind, where)
        self._check_coverage(where)
        hot = tuple(sorted(g.layer_index for g in self.groups
                           if g.placement == Placement.HOST_HOT and g.kind == GroupKind.LAYER))
        if tuple(self.hot_layer_indices) != hot:
            raise PlanError(f"{where}: hot_layer_indices {list(self.hot_layer_indices)} disagree with the groups "
                            f"placed host-hot (layers {list(hot)}); make them agree or {REPLAN}")

    @staticmethod
    def _check_experts_follow_layers(by_kind: Mapping[GroupKind, Mapping[int, GroupPlan]], where: str) -> None:
        """Routed experts belong to a decoder layer, and the prefetch offloader copies a layer
        whole, experts included: an experts group is host-hot exactly when its layer is."""
        layers = by_kind[GroupKind.LAYER]
        for index, e in by_kind[GroupKind.EXPERTS].items():
            layer = layers.get(index)
            if layer is None:
                raise PlanError(f"{where}: group {e.group}: routed experts of layer {index}, but no layer group "
                                f"has layer_index {index}; {REPLAN}")
            # mutation: experts-follow-layers-off
            if (e.placement == Placement.HOST_HOT) != (layer.placement == Placement.HOST_HOT):
                raise PlanError(
                    f"{where}: group {e.group} is {e.placement} but its layer {layer.group} is {layer.placement}; "
                    "the prefetch offloader copies a whole layer, experts included, so the experts are host-hot "
                    f"exactly when their layer is (else device or host-uva); make them agree or {REPLAN}")

    def _check_never_cold(self, g: GroupPlan, where: str) -> None:
        if g.cls != GroupClass.COLD:
            return
        if has_segment(g.group, NEVER_COLD_SEGMENTS):
            why = "the LM head is read in full every step and is never cold"
        elif self.model.tie_word_embeddings and has_segment(g.group, EMBED_SEGMENTS):
            why = ("the model ties its embedding to the LM head (tie_word_embeddings), so the embedding "
                   "is read in full every step: hot, on the device")
        else:
            return
        raise PlanError(f"{where}: group {g.group} is marked cold, but {why}; {REPLAN}")

    def _is_mtp_layer(self, group: str) -> bool:
        """A decoder layer past the model's last one, in a model that declares an MTP head
        (DeepSeek-V3 stores its MTP head so)."""
        layer, n = layer_of(group), self.model.num_hidden_layers
        return bool(self.model.num_mtp_layers and n is not None and layer is not None and layer[1] >= n)

    def _is_vllm_host_table(self, group: str) -> bool:
        """An n-gram / per-layer embedding table of a model whose vLLM class keeps such
        tables in host memory itself (:data:`names.VLLM_HOST_TABLES`)."""
        return (host_table_prefix(group) == group
                and any(a in VLLM_HOST_TABLES for a in self.model.architectures))

    def expected_class(self, g: GroupPlan) -> tuple[GroupClass, bool, str] | None:
        """The class and MTP flag the group's kind, name and the inputs give it (the
        planner's rule), and why; ``None`` for a group of kind cold whose name is not a
        cold module."""
        # mutation: host-tables-classed-hot
        if g.kind == GroupKind.MODULE and self._is_vllm_host_table(g.group):
            return GroupClass.COLD, False, "vLLM keeps this n-gram table in host memory itself and gathers rows"
        fixed = KIND_CLASS.get(g.kind)
        if fixed is not None:
            return fixed, False, f"a group of kind {g.kind} is read every step"
        prefix = cold_prefix(g.group, self.inputs.cold_segments)
        # mutation: cold-kind-any-name
        if prefix != g.group and not self._is_mtp_layer(g.group):
            return None
        if has_segment(g.group, MTP_SEGMENTS) if prefix == g.group else True:
            if self.inputs.speculative == "mtp":
                return GroupClass.HOT, True, "MTP speculative decoding runs the MTP head every step"
            return (GroupClass.ABSENT, True, "an MTP head is not loaded without MTP speculative decoding "
                    "(only an MTP head is ever absent: vLLM loads every other tensor)")
        if has_segment(g.group, EMBED_SEGMENTS) and self.model.tie_word_embeddings:
            return GroupClass.HOT, False, "the embedding is tied to the LM head"
        return GroupClass.COLD, False, "a decode step does not read it in full"

    def _check_class(self, g: GroupPlan, where: str) -> None:
        expected = self.expected_class(g)
        if expected is None:
            raise PlanError(f"{where}: group {g.group} is of kind cold, but its name is not a module under one "
                            f"of the cold segments ({', '.join(self.inputs.cold_segments)}); {REPLAN}")
        cls, mtp, why = expected
        # mutation: mtp-flag-trusted
        if g.mtp != mtp:
            raise PlanError(f"{where}: group {g.group}: mtp is {str(g.mtp).lower()}, but the group is "
                            f"{'' if mtp else 'not '}an MTP head; {REPLAN}")
        # mutation: absent-any-group
        if g.cls != cls:
            what = "placed absent (not loaded)" if g.cls == GroupClass.ABSENT else f"of class {g.cls}"
            if g.cls == GroupClass.ABSENT:
                why += "; only an MTP head is ever absent: vLLM loads every other tensor"
            raise PlanError(f"{where}: group {g.group} is {what}, but it is {cls}: {why}; {REPLAN}")
        if cls == GroupClass.ABSENT and g.est_read_bytes_per_step:
            raise PlanError(f"{where}: group {g.group} is not loaded, so a step reads none of it, not "
                            f"est_read_bytes_per_step {g.est_read_bytes_per_step}; {REPLAN}")
        whole = ((cls == GroupClass.HOT and g.kind not in PARTIAL_READ_KINDS)
                 or (cls == GroupClass.COLD and not has_segment(g.group, EMBED_SEGMENTS)
                     and not self._is_vllm_host_table(g.group)))
        expected = g.bytes if cls == GroupClass.HOT else 0
        # mutation: est-read-trusted
        if whole and g.est_read_bytes_per_step != expected:
            what = "read in full every step" if cls == GroupClass.HOT else "not read by a decode step"
            raise PlanError(f"{where}: group {g.group} is {what}: est_read_bytes_per_step must be {expected}, "
                            f"not {g.est_read_bytes_per_step}; {REPLAN}")
        # mutation: experts-read-not-derived
        if g.kind == GroupKind.EXPERTS:
            expected = experts_read_bytes(g.bytes, g.num_experts, g.experts_per_token)
            if g.est_read_bytes_per_step != expected:
                raise PlanError(f"{where}: group {g.group}: a step at batch 1 reads {g.experts_per_token} of its "
                                f"{g.num_experts} routed experts (est), so est_read_bytes_per_step must be "
                                f"{expected}, not {g.est_read_bytes_per_step}; {REPLAN}")

    def _check_coverage(self, where: str) -> None:
        """The groups hold every tensor of the model: a byte in no group is placed by no one
        and counted nowhere."""
        held = sum(g.bytes for g in self.groups)
        # mutation: groups-need-not-cover
        if held != self.model.total_bytes:
            raise PlanError(
                f"{where}: the groups hold {held} bytes but the model ({self.model.source}) has "
                f"{self.model.total_bytes}: {abs(held - self.model.total_bytes)} bytes are "
                f"{'in no group' if held < self.model.total_bytes else 'counted twice or not in the model'} "
                f"(was a group deleted or edited?); {REPLAN}")
        if all(g.num_tensors for g in self.groups):
            tensors = sum(g.num_tensors for g in self.groups)
            if tensors != self.model.num_tensors:
                raise PlanError(f"{where}: the groups hold {tensors} tensors but the model has "
                                f"{self.model.num_tensors} (was a group deleted or edited?); {REPLAN}")

    def prefetch_buffer_range(self) -> tuple[int, int]:
        """The least and most the prefetch buffers can be for these hot layers: one slot per
        parameter name, each as large as its largest copy, is at least the largest layer
        and at most every layer (``prefetch_step`` slots of each), counting the hot layers
        only: the offloader makes slots for what it offloads. A layer's routed experts are
        copied with it, so they count in its bytes."""
        hot = set(self.hot_layer_indices)
        per_layer: dict[int, int] = {}
        for g in self.groups:
            # mutation: prefetch-range-all-layers
            if g.kind in LAYER_KINDS and g.layer_index in hot:
                per_layer[g.layer_index] = per_layer.get(g.layer_index, 0) + g.bytes
        layers = list(per_layer.values())
        if not self.hot_layer_indices or not layers:
            return 0, 0
        return self.inputs.prefetch_step * max(layers), self.inputs.prefetch_step * sum(layers)

    def tower_transient_limit(self) -> int:
        """The most an on-demand tower can hold on the device (two blocks and the rest of
        the largest tower on the host, at most twice its bytes)."""
        towers = [g.bytes for g in self.groups if g.placement == Placement.HOST_COLD
                  and not has_segment(g.group, EMBED_SEGMENTS) and not self._is_vllm_host_table(g.group)]
        return 2 * max(towers, default=0)

    def check_derived(self, where: str = "plan") -> None:
        """Stated quantities the groups bound: the prefetch buffers and the tower transient."""
        low, high = self.prefetch_buffer_range()
        stated = self.stored_prefetch_buffer_bytes
        # mutation: prefetch-buffers-trusted
        if stated is not None and not low <= stated <= high and (stated or self.hot_layer_indices):
            raise PlanError(
                f"{where}: prefetch_buffer_bytes {stated} cannot be right: prefetch_step "
                f"{self.inputs.prefetch_step} slots of the offloaded layers' parameters need "
                + (f"{low} to {high} bytes" if self.hot_layer_indices else "none without hot layers")
                + f"; {REPLAN}")
        limit = self.tower_transient_limit()
        transient = self.est_transient_device_bytes
        # mutation: transient-trusted
        if transient > limit or (limit and not transient):
            raise PlanError(
                f"{where}: est_transient_device_bytes {transient} cannot be right: the towers placed on the host "
                + (f"hold up to {limit} bytes on the device while they run (more than 0)" if limit else
                   "are none, so nothing runs on demand (0)") + f"; {REPLAN}")

    def check_bulk(self, where: str = "plan") -> None:
        """The bulk baseline's device bytes and verdict follow from its offloaded bytes and
        the groups (what it offloads needs the checkpoint's tensor order: bounded here)."""
        bulk = self.bulk
        if bulk is None:
            return
        loaded = sum(g.bytes for g in self.groups if g.placement != Placement.ABSENT)
        layers = sum(g.bytes for g in self.groups if g.kind in LAYER_KINDS)
        problem = None
        if bulk.offloaded_bytes > layers:
            problem = f"offloaded_bytes {bulk.offloaded_bytes} is more than the {layers} bytes of the decoder layers"
        elif bulk.device_bytes != loaded - bulk.offloaded_bytes:
            problem = (f"device_bytes {bulk.device_bytes} is not the {loaded} bytes loaded less the "
                       f"{bulk.offloaded_bytes} offloaded")
        elif bulk.fits != (bulk.device_bytes <= self.weight_budget_bytes):
            problem = f"fits is {str(bulk.fits).lower()}, but {bulk.device_bytes} device bytes against the " \
                      f"{self.weight_budget_bytes}-byte weight budget say otherwise"
        # mutation: bulk-trusted
        if problem:
            raise PlanError(f"{where}: bulk: {problem}; {REPLAN}")

    def derived_strategy(self) -> Strategy:
        """What the placement does: the strategy a plan must state."""
        if self.shortfall_bytes or self.host_shortfall_bytes:
            return Strategy.INFEASIBLE
        if self.hot_layer_indices or any(g.placement == Placement.HOST_UVA for g in self.groups):
            return Strategy.HOT_OFFLOAD  # hot bytes on the host: layers prefetched, or experts read in place
        if self.host_cold_groups:
            return Strategy.COLD_OFFLOAD
        return Strategy.RESIDENT

    def check_strategy(self, where: str = "plan") -> None:
        """The strategy names what the placement does, and a feasible placement fits."""
        derived = self.derived_strategy()
        if self.strategy == derived:
            return
        shortfall = self.shortfall_bytes
        if self.strategy == Strategy.INFEASIBLE:
            wrong = "it fits the weight budget and the host memory"
        elif shortfall:
            wrong = (f"the groups placed on the device need {shortfall / GB:.3f} GB more than the "
                     f"{self.weight_budget_bytes / GB:.3f} GB weight budget")
        elif self.host_shortfall_bytes:
            wrong = (f"the groups placed on the host need {self.host_shortfall_bytes / GB:.3f} GB more than the "
                     f"{self.inputs.host_memory_bytes / GB:.3f} GB of host memory")
        elif self.strategy == Strategy.RESIDENT:
            wrong = "it places groups on the host"
        elif self.strategy == Strategy.COLD_OFFLOAD:
            wrong = "cold_offload places cold groups, and only cold groups, on the host"
        elif self.strategy == Strategy.HOT_OFFLOAD:
            wrong = "it places no decoder layer and no routed experts on the host"
        else:
            wrong = f"the placement is {derived}"
        raise PlanError(f"{where}: strategy is {self.strategy}, but {wrong}; {REPLAN}")

    def require_feasible(self, what: str = "the plan") -> None:
        """Refuse to apply an infeasible plan (enable(), and plans made at engine start)."""
        if self.strategy != Strategy.INFEASIBLE:
            return
        if self.shortfall_bytes:
            need = f"{self.shortfall_bytes / GB:.3f} GB more device memory is needed than it has"
        else:
            need = f"{self.host_shortfall_bytes / GB:.3f} GB more host memory is needed than it has"
        raise PlanError(f"{what} is infeasible: {need}; plan for a larger card, a smaller KV cache or a "
                        "smaller checkpoint")

    # ---- serialisation
    def to_dict(self, *, derived: bool = True) -> dict[str, Any]:
        """The plan as its JSON object; ``derived=False`` leaves out what is computed from
        the fields (totals, estimates), so a plan of unchecked values can be written out to
        be checked."""
        return {
            "format": PLAN_FORMAT,
            "model": self.model.to_dict(),
            "inputs": self.inputs.to_dict(),
            "strategy": self.strategy,
            "hot_layer_indices": list(self.hot_layer_indices),
            "est_transient_device_bytes": self.est_transient_device_bytes,
            "prefetch_buffer_bytes": self.prefetch_buffer_bytes if derived else self.stored_prefetch_buffer_bytes,
            **({"totals": self.totals(), "est": self.est.__dict__.copy()} if derived else {}),
            "bulk": None if self.bulk is None else self.bulk.to_dict(),
            "bulk_segments": None if self.bulk_segments is None else self.bulk_segments.to_dict(),
            "alternative": None if self.alternative is None else self.alternative.to_dict(),
            "est_ignores": list(self.est_ignores),
            "notes": list(self.notes),
            "groups": [g.to_dict() for g in self.groups],
        }

    def to_json(self) -> str:
        """The plan as strict JSON (no NaN or Infinity: every number a plan holds is bounded)."""
        return jsonio.dumps(self.to_dict()) + "\n"

    def save(self, path: str | os.PathLike) -> None:
        text = self.to_json()
        try:
            Path(path).write_text(text)
        except OSError as exc:
            raise PlanError(f"{path}: cannot write the plan: {exc.strerror or exc}; name a file in an existing, "
                            "writable directory") from None

    @classmethod
    def checked(cls, plan: "Plan", where: str = "the Plan object") -> "Plan":
        """``plan`` validated as a plan file is: written out and read back through the same
        typed reader (types, enums, bounds, derived quantities), so a Plan built or edited
        in Python gets no fewer checks than a file, and its errors name it, not a copy."""
        try:
            data = jsonio.parse(json.dumps(plan.to_dict(derived=False), allow_nan=False, default=_not_json))
        except (TypeError, ValueError, AttributeError, ArithmeticError, KeyError) as exc:
            raise PlanError(f"{where}: is not a well-formed plan ({str(exc).splitlines()[0][:120]}); build it "
                            "with make_plan() or Plan.load(), or " + REPLAN) from None
        read = cls.from_dict(data, where=where)
        return _with_load_notes(read, list(plan.load_notes) + list(read.load_notes))

    @classmethod
    def from_dict(cls, data: Any, where: str = "plan") -> "Plan":
        version = format_version(data, where)
        top = _reader(data, where, "")
        top.seen.add("format")
        model, notes = PlannedModel.read(top.child("model"))
        inputs, more = PlanInputs.read(top.child("inputs"))
        notes += more
        groups_raw = top.raw("groups")
        if not isinstance(groups_raw, list) or not groups_raw:
            top.bad("groups", groups_raw, "a non-empty list of groups")
        groups = []
        for i, raw in enumerate(groups_raw):
            group, more = GroupPlan.read(_reader(raw, where, f"groups[{i}]"), version)
            groups.append(group)
            notes += more
        hot = top.raw("hot_layer_indices")
        if not _int_list(hot):
            top.bad("hot_layer_indices", hot, "a list of layer indices")
        bulk_raw = top.raw("bulk", None)
        alternative_raw = top.raw("alternative", None)
        segments_raw = top.raw("bulk_segments", None)
        plan = cls(
            model=model, inputs=inputs, strategy=top.choice("strategy", Strategy), groups=tuple(groups),
            hot_layer_indices=tuple(hot), est_transient_device_bytes=top.int("est_transient_device_bytes"),
            bulk=None if bulk_raw is None else BulkBaseline.read(top.child("bulk")),
            est_ignores=top.str_list("est_ignores", default=list(EST_IGNORES)),
            notes=top.str_list("notes", default=[]),
            stored_prefetch_buffer_bytes=top.int("prefetch_buffer_bytes", default=None) if version > 1 else None,
            alternative=None if alternative_raw is None else Alternative.read(top.child("alternative")),
            bulk_segments=None if segments_raw is None else BulkBaseline.read(top.child("bulk_segments")),
        )
        top.seen.update({"est"})  # derived: recomputed from the groups
        plan.check_groups(where)
        plan.check_derived(where)
        plan.check_bulk(where)
        stored = _stored_totals(top, version)
        for name, value in stored.items():
            # mutation: totals-not-checked
            if value != getattr(plan, name):
                raise PlanError(
                    f"{where}: {name} says {value} but the groups add up to {getattr(plan, name)} "
                    "(was a group edited?); delete the \"totals\" object to accept the groups as they are, "
                    f"or {REPLAN}")
        plan.check_strategy(where)
        notes += top.unknown()
        return _with_load_notes(plan, notes)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Plan":
        path = Path(path)
        try:
            data = jsonio.read(path)
        except OSError as exc:
            raise PlanError(f"{path}: cannot read the plan: {exc.strerror or exc}") from None
        except ValueError as exc:
            raise PlanError(f"{path}: the plan is not valid JSON ({exc}); {REPLAN}") from None
        return cls.from_dict(data, where=str(path))


def _not_json(value: Any) -> Any:
    if isinstance(value, Enum):
        return value.value
    raise TypeError(f"{type(value).__name__} {value!r} is not a plan value")


def _stored_totals(top: FieldReader, version: int) -> dict[str, int]:
    """The totals a plan file states, to check against the groups."""
    if version == 1:
        # v1 wrote them at the top level; the ones it derived differently are not compared.
        names = ("device_bytes", "host_cold_bytes", "host_hot_bytes", "absent_bytes", "cold_bytes")
        top.seen.update({"shortfall_bytes", "deficit_bytes", "weight_budget_bytes", "prefetch_buffer_bytes",
                         "format"})
        return {n: top.int(n, minimum=None) for n in names if n in top.data}
    if "totals" not in top.data:
        return {}
    r = top.child("totals")
    out = {n: r.int(n, minimum=None) for n in TOTALS if n in r.data}
    return out


def _with_load_notes(plan: Plan, notes: list[str]) -> Plan:
    from dataclasses import replace

    return replace(plan, load_notes=tuple(notes)) if notes else plan
