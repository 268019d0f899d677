"""The probe's host-compute measurements: the host CPU kernel's rate per format, the
threads it ran with, the host's read rate, and one layer's hand-off.

The kernels are ``selective_offload.cpu_kernels``' (``moe``, ``read_gbps``,
``unavailable_reason``), imported inside :func:`measure_host_compute`: a build without
them, or a format whose kernel is unavailable here, is skipped with a one-line reason the
probe prints, and the profile then holds no rate for it (planning assumes the reference
host's and says so). Every format whose kernel is served here is timed, claimed by the
committed benchmark or not: with the read rate beside them, the rates decide the claim of a
plan made from this profile (``cpu_kernels.claimed.verdict``). The thread count is the physical cores of one NUMA node (one pool:
the kernels of all host-compute layers share it), as :func:`physical_cores_of_one_node` finds them.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

#: A layer of a routed-experts shape the kernel rate is measured on (hidden, expert
#: intermediate, experts, experts per token): Qwen3-30B-A3B's, small enough to time quickly
#: and large enough (128 experts of 3 x 2048 x 768) that a batch-1 step reads far more than
#: the CPU's caches hold.
KERNEL_SHAPE = (2048, 768, 128, 8)
QUICK_KERNEL_SHAPE = (1024, 512, 32, 4)


def _cpus(text: str) -> set[int]:
    """A Linux cpulist (``0-3,8,10-11``) as a set."""
    out: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def physical_cores_of_one_node(sys_root: str = "/sys") -> int:
    """Physical cores (not hyperthreads) of NUMA node 0 that this process may run on: the
    one pool host-compute runs in. Falls back to the CPUs this process may use."""
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    root = Path(sys_root)
    try:
        node = _cpus((root / "devices/system/node/node0/cpulist").read_text())
    except (OSError, ValueError):
        node = set(allowed)
    cores = set()
    for cpu in sorted(node & allowed):
        topo = root / f"devices/system/cpu/cpu{cpu}/topology"
        try:
            cores.add((int((topo / "physical_package_id").read_text()), int((topo / "core_id").read_text())))
        except (OSError, ValueError):
            cores.add((0, cpu))
    return max(1, len(cores))


def _median(fn: Callable[[], Any], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2]


def handoff_s(device: Any, hidden: int, repeats: int) -> float:
    """One layer's hand-off on ``device``: a token's hidden states and top-k to pinned host
    memory, a synchronisation, and the weighted sum back (median seconds)."""
    import torch

    x = torch.zeros(1, hidden, dtype=torch.bfloat16, device=device)
    ids = torch.zeros(1, 8, dtype=torch.int32, device=device)
    host_x = torch.empty(1, hidden, dtype=torch.bfloat16, pin_memory=True)
    host_ids = torch.empty(1, 8, dtype=torch.int32, pin_memory=True)
    back = torch.empty(1, hidden, dtype=torch.bfloat16, device=device)

    def once():
        host_x.copy_(x, non_blocking=True)
        host_ids.copy_(ids, non_blocking=True)
        torch.cuda.synchronize(device)
        back.copy_(host_x, non_blocking=True)
        torch.cuda.synchronize(device)

    return _median(once, repeats)


def measure_host_compute(*, device: Any = None, quick: bool = False, repeats: int = 5,
                         say: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The profile's host-compute fields (``cpu_kernel_gbps``, ``cpu_threads``,
    ``host_read_gbps``, ``handoff_s``) measured here; what cannot be measured is left out
    (empty, ``None``) and ``say`` gets one line saying why (default: printed to stderr)."""
    if say is None:
        def say(line: str) -> None:
            print(line, file=sys.stderr)
    out: dict[str, Any] = {"cpu_kernel_gbps": {}, "cpu_threads": None, "host_read_gbps": None, "handoff_s": None}
    if device is not None and getattr(device, "type", None) == "cuda":
        try:
            out["handoff_s"] = handoff_s(device, KERNEL_SHAPE[0], repeats)
        except (RuntimeError, AssertionError) as exc:
            say(f"probe: hand-off not measured: {str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__}")
    threads = physical_cores_of_one_node()
    try:
        from .. import cpu_kernels
        from ..cpu_kernels.claimed import CLAIMED

        moe, read_gbps, unavailable = cpu_kernels.moe, cpu_kernels.read_gbps, cpu_kernels.unavailable_reason
    except (ImportError, AttributeError) as exc:
        say(f"probe: host CPU kernels not measured: selective_offload.cpu_kernels is not available here "
            f"({str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__})")
        return out
    out["cpu_threads"] = threads
    try:
        out["host_read_gbps"] = float(read_gbps(threads))
    except Exception as exc:  # the kernels' own failure, reported in one line, never a traceback
        say(f"probe: host read rate not measured: {type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}")
    hidden, inter, experts, k = QUICK_KERNEL_SHAPE if quick else KERNEL_SHAPE
    for fmt in CLAIMED:
        reason = unavailable(fmt)
        if reason:
            say(f"probe: CPU kernel for {fmt} skipped: {str(reason).splitlines()[0][:160]}")
            continue
        try:
            out["cpu_kernel_gbps"][fmt] = _kernel_gbps(moe, fmt, hidden, inter, experts, k, threads, repeats)
        except Exception as exc:  # an API or kernel failure: one line, the other formats still measured
            say(f"probe: CPU kernel for {fmt} not measured: {type(exc).__name__}: "
                f"{str(exc).splitlines()[0][:120] if str(exc) else ''}")
    return out


def _kernel_gbps(moe: Callable[..., Any], fmt: str, hidden: int, inter: int, experts: int, k: int,
                 threads: int, repeats: int) -> float:
    """GB/s of expert weights the kernel reads at batch 1: the bytes of the ``k`` experts one
    token uses, over the median time of one call, on random weights of that shape and new
    random experts each call (so no expert is read from the caches twice running)."""
    import torch

    from ..cpu_kernels import Activation
    from ..cpu_kernels.weights import random_experts

    weights = random_experts(fmt, experts, hidden, inter)
    x = torch.randn(1, hidden).to(torch.bfloat16)
    picks = torch.rand(1, k)
    g = torch.Generator().manual_seed(1)
    choices = [torch.randperm(experts, generator=g)[:k].view(1, k).to(torch.int32) for _ in range(max(repeats, 1) + 1)]
    turn = iter(range(1 << 30))

    def run():
        moe(x, choices[next(turn) % len(choices)], picks, weights, Activation("silu"), threads=threads)

    return k * weights.expert_bytes / _median(run, repeats) / 1e9
