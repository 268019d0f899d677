"""The routed experts' computation in plain torch, float32: the kernel's oracle; the path
the runtime takes on the device above the crossover batch (:func:`moe_copied`); and a
device share's own path (:func:`held_share`, :func:`moe_picked`), in bf16, which reads its
weights once.

Only torch operations, so it runs on whatever device the tensors are on (a CUDA tensor, a
UVA view of host memory); nothing here calls the compiled kernel.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch

from ..estimate.host import share_gathers
from .weights import Activation, ExpertWeights

#: e2m1 (fp4) code -> value; bit 3 is the sign.
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def _rows(t: torch.Tensor, experts: torch.Tensor | None) -> torch.Tensor:
    return t if experts is None else t.index_select(0, experts.to(t.device, torch.long))


_NIBBLE_TABLES: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}


def _nibbles(w: torch.Tensor, kind: str, dtype: torch.dtype) -> torch.Tensor:
    """Packed 4-bit codes [..., cols / 2] as ``dtype`` values [..., cols], exactly: element
    2i is byte i's low nibble, 2i + 1 its high one. Each byte is looked up in a table of its
    two values, e2m1 values (``"e2m1"``) or the codes 0 to 15 (``"code"``): a few bytes of
    traffic a parameter, where unpacking the nibbles op by op takes tens. The table is made
    once per device: a host-to-device copy cannot be captured in a CUDA graph."""
    table = _NIBBLE_TABLES.get((kind, dtype, w.device))
    if table is None:
        b = torch.arange(256)
        values = torch.tensor(E2M1) if kind == "e2m1" else torch.arange(16.0)
        table = torch.stack((values[b & 0x0F], values[b >> 4]), -1)
        table = _NIBBLE_TABLES[(kind, dtype, w.device)] = table.to(dtype).to(w.device)
    return torch.nn.functional.embedding(w.int(), table).flatten(-2)


def _zero_rows(z: torch.Tensor) -> torch.Tensor:
    """int4 zero points [..., rows / 2, groups] as one per row [..., rows, groups]: rows 2m
    and 2m + 1 are a byte's low and high nibble."""
    return torch.stack((z & 0x0F, z >> 4), dim=-2).flatten(-3, -2)


def dequantize(weights: ExpertWeights, which: str, experts: torch.Tensor | None = None) -> torch.Tensor:
    """``which`` ("w13" or "w2") of the given experts (all when None) as float32
    [n, rows, columns], on the weights' device."""
    if which not in ("w13", "w2"):
        raise ValueError(f"dequantize: which={which!r}; use 'w13' or 'w2'")
    w = _rows(getattr(weights, which), experts)
    if weights.fmt in ("bf16", "f32"):
        return w.float()
    scale = _rows(getattr(weights, which + "_scale"), experts)
    if weights.fmt == "mxfp4":
        factor = torch.exp2(scale.float() - 127.0)
        return (_nibbles(w, "e2m1", torch.float32).unflatten(-1, (-1, 32)) * factor.unsqueeze(-1)).flatten(-2)
    if weights.fmt == "int4":
        # value (nibble - z) times its group's scale, z 8 or the group's zero point
        codes = _nibbles(w, "code", torch.float32)
        zeros = getattr(weights, which + "_zeros")
        if zeros is None:
            values = codes - 8.0
        else:
            z = _zero_rows(_rows(zeros, experts))
            values = codes - z.float().repeat_interleave(codes.shape[-1] // z.shape[-1], dim=-1)
        return (values.unflatten(-1, (scale.shape[-1], -1)) * scale.float().unsqueeze(-1)).flatten(-2)
    # fp8-block: one scale per (block_n rows, block_k columns) (:func:`_block_rows`).
    bcol = torch.arange(w.shape[2], device=w.device) // weights.block[1]
    full = scale.index_select(1, _block_rows(weights, which, w.device)).index_select(2, bcol)
    return w.float() * full


def _block_rows(weights: ExpertWeights, which: str, device: torch.device) -> torch.Tensor:
    """Block FP8: the scale row of each of ``which``'s rows. w13's gate and up halves each
    start a new block row (vLLM's w13 scale is 2 * ceil(I / block_n) rows)."""
    bn = weights.block[0]
    r = torch.arange(getattr(weights, which).shape[1], device=device)
    if which == "w13":
        I = weights.intermediate
        shard = r // I
        return shard * (-(-I // bn)) + (r - shard * I) // bn
    return r // bn


def activate(h: torch.Tensor, activation: Activation) -> torch.Tensor:
    """act of the up projection's output h [..., 2I] -> [..., I]."""
    if activation.kind in ("silu", "gelu_tanh"):
        I = h.shape[-1] // 2
        g = (torch.nn.functional.silu(h[..., :I]) if activation.kind == "silu"
             else torch.nn.functional.gelu(h[..., :I], approximate="tanh"))
        return g * h[..., I:]
    g, u = h[..., 0::2], h[..., 1::2]
    if activation.limit is not None:
        g = g.clamp(max=activation.limit)
        u = u.clamp(min=-activation.limit, max=activation.limit)
    return (u + 1) * g * torch.sigmoid(activation.alpha * g)


def int8_blocks(v: torch.Tensor) -> torch.Tensor:
    """v [..., n] (n a multiple of 32) as the kernel's int8 MXFP4 path holds it, back in
    float32: each block of 32 scaled so its largest magnitude is 127, rounded to nearest
    (even on ties), times the scale again (llama.cpp's q8_0)."""
    b = v.float().unflatten(-1, (-1, 32))
    amax = b.abs().amax(-1, keepdim=True)
    # 127 / amax rounded once, as the kernel's 127.0f / amax: torch's scalar / tensor is the
    # tensor's reciprocal times the scalar, rounded twice, and a product landing a last bit
    # from a half step then rounds the other way than the kernel's.
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    return (torch.round(b * inv).clamp(-127, 127) * (amax / 127.0)).flatten(-2)


def moe_reference(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, weights: ExpertWeights,
                  activation: Activation, *, out: torch.Tensor | None = None, threads: int | None = None,
                  host_mask: torch.Tensor | None = None, int8_vectors: bool = False) -> torch.Tensor:
    """out[t] = sum_j w[t, j] * (W2[e] @ act(W13[e] @ x[t] + b13[e]) + b2[e]), e = ids[t, j],
    over the picks with e >= 0 and host_mask[e] set; float32 [T, H]. ``int8_vectors``:
    the tokens and the activation rounded as the kernel's int8 path rounds them
    (:func:`int8_blocks`). ``threads`` is accepted for the same signature as the kernel
    and ignored."""
    del threads
    dev = weights.w13.device
    xf = x.to(dev, torch.float32)
    rnd = int8_blocks if int8_vectors else (lambda v: v)
    xf = rnd(xf)
    ids = topk_ids.to(dev, torch.long)
    keep = ids >= 0
    if host_mask is not None:
        keep &= host_mask.to(dev, torch.bool)[ids.clamp(min=0)]

    def float32(e: int) -> tuple[torch.Tensor, torch.Tensor]:
        one = torch.tensor([e], device=dev)
        return dequantize(weights, "w13", one)[0], dequantize(weights, "w2", one)[0]

    result = _expert_sums(xf, ids, keep, topk_weights, weights, activation, float32, rnd)
    if out is not None:
        out.copy_(result)
        return out
    return result


def held_share(weights: ExpertWeights, count: int, device: torch.device | str, *,
               into: ExpertWeights | None = None, native: bool = False,
               ids: "tuple[int, ...] | list[int] | None" = None) -> ExpertWeights:
    """The device share of ``weights``' first ``count`` experts (or of the ``count`` experts
    ``ids`` names, in that order: share slot ``i`` holds expert ``ids[i]``) as the device holds
    it: w13 and w2 in bf16 (float32 weights stay float32), dequantized one expert at a time on the
    way (:func:`moe_picked` reads such a weight once per matmul; a quantized share would be
    dequantized at every step, many times its bytes in memory traffic), biases as they are.
    ``native``: every tensor copied as stored instead, for the share kernel that reads the
    format where it lies (``estimate.host.share_native`` says which shares are so held).
    ``into``: a share made before, of the same shape, refilled in place (a captured graph
    holds its tensors)."""
    if not 0 < count <= weights.num_experts:
        raise ValueError(f"{weights.fmt}: a share of 1 to {weights.num_experts} experts, not {count}")
    experts = list(range(count)) if ids is None else [int(e) for e in ids]
    if len(experts) != count or len(set(experts)) != count or not all(0 <= e < weights.num_experts for e in experts):
        raise ValueError(f"held_share: {count} distinct experts of {weights.num_experts}, not {experts[:8]}")
    pick = slice(0, count) if ids is None else torch.tensor(experts, dtype=torch.long)
    if native:
        if into is not None:  # refilled in place, tensor by tensor, as stored
            made = into.tensors()
            for name, t in weights.tensors().items():
                if name not in made or tuple(made[name].shape) != (count, *t.shape[1:]):
                    raise ValueError(f"held_share: the share to refill has no {count}-expert {name} as stored")
                made[name].copy_(t[pick])
            return into
        return replace(weights, **{name: t[pick].to(device, copy=True).contiguous()
                                   for name, t in weights.tensors().items()})
    H, I = weights.hidden, weights.intermediate
    shapes = {"w13": (count, 2 * I, H), "w2": (count, H, I)}
    fmt = "f32" if weights.fmt == "f32" else "bf16"
    if into is None:
        dtype = torch.float32 if fmt == "f32" else torch.bfloat16
        held = {name: torch.empty(shape, dtype=dtype, device=device) for name, shape in shapes.items()}
        for name in ("w13_bias", "w2_bias"):
            t = getattr(weights, name)
            if t is not None:
                held[name] = torch.empty_like(t[:count], device=device)
        into = ExpertWeights(fmt, **held)
    elif into.fmt != fmt or {n: tuple(getattr(into, n).shape) for n in shapes} != shapes:
        raise ValueError(f"held_share: the share to refill is not {count} {fmt} experts of this shape")
    for name in ("w13", "w2"):
        target = getattr(into, name)
        for slot, e in enumerate(experts):
            one = torch.full((1,), e, dtype=torch.long)
            target[slot].copy_(dequantize(weights, name, one)[0])
    for name in ("w13_bias", "w2_bias"):
        if getattr(weights, name) is not None:
            getattr(into, name).copy_(getattr(weights, name)[pick])
    return into


def moe_picked(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, weights: ExpertWeights,
               activation: Activation) -> torch.Tensor:
    """The sum :func:`moe_reference` makes over the picks of a held share's experts
    (:func:`held_share`: bf16; ids 0 to E - 1, any other id, negative or past E, contributes
    nothing), without a host synchronisation or a shape that depends on the routing, so a
    CUDA graph captures it. Matmuls run in the weights' dtype, which they read once. Where
    ``estimate.host.share_gathers`` says so (a decode step picking few of the share's experts),
    each of the k pick slots gathers its tokens' experts and multiplies them batched;
    otherwise every expert is computed for every token and weighted by its picks (each read
    once). ``estimate.host.device_share_traffic`` prices what this moves. float32 [T, H], on the
    weights' device."""
    if weights.fmt not in ("bf16", "f32"):
        raise ValueError(f"moe_picked: {weights.fmt} weights; hold the share in bf16 first (held_share)")
    dev, dtype = weights.w13.device, weights.w13.dtype
    xw = x.to(dev, dtype)
    ids = topk_ids.to(dev, torch.long)
    E = weights.num_experts
    inside = (ids >= 0) & (ids < E)
    safe = torch.where(inside, ids, torch.zeros_like(ids))
    tw = torch.where(inside, topk_weights.to(dev, torch.float32), torch.zeros_like(ids, dtype=torch.float32))
    out = torch.zeros(xw.shape[0], weights.hidden, dtype=torch.float32, device=dev)

    def expert_out(w13: torch.Tensor, w2: torch.Tensor, b13, b2) -> torch.Tensor:
        h = (torch.bmm(w13, xw.unsqueeze(-1)).squeeze(-1) if w13.dim() == 3
             else torch.nn.functional.linear(xw, w13)).float()
        h = h + b13.float() if b13 is not None else h
        a = activate(h, activation).to(dtype)
        y = (torch.bmm(w2, a.unsqueeze(-1)).squeeze(-1) if w2.dim() == 3
             else torch.nn.functional.linear(a, w2)).float()
        return y + b2.float() if b2 is not None else y

    if share_gathers(xw.shape[0], ids.shape[1], E):
        for j in range(ids.shape[1]):
            e = safe[:, j]
            b13 = None if weights.w13_bias is None else weights.w13_bias.index_select(0, e)
            b2 = None if weights.w2_bias is None else weights.w2_bias.index_select(0, e)
            y = expert_out(weights.w13.index_select(0, e), weights.w2.index_select(0, e), b13, b2)
            out += y * tw[:, j:j + 1]
        return out
    for e in range(E):  # views of each expert: read once, nothing copied, nothing on the host
        b13 = None if weights.w13_bias is None else weights.w13_bias[e]
        b2 = None if weights.w2_bias is None else weights.w2_bias[e]
        y = expert_out(weights.w13[e], weights.w2[e], b13, b2)
        out += y * (tw * (safe == e)).sum(-1, keepdim=True)
    return out


def _one_expert(weights: ExpertWeights, which: str, e: int) -> torch.Tensor:
    """Expert ``e``'s ``which`` as the copied path multiplies it: bf16 and float32 weights as
    they are (a view); MXFP4 (exactly: an e2m1 value times a power of two is a bf16 value),
    int4 and block FP8 dequantized to bf16 in a few passes over the expert, each value times
    its scale in bf16 (a float32 or f16 scale rounded to bf16 first: :func:`held_share`'s
    float32 products may round a last bit differently); block FP8 whose columns do not fill
    whole blocks in float32 (:func:`dequantize`)."""
    w = getattr(weights, which)[e]
    if weights.fmt in ("bf16", "f32"):
        return w
    scale = getattr(weights, which + "_scale")[e]
    if weights.fmt == "mxfp4":
        factor = torch.exp2(scale.float() - 127.0).bfloat16()
        return (_nibbles(w, "e2m1", torch.bfloat16).unflatten(-1, (-1, 32)) * factor.unsqueeze(-1)).flatten(-2)
    if weights.fmt == "int4":
        # code * scale less zero * scale in one pass over the expert (the zeros' products are
        # one a group; a symmetric group's zero is 8)
        zeros, s = getattr(weights, which + "_zeros"), scale.bfloat16().unsqueeze(-1)
        z = 8.0 if zeros is None else _zero_rows(zeros[e]).bfloat16().unsqueeze(-1)
        shift = -(z * s)
        codes = _nibbles(w, "code", torch.bfloat16).unflatten(-1, (scale.shape[-1], -1))
        return torch.addcmul(shift, codes, s).flatten(-2)
    bk = weights.block[1]
    if w.shape[-1] % bk:
        return dequantize(weights, which, torch.tensor([e], device=w.device))[0]
    rows = scale.index_select(0, _block_rows(weights, which, w.device)).bfloat16()  # [rows, column blocks]
    return (w.bfloat16().unflatten(-1, (-1, bk)) * rows.unsqueeze(-1)).flatten(-2)


def moe_copied(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, weights: ExpertWeights,
               activation: Activation) -> torch.Tensor:
    """The sum :func:`moe_reference` makes (picks with id >= 0), as the device computes it
    above the crossover, on experts copied there: each expert the step uses is multiplied in
    the dtype :func:`_one_expert` gives it, its weights read once by each matmul, the sums
    in float32. ``estimate.host.COPIED_PATH_TRAFFIC`` prices what this moves. float32 [T, H], on
    the weights' device; not for a CUDA graph (the experts it visits depend on the routing)."""
    ids = topk_ids.to(weights.w13.device, torch.long)
    return _expert_sums(x.to(weights.w13.device), ids, ids >= 0, topk_weights, weights, activation,
                        lambda e: (_one_expert(weights, "w13", e), _one_expert(weights, "w2", e)))


def _expert_sums(x: torch.Tensor, ids: torch.Tensor, keep: torch.Tensor, topk_weights: torch.Tensor,
                 weights: ExpertWeights, activation: Activation,
                 matrices: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
                 rnd: Callable[[torch.Tensor], torch.Tensor] = lambda v: v) -> torch.Tensor:
    """The weighted sum over the picks ``keep`` marks, one expert at a time: its tokens times
    the expert's w13 and w2 as ``matrices(e)`` gives them, each matmul in that matrix's dtype
    with its products summed into float32, the biases and sums in float32; ``rnd`` rounds
    the activation before the second matmul. float32 [T, H] on ``x``'s device."""
    tw = topk_weights.to(x.device, torch.float32)
    result = torch.zeros(x.shape[0], weights.hidden, dtype=torch.float32, device=x.device)
    for e in torch.unique(ids[keep]).tolist():
        tok, pick = torch.nonzero(keep & (ids == e), as_tuple=True)
        w13, w2 = matrices(e)
        h = torch.nn.functional.linear(x[tok].to(w13.dtype), w13).float()
        if weights.w13_bias is not None:
            h = h + weights.w13_bias[e].float()
        y = torch.nn.functional.linear(rnd(activate(h, activation)).to(w2.dtype), w2).float()
        if weights.w2_bias is not None:
            y = y + weights.w2_bias[e].float()
        result.index_add_(0, tok, y * tw[tok, pick].unsqueeze(-1))
    return result
