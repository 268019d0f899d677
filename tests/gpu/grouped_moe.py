"""A grouped-expert MoE layer in Triton: a named stand-in for vLLM's ``TritonExperts``.

Why a stand-in: the GPU machine has torch and Triton but no vLLM, so vLLM's fused-MoE
kernel (``fused_moe_kernel``, which ``TritonExperts`` runs) cannot be carried there. This
computes what that kernel computes, the way it reads expert weights when they are in host
memory (vLLM 0.33, ``fused_moe._prepare_expert_assignment`` with
``weights_host_resident=True``): the (token, expert) pairs are sorted by expert and each
expert's run padded to ``BLOCK_M`` (``moe_align_block_size``), and each program computes a
``BLOCK_M x BLOCK_N`` tile for one expert, so each routed expert's weights are read once per
group of up to ``BLOCK_M`` of its tokens, never once per pair. Two grouped GEMMs (``w13``,
gate and up, then ``w2``, down, scaled by the router weight), SiLU-and-mul between them,
summed over the top-k, as ``TritonExperts`` does. Weights are read through their own
strides, so a UVA view of a page-locked host tensor is read with the layout it was given.
Every step is a fixed-shape kernel with no host synchronisation: the whole layer captures
in a CUDA graph, routing included.

On the CPU the same kernel runs under Triton's interpreter (``TRITON_INTERPRET=1`` in the
environment before Triton is imported; float32 only, numpy has no bfloat16): ``tests/unit/wrappers/test_gpu_checks_cpu_proxy.py`` proves
there that this equals a per-token reference, so the GPU run compares UVA views against
device copies with a computation already known right.
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


@triton.jit
def _grouped_gemm(a_ptr, b_ptr, c_ptr, w_ptr, sorted_ptr, expert_ptr, padded_ptr,
                  N, K, num_valid, top_k,
                  stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
                  MUL_WEIGHT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    """C[slot, n] = sum_k A[slot // top_k, k] * B[expert, n, k] (times the slot's router
    weight with MUL_WEIGHT), for the BLOCK_M sorted slots of one expert and BLOCK_N columns."""
    pid = tl.program_id(0)
    num_n = (N + BLOCK_N - 1) // BLOCK_N
    pid_m = pid // num_n
    pid_n = pid % num_n
    if pid_m * BLOCK_M >= tl.load(padded_ptr):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(sorted_ptr + offs_m)
    valid = slots < num_valid
    expert = tl.load(expert_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows = (slots // top_k).to(tl.int64)
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + expert * stride_be + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None] * stride_bk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, (K + BLOCK_K - 1) // BLOCK_K):
        left = K - k0 * BLOCK_K
        a = tl.load(a_ptrs, mask=valid[:, None] & (offs_k[None, :] < left), other=0.0)
        b = tl.load(b_ptrs, mask=(offs_n[None, :] < N) & (offs_k[:, None] < left), other=0.0)
        acc += tl.dot(a, b)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if MUL_WEIGHT:
        w = tl.load(w_ptr + slots, mask=valid, other=0.0)
        acc = acc * w[:, None]
    c_ptrs = c_ptr + slots[:, None].to(tl.int64) * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & (offs_n[None, :] < N))


def blocks_for(tokens: int, small: bool = False) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): 16 rows for decode (as vLLM's configs take for few
    tokens), 64 for a prefill; 16-wide tiles for the tiny shapes (tl.dot's least)."""
    if small:
        return 16, 16, 16
    return (16 if tokens <= 32 else 64), 64, 64


def align(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """vLLM's ``moe_align_block_size`` in fixed-shape torch ops (no host sync, so it
    captures in a graph): slots ``t * top_k + j`` grouped by expert in token order, each
    expert's run padded to ``block_m`` with the sentinel ``T * top_k``; the expert of each
    block; the padded total."""
    flat = topk_ids.reshape(-1).long()
    m, device = flat.numel(), flat.device
    # Each slot's rank among its expert's slots, from a running count per expert (no sort).
    onehot = torch.zeros(m, num_experts, dtype=torch.long, device=device).scatter_(1, flat[:, None], 1)
    counts = onehot.sum(dim=0)
    rank = onehot.cumsum(dim=0).gather(1, flat[:, None]).squeeze(1) - 1
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = padded.cumsum(0)
    dest = (pad_end - padded).gather(0, flat) + rank
    capacity = -(-(m + num_experts * (block_m - 1)) // block_m) * block_m
    sorted_ids = torch.full((capacity,), m, dtype=torch.int32, device=device).scatter_(
        0, dest, torch.arange(m, dtype=torch.int32, device=device))
    block_starts = torch.arange(0, capacity, block_m, device=device)
    expert_ids = torch.searchsorted(pad_end, block_starts, right=True).clamp_(max=num_experts - 1).to(torch.int32)
    return sorted_ids, expert_ids, pad_end[-1:].to(torch.int32)


def _gemm(a, b, c, weights, sorted_ids, expert_ids, padded, top_k, mul, blocks):
    bm, bn, bk = blocks
    n, k = b.shape[1], b.shape[2]
    grid = (expert_ids.numel() * triton.cdiv(n, bn),)
    _grouped_gemm[grid](
        a, b, c, weights, sorted_ids, expert_ids, padded, n, k, c.shape[0], top_k,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), c.stride(0), c.stride(1),
        MUL_WEIGHT=mul, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)


def grouped_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor, blocks: tuple[int, int, int] | None = None) -> torch.Tensor:
    """The routed experts' output for ``x`` (T, H): ``w13`` (E, 2I, H) gate then up,
    ``w2`` (E, H, I), ``topk_weights`` float32 and ``topk_ids`` (T, top_k)."""
    tokens, hidden = x.shape
    experts, inter = w13.shape[0], w13.shape[1] // 2
    top_k = topk_ids.shape[1]
    blocks = blocks or blocks_for(tokens)
    sorted_ids, expert_ids, padded = align(topk_ids, experts, blocks[0])
    weights = topk_weights.reshape(-1).float()
    up = torch.empty(tokens * top_k, 2 * inter, dtype=x.dtype, device=x.device)
    _gemm(x, w13, up, weights, sorted_ids, expert_ids, padded, top_k, False, blocks)
    act = F.silu(up[:, :inter]) * up[:, inter:]
    down = torch.empty(tokens * top_k, hidden, dtype=x.dtype, device=x.device)
    _gemm(act, w2, down, weights, sorted_ids, expert_ids, padded, 1, True, blocks)
    return down.view(tokens, top_k, hidden).sum(dim=1)


def reference_experts(x, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    """The same layer the plain way, in float32, one expert at a time over its tokens
    (data-dependent indexing: eager only)."""
    inter = w13.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(w13.shape[0]):
        rows, cols = (topk_ids == e).nonzero(as_tuple=True)
        if rows.numel() == 0:
            continue
        h = x[rows].float() @ w13[e].float().t()
        a = F.silu(h[:, :inter]) * h[:, inter:]
        out.index_add_(0, rows, (a @ w2[e].float().t()) * topk_weights[rows, cols].float()[:, None])
    return out


def routing(tokens: int, experts: int, top_k: int, device, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random top-k routing: distinct experts per token, softmax-normalised weights."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=gen)
    weights, ids = torch.topk(logits.softmax(dim=-1), top_k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(device), ids.to(torch.int32).to(device)
