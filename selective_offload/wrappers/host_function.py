"""The host path of :class:`~.host_compute.HostExperts` on CUDA, stream-ordered and capturable.

vLLM captures CUDA graphs by default. A host path that synchronised the stream and called
Python would forbid them (``enforce_eager``) and stall the GPU. Instead each step, on the
current stream: the hidden states, top-k ids and weights are copied into fixed page-locked
buffers; a host function (``cudaLaunchHostFunc``) runs the CPU kernel's job
(:class:`selective_offload.cpu_kernels.MoEJob`: every pointer and size of one call, run by
C code with no Python and no CUDA call, as a host function must); the result is copied
back. All three are stream operations, so a CUDA graph captures them as nodes and replays
them; what else the GPU has queued runs before the host function starts, and the GPU
waits only for the copy back. kt-kernel hands off the same way.

A host function cannot raise and nothing waits for it: a job that fails fills its output
with NaN (never leaving the previous step's sums) and is counted, and the worker raises on
it at the step's host synchronisation, after the step's device work and before its sampled
tokens leave the worker (:func:`selective_offload.cpu_kernels.raise_if_failed`, called by
``vllm_glue.host_compute.check_at_step_sync``), on every path: eager, graph replays,
asynchronous scheduling and vLLM's second model runner. The job also counts its own runs,
so the report's host steps count graph replays, which run no Python.

One job per layer and number of tokens (a graph is captured per batch size, and a job's
sizes are fixed), every job over the first bytes of the process's one page-locked staging
slot and in its one workspace (:mod:`.host_buffers`: why host steps never overlap, and why
a prefix serves a smaller step); the buffers live as long as the process's model (a
captured graph holds their addresses). Measured on a GPU by ``benchmarks/gpu_run.sh``; the
CPU build has no stream and calls the kernel directly.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

import torch

_CUDART: ctypes.CDLL | None = None


def is_cudart(path: str) -> bool:
    """Whether ``path`` names a CUDA runtime library (``libcudart.so``, any version)."""
    return os.path.basename(path).startswith("libcudart.so")


def loaded_cudart_paths(maps: str | None = None) -> list[str]:
    """The CUDA runtime libraries mapped into this process (``/proc/self/maps``, or the
    text given), each once, in address order: not the order they were loaded in, so not by
    itself which one torch uses (:func:`choose_cudart`)."""
    if maps is None:
        try:
            with open("/proc/self/maps") as f:
                maps = f.read()
        except OSError:
            return []
    found: list[str] = []
    for line in maps.splitlines():
        path = line.split()[-1] if len(line.split()) >= 6 else ""
        if is_cudart(path) and path not in found:
            found.append(path)
    return found


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def provider_of(library: str, symbol: str) -> str | None:
    """The file that defines ``symbol`` as ``library`` (already loaded) resolves it: ``dlsym``
    on its handle searches the library and its own dependencies, whatever else is loaded,
    then ``dladdr`` names the object holding the address. ``None`` when ``library`` is not
    loaded or does not resolve ``symbol``."""
    try:
        lib = ctypes.CDLL(library, mode=os.RTLD_NOLOAD)
        address = ctypes.cast(getattr(lib, symbol), ctypes.c_void_p).value
    except (OSError, AttributeError):
        return None
    info = _DlInfo()
    dladdr = ctypes.CDLL(None).dladdr
    dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
    if not address or not dladdr(ctypes.c_void_p(address), ctypes.byref(info)) or not info.dli_fname:
        return None
    return os.path.realpath(os.fsdecode(info.dli_fname))


def torchs_cudart() -> str | None:
    """The CUDA runtime torch's CUDA library resolves ``cudaGetDevice`` to
    (``libtorch_cuda.so``, else ``torch._C``'s dependency tree), or what else defines it
    there (a runtime linked into torch); ``None`` when no torch CUDA library is loaded."""
    lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    for library in (os.path.join(lib, "libtorch_cuda.so"), torch._C.__file__):
        found = provider_of(library, "cudaGetDevice")
        if found is not None:
            return found
    return None


def choose_cudart(loaded: list[str], torchs: str | None) -> str:
    """The CUDA runtime host functions must go through: ``torchs``, the one torch's CUDA
    library resolves to (:func:`torchs_cudart`), whatever else is ``loaded`` (the runtimes
    mapped, :func:`loaded_cudart_paths`); the only one loaded when torch's could not be
    asked. Raises, in one line, when that cannot be decided: none loaded, several and torch's
    not known, or torch's runtime is not a ``libcudart`` of its own (linked into torch)."""
    if torchs is not None and is_cudart(torchs):
        return torchs
    if torchs is None and len(loaded) == 1:
        return loaded[0]
    if not loaded and torchs is None:
        raise RuntimeError("host-compute on CUDA needs the CUDA runtime (libcudart) that torch uses, and none is "
                           "loaded in this process; use a CUDA build of torch")
    where = f"torch resolves it to {torchs}" if torchs else "torch's CUDA library could not be asked which one it uses"
    raise RuntimeError(f"host-compute on CUDA cannot tell which CUDA runtime torch uses ({where}; mapped: "
                       f"{', '.join(loaded) or 'none'}): use a CUDA build of torch that loads one libcudart, "
                       "or serve without host-compute layers")


def cudart() -> ctypes.CDLL:
    """The CUDA runtime torch uses (:func:`choose_cudart`), bound where it is already mapped
    (``RTLD_NOLOAD``): never a second runtime, whose streams and host functions would be
    another's (a ``libcudart.so.13`` mapped beside the one torch uses)."""
    global _CUDART
    if _CUDART is None:
        path = choose_cudart(loaded_cudart_paths(), torchs_cudart())
        try:
            lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_GLOBAL)
        except OSError as exc:
            raise RuntimeError(f"host-compute on CUDA cannot bind the CUDA runtime torch uses ({exc}); use a CUDA "
                               "build of torch") from None
        lib.cudaLaunchHostFunc.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        lib.cudaLaunchHostFunc.restype = ctypes.c_int
        _CUDART = lib
    return _CUDART


def launch_host_function(stream: torch.cuda.Stream, function: int, argument: int) -> None:
    """Queue ``function(argument)`` (a C ``void (*)(void *)``) on ``stream``."""
    err = cudart().cudaLaunchHostFunc(ctypes.c_void_p(stream.cuda_stream), ctypes.c_void_p(function),
                                      ctypes.c_void_p(argument))
    if err != 0:
        raise RuntimeError(f"cudaLaunchHostFunc failed with CUDA error {err}")


class HostFunction:
    """The stream-ordered host path of one layer (see the module's docstring)."""

    def __init__(self, experts: Any):
        """``experts``: the :class:`~.host_compute.HostExperts` whose host path this is."""
        self.experts = experts

    def enqueue(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """Queue the host path on the current stream; the result in ``x``'s dtype, or written
        into ``out`` (float32 [T, H] on the device) and returned as it is."""
        given = out is not None
        slot = self.experts.slot(x, topk_ids, pinned=True)
        stream = torch.cuda.current_stream(x.device)
        slot.x.copy_(x, non_blocking=True)
        slot.ids.copy_(topk_ids.to(torch.int32), non_blocking=True)
        slot.weights.copy_(topk_weights.to(torch.float32), non_blocking=True)
        launch_host_function(stream, slot.job.function_pointer, slot.job.address)
        if out is None:
            out = torch.empty(slot.out.shape, dtype=torch.float32, device=x.device)
        out.copy_(slot.out, non_blocking=True)
        return out if given else out.to(x.dtype)
