"""Decide where every byte of a checkpoint goes: cold bytes to the host first, hot ones last.

A decode step reads every resident weight once, so each byte kept in host memory and read
during the step crosses PCIe (13.9 GB/s on the reference laptop, 34x slower than its
472 GB/s VRAM). Some groups are not read by a text decode step at all, and cost nothing on
the host:

=============  ===========  ============================================================
group          class        why
=============  ===========  ============================================================
lm_head        hot, always  one vocab x hidden GEMM per step
embed_tokens   cold         a gather: one row (hidden x dtype bytes) per token
visual, ...    cold         towers run once per image/clip, in prefill
mtp            absent/hot   vLLM drops ``mtp.`` keys unless MTP speculative decoding is
                            on; then the drafter runs every step
=============  ===========  ============================================================

``embed_tokens`` and ``lm_head`` have the same shape and dtype and opposite classes, so a
size-ordered, name-blind policy (vLLM's ``cpu_offload_gb``) cannot tell them apart.
Classes come from dot-separated name segments (``model.visual.blocks.0`` is cold,
``model.visualise`` is not); ``lm_head`` is never cold; with ``tie_word_embeddings`` the
embedding *is* the LM head's weight and is hot.

Checked against SPEC.md's reference point (Qwen3.8-27B-FP8, 30.89 GB, on a 24 GiB card):
the bundled manifest plans a deficit of ~8.3 GB, a 3.47 GB cold set without MTP, and 12
hot layers (4.58 GB) left on the host: ~329 ms of link time per step, against 773 ms for
vLLM's bulk ``cpu_offload_gb=10`` (10 GiB = 10.74 GB, taken in model order).

Every time and rate here is an estimate from bytes and bandwidths, labelled ``est_``;
:data:`EST_IGNORES` says what the model leaves out. On the reference point it was an
upper bound 1.24x the observed rate, and it is known to be far off for compute-bound
formats (NVFP4 decoded 4.7x slower than it predicts): never choose a format from it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

from .checkpoint import DTYPE_BITS, Checkpoint, TensorInfo
from .errors import PlanError
from .sizes import GB, GiB

PLAN_FORMAT = "selective-offload/plan-v1"

#: Name segments whose modules a text decode step does not read: the token embedding,
#: vision and audio towers and the projectors that feed their output to the language
#: model (run once per image or clip, in prefill), and MTP heads (``mtp`` in Qwen3.5-style
#: checkpoints, ``mtp_layers`` in MiMo's).
DEFAULT_COLD_SEGMENTS: tuple[str, ...] = (
    "embed_tokens", "visual", "vision_tower", "vision_model", "audio_tower",
    "multi_modal_projector", "mm_projector", "connector", "mtp", "mtp_layers",
)
#: Segments that are never cold, whatever the cold list says.
NEVER_COLD_SEGMENTS: tuple[str, ...] = ("lm_head",)
#: Segments of MTP heads: absent unless MTP speculative decoding loads them.
MTP_SEGMENTS: tuple[str, ...] = ("mtp", "mtp_layers")
#: Segments of a token embedding (hot when the embeddings are tied).
EMBED_SEGMENTS: tuple[str, ...] = ("embed_tokens",)

REFERENCE_LINK_GBPS = 13.9
REFERENCE_VRAM_GBPS = 472.0

EST_IGNORES: tuple[str, ...] = (
    "compute time: the model counts bytes only, so compute-bound formats (NVFP4, small "
    "batches of large MoE) run slower than estimated",
    "attention and KV-cache reads, activations and sampling",
    "kernel launch, scheduling and Python overhead between kernels",
    "overlap of prefetch copies with compute (a prefetched layer can hide up to its "
    "VRAM read time behind the link); link and VRAM times are added, not overlapped",
    "batch > 1: the embedding rows read per step grow with the batch, nothing else does",
)

#: A decoder layer: `...layers.N.` (the checkpoint prefix before it names the stack).
LAYER_RE = re.compile(r"^(?P<prefix>(?:.*\.)?layers)\.(?P<index>\d+)\.")
_BLOCK_RE = re.compile(r"\.(?:blocks|layers|layer)\.(\d+)\.")


# --------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class PlanInputs:
    """What the plan is made for. Bytes are bytes; bandwidths are decimal GB/s."""

    device_memory_bytes: int
    kv_cache_bytes: int = 1 * GiB
    #: CUDA context, activations, CUDA graphs and allocator slack.
    reserve_bytes: int = 2 * GiB
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

    @property
    def weight_budget_bytes(self) -> int:
        return self.device_memory_bytes - self.kv_cache_bytes - self.reserve_bytes

    def validate(self) -> None:
        if self.device_memory_bytes <= 0:
            raise PlanError("device memory must be more than 0 bytes; give it like --device-memory 24GiB")
        for label, value in (("link", self.link_gbps), ("VRAM", self.vram_gbps)):
            if not (value > 0 and math.isfinite(value)):
                raise PlanError(f"{label} bandwidth {value!r} GB/s must be a positive number")
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


# --------------------------------------------------------------------------- groups


@dataclass(frozen=True)
class Group:
    """Parameters placed together: one decoder layer, one cold module, or one other module."""

    name: str
    #: ``layer`` (one decoder layer of the main stack), ``cold`` (a whole cold module),
    #: or ``module`` (any other parameters, by module path).
    kind: str
    #: ``cold``, ``hot`` or ``absent`` (not loaded for this run).
    cls: str
    reason: str
    nbytes: int
    num_tensors: int
    layer_index: int | None = None
    #: Bytes a decode step reads from this group at batch 1 (est).
    est_read_bytes_per_step: int = 0
    #: For cold modules with a block list: bytes of the largest block and of the rest;
    #: the on-demand wrapper holds two blocks plus the rest on the device while it runs.
    largest_block_bytes: int = 0
    non_block_bytes: int = 0
    #: An MTP head: loaded by vLLM's speculative drafter, not by the main model.
    mtp: bool = False


def _segments(name: str) -> list[str]:
    return name.split(".")


def _first_segment_index(segments: Sequence[str], wanted: Iterable[str]) -> int | None:
    wanted = set(wanted)
    for i, seg in enumerate(segments):
        if seg in wanted:
            return i
    return None


def _row_bytes(t: TensorInfo) -> int:
    """Bytes of one row of a 2-D tensor: what a gather reads per token."""
    if len(t.shape) < 2 or t.shape[0] == 0:
        return t.nbytes
    return (math.prod(t.shape[1:]) * DTYPE_BITS[t.dtype] + 7) // 8


def group_tensors(checkpoint: Checkpoint, inputs: PlanInputs) -> list[Group]:
    """Group and classify every tensor of ``checkpoint`` (no placement yet)."""
    facts = checkpoint.facts
    cold = set(inputs.cold_segments) - set(NEVER_COLD_SEGMENTS)
    buckets: dict[str, list[TensorInfo]] = {}
    kinds: dict[str, tuple[str, int | None]] = {}
    mtp_keys: set[str] = set()
    for t in checkpoint.tensors.values():
        segs = _segments(t.name)
        cold_at = _first_segment_index(segs, cold)
        never_cold = _first_segment_index(segs, NEVER_COLD_SEGMENTS) is not None
        if cold_at is not None and not never_cold:
            key, kind, index = ".".join(segs[: cold_at + 1]), "cold", None
        elif (m := LAYER_RE.match(t.name)) is not None and _is_mtp_layer(int(m.group("index")), facts):
            # DeepSeek-V3 style: the MTP head is stored as decoder layers past the last one.
            key, kind, index = f"{m.group('prefix')}.{m.group('index')}", "cold", None
            mtp_keys.add(key)
        elif m is not None:
            key = f"{m.group('prefix')}.{m.group('index')}"
            kind, index = "layer", int(m.group("index"))
        else:
            key, kind, index = ".".join(segs[:-1]) or t.name, "module", None
        buckets.setdefault(key, []).append(t)
        kinds[key] = (kind, index)

    # Only the main decoder stack (the longest run of `...layers.N`) is offered to the
    # hot-layer offloader; any other `layers.N` (an encoder, say) stays a module group.
    stacks: dict[str, int] = {}
    for key, (kind, _) in kinds.items():
        if kind == "layer":
            prefix = key.rsplit(".", 1)[0]
            stacks[prefix] = stacks.get(prefix, 0) + 1
    main_stack = max(stacks, key=stacks.get) if stacks else None

    groups: list[Group] = []
    for key, members in buckets.items():
        kind, index = kinds[key]
        if kind == "layer" and key.rsplit(".", 1)[0] != main_stack:
            kind, index = "module", None
        nbytes = sum(t.nbytes for t in members)
        segs = set(_segments(key))
        read = nbytes
        largest_block = non_block = 0
        if kind == "cold":
            if segs & set(MTP_SEGMENTS) or key in mtp_keys:
                if inputs.speculative == "mtp":
                    cls, reason = "hot", "MTP speculative decoding runs the MTP head every step"
                else:
                    cls, reason, read = "absent", "vLLM drops mtp.* keys without MTP speculative decoding", 0
            elif segs & set(EMBED_SEGMENTS) and facts.tie_word_embeddings:
                cls, reason = "hot", "tie_word_embeddings: the embedding is the LM head's weight"
            elif segs & set(EMBED_SEGMENTS):
                cls, reason = "cold", "a gather: one row per token per step"
                read = max((_row_bytes(t) for t in members if t.name.endswith("weight")), default=0)
            else:
                cls, reason, read = "cold", "read only in prefill, once per image or clip", 0
                blocks: dict[int, int] = {}
                for t in members:
                    m = _BLOCK_RE.search(t.name[len(key):] + ".")
                    if m:
                        blocks[int(m.group(1))] = blocks.get(int(m.group(1)), 0) + t.nbytes
                    else:
                        non_block += t.nbytes
                largest_block = max(blocks.values(), default=0)
                if not blocks:
                    non_block = nbytes
        elif kind == "module" and "lm_head" in segs and facts.tie_word_embeddings:
            cls = "hot"
            reason = ("stored although tied: counted on the device in case vLLM keeps it "
                      "apart from the embedding")
        elif kind == "module" and "lm_head" in segs:
            cls, reason = "hot", "one vocab x hidden GEMM per step"
        elif kind == "layer":
            cls, reason = "hot", "decoder layer: read every step"
        else:
            cls, reason = "hot", "read every step"
        is_mtp = kind == "cold" and bool(segs & set(MTP_SEGMENTS) or key in mtp_keys)
        groups.append(Group(key, kind, cls, reason, nbytes, len(members), index,
                            read, largest_block, non_block, is_mtp))
    groups.sort(key=_model_order)
    return groups


def _is_mtp_layer(index: int, facts) -> bool:
    return bool(facts.num_mtp_layers and facts.num_hidden_layers is not None
                and index >= facts.num_hidden_layers)


def _model_order(g: Group) -> tuple:
    """Embedding, then the decoder layers in order, then the rest by name (stable)."""
    if g.kind == "layer":
        return (1, g.layer_index, g.name)
    if set(_segments(g.name)) & set(EMBED_SEGMENTS):
        return (0, 0, g.name)
    return (2, 0, g.name)


# --------------------------------------------------------------------------- plan


@dataclass(frozen=True)
class Placement:
    group: str
    kind: str
    cls: str
    placement: str  # device | host-cold | host-hot | absent
    reason: str
    bytes: int
    layer_index: int | None
    est_link_bytes_per_step: int
    est_vram_bytes_per_step: int
    mtp: bool = False


@dataclass(frozen=True)
class Estimate:
    est_link_s_per_step: float
    est_vram_s_per_step: float
    est_step_s: float
    est_tok_s: float


@dataclass(frozen=True)
class BulkBaseline:
    """vLLM's own ``cpu_offload_gb``: parameters of the layer stack, in model order."""

    cpu_offload_gb: float
    offloaded_bytes: int
    offloaded_tensors: int
    #: Decoder layers with at least one parameter on the host.
    layers_touched: list[int]
    device_bytes: int
    fits: bool
    est: Estimate


@dataclass(frozen=True)
class Plan:
    model: dict[str, Any]
    inputs: dict[str, Any]
    strategy: str  # resident | cold_offload | hot_offload | infeasible
    shortfall_bytes: int
    deficit_bytes: int
    weight_budget_bytes: int
    groups: list[Placement]
    hot_layer_indices: list[int]
    device_bytes: int
    host_cold_bytes: int
    host_hot_bytes: int
    absent_bytes: int
    cold_bytes: int
    prefetch_buffer_bytes: int
    est_transient_device_bytes: int
    est: Estimate
    bulk: BulkBaseline | None
    est_ignores: tuple[str, ...] = EST_IGNORES
    notes: tuple[str, ...] = ()
    format: str = PLAN_FORMAT

    # ---- serialisation
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1) + "\n"

    def save(self, path: str | os.PathLike) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "plan") -> "Plan":
        if not isinstance(data, dict) or data.get("format") != PLAN_FORMAT:
            raise PlanError(
                f"{where}: not a selective-offload plan (expected \"format\": \"{PLAN_FORMAT}\"); "
                "make one with `selective-offload plan MODEL --json -o plan.json`"
            )
        try:
            bulk = data.get("bulk")
            return cls(
                **{
                    **{k: v for k, v in data.items() if k not in ("groups", "est", "bulk", "est_ignores", "notes")},
                    "groups": [Placement(**g) for g in data["groups"]],
                    "est": Estimate(**data["est"]),
                    "bulk": None if bulk is None else BulkBaseline(**{**bulk, "est": Estimate(**bulk["est"])}),
                    "est_ignores": tuple(data.get("est_ignores", EST_IGNORES)),
                    "notes": tuple(data.get("notes", ())),
                }
            )
        except (KeyError, TypeError) as exc:
            raise PlanError(f"{where}: the plan is incomplete or from another version ({exc}); make it again") from None

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Plan":
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except OSError as exc:
            raise PlanError(f"{path}: cannot read the plan: {exc.strerror or exc}") from None
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise PlanError(f"{path}: the plan is not valid JSON ({exc}); make it again") from None
        return cls.from_dict(data, where=str(path))

    # ---- queries the vLLM glue uses
    def make_inputs(self) -> PlanInputs:
        """The :class:`PlanInputs` this plan was made from."""
        return PlanInputs(**{**self.inputs, "cold_segments": tuple(self.inputs["cold_segments"])})

    def placement_of(self, group: str) -> str | None:
        for g in self.groups:
            if g.group == group:
                return g.placement
        return None

    @property
    def host_cold_groups(self) -> list[str]:
        return [g.group for g in self.groups if g.placement == "host-cold"]


def model_fingerprint(checkpoint: Checkpoint) -> str:
    """A hash of every tensor's name, dtype and shape: a plan for another model will differ."""
    h = hashlib.sha256()
    for name in sorted(checkpoint.tensors):
        t = checkpoint.tensors[name]
        h.update(f"{name}\0{t.dtype}\0{','.join(map(str, t.shape))}\n".encode())
    return h.hexdigest()[:16]


def _estimate(link_bytes: int, vram_bytes: int, inputs: PlanInputs) -> Estimate:
    link_s = link_bytes / (inputs.link_gbps * GB)
    vram_s = vram_bytes / (inputs.vram_gbps * GB)
    step = link_s + vram_s
    return Estimate(link_s, vram_s, step, (1.0 / step) if step > 0 else float("inf"))


def _spread(count: int, total: int) -> list[int]:
    """``count`` layer indices out of ``total``, evenly spaced and ending at the last one.

    Spacing them out leaves resident layers between two offloaded ones, whose compute the
    prefetch of the next offloaded layer can hide behind.
    """
    return sorted({(k + 1) * total // count - 1 for k in range(count)}) if count else []


def price_bulk(groups: list[Group], checkpoint: Checkpoint, inputs: PlanInputs,
               deficit_bytes: int) -> BulkBaseline:
    """What vLLM's ``cpu_offload_gb`` would take: whole parameters of the decoder layers,
    in model order, until the GiB budget is met (UVA zero-copy: read every step)."""
    if inputs.bulk_cpu_offload_gb is not None:
        gb = float(inputs.bulk_cpu_offload_gb)
    else:
        gb = float(max(0, math.ceil(deficit_bytes / GiB)))
    max_bytes = int(gb * GiB)  # vLLM: int(cpu_offload_gb * 1024**3)
    layer_groups = sorted((g for g in groups if g.kind == "layer"), key=lambda g: g.layer_index)
    by_layer: dict[str, list[TensorInfo]] = {g.name: [] for g in layer_groups}
    for t in checkpoint.tensors.values():
        m = LAYER_RE.match(t.name)
        if m and f"{m.group('prefix')}.{m.group('index')}" in by_layer:
            by_layer[f"{m.group('prefix')}.{m.group('index')}"].append(t)
    offloaded = count = 0
    touched: list[int] = []
    for g in layer_groups:
        for t in sorted(by_layer[g.name], key=lambda t: t.name):
            if offloaded >= max_bytes:
                break
            offloaded += t.nbytes
            count += 1
            if not touched or touched[-1] != g.layer_index:
                touched.append(g.layer_index)
    loaded = sum(g.nbytes for g in groups if g.cls != "absent")
    read = sum(g.est_read_bytes_per_step for g in groups if g.cls != "absent")
    device = loaded - offloaded
    return BulkBaseline(
        cpu_offload_gb=gb, offloaded_bytes=offloaded, offloaded_tensors=count,
        layers_touched=touched, device_bytes=device,
        fits=device <= inputs.weight_budget_bytes,
        est=_estimate(offloaded, read - offloaded, inputs),
    )


def make_plan(checkpoint: Checkpoint, inputs: PlanInputs, *, with_bulk: bool = True) -> Plan:
    """Place every group of ``checkpoint`` for ``inputs``: cold first, then hot layers."""
    inputs.validate()
    groups = group_tensors(checkpoint, inputs)
    if not any(g.kind == "layer" for g in groups):
        notes = ["no decoder layer stack (`...layers.N.`) found: only cold modules can be offloaded"]
    else:
        notes = []
    budget = inputs.weight_budget_bytes
    loaded = [g for g in groups if g.cls != "absent"]
    needed = sum(g.nbytes for g in loaded)
    deficit = needed - budget
    placement: dict[str, str] = {g.name: ("absent" if g.cls == "absent" else "device") for g in groups}

    cold = sorted((g for g in groups if g.cls == "cold"), key=lambda g: -g.nbytes)
    cold_bytes = sum(g.nbytes for g in cold)
    transient = 0
    remaining = deficit
    for g in cold:
        if remaining <= 0 and not inputs.all_cold:
            break
        placement[g.name] = "host-cold"
        # The on-demand wrapper holds about two blocks and the non-block rest while it runs.
        if g.largest_block_bytes:
            transient = max(transient, 2 * g.largest_block_bytes + g.non_block_bytes)
        elif not set(_segments(g.name)) & set(EMBED_SEGMENTS):
            transient = max(transient, g.nbytes)
        remaining = _device_bytes(loaded, placement) + transient - budget

    layers = sorted((g for g in groups if g.kind == "layer"), key=lambda g: g.layer_index)
    hot_indices: list[int] = []
    buffers = 0
    strategy = "resident" if deficit <= 0 and not any(placement[g.name] == "host-cold" for g in cold) else "cold_offload"
    shortfall = 0
    if remaining > 0 and layers:
        # Offloading n layers frees their bytes but costs prefetch_step device slots of
        # the largest one (vLLM's static buffer pool keeps one copy per parameter and slot).
        buffers = inputs.prefetch_step * max(g.nbytes for g in layers)
        # The fewest spread-out layers that close the rest of the deficit; when none do,
        # every layer (and the plan is infeasible below).
        chosen = next((c for c in (_spread(n, len(layers)) for n in range(1, len(layers) + 1))
                       if sum(layers[i].nbytes for i in c) - buffers >= remaining),
                      list(range(len(layers))))
        for i in chosen:
            placement[layers[i].name] = "host-hot"
        hot_indices = [layers[i].layer_index for i in chosen]
        strategy = "hot_offload"
        remaining = _device_bytes(loaded, placement) + transient + buffers - budget
    if remaining > 0:
        strategy, shortfall = "infeasible", remaining
        notes.append(
            f"infeasible: {remaining / GB:.3f} GB more device memory is needed even with every "
            "cold module and every decoder layer on the host; use a larger card, a smaller "
            "KV cache, or a smaller checkpoint"
        )

    placements: list[Placement] = []
    for g in groups:
        where = placement[g.name]
        link = vram = 0
        if where == "host-hot":
            link, vram = g.nbytes, g.nbytes
        elif where == "host-cold":
            link = g.est_read_bytes_per_step
        elif where == "device":
            vram = g.est_read_bytes_per_step
        placements.append(Placement(g.name, g.kind, g.cls, where, g.reason, g.nbytes,
                                    g.layer_index, link, vram, g.mtp))

    def total(kind: str) -> int:
        return sum(p.bytes for p in placements if p.placement == kind)

    link_total = sum(p.est_link_bytes_per_step for p in placements)
    vram_total = sum(p.est_vram_bytes_per_step for p in placements)
    facts = checkpoint.facts
    model = {
        "source": checkpoint.source,
        "kind": checkpoint.kind,
        "architectures": list(facts.architectures),
        "fingerprint": model_fingerprint(checkpoint),
        "num_tensors": len(checkpoint.tensors),
        "total_bytes": checkpoint.total_bytes,
        "tie_word_embeddings": facts.tie_word_embeddings,
        "num_hidden_layers": facts.num_hidden_layers,
    }
    if checkpoint.kind == "config":
        notes.append("planned from config.json alone: tensor sizes are an estimate (see `manifest_from_config`)")
    bulk = price_bulk(groups, checkpoint, inputs, deficit) if with_bulk and deficit > 0 else None
    return Plan(
        model=model,
        inputs={**asdict(inputs), "cold_segments": list(inputs.cold_segments)},
        strategy=strategy,
        shortfall_bytes=shortfall,
        deficit_bytes=deficit,
        weight_budget_bytes=budget,
        groups=placements,
        hot_layer_indices=hot_indices,
        device_bytes=total("device"),
        host_cold_bytes=total("host-cold"),
        host_hot_bytes=total("host-hot"),
        absent_bytes=total("absent"),
        cold_bytes=cold_bytes,
        prefetch_buffer_bytes=buffers,
        est_transient_device_bytes=transient,
        est=_estimate(link_total, vram_total, inputs),
        bulk=bulk,
        notes=tuple(notes),
    )


def _device_bytes(loaded: list[Group], placement: dict[str, str]) -> int:
    return sum(g.nbytes for g in loaded if placement[g.name] == "device")
