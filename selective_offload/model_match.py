"""Is this plan for this model? Checked by the tensors' bytes, not only by their names.

A plan made for the bf16 checkpoint of a model names the same modules as its fp32 save,
and a plan for a vocab-1024 model the same modules as the vocab-2048 one; applying it
would put other bytes on the host than the plan priced, and the report would compare
against the wrong figures. So the check is, per group: the class, the number of tensors,
the bytes in each dtype, and a digest of every tensor's shape and name relative to its
group. Groups are matched by :func:`names.group_key`, so a plan made from names that
differ only by wrappers (``model.language_model.layers`` against ``model.layers``) still
matches. The whole-model fingerprint is the fast path: equal fingerprints and the same
``tie_word_embeddings`` (which decides whether the embedding is hot), same model.
"""

from __future__ import annotations

from .checkpoint import Checkpoint
from .errors import PlanError
from .names import group_key
from .plan import GroupKind, GroupPlan, Plan
from .planner import Group, group_tensors, model_fingerprint
from .sizes import fmt_bytes, size_arg


def _describe(nbytes: int, dtype_bytes: dict[str, int]) -> str:
    return f"{fmt_bytes(nbytes)} of {'+'.join(dtype_bytes) or 'unknown dtype'}"


def _first_difference(planned: GroupPlan, actual: Group) -> str | None:
    name = planned.group
    if planned.cls != actual.cls:
        return f"{name} is {planned.cls} in the plan and {actual.cls} here ({actual.reason})"
    if planned.num_tensors and planned.num_tensors != actual.num_tensors:
        return f"{name} has {planned.num_tensors} tensors in the plan and {actual.num_tensors} here"
    if planned.bytes != actual.nbytes or (planned.dtype_bytes and dict(planned.dtype_bytes) != actual.dtype_bytes):
        return (f"{name} is {_describe(planned.bytes, dict(planned.dtype_bytes))} in the plan and "
                f"{_describe(actual.nbytes, actual.dtype_bytes)} here")
    if planned.shapes_digest and planned.shapes_digest != actual.shapes_digest:
        return f"{name} has the same bytes but other tensor shapes or names here"
    return None


def differences(plan: Plan, checkpoint: Checkpoint) -> list[str]:
    """Every group that differs between ``plan`` and ``checkpoint``, in the plan's order."""
    segments = plan.inputs.cold_segments
    # A plan without expert groups (format v2 and older) keeps a MoE layer's experts in it.
    split = any(g.kind == GroupKind.EXPERTS for g in plan.groups)
    actual = {group_key(g.name, segments): g for g in group_tensors(checkpoint, plan.inputs, split_experts=split)}
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
    return out


def check_plan_matches_model(plan: Plan, checkpoint: Checkpoint) -> list[str]:
    """Raise :class:`PlanError` naming both models and the first difference when ``plan``
    was made for another model than ``checkpoint``; return notes when it matches."""
    fingerprint = model_fingerprint(checkpoint)
    same_tie = plan.model.tie_word_embeddings == checkpoint.facts.tie_word_embeddings
    if fingerprint == plan.model.fingerprint and same_tie:
        return []
    found = differences(plan, checkpoint)
    if not found:
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
