"""The naming rule: which module a parameter name belongs to, and whether it is cold.

One rule, used by the planner (grouping checkpoint tensors), by construction-time routing
(a vLLM layer's ``prefix``) and by the landing report (vLLM's parameter names), so the
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

Some renames change what that key sees: vLLM's gpt-oss names the checkpoint's
``model.embed_tokens`` ``model.embedding``, which has no cold segment. Plans speak checkpoint
names (what ``plan`` reads); when a plan meets the model, :func:`model_names` turns the
model class's own tensor-name mapping into :class:`ModelNames`, the one translation that
routing, the embedding, the experts and the report all key by.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping

from .errors import PlanError

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

#: Checkpoint names of routed experts stored fused outside an ``experts`` module, and the
#: names vLLM's model class loads them as (a suffix rename of its own ``hf_to_vllm_mapper``:
#: Granite-MoE's ``block_sparse_moe.input_linear.weight`` goes to the fused-MoE layer
#: ``block_sparse_moe.experts``). tests/unit/vllm_glue checks each against vLLM's mapper.
FUSED_EXPERTS_RENAMES: dict[str, str] = {"moe.input_linear.weight": "moe.experts.gate_up_proj",
                                         "moe.output_linear.weight": "moe.experts.down_proj"}

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
    which is also vLLM's FusedMoE ``prefix``. Experts stored fused elsewhere
    (:data:`FUSED_EXPERTS_RENAMES`: Granite-MoE's ``...block_sparse_moe.input_linear.weight`` and its
    ``weight_scale``)
    are in the group vLLM loads them into (``...block_sparse_moe.experts``). ``...mlp.shared_experts.*``, a dense
    ``...mlp.gate_proj`` and what vLLM's runner holds beside them
    (:data:`NOT_ROUTED_UNDER_EXPERTS`: ``...mlp.experts.gate.weight``) are not routed experts.
    """
    m = LAYER_RE.match(name if name.endswith(".") else name + ".")
    if m is None:
        return None
    for stored in FUSED_EXPERTS_RENAMES:
        module = stored.rsplit(".", 1)[0]  # ``moe.input_linear``
        # the module, or any tensor of it: the weight, and an FP8 checkpoint's weight_scale,
        # which vLLM maps onto the same fused experts (granitemoehybrid.py's load_weights)
        owner = name if name.endswith(module) else name.rsplit(".", 1)[0]
        if owner.endswith(module):
            return f"{owner[:-len(module)]}{module.split('.')[0]}.{ROUTED_EXPERTS_SEGMENT}"
    head, rest = name[:m.end() - 1], segments(name[m.end():])
    if ROUTED_EXPERTS_SEGMENT not in rest:
        return None
    at = rest.index(ROUTED_EXPERTS_SEGMENT) + 1
    if set(rest[at:]) & NOT_ROUTED_UNDER_EXPERTS:
        return None
    return ".".join([head, *rest[:at]])


#: The segment right under a decoder layer that holds its MLP (``model.layers.3.mlp``).
MLP_SEGMENT = "mlp"


def in_mlp(name: str) -> bool:
    """Whether ``name`` (a tensor, module or group) is a decoder layer's ``mlp`` module or under it."""
    m = LAYER_RE.match(name if name.endswith(".") else name + ".")
    return m is not None and segments(name[m.end():])[0] == MLP_SEGMENT


def mlp_prefix(name: str) -> str | None:
    """The dense MLP module ``name`` lies in (``model.layers.3.mlp``), or ``None``.

    A dense decoder layer's MLP is everything under the ``mlp`` segment right under the
    layer (``model.layers.3.mlp.gate_proj.weight``, vLLM's ``...mlp.gate_up_proj``), less
    any routed experts (:func:`experts_prefix`: a MoE layer's MLP is its experts group, and
    its router stays with the layer). The planner splits it out of its layer only when it
    serves it host-compute, and only for a layer without routed experts."""
    m = LAYER_RE.match(name if name.endswith(".") else name + ".")
    if m is None:
        return None
    rest = segments(name[m.end():])
    if len(rest) < 2 or rest[0] != MLP_SEGMENT or experts_prefix(name) is not None:
        return None
    return f"{name[:m.end() - 1]}.{MLP_SEGMENT}"


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
        if experts_prefix(name) is not None:
            return ("experts", layer[1])
        # what vLLM's MoE runner holds under ``experts`` beside them (its gate) stays with the layer
        dense = in_mlp(name) and ROUTED_EXPERTS_SEGMENT not in segments(name)
        return ("mlp", layer[1]) if dense else ("layer", layer[1])
    return ("module", ".".join(p for p in segments(name) if p not in WRAPPER_SEGMENTS))


def group_keys(name: str, cold_segments: Iterable[str]) -> tuple[tuple, ...]:
    """The keys to look ``name``'s plan group up by, best first: a routed expert's (or an
    n-gram table's) own group, then its layer's (a plan without such groups keeps them there)."""
    key = group_key(name, cold_segments)
    return (key, ("layer", key[1])) if key[0] in ("experts", "host-table", "mlp") else (key,)



def parameter_group_keys(name: str, cold_segments: Iterable[str]) -> tuple[tuple, ...]:
    """:func:`group_keys` of the module a parameter (its full name) is in. What vLLM's MoE
    runner lists again under ``experts.`` and is not a routed expert (the router's
    score-correction bias, ``...mlp.experts.e_score_correction_bias``: a leaf of the
    runner) keys by its layer, as the checkpoint's ``...mlp.gate.e_score_correction_bias`` does."""
    keys = group_keys(name.rsplit(".", 1)[0] if "." in name else name, cold_segments)
    if keys[0][0] == "experts" and experts_prefix(name) is None:
        return keys[1:]
    return keys

# --------------------------------------------------------------------------- the model's names

#: A tensor's name as the checkpoint spells it -> as the model vLLM builds names it (``None``:
#: the model does not load it). The model class's own mapping (vLLM's ``hf_to_vllm_mapper``).
NameMap = Callable[[str], "str | None"]


@dataclass(frozen=True)
class ModelNames:
    """The plan's groups as the model names them: a group's module name in the model where
    it differs from the checkpoint's, and each renamed cold segment's spelling in the model.
    Empty (the default) when the model loads the checkpoint's names as they are."""

    #: Plan group -> its module name in the model, for the groups whose name differs.
    renamed: Mapping[str, str] = field(default_factory=dict)
    #: Cold segment as the checkpoint spells it -> as the model does (``embed_tokens`` -> ``embedding``).
    segment_renames: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    #: Where the mapping came from (``GptOssForCausalLM.hf_to_vllm_mapper``), for messages.
    source: str = ""

    def model_name(self, group: str) -> str:
        return self.renamed.get(group, group)

    def segments(self, cold_segments: Iterable[str]) -> frozenset[str]:
        """The cold segments as the model spells them (the checkpoint's spelling kept too)."""
        cold = frozenset(cold_segments)
        return cold | {s for c in cold for s in self.segment_renames.get(c, ())}

    def key(self, group: str, cold_segments: Iterable[str]) -> tuple:
        """The :func:`group_key` a plan group has in the model: compare with the model's names."""
        return group_key(self.model_name(group), self.segments(cold_segments))

    def describe(self) -> str:
        """One line for the report: which plan groups the model names otherwise, and by what."""
        pairs = ", ".join(f"{g} as {m}" for g, m in sorted(self.renamed.items())
                          if group_key(g, ()) != group_key(m, ()))
        return f"{self.source} names {pairs}: the plan's groups are matched to the model through it" if pairs else ""


def _group_of(tensor: str, groups: frozenset[str]) -> str | None:
    """The longest group ``tensor`` is under (or is)."""
    parts = segments(tensor)
    return next((g for n in range(len(parts), 0, -1) if (g := ".".join(parts[:n])) in groups), None)


def _common(names: set[str]) -> str:
    split = [segments(n) for n in names]
    out = []
    for parts in zip(*split):
        if len(set(parts)) != 1:
            break
        out.append(parts[0])
    return ".".join(out)


def _unmappable(source: str, group: str, modules: set[str]) -> None:
    raise PlanError(f"{source} puts the tensors of {group} under {', '.join(sorted(modules)[:3]) or 'no module'}, "
                    "which the plan's naming rule cannot take for one group: selective-offload cannot map this "
                    "model's names; run it without a plan")


def model_names(groups: Iterable[str], tensors: Iterable[str], mapping: NameMap | None,
                cold_segments: Iterable[str], source: str = "the model") -> ModelNames:
    """Each plan group's module name in the model, from ``mapping`` applied to its tensors.

    A tensor ``G.rest`` of group ``G`` (the longest group its name is under) maps to a name;
    where that name still ends with ``rest``, the rename was of the group
    (``.embed_tokens.weight`` -> ``.embedding.weight``, ``model.visual.`` -> ``visual.``) and
    what is left is the group's module in the model. Where every tensor of the group was
    renamed inside it too (``.gate_up_proj`` -> ``.w13_weight``), the module is the name less
    as many segments as ``rest`` has. A cold group renamed off its cold segment
    gives the model's spelling of that segment. Refused with one line (the names cannot
    be mapped): a group whose tensors land where the model's names give another group's
    key (split across modules, or a tensor of a hot group under a cold segment's spelling).
    """
    cold = frozenset(cold_segments)
    if mapping is None:
        return ModelNames(source=source)
    groups = frozenset(groups)
    kept: dict[str, set[str]] = {}
    dropped: dict[str, set[str]] = {}
    mapped_names: dict[str, list[str]] = {}
    for tensor in tensors:
        group = _group_of(tensor, groups)
        mapped = mapping(tensor) if group is not None else None
        if mapped is None:
            continue
        rest = tensor[len(group) + 1:]
        mapped_names.setdefault(group, []).append(mapped)
        if not rest or mapped.endswith("." + rest):  # renamed around the group: its module is what is left
            kept.setdefault(group, set()).add(mapped[: len(mapped) - len(rest) - 1] if rest else mapped)
        else:  # renamed inside the group too: as many segments as it had below the group
            parts = segments(mapped)
            dropped.setdefault(group, set()).add(".".join(parts[: len(parts) - len(segments(rest))]))
    found = {g: kept.get(g) or dropped[g] for g in mapped_names}
    named = {g: _common(c) if len(c) > 1 else next(iter(c)) for g, c in found.items()}
    cold_groups = {g for g in named if group_key(g, cold)[0] == "cold"}
    renames: dict[str, set[str]] = {}
    for g in sorted(cold_groups):
        last = segments(named[g])[-1]
        if len(found[g]) > 1 or last in WRAPPER_SEGMENTS or last in NEVER_COLD_SEGMENTS or not named[g]:
            _unmappable(source, g, found[g])
        if cold_segment(named[g], cold) is None:
            renames.setdefault(cold_segment(g, cold), set()).add(last)
    result = ModelNames({g: m for g, m in named.items() if m != g},
                        {c: tuple(sorted(s)) for c, s in renames.items()}, source)
    model_cold = result.segments(cold)
    for g, modules in found.items():
        keys = {group_key(m, model_cold) for m in modules}
        if len(keys) > 1 or not named[g] or (g in cold_groups and next(iter(keys))[0] != "cold"):
            _unmappable(source, g, modules)
        key = result.key(g, cold)
        for m in mapped_names[g]:
            if key in group_keys(m.rsplit(".", 1)[0], model_cold) and (key[0] == "cold") == (g in cold_groups):
                continue
            got = group_key(m.rsplit(".", 1)[0], model_cold)
            if got[0] == "cold" and g not in cold_groups:
                raise PlanError(f"{source} names {m} (of the plan's {g}) under {got[1]}, the model's name of a cold "
                                "group: selective-offload cannot tell them apart in this model; plan that cold "
                                "group on the device (--cold-segments without it)")
            _unmappable(source, g, {m})
    return result


def unnamed_groups(names: ModelNames, groups: Iterable[str], module_names: Iterable[str],
                   cold_segments: Iterable[str]) -> list[str]:
    """The plan groups (outside decoder layers) whose name in the model names no module of
    the model built: a rename the model class makes that its mapping does not say."""
    model_cold = names.segments(cold_segments)
    present = {group_key(n, model_cold) for n in module_names}
    return [g for g in groups if layer_of(names.model_name(g)) is None and names.key(g, cold_segments) not in present]
