"""One MoE layer's routed experts computed by the host CPU at decode (host-compute), against
the GPU reading the same page-locked experts in place (UVA) and against experts resident
on the device, at real layer shapes: gpt-oss-20b's (MXFP4) and Qwen3-30B-A3B's (bf16); and
Qwen3.8-27B-FP8's dense MLP the same way, inside its layer beside the layer's attention.

Why: host-compute trades a link read of the k experts a token picks for a hand-off (the
hidden states to the host and back, a host function on the stream) plus a CPU read of the
same experts at host memory bandwidth. Whether that wins, and up to how many tokens a
step, depends on the machine's link, its CPU's read rate and the hand-off's fixed cost,
none of which a development machine without a GPU can show. Each measurement answers
one part of that:

- **hand-off** (CUDA): the fixed cost of leaving the stream, measured three ways, each
  eager and replayed from a captured CUDA graph: a host function that does nothing
  (``free(NULL)``, the floor of ``cudaLaunchHostFunc``), and the layer's own host path
  with every pick set to ``-1`` (the real copies of the hidden states, a job with nothing
  to compute). It bounds how small a layer host-compute can pay off for.
- **decode time per layer** (T = 1, and 2 to 32 tokens for the crossover), per path:
  ``host_eager`` / ``host_graph`` (:class:`~selective_offload.wrappers.host_compute.HostExperts`
  at or below its crossover: the stream-ordered host function, called eagerly and
  replayed from a graph, as vLLM replays its captured sizes); ``device_path`` (the same
  object above its crossover: the step's distinct experts copied to the device and
  computed there, beside ``device_path_traffic_bytes_est``, the device-memory bytes the
  crossover prices its torch ops at, ``estimate.host.COPIED_PATH_TRAFFIC``); ``uva`` (the
  torch reference, ``cpu_kernels.reference.moe_reference``, on UVA device views of the
  very page-locked tensors the CPU reads, so every expert byte crosses the link inside a
  kernel); ``resident`` (the reference on device copies:
  the reference's own launch overhead, so ``uva - resident`` is the link's part);
  ``uva_floor`` (the step's distinct expert bytes over the UVA read rate of a
  matrix-vector product on the same view: what any kernel reading them in place pays at
  least). The reference syncs to find its experts, so the UVA and resident rows are eager
  only. The crossover is the largest T up to which the host graph beats every device
  alternative: what a plan's ``host_compute`` crossover should be on this machine.
- **kernel** (the CPU's side): the compiled kernel called directly (``MoEJob.run``) at
  each T, its weights GB/s (the distinct expert bytes over its time) beside the host's
  read bandwidth (``cpu_kernels.read_gbps``) at the same thread count, all physical cores:
  how close the kernel comes to the bound a host read can reach.
- **overlap** (CUDA): the host path of a layer while the GPU runs independent work (a
  bf16 matmul chain sized to take about as long, queued first on another stream), total
  against the parts' sum; and the same chain queued first on the same stream, where
  stream order must serialise them. It shows whether the GPU keeps working while the CPU
  computes, which is what makes the hand-off cheap inside a model's step.
- **contention**: the kernel's rate at one token alone and while copies read host memory
  beside it (on CUDA page-locked copies to the device on their own stream, as the prefetch
  offloader's; without CUDA a second thread's host-to-host copy stands in), and the copies'
  rate alone and beside it. The plan's estimate lets a prefetch copy run behind the CPU's
  time with the two reads served one after the other at the kernel's rate; ``model_ratio``
  (both rates together over the kernel's alone) is what that rule is checked against: 1.0
  as priced, above it the estimate is conservative.
- **device share** (``share.py``): one token's layer with its first experts
  also on the device, the GPU computing the picks that land there while the CPU computes
  the rest, against the whole layer on the host and against its two parts alone: whether
  the share's GPU time hides under the CPU's, as the plan's estimate prices it; and the
  same share held as the checkpoint stores it, computed by the share kernel that reads it
  in place (``wrappers/share_kernel.py``; under Triton's interpreter without CUDA, checked only).
- **dense layer** (``dense.py``): Qwen3.8-27B's attention on the GPU and its
  block FP8 MLP on the host CPU, as one captured sequence, against the same layer with the
  MLP's bytes copied over the link (what a prefetched layer pays): whether computing a dense
  layer's MLP where it lives beats carrying it.
- **correctness**: every path's output against the reference on the CPU (the stated
  tolerance, relative to the output's largest magnitude: float32 paths and paths that
  return bf16 each their own), and a captured graph replayed after new inputs are written
  into its input tensors gives the new inputs' result (not the captured ones').

Inputs cycle through several routings, so a timed call rarely finds its experts still in
the CPU's caches from the previous call (a decode step reads every other layer between
two reads of this one). Times are medians of per-call wall time, the device synchronised
around each call; ``--max-seconds`` bounds the measuring from the first timed loop on (making
and page-locking the weights comes on top; a loop past the bound still makes 3 calls).

When the kernel cannot be built on the machine (no C compiler with OpenMP), the host
paths are recorded as skipped with that one line, and the UVA and resident paths are
still measured. Without CUDA (``--small`` here) the shapes are tiny and the CUDA-only
parts are recorded as skipped with the reason; the kernel and the reference still run.

    python -m benchmarks.host_compute [--small] [--max-seconds 25] [--threads N] [--out benchmarks/results]

The pieces: ``layers.py`` (the shapes, weights, inputs, timer, checks and
crossover), ``sections.py``, ``contention.py``, ``share.py``, ``head.py`` and ``dense.py`` (the
measurements), ``report.py`` (the Markdown).

Writes ``host-compute-<cpu|cuda>-<machine>[-small].json`` and ``.md``. Exit status 1
when a correctness check fails, 2 for bad input.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from benchmarks.common import (  # noqa: E402
    RESULTS_DIR,
    BenchError,
    device_name,
    load_1min,
    machine,
    result_stem,
    shared_note,
    today,
    worker_or_run,
    write_results,
)
from benchmarks.host_compute.contention import contention  # noqa: E402
from benchmarks.host_compute.dense import dense_layer  # noqa: E402
from benchmarks.host_compute.head import lm_head_split  # noqa: E402
from benchmarks.host_compute.layers import (  # noqa: E402
    DENSE_MLP,
    SHAPES,
    SMALL_SHAPES,
    SMALL_TOKENS,
    TOKENS,
    TOL_BF16,
    TOL_F32,
    make_weights,
    physical_cores,
)
from benchmarks.host_compute.report import markdown  # noqa: E402
from benchmarks.host_compute.sections import (  # noqa: E402
    Ctx,
    _reason,
    bandwidth,
    build_kernel,
    handoff,
    measure_layer,
    overlap,
    threads_sweep,
)
from benchmarks.host_compute.share import device_share  # noqa: E402

# --------------------------------------------------------------------------- main


def run(args) -> int:
    import torch

    cuda = torch.cuda.is_available()
    small = args.small or not cuda
    if args.max_seconds <= 0 or args.iters < 3:
        raise BenchError("--max-seconds must be positive and --iters at least 3")
    cores = physical_cores()
    threads = args.threads or cores
    if not cuda:
        torch.set_num_threads(threads)
    shapes = SMALL_SHAPES if small else SHAPES
    ctx = Ctx(cuda, small, threads, 3 if small and not cuda else args.iters, args.max_seconds, layers=len(shapes))
    load_before, started = load_1min(), time.perf_counter()
    result: dict = {"benchmark": "host-compute", "date": today(), "device": device_name(cuda), "cuda": cuda,
                    "machine": machine(), "torch": torch.__version__, "small": small, "threads": threads,
                    "physical_cores": cores, "logical_cpus": os.cpu_count(), "iters": ctx.iters,
                    "max_seconds": args.max_seconds, "tolerance": {"float32": TOL_F32, "bf16": TOL_BF16},
                    "handoff": {"status": "not reached", "rows": []}, "layers": [], "threads_sweep": [],
                    "overlap": {"status": "not reached"}, "contention": {"status": "not reached"},
                    "device_share": {"status": "not reached"}, "lm_head_split": {"status": "not reached"},
                    "dense_layer": {"status": "not reached"},
                    "correctness": ctx.checks, "complete": False}
    stem = result_stem("host-compute", cuda, result["device"]) + ("-small" if small else "")

    def save() -> tuple[Path, Path]:
        """Written after each part, so a run past the driver's limit leaves what it measured."""
        result["correct"] = all(c["ok"] for c in ctx.checks)
        result["wall_s"] = time.perf_counter() - started
        result["load_note"] = shared_note(load_before, load_1min())
        return write_results(args.out, stem, result, markdown(result))

    result["kernel"] = build_kernel(ctx)
    print(f"kernel: {result['kernel']['status']}; threads {threads}", flush=True)
    result["bandwidth"] = bandwidth(ctx)
    print(f"read bandwidth: {result['bandwidth']}", flush=True)
    save()

    from selective_offload.wrappers.page_locked import PageLockedLedger, PinPolicy

    ledger = PageLockedLedger(PinPolicy.decide(cuda=cuda))
    layers, arenas = [], []
    try:
        for shape in shapes:
            t0 = time.perf_counter()
            weights = make_weights(shape)
            # One page-aligned arena per layer, registered once, as the glue locks a layer's
            # experts (tensors registered one by one can share a page and be refused).
            locked = ledger.lock_together(list(weights.tensors().values()), f"host-compute {shape.name} experts")
            if locked:
                arenas.append(weights.w13.untyped_storage().data_ptr())
            layers.append((shape, weights))
            print(f"{shape.name}: {weights.nbytes / 1e6:.1f} MB of experts made"
                  + (", page-locked in one arena" if locked else "") + f" in {time.perf_counter() - t0:.1f} s",
                  flush=True)
        ctx.start_clock()
        result["handoff"] = handoff(ctx, layers)
        print(f"hand-off: {result['handoff']['status']}", flush=True)
        save()
        for shape, weights in layers:
            result["layers"].append(measure_layer(ctx, shape, weights, SMALL_TOKENS if small else TOKENS))
            save()
        result["threads_sweep"] = [threads_sweep(ctx, shape, weights, cores) for shape, weights in layers]
        try:
            result["overlap"] = overlap(ctx, *layers[0])
        except Exception as exc:
            result["overlap"] = {"status": _reason(exc)}
        try:
            result["contention"] = contention(ctx, *layers[0])
        except Exception as exc:
            result["contention"] = {"status": _reason(exc)}
        print(f"contention: {result['contention']['status']}", flush=True)
        try:
            result["device_share"] = device_share(ctx, *layers[0])
        except Exception as exc:
            result["device_share"] = {"status": _reason(exc)}
        print(f"device share: {result['device_share']['status']}", flush=True)
        try:
            result["lm_head_split"] = lm_head_split(ctx)
        except Exception as exc:
            result["lm_head_split"] = {"status": _reason(exc)}
        print(f"LM head split: {result['lm_head_split']['status']}", flush=True)
        save()
        result["dense_layer"] = next((dense_layer(ctx, s, w) for s, w in layers if s.name == DENSE_MLP),
                                     {"status": "no dense layer among the shapes"})
        print(f"dense layer: {result['dense_layer']['status']}", flush=True)
        result["complete"] = True
    finally:
        if cuda:
            torch.cuda.synchronize()
        for key in arenas:
            ledger.unlock(key)
    paths = save()
    print(f"wrote {paths[0]} and {paths[1]}")
    if not result["correct"]:
        print("host-compute: a correctness check FAILED (see the Correctness table)", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", "--smoke", dest="small", action="store_true",
                    help="tiny shapes and few calls: the same code path in seconds (automatic without CUDA)")
    ap.add_argument("--max-seconds", type=float, default=25.0, help="bound on the timed loops (setup on top)")
    ap.add_argument("--iters", type=int, default=20, help="timed calls per figure (fewer once past the bound)")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (default: the physical cores)")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR)
    return worker_or_run(ap.parse_args(argv), None, run)
