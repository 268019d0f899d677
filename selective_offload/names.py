"""The naming rule: which module a parameter name belongs to, and whether it is cold.

One rule, used by the planner (grouping checkpoint tensors), by construction-time routing
(a vLLM layer's ``prefix``) and by the placement report (vLLM's parameter names), so the
three can never disagree about what "cold" means.

Names are matched by whole dot-separated segments: ``model.visual.blocks.0`` is under the
cold segment ``visual``; ``model.visualise`` is not (a substring match would say it is).
``lm_head`` is never cold, whatever the cold list says: the LM head has the embedding's
shape and dtype and the opposite decision (one vocab x hidden GEMM every step).

vLLM renames some checkpoint modules (``model.visual`` becomes ``visual``,
``model.language_model.layers`` becomes ``language_model.model.layers``, and q/k/v fuse
into ``qkv_proj``), so :func:`group_key` gives a key that survives those renames: the
cold segment for a cold module, the layer index for a decoder layer, and the module path
without ``model``/``language_model``/``text_model`` wrappers for anything else.
"""

from __future__ import annotations

import re
from typing import Iterable

#: Segments whose modules a text decode step does not read: the token embedding, vision
#: and audio towers and the projectors that feed their output to the language model (run
#: once per image or clip, in prefill: ``embed_vision``/``embed_audio`` are Gemma 3n's and
#: Gemma 4's), and MTP heads (``mtp`` in Qwen3.5-style checkpoints, ``mtp_layers`` in MiMo's).
DEFAULT_COLD_SEGMENTS: tuple[str, ...] = (
    "embed_tokens", "visual", "vision_tower", "vision_model", "audio_tower",
    "multi_modal_projector", "mm_projector", "connector", "embed_vision", "embed_audio",
    "mtp", "mtp_layers",
)
#: Segments that are never cold, whatever the cold list says.
NEVER_COLD_SEGMENTS: tuple[str, ...] = ("lm_head",)
#: Segments of MTP heads: absent unless MTP speculative decoding loads them.
MTP_SEGMENTS: tuple[str, ...] = ("mtp", "mtp_layers")
#: Segments of a token embedding (hot when the embeddings are tied).
EMBED_SEGMENTS: tuple[str, ...] = ("embed_tokens",)
#: Path segments vLLM adds or drops around the language model; ignored by :func:`group_key`.
WRAPPER_SEGMENTS: frozenset[str] = frozenset({"model", "language_model", "text_model"})

#: The segment that holds a MoE layer's ROUTED experts (``mlp.experts``, ``feed_forward.experts``,
#: ``block_sparse_moe.experts``): fused 3-D tensors (``experts.gate_up_proj``) or one module per
#: expert (``experts.17.gate_proj.weight``), and vLLM's FusedMoE module (``experts.w13_weight``).
#: Matched as a whole segment, so ``shared_experts`` / ``shared_expert`` (run for every token,
#: like a dense MLP) are not routed experts and stay with their layer.
ROUTED_EXPERTS_SEGMENT = "experts"
#: What vLLM's MoE runner (the module at ``...mlp.experts``) also holds that is not a routed
#: expert: the router gate, shared experts and their gate, input/output transforms, and the
#: router's score-correction bias, each the same parameter as the layer's own (listed again
#: under ``experts.`` by ``named_parameters(remove_duplicate=False)``). They stay with the layer.
NOT_ROUTED_UNDER_EXPERTS: frozenset[str] = frozenset({
    "gate", "router", "shared_expert_gate", "_shared_experts", "shared_experts", "shared_expert",
    "routed_input_transform", "routed_output_transform", "e_score_correction_bias",
})

#: Sparse-read tables vLLM 0.33 keeps in pinned host memory itself and reads rows of through
#: UVA (``EngramConfig.cpu_offload``, on by default), for the architectures its
#: ``config/engram.py`` lists: architecture -> (the config field naming the layers that have
#: one, the table module's segments as checkpoints and vLLM name it).
VLLM_HOST_TABLES: dict[str, tuple[str, tuple[tuple[str, str], ...]]] = {
    "DeepseekV41ForCausalLM": ("engram_layer_ids", (("engram", "embed"), ("engram", "embed_tokens"))),
    "Qwen4ExpForCausalLM": ("ple_layer_ids", (("ple", "ngram_embedding"),)),
    "Qwen4ExpForConditionalGeneration": ("ple_layer_ids", (("ple", "ngram_embedding"),)),
}
_HOST_TABLE_SEGMENTS = frozenset(pair for _, pairs in VLLM_HOST_TABLES.values() for pair in pairs)

#: A decoder layer: ``...layers.N.`` (the part before ``.N`` names the stack).
LAYER_RE = re.compile(r"^(?P<prefix>(?:.*\.)?layers)\.(?P<index>\d+)\.")


def segments(name: str) -> list[str]:
    return name.split(".")


def has_segment(name: str, wanted: Iterable[str]) -> bool:
    """Whether one of ``name``'s dot-separated segments is in ``wanted``."""
    return bool(set(segments(name)) & set(wanted))


def cold_prefix(name: str, cold_segments: Iterable[str]) -> str | None:
    """``name`` up to and including its first cold segment, or ``None`` when it is not cold.

    ``model.visual.blocks.0.attn`` -> ``model.visual``; ``model.visualise.x`` -> ``None``;
    anything under ``lm_head`` -> ``None``.
    """
    parts = segments(name)
    if set(parts) & set(NEVER_COLD_SEGMENTS):
        return None
    wanted = set(cold_segments) - set(NEVER_COLD_SEGMENTS)
    for i, seg in enumerate(parts):
        # mutation: segment-substring
        if seg in wanted:
            return ".".join(parts[: i + 1])
    return None


def cold_segment(name: str, cold_segments: Iterable[str]) -> str | None:
    """The cold segment ``name`` falls under (``visual``), or ``None``."""
    prefix = cold_prefix(name, cold_segments)
    return None if prefix is None else prefix.rsplit(".", 1)[-1]


def layer_of(name: str) -> tuple[str, int] | None:
    """``("model.layers", 3)`` for a name inside decoder layer 3 of that stack, else ``None``."""
    m = LAYER_RE.match(name if name.endswith(".") else name + ".")
    return None if m is None else (m.group("prefix"), int(m.group("index")))


def experts_prefix(name: str) -> str | None:
    """The routed-experts module ``name`` lies in (``model.layers.3.mlp.experts``), or ``None``.

    A routed expert is anything under a whole ``experts`` segment inside a decoder layer
    (``model.layers.3.mlp.experts.gate_up_proj``, ``...experts.17.down_proj.weight``,
    vLLM's ``...experts.w13_weight``); the group name is the module path up to that segment,
    which is also vLLM's FusedMoE ``prefix``. ``...mlp.shared_experts.*``, a dense
    ``...mlp.gate_proj`` and what vLLM's runner holds beside them
    (:data:`NOT_ROUTED_UNDER_EXPERTS`: ``...mlp.experts.gate.weight``) are not routed experts.
    """
    m = LAYER_RE.match(name if name.endswith(".") else name + ".")
    if m is None:
        return None
    head, rest = name[:m.end() - 1], segments(name[m.end():])
    # mutation: experts-not-split
    if ROUTED_EXPERTS_SEGMENT not in rest:
        return None
    at = rest.index(ROUTED_EXPERTS_SEGMENT) + 1
    # mutation: runner-gate-is-expert
    if set(rest[at:]) & NOT_ROUTED_UNDER_EXPERTS:
        return None
    return ".".join([head, *rest[:at]])


def host_table_prefix(name: str) -> str | None:
    """The n-gram / per-layer embedding table ``name`` lies in, inside a decoder layer
    (``model.layers.3.engram.embed``), or ``None``: see :data:`VLLM_HOST_TABLES`."""
    m = LAYER_RE.match(name if name.endswith(".") else name + ".")
    if m is None:
        return None
    head, rest = name[:m.end() - 1], segments(name[m.end():])
    for i in range(len(rest) - 1):
        if (rest[i], rest[i + 1]) in _HOST_TABLE_SEGMENTS:
            return ".".join([head, *rest[: i + 2]])
    return None


def group_key(name: str, cold_segments: Iterable[str]) -> tuple:
    """A rename-proof key for the plan group a parameter, module or group name belongs to."""
    table = host_table_prefix(name)
    if table is not None:  # before the cold rule: vLLM names an n-gram table ``embed_tokens``
        return ("host-table", layer_of(table)[1])
    segment = cold_segment(name, cold_segments)
    if segment is not None:
        return ("cold", segment)
    layer = layer_of(name)
    if layer is not None:
        return ("experts", layer[1]) if experts_prefix(name) is not None else ("layer", layer[1])
    return ("module", ".".join(p for p in segments(name) if p not in WRAPPER_SEGMENTS))


def group_keys(name: str, cold_segments: Iterable[str]) -> tuple[tuple, ...]:
    """The keys to look ``name``'s plan group up by, best first: a routed expert's (or an
    n-gram table's) own group, then its layer's (a plan without such groups keeps them there)."""
    key = group_key(name, cold_segments)
    return (key, ("layer", key[1])) if key[0] in ("experts", "host-table") else (key,)
