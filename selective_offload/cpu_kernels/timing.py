"""How fast the host-compute kernel reads one layer's experts at batch 1, beside the host's
read bandwidth measured in the same rounds: the one measurement behind the committed
claim (``benchmarks/cpu_kernels/``) and behind a claim on the user's own host
(``selective-offload probe``, judged by ``claimed.verdict``), so a format's ratio to the
claim bar is measured one way wherever it comes from.

Each round computes one token's picks with new random expert ids (so the weights come from
memory, not from a cache), then sums a buffer larger than the caches with the C read kernel
and the same threads: alternating, the two see the same machine. The first rounds start
the threads and touch the code and workspace, and run below the kernel's rate, so they are
not counted; and a rate is the median of many calls (a handful of calls straight after
the weights were made measured far below it).

Per format, :data:`LAYERS` is the real layer shape timed (the small shapes are for tests)
and :func:`layer_weights` makes its random weights quickly: int4 with AWQ's zero points,
the slower of its two paths, so a claim holds for symmetric groups too.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from .weights import Activation, ExpertWeights

#: format -> (model, E, k, H, I, activation, biases): the layer each format is timed on.
LAYERS = {
    "bf16": ("Qwen3-30B-A3B", 128, 8, 2048, 768, "silu", False),
    "mxfp4": ("gpt-oss-20b", 32, 4, 2880, 2880, "swigluoai", True),
    "fp8-block": ("Qwen3-30B-A3B", 128, 8, 2048, 768, "silu", False),
    "int4": ("Qwen3-30B-A3B", 128, 8, 2048, 768, "silu", False),
}
#: format -> (E, k, H, I) of a tiny layer: seconds, for tests (rates understated).
SMALL = {f: (8, 2, 256, 128) for f in LAYERS}
#: Rounds run before the timed ones.
WARM_ROUNDS = 2
#: Bytes of the read kernel's buffer (larger than the caches) and of the small runs' one.
READ_BYTES, SMALL_READ_BYTES = 256 << 20, 16 << 20


def layer_weights(fmt: str, E: int, H: int, I: int, biases: bool, seed: int = 0) -> ExpertWeights:
    """Random experts of ``fmt``'s layout, made fast (GBs): bf16 values in (-1, 1), fp8 bytes
    with no NaN, uniform MXFP4 and int4 nibbles with scales near 1 (int4: groups of 128
    columns, bf16 scales, and zero points)."""
    g = torch.Generator().manual_seed(seed)

    def u8(*shape, low=0, high=256):
        return torch.randint(low, high, shape, dtype=torch.uint8, generator=g)

    extra = {}
    if biases:
        extra = dict(w13_bias=torch.randn(E, 2 * I, generator=g).bfloat16(), w2_bias=torch.randn(E, H, generator=g).bfloat16())
    if fmt == "bf16":
        def bf(*shape):  # bf16 bits 0x3c00-0x3f7f and their negatives: values 2^-7 .. ~1
            bits = torch.empty(shape, dtype=torch.int16)
            for e in range(shape[0]):  # an expert at a time: the layer's bytes, not three times them
                bits[e] = torch.randint(0x3C00, 0x3F80, shape[1:], dtype=torch.int16, generator=g)
                bits[e] |= torch.randint(0, 2, shape[1:], dtype=torch.int16, generator=g) << 15
            return bits.view(torch.bfloat16)
        return ExpertWeights("bf16", bf(E, 2 * I, H), bf(E, H, I), **extra)
    if fmt == "mxfp4":
        return ExpertWeights("mxfp4", u8(E, 2 * I, H // 2), u8(E, H, I // 2), u8(E, 2 * I, H // 32, low=120, high=128),
                             u8(E, H, I // 32, low=120, high=128), **extra)
    if fmt == "int4":
        def scales(*shape):
            return (torch.rand(*shape, generator=g) * 0.02 + 0.01).bfloat16()
        return ExpertWeights("int4", u8(E, 2 * I, H // 2), u8(E, H, I // 2), scales(E, 2 * I, H // 128),
                             scales(E, H, I // 128), w13_zeros=u8(E, I, H // 128), w2_zeros=u8(E, H // 2, I // 128),
                             **extra)
    if fmt == "fp8-block":
        bn, bk = 128, 128
        return ExpertWeights("fp8-block", u8(E, 2 * I, H, high=0x70).view(torch.float8_e4m3fn),
                             u8(E, H, I, high=0x70).view(torch.float8_e4m3fn),
                             torch.rand(E, 2 * -(-I // bn), -(-H // bk), generator=g) + 0.5,
                             torch.rand(E, -(-H // bn), -(-I // bk), generator=g) + 0.5, block=(bn, bk), **extra)
    raise ValueError(f"layer_weights: no timed layer for format {fmt!r}; use one of {', '.join(LAYERS)}")


def layer_of(fmt: str, small: bool = False) -> tuple[dict, ExpertWeights, Activation]:
    """``fmt``'s timed layer: its description (model, E, k, H, I, activation), random
    weights and activation; ``small``: the tiny shape of :data:`SMALL`."""
    model, E, k, H, I, act, biases = LAYERS[fmt]
    if small:
        E, k, H, I = SMALL[fmt]
    return (dict(format=fmt, model=model, E=E, k=k, H=H, I=I, activation=act), layer_weights(fmt, E, H, I, biases),
            Activation(act))


#: Something timed in the same rounds beside the kernel (the benchmark's torch path, or the
#: kernel with another setting): called with the round's token, ids and routing weights,
#: the kernel's job and the next round's ids.
Beside = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, object, torch.Tensor], None]


@dataclass
class Rounds:
    """The counted rounds' seconds: the kernel's call, the read kernel's sum, and each
    thing timed beside them."""
    kernel_s: list[float]
    read_s: list[float]
    beside_s: dict[str, list[float]] = field(default_factory=dict)

    def kernel_gbps(self, nbytes: int) -> float:
        """Bytes of one call over the median call."""
        return nbytes / statistics.median(self.kernel_s) / 1e9

    def read_gbps(self, read_bytes: int) -> float:
        return read_bytes / statistics.median(self.read_s) / 1e9


def side_by_side(weights: ExpertWeights, activation: Activation, k: int, threads: int, calls: int,
                 read_buf: torch.Tensor, lib, beside: dict[str, Beside] | None = None, seed: int | None = None) -> Rounds:
    """``calls`` counted rounds (after :data:`WARM_ROUNDS`) of one kernel call for one token
    with new random ids, then one read-kernel sum of ``read_buf``, then each of ``beside``;
    all with ``threads`` threads (torch's too, for the duration)."""
    from .kernel import MoEJob, read_sum

    E, H = weights.num_experts, weights.hidden
    x = torch.randn(1, H).bfloat16()
    ids = torch.zeros(1, k, dtype=torch.int32)
    tw = torch.rand(1, k)
    job = MoEJob(x, ids, tw, weights, activation, out=torch.empty(1, H), threads=threads, library_=lib)
    g = torch.Generator().manual_seed(threads if seed is None else seed)
    picks = [torch.randperm(E, generator=g)[:k].view(1, k) for _ in range(calls + WARM_ROUNDS)]
    out = Rounds([], [], {name: [] for name in beside or {}})
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for r, p in enumerate(picks):
            ids.copy_(p)
            t0 = time.perf_counter()
            job.run()
            t1 = time.perf_counter()
            read_sum(lib, read_buf, threads)
            t2 = time.perf_counter()
            extra = []
            for fn in (beside or {}).values():
                s = time.perf_counter()
                fn(x, ids, tw, job, picks[(r + 1) % len(picks)])
                extra.append(time.perf_counter() - s)
            if r >= WARM_ROUNDS:
                out.kernel_s.append(t1 - t0)
                out.read_s.append(t2 - t1)
                for name, s in zip(out.beside_s, extra):
                    out.beside_s[name].append(s)
    finally:
        torch.set_num_threads(before)
    return out
