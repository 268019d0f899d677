"""The plan's checks: does a plan agree with itself, and can it be applied?

A plan states its groups and a few quantities that follow from them; the checks here
recompute each (from :mod:`.contents`, which derives, and the rule tables of
:mod:`.vocabulary`) and refuse, in one :class:`PlanError` line naming the field and the
fix, a stated value that disagrees: each group's role, kind, serving and name
(:func:`check_group`), the groups together covering the model (:func:`check_groups`),
the bounds on the prefetch buffers and the tower transient (:func:`check_derived`), the
baseline of vLLM's cpu_offload_gb (:func:`check_vllm_baselines`), the stated totals
(:func:`check_totals`), the strategy (:func:`check_strategy`), and whether an infeasible plan is about to be applied
(:func:`require_feasible`). :mod:`.io` runs them on every plan it reads; the ``Plan``
methods of the same names call them.
"""

from __future__ import annotations

from typing import Iterable, Mapping

from ..errors import PlanError
from ..names import EMBED_SEGMENTS, MLP_SEGMENT, NEVER_COLD_SEGMENTS, experts_prefix, has_segment, layer_of
from ..sizes import GB
from .contents import PlanContents
from .parts import GroupPlan, experts_read_bytes
from .vocabulary import (
    KIND_ONLY_SERVING,
    LAYER_INDEX_KINDS,
    LAYER_KINDS,
    PARTIAL_READ_KINDS,
    REPLAN,
    ROLE_SERVINGS,
    SERVING_KINDS,
    GroupKind,
    Role,
    Serving,
    Strategy,
)


def serving_words(servings: Iterable[Serving]) -> str:
    """``servings`` as a user reads them, in the enum's order (``resident, prefetch, uva``)."""
    return ", ".join(w for w in Serving if w in set(servings))


def check_group(g: GroupPlan, where: str) -> None:
    """Role, kind and serving must agree, the name must be the layer its index says;
    raise naming the group otherwise."""
    problem = None
    kinds = SERVING_KINDS.get(g.serving)
    layer = layer_of(g.group)
    if g.serving not in ROLE_SERVINGS[g.role]:
        problem = (f"a group of role {g.role} cannot be served {g.serving} "
                   f"(only {serving_words(ROLE_SERVINGS[g.role])})")
    elif kinds is not None and g.kind not in kinds:
        problem = (f"serving {g.serving} is for groups of kind {' or '.join(sorted(kinds))}, "
                   f"and this one is {g.kind}")
    elif g.kind == GroupKind.EXPERTS and not 1 <= g.experts_per_token <= g.num_experts:
        problem = (f"routed experts need 1 <= experts_per_token <= num_experts, and these are "
                   f"{g.experts_per_token} of {g.num_experts}")
    elif g.kind != GroupKind.EXPERTS and (g.num_experts or g.experts_per_token):
        problem = f"num_experts and experts_per_token are for kind experts only, and this one is {g.kind}"
    elif g.device_experts and (g.kind != GroupKind.EXPERTS or g.serving != Serving.COMPUTE
                               or not 0 < g.device_experts < g.num_experts):
        problem = (f"device_experts ({g.device_experts}) is the device share of routed experts served compute, "
                   f"between 1 and num_experts - 1 ({g.num_experts - 1}), and this group is {g.kind} served {g.serving}"
                   if g.device_experts > 0 else f"device_experts must be >= 0, not {g.device_experts}")
    elif g.device_expert_ids and (len(g.device_expert_ids) != g.device_experts
                                  or len(set(g.device_expert_ids)) != g.device_experts
                                  or not all(0 <= e < g.num_experts for e in g.device_expert_ids)):
        problem = (f"device_expert_ids {list(g.device_expert_ids)[:8]} must name device_experts ({g.device_experts}) "
                   f"distinct experts from 0 to num_experts - 1 ({g.num_experts - 1})")
    elif g.est_device_hit_rate is not None and not g.device_experts:
        problem = "est_device_hit_rate is the measured hit rate of a device share of routed experts; this group has none"
    elif (g.device_channels or g.intermediate) and (g.kind not in (GroupKind.MLP, GroupKind.MODULE)
                                                    or g.serving != Serving.COMPUTE
                                                    or not 0 < g.device_channels < g.intermediate):
        problem = (f"device_channels ({g.device_channels}) of intermediate ({g.intermediate}) is the device share of "
                   f"a dense MLP or an LM head served compute, 0 < device_channels < intermediate, and this group is "
                   f"{g.kind} served {g.serving}")
    elif g.kernel_dims and g.serving != Serving.COMPUTE:
        problem = (f"kernel_dims {list(g.kernel_dims)} are the sizes a group served compute is computed with on the "
                   f"host, and this group is served {g.serving}")
    elif g.kind == GroupKind.MODULE and g.serving == Serving.COMPUTE and (
            not has_segment(g.group, NEVER_COLD_SEGMENTS) or not g.device_channels):
        problem = ("a group of kind module is served compute only as the LM head split by its vocabulary rows "
                   "(device_channels of them on the device, of intermediate), and this one is "
                   + ("not the LM head" if not has_segment(g.group, NEVER_COLD_SEGMENTS) else "not split"))
    elif g.kind in KIND_ONLY_SERVING and g.serving != KIND_ONLY_SERVING[g.kind]:
        problem = (f"a group of kind {g.kind} is split out of its layer only to be served "
                   f"{KIND_ONLY_SERVING[g.kind]}, and this one is served {g.serving} "
                   "(leave it in its layer's group)")
    elif g.kind == GroupKind.MLP and (layer is None or g.group != f"{layer[0]}.{layer[1]}.{MLP_SEGMENT}"):
        problem = "a group of kind mlp is the MLP of one dense decoder layer, named like model.layers.N.mlp"
    elif g.kind == GroupKind.EXPERTS and experts_prefix(f"{g.group}.weight") != g.group:
        problem = "a group of kind experts is the routed experts module of one layer, named like " \
                  "model.layers.N.mlp.experts"
    elif not 0 <= g.post_processing_bytes <= g.bytes:
        problem = f"post_processing_bytes {g.post_processing_bytes} is not between 0 and its {g.bytes} bytes"
    elif g.dtype_bytes and sum(g.dtype_bytes.values()) != g.bytes:
        problem = f"bytes {g.bytes} is not the sum of dtype_bytes ({sum(g.dtype_bytes.values())})"
    elif g.layer_index is not None and (layer is None or layer[1] != g.layer_index):
        problem = (f"layer_index {g.layer_index} is not the layer its name is in "
                   f"({'no layers.N in the name' if layer is None else f'layer {layer[1]}'})")
    elif (g.kind in LAYER_INDEX_KINDS) != (g.layer_index is not None):
        problem = f"kind is {g.kind} but layer_index is {g.layer_index}"
    elif g.kind == GroupKind.LAYER and g.group != f"{layer[0]}.{layer[1]}":
        problem = f"a group of kind layer is one whole decoder layer, named like {layer[0]}.{layer[1]}"
    elif not 0 <= g.est_read_bytes_per_step <= g.bytes:
        problem = f"est_read_bytes_per_step {g.est_read_bytes_per_step} is more than its {g.bytes} bytes"
    if problem:
        raise PlanError(f"{where}: group {g.group}: {problem}; fix it or {REPLAN}")


def validate(plan: PlanContents, where: str = "plan") -> None:
    """Raise :class:`PlanError` (one line) when the plan contradicts itself: every
    derived quantity (role, MTP flag, coverage, hot layers, prefetch buffers, tower
    transient, strategy) is recomputed, and a stated value that disagrees is an error."""
    check_groups(plan, where)
    check_host_compute(plan, {}, where)
    check_derived(plan, where)
    check_vllm_baselines(plan, where)
    check_strategy(plan, where)


def check_groups(plan: PlanContents, where: str = "plan") -> None:
    """Each group consistent in itself, unique, of the role its name and the inputs
    give it, inside the model; together they hold every tensor of the model."""
    plan.inputs.validate()
    if not plan.groups:
        raise PlanError(f"{where}: the plan has no groups; {REPLAN}")
    seen: set[str] = set()
    by_kind: dict[GroupKind, dict[int, GroupPlan]] = {kind: {} for kind in LAYER_KINDS}
    n_layers = plan.model.num_hidden_layers
    for g in plan.groups:
        if g.group in seen:
            raise PlanError(f"{where}: group {g.group} is listed twice; {REPLAN}")
        seen.add(g.group)
        check_group(g, where)
        _check_never_cold(plan, g, where)
        _check_role(plan, g, where)
        if g.kind not in LAYER_KINDS:
            continue
        if g.layer_index in by_kind[g.kind]:
            raise PlanError(f"{where}: group {g.group}: layer_index {g.layer_index} belongs to another "
                            f"{g.kind} group too; {REPLAN}")
        by_kind[g.kind][g.layer_index] = g
        if n_layers is not None and not 0 <= g.layer_index < n_layers:
            raise PlanError(f"{where}: group {g.group}: layer_index {g.layer_index} is outside the model's "
                            f"{n_layers} layers (0..{n_layers - 1}); {REPLAN}")
    _check_experts_follow_layers(by_kind, where)
    _check_coverage(plan, where)
    hot = tuple(sorted(g.layer_index for g in plan.groups
                       if g.serving == Serving.PREFETCH and g.kind == GroupKind.LAYER))
    if tuple(plan.hot_layer_indices) != hot:
        raise PlanError(f"{where}: hot_layer_indices {list(plan.hot_layer_indices)} disagree with the groups "
                        f"served prefetch (layers {list(hot)}); make them agree or {REPLAN}")


def _check_experts_follow_layers(by_kind: Mapping[GroupKind, Mapping[int, GroupPlan]], where: str) -> None:
    """Routed experts belong to a decoder layer, and the prefetch offloader copies a layer
    whole, experts included: an experts group is served prefetch exactly when its layer is."""
    layers = by_kind[GroupKind.LAYER]
    for index, e in by_kind[GroupKind.EXPERTS].items():
        layer = layers.get(index)
        if layer is None:
            raise PlanError(f"{where}: group {e.group}: routed experts of layer {index}, but no layer group "
                            f"has layer_index {index}; {REPLAN}")
        if (e.serving == Serving.PREFETCH) != (layer.serving == Serving.PREFETCH):
            raise PlanError(
                f"{where}: group {e.group} is served {e.serving} but its layer {layer.group} is served "
                f"{layer.serving}; the prefetch offloader copies a whole layer, experts included, so the experts "
                f"are served prefetch exactly when their layer is (else resident or uva); make them agree or {REPLAN}")
    for index, m in by_kind[GroupKind.MLP].items():
        if index not in layers:
            raise PlanError(f"{where}: group {m.group}: the MLP of layer {index}, but no layer group "
                            f"has layer_index {index}; {REPLAN}")
        if index in by_kind[GroupKind.EXPERTS]:
            raise PlanError(f"{where}: group {m.group}: layer {index} has routed experts, and a MoE layer's MLP "
                            f"is its experts group, not a group of kind mlp; {REPLAN}")


def _check_never_cold(plan: PlanContents, g: GroupPlan, where: str) -> None:
    if g.role != Role.COLD:
        return
    if has_segment(g.group, NEVER_COLD_SEGMENTS):
        why = "the LM head is read in full every step and is never cold"
    elif plan.model.tie_word_embeddings and has_segment(g.group, EMBED_SEGMENTS):
        why = ("the model ties its embedding to the LM head (tie_word_embeddings), so the embedding "
               "is read in full every step: hot, on the device")
    else:
        return
    raise PlanError(f"{where}: group {g.group} is marked cold, but {why}; {REPLAN}")


def _check_role(plan: PlanContents, g: GroupPlan, where: str) -> None:
    expected = plan.expected_role(g)
    if expected is None:
        raise PlanError(f"{where}: group {g.group} is of kind component, but its name is not a module under one "
                        f"of the cold segments ({', '.join(plan.inputs.cold_segments)}); {REPLAN}")
    cls, mtp, why = expected
    if g.mtp != mtp:
        raise PlanError(f"{where}: group {g.group}: mtp is {str(g.mtp).lower()}, but the group is "
                        f"{'' if mtp else 'not '}an MTP head; {REPLAN}")
    if g.role != cls:
        what = "placed absent (not loaded)" if g.role == Role.ABSENT else f"of role {g.role}"
        if g.role == Role.ABSENT:
            why += "; only an MTP head is ever absent: vLLM loads every other tensor"
        raise PlanError(f"{where}: group {g.group} is {what}, but it is {cls}: {why}; {REPLAN}")
    if cls == Role.ABSENT and g.est_read_bytes_per_step:
        raise PlanError(f"{where}: group {g.group} is not loaded, so a step reads none of it, not "
                        f"est_read_bytes_per_step {g.est_read_bytes_per_step}; {REPLAN}")
    whole = ((cls == Role.HOT and g.kind not in PARTIAL_READ_KINDS)
             or (cls == Role.COLD and not has_segment(g.group, EMBED_SEGMENTS)
                 and not plan._is_vllm_host_table(g.group)))
    expected = g.bytes if cls == Role.HOT else 0
    if whole and g.est_read_bytes_per_step != expected:
        what = "read in full every step" if cls == Role.HOT else "not read by a decode step"
        raise PlanError(f"{where}: group {g.group} is {what}: est_read_bytes_per_step must be {expected}, "
                        f"not {g.est_read_bytes_per_step}; {REPLAN}")
    if g.kind == GroupKind.EXPERTS:
        expected = experts_read_bytes(g.bytes, g.num_experts, g.experts_per_token)
        if g.est_read_bytes_per_step != expected:
            raise PlanError(f"{where}: group {g.group}: a step at batch 1 reads {g.experts_per_token} of its "
                            f"{g.num_experts} routed experts (est), so est_read_bytes_per_step must be "
                            f"{expected}, not {g.est_read_bytes_per_step}; {REPLAN}")


def _check_coverage(plan: PlanContents, where: str) -> None:
    """The groups hold every tensor of the model: a byte in no group is placed by no one
    and counted nowhere."""
    held = sum(g.bytes for g in plan.groups)
    if held != plan.model.total_bytes:
        raise PlanError(
            f"{where}: the groups hold {held} bytes but the model ({plan.model.source}) has "
            f"{plan.model.total_bytes}: {abs(held - plan.model.total_bytes)} bytes are "
            f"{'in no group' if held < plan.model.total_bytes else 'counted twice or not in the model'} "
            f"(was a group deleted or edited?); {REPLAN}")
    if all(g.num_tensors for g in plan.groups):
        tensors = sum(g.num_tensors for g in plan.groups)
        if tensors != plan.model.num_tensors:
            raise PlanError(f"{where}: the groups hold {tensors} tensors but the model has "
                            f"{plan.model.num_tensors} (was a group deleted or edited?); {REPLAN}")


def check_derived(plan: PlanContents, where: str = "plan") -> None:
    """Stated quantities the groups bound: the prefetch buffers and the tower transient."""
    low, high = plan.prefetch_buffer_range()
    stated = plan.stored_prefetch_buffer_bytes
    if stated is not None and not low <= stated <= high and (stated or plan.hot_layer_indices):
        raise PlanError(
            f"{where}: prefetch_buffer_bytes {stated} cannot be right: prefetch_step "
            f"{plan.inputs.prefetch_step} slots of the offloaded layers' parameters need "
            + (f"{low} to {high} bytes" if plan.hot_layer_indices else "none without hot layers")
            + f"; {REPLAN}")
    copied = plan.copied_transient_bytes()
    limit = max(plan.tower_transient_limit(), copied)
    transient = plan.est_transient_device_bytes
    if transient > limit or (limit and not transient) or transient < copied:
        raise PlanError(
            f"{where}: est_transient_device_bytes {transient} cannot be right: the towers placed on the host "
            + (f"{f'and the host-compute groups copied above the crossover ({copied} bytes) ' if copied else ''}"
               f"hold up to {limit} bytes on the device while they run (at least {copied or 1})" if limit else
               "are none and nothing is computed on the host, so nothing runs on demand (0)") + f"; {REPLAN}")


def check_vllm_baselines(plan: PlanContents, where: str = "plan") -> None:
    """The baseline of vLLM's cpu_offload_gb: its device bytes and verdict follow from its
    offloaded bytes and the groups (what it offloads needs the checkpoint's tensor order: bounded here)."""
    cpu_offload = plan.vllm_cpu_offload_gb
    if cpu_offload is None:
        return
    loaded = sum(g.bytes for g in plan.groups if g.serving != Serving.NONE)
    layers = sum(g.bytes for g in plan.groups if g.kind in LAYER_KINDS)
    problem = None
    if cpu_offload.offloaded_bytes > layers:
        problem = f"offloaded_bytes {cpu_offload.offloaded_bytes} is more than the {layers} bytes of the decoder layers"
    elif cpu_offload.device_bytes != loaded - cpu_offload.offloaded_bytes:
        problem = (f"device_bytes {cpu_offload.device_bytes} is not the {loaded} bytes loaded less the "
                   f"{cpu_offload.offloaded_bytes} offloaded")
    elif cpu_offload.fits != (cpu_offload.device_bytes <= plan.weight_budget_bytes):
        problem = f"fits is {str(cpu_offload.fits).lower()}, but {cpu_offload.device_bytes} device bytes against the " \
                  f"{plan.weight_budget_bytes}-byte weight budget say otherwise"
    if problem:
        raise PlanError(f"{where}: vllm_cpu_offload_gb: {problem}; {REPLAN}")


def check_totals(plan: PlanContents, stated: Mapping[str, int], where: str) -> None:
    """The totals a plan file states (see :func:`.io.stored_totals`) are what its groups
    add up to: an edited group with stale totals is caught."""
    for name, value in stated.items():
        if value != getattr(plan, name):
            raise PlanError(
                f"{where}: {name} says {value} but the groups add up to {getattr(plan, name)} "
                "(was a group edited?); delete the \"totals\" object to accept the groups as they are, "
                f"or {REPLAN}")


def check_strategy(plan: PlanContents, where: str = "plan") -> None:
    """The strategy names what the placement does, and a feasible placement fits."""
    derived = plan.derived_strategy()
    if plan.strategy == derived:
        return
    shortfall = plan.shortfall_bytes
    if plan.strategy == Strategy.INFEASIBLE:
        wrong = "it fits the weight budget and the host memory"
    elif shortfall:
        wrong = (f"the groups placed on the device need {shortfall / GB:.3f} GB more than the "
                 f"{plan.weight_budget_bytes / GB:.3f} GB weight budget")
    elif plan.host_shortfall_bytes:
        wrong = (f"the groups placed on the host need {plan.host_shortfall_bytes / GB:.3f} GB more than the "
                 f"{plan.inputs.host_available_bytes / GB:.3f} GB of host memory left beside the system and vLLM")
    elif plan.strategy == Strategy.RESIDENT:
        wrong = "it places groups on the host"
    elif plan.strategy == Strategy.COLD_OFFLOAD:
        wrong = "cold_offload places cold groups, and only cold groups, on the host"
    elif plan.strategy == Strategy.HOT_OFFLOAD:
        wrong = "it places no decoder layer and no routed experts on the host"
    else:
        wrong = f"the placement is {derived}"
    raise PlanError(f"{where}: strategy is {plan.strategy}, but {wrong}; {REPLAN}")


def require_feasible(plan: PlanContents, what: str = "the plan", fix: str | None = None) -> None:
    """Refuse to apply an infeasible plan (enable(), and plans made at engine start); ``fix``:
    what to change, where the caller knows the inputs better (an engine's settings)."""
    if plan.strategy != Strategy.INFEASIBLE:
        return
    if plan.shortfall_bytes:
        need = f"{plan.shortfall_bytes / GB:.3f} GB more device memory is needed than it has"
    else:
        need = f"{plan.host_shortfall_bytes / GB:.3f} GB more host memory is needed than it has"
    raise PlanError(f"{what} is infeasible: {need}; "
                    + (fix or "plan for a larger card, a smaller KV cache or a smaller checkpoint"))


def claimed_formats() -> Mapping[str, bool]:
    """The CPU kernel formats the committed benchmark claims (``cpu_kernels.claimed``);
    imported when asked, so reading a plan without host-compute never imports it."""
    from ..cpu_kernels.claimed import CLAIMED

    return CLAIMED


def check_host_compute(plan: PlanContents, stated: Mapping[str, object], where: str = "plan") -> None:
    """Host-compute groups exactly when the plan names a CPU kernel format, that format one
    with a fast kernel, and what the plan states of ``host_compute`` (the crossover, the
    threads, the rates) what its inputs and groups give."""
    computed = [g.group for g in plan.groups if g.serving == Serving.COMPUTE]
    fmt = plan.host_compute_format
    if computed and fmt is None:
        raise PlanError(f"{where}: group {computed[0]} is served compute, but the plan has no host_compute "
                        f"(the CPU kernel's format); {REPLAN}")
    if fmt is None:
        return
    if not computed:
        raise PlanError(f"{where}: host_compute names format {fmt[:40]!r} but no group is served compute; "
                        f"delete host_compute or {REPLAN}")
    from ..cpu_kernels.claimed import verdict_for

    claimed = claimed_formats()
    ok, why = verdict_for(fmt, plan.inputs) if fmt in claimed else (False, "")
    if not ok:
        why = f": {why}" if fmt in claimed else " is not a CPU kernel format"
        raise PlanError(f"{where}: host_compute format {fmt[:40]!r}{why} (claimed by the committed benchmark: "
                        f"{', '.join(f for f, ok in claimed.items() if ok)}); serve those experts uva, or {REPLAN}")
    _check_host_compute_allowed(plan, where)
    record = plan.host_compute
    for name, value in stated.items():
        expected = getattr(record, name)
        if value != expected:
            raise PlanError(f"{where}: host_compute.{name} says {str(value)[:40]}, but the inputs and groups give "
                            f"{expected}; delete it to accept the derived value, or {REPLAN}")


def _is_split_head(g: GroupPlan) -> bool:
    return g.kind == GroupKind.MODULE and g.serving == Serving.COMPUTE


def _check_host_compute_allowed(plan: PlanContents, where: str) -> None:
    """The plan's own inputs allow what its groups do: host-compute (``inputs.host_compute``),
    a layer's device share (``inputs.device_share``, one rank) and the LM head split
    (``inputs.head_share``, one rank, no speculative decoding, a head of its own)."""
    inputs = plan.inputs
    computed = [g for g in plan.groups if g.serving == Serving.COMPUTE]
    problem = None
    if computed and not inputs.host_compute:
        problem = (f"inputs.host_compute is false, but group {computed[0].group} is served compute: it should be "
                   "true, or the group served uva")
    for g in computed:
        if problem:
            break
        if _is_split_head(g):
            what = (f"group {g.group} splits the LM head ({g.device_channels} of its {g.intermediate} vocabulary "
                    "rows on the device)")
            if not inputs.head_share:
                problem = f"inputs.head_share is false, but {what}: it should be true, or the head kept on the device"
            elif inputs.ranks != 1:
                problem = (f"inputs.ranks is {inputs.ranks}, but {what}, which is planned for one rank only: ranks "
                           "should be 1, or the head kept on the device")
            elif inputs.speculative:
                problem = (f"inputs.speculative is {inputs.speculative}, but {what}, which a draft pass reads too: "
                           "speculative should be null, or the head kept on the device")
            elif plan.model.tie_word_embeddings:
                problem = (f"model.tie_word_embeddings is true, but {what}, and a head tied to the embedding is "
                           "never split: it should be false, or the head kept on the device")
        elif g.device_experts or g.device_channels:
            what = (f"group {g.group} keeps " + (f"{g.device_experts} of its routed experts" if g.device_experts
                                                 else f"{g.device_channels} of its channels") + " on the device")
            if not inputs.device_share:
                problem = f"inputs.device_share is false, but {what}: it should be true, or the group's share 0"
            elif inputs.ranks != 1:
                problem = (f"inputs.ranks is {inputs.ranks}, but {what}, a device share planned for one rank only: "
                           "ranks should be 1, or the group's share 0")
    if problem:
        raise PlanError(f"{where}: {problem}; {REPLAN}")

