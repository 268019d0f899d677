"""Decide where every byte of a checkpoint goes: cold bytes to the host first, hot ones last.

A decode step reads every resident weight once, so each byte kept in host memory and read
during the step crosses PCIe (34x slower than VRAM on the reference laptop: docs/design/reference-measurements.md).
Some groups are not read by a text decode step at all, and cost nothing on the host:

=============  ===========  ============================================================
group          role         why
=============  ===========  ============================================================
lm_head        hot, always  one vocab x hidden GEMM per step
embed_tokens   cold         a gather: one row (hidden x dtype bytes) per token
visual, ...    cold         towers run once per image/clip, in prefill
mtp            absent/hot   vLLM drops ``mtp.`` keys unless MTP speculative decoding is
                            on; then the drafter runs every step
=============  ===========  ============================================================

``embed_tokens`` and ``lm_head`` have the same shape and dtype and opposite roles, so a
size-ordered, name-blind policy (vLLM's ``cpu_offload_gb``) cannot tell them apart. Which
names are cold is :mod:`selective_offload.names`' rule; with ``tie_word_embeddings`` the
embedding *is* the LM head's weight and is hot.

A MoE decoder layer reads only the routed experts its tokens are sent to (k of E per
token), so its routed experts are a group of their own, and the hot part of the deficit is
closed from a menu per layer (:func:`.placement.place_hot`): resident, routed experts read in place
through UVA at the step's read fraction, routed experts computed where they live by the host
CPU (host-compute, for formats with a claimed CPU kernel), or the whole layer prefetched.

The reference arithmetic (the bundled Qwen3.8-27B-FP8-shaped manifest on a 24 GiB card)
is asserted by ``tests/unit/planner/test_planner.py`` and shown in docs/usage/planning.md.

Every time and rate here is an estimate from bytes and bandwidths, labelled ``est_``
(:mod:`selective_offload.estimate` prices a step; :data:`~selective_offload.plan_format.EST_IGNORES`
says what it leaves out). benchmarks/planning/published.py checks it against published
measurements (docs/design/step-model.md shows which points calibrate it and which validate); it prices
compute only at a matmul's best rate, which does not explain how slow NVFP4 ran on the
reference laptop: never choose a format from it.

How the modules relate (each imports only those above it; none imports this package):

    grouping      tensors -> groups: role, est read per step, model order, fingerprints
    host_compute  which CPU kernel format the routed experts are in, whether it is claimed, its notes
    placement     groups -> placement: cold set first, then hot layers / routed experts
    baselines     vLLM's own cpu_offload_gb and cpu_offload_params
    speculation   MTP draft tokens: best K, where it flips, break-even acceptance
    notes         the plan's notes on its placement (infeasible, assumed, what bounds it)
    make          make_plan: composes the steps into a checked plan

The planner never touches tensors; it returns a :class:`~selective_offload.plan_format.Plan`.
"""

from ..plan_format import EST_IGNORES, EST_MODEL, Plan, PlanInputs
from .baselines import TIE, baseline_notes, price_cpu_offload
from .grouping import COMPILED_BLOCK_TOWERS, Group, experts_notes, group_signature, group_tensors, model_fingerprint
from .make import make_plan
from .notes import compute_note, plan_notes
from .placement import Placing, place_cold, place_hot, prefetch_buffer_bytes, strategy_of, tower_transient_bytes
from .speculation import (
    best_draft_tokens,
    break_even_accept_rate,
    draft_flips,
    spec_estimate,
    with_alternative,
    with_draft_tokens,
)

__all__ = [
    "COMPILED_BLOCK_TOWERS",
    "EST_IGNORES",
    "EST_MODEL",
    "TIE",
    "Group",
    "Placing",
    "Plan",
    "PlanInputs",
    "baseline_notes",
    "best_draft_tokens",
    "break_even_accept_rate",
    "compute_note",
    "draft_flips",
    "experts_notes",
    "group_signature",
    "group_tensors",
    "make_plan",
    "model_fingerprint",
    "place_cold",
    "place_hot",
    "plan_notes",
    "prefetch_buffer_bytes",
    "price_cpu_offload",
    "spec_estimate",
    "strategy_of",
    "tower_transient_bytes",
    "with_alternative",
    "with_draft_tokens",
]
