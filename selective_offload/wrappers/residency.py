"""Host residency: putting a tensor in host memory, and counting what crosses the link.

Shared by both wrappers (:mod:`.host_embedding`, :mod:`.on_demand`); neither decides
*what* is offloaded (that is the planner's job), they only keep it there and report.

Why pin. A copy from pageable memory is staged by the driver through its own pinned
bounce buffer, is slower, and blocks the host; pinned memory is read by DMA at link rate
and asynchronously, so the copy can overlap compute. Pinning exists only with CUDA: on a CPU-only machine host memory is
plain memory and the same code runs unpinned (``pin=None`` means "pin where CUDA exists").

Why ``param.data = host`` rather than a new Parameter. vLLM's ``weight_loader`` and
attributes such as ``output_dim`` live on the Parameter object, and the model holds
references to it; swapping only its storage keeps every reference and attribute valid, so
a loader that copies into ``param.data`` writes straight into host memory.

Page-locked, not pinned by the allocator. torch's caching host allocator (``pin_memory``)
rounds each block up to a power of two, so a 2.54 GB embedding would hold 4 GiB of RAM the
system can neither use nor swap. Given a :class:`~.page_locked.PageLockedLedger` (the vLLM
glue always passes one), host weights are exact-size allocations page-locked in place;
without one, ``pin`` falls back to the allocator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import UserError
from .layout import host_copy_like


class OffloadError(UserError, ValueError):
    """An offload that cannot be set up as asked: the message says why and what to do."""


@dataclass(frozen=True)
class OffloadStats:
    """What one wrapper holds in host memory and what it moved to the device.

    ``host_bytes`` counts the weights that are in host memory *now* (a weight that
    something moved back to the device counts zero, so the report cannot claim an offload
    that did not happen). ``peak_transient_device_bytes`` counts device memory held by the
    mechanism beyond what the unwrapped module would allocate (an embedding's output is
    the module's result, not a transient: it counts zero there). Counters advance only
    when Python runs: a replayed CUDA graph moves bytes without counting them.
    """

    host_bytes: int
    bytes_moved_last_call: int
    bytes_moved_total: int
    calls: int
    peak_transient_device_bytes: int


class TransferLedger:
    """The mutable counters behind :class:`OffloadStats` (one per wrapper)."""

    def __init__(self) -> None:
        self.calls = 0
        self.bytes_moved_last_call = 0
        self.bytes_moved_total = 0
        self.transient_device_bytes = 0
        self.peak_transient_device_bytes = 0

    def start_call(self) -> None:
        self.calls += 1
        self.bytes_moved_last_call = 0

    def moved(self, nbytes: int) -> None:
        self.bytes_moved_last_call += nbytes
        self.bytes_moved_total += nbytes

    def onloaded(self, nbytes: int) -> None:
        self.transient_device_bytes += nbytes
        self.peak_transient_device_bytes = max(
            self.peak_transient_device_bytes, self.transient_device_bytes
        )

    def released(self, nbytes: int) -> None:
        self.transient_device_bytes -= nbytes

    def snapshot(self, host_bytes: int) -> OffloadStats:
        return OffloadStats(
            host_bytes=host_bytes,
            bytes_moved_last_call=self.bytes_moved_last_call,
            bytes_moved_total=self.bytes_moved_total,
            calls=self.calls,
            peak_transient_device_bytes=self.peak_transient_device_bytes,
        )


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def resolve_device(device: torch.device | str | int | None) -> torch.device:
    """The compute device: as given, else the current CUDA device, else the CPU."""
    if device is None:
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def resolve_pin(pin: bool | None, device: torch.device) -> bool:
    """Whether host copies are pinned: by default exactly when the device is a CUDA one."""
    cuda_target = device.type == "cuda" and torch.cuda.is_available()
    if pin is None:
        return cuda_target
    if pin and not torch.cuda.is_available():
        raise OffloadError(
            "pin=True, but this torch build has no CUDA device, so host memory cannot be "
            "pinned; pass pin=None (pin where CUDA exists) or pin=False"
        )
    return bool(pin)


def to_host(tensor: torch.Tensor, pin: bool, page_locked=None, purpose: str = "") -> torch.Tensor:
    """``tensor``'s values in host memory (pinned if ``pin``); ``tensor`` itself when it
    already lives there as asked, so nothing is copied twice.

    With a :class:`~.page_locked.PageLockedLedger`, host memory is exactly the tensor's
    size and page-locked in place (a host tensor is never copied to be pinned); without
    one, ``pin`` uses torch's caching allocator (rounded up to a power of two).
    """
    if tensor.is_meta:
        raise OffloadError(
            f"cannot offload a meta tensor of shape {tuple(tensor.shape)}: it has no values; "
            "materialise the module (build it on the CPU) before offloading it"
        )
    if page_locked is not None:
        host = tensor if tensor.device.type == "cpu" else host_copy_like(tensor)
        if pin:
            page_locked.lock(host, purpose)
        return host
    if tensor.device.type == "cpu" and (not pin or tensor.is_pinned()):
        return tensor
    return host_copy_like(tensor, pin=pin)
