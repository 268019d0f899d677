"""The GPU run's host-compute section (benchmarks/host_compute/) on this CPU machine.

Its --small form runs here as the driver runs it: the kernel and the reference parts are
measured and checked, every CUDA-only part is recorded as skipped with its reason. The
UVA and resident rows, CUDA-only in the run, are exercised through stand-in views (host
tensors in place of device views), so their code and their correctness check run here;
a view that reads another expert's bytes must fail that check.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace

import pytest

from helpers import REPO

if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # the benchmarks are the package ``benchmarks`` at the checkout's root

from benchmarks.gpu import figures as gpu_figures  # noqa: E402
from benchmarks.host_compute import dense as hd  # noqa: E402
from benchmarks.host_compute import head as hh  # noqa: E402
from benchmarks.host_compute import layers as hl  # noqa: E402
from benchmarks.host_compute import report as host_compute_report  # noqa: E402
from benchmarks.host_compute import sections as hs  # noqa: E402


@pytest.fixture(scope="module")
def small(small_run_files):
    """`python -m benchmarks.host_compute --small`'s result, as the GPU run's --small runs it."""
    (path,) = small_run_files.glob("host-compute-cpu-*-small.json")
    assert path.with_suffix(".md").read_text().startswith("# Host-compute")
    return json.loads(path.read_text())


def test_small_run_records_what_it_measured_and_why_the_cuda_parts_were_not(small):
    assert small["cuda"] is False and small["small"] is True and small["complete"] is True
    assert small["threads"] == small["physical_cores"] >= 1
    for key in ("handoff", "overlap"):
        assert small[key]["status"] == hl.NO_CUDA and "no CUDA device" in small[key]["status"]
    assert [layer["shape"] for layer in small["layers"]] == [s.name for s in hl.SMALL_SHAPES]
    built = small["kernel"]["status"] == "built"
    for layer in small["layers"]:
        st = layer["status"]
        for path in ("host_graph", "device_path", "uva", "resident", "uva_floor"):
            assert "no CUDA device" in st[path], (path, st[path])
        assert [r["tokens"] for r in layer["rows"]] == list(hl.SMALL_TOKENS)
        assert layer["crossover"]["tokens"] is None and "not measured" in layer["crossover"]["note"]
        for row in layer["rows"]:
            assert row["distinct_experts"] >= 1
            assert row["expert_bytes_read"] == row["distinct_experts"] * layer["expert_bytes"]
            assert not any(k.startswith(("uva", "resident", "device_path", "host_graph")) for k in row), row
            if built:
                assert row["kernel_s"]["n"] >= 3 and row["kernel_s"]["median"] > 0
                assert row["kernel_weights_gbps"] == pytest.approx(
                    row["expert_bytes_read"] / row["kernel_s"]["median"] / 1e9)
                assert row["host_eager_s"]["median"] > 0
    if built:
        assert small["bandwidth"]["read_gbps"] > 0 and small["bandwidth"]["threads"] == small["threads"]
        checked = {(c["shape"], c["path"], c["tokens"]) for c in small["correctness"]}
        assert checked == {(s.name, p, t) for s in hl.SMALL_SHAPES for p in ("kernel", "host_eager")
                           for t in hl.CHECKED_TOKENS} | {(hl.DENSE_MLP, "dense layer (attention + host MLP)", 1),
                                                         (hl.SMALL_SHAPES[0].name, "device_share", 1),
                                                         (hl.SMALL_SHAPES[0].name, "device_share_native", 1),
                                                         ("LM head 1024x256", "lm_head_split", 1)}
        head = small["lm_head_split"]
        assert head["status"] == "measured" and head["graph"] is False
        assert (head["rows"], head["hidden"], head["device_rows"]) == (*hh.SMALL_HEAD, hh.SMALL_DEVICE_ROWS)
        assert head["host_rows"] == hh.SMALL_HEAD[0] - hh.SMALL_DEVICE_ROWS
        for part in ("whole_s", "split_s", "device_part_s", "host_part_s"):
            assert head[part]["n"] >= 3 and head[part]["median"] > 0, part
        assert head["split_over_whole"] == pytest.approx(head["split_s"]["median"] / head["whole_s"]["median"])
        assert head["host_part_gbps"] == pytest.approx(128 * 256 * 2 / head["host_part_s"]["median"] / 1e9)
        share = small["device_share"]
        assert share["status"] == "measured" and share["graph"] is False
        assert 1 <= share["on_device"] < share["experts"] == hl.SMALL_SHAPES[0].experts and share["share_bytes"] > 0
        for part in ("whole_s", "shared_s", "host_part_s", "share_part_s"):
            assert share[part]["n"] >= 3 and share[part]["median"] > 0, part
        assert share["shared_over_whole"] == pytest.approx(share["shared_s"]["median"] / share["whole_s"]["median"])
        # the native share: checked under Triton's interpreter, its stored bytes held, nothing timed
        native = share["native"]
        assert native["status"].startswith("checked under Triton's interpreter") and "native_s" not in native
        assert native["held_bytes"] * share["experts"] == pytest.approx(
            share["on_device"] * next(L["layer_bytes"] for L in small["layers"] if L["shape"] == hl.SMALL_SHAPES[0].name))
        assert 0 < native["read_bytes_mean"] <= native["held_bytes"]
        dense = small["dense_layer"]
        assert dense["status"] == "measured" and dense["graph"] is False and "stand-in" in dense["copy"]
        assert dense["mlp_bytes"] == next(L["layer_bytes"] for L in small["layers"] if L["shape"] == hl.DENSE_MLP)
        for part in ("attention_s", "mlp_host_s", "layer_host_s", "mlp_copy_s"):
            assert dense[part]["n"] >= 3 and dense[part]["median"] > 0, part
        # the prefetch row is the attention plus the MLP's bytes copied, in line
        assert dense["layer_prefetch_s"] == pytest.approx(dense["attention_s"]["median"] + dense["mlp_copy_s"]["median"])
        assert dense["host_over_prefetch"] == pytest.approx(dense["layer_host_s"]["median"] / dense["layer_prefetch_s"])
        assert all(c["ok"] and c["max_abs_err"] <= c["tol"] * c["max_abs_ref"] for c in small["correctness"])
        sweep = {t["shape"]: [r["threads"] for r in t["rows"]] for t in small["threads_sweep"]}
        assert sweep == {s.name: hl.thread_counts(small["physical_cores"]) for s in hl.SMALL_SHAPES}
    else:
        assert small["bandwidth"]["status"].startswith("skipped: the CPU kernel cannot be built here")
    assert small["correct"] is True
    fam = gpu_figures.host_compute_over_uva(small)
    assert isinstance(fam, str) and fam.startswith("no CUDA")
    assert gpu_figures.host_mlp_over_copy(small).startswith("no CUDA")


def test_a_measured_native_share_is_reported_beside_the_bf16_shares_time(small):

    d = json.loads(json.dumps(small))
    d["device_share"]["native"] = {"status": "measured", "held_bytes": 132e6, "read_bytes_mean": 15e6,
                                   "block_rows": 32, "native_s": {"median": 5e-5, "n": 9},
                                   "native_gbps": 300.0, "native_over_share_part": 0.125}
    text = host_compute_report.markdown(d)
    assert "(132 MB), computed by the share kernel" in text and "32 rows a program): 50.0 us, 300.0 GB/s" in text
    assert "of the 15 MB it reads a step on average, 0.125 of the bf16 share's time" in text
    assert "share kernel that reads it in place (selective_offload/wrappers/share_kernel.py): checked under Triton's" in \
        host_compute_report.markdown(small)
    # the headline: the native share's time over the bf16 share's, beside the step model's ratio of their bytes
    assert gpu_figures.native_share_over_bf16_share(small).startswith("no CUDA")
    d["cuda"] = True
    (row,) = gpu_figures.native_share_over_bf16_share(d)
    assert row["measured"] == 0.125
    assert row["est"] == pytest.approx(15e6 / d["device_share"]["share_traffic_bytes_est"])
    assert row["note"].startswith("300 GB/s of 15.0 MB a step, 32 rows a program")
    d["device_share"]["native"]["status"] = "FAILED: CompilationError: x"
    assert gpu_figures.native_share_over_bf16_share(d) == "not measured: FAILED: CompilationError: x"


def test_a_measured_head_split_is_reported_and_its_headline_set_beside_the_slower_part(small):

    d = json.loads(json.dumps(small))
    d["lm_head_split"] = {"status": "measured", "rows": 201088, "hidden": 2880, "device_rows": 173312,
                          "host_rows": 27776, "threads": 16, "graph": False, "whole_s": {"median": 4e-3, "n": 9},
                          "split_s": {"median": 3.5e-3, "n": 9}, "device_part_s": {"median": 3.3e-3, "n": 9},
                          "host_part_s": {"median": 3e-3, "n": 9}, "overlap": 0.93, "split_over_whole": 0.875,
                          "host_part_gbps": 53.3, "device_part_gbps": 302.5, "whole_gbps": 289.5}
    text = host_compute_report.markdown(d)
    assert "| 201088x2880 bf16 | 173312 of 201088 | 4000.0 (289.5) | 3500.0 | 3300.0 (302.5) | 3000.0 (53.3) | 0.93 " \
           "| 0.875 |" in text
    assert gpu_figures.lm_head_split_over_whole(small).startswith("no CUDA")
    d["cuda"] = True
    (row,) = gpu_figures.lm_head_split_over_whole(d)
    # measured split / whole, beside what the step model would price at the parts' own rates
    assert row["measured"] == 0.875 and row["est"] == pytest.approx(3.3e-3 / 4e-3)
    assert row["note"].startswith("27776 of 201088 rows on the host CPU at 53.3 GB/s")


def _layer(stand_in_view, shape=hl.SMALL_SHAPES[1]):
    ctx = hs.Ctx(cuda=False, small=True, threads=1, iters=3, max_seconds=5)
    hs.build_kernel(ctx)
    weights = hl.make_weights(shape)
    return ctx, hs.measure_layer(ctx, shape, weights, (1, 2), view=stand_in_view, resident=lambda t: t.clone())


@pytest.mark.parametrize("shape", hl.SMALL_SHAPES, ids=lambda s: s.fmt)
def test_the_uva_and_resident_rows_run_and_are_checked_through_stand_in_views(shape):
    ctx, layer = _layer(lambda t: t, shape)
    assert layer["status"]["uva"] == layer["status"]["resident"] == "measured"
    assert layer["uva_read_gbps"] > 0
    for row in layer["rows"]:
        assert row["uva_s"]["median"] > 0 and row["resident_s"]["median"] > 0
        assert row["uva_floor_s"] == pytest.approx(row["expert_bytes_read"] / (layer["uva_read_gbps"] * 1e9))
    paths = {(c["path"], c["tokens"]): c for c in ctx.checks}
    assert {("uva", 1), ("uva", 2), ("resident", 1), ("resident", 2)} <= set(paths)
    assert all(c["ok"] for c in ctx.checks), ctx.checks


def test_a_view_that_reads_other_experts_fails_the_check():
    """Experts shifted by one (the right shape, another expert's bytes): the UVA row's
    check must say NO, the resident row's (a true copy) yes."""
    ctx, _ = _layer(lambda t: t.roll(1, 0).contiguous())
    uva = [c for c in ctx.checks if c["path"] == "uva"]
    assert uva and not any(c["ok"] for c in uva), uva
    assert all(c["ok"] for c in ctx.checks if c["path"] == "resident")


def test_the_check_is_relative_to_the_reference_and_refuses_a_wrong_shape():
    import torch

    want = torch.tensor([[2.0, -4.0]])
    assert hl.check("p", 1, want + 3e-4, want, 1e-4)["ok"] is True  # 3e-4 <= 1e-4 * 4
    assert hl.check("p", 1, want + 5e-4, want, 1e-4)["ok"] is False
    assert hl.check("p", 1, want[:, :1], want, 1e-4)["ok"] is False


def test_the_crossover_is_the_last_token_count_the_host_path_still_wins():
    def row(t, host, copy, uva):
        return {"tokens": t, "host_graph_s": {"median": host}, "device_path_s": {"median": copy},
                "uva_s": {"median": uva}}

    rows = [row(1, 1.0, 5.0, 3.0), row(2, 2.0, 5.0, 2.5), row(4, 4.0, 5.0, 3.0), row(8, 3.0, 9.0, 9.0)]
    got = hl.crossover(rows)
    assert got["tokens"] == 2 and got["host"] == "host_graph" and got["against"] == ["device_path", "uva"]
    assert hl.crossover([row(1, 4.0, 5.0, 3.0)])["tokens"] is None
    assert hl.crossover([{"tokens": 1, "host_eager_s": {"median": 1.0}}])["tokens"] is None


def test_the_weights_differ_between_experts():
    """The tiled fill must not repeat an expert (a path reading the wrong one would pass)."""
    for shape in hl.SMALL_SHAPES + hl.SHAPES[1:]:
        w = hl.make_weights(replace(shape, experts=3))
        assert not any(bool((w.w13[a] == w.w13[b]).all()) for a, b in ((0, 1), (1, 2), (0, 2))), shape.name


def test_cuda_shaped_results_give_the_headline_figure(small):
    """What a CUDA run writes (the CPU file with the CUDA fields filled) gives host / UVA
    and host / resident per layer, with the hand-off and the crossover in the note."""
    d = json.loads(json.dumps(small))
    d["cuda"] = True
    d["handoff"] = {"status": "measured", "rows": [
        {"what": "bare host function (free(NULL))", "graph_s": {"median": 5e-6}},
        {"what": f"{hl.SMALL_SHAPES[0].name} host path, every pick -1 (copies and an empty job)",
         "graph_s": {"median": 2e-5}}]}
    first, second, *_ = d["layers"]
    first["rows"][0].update(host_graph_s={"median": 4e-4}, uva_s={"median": 1e-3}, resident_s={"median": 2e-4})
    first["crossover"] = {"tokens": 8}
    second["rows"][0].pop("host_eager_s", None)
    second["status"]["host_graph"] = "FAILED: RuntimeError: capture failed"
    rows = gpu_figures.host_compute_over_uva(d)
    assert [r["measured"] for r in rows[:2]] == pytest.approx([0.4, 2.0])
    assert rows[0]["label"].endswith("graph replay: host / UVA")
    assert "hand-off (graph, empty job) 20 us" in rows[0]["note"] and "wins up to T = 8" in rows[0]["note"]
    assert rows[2]["measured"] is None and "capture failed" in rows[2]["note"]
    d["correctness"] = [{"shape": "x", "path": "uva", "tokens": 1, "ok": False}]
    assert "correctness FAILED: x uva T=1" in gpu_figures.host_compute_over_uva(d)[0]["note"]


def test_bad_arguments_are_one_line(tmp_path, capsys):
    from benchmarks.host_compute import main

    assert main(["--small", "--max-seconds", "0", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --max-seconds") and len(err.splitlines()) == 1


def test_a_view_that_cannot_be_made_is_recorded_and_the_rest_still_run():
    """A refused view (OffloadError on the GPU machine, say) is the UVA rows' status; the
    resident and host rows are still measured."""
    def refuse(t):
        raise RuntimeError("cudaHostRegister refused")

    ctx, layer = _layer(refuse)
    assert layer["status"]["uva"] == "FAILED: RuntimeError: cudaHostRegister refused"
    assert layer["status"]["resident"] == "measured" and "uva_read_gbps" not in layer
    assert all("uva_s" not in r and r["resident_s"]["median"] > 0 for r in layer["rows"])


def test_the_dense_layer_is_checked_against_attention_and_the_mlp_reference(monkeypatch):
    """A host MLP that returns nothing of the MLP (zeros) must fail the layer's check; the
    real one passes it."""
    import torch

    from selective_offload.wrappers.host_compute import HostExperts

    shape = next(s for s in hl.SMALL_SHAPES if s.name == hl.DENSE_MLP)
    weights = hl.make_weights(shape)
    ctx = hs.Ctx(cuda=False, small=True, threads=1, iters=3, max_seconds=5)
    if hs.build_kernel(ctx)["status"] != "built":
        pytest.skip(f"the CPU kernel cannot be built here: {ctx.kernel}")
    assert hd.dense_layer(ctx, shape, weights)["status"] == "measured"
    assert [c["ok"] for c in ctx.checks] == [True]
    monkeypatch.setattr(HostExperts, "__call__", lambda self, x, ids, w: torch.zeros_like(x))
    hd.dense_layer(ctx, shape, weights)
    assert [c["ok"] for c in ctx.checks] == [True, False]


def test_cuda_shaped_dense_layer_gives_its_headline_figure(small):
    d = json.loads(json.dumps(small))
    d["cuda"] = True
    d["dense_layer"].update(attention_s={"median": 1e-4}, mlp_host_s={"median": 5e-3}, layer_host_s={"median": 5.2e-3},
                            mlp_copy_s={"median": 2e-2}, layer_prefetch_s=2.01e-2, host_over_prefetch=5.2e-3 / 2.01e-2)
    (row,) = gpu_figures.host_mlp_over_copy(d)
    assert row["measured"] == pytest.approx(0.2587, abs=1e-4)
    assert "copied 20000 us" in row["note"] and "on the host 5000 us" in row["note"]
    d["dense_layer"] = {"status": "FAILED: RuntimeError: capture failed"}
    assert "capture failed" in gpu_figures.host_mlp_over_copy(d)


def test_small_run_measures_the_kernel_beside_a_copier_and_names_the_stand_in(small):
    """Without CUDA a host-to-host copying thread stands in for the copy engine, and says so;
    the ratio the estimate's rule is checked against is the two rates together over the
    kernel's alone, from the figures recorded beside it."""
    c = small["contention"]
    if small["kernel"]["status"] != "built":
        assert c["status"] == small["kernel"]["status"]
        return
    assert c["status"] == "measured" and "stand-in" in c["copier"] and "no CUDA" in c["copier"]
    assert c["kernel_threads"] == max(1, small["threads"] - 1)  # a core left to the copier
    assert min(c["kernel_gbps_alone"], c["kernel_gbps_beside"], c["copy_gbps_alone"], c["copy_gbps_beside"]) > 0
    assert c["model_ratio"] == pytest.approx((c["kernel_gbps_beside"] + c["copy_gbps_beside"]) / c["kernel_gbps_alone"])


def test_cuda_shaped_contention_gives_its_headline_figure_against_the_estimates_one(small):
    d = json.loads(json.dumps(small))
    assert gpu_figures.host_reads_together(d).startswith("no CUDA")
    d["cuda"] = True
    d["contention"] = {"status": "measured", "shape": "gpt-oss-20b", "kernel_gbps_alone": 50.0,
                       "kernel_gbps_beside": 45.0, "copy_gbps_alone": 25.0, "copy_gbps_beside": 20.0,
                       "model_ratio": 1.3}
    (row,) = gpu_figures.host_reads_together(d)
    assert row["measured"] == 1.3 and row["est"] == 1.0
    assert "45.0 beside copies at 20.0 GB/s (25.0 alone)" in row["note"]
    d["contention"] = {"status": "FAILED: RuntimeError: no pinned memory"}
    assert "no pinned memory" in gpu_figures.host_reads_together(d)
