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
  a device-built tower frees its device memory.

Without CUDA the meta device stands in for the GPU where placement is the point (a
drafter's own layer, an explicit-device workspace); bit-exactness, routing, ``finish``'s
ledger and the release of host storages are still checked. torch cannot swap a storage to
meta in place, so there the globally held tensor is checked to be reported as left on
the host instead.

What it measures (a table each): device gather vs host gather vs UVA gather for 1, 16, 256
and 4096 tokens per step; the masked TP lookup, device shard vs host shard; construction
figures (bytes routed, device growth, release time); tower onload time against tower
size; pinned (and pageable) host-to-device bandwidth. Times are medians of per-call wall
time with the device synchronised around each call, so they include launch and sync
overhead: measured, not estimated.

Results go to ``--out`` (default ``benchmarks/results/``) as JSON and Markdown named after
the device and the date. Without CUDA (or with ``--small``) sizes shrink so the script
finishes in seconds on two cores (2.5 to 3.7 s measured on 2 shared EPYC cores, 1 torch
thread). The full run on a GPU is an estimate, not a measurement: 1 to 3 minutes on an
H100/H200-class machine, well under 8. Its cost is host work, not the GPU: first-touching and pinning
host memory (the 2.54 GB table copied to the host and pinned twice, 5.1 GB of drafter
copies written, about 1.3 GiB more pinned for the TP shard and the cold weight; at 0.3 to
2 GB/s for first touch and pinning that is 10 to 60 s), building 2.4 G tower parameters
on the CPU (each depth twice; 10 to 30 s), and the timed loops (30 calls per figure,
about 10 s; the host gather of 4096 rows is the slowest call, tens of ms).

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

from selective_offload.wrappers import (  # noqa: E402
    HostEmbedding,
    HostGather,
    cuda_view_of_pinned,
    offload_on_demand,
)
from selective_offload.wrappers.construct_on_host import ConstructOnHost  # noqa: E402

TOKENS_PER_STEP = (1, 16, 256, 4096)
# vocab x hidden is also the drafter's embedding and LM head, and the table whose TP shard
# (1 / tp_size of the rows) the masked lookup reads; cold/hot/workspace/rope/table size the
# explicit-device section (a 256 MiB cold weight, FlashInfer's 128 MiB ViT workspace, a
# 131072 x 128 float32 rotary cache).
FULL = {"vocab": 248320, "hidden": 5120, "tower_hidden": 1280, "tower_depths": (4, 8, 16, 32),
        "tower_tokens": 1024, "bandwidth_bytes": 1 << 30, "iters": 30, "tp_size": 4,
        "cold_rows": 8192, "cold_cols": 16384, "hot_rows": 5120, "hot_cols": 5120,
        "workspace_bytes": 128 << 20, "rope_positions": 131072, "rope_dim": 128,
        "table_elems": 4 << 20}
SMALL = {"vocab": 32768, "hidden": 1024, "tower_hidden": 256, "tower_depths": (2, 4, 8),
         "tower_tokens": 64, "bandwidth_bytes": 64 << 20, "iters": 10, "tp_size": 4,
         "cold_rows": 1024, "cold_cols": 1024, "hot_rows": 512, "hot_cols": 512,
         "workspace_bytes": 1 << 20, "rope_positions": 4096, "rope_dim": 64,
         "table_elems": 1 << 16}
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
    else:
        src = torch.ones(nbytes, dtype=torch.uint8)
        us = median_us(lambda: dst.copy_(src), iters, cuda)
        result["host_to_host_copy_gb_per_s"] = nbytes / us / 1e3
        result["note"] = "no CUDA device: a host memory copy stands in for host-to-device"
    print(result)
    return result


def _fmt(value, digits: int = 1) -> str:
    if value is None:
        return "n/a"
    return value if isinstance(value, str) else f"{value:.{digits}f}"


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
    ]
    return "\n".join(lines)


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
