"""The LM head split between the GPU and the host CPU beside a device share: its last
vocabulary rows computed by the CPU (which waits while the GPU reads the head at the end of
a step), sized so that the two parts take about as long, the device memory they free given
to the layers' shares. Each figure is recomputed by hand from the inputs the test chooses
(the checkpoint of test_host_compute.py: an LM head of 1000 rows of 50,000 bf16, 100 MB)."""

from __future__ import annotations

import json

import pytest
from test_host_compute import EXPERTS_BYTES, E, K, moe, plan_of, refused_edit

from builders import MB, make_ckpt
from selective_offload.estimate.traffic import ASSUMED_HANDOFF_S, DEFAULT_DECODE_READ_FACTOR, REFERENCE_CPU_GBPS
from selective_offload.picture import DEVICE_SHARE, picture_data
from selective_offload.plan_format import Plan
from selective_offload.plan_format.vocabulary import REFERENCE_VRAM_GBPS
from selective_offload.render import render_plan

HEAD = 100 * MB
ROWS = 1000


def split(ckpt, short_mb, **kw):
    """The planner with a device share and the head split allowed, ``short_mb`` under the model."""
    return plan_of(ckpt, ckpt.total_bytes / MB - short_mb, **{"device_share": True, "head_share": True, **kw})


def experts_of(plan):
    return [g for g in plan.groups if g.kind == "experts"]


def slower_part(on_device: int) -> float:
    """By hand: the CPU reads the host's rows at the host rate and hands off once; the GPU
    reads its rows at the decode read rate; the step waits for the slower."""
    share = on_device / ROWS
    cpu = (1 - share) * HEAD / (REFERENCE_CPU_GBPS * 1e9) + ASSUMED_HANDOFF_S
    gpu = share * HEAD / (REFERENCE_VRAM_GBPS * DEFAULT_DECODE_READ_FACTOR * 1e9)
    return max(cpu, gpu)


def test_the_head_splits_where_its_two_parts_take_as_long_and_the_room_it_frees_goes_to_the_shares():
    ckpt = moe(4)
    # 300 MB short: with every layer's experts and the head on the host, 220 MB of the budget
    # is free; the head's device rows take 89.6 MB of it, and the experts' share the rest.
    plan = split(ckpt, 300)
    head = plan.group_of("lm_head")
    best = min(range(128, ROWS, 128), key=slower_part)
    assert (head.serving, head.device_channels, head.intermediate) == ("compute", best, ROWS)
    assert best == 896  # the CPU's part (10.4 MB at 55 GB/s and a hand-off) just under the GPU's (89.6 MB)
    assert slower_part(best) < HEAD / (REFERENCE_VRAM_GBPS * DEFAULT_DECODE_READ_FACTOR * 1e9)  # beats the whole head
    # 130.4 MB for the experts: 3 of every layer's (120 MB) and one more in the first layer
    assert [g.device_experts for g in experts_of(plan)] == [4, 3, 3, 3]
    assert plan.device_share_bytes == 13 * EXPERTS_BYTES // E + HEAD * best // ROWS and plan.shortfall_bytes == 0
    assert plan.host_compute_bytes == 4 * EXPERTS_BYTES + HEAD  # the host keeps every row
    # the step: the experts' CPU time as before plus the head's CPU part, which the GPU's hides behind
    per_layer = [EXPERTS_BYTES * K / E * (1 - m / E) / (REFERENCE_CPU_GBPS * 1e9) + ASSUMED_HANDOFF_S
                 for m in (4, 3, 3, 3)]
    head_cpu = (1 - best / ROWS) * HEAD / (REFERENCE_CPU_GBPS * 1e9) + ASSUMED_HANDOFF_S
    assert plan.est.est_cpu_s_per_step == pytest.approx(sum(per_layer) + head_cpu, rel=1e-9)
    whole = split(ckpt, 300, head_share=False)
    assert whole.group_of("lm_head").serving == "resident"
    assert [g.device_experts for g in experts_of(whole)] == [3, 3, 3, 3]
    assert plan.est.est_step_s < whole.est.est_step_s
    words = f"LM head lm_head: its last {ROWS - best} of {ROWS} vocabulary rows computed by the host CPU"
    assert any(words in n for n in plan.notes)
    text = render_plan(plan, verbose=True)
    assert words in text and "lm_head" in text
    # the picture draws the head's slot with its device rows on it
    slot = next(s for s in picture_data(plan)["slots"] if s["label"] == "lm_head")
    stack = [(e["serving"], e["bytes"]) for e in slot["stack"]]
    assert stack == [("compute", HEAD), (DEVICE_SHARE, HEAD * best // ROWS)]


def test_no_split_without_a_device_share_one_rank_a_claimed_bf16_walk_or_a_bf16_head_of_its_own(monkeypatch, tmp_path):
    import sys

    from helpers import REPO
    from selective_offload.cpu_kernels import claimed
    from selective_offload.planner import PlanInputs, make_plan
    from selective_offload.sizes import GiB

    ckpt = moe(4)
    # gpt-oss-20b on 8 GiB: MXFP4 experts on the host CPU, a bf16 head split beside them,
    # unless the bf16 row walk is not claimed fast
    sys.path.insert(0, str(REPO))
    from benchmarks.planning import moe_plans as moe_reference_plans

    _, gib, _, oss = next(moe_reference_plans.case_checkpoints(tmp_path))
    assert make_plan(oss, PlanInputs(device_memory_bytes=gib * GiB)).group_of("lm_head").serving == "compute"
    monkeypatch.setitem(claimed.CLAIMED, "bf16", False)
    unclaimed = make_plan(oss, PlanInputs(device_memory_bytes=gib * GiB))
    assert unclaimed.host_compute_format == "mxfp4" and unclaimed.group_of("lm_head").serving == "resident"
    monkeypatch.undo()
    assert split(ckpt, 300, device_share=False).group_of("lm_head").serving == "resident"
    assert split(ckpt, 300, ranks=2).group_of("lm_head").serving == "resident"
    spec = {n: (t.dtype, list(t.shape)) for n, t in ckpt.tensors.items()}
    f32 = make_ckpt({**spec, "lm_head.weight": ("F32", [ROWS, 50_000])}, **{
        k: v for k, v in ckpt.config.items() if k != "tie_word_embeddings"})
    assert split(f32, 400).group_of("lm_head").serving == "resident"
    # a head too small to split into whole blocks of rows
    small = make_ckpt({**spec, "lm_head.weight": ("BF16", [128, 50_000])}, **{
        k: v for k, v in ckpt.config.items() if k != "tie_word_embeddings"})
    assert split(small, 300).group_of("lm_head").serving == "resident"


def test_the_split_head_round_trips_and_an_edit_the_format_does_not_allow_is_refused_in_one_line():
    plan = split(moe(4), 300)
    back = Plan.from_dict(json.loads(plan.to_json()))
    assert back.group_of("lm_head") == plan.group_of("lm_head") and back.est == plan.est
    at = next(i for i, g in enumerate(plan.groups) if g.group == "lm_head")
    norm = next(i for i, g in enumerate(plan.groups) if g.group == "model.norm")
    refused_edit(plan, lambda d: d["groups"][at].update(device_channels=0, intermediate=0), "not split")
    refused_edit(plan, lambda d: d["groups"][at].update(device_channels=ROWS), "device_channels")
    refused_edit(plan, lambda d: d["groups"][norm].update(serving="compute", location="host", device_channels=128,
                                                          intermediate=256), "not the LM head")


def test_the_head_leaves_the_cpu_at_its_own_crossover_and_the_step_model_copies_it_above():
    """The head's CPU part turns compute-bound at far fewer logits per step than a layer's
    experts, so it has a crossover of its own (``estimate.host.crossover_sets``), by hand: the
    largest step at which its rows on the CPU (their bytes at the host rate or their FLOPs at
    the CPU's matmul rate, and a hand-off) beat copying them over the link (and the GPU
    reading them beside its own rows). Between the two crossovers the step model computes the
    experts on the CPU and copies the head's rows."""
    from dataclasses import replace

    from selective_offload.estimate.host import host_compute_crossover, host_compute_times
    from selective_offload.estimate.traffic import (
        ASSUMED_CPU_TFLOPS,
        DEFAULT_UVA_READ_FACTOR,
        EXPERTS_CPU,
        StepSettings,
    )
    from selective_offload.plan_format import Estimate
    from selective_offload.plan_format.vocabulary import REFERENCE_LINK_GBPS

    plan = split(moe(4), 300)
    on_host = 1 - plan.group_of("lm_head").device_channels / ROWS
    vram = REFERENCE_VRAM_GBPS * DEFAULT_DECODE_READ_FACTOR * 1e9
    flops = 2 * HEAD / 2  # 2 FLOPs a bf16 parameter, a token

    def cpu_wins(t):
        cpu = max(on_host * HEAD / (REFERENCE_CPU_GBPS * 1e9), flops * on_host * t / (ASSUMED_CPU_TFLOPS * 1e12))
        copied = on_host * HEAD / (REFERENCE_LINK_GBPS * 1e9) + HEAD / vram
        return cpu + ASSUMED_HANDOFF_S < copied + ASSUMED_HANDOFF_S

    by_hand = max(t for t in range(1, 10_000) if cpu_wins(t))
    record = plan.host_compute
    assert record.head_crossover_tokens == by_hand
    units = [e for e in plan.traffic().experts if e.where == EXPERTS_CPU]
    i = plan.inputs
    settings = StepSettings(i.link_gbps, i.vram_gbps, cpu_gbps=i.host_cpu_gbps, cpu_tflops=i.host_cpu_tflops,
                            handoff_s=i.host_handoff_s)
    layers = [e for e in units if e.layer >= 0]
    assert record.crossover_tokens == host_compute_crossover(layers, settings) > by_hand
    assert f"the split LM head's own: {by_hand} logits per step" in record.describe()
    # a step between the two: the experts on the CPU, the head's rows over the link
    t = by_hand + 1
    est = Estimate.of(plan.traffic(), replace(i, batch=t), plan.model.kv, 0, pipelined=True)
    head = [e for e in units if e.layer < 0]
    embedding_rows = plan.traffic().row_bytes_host * t / (i.link_gbps * DEFAULT_UVA_READ_FACTOR * 1e9)  # gathered
    assert est.est_link_s_per_step == pytest.approx(host_compute_times(head, t, settings)[1] + embedding_rows, rel=1e-9)
    assert est.est_cpu_s_per_step == pytest.approx(host_compute_times(layers, t, settings)[0], rel=1e-9)
