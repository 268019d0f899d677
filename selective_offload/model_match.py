"""Is this plan for this model? Checked by the tensors' bytes, not only by their names.

A plan made for the bf16 checkpoint of a model names the same modules as its fp32 save,
and a plan for a vocab-1024 model the same modules as the vocab-2048 one; applying it
would put other bytes on the host than the plan priced, and the report would compare
against the wrong figures. So the check is, per group: the role, the number of tensors,
the bytes in each dtype, and a digest of every tensor's shape and name relative to its
group. Groups are matched by :func:`names.group_key`, so a plan made from names that
differ only by wrappers (``model.language_model.layers`` against ``model.layers``) still
matches. The groups are compared always, a matching whole-model fingerprint included: it
names the model the plan was made for, and a hand-edited plan keeps it. The quantities
the plan alone only bounds (prefetch buffers, the tower transient, each group's reads per
step) are recomputed from the checkpoint and compared too. So is what the plan says of
computing on the host CPU (:func:`host_compute_differences`): the kernel format its
weights are read in, the routed experts of each group, the rows of a split LM head and the
channels of a split MLP are this checkpoint's.

:func:`check_plan_matches_model` is the one check of a plan against a checkpoint; it runs
once before any engine starts (``enable(plan, model=...)``, or where the engine is started
for a model enable() did not know) and once in the worker, on the model vLLM loads.
"""

from __future__ import annotations

from .checkpoint import Checkpoint
from .errors import PlanError
from .names import NEVER_COLD_SEGMENTS, group_key, has_segment
from .plan_format import COLD_SERVINGS, PREFETCH_KINDS, GroupKind, GroupPlan, Plan, Serving
from .planner import Group, group_tensors, model_fingerprint, prefetch_buffer_bytes, tower_transient_bytes
from .planner.host_compute import cpu_format, mlp_cpu_format
from .planner.kernels import method_of_config
from .planner.shares import channel_align, intermediate_size
from .sizes import fmt_bytes, size_arg


def _describe(nbytes: int, dtype_bytes: dict[str, int]) -> str:
    return f"{fmt_bytes(nbytes)} of {'+'.join(dtype_bytes) or 'unknown dtype'}"


def _first_difference(planned: GroupPlan, actual: Group) -> str | None:
    name = planned.group
    if planned.role != actual.role:
        return f"{name} is {planned.role} in the plan and {actual.role} here ({actual.reason})"
    if planned.kind != actual.kind or planned.layer_index != actual.layer_index or planned.mtp != actual.mtp:
        return (f"{name} is kind {planned.kind}, layer {planned.layer_index}, mtp {planned.mtp} in the plan and "
                f"kind {actual.kind}, layer {actual.layer_index}, mtp {actual.mtp} here")
    if planned.num_tensors and planned.num_tensors != actual.num_tensors:
        return f"{name} has {planned.num_tensors} tensors in the plan and {actual.num_tensors} here"
    if planned.bytes != actual.nbytes or (planned.dtype_bytes and dict(planned.dtype_bytes) != actual.dtype_bytes):
        return (f"{name} is {_describe(planned.bytes, dict(planned.dtype_bytes))} in the plan and "
                f"{_describe(actual.nbytes, actual.dtype_bytes)} here")
    if planned.post_processing_bytes != actual.growth:
        return (f"{name}: vLLM's post-processing adds {planned.post_processing_bytes} bytes to it in the plan and "
                f"{actual.growth} here")
    if planned.shapes_digest and planned.shapes_digest != actual.shapes_digest:
        return f"{name} has the same bytes but other tensor shapes or names here"
    if (planned.num_experts, planned.experts_per_token) != (actual.num_experts, actual.experts_per_token):
        return (f"{name} has {planned.num_experts} routed experts, {planned.experts_per_token} per token, in the "
                f"plan and {actual.num_experts}, {actual.experts_per_token} per token, here")
    if planned.est_read_bytes_per_step != actual.est_read_bytes_per_step:
        return (f"{name}: a decode step reads {planned.est_read_bytes_per_step} bytes of it in the plan and "
                f"{actual.est_read_bytes_per_step} here")
    return None


def _derived_differences(plan: Plan, actual: dict[tuple, Group]) -> list[str]:
    """The plan's stated prefetch buffers and tower transient against the same quantities
    recomputed from this checkpoint's groups (the plan alone only bounds them)."""
    segments = plan.inputs.cold_segments
    mine = [actual.get(group_key(g.group, segments)) for g in plan.groups]
    if any(g is None for g in mine):
        return []
    out = []
    if plan.hot_layer_indices:
        hot = set(plan.hot_layer_indices)  # the offloader's slots: the hot layers' parameters, experts included
        buffers = prefetch_buffer_bytes([g for g in mine if g.kind in PREFETCH_KINDS and g.layer_index in hot],
                                        plan.inputs.prefetch_step)
        if plan.prefetch_buffer_bytes != buffers:
            out.append(f"the prefetch buffers are {plan.prefetch_buffer_bytes} bytes in the plan and {buffers} "
                       f"for this model's layers at prefetch_step {plan.inputs.prefetch_step}")
    transient = max((tower_transient_bytes(a) for g, a in zip(plan.groups, mine)
                     if g.serving in COLD_SERVINGS), default=0)
    transient = max(transient, plan.copied_transient_bytes())  # the host-compute copy: from the groups checked above
    if plan.est_transient_device_bytes != transient:
        out.append(f"est_transient_device_bytes is {plan.est_transient_device_bytes} in the plan and {transient} "
                   "for this model's towers and host-compute groups")
    return out


def host_compute_differences(plan: Plan, checkpoint: Checkpoint) -> list[str]:
    """What the plan says of computing on the host CPU against this checkpoint: the format
    (the CPU kernel that reads its routed experts, or its dense MLPs when no experts are
    computed), a split LM head's rows, a split MLP's channels. Each names the field and
    what it should be."""
    computed = [g for g in plan.groups if g.serving == Serving.COMPUTE]
    if not computed or plan.host_compute_format is None:
        return []
    out = []
    method = method_of_config(checkpoint.config)
    experts = any(g.kind == GroupKind.EXPERTS for g in computed)
    mlps = any(g.kind == GroupKind.MLP for g in computed)
    expected = (cpu_format(method, checkpoint.config) if experts
                else mlp_cpu_format(method, checkpoint.config) if mlps else plan.host_compute_format)
    what = "routed experts" if experts else "dense MLPs"
    if expected != plan.host_compute_format:
        dtype = checkpoint.config.get("torch_dtype") or checkpoint.config.get("dtype") or "bf16"
        weights = ("weights of a quantization the CPU kernels do not read" if method is None else
                   f"unquantized ({dtype}) weights" if method == "unquantized" else f"{method} weights")
        out.append(f"host_compute.format is {plan.host_compute_format[:40]!r}, but this model's {what} are "
                   f"{weights}: " + (f"it should be {expected!r}" if expected else
                                     "they have no CPU kernel format, so serve them uva or on the device"))
    for g in computed:
        if g.kind == GroupKind.MODULE and has_segment(g.group, NEVER_COLD_SEGMENTS):
            key = group_key(g.group, plan.inputs.cold_segments)
            weight = next((t for n, t in checkpoint.tensors.items() if n.endswith(".weight")
                           and group_key(n.removesuffix(".weight"), plan.inputs.cold_segments) == key), None)
            rows = int(weight.shape[0]) if weight is not None and len(weight.shape) == 2 else None
            if weight is None or weight.dtype != "BF16" or rows is None:
                held = "has no weight" if weight is None else f"is {weight.dtype} of shape {list(weight.shape)}"
                out.append(f"group {g.group} splits the LM head by its rows, but this model's LM head {held}: only "
                           "a bf16 head of its own is split; keep it on the device")
            elif g.intermediate != rows:
                out.append(f"group {g.group}: intermediate is {g.intermediate} vocabulary rows, but this model's LM "
                           f"head has {rows}: it should be {rows}")
        elif g.kind == GroupKind.MLP and g.intermediate:
            size, align = intermediate_size(checkpoint.config), channel_align(checkpoint.config)
            if g.intermediate != size:
                out.append(f"group {g.group}: intermediate is {g.intermediate} channels, but this model's MLPs have "
                           f"{size}: it should be {size}")
            elif g.device_channels % align:
                out.append(f"group {g.group}: device_channels is {g.device_channels}, but this model's MLP is cut "
                           f"in blocks of {align} channels: it should be a multiple of {align}")
    return out


def differences(plan: Plan, checkpoint: Checkpoint) -> list[str]:
    """Every group that differs between ``plan`` and ``checkpoint``, in the plan's order."""
    segments = plan.inputs.cold_segments
    # Only the dense MLPs a plan computes on the host are groups of their own.
    mlps = {g.layer_index for g in plan.groups if g.kind == GroupKind.MLP}
    actual = {group_key(g.name, segments): g
              for g in group_tensors(checkpoint, plan.inputs, split_mlp=mlps)}
    out: list[str] = []
    matched: set[tuple] = set()
    for planned in plan.groups:
        key = group_key(planned.group, segments)
        group = actual.get(key)
        if group is None:
            out.append(f"{planned.group} ({fmt_bytes(planned.bytes)}) is in the plan but not in this model")
            continue
        matched.add(key)
        diff = _first_difference(planned, group)
        if diff:
            out.append(diff)
    out += [f"{g.name} ({fmt_bytes(g.nbytes)}) is in this model but not in the plan"
            for key, g in actual.items() if key not in matched]
    return out + _derived_differences(plan, actual)


def _require_host_compute_fits(plan: Plan, checkpoint: Checkpoint) -> None:
    """Raise :class:`PlanError` naming the first of :func:`host_compute_differences`."""
    host = host_compute_differences(plan, checkpoint)
    if host:
        raise PlanError(f"the plan does not fit {checkpoint.source}: {host[0]}"
                        + (f" (and {len(host) - 1} more)" if len(host) > 1 else "")
                        + f"; fix it, or make the plan again: selective-offload plan {checkpoint.source} "
                        f"--device-memory {size_arg(plan.inputs.device_memory_bytes)} -o plan.json")


def check_plan_matches_model(plan: Plan, checkpoint: Checkpoint) -> list[str]:
    """Raise :class:`PlanError` naming both models and the first difference when ``plan``
    was made for another model than ``checkpoint``; return notes when it matches."""
    fingerprint = model_fingerprint(checkpoint)
    same_tie = plan.model.tie_word_embeddings == checkpoint.facts.tie_word_embeddings
    # Group by group always: the fingerprint says which model the plan names, not that its
    # groups were left as the planner made them (a hand-edited group keeps the fingerprint).
    found = differences(plan, checkpoint)
    if not found and fingerprint == plan.model.fingerprint and same_tie:
        _require_host_compute_fits(plan, checkpoint)
        return []
    if found and fingerprint == plan.model.fingerprint and same_tie:
        raise PlanError(
            f"the plan names this model ({checkpoint.source}, fingerprint {fingerprint}) but its groups do not "
            f"match it: {found[0]}" + (f" (and {len(found) - 1} more)" if len(found) > 1 else "")
            + f"; was the plan edited? make it again: selective-offload plan {checkpoint.source} "
            f"--device-memory {size_arg(plan.inputs.device_memory_bytes)} -o plan.json")
    if not found:
        _require_host_compute_fits(plan, checkpoint)
        return [f"the plan's fingerprint ({plan.model.fingerprint}) differs from {checkpoint.source}'s "
                f"({fingerprint}), but every group has the same tensors: tensor names outside the groups "
                "differ only by wrappers"]
    estimate = (" (the plan was estimated from a config.json: plan from the downloaded checkpoint's "
                "headers instead)" if plan.model.kind == "config" else "")
    raise PlanError(
        f"the plan was made for another model: it is for {plan.model.source} (fingerprint "
        f"{plan.model.fingerprint}), this is {checkpoint.source} (fingerprint {fingerprint}); first "
        f"difference: {found[0]}"
        + (f" (and {len(found) - 1} more)" if len(found) > 1 else "")
        + f"{estimate}; make the plan again: selective-offload plan {checkpoint.source} "
        f"--device-memory {size_arg(plan.inputs.device_memory_bytes)} -o plan.json"
    )
