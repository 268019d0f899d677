"""A plan as a picture: which bytes go where, and what each placement costs per step.

A 64-layer plan is a long table; the picture shows at a glance every group's bytes by how
it is served (one bar per decoder layer, an MoE layer's routed experts hatched on top of
the rest of the layer; the embedding, towers, head and MTP as bars of their own), the
totals by serving beside vLLM's own ``cpu_offload_gb``, and the estimated decode step split
into VRAM time and link time (the part the prefetch overlap hides drawn apart), selective
beside ``cpu_offload_gb``. Every time is an estimate and says so.

:func:`picture_data` decides what is drawn (plain numbers, JSON-able, so a test can check
the picture's content without comparing pixels); :func:`draw` only draws it, with
matplotlib, which is needed for this and nothing else (the ``picture`` extra).
"""

from __future__ import annotations

import argparse
import io
import textwrap
from pathlib import Path
from typing import Any

from .errors import UserError
from .outputs import PICTURE_MARK, write_files
from .plan_format import GroupKind, GroupPlan, Plan, Serving
from .sizes import GB, GiB

#: Colours of the known servings; a serving this module does not know (a newer plan
#: format) gets one of :data:`_SPARE_COLOURS` and its own legend entry.
COLOURS = {
    Serving.RESIDENT.value: "#4c72b0",
    Serving.GATHER.value: "#55a868",
    Serving.ON_DEMAND.value: "#8fc79a",
    Serving.PREFETCH.value: "#c44e52",
    Serving.UVA.value: "#dd8452",
    Serving.COMPUTE.value: "#8172b3",
    Serving.NONE.value: "#c8c8c8",
}
#: A host-compute group's device share: a copy of its first experts or channels on the device.
DEVICE_SHARE = "device share"
COLOURS[DEVICE_SHARE] = "#64b5cd"
_SPARE_COLOURS = ("#937860", "#da8bc3", "#8c8c8c", "#ccb974", "#2f4b7c")
LABELS = {
    Serving.RESIDENT.value: "device, resident",
    Serving.GATHER.value: "host, rows gathered (embedding)",
    Serving.ON_DEMAND.value: "host, onloaded on demand (towers)",
    Serving.PREFETCH.value: "host, prefetched per step (vLLM's prefetch offloader)",
    Serving.UVA.value: "host, experts read in place (UVA)",
    Serving.COMPUTE.value: "host, computed there by the CPU",
    Serving.NONE.value: "absent (not loaded)",
    DEVICE_SHARE: "device, a copy of the first experts or MLP channels (device share)",
}
#: The key and legend of the bytes vLLM's cpu_offload_gb baseline puts on the host.
CPU_OFFLOAD_GB = "cpu_offload_gb"
#: Layer numbers shown on the axis: every this many, so 64 layers stay readable.
LAYER_TICK_EVERY = 8
INSTALL_HINT = "pip install 'selective-offload[picture]' (or pip install matplotlib)"


def _short(group: str) -> str:
    parts = group.split(".")
    while parts and parts[0] in ("model", "language_model", "thinker"):
        parts = parts[1:]
    if len(parts) >= 2 and parts[-1].isdigit():
        return ".".join(parts[-2:])
    return parts[-1] if parts else group


def _serving(g: GroupPlan) -> str:
    """How ``g`` is served (a serving this release does not know, as it is named)."""
    return str(g.serving)


def picture_data(plan: Plan) -> dict[str, Any]:
    """What the picture shows, as plain numbers (bytes, seconds)."""
    slots: list[dict[str, Any]] = []
    by_layer: dict[int, dict[str, Any]] = {}
    for g in plan.groups:
        experts = g.kind == "experts"
        entry = {"group": g.group, "serving": _serving(g), "bytes": g.bytes, "experts": experts}
        if g.layer_index is not None and g.kind in (GroupKind.LAYER, GroupKind.EXPERTS, GroupKind.MLP):
            slot = by_layer.get(g.layer_index)
            if slot is None:
                slot = by_layer[g.layer_index] = {"label": str(g.layer_index), "layer": g.layer_index, "stack": []}
                slots.append(slot)
            slot["stack"].append(entry)
            share = plan.share_bytes(g)
            if share:
                slot["stack"].append({"group": g.group, "serving": DEVICE_SHARE, "bytes": share,
                                      "experts": experts})
        else:
            slots.append({"label": _short(g.group), "layer": None, "stack": [entry]})
            share = plan.share_bytes(g)
            if share:  # a split LM head: its first rows on the device too
                slots[-1]["stack"].append({"group": g.group, "serving": DEVICE_SHARE, "bytes": share, "experts": False})
    for slot in slots:  # the rest of a layer first, its routed experts on top
        slot["stack"].sort(key=lambda e: e["experts"])

    totals: dict[str, int] = {}
    for g in plan.groups:
        totals[_serving(g)] = totals.get(_serving(g), 0) + g.bytes
    if plan.device_share_bytes:
        totals[DEVICE_SHARE] = plan.device_share_bytes

    def step(est) -> dict[str, float]:
        hidden = min(est.est_hidden_link_s_per_step, est.est_link_s_per_step)
        return {"est_vram_s": est.est_vram_s_per_step, "est_link_exposed_s": est.est_link_s_per_step - hidden,
                "est_link_hidden_s": hidden, "est_draft_s": est.est_draft_s_per_step,
                "est_cpu_s": est.est_cpu_s_per_step,
                "est_step_s": est.est_step_s, "est_tok_s": est.est_tok_s}

    rows = [{"label": "this plan", "bytes": totals, "step": step(plan.est)}]
    cpu_offload = plan.vllm_cpu_offload_gb
    if cpu_offload is not None:
        absent = totals.get(Serving.NONE.value, 0)
        cpu_offload_bytes = {Serving.RESIDENT.value: plan.model.total_bytes - absent - cpu_offload.offloaded_bytes,
                      CPU_OFFLOAD_GB: cpu_offload.offloaded_bytes}
        if absent:
            cpu_offload_bytes[Serving.NONE.value] = absent
        rows.append({"label": f"vLLM cpu_offload_gb={cpu_offload.cpu_offload_gb:g}"
                              + ("" if cpu_offload.fits else "\n(over the card)"),
                     "bytes": cpu_offload_bytes, "step": step(cpu_offload.est), "layers": list(cpu_offload.layers_touched)})
    inp = plan.inputs
    name = plan.model.source.removeprefix("bundled: ").split(" (")[0]
    return {
        "title": f"{name} on a {inp.device_memory_bytes / GiB:.3g} GiB card ({inp.device_memory_bytes / GB:.2f} GB): "
                 f"this plan beside vLLM's cpu_offload_gb (link {inp.link_gbps:g} GB/s, VRAM {inp.vram_gbps:g} GB/s)",
        "slots": slots,
        "rows": rows,
        "servings": list(dict.fromkeys([*COLOURS, *totals])),
    }


def _colours(servings: list[str]) -> dict[str, str]:
    colours = dict(COLOURS)
    spare = iter(_SPARE_COLOURS * 4)
    for p in servings:
        colours.setdefault(p, next(spare))
    colours[CPU_OFFLOAD_GB] = "#8c613c"
    return colours


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise UserError(f"--png/--svg draw with matplotlib, which is not installed: {INSTALL_HINT}") from None
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    return plt


def drawn(data: dict[str, Any], paths: list[str | Path]) -> list[bytes]:
    """:func:`picture_data`'s ``data`` drawn in the format of each of ``paths`` (.png, .svg,
    by suffix), in memory: the files are written by the caller, all or none."""
    plt = _pyplot()
    fig = figure(data)
    drawn = []
    for path in paths:
        buffer = io.BytesIO()
        fmt = Path(path).suffix.lower().lstrip(".") or "png"
        # the mark that recognises the picture as this project's when it is drawn again (outputs.py)
        fig.savefig(buffer, format=fmt, dpi=DPI, metadata={"Software" if fmt == "png" else "Creator": PICTURE_MARK})
        drawn.append(buffer.getvalue())
    plt.close(fig)
    return drawn


#: The picture's size in inches and its resolution: 1500 x 900 pixels.
SIZE, DPI = (15, 9), 100


def figure(data: dict[str, Any]):
    """The matplotlib figure of :func:`picture_data`'s ``data``, laid out (every title,
    label and legend inside it; the legends beside the bars, not over them)."""
    plt = _pyplot()
    from matplotlib.patches import Patch

    colours = _colours(data["servings"])
    used: dict[str, None] = {}
    fig = plt.figure(figsize=SIZE, dpi=DPI, layout="constrained")
    grid = fig.add_gridspec(2, 2, height_ratios=[3, 2], width_ratios=[1, 1])
    ax = fig.add_subplot(grid[0, :])
    slots = data["slots"]
    for x, slot in enumerate(slots):
        bottom = 0.0
        for e in slot["stack"]:
            height = e["bytes"] / GB
            ax.bar(x, height, bottom=bottom, width=0.8, color=colours[e["serving"]],
                   hatch="//" if e["experts"] else None, edgecolor="white" if e["experts"] else None, linewidth=0)
            bottom += height
            used[e["serving"]] = None
    ticks = [x for x, s in enumerate(slots) if s["layer"] is None or s["layer"] % LAYER_TICK_EVERY == 0]
    ax.set_xticks(ticks, [slots[x]["label"] if slots[x]["layer"] is None else f"L{slots[x]['layer']}"
                          for x in ticks], rotation=60, ha="right", fontsize=9)
    ax.set_xlim(-0.7, len(slots) - 0.3)
    ax.set_ylabel("GB (checkpoint bytes)")
    layers = [s for s in slots if s["layer"] is not None]
    has_experts = any(e["experts"] for s in slots for e in s["stack"])
    ax.set_title(f"every group's bytes by serving ({len(layers)} decoder layers, L0..L{max(len(layers) - 1, 0)}; "
                 "other bars: embedding, towers, head, MTP" + ("; routed experts hatched" if has_experts else "")
                 + ")", fontsize=11)
    ax.grid(axis="y", alpha=0.3)

    rows = data["rows"]
    ax_bytes = fig.add_subplot(grid[1, 0])
    for y, row in enumerate(rows):
        left = 0.0
        for serving, nbytes in row["bytes"].items():
            width = nbytes / GB
            ax_bytes.barh(y, width, left=left, color=colours[serving], height=0.6)
            if width > 2.0:  # a number that fits inside its segment
                ax_bytes.text(left + width / 2, y, f"{width:.2f}", ha="center", va="center", fontsize=9,
                              color="white")
            left += width
            used[serving] = None
    ax_bytes.set_yticks(range(len(rows)), [r["label"] for r in rows])
    ax_bytes.invert_yaxis()
    ax_bytes.set_xlabel("GB")
    ax_bytes.set_title("all weights by serving", fontsize=11)

    ax_step = fig.add_subplot(grid[1, 1])
    # Two bars per row, not one stack: link time overlaps the rest (the prefetch hides link
    # time behind the GPU's and the host CPU's work), so the step is marked on its own, not
    # the sum of the bars. The host CPU's time (host-compute) is in line with the GPU's.
    link_in_line, link_hidden, vram, draft = "#c44e52", "#f2b5b7", "#4c72b0", "#e5ae38"
    cpu = colours[Serving.COMPUTE.value]
    for y, row in enumerate(rows):
        st = row["step"]
        exposed, hidden = st["est_link_exposed_s"] * 1e3, st["est_link_hidden_s"] * 1e3
        ax_step.barh(y - 0.17, exposed, color=link_in_line, height=0.3)
        ax_step.barh(y - 0.17, hidden, left=exposed, color=link_hidden, hatch="..", edgecolor="white", height=0.3)
        ax_step.barh(y + 0.17, st["est_vram_s"] * 1e3, color=vram, height=0.3)
        if st["est_draft_s"]:
            ax_step.barh(y + 0.17, st["est_draft_s"] * 1e3, left=st["est_vram_s"] * 1e3, color=draft, height=0.3)
        if st.get("est_cpu_s"):
            ax_step.barh(y + 0.17, st["est_cpu_s"] * 1e3, left=(st["est_vram_s"] + st["est_draft_s"]) * 1e3,
                         color=cpu, height=0.3)
        step_ms = st["est_step_s"] * 1e3
        ax_step.vlines(step_ms, y - 0.4, y + 0.4, color="black", linewidth=2)
        ax_step.text(max(step_ms, (exposed + hidden)), y, f"  est step {step_ms:.0f} ms\n  {st['est_tok_s']:.2f} tok/s",
                     va="center", fontsize=9)
    ax_step.set_yticks(range(len(rows)), [r["label"] for r in rows])
    ax_step.invert_yaxis()
    ax_step.set_xlabel("ms per decode step (est)")
    ax_step.margins(x=0.3)
    ax_step.set_title("estimated decode step: link, VRAM and host CPU time (est)", fontsize=11)
    step_handles = [Patch(color=link_in_line, label="link, paid in line"),
                    Patch(facecolor=link_hidden, hatch="..", edgecolor="white", label="link, hidden behind compute"),
                    Patch(color=vram, label="VRAM reads")]
    if any(r["step"]["est_draft_s"] for r in rows):
        step_handles.append(Patch(color=draft, label="drafts (MTP)"))
    if any(r["step"].get("est_cpu_s") for r in rows):
        step_handles.append(Patch(color=cpu, label="host CPU (host-compute)"))
    step_handles.append(Patch(color="black", label="the step"))
    ax_step.legend(handles=step_handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), ncol=1)

    handles = [Patch(color=colours[p], label=LABELS.get(p, p)) for p in used if p != CPU_OFFLOAD_GB]
    if any(r["bytes"].get(CPU_OFFLOAD_GB) for r in rows):
        handles.append(Patch(color=colours[CPU_OFFLOAD_GB], label="host, vLLM cpu_offload_gb (layers in model order)"))
    if has_experts:
        handles.append(Patch(facecolor="#999999", hatch="//", edgecolor="white", label="routed experts"))
    cpu_offload_layers = next((r["layers"] for r in rows if r.get("layers")), None)
    if cpu_offload_layers:
        xs = [x for x, s in enumerate(slots) if s["layer"] in set(cpu_offload_layers)]
        top = max(sum(e["bytes"] for e in s["stack"]) for s in layers) / GB * 1.12
        ax.hlines(top, xs[0] - 0.4, xs[-1] + 0.4, color=colours[CPU_OFFLOAD_GB], linewidth=3)
        ax.text(xs[0] - 0.4, top * 1.02, f"vLLM cpu_offload_gb offloads these {len(cpu_offload_layers)} layers' parameters "
                f"(model order), every step", ha="left", va="bottom", fontsize=9, color=colours[CPU_OFFLOAD_GB])
    # beside the bars, not over them (the tallest, the embedding and the head, stand at the edges)
    ax.legend(handles=handles, fontsize=9, loc="upper left", bbox_to_anchor=(1.01, 1.0), ncol=1)
    fig.suptitle("\n".join(textwrap.wrap(data["title"], 120)), fontsize=12)
    fig.canvas.draw()  # the layout made, so the figure's extents are final
    return fig


def draw(data: dict[str, Any], paths: list[str | Path]) -> None:
    """Draw :func:`picture_data`'s ``data`` into each of ``paths`` (.png, .svg, by suffix),
    each written whole or not at all (:func:`~.outputs.write_files`)."""
    kinds = [Path(p).suffix.lower().lstrip(".") for p in paths]
    write_files([(f"--{k}", p, b, k) for k, p, b in zip(kinds, paths, drawn(data, paths))])


def add_picture_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--png", metavar="FILE", default=None,
                   help="also draw the plan as a PNG picture (needs matplotlib)")
    p.add_argument("--svg", metavar="FILE", default=None, help="also draw the plan as an SVG picture (as --png)")


def picture_outputs(args: argparse.Namespace) -> list[tuple[str, str]]:
    """The ``(flag, path)`` of each picture asked for."""
    return [(flag, path) for flag, path in (("--png", getattr(args, "png", None)),
                                            ("--svg", getattr(args, "svg", None))) if path]


def check_picture_arguments(args: argparse.Namespace) -> list[tuple[str, str, str]]:
    """Refuse, before any work, a picture that cannot be drawn (a name without its suffix,
    no matplotlib); the ``(flag, path, kind)`` of each picture asked for, for
    :func:`~.outputs.resolve_outputs` to resolve and try with the plan's other outputs."""
    outputs = picture_outputs(args)
    for flag, path in outputs:
        if Path(path).suffix.lower() != "." + flag[2:]:
            raise UserError(f"{flag} {path[:200]}: the file name must end in .{flag[2:]}")
    if outputs:
        _pyplot()
    return [(flag, path, flag[2:]) for flag, path in outputs]


def drawn_pictures(plan: Plan, args: argparse.Namespace) -> list[tuple[str, str, bytes]]:
    """The plan drawn for each of ``--png`` / ``--svg``, as ``(flag, path, bytes)`` for
    :func:`~.outputs.write_outputs` to write with the plan's other outputs."""
    outputs = picture_outputs(args)
    if not outputs:
        return []
    return [(flag, path, data) for (flag, path), data in
            zip(outputs, drawn(picture_data(plan), [path for _, path in outputs]))]
