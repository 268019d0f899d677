"""Page-locked host memory of exactly the planned size, and a ledger of every byte of it.

Why not ``pin_memory=True``. torch's caching host allocator (what ``pin_memory=True`` and
``.pin_memory()`` use) rounds each block up to a power of two and keeps freed blocks for
reuse: a 2.54 GB embedding takes a 4 GiB block, and a pinned copy made from a pageable
tensor leaves two copies until the first is freed. Page-locked memory is memory the
operating system can neither swap nor reclaim, so on a laptop with 32-64 GB of RAM the
difference decides whether the machine stays usable. So large host weights are ordinary
(pageable) allocations of exactly their size, registered with the driver in place
(``cudaHostRegister``): the same bytes, now page-locked, with no copy and no rounding,
and unregistered when the module that owns them is released.

When not to page-lock at all (:class:`PinPolicy`):

- no CUDA device (the CPU build): host memory is device memory; nothing to lock;
- vLLM's own pin policy says no: ``is_pin_memory_available()`` is false (WSL), or the user
  set ``VLLM_WEIGHT_OFFLOADING_DISABLE_PIN_MEMORY``: weights stay pageable (the link
  copies through the driver's staging buffer: slower, but what the user asked for);
- an integrated GPU (DGX Spark's GB10, Jetson: ``is_integrated``), where host and device
  memory are one pool: page-locking buys nothing and offloading saves nothing; the plan
  and report say so. (A Grace Hopper GH200 is not integrated: its HBM is its own, so
  moving weights to the Grace side's LPDDR does free HBM.)

:class:`PageLockedLedger` records what this project page-locked: registered storages
(exact bytes), and small buffers it pinned through torch's allocator (the host gather's
staging buffer), so the report can put page-locked bytes next to the plan's host bytes.

One registration per module (:meth:`PageLockedLedger.lock_together`). The driver locks
whole pages, and small tensors (a norm's weight, a bias) share pages with their neighbours:
a second ``cudaHostRegister`` over a page already registered fails (CUDA error 712), and
that tensor is not locked. So a module's host tensors (a tower, a hot layer) are packed
into one arena that starts and ends on page boundaries, registered once: no page is
shared between registrations, and the bytes locked are the module's bytes plus at most
its alignment padding. Each tensor keeps its layout there (:mod:`.layout`): its whole
storage span is copied as bytes and viewed with its own strides, so a column-major FP8
weight or DeepGEMM's padded, MN-major scales reach the kernel as vLLM left them.

Unregistering. Memory is unregistered when the module owning it is collected, after the
device is synchronised; never at interpreter exit (the driver releases it with the
process, and unregistering then only prints errors), and never for a table that a UVA view
exposes to the device (a captured CUDA graph may still hold that address: it stays
registered until the process ends).
"""

from __future__ import annotations

import mmap
import threading
import weakref
from dataclasses import dataclass
from enum import Enum
from typing import Callable, Protocol

import torch

from .layout import pack_plan, storage_bytes, strided_like
from .residency import OffloadError

#: cudaHostRegisterPortable | cudaHostRegisterMapped: usable from every context, and
#: with a device address (the UVA view reads through it).
_REGISTER_FLAGS = 0x01 | 0x02


class PinPath(str, Enum):
    """How host weights are held."""

    REGISTER = "register"      # exact-size pageable memory, page-locked in place
    PAGEABLE = "pageable"      # not page-locked (no CUDA, or vLLM's pin policy says no)
    UNIFIED = "unified"        # integrated GPU: host memory is device memory

    __str__ = str.__str__


@dataclass(frozen=True)
class PinPolicy:
    path: PinPath
    reason: str

    @property
    def locks(self) -> bool:
        return self.path == PinPath.REGISTER

    @classmethod
    def decide(cls, *, cuda: bool, pin_available: bool = True, disabled_by_env: bool = False,
               integrated: bool = False) -> "PinPolicy":
        """The path for this machine and vLLM's settings, with the reason to report."""
        if not cuda:
            return cls(PinPath.PAGEABLE, "no CUDA device: host memory is the device's memory here, nothing to lock")
        if integrated:
            return cls(PinPath.UNIFIED, "an integrated GPU shares one memory with the host: offloading frees no "
                                        "device memory and page-locking buys nothing")
        if disabled_by_env:
            return cls(PinPath.PAGEABLE, "VLLM_WEIGHT_OFFLOADING_DISABLE_PIN_MEMORY is set: host weights stay "
                                         "pageable (copies to the device go through the driver's staging buffer)")
        if not pin_available:
            return cls(PinPath.PAGEABLE, "vLLM reports pinned memory unavailable on this platform (WSL): host "
                                         "weights stay pageable")
        return cls(PinPath.REGISTER, "host weights are page-locked in place at their exact size (cudaHostRegister)")


class Registrar(Protocol):
    def register(self, ptr: int, nbytes: int) -> None: ...
    def unregister(self, ptr: int) -> None: ...


#: The page the driver locks in; arenas start and end on its boundaries.
PAGE = mmap.PAGESIZE
#: Each tensor in an arena starts on this boundary (what kernels and torch's allocator align to).
ARENA_ALIGN = 64


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


#: CUDA runtime error codes this module tells apart.
_CUDA_ERROR_ALREADY_REGISTERED = 712
_CUDA_ERROR_MEMORY_ALLOCATION = 2


class AlreadyRegistered(Exception):
    """The memory was page-locked by someone else (the driver refused a second registration)."""


class CudaRegistrar:
    """``cudaHostRegister`` / ``cudaHostUnregister`` through torch's CUDA runtime binding.

    A failed call leaves its error pending in the CUDA runtime, where torch's next error
    check would report it against an unrelated call; it is cleared here
    (:func:`clear_pending_cuda_error`) before the failure is raised with its own reason.
    """

    def __init__(self) -> None:
        self._cudart = torch.cuda.cudart()

    def register(self, ptr: int, nbytes: int) -> None:
        err = int(self._cudart.cudaHostRegister(ptr, nbytes, _REGISTER_FLAGS))
        if err == 0:
            return
        clear_pending_cuda_error()
        if err == _CUDA_ERROR_ALREADY_REGISTERED:
            raise AlreadyRegistered(ptr)
        why = ("the system limits page-locked memory (ulimit -l): raise the limit"
               if err == _CUDA_ERROR_MEMORY_ALLOCATION else "see the CUDA error code")
        raise OffloadError(f"cudaHostRegister of {nbytes} bytes failed (CUDA error {err}): {why}, or set "
                           "VLLM_WEIGHT_OFFLOADING_DISABLE_PIN_MEMORY=1 to keep host weights pageable")

    def unregister(self, ptr: int) -> None:
        err = int(self._cudart.cudaHostUnregister(ptr))
        if err != 0:
            clear_pending_cuda_error()
            raise OffloadError(f"cudaHostUnregister failed (CUDA error {err}) for memory this process registered")


def clear_pending_cuda_error() -> None:
    """Consume the CUDA runtime's pending error (torch's binding has no cudaGetLastError)."""
    import ctypes
    import os

    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            ctypes.CDLL(name, mode=os.RTLD_NOLOAD).cudaGetLastError()
            return
        except (OSError, AttributeError):
            continue


@dataclass(frozen=True)
class LockedEntry:
    nbytes: int
    purpose: str
    #: ``registered`` (exact, in place) or ``caching allocator`` (torch's pinned blocks,
    #: counted at the size asked for; the block may be rounded up).
    how: str


class PageLockedLedger:
    """What this process page-locked for the plan, by storage address."""

    def __init__(self, policy: PinPolicy, registrar: Registrar | None = None) -> None:
        self.policy = policy
        self._registrar = registrar
        self._entries: dict[int, LockedEntry] = {}
        #: Registered storages are held until unlocked: freeing registered memory first
        #: would leave the driver with a dangling registration.
        self._held: dict[int, torch.UntypedStorage] = {}
        #: Where an arena's registration starts (its page-aligned start), by storage address.
        self._registered_at: dict[int, int] = {}
        #: Bytes the driver refused to register because a page was already registered.
        self.refused_bytes = 0
        self._lock = threading.Lock()

    @property
    def registrar(self) -> Registrar:
        if self._registrar is None:
            self._registrar = CudaRegistrar()
        return self._registrar

    def lock(self, tensor: torch.Tensor, purpose: str) -> bool:
        """Page-lock ``tensor``'s host storage in place, exactly its size. Returns whether it
        is locked now (False when the policy does not lock). Never copies."""
        if not self.policy.locks:
            return False
        if tensor.device.type != "cpu":
            raise OffloadError(f"{purpose}: only host memory can be page-locked, not {tensor.device}")
        storage = tensor.untyped_storage()
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        with self._lock:
            if ptr in self._entries or nbytes == 0:
                return True
            if tensor.is_pinned():  # pinned by someone else (torch's allocator): count, do not register
                self._entries[ptr] = LockedEntry(nbytes, purpose, "caching allocator")
                return True
            try:
                self.registrar.register(ptr, nbytes)
            except AlreadyRegistered:
                # Not pinned, yet the driver says registered: a page it shares with another
                # registration (CUDA error 712). It is not locked, so it is not counted;
                # modules of small tensors go through lock_together, which never shares pages.
                self.refused_bytes += nbytes
                return False
            self._entries[ptr] = LockedEntry(nbytes, purpose, "registered")
            self._held[ptr] = storage
        return True

    def lock_together(self, tensors, purpose: str) -> bool:
        """Move ``tensors`` (parameters or buffers: their ``.data`` is replaced) into one
        page-aligned host arena and page-lock it with one registration. Returns whether it
        is locked (False when the policy does not lock: the tensors are then left as they
        are). Each tensor keeps its layout (:mod:`.layout`): dtype, shape, strides and its
        storage span, copied as raw bytes; tensors that shared a storage share the arena's
        copy of it, at the same offsets."""
        if not self.policy.locks:
            return False
        tensors = [t for t in tensors if t.numel()]
        if not tensors:
            return True
        sources = [t.data for t in tensors]
        plan = pack_plan(sources, ARENA_ALIGN)
        span = _round_up(plan.nbytes, PAGE)
        buf = torch.empty(span + PAGE, dtype=torch.uint8, device="cpu")
        start = (-buf.data_ptr()) % PAGE
        arena = buf[start:start + span]
        for at, source, lo, hi in plan.groups:
            arena[at:at + hi - lo].copy_(storage_bytes(source, lo, hi))
        for t, source, at in zip(tensors, sources, plan.at):
            t.data = strided_like(arena, source, at)
        storage = buf.untyped_storage()
        key = storage.data_ptr()
        try:
            self.registrar.register(buf.data_ptr() + start, span)
        except AlreadyRegistered:  # cannot happen for a fresh, page-aligned arena; never counted
            raise OffloadError(f"{purpose}: the driver refused to page-lock a fresh arena (already registered)")
        with self._lock:
            self._entries[key] = LockedEntry(span, purpose, "registered")
            self._held[key] = storage
            self._registered_at[key] = buf.data_ptr() + start
        return True

    def pinned(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is page-locked as the driver sees it (``is_pinned()``); the
        registrar answers where it can (a recording registrar, on a machine without CUDA)."""
        ask = getattr(self._registrar, "is_pinned", None)
        return bool(ask(tensor)) if ask is not None else tensor.is_pinned()

    def note_pinned(self, tensor: torch.Tensor, purpose: str) -> None:
        """Count a buffer pinned through torch's caching allocator (at the size asked for)."""
        if tensor.is_pinned():
            storage = tensor.untyped_storage()
            with self._lock:
                self._entries[storage.data_ptr()] = LockedEntry(storage.nbytes(), purpose, "caching allocator")

    def forget(self, tensor: torch.Tensor) -> None:
        """A caching-allocator buffer that was dropped (a staging buffer that grew)."""
        with self._lock:
            entry = self._entries.get(tensor.untyped_storage().data_ptr())
            if entry is not None and entry.how == "caching allocator":
                del self._entries[tensor.untyped_storage().data_ptr()]

    def unlock(self, ptr: int) -> None:
        with self._lock:
            entry = self._entries.pop(ptr, None)
            storage = self._held.pop(ptr, None)
            at = self._registered_at.pop(ptr, ptr)
        if entry is not None and entry.how == "registered":
            self.registrar.unregister(at)
        del storage

    def release_with(self, owner: object, tensors, keep_registered: bool = False) -> None:
        """Unlock ``tensors``' storages when ``owner`` (a module) is garbage-collected, after
        the device has finished with them; not at interpreter exit. ``keep_registered``:
        the memory backs a UVA view that a captured CUDA graph may still read, so it stays
        registered (and held) until the process ends."""
        ptrs = [t.untyped_storage().data_ptr() for t in tensors]
        if keep_registered:
            return
        ref = weakref.ref(self)

        def release(ptrs=ptrs, ref=ref) -> None:
            ledger = ref()
            if ledger is None:
                return
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.synchronize()  # no copy in flight reads memory about to be unlocked
            for ptr in ptrs:
                try:
                    ledger.unlock(ptr)
                except OffloadError:  # the driver's complaint changes nothing for a freed module
                    pass

        weakref.finalize(owner, release).atexit = False

    def is_locked(self, tensor: torch.Tensor) -> bool:
        return tensor.untyped_storage().data_ptr() in self._entries

    @property
    def locked_bytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

    def by_purpose(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for e in self._entries.values():
            out[e.purpose] = out.get(e.purpose, 0) + e.nbytes
        return out

    def by_how(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for e in self._entries.values():
            out[e.how] = out.get(e.how, 0) + e.nbytes
        return out


def resident_set_bytes() -> int | None:
    """This process's resident set (Linux), or None where it cannot be read."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def torch_pinned_bytes() -> int | None:
    """Bytes torch's caching host allocator holds now (its own count), where torch has it."""
    stats: Callable | None = getattr(torch.cuda, "host_memory_stats", None)
    if stats is None or not torch.cuda.is_available():
        return None
    try:
        return int(stats().get("allocated_bytes.current", 0))  # rounded block sizes, cached blocks included
    except (RuntimeError, AttributeError):
        return None
