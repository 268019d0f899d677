"""A device share of the host-compute experts: every layer's routed experts computed on the
host, the first few of each also copied to the device, where the GPU computes the picks
that land there while the CPU computes the rest. Each figure is recomputed by hand from
the inputs the test chooses (the checkpoint of test_host_compute.py: 8 experts of 10 MB a
layer, 2 per token)."""

from __future__ import annotations

import json

import pytest
from test_host_compute import EXPERTS_BYTES, E, K, computed, moe, plan_of, refused_edit

from builders import MB
from selective_offload.estimate.traffic import ASSUMED_HANDOFF_S, REFERENCE_CPU_GBPS
from selective_offload.plan_format import Plan
from selective_offload.render import render_plan


def shared(ckpt, short_mb, **kw):
    return plan_of(ckpt, ckpt.total_bytes / MB - short_mb, **{"device_share": True, **kw})


def test_the_room_left_holds_the_same_first_experts_of_every_layer_and_the_step_is_faster():
    ckpt = moe(4)
    # 300 MB short: the embedding (100 MB) goes cold; with every layer's experts (4 x 80 MB)
    # on the host 120 MB of the budget is free: 3 experts of 10 MB in each of the 4 layers.
    plan = shared(ckpt, 300)
    host = computed(plan)
    assert len(host) == 4 and all(g.device_experts == 3 for g in host)
    assert plan.device_share_bytes == 4 * 3 * EXPERTS_BYTES // E and plan.shortfall_bytes == 0
    assert plan.device_bytes + plan.device_share_bytes + plan.est_transient_device_bytes <= plan.weight_budget_bytes
    # the CPU reads only the picks off the share: 5/8 of a step's k/E of each layer
    per_layer = EXPERTS_BYTES * K / E * (1 - 3 / E) / (REFERENCE_CPU_GBPS * 1e9) + ASSUMED_HANDOFF_S
    assert plan.est.est_cpu_s_per_step == pytest.approx(4 * per_layer, rel=1e-9)
    whole = shared(ckpt, 300, device_share=False)
    assert all(not g.device_experts for g in whole.groups) and len(computed(whole)) == 3
    assert plan.est.est_step_s < whole.est.est_step_s
    assert any("keeps its first 3 of 8 routed experts on the device" in n for n in plan.notes)
    text = render_plan(plan, verbose=True)
    assert "keeps its first 3 of 8 routed experts on the device" in text
    assert "+ 120.0 MB device share + 80.0 MB transient\n       = 340.0 MB of 340.0 MB" in text


def test_the_room_a_uniform_share_leaves_goes_to_the_first_layers_one_expert_each():
    ckpt = moe(4)
    # 280 MB short: 140 MB free once every layer's experts are on the host, 3 experts of each
    # layer (120 MB) and 20 MB more: one more expert in each of the first two layers
    plan = shared(ckpt, 280)
    assert [g.device_experts for g in computed(plan)] == [4, 4, 3, 3]
    assert plan.device_share_bytes == 14 * EXPERTS_BYTES // E and plan.shortfall_bytes == 0
    per_layer = [EXPERTS_BYTES * K / E * (1 - m / E) / (REFERENCE_CPU_GBPS * 1e9) + ASSUMED_HANDOFF_S
                 for m in (4, 4, 3, 3)]
    assert plan.est.est_cpu_s_per_step == pytest.approx(sum(per_layer), rel=1e-9)
    assert plan.est.est_step_s < shared(ckpt, 300).est.est_step_s
    assert any("keeps its first 3 of 8 routed experts (4 in the first 2 layers) on the device" in n
               for n in plan.notes)
    # 400 MB short: 20 MB free, less than one expert of every layer: the first two take one
    tight = shared(ckpt, 400)
    assert [g.device_experts for g in computed(tight)] == [1, 1, 0, 0]
    assert tight.device_share_bytes == 2 * EXPERTS_BYTES // E
    assert any("each of the 2 layers keeps its first 1 of 8 routed experts on the device" in n for n in tight.notes)


def test_no_share_when_the_room_holds_no_expert_or_ranks_share_the_host():
    ckpt = moe(4)
    # 415 MB short: 5 MB free once every layer's experts are on the host, half an expert
    tight = shared(ckpt, 415)
    assert not any(g.device_experts for g in tight.groups) and tight.device_share_bytes == 0
    two = shared(ckpt, 300, ranks=2)
    assert not any(g.device_experts for g in two.groups)
    # the host keeps every expert of a shared layer: 420 MB, more than 400 MB of host memory
    small_host = shared(ckpt, 300, host_memory_bytes=400 * MB, host_headroom_bytes=0)
    assert not any(g.device_experts for g in small_host.groups) and small_host.strategy == "hot_offload"
    assert shared(ckpt, 300, host_memory_bytes=420 * MB, host_headroom_bytes=0).device_share_bytes == 120 * MB


def test_the_share_round_trips_and_a_share_the_plan_cannot_hold_is_refused_in_one_line():
    ckpt = moe(4)
    plan = shared(ckpt, 300)
    data = json.loads(plan.to_json())
    groups = {g["group"]: g for g in data["groups"]}
    assert [g.get("device_experts") for g in groups.values() if g["serving"] == "compute"] == [3] * 4
    assert all("device_experts" not in g for g in groups.values() if g["serving"] != "compute")
    assert data["totals"]["device_share_bytes"] == plan.device_share_bytes
    back = Plan.from_dict(data)
    assert back.groups == plan.groups and back.est == plan.est and back.device_share_bytes == plan.device_share_bytes

    def refused(edit, match):
        refused_edit(plan, edit, match)

    first = next(i for i, g in enumerate(data["groups"]) if g["serving"] == "compute")
    refused(lambda d: d["groups"][first].update(device_experts=E), "device_experts")
    attn = next(i for i, g in enumerate(data["groups"]) if g["serving"] == "resident")
    refused(lambda d: d["groups"][attn].update(device_experts=1), "device_experts")
    refused(lambda d: d["totals"].update(device_share_bytes=0), "device_share_bytes")


# ---- a dense MLP's share: its first intermediate channels


def test_every_dense_mlp_keeps_its_first_channels_on_the_device_in_whole_blocks():
    from test_mlp_host_compute import MLP, dense
    from test_mlp_host_compute import I as INTERMEDIATE
    from test_mlp_host_compute import plan_of as dense_plan

    ckpt = dense(8, intermediate_size=INTERMEDIATE)
    # 150 MB short: the embedding (100 MB) goes cold, the MLPs close the rest
    # (and one MLP's copy held on the device by a step above the crossover)
    plan = dense_plan(ckpt, ckpt.total_bytes / MB - 150 + MLP / MB, head_share=False)  # the head's: test_head_share.py
    shared_mlps = [g for g in plan.groups if g.kind == "mlp"]
    assert len(shared_mlps) == 8 and not plan.hot_layer_indices and plan.shortfall_bytes == 0
    n = shared_mlps[0].device_channels
    assert all((g.device_channels, g.intermediate) == (n, INTERMEDIATE) for g in shared_mlps) and n % 128 == 0
    room = plan.weight_budget_bytes - plan.device_bytes - plan.est_transient_device_bytes - plan.est_vllm_workspace_bytes
    assert plan.device_share_bytes == 8 * (MLP * n // INTERMEDIATE) <= room
    assert 8 * (MLP * (n + 128) // INTERMEDIATE) > room or n + 128 >= INTERMEDIATE  # the most whole blocks that fit
    per_layer = MLP * (1 - n / INTERMEDIATE) / (REFERENCE_CPU_GBPS * 1e9) + ASSUMED_HANDOFF_S
    assert plan.est.est_cpu_s_per_step == pytest.approx(8 * per_layer, rel=1e-9)
    whole = dense_plan(ckpt, ckpt.total_bytes / MB - 150 + MLP / MB, device_share=False, head_share=False)
    assert not whole.device_share_bytes and plan.est.est_step_s < whole.est.est_step_s
    assert any(f"keeps its first {n} of {INTERMEDIATE} MLP channels (gate and up rows, down columns) on the device"
               in x for x in plan.notes)
    data = json.loads(plan.to_json())
    back = Plan.from_dict(data)
    assert back.groups == plan.groups and back.device_share_bytes == plan.device_share_bytes
    mlp_at = next(i for i, g in enumerate(data["groups"]) if g["kind"] == "mlp")
    layer_at = next(i for i, g in enumerate(data["groups"]) if g["kind"] == "layer")
    for index, change in ((mlp_at, {"device_channels": INTERMEDIATE}), (layer_at, {"device_channels": 128,
                                                                               "intermediate": INTERMEDIATE})):
        refused_edit(plan, lambda d, i=index, c=change: d["groups"][i].update(c), "device_channels")
    # a model the device holds once its embedding is on the host stays resident: no share
    fits = dense_plan(ckpt, ckpt.total_bytes / MB - 50)
    assert fits.strategy == "cold_offload" and not fits.device_share_bytes and not fits.host_compute_bytes
    # without the config's intermediate size no share is planned (nothing to cut it at)
    assert not dense_plan(dense(8), dense(8).total_bytes / MB - 150).device_share_bytes


def test_an_mxfp4_share_is_held_as_stored_sized_so_and_kept_for_the_faster_step(tmp_path):
    """gpt-oss-20b (MXFP4) on 8 GiB: the room left once every layer's experts are on the host
    holds as many of each layer's first experts as fit at their stored size (the share kernel
    reads them so: ``estimate.host.NATIVE_SHARE_FORMATS``), more than would fit in bf16; priced by
    the stored bytes of the share's picked experts, read once, the share beats the
    layer-at-a-time placement, and the plan says how it is held."""
    import sys

    from helpers import REPO
    from selective_offload.estimate.host import share_held_bytes
    from selective_offload.planner import PlanInputs, make_plan
    from selective_offload.sizes import GiB

    sys.path.insert(0, str(REPO))
    from benchmarks.planning import moe_plans as moe_reference_plans

    label, gib, _, ckpt = next(moe_reference_plans.case_checkpoints(tmp_path))
    assert label.startswith("gpt-oss-20b") and gib == 8
    plan = make_plan(ckpt, PlanInputs(device_memory_bytes=gib * GiB, head_share=False))  # the head's: test_head_share.py
    whole = make_plan(ckpt, PlanInputs(device_memory_bytes=gib * GiB, device_share=False))
    experts = [g for g in plan.groups if g.kind == "experts"]
    assert plan.host_compute_format == "mxfp4" and all(g.serving == "compute" for g in experts)
    m = min(g.device_experts for g in experts)
    more = sum(1 for g in experts if g.device_experts == m + 1)  # the first layers: one more each
    assert m and [g.device_experts for g in experts] == [m + 1] * more + [m] * (len(experts) - more)
    stored = sum(g.bytes // g.num_experts for g in experts)  # one expert of every layer, as stored
    assert plan.device_share_bytes == sum(g.bytes * g.device_experts // g.num_experts for g in experts)
    room = plan.weight_budget_bytes - plan.est_transient_device_bytes - plan.device_bytes - plan.est_vllm_workspace_bytes
    assert m * stored <= room < (m + 1) * stored
    # what is left is less than one more expert of the next layer
    assert room - plan.device_share_bytes < experts[more].bytes // experts[more].num_experts
    wide = sum(share_held_bytes(g.dtype_bytes) // g.num_experts for g in experts)  # the same in bf16
    assert room // wide < m
    assert plan.est.est_step_s < whole.est.est_step_s
    assert any("held as stored (mxfp4, read in place)" in n for n in plan.notes)


def test_a_share_held_wide_is_sized_so_and_declined_when_its_path_moves_more(tmp_path, monkeypatch):
    """The same gpt-oss-20b plan with no format read as stored (``NATIVE_SHARE_FORMATS``
    emptied: how block FP8 and int4 shares are held): the room holds as many of each layer's
    first experts as fit in bf16, not as many as fit as stored; priced by the bytes its torch
    path moves, the share loses to the layer-at-a-time placement, and the plan says so with
    both rates."""
    import sys

    from helpers import REPO
    from selective_offload.estimate import host as estimate_host
    from selective_offload.estimate.host import share_held_bytes
    from selective_offload.planner import PlanInputs, make_plan
    from selective_offload.sizes import GiB

    sys.path.insert(0, str(REPO))
    from benchmarks.planning import moe_plans as moe_reference_plans

    monkeypatch.setattr(estimate_host, "NATIVE_SHARE_FORMATS", frozenset())
    label, gib, _, ckpt = next(moe_reference_plans.case_checkpoints(tmp_path))
    plan = make_plan(ckpt, PlanInputs(device_memory_bytes=gib * GiB))
    assert not plan.device_share_bytes
    note = next(n for n in plan.notes if n.startswith("host-compute: no device share"))
    assert "GB held in bf16, priced" in note
    m = int(note.split("its first ", 1)[1].split(" of ", 1)[0])
    experts = [g for g in plan.groups if g.kind == "experts"]
    # every layer's experts on the host: the device keeps the rest of the plan's resident bytes
    room = (plan.weight_budget_bytes - plan.est_transient_device_bytes - plan.est_vllm_workspace_bytes
            - (plan.device_bytes - sum(g.bytes for g in experts if g.serving == "resident")))
    held = sum(share_held_bytes(g.dtype_bytes) // g.num_experts for g in experts)  # one expert of every layer, bf16
    layers = int(note.split("in each of the ", 1)[1].split(" layers", 1)[0])
    if layers < len(experts):  # m of every layer does not fit: m more in as many layers as it holds
        one = held // len(experts)
        assert layers * one <= room - (m - 1) * held < (layers + 1) * one
    else:
        assert m * held <= room < (m + 1) * held
    assert sum(g.bytes // g.num_experts for g in experts) * (m + 1) <= room  # stored bytes would fit more
    rates = note.split("priced at ", 1)[1]
    assert float(rates.split(" tok/s", 1)[0]) < float(rates.split("against ", 1)[1].split(" ", 1)[0]) \
        == round(plan.est.est_tok_s, 2)


# ---- device shares from a routing profile (plan --routing)

def skewed_profile(layers=4, busy=(6, 2, 7)):
    """Counts a router skewed to ``busy`` would leave: the busy experts picked 40, 30 and 20
    times a layer (in that order), every other one 2 times."""
    from selective_offload.routing import RoutingProfile

    counts = {i: tuple({busy[0]: 40, busy[1]: 30, busy[2]: 20}.get(e, 2) for e in range(E)) for i in range(layers)}
    return RoutingProfile(counts, model="tiny", vllm_version="0.32.0", tokens=55 * layers, workload="four prompts",
                          experts_per_token={i: K for i in range(layers)})


def test_a_routing_profile_puts_each_layers_busiest_experts_on_the_device_and_prices_their_hit_rate():
    from selective_offload.planner.shares import by_routing

    ckpt = moe(4)
    uniform = shared(ckpt, 300)
    assert any("priced as uniform routing (no routing profile" in n for n in by_routing(uniform, None).notes)
    plan = by_routing(uniform, skewed_profile())
    host = computed(plan)
    assert [g.device_expert_ids for g in host] == [(6, 2, 7)] * 4 and all(g.device_experts == 3 for g in host)
    hit = 90 / (90 + 5 * 2)
    assert all(g.est_device_hit_rate == pytest.approx(hit) for g in host)
    # the CPU reads the picks the share does not take: 1 - the measured hit rate, not 1 - 3/8
    per_layer = EXPERTS_BYTES * K / E * (1 - hit) / (REFERENCE_CPU_GBPS * 1e9) + ASSUMED_HANDOFF_S
    assert plan.est.est_cpu_s_per_step == pytest.approx(4 * per_layer, rel=1e-9)
    assert plan.est.est_tok_s > uniform.est.est_tok_s
    assert plan.device_share_bytes == uniform.device_share_bytes  # the same room, other experts
    note = next(n for n in plan.notes if n.startswith("device shares: each layer's busiest experts"))
    assert "220 tokens routed (four prompts) on tiny, vLLM 0.32.0" in note and "est hit rate 90.0%" in note
    assert any("keeps its busiest 3 of 8 routed experts" in n for n in plan.notes)
    again = Plan.from_dict(json.loads(plan.to_json()))  # plan format v5: the optional fields round-trip
    assert [g.device_expert_ids for g in computed(again)] == [(6, 2, 7)] * 4
    assert again.est.est_tok_s == pytest.approx(plan.est.est_tok_s)
    refused_edit(plan, lambda d: d["groups"][next(i for i, g in enumerate(d["groups"]) if g.get("device_experts"))]
                 .update(device_expert_ids=[6, 6, 7]), "device_expert_ids .* distinct experts")
    assert not any("counted no picks" in n for n in plan.notes)
    # a layer the counters never saw (all zero) keeps its first experts and says so
    from dataclasses import replace as replaced

    profile = skewed_profile()
    silent = by_routing(uniform, replaced(profile, layers={**profile.layers, 2: (0,) * E}))
    assert computed(silent)[2].device_expert_ids == (0, 1, 2) and computed(silent)[2].est_device_hit_rate == 3 / E
    assert any(n.startswith("routing profile: layers 2 counted no picks") for n in silent.notes)


@pytest.mark.parametrize("edit, match", [
    (lambda c: c.pop(3), "no counts for MoE layer 3 of this model"),
    (lambda c: c.update({9: (1,) * E}), "layer 9 is no MoE layer of this model"),
    (lambda c: c.update({0: (1,) * (E + 1)}), "layer 0 counts 9 experts, and this model's layer 0 has 8"),
])
def test_a_routing_profile_of_another_model_is_refused_in_one_line(edit, match):
    from dataclasses import replace

    from selective_offload.errors import PlanError
    from selective_offload.planner.shares import by_routing

    profile = skewed_profile()
    layers = dict(profile.layers)
    edit(layers)
    with pytest.raises(PlanError, match=match) as info:
        by_routing(shared(moe(4), 300), replace(profile, layers=layers))
    assert "\n" not in str(info.value)
