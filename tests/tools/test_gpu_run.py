"""The GPU run's driver (benchmarks/gpu_run.sh) and the generated tables of docs/benchmarks.md.

The driver runs end to end here in its --small form, as the GPU machine would run it in
full: every section in its own process with vLLM blocked (this machine has vLLM, so the
block is exercised), results packed into a few small files. The page's
results tables must be exactly what benchmarks/tables.py makes of benchmarks/results/.
"""

from __future__ import annotations

import json
import math
import sys
import tarfile
from pathlib import Path

import pytest

from helpers import REPO

ROOT = REPO
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # the benchmarks are the package ``benchmarks`` at the checkout's root

import benchmarks.gpu as gpu_run  # noqa: E402
from benchmarks import common as _common  # noqa: E402
from benchmarks import tables  # noqa: E402
from benchmarks import uva_read as bench_uva_read  # noqa: E402
from benchmarks.gpu import figures as gpu_figures  # noqa: E402
from benchmarks.gpu import pack as gpu_run_pack  # noqa: E402
from benchmarks.gpu import sections as gpu_sections  # noqa: E402
from selective_offload import probe
from selective_offload.probe import measurements  # the UVA series calls its own module's gemv_read_s


def test_small_run_packs_its_results_into_one_archive(small_run):
    out, summary, _ = small_run
    stem = summary["stem"]
    assert sorted(p.name for p in out.iterdir()) == sorted(f"{stem}{ext}" for ext in (".json", ".log", ".md", ".tar.gz"))
    with tarfile.open(out / f"{stem}.tar.gz") as tar:
        names = tar.getnames()
        assert all("/" not in n for n in names)
        for section in summary["sections"]:
            assert section["files"], section
            for name in section["files"]:
                assert name in names
                if name.endswith(".json"):
                    json.loads(tar.extractfile(name).read())
                else:
                    assert tar.extractfile(name).read().startswith(b"# ")


def test_small_run_records_every_section_and_needs_no_vllm(small_run):
    _, summary, stdout = small_run
    assert [s["name"] for s in summary["sections"]] == [s.name for s in gpu_sections.SECTIONS]
    for s in summary["sections"]:
        assert s["status"] == "ok" and s["exit_code"] == 0, s
        assert s["vllm_imports_blocked"] == [], s
        assert 0 < s["wall_s"] <= s["limit_s"]
        assert any(n.endswith(".json") for n in s["files"]) and any(n.endswith(".md") for n in s["files"])
    env = summary["environment"]
    assert env["cuda"] is False and env["torch"] and summary["small"] is True
    assert summary["stem"] == f"gpu-run-cpu-{_common.slug(env['device'])}-small"
    assert "## Headline ratios" in stdout  # the summary is the last thing printed


def test_small_run_preflight_says_no_cuda_and_checks_every_reference_plan(small_run):
    """The pre-flight section on the CPU: the card and the free memory labelled "no CUDA
    device", gpt-oss's expert shapes on the plan's default card, every reference plan's
    verdict against its stand-in card."""
    out, summary, stdout = small_run
    section = next(s for s in summary["sections"] if s["name"] == "preflight")
    name = next(n for n in section["files"] if n.endswith(".json"))
    with tarfile.open(out / f"{summary['stem']}.tar.gz") as tar:
        pre = json.loads(tar.extractfile(name).read())
        md = tar.extractfile(name[:-5] + ".md").read().decode()
    assert "no CUDA device" in pre["card"]["source"] and pre["memory"] == {"measured": False,
                                                                          "why": "not measured (no CUDA device)"}
    assert [m["model"] for m in pre["expert_shapes"]] == ["gpt-oss-20b (MXFP4)", "gpt-oss-120b (MXFP4)"]
    assert len(pre["plans"]) == 4 and all("verdict" in p and "stand-in" in p["planned_for"] for p in pre["plans"])
    assert "not measured (no CUDA device)" in md and "| gate_up_proj_blocks | w13_weight | U8 |" in md
    assert "[preflight] **After the CUDA context:** not measured (no CUDA device)." in stdout


def test_small_run_summary_has_every_ratio_measured_or_why_not(small_run):
    out, summary, _ = small_run
    assert [f["key"] for f in summary["ratios"]] == [f.key for f in gpu_figures.FAMILIES]
    by = {f["key"]: f for f in summary["ratios"]}
    for f in summary["ratios"]:
        assert bool(f["rows"]) != bool(f["not_measured"]), f
        for row in f["rows"]:
            assert isinstance(row["measured"], float) and math.isfinite(row["measured"]) and row["measured"] > 0, row
    # Measured here: the host gather; not without CUDA: the link, UVA and page-locking, each with its reason.
    assert by["host_gather_over_device"]["rows"]
    for key in ("uva_over_copy_sizes", "pageable_over_pinned",
                "page_locked_over_planned", "uva_embedding_over_device", "uva_moe_over_device", "host_compute_over_uva",
                "preflight_free_over_need"):
        assert "no CUDA" in by[key]["not_measured"] or "no GPU" in by[key]["not_measured"], by[key]
    md = (out / f"{summary['stem']}.md").read_text()
    for f in gpu_figures.FAMILIES:
        assert f.label in md


def _section(tmp_path: Path, name: str, code: str, limit: int = 60) -> gpu_sections.Section:
    script = tmp_path / f"{name}.py"
    script.write_text(code)
    return gpu_sections.Section(name, str(script), "--out {out}", "--out {out}", limit, limit, "")


def test_sections_run_with_vllm_blocked_and_counted(tmp_path):
    """This machine has vLLM installed: a section that imports it fails, one that falls
    back on ImportError runs, and both tries are counted."""
    log = gpu_run.Log(tmp_path / "log")
    rows = {}
    for name, code in (("imports", "import vllm\n"),
                       ("falls-back", "try:\n    import vllm.config\nexcept ImportError:\n    print('no vllm')\n")):
        section = _section(tmp_path, name, code)
        rows[name] = gpu_run.run_section(section, *gpu_run.command(section, sys.executable, tmp_path, "x", True),
                                         60, tmp_path, log)
    assert rows["imports"]["status"] == "failed" and rows["imports"]["vllm_imports_blocked"] == ["vllm"]
    assert any("ModuleNotFoundError" in line for line in rows["imports"]["output_tail"])
    assert rows["falls-back"]["status"] == "ok" and rows["falls-back"]["vllm_imports_blocked"] == ["vllm"]


def test_a_failed_or_timed_out_section_is_recorded_and_the_rest_still_run(tmp_path, monkeypatch):
    writes = ("import json, sys\nout = sys.argv[sys.argv.index('--out') + 1]\n"
              "open(out + '/later-cpu-x-2026-01-01.json', 'w').write(json.dumps({'ok': True}))\n")
    monkeypatch.setattr(gpu_run, "SECTIONS", (
        _section(tmp_path, "fails", "import sys\nprint('about to fail')\nsys.exit(3)\n"),
        _section(tmp_path, "hangs", "import time\ntime.sleep(20)\n", limit=2),
        _section(tmp_path, "later", writes),
    ))
    out = tmp_path / "out"
    assert gpu_run.main(["--small", "--out", str(out), "--no-pack"]) == 1
    summary = json.loads(next(out.glob("gpu-run-*.json")).read_text())
    rows = {s["name"]: s for s in summary["sections"]}
    assert rows["fails"]["status"] == "failed" and rows["fails"]["exit_code"] == 3
    assert "about to fail" in rows["fails"]["output_tail"]
    assert rows["hangs"]["status"] == "timed out" and rows["hangs"]["wall_s"] < 15
    assert rows["later"]["status"] == "ok"
    # The console output of a section that wrote JSON and no Markdown becomes its Markdown.
    assert rows["later"]["files"] == ["later-cpu-x-2026-01-01.json", "later-cpu-x-2026-01-01.md"]
    assert all(f["not_measured"] == f"the {f['section']} section was not run" for f in summary["ratios"])
    md = next(out.glob("gpu-run-*.md")).read_text()
    assert "| hangs | timed out |" in md and "fails (failed), last lines:" in md


def test_every_section_has_its_est_within_its_limit():
    """Each full-run section's est (its own arithmetic, on a GPU) lies within its limit."""
    assert all(s.est_s and int(s.est_s.split("-")[-1]) <= s.limit_s for s in gpu_sections.SECTIONS)


def test_only_takes_known_sections(capsys):
    assert gpu_run.main(["--only", "probe,nope"]) == 2
    assert "unknown nope" in capsys.readouterr().err


def test_the_benchmark_page_tables_are_what_the_results_files_make():
    """Regenerate every marked table from benchmarks/results/: the page must not differ
    (a figure edited by hand, or a results file added or changed without regenerating)."""
    text = tables.DOC.read_text()
    names = [m.group("name") for m in tables.BLOCK.finditer(text)]
    assert names == ["measured-cpu", "gpu-budget", "gpu-runs"]
    assert tables.regenerate(text, tables.RESULTS_DIR) == text, "run `python -m benchmarks.tables`"


def test_tables_check_fails_on_a_hand_edited_figure(tmp_path, capsys):
    readme = tmp_path / "benchmarks.md"
    text = tables.DOC.read_text()
    assert "| 8.0 ms median (page cache warm) |" in text
    readme.write_text(text.replace("| 8.0 ms median (page cache warm) |", "| 7.0 ms median (page cache warm) |"))
    assert tables.main(["--check", "--doc", str(readme)]) == 1
    assert "-| read headers" in capsys.readouterr().out
    assert tables.main(["--doc", str(readme)]) == 0 and readme.read_text() == text


def test_a_gpu_run_lands_in_the_readme_table(small_run, tmp_path):
    """A packed run imported into a results directory, as a GPU run's would be, becomes the
    gpu-runs table (here the CPU run, relabelled as a full CUDA run)."""
    out, summary, _ = small_run
    results = tmp_path / "results"
    copied = gpu_run_pack.import_results(out / f"{summary['stem']}.tar.gz", results)
    assert copied and all(n.endswith((".json", ".md")) for n in copied)
    assert not any(n.endswith(".log") for n in copied)
    assert "No GPU run recorded yet" in tables.gpu_runs(results)  # a --small CPU run is not one
    gpu = {**summary, "cuda": True, "small": False, "device": "NVIDIA H200", "date": "2026-12-01"}
    (results / "gpu-run-cuda-nvidia-h200.json").write_text(json.dumps(gpu))
    table = tables.gpu_runs(results)
    assert table.startswith("**NVIDIA H200**, ") and "gpu-run-cuda-nvidia-h200.md" in table
    for f in gpu_figures.FAMILIES:
        assert f"| {f.label}" in table
    assert "| host gather / device embedding, time per lookup: 1 token(s) per step | " in table
    # A later rerun of one section (--only) replaces that section's figures, not the others'.
    rerun = json.loads(json.dumps(gpu))
    rerun.update(only=["gather"], stem="gpu-run-cuda-nvidia-h200-only-gather",
                 sections=[s for s in rerun["sections"] if s["name"] == "gather"])
    family = next(f for f in rerun["ratios"] if f["key"] == "host_gather_over_device")
    family["rows"][0]["measured"] = 123.456
    (results / "gpu-run-cuda-nvidia-h200-only-gather.json").write_text(json.dumps(rerun))
    merged = tables.gpu_runs(results)
    assert "| 123.456 (" in merged and "gpu-run-cuda-nvidia-h200-only-gather.md" in merged
    assert merged.count("| host gather / device embedding, time per lookup: 256 token(s) per step | ") == 1
    assert "(sections: probe ok, preflight ok, mechanism ok, gather ok, uva-read ok, host-compute ok, routing ok)" in merged


def test_uva_read_runs_its_uva_path_through_a_stand_in_view():
    """The UVA figures need CUDA; a stand-in view (the host buffer itself) runs their code
    here: the GEMV through the view, its rate against the copy's, the check that it reads
    the same bytes."""
    row = bench_uva_read.measure(1 << 20, 2, False, view=lambda t: t)
    assert row["bytes"] == 1 << 20 and row["page_locked"] is False and "error" not in row, row
    assert row["copy_gbps"] > 0 and row["uva_gemv_gbps"] > 0 and row["device_gemv_gbps"] > 0
    assert row["uva_over_copy"] == row["uva_gemv_gbps"] / row["copy_gbps"] and row["uva_equals_device"] is True
    wrong = bench_uva_read.measure(1 << 20, 2, False, view=lambda t: t.flip(0))  # other bytes, same shape
    assert wrong["uva_equals_device"] is False
    bad = bench_uva_read.measure(1 << 20, 2, False, view=lambda t: t[: t.numel() // 2])
    assert "error" in bad and "uva_gemv_gbps" not in bad  # a wrong view is recorded, not raised


def test_the_benchmark_and_the_probe_share_one_read_measurement(monkeypatch):
    """benchmarks/uva_read/ sweeps sizes over the probe's own read kernel
    (probe.gemv_read_s), for the UVA view and the device copy alike: one measurement, not two
    written apart; the probe's UVA series goes through it too."""
    calls = []
    for where in (probe, measurements):
        monkeypatch.setattr(where, "gemv_read_s", lambda w, **kw: (calls.append(w.numel() * w.element_size()), 0.001)[1])
    row = bench_uva_read.measure(1 << 20, 1, False, view=lambda t: t)
    assert calls == [1 << 20, 1 << 20]  # the device copy, then the view
    assert row["uva_gemv_gbps"] == row["device_gemv_gbps"] == pytest.approx((1 << 20) / 0.001 / 1e9)
    assert probe.uva_read_series([1 << 20], repeats=1, warmup=0, cuda=None, view=lambda h: h, pin=False) == {
        1 << 20: 0.001} and len(calls) == 3


def test_uva_read_sizes_and_bad_input(tmp_path, capsys):
    offloaded = bench_uva_read.cpu_offload_bytes()
    assert offloaded > 1 << 30  # the reference plan's cpu_offload_gb on 24 GiB: GBs, not a test-sized buffer
    assert bench_uva_read.parse_sizes("1MiB,cpu_offload_gb") == [1 << 20, offloaded]
    assert bench_uva_read.main(["--sizes", "1KiB", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --sizes") and len(err.splitlines()) == 1


def test_cuda_shaped_results_give_every_cuda_figure(small_run, tmp_path):
    """What the sections write on a GPU (their CPU files with the CUDA-only fields filled as
    a CUDA run fills them) gives a figure for every family that needs CUDA: the branches
    that cannot run here are read at least once."""
    out, summary, _ = small_run
    with tarfile.open(out / f"{summary['stem']}.tar.gz") as tar:
        files = {n: json.loads(tar.extractfile(n).read()) for n in tar.getnames() if n.endswith(".json")}
    sections = [dict(s) for s in summary["sections"]]
    by_section = {s["name"]: next(n for n in s["files"] if n.endswith(".json")) for s in sections}
    probe = files[by_section["probe"]]
    probe.update(no_link_reason=None, device="NVIDIA H200", link_gbps_pinned=53.0, link_gbps_pageable=21.0,
                 vram_gbps=4100.0, uva_read_gbps=40.0)
    mech = files[by_section["mechanism"]]
    mech["cuda"] = True
    mech["host_memory"]["overall"].update(ratio_exact=1.0, ratio_rounding=1.62)
    mech["fused_moe"] = {"rows": [
        {"phase": "decode", "tokens": 1, "distinct_experts": 8, "uva_replay_us": 300.0, "device_replay_us": 60.0,
         "uva_over_device": 5.0, "bit_equal": True},
        {"phase": "prefill", "tokens": 2048, "error": "RuntimeError: capture failed"}]}
    gather = files[by_section["gather"]]
    gather["cuda"] = True
    for p in gather["paths"]:
        p["status"] = "measured"
    for r in gather["rows"]:
        r["uva_embedding_s"] = {**r["device_s"], "median": 3 * r["device_s"]["median"]}
        r["uva_embedding_graph_s"] = {**r["device_s"], "median": 2 * r["device_s"]["median"]}
    uva = files[by_section["uva-read"]]
    uva.update(cuda=True, uva="measured")
    for r in uva["rows"]:
        r.update(uva_gemv_gbps=40.0, copy_gbps=50.0, uva_over_copy=0.8, uva_equals_device=True)
    uva["rows"].append({"bytes": 8 << 30, "error": "OffloadError: cudaHostRegister of 8 GiB failed"})
    pre = files[by_section["preflight"]]
    pre.update(cuda=True, memory={"measured": True, "free_bytes": 80 << 30, "est_card_class_gib": 80})
    for name, data in files.items():
        (tmp_path / name).write_text(json.dumps(data))
    ratios = {f["key"]: f for f in gpu_figures.ratios(sections, tmp_path)}
    for key in ("uva_over_copy_sizes", "uva_over_copy_probe", "pageable_over_pinned",
                "page_locked_over_planned", "uva_embedding_over_device", "uva_moe_over_device",
                "preflight_free_over_need"):
        assert ratios[key]["rows"] and not ratios[key]["not_measured"], ratios[key]
    moe = ratios["uva_moe_over_device"]["rows"]
    assert [r["measured"] for r in moe] == [5.0, None] and moe[1]["note"] == "RuntimeError: capture failed"
    assert [r["measured"] for r in ratios["uva_over_copy_sizes"]["rows"]] == [0.8, 0.8, None]
    assert "cudaHostRegister" in ratios["uva_over_copy_sizes"]["rows"][-1]["note"]
    assert ratios["uva_over_copy_probe"]["rows"][0]["measured"] == pytest.approx(40.0 / 53.0)
    assert ratios["pageable_over_pinned"]["rows"][0]["measured"] == pytest.approx(21.0 / 53.0)
    assert [r["measured"] for r in ratios["preflight_free_over_need"]["rows"]] == pytest.approx(
        [p["free_bytes"] / p["need_bytes"] for p in pre["plans"]])
    assert [r["measured"] for r in ratios["page_locked_over_planned"]["rows"]] == [1.0, 1.62]
    uva_rows = ratios["uva_embedding_over_device"]["rows"]
    assert [r["measured"] for r in uva_rows] == pytest.approx([3.0, 3.0, 2.0, 2.0])
    assert uva_rows[2]["label"] == "CUDA graph replay, 1 token(s) per step"
    next(p for p in gather["paths"] if p["key"] == "uva_embedding_graph")["status"] = "FAILED: capture raised"
    (tmp_path / by_section["gather"]).write_text(json.dumps(gather))
    failed = next(f for f in gpu_figures.ratios(sections, tmp_path) if f["key"] == "uva_embedding_over_device")
    assert failed["rows"][-1] == {"label": "CUDA graph replay", "measured": None, "est": None,
                                  "note": "FAILED: capture raised"}
    rows = gpu_figures.ratio_rows(list(ratios.values()))
    assert any(r[1].startswith("n/a (OffloadError") for r in rows)
