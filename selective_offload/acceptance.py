"""Speculative decoding's acceptance: the published per-token acceptance rate of each family's
MTP head (the default a plan uses when ``--accept-rate`` is not given, and the range it also
prices), and the tokens a step of K drafts yields at a rate. The step model
(:mod:`selective_offload.estimate`, which re-exports these names) prices a step with them.
"""

from __future__ import annotations

from dataclasses import dataclass

#: DeepSeek-V3's technical report (arXiv:2412.19437, section 5.4.3) measures 85-90%
#: acceptance of its MTP head's second-token prediction; the low end is the default. No
#: published figure was found for Qwen's MTP heads: pass ``--accept-rate`` from vLLM's own
#: spec-decode metrics (accepted / draft tokens) for the model you run.
DEFAULT_ACCEPT_RATE = 0.85


@dataclass(frozen=True)
class AcceptanceDefault:
    """A published per-token acceptance rate of a family's MTP head: the default, the range
    the sources report across workloads, and where each figure comes from."""

    family: str
    default: float
    low: float
    high: float
    source: str


#: Per family (matched on the config's ``model_type`` prefix), the acceptance a plan uses
#: when ``--accept-rate`` is not given. Acceptance depends on the workload far more than on
#: the format, so each carries the range the plan also prices.
ACCEPTANCE_DEFAULTS: tuple[tuple[tuple[str, ...], AcceptanceDefault], ...] = (
    (("qwen3",), AcceptanceDefault(
        "Qwen3.x MTP head", 0.65, 0.48, 0.91,
        "Qwen3.8-27B bf16, teacher-forced, K=1: 0.647 pooled, 0.908 code, 0.606 factual, 0.492 prose, "
        "0.480 technical (tenstorrent/vllm issue #442); the NVFP4 build 0.835 (kekzl/imp PR #1839); "
        "FP8 on coding prompts 0.90 at K=1 (SemiAnalysisAI/InferenceX PR #3304)")),
    (("deepseek", "kimi"), AcceptanceDefault(
        "DeepSeek-V3 MTP head", 0.85, 0.85, 0.90,
        "DeepSeek-V3 technical report (arXiv:2412.19437, section 5.4.3): 85-90% for the second token")),
)
#: A family with no published figure: DeepSeek-V3's rate, priced across the widest range
#: published for any family above.
GENERIC_ACCEPTANCE = AcceptanceDefault(
    "no published figure for this family", DEFAULT_ACCEPT_RATE, 0.48, 0.91,
    "DeepSeek-V3's 0.85 (arXiv:2412.19437); range: the lowest and highest published for Qwen3.x heads "
    "(tenstorrent/vllm issue #442)")
#: Draft tokens the planner considers. Per-position acceptance falls with depth (Qwen3.8-27B
#: FP8, coding: mean accepted length 1.90, 2.68, 3.28, 3.79 at K = 1-4, SemiAnalysisAI/
#: InferenceX PR #3304; a constant rate from K=1 predicts 2.71, 3.44, 4.10), so the constant
#: rate used here flatters deep drafts and the search stops at 4.
MAX_DRAFT_TOKENS = 4


def acceptance_default(model_type: str | None) -> AcceptanceDefault:
    """The published acceptance of ``model_type`` 's MTP head (its family's), else the generic."""
    text = (model_type or "").lower()
    for prefixes, found in ACCEPTANCE_DEFAULTS:
        if text.startswith(prefixes):
            return found
    return GENERIC_ACCEPTANCE


def expected_tokens_per_step(k: int, accept_rate: float) -> float:
    """Tokens a sequence gains per step with ``k`` draft tokens at acceptance ``accept_rate``."""
    if k <= 0:
        return 1.0
    if accept_rate >= 1.0:
        return float(k + 1)
    return (1.0 - accept_rate ** (k + 1)) / (1.0 - accept_rate)
