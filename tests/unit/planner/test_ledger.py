"""The plan's ledger: every allocation the plan makes is a named line (device, page-locked,
pageable), the worker's host-compute buffers among them, and the totals the checks use
(shortfall_bytes, host_bytes, host_shortfall_bytes) are those lines. Each figure is
recomputed by hand from the inputs the test chooses (test_host_compute.py's checkpoint:
8 experts of 10 MB a layer, 2 per token, bf16), with the config's sizes H and I."""

from __future__ import annotations

import json
from dataclasses import replace

from test_host_compute import EXPERTS_BYTES, E, K, computed, moe, plan_of, refused_edit

from builders import MB
from selective_offload.plan_format import Plan
from selective_offload.planner import make_plan
from selective_offload.worker_buffers import align, moe_workspace_bytes

H, I = 1000, 1500


def host_plan(**kw):
    ckpt = moe(4, hidden_size=H, moe_intermediate_size=I)
    return plan_of(ckpt, ckpt.total_bytes / MB - 300, **kw)


def test_the_workers_buffers_are_lines_of_the_ledger_and_in_the_host_totals():
    plan = host_plan()
    assert computed(plan) and all(g.kernel_dims == (H, I) for g in computed(plan))
    assert all(not g.kernel_dims for g in plan.groups if g.serving != "compute")
    T = plan.host_compute.crossover_tokens
    assert T > 0
    staging = align(T * H * 4) + 2 * align(T * K * 4) + align(T * H * 4)  # x, ids, weights, sums
    workspace = moe_workspace_bytes(T, K, E, H, I)
    assert (plan.host_compute_staging_bytes, plan.host_compute_workspace_bytes) == (staging, workspace)
    lines = {(line.name, line.where): line.bytes for line in plan.ledger()}
    assert lines[("host-compute staging", "page-locked")] == staging
    assert lines[("host-compute workspace", "pageable")] == workspace
    assert lines[("host weights", "page-locked")] == plan.host_weight_bytes
    assert plan.host_page_locked_bytes == plan.host_weight_bytes + staging
    assert plan.host_pageable_bytes == workspace
    assert plan.host_bytes == plan.host_weight_bytes + staging + workspace
    # a step above the crossover copies a whole layer's experts at most (bf16: multiplied as
    # they are) and holds the activations of vLLM's largest step (2048 tokens): the float32
    # sums [T, H] and, with two picks a token, two experts' float32 products (20 n I + 6 n H)
    # for the n = T k / E = 512 tokens each (uniform routing); the one transient line is the
    # plan's, held to the weight budget with the rest
    activations = 4 * 2048 * H + 512 * (20 * I + 6 * H)
    assert plan.est_transient_device_bytes == EXPERTS_BYTES + activations == lines[("est transient", "device")]
    device = sum(b for (name, where), b in lines.items() if where == "device")
    assert plan.shortfall_bytes == max(0, device - plan.weight_budget_bytes)


def test_the_host_check_holds_the_buffers_to_the_hosts_memory():
    plan = host_plan()
    need = plan.host_weight_bytes + plan.host_compute_staging_bytes + plan.host_compute_workspace_bytes
    headroom = plan.inputs.host_headroom_bytes  # kept for the system and vLLM beside the plan's bytes
    exact = host_plan(host_memory_bytes=need + headroom)
    assert exact.strategy == "hot_offload" and exact.host_shortfall_bytes == 0
    short = host_plan(host_memory_bytes=need + headroom - 1)
    assert short.host_shortfall_bytes == 1 and short.strategy == "infeasible"


def test_two_ranks_each_make_their_own_buffers_for_their_shard():
    one, two = host_plan(), host_plan(ranks=2)
    T = two.host_compute.crossover_tokens
    assert two.host_compute_workspace_bytes == 2 * moe_workspace_bytes(T, K, E, H, I // 2)
    assert two.host_compute_staging_bytes == 2 * (align(T * H * 4) * 2 + 2 * align(T * K * 4))
    assert one.host_compute_workspace_bytes == moe_workspace_bytes(one.host_compute.crossover_tokens, K, E, H, I)


def test_the_ledger_round_trips_and_an_edited_line_or_misplaced_sizes_are_refused_in_one_line():
    plan = host_plan()
    data = json.loads(plan.to_json())
    assert data["totals"]["ledger"] == [{"name": line.name, "where": line.where, "bytes": line.bytes} for line in plan.ledger()]
    back = Plan.from_dict(data)
    assert back.ledger() == plan.ledger() and back.groups == plan.groups
    staging = next(i for i, line in enumerate(data["totals"]["ledger"]) if line["name"] == "host-compute staging")
    refused_edit(plan, lambda d: d["totals"]["ledger"][staging].update(bytes=0), "totals.ledger")
    del data["totals"]["ledger"]
    assert Plan.from_dict(data).ledger() == plan.ledger()  # derived: may be left out
    attn = next(i for i, g in enumerate(data["groups"]) if g["serving"] == "resident")
    refused_edit(plan, lambda d: d["groups"][attn].update(kernel_dims=[H, I]), "kernel_dims")
    first = next(i for i, g in enumerate(data["groups"]) if g["serving"] == "compute")
    refused_edit(plan, lambda d: d["groups"][first].update(kernel_dims=[H]), "kernel_dims")


def test_a_plan_without_sizes_prices_no_buffers():
    """A plan whose groups do not say H and I (older files, a config without them) prices
    no staging or workspace."""
    plan = host_plan()
    data = json.loads(plan.to_json())
    for g in data["groups"]:
        g.pop("kernel_dims", None)
    del data["totals"]
    data["est_transient_device_bytes"] = EXPERTS_BYTES  # nor the copied step's activations
    old = Plan.from_dict(data)
    assert old.host_compute_staging_bytes == old.host_compute_workspace_bytes == 0
    assert old.host_bytes == old.host_weight_bytes


def test_vllms_fused_moe_workspace_is_a_device_line_the_placement_leaves_room_for():
    """vLLM's workspace manager holds one fused-MoE workspace per process (TritonExperts for
    these bf16 experts on SM 8.9), sized for a step of 2048 tokens (est): workspace13
    (T*k x max(I, H)) sharing its storage with the output (T x H) and workspace2
    (T*k x max(2I, H)), bf16, each rounded up to 256 bytes. By hand here; held to vLLM's own
    allocation in tests/contract/check_kernel_table.py."""
    plan = host_plan()
    T = 2048
    workspace = -(-T * K * max(I, H) * 2 // 256) * 256 + -(-T * K * max(2 * I, H) * 2 // 256) * 256
    assert plan.est_vllm_workspace_bytes == workspace
    lines = {(line.name, line.where): line.bytes for line in plan.ledger()}
    assert lines[("est vLLM fused-MoE workspace", "device")] == workspace
    assert any("fused-MoE workspace, one per process for TritonExperts" in n for n in plan.notes)
    # the placement left room for it: the device lines fit the budget, to within less than the
    # step the placement moves by (a layer's routed experts)
    assert plan.shortfall_bytes == 0 and plan.device_ledger_bytes <= plan.weight_budget_bytes
    assert plan.weight_budget_bytes - plan.device_ledger_bytes < EXPERTS_BYTES
    back = Plan.from_dict(json.loads(plan.to_json()))
    assert back.est_vllm_workspace_bytes == workspace and back.ledger() == plan.ledger()
    # one byte less than this plan's device lines: the placement moves more to the host
    # rather than count on the workspace's room
    left = plan.weight_budget_bytes - plan.device_ledger_bytes
    tight = make_plan(moe(4, hidden_size=H, moe_intermediate_size=I), replace(
        plan.inputs, device_memory_bytes=plan.inputs.card_bytes - left - 1, usable_device_bytes=None,
        usable_from=None))
    assert tight.est_vllm_workspace_bytes == workspace and tight.shortfall_bytes == 0
    assert tight.device_bytes + tight.est_transient_device_bytes + workspace <= tight.weight_budget_bytes


def test_the_workspace_is_priced_for_the_engines_step_and_the_serve_command_passes_it():
    """vLLM sizes its fused-MoE workspace for ``max_num_batched_tokens`` (8192 for the LLM
    class and on a card of 70 GiB or more): a plan told the engine's step prices it there
    and records it; the serve command and ``enable()``'s settings pass the step priced."""
    from selective_offload.planner.serving import engine_settings, serve_flags

    plan = host_plan()
    T = 8192
    larger = make_plan(moe(4, hidden_size=H, moe_intermediate_size=I),
                       replace(plan.inputs, max_num_batched_tokens=T))
    workspace = -(-T * K * max(I, H) * 2 // 256) * 256 + -(-T * K * max(2 * I, H) * 2 // 256) * 256
    assert larger.est_vllm_workspace_bytes == workspace > plan.est_vllm_workspace_bytes
    assert Plan.from_dict(json.loads(larger.to_json())).inputs.batched_tokens == T
    flags = serve_flags(larger)
    assert flags[flags.index("--max-num-batched-tokens") + 1] == str(T)
    assert engine_settings(plan)["max_num_batched_tokens"] == 2048  # the step it assumed, told to vLLM
