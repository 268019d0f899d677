"""Estimates that match measurements: per-mechanism link rates, compute, the acceptance
of each model family's MTP head and the number of draft tokens, and the published points
the step model is checked against (benchmarks/published.*)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from helpers import REPO
from selective_offload.acceptance import ACCEPTANCE_DEFAULTS, GENERIC_ACCEPTANCE, MAX_DRAFT_TOKENS, acceptance_default
from selective_offload.checkpoint import load_checkpoint
from selective_offload.cli import BUNDLED
from selective_offload.estimate.traffic import DEFAULT_DECODE_READ_FACTOR, DEFAULT_UVA_READ_FACTOR
from selective_offload.planner import PlanInputs, best_draft_tokens, draft_flips, make_plan, spec_estimate
from selective_offload.sizes import GiB

ROOT = REPO


@pytest.fixture(scope="module")
def reference():
    return load_checkpoint(BUNDLED["qwen3.8-27b-fp8"])


@pytest.fixture(scope="module")
def mtp_plans(reference):
    """The reference checkpoint planned with MTP speculation, and without (24 GiB card), on
    the prefetch menu (host-compute off: these are the link-bound plans)."""
    spec = make_plan(reference, PlanInputs(device_memory_bytes=24 * GiB, speculative="mtp", host_compute=False))
    plain = make_plan(reference, PlanInputs(device_memory_bytes=24 * GiB, host_compute=False))
    return spec, plain


# --------------------------------------------------------------------------- acceptance


def test_acceptance_default_per_family_with_its_range_and_source():
    qwen = acceptance_default("qwen3_8")
    assert (qwen.default, qwen.low, qwen.high) == (0.65, 0.48, 0.91)
    assert "tenstorrent/vllm issue #442" in qwen.source and "0.647 pooled" in qwen.source
    assert acceptance_default("qwen3_5_moe") is qwen and acceptance_default("Qwen3_Next") is qwen
    deepseek = acceptance_default("deepseek_v3")
    assert (deepseek.default, deepseek.low, deepseek.high) == (0.85, 0.85, 0.90)
    assert "2412.19437" in deepseek.source
    assert acceptance_default("llama") is GENERIC_ACCEPTANCE and acceptance_default(None) is GENERIC_ACCEPTANCE
    for _, found in ACCEPTANCE_DEFAULTS:
        assert found.low <= found.default <= found.high


def test_plan_fills_the_family_acceptance_and_keeps_a_given_one(reference):
    plan = make_plan(reference, PlanInputs(device_memory_bytes=24 * GiB, speculative="mtp"))
    assert plan.inputs.accept_rate == 0.65
    assert any(n.startswith("acceptance 0.65: the published rate for the Qwen3.x MTP head") for n in plan.notes)
    given = make_plan(reference, PlanInputs(device_memory_bytes=24 * GiB, speculative="mtp", accept_rate=0.8))
    assert given.inputs.accept_rate == 0.8 and not any(n.startswith("acceptance ") for n in given.notes)
    # a plan without speculation records the family's rate too (the plan file always holds a number)
    assert make_plan(reference, PlanInputs(device_memory_bytes=24 * GiB)).inputs.accept_rate == 0.65


# --------------------------------------------------------------------------- draft tokens


def test_draft_tokens_recommended_for_the_priced_step(mtp_plans):
    spec, plain = mtp_plans
    # link-bound at batch 1: verifying K + 1 tokens costs one pass, so deeper drafts win
    # up to the cap, and the plan takes the recommended K when none was given
    assert best_draft_tokens(spec, plain, 0.65)[0] == MAX_DRAFT_TOKENS == spec.spec_tokens
    assert best_draft_tokens(spec, plain, 0.02)[0] == 0  # too few accepted: no speculation
    k, tok_s = best_draft_tokens(spec, plain, 0.65)
    assert tok_s == pytest.approx(spec_estimate(spec, k, 0.65).est_tok_s) == pytest.approx(spec.est.est_tok_s)
    assert all(spec_estimate(spec, j, 0.65).est_tok_s <= tok_s for j in range(1, MAX_DRAFT_TOKENS + 1))


def test_the_flip_is_where_the_best_k_changes(mtp_plans):
    spec, plain = mtp_plans
    below, k_below, above, k_above = draft_flips(spec, plain, 0.65)
    assert above is None and below is not None and k_below < MAX_DRAFT_TOKENS
    assert best_draft_tokens(spec, plain, below + 0.002)[0] == MAX_DRAFT_TOKENS
    assert best_draft_tokens(spec, plain, below - 0.002)[0] == k_below
    note = next(n for n in spec.notes if n.startswith("draft tokens: "))
    assert f"flips to K={k_below} below acceptance {below:.3f}" in note


def test_a_given_k_is_kept_and_the_range_is_priced(reference):
    plan = make_plan(reference, PlanInputs(device_memory_bytes=24 * GiB, speculative="mtp", spec_tokens=2))
    assert plan.spec_tokens == 2
    span = next(n for n in plan.notes if n.startswith("est tok/s at acceptance 0.48/0.65/0.91"))
    plain = plan.alternative.est.est_tok_s
    assert f"without speculation {plain:.2f}" in span
    for k in range(1, MAX_DRAFT_TOKENS + 1):
        assert f"K={k}: " + "/".join(f"{spec_estimate(plan, k, a).est_tok_s:.2f}" for a in (0.48, 0.65, 0.91)) in span


# --------------------------------------------------------------------------- published points


def _published():
    sys.path.insert(0, str(ROOT))
    from benchmarks.planning import published

    return published


def test_every_published_point_has_a_source_and_an_expression_or_what_is_missing():
    published = _published()
    points = published.load_points()
    assert points[0]["id"] == "reference-fp8-cpu-offload" and points[0]["measured_tok_s"] == 1.05
    for p in points:
        assert p["source"] and p["verified"] and p["setup"]
        if p["role"] == "not expressed":
            assert p["missing"] and "plan_args" not in p
        else:
            assert p["plan_args"] and p["compare"] in ("cpu_offload", "selective")
    # a point that calibrates a default says which, so it is not read as a validation
    assert all(p.get("calibrates") for p in points if p["role"] == "calibrates")


def test_the_results_file_is_what_the_points_give_now():
    """benchmarks/results/published.{json,md} are regenerated, never edited: a change to the
    step model or the points that is not rerun shows here."""
    proc = subprocess.run([sys.executable, "-m", "benchmarks.planning", "published", "--check"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_expressed_point_is_within_its_tolerance():
    """The issue's bar: est/measured within 10% for dense UVA reads and prefetch copies,
    25% for resident MoE and compute-bound formats, on every point the model expresses
    (calibration points included: they check the arithmetic stays what it was). A point the
    model is known to miss says why in the points file, and must really be outside: when
    the model learns to meet it, the note has to go."""
    result = json.loads((ROOT / "benchmarks" / "results" / "published.json").read_text())
    assert result["expressed"]
    outside = [(r["id"], round(r["est_over_measured"], 3)) for r in result["expressed"]
               if not r["within"] and not r["known_outside"]]
    assert not outside, outside
    stale = [r["id"] for r in result["expressed"] if r["within"] and r["known_outside"]]
    assert not stale, stale
    # every default factor names its calibration point, and each point that calibrates one is named
    calibrating = {r["id"] for r in result["expressed"] if r["role"] == "calibrates"}
    assert calibrating == {c["calibrate_on"] for c in result["calibrations"]}
    validated = {v["id"] for c in result["calibrations"] for v in c["validates"]}
    assert validated and validated <= {r["id"] for r in result["expressed"] if r["role"] == "validates"}


def test_the_step_model_page_shows_the_results_table():
    md = (ROOT / "benchmarks" / "results" / "published.md").read_text()
    page = (ROOT / "docs" / "design" / "step-model.md").read_text()
    shown = md.split("Not expressed by the step model", 1)[0]  # the page lists the rest in prose
    table = [line for line in shown.splitlines() if line.startswith("|")]
    assert len(table) > 10
    missing = [line for line in table if line not in page]
    assert not missing, missing


@pytest.mark.parametrize("edit, words", [
    (lambda d: d.update(format="x"), "format is 'x'"),
    (lambda d: d["points"][0].pop("source"), "'source' must be a non-empty string"),
    (lambda d: d["points"][1].pop("missing"), "says what is 'missing'"),
    (lambda d: d["points"][0].pop("plan_args"), "needs 'plan_args'"),
    (lambda d: d["points"][0].update(measured_ms_per_token=900.0), "exactly one of"),
    (lambda d: d["points"].append(dict(d["points"][0])), "the id is used twice"),
    (lambda d: d["acceptance_lengths"][0].update(calibrate_on=7), "calibrate_on among the K"),
    (lambda d: d["calibrations"][1].update(calibrate_on="dgx-spark-gpt-oss-120b"), "whose role is 'calibrates'"),
])
def test_a_bad_points_file_is_one_line(tmp_path, edit, words):
    data = json.loads((ROOT / "benchmarks" / "planning" / "published.json").read_text())
    edit(data)
    path = tmp_path / "points.json"
    path.write_text(json.dumps(data))
    proc = subprocess.run([sys.executable, "-m", "benchmarks.planning", "published", "--points", str(path),
                           "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 2 and words in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr


# --------------------------------------------------------------------------- per-mechanism rates


def test_the_default_uva_factor_is_the_reference_arithmetic(reference):
    """The reference point (docs/design/reference-measurements.md): cpu_offload_gb=10 measured 1.05 tok/s with 13.9 GB/s copies;
    what the step leaves for the UVA bytes after the device reads gives the factor. A
    calibration on that point (the literal here, so changing the default is caught)."""
    plan = make_plan(reference, PlanInputs(device_memory_bytes=24 * GiB, vllm_cpu_offload_gb=10, link_gbps=13.9,
                                           vram_gbps=472.0))
    b = plan.vllm_cpu_offload_gb
    uva_s = 1 / 1.05 - b.est.est_vram_s_per_step
    assert b.offloaded_bytes / uva_s / 13.9e9 == pytest.approx(DEFAULT_UVA_READ_FACTOR, abs=0.005)
    assert DEFAULT_UVA_READ_FACTOR == 0.86
    assert b.est.est_tok_s == pytest.approx(1.05, rel=0.01)
    # the device's share is read at the decode factor's fraction of 472 GB/s: the UVA factor moves with it
    at_full = make_plan(reference, PlanInputs(device_memory_bytes=24 * GiB, vllm_cpu_offload_gb=10, link_gbps=13.9,
                                              vram_gbps=472.0, decode_read_gbps=472.0)).vllm_cpu_offload_gb
    assert b.est.est_vram_s_per_step == pytest.approx(at_full.est.est_vram_s_per_step / DEFAULT_DECODE_READ_FACTOR)


def test_the_default_decode_factor_is_the_calibration_point_arithmetic():
    """The Llama-3.3-70B NVFP4 point on a DGX Spark (4.0-4.2 tok/s measured, 232 GB/s
    saturating reads) gives 0.700-0.735; the default is its middle, rounded (the literal
    here, so changing the default is caught). It is a calibration: the points that validate
    it are others (another model on that box, two other boxes at their datasheet rates)."""
    result = json.loads((ROOT / "benchmarks" / "results" / "published.json").read_text())
    row = next(r for r in result["calibrations"] if r["constant"] == "DEFAULT_DECODE_READ_FACTOR")
    low, high = row["implied"]
    assert DEFAULT_DECODE_READ_FACTOR == 0.72 == round((low + high) / 2, 2) and low < 0.72 < high
    assert row["calibrate_on"] == "dgx-spark-llama-3.3-70b-nvfp4"
    assert {v["id"] for v in row["validates"]} == {"dgx-spark-gpt-oss-120b", "a100-40gb-llama-3.1-8b-bf16",
                                                    "h100-sxm-llama-3.1-8b-fp16"}
    assert all(v["within"] for v in row["validates"])
    # a decode rate measured the way decode reads is taken as is; a datasheet one is scaled
    from selective_offload.estimate.traffic import decode_read_rate

    assert decode_read_rate(1000.0) == pytest.approx(720.0) and decode_read_rate(1000.0, 640.0) == 640.0


def test_each_mechanism_at_its_own_rate():
    from selective_offload.estimate.step import step_cost
    from selective_offload.estimate.traffic import StepSettings, Traffic

    gb = 10 ** 9
    traffic = Traffic(layers=((gb, True), (gb, False)), uva_bytes=2 * gb, row_bytes_host=1000)
    base = StepSettings(10.0, 1000.0)
    one = step_cost(traffic, base, None, pipelined=True)
    # the copy (1 GB at 10 GB/s) at the link rate, the UVA bytes and the row at 0.86 of it
    assert one["est_link_s_per_step"] == pytest.approx(0.1 + (2 * gb + 1000) / 8.6e9)
    probed = step_cost(traffic, replace(base, uva_gbps=5.0), None, pipelined=True)
    assert probed["est_link_s_per_step"] == pytest.approx(0.1 + (2 * gb + 1000) / 5e9)
    # a faster UVA rate leaves the prefetch copy's cost alone
    copy_only = Traffic(layers=((gb, True), (gb, False)))
    assert step_cost(copy_only, replace(base, uva_gbps=99.0), None, pipelined=True)["est_step_s"] == \
        pytest.approx(step_cost(copy_only, base, None, pipelined=True)["est_step_s"])
    cpu_offload = step_cost(Traffic(layers=((gb, False),), uva_bytes=gb), base, None, pipelined=False)
    # the device's gigabyte read by decode kernels at 0.72 of the 1000 GB/s given
    assert cpu_offload["est_step_s"] == pytest.approx(gb / 720e9 + gb / 8.6e9)
    measured = step_cost(Traffic(layers=((gb, False),), uva_bytes=gb), replace(base, decode_read_gbps=500.0), None,
                         pipelined=False)
    assert measured["est_step_s"] == pytest.approx(gb / 500e9 + gb / 8.6e9)  # a measured decode rate is taken as is


def test_cli_takes_the_uva_rate_and_the_probe_s_only_with_its_link(capsys, tmp_path, monkeypatch):
    from selective_offload.cli import main

    def plan(*argv):
        code = main(["plan", "qwen3.8-27b-fp8", "--device-memory", "24GiB", "--host-memory", "none", "--json", *argv])
        out, err = capsys.readouterr()
        return code, (json.loads(out)["inputs"] if code == 0 else err)

    monkeypatch.setenv("SELECTIVE_OFFLOAD_PROFILE", str(tmp_path / "none.json"))
    assert plan()[1]["uva_gbps"] is None and plan("--uva-gbps", "9.5")[1]["uva_gbps"] == 9.5
    code, err = plan("--uva-gbps", "fast")
    assert code == 2 and "--uva-gbps: cannot read 'fast'" in err and err.count("\n") == 1
    code, err = plan("--compute-tflops", "-3")
    assert code == 2 and "--compute-tflops: '-3' must be a positive number" in err and err.count("\n") == 1
    from builders import gpu_profile  # a hand-written H200-like profile

    gpu_profile(uva_read_gbps=40.0, uva_read_samples_s={GiB: GiB / 40e9}, matmul_tflops=700.0,
                matmul_dtype="bfloat16", decode_read_gbps=3100.0).save(tmp_path / "p.json")
    monkeypatch.setenv("SELECTIVE_OFFLOAD_PROFILE", str(tmp_path / "p.json"))
    inputs = plan()[1]
    assert (inputs["link_gbps"], inputs["uva_gbps"], inputs["compute_tflops"]) == (52.3, 40.0, 700.0)
    assert (inputs["vram_gbps"], inputs["decode_read_gbps"]) == (3900.0, 3100.0)
    # another link given by hand: the probe's UVA rate belongs to the probe's link, so not taken
    inputs = plan("--link-gbps", "13.9")[1]
    assert inputs["uva_gbps"] is None and inputs["compute_tflops"] == 700.0
    # likewise the probe's decode rate belongs to its VRAM: another VRAM rate is scaled by the default factor
    inputs = plan("--vram-gbps", "4800")[1]
    assert (inputs["vram_gbps"], inputs["decode_read_gbps"]) == (4800.0, None)
    assert plan("--vram-gbps", "4800", "--decode-read-gbps", "3500")[1]["decode_read_gbps"] == 3500.0


# --------------------------------------------------------------------------- compute


def test_flops_are_counted_from_stored_bytes():
    from selective_offload.estimate.traffic import flops_per_token

    assert flops_per_token({"BF16": 100}) == 100  # 50 parameters
    assert flops_per_token({"F8_E4M3": 100}) == 200
    assert flops_per_token({"U8": 100, "F8_E4M3": 10}) == 400 + 20  # NVFP4: two 4-bit values a byte
    assert flops_per_token({"I32": 4}) == 16  # GPTQ/AWQ: eight 4-bit values an int32


def test_a_layer_costs_at_least_its_compute():
    from selective_offload.estimate.step import step_cost
    from selective_offload.estimate.traffic import StepSettings, Traffic

    traffic = Traffic(layers=((10 ** 9, False), (10 ** 9, False)), layer_flops=(2e9, 2e9), other_flops=1e9,
                      other_device_bytes=10 ** 9)
    memory = step_cost(traffic, StepSettings(10.0, 1000.0, batch=1, decode_read_gbps=1000.0), None, pipelined=True)
    assert memory["est_compute_s_per_step"] == 0.0 and memory["est_step_s"] == pytest.approx(3e9 / 1000e9)
    priced = step_cost(traffic, StepSettings(10.0, 1000.0, batch=1, compute_tflops=1.0, decode_read_gbps=1000.0), None,
                       pipelined=True)
    assert priced["est_compute_s_per_step"] == pytest.approx(5e9 / 1e12)
    assert priced["est_step_s"] == pytest.approx(3e-3 + 2e-3)  # 2 ms of each layer and the head: 3 ms over 3 ms reads
    big = step_cost(traffic, StepSettings(10.0, 1000.0, batch=100, compute_tflops=1.0), None, pipelined=False)
    assert big["est_step_s"] == pytest.approx(5e9 * 100 / 1e12)  # every part compute-bound


def test_the_plan_says_what_bounds_the_step(reference):
    # the prefetch plans (host-compute off): link-bound
    link = make_plan(reference, PlanInputs(device_memory_bytes=24 * GiB, compute_tflops=200.0, host_compute=False))
    assert any(n.startswith("link-bound: the host bytes decide the step (the step's FLOPs take 0.3 ms at "
                            "200 TFLOP/s") for n in link.notes)
    # at batch 512 the FLOPs exceed the VRAM reads but hide behind the copies: still link-bound
    hidden = make_plan(reference, PlanInputs(device_memory_bytes=24 * GiB, compute_tflops=200.0, batch=512,
                                             host_compute=False))
    assert any(n.startswith("link-bound") for n in hidden.notes)
    # on a card that holds it all, the FLOPs decide
    big = make_plan(reference, PlanInputs(device_memory_bytes=48 * GiB, compute_tflops=200.0, batch=1024))
    note = next(n for n in big.notes if n.startswith("compute-bound: "))
    assert f"FLOPs take {big.est.est_compute_s_per_step * 1e3:.1f} ms at 200 TFLOP/s" in note
    without = make_plan(reference, PlanInputs(device_memory_bytes=48 * GiB, batch=1024))
    assert big.est.est_step_s == pytest.approx(big.est.est_compute_s_per_step)
    assert big.est.est_step_s > 2 * without.est.est_step_s and without.est.est_compute_s_per_step == 0
    assert not any(n.startswith(("compute-bound", "memory-bound", "link-bound")) for n in without.notes)
