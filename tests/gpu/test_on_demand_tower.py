"""An on-demand tower gives the resident tower's output, its transient device memory is
about two blocks plus the non-block part (ledger and allocator agree), and offloading a
device-built tower frees its device memory; at several depths. The fixture also times the
resident and the on-demand forward (the results' "Tower onload vs size" table)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from stand_ins import Tower

from benchmarks.common import median_us
from mechanism import needs_cuda, records, sync
from selective_offload.wrappers import offload_on_demand


def frees(depth: int) -> str:
    return f"offloading frees the tower's device memory (depth {depth})"


def within_ledger(depth: int) -> str:
    return f"measured device peak within ledger + activations (depth {depth})"


@pytest.fixture(scope="module")
def towers(cfg, cuda, device, results):
    """Each depth built resident and again offloaded on demand, compared, measured and
    timed; each depth's towers are freed before the next is built."""
    hidden, dtype, rows, seen = cfg["tower_hidden"], torch.bfloat16, [], []
    for depth in cfg["tower_depths"]:
        torch.manual_seed(depth)
        resident = Tower(hidden, depth).to(device=device, dtype=dtype).eval()
        tower_bytes = sum(p.numel() * p.element_size() for p in resident.parameters())
        block_bytes = sum(p.numel() * p.element_size() for p in resident.blocks[0].parameters())
        rest_bytes = tower_bytes - depth * block_bytes
        x = torch.randn(1, cfg["tower_tokens"], hidden, device=device, dtype=dtype)
        with torch.no_grad():
            expected = resident(x)
            sync(cuda)
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated() if cuda else 0
            resident(x)
            sync(cuda)
            resident_activation_peak = (torch.cuda.max_memory_allocated() - base) if cuda else None
            resident_us = median_us(lambda: resident(x), cfg["iters"], cuda)

            offloaded = Tower(hidden, depth).to(device=device, dtype=dtype).eval()
            offloaded.load_state_dict(resident.state_dict())
            sync(cuda)
            before_offload = torch.cuda.memory_allocated() if cuda else 0
            handle = offload_on_demand(offloaded, device)
            sync(cuda)
            freed = (before_offload - torch.cuda.memory_allocated()) if cuda else None

            out = offloaded(x)
            equal = torch.equal(out, expected)
            ledger_peak = handle.stats.peak_transient_device_bytes
            del out
            sync(cuda)
            measured_peak = allowed = None
            if cuda:
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                offloaded(x)
                sync(cuda)
                measured_peak = torch.cuda.max_memory_allocated() - base
                allowed = 1.05 * (ledger_peak + resident_activation_peak) + (2 << 20)
            offloaded_us = median_us(lambda: offloaded(x), cfg["iters"], cuda)
        seen.append(SimpleNamespace(depth=depth, equal=equal, ledger_peak=ledger_peak,
                                    planned_peak=rest_bytes + 2 * block_bytes, freed=freed,
                                    tower_bytes=tower_bytes, measured_peak=measured_peak, allowed=allowed))
        row = {
            "depth": depth,
            "tower_bytes": tower_bytes,
            "block_bytes": block_bytes,
            "resident_forward_us": resident_us,
            "on_demand_forward_us": offloaded_us,
            "onload_overhead_us": offloaded_us - resident_us,
            "bytes_moved_per_call": handle.stats.bytes_moved_last_call,
            # Bytes over the added time; None when prefetch hid the copies entirely.
            "effective_onload_gb_per_s": (
                handle.stats.bytes_moved_last_call / (offloaded_us - resident_us) / 1e3
                if offloaded_us > resident_us else None
            ),
            "peak_transient_device_bytes_ledger": ledger_peak,
            "peak_device_bytes_measured": measured_peak,
        }
        rows.append(row)
        print(row)
        handle.detach()
        resident = offloaded = None  # free this depth's towers before building the next
    results["tower"] = rows
    return seen


def test_the_on_demand_tower_gives_the_resident_towers_output(towers, checks):
    for t in towers:
        checks.check(f"on-demand tower == resident tower (depth {t.depth})", t.equal)


def test_the_ledgers_peak_transient_is_the_non_block_part_plus_two_blocks(towers, checks):
    for t in towers:
        checks.check(f"ledger peak transient == non-block + 2 blocks (depth {t.depth})",
                     t.ledger_peak == t.planned_peak, f"{t.ledger_peak} vs {t.planned_peak} bytes")


@records(lambda cfg: [frees(d) for d in cfg["tower_depths"]])
@needs_cuda("device memory is counted by the CUDA allocator")
def test_offloading_frees_the_towers_device_memory(towers, checks):
    for t in towers:
        checks.check(frees(t.depth), t.freed >= t.tower_bytes, f"{t.freed} >= {t.tower_bytes} bytes")


@records(lambda cfg: [within_ledger(d) for d in cfg["tower_depths"]])
@needs_cuda("the device peak is the CUDA allocator's")
def test_the_measured_device_peak_is_within_the_ledger_plus_activations(towers, checks):
    for t in towers:
        checks.check(within_ledger(t.depth), t.measured_peak <= t.allowed,
                     f"{t.measured_peak} <= {int(t.allowed)} bytes")
