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

from ..acceptance import acceptance_default
from ..checkpoint import Checkpoint
from ..errors import PlanError
from ..estimate.host import host_compute_bound_tokens, share_native
from ..estimate.traffic import StepSettings
from ..kv_model import KV_DTYPE_BYTES, KvModel
from ..names import mlp_prefix
from ..plan_format import GroupKind, GroupPlan, Plan, PlanInputs, PlannedModel, Serving
from ..plan_format import contents as plan_contents
from ..plan_format.inputs import InputError
from ..plan_format.vocabulary import HOST_COMPUTE_NOTE, SERVED_UVA
from ..sizes import GB
from .allocation import (
    allocated_tensors,
    experts_bytes,
    padding_for,
    post_processing_for,
    post_processing_growth,
    workspace_for,
)
from .baselines import baseline_notes, price_cpu_offload
from .cards import card_memory
from .grouping import group_tensors, model_fingerprint
from .host_compute import (
    claim_of,
    claimed,
    cpu_format,
    declined_share_note,
    head_note,
    host_compute_notes,
    mlp_cpu_format,
    mlp_unclaimed_note,
    not_computed,
    unclaimed_reason,
)
from .kernels import kernel_notes, method_of_config, pick
from .notes import compute_note, plan_notes
from .placement import Placing, place_cold, place_hot, strategy_of
from .shares import channel_shares, expert_intermediate_size, expert_shares, head_share, intermediate_size
from .speculation import with_alternative, with_draft_tokens


def _planned_model(checkpoint: Checkpoint, kv: KvModel | None, groups) -> PlannedModel:
    """The plan's model; its bytes are its groups', as vLLM allocates them on the plan's card
    (the checkpoint's, with routed experts at their kernel's padded sizes: :mod:`.allocation`)."""
    facts = checkpoint.facts
    # A local checkpoint is named absolutely: the plan is used from other directories, and
    # enable(plan) finds the model (and checks the plan against it) by this path.
    source = checkpoint.source
    if checkpoint.kind == "safetensors" and Path(source).exists():
        source = os.path.abspath(source)
    return PlannedModel(
        source=source, kind=checkpoint.kind, architectures=tuple(facts.architectures),
        fingerprint=model_fingerprint(checkpoint), num_tensors=len(checkpoint.tensors),
        total_bytes=sum(g.nbytes for g in groups), tie_word_embeddings=facts.tie_word_embeddings,
        num_hidden_layers=facts.num_hidden_layers, num_mtp_layers=facts.num_mtp_layers, kv=kv,
    )


def _kv_inputs(checkpoint: Checkpoint, inputs: PlanInputs) -> tuple[PlanInputs, KvModel | None, list[str]]:
    """The KV model of the checkpoint's config; with ``max_model_len`` and ``max_seqs`` the
    KV cache is sized from it, replacing the flat ``kv_cache_bytes``."""
    kv = KvModel.from_config(checkpoint.config, KV_DTYPE_BYTES[inputs.kv_cache_dtype])
    if inputs.max_model_len is None or inputs.max_seqs is None:
        if inputs.max_model_len is not None or inputs.max_seqs is not None:
            raise InputError("max_model_len" if inputs.max_seqs is None else "max_seqs",
                             "max_model_len and max_seqs size the KV cache together; give both or neither")
        return inputs, kv, []
    if kv is None:
        raise PlanError("the config does not say enough about the attention layers (layers, KV heads, head dim) "
                        "to size the KV cache; give --kv-cache instead of --max-model-len/--max-seqs")
    sized = kv.cache_bytes(inputs.max_model_len, inputs.max_seqs)
    note = (f"KV cache {sized / GB:.3f} GB (est): {inputs.max_seqs} sequence(s) of {inputs.max_model_len} tokens "
            f"at {kv.bytes_per_seq(inputs.max_model_len) / inputs.max_model_len / 1e3:.1f} kB/token ({kv.description})")
    return replace(inputs, kv_cache_bytes=sized), kv, [note]


def make_plan(checkpoint: Checkpoint, inputs: PlanInputs, *, with_cpu_offload: bool = True) -> Plan:
    """Place every group of ``checkpoint`` for ``inputs``: cold first, then hot layers.

    With speculative decoding asked for, the same input is also planned without it, and
    the plan says which is estimated faster (``alternative`` and a note)."""
    if inputs.usable_device_bytes is None:  # no measurement given: the card class's figure, or the size as given
        usable, source = card_memory(inputs.device_memory_bytes)
        inputs = replace(inputs, usable_device_bytes=usable, usable_from=source)
    inputs.validate()
    inputs, kv, kv_notes = _kv_inputs(checkpoint, inputs)
    family = acceptance_default(checkpoint.facts.model_type)
    if inputs.accept_rate is None:
        inputs = replace(inputs, accept_rate=family.default)
        if inputs.speculative == "mtp":
            kv_notes.append(f"acceptance {family.default:.2f}: the published rate for the {family.family} "
                            f"({family.source}); give --accept-rate to use yours")
    inputs.validate()
    plan = _place(checkpoint, inputs, kv, kv_notes, with_cpu_offload)
    if inputs.speculative == "mtp":
        plain = _place(checkpoint, replace(inputs, speculative=None, spec_tokens=None), kv, [], False)
        placed_tokens = inputs.batch * (1 + _placed_spec_tokens(inputs, checkpoint))
        plan = _restate_step(with_alternative(with_draft_tokens(plan, plain, family), plain), placed_tokens)
    plan.validate()
    return plan


def _place(checkpoint: Checkpoint, inputs: PlanInputs, kv: KvModel | None, notes: list[str],
           with_cpu_offload: bool) -> Plan:
    groups = group_tensors(checkpoint, inputs)
    model = _planned_model(checkpoint, kv, groups)

    method = method_of_config(checkpoint.config)
    fmt = cpu_format(method, checkpoint.config)
    refused = not_computed(checkpoint, GroupKind.EXPERTS)  # what the worker would refuse, never planned
    computes = claimed(fmt, inputs) and inputs.host_compute and refused is None
    why_not = (None if computes else f"{refused}, {SERVED_UVA}" if refused and inputs.host_compute
               else unclaimed_reason(method, fmt, inputs) if inputs.host_compute
               else f"host-compute is off for this plan (--no-host-compute), {SERVED_UVA}")
    has_experts = any(g.kind == GroupKind.EXPERTS for g in groups)
    has_dense = any(g.kind == GroupKind.LAYER for g in groups) and bool(dense_layers_of(groups))
    # A dense layer's MLP is offered host-compute in its own format when that format is
    # claimed; it shares the plan's one CPU format (and pool) with host-compute experts.
    mlp_fmt = mlp_cpu_format(method, checkpoint.config)
    mlp_refused = not_computed(checkpoint, GroupKind.MLP) if has_dense else None
    mlp_computes = (has_dense and inputs.host_compute and claimed(mlp_fmt, inputs) and mlp_refused is None
                    and (mlp_fmt == fmt or not computes))
    # Priced with every dense MLP a group of its own; the plan keeps only the computed ones split.
    priced = group_tensors(checkpoint, inputs, split_mlp=True) if mlp_computes else groups
    # vLLM's fused-MoE workspace (one per process) holds device memory whatever the placement
    workspace = (workspace_for(checkpoint.config, inputs.card, inputs.moe_setting, inputs.batched_tokens)
                 if has_experts else None)
    workspace_bytes = workspace.nbytes if workspace else 0
    placing = Placing(priced, inputs.weight_budget_bytes - workspace_bytes,
                      compute_formats={GroupKind.EXPERTS: fmt, GroupKind.MLP: mlp_fmt, GroupKind.MODULE: "bf16"},
                      kernel_dims={k: kernel_dims_of(checkpoint, inputs, k) for k in (GroupKind.EXPERTS, GroupKind.MLP)},
                      repack=post_processing_for(checkpoint.config, inputs.card, inputs.moe_setting).repack_bytes(
                          max((g.num_experts for g in groups if g.kind == GroupKind.EXPERTS), default=0)),
                      tokens=inputs.batched_tokens, ranks=inputs.ranks)
    deficit = placing.over_budget()

    def reason(g, where: Serving) -> str:
        if where == Serving.UVA and why_not is not None:
            return f"{g.reason}; {why_not}"
        return g.reason

    def placed(p: Placing, hot: list[int], shares: dict[str, tuple[int, int]] | None = None, **extra) -> Plan:
        computed = [g for g in p.groups if p.where[g.name] == Serving.COMPUTE]
        plan_fmt = (fmt if any(g.kind == GroupKind.EXPERTS for g in computed) else mlp_fmt) if computed else None
        plan = Plan(
            model=model, inputs=inputs, strategy=strategy_of(p, hot, inputs),
            groups=tuple(GroupPlan(g.name, g.kind, g.role, p.where[g.name], reason(g, p.where[g.name]), g.nbytes,
                                   g.layer_index, g.est_read_bytes_per_step, g.mtp, g.num_tensors, g.dtype_bytes,
                                   g.shapes_digest, g.num_experts, g.experts_per_token,
                                   *_share_fields(g.kind, (shares or {}).get(g.name)),
                                   kernel_dims=_kernel_dims(checkpoint, inputs, g, p.where[g.name],
                                                            (shares or {}).get(g.name)),
                                   post_processing_bytes=g.growth)
                    for g in p.groups),
            hot_layer_indices=tuple(hot), est_transient_device_bytes=p.all_transient(),
            stored_prefetch_buffer_bytes=p.buffers if hot else None, est_vllm_workspace_bytes=workspace_bytes,
            est_load_transient_device_bytes=p.load_transient(),
            host_compute_format=plan_fmt, **{"vllm_cpu_offload_gb": None, **extra})
        # The placement was made against the weights and transients; the plan's ledger adds
        # the worker's host buffers (a few MB), which only the plan itself can price.
        return replace(plan, strategy=plan.derived_strategy())

    def step_s(p: Placing) -> float:
        hot = sorted(g.layer_index for g in p.groups
                     if g.kind == GroupKind.LAYER and p.where[g.name] == Serving.PREFETCH)
        return placed(p, hot).est.est_step_s

    spec_tokens = _placed_spec_tokens(inputs, checkpoint)
    place_cold(placing, inputs)
    kernel = pick(method, inputs.card, inputs.moe_setting)
    tokens = inputs.batch * (1 + spec_tokens)
    hot = place_hot(placing, inputs, step_s, tokens, uva=kernel.reads_uva, moves=kernel.moves, compute=computes,
                    mlp_compute=mlp_computes)
    if mlp_computes:
        placing = _keep_computed_mlps_split(checkpoint, inputs, placing)
    shares: dict[str, tuple[int, int]] = {}
    sharing = inputs.device_share and inputs.ranks == 1
    split = (expert_shares(placing, inputs, fmt) if sharing and has_experts and computes and not hot else
             channel_shares(checkpoint, inputs, placing, mlp_fmt) if sharing and mlp_computes and not has_experts
             else None)
    declined = None
    if split is not None:
        candidate = placed(split[0], [], split[1])
        if candidate.est.est_step_s < placed(placing, hot).est.est_step_s:
            (placing, shares), hot = split, []
        else:
            declined = candidate
    if shares and not spec_tokens:
        placing, shares = _with_head_share(checkpoint, inputs, placing, shares, fmt if has_experts else mlp_fmt,
                                           has_experts, lambda p, s: placed(p, [], s).est.est_step_s)
    cpu_offload = (price_cpu_offload(groups, checkpoint, inputs, deficit, kv, spec_tokens)
            if with_cpu_offload and deficit > 0 else None)
    # MoE: vLLM's segment selection of the routed experts is the run a user would try next.
    segments = (price_cpu_offload(groups, checkpoint, inputs, deficit, kv, spec_tokens, params=("experts",))
                if cpu_offload is not None and any(g.kind == GroupKind.EXPERTS for g in groups) else None)
    plan = placed(placing, hot, shares, vllm_cpu_offload_gb=cpu_offload, vllm_cpu_offload_params=segments,
                  notes=tuple(notes + plan_notes(placing.groups, checkpoint, placing, inputs)
                              + (kernel_notes(kernel, inputs.compute_capability is None) if has_experts else [])
                              + _padding_notes(checkpoint, inputs, has_experts)
                              + ([workspace.note()] if workspace else [])))
    if has_experts and why_not is not None:
        plan = replace(plan, notes=plan.notes + (f"{HOST_COMPUTE_NOTE}{why_not}",))
    elif plan.host_compute is not None and inputs.cpu_read_gbps:  # claimed on this host, not by the benchmark
        plan = replace(plan, notes=plan.notes + (f"host-compute: claimed on this host: "
                                                 f"{claim_of(plan.host_compute_format, inputs)[1]}",))
    if has_dense and not mlp_computes and deficit > 0:
        plan = replace(plan, notes=plan.notes + (f"host-compute: {mlp_refused}: they are resident or prefetched with their "
                                                 "layer" if mlp_refused and inputs.host_compute else
                                                 _mlp_why_not(inputs, mlp_fmt, groups, computes, fmt, method),))
    plan = replace(plan, notes=plan.notes + _host_compute_lines(plan, tokens)
                   + tuple(head_note(g) for g in plan.groups if g.kind == GroupKind.MODULE and g.device_channels))
    if declined is not None:  # the rates only where the model is large enough for them to mean anything
        rates = (declined.est.est_tok_s, plan.est.est_tok_s) if plan_contents.priced(plan) else None
        plan = replace(plan, notes=plan.notes + (declined_share_note(_shares_of(declined), rates, tokens),))
    if inputs.compute_tflops:
        plan = replace(plan, notes=plan.notes + (compute_note(plan.est, inputs.compute_tflops),))
    return replace(plan, notes=plan.notes + tuple(baseline_notes(plan)))


def _with_head_share(checkpoint: Checkpoint, inputs: PlanInputs, placing: Placing, shares: dict[str, tuple[int, int]],
                     fmt: str | None, experts: bool, step_s) -> tuple[Placing, dict[str, tuple[int, int]]]:
    """The placement with the LM head split between the GPU and the CPU (:func:`.shares.head_share`)
    and the layers' shares made again in the room left, when the step model prices it faster."""
    head = head_share(checkpoint, inputs, placing) if claimed("bf16", inputs) else None  # the CPU's rows are bf16
    if head is None:
        return placing, shares
    name, rows_on_device, rows = head
    trial = placing.like(placing.groups)
    trial.where = {**placing.where, name: Serving.COMPUTE}
    trial.head_rows[name] = (rows_on_device, rows)
    trial.transient, trial.buffers = placing.transient, placing.buffers
    nbytes = next(g.nbytes for g in placing.groups if g.name == name)
    reserved = nbytes * rows_on_device // rows
    split = (expert_shares(trial, inputs, fmt, reserved) if experts
             else channel_shares(checkpoint, inputs, trial, fmt, reserved))
    if split is None:
        return placing, shares
    with_head = {**split[1], name: (rows_on_device, rows)}
    return (split[0], with_head) if step_s(split[0], with_head) < step_s(placing, shares) else (placing, shares)


def _padding_notes(checkpoint: Checkpoint, inputs: PlanInputs, has_experts: bool) -> list[str]:
    """The plan's notes on the routed experts' padded sizes, when vLLM pads them on its card,
    and on what vLLM's post-processing adds there (the ledger's lines of it)."""
    padding = padding_for(checkpoint.config, inputs.card, inputs.moe_setting) if has_experts else None
    post = post_processing_for(checkpoint.config, inputs.card, inputs.moe_setting)
    allocated = allocated_tensors(checkpoint.tensors, padding)
    grown = post_processing_growth(allocated, post)
    notes = [f"vLLM post-processing on SM {inputs.card}: {post.what(has_experts)}: {grown / 1e6:.1f} MB more than "
             "create_weights allocates, priced as the ledger's vLLM post-processing lines where vLLM post-processes "
             "them (device or host); groups the host CPU computes keep their layout as loaded"] if grown else []
    if padding is None or not padding.pads:
        return notes
    return notes + [padding.note(experts_bytes(checkpoint.tensors), experts_bytes(allocated_tensors(checkpoint.tensors,
                                                                                             padding)))]


def _kernel_dims(checkpoint: Checkpoint, inputs: PlanInputs, g, where: Serving,
                 share: tuple[int, int] | None) -> tuple[int, ...]:
    """A host-compute group's ``(H, I)`` (:attr:`GroupPlan.kernel_dims`, :func:`kernel_dims_of`);
    ``()`` for any other group."""
    return kernel_dims_of(checkpoint, inputs, g.kind, share) if where == Serving.COMPUTE else ()


def kernel_dims_of(checkpoint: Checkpoint, inputs: PlanInputs, kind: GroupKind,
                   share: tuple[int, int] | None = None) -> tuple[int, ...]:
    """The ``(H, I)`` a host-compute group of ``kind`` is computed with: the hidden size and
    one expert's intermediate size (a dense MLP's; the split head's vocabulary rows, from its
    ``share``), from the config, routed experts at the sizes vLLM pads them to on the plan's
    card (:mod:`.allocation`: the worker's kernel reads them so); ``()`` where the config
    does not say."""
    hidden = checkpoint.facts.hidden_size
    if kind == GroupKind.MODULE:
        inner = share[1] if share else None
    elif kind == GroupKind.MLP:
        inner = intermediate_size(checkpoint.config)
    else:
        inner = expert_intermediate_size(checkpoint.config)
        padding = padding_for(checkpoint.config, inputs.card, inputs.moe_setting)
        if padding is not None and hidden and inner:
            hidden, inner = padding.hidden_to, padding.intermediate_to
    return (int(hidden), int(inner)) if hidden and inner else ()


def _placed_spec_tokens(inputs: PlanInputs, checkpoint: Checkpoint) -> int:
    """Draft tokens a placement is made at: the given K, else one per MTP layer (at least
    one; the draft search may then choose another K on the same placement)."""
    return (inputs.spec_tokens or max(1, checkpoint.facts.num_mtp_layers)) if inputs.speculative == "mtp" else 0


def _host_compute_lines(plan: Plan, tokens: int) -> tuple[str, ...]:
    """The plan's host-compute notes for a step of ``tokens`` tokens (:func:`host_compute_notes`)."""
    record, inputs = plan.host_compute, plan.inputs
    bound = None
    if record is not None:
        settings = StepSettings(inputs.link_gbps, inputs.vram_gbps, cpu_gbps=inputs.host_cpu_gbps,
                                cpu_tflops=inputs.host_cpu_tflops, handoff_s=inputs.host_handoff_s, ranks=inputs.ranks)
        bound = host_compute_bound_tokens(plan.traffic().experts, settings)
    mlps = sum(1 for g in plan.groups if g.kind == GroupKind.MLP)
    return tuple(host_compute_notes(record, tokens, bound, mlps, _shares_of(plan)))


def _shares_of(plan: Plan) -> tuple[int, tuple[int, ...], int, int, bool, str] | None:
    """A plan's device shares as :func:`host_compute_notes` states them: layers, experts or
    channels on the device of each of those layers (in order), of how many, their device
    bytes, whether channels, and how they are held (``estimate.host.share_native``)."""
    split = [g for g in plan.groups if plan.share_bytes(g) and g.kind != GroupKind.MODULE]  # the head: its own note
    if not split:
        return None
    channels = split[0].kind == GroupKind.MLP
    held = (f"as stored ({plan.host_compute_format}, read in place)"
            if share_native(plan.host_compute_format, not channels) else "in bf16")
    return (len(split), tuple(g.device_experts or g.device_channels for g in split),
            split[0].num_experts or split[0].intermediate, plan.device_share_bytes, channels, held)


def _restate_step(plan: Plan, placed_tokens: int) -> Plan:
    """The host-compute notes restated for the plan's own step once the draft search has
    chosen its K (they were written for the ``placed_tokens`` the placement was made at)."""
    tokens = plan.inputs.batch * (1 + (plan.spec_tokens or 0))
    if tokens == placed_tokens:
        return plan
    return replace(plan, notes=_swapped(plan.notes, _host_compute_lines(plan, placed_tokens),
                                        _host_compute_lines(plan, tokens)))


def _swapped(notes: tuple[str, ...], old: tuple[str, ...], new: tuple[str, ...]) -> tuple[str, ...]:
    """``notes`` with the ``old`` ones replaced by ``new``, where the first of them stood."""
    kept = tuple(n for n in notes if n not in old)
    at = next((i for i, n in enumerate(notes) if n in old), len(kept))
    return kept[:at] + new + kept[at:]


def refitted(planned: Plan, fitted: Plan, why: str) -> Plan:
    """``fitted`` (``planned`` with part of its placement given up after planning: the worker's
    pre-flight shrinking a plan made at engine start) with the notes that follow from the
    placement restated for it (the host-compute lines with its device shares, the step's
    bound, vLLM's baselines against its estimate), and ``why`` it was refitted."""
    tokens = fitted.inputs.batch * (1 + fitted.spec_tokens)
    notes = _swapped(planned.notes, _host_compute_lines(planned, tokens), _host_compute_lines(fitted, tokens))
    if fitted.inputs.compute_tflops:
        notes = _swapped(notes, (compute_note(planned.est, fitted.inputs.compute_tflops),),
                         (compute_note(fitted.est, fitted.inputs.compute_tflops),))
    notes = _swapped(notes, tuple(baseline_notes(planned)), tuple(baseline_notes(fitted)))
    return replace(fitted, notes=notes + (why,))


def _share_fields(kind: GroupKind, share: tuple[int, int] | None) -> tuple[int, int, int]:
    """A group's device_experts, device_channels and intermediate from its share (count, I)."""
    if share is None:
        return 0, 0, 0
    return (share[0], 0, 0) if kind == GroupKind.EXPERTS else (0, *share)


def dense_layers_of(groups) -> set[int]:
    """Decoder layers without routed experts (their MLP may be computed on the host)."""
    layers = {g.layer_index for g in groups if g.kind == GroupKind.LAYER}
    return layers - {g.layer_index for g in groups if g.kind == GroupKind.EXPERTS}


def _keep_computed_mlps_split(checkpoint: Checkpoint, inputs: PlanInputs, p: Placing) -> Placing:
    """The placement regrouped so that only the MLPs served compute are groups of their own:
    every other MLP goes back into its layer, which the menu placed alike (resident, or
    prefetched whole)."""
    computed = {g.layer_index for g in p.groups if g.kind == GroupKind.MLP and p.where[g.name] == Serving.COMPUTE}
    for g in p.groups:
        if g.kind == GroupKind.MLP and g.layer_index not in computed:
            layer = next(x for x in p.groups if x.kind == GroupKind.LAYER and x.layer_index == g.layer_index)
            if p.where[g.name] != p.where[layer.name]:
                raise AssertionError(f"{g.name} placed {p.where[g.name]} apart from its layer")  # a planner bug
    final = group_tensors(checkpoint, inputs, split_mlp=computed)
    out = p.like(final)
    out.where = {g.name: p.where[g.name] for g in final}
    out.transient, out.buffers = p.transient, p.buffers
    return out


def _mlp_why_not(inputs: PlanInputs, mlp_fmt: str | None, groups, computes: bool, fmt: str | None,
                 method: str | None) -> str:
    if not inputs.host_compute:
        return "host-compute is off for this plan (--no-host-compute): no dense MLP is computed on the host"
    if claimed(mlp_fmt, inputs) and computes and mlp_fmt != fmt:
        return (f"host-compute: the dense MLPs ({mlp_fmt}) and the routed experts ({fmt}) are in different CPU "
                "formats and a plan has one: only the experts are computed on the host")
    dense = dense_layers_of(groups)
    mlp_bytes = max((sum(b for name, b in g.param_bytes.items() if mlp_prefix(f"{g.name}.{name}"))
                     for g in groups if g.kind == GroupKind.LAYER and g.layer_index in dense), default=0)
    return mlp_unclaimed_note(mlp_fmt, mlp_bytes, inputs.link_gbps, inputs.host_cpu_gbps, method, inputs)
