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

A MoE decoder layer reads only the routed experts its tokens are sent to (k of E per
token), so its routed experts are a group of their own, and the hot part of the deficit is
closed from a menu per layer (:func:`_place_hot`): resident, routed experts read in place
through UVA at the step's read fraction, or the whole layer prefetched.

The reference arithmetic (the bundled Qwen3.8-27B-FP8-shaped manifest on a 24 GiB card)
is asserted by ``tests/unit/planner/test_planner.py`` and shown in the README.

Every time and rate here is an estimate from bytes and bandwidths, labelled ``est_``
(:mod:`selective_offload.estimate` prices a step; :data:`~selective_offload.plan.EST_IGNORES`
says what it leaves out). benchmarks/published.py checks it against published
measurements (the README shows which points calibrate it and which validate); it prices
compute only at a matmul's best rate, which does not explain how slow NVFP4 ran on the
reference laptop: never choose a format from it.

The planner never touches tensors; it returns a :class:`~selective_offload.plan.Plan`.
"""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass, field, replace
from typing import Callable
from pathlib import Path

from .checkpoint import DTYPE_BITS, Checkpoint, TensorInfo
from .names import (
    EMBED_SEGMENTS,
    MTP_SEGMENTS,
    NEVER_COLD_SEGMENTS,
    cold_prefix,
    experts_prefix,
    has_segment,
    host_table_prefix,
    layer_of,
)
from .estimate import (
    EXPERTS_DEVICE,
    EXPERTS_UVA,
    KV_DTYPE_BYTES,
    MAX_DRAFT_TOKENS,
    AcceptanceDefault,
    ExpertsRead,
    KvModel,
    Traffic,
    acceptance_default,
    expected_tokens_per_step,
    expert_read_fraction,
    flops_per_token,
)
from .errors import PlanError
from .plan import (  # noqa: F401  (PlanInputs, Plan, EST_IGNORES: re-exported for callers)
    EST_IGNORES,
    Alternative,
    BulkBaseline,
    Estimate,
    GroupClass,
    GroupKind,
    GroupPlan,
    HOST_PLACEMENTS,
    LAYER_KINDS,
    Placement,
    Plan,
    PlanInputs,
    PlannedModel,
    Strategy,
    _read_flops,
    experts_read_bytes,
)
from .sizes import GB, GiB

_BLOCK_SEGMENTS = ("blocks", "layers", "layer")
#: Model types whose vision blocks vLLM 0.33 builds under ``@support_torch_compile`` (read
#: in its sources: Qwen2_5_VisionBlock, Qwen3_VisionBlock), which sends calls straight to
#: ``forward`` even when it does not compile: module hooks never run, so the tower is
#: onloaded whole and is budgeted whole. The glue checks the budget against what it builds.
COMPILED_BLOCK_TOWERS = frozenset({"qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"})


# --------------------------------------------------------------------------- groups


@dataclass(frozen=True)
class Group:
    """Parameters placed together: one decoder layer (less its routed experts), the routed
    experts of one MoE layer, one cold module, or one other module."""

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
    #: Bytes per parameter name relative to the decoder layer (``self_attn.qkv_proj.weight``,
    #: ``mlp.experts.gate_up_proj``): vLLM's prefetch buffers are keyed by it.
    param_bytes: dict[str, int] = field(default_factory=dict)
    #: Routed experts (E) and experts per token (k) of an experts group; 0 otherwise.
    num_experts: int = 0
    experts_per_token: int = 0
    #: A sparse-read table vLLM keeps in host memory itself: placed there whatever the deficit.
    vllm_host: bool = False


@dataclass
class _Bucket:
    """Tensors of one group while grouping: the key names the group."""

    key: str
    kind: GroupKind
    layer_index: int | None = None
    mtp: bool = False
    tensors: list[TensorInfo] = field(default_factory=list)
    vllm_host: bool = False


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
        elif layer is not None and facts.vllm_host_tables and host_table_prefix(t.name) is not None:
            bucket = _Bucket(host_table_prefix(t.name), GroupKind.MODULE, vllm_host=True)
        elif layer is not None and experts_prefix(t.name) is not None:
            bucket = _Bucket(experts_prefix(t.name), GroupKind.EXPERTS, layer[1])
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
        if b.kind in LAYER_KINDS and layer_of(b.key)[0] != main:
            b.kind, b.layer_index = GroupKind.MODULE, None


def _experts_shape(b: _Bucket, facts) -> tuple[int, int, list[str]]:
    """E and k of a routed-experts group. E from the headers when they show it (the first
    dimension of fused 3-D tensors, or the number of per-expert modules), else the config;
    k from the config (``num_experts_per_tok`` and its aliases). Without k, every expert is
    priced as read (what a whole-layer price assumes), with a note."""
    notes = []
    fused = [t.shape[0] for t in b.tensors if len(t.shape) >= 3]
    indices = {int(parts[0]) for t in b.tensors
               if (parts := t.name[len(b.key) + 1:].split("."))[0].isdigit()}
    num = max(fused) if fused else (max(indices) + 1 if indices else facts.num_experts)
    if not num:
        num = 1
        notes.append(f"{b.key}: the number of routed experts is neither in the tensors nor in the config; "
                     "priced as one expert read whole")
    k = facts.experts_per_token
    if k is None:
        k = num
        notes.append(f"the config names no experts per token (num_experts_per_tok or an alias): the routed experts "
                     f"of {b.key} are priced as read whole every step")
    elif k > num:
        notes.append(f"{b.key}: the config routes each token to {k} experts but the layer has {num}: priced as "
                     "reading all of them")
        k = num
    return num, k, notes


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
    if b.vllm_host:
        row = max((_row_bytes(t) for t in b.tensors if t.name.endswith("weight")), default=0)
        return (GroupClass.COLD, "n-gram embedding table: vLLM keeps it in pinned host memory itself "
                "(EngramConfig.cpu_offload) and gathers rows per token", row)
    if b.kind == GroupKind.MODULE and has_segment(b.key, NEVER_COLD_SEGMENTS):
        if tie_word_embeddings:
            return (GroupClass.HOT, "stored although tied: counted on the device in case vLLM keeps it "
                    "apart from the embedding", nbytes)
        return GroupClass.HOT, "one vocab x hidden GEMM per step", nbytes
    if b.kind == GroupKind.LAYER:
        return GroupClass.HOT, "decoder layer: read every step", nbytes
    if b.kind == GroupKind.EXPERTS:  # the read is priced with E and k in group_tensors
        return GroupClass.HOT, "routed experts: a token reads k of E", nbytes
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


def group_tensors(checkpoint: Checkpoint, inputs: PlanInputs, *, split_experts: bool = True) -> list[Group]:
    """Group and classify every tensor of ``checkpoint`` (no placement yet), in model order.

    Each MoE layer is two groups: its routed experts and the rest of the layer.
    ``split_experts=False`` keeps them as one (how plans before format v3 grouped them)."""
    buckets = _bucket_tensors(checkpoint, inputs)
    if not split_experts:
        buckets = _merge_experts(buckets)
    _keep_main_stack(buckets)
    facts = checkpoint.facts
    whole = facts.model_type in COMPILED_BLOCK_TOWERS
    groups = []
    for b in buckets.values():
        cls, reason, read = _classify(b, facts.tie_word_embeddings, inputs)
        num = k = 0
        if b.kind == GroupKind.EXPERTS:
            num, k, _ = _experts_shape(b, facts)
            read = experts_read_bytes(read, num, k)
            reason = f"routed experts: a token reads {k} of {num} (est: uniform routing)"
        tower = cls == GroupClass.COLD and not has_segment(b.key, EMBED_SEGMENTS)
        # mutation: compiled-tower-budgeted-by-blocks
        largest, rest = _block_sizes(b) if tower and not whole else (0, 0)
        dtype_bytes, digest = group_signature(b.key, b.tensors)
        params = {_in_layer(t.name): t.nbytes for t in b.tensors} if b.kind in LAYER_KINDS else {}
        groups.append(Group(b.key, b.kind, cls, reason, sum(t.nbytes for t in b.tensors), len(b.tensors),
                            b.layer_index, read, largest, rest, b.mtp, dtype_bytes, digest, params, num, k,
                            b.vllm_host))
    groups.sort(key=_model_order)
    return groups


def _in_layer(name: str) -> str:
    """A parameter's name relative to its decoder layer (``mlp.experts.down_proj``)."""
    stack, index = layer_of(name)
    return name[len(f"{stack}.{index}."):]


def _merge_experts(buckets: dict[str, _Bucket]) -> dict[str, _Bucket]:
    """Routed experts back into their layer's group (the grouping of v2 and older plans)."""
    out: dict[str, _Bucket] = {}
    for b in buckets.values():
        if b.kind == GroupKind.EXPERTS:
            stack, index = layer_of(b.key)
            target = out.setdefault(f"{stack}.{index}", _Bucket(f"{stack}.{index}", GroupKind.LAYER, index))
        else:
            target = out.setdefault(b.key, _Bucket(b.key, b.kind, b.layer_index, b.mtp, vllm_host=b.vllm_host))
        target.tensors.extend(b.tensors)
    return out


def experts_notes(checkpoint: Checkpoint, inputs: PlanInputs) -> list[str]:
    """What the planner assumed about the routed experts (E or k missing), once each."""
    facts, notes = checkpoint.facts, []
    for b in _bucket_tensors(checkpoint, inputs).values():
        if b.kind == GroupKind.EXPERTS:
            notes += _experts_shape(b, facts)[2]
    return list(dict.fromkeys(notes))


def _model_order(g: Group) -> tuple:
    """Embedding, then the decoder layers in order (each layer before its routed experts),
    then the rest by name (stable)."""
    if g.kind in LAYER_KINDS:
        return (1, g.layer_index, g.kind != GroupKind.LAYER, g.name)
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
        self.where = {g.name: Placement.ABSENT if g.cls == GroupClass.ABSENT else
                      Placement.HOST_COLD if g.vllm_host else Placement.DEVICE for g in self.groups}

    def over_budget(self) -> int:
        """Device bytes (resident, tower transient, prefetch buffers) above the budget."""
        device = sum(g.nbytes for g in self.groups if self.where[g.name] == Placement.DEVICE)
        return device + self.transient + self.buffers - self.budget


def _place_cold(p: _Placing, inputs: PlanInputs) -> None:
    """Cold modules to the host, largest first, until the deficit closes (or all of them)."""
    for g in sorted((g for g in p.groups if g.cls == GroupClass.COLD and not g.vllm_host), key=lambda g: -g.nbytes):
        if p.over_budget() <= 0 and not inputs.all_cold:
            break
        p.where[g.name] = Placement.HOST_COLD
        p.transient = max(p.transient, tower_transient_bytes(g))


def tower_transient_bytes(g: Group) -> int:
    """Device bytes a cold group on the host holds while it runs: the on-demand wrapper
    holds about two blocks and the non-block rest of a tower (the whole of a tower without
    blocks); an embedding is gathered row by row and holds nothing, and so is an n-gram
    table vLLM keeps on the host itself."""
    if g.vllm_host:
        return 0
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
    # mutation: hybrid-buffers-largest-only
    return prefetch_step * sum(largest.values())


def _layer_units(groups: list[Group]) -> list[list[Group]]:
    """Decoder layers in stack order, each with its routed-experts group (if any): what the
    prefetch offloader copies as one."""
    by_index: dict[int, list[Group]] = {}
    for g in groups:
        if g.kind in LAYER_KINDS:
            by_index.setdefault(g.layer_index, []).append(g)
    return [sorted(by_index[i], key=lambda g: g.kind != GroupKind.LAYER) for i in sorted(by_index)
            if any(g.kind == GroupKind.LAYER for g in by_index[i])]


def _prefetch_fewest(p: _Placing, units: list[list[Group]], inputs: PlanInputs) -> list[int]:
    """The fewest spread-out decoder layers of ``units`` that close the rest of the deficit
    (all of them when none do: the plan is then infeasible), net of the prefetch buffers
    they need. A layer goes whole: the offloader copies its routed experts with it."""
    p.buffers = 0
    remaining = p.over_budget()
    if remaining <= 0 or not units:
        return []
    buffers = prefetch_buffer_bytes([g for unit in units for g in unit], inputs.prefetch_step)
    chosen = next((c for c in (_spread(n, len(units)) for n in range(1, len(units) + 1))
                   if sum(g.nbytes for i in c for g in units[i]) - buffers >= remaining),
                  list(range(len(units))))
    for i in chosen:
        # mutation: prefetch-leaves-experts
        for g in units[i]:
            p.where[g.name] = Placement.HOST_HOT
    # The candidates' buffers decided how many layers go (never fewer than needed); the
    # plan states what vLLM will allocate: slots for the chosen layers' parameters.
    p.buffers = prefetch_buffer_bytes([g for i in chosen for g in units[i]], inputs.prefetch_step)
    return [units[i][0].layer_index for i in chosen]


def _place_hot(p: _Placing, inputs: PlanInputs, step_s: Callable[[_Placing], float], tokens: int) -> list[int]:
    """Close the rest of the deficit (after the cold set) at the least est step time.

    The menu, per decoder layer: resident; a MoE layer's routed experts in host memory,
    read in place through UVA (a step pays, in line, the read fraction of their bytes over
    the link instead of from VRAM); or the whole layer, experts included, through the
    prefetch offloader (every byte crosses the link each step, overlapped with the compute
    of the layers before it, plus device buffers of a layer's size).

    Why this search finds the cheapest combination the menu allows (under the step model):
    a UVA read costs the same per byte wherever it sits in the stack (it is paid in line,
    so order does not matter) and is cheapest per byte for the layers with the smallest
    read fraction, so for a given number ``n`` of UVA layers the best choice is the ``n``
    with the smallest fraction (largest first among equals, to free the most); prefetching
    then takes the fewest spread-out layers of the rest, as for a dense model. Each ``n``
    from 0 to every MoE layer is priced with the whole step model (``step_s``), and the
    fastest placement that fits wins (the one with the smallest shortfall when none fits).
    Once experts alone close the deficit, more of them only add link time: the search stops.
    ``tokens``: the tokens one step serves (batch x tokens verified per sequence).
    """
    units = _layer_units(p.groups)
    if p.over_budget() <= 0 or not units:
        return []
    moe = sorted((u for u in units if len(u) > 1),
                 key=lambda u: (expert_read_fraction(u[1].num_experts, u[1].experts_per_token, tokens),
                                -u[1].nbytes, u[0].layer_index))
    start = dict(p.where)
    best: tuple[tuple, dict[str, Placement], int, list[int]] | None = None
    for n in range(len(moe) + 1):
        p.where = dict(start)
        # mutation: uva-not-in-menu
        for unit in moe[:n]:
            p.where[unit[1].name] = Placement.HOST_UVA
        uva = {u[0].layer_index for u in moe[:n]}
        hot = _prefetch_fewest(p, [u for u in units if u[0].layer_index not in uva], inputs)
        over = p.over_budget()
        key = (over > 0, max(over, 0), step_s(p) if over <= 0 else 0.0, n)
        if best is None or key < best[0]:
            best = (key, dict(p.where), p.buffers, hot)
        if over <= 0 and not hot:
            break
    _, p.where, p.buffers, hot = best
    return hot


def _host_bytes(p: _Placing) -> int:
    return sum(g.nbytes for g in p.groups if p.where[g.name] in HOST_PLACEMENTS)


def _host_shortfall(p: _Placing, inputs: PlanInputs) -> int:
    return 0 if inputs.host_memory_bytes is None else max(0, _host_bytes(p) - inputs.host_memory_bytes)


def _strategy(p: _Placing, hot: list[int], inputs: PlanInputs) -> Strategy:
    if p.over_budget() > 0 or _host_shortfall(p, inputs):
        return Strategy.INFEASIBLE
    if hot or any(w == Placement.HOST_UVA for w in p.where.values()):  # hot bytes on the host
        return Strategy.HOT_OFFLOAD
    if any(w == Placement.HOST_COLD for w in p.where.values()):
        return Strategy.COLD_OFFLOAD
    return Strategy.RESIDENT


def price_bulk(groups: list[Group], checkpoint: Checkpoint, inputs: PlanInputs,
               deficit_bytes: int, kv: KvModel | None = None, spec_tokens: int = 0,
               params: tuple[str, ...] = ()) -> BulkBaseline:
    """What vLLM's ``cpu_offload_gb`` would take: whole parameters of the decoder layers,
    in model order, until the GiB budget is met; with ``params`` (vLLM's
    ``cpu_offload_params``, such as ``("experts",)``) only the parameters whose name holds
    one of them as whole segments, as vLLM matches them. It is UVA zero-copy: the kernels
    read the host parameters in place every step, so a host-resident routed-expert tensor
    crosses the link only for the experts the step routes to (the plan's read fraction)."""
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
    experts_per_layer: dict[int, int] = {}
    for index in sorted(by_layer):
        for t in sorted(by_layer[index], key=lambda t: t.name):
            if offloaded >= max_bytes:
                break
            # mutation: segment-baseline-all-params
            if params and not any(f".{p}." in f".{t.name}." for p in params):  # vLLM's segment match
                continue
            offloaded += t.nbytes
            # mutation: bulk-experts-read-whole
            into = experts_per_layer if experts_prefix(t.name) is not None else per_layer
            into[index] = into.get(index, 0) + t.nbytes
            count += 1
            if not touched or touched[-1] != index:
                touched.append(index)
    # vLLM keeps its own host tables (n-gram embeddings) on the host in this run too.
    loaded = sum(g.nbytes for g in groups if g.cls != GroupClass.ABSENT and not g.vllm_host)
    device = loaded - offloaded
    return BulkBaseline(
        cpu_offload_gb=gb, offloaded_bytes=offloaded, offloaded_tensors=count,
        layers_touched=tuple(touched), device_bytes=device, cpu_offload_params=tuple(params),
        fits=device <= inputs.weight_budget_bytes,
        est=Estimate.of(_bulk_traffic(groups, per_layer, inputs, experts_per_layer), inputs, kv, spec_tokens,
                        pipelined=False),
    )


def _experts_reads(groups: list[Group], host_by_layer: dict[int, int]) -> tuple[ExpertsRead, ...]:
    """Each MoE layer's routed experts as the step model reads them: ``host_by_layer`` of
    their bytes from host memory through UVA, the rest from VRAM."""
    stack = sorted(g.layer_index for g in groups if g.kind == GroupKind.LAYER)
    position = {index: i for i, index in enumerate(stack)}
    reads = []
    for g in groups:
        if g.kind != GroupKind.EXPERTS or g.layer_index not in position:
            continue
        host = min(g.nbytes, host_by_layer.get(g.layer_index, 0))
        flops = flops_per_token(g.dtype_bytes) * expert_read_fraction(g.num_experts, g.experts_per_token, 1)
        for nbytes, where in ((g.nbytes - host, EXPERTS_DEVICE), (host, EXPERTS_UVA)):
            if nbytes:
                reads.append(ExpertsRead(position[g.layer_index], nbytes, g.num_experts, g.experts_per_token, where,
                                         flops * nbytes / g.nbytes))
    return tuple(reads)


def _bulk_traffic(groups: list[Group], uva_by_layer: dict[int, int], inputs: PlanInputs,
                  uva_experts_by_layer: dict[int, int] | None = None) -> Traffic:
    """Bulk offload's bytes per pass: everything on the device but the UVA bytes, which the
    kernels read over the link in line (the embedding stays on the device); routed experts
    on the host are read at the step's read fraction."""
    stack = sorted((g for g in groups if g.kind == GroupKind.LAYER), key=lambda g: g.layer_index)
    layers = tuple((g.est_read_bytes_per_step - uva_by_layer.get(g.layer_index, 0), False) for g in stack)
    experts = _experts_reads(groups, uva_experts_by_layer or {})
    other = row = draft = 0
    other_flops = draft_flops = 0.0
    for g in groups:
        if g.kind in LAYER_KINDS or g.cls == GroupClass.ABSENT:
            continue
        if g.mtp:
            draft += g.nbytes
            draft_flops += flops_per_token(g.dtype_bytes)
        elif has_segment(g.name, EMBED_SEGMENTS) and g.cls == GroupClass.COLD:
            row += g.est_read_bytes_per_step
        else:
            other += g.est_read_bytes_per_step
            other_flops += _read_flops(g.dtype_bytes, g.est_read_bytes_per_step, g.nbytes)
    head = sum(g.est_read_bytes_per_step for g in groups if has_segment(g.name, NEVER_COLD_SEGMENTS))
    head_flops = sum(flops_per_token(g.dtype_bytes) for g in groups if has_segment(g.name, NEVER_COLD_SEGMENTS))
    speculating = inputs.speculative == "mtp"
    return Traffic(layers, other, 0, row, sum(uva_by_layer.values()), (draft + head) if speculating else 0, experts,
                   tuple(flops_per_token(g.dtype_bytes) for g in stack), other_flops,
                   (draft_flops + head_flops) if speculating else 0.0)


def _planned_model(checkpoint: Checkpoint, kv: KvModel | None) -> PlannedModel:
    facts = checkpoint.facts
    # A local checkpoint is named absolutely: the plan is used from other directories, and
    # enable(plan) finds the model (and checks the plan against it) by this path.
    source = checkpoint.source
    if checkpoint.kind == "safetensors" and Path(source).exists():
        # mutation: relative-model-source
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
    notes += experts_notes(checkpoint, inputs)
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
    family = acceptance_default(checkpoint.facts.model_type)
    if inputs.accept_rate is None:
        # mutation: family-acceptance-ignored
        inputs = replace(inputs, accept_rate=family.default)
        if inputs.speculative == "mtp":
            kv_notes.append(f"acceptance {family.default:.2f}: the published rate for the {family.family} "
                            f"({family.source}); give --accept-rate to use yours")
    inputs.validate()
    plan = _place(checkpoint, inputs, kv, kv_notes, with_bulk)
    if inputs.speculative == "mtp":
        plain = _place(checkpoint, replace(inputs, speculative=None, spec_tokens=None), kv, [], False)
        plan = _with_alternative(_with_draft_tokens(plan, plain, family), plain)
    plan.validate()
    return plan


def _place(checkpoint: Checkpoint, inputs: PlanInputs, kv: KvModel | None, notes: list[str],
           with_bulk: bool) -> Plan:
    groups = group_tensors(checkpoint, inputs)
    placing = _Placing(groups, inputs.weight_budget_bytes)
    deficit = placing.over_budget()
    model = _planned_model(checkpoint, kv)

    def placed(p: _Placing, hot: list[int], **extra) -> Plan:
        return Plan(
            model=model, inputs=inputs, strategy=_strategy(p, hot, inputs),
            groups=tuple(GroupPlan(g.name, g.kind, g.cls, p.where[g.name], g.reason, g.nbytes, g.layer_index,
                                   g.est_read_bytes_per_step, g.mtp, g.num_tensors, g.dtype_bytes, g.shapes_digest,
                                   g.num_experts, g.experts_per_token) for g in groups),
            hot_layer_indices=tuple(hot), est_transient_device_bytes=p.transient,
            stored_prefetch_buffer_bytes=p.buffers if hot else None, **{"bulk": None, **extra})

    def step_s(p: _Placing) -> float:
        hot = sorted(g.layer_index for g in groups if g.kind == GroupKind.LAYER and p.where[g.name] == Placement.HOST_HOT)
        return placed(p, hot).est.est_step_s

    facts = checkpoint.facts
    spec_tokens = (inputs.spec_tokens or max(1, facts.num_mtp_layers)) if inputs.speculative == "mtp" else 0
    _place_cold(placing, inputs)
    hot = _place_hot(placing, inputs, step_s, inputs.batch * (1 + spec_tokens))
    bulk = (price_bulk(groups, checkpoint, inputs, deficit, kv, spec_tokens)
            if with_bulk and deficit > 0 else None)
    # MoE: vLLM's segment selection of the routed experts is the run a user would try next.
    segments = (price_bulk(groups, checkpoint, inputs, deficit, kv, spec_tokens, params=("experts",))
                if bulk is not None and any(g.kind == GroupKind.EXPERTS for g in groups) else None)
    plan = placed(placing, hot, bulk=bulk, bulk_segments=segments,
                  notes=tuple(notes + _notes(groups, checkpoint, placing, inputs)))
    if inputs.compute_tflops:
        plan = replace(plan, notes=plan.notes + (compute_note(plan.est, inputs.compute_tflops),))
    return replace(plan, notes=plan.notes + tuple(_baseline_notes(plan)))


#: Step times within this share of each other are a tie (the estimate is not finer).
TIE = 1e-3


def _baseline_notes(plan: Plan) -> list[str]:
    """A note for each vLLM baseline the plan does not beat, saying why it may not."""
    notes = []
    for baseline in plan.baselines:
        if not baseline.fits or plan.strategy == Strategy.INFEASIBLE:
            continue
        mine, theirs = plan.est.est_step_s, baseline.est.est_step_s
        if theirs > mine * (1 + TIE):
            continue
        why = []
        if plan.hot_layer_indices or plan.est_transient_device_bytes:
            why.append("its prefetch buffers and tower transient cost device memory the bulk offload does not need")
        if plan.host_uva_bytes:
            why.append("a layer's routed experts go to the host whole, where vLLM's budget takes single tensors")
        times = f"est {mine * 1e3:.1f} ms against {theirs * 1e3:.1f} ms per step"
        if theirs >= mine * (1 - TIE):
            notes.append(f"selective matches vLLM's {baseline.label} here ({times}): both read the same bytes over "
                         "the link")
        else:
            notes.append(f"selective is not estimated faster than vLLM's {baseline.label} here ({times}"
                         + (f": {'; '.join(why)}" if why else "") + "); consider vLLM's own offload for this card")
    return notes


def compute_note(est: Estimate, tflops: float) -> str:
    """What bounds the step, in one line for the plan's notes (est): its FLOPs at the matmul
    rate, its VRAM reads, or its link time, whichever is largest."""
    compute, vram, link = est.est_compute_s_per_step, est.est_vram_s_per_step, est.est_link_s_per_step
    if compute > max(vram, link):
        kind = ("compute-bound: layers are priced at their compute, and fewer host bytes or a faster link will "
                "not speed it up as much as the bytes suggest")
    elif link >= vram:
        kind = "link-bound: the host bytes decide the step"
    else:
        kind = "memory-bound: the VRAM reads decide the step"
    return (f"{kind} (the step's FLOPs take {compute * 1e3:.1f} ms at {tflops:g} TFLOP/s, its VRAM reads "
            f"{vram * 1e3:.1f} ms, the link {link * 1e3:.1f} ms; est)")


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
                              plain.host_hot_bytes, plain.hot_layer_indices, plain.est, plain.host_uva_bytes)
    faster = plan.est.est_tok_s > plain.est.est_tok_s
    even = break_even_accept_rate(plan.est.est_step_s, plain.est.est_step_s, k)
    note = (f"recommended: {'MTP speculative decoding' if faster else 'no speculative decoding'} "
            f"(est {plan.est.est_tok_s:.2f} tok/s with {k} draft token(s) at acceptance {a:.2f}, "
            f"{plain.est.est_tok_s:.2f} tok/s without; E = (1 - a^(K+1)) / (1 - a) = "
            f"{plan.est.est_tokens_per_step / plan.inputs.batch:.2f} tokens per step; "
            + (f"speculation breaks even at acceptance {even:.2f})" if even is not None
               else "speculation cannot break even here, even at acceptance 1.0)"))
    return replace(plan, alternative=alternative, notes=plan.notes + (note,))


# --------------------------------------------------------------------------- draft tokens


def spec_estimate(plan: Plan, k: int, accept_rate: float) -> Estimate:
    """The speculative placement's step with ``k`` draft tokens at ``accept_rate`` (est): the
    placement does not depend on K (the MTP head is loaded either way), only the step does."""
    inputs = replace(plan.inputs, spec_tokens=k, accept_rate=accept_rate)
    return Estimate.of(plan.traffic(), inputs, plan.model.kv, k, pipelined=True)


def best_draft_tokens(plan: Plan, plain: Plan, accept_rate: float) -> tuple[int, float]:
    """The number of draft tokens (0: no speculation, the plain placement) with the highest
    est tok/s at ``accept_rate``, and that rate; ties go to fewer drafts."""
    best = (0, plain.est.est_tok_s)
    # mutation: draft-tokens-fixed
    for k in range(1, MAX_DRAFT_TOKENS + 1):
        tok_s = spec_estimate(plan, k, accept_rate).est_tok_s
        if tok_s > best[1] * (1 + 1e-9):
            best = (k, tok_s)
    return best


def draft_flips(plan: Plan, plain: Plan, accept_rate: float) -> tuple[float | None, int, float | None, int]:
    """Where the recommendation changes around ``accept_rate``: the acceptance below which
    (and the K then best), and above which (and the K then best); ``None`` when it does not
    change in that direction. Found on a 0.01 grid, then bisected to 0.001."""
    k_here = best_draft_tokens(plan, plain, accept_rate)[0]

    def k_at(a: float) -> int:
        return best_draft_tokens(plan, plain, a)[0]

    def edge(inside: float, outside: float) -> float:
        for _ in range(10):
            mid = (inside + outside) / 2
            inside, outside = (mid, outside) if k_at(mid) == k_here else (inside, mid)
        return round((inside + outside) / 2, 3)

    below = above = None
    k_below = k_above = k_here
    steps = [round(accept_rate - 0.01 * i, 6) for i in range(1, 101)]
    for a in (x for x in steps if x >= 0.0):
        if k_at(a) != k_here:
            below = edge(min(a + 0.01, accept_rate), a)
            k_below = k_at(a)
            break
    for a in (round(accept_rate + 0.01 * i, 6) for i in range(1, 101)):
        if a >= 1.0:
            break
        if k_at(a) != k_here:
            above = edge(max(a - 0.01, accept_rate), a)
            k_above = k_at(a)
            break
    return below, k_below, above, k_above


def _with_draft_tokens(plan: Plan, plain: Plan, family: AcceptanceDefault) -> Plan:
    """Recommend K for the step this plan prices, say where the recommendation flips, and
    show est tok/s across the family's published acceptance range. When K was not given,
    the plan takes the recommended K (at least 1: it was asked to speculate)."""
    a = plan.inputs.accept_rate
    k_best, best_tok_s = best_draft_tokens(plan, plain, a)
    if plan.inputs.spec_tokens is None and k_best:
        plan = replace(plan, inputs=replace(plan.inputs, spec_tokens=k_best))
    below, k_below, above, k_above = draft_flips(plan, plain, a)

    def name(k: int) -> str:
        return "no speculation" if k == 0 else f"K={k}"

    flips = []
    if below is not None:
        flips.append(f"{name(k_below)} below acceptance {below:.3f}")
    if above is not None:
        flips.append(f"{name(k_above)} above {above:.3f}")
    note = (f"draft tokens: {name(k_best)} is estimated fastest at acceptance {a:.2f} (est {best_tok_s:.2f} tok/s; "
            f"K = 1..{MAX_DRAFT_TOKENS} considered on this placement)"
            + (f"; the recommendation flips to {' and to '.join(flips)}" if flips
               else "; it holds across every acceptance from 0 to 1"))
    rates = sorted({family.low, a, family.high})
    table = "; ".join(
        f"K={k}: " + "/".join(f"{spec_estimate(plan, k, r).est_tok_s:.2f}" for r in rates)
        for k in range(1, MAX_DRAFT_TOKENS + 1))
    span = (f"est tok/s at acceptance {'/'.join(f'{r:.2f}' for r in rates)} (the {family.family}'s published "
            f"range and this plan's rate): {table}; without speculation {plain.est.est_tok_s:.2f}")
    return replace(plan, notes=plan.notes + (note, span))
