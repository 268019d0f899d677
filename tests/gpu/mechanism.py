"""What the GPU mechanism tests share: the sizes they run at, the named checks they record,
the skips that say why, and the small probes of device and host memory they all use.

Why a module of its own: these tests run two ways. Under pytest (the suite, on any
machine: the CPU runs everything that needs no CUDA, at the small sizes), and under
``benchmarks/mechanism/`` on a GPU machine whose image may have no pytest, which
runs them through ``runner.py`` and writes every check and figure to the results files.
Both need the same state: :data:`RUN` (the sizes, the figures each section's fixture
records, the checks each test records). Each ``test_*.py`` here is one mechanism; its
fixture measures (once per module: the tables are gigabytes at full size) and its tests
assert on what was measured, each check by the name the results files carry.

A check is an assert with a name: :meth:`Checks.check` records it, passed or FAILED, and
raises on failure, so the test fails as a plain ``assert`` would. A test skipped as a
whole (no CUDA, no vLLM) lists the checks it would have made with :func:`records`, so the
results still name each of them, skipped, with the reason's head (the text before its
first ``": "``) as the status: ``"skipped: no CUDA device"``.
"""

from __future__ import annotations

import gc
import os
import weakref
from pathlib import Path
from typing import Callable, Iterable

import pytest
import torch

CUDA = torch.cuda.is_available()

TOKENS_PER_STEP = (1, 16, 256, 4096)
# vocab x hidden is also the drafter's embedding and LM head, and the table whose TP shard
# (1 / tp_size of the rows) the masked lookup reads; cold/hot/workspace/rope/table size the
# explicit-device section (a 256 MiB cold weight, FlashInfer's 128 MiB ViT workspace, a
# 131072 x 128 float32 rotary cache).
FULL = {"vocab": 248320, "hidden": 5120, "tower_hidden": 1280, "tower_depths": (4, 8, 16, 32),
        "tower_tokens": 1024, "bandwidth_bytes": 1 << 30, "iters": 30, "tp_size": 4,
        "cold_rows": 8192, "cold_cols": 16384, "hot_rows": 5120, "hot_cols": 5120,
        "workspace_bytes": 128 << 20, "rope_positions": 131072, "rope_dim": 128,
        "table_elems": 4 << 20, "host_shrink": 1, "host_repeats": 2, "expert_scale": 1.0,
        # Qwen3-30B-A3B's MoE layer and attention (the fused-MoE and arena checks), an FP8
        # (N, K) weight for CUTLASS's scaled matmul with M tokens, the small heap tensors.
        "moe_experts": 128, "moe_hidden": 2048, "moe_inter": 768, "moe_top_k": 8, "moe_prefill": 2048,
        "hot_q": 4096, "hot_kv": 512, "head_dim": 128, "fp8_n": 4096, "fp8_k": 2048, "fp8_m": 256,
        "heap_scales": 64}
SMALL = {"vocab": 32768, "hidden": 1024, "tower_hidden": 256, "tower_depths": (2, 4, 8),
         "tower_tokens": 64, "bandwidth_bytes": 64 << 20, "iters": 10, "tp_size": 4,
         "cold_rows": 1024, "cold_cols": 1024, "hot_rows": 512, "hot_cols": 512,
         "workspace_bytes": 1 << 20, "rope_positions": 4096, "rope_dim": 64,
         "table_elems": 1 << 16, "host_shrink": 8, "host_repeats": 2, "expert_scale": 0.01,
         "moe_experts": 8, "moe_hidden": 64, "moe_inter": 32, "moe_top_k": 2, "moe_prefill": 64,
         "hot_q": 128, "hot_kv": 32, "head_dim": 16, "fp8_n": 256, "fp8_k": 128, "fp8_m": 32,
         "heap_scales": 64}
NO_CUDA_REASON = "no CUDA device"
NO_VLLM_REASON = "vLLM is not importable here"
NO_CUDA = f"skipped: {NO_CUDA_REASON}"
NO_VLLM = f"skipped: {NO_VLLM_REASON}"


class Checks:
    """Named asserts, recorded in order (the results' "asserts" table); a failed one raises."""

    def __init__(self) -> None:
        self.rows: list[dict] = []

    def check(self, name: str, ok: bool, detail: str = "") -> None:
        self.rows.append({"name": name, "status": "passed" if ok else "FAILED", "detail": detail})
        print(f"[{'ok' if ok else 'FAIL'}] {name} {detail}")
        if not ok:
            raise AssertionError(f"{name}: {detail}" if detail else name)

    def skip(self, name: str, why: str = NO_CUDA) -> None:
        """A check not made, and why (the whole test goes on: for one case of several)."""
        self.rows.append({"name": name, "status": why, "detail": ""})
        print(f"[skip] {name}: {why}")

    @property
    def failed(self) -> bool:
        return any(r["status"] == "FAILED" for r in self.rows)


class Run:
    """One run of the mechanism tests: the sizes, the sections' figures, the checks."""

    def __init__(self) -> None:
        # Under pytest the small sizes, unless SELECTIVE_OFFLOAD_CHECK_SIZES=full on CUDA;
        # the runner sets ``small`` from its own arguments before any test runs.
        self.small = os.environ.get("SELECTIVE_OFFLOAD_CHECK_SIZES", "small") != "full" or not CUDA
        self.results: dict = {}
        self.checks = Checks()

    @property
    def config(self) -> dict:
        return SMALL if self.small else FULL


RUN = Run()


def needs_cuda(why: str):
    """Skip without CUDA, saying what needs it."""
    return pytest.mark.skipif(not CUDA, reason=f"{NO_CUDA_REASON}: {why}")


def records(*names: str | Callable[[dict], Iterable[str]]):
    """The checks a test makes, named so a skipped test still lists them; a callable gives
    names that depend on the sizes (one per tower depth)."""

    def mark(test):
        test.records = names
        return test

    return mark


def recorded_names(test, cfg: dict) -> list[str]:
    out: list[str] = []
    for n in getattr(test, "records", ()):
        out.extend([n] if isinstance(n, str) else n(cfg))
    return out


def skip_status(reason: str) -> str:
    """A skip's reason as the status of each check it skips: its head, before ``": "``."""
    return "skipped: " + reason.split(": ", 1)[0]


# ---------------------------------------------------------------- probes shared by the tests

def sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.shape, a.dtype) == (b.shape, b.dtype) and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    )


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def storage_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def storage_ref(t: torch.Tensor):
    """A weak reference that dies when ``t``'s storage is freed (torch keeps one Python
    object per storage alive exactly as long as the storage), else the tensor's own."""
    try:
        ref = weakref.ref(t.untyped_storage())
    except TypeError:  # a torch without weak references to storages
        ref = None
    if ref is None or ref() is None:  # the storage's Python object is not kept alive
        ref = weakref.ref(t)
    return ref


def rss_bytes() -> int | None:
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def allocated(cuda: bool) -> int | None:
    if not cuda:
        return None
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def host_allocator_bytes() -> int | None:
    """torch's caching host allocator's own count: bytes of the blocks it owns (rounded
    block sizes, cached blocks included), or None where torch gives no count."""
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if stats is None:
        return None
    try:
        return int(stats().get("allocated_bytes.current", 0))
    except (RuntimeError, AttributeError):
        return None


def host_empty_cache() -> bool:
    empty = getattr(torch._C, "_host_emptyCache", None)
    if empty is None:
        return False
    torch.cuda.synchronize()
    gc.collect()
    empty()
    return True


def clear_pending_cuda_error(device: torch.device) -> None:
    """A failed ``cudaHostRegister`` leaves its error pending in the CUDA runtime, and
    torch's next error check reports it against an unrelated call: clear it as the
    project does (``page_locked.clear_pending_cuda_error``), else let one small op
    consume it."""
    from selective_offload.wrappers.page_locked import clear_pending_cuda_error as clear

    clear()
    try:
        torch.zeros(1, device=device).add_(1)
        torch.cuda.synchronize()
    except RuntimeError:
        pass
