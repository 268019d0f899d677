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
with NaN (never leaving the previous step's sums) and is counted, and the next Python that
runs raises on it (:func:`selective_offload.cpu_kernels.raise_if_failed`: at each host step
queued, the split head's step, and each step's logits, which the worker checks).

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

from .. import cpu_kernels

_CUDART: ctypes.CDLL | None = None


def loaded_cudart_paths(maps: str | None = None) -> list[str]:
    """The CUDA runtime libraries mapped into this process (``/proc/self/maps``, or the
    text given), in the order they appear: the one torch loaded among them."""
    if maps is None:
        try:
            with open("/proc/self/maps") as f:
                maps = f.read()
        except OSError:
            return []
    found: list[str] = []
    for line in maps.splitlines():
        path = line.split()[-1] if len(line.split()) >= 6 else ""
        if os.path.basename(path).startswith("libcudart.so") and path not in found:
            found.append(path)
    return found


def cudart() -> ctypes.CDLL:
    """The CUDA runtime torch loaded, bound where it is already mapped (``RTLD_NOLOAD``):
    never a second runtime, whose streams and host functions would be another's (a
    ``libcudart.so.13`` found on the library path before the one torch uses)."""
    global _CUDART
    if _CUDART is None:
        errors = []
        # mutation: cudart-dlopened-by-name
        for path in loaded_cudart_paths():
            try:
                lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_GLOBAL)
            except OSError as exc:
                errors.append(str(exc))
                continue
            lib.cudaLaunchHostFunc.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
            lib.cudaLaunchHostFunc.restype = ctypes.c_int
            _CUDART = lib
            break
        else:
            raise RuntimeError("host-compute on CUDA needs the CUDA runtime (libcudart) that torch uses, and none is "
                               "loaded in this process" + (f" ({errors[-1]})" if errors else "")
                               + "; use a CUDA build of torch")
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
        # A job an earlier host function ran may have failed (it cannot raise): raise here.
        # mutation: host-function-failures-unchecked
        cpu_kernels.raise_if_failed(self.experts.group)
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
