"""The host-compute section's measurements (``benchmarks.host_compute`` runs them, in order):
the kernel and the host's read bandwidth, the hand-off, each layer's paths at each number
of tokens, the thread counts, the overlap. What each is for is the section's docstring.
"""

from __future__ import annotations

import ctypes
import statistics
import time

from benchmarks.host_compute.layers import (
    CHECKED_TOKENS,
    LAYERS_SHARE,
    NO_CUDA,
    ROUTINGS,
    TOL_BF16,
    TOL_F32,
    Shape,
    _reason,
    activation,
    capture,
    check,
    copier,
    crossover,
    distinct,
    make_inputs,
    thread_counts,
    timed,
    with_tensors,
)
from selective_offload.estimate.host import COPIED_PATH_TRAFFIC

# --------------------------------------------------------------------------- the context


class Ctx:
    """What every measurement shares: the device, the kernel's state, the threads, the
    time left for timed loops, the results' correctness rows."""

    def __init__(self, cuda: bool, small: bool, threads: int, iters: int, max_seconds: float, layers: int = 2):
        import torch

        self.cuda, self.small, self.threads, self.iters = cuda, small, threads, iters
        #: The layers measured, which share the layers' part of the budget.
        self.layers = layers
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        self.deadline_total = max_seconds
        self.started = time.perf_counter()
        self.kernel: str = "unknown"  # "built", or the one line why not
        #: The kernel's tolerance: float32's, or bf16's where the build holds the tokens and
        #: the activation in bf16 (AVX512-BF16, as vLLM's device kernels do).
        self.kernel_tol = TOL_F32
        #: Whether the build multiplies MXFP4 and int4 weights with int8 vectors (AVX512-VNNI, or AVX2).
        self.int8_mxfp4 = False
        self.checks: list[dict] = []

    def start_clock(self) -> None:
        """The budget runs from the first timed loop (the weights' setup comes on top)."""
        self.started = time.perf_counter()

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
        bf16 = bool(lib.so_bf16_activations())
        ctx.int8_mxfp4 = bool(lib.so_int8_mxfp4())
        ctx.kernel_tol = TOL_BF16 if bf16 else TOL_F32
        out = {"status": "built", "library": getattr(lib, "_name", None), "bf16_activations": bf16,
               "int8_mxfp4": ctx.int8_mxfp4, "tol": ctx.kernel_tol}
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
    """The fixed cost of the host path, eager and from a graph (why: ``benchmarks.host_compute``)."""
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
    (``resident``; on CUDA ``.to(device)``), and why either could not be made: a test
    passes stand-ins to run the rows' code without a GPU."""
    if view is None and ctx.cuda:
        from selective_offload.wrappers import cuda_view_of_pinned

        view = lambda t: cuda_view_of_pinned(t, ctx.device)  # noqa: E731
    if resident is None and ctx.cuda:
        resident = lambda t: t.to(ctx.device)  # noqa: E731
    made, failed = {}, {}
    for key, fn in (("uva", view), ("resident", resident)):
        try:
            made[key] = with_tensors(weights, fn) if fn else None
        except Exception as exc:  # a view refused (OffloadError), out of device memory
            made[key] = None
            failed[key] = _reason(exc)
    return made["uva"], made["resident"], failed


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
    uva, dev, failed = views(ctx, weights, view, resident)
    result: dict = {"shape": shape.name, "fmt": shape.fmt, "experts": shape.experts, "k": shape.k,
                    "hidden": shape.hidden, "intermediate": shape.intermediate, "activation": shape.activation,
                    "expert_bytes": weights.expert_bytes, "layer_bytes": weights.nbytes, "rows": []}
    status = {"kernel": "measured" if ctx.kernel_ok else ctx.kernel,
              "host_eager": "measured" if ctx.kernel_ok else ctx.kernel,
              "host_graph": ("measured" if ctx.kernel_ok else ctx.kernel) if ctx.cuda else NO_CUDA,
              "device_path": "measured" if ctx.cuda else NO_CUDA,
              "uva": "measured" if uva is not None else failed.get("uva", NO_CUDA),
              "resident": "measured" if dev is not None else failed.get("resident", NO_CUDA)}
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
        # The host paths' oracle: the reference with the vectors rounded as the kernel rounds
        # them (int8 for MXFP4 and int4 where the build multiplies them in int8: the
        # AVX512-BF16 build and the AVX2 one), at the tolerance of a path that rounds.
        int8 = ctx.int8_mxfp4 and shape.fmt in ("mxfp4", "int4")
        host_ref = [cpu_kernels.reference.moe_reference(x, i, w, weights, act, int8_vectors=True)
                    for x, i, w in sets[:2]] if checked and int8 else ref
        kernel_tol = TOL_BF16 if int8 else ctx.kernel_tol
        iters = ctx.iters
        paths: list[tuple[str, object, float, list]] = []
        if ctx.kernel_ok:
            outs = [torch.empty(T, shape.hidden, dtype=torch.float32) for _ in sets]
            jobs = [cpu_kernels.MoEJob(x, i, w, weights, act, out=o, threads=ctx.threads)
                    for (x, i, w), o in zip(sets, outs)]
            paths.append(("kernel", lambda j: jobs[j].run(), kernel_tol, host_ref))
            paths.append(("host_eager", lambda j: host(*on[j]), TOL_BF16, host_ref))
        if copy is not None:
            paths.append(("device_path", lambda j: copy(*on[j]), TOL_BF16, ref))
            # what the crossover prices the path at beside its copy (est): the VRAM bytes its ops move
            row["device_path_traffic_bytes_est"] = row["expert_bytes_read"] * COPIED_PATH_TRAFFIC.get(shape.fmt, 1.0)
        if uva is not None:
            paths.append(("uva", lambda j: cpu_kernels.reference.moe_reference(*on[j], uva, act), TOL_F32, ref))
        if dev is not None:
            paths.append(("resident", lambda j: cpu_kernels.reference.moe_reference(*on[j], dev, act), TOL_F32, ref))
        # The layers share LAYERS_SHARE of the budget, split evenly over their T and paths.
        budget = LAYERS_SHARE / ctx.layers / len(tokens) / max(1, len(paths) + (1 if ctx.cuda and ctx.kernel_ok else 0))
        for name, run, tol, want in paths:
            try:
                if checked:
                    ctx.checks.append({"shape": shape.name, **check(name, T, run(0), want[0], tol)})
                row[f"{name}_s"] = timed(run, n, iters, ctx.cuda and name != "kernel", ctx.deadline(budget))
            except Exception as exc:
                row[f"{name}_error"] = _reason(exc)
        if ctx.cuda and ctx.kernel_ok:
            _host_graph(ctx, shape, host, sets, on, host_ref, row, checked, ctx.deadline(budget))
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
        prepare = copier((x, ids, w), on)
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
        graph = None  # its memory pool goes before the next shape's capture
    except Exception as exc:
        row["host_graph_error"] = _reason(exc)


def threads_sweep(ctx: Ctx, shape: Shape, weights, cores: int) -> dict:
    """One token's layer at several thread counts: the kernel called directly and (on
    CUDA) the host path replayed from a graph. A kernel team as large as the cores
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
                row["host_graph_s"] = timed(lambda j: graph.replay(), len(on), ctx.iters, True, ctx.deadline(0.01),
                                            prepare=copier((x, ids, w), on))
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
