"""The host-compute section's layers, inputs, timer and checks (``benchmarks.host_compute``).

Why apart: the section's measurements (``sections.py``), its report
(``report.py``) and the tests share these, and none of them needs the others.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path

from benchmarks.common import spread

NO_CUDA = "skipped: no CUDA device (a stream, a CUDA graph and UVA views need one)"
#: The dense layer's MLP among the shapes: the dense-layer measurement takes it.
DENSE_MLP = "qwen3.8-27b-mlp"


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
#: 128 experts top-8, hidden 2048, intermediate 768, bf16, silu; Qwen3.8-27B-FP8's dense MLP
#: (hidden 5120, intermediate 17920, block FP8 128 x 128, silu) as the one expert every token
#: takes, which is how the glue serves a dense MLP on the host.
SHAPES = (Shape("gpt-oss-20b", "mxfp4", 32, 4, 2880, 2880, "swigluoai", True),
          Shape("qwen3-30b-a3b", "bf16", 128, 8, 2048, 768, "silu", False),
          Shape(DENSE_MLP, "fp8-block", 1, 1, 5120, 17920, "silu", False))
#: The same layers, tiny: the same code path in seconds on a CPU (block FP8 in whole blocks).
SMALL_SHAPES = (Shape("gpt-oss-20b", "mxfp4", 8, 2, 64, 64, "swigluoai", True),
                Shape("qwen3-30b-a3b", "bf16", 16, 4, 64, 32, "silu", False),
                Shape(DENSE_MLP, "fp8-block", 1, 1, 128, 256, "silu", False))
TOKENS = (1, 2, 4, 8, 16, 32)
SMALL_TOKENS = (1, 2, 4)
CHECKED_TOKENS = (1, 2)
#: The timed loops' shares of ``--max-seconds``: the layers' sweep; hand-off and overlap
#: take 0.01 a loop (a dozen loops), the dense layer 0.02 for all its loops, from the rest.
LAYERS_SHARE = 0.8
#: Routings each timed loop cycles through.
ROUTINGS = 8
#: max |path - reference| <= TOL * max |reference|: float32 paths (the torch reference on
#: the device, the kernel where it keeps float32: summation order only), and paths that
#: round to bf16 (the host path's and the device path's outputs, the kernel's AVX512-BF16
#: build that holds tokens and activation in bf16: 2^-9 relative per rounding).
TOL_F32 = 1e-4
TOL_BF16 = 1e-2
#: Elements in the block the weights are tiled from: not a divisor of any expert's size,
#: so every expert holds other values (a path that reads the wrong expert is caught).
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
    if shape.fmt == "fp8-block":
        # e4m3 codes of order one; one float32 scale per 128 x 128 block near 1/sqrt(fan-in)
        # keeps x @ W13 and the down projection of order one.
        def codes(n, g):
            return torch.randn(n, generator=g).clamp(-8, 8).to(torch.float8_e4m3fn)

        def scales(fan_in):
            return lambda n, g: (torch.rand(n, generator=g) * 0.5 + 0.75) * fan_in ** -0.5

        return ExpertWeights("fp8-block", _tiled((E, 2 * I, H), torch.float8_e4m3fn, codes, seed),
                             _tiled((E, H, I), torch.float8_e4m3fn, codes, seed + 1),
                             w13_scale=_tiled((E, 2 * I // 128, H // 128), torch.float32, scales(H), seed + 2),
                             w2_scale=_tiled((E, H // 128, I // 128), torch.float32, scales(I), seed + 3))
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


def copier(static, inputs):
    """``prepare(j)`` for :func:`timed`: input set ``j`` copied into a graph's ``static`` inputs."""
    def prepare(j):
        for dst, src in zip(static, inputs[j]):
            dst.copy_(src)

    return prepare


def _reason(exc: BaseException) -> str:
    return f"FAILED: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def thread_counts(cores: int) -> list[int]:
    """All physical cores, one fewer (a core left to the thread that waits on the device),
    and half."""
    return sorted({cores, max(1, cores - 1), max(1, cores // 2)}, reverse=True)



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
        if host is None or host > best:
            break
        wins = r["tokens"]
    return {"tokens": wins, "host": key[:-2], "against": [k[:-2] for k in others],
            "note": "the host path loses already at the smallest T" if wins is None else ""}
