"""Page-locked host bytes against planned host bytes, two ways, for the reference embedding
and the reference decoder layer split into its weights (from the bundled manifest).

(a) torch's caching host allocator (``pin_memory=True``: each block rounded up to a power
of two, freed blocks cached), measured by its own count; (b) exact registration in place
through the project's ledger (``cudaHostRegister``), measured by the ledger; and the
ledger's bookkeeping with a recording registrar standing in for the driver (any machine).
Each way allocates, fills, copies to the device and reads back, and times it. Why a
module of its own: ``test_page_locked_host_memory.py`` asserts on what these return.
"""

from __future__ import annotations

import gc
import json
import statistics
import time
from pathlib import Path

import torch

from mechanism import bitwise_equal, clear_pending_cuda_error, host_allocator_bytes, host_empty_cache
from selective_offload.wrappers.page_locked import PageLockedLedger, PinPolicy, resident_set_bytes
from selective_offload.wrappers.residency import OffloadError

MANIFEST = Path(__file__).resolve().parents[2] / "selective_offload" / "data" / "qwen3.8-27b-fp8.manifest.json"
_MANIFEST_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32,
                    "F8_E4M3": getattr(torch, "float8_e4m3fn", torch.uint8), "U8": torch.uint8}


class RecordingRegistrar:
    """Stands in for ``cudaHostRegister`` without CUDA: receives the address and size the
    driver would, so which storages are registered, and at which size, is still checked."""

    def __init__(self) -> None:
        self.registered: dict[int, int] = {}
        self.unregistered: list[int] = []

    def register(self, ptr: int, nbytes: int) -> None:
        self.registered[ptr] = nbytes

    def unregister(self, ptr: int) -> None:
        self.unregistered.append(ptr)


def host_tensor_sets(cfg: dict) -> list[tuple[str, list[tuple[str, list[int], torch.dtype]]]]:
    """The reference embedding and the reference decoder layer's weights (layer 0 of the
    bundled manifest: 19 tensors, 0.38 GB, none a power of two in bytes but its norms),
    every dimension divided by ``host_shrink`` (1 at full size)."""
    tensors = json.loads(MANIFEST.read_text())["tensors"]
    div = cfg["host_shrink"]

    def spec(name: str, meta: dict) -> tuple[str, list[int], torch.dtype]:
        return name, [max(1, -(-d // div)) for d in meta["shape"]], _MANIFEST_DTYPES[meta["dtype"]]

    prefix = "model.layers.0."
    layer = [spec(n[len(prefix):], m) for n, m in tensors.items() if n.startswith(prefix)]
    return [("embedding", [spec("embed_tokens.weight", tensors["model.embed_tokens.weight"])]),
            ("decoder layer", layer)]


def spec_bytes(spec: tuple[str, list[int], torch.dtype]) -> int:
    n = 1
    for d in spec[1]:
        n *= d
    return n * torch.empty((), dtype=spec[2]).element_size()


def pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def fill_bytes(t: torch.Tensor, seed: int) -> None:
    """Random bytes in ``t``: a block of an odd length (1,000,003 bytes) tiled over it."""
    flat = t.view(-1).view(torch.uint8)
    gen = torch.Generator().manual_seed(seed)
    block = torch.randint(0, 256, (min(flat.numel(), 1_000_003),), dtype=torch.uint8, generator=gen)
    for start in range(0, flat.numel(), block.numel()):
        n = min(block.numel(), flat.numel() - start)
        flat[start:start + n].copy_(block[:n])


def h2d_check(tensors: list[torch.Tensor], device: torch.device) -> dict:
    """Copy every tensor to the device with ``non_blocking=True`` (one sync at the end),
    read each back and compare bit for bit; then time the largest copy's enqueue (the call
    returning) against its completion, 3 times, each queued behind a GPU spin of about 25 ms
    (``torch.cuda._sleep``) so that small copies tell too: a copy from page-locked memory
    is a DMA the call does not wait for, one from pageable memory waits for the stream."""
    dsts = [torch.empty(t.shape, dtype=t.dtype, device=device) for t in tensors]
    torch.cuda.synchronize()
    start = time.perf_counter()
    for src, dst in zip(tensors, dsts):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    copy_s = time.perf_counter() - start
    exact = all(bitwise_equal(dst.cpu(), src) for src, dst in zip(tensors, dsts))
    big = max(range(len(tensors)), key=lambda i: tensors[i].numel() * tensors[i].element_size())
    spin = getattr(torch.cuda, "_sleep", None)
    spin_s = None
    if spin is not None:
        torch.cuda.synchronize()
        start = time.perf_counter()
        spin(SPIN_CYCLES)
        torch.cuda.synchronize()
        spin_s = time.perf_counter() - start
    enqueue, done = [], []
    for _ in range(3):
        torch.cuda.synchronize()
        if spin is not None:
            spin(SPIN_CYCLES)
        start = time.perf_counter()
        dsts[big].copy_(tensors[big], non_blocking=True)
        returned = time.perf_counter()
        torch.cuda.synchronize()
        enqueue.append(returned - start)
        done.append(time.perf_counter() - start)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    del dsts
    return {"bit_exact": exact, "h2d_all_s": copy_s, "h2d_gb_per_s": nbytes / copy_s / 1e9,
            "largest_bytes": tensors[big].numel() * tensors[big].element_size(),
            "largest_enqueue_us": statistics.median(enqueue) * 1e6,
            "largest_copy_us": statistics.median(done) * 1e6,
            # What the enqueue is compared with: the GPU spin the copy queues behind, or
            # without torch.cuda._sleep the copy's own completion.
            "async_reference_us": (spin_s if spin_s is not None else statistics.median(done)) * 1e6,
            "async_reference": "GPU spin ahead of the copy" if spin_s is not None else "the copy's completion"}


#: About 25 ms of GPU time at 2 GHz (torch.cuda._sleep spins the given clock cycles).
SPIN_CYCLES = 50_000_000


def mb(value: int | None) -> float | None:
    return None if value is None else value / 1e6


def pinned_way(specs: list, planned: int, device: torch.device, seed: int) -> dict:
    """(a) torch's caching host allocator: ``torch.empty(..., pin_memory=True)``."""
    host_empty_cache()
    before, rss0 = host_allocator_bytes(), resident_set_bytes()
    start = time.perf_counter()
    tensors = [torch.empty(shape, dtype=dtype, pin_memory=True) for _, shape, dtype in specs]
    alloc_s = time.perf_counter() - start
    after, rss1 = host_allocator_bytes(), resident_set_bytes()
    for i, t in enumerate(tensors):
        fill_bytes(t, seed + i)
    rss2 = resident_set_bytes()
    copy = h2d_check(tensors, device)
    start = time.perf_counter()
    del tensors
    host_empty_cache()
    release_s = time.perf_counter() - start
    released = host_allocator_bytes()
    locked = None if None in (before, after) else after - before
    return {"page_locked_bytes": locked, "ratio": None if locked is None else locked / planned,
            "alloc_and_lock_s": alloc_s, "release_s": release_s, **copy,
            "rss_growth_at_alloc_mb": None if None in (rss0, rss1) else mb(rss1 - rss0),
            "rss_growth_after_fill_mb": None if None in (rss0, rss2) else mb(rss2 - rss0),
            "allocator_back_to_start": None if None in (before, released) else released == before}


def exact_way(specs: list, planned: int, device: torch.device, seed: int) -> dict:
    """(b) exact registration in place: ``PageLockedLedger(PinPolicy.decide(cuda=True))``."""
    torch_before, rss0 = host_allocator_bytes(), resident_set_bytes()
    ledger = PageLockedLedger(PinPolicy.decide(cuda=True))
    errors, tensors, moved = [], [], 0
    start = time.perf_counter()
    for name, shape, dtype in specs:
        t = torch.empty(shape, dtype=dtype)
        ptr = t.data_ptr()
        try:
            ledger.lock(t, name)
        except OffloadError as err:  # recorded: the check names the tensors that failed
            errors.append(f"{name} ({spec_bytes((name, shape, dtype))} B): {err}")
            clear_pending_cuda_error(device)
        moved += t.data_ptr() != ptr
        tensors.append(t)
    alloc_s = time.perf_counter() - start
    torch_after, rss1 = host_allocator_bytes(), resident_set_bytes()
    locked, by_how = ledger.locked_bytes, ledger.by_how()
    pinned = [t.is_pinned() for t in tensors]
    for i, t in enumerate(tensors):
        fill_bytes(t, seed + i)
    rss2 = resident_set_bytes()
    copy = h2d_check(tensors, device)
    start = time.perf_counter()
    for t in tensors:
        ledger.unlock(t.untyped_storage().data_ptr())
    unpinned = not any(t.is_pinned() for t in tensors)
    del tensors
    gc.collect()
    release_s = time.perf_counter() - start
    return {"page_locked_bytes": locked, "ratio": locked / planned, "by_how": by_how,
            "errors": errors, "tensors_moved": moved,
            "all_read_as_pinned": all(pinned), "unlock_unpins": unpinned,
            "ledger_empty_after_unlock": ledger.locked_bytes == 0,
            "torch_allocator_growth_bytes": None if None in (torch_before, torch_after) else torch_after - torch_before,
            "alloc_and_lock_s": alloc_s, "release_s": release_s, **copy,
            "rss_growth_at_alloc_mb": None if None in (rss0, rss1) else mb(rss1 - rss0),
            "rss_growth_after_fill_mb": None if None in (rss0, rss2) else mb(rss2 - rss0)}


def recorded_registration(specs: list, planned: int) -> dict:
    """The ledger's bookkeeping with a recording registrar (any machine): every storage
    registered once, in place, at its exact size, and unregistered at unlock."""
    registrar = RecordingRegistrar()
    ledger = PageLockedLedger(PinPolicy.decide(cuda=True), registrar)
    tensors = [torch.empty(shape, dtype=dtype) for _, shape, dtype in specs]  # untouched: no RSS
    ptrs = [t.data_ptr() for t in tensors]
    start = time.perf_counter()
    locked = [ledger.lock(t, name) for t, (name, _, _) in zip(tensors, specs)]
    lock_s = time.perf_counter() - start
    exact = (all(locked) and [t.data_ptr() for t in tensors] == ptrs
             and registrar.registered == {p: spec_bytes(s) for p, s in zip(ptrs, specs)})
    out = {"page_locked_bytes": ledger.locked_bytes, "ratio": ledger.locked_bytes / planned,
           "exact_and_in_place": exact, "by_how": ledger.by_how(), "lock_s": lock_s}
    for p in ptrs:
        ledger.unlock(p)
    out["unlocked_all"] = sorted(registrar.unregistered) == sorted(ptrs) and ledger.locked_bytes == 0
    del tensors
    return out

