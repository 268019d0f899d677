"""The plan as a picture (selective_offload/picture.py): what it shows is checked as data
(picture_data), the drawing as structure (sizes, the SVG's text), never as pixels."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

pytest.importorskip("matplotlib", reason="the picture needs matplotlib (the `picture` extra)")

from helpers import REPO  # noqa: E402
from selective_offload.picture import COLOURS, draw, picture_data  # noqa: E402
from selective_offload.plan_format import GroupKind, Serving  # noqa: E402
from selective_offload.sizes import GiB  # noqa: E402

ROOT = REPO
sys.path.insert(0, str(ROOT / "scripts"))
import make_plan_picture  # noqa: E402
from selective_offload.checkpoint import load_checkpoint
from selective_offload.cli import BUNDLED, main
from selective_offload.planner import PlanInputs, make_plan

RESULTS = ROOT / "docs" / "images"


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def test_the_readme_picture_is_the_reference_plans(tmp_path):
    """The committed picture's data is what the reference plan gives today (regenerate with
    scripts/make_plan_picture.py when the plan changes), and the script draws it again."""
    committed = json.loads((RESULTS / f"{make_plan_picture.NAME}.json").read_text())
    assert picture_data(make_plan_picture.reference_plan()) == committed
    assert f"docs/images/{make_plan_picture.NAME}.png" in (ROOT / "README.md").read_text()
    png, _ = make_plan_picture.main(tmp_path)
    assert png_size(png) == png_size(RESULTS / png.name) == (1500, 900)


def test_every_group_is_drawn_by_serving_beside_cpu_offload_gb():
    data = picture_data(make_plan_picture.reference_plan())
    plan = make_plan_picture.reference_plan()
    layers = [s for s in data["slots"] if s["layer"] is not None]
    assert [s["layer"] for s in layers] == list(range(64))
    drawn = {e["group"]: e for s in data["slots"] for e in s["stack"] if e["serving"] != "device share"}
    assert set(drawn) == {g.group for g in plan.groups}
    assert all(drawn[g.group]["serving"] == g.serving and drawn[g.group]["bytes"] == g.bytes for g in plan.groups)
    assert drawn["model.embed_tokens"]["serving"] == "gather"
    selective, cpu_offload = data["rows"]
    assert "device share" not in selective["bytes"]  # the planner keeps none for this checkpoint (planning.md)
    assert sum(selective["bytes"].values()) == sum(cpu_offload["bytes"].values()) == plan.model.total_bytes
    # each MLP's device share drawn on its layer, beside the MLP it copies (a share set by hand)
    shared = replace(plan, groups=tuple(replace(g, device_channels=1024, intermediate=17920)
                                        if g.kind == GroupKind.MLP else g for g in plan.groups))
    drawn_shared = picture_data(shared)
    shares = {e["group"]: e["bytes"] for s in drawn_shared["slots"] if s["layer"] is not None for e in s["stack"]
              if e["serving"] == "device share"}
    assert shared.device_share_bytes and shares == {g.group: shared.share_bytes(g) for g in shared.groups
                                                    if shared.share_bytes(g)}
    row = drawn_shared["rows"][0]
    assert row["bytes"]["device share"] == shared.device_share_bytes
    assert sum(row["bytes"].values()) - shared.device_share_bytes == plan.model.total_bytes
    assert cpu_offload["bytes"]["cpu_offload_gb"] == plan.vllm_cpu_offload_gb.offloaded_bytes
    assert cpu_offload["layers"] == list(plan.vllm_cpu_offload_gb.layers_touched)
    st = selective["step"]
    assert st["est_link_exposed_s"] + st["est_link_hidden_s"] == pytest.approx(plan.est.est_link_s_per_step)
    assert st["est_step_s"] == plan.est.est_step_s and cpu_offload["step"]["est_tok_s"] == plan.vllm_cpu_offload_gb.est.est_tok_s
    # the host CPU's time is drawn beside the VRAM reads (in line with the GPU's work); cpu_offload computes nothing
    assert st["est_cpu_s"] == plan.est.est_cpu_s_per_step > 0 and cpu_offload["step"]["est_cpu_s"] == 0


def moe_plan():
    """The reference plan with every decoder layer split as an MoE plan splits it (see the
    MoE plan interface): the layer's routed experts as a group of their own (128 experts,
    top-8), some read in place from the host (uva), and one layer in a placement this
    module has never heard of (on a layer group, which the step model prices as resident:
    an unknown way of reading experts cannot be priced at all). Built by hand so that the
    picture sees every placement at once, which no single planner plan has."""
    # without host-compute: every decoder layer one group, as the hand split below expects
    plan = make_plan(load_checkpoint(BUNDLED["qwen3.8-27b-fp8"]),
                     PlanInputs(device_memory_bytes=24 * GiB, vllm_cpu_offload_gb=10.0, host_compute=False))
    groups = []
    for g in plan.groups:
        if g.kind != GroupKind.LAYER:
            groups.append(g)
            continue
        experts = g.bytes * 3 // 4
        hot = g.serving == Serving.PREFETCH
        where = g.serving if hot else Serving.UVA if g.layer_index % 3 == 0 else Serving.RESIDENT
        rest = "host-nvme" if g.layer_index == 1 and not hot else g.serving
        groups += [replace(g, bytes=g.bytes - experts, dtype_bytes={}, serving=rest),
                   replace(g, group=f"{g.group}.mlp.experts", kind="experts", serving=where, bytes=experts,
                           dtype_bytes={}, num_experts=128, experts_per_token=8)]
    return replace(plan, groups=tuple(groups))


def test_an_moe_plan_stacks_each_layers_experts_and_names_unknown_placements(tmp_path):
    data = picture_data(moe_plan())
    layers = [s for s in data["slots"] if s["layer"] is not None]
    assert len(layers) == 64 and all(len(s["stack"]) == 2 and s["stack"][1]["experts"] for s in layers)
    assert "uva" in data["servings"] and "host-nvme" in data["servings"]
    assert data["rows"][0]["bytes"]["uva"] > 0
    draw(data, [tmp_path / "moe.svg", tmp_path / "moe.png"])
    svg = (tmp_path / "moe.svg").read_text()
    for label in ("host, experts read in place (UVA)", "host-nvme", "routed experts", "device",
                  "estimated decode step: link, VRAM and host CPU time (est)"):
        assert label in svg, label
    assert png_size(tmp_path / "moe.png") == (1500, 900)
    assert "host-nvme" not in COLOURS


def cli(*args, env=None):
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               **(env or {})}
    return subprocess.run([sys.executable, "-m", "selective_offload.cli", *args], capture_output=True, text=True,
                          env=environ, timeout=180)


def test_plan_png_and_svg_from_the_cli(tmp_path, capsys):
    code = main(["plan", "qwen3.8-27b-fp8", "--device-memory", "24GiB", "--png", str(tmp_path / "p.png"),
                 "--svg", str(tmp_path / "p.svg")])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert f"wrote  picture: {tmp_path / 'p.png'}, {tmp_path / 'p.svg'}" in out.splitlines()
    assert png_size(tmp_path / "p.png") == (1500, 900) and "<svg" in (tmp_path / "p.svg").read_text()


@pytest.mark.parametrize("case,expected", [
    ("suffix", "--png {tmp}/p.jpg: the file name must end in .png"),
    ("no matplotlib", "--png/--svg draw with matplotlib, which is not installed: pip install "
                      "'selective-offload[picture]' (or pip install matplotlib)"),
])
def test_picture_refusals_are_one_line_before_any_work(tmp_path, case, expected, capsys):
    argv = ["plan", "qwen3.8-27b-fp8", "--device-memory", "24GiB", "--png"]
    if case == "no matplotlib":  # a matplotlib that cannot be imported, first on a real run's path
        (tmp_path / "shadow" / "matplotlib").mkdir(parents=True)
        (tmp_path / "shadow" / "matplotlib" / "__init__.py").write_text("raise ImportError('not here')\n")
        env = {"PYTHONPATH": os.pathsep.join([str(tmp_path / "shadow"), str(ROOT)])}
        proc = cli(*argv, str(tmp_path / "p.png"), env=env)
        code, out, err = proc.returncode, proc.stdout, proc.stderr
    else:
        code, (out, err) = main([*argv, str(tmp_path / "p.jpg")]), capsys.readouterr()
    assert code == 2 and out == ""
    assert err.strip() == f"selective-offload: error: {expected.format(tmp=tmp_path)}"


def test_every_text_lies_inside_the_figure_and_no_legend_covers_a_bar():
    """By the renderer's own extents: the title, the axes' labels, the annotations and both
    legends inside the 1500 x 900 figure, and neither legend over a bar."""
    import matplotlib.pyplot as plt
    from matplotlib.legend import Legend
    from matplotlib.patches import Rectangle
    from matplotlib.text import Text

    from selective_offload.picture import figure

    for data in (picture_data(make_plan_picture.reference_plan()), picture_data(moe_plan())):
        fig = figure(data)
        renderer = fig.canvas.get_renderer()
        width, height = fig.bbox.width, fig.bbox.height
        assert (width, height) == (1500, 900)
        # a tick beyond the axis' limits is made but not drawn
        unseen = {id(label) for ax in fig.axes for axis in (ax.xaxis, ax.yaxis)
                  for tick in axis.get_major_ticks() + axis.get_minor_ticks()
                  if not min(axis.get_view_interval()) <= tick.get_loc() <= max(axis.get_view_interval())
                  for label in (tick.label1, tick.label2)}
        texts = [t for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip() and id(t) not in unseen]
        assert any(t.get_text() == data["title"] or "\n" in t.get_text() for t in texts)
        for t in texts:
            box = t.get_window_extent(renderer)
            assert box.x0 >= 0 and box.y0 >= 0 and box.x1 <= width and box.y1 <= height, (t.get_text(), box)
        legends = [leg for ax in fig.axes for leg in ax.findobj(Legend)]
        assert len(legends) == 2
        bars = [r.get_window_extent(renderer) for ax in fig.axes for r in ax.patches
                if isinstance(r, Rectangle) and r.get_height() and r.get_width()]
        for legend in legends:
            box = legend.get_window_extent(renderer)
            assert box.x1 <= width and box.y0 >= 0
            assert not [b for b in bars if b.overlaps(box)], legend.get_texts()[0].get_text()
        plt.close(fig)


def test_the_picture_speaks_as_the_command_does():
    data = picture_data(make_plan_picture.reference_plan())
    assert [r["label"] for r in data["rows"]] == ["this plan", "vLLM cpu_offload_gb=10"]
    assert "selective" not in json.dumps(data) and "hot_offload" not in data["title"]
