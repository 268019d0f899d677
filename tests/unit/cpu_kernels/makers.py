"""Tiny random experts of every format, made by the tests (nothing downloaded)."""

from __future__ import annotations

import torch

from selective_offload.cpu_kernels import ExpertWeights


def ceil(a, b):
    return -(-a // b)


def experts(fmt: str, E: int, H: int, I: int, *, bias: str | None = None, seed: int = 0,
            block=(128, 128), group: int = 32, scale_dtype=torch.bfloat16, zeros: bool = False) -> ExpertWeights:
    g = torch.Generator().manual_seed(seed)
    biases = {}
    if bias:
        dtype = torch.bfloat16 if bias == "bf16" else torch.float32
        biases = dict(w13_bias=torch.randn(E, 2 * I, generator=g).to(dtype),
                      w2_bias=torch.randn(E, H, generator=g).to(dtype))
    if fmt == "bf16":
        return ExpertWeights("bf16", (torch.randn(E, 2 * I, H, generator=g) * 0.2).bfloat16(),
                             (torch.randn(E, H, I, generator=g) * 0.2).bfloat16(), **biases)
    if fmt == "mxfp4":
        def q(*shape):
            return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)

        def s(*shape):  # e8m0 around 2^-4 .. 2^0, with an s = 0 (2^-127) now and then
            t = torch.randint(123, 128, shape, generator=g, dtype=torch.uint8)
            t.view(-1)[::17] = 0
            return t
        return ExpertWeights("mxfp4", q(E, 2 * I, H // 2), q(E, H, I // 2), s(E, 2 * I, H // 32), s(E, H, I // 32),
                             **biases)
    if fmt == "int4":
        def q(*shape):
            return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)

        def s(*shape):
            return (torch.rand(*shape, generator=g) * 0.1 + 0.01).to(scale_dtype)
        z = dict(w13_zeros=q(E, I, H // group), w2_zeros=q(E, H // 2, I // group)) if zeros else {}
        return ExpertWeights("int4", q(E, 2 * I, H // 2), q(E, H, I // 2), s(E, 2 * I, H // group),
                             s(E, H, I // group), **biases, **z)
    bn, bk = block
    return ExpertWeights("fp8-block", (torch.randn(E, 2 * I, H, generator=g) * 2).to(torch.float8_e4m3fn),
                         (torch.randn(E, H, I, generator=g) * 2).to(torch.float8_e4m3fn),
                         torch.rand(E, 2 * ceil(I, bn), ceil(H, bk), generator=g) * 0.1 + 0.01,
                         torch.rand(E, ceil(H, bn), ceil(I, bk), generator=g) * 0.1 + 0.01, block=block, **biases)


def routing(T: int, K: int, E: int, seed: int = 0, negative: bool = True):
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)
    if negative and T * K > 2:
        ids.view(-1)[1] = -1
    return ids, torch.rand(T, K, generator=g)
