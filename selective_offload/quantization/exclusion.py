"""Which parameters a method leaves alone, and which config group quantizes the rest.

One set of matching rules for every method, because checkpoints mix the forms (a ModelOpt
wildcard next to a compressed-tensors ``re:`` entry in one list) and the names a config
uses are not always the parameter's own: fused experts are listed per expert. The
dispatcher asks these questions before it hands a parameter to a layout; no layout
matches names itself.

Exclusion lists
    ``modules_to_not_convert``, ``ignore``, ``ignored_layers``, ``llm_int8_skip_modules``
    and ModelOpt's ``exclude_modules``. An entry is matched against the parameter's module
    name (and, for fused experts, the per-expert names a checkpoint uses, e.g.
    ``model.layers.3.mlp.experts.0.gate_proj`` for ``...experts.gate_up_proj``):

    * ``re:PATTERN``: a regular expression matched at the start of the name (as
      compressed-tensors does);
    * an entry with ``*``, ``?`` or ``[``: a shell wildcard (ModelOpt, gpt-oss) matching the
      module or anything below it;
    * anything else: a dot-separated run of name segments, anywhere in the name. So
      ``model.visual`` excludes ``model.visual.blocks.0.attn.qkv.weight``, ``visual`` alone
      excludes every parameter with a ``visual`` segment, and ``mlp.gate`` excludes
      ``model.layers.0.mlp.gate.weight`` but ``model.visualise`` is not ``model.visual``.

LM head and embeddings
    Any parameter whose module path has an LM-head or embedding segment (``lm_head``,
    ``embed_tokens``, ``embed_out``, ...) is never quantized, excluded or not; GPTQ's
    ``lm_head: true`` is the one opt-in that quantizes the LM head.
"""

from __future__ import annotations

import re
from fnmatch import fnmatchcase
from typing import Iterable

from .base import QuantScheme

#: Module-name segments of the LM head and embeddings: never quantized by default.
HEAD_SEGMENTS = frozenset({"lm_head", "embed_out"})
EMBEDDING_SEGMENTS = frozenset({"embed_tokens", "embed_in", "wte", "wpe", "word_embeddings",
                                "tok_embeddings", "embed_positions"})

_GLOB_CHARS = frozenset("*?[")


def _segments_match(entry: str, name: str) -> bool:
    """``entry``'s dot-separated segments appear as a contiguous run in ``name``'s."""
    want = [s for s in entry.strip(".").split(".") if s]
    have = name.split(".")
    if not want:
        return False
    n = len(want)
    return any(have[i:i + n] == want for i in range(len(have) - n + 1))


def entry_matches(entry: str, name: str) -> bool:
    """Whether one exclusion entry or group target (any form above) matches ``name``."""
    if entry.startswith("re:"):
        try:
            return re.match(entry[3:], name) is not None
        except re.error:
            return False
    if _GLOB_CHARS & set(entry):
        return fnmatchcase(name, entry) or fnmatchcase(name, entry + ".*")
    return _segments_match(entry, name)


def module_names(name: str, kind: str) -> list[str]:
    """The names an exclusion entry or a target may use for parameter ``name``: its module,
    the parameter itself and, for fused experts, the per-expert names checkpoints use."""
    names = [name]
    if name.endswith(".weight"):
        names.insert(0, name[: -len(".weight")])
    elif kind == "experts" and "." in name:
        parent, leaf = name.rsplit(".", 1)
        names.append(parent)
        names.append(f"{parent}.0.{leaf}")
        if leaf == "gate_up_proj":
            names += [f"{parent}.0.gate_proj", f"{parent}.0.up_proj"]
    return names


def is_excluded(entries: Iterable[str], name: str, kind: str = "linear") -> bool:
    """Whether parameter ``name`` is matched by one of ``entries`` (an exclusion list)."""
    names = module_names(name, kind)
    return any(entry_matches(e, n) for e in entries for n in names)


def _module_segments(name: str) -> list[str]:
    segments = name.split(".")
    return segments[:-1] if len(segments) > 1 else segments


def is_head(name: str) -> bool:
    return any(s in HEAD_SEGMENTS for s in _module_segments(name))


def is_embedding(name: str) -> bool:
    return any(s in EMBEDDING_SEGMENTS for s in _module_segments(name))


def _is_class_target(target: str) -> bool:
    """``Linear``, ``Qwen3MoeSparseMoeBlock``...: a module class, not a module name."""
    return not target.startswith("re:") and "." not in target and target[:1].isupper()


def group_for(scheme: QuantScheme, name: str, kind: str) -> QuantScheme | None:
    """The config group that quantizes ``name``: one naming it (by ``re:`` or module name)
    wins over a class target (``Linear`` covers linear layers and the per-expert linears of
    fused experts; other classes are not modelled); ``None`` when no group targets it."""
    names = module_names(name, kind)
    for targets, sub in scheme.groups:
        if any(entry_matches(t, n) for t in targets if not _is_class_target(t) for n in names):
            return sub
    for targets, sub in scheme.groups:
        if "Linear" in targets:
            return sub
    return None
