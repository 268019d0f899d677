"""Decide where every byte of a checkpoint goes: cold bytes to the host first, hot ones last.

A decode step reads every resident weight once, so each byte kept in host memory and read
during the step crosses PCIe (34x slower than VRAM on the reference laptop, SPEC.md).
Some groups are not read by a text decode step at all, and cost nothing on the host:

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
size-ordered, name-blind policy (vLLM's ``cpu_offload_gb``) cannot tell them apart. Which
names are cold is :mod:`selective_offload.names`' rule; with ``tie_word_embeddings`` the
embedding *is* the LM head's weight and is hot.

The reference arithmetic (the bundled Qwen3.8-27B-FP8-shaped manifest on a 24 GiB card)
is asserted by ``tests/test_planner.py`` and shown in the README.

Every time and rate here is an estimate from bytes and bandwidths, labelled ``est_``
(:mod:`selective_offload.estimate` prices a step; :data:`~selective_offload.plan.EST_IGNORES`
says what it leaves out). It overestimates the measured reference point (the README says
by how much) and is known to be far off for compute-bound formats (NVFP4): never choose a
format from it.

The planner never touches tensors; it returns a :class:`~selective_offload.plan.Plan`.
"""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

from .checkpoint import DTYPE_BITS, Checkpoint, TensorInfo
from .names import EMBED_SEGMENTS, MTP_SEGMENTS, NEVER_COLD_SEGMENTS, cold_prefix, has_segment, layer_of
from .estimate import KV_DTYPE_BYTES, KvModel, Traffic, expected_tokens_per_step
from .errors import PlanError
from .plan import (  # noqa: F401  (PlanInputs, Plan, EST_IGNORES: re-exported for callers)
    EST_IGNORES,
    Alternative,
    BulkBaseline,
    Estimate,
    GroupClass,
    GroupKind,
    GroupPlan,
    Placement,
    Plan,
    PlanInputs,
    PlannedModel,
    Strategy,
)
from .sizes import GB, GiB

_BLOCK_SEGMENTS = ("blocks", "layers", "layer")


# --------------------------------------------------------------------------- groups


@dataclass(frozen=True)
class Group:
    """Parameters placed together: one decoder layer, one cold module, or one other module."""

    name: str
    kind: GroupKind
    cls: GroupClass
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
    #: What identifies the group's tensors, for the model check.
    dtype_bytes: dict[str, int] = field(default_factory=dict)
    shapes_digest: str = ""
    #: Bytes per parameter name relative to the group (``self_attn.qkv_proj.weight``): vLLM's
    #: prefetch buffers are keyed by it.
    param_bytes: dict[str, int] = field(default_factory=dict)


@dataclass
class _Bucket:
    """Tensors of one group while grouping: the key names the group."""

    key: str
    kind: GroupKind
    layer_index: int | None = None
    mtp: bool = False
    tensors: list[TensorInfo] = field(default_factory=list)


def _row_bytes(t: TensorInfo) -> int:
    """Bytes of one row of a 2-D tensor: what a gather reads per token."""
    if len(t.shape) < 2 or t.shape[0] == 0:
        return t.nbytes
    return (math.prod(t.shape[1:]) * DTYPE_BITS[t.dtype] + 7) // 8


def _is_mtp_layer(index: int, facts) -> bool:
    """DeepSeek-V3 style: the MTP head is stored as decoder layers past the last one."""
    return bool(facts.num_mtp_layers and facts.num_hidden_layers is not None
                and index >= facts.num_hidden_layers)


def _bucket_tensors(checkpoint: Checkpoint, inputs: PlanInputs) -> dict[str, _Bucket]:
    """Step 1: which group each tensor belongs to (by the naming rule)."""
    facts = checkpoint.facts
    buckets: dict[str, _Bucket] = {}
    for t in checkpoint.tensors.values():
        prefix = cold_prefix(t.name, inputs.cold_segments)
        layer = layer_of(t.name)
        if prefix is not None:
            bucket = _Bucket(prefix, GroupKind.COLD, mtp=has_segment(prefix, MTP_SEGMENTS))
        elif layer is not None and _is_mtp_layer(layer[1], facts):
            bucket = _Bucket(f"{layer[0]}.{layer[1]}", GroupKind.COLD, mtp=True)
        elif layer is not None:
            bucket = _Bucket(f"{layer[0]}.{layer[1]}", GroupKind.LAYER, layer[1])
        else:
            bucket = _Bucket(t.name.rsplit(".", 1)[0] if "." in t.name else t.name, GroupKind.MODULE)
        buckets.setdefault(bucket.key, bucket).tensors.append(t)
    return buckets


def _keep_main_stack(buckets: dict[str, _Bucket]) -> None:
    """Step 2: only the main decoder stack (the longest run of ``...layers.N``) is offered
    to the hot-layer offloader; any other ``layers.N`` (an encoder, say) is a module group."""
    stacks: dict[str, int] = {}
    for b in buckets.values():
        if b.kind == GroupKind.LAYER:
            stack = b.key.rsplit(".", 1)[0]
            stacks[stack] = stacks.get(stack, 0) + 1
    main = max(stacks, key=stacks.get) if stacks else None
    for b in buckets.values():
        if b.kind == GroupKind.LAYER and b.key.rsplit(".", 1)[0] != main:
            b.kind, b.layer_index = GroupKind.MODULE, None


def _classify(b: _Bucket, tie_word_embeddings: bool, inputs: PlanInputs) -> tuple[GroupClass, str, int]:
    """Step 3: a group's class, the reason, and the bytes a decode step reads from it (est)."""
    nbytes = sum(t.nbytes for t in b.tensors)
    if b.kind == GroupKind.COLD:
        if b.mtp and inputs.speculative == "mtp":
            return GroupClass.HOT, "MTP speculative decoding runs the MTP head every step", nbytes
        if b.mtp:
            return GroupClass.ABSENT, "vLLM drops mtp.* keys without MTP speculative decoding", 0
        if has_segment(b.key, EMBED_SEGMENTS) and tie_word_embeddings:
            return GroupClass.HOT, "tie_word_embeddings: the embedding is the LM head's weight", nbytes
        if has_segment(b.key, EMBED_SEGMENTS):
            row = max((_row_bytes(t) for t in b.tensors if t.name.endswith("weight")), default=0)
            return GroupClass.COLD, "a gather: one row per token per step", row
        return GroupClass.COLD, "read only in prefill, once per image or clip", 0
    if b.kind == GroupKind.MODULE and has_segment(b.key, NEVER_COLD_SEGMENTS):
        if tie_word_embeddings:
            return (GroupClass.HOT, "stored although tied: counted on the device in case vLLM keeps it "
                    "apart from the embedding", nbytes)
        return GroupClass.HOT, "one vocab x hidden GEMM per step", nbytes
    if b.kind == GroupKind.LAYER:
        return GroupClass.HOT, "decoder layer: read every step", nbytes
    return GroupClass.HOT, "read every step", nbytes


def _block_sizes(b: _Bucket) -> tuple[int, int]:
    """Step 4, for cold towers: bytes of the largest block and of everything outside blocks."""
    blocks: dict[int, int] = {}
    non_block = 0
    for t in b.tensors:
        parts = t.name[len(b.key) + 1:].split(".")
        index = next((int(parts[i + 1]) for i in range(len(parts) - 1)
                      if parts[i] in _BLOCK_SEGMENTS and parts[i + 1].isdigit()), None)
        if index is None:
            non_block += t.nbytes
        else:
            blocks[index] = blocks.get(index, 0) + t.nbytes
    return max(blocks.values(), default=0), non_block


def group_signature(key: str, tensors: list[TensorInfo]) -> tuple[dict[str, int], str]:
    """Bytes per dtype, and a digest of (name relative to the group, dtype, shape) of every
    tensor: what the model check compares, unchanged when wrappers around the group move."""
    dtype_bytes: dict[str, int] = {}
    h = hashlib.sha256()
    for t in sorted(tensors, key=lambda t: t.name):
        dtype_bytes[t.dtype] = dtype_bytes.get(t.dtype, 0) + t.nbytes
        h.update(f"{t.name[len(key):]}\0{t.dtype}\0{','.join(map(str, t.shape))}\n".encode())
    return dict(sorted(dtype_bytes.items())), h.hexdigest()[:16]


def group_tensors(checkpoint: Checkpoint, inputs: PlanInputs) -> list[Group]:
    """Group and classify every tensor of ``checkpoint`` (no placement yet), in model order."""
    buckets = _bucket_tensors(checkpoint, inputs)
    _keep_main_stack(buckets)
    tie = checkpoint.facts.tie_word_embeddings
    groups = []
    for b in buckets.values():
        cls, reason, read = _classify(b, tie, inputs)
        tower = cls == GroupClass.COLD and not has_segment(b.key, EMBED_SEGMENTS)
        largest, rest = _block_sizes(b) if tower else (0, 0)
        dtype_bytes, digest = group_signature(b.key, b.tensors)
        params = {t.name[len(b.key) + 1:]: t.nbytes for t in b.tensors} if b.kind == GroupKind.LAYER else {}
        groups.append(Group(b.key, b.kind, cls, reason, sum(t.nbytes for t in b.tensors), len(b.tensors),
                            b.layer_index, read, largest, rest, b.mtp, dtype_bytes, digest, params))
    groups.sort(key=_model_order)
    return groups


def _model_order(g: Group) -> tuple:
    """Embedding, then the decoder layers in order, then the rest by name (stable)."""
    if g.kind == GroupKind.LAYER:
        return (1, g.layer_index, g.name)
    if has_segment(g.name, EMBED_SEGMENTS):
        return (0, 0, g.name)
    return (2, 0, g.name)


def model_fingerprint(checkpoint: Checkpoint) -> str:
    """A hash of every tensor's name, dtype and shape: a plan for another model will differ."""
    h = hashlib.sha256()
    for name in sorted(checkpoint.tensors):
        t = checkpoint.tensors[name]
        h.update(f"{name}\0{t.dtype}\0{','.join(map(str, t.shape))}\n".encode())
    return h.hexdigest()[:16]


# --------------------------------------------------------------------------- placement


def _spread(count: int, total: int) -> list[int]:
    """``count`` layer indices out of ``total``, evenly spaced and ending at the last one.

    Spacing them out leaves resident layers between two offloaded ones, whose compute the
    prefetch of the next offloaded layer can hide behind.
    """
    return sorted({(k + 1) * total // count - 1 for k in range(count)}) if count else []


@dataclass
class _Placing:
    """The placement being built: group name -> placement, and what it costs the device."""

    groups: list[Group]
    budget: int
    where: dict[str, Placement] = field(default_factory=dict)
    transient: int = 0
    buffers: int = 0

    def __post_init__(self) -> None:
        self.where = {g.name: Placement.ABSENT if g.cls == GroupClass.ABSENT else Placement.DEVICE
                      for g in self.groups}

    def over_budget(self) -> int:
        """Device bytes (resident, tower transient, prefetch buffers) above the budget."""
        device = sum(g.nbytes for g in self.groups if self.where[g.name] == Placement.DEVICE)
        return device + self.transient + self.buffers - self.budget


def _place_cold(p: _Placing, inputs: PlanInputs) -> None:
    """Cold modules to the host, largest first, until the deficit closes (or all of them)."""
    for g in sorted((g for g in p.groups if g.cls == GroupClass.COLD), key=lambda g: -g.nbytes):
        if p.over_budget() <= 0 and not inputs.all_cold:
            break
        p.where[g.name] = Placement.HOST_COLD
        p.transient = max(p.transient, tower_transient_bytes(g))


def tower_transient_bytes(g: Group) -> int:
    """Device bytes a cold group on the host holds while it runs: the on-demand wrapper
    holds about two blocks and the non-block rest of a tower (the whole of a tower without
    blocks); an embedding is gathered row by row and holds nothing."""
    if g.largest_block_bytes:
        return 2 * g.largest_block_bytes + g.non_block_bytes
    return 0 if has_segment(g.name, EMBED_SEGMENTS) else g.nbytes


def prefetch_buffer_bytes(layers: list[Group], prefetch_step: int) -> int:
    """vLLM's prefetch offloader keeps ``prefetch_step`` static device slots per parameter
    *name*, each as large as that parameter's largest offloaded copy. In a uniform stack
    that is the largest layer; a hybrid stack (linear- and full-attention layers, as
    Qwen3.5's) needs slots for the union of both kinds' parameters."""
    largest: dict[str, int] = {}
    for g in layers:
        for name, nbytes in (g.param_bytes or {"": g.nbytes}).items():
            largest[name] = max(largest.get(name, 0), nbytes)
    return prefetch_step * sum(largest.values())


def _place_hot_layers(p: _Placing, inputs: PlanInputs) -> list[int]:
    """The fewest spread-out decoder layers that close the rest of the deficit (every layer
    when none do: the plan is then infeasible), net of the prefetch buffers they need."""
    layers = sorted((g for g in p.groups if g.kind == GroupKind.LAYER), key=lambda g: g.layer_index)
    remaining = p.over_budget()
    if remaining <= 0 or not layers:
        return []
    buffers = prefetch_buffer_bytes(layers, inputs.prefetch_step)
    chosen = next((c for c in (_spread(n, len(layers)) for n in range(1, len(layers) + 1))
                   if sum(layers[i].nbytes for i in c) - buffers >= remaining),
                  list(range(len(layers))))
    for i in chosen:
        p.where[layers[i].name] = Placement.HOST_HOT
    p.buffers = buffers
    return [layers[i].layer_index for i in chosen]


def _host_bytes(p: _Placing) -> int:
    return sum(g.nbytes for g in p.groups if p.where[g.name] in (Placement.HOST_COLD, Placement.HOST_HOT))


def _host_shortfall(p: _Placing, inputs: PlanInputs) -> int:
    return 0 if inputs.host_memory_bytes is None else max(0, _host_bytes(p) - inputs.host_memory_bytes)


def _strategy(p: _Placing, hot: list[int], inputs: PlanInputs) -> Strategy:
    if p.over_budget() > 0 or _host_shortfall(p, inputs):
        return Strategy.INFEASIBLE
    if hot:
        return Strategy.HOT_OFFLOAD
    if any(w == Placement.HOST_COLD for w in p.where.values()):
        return Strategy.COLD_OFFLOAD
    return Strategy.RESIDENT


def price_bulk(groups: list[Group], checkpoint: Checkpoint, inputs: PlanInputs,
               deficit_bytes: int, kv: KvModel | None = None, spec_tokens: int = 0) -> BulkBaseline:
    """What vLLM's ``cpu_offload_gb`` would take: whole parameters of the decoder layers,
    in model order, until the GiB budget is met (UVA zero-copy: read every step)."""
    if inputs.bulk_cpu_offload_gb is not None:
        gb = float(inputs.bulk_cpu_offload_gb)
    else:
        gb = float(max(0, math.ceil(deficit_bytes / GiB)))
    max_bytes = int(gb * GiB)  # vLLM: int(cpu_offload_gb * 1024**3)
    layer_names = {g.name: g.layer_index for g in groups if g.kind == GroupKind.LAYER}
    by_layer: dict[int, list[TensorInfo]] = {i: [] for i in layer_names.values()}
    for t in checkpoint.tensors.values():
        layer = layer_of(t.name)
        if layer is not None and f"{layer[0]}.{layer[1]}" in layer_names:
            by_layer[layer[1]].append(t)
    offloaded = count = 0
    touched: list[int] = []
    per_layer: dict[int, int] = {}
    for index in sorted(by_layer):
        for t in sorted(by_layer[index], key=lambda t: t.name):
            if offloaded >= max_bytes:
                break
            offloaded += t.nbytes
            per_layer[index] = per_layer.get(index, 0) + t.nbytes
            count += 1
            if not touched or touched[-1] != index:
                touched.append(index)
    loaded = sum(g.nbytes for g in groups if g.cls != GroupClass.ABSENT)
    device = loaded - offloaded
    return BulkBaseline(
        cpu_offload_gb=gb, offloaded_bytes=offloaded, offloaded_tensors=count,
        layers_touched=tuple(touched), device_bytes=device,
        fits=device <= inputs.weight_budget_bytes,
        est=Estimate.of(_bulk_traffic(groups, per_layer, inputs), inputs, kv, spec_tokens, pipelined=False),
    )


def _bulk_traffic(groups: list[Group], uva_by_layer: dict[int, int], inputs: PlanInputs) -> Traffic:
    """Bulk offload's bytes per pass: everything on the device but the UVA bytes, which the
    kernels read over the link in line (the embedding stays on the device)."""
    layers = tuple((g.est_read_bytes_per_step - uva_by_layer.get(g.layer_index, 0), False)
                   for g in sorted((g for g in groups if g.kind == GroupKind.LAYER), key=lambda g: g.layer_index))
    other = row = draft = 0
    for g in groups:
        if g.kind == GroupKind.LAYER or g.cls == GroupClass.ABSENT:
            continue
        if g.mtp:
            draft += g.nbytes
        elif has_segment(g.name, EMBED_SEGMENTS) and g.cls == GroupClass.COLD:
            row += g.est_read_bytes_per_step
        else:
            other += g.est_read_bytes_per_step
    head = sum(g.est_read_bytes_per_step for g in groups if has_segment(g.name, NEVER_COLD_SEGMENTS))
    speculating = inputs.speculative == "mtp"
    return Traffic(layers, other, 0, row, sum(uva_by_layer.values()), (draft + head) if speculating else 0)


def _planned_model(checkpoint: Checkpoint, kv: KvModel | None) -> PlannedModel:
    facts = checkpoint.facts
    # A local checkpoint is named absolutely: the plan is used from other directories, and
    # enable(plan) finds the model (and checks the plan against it) by this path.
    source = checkpoint.source
    if checkpoint.kind == "safetensors" and Path(source).exists():
        source = os.path.abspath(source)
    return PlannedModel(
        source=source, kind=checkpoint.kind, architectures=tuple(facts.architectures),
        fingerprint=model_fingerprint(checkpoint), num_tensors=len(checkpoint.tensors),
        total_bytes=checkpoint.total_bytes, tie_word_embeddings=facts.tie_word_embeddings,
        num_hidden_layers=facts.num_hidden_layers, num_mtp_layers=facts.num_mtp_layers, kv=kv,
    )


def _kv_inputs(checkpoint: Checkpoint, inputs: PlanInputs) -> tuple[PlanInputs, KvModel | None, list[str]]:
    """The KV model of the checkpoint's config; with ``max_model_len`` and ``max_seqs`` the
    KV cache is sized from it, replacing the flat ``kv_cache_bytes``."""
    kv = KvModel.from_config(checkpoint.config, KV_DTYPE_BYTES[inputs.kv_cache_dtype])
    if inputs.max_model_len is None or inputs.max_seqs is None:
        if inputs.max_model_len is not None or inputs.max_seqs is not None:
            raise PlanError("give --max-model-len and --max-seqs together to size the KV cache from the model")
        return inputs, kv, []
    if kv is None:
        raise PlanError("the config does not say enough about the attention layers (layers, KV heads, head dim) "
                        "to size the KV cache; give --kv-cache instead of --max-model-len/--max-seqs")
    sized = kv.cache_bytes(inputs.max_model_len, inputs.max_seqs)
    note = (f"KV cache {sized / GB:.3f} GB (est): {inputs.max_seqs} sequence(s) of {inputs.max_model_len} tokens "
            f"at {kv.bytes_per_seq(inputs.max_model_len) / inputs.max_model_len / 1e3:.1f} kB/token ({kv.description})")
    return replace(inputs, kv_cache_bytes=sized), kv, [note]


def _notes(groups: list[Group], checkpoint: Checkpoint, placing: _Placing, inputs: PlanInputs) -> list[str]:
    notes = []
    shortfall, host_short = max(0, placing.over_budget()), _host_shortfall(placing, inputs)
    if not any(g.kind == GroupKind.LAYER for g in groups):
        notes.append("no decoder layer stack (`...layers.N.`) found: only cold modules can be offloaded")
    if shortfall > 0:
        notes.append(
            f"infeasible: {shortfall / GB:.3f} GB more device memory is needed even with every "
            "cold module and every decoder layer on the host; use a larger card, a smaller "
            "KV cache, or a smaller checkpoint"
        )
    if host_short > 0:
        notes.append(
            f"infeasible: the plan puts {_host_bytes(placing) / GB:.3f} GB in host memory, "
            f"{host_short / GB:.3f} GB more than the {inputs.host_memory_bytes / GB:.3f} GB there is "
            "(--host-memory); the operating system and vLLM need RAM beyond that too: use a machine with "
            "more RAM, a larger card, or a smaller checkpoint"
        )
    if checkpoint.kind == "config":
        notes.append("planned from config.json alone: tensor sizes are an estimate (see `manifest_from_config`)")
    notes += checkpoint.facts.notes
    return notes


def make_plan(checkpoint: Checkpoint, inputs: PlanInputs, *, with_bulk: bool = True) -> Plan:
    """Place every group of ``checkpoint`` for ``inputs``: cold first, then hot layers.

    With speculative decoding asked for, the same input is also planned without it, and
    the plan says which is estimated faster (``alternative`` and a note)."""
    inputs.validate()
    inputs, kv, kv_notes = _kv_inputs(checkpoint, inputs)
    inputs.validate()
    plan = _place(checkpoint, inputs, kv, kv_notes, with_bulk)
    if inputs.speculative == "mtp":
        plan = _with_alternative(plan, _place(checkpoint, replace(inputs, speculative=None), kv, [], False))
    plan.validate()
    return plan


def _place(checkpoint: Checkpoint, inputs: PlanInputs, kv: KvModel | None, notes: list[str],
           with_bulk: bool) -> Plan:
    groups = group_tensors(checkpoint, inputs)
    placing = _Placing(groups, inputs.weight_budget_bytes)
    deficit = placing.over_budget()
    _place_cold(placing, inputs)
    hot = _place_hot_layers(placing, inputs)
    planned = tuple(
        GroupPlan(g.name, g.kind, g.cls, placing.where[g.name], g.reason, g.nbytes, g.layer_index,
                  g.est_read_bytes_per_step, g.mtp, g.num_tensors, g.dtype_bytes, g.shapes_digest)
        for g in groups)
    facts = checkpoint.facts
    spec_tokens = (inputs.spec_tokens or max(1, facts.num_mtp_layers)) if inputs.speculative == "mtp" else 0
    bulk = (price_bulk(groups, checkpoint, inputs, deficit, kv, spec_tokens)
            if with_bulk and deficit > 0 else None)
    plan = Plan(
        model=_planned_model(checkpoint, kv),
        inputs=inputs,
        strategy=_strategy(placing, hot, inputs),
        groups=planned,
        hot_layer_indices=tuple(hot),
        est_transient_device_bytes=placing.transient,
        bulk=bulk,
        notes=tuple(notes + _notes(groups, checkpoint, placing, inputs)),
        stored_prefetch_buffer_bytes=placing.buffers if hot else None,
    )
    if bulk is not None and bulk.fits and plan.strategy != Strategy.INFEASIBLE and \
            bulk.est.est_step_s <= plan.est.est_step_s:
        plan = replace(plan, notes=plan.notes + (
            f"selective is not estimated faster than vLLM's cpu_offload_gb={bulk.cpu_offload_gb:g} here "
            f"(est {plan.est.est_step_s * 1e3:.1f} ms against {bulk.est.est_step_s * 1e3:.1f} ms per step: its "
            "prefetch buffers and tower transient cost device memory the bulk offload does not need); "
            "consider vLLM's own offload for this card",))
    return plan


def break_even_accept_rate(spec_step_s: float, plain_step_s: float, k: int) -> float | None:
    """The acceptance rate at which ``k`` drafts per step break even (est), or None when
    even accepting every draft would not pay."""
    need = spec_step_s / plain_step_s  # tokens per step speculation must yield per sequence
    if expected_tokens_per_step(k, 1.0) < need:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens_per_step(k, mid) < need else (lo, mid)
    return hi


def _with_alternative(plan: Plan, plain: Plan) -> Plan:
    """The speculative plan, with the plan without speculation beside it and a recommendation."""
    k, a = plan.spec_tokens, plan.inputs.accept_rate
    alternative = Alternative("without speculative decoding", plain.strategy, plain.host_cold_bytes,
                              plain.host_hot_bytes, plain.hot_layer_indices, plain.est)
    faster = plan.est.est_tok_s > plain.est.est_tok_s
    even = break_even_accept_rate(plan.est.est_step_s, plain.est.est_step_s, k)
    note = (f"recommended: {'MTP speculative decoding' if faster else 'no speculative decoding'} "
            f"(est {plan.est.est_tok_s:.2f} tok/s with {k} draft token(s) at acceptance {a:.2f}, "
            f"{plain.est.est_tok_s:.2f} tok/s without; E = (1 - a^(K+1)) / (1 - a) = "
            f"{plan.est.est_tokens_per_step / plan.inputs.batch:.2f} tokens per step; "
            + (f"speculation breaks even at acceptance {even:.2f})" if even is not None
               else "speculation cannot break even here, even at acceptance 1.0)"))
    return replace(plan, alternative=alternative, notes=plan.notes + (note,))
