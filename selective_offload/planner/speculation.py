"""MTP speculative decoding: whether it pays on a placement, and with how many draft tokens.

The placement does not depend on the number of draft tokens K (the MTP head is loaded
either way), only the step does; so :mod:`.make` places the model twice, with and without
speculation, and this module compares the two plans: the K with the highest est tok/s at
the acceptance rate (:func:`best_draft_tokens`), the acceptance rates where that choice
flips (:func:`draft_flips`), the rate at which speculation breaks even
(:func:`break_even_accept_rate`), and the notes and the alternative that say so.
"""

from __future__ import annotations

from dataclasses import replace

from ..acceptance import MAX_DRAFT_TOKENS, AcceptanceDefault, expected_tokens_per_step
from ..plan_format import Alternative, Estimate, Plan


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


def with_alternative(plan: Plan, plain: Plan) -> Plan:
    """The speculative plan, with the plan without speculation beside it and a recommendation."""
    k, a = plan.spec_tokens, plan.inputs.accept_rate
    alternative = Alternative("without speculative decoding", plain.strategy, plain.cold_on_host_bytes,
                              plain.prefetch_bytes, plain.hot_layer_indices, plain.est, plain.uva_bytes,
                              plain.host_compute_bytes)
    faster = plan.est.est_tok_s > plain.est.est_tok_s
    even = break_even_accept_rate(plan.est.est_step_s, plain.est.est_step_s, k)
    note = (f"recommended: {'MTP speculative decoding' if faster else 'no speculative decoding'} "
            f"(est {plan.est.est_tok_s:.2f} tok/s with {k} draft token(s) at acceptance {a:.2f}, "
            f"{plain.est.est_tok_s:.2f} tok/s without; E = (1 - a^(K+1)) / (1 - a) = "
            f"{plan.est.est_tokens_per_step / plan.inputs.batch:.2f} tokens per step; "
            + (f"speculation breaks even at acceptance {even:.2f})" if even is not None
               else "speculation cannot break even here, even at acceptance 1.0)"))
    return replace(plan, alternative=alternative, notes=plan.notes + (note,))


def spec_estimate(plan: Plan, k: int, accept_rate: float) -> Estimate:
    """The speculative placement's step with ``k`` draft tokens at ``accept_rate`` (est): the
    placement does not depend on K (the MTP head is loaded either way), only the step does."""
    inputs = replace(plan.inputs, spec_tokens=k, accept_rate=accept_rate)
    return Estimate.of(plan.traffic(), inputs, plan.model.kv, k, pipelined=True)


def best_draft_tokens(plan: Plan, plain: Plan, accept_rate: float) -> tuple[int, float]:
    """The number of draft tokens (0: no speculation, the plain placement) with the highest
    est tok/s at ``accept_rate``, and that rate; ties go to fewer drafts."""
    best = (0, plain.est.est_tok_s)
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


def with_draft_tokens(plan: Plan, plain: Plan, family: AcceptanceDefault) -> Plan:
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
