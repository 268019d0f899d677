"""The mechanism never changes a tensor's layout: one invariant, one place.

vLLM post-processes each weight into the layout its kernel reads, and the kernels check it:
an FP8/INT8 linear weight is kept as a column-major ``.t()`` view (CUTLASS checks
``b.stride(0) == 1``), DeepGEMM's packed UE8M0 block scales are MN-major with a
TMA-aligned stride that leaves padding between columns, a ROCm-padded weight is a slice
with gaps. Any copy this project makes (into a page-locked arena, to the device for one
forward, back to the host after post-processing) must hand the kernel the same tensor:

    the copy has the original's dtype, shape and strides, and its storage holds the
    original's whole *span* (every byte from the lowest to one past the highest byte the
    tensor reaches, gaps included) at the same offset relation.

So a copy is made of the span's raw bytes, never element by element: ``Tensor.to`` and
``torch.empty(shape)`` make non-dense tensors contiguous, and ``copy_`` into an expanded
(stride-0) or overlapping destination is refused by torch. Expanded and overlapping
tensors are kept as they are: their span is small (an expanded scalar spans one element),
and the arena holds exactly it. Only what lies outside the span (the rest of a larger
storage the tensor is a slice of) is left behind.

Tensors that share one storage (a view and its base) are placed in one span over both, so
they still share it after the copy (:func:`pack_plan`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Layout:
    """What a kernel sees of a tensor, and the bytes a copy of it must hold."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    #: Bytes from the lowest to one past the highest byte of storage the tensor reaches.
    span_nbytes: int


def span(t: torch.Tensor) -> tuple[int, int]:
    """The byte range ``[lo, hi)`` of ``t``'s storage that ``t`` reaches (torch strides are
    never negative: the lowest byte is the first element's)."""
    size = t.element_size()
    lo = t.storage_offset() * size
    if t.numel() == 0:
        return lo, lo
    extent = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return lo, lo + extent * size


def layout_of(t: torch.Tensor) -> Layout:
    lo, hi = span(t)
    return Layout(t.dtype, tuple(t.shape), tuple(t.stride()), hi - lo)


def span_bytes(t: torch.Tensor) -> torch.Tensor:
    """A ``uint8`` view of the bytes ``t`` reaches in its storage (on ``t``'s device)."""
    return storage_bytes(t, *span(t))


def strided_like(region: torch.Tensor, like: torch.Tensor, at: int = 0) -> torch.Tensor:
    """A view of ``region`` (1-D ``uint8``) with ``like``'s dtype, shape and strides, its
    span starting ``at`` bytes into ``region`` (a multiple of ``like``'s element size)."""
    lo, hi = span(like)
    typed = region[at:at + (hi - lo)].view(like.dtype)
    return typed.as_strided(like.shape, like.stride())


def copy_like(t: torch.Tensor, device: torch.device | str, *, pin: bool = False,
              non_blocking: bool = False) -> torch.Tensor:
    """``t``'s values on ``device`` in storage of exactly its span, with its layout.

    ``pin`` allocates through torch's pinned allocator (host copies only); ``non_blocking``
    is passed to the byte copy (a pinned host source and a CUDA target run asynchronously).
    """
    lo, hi = span(t)
    buf = torch.empty(hi - lo, dtype=torch.uint8, device=device, pin_memory=pin)
    buf.copy_(span_bytes(t), non_blocking=non_blocking)
    return strided_like(buf, t)


def host_copy_like(t: torch.Tensor, *, pin: bool = False) -> torch.Tensor:
    """``t`` in host memory of exactly its span (pageable unless ``pin``), its layout kept."""
    return copy_like(t, "cpu", pin=pin)


def device_copy_like(t: torch.Tensor, device: torch.device | str, *, non_blocking: bool = False) -> torch.Tensor:
    """``t`` on ``device`` in storage of exactly its span, its layout kept."""
    return copy_like(t, device, non_blocking=non_blocking)


@dataclass(frozen=True)
class Packed:
    """Where :func:`pack_plan` puts each tensor: its span's byte offset in the arena."""

    #: Per tensor (in the order given), the byte offset of its span in the arena.
    at: tuple[int, ...]
    #: Per storage group, (arena offset, source tensor whose storage it copies, lo, hi).
    groups: tuple[tuple[int, torch.Tensor, int, int], ...]
    nbytes: int


def pack_plan(tensors, align: int) -> Packed:
    """Lay ``tensors`` out in one arena: one span per source storage (the union of the
    spans of the tensors sharing it), each starting on an ``align`` boundary plus its
    original offset modulo ``align`` (so every tensor keeps its address alignment and its
    offset from the tensors it shares storage with)."""
    by_storage: dict[tuple[str, int], list[int]] = {}
    for i, t in enumerate(tensors):
        by_storage.setdefault((str(t.device), t.untyped_storage().data_ptr()), []).append(i)
    at = [0] * len(tensors)
    groups, total = [], 0
    for members in by_storage.values():
        spans = [span(tensors[i]) for i in members]
        lo, hi = min(s[0] for s in spans), max(s[1] for s in spans)
        start = -(-total // align) * align + lo % align
        for i, (t_lo, _) in zip(members, spans):
            at[i] = start + t_lo - lo
        groups.append((start, tensors[members[0]], lo, hi))
        total = start + hi - lo
    return Packed(tuple(at), tuple(groups), total)


def storage_bytes(t: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """A ``uint8`` view of bytes ``[lo, hi)`` of ``t``'s storage."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage(), lo, (hi - lo,), (1,))
