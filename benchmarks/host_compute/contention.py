"""The host-compute section's contention measurement (``benchmarks.host_compute`` runs it after
the overlap): the CPU kernel and copies reading host memory at the same time. What it is
for is :func:`contention`'s docstring."""

from __future__ import annotations

import statistics
import time

from benchmarks.host_compute.layers import ROUTINGS, Shape, activation, distinct, make_inputs
from benchmarks.host_compute.sections import Ctx


def contention(ctx: Ctx, shape: Shape, weights) -> dict:
    """The CPU kernel's rate at one token alone and while host memory feeds copies beside
    it, and the copies' rate alone and beside the kernel: what the estimate's rule for a
    prefetch copy run behind the CPU's time (the two reads served one after the other at
    the kernel's rate) can be checked against. ``model_ratio`` is the two rates together
    over the kernel's alone: 1.0 is what the estimate prices, above it the estimate is
    conservative, below it optimistic.

    On CUDA the copies are page-locked host to device on their own stream (the copy engine,
    as vLLM's prefetch offloader copies). Without CUDA a second thread copies host memory
    to host memory instead: a stand-in that also writes, and takes a core from the kernel."""
    if not ctx.kernel_ok:
        return {"status": ctx.kernel}
    import threading

    import torch

    from selective_offload import cpu_kernels

    act = activation(shape)
    sets = make_inputs(shape, 1, 2 if ctx.small else ROUTINGS, seed=5)
    outs = [torch.empty(1, shape.hidden, dtype=torch.float32) for _ in sets]
    threads = ctx.threads if ctx.cuda else max(1, ctx.threads - 1)
    jobs = [cpu_kernels.MoEJob(x, i, w, weights, act, out=o, threads=threads) for (x, i, w), o in zip(sets, outs)]
    read = statistics.mean(distinct(i) for _, i, _ in sets) * weights.expert_bytes
    size = (8 if ctx.small else 512) << 20
    src = torch.empty(size, dtype=torch.uint8, pin_memory=ctx.cuda).fill_(1)
    dst = torch.empty(size, dtype=torch.uint8, device=ctx.device)
    seconds = 0.05 if ctx.small else 1.0

    def kernel_loop(until) -> float:
        """Kernel calls until ``until()``; the median call's seconds."""
        secs, j = [], 0
        while not until() or len(secs) < 3:
            t0 = time.perf_counter()
            jobs[j % len(jobs)].run()
            secs.append(time.perf_counter() - t0)
            j += 1
        return statistics.median(secs)

    def timer(s: float):
        end = time.perf_counter() + s
        return lambda: time.perf_counter() > end

    kernel_alone = kernel_loop(timer(seconds))
    if ctx.cuda:
        stream = torch.cuda.Stream()

        def queue(n: int) -> float:
            """``n`` copies queued on the copy stream; the clock's start."""
            t0 = time.perf_counter()
            with torch.cuda.stream(stream):
                for _ in range(n):
                    dst.copy_(src, non_blocking=True)
            return t0

        def rate(n: int, t0: float) -> float:
            stream.synchronize()
            return n * size / (time.perf_counter() - t0)

        copies = max(2, round(seconds * rate(1, queue(1)) / size))
        copy_alone = rate(copies, queue(copies))
        t0 = queue(copies)
        kernel_beside = kernel_loop(lambda: stream.query())
        copy_beside = rate(copies, t0)
        copier = "page-locked host to device, own stream"
    else:
        def copy_for(stop) -> float:
            done, t0 = 0, time.perf_counter()
            while not stop.is_set():
                dst.copy_(src)
                done += size
            return done / (time.perf_counter() - t0)

        stop = threading.Event()
        timer_thread = threading.Timer(seconds, stop.set)
        timer_thread.start()
        copy_alone = copy_for(stop)
        stop = threading.Event()
        rates: list[float] = []
        worker = threading.Thread(target=lambda: rates.append(copy_for(stop)))
        worker.start()
        kernel_beside = kernel_loop(timer(seconds))
        stop.set()
        worker.join()
        copy_beside = rates[0]
        copier = "stand-in: a second thread copying host memory to host memory (no CUDA)"
    alone_gbps, beside_gbps = read / kernel_alone / 1e9, read / kernel_beside / 1e9
    return {"status": "measured", "shape": shape.name, "tokens": 1, "kernel_threads": threads, "copier": copier,
            "copy_bytes": size, "kernel_gbps_alone": alone_gbps, "kernel_gbps_beside": beside_gbps,
            "copy_gbps_alone": copy_alone / 1e9, "copy_gbps_beside": copy_beside / 1e9,
            "model_ratio": (beside_gbps + copy_beside / 1e9) / alone_gbps}
