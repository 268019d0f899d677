"""One MoE layer's routed experts kept in host memory and computed there, by the host CPU.

At batch 1 a decode step reads k of a layer's E experts. Read over the link (UVA), those
bytes cross PCIe every step; computed where they live, only the hidden states cross (a few
kB each way) and the experts are read at the host's memory bandwidth, several times the
link's on a laptop. llama.cpp (``--n-cpu-moe``) and KTransformers serve experts this way.

A step that carries many tokens turns the CPU compute-bound (prefill, large batches), so
:class:`HostExperts` serves a step one of two ways, by its number of tokens:

- **on the host** (``tokens <= crossover``): the tokens' hidden states, top-k ids and
  weights go to the host, the CPU kernel (:mod:`selective_offload.cpu_kernels`) computes
  the routed experts where their weights live, the weighted sum comes back;
- **on the device** (above the crossover): the distinct experts the step routes to are
  copied from the same page-locked host weights to the device and computed there, as
  llama.cpp copies weights for ops of many tokens.

The crossover is the plan's (:attr:`Plan.host_compute`), computed by the planner from the
measured rates; the counts of steps and tokens served each way are kept for the report.

On CUDA the host path is stream-ordered (:mod:`.host_function`): copies to fixed pinned
buffers, a host function on the stream that runs the kernel with no Python, a copy back;
a CUDA graph captures it, so vLLM's graphs need not be turned off. Those buffers, and the
kernel's workspace, are one per process, shared by every unit (:mod:`.host_buffers`). A step above the
crossover cannot be captured (which experts it copies depends on the routing), so the
glue caps the worker's graph sizes at the crossover before the engine captures any.

Weights stay in the layout vLLM's ``create_weights`` gave them (before any kernel's
post-processing): the layout the CPU kernel reads, and :func:`cpu_kernels.reference.dequantize`
reads on the device.
"""

from __future__ import annotations

import itertools
import time
import weakref
from dataclasses import dataclass, field, replace

import torch

from .. import cpu_kernels
from ..cpu_kernels import Activation, ExpertWeights
from ..estimate.host import NATIVE_SHARE_FORMATS, share_native
from ..worker_buffers import Unit
from .host_buffers import HostBuffers


def share_kernel_computes(fmt: str, device: torch.device | str) -> bool:
    """Whether a device share of ``fmt`` on ``device`` is computed by the share kernel
    (:mod:`.share_kernel`): a share held as stored (not bf16 or float32) on CUDA. On a CPU
    device (vLLM's CPU build) :meth:`HostExperts._on_share` computes it with its stand-in."""
    return fmt not in ("bf16", "f32") and torch.device(device).type == "cuda"


@dataclass
class Slot:
    """One step shape's buffers (views of the process's one staging slot) and the kernel
    job that reads and writes them."""

    x: torch.Tensor
    ids: torch.Tensor
    weights: torch.Tensor
    out: torch.Tensor
    job: "cpu_kernels.MoEJob"


@dataclass
class PathCount:
    """Steps and tokens one path served, and the host time it took (where timed)."""

    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0
    timed_steps: int = 0

    def add(self, tokens: int, seconds: float | None) -> None:
        self.steps += 1
        self.tokens += tokens
        if seconds is not None:
            self.seconds += seconds
            self.timed_steps += 1

    def per_step_s(self) -> float | None:
        return self.seconds / self.timed_steps if self.timed_steps else None


@dataclass
class ServingCounts:
    """What one host-compute layer served, for the report. Host steps run by a C job are
    counted by the job itself where it runs (:attr:`cpu_kernels.MoEJob.runs`), so a CUDA
    graph's replays, which run no Python, count; only steps with no C job (torch's float32
    ops) and the CPU's time of the steps timed here are counted in Python. A job counts the
    rows it was made for on every run, so a replayed graph counts its captured size: the
    rows vLLM pads a step with to reach it are routed like real tokens and cannot be told
    apart without waiting for the device, and ``host_tokens`` counts token rows, padding
    included."""

    device: PathCount = field(default_factory=PathCount)
    #: Host steps with no C job, and the time of the host steps timed in Python.
    by_python: PathCount = field(default_factory=PathCount)
    #: Expert bytes the CPU read on steps with no C job.
    bytes_by_python: int = 0
    #: The C structs of the jobs whose runs are this layer's host steps (the structs only:
    #: a job's tensors, weights included, are not held), each with the bytes one distinct
    #: expert read and one run read (what :attr:`host_bytes` multiplies their counters by).
    jobs: list = field(default_factory=list)
    #: Where the counts start: the layer's construction, or what :meth:`reset` was told.
    since: str = "construction"

    def add_job(self, job: "cpu_kernels.MoEJob | cpu_kernels.RowsJob", *, bytes_per_expert: int = 0,
                bytes_per_run: int = 0) -> None:
        self.jobs.append((job.job, int(bytes_per_expert), int(bytes_per_run)))

    def time_host(self, seconds: float) -> None:
        """The CPU's time of one host step its C job counted."""
        self.by_python.seconds += seconds
        self.by_python.timed_steps += 1

    @property
    def host(self) -> PathCount:
        """Steps and tokens the host CPU served: its jobs' own counters, plus the steps with no job."""
        p = self.by_python
        return PathCount(steps=p.steps + sum(j.runs for j, _, _ in self.jobs),
                         tokens=p.tokens + sum(j.tokens for j, _, _ in self.jobs),
                         seconds=p.seconds, timed_steps=p.timed_steps)

    @property
    def host_bytes(self) -> int:
        """Expert bytes the CPU read (each distinct expert of a step once)."""
        return self.bytes_by_python + sum(getattr(j, "experts_read", 0) * per_expert + j.runs * per_run
                                          for j, per_expert, per_run in self.jobs)

    def reset(self, since: str) -> None:
        """Start counting again from ``since``: every count zeroed, the jobs' own included
        (between steps: no job runs while this writes its struct)."""
        self.device, self.by_python, self.bytes_by_python, self.since = PathCount(), PathCount(), 0, since
        for job, _, _ in self.jobs:
            job.runs = job.tokens = 0
            if hasattr(job, "experts_read"):
                job.experts_read = 0

    def as_dict(self) -> dict[str, object]:
        host = self.host
        return {"host_steps": host.steps, "host_tokens": host.tokens,
                "host_s_per_step": host.per_step_s(), "device_steps": self.device.steps,
                "device_tokens": self.device.tokens, "host_bytes": self.host_bytes, "counted_since": self.since}


class HostExperts:
    """The routed experts of one MoE layer in host memory, served by the CPU at or below
    ``crossover_tokens`` tokens per step and copied to ``device`` above it.

    ``host_mask``: which experts live here (a bool/uint8 tensor of E); picks of the others
    (and ids < 0) are left to whoever computes them and contribute nothing here.

    ``device_share``: the weights of the experts ``share_ids`` names (by share slot; default:
    the first ones) held on the device in bf16 (the layer's device share,
    :func:`cpu_kernels.reference.held_share`): the device computes the picks that land on them
    (:func:`cpu_kernels.reference.moe_picked`, plain torch ops a CUDA graph captures) and
    the host the rest, at or below the crossover as above it. On CUDA the host path is
    queued on a side stream forked from the current one, so the device share runs while
    the CPU computes, and the current stream waits for both before the sum.
    ``share_channels``: the share is not the first experts but the first intermediate
    channels of every expert (a dense MLP's, :func:`cpu_kernels.channels.split_channels`;
    ``weights`` then holds the other channels): every pick is computed on both sides and
    the two sums added.

    ``buffers``: the process's one staging slot and workspace (:mod:`.host_buffers`), which
    this layer reserves its largest host step in (``crossover_tokens`` tokens of
    ``experts_per_token`` picks); without them the layer makes buffers of its own, as
    large as its largest step so far.
    """

    def __init__(self, group: str, weights: ExpertWeights, activation: Activation, *, crossover_tokens: int,
                 threads: int | None, device: torch.device, host_mask: torch.Tensor | None = None,
                 device_share: ExpertWeights | None = None, share_channels: bool = False,
                 buffers: HostBuffers | None = None, experts_per_token: int | None = None,
                 share_ids: "tuple[int, ...] | None" = None):
        if crossover_tokens < 0:
            raise ValueError(f"{group}: the crossover must be a number of tokens >= 0, not {crossover_tokens}")
        self.group = group
        self.weights = weights
        self.activation = activation
        self.crossover_tokens = int(crossover_tokens)
        self.threads = threads
        self.device = torch.device(device)
        self.share = device_share
        if device_share is not None and device_share.fmt not in ("bf16", "f32") and (
                share_channels or not share_native(device_share.fmt, True) or device_share.fmt != weights.fmt):
            raise ValueError(f"{group}: a {device_share.fmt} device share; hold it in bf16 first, or as stored for "
                             f"routed experts of {', '.join(sorted(NATIVE_SHARE_FORMATS))} "
                             "(cpu_kernels.reference.held_share)")
        if device_share is not None and share_channels and device_share.num_experts != weights.num_experts:
            raise ValueError(f"{group}: a share of channels holds every expert ({weights.num_experts}), not "
                             f"{device_share.num_experts}")
        #: The experts the device share holds, by share slot (the first ones unless a plan
        #: chose them from a routing profile).
        self.share_ids = (tuple(range(device_share.num_experts)) if share_ids is None else tuple(share_ids)) \
            if device_share is not None and not share_channels else ()
        if self.share_ids and (len(self.share_ids) != device_share.num_experts
                               or not all(0 <= e < weights.num_experts for e in self.share_ids)):
            raise ValueError(f"{group}: a device share of {device_share.num_experts} experts holding "
                             f"{list(self.share_ids)[:8]}; name that many experts of {weights.num_experts}")
        if device_share is not None and not share_channels:
            mask = (torch.ones(weights.num_experts, dtype=torch.bool) if host_mask is None
                    else host_mask.to(torch.bool).clone())
            mask[list(self.share_ids)] = False
            host_mask = mask
            #: Each expert's slot in the device share, -1 for the host's: the router's ids are
            #: mapped through it on the device (no host synchronisation; a graph captures it).
            slot = torch.full((weights.num_experts,), -1, dtype=torch.long)
            slot[list(self.share_ids)] = torch.arange(len(self.share_ids))
            self.share_slot = slot.to(device_share.w13.device)
        if device_share is not None:
            #: Picks the device share computed, counted on its device (no synchronisation).
            self.share_picks = torch.zeros((), dtype=torch.long, device=device_share.w13.device)
        #: The share is computed by the share kernel (:func:`share_kernel_computes`).
        self.share_kernel = device_share is not None and share_kernel_computes(device_share.fmt,
                                                                               device_share.w13.device)
        self.share_channels = share_channels
        self.host_mask = host_mask
        self._side_stream = None  # the host path's stream beside a device share (CUDA)
        self.counts = ServingCounts()
        self._host_function = None  # made on the first CUDA step (:mod:`.host_function`)
        self._slots: dict[tuple, Slot] = {}  # jobs by step shape, over views of the buffers
        if buffers is None:
            buffers = HostBuffers(pinned=self.on_cuda, fixed=False)
        elif self.crossover_tokens and weights.fmt not in cpu_kernels.TORCH_FORMATS:
            if experts_per_token is None:
                raise ValueError(f"{group}: shared host-compute buffers are sized for the experts per token; "
                                 "pass experts_per_token")
            buffers.reserve(self.unit(self.crossover_tokens, int(experts_per_token)))
        self.buffers = buffers

    def reset_counts(self, since: str) -> None:
        """Count what this layer serves from ``since`` on (:meth:`ServingCounts.reset`), the
        device share's picks too."""
        self.counts.reset(since)
        if self.share is not None:
            self.share_picks.zero_()

    def unit(self, tokens: int, picks: int) -> Unit:
        """A host step of ``tokens`` tokens of ``picks`` picks, as the buffers count it."""
        w = self.weights
        return Unit.experts(tokens, picks, w.num_experts, w.hidden, w.intermediate)

    @property
    def on_cuda(self) -> bool:
        return self.device.type == "cuda"

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """The weighted sum of the routed experts for ``x`` ([T, H]), in ``x``'s dtype and device."""
        tokens = int(x.shape[0])
        if tokens <= self.crossover_tokens:
            return self._on_host(x, topk_ids, topk_weights)
        out = self._on_device(x, topk_ids, topk_weights)
        return out if self.share is None else (out.float() + self._on_share(x, topk_ids, topk_weights)).to(x.dtype)

    __call__ = forward

    # ------------------------------------------------------------------ the host path

    def _on_host(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        if self.on_cuda:
            from .host_function import HostFunction

            if self._host_function is None:
                self._host_function = HostFunction(self)
            # Counted by the job as the host function runs it (graph replays too); the CPU's
            # time is the host function's, off this thread.
            return (self._host_function.enqueue(x, topk_ids, topk_weights) if self.share is None
                    else self._beside_share(x, topk_ids, topk_weights))
        start = time.perf_counter()
        out = self.compute_on_host(x, topk_ids, topk_weights)  # a buffer the next step reuses
        seconds = time.perf_counter() - start
        if self.weights.fmt in cpu_kernels.TORCH_FORMATS:
            self.counts.by_python.add(int(x.shape[0]), seconds)  # no C job to count it
        else:
            self.counts.time_host(seconds)  # the job counted the step
        if self.share is not None:
            out = out + self._on_share(x, topk_ids, topk_weights)
        return out.to(x.dtype, copy=True)

    def _beside_share(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """CUDA: the host path on a side stream forked from the current one, the device share
        on the current stream meanwhile, joined before the sum (a graph captures the fork
        and the join as it captures the host function)."""
        main = torch.cuda.current_stream(x.device)
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(x.device)
        side = self._side_stream
        # Made on the current stream, which waits for the side stream before it reads (or
        # frees) it or the inputs the side stream reads: no record_stream needed.
        host = torch.empty((x.shape[0], x.shape[1]), dtype=torch.float32, device=x.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            self._host_function.enqueue(x, topk_ids, topk_weights, out=host)
        share = self._on_share(x, topk_ids, topk_weights)
        main.wait_stream(side)
        return (host + share).to(x.dtype)

    def _on_share(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """The picks that land on the device share, computed where it lives (float32): a bf16
        share with torch ops, a share held as stored by the share kernel (:mod:`.share_kernel`)
        on CUDA. On a CPU device (vLLM's CPU build) there is no such kernel to run: its
        stand-in there is the copied path's sums over the share's picks, each picked expert
        dequantized as it is read, the same sums the kernel makes."""
        ids = topk_ids.to(self.share.w13.device).long()
        if not self.share_channels:  # the router's expert ids as share slots: -1 for the host's picks
            known = (ids >= 0) & (ids < self.share_slot.numel())  # an id past E reads no slot: no device fault
            ids = torch.where(known, self.share_slot[ids.clamp(0, self.share_slot.numel() - 1)], -1)
        inside = (ids >= 0) & (ids < self.share.num_experts)
        self.share_picks += inside.sum()
        if self.share.fmt in ("bf16", "f32"):
            return cpu_kernels.reference.moe_picked(x, ids, topk_weights, self.share, self.activation)
        if self.share_kernel:
            from .share_kernel import moe_native

            return moe_native(x, ids, topk_weights, self.share, self.activation)
        return cpu_kernels.reference.moe_copied(x, torch.where(inside, ids, -1), topk_weights, self.share,
                                                self.activation)

    def compute_on_host(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """The kernel on host tensors (float32 [T, H], a view of the process's staging slot
        that the next host step of any unit overwrites: copy it before then); the job counts
        the step and the expert bytes it read."""
        ids = topk_ids.to(torch.int32)
        if self.weights.fmt in cpu_kernels.TORCH_FORMATS:  # no C job to reuse (cpu_kernels.moe)
            self.counts.bytes_by_python += int(self._picked(ids)[1].numel()) * self.weights.expert_bytes
            return cpu_kernels.moe(x, ids, topk_weights, self.weights, self.activation, threads=self.threads,
                                   host_mask=self.host_mask)
        slot = self.slot(x, ids, pinned=False)
        slot.x.copy_(x)
        slot.ids.copy_(ids)
        slot.weights.copy_(topk_weights)
        # Run as a CUDA host function runs it: a failure fills the output with NaN, is counted,
        # and is raised at the step's host synchronisation (cpu_kernels.raise_if_failed).
        slot.job.launch()
        return slot.out

    def slot(self, x: torch.Tensor, topk_ids: torch.Tensor, *, pinned: bool) -> "Slot":
        """The buffers and a kernel job for steps of ``x``'s shape: a job's sizes are fixed
        when it is made, and making one costs more than the copies into its buffers. The
        buffers are the first bytes of the process's one staging slot, and the job runs in
        its one workspace (:mod:`.host_buffers`); a captured CUDA graph holds their addresses
        (:mod:`.host_function`), which never move. ``pinned``: the buffers are the
        page-locked ones (CUDA), which :attr:`buffers` must be."""
        if pinned != self.buffers.pinned:
            raise ValueError(f"{self.group}: a {'page-locked' if pinned else 'pageable'} step on "
                             f"{'page-locked' if self.buffers.pinned else 'pageable'} buffers")
        key = (int(x.shape[0]), int(topk_ids.shape[1]), x.dtype)
        slot = self._slots.get(key)
        if slot is None:
            unit = self.unit(key[0], key[1])
            xs, ids, weights, out = self.buffers.experts_views(unit, x.dtype)
            job = cpu_kernels.MoEJob(xs, ids, weights, self.weights, self.activation, out=out, threads=self.threads,
                                     host_mask=self.host_mask, workspace=self.buffers.workspace)
            job.name(self.group)
            self.counts.add_job(job, bytes_per_expert=self.weights.expert_bytes)
            slot = self._slots[key] = Slot(xs, ids, weights, out, job)
        return slot

    def _picked(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Which picks are this host's (id >= 0 and in the host set), and the distinct
        experts they name (sorted, on the host)."""
        ids = ids.to(torch.long)
        valid = ids >= 0
        if self.host_mask is not None:
            valid &= self.host_mask.to(device=ids.device, dtype=torch.bool)[ids.clamp(min=0)]
        return valid, torch.unique(ids[valid]).cpu()

    # ------------------------------------------------------------------ the device path

    def _on_device(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        if self.on_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"{self.group}: a CUDA graph of {int(x.shape[0])} tokens was captured, above the "
                               f"plan's crossover of {self.crossover_tokens}: the experts such a step copies depend "
                               "on its routing, so it cannot be captured; cap vLLM's graph sizes at the crossover")
        start = time.perf_counter()
        ids = topk_ids.to(torch.long)
        valid, used = self._picked(ids)
        if not used.numel():  # every pick is another's (device-resident experts)
            self.counts.device.add(int(x.shape[0]), None)
            return torch.zeros_like(x)
        # Only the distinct experts of this step cross the link, from the page-locked weights.
        sub = self._experts_on_device(used)
        local = torch.full((self.weights.num_experts,), -1, dtype=torch.long, device=ids.device)
        local[used.to(ids.device)] = torch.arange(used.numel(), device=ids.device)
        remapped = torch.where(valid, local[ids.clamp(min=0)], torch.full_like(ids, -1))
        out = cpu_kernels.reference.moe_copied(x, remapped, topk_weights, sub, self.activation)
        self.counts.device.add(int(x.shape[0]), None if self.on_cuda else time.perf_counter() - start)
        return out.to(x.dtype)

    def _experts_on_device(self, used: torch.Tensor) -> ExpertWeights:
        """Every tensor of the experts ``used`` names (sorted, on the host), on the device: each
        run of consecutive experts copied straight from a view of the page-locked weights, so
        the copy runs at the pinned rate with no gather on the host first."""
        runs: list[list[int]] = []  # [first expert, count]
        for e in used.tolist():
            if runs and runs[-1][0] + runs[-1][1] == e:
                runs[-1][1] += 1
            else:
                runs.append([e, 1])

        def take(t: torch.Tensor) -> torch.Tensor:
            out = torch.empty((int(used.numel()), *t.shape[1:]), dtype=t.dtype, device=self.device)
            at = 0
            for first, n in runs:
                out[at:at + n].copy_(t[first:first + n], non_blocking=True)
                at += n
            return out

        return replace(self.weights, **{name: take(t) for name, t in self.weights.tensors().items()})


# ----------------------------------------------------------------------- the opaque op

#: Live host experts by key: what the op below calls (held weakly: the model owns them).
_LIVE: "weakref.WeakValueDictionary[int, HostExperts]" = weakref.WeakValueDictionary()
_KEYS = itertools.count(1)


def register(experts: HostExperts) -> int:
    """A key :func:`on_host` finds ``experts`` by, for as long as they live."""
    key = next(_KEYS)
    _LIVE[key] = experts
    return key


@torch.library.custom_op("selective_offload::experts_on_host", mutates_args=())
def on_host(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, key: int) -> torch.Tensor:
    """The host experts registered under ``key`` applied to ``x``, as one op that
    torch.compile (vLLM compiles the model with ``fullgraph``) does not trace into: inside
    are a ctypes call and a step-dependent choice of path, neither of which it can trace.
    A CUDA graph captures what it queues (the host path is stream-ordered)."""
    experts = _LIVE.get(key)
    if experts is None:
        raise RuntimeError(f"selective-offload: no host experts are registered under key {key} (their model was released)")
    return experts(x, topk_ids, topk_weights)


@on_host.register_fake
def _(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, key: int) -> torch.Tensor:
    return torch.empty_like(x)
