"""Check the offload mechanism on this machine, and time it: one prepared script.

What it asserts (on CUDA; on a CPU-only machine the device asserts are listed as skipped):
- a host-resident embedding of the reference size (248320 x 5120 bf16, 2.54 GB) adds no
  device memory where a device-resident one adds its full size; its weight is pinned;
- host gather and UVA gather return exactly what ``F.embedding`` on the device weight does;
- under vLLM's masked tensor-parallel lookup (ids outside this rank's shard become local
  id 0, their rows zeroed in place afterwards), the host gather on a pinned host shard
  (rank 1 of 4) returns exactly what the same lookup on a device shard does, on the
  device and writable in place, for 1 to 4096 tokens;
- a speculative drafter's own embedding and LM head (routed by class with
  ``ConstructOnHost((), force=...)``, as the glue does) allocate no device memory: the
  device peak grows by the drafter's own layer only; once they are replaced by the
  target's, their host storages are freed (weak references to the storages);
- inside a cold (``visual``) module, an explicit-device workspace stays on the device, a
  rotary module from a process-wide cache that a hot layer shares and a tensor only a
  module-global cache holds go back to the device at ``finish`` (in place), the module's
  own weight stays in pinned host memory, and ``finish`` reports the bytes it moved back,
  which is what device memory grows by;
- an on-demand tower gives the resident tower's output, its transient device memory is
  about two blocks plus the non-block part (ledger and allocator agree), and offloading
  a device-built tower frees its device memory;
- the CUDA load paths (issue 16): memory registered with ``cudaHostRegister`` reads as
  pinned and vLLM's (or torch's) UVA view reads it in place (a host write shows through; no
  device or torch-pinned bytes added); vLLM's ``device_loading_context`` on a host
  embedding is run and its effect recorded (new storage? pinned? torch-pinned bytes added),
  then the same post-processing with ``keep_on_host`` leaves storage and pinned bytes
  alone; the exact prefetch offloader over small layers leaves nothing in torch's pinned
  cache after ``post_init`` and the hot layers registered within 1.05x of their bytes, and
  they compute what the resident layers do. Needs vLLM for all but the first (skipped,
  with that reason, where vLLM is not importable);
- host memory page-locked the project's way (pageable ``torch.empty`` registered in place
  by ``PageLockedLedger(PinPolicy.decide(cuda=True))``, ``cudaHostRegister``) is exactly the
  planned bytes (ratio 1.0) for the reference embedding and for the reference decoder
  layer split into its 19 weights, reads as pinned, takes nothing from torch's pinned
  allocator, serves an async host-to-device copy (queued behind a GPU spin, the call
  returns without waiting for it) that reads back bit-exact, and is unregistered at unlock; torch's
  ``pin_memory=True`` blocks for the same tensors are measured beside it (their ratio is
  reported, asserted only to be at least 1). Without CUDA the pin policy is checked to be
  pageable, and the ledger's bookkeeping runs with a recording registrar in place of the
  driver (every storage registered once, in place, at its exact size).
- routed experts of one MoE layer (Qwen3-30B-A3B's shape: 128 experts top-8) in host memory,
  the glue's way: pageable, page-locked in place by ``PageLockedLedger``, the parameter
  swapped for a UVA device view and marked as vLLM marks its own (``experts.mark_uva_view``):
  making the view allocates no device memory, the parameter object stays the same, and
  reading experts through it inside a kernel returns exactly what reads from a device copy
  return. Without CUDA the view step is skipped (host memory is the device's there).

Without CUDA the meta device stands in for the GPU where placement is the point (a
drafter's own layer, an explicit-device workspace); bit-exactness, routing, ``finish``'s
ledger and the release of host storages are still checked. torch cannot swap a storage to
meta in place, so there the globally held tensor is checked to be reported as left on
the host instead.

What it measures (a table each): routed-expert reads, k of E experts through the UVA view
against copying the whole layer first and against device-resident reads, for steps of 1, 4
and 16 tokens (``_common.routed_expert_reads``: the read efficiency host-uva plans price); device gather vs host gather vs UVA gather for 1, 16, 256
and 4096 tokens per step; the masked TP lookup, device shard vs host shard; construction
figures (bytes routed, device growth, release time); tower onload time against tower
size; pinned (and pageable) host-to-device bandwidth, beside the probe's UVA read rate (a
kernel reading page-locked host memory in place) and decode-shaped VRAM read rate; page-locked bytes over planned host
bytes (``ratio_rounding`` for torch's pinned blocks, ``ratio_exact`` for registration, per
tensor set and overall), the time to allocate and page-lock each way, and the process RSS
around it. Times are medians of per-call wall time with the device synchronised around
each call, so they include launch and sync overhead: measured, not estimated.

Results go to ``--out`` (default ``benchmarks/results/``) as JSON and Markdown named after
the device and the date. Without CUDA (or with ``--small``) sizes shrink so the script
finishes in seconds on two cores (2.7 to 3.3 s measured on 2 shared EPYC cores, 1 torch
thread, host-memory section included). The full run on a GPU is an estimate, not a measurement:
1.5 to 4 minutes on an H100/H200-class machine, under 8. Its cost is host work, not the
GPU: first-touching and pinning host memory (the 2.54 GB table copied to the host and
pinned twice, 5.1 GB of drafter copies written, about 1.3 GiB more pinned for the TP shard
and the cold weight; at 0.3 to 2 GB/s for first touch and pinning that is 10 to 60 s),
building 2.4 G tower parameters on the CPU (each depth twice; 10 to 30 s), the timed loops
(30 calls per figure, about 10 s; the host gather of 4096 rows is the slowest call, tens
of ms), and the host-memory section (2.92 GB page-locked, filled, copied to the device,
read back and compared, 2 ways x 2 repetitions, 4.8 GB of it in torch's rounded blocks:
about 12 GB locked and 35 GB of host memory traffic, 20 to 60 s).

Usage: ``python benchmarks/gpu_mechanism_check.py [--small] [--out DIR]``. Exit status 1
when an assert failed (the results are still written), 0 otherwise.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import platform
import re
import statistics
import sys
import time
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from selective_offload.wrappers import (  # noqa: E402
    HostEmbedding,
    HostGather,
    cuda_view_of_pinned,
    offload_on_demand,
)
from selective_offload.wrappers.construct_on_host import ConstructOnHost  # noqa: E402
from selective_offload.wrappers.page_locked import (  # noqa: E402
    PageLockedLedger,
    PinPath,
    PinPolicy,
    resident_set_bytes,
)
from selective_offload.wrappers.residency import OffloadError  # noqa: E402

TOKENS_PER_STEP = (1, 16, 256, 4096)
# vocab x hidden is also the drafter's embedding and LM head, and the table whose TP shard
# (1 / tp_size of the rows) the masked lookup reads; cold/hot/workspace/rope/table size the
# explicit-device section (a 256 MiB cold weight, FlashInfer's 128 MiB ViT workspace, a
# 131072 x 128 float32 rotary cache).
FULL = {"vocab": 248320, "hidden": 5120, "tower_hidden": 1280, "tower_depths": (4, 8, 16, 32),
        "tower_tokens": 1024, "bandwidth_bytes": 1 << 30, "iters": 30, "tp_size": 4,
        "cold_rows": 8192, "cold_cols": 16384, "hot_rows": 5120, "hot_cols": 5120,
        "workspace_bytes": 128 << 20, "rope_positions": 131072, "rope_dim": 128,
        "table_elems": 4 << 20, "host_shrink": 1, "host_repeats": 2, "expert_scale": 1.0}
SMALL = {"vocab": 32768, "hidden": 1024, "tower_hidden": 256, "tower_depths": (2, 4, 8),
         "tower_tokens": 64, "bandwidth_bytes": 64 << 20, "iters": 10, "tp_size": 4,
         "cold_rows": 1024, "cold_cols": 1024, "hot_rows": 512, "hot_cols": 512,
         "workspace_bytes": 1 << 20, "rope_positions": 4096, "rope_dim": 64,
         "table_elems": 1 << 16, "host_shrink": 8, "host_repeats": 2, "expert_scale": 0.01}
NO_CUDA = "skipped: no CUDA device"


class Checks:
    """Named asserts that are recorded, not raised, so every section still runs."""

    def __init__(self) -> None:
        self.rows: list[dict] = []

    def check(self, name: str, ok: bool, detail: str = "") -> None:
        self.rows.append({"name": name, "status": "passed" if ok else "FAILED", "detail": detail})
        print(f"[{'ok' if ok else 'FAIL'}] {name} {detail}")

    def skip(self, name: str, why: str = NO_CUDA) -> None:
        self.rows.append({"name": name, "status": why, "detail": ""})
        print(f"[skip] {name}: {why}")

    @property
    def failed(self) -> bool:
        return any(r["status"] == "FAILED" for r in self.rows)


def device_name(cuda: bool) -> str:
    if cuda:
        return torch.cuda.get_device_name()
    try:
        text = Path("/proc/cpuinfo").read_text()
        match = re.search(r"^model name\s*:\s*(.+)$", text, re.MULTILINE)
        if match:
            return match.group(1).strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def median_us(fn, iters: int, cuda: bool, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        sync(cuda)
        start = time.perf_counter()
        fn()
        sync(cuda)
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.shape, a.dtype) == (b.shape, b.dtype) and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    )


def embedding_section(cfg: dict, cuda: bool, device: torch.device, checks: Checks) -> dict:
    vocab, hidden, dtype = cfg["vocab"], cfg["hidden"], torch.bfloat16
    weight_bytes = vocab * hidden * 2
    print(f"embedding {vocab} x {hidden} bf16 = {weight_bytes / 1e9:.3f} GB")
    sync(cuda)
    before = torch.cuda.memory_allocated() if cuda else 0
    resident = nn.Embedding(vocab, hidden, dtype=dtype, device=device)
    sync(cuda)
    resident_delta = (torch.cuda.memory_allocated() - before) if cuda else None

    cpu_module = nn.Embedding(vocab, hidden, dtype=dtype, device="meta")
    cpu_module.weight = nn.Parameter(resident.weight.detach().to("cpu"), requires_grad=False)
    sync(cuda)
    before = torch.cuda.memory_allocated() if cuda else 0
    host = HostEmbedding.from_embedding(cpu_module, device)
    sync(cuda)
    host_delta = (torch.cuda.memory_allocated() - before) if cuda else None

    result = {"vocab": vocab, "hidden": hidden, "dtype": "bfloat16", "weight_bytes": weight_bytes,
              "device_resident_build_device_bytes": resident_delta,
              "host_resident_build_device_bytes": host_delta}
    if cuda:
        checks.check("device-resident embedding allocates its size on the device",
                     resident_delta >= weight_bytes, f"{resident_delta} >= {weight_bytes} bytes")
        checks.check("host-resident embedding allocates nothing on the device",
                     host_delta == 0, f"{host_delta} bytes")
        checks.check("device memory drops by the host bytes",
                     resident_delta - host_delta >= host.stats.host_bytes,
                     f"{resident_delta - host_delta} vs host_bytes {host.stats.host_bytes}")
        checks.check("host weight storage is pinned", host.weight.is_pinned())
        stats = torch.cuda.host_memory_stats()
        result["pinned_host_reserved_bytes"] = stats.get("reserved_bytes.current",
                                                         stats.get("reserved_bytes.all.current"))
    else:
        for name in ("device-resident embedding allocates its size on the device",
                     "host-resident embedding allocates nothing on the device",
                     "device memory drops by the host bytes", "host weight storage is pinned"):
            checks.skip(name)

    uva = view = None
    if cuda:
        try:
            uva = HostEmbedding.from_embedding(cpu_module, device, mode="uva")
            view = cuda_view_of_pinned(uva.weight.data, device)
        except Exception as err:  # noqa: BLE001 -- recorded as a failed check; timing goes on
            checks.check("UVA view of pinned memory can be built", False, repr(err))
            uva = view = None
        else:
            checks.check("UVA view of pinned memory can be built",
                         view.data_ptr() == uva.weight.data_ptr() and view.device == device,
                         f"device view at the host address, on {view.device}")
    else:
        checks.skip("UVA view of pinned memory can be built")

    gen = torch.Generator().manual_seed(0)
    rows = []
    for tokens in TOKENS_PER_STEP:
        ids = torch.randint(0, vocab, (tokens,), generator=gen).to(device)
        expected = F.embedding(ids, resident.weight.detach())
        checks.check(f"host gather == device F.embedding ({tokens} tokens)",
                     bitwise_equal(host(ids), expected))
        if uva is not None:
            checks.check(f"UVA gather == device F.embedding ({tokens} tokens)",
                         bitwise_equal(uva(ids), expected))
        elif not cuda:
            checks.skip(f"UVA gather == device F.embedding ({tokens} tokens)")
        def time_us(fn):
            return median_us(fn, cfg["iters"], cuda)

        with torch.no_grad():
            row = {
                "tokens": tokens,
                "row_bytes_moved": tokens * hidden * 2,
                "device_gather_us": time_us(lambda: F.embedding(ids, resident.weight)),
                "host_gather_us": time_us(lambda: host(ids)),
                "uva_gather_us": time_us(lambda: uva(ids)) if uva is not None else None,
                "uva_kernel_only_us": (
                    time_us(lambda: torch.index_select(view, 0, ids)) if view is not None else None
                ),
            }
        rows.append(row)
        print(row)
    result["gather"] = rows
    return result  # the tables (and the closures that read them) are freed here


# ---------------------------------------------------------------- construction and TP lookup
# Torch stand-ins for the vLLM classes the glue routes (no vLLM import here): the bytes and
# the allocation calls are what matter. Each takes a ``prefix`` as every vLLM layer does.

class EmbeddingLike(nn.Module):
    """Like vLLM's ``VocabParallelEmbedding``: an uninitialised (vocab, hidden) weight."""

    def __init__(self, vocab: int, hidden: int, prefix: str = "") -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab, hidden, dtype=torch.bfloat16),
                                   requires_grad=False)


class LMHeadLike(EmbeddingLike):
    """Like vLLM's ``ParallelLMHead``, a subclass of the embedding class."""


class LayerLike(nn.Module):
    """A plain layer built with a hot prefix: never routed."""

    def __init__(self, rows: int, cols: int, prefix: str = "") -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, cols, dtype=torch.bfloat16),
                                   requires_grad=False)


class DrafterLike(nn.Module):
    """An EAGLE-style drafter: its own embedding and LM head (vLLM replaces both by the
    target's after loading) and its own layer (an EAGLE ``fc``: 2 x hidden -> hidden)."""

    def __init__(self, vocab: int, hidden: int, prefix: str = "") -> None:
        super().__init__()
        self.embed_tokens = EmbeddingLike(vocab, hidden, prefix="model.embed_tokens")
        self.fc = LayerLike(hidden, 2 * hidden, prefix="model.fc")
        # "lm_head" is never cold by prefix; the drafter's is routed by class (force).
        self.lm_head = LMHeadLike(vocab, hidden, prefix="lm_head")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _storage_ref(t: torch.Tensor):
    """A weak reference that dies when ``t``'s storage is freed (torch keeps one Python
    object per storage alive exactly as long as the storage), else the tensor's own."""
    try:
        ref = weakref.ref(t.untyped_storage())
    except TypeError:  # a torch without weak references to storages
        ref = None
    if ref is None or ref() is None:  # the storage's Python object is not kept alive
        ref = weakref.ref(t)
    return ref


def _rss_bytes() -> int | None:
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _allocated(cuda: bool) -> int | None:
    if not cuda:
        return None
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def drafter_section(cfg: dict, cuda: bool, device: torch.device, checks: Checks) -> dict:
    """A drafter's shared modules (embedding, LM head) never allocate device memory, and
    their host copies are freed once vLLM replaces them by the target's."""
    vocab, hidden = cfg["vocab"], cfg["hidden"]
    # The meta device stands in for the GPU without CUDA: anything not routed lands there.
    target = device if cuda else torch.device("meta")
    shared_bytes = 2 * vocab * hidden * 2
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base = _allocated(cuda)
    start = time.perf_counter()
    mode = ConstructOnHost((), force=((LMHeadLike, "lm_head"), (EmbeddingLike, "embed_tokens")))
    with torch.device(target), mode:
        drafter = DrafterLike(vocab, hidden)
    build_s = time.perf_counter() - start
    after_build = _allocated(cuda)
    peak_growth = (torch.cuda.max_memory_allocated() - base) if cuda else None
    fc_bytes = _nbytes(drafter.fc.weight)
    vocab_names = {n for n, m in drafter.named_modules() if isinstance(m, EmbeddingLike)}
    result = mode.finish(drafter, lambda n: any(n == v or n.startswith(v + ".") for v in vocab_names))
    shared = (drafter.embed_tokens.weight, drafter.lm_head.weight)
    on_host = all(w.device.type == "cpu" for w in shared)
    checks.check("drafter's embedding and LM head are built in host memory (force, any prefix)",
                 on_host and mode.routed == {"lm_head": shared_bytes // 2,
                                             "embed_tokens": shared_bytes // 2},
                 f"{[w.device.type for w in shared]}, routed {mode.routed}")
    checks.check("drafter's own layer is built on the device",
                 drafter.fc.weight.device.type == target.type, f"on {drafter.fc.weight.device}")
    checks.check("finish keeps the shared weights on the host and moves nothing back",
                 result.storages == {_ptr(w) for w in shared}
                 and result.moved_back_bytes == 0 and result.left_on_host_bytes == 0,
                 f"{len(result.storages)} storages, moved back {result.moved_back_bytes} B")
    bound = 1 << 20
    if cuda:
        checks.check("building the drafter grows the device peak by its own layer only",
                     peak_growth - fc_bytes < bound and after_build - base >= fc_bytes,
                     f"peak +{peak_growth} B = layer {fc_bytes} B + {peak_growth - fc_bytes} B "
                     f"(< {bound} B; the shared modules are {shared_bytes} B)")
    else:
        checks.skip("building the drafter grows the device peak by its own layer only")

    # The load writes the host copies (touch them, so the RSS figure means something).
    for w in shared:
        w.zero_()
    refs = [_storage_ref(w) for w in shared]
    del shared, w
    alive = all(r() is not None for r in refs)  # the drafter still holds them
    rss_before = _rss_bytes()
    # vLLM's drafter setup: the target's embedding and LM head replace the drafter's.
    with torch.device(target):
        target_embed = EmbeddingLike(vocab, hidden, prefix="model.embed_tokens")
        target_head = LMHeadLike(vocab, hidden, prefix="lm_head")
    start = time.perf_counter()
    drafter.embed_tokens, drafter.lm_head = target_embed, target_head
    gc.collect()
    release_s = time.perf_counter() - start
    rss_after = _rss_bytes()
    freed = alive and all(r() is None for r in refs)
    checks.check("replacing them by the target's frees the host copies",
                 freed, f"held before: {alive}; {sum(r() is None for r in refs)}/{len(refs)} "
                 f"storages released after ({shared_bytes} B)")
    checks.check("the drafter then reads the target's device weights",
                 drafter.embed_tokens.weight is target_embed.weight
                 and drafter.lm_head.weight.device.type == target.type,
                 f"on {drafter.embed_tokens.weight.device}")
    out = {"vocab": vocab, "hidden": hidden, "shared_bytes": shared_bytes,
           "routed_bytes": dict(mode.routed), "own_layer_bytes": fc_bytes,
           "device_peak_growth_bytes": peak_growth,
           "device_allocated_growth_bytes": None if base is None else after_build - base,
           "build_s": build_s, "release_s": release_s, "host_storages_released": freed,
           # Informational: RSS depends on the allocator returning pages to the system.
           "rss_drop_bytes_informational": (None if None in (rss_before, rss_after)
                                            else rss_before - rss_after)}
    print(out)
    del drafter, target_embed, target_head
    return out


def masked_lookup(ids: torch.Tensor, start: int, end: int, lookup) -> torch.Tensor:
    """vLLM's masked tensor-parallel lookup (``VocabParallelEmbedding.forward`` with
    ``use_fused_embedding`` off): ids outside this rank's shard [start, end) become local
    id 0, and their rows are zeroed in place after the lookup. No added vocabulary."""
    org_vocab_mask = (ids >= start) & (ids < end)
    valid_offset = start * org_vocab_mask
    masked = org_vocab_mask * (ids - valid_offset)
    out = lookup(masked.long())
    out.masked_fill_(~org_vocab_mask.unsqueeze(-1), 0)
    return out


def tp_lookup_section(cfg: dict, cuda: bool, device: torch.device, checks: Checks) -> dict:
    """The host gather under vLLM's masked TP lookup, against the same on a device shard."""
    vocab, hidden, tp, rank = cfg["vocab"], cfg["hidden"], cfg["tp_size"], 1
    rows = vocab // tp
    start, end = rank * rows, (rank + 1) * rows
    gen = torch.Generator(device=device).manual_seed(1)
    device_shard = torch.randn(rows, hidden, device=device, dtype=torch.bfloat16, generator=gen)
    host_shard = torch.empty(rows, hidden, dtype=torch.bfloat16, pin_memory=cuda)
    host_shard.copy_(device_shard)
    gather = HostGather(device)
    result = {"vocab": vocab, "hidden": hidden, "tp_size": tp, "rank": rank,
              "shard_rows": [start, end], "shard_bytes": _nbytes(host_shard),
              "host_shard_pinned": host_shard.is_pinned() if cuda else None}
    if cuda:
        checks.check("host shard is pinned", host_shard.is_pinned())
    else:
        checks.skip("host shard is pinned")
    ids_gen = torch.Generator().manual_seed(2)
    rows_out = []
    with torch.inference_mode():  # as vLLM runs the model
        for tokens in TOKENS_PER_STEP:
            ids = torch.randint(0, vocab, (tokens,), generator=ids_gen)
            # The shard's edges, both sides: start and end - 1 are its own, end is not.
            for i, v in enumerate((start, end, end - 1, start - 1)[:tokens]):
                ids[i] = v
            ids = ids.to(device)
            in_shard = int(((ids >= start) & (ids < end)).sum())
            expected = masked_lookup(ids, start, end, lambda i: F.embedding(i, device_shard))
            raw = {}

            def host_lookup(i):
                raw["out"] = gather(host_shard, i)
                raw["ptr"] = raw["out"].data_ptr()
                return raw["out"]

            got = masked_lookup(ids, start, end, host_lookup)
            sync(cuda)
            checks.check(f"masked host lookup == masked device lookup ({tokens} tokens, "
                         f"TP rank {rank} of {tp})", bitwise_equal(got, expected),
                         f"{in_shard} of {tokens} ids in the shard")
            zero_rows = int((got == 0).all(dim=-1).sum())
            checks.check(f"host lookup output is on the device and masked in place ({tokens} tokens)",
                         got.device == device and got is raw["out"] and got.data_ptr() == raw["ptr"]
                         and zero_rows >= tokens - in_shard,
                         f"on {got.device}, {tokens - in_shard} rows zeroed in place")
            row = {
                "tokens": tokens, "ids_in_shard": in_shard,
                "masked_device_lookup_us": median_us(
                    lambda: masked_lookup(ids, start, end, lambda i: F.embedding(i, device_shard)),
                    cfg["iters"], cuda),
                "masked_host_lookup_us": median_us(
                    lambda: masked_lookup(ids, start, end, lambda i: gather(host_shard, i)),
                    cfg["iters"], cuda),
            }
            rows_out.append(row)
            print(row)
    result["lookup"] = rows_out
    return result


# Module-global caches, as vLLM's rotary-embedding cache (``_ROPE_DICT``) and FlashInfer's
# ViT workspace are: whoever asks first builds the entry, everyone after shares it.
_ROPE_CACHE: dict = {}
_WORKSPACE: list = []
_GLOBAL_TABLES: dict = {}


class RotaryLike(nn.Module):
    def __init__(self, max_positions: int, rotary_dim: int) -> None:
        super().__init__()
        self.register_buffer("cos_sin_cache", torch.ones(max_positions, rotary_dim),
                             persistent=False)


def get_rope(max_positions: int, rotary_dim: int) -> RotaryLike:
    key = (max_positions, rotary_dim)
    if key not in _ROPE_CACHE:
        _ROPE_CACHE[key] = RotaryLike(max_positions, rotary_dim)
    return _ROPE_CACHE[key]


class VisionBlockLike(nn.Module):
    """A cold module: its own weight (routed to the host), a workspace allocated with an
    explicit device (left alone), a rotary module from the process-wide cache (built here
    first, so routed, then shared with the language model), and a table that only a
    module-global cache holds (not a parameter, buffer or attribute of any module)."""

    def __init__(self, cfg: dict, workspace_device: torch.device, prefix: str = "") -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg["cold_rows"], cfg["cold_cols"],
                                               dtype=torch.bfloat16), requires_grad=False)
        if not _WORKSPACE:
            _WORKSPACE.append(torch.zeros(cfg["workspace_bytes"], dtype=torch.uint8,
                                          device=workspace_device))
        self.rotary = get_rope(cfg["rope_positions"], cfg["rope_dim"])
        _GLOBAL_TABLES["table"] = torch.arange(cfg["table_elems"], dtype=torch.float32)


class LanguageLayerLike(nn.Module):
    def __init__(self, cfg: dict, prefix: str = "") -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg["hot_rows"], cfg["hot_cols"],
                                               dtype=torch.bfloat16), requires_grad=False)
        self.rotary = get_rope(cfg["rope_positions"], cfg["rope_dim"])  # cached: shared


class SharedModel(nn.Module):
    def __init__(self, cfg: dict, workspace_device: torch.device) -> None:
        super().__init__()
        self.visual = VisionBlockLike(cfg, workspace_device, prefix="visual.blocks.0")
        self.layer = LanguageLayerLike(cfg, prefix="model.layers.0")


def explicit_device_section(cfg: dict, cuda: bool, device: torch.device, checks: Checks) -> dict:
    """Inside a routed (cold) module, explicit-device allocations stay on the device and
    shared or globally held tensors go back to it; only the module's own weight stays."""
    target = device if cuda else torch.device("meta")
    _ROPE_CACHE.clear()
    _WORKSPACE.clear()
    _GLOBAL_TABLES.clear()
    workspace_bytes = cfg["workspace_bytes"]
    cold_bytes = cfg["cold_rows"] * cfg["cold_cols"] * 2
    hot_bytes = cfg["hot_rows"] * cfg["hot_cols"] * 2
    rope_bytes = cfg["rope_positions"] * cfg["rope_dim"] * 4
    table_bytes = cfg["table_elems"] * 4
    base = _allocated(cuda)
    start = time.perf_counter()
    mode = ConstructOnHost({"visual"}, pin_memory=cuda)
    with torch.device(target), mode:
        model = SharedModel(cfg, target)
    build_s = time.perf_counter() - start
    after_build = _allocated(cuda)
    table = _GLOBAL_TABLES["table"]
    routed_rope = model.visual.rotary.cos_sin_cache.device.type == "cpu"
    start = time.perf_counter()
    result = mode.finish(model, lambda n: "visual" in n.split("."))
    finish_s = time.perf_counter() - start
    after_finish = _allocated(cuda)
    workspace = _WORKSPACE[0]
    rope = model.visual.rotary.cos_sin_cache
    checks.check("explicit-device workspace inside a cold module stays on the device",
                 workspace.device.type == target.type,
                 f"on {workspace.device}" + ("" if cuda else " (meta stands in for the GPU)"))
    checks.check("cold module's own weight is built in host memory",
                 model.visual.weight.device.type == "cpu"
                 and result.storages == {_ptr(model.visual.weight)},
                 f"on {model.visual.weight.device}")
    if cuda:
        checks.check("cold module's own weight is pinned", model.visual.weight.is_pinned())
    else:
        checks.skip("cold module's own weight is pinned")
    checks.check("shared cached rotary module's buffer is back on the device after finish",
                 routed_rope and rope.device.type == target.type
                 and model.layer.rotary is model.visual.rotary
                 and _ROPE_CACHE[(cfg["rope_positions"], cfg["rope_dim"])] is model.visual.rotary
                 and model.layer.rotary.cos_sin_cache is rope,
                 f"built on the host (cold module first), now on {rope.device}, one object")
    if cuda:
        checks.check("tensor held only by a module-global cache is moved back in place",
                     _GLOBAL_TABLES["table"] is table and table.device.type == "cuda",
                     f"on {table.device}, the same object")
        checks.check("finish reports the bytes it moved back",
                     result.moved_back_bytes == rope_bytes + table_bytes
                     and result.left_on_host_bytes == 0,
                     f"{result.moved_back_bytes} B = rope {rope_bytes} + table {table_bytes}")
        build_growth, finish_growth = after_build - base, after_finish - after_build
        bound = 1 << 20
        checks.check("construction allocates only the workspace and the hot layer on the device",
                     0 <= build_growth - (workspace_bytes + hot_bytes) < bound,
                     f"+{build_growth} B vs {workspace_bytes + hot_bytes} B "
                     f"(cold weight {cold_bytes} B, rope {rope_bytes} B routed)")
        checks.check("device memory grows at finish by the bytes reported moved back",
                     abs(finish_growth - result.moved_back_bytes) < bound,
                     f"+{finish_growth} B vs {result.moved_back_bytes} B")
    else:
        checks.skip("tensor held only by a module-global cache is moved back in place")
        checks.check("finish reports the bytes it moved back",
                     result.moved_back_bytes == rope_bytes,
                     f"{result.moved_back_bytes} B = rope {rope_bytes} B")
        checks.check("tensor held only by a module-global cache is reported as left on the host "
                     "(meta cannot swap storage in place)",
                     result.left_on_host_bytes == table_bytes and table.device.type == "cpu",
                     f"{result.left_on_host_bytes} B")
        checks.skip("construction allocates only the workspace and the hot layer on the device")
        checks.skip("device memory grows at finish by the bytes reported moved back")
    out = {"cold_weight_bytes": cold_bytes, "hot_weight_bytes": hot_bytes,
           "workspace_bytes": workspace_bytes, "rope_cache_bytes": rope_bytes,
           "global_table_bytes": table_bytes, "routed_bytes": dict(mode.routed),
           "moved_back_bytes": result.moved_back_bytes,
           "left_on_host_bytes": result.left_on_host_bytes,
           "device_growth_at_construction_bytes": None if base is None else after_build - base,
           "device_growth_at_finish_bytes": None if base is None else after_finish - after_build,
           "build_s": build_s, "finish_s": finish_s}
    print(out)
    del model, workspace, rope, table
    _ROPE_CACHE.clear()
    _WORKSPACE.clear()
    _GLOBAL_TABLES.clear()
    return out


class Block(nn.Module):
    """A ViT-like block: attention projections and an MLP (the bytes are what matters)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.norm2 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class Tower(nn.Module):
    def __init__(self, hidden: int, depth: int) -> None:
        super().__init__()
        self.patch_embed = nn.Linear(hidden, hidden)
        self.blocks = nn.ModuleList(Block(hidden) for _ in range(depth))
        self.norm = nn.LayerNorm(hidden)

    def forward(self, x):
        x = self.patch_embed(x)
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


def tower_section(cfg: dict, cuda: bool, device: torch.device, checks: Checks) -> list[dict]:
    hidden, dtype, rows = cfg["tower_hidden"], torch.bfloat16, []
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
            checks.check(f"on-demand tower == resident tower (depth {depth})",
                         torch.equal(out, expected))
            ledger_peak = handle.stats.peak_transient_device_bytes
            checks.check(f"ledger peak transient == non-block + 2 blocks (depth {depth})",
                         ledger_peak == rest_bytes + 2 * block_bytes,
                         f"{ledger_peak} vs {rest_bytes + 2 * block_bytes} bytes")
            del out
            sync(cuda)
            if cuda:
                checks.check(f"offloading frees the tower's device memory (depth {depth})",
                             freed >= tower_bytes, f"{freed} >= {tower_bytes} bytes")
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                offloaded(x)
                sync(cuda)
                measured_peak = torch.cuda.max_memory_allocated() - base
                allowed = 1.05 * (ledger_peak + resident_activation_peak) + (2 << 20)
                checks.check(f"measured device peak within ledger + activations (depth {depth})",
                             measured_peak <= allowed, f"{measured_peak} <= {int(allowed)} bytes")
            else:
                measured_peak = None
                checks.skip(f"offloading frees the tower's device memory (depth {depth})")
                checks.skip(f"measured device peak within ledger + activations (depth {depth})")
            offloaded_us = median_us(lambda: offloaded(x), cfg["iters"], cuda)
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
    return rows


def bandwidth_section(cfg: dict, cuda: bool, device: torch.device) -> dict:
    nbytes, iters = cfg["bandwidth_bytes"], max(cfg["iters"] // 3, 5)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    result = {"bytes_per_copy": nbytes}
    if cuda:
        pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        pageable = torch.empty(nbytes, dtype=torch.uint8)
        pinned.fill_(1)
        pageable.fill_(1)
        us = median_us(lambda: dst.copy_(pinned, non_blocking=True), iters, cuda)
        result["pinned_h2d_gb_per_s"] = nbytes / us / 1e3
        us = median_us(lambda: dst.copy_(pageable), iters, cuda)
        result["pageable_h2d_gb_per_s"] = nbytes / us / 1e3
        # The probe's own measurements of what the plan prices: kernels reading page-locked
        # host memory in place through a UVA view (bulk cpu_offload_gb, the UVA embedding,
        # experts read in place), against the copy; and a decode-shaped VRAM read.
        from selective_offload.probe import decode_read_gbps, uva_read_series
        from selective_offload.wrappers.host_embedding import cuda_view_of_pinned

        pinned = pageable = None
        uva = uva_read_series([nbytes], repeats=iters, warmup=2, cuda=device, pin=True, required=1,
                              view=lambda host: cuda_view_of_pinned(host, device))
        result["uva_read_gb_per_s"] = nbytes / uva[nbytes] / 1e9
        result["uva_over_pinned_copy"] = result["uva_read_gb_per_s"] / result["pinned_h2d_gb_per_s"]
        result["decode_read_gb_per_s"] = decode_read_gbps(device, nbytes, repeats=iters, warmup=2, cuda=device)
    else:
        src = torch.ones(nbytes, dtype=torch.uint8)
        us = median_us(lambda: dst.copy_(src), iters, cuda)
        result["host_to_host_copy_gb_per_s"] = nbytes / us / 1e3
        result["note"] = "no CUDA device: a host memory copy stands in for host-to-device"
    print(result)
    return result


# --------------------------------------------------------------------------- host memory
# Page-locked bytes against planned host bytes, two ways, for the reference embedding and
# the reference decoder layer split into its weights (from the bundled manifest): (a) torch's
# caching host allocator (``pin_memory=True``: each block rounded up to a power of two, freed
# blocks cached), measured by its own count; (b) exact registration in place through the
# project's ledger (``cudaHostRegister``), measured by the ledger.

MANIFEST = Path(__file__).resolve().parents[1] / "selective_offload" / "data" / "qwen3.8-27b-fp8.manifest.json"
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


def _spec_bytes(spec: tuple[str, list[int], torch.dtype]) -> int:
    n = 1
    for d in spec[1]:
        n *= d
    return n * torch.empty((), dtype=spec[2]).element_size()


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _fill_bytes(t: torch.Tensor, seed: int) -> None:
    """Random bytes in ``t``: a block of an odd length (1,000,003 bytes) tiled over it."""
    flat = t.view(-1).view(torch.uint8)
    gen = torch.Generator().manual_seed(seed)
    block = torch.randint(0, 256, (min(flat.numel(), 1_000_003),), dtype=torch.uint8, generator=gen)
    for start in range(0, flat.numel(), block.numel()):
        n = min(block.numel(), flat.numel() - start)
        flat[start:start + n].copy_(block[:n])


def _host_allocator_bytes() -> int | None:
    """torch's caching host allocator's own count: bytes of the blocks it owns (rounded
    block sizes, cached blocks included), or None where torch gives no count."""
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if stats is None:
        return None
    try:
        return int(stats().get("allocated_bytes.current", 0))
    except (RuntimeError, AttributeError):
        return None


def _host_empty_cache() -> bool:
    empty = getattr(torch._C, "_host_emptyCache", None)
    if empty is None:
        return False
    torch.cuda.synchronize()
    gc.collect()
    empty()
    return True


def _h2d_check(tensors: list[torch.Tensor], device: torch.device) -> dict:
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


def _mb(value: int | None) -> float | None:
    return None if value is None else value / 1e6


def pinned_way(specs: list, planned: int, device: torch.device, seed: int) -> dict:
    """(a) torch's caching host allocator: ``torch.empty(..., pin_memory=True)``."""
    _host_empty_cache()
    before, rss0 = _host_allocator_bytes(), resident_set_bytes()
    start = time.perf_counter()
    tensors = [torch.empty(shape, dtype=dtype, pin_memory=True) for _, shape, dtype in specs]
    alloc_s = time.perf_counter() - start
    after, rss1 = _host_allocator_bytes(), resident_set_bytes()
    for i, t in enumerate(tensors):
        _fill_bytes(t, seed + i)
    rss2 = resident_set_bytes()
    copy = _h2d_check(tensors, device)
    start = time.perf_counter()
    del tensors
    _host_empty_cache()
    release_s = time.perf_counter() - start
    released = _host_allocator_bytes()
    locked = None if None in (before, after) else after - before
    return {"page_locked_bytes": locked, "ratio": None if locked is None else locked / planned,
            "alloc_and_lock_s": alloc_s, "release_s": release_s, **copy,
            "rss_growth_at_alloc_mb": None if None in (rss0, rss1) else _mb(rss1 - rss0),
            "rss_growth_after_fill_mb": None if None in (rss0, rss2) else _mb(rss2 - rss0),
            "allocator_back_to_start": None if None in (before, released) else released == before}


def exact_way(specs: list, planned: int, device: torch.device, seed: int) -> dict:
    """(b) exact registration in place: ``PageLockedLedger(PinPolicy.decide(cuda=True))``."""
    torch_before, rss0 = _host_allocator_bytes(), resident_set_bytes()
    ledger = PageLockedLedger(PinPolicy.decide(cuda=True))
    errors, tensors, moved = [], [], 0
    start = time.perf_counter()
    for name, shape, dtype in specs:
        t = torch.empty(shape, dtype=dtype)
        ptr = t.data_ptr()
        try:
            ledger.lock(t, name)
        except OffloadError as err:  # recorded: the check names the tensors that failed
            errors.append(f"{name} ({_spec_bytes((name, shape, dtype))} B): {err}")
            _clear_pending_cuda_error(device)
        moved += t.data_ptr() != ptr
        tensors.append(t)
    alloc_s = time.perf_counter() - start
    torch_after, rss1 = _host_allocator_bytes(), resident_set_bytes()
    locked, by_how = ledger.locked_bytes, ledger.by_how()
    pinned = [t.is_pinned() for t in tensors]
    for i, t in enumerate(tensors):
        _fill_bytes(t, seed + i)
    rss2 = resident_set_bytes()
    copy = _h2d_check(tensors, device)
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
            "rss_growth_at_alloc_mb": None if None in (rss0, rss1) else _mb(rss1 - rss0),
            "rss_growth_after_fill_mb": None if None in (rss0, rss2) else _mb(rss2 - rss0)}


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
             and registrar.registered == {p: _spec_bytes(s) for p, s in zip(ptrs, specs)})
    out = {"page_locked_bytes": ledger.locked_bytes, "ratio": ledger.locked_bytes / planned,
           "exact_and_in_place": exact, "by_how": ledger.by_how(), "lock_s": lock_s}
    for p in ptrs:
        ledger.unlock(p)
    out["unlocked_all"] = sorted(registrar.unregistered) == sorted(ptrs) and ledger.locked_bytes == 0
    del tensors
    return out


def _host_cuda_checks(set_name: str) -> list[str]:
    return [f"exact registration: page-locked bytes == planned bytes ({set_name})",
            f"registered {set_name} memory reads as pinned and takes nothing from torch's allocator",
            f"async H2D copy from registered memory reads back bit-exact ({set_name})",
            f"H2D copy from registered memory returns before it completes ({set_name})",
            f"unlocking unregisters and empties the ledger ({set_name})",
            f"async H2D copy from torch pinned memory reads back bit-exact ({set_name})",
            f"torch pinned blocks: page-locked bytes >= planned bytes ({set_name})",
            f"freeing returns torch's pinned blocks once its cache is emptied ({set_name})"]


def _clear_pending_cuda_error(device: torch.device) -> None:
    """A failed ``cudaHostRegister`` leaves its error pending in the CUDA runtime, and
    torch's next error check reports it against an unrelated call: clear it as the
    project does (``page_locked.clear_pending_cuda_error``), else let one small op
    consume it."""
    from selective_offload.wrappers.page_locked import clear_pending_cuda_error

    clear_pending_cuda_error()
    try:
        torch.zeros(1, device=device).add_(1)
        torch.cuda.synchronize()
    except RuntimeError:
        pass


def host_memory_section(cfg: dict, cuda: bool, device: torch.device, checks: Checks) -> dict:
    """Page-locked bytes over planned host bytes: torch's rounded pinned blocks against
    exact registration, for the reference embedding and a reference decoder layer."""
    sets = host_tensor_sets(cfg)
    stand_in = RecordingRegistrar()
    pageable = PageLockedLedger(PinPolicy.decide(cuda=False), stand_in)
    probe = torch.empty(1000, 77, dtype=torch.bfloat16)
    checks.check("without CUDA the pin policy is pageable and the ledger locks nothing",
                 pageable.policy.path == PinPath.PAGEABLE and not pageable.lock(probe, "probe")
                 and pageable.locked_bytes == 0 and not stand_in.registered,
                 f"path {pageable.policy.path}: {pageable.policy.reason}")
    stats_ok = False
    if cuda:
        torch.empty(1, device=device)
        probe = torch.empty(1, pin_memory=True)  # the allocator's first call outside the timings
        stats = getattr(torch.cuda, "host_memory_stats", None)
        stats_ok = (stats is not None and "allocated_bytes.current" in stats()
                    and hasattr(torch._C, "_host_emptyCache"))
        del probe
        _host_empty_cache()
    out = {"repeats": cfg["host_repeats"], "shrink": cfg["host_shrink"],
           "pytorch_alloc_conf": os.environ.get("PYTORCH_ALLOC_CONF", os.environ.get("PYTORCH_CUDA_ALLOC_CONF")),
           "torch_host_stats": stats_ok if cuda else None, "sets": []}
    for s, (set_name, specs) in enumerate(sets):
        sizes = [_spec_bytes(spec) for spec in specs]
        planned = sum(sizes)
        est_rounded = sum(_pow2(n) for n in sizes)
        row = {"set": set_name, "tensors": len(specs), "planned_bytes": planned,
               "power_of_two_tensors": sum(n == _pow2(n) for n in sizes),
               "est_rounded_bytes": est_rounded, "est_ratio_rounding": est_rounded / planned,
               "shapes": [[name, shape, str(dtype).replace("torch.", "")] for name, shape, dtype in specs]}
        print(f"host memory, {set_name}: {len(specs)} tensors, {planned / 1e9:.4f} GB planned")
        rec = recorded_registration(specs, planned)
        row["recorded"] = rec
        checks.check(f"ledger registers every {set_name} tensor at its exact size, in place "
                     "(recording registrar)", rec["exact_and_in_place"] and rec["ratio"] == 1.0,
                     f"{rec['page_locked_bytes']} of {planned} B")
        checks.check(f"unlocking unregisters every {set_name} storage (recording registrar)",
                     rec["unlocked_all"])
        rounding, exact, crashed = [], [], None
        if cuda:
            for r in range(cfg["host_repeats"]):  # alternating order: neither way always first
                ways = (("a", pinned_way), ("b", exact_way)) if r % 2 == 0 else (("b", exact_way), ("a", pinned_way))
                for key, way in ways:
                    try:
                        result = way(specs, planned, device, seed=100 * s + r)
                    except Exception as err:  # noqa: BLE001 -- recorded; the other sections ran
                        crashed = f"({key}) {type(err).__name__}: {str(err)[:400]}"
                        _clear_pending_cuda_error(device)
                        break
                    result["order"] = "first" if (key, way) == ways[0] else "second"
                    (rounding if key == "a" else exact).append(result)
                    print(f"  ({key}) {'torch pinned' if key == 'a' else 'registered'}: "
                          f"{ {k: v for k, v in result.items() if k not in ('by_how', 'errors')} }")
                if crashed:
                    break
            row["rounding"], row["exact"], row["error"] = rounding, exact, crashed
        if cuda and crashed:
            checks.check(f"both ways ran without error ({set_name})", False, crashed)
            for name in _host_cuda_checks(set_name):
                checks.skip(name, "skipped: the section stopped at the error above")
            row["ratio_exact"] = row["ratio_rounding"] = None
            out["sets"].append(row)
            continue
        if cuda:
            row["ratio_exact"] = exact[0]["ratio"]
            row["ratio_rounding"] = rounding[0]["ratio"] if stats_ok else None
            errors = sorted({e for x in exact for e in x["errors"]})
            checks.check(f"exact registration: page-locked bytes == planned bytes ({set_name})",
                         not errors and all(x["page_locked_bytes"] == planned and x["tensors_moved"] == 0
                                            and x["by_how"] == {"registered": planned} for x in exact),
                         f"ratio {row['ratio_exact']:.6f}" + (f"; failed: {'; '.join(errors)[:600]}" if errors else ""))
            checks.check(f"registered {set_name} memory reads as pinned and takes nothing from torch's allocator",
                         all(x["all_read_as_pinned"] and x["torch_allocator_growth_bytes"] in (0, None)
                             for x in exact),
                         f"torch allocator growth {[x['torch_allocator_growth_bytes'] for x in exact]} B")
            checks.check(f"async H2D copy from registered memory reads back bit-exact ({set_name})",
                         all(x["bit_exact"] for x in exact),
                         f"{min(x['h2d_gb_per_s'] for x in exact):.1f} GB/s or more")
            checks.check(f"H2D copy from registered memory returns before it completes ({set_name})",
                         all(x["largest_enqueue_us"] < 0.5 * x["async_reference_us"] for x in exact),
                         "; ".join(f"returned in {x['largest_enqueue_us']:.0f} us, {x['async_reference']} "
                                   f"{x['async_reference_us']:.0f} us" for x in exact))
            checks.check(f"unlocking unregisters and empties the ledger ({set_name})",
                         all(x["unlock_unpins"] and x["ledger_empty_after_unlock"] for x in exact))
            checks.check(f"async H2D copy from torch pinned memory reads back bit-exact ({set_name})",
                         all(x["bit_exact"] for x in rounding))
            if stats_ok:
                checks.check(f"torch pinned blocks: page-locked bytes >= planned bytes ({set_name})",
                             all(x["ratio"] >= 1.0 for x in rounding),
                             f"ratio {row['ratio_rounding']:.4f} (est from powers of two "
                             f"{row['est_ratio_rounding']:.4f})")
                checks.check(f"freeing returns torch's pinned blocks once its cache is emptied ({set_name})",
                             all(x["allocator_back_to_start"] for x in rounding))
            else:
                for name in (f"torch pinned blocks: page-locked bytes >= planned bytes ({set_name})",
                             f"freeing returns torch's pinned blocks once its cache is emptied ({set_name})"):
                    checks.skip(name, "skipped: this torch has no host_memory_stats or _host_emptyCache")
        else:
            row["rounding"] = row["exact"] = None
            row["ratio_exact"] = row["ratio_rounding"] = None
            for name in _host_cuda_checks(set_name):
                checks.skip(name)
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
    return out


def _fmt(value, digits: int = 1) -> str:
    if value is None:
        return "n/a"
    return value if isinstance(value, str) else f"{value:.{digits}f}"


# --------------------------------------------------------------------------- CUDA load paths

NO_VLLM = "skipped: vLLM is not importable here"
CUDA_PATH_CHECKS = (
    "registered memory is_pinned and its UVA view reads it in place (no private copy)",
    "vLLM's device_loading_context on a host embedding: storage and pinned bytes recorded",
    "keep_on_host: vLLM's post-processing leaves a host embedding's storage and pinned bytes alone",
    "hot layers after the exact prefetch offloader's post_init: page-locked within 1.05x, torch's cache empty",
    "hot layers after post_init compute what the resident layers do",
)


def _vllm_patched_tp():
    """vLLM's layer modules with a one-rank tensor-parallel group (no process group here)."""
    import vllm.model_executor.layers.vocab_parallel_embedding as vpe
    import vllm.model_executor.parameter as parameter

    for module in (vpe, parameter):
        module.get_tensor_model_parallel_rank = lambda: 0
        module.get_tensor_model_parallel_world_size = lambda: 1
    return vpe


def make_layers(num_hidden_layers: int, prefix: str, offloader, build) -> list:
    """The shape of vLLM's make_layers (the glue's offloader reads these locals)."""
    start_layer, end_layer = 0, num_hidden_layers
    return offloader.wrap_modules(build(i) for i in range(start_layer, end_layer))


def cuda_paths_section(cfg: dict, cuda: bool, device: torch.device, checks: Checks) -> dict:
    """The three load paths the CPU build never takes (issue 16): registration and the UVA
    view, vLLM's device round trip in post-processing, and the prefetch offloader's pinned
    copies around post_init. Figures first, then the asserts on them."""
    out: dict = {}
    if not cuda:
        for name in CUDA_PATH_CHECKS:
            checks.skip(name)
        return out
    # 1. cudaHostRegister in place, is_pinned(), and a UVA view with no private copy.
    n = cfg["vocab"] * cfg["hidden"] // 8
    table = torch.empty(n, dtype=torch.bfloat16)
    table.copy_(torch.arange(n, dtype=torch.float32).remainder_(251).to(torch.bfloat16))
    ledger = PageLockedLedger(PinPolicy.decide(cuda=True))
    _host_empty_cache()
    host_before, dev_before = _host_allocator_bytes(), torch.cuda.memory_allocated(device)
    ledger.lock(table, "table")
    pinned = table.is_pinned()
    try:
        try:
            from vllm.utils.torch_utils import get_accelerator_view_from_cpu_tensor as view_of
            out["uva_view_by"] = "vllm"
        except ImportError:
            view_of, out["uva_view_by"] = cuda_view_of_pinned, "torch"
        view = view_of(table)
        torch.cuda.synchronize()
        table[0] = 7.0  # a write on the host must show through the view: the same memory
        in_place = (view.device.type == "cuda" and view.data_ptr() == table.data_ptr()
                    and float(view[0].item()) == 7.0 and torch.equal(view[1:4096].cpu(), table[1:4096]))
        out["uva"] = {"bytes": n * 2, "is_pinned": pinned, "same_address": view.data_ptr() == table.data_ptr(),
                      "torch_pinned_delta": (_host_allocator_bytes() or 0) - (host_before or 0),
                      "device_allocated_delta": torch.cuda.memory_allocated(device) - dev_before}
        checks.check(CUDA_PATH_CHECKS[0], pinned and in_place and out["uva"]["torch_pinned_delta"] == 0
                     and out["uva"]["device_allocated_delta"] == 0, json.dumps(out["uva"]))
        del view
    except Exception as err:  # noqa: BLE001 - recorded, the run goes on
        checks.check(CUDA_PATH_CHECKS[0], False, repr(err))
    ledger.unlock(table.untyped_storage().data_ptr())
    del table
    try:
        vpe = _vllm_patched_tp()
        import vllm.model_executor.model_loader.utils as loader_utils

        from selective_offload.vllm_glue.host_resident import keep_on_host
    except ImportError:
        for name in CUDA_PATH_CHECKS[1:]:
            checks.skip(name, NO_VLLM)
        return out
    # 2. vLLM's round trip on a host embedding, then the same load with keep_on_host.
    config = type("Cfg", (), {"word_embeddings_untied_by_checkpoint": False, "quantization": None,
                              "dtype": torch.bfloat16})()
    for label, keep in (("vllm", False), ("keep_on_host", True)):
        try:
            with torch.device("cpu"):
                layer = vpe.VocabParallelEmbedding(cfg["vocab"] // 8, cfg["hidden"], params_dtype=torch.bfloat16)
            model = nn.ModuleDict({"embed_tokens": layer})
            if keep:
                keep_on_host(list(model.named_modules()), device)
            _host_empty_cache()
            before = (_ptr(layer.weight), layer.weight.is_pinned(), _host_allocator_bytes())
            loader_utils.process_weights_after_loading(model, config, device)
            gc.collect()
            after = (_ptr(layer.weight), layer.weight.is_pinned(), _host_allocator_bytes())
            out[f"round_trip_{label}"] = {
                "bytes": _nbytes(layer.weight), "storage_changed": before[0] != after[0],
                "pinned_after": after[1], "device": str(layer.weight.device),
                "torch_pinned_delta": (after[2] or 0) - (before[2] or 0)}
            row = out[f"round_trip_{label}"]
            ok = (row["device"] == "cpu" and not row["storage_changed"] and row["torch_pinned_delta"] == 0
                  if keep else row["device"] == "cpu")
            checks.check(CUDA_PATH_CHECKS[2 if keep else 1], ok, json.dumps(row))
            del layer, model
        except Exception as err:  # noqa: BLE001
            checks.check(CUDA_PATH_CHECKS[2 if keep else 1], False, repr(err))
    # 3. Page-locked bytes around the prefetch offloader's post_init, small layers.
    try:
        from vllm.model_executor.offloader.prefetch import PrefetchOffloader

        from selective_offload.vllm_glue.offloader import make_exact_prefetch_offloader
    except ImportError:
        for name in CUDA_PATH_CHECKS[3:]:
            checks.skip(name, NO_VLLM)
        return out
    try:
        hidden = cfg["hot_rows"]
        torch.manual_seed(0)
        reference = [nn.Sequential(nn.Linear(hidden, 3 * hidden), nn.GELU(), nn.Linear(3 * hidden, hidden)).to(
            device, torch.bfloat16) for _ in range(4)]
        ledger = PageLockedLedger(PinPolicy.decide(cuda=True))
        _host_empty_cache()
        base_pinned = _host_allocator_bytes() or 0
        offloader = make_exact_prefetch_offloader(PrefetchOffloader, [1, 3], 1, "model.layers", 4, page_locked=ledger)
        copies = [None] * 4

        def build(i):
            layer = nn.Sequential(nn.Linear(hidden, 3 * hidden), nn.GELU(), nn.Linear(3 * hidden, hidden)).to(
                device, torch.bfloat16)
            layer.load_state_dict(reference[i].state_dict())
            copies[i] = layer
            return layer

        layers = nn.ModuleList(make_layers(4, "model.layers", offloader, build))
        host = sum(_nbytes(p) for i in (1, 3) for p in layers[i].parameters())
        after_wrap = (_host_allocator_bytes() or 0) - base_pinned
        offloader.post_init()
        torch.cuda.synchronize()
        after = (_host_allocator_bytes() or 0) - base_pinned
        locked = ledger.locked_bytes
        out["prefetch"] = {"host_bytes": host, "torch_pinned_after_wrap": after_wrap,
                           "torch_pinned_after_post_init": after, "registered_after_post_init": locked,
                           "ratio": (locked + after) / host}
        checks.check(CUDA_PATH_CHECKS[3], after == 0 and host <= locked + after <= 1.05 * host,
                     json.dumps(out["prefetch"]))
        from vllm.model_executor.offloader import base as offloader_base

        x = torch.randn(8, hidden, device=device, dtype=torch.bfloat16)
        y, ref = x, x
        previous = offloader_base.get_offloader()
        offloader_base.set_offloader(offloader)  # the prefetch ops find it there
        try:
            with torch.no_grad():
                for i in range(4):
                    y, ref = layers[i](y), reference[i](ref)
            torch.cuda.synchronize()
        finally:
            offloader_base.set_offloader(previous)
        checks.check(CUDA_PATH_CHECKS[4], torch.equal(y, ref), f"max abs diff {float((y - ref).abs().max())}")
    except Exception as err:  # noqa: BLE001
        recorded = {r["name"] for r in checks.rows}
        for name in CUDA_PATH_CHECKS[3:]:
            if name not in recorded:
                checks.check(name, False, repr(err))
    return out


def _table(headers: list[str], rows: list[list]) -> list[str]:
    return [
        "| " + " | ".join(headers) + " |",
        "|" + "|".join("---" for _ in headers) + "|",
        *("| " + " | ".join(str(cell) for cell in row) + " |" for row in rows),
        "",
    ]


def _measures(title: str, values: dict) -> str:
    rows = [[k, _fmt(v, 4) if isinstance(v, float) or v is None else v] for k, v in values.items()]
    return "\n".join([title, "", *_table(["measure", "value"], rows)])


def markdown(results: dict) -> str:
    cuda, emb, tp = results["cuda"], results["embedding"], results["tp_lookup"]
    setting = "CUDA" if cuda else "no CUDA: CPU figures, device asserts skipped"
    lines = [
        f"# Offload mechanism check: {results['device']}",
        "",
        f"Date {results['date']}, torch {results['torch']}, "
        f"{'small' if results['small'] else 'full'} sizes, {setting}; whole run "
        f"{results['wall_s']:.0f} s. Times are medians of per-call wall time with the device "
        "synchronised around each call (measured, not estimated)."
        + ("" if cuda else f" CPU run with {results['cpu_threads']} torch thread: the figures "
           "show that the code runs, not what a GPU does."),
        "",
        "## Asserts",
        "",
        *_table(["check", "status", "detail"],
                [[r["name"], r["status"], r["detail"]] for r in results["asserts"]]),
        f"## Embedding gather ({emb['vocab']} x {emb['hidden']} bf16)",
        "",
        *_table(
            ["tokens/step", "bytes moved", "device gather us", "host gather us",
             "UVA gather us", "UVA kernel only us"],
            [[r["tokens"], r["row_bytes_moved"], _fmt(r["device_gather_us"]),
              _fmt(r["host_gather_us"]), _fmt(r["uva_gather_us"]),
              _fmt(r["uva_kernel_only_us"])] for r in emb["gather"]],
        ),
        _measures(f"## Masked TP lookup, host shard against device shard "
                  f"(rank {tp['rank']} of {tp['tp_size']}: rows {tp['shard_rows'][0]}-"
                  f"{tp['shard_rows'][1] - 1} of {tp['vocab']} x {tp['hidden']} bf16)",
                  {k: v for k, v in tp.items() if k != "lookup"}),
        *_table(
            ["tokens/step", "ids in the shard", "masked device lookup us",
             "masked host lookup us"],
            [[r["tokens"], r["ids_in_shard"], _fmt(r["masked_device_lookup_us"]),
              _fmt(r["masked_host_lookup_us"])] for r in tp["lookup"]],
        ),
        _measures("## A drafter's shared embedding and LM head (built on the host, "
                  "freed when replaced by the target's)", results["drafter"]),
        _measures("## Explicit-device and shared allocations inside a cold module",
                  results["explicit_device"]),
        _measures("## CUDA load paths (registration and UVA view, post-processing round trip, "
                  "prefetch offloader post_init)",
                  {k: json.dumps(v) for k, v in results.get("cuda_paths", {}).items()}),
        "## Tower onload vs size",
        "",
        *_table(
            ["blocks", "tower MB", "resident us", "on-demand us", "overhead us",
             "onload GB/s", "peak transient MB (ledger)", "peak device MB (measured)"],
            [[r["depth"], _fmt(r["tower_bytes"] / 1e6), _fmt(r["resident_forward_us"], 0),
              _fmt(r["on_demand_forward_us"], 0), _fmt(r["onload_overhead_us"], 0),
              _fmt(r["effective_onload_gb_per_s"], 2),
              _fmt(r["peak_transient_device_bytes_ledger"] / 1e6),
              _fmt(None if r["peak_device_bytes_measured"] is None
                   else r["peak_device_bytes_measured"] / 1e6)]
             for r in results["tower"]],
        ),
        "## Copy bandwidth",
        "",
        *_table(["measure", "value"],
                [[k, _fmt(v, 2) if isinstance(v, float) else v]
                 for k, v in results["bandwidth"].items()]),
        *host_memory_markdown(results["host_memory"], cuda),
        *routed_experts_markdown(results.get("routed_experts")),
    ]
    return "\n".join(lines)


def routed_experts_markdown(r: dict | None) -> list[str]:
    if not r:
        return []
    from _common import routed_expert_rows

    e = r["reads"]
    return [f"## Routed experts: k of E through a UVA view against a whole-layer copy ({r['shape']}: "
            f"{e['num_experts']} experts top-{e['experts_per_token']}, {e['expert_bytes'] / 1e6:.2f} MB an expert; "
            f"{e['uva']})", "", *_table(*routed_expert_rows(e))]


def host_memory_markdown(hm: dict, cuda: bool) -> list[str]:
    def med(rows, key, digits=2):
        vals = [r[key] for r in rows or [] if r.get(key) is not None]
        return _fmt(statistics.median(vals), digits) if vals else "n/a"

    def ratio(value):
        return _fmt(value, 4)

    rows = []
    for r in hm["sets"]:
        a, b = r["rounding"], r["exact"]
        rows.append([r["set"], r["tensors"], _fmt(r["planned_bytes"] / 1e6),
                     _fmt(a[0]["page_locked_bytes"] / 1e6) if a and a[0]["page_locked_bytes"] is not None else "n/a",
                     ratio(r["ratio_rounding"]), ratio(r["est_ratio_rounding"]),
                     med(a, "alloc_and_lock_s", 3), med(a, "h2d_gb_per_s", 1),
                     _fmt(b[0]["page_locked_bytes"] / 1e6) if b else "n/a", ratio(r["ratio_exact"]),
                     med(b, "alloc_and_lock_s", 3), med(b, "h2d_gb_per_s", 1),
                     ratio(r["recorded"]["ratio"])])
    o = hm["overall"]
    rows.append(["**overall**", sum(r["tensors"] for r in hm["sets"]), _fmt(o["planned_bytes"] / 1e6),
                 "", ratio(o["ratio_rounding"]), ratio(o["est_ratio_rounding"]), "", "", "",
                 ratio(o["ratio_exact"]), "", "", ""])
    rss = []
    for r in hm["sets"]:
        for key, label in (("rounding", "(a) torch pinned"), ("exact", "(b) registered")):
            for x in r[key] or []:
                rss.append([r["set"], label, x["order"], _fmt(x["rss_growth_at_alloc_mb"]),
                            _fmt(x["rss_growth_after_fill_mb"]), _fmt(x["alloc_and_lock_s"], 3),
                            _fmt(x["release_s"], 3), _fmt(x["largest_enqueue_us"], 0),
                            _fmt(x["largest_copy_us"], 0)])
    return [
        "## Page-locked host memory against planned host bytes",
        "",
        "Each set allocated two ways, freed in between: (a) torch's caching host allocator "
        "(`torch.empty(..., pin_memory=True)`; page-locked bytes from "
        "`torch.cuda.host_memory_stats()[\"allocated_bytes.current\"]` before and after, its cache "
        "emptied first: the rounded block sizes); (b) pageable `torch.empty` registered in place "
        "through `PageLockedLedger(PinPolicy.decide(cuda=True))` (`cudaHostRegister`; bytes from "
        "the ledger). Ratio = page-locked / planned bytes. `est` ratio: every tensor rounded up "
        "to a power of two (what torch's allocator is documented to do). The recording-registrar "
        "column is the ledger's bookkeeping with a stand-in registrar (runs without CUDA). Times "
        f"are medians over {hm['repeats']} repetitions in alternating order (alloc+lock: "
        "allocating and page-locking, first touch included; H2D: every tensor of the set copied "
        "with `non_blocking=True`, one sync; the largest copy's enqueue is timed queued behind a "
        "~25 ms GPU spin, `torch.cuda._sleep`, which an async copy does not wait for). "
        f"PYTORCH_ALLOC_CONF: {hm['pytorch_alloc_conf'] or 'unset'}."
        + ("" if cuda else " No CUDA here: (a) and (b) are skipped, the est and recording columns "
           "still run (small form: every dimension divided by " f"{hm['shrink']})."),
        "",
        *_table(["set", "tensors", "planned MB", "(a) page-locked MB", "ratio_rounding",
                 "est ratio (pow2)", "(a) alloc+lock s", "(a) H2D GB/s", "(b) page-locked MB",
                 "ratio_exact", "(b) alloc+lock s", "(b) H2D GB/s", "recording registrar ratio"],
                rows),
        *(["Per run: process RSS growth (informational), times, and the largest tensor's copy "
           "call returning (enqueue) against the copy completing.", "",
           *_table(["set", "way", "order", "RSS growth at alloc MB", "RSS growth after fill MB",
                    "alloc+lock s", "release s", "largest copy enqueue us", "largest copy done us (behind the spin)"],
                   rss)] if rss else []),
    ]


def routed_experts_section(cfg: dict, cuda: bool, device: torch.device, checks: Checks) -> dict:
    """Routed experts the glue's way (page-locked in place, a marked UVA view on the same
    Parameter), checked, then k-of-E reads timed against a whole-layer copy."""
    from _common import EXPERT_SHAPES, routed_expert_reads
    from selective_offload.vllm_glue.experts import UVA_MARKER, mark_uva_view

    shape = EXPERT_SHAPES["qwen3-30b-a3b"]
    num, k = shape["num_experts"], shape["experts_per_token"]
    hidden = 1024
    rows = max(1, int(shape["expert_bytes"] * cfg["expert_scale"]) // (2 * hidden))
    out: dict = {"shape": "qwen3-30b-a3b", "num_experts": num, "experts_per_token": k,
                 "expert_bytes": rows * hidden * 2}
    names = ("routed experts page-locked in place at their exact size",
             "the expert parameter becomes a marked UVA view, allocating no device memory",
             "k experts read through the view equal reads from a device copy")
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
        checks.check(names[0], locked and ledger.locked_bytes == host.numel() * host.element_size(),
                     f"{ledger.locked_bytes} B")
        checks.check(names[1], param.is_cuda and getattr(param, UVA_MARKER, False) and grew == 0, f"grew {grew} B")
        checks.check(names[2], same, f"experts {ids}")
        out.update(locked_bytes=ledger.locked_bytes, device_growth_bytes=grew, reads_equal=same)
        del resident
        param.data = host  # drop the view before unlocking
        ledger.unlock(host.untyped_storage().data_ptr())
        del param, host
        gc.collect()
    else:
        for name in names:
            checks.skip(name)
    reads = routed_expert_reads(num, k, rows * hidden * 2, cuda, tokens=(1, 4, 16), iters=cfg["iters"],
                                hidden=hidden, device=device)
    checks.check("routed-expert reads through the view equal device-resident reads (timed section)",
                 all(r["uva_equals_resident"] for r in reads["rows"]))
    out["reads"] = reads
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="small sizes (automatic without CUDA)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args(argv)

    cuda = torch.cuda.is_available()
    small = args.small or not cuda
    cfg = SMALL if small else FULL
    if not cuda:
        # Multi-threaded CPU kernels stall for milliseconds when another process holds a
        # core (shared CI machines); one thread gives figures that mean something.
        torch.set_num_threads(1)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    name = device_name(cuda)
    date = dt.datetime.now(dt.timezone.utc).date().isoformat()
    checks = Checks()
    started = time.perf_counter()
    results = {
        "device": name, "date": date, "torch": torch.__version__, "cuda": cuda, "small": small,
        "cpu_threads": torch.get_num_threads(),
        "config": {k: list(v) if isinstance(v, tuple) else v for k, v in cfg.items()},
    }
    results["embedding"] = embedding_section(cfg, cuda, device, checks)
    results["tp_lookup"] = tp_lookup_section(cfg, cuda, device, checks)
    results["drafter"] = drafter_section(cfg, cuda, device, checks)
    results["explicit_device"] = explicit_device_section(cfg, cuda, device, checks)
    results["tower"] = tower_section(cfg, cuda, device, checks)
    results["bandwidth"] = bandwidth_section(cfg, cuda, device)
    results["host_memory"] = host_memory_section(cfg, cuda, device, checks)
    results["cuda_paths"] = cuda_paths_section(cfg, cuda, device, checks)
    results["routed_experts"] = routed_experts_section(cfg, cuda, device, checks)
    results["asserts"] = checks.rows
    results["wall_s"] = time.perf_counter() - started

    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")[:40]
    stem = f"mechanism-{'cuda' if cuda else 'cpu'}-{slug}-{date}"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out / f"{stem}.md").write_text(markdown(results))
    skipped = sum(r["status"].startswith("skipped") for r in checks.rows)
    print(f"wrote {args.out / stem}.{{json,md}} in {results['wall_s']:.1f} s; "
          f"{'FAILED asserts' if checks.failed else 'all run asserts passed'}, {skipped} skipped")
    return 1 if checks.failed else 0


if __name__ == "__main__":
    sys.exit(main())
