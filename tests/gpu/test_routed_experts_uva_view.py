"""Routed experts of one MoE layer (Qwen3-30B-A3B's shape: 128 experts top-8) in host memory,
the glue's way: pageable, page-locked in place by ``PageLockedLedger``, the parameter
swapped for a UVA device view and marked as vLLM marks its own (``experts.mark_uva_view``):
making the view allocates no device memory, the parameter object stays the same, and
reading experts through it inside a kernel returns exactly what reads from a device copy
return. Without CUDA the view step is skipped (host memory is the device's there). The
fixture also times k-of-E reads through the view against copying the whole layer first
(``benchmarks.common.routed_expert_reads``, the results' "Routed experts" table)."""

from __future__ import annotations

import gc
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from benchmarks.common import EXPERT_SHAPES, routed_expert_reads
from mechanism import bitwise_equal, needs_cuda, records
from selective_offload.vllm_glue.experts import UVA_MARKER, mark_uva_view
from selective_offload.wrappers import cuda_view_of_pinned
from selective_offload.wrappers.page_locked import PageLockedLedger, PinPolicy

LOCKED = "routed experts page-locked in place at their exact size"
VIEW = "the expert parameter becomes a marked UVA view, allocating no device memory"
READS = "k experts read through the view equal reads from a device copy"


@pytest.fixture(scope="module")
def routed_experts(cfg, cuda, device, results):
    """Routed experts the glue's way (page-locked in place, a marked UVA view on the same
    Parameter), then k-of-E reads timed against a whole-layer copy."""
    shape = EXPERT_SHAPES["qwen3-30b-a3b"]
    num, k = shape["num_experts"], shape["experts_per_token"]
    hidden = 1024
    rows = max(1, int(shape["expert_bytes"] * cfg["expert_scale"]) // (2 * hidden))
    out: dict = {"shape": "qwen3-30b-a3b", "num_experts": num, "experts_per_token": k,
                 "expert_bytes": rows * hidden * 2}
    seen = SimpleNamespace()
    if cuda:
        host = torch.empty(num, rows, hidden, dtype=torch.bfloat16)  # pageable, exact size, as routing builds
        host.normal_()
        param = nn.Parameter(host, requires_grad=False)
        ledger = PageLockedLedger(PinPolicy.decide(cuda=True))
        locked = ledger.lock(param.data, "experts")
        before = torch.cuda.memory_allocated(device)
        mark_uva_view(param, lambda t: cuda_view_of_pinned(t.view(-1), device).view(t.shape))
        grew = torch.cuda.memory_allocated(device) - before
        resident = host.to(device)
        x = torch.randn(hidden, dtype=torch.bfloat16, device=device)
        ids = torch.randperm(num)[:k].tolist()
        same = all(bitwise_equal(torch.mv(param[e], x), torch.mv(resident[e], x)) for e in ids)
        seen.locked = (locked and ledger.locked_bytes == host.numel() * host.element_size(), f"{ledger.locked_bytes} B")
        seen.view = (param.is_cuda and getattr(param, UVA_MARKER, False) and grew == 0, f"grew {grew} B")
        seen.reads = (same, f"experts {ids}")
        out.update(locked_bytes=ledger.locked_bytes, device_growth_bytes=grew, reads_equal=same)
        del resident
        param.data = host  # drop the view before unlocking
        ledger.unlock(host.untyped_storage().data_ptr())
        del param, host
        gc.collect()
    reads = routed_expert_reads(num, k, rows * hidden * 2, cuda, tokens=(1, 4, 16), iters=cfg["iters"],
                                hidden=hidden, device=device)
    seen.timed_equal = all(r["uva_equals_resident"] for r in reads["rows"])
    out["reads"] = reads
    results["routed_experts"] = out
    return seen


@records(LOCKED)
@needs_cuda("cudaHostRegister is CUDA's")
def test_routed_experts_are_page_locked_in_place_at_their_exact_size(routed_experts, checks):
    checks.check(LOCKED, *routed_experts.locked)


@records(VIEW)
@needs_cuda("a UVA view maps pinned host memory into the device's address space")
def test_the_expert_parameter_becomes_a_marked_uva_view_allocating_no_device_memory(routed_experts, checks):
    checks.check(VIEW, *routed_experts.view)


@records(READS)
@needs_cuda("a UVA view maps pinned host memory into the device's address space")
def test_experts_read_through_the_view_equal_reads_from_a_device_copy(routed_experts, checks):
    checks.check(READS, *routed_experts.reads)


def test_timed_expert_reads_through_the_view_equal_device_resident_reads(routed_experts, checks):
    checks.check("routed-expert reads through the view equal device-resident reads (timed section)",
                 routed_experts.timed_equal)
