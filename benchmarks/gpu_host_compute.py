"""One MoE layer's routed experts computed by the host CPU at decode (host-compute), against
the GPU reading the same page-locked experts in place (UVA) and against experts resident
on the device, at real layer shapes: gpt-oss-20b's (MXFP4) and Qwen3-30B-A3B's (bf16).

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
  computed there); ``uva`` (the torch reference, ``cpu_kernels.reference.moe_reference``,
  on UVA device views of the very page-locked tensors the CPU reads, so every expert
  byte crosses the link inside a kernel); ``resident`` (the reference on device copies:
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
- **correctness**: every path's output against the reference on the CPU (the stated
  tolerance, relative to the output's largest magnitude: float32 paths and paths that
  return bf16 each their own), and a captured graph replayed after new inputs are written
  into its input tensors gives the new inputs' result (not the captured ones').

Inputs cycle through several routings, so a timed call rarely finds its experts still in
the CPU's caches from the previous call (a decode step reads every other layer between
two reads of this one). Times are medians of per-call wall time, the device synchronised
around each call; ``--max-seconds`` bounds the timed loops (setup comes on top).

When the kernel cannot be built on the machine (no C compiler with OpenMP), the host
paths are recorded as skipped with that one line, and the UVA and resident paths are
still measured. Without CUDA (``--small`` here) the shapes are tiny and the CUDA-only
parts are recorded as skipped with the reason; the kernel and the reference still run.

    python benchmarks/gpu_host_compute.py [--small] [--max-seconds 25] [--out benchmarks/results]

Writes ``host-compute-<cpu|cuda>-<machine>-<date>[-small].json`` and ``.md``. Exit status 1
when a correctness check fails, 2 for bad input.
"""

from __future__ import annotations

import argparse
import ctypes
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import (  # noqa: E402
    RESULTS_DIR, BenchError, device_name, fmt, load_1min, machine, md_table, result_stem, shared_note, spread,
    today, worker_or_run, write_results,
)

NO_CUDA = "skipped: no CUDA device (a stream, a CUDA graph and UVA views need one)"


@dataclass(frozen=True)
class Shape:
    """One MoE layer's routed experts, from the model's config."""

    name: str
    fmt: str
    experts: int
    k: int
    hidden: int
    intermediate: int
    activation: str
    bias: bool


#: gpt-oss-20b: 32 experts top-4, 2880 x 2880, MXFP4 with biases, swigluoai; Qwen3-30B-A3B:
#: 128 experts top-8, hidden 2048, intermediate 768, bf16, silu.
SHAPES = (Shape("gpt-oss-20b", "mxfp4", 32, 4, 2880, 2880, "swigluoai", True),
          Shape("qwen3-30b-a3b", "bf16", 128, 8, 2048, 768, "silu", False))
#: The same layers, tiny: the same code path in seconds on a CPU.
SMALL_SHAPES = (Shape("gpt-oss-20b", "mxfp4", 8, 2, 64, 64, "swigluoai", True),
                Shape("qwen3-30b-a3b", "bf16", 16, 4, 64, 32, "silu", False))
TOKENS = (1, 2, 4, 8, 16, 32)
SMALL_TOKENS = (1, 2, 4)
CHECKED_TOKENS = (1, 2)
#: The timed loops' shares of ``--max-seconds``: the layers' sweep; hand-off and overlap
#: take 0.01 a loop (a dozen loops) from the rest.
LAYERS_SHARE = 0.85
#: Routings each timed loop cycles through.
ROUTINGS = 8
#: max |path - reference| <= TOL * max |reference|: float32 paths (the kernel against the
#: torch reference: summation order only) and paths that return bf16 (one rounding of
#: the output, 2^-9 relative, plus the summation order).
TOL_F32 = 1e-4
TOL_BF16 = 1e-2
#: Elements in the block the weights are tiled from: not a divisor of any expert's size,
#: so every expert holds other values (a path that reads the wrong expert is caught).
# mutation: host-compute-experts-repeat
BLOCK = (1 << 20) + 37


# --------------------------------------------------------------------------- the machine


def physical_cores() -> int:
    """Physical cores this process may run on (SMT siblings counted once)."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
    cores = set()
    for cpu in cpus:
        base = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add((base.joinpath("physical_package_id").read_text().strip(),
                       base.joinpath("core_id").read_text().strip()))
        except OSError:
            cores.add(("?", str(cpu)))
    return max(1, len(cores))


# --------------------------------------------------------------------------- weights and inputs


def _tiled(shape, dtype, block_fn, seed: int):
    import torch

    t = torch.empty(shape, dtype=dtype)
    flat = t.view(-1)
    gen = torch.Generator().manual_seed(seed)
    block = block_fn(min(flat.numel(), BLOCK), gen)
    for start in range(0, flat.numel(), block.numel()):
        n = min(block.numel(), flat.numel() - start)
        flat[start:start + n].copy_(block[:n])
    return t


def make_weights(shape: Shape, seed: int = 0):
    """The layer's experts in vLLM's create_weights layout, pageable host tensors, with
    values that keep every activation in range (outputs of order one)."""
    import torch

    from selective_offload.cpu_kernels import ExpertWeights

    E, H, I = shape.experts, shape.hidden, shape.intermediate

    def normal(std):
        return lambda n, g: (torch.randn(n, generator=g) * std).to(torch.bfloat16)

    def randint(lo, hi):
        return lambda n, g: torch.randint(lo, hi, (n,), generator=g, dtype=torch.uint8)

    if shape.fmt == "bf16":
        return ExpertWeights("bf16", _tiled((E, 2 * I, H), torch.bfloat16, normal(H ** -0.5), seed),
                             _tiled((E, H, I), torch.bfloat16, normal(I ** -0.5), seed + 1))
    # mxfp4: any byte is two finite e2m1 codes; e8m0 scales near 2^-6 keep x @ W13 of order one.
    bias = dict(w13_bias=_tiled((E, 2 * I), torch.bfloat16, normal(0.1), seed + 4),
                w2_bias=_tiled((E, H), torch.bfloat16, normal(0.1), seed + 5)) if shape.bias else {}
    return ExpertWeights("mxfp4", _tiled((E, 2 * I, H // 2), torch.uint8, randint(0, 256), seed),
                         _tiled((E, H, I // 2), torch.uint8, randint(0, 256), seed + 1),
                         w13_scale=_tiled((E, 2 * I, H // 32), torch.uint8, randint(119, 123), seed + 2),
                         w2_scale=_tiled((E, H, I // 32), torch.uint8, randint(119, 123), seed + 3), **bias)


def activation(shape: Shape):
    from selective_offload.cpu_kernels import Activation

    return Activation(shape.activation)


def make_inputs(shape: Shape, tokens: int, count: int, seed: int) -> list[tuple]:
    """``count`` routings of ``tokens`` tokens: bf16 hidden states, k distinct experts per
    token (int32), softmax weights (float32); CPU tensors."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        x = torch.randn(tokens, shape.hidden, generator=gen).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(shape.experts, generator=gen)[:shape.k] for _ in range(tokens)])
        w = torch.softmax(torch.randn(tokens, shape.k, generator=gen), dim=-1)
        out.append((x, ids.to(torch.int32), w.float()))
    return out


def distinct(ids) -> int:
    import torch

    return int(torch.unique(ids[ids >= 0]).numel())


def with_tensors(weights, fn):
    """The same ExpertWeights with every tensor replaced by ``fn(tensor)``."""
    return replace(weights, **{n: fn(t) for n, t in weights.tensors().items()})


# --------------------------------------------------------------------------- timing and checks


def timed(run, n: int, iters: int, cuda: bool, deadline: float | None, prepare=None, warmup: int = 2) -> dict:
    """Wall seconds of ``run(i)`` over inputs ``i`` cycling through ``n``, the device
    synchronised around each call; ``prepare(i)`` (writing a graph's inputs) runs before
    the clock. Stops past ``deadline`` once it has 3 calls."""
    import torch

    for i in range(warmup):
        if prepare:
            prepare(i % n)
        run(i % n)
    secs = []
    for j in range(iters):
        i = j % n
        if prepare:
            prepare(i)
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        run(i)
        if cuda:
            torch.cuda.synchronize()
        secs.append(time.perf_counter() - t0)
        if deadline is not None and time.perf_counter() > deadline and len(secs) >= 3:
            break
    return spread(secs)


def check(path: str, tokens: int, got, want, tol: float) -> dict:
    """One correctness row: the largest difference against the reference, relative to the
    reference's largest magnitude."""
    got, want = got.detach().float().cpu(), want.detach().float().cpu()
    scale = float(want.abs().max()) or 1.0
    err = float((got - want).abs().max()) if got.shape == want.shape else math.inf
    # mutation: host-compute-check-off
    ok = bool(math.isfinite(err) and err <= tol * scale)
    return {"path": path, "tokens": tokens, "max_abs_err": err, "max_abs_ref": scale, "tol": tol, "ok": ok}


def capture(fn):
    """A CUDA graph of ``fn()`` (warmed up on a side stream first, as torch advises), and
    the output tensor it writes."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    torch.cuda.synchronize()
    return graph, out


def _reason(exc: BaseException) -> str:
    return f"FAILED: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


# --------------------------------------------------------------------------- the context


class Ctx:
    """What every measurement shares: the device, the kernel's state, the threads, the
    time left for timed loops, the results' correctness rows."""

    def __init__(self, cuda: bool, small: bool, threads: int, iters: int, max_seconds: float):
        import torch

        self.cuda, self.small, self.threads, self.iters = cuda, small, threads, iters
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        self.deadline_total = max_seconds
        self.started = time.perf_counter()
        self.kernel: str = "unknown"  # "built", or the one line why not
        self.checks: list[dict] = []

    def deadline(self, share: float) -> float:
        """A deadline for the next loop: ``share`` of the whole budget from now, never past
        the budget's end (a loop past it still makes 3 calls)."""
        now = time.perf_counter()
        return min(now + self.deadline_total * share, self.started + self.deadline_total)

    @property
    def kernel_ok(self) -> bool:
        return self.kernel == "built"


def build_kernel(ctx: Ctx) -> dict:
    from selective_offload import cpu_kernels

    t0 = time.perf_counter()
    try:
        lib = cpu_kernels.library()
        ctx.kernel = "built"
        out = {"status": "built", "library": getattr(lib, "_name", None)}
    except cpu_kernels.KernelUnavailable as exc:
        ctx.kernel = "skipped: the CPU kernel cannot be built here: " + str(exc).splitlines()[0]
        out = {"status": ctx.kernel}
    out["build_or_load_s"] = time.perf_counter() - t0
    try:
        out["openmp_runtimes"] = cpu_kernels.openmp_runtimes()
    except Exception as exc:  # a diagnostic only
        out["openmp_runtimes"] = _reason(exc)
    return out


def bandwidth(ctx: Ctx) -> dict:
    from selective_offload import cpu_kernels

    if not ctx.kernel_ok:
        return {"status": ctx.kernel, "threads": ctx.threads}
    nbytes = (32 << 20) if ctx.small else (512 << 20)
    return {"status": "measured", "threads": ctx.threads, "bytes": nbytes,
            "read_gbps": cpu_kernels.read_gbps(ctx.threads, nbytes=nbytes, repeats=3 if ctx.small else 7)}


# --------------------------------------------------------------------------- hand-off


def free_null() -> int:
    """The address of libc's ``free``: ``free(NULL)`` is a host function that does nothing."""
    return ctypes.cast(ctypes.CDLL(None).free, ctypes.c_void_p).value


def handoff(ctx: Ctx, layers: list[tuple]) -> dict:
    """The fixed cost of the host path, eager and from a graph (see the module docstring)."""
    if not ctx.cuda:
        return {"status": NO_CUDA, "rows": []}
    import torch

    from selective_offload.wrappers.host_compute import HostExperts
    from selective_offload.wrappers.host_function import launch_host_function

    rows = []
    iters = max(ctx.iters * 5, 50)
    fptr = free_null()

    def bare():
        launch_host_function(torch.cuda.current_stream(), fptr, 0)

    row = {"what": "bare host function (free(NULL))", "tokens": 0}
    try:
        row["eager_s"] = timed(lambda i: bare(), 1, iters, True, ctx.deadline(0.01))
        graph, _ = capture(lambda: bare())
        row["graph_s"] = timed(lambda i: graph.replay(), 1, iters, True, ctx.deadline(0.01))
    except Exception as exc:
        row["error"] = _reason(exc)
    rows.append(row)
    row = {"what": "empty GPU step (synchronize only)", "tokens": 0,
           "eager_s": timed(lambda i: None, 1, iters, True, ctx.deadline(0.01))}
    rows.append(row)
    if not ctx.kernel_ok:
        return {"status": "measured (the host path's rows: " + ctx.kernel + ")", "rows": rows}
    for shape, weights in layers:
        he = HostExperts(shape.name, weights, activation(shape), crossover_tokens=1, threads=ctx.threads,
                         device=ctx.device)
        x = torch.randn(1, shape.hidden, device=ctx.device).to(torch.bfloat16)
        ids = torch.full((1, shape.k), -1, dtype=torch.int32, device=ctx.device)
        w = torch.full((1, shape.k), 1.0 / shape.k, dtype=torch.float32, device=ctx.device)
        row = {"what": f"{shape.name} host path, every pick -1 (copies and an empty job)", "tokens": 1}
        try:
            row["eager_s"] = timed(lambda i: he(x, ids, w), 1, iters, True, ctx.deadline(0.01))
            graph, _ = capture(lambda: he(x, ids, w))
            row["graph_s"] = timed(lambda i: graph.replay(), 1, iters, True, ctx.deadline(0.01))
        except Exception as exc:
            row["error"] = _reason(exc)
        rows.append(row)
    return {"status": "measured", "rows": rows}


# --------------------------------------------------------------------------- one layer


def views(ctx: Ctx, weights, view=None, resident=None):
    """The layer's UVA views (``view``; on CUDA ``cuda_view_of_pinned``) and device copies
    (``resident``; on CUDA ``.to(device)``): a test passes stand-ins to run the rows'
    code without a GPU."""
    if view is None and ctx.cuda:
        from selective_offload.wrappers import cuda_view_of_pinned

        view = lambda t: cuda_view_of_pinned(t, ctx.device)  # noqa: E731
    if resident is None and ctx.cuda:
        resident = lambda t: t.to(ctx.device)  # noqa: E731
    uva = with_tensors(weights, view) if view else None
    dev = with_tensors(weights, resident) if resident else None
    return uva, dev


def uva_read_gbps(ctx: Ctx, uva) -> float | None:
    """The read rate of a matrix-vector product through the layer's w13 view (the probe's
    own read measurement)."""
    from selective_offload.probe import gemv_read_s

    w = uva.w13
    nbytes = w.numel() * w.element_size()
    sync = ctx.device if ctx.cuda else None
    return nbytes / gemv_read_s(w, repeats=max(3, ctx.iters // 2), warmup=2, cuda=sync) / 1e9


def measure_layer(ctx: Ctx, shape: Shape, weights, tokens: tuple[int, ...], *, view=None, resident=None) -> dict:
    """Every path of one layer at each number of tokens, and their correctness."""
    import torch

    from selective_offload import cpu_kernels
    from selective_offload.wrappers.host_compute import HostExperts

    act = activation(shape)
    uva, dev = views(ctx, weights, view, resident)
    result: dict = {"shape": shape.name, "fmt": shape.fmt, "experts": shape.experts, "k": shape.k,
                    "hidden": shape.hidden, "intermediate": shape.intermediate, "activation": shape.activation,
                    "expert_bytes": weights.expert_bytes, "layer_bytes": weights.nbytes, "rows": []}
    status = {"kernel": "measured" if ctx.kernel_ok else ctx.kernel,
              "host_eager": "measured" if ctx.kernel_ok else ctx.kernel,
              "host_graph": ("measured" if ctx.kernel_ok else ctx.kernel) if ctx.cuda else NO_CUDA,
              "device_path": "measured" if ctx.cuda else NO_CUDA,
              "uva": "measured" if uva is not None else NO_CUDA,
              "resident": "measured" if dev is not None else NO_CUDA}
    status["uva_floor"] = status["uva"]
    if uva is not None:
        try:
            result["uva_read_gbps"] = uva_read_gbps(ctx, uva)
        except Exception as exc:
            status["uva_floor"] = _reason(exc)
    result["status"] = status
    big = max(tokens)
    host = HostExperts(shape.name, weights, act, crossover_tokens=big, threads=ctx.threads, device=ctx.device) \
        if ctx.kernel_ok else None
    copy = HostExperts(shape.name, weights, act, crossover_tokens=0, threads=ctx.threads, device=ctx.device) \
        if ctx.cuda else None
    for T in tokens:
        sets = make_inputs(shape, T, 2 if ctx.small else ROUTINGS, seed=1000 * T)
        on = [(x.to(ctx.device), i.to(ctx.device), w.to(ctx.device)) for x, i, w in sets]
        n = len(sets)
        row: dict = {"tokens": T, "distinct_experts": statistics.mean(distinct(i) for _, i, _ in sets)}
        row["expert_bytes_read"] = row["distinct_experts"] * weights.expert_bytes
        # Checked at one token and at two (tokens that may share an expert): the reference on
        # the CPU dequantises in memory, too slow for every T at real shapes.
        checked = T in CHECKED_TOKENS
        ref = [cpu_kernels.reference.moe_reference(x, i, w, weights, act) for x, i, w in sets[:2]] if checked else []
        iters = ctx.iters
        paths: list[tuple[str, object, float]] = []
        if ctx.kernel_ok:
            outs = [torch.empty(T, shape.hidden, dtype=torch.float32) for _ in sets]
            jobs = [cpu_kernels.MoEJob(x, i, w, weights, act, out=o, threads=ctx.threads)
                    for (x, i, w), o in zip(sets, outs)]
            paths.append(("kernel", lambda j: jobs[j].run(), TOL_F32))
            paths.append(("host_eager", lambda j: host(*on[j]), TOL_BF16))
        if copy is not None:
            paths.append(("device_path", lambda j: copy(*on[j]), TOL_BF16))
        if uva is not None:
            paths.append(("uva", lambda j: cpu_kernels.reference.moe_reference(*on[j], uva, act), TOL_F32))
        if dev is not None:
            paths.append(("resident", lambda j: cpu_kernels.reference.moe_reference(*on[j], dev, act), TOL_F32))
        # Two layers share LAYERS_SHARE of the budget, split evenly over their T and paths.
        budget = LAYERS_SHARE / 2 / len(tokens) / max(1, len(paths) + (1 if ctx.cuda and ctx.kernel_ok else 0))
        for name, run, tol in paths:
            try:
                if checked:
                    ctx.checks.append({"shape": shape.name, **check(name, T, run(0), ref[0], tol)})
                row[f"{name}_s"] = timed(run, n, iters, ctx.cuda, ctx.deadline(budget))
            except Exception as exc:
                row[f"{name}_error"] = _reason(exc)
        if ctx.cuda and ctx.kernel_ok:
            _host_graph(ctx, shape, host, sets, on, ref, row, checked, ctx.deadline(budget))
        med = (row.get("kernel_s") or {}).get("median")
        if med:
            row["kernel_weights_gbps"] = row["expert_bytes_read"] / med / 1e9
        if result.get("uva_read_gbps"):
            row["uva_floor_s"] = row["expert_bytes_read"] / (result["uva_read_gbps"] * 1e9)
        result["rows"].append(row)
        print({k: (round(v["median"] * 1e6, 1) if isinstance(v, dict) and v.get("median") else v)
               for k, v in row.items()}, flush=True)
    result["crossover"] = crossover(result["rows"])
    return result


def _host_graph(ctx: Ctx, shape: Shape, host, sets, on, ref, row: dict, checked: bool, deadline: float) -> None:
    """The host path captured once over static inputs, replayed after each new routing is
    written into them; checked with a routing other than the captured one."""
    import torch

    x, ids, w = (t.clone() for t in on[0])
    try:
        graph, out = capture(lambda: host(x, ids, w))

        def prepare(j):
            for dst, src in zip((x, ids, w), on[j]):
                dst.copy_(src)

        if checked:
            other = 1 % len(sets)
            prepare(other)
            graph.replay()
            torch.cuda.synchronize()
            ctx.checks.append({"shape": shape.name, **check("host_graph", row["tokens"], out, ref[other], TOL_BF16)})
            if other != 0:  # the replay computed the new routing, not the captured one
                stale = not check("host_graph", row["tokens"], out, ref[0], TOL_BF16)["ok"]
                ctx.checks.append({"shape": shape.name, "path": "host_graph replay with new inputs",
                                   "tokens": row["tokens"], "ok": stale,
                                   "note": "the replay's output differs from the captured routing's result"})
        row["host_graph_s"] = timed(lambda j: graph.replay(), len(sets), ctx.iters, True, deadline, prepare=prepare)
        del graph
    except Exception as exc:
        row["host_graph_error"] = _reason(exc)


def crossover(rows: list[dict]) -> dict:
    """The largest T up to which the host path (graph, else eager) beats every device
    path measured (device_path, uva), with what it was compared with."""
    key = next((k for k in ("host_graph_s", "host_eager_s") if any(r.get(k) for r in rows)), None)
    others = [k for k in ("device_path_s", "uva_s") if any(r.get(k) for r in rows)]
    if key is None or not others:
        return {"tokens": None, "note": "not measured: needs the host path and a device path (CUDA and the kernel)"}
    wins = None
    for r in sorted(rows, key=lambda r: r["tokens"]):
        host = (r.get(key) or {}).get("median")
        best = min(((r.get(k) or {}).get("median") or math.inf) for k in others)
        # mutation: host-compute-crossover-inverted
        if host is None or host > best:
            break
        wins = r["tokens"]
    return {"tokens": wins, "host": key[:-2], "against": [k[:-2] for k in others],
            "note": "the host path loses already at the smallest T" if wins is None else ""}


# --------------------------------------------------------------------------- threads


def thread_counts(cores: int) -> list[int]:
    """All physical cores, one fewer (a core left to the thread that waits on the device),
    and half."""
    return sorted({cores, max(1, cores - 1), max(1, cores // 2)}, reverse=True)


def threads_sweep(ctx: Ctx, shape: Shape, weights, cores: int) -> dict:
    """One token's layer at several thread counts: the kernel called directly and (on
    CUDA) the host path replayed from a graph. An OpenMP team as large as the cores
    shares one with whatever else runs (the thread spinning on the device's completion,
    another process), and a descheduled member holds every barrier for a time slice."""
    import torch

    from selective_offload import cpu_kernels
    from selective_offload.wrappers.host_compute import HostExperts

    if not ctx.kernel_ok:
        return {"status": ctx.kernel, "rows": []}
    act = activation(shape)
    sets = make_inputs(shape, 1, 2 if ctx.small else ROUTINGS, seed=99)
    on = [(x.to(ctx.device), i.to(ctx.device), w.to(ctx.device)) for x, i, w in sets]
    rows = []
    for t in thread_counts(cores):
        outs = [torch.empty(1, shape.hidden, dtype=torch.float32) for _ in sets]
        jobs = [cpu_kernels.MoEJob(x, i, w, weights, act, out=o, threads=t) for (x, i, w), o in zip(sets, outs)]
        row = {"threads": t, "kernel_s": timed(lambda j: jobs[j].run(), len(jobs), ctx.iters, False,
                                               ctx.deadline(0.01))}
        if ctx.cuda:
            he = HostExperts(shape.name, weights, act, crossover_tokens=1, threads=t, device=ctx.device)
            x, ids, w = (v.clone() for v in on[0])
            try:
                graph, _ = capture(lambda: he(x, ids, w))

                def prepare(j):
                    for dst, src in zip((x, ids, w), on[j]):
                        dst.copy_(src)

                row["host_graph_s"] = timed(lambda j: graph.replay(), len(on), ctx.iters, True, ctx.deadline(0.01),
                                            prepare=prepare)
            except Exception as exc:
                row["host_graph_error"] = _reason(exc)
        rows.append(row)
    return {"status": "measured", "shape": shape.name, "tokens": 1, "rows": rows,
            "host_graph": "measured" if ctx.cuda else NO_CUDA}


# --------------------------------------------------------------------------- overlap


def overlap(ctx: Ctx, shape: Shape, weights) -> dict:
    """The host path of one layer (a graph replay, one token) beside a bf16 matmul chain
    sized to take about as long: on another stream, and on the same stream, queued first."""
    if not ctx.cuda:
        return {"status": NO_CUDA}
    if not ctx.kernel_ok:
        return {"status": ctx.kernel}
    import torch

    from selective_offload.wrappers.host_compute import HostExperts

    he = HostExperts(shape.name, weights, activation(shape), crossover_tokens=1, threads=ctx.threads,
                     device=ctx.device)
    x, ids, w = (t.to(ctx.device) for t in make_inputs(shape, 1, 1, seed=7)[0])
    graph, _ = capture(lambda: he(x, ids, w))
    n = 4096
    a = torch.randn(n, n, device=ctx.device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=ctx.device, dtype=torch.bfloat16)
    c = torch.empty_like(a)
    main, other = torch.cuda.current_stream(), torch.cuda.Stream()
    iters = max(5, ctx.iters)
    host_s = timed(lambda i: graph.replay(), 1, iters, True, ctx.deadline(0.01))["median"]
    one_s = timed(lambda i: torch.mm(a, b, out=c), 1, iters, True, ctx.deadline(0.01))["median"]
    reps = max(1, round(host_s / one_s))

    def chain(stream):
        with torch.cuda.stream(stream):
            for _ in range(reps):
                torch.mm(a, b, out=c)

    def together(stream):
        stream.wait_stream(main)
        chain(stream)
        graph.replay()

    gpu_s = timed(lambda i: chain(main), 1, iters, True, ctx.deadline(0.01))["median"]
    apart = timed(lambda i: together(other), 1, iters, True, ctx.deadline(0.01))["median"]
    same = timed(lambda i: together(main), 1, iters, True, ctx.deadline(0.01))["median"]
    shorter = min(host_s, gpu_s)
    return {"status": "measured", "shape": shape.name, "tokens": 1, "matmul": f"bf16 {n}x{n} @ {n}x{n}",
            "matmul_reps": reps, "host_s": host_s, "gpu_s": gpu_s, "sum_s": host_s + gpu_s,
            "other_stream_s": apart, "same_stream_s": same,
            "other_stream_overlap": (host_s + gpu_s - apart) / shorter,
            "same_stream_overlap": (host_s + gpu_s - same) / shorter}


# --------------------------------------------------------------------------- the report


def _us(s: dict | None) -> str:
    return "n/a" if not s or s.get("median") is None else f"{s['median'] * 1e6:.1f}"


def markdown(r: dict) -> str:
    lines = [f"# Host-compute: one MoE layer's routed experts on the host CPU: {r['device']}", "",
             f"Date {r['date']}, torch {r['torch']}, host CPU {r['machine']} ({r['threads']} threads = physical "
             f"cores; {r['logical_cpus']} logical CPUs); {'tiny shapes (--small)' if r['small'] else 'real shapes'}; "
             f"kernel: {r['kernel']['status']}; whole run {r['wall_s']:.0f} s; {r['load_note']}. Times are medians "
             "of per-call wall time (us), the device synchronised around each call. Measured, not estimated.", ""]
    bw = r["bandwidth"]
    lines += ["## The host CPU: read bandwidth and the kernel's weights rate", "",
              md_table(["layer", "T", "distinct experts", "kernel us", "kernel weights GB/s",
                        f"host read GB/s ({bw['threads']} threads)", "kernel / read"],
                       [[L["shape"], x["tokens"], fmt(x["distinct_experts"], 1), _us(x.get("kernel_s")),
                         fmt(x.get("kernel_weights_gbps")), fmt(bw.get("read_gbps")),
                         fmt(x["kernel_weights_gbps"] / bw["read_gbps"], 3)
                         if x.get("kernel_weights_gbps") and bw.get("read_gbps") else "n/a"]
                        for L in r["layers"] for x in L["rows"]])]
    if bw["status"] != "measured":
        lines += [f"Read bandwidth: {bw['status']}.", ""]
    h = r["handoff"]
    lines += ["## Hand-off per layer", "", f"Status: {h['status']}.", ""]
    if h["rows"]:
        lines += [md_table(["what", "eager us", "graph replay us", "error"],
                           [[x["what"], _us(x.get("eager_s")), _us(x.get("graph_s")), x.get("error", "")]
                            for x in h["rows"]])]
    for L in r["layers"]:
        st = L["status"]
        lines += [f"## {L['shape']} ({L['fmt']}, {L['experts']} experts top-{L['k']}, H {L['hidden']}, "
                  f"I {L['intermediate']}): decode time per layer", "",
                  f"Expert {L['expert_bytes'] / 1e6:.2f} MB, layer {L['layer_bytes'] / 1e6:.1f} MB; UVA read rate "
                  f"{fmt(L.get('uva_read_gbps'))} GB/s. Crossover (host path beats every device path up to T): "
                  f"{L['crossover']['tokens']} {L['crossover'].get('note', '')}".rstrip() + ".", "",
                  md_table(["T", "distinct experts", "host eager", "host graph", "device path (copy)", "UVA",
                            "resident", "UVA floor", "host graph / UVA", "errors"],
                           [[x["tokens"], fmt(x["distinct_experts"], 1), _us(x.get("host_eager_s")),
                             _us(x.get("host_graph_s")), _us(x.get("device_path_s")), _us(x.get("uva_s")),
                             _us(x.get("resident_s")),
                             f"{x['uva_floor_s'] * 1e6:.1f}" if x.get("uva_floor_s") else "n/a",
                             fmt(ratio(x, "host_graph_s", "uva_s"), 3),
                             "; ".join(f"{k}: {v}" for k, v in x.items() if k.endswith("_error"))]
                            for x in L["rows"]])]
        skipped = [f"`{k}`: {v}" for k, v in st.items() if v != "measured"]
        if skipped:
            lines += ["Not measured: " + "; ".join(skipped) + ".", ""]
    sweep = [[t["shape"], x["threads"], _us(x.get("kernel_s")), _us(x.get("host_graph_s")),
              x.get("host_graph_error", "" if t["host_graph"] == "measured" else t["host_graph"])]
             for t in r["threads_sweep"] if t["status"] == "measured" for x in t["rows"]]
    lines += ["## Threads: one token's layer at several thread counts", "",
              md_table(["layer", "threads", "kernel us", "host graph us", "note"], sweep) if sweep else
              f"Not measured: {r['threads_sweep'][0]['status'] if r['threads_sweep'] else 'no layer'}.\n"]
    o = r["overlap"]
    lines += ["## Overlap: the host path beside independent GPU work", ""]
    if o["status"] != "measured":
        lines += [f"Status: {o['status']}.", ""]
    else:
        lines += [md_table(["layer", "host path us", "GPU work us", "sum us", "other stream us", "overlap",
                            "same stream us", "overlap"],
                           [[o["shape"], f"{o['host_s'] * 1e6:.1f}", f"{o['gpu_s'] * 1e6:.1f}",
                             f"{o['sum_s'] * 1e6:.1f}", f"{o['other_stream_s'] * 1e6:.1f}",
                             fmt(o["other_stream_overlap"], 2), f"{o['same_stream_s'] * 1e6:.1f}",
                             fmt(o["same_stream_overlap"], 2)]]),
                  f"GPU work: {o['matmul']} x {o['matmul_reps']}. Overlap: (sum - together) / the shorter part "
                  "(1: fully hidden, 0: serialised).", ""]
    lines += ["## Correctness", "",
              f"max |path - reference| <= tol x max |reference|, the reference on the CPU; tol {TOL_F32:g} for "
              f"float32 paths, {TOL_BF16:g} for paths that return bf16.", "",
              md_table(["layer", "path", "T", "max abs err", "max abs ref", "tol", "ok"],
                       [[c["shape"], c["path"], c["tokens"], fmt(c.get("max_abs_err"), 6),
                         fmt(c.get("max_abs_ref"), 3), fmt(c.get("tol"), 4) if c.get("tol") else c.get("note", ""),
                         "yes" if c["ok"] else "NO"] for c in r["correctness"]])]
    return "\n".join(lines)


def ratio(row: dict, top: str, bottom: str) -> float | None:
    a, b = (row.get(top) or {}).get("median"), (row.get(bottom) or {}).get("median")
    return a / b if a and b else None


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
    ctx = Ctx(cuda, small, threads, 3 if small and not cuda else args.iters, args.max_seconds)
    load_before, started = load_1min(), time.perf_counter()
    result: dict = {"benchmark": "host-compute", "date": today(), "device": device_name(cuda), "cuda": cuda,
                    "machine": machine(), "torch": torch.__version__, "small": small, "threads": threads,
                    "physical_cores": cores, "logical_cpus": os.cpu_count(), "iters": ctx.iters,
                    "max_seconds": args.max_seconds, "tolerance": {"float32": TOL_F32, "bf16": TOL_BF16}}
    result["kernel"] = build_kernel(ctx)
    print(f"kernel: {result['kernel']['status']}; threads {threads}", flush=True)
    result["bandwidth"] = bandwidth(ctx)
    print(f"read bandwidth: {result['bandwidth']}", flush=True)

    from selective_offload.wrappers.page_locked import PageLockedLedger, PinPolicy

    ledger = PageLockedLedger(PinPolicy.decide(cuda=cuda))
    layers = []
    for shape in SMALL_SHAPES if small else SHAPES:
        t0 = time.perf_counter()
        weights = make_weights(shape)
        locked = all(ledger.lock(t, f"host-compute {shape.name} experts") for t in weights.tensors().values())
        layers.append((shape, weights))
        print(f"{shape.name}: {weights.nbytes / 1e6:.1f} MB of experts made"
              + (", page-locked in place" if locked else "") + f" in {time.perf_counter() - t0:.1f} s", flush=True)
    try:
        result["handoff"] = handoff(ctx, layers)
        print(f"hand-off: {result['handoff']['status']}", flush=True)
        result["layers"] = [measure_layer(ctx, shape, weights, SMALL_TOKENS if small else TOKENS)
                            for shape, weights in layers]
        result["threads_sweep"] = [threads_sweep(ctx, shape, weights, cores) for shape, weights in layers]
        try:
            result["overlap"] = overlap(ctx, *layers[0])
        except Exception as exc:
            result["overlap"] = {"status": _reason(exc)}
    finally:
        if cuda:
            torch.cuda.synchronize()
        for _, weights in layers:
            for t in weights.tensors().values():
                if ledger.is_locked(t):
                    ledger.unlock(t.untyped_storage().data_ptr())
    result["correctness"] = ctx.checks
    result["correct"] = all(c["ok"] for c in ctx.checks)
    result["wall_s"] = time.perf_counter() - started
    result["load_note"] = shared_note(load_before, load_1min())
    stem = result_stem("host-compute", cuda, result["device"]) + ("-small" if small else "")
    paths = write_results(args.out, stem, result, markdown(result))
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


if __name__ == "__main__":
    sys.exit(main())
