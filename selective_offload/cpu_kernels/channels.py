"""A dense MLP's weights split by intermediate channels: the first channels' share for the
device, the rest for the host CPU, in the same storage.

An MLP is one expert every token takes (``W13`` = gate rows then up rows, ``W2`` = down),
so it has no experts to divide between the GPU and the CPU; its channels are. With the
first ``n`` of its ``I`` intermediate channels on the device, the device computes
``W2[:, :n] @ act(W13[gate :n; up :n] @ x)`` and the host the same over channels ``n`` to
``I``; the two sums add up to the MLP's output, since the activation is per channel.

The CPU kernel streams whole rows of contiguous tensors, so each tensor is rearranged in
place (the same bytes, the same storage, a page-locked arena included) so that the host's
part comes first and is contiguous: ``W13``'s rows (and its scales' and zero points' rows)
as ``[gate n:, up n:, gate :n, up :n]``, ``W2``'s columns (and its scales' and zero points'
group columns) as the ``[rows, n:]`` block followed by the ``[rows, :n]`` block. The
device's part is the tail of each storage, held on the device by the caller
(:func:`~selective_offload.cpu_kernels.reference.held_share` of the returned share, in bf16). A reload writes the checkpoint's
layout back into the same tensors; splitting again restores the views' meaning.

Every cut must fall on a whole scale block or group: ``n`` times a tensor's entries per
channel must be whole (fp8's 128-row blocks, int4's groups, int4's row pairs of zero
points); otherwise :func:`split_channels` refuses with ``ValueError``.
"""

from __future__ import annotations

import torch

from .weights import ExpertWeights

#: Tensors whose rows run over W13's channels (gate then up), and those whose columns run
#: over W2's input channels.
ROW_TENSORS = ("w13", "w13_scale", "w13_zeros")
COLUMN_TENSORS = ("w2", "w2_scale", "w2_zeros")


def _cut(name: str, entries: int, channels: int, n: int) -> int:
    if (n * entries) % channels:
        raise ValueError(f"{name}: {entries} entries for {channels} channels cannot be cut after channel {n} "
                         "(the cut must fall on a whole block or group)")
    return n * entries // channels


def split_channels(weights: ExpertWeights, n: int) -> tuple[ExpertWeights, ExpertWeights]:
    """Rearrange one MLP's tensors (``weights``: one expert, each tensor contiguous) in place
    and return the host's part (channels ``n`` to ``I``) and the device's share (channels 0
    to ``n - 1``), both views of the same storage. Biases are not split (an MLP with one is
    refused before this)."""
    I = weights.intermediate
    if weights.num_experts != 1 or not 0 < n < I:
        raise ValueError(f"split_channels: one MLP (one expert) and 0 < n < {I} channels, not "
                         f"{weights.num_experts} experts and n={n}")
    if weights.w13_bias is not None or weights.w2_bias is not None:
        raise ValueError("split_channels: the MLP has biases; its channels are not split")
    host, share = {}, {}
    for name in ROW_TENSORS:
        t = getattr(weights, name)
        if t is None:
            continue
        if not t.is_contiguous():
            raise ValueError(f"{name}: not contiguous; its rows cannot be rearranged in place")
        half = t.shape[1] // 2
        c = _cut(name, half, I, n)
        gate, up = t[:, :half], t[:, half:]
        t.copy_(torch.cat([gate[:, c:], up[:, c:], gate[:, :c], up[:, :c]], dim=1))
        host[name], share[name] = t[:, :2 * (half - c)], t[:, 2 * (half - c):]
    for name in COLUMN_TENSORS:
        t = getattr(weights, name)
        if t is None:
            continue
        if not t.is_contiguous():
            raise ValueError(f"{name}: not contiguous; its columns cannot be rearranged in place")
        rows, cols = t.shape[1], t.shape[2]
        c = _cut(name, cols, I, n)
        kept, moved = t[..., c:].contiguous(), t[..., :c].contiguous()
        flat = t.view(-1)
        flat[:kept.numel()].copy_(kept.view(-1))
        flat[kept.numel():].copy_(moved.view(-1))
        host[name] = flat[:kept.numel()].view(1, rows, cols - c)
        share[name] = flat[kept.numel():].view(1, rows, c)
    block = weights.block
    return (ExpertWeights(weights.fmt, block=block, **host), ExpertWeights(weights.fmt, block=block, **share))
