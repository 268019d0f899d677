"""The LM head split by output rows between the device and the host CPU.

The LM head (vocabulary x hidden, no bias) is read in full by every decode step, so it is
hot; it is also one of a model's largest single tensors. Read over the link (UVA), every
byte of it would cross PCIe every step. Split by rows instead, the device keeps the first
rows and the host CPU computes the others where they live, at the host's memory bandwidth
and at the same time as the device computes its own: only the hidden states go down (a
few kB) and the host rows' logits come back. The split costs the step whichever side is
slower, so the device share is best sized for the two to finish together.

A step of many tokens turns the CPU compute-bound (prefill, large batches), so
:class:`HostRows` serves a step one of two ways, by its number of tokens, as
:class:`.host_compute.HostExperts` does:

- **on the host** (``tokens <= crossover``): the host-compute C kernel's row walk on the
  host rows (:func:`selective_offload.cpu_kernels.rows`, the experts' threads; torch's own
  CPU ``linear`` would run on the one thread vLLM's GPU worker leaves torch while serving),
  the device's rows meanwhile on the device;
- **on the device** (above the crossover): the host rows are copied from the page-locked
  host weight to the device, as one slice, and computed there, as llama.cpp copies weights
  for ops of many tokens.

vLLM computes logits outside its CUDA graphs and outside ``torch.compile``'s graph, so no
opaque op is needed; the host path is still stream-ordered on CUDA (a host function runs
the rows job, :mod:`.host_function`), so the worker's thread never waits for the device
and can prepare the next step meanwhile, as vLLM's asynchronous scheduling expects. A call
made while a graph is being captured is refused: the wrapper was installed somewhere it
does not belong.

The CUDA branch cannot run on a machine without CUDA (this project's tests run on the CPU
build, where "the device" is the CPU); it is written to the ordering in
:meth:`HostRows._cuda_host_step` and checked on a GPU only (``benchmarks/gpu_run.sh``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .. import cpu_kernels
from ..worker_buffers import Unit
from .host_buffers import HostBuffers
from .host_compute import ServingCounts

#: The dtypes the head may be held in: the C row walk reads bf16, torch's float32 op float32
#: (vLLM's CPU build runs a model in float32 when asked).
DTYPES = (torch.bfloat16, torch.float32)


@dataclass
class _Slot:
    """One step shape's buffers (views of the process's one staging slot: page-locked on
    CUDA): the hidden states copied to the host, the host rows' logits read back, and the
    rows job that reads and writes them (a CUDA host function runs it by address)."""

    x: torch.Tensor
    out: torch.Tensor
    job: "cpu_kernels.RowsJob"


class HostRows:
    """An LM head ``host_weight`` [V, H] whose rows ``device_rows:`` are computed by the host
    CPU at or below ``crossover_tokens`` tokens per call, and copied to ``device`` above it.

    ``host_weight`` holds every row (page-locked where ``device`` is CUDA, so that copies
    from it are asynchronous); the host path reads its rows ``device_rows:`` in place.
    ``device_weight`` holds the first ``device_rows`` rows on ``device``; when None they are
    copied there from ``host_weight`` (a copy even on a CPU device, so the two are as
    independent as they are on a GPU). ``buffers``: the process's one staging slot and
    workspace (:mod:`.host_buffers`), shared with the host-compute layers; without them the
    head makes its own.
    """

    def __init__(self, group: str, host_weight: torch.Tensor, device_rows: int, *, crossover_tokens: int,
                 device: torch.device | str, device_weight: torch.Tensor | None = None,
                 threads: int | None = None, buffers: HostBuffers | None = None):
        if host_weight.dim() != 2:
            raise ValueError(f"{group}: the LM head's weight must be 2-D [vocab, hidden], "
                             f"not {tuple(host_weight.shape)}")
        if host_weight.dtype not in DTYPES:
            raise ValueError(f"{group}: a {host_weight.dtype} LM head; only bf16 and float32 are split by rows")
        if host_weight.device.type != "cpu":
            raise ValueError(f"{group}: the host weight is on {host_weight.device}, not in host memory")
        rows, hidden = host_weight.shape
        if not 0 < device_rows < rows:
            raise ValueError(f"{group}: the device must hold between 1 and {rows - 1} of the {rows} rows, "
                             f"not {device_rows}")
        if crossover_tokens < 0:
            raise ValueError(f"{group}: the crossover must be a number of tokens >= 0, not {crossover_tokens}")
        self.group = group
        self.device = torch.device(device)
        if self.on_cuda and not host_weight.is_pinned():
            raise ValueError(f"{group}: the host weight must be page-locked to be read beside a CUDA device")
        if device_weight is None:
            device_weight = host_weight[:device_rows].to(self.device, copy=True)
        elif tuple(device_weight.shape) != (device_rows, hidden) or device_weight.dtype != host_weight.dtype:
            raise ValueError(f"{group}: the device weight is {device_weight.dtype} {tuple(device_weight.shape)}, "
                             f"not {host_weight.dtype} {(device_rows, hidden)}")
        self.host_weight = host_weight
        self.device_weight = device_weight
        self.device_rows = int(device_rows)
        self.crossover_tokens = int(crossover_tokens)
        self.threads = threads
        self.counts = ServingCounts()
        self._slots: dict[tuple, _Slot] = {}  # jobs by step shape, over views of the buffers
        self._side = None  # CUDA: the side stream the host part is queued on
        if buffers is None:
            buffers = HostBuffers(pinned=self.on_cuda, fixed=False)
        elif self.crossover_tokens:
            buffers.reserve(self.unit(self.crossover_tokens))
        self.buffers = buffers

    def unit(self, tokens: int) -> Unit:
        """A host step of ``tokens`` tokens, as the buffers count it."""
        return Unit.rows(tokens, int(self.host_weight.shape[1]), self.host_rows)

    @property
    def on_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def host_rows(self) -> int:
        """How many rows the host holds alone (and computes at or below the crossover)."""
        return int(self.host_weight.shape[0]) - self.device_rows

    @property
    def dtype(self) -> torch.dtype:
        return self.host_weight.dtype

    def refresh(self, source: torch.Tensor | None = None) -> None:
        """Copy the first rows of ``source`` (the whole head as reloaded; the host weight by
        default) to the device again: a reload leaves the device's copy stale."""
        source = self.host_weight if source is None else source
        self.device_weight.copy_(source[:self.device_rows], non_blocking=self.on_cuda)

    def reset_counts(self, since: str) -> None:
        """Count what the head serves from ``since`` on (:meth:`.ServingCounts.reset`)."""
        self.counts.reset(since)

    def as_dict(self) -> dict[str, object]:
        return {"group": self.group, "device_rows": self.device_rows, "host_rows": self.host_rows,
                "crossover_tokens": self.crossover_tokens, **self.counts.as_dict()}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The logits ``x @ weight.T`` for ``x`` [T, H]: [T, V] in ``x``'s dtype and device."""
        if self.on_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"{self.group}: an LM head split with the host was called inside a CUDA graph "
                               "capture; vLLM computes logits outside its graphs, so it was installed elsewhere")
        tokens = int(x.shape[0])
        xw = x.to(self.dtype)
        if tokens <= self.crossover_tokens:
            out = self._cuda_host_step(xw) if self.on_cuda else self._cpu_host_step(xw)
        else:
            out = self._on_device(xw)
        return out.to(x.dtype)

    __call__ = forward

    # ------------------------------------------------------------------ the host path

    def _cpu_host_step(self, x: torch.Tensor) -> torch.Tensor:
        """A CPU device (vLLM's CPU build, the tests): the device's rows by torch, the host's
        by the rows walk, read from the host tensor's own rows, never from a device copy."""
        device = F.linear(x, self.device_weight)
        start = time.perf_counter()
        host = self._host_rows(x.to("cpu"))
        self._count_host(int(x.shape[0]), time.perf_counter() - start)  # a C job counts its own steps
        return torch.cat([device, host.to(device=device.device, dtype=device.dtype)], dim=-1)

    def _host_rows(self, x: torch.Tensor) -> torch.Tensor:
        """The host's rows of the head for host tensors ``x``: float32 [T, host rows], a
        view of the staging slot the next host step overwrites (a float32 head: torch's own
        float32 op, exact, into a tensor of its own). The rows job runs as a CUDA host
        function runs it: a failure leaves NaN, is counted, and is raised at the step's host
        synchronisation (:func:`cpu_kernels.raise_if_failed`)."""
        if self.dtype == torch.float32:
            return cpu_kernels.rows(x, self._host_weight_rows(), threads=self.threads)
        slot = self._slot(x)
        slot.x.copy_(x)
        slot.job.launch()
        return slot.out

    def _host_weight_rows(self) -> torch.Tensor:
        """The rows the host computes, read in place."""
        return self.host_weight[self.device_rows:]

    def _cuda_host_step(self, x: torch.Tensor) -> torch.Tensor:
        """CUDA (not runnable here), stream-ordered, so no Python waits for the device: on a
        side stream forked from the current one the hidden states are copied into a
        page-locked buffer, a host function (``cudaLaunchHostFunc``, :mod:`.host_function`)
        runs the rows job on them and the host rows' logits are copied back; the device's
        rows are computed on the current stream meanwhile, which waits for the side stream
        before the two are joined (as :class:`.host_compute.HostExperts` runs a layer beside
        its device share)."""
        from .host_function import launch_host_function

        slot = self._slot(x)
        main = torch.cuda.current_stream(x.device)
        if self._side is None:
            self._side = torch.cuda.Stream(x.device)
        side = self._side
        # Made on the current stream, which waits for the side stream before it reads (or
        # frees) it or the input the side stream reads: no record_stream needed.
        up = torch.empty(slot.out.shape, dtype=torch.float32, device=x.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            slot.x.copy_(x, non_blocking=True)
            launch_host_function(side, slot.job.function_pointer, slot.job.address)
            up.copy_(slot.out, non_blocking=True)
        device = F.linear(x, self.device_weight)  # beside the host function
        main.wait_stream(side)
        # The job counts the step as the host function runs it; the CPU's time is the host
        # function's, off this thread.
        return torch.cat([device, up.to(device.dtype)], dim=-1)

    def _slot(self, x: torch.Tensor) -> _Slot:
        """The buffers and the rows job for steps of ``x``'s shape: views of the first bytes
        of the process's one staging slot, the job in its one workspace (:mod:`.host_buffers`;
        a job's sizes are fixed when it is made, its buffers' addresses never move)."""
        key = tuple(x.shape)
        slot = self._slots.get(key)
        if slot is None:
            x_host, out = self.buffers.rows_views(self.unit(key[0]), self.dtype)
            job = cpu_kernels.RowsJob(x_host, self._host_weight_rows(), out, threads=self.threads,
                                      workspace=self.buffers.workspace)
            job.name(self.group)
            self.counts.add_job(job, bytes_per_run=self._bytes_per_step)
            slot = self._slots[key] = _Slot(x_host, out, job)
        return slot

    @property
    def _bytes_per_step(self) -> int:
        """The host rows' bytes, read once a host step."""
        return self.host_rows * int(self.host_weight.shape[1]) * self.host_weight.element_size()

    def _count_host(self, tokens: int, seconds: float) -> None:
        """A host step timed here: its CPU time; a float32 head (no C job) also its tokens
        and bytes (a C job counts those itself, as it runs)."""
        if self.dtype == torch.float32:
            self.counts.by_python.add(tokens, seconds)
            self.counts.bytes_by_python += self._bytes_per_step
        else:
            self.counts.time_host(seconds)

    # ------------------------------------------------------------------ the device path

    def _on_device(self, x: torch.Tensor) -> torch.Tensor:
        """Above the crossover: the host rows cross to the device as one slice of the
        page-locked weight (no gather on the host first) and are computed there."""
        start = time.perf_counter()
        rows = self.host_weight[self.device_rows:].to(x.device, non_blocking=True)
        out = torch.cat([F.linear(x, self.device_weight), F.linear(x, rows)], dim=-1)
        self.counts.device.add(int(x.shape[0]), None if self.on_cuda else time.perf_counter() - start)
        return out
