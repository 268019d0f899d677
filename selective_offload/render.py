"""A plan as people read it: the verdict first, then the totals they check, the estimate and
the next command; ``--verbose`` adds the detail (every group, decoder layers folded, the
budget, each step's parts, the notes), ``--explain`` what the estimate leaves out and a
competitor's published figure for a model and card like these.

The default view (:func:`render_plan`) is a screenful that a user checks against
``nvidia-smi`` and ``free``: line 1 is the model (named by its folder), the card and the
verdict (a checkpoint that fits whole needs no plan; when nothing fits, by how much, and
on the lines after it each flag that would make it fit); then device memory as weights +
buffers + transients + KV + reserve of the card, the host bytes against the host RAM
checked, the estimate rows beside vLLM's own offload with the rates they assume (none for
an infeasible plan), the host CPU's part or why it has none, and the commands to save and
apply the plan (:class:`Shown` carries what only the command line knows: the name typed,
where the rates and the RAM came from, the commands).

In the detail, a MoE layer is two groups (the layer and its routed experts); consecutive
layers placed alike fold into one row each for the layers and for their experts, and when a
placement alternates too often to fold (hot layers spread through the stack), layers fold by
placement instead, their indices listed in the summary. Every size goes through one
formatter, :func:`~selective_offload.sizes.fmt_bytes` (the landing report's too).

Used by ``selective-offload plan`` and by the demo; it only formats, it decides nothing.
"""

from __future__ import annotations

import re
import shlex
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

from .anchors import anchors_for
from .checkpoint import Checkpoint
from .estimate.traffic import DEFAULT_DECODE_READ_FACTOR
from .plan_format import EST_IGNORES, EST_MODEL, Estimate, GroupKind, GroupPlan, Plan, Serving, Strategy, VllmBaseline
from .plan_format.contents import MIN_PRICED_MODEL_BYTES, priced  # noqa: F401  (the tok/s rule; re-exported)
from .planner.cards import card_memory
from .planner.host_compute import head_words
from .sizes import GiB, fmt_bytes


def _step_bytes(nbytes: int) -> str:
    """Per-step reads: a gathered embedding row is kilobytes, a layer is gigabytes."""
    return fmt_bytes(nbytes) if nbytes else "-"


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
        f"model     {m.source}  ({m.num_tensors} tensors, {fmt_bytes(m.total_bytes).strip()}, fingerprint {m.fingerprint})",
        f"card      {fmt_bytes(inp.device_memory_bytes).strip()}: planned for {fmt_bytes(inp.card_bytes).strip()} "
        f"({inp.usable_from or 'as given'})",
        f"budget    {fmt_bytes(inp.card_bytes).strip()} device - {fmt_bytes(inp.kv_cache_bytes).strip()} KV cache"
        f" - {fmt_bytes(inp.reserve_bytes).strip()} reserve = {fmt_bytes(plan.weight_budget_bytes).strip()} for weights;"
        f" link {inp.link_gbps} GB/s, VRAM {inp.vram_gbps} GB/s (decode reads {inp.vram_read_gbps:.4g}"
        + (")" if inp.decode_read_gbps is not None else f": {DEFAULT_DECODE_READ_FACTOR} x VRAM)")
        + (f"; speculative {inp.speculative}" if inp.speculative else ""),
        "",
    ]


def _row(name: str, groups: list[GroupPlan]) -> str:
    first = groups[0]
    return (f"{name:<40} {fmt_bytes(sum(g.bytes for g in groups)):>10} {first.role:<6} {first.location:<8} "
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
    return (layer.serving, None if experts is None else experts.serving)


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
    lines = ["", f"strategy  {plan.strategy}",
             f"deficit   {fmt_bytes(plan.deficit_bytes).strip()} (weights to load minus the budget; <= 0 fits)",
             f"cold set  {fmt_bytes(plan.cold_bytes).strip()}, of which {fmt_bytes(plan.cold_on_host_bytes).strip()} on the host"]
    uva = [g for g in plan.groups if g.serving == Serving.UVA]
    if uva:
        lines.append(f"routed experts in host memory, read in place through UVA ({len(uva)} layers, "
                     f"{fmt_bytes(plan.uva_bytes).strip()}): layers {ranges(sorted(g.layer_index for g in uva))}")
    computed = [g for g in plan.groups if g.serving == Serving.COMPUTE]
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
                             f"{fmt_bytes(sum(g.bytes for g in mine)).strip()}): "
                             f"layers {ranges(sorted(g.layer_index for g in mine))}")
        for g in (g for g in computed if g.kind == GroupKind.MODULE):
            lines.append(head_words(g))
        lines.append(f"host CPU  {record.format} kernel at {record.cpu_gbps:g} GB/s ({record.cpu_gbps_source}), "
                     f"{threads}{split}; crossover {record.crossover_tokens} tokens per step (above it: copied over "
                     f"the link, computed on the GPU); est CPU time {_ms(plan.est.est_cpu_s_per_step).strip()} per step")
    if plan.hot_layer_indices:
        lines.append(f"hot layers on the host, served by vLLM's prefetch offloader ({len(plan.hot_layer_indices)}, "
                     f"{fmt_bytes(plan.prefetch_bytes).strip()}): "
                     f"{ranges(plan.hot_layer_indices)}")
        lines.append(f"prefetch buffers {fmt_bytes(plan.prefetch_buffer_bytes).strip()} on the device "
                     f"(prefetch_step={inp.prefetch_step} slot(s) of the largest layer)")
    if plan.est_transient_device_bytes:
        lines.append(f"est transient device bytes while a cold tower runs: "
                     f"{fmt_bytes(plan.est_transient_device_bytes).strip()}")
    return lines


def _estimates(plan: Plan) -> list[str]:
    """What each estimated step is made of (the summary has the totals, tok/s and speed-ups):
    link time, the part of it hidden behind compute, VRAM reads; and which tensors vLLM's
    own offload takes."""
    inp = plan.inputs
    batch = f", batch {inp.batch}" if inp.batch > 1 else ""
    lines = ["", f"{'step parts (est)':<40} {'link':>10} {'hidden':>10} {'VRAM':>10}"]

    def parts(label: str, est: Estimate) -> str:
        return (f"{label[:40]:<40} {_ms(est.est_link_s_per_step):>10} {_ms(est.est_hidden_link_s_per_step):>10} "
                f"{_ms(est.est_vram_s_per_step):>10}")

    for baseline in plan.baselines:
        lines.append(parts(f"vLLM {_short(baseline)}", baseline.est))
    lines.append(parts("this plan", plan.est))
    if plan.alternative is not None:
        lines.append(parts(f"  {plan.alternative.label}", plan.alternative.est))
    for baseline in plan.baselines:
        lines.append(f"{_short(baseline)} takes {baseline.offloaded_tensors} tensors of layers "
                     f"{ranges(baseline.layers_touched)} in model order (cpu_offload_gb counts GiB"
                     + ("; routed experts on the host are read top-k through UVA, like the plan's)"
                        if any(g.kind == GroupKind.EXPERTS for g in plan.groups) else ")"))
    lines.append(f"hidden: link time the prefetch overlap hides{batch}; --explain: what the estimate leaves out")
    return lines


def _short(baseline: VllmBaseline) -> str:
    return "cpu_offload_params" if baseline.cpu_offload_params else "cpu_offload_gb"


@dataclass(frozen=True)
class Shown:
    """What the command line knows of a plan and the plan does not: the model's name as the
    user typed it, where the host RAM checked and the rates came from, and the commands that
    save and apply the plan (the demo and the library have none of these)."""

    #: The model as the user named it (default: the plan's source, cut short).
    label: str | None = None
    #: Whose RAM ``inputs.host_memory_bytes`` is: ``"this machine's"`` or ``"--host-memory"``.
    host_ram_from: str | None = None
    #: Where each bandwidth came from, by name (``link``, ``vram``): ``given``, ``probed`` or
    #: ``reference`` (the reference laptop's, no probe of a GPU here).
    rates_from: dict[str, str] = field(default_factory=dict)
    #: The commands to run next (shell-quoted), first the one that saves the plan when none was saved.
    next_commands: tuple[str, ...] = ()
    #: Files written (the plan, pictures), as ``what path`` phrases.
    written: tuple[str, ...] = ()


#: The width of the default view's labels (``device``, ``host``, ``next:``).
_LABEL = 7


def _label(name: str, text: str) -> str:
    return f"{name:<{_LABEL}}{text}"


def _cont(text: str) -> str:
    return " " * _LABEL + text


#: The terminal width the default view is laid out for.
WIDTH = 80
#: The widest line of the ``--verbose`` detail (its group table is 99 columns).
DETAIL_WIDTH = 100


def _wrapped(name: str, pieces: list[str]) -> list[str]:
    """``pieces`` after a label, as many to a line as fit :data:`WIDTH` (a piece is never split)."""
    lines = [name.ljust(_LABEL)]
    for piece in pieces:
        if len(lines[-1]) > _LABEL and len(lines[-1]) + len(piece.rstrip()) > WIDTH:
            lines.append(" " * _LABEL)
        lines[-1] += piece.lstrip() if len(lines[-1]) == _LABEL else piece
    return [line.rstrip() for line in lines]


def _card(nbytes: int) -> str:
    """A card's memory as it is sold (24 GiB), or in decimal units when not a whole GiB."""
    return f"{nbytes // GiB} GiB" if nbytes and nbytes % GiB == 0 else fmt_bytes(nbytes)


def model_name(typed: str) -> str:
    """A model as people name it: a checkpoint by its folder (``config.json``, a shard or the
    folder itself), a manifest by its file name less ``.json``; a hub id, a bundled name or
    any other label as given."""
    path = Path(typed).expanduser()
    try:
        exists = path.exists()
    except OSError:
        exists = False
    if not exists:
        return typed
    if path.is_dir() or path.name == "config.json" or path.suffix == ".safetensors":
        folder = path if path.is_dir() else path.parent
        return folder.resolve().name or str(folder)
    return path.name.removesuffix(".json").removesuffix(".manifest")


def _model_name(plan: Plan, shown: Shown) -> str:
    source = model_name(shown.label) if shown.label else plan.model.source.removeprefix("bundled: ").split(" (")[0]
    return source if len(source) <= 40 else "..." + source[-37:]


def verdict(plan: Plan, shown: Shown | None = None) -> list[str]:
    """Line 1: the model, the card and the verdict; when nothing fits, by how much on line 1
    and what to change on the lines after it (so line 1 stays readable in a terminal)."""
    shown = shown or Shown()
    inp = plan.inputs
    head = f"{_model_name(plan, shown)} on a {_card(inp.device_memory_bytes)} card"
    if plan.strategy == Strategy.INFEASIBLE:
        short = []
        if plan.shortfall_bytes:
            short.append(f"{fmt_bytes(plan.shortfall_bytes)} short of device memory")
        if plan.host_shortfall_bytes:
            short.append(f"{fmt_bytes(plan.host_shortfall_bytes)} short of host RAM")
        if not short:
            return [f"{head}: INFEASIBLE: the placement does not fit"]
        return [f"{head}: INFEASIBLE: " + ", ".join(short)] + _wrapped("fix", fixes(plan, shown))
    if not plan.host_bytes:
        return [f"{head}: fits whole on the device; plain `vllm serve` needs no plan"]
    return [f"{head}: fits with {fmt_bytes(plan.host_bytes)} on the host"]


def device_memory_fix(plan: Plan) -> int:
    """The smallest whole GiB of ``--device-memory`` whose card (its class's margin and CUDA
    context taken off, as :func:`~selective_offload.planner.cards.card_memory` does) holds
    this plan's device lines and the bytes its host falls short by. A device shortfall alone
    is exact (the same placement fits); host bytes brought back to the device are est."""
    need = plan.inputs.card_bytes + plan.shortfall_bytes + plan.host_shortfall_bytes
    gib = -(-need // GiB)
    while card_memory(gib * GiB)[0] < need:
        gib += 1
    return gib


def fixes(plan: Plan, shown: Shown | None = None) -> list[str]:
    """What would make an infeasible plan fit, each a flag of ``plan`` (with the value that
    does it where the plan's own figures give one), as pieces for :func:`_wrapped`."""
    inp = plan.inputs
    room = plan.shortfall_bytes + plan.host_shortfall_bytes  # device bytes a fit needs, at most
    moved = " (all it can move is on the host already)" if plan.shortfall_bytes else " (est)"
    out = [f"{word} " for word in f"--device-memory {device_memory_fix(plan)}GiB{moved},".split(" ")]
    if inp.kv_cache_bytes + inp.reserve_bytes > room:
        out.append("less --kv-cache or --reserve, ")
    if plan.host_shortfall_bytes and not plan.shortfall_bytes:  # the same plan fits a host with this much RAM
        need = -(-(plan.host_bytes + inp.host_headroom_bytes) // GiB)
        whose = (shown.host_ram_from if shown and shown.host_ram_from else "--host-memory")
        words = (f"--host-memory {need}GiB (a host with that much RAM; {whose}: "
                 f"{fmt_bytes(inp.host_memory_bytes or 0).strip()}, of which {fmt_bytes(inp.host_headroom_bytes).strip()} "
                 "is kept for the system and vLLM, est), ").split(" ")
        out += [f"{word} " for word in words if word]
    return out + ["or a smaller checkpoint"]


def _device_lines(plan: Plan) -> list[str]:
    """Device memory as ``nvidia-smi`` shows it used: weights + buffers + transients + KV +
    reserve, of the card."""
    inp = plan.inputs
    grown = plan.post_processing_bytes(Serving.RESIDENT)
    parts = [(plan.device_bytes - grown, "weights"), (grown, "post-processing"),
             (plan.device_share_bytes, "device share"), (plan.prefetch_buffer_bytes, "buffers"),
             (plan.est_transient_device_bytes, "transient"), (plan.est_vllm_workspace_bytes, "MoE workspace"),
             (inp.kv_cache_bytes, "KV"), (inp.reserve_bytes, "reserve")]
    shown = [f"{fmt_bytes(n)} {what}" for n, what in parts if n or what == "weights"]
    used = sum(n for n, _ in parts)
    pieces = [p + " + " for p in shown[:-1]] + [shown[-1] + " ", f"= {fmt_bytes(used)} "
                                                f"of {fmt_bytes(inp.card_bytes)}"]
    if inp.card_bytes != inp.device_memory_bytes:  # the card's class figure, or the probe's
        measured = (inp.usable_from or "").startswith("measured")
        pieces.append(f" (free {'measured' if measured else 'est'} of the {_card(inp.device_memory_bytes)} card)")
    if plan.absent_bytes:
        pieces.append(f" ({fmt_bytes(plan.absent_bytes)} not loaded)")
    return _wrapped("device", pieces)


def _host_lines(plan: Plan, shown: Shown) -> list[str]:
    """Host bytes as ``free`` shows them used, against the RAM checked (and whose), then by
    how they are served."""
    inp = plan.inputs
    whose = f" ({shown.host_ram_from})" if shown.host_ram_from else ""
    ram = ("(host RAM not checked)" if inp.host_memory_bytes is None
           else f"of {fmt_bytes(inp.host_available_bytes or 0)} free of {fmt_bytes(inp.host_memory_bytes).strip()} "
                f"RAM{whose}")
    if not plan.host_bytes:
        return _wrapped("host", ["nothing ", ram])
    parts = [(plan.cold_on_host_bytes, "cold"),
             (plan.prefetch_bytes, f"prefetched ({len(plan.hot_layer_indices)} layers)"),
             (plan.uva_bytes, "read in place (UVA)"), (plan.host_compute_bytes, "computed on the CPU"),
             (plan.host_compute_staging_bytes + plan.host_compute_workspace_bytes, "the CPU's buffers")]
    said = [f"{fmt_bytes(n)} {what}" for n, what in parts if n]
    if len(said) == 1:
        return _wrapped("host", [said[0] + " ", ram])
    return _wrapped("host", [f"{fmt_bytes(plan.host_bytes)} ", ram + ": ", *(p + " + " for p in said[:-1]), said[-1]])


def _speedups(plan: Plan) -> str:
    if plan.strategy == Strategy.INFEASIBLE:
        return ""
    return ", ".join(f"{plan.est.est_tok_s / b.est.est_tok_s:.2f}x {_short(b)}" for b in plan.baselines
                     if b.est.est_tok_s > 0)


def _rates_line(plan: Plan, shown: Shown) -> str:
    """The rates the estimate assumes, and where they came from, in one short line."""
    inp = plan.inputs
    link, vram = shown.rates_from.get("link"), shown.rates_from.get("vram")
    words = {"given": "given", "probed": "this machine's probe", "reference": "reference laptop's"}
    if link is None or vram is None:
        text = f"link {inp.link_gbps:g}, VRAM {inp.vram_gbps:g} GB/s"
    elif link == vram:
        text = f"link {inp.link_gbps:g}, VRAM {inp.vram_gbps:g} GB/s: {words[link]}"
        text += "; run selective-offload probe" if link == "reference" else ""
    else:
        text = f"link {inp.link_gbps:g} GB/s ({words[link]}), VRAM {inp.vram_gbps:g} GB/s ({words[vram]})"
    if inp.compute_tflops is not None:
        text += f", compute {inp.compute_tflops:g} TFLOP/s"
    return _label("rates", text)


def _estimate_lines(plan: Plan, shown: Shown) -> list[str]:
    """vLLM's own offload and this plan, est tok/s and speed-up (none for a model too small
    to price), then the rates they assume."""
    if plan.strategy == Strategy.INFEASIBLE:
        return []
    if not priced(plan):
        return _wrapped("est", [f"no tok/s: {fmt_bytes(plan.model.total_bytes)} of weights is below "
                                f"{MIN_PRICED_MODEL_BYTES >> 20} MiB, ", "where a step is launch overhead, ",
                                "not bytes over bandwidth"])
    inp = plan.inputs
    per_seq = inp.batch > 1
    width = 30

    def row(label: str, host: int, est: Estimate, tail: str = "") -> list[str]:
        """One row; a label wider than its column (vLLM's two settings) breaks after its
        last comma that fits, the rest indented on the row's own line."""
        head = []
        cut = label.rfind(", ", 0, width) if len(label) > width else -1
        if cut > 0:
            head, label = [label[:cut + 1]], "  " + label[cut + 2:]
        return head + [f"{label:<{width}} {fmt_bytes(host):>10} {est.est_step_s * 1e3:8.1f} {est.est_tok_s:7.2f}"
                       + (f" {est.est_tok_s_per_seq:7.2f}" if per_seq else "") + (f"  {tail}" if tail else "")]

    spec = f", MTP K={plan.spec_tokens} a={inp.accept_rate:.2f}" if plan.spec_tokens else ""
    speedups = _speedups(plan)
    mine = row(f"this plan{f' ({spec[2:]})' if spec else ''}", plan.host_bytes, plan.est)
    inline = not speedups or len(mine[-1]) + 2 + len(speedups) <= WIDTH  # else on a line of their own below
    if inline and speedups:
        mine[-1] += f"  {speedups}"
    elif speedups:
        mine += _wrapped("", [f"  est speed-up: {speedups}"])
    lines = [f"{'estimate (bytes / bandwidth)':<{width}} {'host bytes':>10} {'ms/step':>8} {'tok/s':>7}"
             + (f" {'per seq':>7}" if per_seq else "") + ("  speed-up" if plan.baselines and inline else "")]
    for baseline in plan.baselines:
        lines += row(f"vLLM {baseline.label}", baseline.offloaded_bytes, baseline.est, _baseline_misfit(plan, baseline))
    alt = plan.alternative
    lines += mine
    if alt is not None:
        lines += row(f"  {alt.label.replace('speculative decoding', 'speculation')}",
                     alt.cold_on_host_bytes + alt.prefetch_bytes + alt.uva_bytes + alt.host_compute_bytes,
                     alt.est, "slower" if plan.est.est_tok_s >= alt.est.est_tok_s else "faster")
    return lines + [_rates_line(plan, shown)]


def _baseline_misfit(plan: Plan, baseline: VllmBaseline) -> str:
    """Where vLLM's own offload would not fit: the card (its weights left on the device) and
    the host RAM checked (the bytes it offloads)."""
    available = plan.inputs.host_available_bytes
    over_host = available is not None and baseline.offloaded_bytes > available
    return {(True, False): "(over the card)", (False, True): "(over host RAM)",
            (True, True): "(over card and RAM)"}.get((not baseline.fits, over_host), "")


def anchor_lines(plan: Plan) -> list[str]:
    """A competitor's published figure for a model and card like these (llama.cpp's), its
    setup and source broken between words (``--explain``)."""
    experts = [g for g in plan.groups if g.kind == GroupKind.EXPERTS]
    lines: list[str] = []
    if experts:
        for anchor in anchors_for(plan.model.architectures, plan.model.num_hidden_layers, experts[0].num_experts,
                                  plan.inputs.device_memory_bytes):
            lines += textwrap.wrap(anchor.line(), WIDTH, subsequent_indent=" " * _LABEL, break_on_hyphens=False)
    return lines


def _cpu_unused(plan: Plan, checkpoint: Checkpoint | None) -> str | None:
    """Why a plan with bytes on the host computes none of them on the host CPU (``None`` when
    it has none there to compute)."""
    inp = plan.inputs
    if not any(g.serving in (Serving.PREFETCH, Serving.UVA) for g in plan.groups):
        return None  # nothing on the host a decode step computes (cold weights only, or none)
    declined = plan.host_compute_declined
    if declined:  # the planner's own cause
        return declined
    if not inp.host_compute:
        return "host-compute is off for this plan (--no-host-compute)"
    if checkpoint is not None:
        from .planner.host_compute import claim_of, mlp_cpu_format, model_cpu_format
        from .planner.kernels import method_of_config

        fmt = (model_cpu_format(checkpoint) if any(g.kind == GroupKind.EXPERTS for g in plan.groups)
               else mlp_cpu_format(method_of_config(checkpoint.config), checkpoint.config))
        fast, why = claim_of(fmt, inp)
        if not fast:
            return why
    return "est faster without it (see --verbose)"


def _host_compute_line(plan: Plan, checkpoint: Checkpoint | None = None) -> list[str]:
    """Host-compute: the CPU kernel's format, its rate and where it came from, the crossover;
    or, where the plan computes none of its host experts there, why not."""
    record = plan.host_compute
    computed = [g for g in plan.groups if g.serving == Serving.COMPUTE]
    if record is None or not computed:  # the first thing a user comparing with llama.cpp's --n-cpu-moe asks
        why = _cpu_unused(plan, checkpoint)
        return _wrapped("cpu", [f"{word} " for word in f"not used: {why}".split()]) if why else []
    layers = len({g.layer_index for g in computed if g.layer_index is not None})
    return _wrapped("cpu", [f"{record.format} at {record.cpu_gbps:g} GB/s ({record.cpu_gbps_source}) ",
                            f"on {layers} layers, ", f"crossover {record.crossover_tokens} tokens/step"])


def summary(plan: Plan, checkpoint: Checkpoint | None = None, shown: Shown | None = None) -> list[str]:
    """The default view: the verdict first (see the module docstring)."""
    shown = shown or Shown()
    lines = verdict(plan, shown)
    lines += _device_lines(plan) + _host_lines(plan, shown)
    if checkpoint is not None and checkpoint.incomplete_shards:
        lines.append(_label("note", f"{len(checkpoint.incomplete_shards)} shard(s) hold headers without all their "
                                    "data: fine for planning, not for loading"))
    if plan.model.kind == "config":
        lines.append(_label("sizes", "estimated from config.json alone (no shard headers read)"))
    lines += _estimate_lines(plan, shown) + _host_compute_line(plan, checkpoint)
    if shown.written:
        lines.append(_label("wrote", "; ".join(shown.written)))
    if shown.next_commands and plan.strategy != Strategy.INFEASIBLE:
        first, *rest = [line for c in shown.next_commands for line in _command_lines(c)]
        lines += [_label("next:", first)] + [_cont(c) for c in rest]
    return lines


#: One word of a POSIX shell command as written: unquoted characters, '...' and "..." runs
#: and backslash escapes, side by side (``SELECTIVE_OFFLOAD_PLAN='my plan.json'`` is one word).
_SHELL_WORD = re.compile(r"""(?:[^\s'"\\]+|'[^']*'|"(?:[^"\\]|\\.)*"|\\.)+""")


def _command_lines(command: str) -> list[str]:
    """A shell command as lines that fit the view after its label: broken before its
    ``--`` options, each broken line ending in `` \\`` (so the lines paste as one command),
    the options after it indented; a comment or a command that fits stays one line. Each
    word is kept as the command quotes it (an assignment stays an assignment: quoting it
    whole would make the shell take it for a command's name)."""
    room = WIDTH - _LABEL
    if command.startswith("#") or len(command) <= room:
        return [command]
    groups: list[list[str]] = []
    for word in _SHELL_WORD.findall(command):
        if not groups or shlex.split(word)[0].startswith("--"):
            groups.append([])
        groups[-1].append(word)
    lines = [" ".join(groups[0])]
    for group in groups[1:]:
        part = " ".join(group)
        if len(lines[-1]) + 1 + len(part) + 2 > room:
            lines[-1] += " \\"
            lines.append("  " + part)
        else:
            lines[-1] += " " + part
    return lines


def explanation() -> list[str]:
    """What the estimate leaves out (``--explain``): the prose lives here, in code, and the
    plan file names only the estimate model."""
    lines = [f"the estimate ({EST_MODEL}) prices a step as bytes over bandwidth;", "it leaves out:"]
    for item in EST_IGNORES:
        lines += textwrap.wrap(item, WIDTH, initial_indent="  - ", subsequent_indent="    ",
                               break_on_hyphens=False)
    return lines


def render_plan(plan: Plan, checkpoint: Checkpoint | None = None, *, verbose: bool = False, explain: bool = False,
                shown: Shown | None = None) -> str:
    """The human-readable plan: the verdict first (:func:`summary`); ``verbose`` adds every
    group and the notes, ``explain`` what the estimate leaves out. ``checkpoint`` (when at
    hand) adds notes about its shards."""
    lines = summary(plan, checkpoint, shown)
    notes = [*plan.notes, *plan.load_notes]
    if verbose:  # the detail the summary leaves out, never its totals again
        detail = [""] + _header(plan) + _group_table(plan) + _placement_summary(plan)
        detail += _estimates(plan) if priced(plan) and plan.strategy != Strategy.INFEASIBLE else []
        detail += [""] + [f"note: {note}" for note in notes]
        if checkpoint is not None and checkpoint.incomplete_shards:
            detail.append(f"note: first shard without all its data: {checkpoint.incomplete_shards[0]}")
        width = DETAIL_WIDTH
        lines += [part for line in detail for part in (textwrap.wrap(line, width, subsequent_indent="      ",
                                                                     break_on_hyphens=False)
                                                       if len(line) > width else [line])]
    if explain:
        lines += [""] + explanation() + ([""] + anchor_lines(plan) if anchor_lines(plan) else [])
    if not verbose:
        more = ["--verbose: every group" + (f", {len(notes)} note{'s' if len(notes) > 1 else ''}" if notes else "")]
        if not explain:
            more.append("--explain: what the estimate omits")
        lines.append(_label("more:", "; ".join(more)))
    return "\n".join(lines)
