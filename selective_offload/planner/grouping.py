"""Step one of planning: which group each checkpoint tensor belongs to, and what a decode
step reads from it.

Groups are named by :mod:`selective_offload.names`' rule: one decoder layer (less its routed
experts), the routed experts of one MoE layer, one cold module, or one other module. Each
gets a role (hot, cold, absent) and the bytes a text decode step reads from it (est), in
model order. :mod:`.placement` then decides where each group goes; the model check
(:mod:`selective_offload.model_match`) regroups a checkpoint the same way, and compares
:func:`model_fingerprint` and each group's :func:`group_signature`, to tell whether a plan was
made for it.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Collection

from ..checkpoint import DTYPE_BITS, Checkpoint, TensorInfo
from ..names import (
    EMBED_SEGMENTS,
    MTP_SEGMENTS,
    NEVER_COLD_SEGMENTS,
    cold_prefix,
    experts_prefix,
    has_segment,
    host_table_prefix,
    layer_of,
    mlp_prefix,
)
from ..plan_format import LAYER_KINDS, GroupKind, PlanInputs, Role, Serving, experts_read_bytes
from .allocation import allocated_tensors, padding_for, post_processed_tensors, post_processing_for

_BLOCK_SEGMENTS = ("blocks", "layers", "layer")
#: Model types whose vision blocks vLLM 0.33 builds under ``@support_torch_compile`` (read
#: in its sources: Qwen2_5_VisionBlock, Qwen3_VisionBlock), which sends calls straight to
#: ``forward`` even when it does not compile: module hooks never run, so the tower is
#: onloaded whole and is budgeted whole. The glue checks the budget against what it builds.
COMPILED_BLOCK_TOWERS = frozenset({"qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"})


@dataclass(frozen=True)
class Group:
    """Parameters placed together: one decoder layer (less its routed experts), the routed
    experts of one MoE layer, one cold module, or one other module."""

    name: str
    kind: GroupKind
    role: Role
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
    #: Bytes of :attr:`nbytes` vLLM's post-processing adds on the plan's card
    #: (:attr:`GroupPlan.post_processing_bytes`): not allocated where the host CPU computes it.
    growth: int = 0

    def served_bytes(self, serving: Serving) -> int:
        """Its bytes served ``serving`` (:attr:`GroupPlan.served_bytes`): computed on the
        host, as loaded; else as vLLM post-processes it."""
        return self.nbytes - self.growth if serving == Serving.COMPUTE else self.nbytes


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


def allocated(checkpoint: Checkpoint, inputs: PlanInputs) -> dict[str, TensorInfo]:
    """The checkpoint's tensors at the bytes vLLM 0.33 allocates for them on the plan's card
    (routed experts at their kernel's padded sizes, :mod:`.allocation`; the rest as stored),
    and at what vLLM's post-processing leaves of them there (Marlin FP8's bf16 scales, OAI
    triton_kernels' float32 expert biases: :func:`.allocation.post_processed_tensors`)."""
    return allocated_and_growth(checkpoint, inputs)[0]


def allocated_and_growth(checkpoint: Checkpoint, inputs: PlanInputs) -> tuple[dict[str, TensorInfo], dict[str, int]]:
    """:func:`allocated`, and by tensor name the bytes of it that vLLM's post-processing adds
    (only the tensors it grows)."""
    loaded = allocated_tensors(checkpoint.tensors, padding_for(checkpoint.config, inputs.card, inputs.moe_setting))
    held = post_processed_tensors(loaded, post_processing_for(checkpoint.config, inputs.card, inputs.moe_setting))
    return held, {name: t.nbytes - loaded[name].nbytes for name, t in held.items() if t.nbytes != loaded[name].nbytes}


def _bucket_tensors(checkpoint: Checkpoint, inputs: PlanInputs,
                    held: dict[str, TensorInfo] | None = None) -> dict[str, _Bucket]:
    """Step 1: which group each tensor belongs to (by the naming rule), each at the bytes
    vLLM allocates for it (``held``: :func:`allocated`)."""
    facts = checkpoint.facts
    buckets: dict[str, _Bucket] = {}
    for t in (allocated(checkpoint, inputs) if held is None else held).values():
        prefix = cold_prefix(t.name, inputs.cold_segments)
        layer = layer_of(t.name)
        if layer is not None and _is_mtp_layer(layer[1], facts):  # its own embed_tokens too
            bucket = _Bucket(f"{layer[0]}.{layer[1]}", GroupKind.COMPONENT, mtp=True)
        elif prefix is not None:
            bucket = _Bucket(prefix, GroupKind.COMPONENT, mtp=has_segment(prefix, MTP_SEGMENTS))
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


def _classify(b: _Bucket, tie_word_embeddings: bool, inputs: PlanInputs) -> tuple[Role, str, int]:
    """Step 3: a group's role, the reason, and the bytes a decode step reads from it (est)."""
    nbytes = sum(t.nbytes for t in b.tensors)
    if b.kind == GroupKind.COMPONENT:
        if b.mtp and inputs.speculative == "mtp":
            return Role.HOT, "MTP speculative decoding runs the MTP head every step", nbytes
        if b.mtp:
            return Role.ABSENT, "vLLM drops mtp.* keys without MTP speculative decoding", 0
        if has_segment(b.key, EMBED_SEGMENTS) and tie_word_embeddings:
            return Role.HOT, "tie_word_embeddings: the embedding is the LM head's weight", nbytes
        if has_segment(b.key, EMBED_SEGMENTS):
            row = max((_row_bytes(t) for t in b.tensors if t.name.endswith("weight")), default=0)
            return Role.COLD, "a gather: one row per token per step", row
        return Role.COLD, "read only in prefill, once per image or clip", 0
    if b.vllm_host:
        row = max((_row_bytes(t) for t in b.tensors if t.name.endswith("weight")), default=0)
        return (Role.COLD, "n-gram embedding table: vLLM keeps it in pinned host memory itself "
                "(EngramConfig.cpu_offload) and gathers rows per token", row)
    if b.kind == GroupKind.MODULE and has_segment(b.key, NEVER_COLD_SEGMENTS):
        if tie_word_embeddings:
            return (Role.HOT, "stored although tied: counted on the device in case vLLM keeps it "
                    "apart from the embedding", nbytes)
        return Role.HOT, "one vocab x hidden GEMM per step", nbytes
    if b.kind == GroupKind.LAYER:
        return Role.HOT, "decoder layer: read every step", nbytes
    if b.kind == GroupKind.MLP:
        return Role.HOT, "dense MLP: read whole every step", nbytes
    if b.kind == GroupKind.EXPERTS:  # the read is priced with E and k in group_tensors
        return Role.HOT, "routed experts: a token reads k of E", nbytes
    return Role.HOT, "read every step", nbytes


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
        h.update(f"{t.name.removeprefix(key)}\0{t.dtype}\0{','.join(map(str, t.shape))}\n".encode())
    return dict(sorted(dtype_bytes.items())), h.hexdigest()[:16]


def group_tensors(checkpoint: Checkpoint, inputs: PlanInputs, *,
                  split_mlp: "Collection[int] | bool" = ()) -> list[Group]:
    """Group and classify every tensor of ``checkpoint`` (no placement yet), in model order.

    Each MoE layer is two groups: its routed experts and the rest of the layer.
    ``split_mlp``: the dense decoder layers (indices, or ``True``: every one) whose MLP is a
    group of its own (:func:`split_mlps`); a plan splits exactly those it computes on the host."""
    held, growth = allocated_and_growth(checkpoint, inputs)
    buckets = _bucket_tensors(checkpoint, inputs, held)
    _keep_main_stack(buckets)
    if split_mlp:
        buckets = split_mlps(buckets, split_mlp)
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
        tower = cls == Role.COLD and not has_segment(b.key, EMBED_SEGMENTS)
        largest, rest = _block_sizes(b) if tower and not whole else (0, 0)
        dtype_bytes, digest = group_signature(b.key, b.tensors)
        params = {_in_layer(t.name): t.nbytes for t in b.tensors} if b.kind in LAYER_KINDS else {}
        groups.append(Group(b.key, b.kind, cls, reason, sum(t.nbytes for t in b.tensors), len(b.tensors),
                            b.layer_index, read, largest, rest, b.mtp, dtype_bytes, digest, params, num, k,
                            b.vllm_host, sum(growth.get(t.name, 0) for t in b.tensors)))
    groups.sort(key=_model_order)
    return groups


def dense_layers(buckets: "dict[str, _Bucket]") -> set[int]:
    """Main-stack decoder layers without routed experts: the ones whose MLP may be split."""
    layers = {b.layer_index for b in buckets.values() if b.kind == GroupKind.LAYER}
    return layers - {b.layer_index for b in buckets.values() if b.kind == GroupKind.EXPERTS}


def split_mlps(buckets: "dict[str, _Bucket]", which: "Collection[int] | bool") -> "dict[str, _Bucket]":
    """The MLP tensors (:func:`selective_offload.names.mlp_prefix`) of the dense layers
    ``which`` names (``True``: all of them) moved out of their layer into an MLP group. A MoE
    layer is never split this way: its MLP is its routed-experts group."""
    dense = dense_layers(buckets)
    wanted = dense if which is True else dense & set(which)
    out: dict[str, _Bucket] = {}
    for b in buckets.values():
        if b.kind != GroupKind.LAYER or b.layer_index not in wanted:
            out[b.key] = b
            continue
        rest = _Bucket(b.key, b.kind, b.layer_index, b.mtp, vllm_host=b.vllm_host)
        out[b.key] = rest
        for t in b.tensors:
            prefix = mlp_prefix(t.name)
            if prefix is None:
                rest.tensors.append(t)
            else:
                out.setdefault(prefix, _Bucket(prefix, GroupKind.MLP, b.layer_index)).tensors.append(t)
    return out


def _in_layer(name: str) -> str:
    """A parameter's name relative to its decoder layer (``mlp.experts.down_proj``)."""
    stack, index = layer_of(name)
    return name[len(f"{stack}.{index}."):]


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
