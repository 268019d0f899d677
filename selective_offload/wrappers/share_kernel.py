"""A device share read where it lies: a host-compute layer's first experts held on the device
in the checkpoint's own format and computed there by a kernel that reads them by the
router's ids, while the CPU computes the picks that land on the host
(:class:`~selective_offload.wrappers.host_compute.HostExperts`).

Why: a share held in bf16 (``cpu_kernels.reference.held_share``) costs an MXFP4 checkpoint
about four times the bytes it stores, and torch ops would dequantize a share held as stored at
every step, many times its bytes in memory traffic. This kernel reads each picked expert's
stored bytes once per step, so the share costs the device its stored size and the step
model prices its traffic so (``estimate.host.NATIVE_SHARE_FORMATS``, ``device_share_traffic``).

Two Triton kernels, one program per (block of output rows, expert of the share), on a fixed
grid (a CUDA graph captures it): each program walks the step's pick slots and, for each
slot that picked its expert, computes that slot's rows: ``_up`` act(W13[e] @ x[t] + b13[e]),
``_down`` (W2[e] @ act + b2[e]) times the slot's top-k weight. A program whose expert no slot
picked reads nothing but the ids; a slot picking its expert again rereads a block of rows the
first read just brought into the cache. Slots whose pick lies outside the share (a host
expert, or -1) are left zero. MXFP4's e2m1 codes and e8m0 scales (one per 32 columns) are
decoded in registers; bf16 is read as it is (the benchmarks compare it with the bf16 share's
torch path; plans use the kernel for ``NATIVE_SHARE_FORMATS`` only). The activation is
:class:`~selective_offload.cpu_kernels.Activation`'s (silu with gate and up halves, or
gpt-oss's clamped swiglu with interleaved rows), as ``cpu_kernels.reference.activate``
computes it.

Triton compiles it where torch sees a CUDA device. A share on the CPU runs under Triton's
interpreter, which is how the tests check it against the reference: Triton decides that when
it is imported, from ``TRITON_INTERPRET=1`` in the environment, for every kernel in the
process, so such a process imports no other Triton code (no vLLM); without it,
:func:`moe_native` refuses a CPU share (the CPU build's engine computes its share with
:func:`moe_held`'s stand-in instead). The tests also compile both kernels ahead for sm_89 and
sm_90 with Triton's NVIDIA backend, which needs no GPU: that they build for the card is
checked here; how fast they run, the GPU run measures (``benchmarks/host_compute/share.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..cpu_kernels import Activation, ExpertWeights
from ..cpu_kernels.reference import held_share

#: The formats the kernel reads: bf16 weights as they are, MXFP4 (uint8 pairs of e2m1
#: codes, low nibble first; one e8m0 scale per 32 columns).
FORMATS = ("bf16", "mxfp4")


@triton.jit
def _e2m1(code):
    """e2m1 codes (int32, 0 to 15) as float32 values; bit 3 is the sign."""
    e = (code >> 1) & 3
    m = (code & 1).to(tl.float32)
    mag = tl.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * tl.exp2((e - 1).to(tl.float32)))
    return tl.where((code & 8) != 0, -mag, mag)


@triton.jit
def _rows_dot(w_ptr, s_ptr, v_ptr, rows, live_rows, ncols,
              MXFP4: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """sum over columns of W[rows, c] * v[c] (float32 [BLOCK_R]); ``w_ptr`` and ``s_ptr``
    point at the expert's first row, ``live_rows`` masks rows (and the whole slot) off."""
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for k0 in range(0, ncols, BLOCK_K):
        if MXFP4:
            half = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            hm = half < ncols // 2
            m2 = live_rows[:, None] & hm[None, :]
            byte = tl.load(w_ptr + rows[:, None] * (ncols // 2) + half[None, :], mask=m2, other=0).to(tl.int32)
            ve = tl.load(v_ptr + 2 * half, mask=hm, other=0.0)
            vo = tl.load(v_ptr + 2 * half + 1, mask=hm, other=0.0)
            part = _e2m1(byte & 15) * ve[None, :] + _e2m1(byte >> 4) * vo[None, :]
            blocks = tl.sum(tl.reshape(part, [BLOCK_R, BLOCK_K // 32, 16]), axis=2)
            sb = k0 // 32 + tl.arange(0, BLOCK_K // 32)
            sm = live_rows[:, None] & (sb < ncols // 32)[None, :]
            scale = tl.load(s_ptr + rows[:, None] * (ncols // 32) + sb[None, :], mask=sm, other=127)
            acc += tl.sum(blocks * tl.exp2(scale.to(tl.float32) - 127.0), axis=1)
        else:
            cols = k0 + tl.arange(0, BLOCK_K)
            cm = cols < ncols
            w = tl.load(w_ptr + rows[:, None] * ncols + cols[None, :], mask=live_rows[:, None] & cm[None, :],
                        other=0.0).to(tl.float32)
            v = tl.load(v_ptr + cols, mask=cm, other=0.0)
            acc += tl.sum(w * v[None, :], axis=1)
    return acc


@triton.jit
def _up(x_ptr, ids_ptr, w_ptr, s_ptr, b_ptr, act_ptr, H, I, SLOTS, K, alpha, limit,
        MXFP4: tl.constexpr, SWIGLU: tl.constexpr, GELU: tl.constexpr, BIAS: tl.constexpr, CLAMP: tl.constexpr,
        BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    e = tl.program_id(1)  # the share's expert this program reads
    i = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rm = i < I
    if SWIGLU:  # gpt-oss: gate and up rows interleaved
        gate, up = 2 * i, 2 * i + 1
    else:  # gate rows, then up rows
        gate, up = i, I + i
    e64 = e.to(tl.int64)
    if MXFP4:
        w_e = w_ptr + e64 * (2 * I) * (H // 2)
    else:
        w_e = w_ptr + e64 * (2 * I) * H
    s_e = s_ptr + e64 * (2 * I) * (H // 32)
    for slot in range(0, SLOTS):
        if tl.load(ids_ptr + slot) == e:
            x_t = x_ptr + (slot // K) * H
            g = _rows_dot(w_e, s_e, x_t, gate, rm, H, MXFP4, BLOCK_R, BLOCK_K)
            u = _rows_dot(w_e, s_e, x_t, up, rm, H, MXFP4, BLOCK_R, BLOCK_K)
            if BIAS:
                g += tl.load(b_ptr + e64 * (2 * I) + gate, mask=rm, other=0.0).to(tl.float32)
                u += tl.load(b_ptr + e64 * (2 * I) + up, mask=rm, other=0.0).to(tl.float32)
            if SWIGLU:
                if CLAMP:
                    g = tl.minimum(g, limit)
                    u = tl.minimum(tl.maximum(u, -limit), limit)
                a = (u + 1.0) * g / (1.0 + tl.exp(-alpha * g))
            elif GELU:  # gelu(g, tanh) = g * sigmoid(2 * sqrt(2/pi) * (g + 0.044715 g^3))
                a = g / (1.0 + tl.exp(-1.5957691216057308 * (g + 0.044715 * g * g * g))) * u
            else:
                a = g / (1.0 + tl.exp(-g)) * u
            tl.store(act_ptr + slot * I + i, a, mask=rm)


@triton.jit
def _down(act_ptr, ids_ptr, tw_ptr, w_ptr, s_ptr, b_ptr, y_ptr, H, I, SLOTS,
          MXFP4: tl.constexpr, BIAS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    e = tl.program_id(1)
    h = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    hm = h < H
    e64 = e.to(tl.int64)
    if MXFP4:
        w_e = w_ptr + e64 * H * (I // 2)
    else:
        w_e = w_ptr + e64 * H * I
    s_e = s_ptr + e64 * H * (I // 32)
    for slot in range(0, SLOTS):
        if tl.load(ids_ptr + slot) == e:
            y = _rows_dot(w_e, s_e, act_ptr + slot * I, h, hm, I, MXFP4, BLOCK_R, BLOCK_K)
            if BIAS:
                y += tl.load(b_ptr + e64 * H + h, mask=hm, other=0.0).to(tl.float32)
            weight = tl.load(tw_ptr + slot).to(tl.float32)
            tl.store(y_ptr + slot * H + h, y * weight, mask=hm)


def native_share(weights: ExpertWeights, count: int, device: torch.device | str) -> ExpertWeights:
    """The first ``count`` experts of ``weights`` on ``device`` as the checkpoint stores them
    (copies of its tensors: the bytes a natively held share takes)."""
    if weights.fmt not in FORMATS:
        raise ValueError(f"share_kernel reads {' and '.join(FORMATS)}, not {weights.fmt}")
    return held_share(weights, count, device, native=True)


def moe_native(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, share: ExpertWeights,
               activation: Activation, *, block_rows: int = 32, block_k: int = 256) -> torch.Tensor:
    """The sum ``cpu_kernels.reference.moe_reference`` makes over the picks that land in
    ``share`` (ids 0 to its experts - 1; any other id, negative or past it, contributes
    nothing), read from the share as it is held (:func:`native_share`). No host
    synchronisation and no shape that depends on the routing. float32 [T, H], on the
    share's device."""
    if share.fmt not in FORMATS:
        raise ValueError(f"moe_native reads {' and '.join(FORMATS)}, not {share.fmt}")
    mxfp4 = share.fmt == "mxfp4"
    if block_k % 32 or (mxfp4 and (share.hidden % 32 or share.intermediate % 32)):
        raise ValueError("moe_native: MXFP4 columns and block_k in whole 32-column blocks")
    dev = share.w13.device
    if dev.type != "cuda" and not triton.knobs.runtime.interpret:
        raise RuntimeError("share_kernel: a share on the CPU runs under Triton's interpreter only: "
                           "TRITON_INTERPRET=1 in the environment before Triton is imported")
    H, I, M = share.hidden, share.intermediate, share.num_experts
    T, K = topk_ids.shape
    xf = x.to(dev, torch.float32).contiguous()
    ids = topk_ids.to(dev, torch.int32).contiguous()
    tw = topk_weights.to(dev, torch.float32).contiguous()
    act = torch.empty(T * K, I, dtype=torch.float32, device=dev)
    # A slot no program writes (its pick is outside the share) adds zero to the sum.
    y = torch.zeros(T * K, H, dtype=torch.float32, device=dev)
    s13 = share.w13_scale if mxfp4 else share.w13  # an unused pointer when bf16
    s2 = share.w2_scale if mxfp4 else share.w2
    b13 = share.w13_bias if share.w13_bias is not None else share.w13
    b2 = share.w2_bias if share.w2_bias is not None else share.w2
    if activation.kind not in ("silu", "swigluoai", "gelu_tanh"):
        raise ValueError(f"moe_native computes silu, swigluoai and gelu_tanh, not {activation.kind}")
    swiglu = activation.kind == "swigluoai"
    limit = activation.limit if activation.limit is not None else 0.0
    _up[(triton.cdiv(I, block_rows), M)](
        xf, ids, share.w13, s13, b13, act, H, I, T * K, K, float(activation.alpha), float(limit),
        MXFP4=mxfp4, SWIGLU=swiglu, GELU=activation.kind == "gelu_tanh", BIAS=share.w13_bias is not None,
        CLAMP=swiglu and activation.limit is not None,
        BLOCK_R=block_rows, BLOCK_K=block_k)
    _down[(triton.cdiv(H, block_rows), M)](
        act, ids, tw, share.w2, s2, b2, y, H, I, T * K,
        MXFP4=mxfp4, BIAS=share.w2_bias is not None, BLOCK_R=block_rows, BLOCK_K=block_k)
    return y.view(T, K, H).sum(1)
