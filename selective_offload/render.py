"""A plan as people read it: a group table (decoder layers folded) and a summary.

Used by ``selective-offload plan`` and by the demo; it only formats, it decides nothing.
"""

from __future__ import annotations

from .checkpoint import Checkpoint
from .plan import Estimate, GroupKind, GroupPlan, Plan
from .sizes import GB


def _gb(nbytes: int | float) -> str:
    return f"{nbytes / GB:7.3f} GB"


def _step_bytes(nbytes: int) -> str:
    """Per-step reads: a gathered embedding row is kilobytes, a layer is gigabytes."""
    if not nbytes:
        return "-"
    if nbytes < 1_000_000:
        return f"{nbytes / 1e3:.1f} kB"
    return _gb(nbytes)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:7.1f} ms"


def ranges(indices: list[int] | tuple[int, ...]) -> str:
    """``0-3,7,9-10`` for ``[0, 1, 2, 3, 7, 9, 10]``."""
    if not indices:
        return "none"
    out, start, prev = [], indices[0], indices[0]
    for i in list(indices[1:]) + [None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    return ",".join(out)


def _header(plan: Plan) -> list[str]:
    m, inp = plan.model, plan.inputs
    return [
        f"model     {m.source}  ({m.num_tensors} tensors, {_gb(m.total_bytes).strip()}, fingerprint {m.fingerprint})",
        f"budget    {_gb(inp.device_memory_bytes).strip()} device - {_gb(inp.kv_cache_bytes).strip()} KV cache"
        f" - {_gb(inp.reserve_bytes).strip()} reserve = {_gb(plan.weight_budget_bytes).strip()} for weights;"
        f" link {inp.link_gbps} GB/s, VRAM {inp.vram_gbps} GB/s"
        + (f"; speculative {inp.speculative}" if inp.speculative else ""),
        "",
    ]


def _row(name: str, groups: list[GroupPlan]) -> str:
    first = groups[0]
    return (f"{name:<40} {_gb(sum(g.bytes for g in groups)):>10} {first.cls:<6} {first.placement:<10} "
            f"{_step_bytes(sum(g.est_link_bytes_per_step for g in groups)):>10} "
            f"{_step_bytes(sum(g.est_vram_bytes_per_step for g in groups)):>10}")


def _group_table(plan: Plan) -> list[str]:
    """One row per group; runs of consecutive decoder layers placed alike fold into one."""
    header = f"{'group':<40} {'bytes':>10} {'class':<6} {'placement':<10} {'link/step':>10} {'VRAM/step':>10}"
    lines = [header, "-" * len(header)]
    run: list[GroupPlan] = []

    def flush() -> None:
        if run:
            first, last = run[0], run[-1]
            name = (first.group if len(run) == 1 else
                    f"{first.group.rsplit('.', 1)[0]}.{first.layer_index}-{last.layer_index} ({len(run)})")
            lines.append(_row(name, run))
            run.clear()

    for g in plan.groups:
        if g.kind == GroupKind.LAYER:
            if run and g.placement != run[-1].placement:
                flush()
            run.append(g)
            continue
        flush()
        lines.append(_row(g.group, [g]))
    flush()
    return lines


def _placement_summary(plan: Plan) -> list[str]:
    inp = plan.inputs
    lines = ["", f"strategy  {plan.strategy}"
             + (f": short by {_gb(plan.shortfall_bytes).strip()}" if plan.shortfall_bytes else ""),
             f"deficit   {_gb(plan.deficit_bytes).strip()} (weights to load minus the budget; <= 0 fits)",
             f"cold set  {_gb(plan.cold_bytes).strip()}, of which {_gb(plan.host_cold_bytes).strip()} on the host"]
    if plan.hot_layer_indices:
        lines.append(f"hot layers on the host ({len(plan.hot_layer_indices)}, {_gb(plan.host_hot_bytes).strip()}): "
                     f"{','.join(map(str, plan.hot_layer_indices))}")
        lines.append(f"prefetch buffers {_gb(plan.prefetch_buffer_bytes).strip()} on the device "
                     f"(prefetch_step={inp.prefetch_step} slot(s) of the largest layer)")
    if plan.est_transient_device_bytes:
        lines.append(f"est transient device bytes while a cold tower runs: "
                     f"{_gb(plan.est_transient_device_bytes).strip()}")
    lines.append(f"device    {_gb(plan.device_bytes).strip()} resident weights; absent (not loaded): "
                 f"{_gb(plan.absent_bytes).strip()}")
    return lines


def _estimates(plan: Plan) -> list[str]:
    """Selective against vLLM's bulk cpu_offload_gb (and without speculation, when it was
    asked for), every figure labelled est_."""
    inp = plan.inputs
    batch = f", batch {inp.batch}" if inp.batch > 1 else ""
    lines = ["", f"{'':<44} {'host bytes':>10} {'est_link':>10} {'est_hidden':>10} {'est_vram':>10} "
                 f"{'est_step':>10} {'est_tok/s':>9}" + (f" {'per seq':>8}" if inp.batch > 1 else "")]

    def summary(label: str, host: int, est: Estimate) -> str:
        return (f"{label:<44} {_gb(host):>10} {_ms(est.est_link_s_per_step):>10} "
                f"{_ms(est.est_hidden_link_s_per_step):>10} {_ms(est.est_vram_s_per_step):>10} "
                f"{_ms(est.est_step_s):>10} {est.est_tok_s:9.2f}"
                + (f" {est.est_tok_s_per_seq:8.2f}" if inp.batch > 1 else ""))

    bulk = plan.bulk
    if bulk is not None:
        lines.append(summary(f"vLLM cpu_offload_gb={bulk.cpu_offload_gb:g}", bulk.offloaded_bytes, bulk.est)
                     + ("" if bulk.fits else "  (does not fit)"))
    spec = f", MTP K={plan.spec_tokens} a={inp.accept_rate:.2f}" if plan.spec_tokens else ""
    lines.append(summary(f"selective ({plan.strategy}{spec})", plan.host_cold_bytes + plan.host_hot_bytes, plan.est))
    alt = plan.alternative
    if alt is not None:
        lines.append(summary(f"selective, {alt.label}"[:44], alt.host_cold_bytes + alt.host_hot_bytes, alt.est)
                     + f"  ({len(alt.hot_layer_indices)} hot layers)")
    if bulk is not None and plan.strategy != "infeasible":
        lines.append(f"est speed-up over bulk: {plan.est.est_tok_s / bulk.est.est_tok_s:.2f}x"
                     f" (link time {_ms(bulk.est.est_link_s_per_step).strip()} -> "
                     f"{_ms(plan.est.est_link_s_per_step).strip()} per step, "
                     f"{_ms(plan.est.est_hidden_link_s_per_step).strip()} of it hidden behind compute)")
    if bulk is not None:
        lines.append(f"bulk takes {bulk.offloaded_tensors} tensors of layers "
                     f"{ranges(bulk.layers_touched)} in model order (cpu_offload_gb counts GiB)")
    lines += ["", f"est_ values are estimates from bytes / bandwidth{batch} (est_hidden: link time the "
                  "prefetch overlap hides). They ignore:"]
    lines += [f"  - {item}" for item in plan.est_ignores]
    return lines


def render_plan(plan: Plan, checkpoint: Checkpoint | None = None) -> str:
    """The human-readable plan. ``checkpoint`` (when at hand) adds notes about its shards."""
    lines = _header(plan) + _group_table(plan) + _placement_summary(plan) + _estimates(plan)
    lines += [f"note: {note}" for note in (*plan.notes, *plan.load_notes)]
    if checkpoint is not None and checkpoint.incomplete_shards:
        lines.append(f"note: {len(checkpoint.incomplete_shards)} shard(s) hold headers without all their data "
                     f"(first: {checkpoint.incomplete_shards[0]}): fine for planning, not for loading")
    return "\n".join(lines)
