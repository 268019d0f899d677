"""A plan as people read it: a group table (decoder layers folded) and a summary.

A MoE layer is two groups (the layer and its routed experts); consecutive layers placed
alike fold into one row each for the layers and for their experts, and when a placement
alternates too often to fold (hot layers spread through the stack), layers fold by
placement instead, their indices listed in the summary.

Used by ``selective-offload plan`` and by the demo; it only formats, it decides nothing.
"""

from __future__ import annotations

from .estimate import DEFAULT_DECODE_READ_FACTOR
from .anchors import anchors_for
from .checkpoint import Checkpoint
from .plan import BulkBaseline, Estimate, GroupKind, GroupPlan, Placement, Plan
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
        f" link {inp.link_gbps} GB/s, VRAM {inp.vram_gbps} GB/s (decode reads {inp.vram_read_gbps:.4g}"
        + (")" if inp.decode_read_gbps is not None else f": {DEFAULT_DECODE_READ_FACTOR} x VRAM)")
        + (f"; speculative {inp.speculative}" if inp.speculative else ""),
        "",
    ]


def _row(name: str, groups: list[GroupPlan]) -> str:
    first = groups[0]
    return (f"{name:<40} {_gb(sum(g.bytes for g in groups)):>10} {first.role:<6} {first.location:<8} "
            f"{first.serving:<9} "
            f"{_step_bytes(sum(g.est_link_bytes_per_step for g in groups)):>10} "
            f"{_step_bytes(sum(g.est_vram_bytes_per_step for g in groups)):>10}")


#: More runs of consecutive layers than this, and layers fold by placement instead.
MAX_LAYER_RUNS = 8

_Unit = tuple[GroupPlan, "GroupPlan | None"]  # a decoder layer and its routed experts (or its host-compute MLP)


def _units(plan: Plan) -> list[_Unit]:
    experts = {g.layer_index: g for g in plan.groups if g.kind in (GroupKind.EXPERTS, GroupKind.MLP)}
    return [(g, experts.get(g.layer_index)) for g in plan.groups if g.kind == GroupKind.LAYER]


def _pattern(unit: _Unit) -> tuple:
    layer, experts = unit
    return (layer.placement, None if experts is None else experts.placement)


def _unit_rows(units: list[_Unit], contiguous: bool) -> list[str]:
    """Rows for layers placed alike: the layers, then their routed experts (if any)."""
    layers = [u[0] for u in units]
    experts = [u[1] for u in units if u[1] is not None]
    stack = layers[0].group.rsplit(".", 1)[0]
    if len(units) == 1:
        name = layers[0].group
    elif contiguous:
        name = f"{stack}.{layers[0].layer_index}-{layers[-1].layer_index} ({len(units)})"
    else:  # the summary lists which (hot layers, experts through UVA)
        name = f"{stack}.* ({len(units)} layers)"
    rows = [_row(name, layers)]
    if experts:
        inner = experts[0].group[len(f"{stack}.{experts[0].layer_index}."):]  # mlp.experts, or a dense layer's mlp
        rows.append(_row(experts[0].group if len(units) == 1 else f"  {inner} of those", experts))
    return rows


def _layer_rows(plan: Plan) -> list[str]:
    units = _units(plan)
    runs: list[list[_Unit]] = []
    for u in units:
        if runs and _pattern(runs[-1][-1]) == _pattern(u) and runs[-1][-1][0].layer_index + 1 == u[0].layer_index:
            runs[-1].append(u)
        else:
            runs.append([u])
    if len(runs) <= MAX_LAYER_RUNS:
        return [row for run in runs for row in _unit_rows(run, contiguous=True)]
    by_pattern: dict[tuple, list[_Unit]] = {}
    for u in units:
        by_pattern.setdefault(_pattern(u), []).append(u)
    return [row for same in by_pattern.values() for row in _unit_rows(same, contiguous=False)]


def _group_table(plan: Plan) -> list[str]:
    """One row per group; decoder layers (and their routed experts) folded."""
    header = (f"{'group':<40} {'bytes':>10} {'role':<6} {'location':<8} {'serving':<9} {'link/step':>10} "
              f"{'VRAM/step':>10}")
    lines = [header, "-" * len(header)]
    stack_done = False
    for g in plan.groups:
        if g.kind in (GroupKind.LAYER, GroupKind.EXPERTS, GroupKind.MLP):
            if not stack_done:
                lines += _layer_rows(plan)
                stack_done = True
            continue
        lines.append(_row(g.group, [g]))
    return lines


def _placement_summary(plan: Plan) -> list[str]:
    inp = plan.inputs
    lines = ["", f"strategy  {plan.strategy}"
             + (f": short by {_gb(plan.shortfall_bytes).strip()}" if plan.shortfall_bytes else ""),
             f"deficit   {_gb(plan.deficit_bytes).strip()} (weights to load minus the budget; <= 0 fits)",
             f"cold set  {_gb(plan.cold_bytes).strip()}, of which {_gb(plan.host_cold_bytes).strip()} on the host"]
    uva = [g for g in plan.groups if g.placement == Placement.HOST_UVA]
    if uva:
        lines.append(f"routed experts in host memory, read in place through UVA ({len(uva)} layers, "
                     f"{_gb(plan.host_uva_bytes).strip()}): layers {ranges(sorted(g.layer_index for g in uva))}")
    computed = [g for g in plan.groups if g.placement == Placement.HOST_COMPUTE]
    record = plan.host_compute
    if computed and record is not None:
        threads = ("all physical cores of one NUMA node" if record.threads is None
                   else f"{record.threads} thread{'s' if record.threads != 1 else ''}")
        split = f", {record.ranks} ranks sharing the host" + (" (its cores split between them)" if record.threads is None
                                                               else " each") if record.ranks > 1 else ""
        for kind, what in ((GroupKind.EXPERTS, "routed experts"), (GroupKind.MLP, "dense MLPs")):
            mine = [g for g in computed if g.kind == kind]
            if mine:
                lines.append(f"{what} in host memory, computed there by the host CPU ({len(mine)} layers, "
                             f"{_gb(sum(g.bytes for g in mine)).strip()}): "
                             f"layers {ranges(sorted(g.layer_index for g in mine))}")
        lines.append(f"host CPU  {record.format} kernel at {record.cpu_gbps:g} GB/s ({record.cpu_gbps_source}), "
                     f"{threads}{split}; crossover {record.crossover_tokens} tokens per step (above it: copied over "
                     f"the link, computed on the GPU); est CPU time {_ms(plan.est.est_cpu_s_per_step).strip()} per step")
    if plan.hot_layer_indices:
        lines.append(f"hot layers on the host, served by vLLM's prefetch offloader ({len(plan.hot_layer_indices)}, "
                     f"{_gb(plan.host_hot_bytes).strip()}): "
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
    """Selective against vLLM's own cpu_offload_gb (and without speculation, when it was
    asked for), every figure labelled est_."""
    inp = plan.inputs
    batch = f", batch {inp.batch}" if inp.batch > 1 else ""
    lines = ["", f"{'':<54} {'host bytes':>10} {'est_link':>10} {'est_hidden':>10} {'est_vram':>10} "
                 f"{'est_step':>10} {'est_tok/s':>9}" + (f" {'per seq':>8}" if inp.batch > 1 else "")]

    def summary(label: str, host: int, est: Estimate) -> str:
        return (f"{label:<54} {_gb(host):>10} {_ms(est.est_link_s_per_step):>10} "
                f"{_ms(est.est_hidden_link_s_per_step):>10} {_ms(est.est_vram_s_per_step):>10} "
                f"{_ms(est.est_step_s):>10} {est.est_tok_s:9.2f}"
                + (f" {est.est_tok_s_per_seq:8.2f}" if inp.batch > 1 else ""))

    for baseline in plan.baselines:
        lines.append(summary(f"vLLM {baseline.label}"[:54], baseline.offloaded_bytes, baseline.est)
                     + ("" if baseline.fits else "  (does not fit)"))
    spec = f", MTP K={plan.spec_tokens} a={inp.accept_rate:.2f}" if plan.spec_tokens else ""
    lines.append(summary(f"selective ({plan.strategy}{spec})", plan.host_bytes, plan.est))
    alt = plan.alternative
    if alt is not None:
        lines.append(summary(f"selective, {alt.label}"[:54], alt.host_cold_bytes + alt.host_hot_bytes + alt.host_uva_bytes
                             + alt.host_compute_bytes,
                             alt.est) + f"  ({len(alt.hot_layer_indices)} hot layers)")
    experts = [g for g in plan.groups if g.kind == GroupKind.EXPERTS]
    if experts:
        for anchor in anchors_for(plan.model.architectures, plan.model.num_hidden_layers, experts[0].num_experts,
                                  plan.inputs.device_memory_bytes):
            lines.append(anchor.line())
    if plan.strategy != "infeasible":
        for baseline in plan.baselines:
            lines.append(f"est speed-up over {_short(baseline)}: {plan.est.est_tok_s / baseline.est.est_tok_s:.2f}x"
                         f" (link time {_ms(baseline.est.est_link_s_per_step).strip()} -> "
                         f"{_ms(plan.est.est_link_s_per_step).strip()} per step, "
                         f"{_ms(plan.est.est_hidden_link_s_per_step).strip()} of it hidden behind compute)")
    for baseline in plan.baselines:
        lines.append(f"{_short(baseline)} takes {baseline.offloaded_tensors} tensors of layers "
                     f"{ranges(baseline.layers_touched)} in model order (cpu_offload_gb counts GiB"
                     + ("; routed experts on the host are read top-k through UVA, like the plan's)"
                        if any(g.kind == GroupKind.EXPERTS for g in plan.groups) else ")"))
    lines += ["", f"est_ values are estimates from bytes / bandwidth{batch} (est_hidden: link time the "
                  "prefetch overlap hides). They ignore:"]
    lines += [f"  - {item}" for item in plan.est_ignores]
    return lines


def _short(baseline: BulkBaseline) -> str:
    return "cpu_offload_params" if baseline.cpu_offload_params else "cpu_offload_gb"


def render_plan(plan: Plan, checkpoint: Checkpoint | None = None) -> str:
    """The human-readable plan. ``checkpoint`` (when at hand) adds notes about its shards."""
    lines = _header(plan) + _group_table(plan) + _placement_summary(plan) + _estimates(plan)
    lines += [f"note: {note}" for note in (*plan.notes, *plan.load_notes)]
    if checkpoint is not None and checkpoint.incomplete_shards:
        lines.append(f"note: {len(checkpoint.incomplete_shards)} shard(s) hold headers without all their data "
                     f"(first: {checkpoint.incomplete_shards[0]}): fine for planning, not for loading")
    return "\n".join(lines)
