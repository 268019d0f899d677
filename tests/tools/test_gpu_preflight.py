"""The GPU run's pre-flight section (benchmarks/preflight/) on the CPU.

Without a CUDA device the section prints the expert shapes for a card it is told, and
checks the reference plans against a stand-in (each plan's nominal card): these tests hold
its shapes to the planner's own allocation rule on SM 8.9 (Marlin, padded) and 9.0 (OAI
triton_kernels, unpadded), its verdicts to the plans' ledgers, and its reference manifests
to the configs benchmarks/planning/moe_plans.py builds.
"""

from __future__ import annotations

import json
import math
import sys

import pytest

from helpers import REPO

if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # the benchmarks are the package ``benchmarks`` at the checkout's root

import benchmarks.preflight as gpu_preflight  # noqa: E402
from benchmarks.planning import moe_plans as moe_reference_plans  # noqa: E402
from selective_offload.checkpoint import read_manifest  # noqa: E402
from selective_offload.names import experts_prefix  # noqa: E402
from selective_offload.planner import PlanInputs, make_plan  # noqa: E402
from selective_offload.planner.allocation import allocated_tensors, experts_bytes, padding_for  # noqa: E402
from selective_offload.planner.kernels import ROUND_UP, kernel_for  # noqa: E402
from selective_offload.sizes import GiB  # noqa: E402


@pytest.mark.parametrize("card", ["8.9", "9.0"])
def test_expert_shapes_are_the_planners_allocation(card):
    """Per expert, the bytes of the shapes printed are the planner's allocated bytes (its
    allocation rule over the whole layer), and the shapes follow the kernel's round-up."""
    shapes = {m["model"]: m for m in gpu_preflight.expert_shapes(card)}
    assert set(shapes) == set(gpu_preflight.GPT_OSS)
    for label, m in shapes.items():
        checkpoint = read_manifest(moe_reference_plans.MANIFEST_DIR / moe_reference_plans.MANIFESTS[label])
        padding = padding_for(checkpoint.config, card, "auto")
        kernel = kernel_for("mxfp4", card)
        assert m["kernel"] == padding.kernel == kernel
        h_mult, i_mult = ROUND_UP.get(("mxfp4", kernel), (1, 1))
        assert m["hidden"] == [2880, -(-2880 // h_mult) * h_mult]
        assert m["intermediate"] == [2880, -(-2880 // i_mult) * i_mult]
        layer = next(experts_prefix(n) for n in checkpoint.tensors if experts_prefix(n))
        ours = {n: t for n, t in checkpoint.tensors.items() if experts_prefix(n) == layer}
        experts = next(iter(ours.values())).shape[0]
        planner = experts_bytes(allocated_tensors(ours, padding))
        assert m["bytes_per_expert"]["allocated"] * experts == planner
        assert m["bytes_per_expert"]["checkpoint"] * experts == experts_bytes(ours)
        assert all(t["equals_planner"] for t in m["tensors"]), m["tensors"]
        h, i = m["hidden"][1], m["intermediate"][1]
        vllm = {t["vllm_parameter"]: t["vllm_shape"] for t in m["tensors"]}
        # vLLM 0.33's GptOssMxfp4MoEMethod.create_weights, per expert
        assert vllm == {"w13_weight": [2 * i, h // 2], "w13_weight_scale": [2 * i, h // 32], "w13_bias": [2 * i],
                        "w2_weight": [h, i // 2], "w2_weight_scale": [h, i // 32], "w2_bias": [h]}
    padded = shapes["gpt-oss-20b (MXFP4)"]["extra_pct"]
    assert (padded > 9) if card == "8.9" else (padded == 0)


def test_cpu_build_labels_the_card_and_the_memory_and_checks_a_stand_in():
    card = gpu_preflight.card_of_device(False)
    assert card["card"] == "8.9" and "no CUDA device" in card["source"] and "default" in card["source"]
    memory = gpu_preflight.context_memory(False)
    assert memory == {"measured": False, "why": "not measured (no CUDA device)"}
    rows = gpu_preflight.preflight(card["card"], memory)
    assert [(r["model"], r["reference_gib"]) for r in rows] == [(label, gib) for label, _, gib in
                                                               gpu_preflight.REFERENCE_PLANS]
    for r in rows:
        assert "stand-in" in r["planned_for"] and "no CUDA device" in r["against"]
        assert r["free_bytes"] == r["reference_gib"] * GiB
        plan = make_plan(read_manifest(next(p for label, p, _ in gpu_preflight.REFERENCE_PLANS if label == r["model"])),
                         PlanInputs(device_memory_bytes=r["free_bytes"], compute_capability="8.9"))
        assert r["need_bytes"] == (plan.device_bytes + plan.device_share_bytes + plan.est_transient_device_bytes
                                   + plan.prefetch_buffer_bytes + plan.inputs.kv_cache_bytes)
        assert r["fits"] is (r["need_bytes"] <= r["free_bytes"]) and r["verdict"].startswith("fits")
    # The summary's family says why it is not measured.
    got = gpu_preflight.free_over_need({"card": card, "memory": memory, "plans": rows})
    assert isinstance(got, str) and got.startswith("no CUDA device")


def test_a_measured_card_gets_a_verdict_per_plan_and_a_short_one_says_by_how_much():
    """What a CUDA card would give (SM 12.0 at 23.6 GiB free, its class 24 GiB): each plan is
    made for the free memory and for the card class, and the class's plan, made for what a 24 GB
    card keeps free after its context (the planner's card table: 23.15 GiB, est), fits the
    23.6 GiB with its reserve."""
    free = int(23.6 * GiB)
    memory = {"measured": True, "free_bytes": free, "est_card_class_gib": 24}
    rows = gpu_preflight.preflight("12.0", memory, plans=gpu_preflight.REFERENCE_PLANS[:1])
    assert [r["planned_for"] for r in rows] == ["free after context", "card class 24 GiB (est)"]
    on_free, on_class = rows
    assert on_free["fits"] and on_free["reserve_covered"] and on_free["device_memory_bytes"] == free
    assert on_class["device_memory_bytes"] == 24 * GiB and on_class["need_bytes"] < on_free["need_bytes"]
    assert on_class["left_bytes"] == free - on_class["need_bytes"] >= on_class["reserve_bytes"] and on_class["fits"]
    short = gpu_preflight.verdict(on_class["need_bytes"], on_class["need_bytes"] - GiB // 2)
    assert short == "short by 0.50 GiB"
    ratios = gpu_preflight.free_over_need({"card": {"card": "12.0"}, "memory": memory, "plans": rows})
    assert [r["measured"] for r in ratios] == pytest.approx([free / r["need_bytes"] for r in rows])
    assert all(math.isfinite(r["measured"]) for r in ratios) and "fits" in ratios[0]["note"]


def test_reference_manifests_are_what_the_configs_build(tmp_path):
    """The committed manifests (the GPU image has no transformers) are the reference
    configs' checkpoints."""
    written = moe_reference_plans.write_manifests(tmp_path)
    assert sorted(p.name for p in written) == sorted(moe_reference_plans.MANIFESTS.values())
    for path in written:
        committed = json.loads((moe_reference_plans.MANIFEST_DIR / path.name).read_text())
        assert json.loads(path.read_text()) == committed, f"rerun python -m benchmarks.planning moe-plans --manifests for {path.name}"
