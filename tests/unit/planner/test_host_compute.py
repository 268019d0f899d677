"""Host-compute: routed experts computed by the host CPU where they live, priced at the host
kernel's rate up to a crossover, above which the distinct experts a step uses are copied
over the link. Each figure here is recomputed by hand from the inputs the test chooses."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from builders import MB, make_ckpt
from helpers import REPO
from selective_offload.anchors import LLAMA_CPP, anchors_for
from selective_offload.errors import PlanError
from selective_offload.estimate.host import COPIED_PATH_TRAFFIC, host_compute_crossover, host_compute_times
from selective_offload.estimate.traffic import EXPERTS_CPU, ExpertsRead, StepSettings, expert_read_fraction
from selective_offload.plan_format import Plan
from selective_offload.planner import PlanInputs, make_plan
from selective_offload.probe import Profile
from selective_offload.render import render_plan

E, K = 8, 2


def moe(layers: int = 4, **config):
    """Embed/lm_head 100 MB each, attention 10 MB a layer, routed experts 80 MB a layer
    (8 experts of 10 MB, 2 per token), all BF16."""
    spec = {"model.embed_tokens.weight": ("BF16", [1000, 50_000]), "lm_head.weight": ("BF16", [1000, 50_000]),
            "model.norm.weight": ("BF16", [500])}
    for i in range(layers):
        spec[f"model.layers.{i}.self_attn.qkv.weight"] = ("BF16", [1000, 5000])
        spec[f"model.layers.{i}.mlp.gate.weight"] = ("BF16", [E, 500])
        spec[f"model.layers.{i}.mlp.experts.gate_up_proj"] = ("BF16", [E, 1000, 3000])
        spec[f"model.layers.{i}.mlp.experts.down_proj"] = ("BF16", [E, 1000, 2000])
    return make_ckpt(spec, **{"num_experts": E, "num_experts_per_tok": K, "num_hidden_layers": layers, **config})


#: What a step above the crossover holds on the device when experts are computed on the
#: host: one layer's experts copied there (bf16: nothing to dequantize), est_transient_device_bytes.
COPY_MB = 80


def plan_of(ckpt, device_mb, **kw):
    """A plan of ``ckpt`` on ``device_mb`` of weights, plus the :data:`COPY_MB` a step
    above the crossover holds when the host may compute (so the figures below are the
    weights'); without a device share unless asked (the tests of the share are
    test_device_share.py's)."""
    kw.setdefault("device_share", False)
    kw.setdefault("head_share", False)
    copy = COPY_MB if kw.get("host_compute", True) else 0
    return make_plan(ckpt, PlanInputs(device_memory_bytes=int((device_mb + copy) * MB), kv_cache_bytes=0,
                                      reserve_bytes=0, **kw))


EXPERTS_BYTES = 80 * MB
FLOPS_PER_TOKEN = 2 * (EXPERTS_BYTES / 2) * K / E  # 2 FLOPs per bf16 parameter, k of E experts


def refused_edit(plan, edit, match) -> None:
    """``plan`` written, changed by ``edit`` (its JSON data), read back: refused in one line."""
    bad = json.loads(plan.to_json())
    edit(bad)
    with pytest.raises(PlanError, match=match) as info:
        Plan.from_dict(bad)
    assert "\n" not in str(info.value)


def computed(plan):
    return [g for g in plan.groups if g.serving == "compute"]


# ---- the step model


def hand_times(tokens, n, *, cpu, link, vram, cpu_tflops, handoff, traffic=1.0):
    """What the docstring of host_compute_times says, for ``n`` layers of this test's experts
    (``traffic``: bytes the copied path moves in VRAM per byte copied)."""
    read = EXPERTS_BYTES * (1 - (1 - K / E) ** tokens)
    flops = FLOPS_PER_TOKEN * tokens
    on_cpu = n * (max(read / (cpu * 1e9), flops / (cpu_tflops * 1e12)) + handoff)
    copied = n * (read / (link * 1e9) + traffic * read / (vram * 1e9) + handoff)
    return on_cpu, copied


def test_the_crossover_is_the_last_step_size_the_cpu_still_wins_by_hand():
    experts = [ExpertsRead(i, EXPERTS_BYTES, E, K, EXPERTS_CPU, FLOPS_PER_TOKEN) for i in range(3)]
    settings = StepSettings(10.0, 500.0, cpu_gbps=40.0, cpu_tflops=0.05, handoff_s=20e-6, decode_read_gbps=500.0)
    rates = dict(cpu=40.0, link=10.0, vram=500.0, cpu_tflops=0.05, handoff=20e-6)
    for t in (1, 3, 17):
        assert host_compute_times(experts, t, settings) == pytest.approx(hand_times(t, 3, **rates), rel=1e-12)
    wins = [t for t in range(1, 400) if (lambda c: c[0] < c[1])(hand_times(t, 3, **rates))]
    first_loss = next(t for t in range(1, 400) if t not in wins)
    assert 1 < first_loss < 400
    assert host_compute_crossover(experts, settings) == first_loss - 1
    # a faster link moves it down, a faster CPU up
    assert host_compute_crossover(experts, replace(settings, link_gbps=30.0)) < first_loss - 1
    assert host_compute_crossover(experts, replace(settings, cpu_tflops=0.2)) > first_loss - 1
    # a CPU slower than the link at reading loses at one token already
    assert host_compute_crossover(experts, replace(settings, cpu_gbps=1.0)) == 0


def test_the_crossover_prices_the_copied_path_as_it_runs(monkeypatch):
    """Copied experts are dequantized and computed by torch ops on the device, for MXFP4
    COPIED_PATH_TRAFFIC times their bytes in VRAM traffic: the copy loses more steps to the
    CPU than one read of the copy would."""
    traffic = COPIED_PATH_TRAFFIC["mxfp4"]
    experts = [ExpertsRead(i, EXPERTS_BYTES, E, K, EXPERTS_CPU, FLOPS_PER_TOKEN, copied_traffic=traffic)
               for i in range(3)]
    settings = StepSettings(10.0, 100.0, cpu_gbps=40.0, cpu_tflops=0.05, handoff_s=20e-6, decode_read_gbps=100.0)
    rates = dict(cpu=40.0, link=10.0, vram=100.0, cpu_tflops=0.05, handoff=20e-6)
    for t in (1, 17, 200):
        assert host_compute_times(experts, t, settings) == pytest.approx(hand_times(t, 3, traffic=traffic, **rates))
    first_loss = next(t for t in range(1, 2000) if (lambda c: c[0] >= c[1])(hand_times(t, 3, traffic=traffic, **rates)))
    assert host_compute_crossover(experts, settings) == first_loss - 1
    once = [replace(e, copied_traffic=1.0) for e in experts]
    assert host_compute_crossover(once, settings) < first_loss - 1
    # a plan prices its host-compute groups' copies at its format's traffic
    monkeypatch.setitem(COPIED_PATH_TRAFFIC, "bf16", traffic)
    ckpt = moe(4)
    plan = plan_of(ckpt, ckpt.total_bytes / MB - 200, cpu_gbps=40.0, cpu_gbps_source="flag")
    on_cpu = [e for e in plan.traffic().experts if e.where == EXPERTS_CPU]
    assert on_cpu and all(e.copied_traffic == traffic for e in on_cpu)


def test_the_step_prices_host_compute_at_the_cpu_rate_and_one_hand_off_per_layer():
    ckpt = moe(4)
    # 300 MB short: the embedding (100 MB, cold) first, then three layers' experts (80 MB each)
    plan = plan_of(ckpt, ckpt.total_bytes / MB - 300, cpu_gbps=40.0, cpu_gbps_source="flag", handoff_s=50e-6)
    host = computed(plan)
    assert len(host) == 3 and plan.host_compute_bytes == 3 * EXPERTS_BYTES and not plan.uva_bytes
    assert all(g.est_link_bytes_per_step == 0 and g.serving == "compute" and g.location == "host" for g in host)
    assert plan.strategy == "hot_offload"
    expected = 3 * (EXPERTS_BYTES * K / E / 40e9 + 50e-6)  # bytes-bound at one token
    assert plan.est.est_cpu_s_per_step == pytest.approx(expected, rel=1e-9)
    faster = plan_of(ckpt, ckpt.total_bytes / MB - 300, cpu_gbps=80.0, cpu_gbps_source="flag", handoff_s=50e-6)
    assert faster.est.est_cpu_s_per_step == pytest.approx(3 * (EXPERTS_BYTES * K / E / 80e9 + 50e-6), rel=1e-9)
    assert faster.est.est_step_s < plan.est.est_step_s
    assert plan.est.est_link_s_per_step == pytest.approx(2 * 50_000 / (13.9e9 * 0.86), rel=1e-6)  # one embedding row


def test_above_the_crossover_the_step_copies_the_experts_it_uses():
    ckpt = moe(4)
    small = plan_of(ckpt, ckpt.total_bytes / MB - 200, cpu_gbps=40.0, cpu_gbps_source="flag", batch=1)
    crossover = small.host_compute.crossover_tokens
    big = plan_of(ckpt, ckpt.total_bytes / MB - 200, cpu_gbps=40.0, cpu_gbps_source="flag", batch=crossover + 1)
    if computed(big):
        assert big.est.est_cpu_s_per_step == 0.0
        read = len(computed(big)) * EXPERTS_BYTES * expert_read_fraction(E, K, crossover + 1)
        assert big.est.est_link_s_per_step >= read / 13.9e9
        assert any("above the crossover" in n for n in big.notes)


def test_ranks_share_the_host_bandwidth_and_split_its_threads():
    ckpt = moe(4)
    one = plan_of(ckpt, ckpt.total_bytes / MB - 200, cpu_threads=16)
    # each rank's device holds its half of a layer's copy above the crossover: the room it frees is taken back
    two = plan_of(ckpt, ckpt.total_bytes / MB - 200 - COPY_MB / 2, cpu_threads=16, ranks=2)
    assert two.est_transient_device_bytes == one.est_transient_device_bytes // 2 == EXPERTS_BYTES // 2
    assert [g.serving for g in two.groups] == [g.serving for g in one.groups]
    assert two.host_compute.threads == 8 and one.host_compute.threads == 16 and two.host_compute.ranks == 2
    # each rank reads half the bytes at half the bandwidth: the host's time is the same
    assert two.est.est_cpu_s_per_step == pytest.approx(one.est.est_cpu_s_per_step, rel=1e-12)
    text = two.host_compute.describe()
    assert "2 ranks, each its own host-compute unit" in text and "shared" in text and "8 threads each" in text
    with pytest.raises(PlanError, match="cannot be split between 4 ranks"):
        PlanInputs(device_memory_bytes=10**9, cpu_threads=2, ranks=4).validate()


# ---- the menu


def test_an_unclaimed_format_stays_uva_with_the_reason_in_the_plan(monkeypatch):
    from selective_offload.cpu_kernels.claimed import CLAIMED

    monkeypatch.setitem(CLAIMED, "fp8-block", False)  # as if its benchmark had not reached the bar
    ckpt = moe(4, quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]})
    plan = plan_of(ckpt, ckpt.total_bytes / MB - 200)
    assert not computed(plan) and plan.host_compute is None
    uva = [g for g in plan.groups if g.serving == "uva"]
    assert uva and all("fp8-block CPU kernel is not claimed fast" in g.reason for g in uva)
    assert any(n.startswith("host-compute: the fp8-block CPU kernel is not claimed") for n in plan.notes)
    # a format with no CPU kernel at all says so too
    nv = plan_of(moe(4, quantization_config={"quant_method": "modelopt", "quant_algo": "NVFP4"}), 1e9)
    assert not computed(nv)


def test_bf16_experts_are_computed_on_the_host_and_the_plan_says_at_what_rate():
    ckpt = moe(4)
    plan = plan_of(ckpt, ckpt.total_bytes / MB - 200)
    record = plan.host_compute
    assert record.format == "bf16" and record.cpu_gbps == 55.0 and record.cpu_gbps_source == "assumed"
    assert record.threads is None and record.ranks == 1 and record.crossover_tokens >= 1
    assert any("assumed: the reference host's, a 2-channel DDR5 machine" in n for n in plan.notes)
    text = render_plan(plan, verbose=True)
    assert " host     compute " in text
    assert f"crossover {record.crossover_tokens} tokens per step" in text
    assert "all physical cores of one NUMA node" in text and "(assumed)" in text
    # host-compute off: the same deficit closed through UVA, slower at this rate
    off = plan_of(ckpt, ckpt.total_bytes / MB - 200, host_compute=False)
    assert not computed(off) and off.uva_bytes == plan.host_compute_bytes
    assert off.est.est_step_s > plan.est.est_step_s


def test_a_cpu_that_loses_at_one_token_leaves_every_step_to_the_copy():
    """At 2 GB/s the CPU loses at one token (crossover 0): a decode step copies the experts
    it uses at the pinned copy rate, which still beats reading them through UVA."""
    ckpt = moe(4)
    # The planner would rather read one layer fewer through UVA than hold the copy of a
    # CPU that never computes: the same placement, priced at 2 GB/s.
    fast = plan_of(ckpt, ckpt.total_bytes / MB - 200)
    plan = replace(fast, inputs=replace(fast.inputs, cpu_gbps=2.0, cpu_gbps_source="flag"))
    assert plan.host_compute.crossover_tokens == 0 and plan.est.est_cpu_s_per_step == 0.0
    uva = plan_of(ckpt, ckpt.total_bytes / MB - 200, host_compute=False)  # as many layers' experts on the host
    assert uva.uva_bytes == plan.host_compute_bytes
    assert plan.est.est_step_s < uva.est.est_step_s


# ---- the plan file


def test_host_compute_round_trips_and_a_stated_field_that_disagrees_is_refused(tmp_path, monkeypatch):
    ckpt = moe(4)
    plan = plan_of(ckpt, ckpt.total_bytes / MB - 200, cpu_gbps=40.0, cpu_gbps_source="flag", cpu_threads=6)
    data = json.loads(plan.to_json())
    assert data["host_compute"]["crossover_tokens"] == plan.host_compute.crossover_tokens
    assert data["inputs"]["cpu_gbps"] == 40.0 and data["inputs"]["cpu_gbps_source"] == "flag"
    back = Plan.from_dict(data)
    assert back.host_compute == plan.host_compute and back.host_compute.threads == 6

    def refused(edit, match):
        refused_edit(plan, edit, match)

    refused(lambda d: d["host_compute"].update(crossover_tokens=d["host_compute"]["crossover_tokens"] + 1),
            "host_compute.crossover_tokens says")
    from selective_offload.cpu_kernels import claimed

    with monkeypatch.context() as mp:  # a format the committed benchmark does not claim
        mp.setitem(claimed.CLAIMED, "int4", False)
        refused(lambda d: d["host_compute"].update(format="int4"), "int4 CPU kernel is not claimed fast by the committed")
    refused(lambda d: d["host_compute"].update(format="q4_k"), "is not a CPU kernel format")
    refused(lambda d: d.update(host_compute=None), "served compute, but the plan has no host_compute")
    refused(lambda d: d["inputs"].update(cpu_gbps_source="measured", cpu_gbps=None), "exactly when no rate")
    refused(lambda d: d["inputs"].update(cpu_threads=0), "cpu_threads")
    # an older plan (no host-compute fields) reads with host_compute None
    uva = json.loads(plan_of(ckpt, ckpt.total_bytes / MB - 200, host_compute=False).to_json())
    for name in ("cpu_gbps", "cpu_gbps_source", "cpu_threads", "cpu_tflops", "handoff_s", "ranks", "host_compute"):
        uva["inputs"].pop(name)
    uva.pop("host_compute")
    uva["totals"].pop("host_compute_bytes")
    assert Plan.from_dict(uva).host_compute is None


def test_a_kernel_is_claimed_on_the_host_the_probe_measured(monkeypatch):
    """With the probe's kernel rate and read rate, the claim is this host's: a format the
    committed benchmark does not claim is computed where it reads at least the bar of the
    host's read rate, a claimed one is not where it reads less; the plan says which, and
    the plan's reader and the worker hold a plan to the same rule."""
    from selective_offload.cpu_kernels import claimed

    monkeypatch.setitem(claimed.CLAIMED, "bf16", False)  # as the committed benchmark says int4 today
    ckpt = moe(4)
    measured = dict(cpu_gbps=30.0, cpu_gbps_source="measured")
    fast = plan_of(ckpt, ckpt.total_bytes / MB - 200, cpu_read_gbps=40.0, **measured)  # 0.75 of the host's reads
    assert computed(fast) and fast.host_compute.format == "bf16"
    assert any(n.startswith("host-compute: claimed on this host: the probe measured the bf16 CPU kernel on this "
                            "host at 0.75 of its read rate") for n in fast.notes)
    back = Plan.from_dict(json.loads(fast.to_json()))
    assert back.inputs.cpu_read_gbps == 40.0 and back.host_compute == fast.host_compute
    # the same rate without the host's read rate beside it: the committed verdict, not claimed
    committed = plan_of(ckpt, ckpt.total_bytes / MB - 200, cpu_gbps=30.0, cpu_gbps_source="flag")
    assert not computed(committed)
    assert any("bf16 CPU kernel is not claimed fast by the committed benchmark" in n for n in committed.notes)
    monkeypatch.setitem(claimed.CLAIMED, "bf16", True)
    slow = plan_of(ckpt, ckpt.total_bytes / MB - 200, cpu_read_gbps=60.0, **measured)  # 0.50: under the bar
    assert not computed(slow) and slow.host_compute is None
    assert any("at 0.50 of its read rate (30 of 60 GB/s; the bar is 0.6), so host experts are served uva" in n
               for n in slow.notes)
    # a measured plan edited to a read rate that puts its kernel under the bar, or a read rate
    # without a measured kernel rate, is refused on reading
    refused_edit(fast, lambda d: d["inputs"].update(cpu_read_gbps=80.0), "at 0.38 of its read rate")
    refused_edit(fast, lambda d: d["inputs"].update(cpu_gbps_source="flag"), "comes with a kernel rate the probe")


# ---- the probe


def cpu_profile(**fields):
    base = dict(machine="test x86_64", date="2026-12-02T00:00:00+00:00", torch_version="2.13", device=None,
                integrated=False, link_gbps_pinned=None, link_gbps_pageable=None, vram_gbps=None,
                device_memory_total_bytes=None, device_memory_free_bytes=None, host_memcpy_gbps=20.0,
                no_link_reason="no GPU here")
    return Profile(**{**base, **fields})


def test_a_profile_with_kernel_rates_reads_back_and_supplies_the_models_format(tmp_path, monkeypatch):
    from selective_offload.plan_options import with_measured_cpu_rate
    from selective_offload.probe import plan_defaults

    profile = cpu_profile(cpu_kernel_gbps={"bf16": 61.5, "mxfp4": 48.0}, cpu_threads=8, host_read_gbps=70.0)
    path = tmp_path / "profile.json"
    profile.save(path)
    read = Profile.load(path)
    assert read.cpu_kernel_gbps == {"bf16": 61.5, "mxfp4": 48.0} and read.cpu_threads == 8
    assert plan_defaults(read)["cpu_kernel_gbps"] == {"bf16": 61.5, "mxfp4": 48.0}
    assert "CPU kernels    bf16 61.5, mxfp4 48.0 GB/s" in read.render()
    ckpt = moe(4)
    inputs = PlanInputs(device_memory_bytes=ckpt.total_bytes - 200 * MB, kv_cache_bytes=0, reserve_bytes=0)
    measured = with_measured_cpu_rate(inputs, ckpt, read)
    assert (measured.cpu_gbps, measured.cpu_gbps_source, measured.cpu_read_gbps) == (61.5, "measured", 70.0)
    plan = make_plan(ckpt, measured)
    assert plan.host_compute.cpu_gbps == 61.5 and "measured by `selective-offload probe`" in plan.host_compute.describe()
    # a flag wins over the profile; an fp8-block model takes no bf16 rate
    flagged = with_measured_cpu_rate(replace(inputs, cpu_gbps=30.0, cpu_gbps_source="flag"), ckpt, read)
    assert flagged.cpu_gbps == 30.0
    fp8 = moe(4, quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]})
    assert with_measured_cpu_rate(inputs, fp8, read).cpu_gbps is None


@pytest.mark.parametrize("field,value", [("cpu_kernel_gbps", {"bf16": -1}), ("cpu_kernel_gbps", [1]),
                                         ("cpu_kernel_gbps", {"bf16": 0}), ("cpu_kernel_gbps", {"bf16": 1e7}),
                                         ("cpu_kernel_gbps", {"": 3.0}), ("cpu_threads", 0),
                                         ("handoff_s", 5.0), ("host_read_gbps", "fast")])
def test_a_profile_with_a_bad_host_compute_field_is_one_line(tmp_path, field, value):
    from selective_offload.errors import UserError

    data = cpu_profile().to_dict()
    data[field] = value
    with pytest.raises(UserError, match=field) as info:
        Profile.from_dict(data)
    assert "\n" not in str(info.value)


def test_the_probe_skips_the_kernels_in_one_line_when_they_are_not_here():
    from selective_offload.probe.host_compute import measure_host_compute, physical_cores_of_one_node

    said = []
    out = measure_host_compute(device=None, quick=True, repeats=1, say=said.append)
    assert physical_cores_of_one_node() >= 1
    if not out["cpu_kernel_gbps"]:
        assert said and all("\n" not in line and line.startswith("probe: ") for line in said)


# ---- the llama.cpp anchors


def test_the_anchors_are_the_published_files_and_match_by_model_and_card():
    data = json.loads((REPO / "benchmarks" / "planning" / "published.json").read_text())["llama_cpp_anchors"]
    assert [(a["model"], a["card_gb"], a["measured_tok_s"], a["source"]) for a in data] == \
        [(a.model, a.card_gb, a.tok_s, a.source) for a in LLAMA_CPP]
    gib = 1 << 30
    assert [a.tok_s for a in anchors_for(("GptOssForCausalLM",), 36, 128, 24 * gib)] == [33.1]
    assert [a.tok_s for a in anchors_for(("GptOssForCausalLM",), 24, 32, 8 * gib)] == [36.4]
    assert anchors_for(("Qwen3MoeForCausalLM",), 48, 128, 24 * gib) == []
    assert len(anchors_for(("GptOssForCausalLM",), 36, 128)) == 2


def test_a_tie_is_not_a_win_for_the_cpu():
    """The crossover is where the CPU is still cheaper: at equal cost the step copies. With
    no FLOPs and no hand-off, a CPU reading at half the rate of link and VRAM read in turn
    (1 / 0.5 = 1 / 1 + 1 / 1) ties at every step size."""
    experts = [ExpertsRead(0, EXPERTS_BYTES, E, K, EXPERTS_CPU, 0.0)]
    settings = StepSettings(1.0, 1.0, cpu_gbps=0.5, handoff_s=0.0, decode_read_gbps=1.0)
    cpu, copied = host_compute_times(experts, 1, settings)
    assert cpu == copied
    assert host_compute_crossover(experts, settings) == 0


def test_plan_takes_cpu_gbps_as_a_flag_and_shows_llama_cpps_figure_for_the_card(capsys, tmp_path, monkeypatch):
    """With the MXFP4 kernel claimed (the claim itself is the benchmark's: test_claimed.py)."""
    from selective_offload.cli import main
    from selective_offload.cpu_kernels import claimed

    monkeypatch.setitem(claimed.CLAIMED, "mxfp4", True)
    monkeypatch.setenv("SELECTIVE_OFFLOAD_PROFILE", str(tmp_path / "none.json"))
    config = REPO / "benchmarks" / "planning" / "published_models" / "gpt-oss-120b" / "config.json"
    args = [str(config), "--device-memory", "24GiB", "--host-memory", "none"]
    assert main(["plan", *args, "--cpu-gbps", "70", "--cpu-threads", "12", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["inputs"]["cpu_gbps"] == 70.0 and data["inputs"]["cpu_gbps_source"] == "flag"
    assert data["host_compute"]["format"] == "mxfp4" and data["host_compute"]["threads"] == 12
    assert data["host_compute"]["crossover_tokens"] >= 1
    assert main(["plan", *args, "--explain"]) == 0
    out = capsys.readouterr().out
    assert "llama.cpp published: 33.1 tok/s (gpt-oss-120b, 24 GB card" in out
    assert "\ncpu    mxfp4 at 55 GB/s (assumed) on " in out
