"""One staging slot and one kernel workspace for every host-compute unit of a process.

Each host step of a routed-experts layer, a dense MLP or the split LM head copies its
hidden states (and top-k) into host buffers, runs a C job on them
(:class:`~selective_offload.cpu_kernels.MoEJob`, :class:`~selective_offload.cpu_kernels.RowsJob`)
with a scratch workspace, and reads the sums back. :class:`HostBuffers` holds those
buffers once per process (the worker makes one per model load and hands it to every
unit it installs), sized for the largest step the plan computes on the host (its
crossover), with the sizes of :mod:`selective_offload.worker_buffers`, the plan's ledger
lines for them.

**Why one of each is safe.** Host steps never overlap:

- the CPU build calls each job directly, from the one thread that runs the model, and
  reads its result before the next unit runs (``HostExperts._on_host`` copies it out);
- on CUDA every host step is a host function queued on a stream
  (:mod:`.host_function`), the copies in and out stream operations beside it. A layer's
  host function is queued on the current stream, or on a side stream forked from it and
  joined back (``main.wait_stream(side)``) before the layer's sum, which the next layer
  reads before it copies its own hidden states in; the split head forks and joins the same
  way after the last layer; vLLM replays its graphs, and runs the logits, one after the
  other on one stream. So every unit's copy in is ordered after the previous unit's copy
  out, and the CUDA driver runs a stream's host functions one at a time, in order.

**Why a prefix serves a smaller step.** A job's sizes are fixed when it is made (the C
struct holds T) and its pointers are the starts of its buffers: a job of T tokens reads
``x[:T]``, ids and weights ``[:T, :k]`` and writes ``out[:T]``, all contiguous from the
start of each region. So the jobs of every step size, layer and kind are made over views
at the same addresses, and the one workspace is at least what the largest needs
(``so_moe_workspace_bytes`` grows with every size). A captured CUDA graph holds those
addresses: the buffers are allocated once, at the first step, and never move or grow
after it (:meth:`HostBuffers.reserve` refuses a larger unit then).

The staging slot is page-locked where the units run beside a CUDA device (so that its
copies are asynchronous), registered in place at its exact size through the worker's
:class:`~.page_locked.PageLockedLedger` when one is given (else torch's pinned allocator);
the workspace is ordinary pageable memory (only the CPU reads it).
"""

from __future__ import annotations

import torch

from ..worker_buffers import Staging, Unit

#: What the page-locked ledger calls the staging slot.
STAGING_PURPOSE = "host-compute staging"


def allocate_staging(nbytes: int, pinned: bool, page_locked=None) -> torch.Tensor:
    """The staging slot's one allocation (uint8, ``nbytes``): page-locked when ``pinned``.
    The one site it is allocated at (a test counts the bytes here)."""
    buf = torch.empty(nbytes, dtype=torch.uint8)
    if pinned and page_locked is not None and page_locked.policy.locks:
        page_locked.lock_together([buf], STAGING_PURPOSE)  # buf.data: a page-aligned arena, registered
        return buf
    return buf.pin_memory() if pinned else buf


def allocate_workspace(nbytes: int) -> torch.Tensor:
    """The kernel workspace's one allocation (pageable uint8; a test counts the bytes here)."""
    return torch.empty(nbytes, dtype=torch.uint8)


class HostBuffers:
    """The staging slot and workspace shared by the units that :meth:`reserve` them (see the
    module docstring). ``pinned``: page-lock the staging slot (units beside a CUDA device).
    ``fixed``: the buffers never grow once made (the worker's, which captured graphs hold);
    a private one (``fixed=False``, what a unit made alone gets) is made again, larger, for a
    step larger than any before, and the jobs made on the old one keep it alive."""

    def __init__(self, *, pinned: bool, page_locked=None, fixed: bool = True):
        self.pinned = pinned
        self.page_locked = page_locked
        self.fixed = fixed
        self.units: list[Unit] = []
        self.staging: torch.Tensor | None = None
        self.workspace: torch.Tensor | None = None
        self._made = Staging()

    # ------------------------------------------------------------------ sizes

    def reserve(self, unit: Unit) -> None:
        """Count ``unit``'s largest host step in the buffers' sizes (before they are made)."""
        if self.staging is not None and self.fixed and not (
                self._made.covers(Staging.of([unit])) and self.workspace.numel() >= unit.workspace):
            raise RuntimeError("selective-offload: a host-compute unit was installed after the first host step, "
                               "larger than the buffers that step made (a captured graph holds their addresses)")
        self.units.append(unit)

    @property
    def staging_bytes(self) -> int:
        return Staging.of(self.units).nbytes

    @property
    def workspace_bytes(self) -> int:
        return max((u.workspace for u in self.units), default=0)

    def _ensure(self, need: Unit) -> None:
        """Make the buffers (at the first step), for every unit reserved and ``need``."""
        fits = (self.staging is not None and self._made.covers(Staging.of([need]))
                and self.workspace.numel() >= need.workspace)
        if fits:
            return
        if self.staging is not None and self.fixed:
            raise RuntimeError(f"selective-offload: a host step of {need.tokens} tokens is larger than the "
                               "host-compute buffers this process made for the plan's crossover")
        layout = Staging.of(self.units + [need])
        self._made = layout
        self.staging = allocate_staging(layout.nbytes, self.pinned, self.page_locked)
        self.workspace = allocate_workspace(max(self.workspace_bytes, need.workspace))

    # ------------------------------------------------------------------ views

    def _region(self, at: int, count: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        nbytes = count * torch.empty((), dtype=dtype).element_size()
        return self.staging[at:at + nbytes].view(dtype).view(shape)

    def experts_views(self, unit: Unit, x_dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """Hidden states [T, H] (``x_dtype``), ids [T, k] int32, weights [T, k] float32 and
        sums [T, H] float32 for a step of ``unit.tokens`` tokens: the first bytes of each
        region of the one staging slot."""
        self._ensure(unit)
        x, ids, weights, out = self._made.offsets()
        T, H, K = unit.tokens, unit.hidden, unit.picks
        return (self._region(x, T * H, x_dtype, (T, H)), self._region(ids, T * K, torch.int32, (T, K)),
                self._region(weights, T * K, torch.float32, (T, K)), self._region(out, T * H, torch.float32, (T, H)))

    def rows_views(self, unit: Unit, x_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Hidden states [T, H] and the host rows' logits [T, R] float32 of the split head."""
        self._ensure(unit)
        x, _, _, out = self._made.offsets()
        T, H, R = unit.tokens, unit.hidden, unit.out_width
        return self._region(x, T * H, x_dtype, (T, H)), self._region(out, T * R, torch.float32, (T, R))

