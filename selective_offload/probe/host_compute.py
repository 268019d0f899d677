"""The probe's host-compute measurements: the host CPU kernel's rate per format, the
threads it ran with, the host's read rate, and one layer's hand-off.

The kernels are ``selective_offload.cpu_kernels``', timed by its ``timing`` module as the
committed benchmark times them, imported inside :func:`measure_host_compute`: a build without
them, or a format whose kernel is unavailable here, is skipped with a one-line reason the
probe prints, and the profile then holds no rate for it (planning assumes the reference
host's and says so). Every format whose kernel is served here is timed, claimed by the
committed benchmark or not: with the read rate beside them, the rates decide the claim of a
plan made from this profile (``cpu_kernels.claimed.verdict``). The thread count is the physical cores of one NUMA node (one pool:
the kernels of all host-compute layers share it), as :func:`physical_cores_of_one_node` finds them.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any, Callable

#: Counted rounds per format (the committed benchmark's calls per measurement), and with
#: ``--quick``.
CALLS, QUICK_CALLS = 41, 3
#: The hidden size of the hand-off's token (Qwen3-30B-A3B's).
KERNEL_HIDDEN = 2048


def physical_cores_of_one_node(sys_root: str = "/sys", allowed: set[int] | None = None) -> int:
    """Physical cores (not hyperthreads) of the NUMA node this process runs on: the one pool
    host-compute runs in (``cpu_kernels.cores.cores_of_one_node``: the node vLLM binds a
    worker to, not node 0 by rule); its threads are pinned to those cores."""
    from ..cpu_kernels.cores import cores_of_one_node

    return len(cores_of_one_node(sys_root, allowed))


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
    (empty, ``None``) and ``say`` gets one line saying why (default: printed to stderr).

    The kernel rates and the read rate come from the same alternating rounds as the
    committed benchmark's (``cpu_kernels.timing``: each format's layer, new random experts
    every call, the first rounds not counted), so the ratio a plan made from this profile is
    claimed by is measured as the committed claim is; the read rate is the median of every
    format's rounds. ``quick``: the tiny layers and a few rounds (the rates understated)."""
    if say is None:
        def say(line: str) -> None:
            print(line, file=sys.stderr)
    out: dict[str, Any] = {"cpu_kernel_gbps": {}, "cpu_threads": None, "host_read_gbps": None, "handoff_s": None}
    if device is not None and getattr(device, "type", None) == "cuda":
        try:
            out["handoff_s"] = handoff_s(device, KERNEL_HIDDEN, repeats)
        except (RuntimeError, AssertionError) as exc:
            say(f"probe: hand-off not measured: {str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__}")
    threads = physical_cores_of_one_node()
    try:
        import torch

        from .. import cpu_kernels
        from ..cpu_kernels import timing
        from ..cpu_kernels.claimed import CLAIMED

        read_gbps, unavailable = cpu_kernels.read_gbps, cpu_kernels.unavailable_reason
    except (ImportError, AttributeError) as exc:
        say(f"probe: host CPU kernels not measured: selective_offload.cpu_kernels is not available here "
            f"({str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__})")
        return out
    out["cpu_threads"] = threads
    read_bytes = timing.SMALL_READ_BYTES if quick else timing.READ_BYTES
    calls = QUICK_CALLS if quick else CALLS
    read_s: list[float] = []
    read_buf = None
    for fmt in CLAIMED:
        reason = unavailable(fmt)
        if reason:
            say(f"probe: CPU kernel for {fmt} skipped: {str(reason).splitlines()[0][:160]}")
            continue
        try:
            lib = cpu_kernels.library()
            if read_buf is None:
                read_buf = torch.ones(read_bytes // 4)
            base, weights, act = timing.layer_of(fmt, small=quick)
            nbytes = base["k"] * weights.expert_bytes
            rounds = timing.side_by_side(weights, act, base["k"], threads, calls, read_buf, lib)
            del weights  # the next format's layer is made next (GBs)
            out["cpu_kernel_gbps"][fmt] = rounds.kernel_gbps(nbytes)
            read_s += rounds.read_s
        except Exception as exc:  # an API or kernel failure: one line, the other formats still measured
            say(f"probe: CPU kernel for {fmt} not measured: {type(exc).__name__}: "
                f"{str(exc).splitlines()[0][:120] if str(exc) else ''}")
    try:
        out["host_read_gbps"] = (read_bytes / statistics.median(read_s) / 1e9 if read_s
                                 else float(read_gbps(threads)))
    except Exception as exc:  # the kernels' own failure, reported in one line, never a traceback
        say(f"probe: host read rate not measured: {type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}")
    return out
