"""The planner's entry point: :func:`make_plan` composes the steps into a checked plan.

It sizes the KV cache from the model when asked, fills in the family's acceptance rate,
groups the tensors (:mod:`.grouping`), places them (:mod:`.placement`) against the whole
step model, prices vLLM's own offload beside them (:mod:`.baselines`), adds the notes
(:mod:`.notes`), and with MTP speculative decoding asked for also plans without it and
compares the two (:mod:`.speculation`).
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from ..checkpoint import Checkpoint
from ..errors import PlanError
from ..estimate import KV_DTYPE_BYTES, KvModel, acceptance_default
from ..plan import GroupKind, GroupPlan, Placement, Plan, PlanInputs, PlannedModel
from ..sizes import GB
from .baselines import baseline_notes, price_bulk
from .grouping import group_tensors, model_fingerprint
from .host_compute import claimed, cpu_format, host_compute_notes, unclaimed_reason
from .kernels import kernel_notes, method_of_config, pick
from .notes import compute_note, plan_notes
from .placement import Placing, place_cold, place_hot, strategy_of
from .speculation import with_alternative, with_draft_tokens


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
        plan = with_alternative(with_draft_tokens(plan, plain, family), plain)
    plan.validate()
    return plan


def _place(checkpoint: Checkpoint, inputs: PlanInputs, kv: KvModel | None, notes: list[str],
           with_bulk: bool) -> Plan:
    groups = group_tensors(checkpoint, inputs)
    placing = Placing(groups, inputs.weight_budget_bytes)
    deficit = placing.over_budget()
    model = _planned_model(checkpoint, kv)

    method = method_of_config(checkpoint.config)
    fmt = cpu_format(method, checkpoint.config)
    # mutation: host-compute-switch-ignored
    computes = claimed(fmt) and inputs.host_compute
    why_not = (None if computes else unclaimed_reason(method, fmt) if inputs.host_compute
               else "host-compute is off for this plan (--no-host-compute), so host experts are served uva")

    def reason(g, where: Placement) -> str:
        if where == Placement.HOST_UVA and why_not is not None:
            return f"{g.reason}; {why_not}"
        return g.reason

    def placed(p: Placing, hot: list[int], **extra) -> Plan:
        computed = any(w == Placement.HOST_COMPUTE for w in p.where.values())
        return Plan(
            model=model, inputs=inputs, strategy=strategy_of(p, hot, inputs),
            groups=tuple(GroupPlan(g.name, g.kind, g.role, p.where[g.name], reason(g, p.where[g.name]), g.nbytes,
                                   g.layer_index, g.est_read_bytes_per_step, g.mtp, g.num_tensors, g.dtype_bytes,
                                   g.shapes_digest, g.num_experts, g.experts_per_token) for g in groups),
            hot_layer_indices=tuple(hot), est_transient_device_bytes=p.transient,
            stored_prefetch_buffer_bytes=p.buffers if hot else None,
            host_compute_format=fmt if computed else None, **{"bulk": None, **extra})

    def step_s(p: Placing) -> float:
        hot = sorted(g.layer_index for g in groups if g.kind == GroupKind.LAYER and p.where[g.name] == Placement.HOST_HOT)
        return placed(p, hot).est.est_step_s

    facts = checkpoint.facts
    spec_tokens = (inputs.spec_tokens or max(1, facts.num_mtp_layers)) if inputs.speculative == "mtp" else 0
    place_cold(placing, inputs)
    has_experts = any(g.kind == GroupKind.EXPERTS for g in groups)
    # mutation: plan-setting-ignored
    kernel = pick(method, inputs.card, inputs.moe_setting)
    tokens = inputs.batch * (1 + spec_tokens)
    hot = place_hot(placing, inputs, step_s, tokens, uva=kernel.reads_uva, moves=kernel.moves, compute=computes)
    bulk = (price_bulk(groups, checkpoint, inputs, deficit, kv, spec_tokens)
            if with_bulk and deficit > 0 else None)
    # MoE: vLLM's segment selection of the routed experts is the run a user would try next.
    segments = (price_bulk(groups, checkpoint, inputs, deficit, kv, spec_tokens, params=("experts",))
                if bulk is not None and any(g.kind == GroupKind.EXPERTS for g in groups) else None)
    plan = placed(placing, hot, bulk=bulk, bulk_segments=segments,
                  notes=tuple(notes + plan_notes(groups, checkpoint, placing, inputs)
                              + (kernel_notes(kernel, inputs.compute_capability is None) if has_experts else [])))
    if has_experts and why_not is not None:
        plan = replace(plan, notes=plan.notes + (f"host-compute: {why_not}",))
    plan = replace(plan, notes=plan.notes + tuple(host_compute_notes(plan.host_compute, tokens)))
    if inputs.compute_tflops:
        plan = replace(plan, notes=plan.notes + (compute_note(plan.est, inputs.compute_tflops),))
    return replace(plan, notes=plan.notes + tuple(baseline_notes(plan)))
