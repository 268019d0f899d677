"""Host memory page-locked the project's way (pageable ``torch.empty`` registered in place by
``PageLockedLedger(PinPolicy.decide(cuda=True))``, ``cudaHostRegister``) is exactly the
planned bytes (ratio 1.0) for the reference embedding and for the reference decoder layer
split into its 19 weights, reads as pinned, takes nothing from torch's pinned allocator,
serves an async host-to-device copy (queued behind a GPU spin, the call returns without
waiting for it) that reads back bit-exact, and is unregistered at unlock; torch's
``pin_memory=True`` blocks for the same tensors are measured beside it (their ratio is
reported, asserted only to be at least 1). Without CUDA the pin policy is checked to be
pageable, and the ledger's bookkeeping runs with a recording registrar in place of the
driver (every storage registered once, in place, at its exact size)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from page_locking import (
    RecordingRegistrar,
    exact_way,
    host_tensor_sets,
    pinned_way,
    pow2,
    recorded_registration,
    spec_bytes,
)

from mechanism import clear_pending_cuda_error, host_empty_cache, needs_cuda, records
from selective_offload.wrappers.page_locked import PageLockedLedger, PinPath, PinPolicy

SETS = ("embedding", "decoder layer")
STOPPED = "skipped: the section stopped at the error above"
NO_STATS = "skipped: this torch has no host_memory_stats or _host_emptyCache"


def exact_bytes(s: str) -> str:
    return f"exact registration: page-locked bytes == planned bytes ({s})"


def reads_pinned(s: str) -> str:
    return f"registered {s} memory reads as pinned and takes nothing from torch's allocator"


def registered_bit_exact(s: str) -> str:
    return f"async H2D copy from registered memory reads back bit-exact ({s})"


def returns_early(s: str) -> str:
    return f"H2D copy from registered memory returns before it completes ({s})"


def unlock_empties(s: str) -> str:
    return f"unlocking unregisters and empties the ledger ({s})"


def torch_bit_exact(s: str) -> str:
    return f"async H2D copy from torch pinned memory reads back bit-exact ({s})"


def torch_at_least(s: str) -> str:
    return f"torch pinned blocks: page-locked bytes >= planned bytes ({s})"


def torch_returns(s: str) -> str:
    return f"freeing returns torch's pinned blocks once its cache is emptied ({s})"


@pytest.fixture(scope="module")
def host_memory(cfg, cuda, device, results):
    """Page-locked bytes over planned host bytes: torch's rounded pinned blocks against
    exact registration, for the reference embedding and a reference decoder layer."""
    sets = host_tensor_sets(cfg)
    stand_in = RecordingRegistrar()
    pageable = PageLockedLedger(PinPolicy.decide(cuda=False), stand_in)
    probe = torch.empty(1000, 77, dtype=torch.bfloat16)
    seen = SimpleNamespace(
        pageable=(pageable.policy.path == PinPath.PAGEABLE and not pageable.lock(probe, "probe")
                  and pageable.locked_bytes == 0 and not stand_in.registered),
        pageable_detail=f"path {pageable.policy.path}: {pageable.policy.reason}", stats_ok=False, sets=[])
    stats_ok = False
    if cuda:
        torch.empty(1, device=device)
        probe = torch.empty(1, pin_memory=True)  # the allocator's first call outside the timings
        stats = getattr(torch.cuda, "host_memory_stats", None)
        stats_ok = (stats is not None and "allocated_bytes.current" in stats()
                    and hasattr(torch._C, "_host_emptyCache"))
        del probe
        host_empty_cache()
    seen.stats_ok = stats_ok
    out = {"repeats": cfg["host_repeats"], "shrink": cfg["host_shrink"],
           "pytorch_alloc_conf": os.environ.get("PYTORCH_ALLOC_CONF", os.environ.get("PYTORCH_CUDA_ALLOC_CONF")),
           "torch_host_stats": stats_ok if cuda else None, "sets": []}
    for s, (set_name, specs) in enumerate(sets):
        sizes = [spec_bytes(spec) for spec in specs]
        planned = sum(sizes)
        est_rounded = sum(pow2(n) for n in sizes)
        row = {"set": set_name, "tensors": len(specs), "planned_bytes": planned,
               "power_of_two_tensors": sum(n == pow2(n) for n in sizes),
               "est_rounded_bytes": est_rounded, "est_ratio_rounding": est_rounded / planned,
               "shapes": [[name, shape, str(dtype).replace("torch.", "")] for name, shape, dtype in specs]}
        print(f"host memory, {set_name}: {len(specs)} tensors, {planned / 1e9:.4f} GB planned")
        row["recorded"] = recorded_registration(specs, planned)
        rounding, exact, crashed = [], [], None
        if cuda:
            for r in range(cfg["host_repeats"]):  # alternating order: neither way always first
                ways = (("a", pinned_way), ("b", exact_way)) if r % 2 == 0 else (("b", exact_way), ("a", pinned_way))
                for key, way in ways:
                    try:
                        result = way(specs, planned, device, seed=100 * s + r)
                    except Exception as err:  # noqa: BLE001 -- a failed check; the other sections ran
                        crashed = f"({key}) {type(err).__name__}: {str(err)[:400]}"
                        clear_pending_cuda_error(device)
                        break
                    result["order"] = "first" if (key, way) == ways[0] else "second"
                    (rounding if key == "a" else exact).append(result)
                    print(f"  ({key}) {'torch pinned' if key == 'a' else 'registered'}: "
                          f"{ {k: v for k, v in result.items() if k not in ('by_how', 'errors')} }")
                if crashed:
                    break
            row["rounding"], row["exact"], row["error"] = rounding, exact, crashed
            if crashed:
                row["ratio_exact"] = row["ratio_rounding"] = None
            else:
                row["ratio_exact"] = exact[0]["ratio"]
                row["ratio_rounding"] = rounding[0]["ratio"] if stats_ok else None
        else:
            row["rounding"] = row["exact"] = None
            row["ratio_exact"] = row["ratio_rounding"] = None
        seen.sets.append(SimpleNamespace(name=set_name, planned=planned, row=row, crashed=crashed,
                                         exact=exact, rounding=rounding))
        out["sets"].append(row)
    planned = sum(r["planned_bytes"] for r in out["sets"])
    overall = {"planned_bytes": planned,
               "est_ratio_rounding": sum(r["est_rounded_bytes"] for r in out["sets"]) / planned,
               "ratio_exact": None, "ratio_rounding": None}
    if cuda and all(r["exact"] for r in out["sets"]):
        overall["ratio_exact"] = sum(r["exact"][0]["page_locked_bytes"] for r in out["sets"]) / planned
    if cuda and stats_ok and all(r["rounding"] for r in out["sets"]):
        overall["ratio_rounding"] = sum(r["rounding"][0]["page_locked_bytes"] for r in out["sets"]) / planned
    out["overall"] = overall
    print({"host_memory_overall": overall})
    results["host_memory"] = out
    return seen


def ran(host_memory, checks, name):
    """The sets whose two ways both ran; for the others, ``name``'s check is skipped."""
    for s in host_memory.sets:
        if s.crashed:
            checks.skip(name(s.name), STOPPED)
        else:
            yield s


def test_without_cuda_the_pin_policy_is_pageable_and_the_ledger_locks_nothing(host_memory, checks):
    checks.check("without CUDA the pin policy is pageable and the ledger locks nothing",
                 host_memory.pageable, host_memory.pageable_detail)


def test_the_ledger_registers_every_tensor_at_its_exact_size_in_place(host_memory, checks):
    for s in host_memory.sets:
        rec = s.row["recorded"]
        checks.check(f"ledger registers every {s.name} tensor at its exact size, in place "
                     "(recording registrar)", rec["exact_and_in_place"] and rec["ratio"] == 1.0,
                     f"{rec['page_locked_bytes']} of {s.planned} B")


def test_unlocking_unregisters_every_storage(host_memory, checks):
    for s in host_memory.sets:
        checks.check(f"unlocking unregisters every {s.name} storage (recording registrar)",
                     s.row["recorded"]["unlocked_all"])


@needs_cuda("page-locking is CUDA's")
def test_both_ways_of_page_locking_run_without_error(host_memory, checks):
    for s in host_memory.sets:
        if s.crashed:
            checks.check(f"both ways ran without error ({s.name})", False, s.crashed)


@records(*(exact_bytes(s) for s in SETS))
@needs_cuda("cudaHostRegister is CUDA's")
def test_exact_registration_page_locks_exactly_the_planned_bytes(host_memory, checks):
    for s in ran(host_memory, checks, exact_bytes):
        errors = sorted({e for x in s.exact for e in x["errors"]})
        checks.check(exact_bytes(s.name),
                     not errors and all(x["page_locked_bytes"] == s.planned and x["tensors_moved"] == 0
                                        and x["by_how"] == {"registered": s.planned} for x in s.exact),
                     f"ratio {s.row['ratio_exact']:.6f}" + (f"; failed: {'; '.join(errors)[:600]}" if errors else ""))


@records(*(reads_pinned(s) for s in SETS))
@needs_cuda("cudaHostRegister is CUDA's")
def test_registered_memory_reads_as_pinned_and_takes_nothing_from_torchs_allocator(host_memory, checks):
    for s in ran(host_memory, checks, reads_pinned):
        checks.check(reads_pinned(s.name),
                     all(x["all_read_as_pinned"] and x["torch_allocator_growth_bytes"] in (0, None)
                         for x in s.exact),
                     f"torch allocator growth {[x['torch_allocator_growth_bytes'] for x in s.exact]} B")


@records(*(registered_bit_exact(s) for s in SETS))
@needs_cuda("a host-to-device copy needs a device")
def test_an_async_copy_from_registered_memory_reads_back_bit_exact(host_memory, checks):
    for s in ran(host_memory, checks, registered_bit_exact):
        checks.check(registered_bit_exact(s.name), all(x["bit_exact"] for x in s.exact),
                     f"{min(x['h2d_gb_per_s'] for x in s.exact):.1f} GB/s or more")


@records(*(returns_early(s) for s in SETS))
@needs_cuda("a host-to-device copy needs a device")
def test_a_copy_from_registered_memory_returns_before_it_completes(host_memory, checks):
    for s in ran(host_memory, checks, returns_early):
        checks.check(returns_early(s.name),
                     all(x["largest_enqueue_us"] < 0.5 * x["async_reference_us"] for x in s.exact),
                     "; ".join(f"returned in {x['largest_enqueue_us']:.0f} us, {x['async_reference']} "
                               f"{x['async_reference_us']:.0f} us" for x in s.exact))


@records(*(unlock_empties(s) for s in SETS))
@needs_cuda("cudaHostRegister is CUDA's")
def test_unlocking_unregisters_and_empties_the_ledger(host_memory, checks):
    for s in ran(host_memory, checks, unlock_empties):
        checks.check(unlock_empties(s.name),
                     all(x["unlock_unpins"] and x["ledger_empty_after_unlock"] for x in s.exact))


@records(*(torch_bit_exact(s) for s in SETS))
@needs_cuda("a host-to-device copy needs a device")
def test_an_async_copy_from_torch_pinned_memory_reads_back_bit_exact(host_memory, checks):
    for s in ran(host_memory, checks, torch_bit_exact):
        checks.check(torch_bit_exact(s.name), all(x["bit_exact"] for x in s.rounding))


@records(*(torch_at_least(s) for s in SETS))
@needs_cuda("torch's pinned host allocator is CUDA's")
def test_torch_pinned_blocks_lock_at_least_the_planned_bytes(host_memory, checks):
    for s in ran(host_memory, checks, torch_at_least):
        if not host_memory.stats_ok:
            checks.skip(torch_at_least(s.name), NO_STATS)
            continue
        checks.check(torch_at_least(s.name), all(x["ratio"] >= 1.0 for x in s.rounding),
                     f"ratio {s.row['ratio_rounding']:.4f} (est from powers of two "
                     f"{s.row['est_ratio_rounding']:.4f})")


@records(*(torch_returns(s) for s in SETS))
@needs_cuda("torch's pinned host allocator is CUDA's")
def test_freeing_returns_torchs_pinned_blocks_once_its_cache_is_emptied(host_memory, checks):
    for s in ran(host_memory, checks, torch_returns):
        if not host_memory.stats_ok:
            checks.skip(torch_returns(s.name), NO_STATS)
            continue
        checks.check(torch_returns(s.name), all(x["allocator_back_to_start"] for x in s.rounding))
