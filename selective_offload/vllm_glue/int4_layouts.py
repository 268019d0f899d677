"""Int4 weights as the host CPU's int4 kernel reads them: which vLLM W4A16 methods it
reads (GPTQ's, AWQ's, compressed-tensors'), the one-line refusal of any other, and the
rewrite of GPTQ's and AWQ's layouts in place.

GPTQ's and AWQ's create_weights pack along the input dimension first, which a row walk
cannot stream, so each tensor is rewritten row-major in its own storage (:func:`int4_rows`,
:func:`mlp_rows`), the same bytes in the page-locked arena, and again after a reload.
compressed-tensors' int4 (``pack-quantized``) is row-major already and is read as loaded.
4-bit groups without act-order: symmetric (value = nibble - 8), or AWQ's with zero points.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..errors import PlanError

#: The W4A16 methods whose create_weights layout :func:`int4_rows` reads (vLLM 0.33's
#: auto_gptq.py, and the names before its rename), for experts and for linears.
GPTQ_METHODS = ("AutoGPTQMoEMethod", "GPTQMarlinMoEMethod", "AutoGPTQLinearMethod", "GPTQMarlinLinearMethod")
#: The same for AWQ (the CPU build serves its linears by AutoAWQMarlinLinearMethod).
AWQ_METHODS = ("AutoAWQMoEMethod", "AWQMarlinMoEMethod", "AutoAWQLinearMethod", "AutoAWQMarlinLinearMethod",
               "AWQMarlinLinearMethod")
#: AWQ packs eight output columns per int32 in this order: nibble i holds column AWQ_ORDER[i].
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
#: compressed-tensors' W4A16 experts method and linear scheme, whose layout is the kernel's
#: (``weight_packed`` [.., N, K/8] int32 and ``weight_scale`` [.., N, K/g], row-major).
CT_INT4 = ("CompressedTensorsWNA16MoEMethod", "CompressedTensorsWNA16")


def refuse_unread_int4(group: str, method: Any, what: str = "these routed experts") -> None:
    """W4A16 weights the int4 kernel reads: GPTQ's, AWQ's or compressed-tensors' layout,
    4-bit groups of a multiple of 32 columns (or one per channel), symmetric or with AWQ's
    zero points, no act-order; anything else one line."""
    name = type(method).__name__
    if name in CT_INT4:
        bits, sym, group_size = method.num_bits, bool(method.symmetric), method.group_size
        act_order = getattr(getattr(method, "weight_quant", None), "actorder", None) == "group"
    elif name in AWQ_METHODS:  # zero points the kernel reads: "symmetric" for its purpose
        qc = method.quant_config
        bits, sym, group_size, act_order = qc.weight_bits, bool(qc.zero_point), qc.group_size, False
    else:
        qc = getattr(method, "quant_config", None)
        bits = getattr(getattr(qc, "quant_type", None), "size_bits", None)
        sym, group_size = bool(getattr(qc, "is_sym", False)), getattr(qc, "group_size", None)
        act_order = bool(getattr(qc, "desc_act", False))
    why = None
    if name not in GPTQ_METHODS + AWQ_METHODS + CT_INT4:
        why = f"{name}'s layout (the int4 kernel reads GPTQ's, AWQ's and compressed-tensors')"
    elif bits != 4 or not sym:
        why = (f"{bits}-bit AWQ weights{'' if sym else ' without zero points'}" if name in AWQ_METHODS else
               f"{bits}-bit {'symmetric' if sym else 'asymmetric (zero points)'} weights")
    elif act_order:
        why = "act-order groups"
    elif not isinstance(group_size, int) or (group_size != -1 and group_size % 32):
        why = f"groups of {group_size} columns (the kernel reads multiples of 32)"
    if why is not None:
        raise PlanError(f"{group}: the plan computes {what} on the host CPU in int4, and the int4 kernel "
                        f"reads 4-bit groups (symmetric, or AWQ's with zero points), not {why}; plan them "
                        "served uva or on the device")


def _unpack_awq(q: torch.Tensor) -> torch.Tensor:
    """AWQ's [.., rows, N/8] int32 as [.., rows, N] codes in column order."""
    nibbles = torch.stack([(q >> (4 * i)) & 0xF for i in range(8)], dim=-1)
    inverse = [AWQ_ORDER.index(c) for c in range(8)]
    return nibbles[..., inverse].flatten(-2).to(torch.uint8)


def awq_rows_in_place(q: torch.Tensor, scale: torch.Tensor, zeros: torch.Tensor | None):
    """One AWQ weight as the int4 kernel reads it, rewritten in its own storages: qweight
    ([E, K, N/8] or [K, N/8] int32, eight output columns per word in AWQ's order) as
    row-major nibbles [E, N, K/2], scales ([.., K/g, N]) as [E, N, K/g], and qzeros ([..,
    K/g, N/8], the same packing) as a byte per group for each pair of rows [E, N/2, K/g]
    (row 2m's zero point in the low nibble): each the same bytes as before."""
    q3, s3 = (q, scale) if q.dim() == 3 else (q.unsqueeze(0), scale.unsqueeze(0))
    E, K, packed = q3.shape
    codes = _unpack_awq(q3).transpose(1, 2)  # [E, N, K]
    q3.view(-1).view(torch.uint8).copy_((codes[..., 0::2] | (codes[..., 1::2] << 4)).reshape(-1))
    s3.view(-1).copy_(s3.transpose(1, 2).contiguous().view(-1))
    N = packed * 8
    out = [q3.view(-1).view(torch.uint8).view(E, N, K // 2), s3.view(E, N, s3.shape[1])]
    if zeros is None:
        return *out, None
    z3 = zeros if zeros.dim() == 3 else zeros.unsqueeze(0)
    z = _unpack_awq(z3).transpose(1, 2)  # [E, N, K/g]
    z3.view(-1).view(torch.uint8).copy_((z[:, 0::2] | (z[:, 1::2] << 4)).reshape(-1))
    return *out, z3.view(-1).view(torch.uint8).view(E, N // 2, z.shape[-1])


def rows_in_place(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One GPTQ weight as the int4 kernel reads it, rewritten in its own storage: qweight
    ([E, K/8, N] or [K/8, N] int32, 8 nibbles of consecutive inputs per word) and scales
    ([E, K/g, N] or [K/g, N]) transposed row-major (the output's rows, their inputs
    consecutive: a word's nibbles are then bytes in the order the kernel reads, low nibble
    first). Returns uint8 [E, N, K/2] and scales [E, N, K/g] (E = 1 for a linear)."""
    q3, s3 = (q, scale) if q.dim() == 3 else (q.unsqueeze(0), scale.unsqueeze(0))
    E, packed, N = q3.shape
    q3.view(-1).copy_(q3.transpose(1, 2).contiguous().view(-1))
    s3.view(-1).copy_(s3.transpose(1, 2).contiguous().view(-1))
    return q3.view(-1).view(torch.uint8).view(E, N, packed * 4), s3.view(E, N, s3.shape[1])


def _rewritten(which: str, q: torch.Tensor, scale: torch.Tensor, zeros: Any, awq: bool) -> dict[str, torch.Tensor]:
    """``which``'s tensors (``w13`` or ``w2``) for the int4 kernel, GPTQ's or AWQ's (with its
    zero points, when it holds them) rewritten in place."""
    if not awq:
        return dict(zip((which, f"{which}_scale"), rows_in_place(q, scale)))
    z = zeros.data if isinstance(zeros, torch.Tensor) else None
    return dict(zip((which, f"{which}_scale", f"{which}_zeros"), awq_rows_in_place(q, scale, z)))


def int4_rows(module: nn.Module, awq: bool, shared: frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
    """GPTQ's or AWQ's experts as the int4 kernel reads them, each of w13/w2 rewritten in
    place (:func:`rows_in_place`, :func:`awq_rows_in_place`). Idempotent: a module already
    rewritten is read as it is."""
    done = getattr(module, "_selective_offload_int4_rows", None)
    if done is not None:
        return done
    out = {}
    for which in ("w13", "w2"):
        out.update(_rewritten(which, getattr(module, f"{which}_qweight").data, getattr(module, f"{which}_scales").data,
                              getattr(module, f"{which}_qzeros", None), awq))
    loaded = getattr(module, "_loaded_expert_biases", ())
    for name in ("w13_bias", "w2_bias"):
        t = getattr(module, name, None)
        if isinstance(t, torch.Tensor) and name in loaded and name not in shared:
            out[name] = t.data
    module._selective_offload_int4_rows = out
    return out


def mlp_rows(mlp: nn.Module) -> dict[str, torch.Tensor]:
    """An int4 MLP as one expert: compressed-tensors' projections as loaded, GPTQ's and AWQ's
    rewritten in place (:func:`rows_in_place`, :func:`awq_rows_in_place`); idempotent, as
    :func:`int4_rows`."""
    parts = (("w13", mlp.gate_up_proj), ("w2", mlp.down_proj))
    if all(isinstance(getattr(p, "weight_packed", None), torch.Tensor) for _, p in parts):  # compressed-tensors
        return {k: v for which, p in parts for k, v in ((which, p.weight_packed.data.view(torch.uint8).unsqueeze(0)),
                                                        (f"{which}_scale", p.weight_scale.data.unsqueeze(0)))}
    done = getattr(mlp, "_selective_offload_int4_rows", None)
    if done is None:
        done = {}
        for which, part in parts:
            done.update(_rewritten(which, part.qweight.data, part.scales.data, getattr(part, "qzeros", None),
                                   type(part.quant_method).__name__ in AWQ_METHODS))
        mlp._selective_offload_int4_rows = done
    return done
