"""The ``config.json`` facts the planner uses, resolved once: :class:`ModelFacts`.

Every source of a checkpoint (shard headers, a manifest, a config alone) carries the raw
config; the planner needs a few numbers from it (layers, sizes, experts, the MTP head) and
one decision (is the embedding tied to the LM head?), which families spell under many keys
and in two places (``text_config`` and the top level). This module holds those key lists
and the resolution, so the readers (:mod:`.headers`, :mod:`.manifest`) and the config-only
build (:mod:`.from_config`) all give the planner the same facts. It reads configs only:
no files, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from ..names import VLLM_HOST_TABLES
from ..tensors import MAX_DIM

#: Routed experts per MoE layer (E) and experts each token is routed to (k), as families name them.
_NUM_EXPERTS_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_routed_experts")
_EXPERTS_PER_TOKEN_KEYS = ("num_experts_per_tok", "experts_per_token", "num_experts_per_token", "top_k_experts",
                           "moe_top_k", "moe_topk", "top_k")
_MTP_KEYS = ("num_nextn_predict_layers", "mtp_num_hidden_layers", "num_mtp_layers", "n_mtp_layers", "mtp_num_layers")


@dataclass(frozen=True)
class ModelFacts:
    """The ``config.json`` facts the planner uses. Unknown values are ``None``.

    Whether the embedding is tied to the LM head decides whether it is cold or hot, so it
    is resolved as vLLM resolves it: the language model's own config (``text_config``)
    first, then the top level; when neither states it, the checkpoint decides (no
    ``lm_head`` tensor: the embedding is the head), or, planning from a config alone,
    transformers' default for that architecture. A checkpoint that says untied but stores
    no ``lm_head`` is tied whatever it says (the head must come from somewhere).
    """

    architectures: tuple[str, ...] = ()
    model_type: str | None = None
    tie_word_embeddings: bool = False
    num_hidden_layers: int | None = None
    hidden_size: int | None = None
    vocab_size: int | None = None
    has_vision: bool = False
    has_audio: bool = False
    num_mtp_layers: int = 0
    #: Routed experts per MoE layer (E) and top-k (k), when the config declares them.
    num_experts: int | None = None
    experts_per_token: int | None = None
    #: The config declares sparse-read tables vLLM keeps in host memory itself (n-gram /
    #: per-layer embeddings, ``names.VLLM_HOST_TABLES``).
    vllm_host_tables: bool = False
    #: Where the tie flag came from (``text_config``, ``config``, ``checkpoint``, ``default``).
    tie_source: str = "default"
    notes: tuple[str, ...] = ()

    @classmethod
    def from_config(cls, config: Mapping[str, Any], tensor_names: Iterable[str] | None = None,
                    resolved: Any = None) -> "ModelFacts":
        """Facts from the raw ``config.json`` (and, when given, the checkpoint's tensor
        names, or transformers' resolved config object for defaults it does not state)."""
        text = config.get("text_config") or {}
        if not isinstance(text, Mapping):
            text = {}
        resolved_text = resolved.get_text_config() if resolved is not None else None

        def pick(*keys: str) -> Any:
            # The text model's own value wins over the top level: multimodal configs keep
            # the language model's sizes (and often its tie flag) under text_config.
            for source in (text, config):
                for key in keys:
                    if source.get(key) is not None:
                        return source[key]
            for obj in (resolved_text, resolved):
                for key in keys:
                    if obj is not None and getattr(obj, key, None) is not None:
                        return getattr(obj, key)
            return None

        tie, source, notes = _resolve_tie(text, config, tensor_names, resolved_text, resolved)
        architectures = config.get("architectures")
        model_type = config.get("model_type")
        return cls(
            architectures=tuple(a for a in architectures if isinstance(a, str))
            if isinstance(architectures, list) else (),
            model_type=model_type if isinstance(model_type, str) else None,
            tie_word_embeddings=tie,
            num_hidden_layers=_count(pick("num_hidden_layers", "num_layers", "n_layer")),
            hidden_size=_count(pick("hidden_size", "d_model", "n_embd")),
            vocab_size=_count(pick("vocab_size")),
            has_vision=any(k in config for k in ("vision_config", "visual", "vision_tower")),
            has_audio="audio_config" in config,
            num_mtp_layers=_count(pick(*_MTP_KEYS)) or 0,
            num_experts=_positive_int(pick(*_NUM_EXPERTS_KEYS)),
            experts_per_token=_positive_int(pick(*_EXPERTS_PER_TOKEN_KEYS)),
            vllm_host_tables=_declares_host_tables(architectures, pick),
            tie_source=source,
            notes=tuple(notes),
        )


def _declares_host_tables(architectures: Any, pick) -> bool:
    arch = architectures[0] if isinstance(architectures, list) and architectures else None
    field = VLLM_HOST_TABLES.get(arch, (None,))[0] if isinstance(arch, str) else None
    return bool(field and pick(field))


def _positive_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 < value <= MAX_DIM else None


def _count(value: Any) -> int | None:
    """A count from a config (layers, sizes): a whole number from 0 up, else unknown (a
    hand-edited config's ``"32"`` or ``1e400`` must not reach arithmetic)."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_DIM:
        return value
    return None


def _resolve_tie(text: Mapping, config: Mapping, tensor_names, resolved_text, resolved) -> tuple[bool, str, list[str]]:
    stated = next(((bool(src["tie_word_embeddings"]), label) for src, label in
                   ((text, "text_config"), (config, "config"))
                   if src.get("tie_word_embeddings") is not None), None)
    if tensor_names is not None:
        names = list(tensor_names)
        has_head = any("lm_head" in n.split(".") for n in names)
        has_embed = any("embed_tokens" in n.split(".") for n in names)
        if stated is None:
            return (not has_head and has_embed), "checkpoint", []
        if not stated[0] and has_embed and not has_head:
            return True, "checkpoint", ["the config says the embeddings are not tied, but the checkpoint stores no "
                                        "lm_head: the embedding is the LM head's weight (tied)"]
        return stated[0], stated[1], []
    if stated is not None:
        return stated[0], stated[1], []
    for obj, label in ((resolved_text, "transformers' default (text config)"), (resolved, "transformers' default")):
        value = getattr(obj, "tie_word_embeddings", None) if obj is not None else None
        if value is not None:
            return bool(value), label, []
    return False, "default", []
