"""The parts of a plan: each group's placement, a step's estimate, vLLM's own offload
priced as a baseline, the model the plan is for, and the alternative placement.

These are frozen records with the quantities that follow from their own fields (a group's
link and VRAM reads per step, a baseline's label); what follows from all the groups
together is :mod:`.contents`, whether the parts agree is :mod:`.checks`, and how they are
read and written is :mod:`.io`. Estimates are labelled ``est`` and never stored as the
truth: :class:`Estimate` is recomputed from the groups by :mod:`selective_offload.estimate`,
:data:`EST_MODEL` names that model in every plan file, and :data:`EST_IGNORES` says what it
leaves out (printed by ``selective-offload plan --explain``, never stored: prose in a file
goes stale with the code that made it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from ..acceptance import DEFAULT_ACCEPT_RATE
from ..estimate.host import crossover_sets, host_compute_crossover, share_held_bytes, share_native
from ..estimate.step import step_cost
from ..estimate.traffic import (
    DEFAULT_DECODE_READ_FACTOR,
    DEFAULT_UVA_READ_FACTOR,
    REFERENCE_CPU_GBPS,
    ExpertsRead,
    StepSettings,
    Traffic,
    expert_read_fraction,
    flops_per_token,
)
from ..kv_model import KvModel
from ..names import EMBED_SEGMENTS, has_segment
from .inputs import PlanInputs
from .vocabulary import (
    HOST_SERVINGS,
    SERVING_LOCATION,
    GroupKind,
    Location,
    Role,
    Serving,
    Strategy,
)

#: The estimate model a plan's ``est`` figures come from, written into every plan file. A
#: change to what :mod:`selective_offload.estimate` prices, or leaves out, names a new one.
EST_MODEL = "bytes-over-bandwidth-v2"

#: What the estimates of :data:`EST_MODEL` leave out (``selective-offload plan --explain``).
EST_IGNORES: tuple[str, ...] = (
    "compute beyond a matmul's best rate: with --compute-tflops (or a probe of the GPU) a layer costs "
    "at least its FLOPs (2 per parameter per token, counted from stored bytes) at that rate; kernels "
    "that reach less at decode shapes (NVFP4 on the reference laptop: docs/design/reference-measurements.md) "
    "run slower than estimated, and without a rate compute is not priced at all",
    "attention compute, activations and sampling; KV reads are priced only with --max-model-len "
    "or --context, and spread evenly over the layers",
    "kernel launch, scheduling and Python overhead between kernels (the host gather's fixed host "
    "work per step among them)",
    "prefetch overlap: a copy starts once the previous offloaded layer has run (vLLM's fork point), "
    "copies and the GPU's compute assumed not to slow each other (they share memory bandwidth); "
    "copies are priced at the pinned copy rate, which no published "
    "measurement of vLLM's prefetch offloader has checked",
    f"UVA reads in kernels at one rate whatever the buffer size ({DEFAULT_UVA_READ_FACTOR} of the copy rate "
    "unless probed; "
    "in-kernel host reads fall as buffers grow past GBs)",
    f"VRAM read by decode kernels at one fraction of a datasheet or saturating-read rate "
    f"({DEFAULT_DECODE_READ_FACTOR} unless the probe measured decode reads or --decode-read-gbps gives them; "
    "published vLLM decode runs: docs/design/step-model.md)",
    "speculative decoding: one acceptance rate for every draft position (measured accepted lengths fall "
    "below it as drafts deepen: docs/design/step-model.md), and the drafts' KV",
    "routed experts (MoE): uniform routing assumed, a step of T tokens reading 1 - (1 - k/E)^T of a "
    "layer's expert bytes; real routers favour some experts, so at T > 1 fewer distinct experts are "
    "read than estimated",
    "host-compute: the CPU kernel reads the experts a step uses at one rate (probed, --cpu-gbps, or the "
    f"reference host's {REFERENCE_CPU_GBPS:g} GB/s assumed) whatever the layer, and computes at least their FLOPs at one CPU "
    "matmul rate; the CPU's and the GPU's work of a layer are sequential (no overlap); prefetch copies run "
    "behind the CPU's time, and host memory serves the copy and the kernel one byte after the other at the "
    "kernel's rate (no measurement of the two together); ranks sharing the "
    "host split its memory bandwidth evenly; the per-layer hand-off is one fixed time",
)


def cold_serving(group: str, kind: GroupKind | str) -> Serving:
    """How a step gets a cold group kept on the host: gathered row by row when it is an
    embedding (or another table, kind module), onloaded on demand when it is a tower,
    projector or other component. The one rule the planner, the plan file's check and the
    report all follow."""
    gathered = has_segment(group, EMBED_SEGMENTS) or kind == GroupKind.MODULE
    return Serving.GATHER if gathered else Serving.ON_DEMAND


@dataclass(frozen=True)
class GroupPlan:
    """One group's role, how a decode step gets it (its serving, which says where it lives)
    and what identifies its tensors."""

    group: str
    kind: GroupKind
    role: Role
    serving: Serving
    reason: str
    bytes: int
    layer_index: int | None
    #: Bytes a decode step reads from this group at batch 1 (est): all of a layer, one row
    #: of an embedding, nothing of a tower, k/E of a layer's routed experts.
    est_read_bytes_per_step: int
    mtp: bool = False
    #: What the model check compares (rename-proof: names are relative to the group).
    num_tensors: int = 0
    dtype_bytes: Mapping[str, int] = field(default_factory=dict)
    shapes_digest: str | None = None
    #: Routed experts of the layer (E) and experts per token (k); 0 for every other kind.
    num_experts: int = 0
    experts_per_token: int = 0
    #: Host-compute routed experts only: how many of the layer's experts (the first, ids 0 to
    #: n - 1) are also held on the device (in bf16; MXFP4 as stored), where the GPU computes
    #: the picks that land on them while the CPU computes the rest (the layer's device share);
    #: 0 for every other group.
    device_experts: int = 0
    #: A host-compute dense MLP only: how many of its first intermediate channels (gate and up
    #: rows, down columns) are also held on the device (in bf16), where the GPU computes them beside
    #: the CPU, and its intermediate size I; 0 and 0 for every other group. A host-compute LM
    #: head: its first vocabulary rows on the device, of its rows (the CPU computes the others).
    device_channels: int = 0
    intermediate: int = 0
    #: A host-compute group only: the sizes its CPU kernel computes with, ``(H, I)``: the
    #: hidden size and the intermediate size of one expert (a dense MLP's; the LM head's
    #: vocabulary rows), which size the worker's staging slot and workspace
    #: (:mod:`selective_offload.worker_buffers`); ``()`` where not known (then not priced).
    kernel_dims: tuple[int, ...] = ()
    #: Which experts the device share holds (``device_experts`` ids, busiest first), when a
    #: routing profile chose them (``plan --routing``); ``()``: the first ``device_experts``.
    device_expert_ids: tuple[int, ...] = ()
    #: The share of the layer's picks the device share's experts took in that profile (est:
    #: what the step model prices); ``None``: priced as uniform routing (``device_share``).
    est_device_hit_rate: float | None = None
    #: Bytes of :attr:`bytes` that vLLM 0.33's post-processing adds on the plan's card
    #: (Marlin FP8's repacked weights and bf16 scales, float32 expert biases;
    #: ``planner.allocation``): allocated where vLLM post-processes the group (on the device,
    #: through UVA, prefetched, cold), not where the host CPU computes it, which keeps the
    #: layout as loaded (:attr:`served_bytes`). 0 where post-processing changes nothing.
    post_processing_bytes: int = 0

    @property
    def served_bytes(self) -> int:
        """The bytes allocated for this group the way it is served: a group the host CPU
        computes is kept as loaded (vLLM's ``create_weights`` sizes, no post-processing);
        any other as vLLM's post-processing leaves it (:attr:`bytes`)."""
        return self.bytes - self.post_processing_bytes if self.serving == Serving.COMPUTE else self.bytes

    @property
    def device_share(self) -> float:
        """The share of this group's bytes also on the device (0 without a device share)."""
        if self.device_experts:
            return self.device_experts / self.num_experts
        return self.device_channels / self.intermediate if self.device_channels else 0.0

    @property
    def device_experts_held(self) -> tuple[int, ...]:
        """The ids of the experts the device share holds: the profile's, else the first."""
        return self.device_expert_ids or tuple(range(self.device_experts))

    @property
    def device_hit_rate(self) -> float:
        """The share of this group's picks the device share computes (est): measured where a
        routing profile chose its experts, else :attr:`device_share` (uniform routing)."""
        return self.device_share if self.est_device_hit_rate is None else self.est_device_hit_rate

    def held_share_bytes(self, fmt: str | None) -> int:
        """Device bytes of this group's device share (its first experts, or its first
        channels) in a plan whose CPU format is ``fmt``: routed experts of a format the share
        kernel reads as stored, at their stored size; any other share in bf16
        (``estimate.host.share_native``, ``estimate.host.share_held_bytes``)."""
        held = self.held_bytes(share_native(fmt, self.kind == GroupKind.EXPERTS))
        if self.device_experts:
            return held * self.device_experts // self.num_experts
        return held * self.device_channels // self.intermediate if self.device_channels else 0

    def held_bytes(self, native: bool) -> int:
        """This whole group held as a device share (``estimate.host.share_held_bytes``), from
        its bytes as served: the post-processing's growth is in tensors of 16 bits or more
        (Marlin's scales, float32 biases), which a share counts once, so it comes off whole."""
        return share_held_bytes(self.dtype_bytes, native) - (self.bytes - self.served_bytes)

    @property
    def on_host(self) -> bool:
        return self.serving in HOST_SERVINGS

    @property
    def location(self) -> Location:
        """Where this group's bytes live during decode."""
        return SERVING_LOCATION[self.serving]

    @property
    def est_link_bytes_per_step(self) -> int:
        """Bytes that cross the link per step at batch 1 (est): a prefetched layer whole
        (experts included), a cold group's reads, the routed experts read through UVA."""
        if self.serving == Serving.PREFETCH:
            return self.bytes
        if self.serving == Serving.COMPUTE:
            return 0  # computed where it lives: only hidden states and top-k cross
        return self.est_read_bytes_per_step if self.on_host else 0

    @property
    def est_vram_bytes_per_step(self) -> int:
        """Device memory reads per step (est); a prefetched layer is read from its buffer too."""
        if self.serving in (Serving.RESIDENT, Serving.PREFETCH):
            return self.est_read_bytes_per_step
        return 0


def experts_read_bytes(nbytes: int, num_experts: int, experts_per_token: int, tokens: int = 1) -> int:
    """Bytes of a layer's routed experts that a step of ``tokens`` tokens reads (est)."""
    return round(nbytes * expert_read_fraction(num_experts, experts_per_token, tokens))


def read_flops(dtype_bytes: Mapping[str, int], read_bytes: int, nbytes: int) -> float:
    """FLOPs per token of a module a step reads ``read_bytes`` of: its FLOPs in that share
    (a module read whole every step computes whole; one read a row at a time, nothing)."""
    return flops_per_token(dtype_bytes) * (read_bytes / nbytes) if nbytes and read_bytes else 0.0


@dataclass(frozen=True)
class Estimate:
    """One decode step, estimated (:mod:`selective_offload.estimate`): link and VRAM time,
    the link time the prefetch overlap hides, the drafts' time, the step, and tokens."""

    est_link_s_per_step: float
    est_vram_s_per_step: float
    est_step_s: float
    est_tok_s: float
    est_tokens_per_step: float = 1.0
    est_tok_s_per_seq: float = 0.0
    est_hidden_link_s_per_step: float = 0.0
    est_draft_s_per_step: float = 0.0
    #: The step's FLOPs over the matmul rate (0 when no rate was given: not priced).
    est_compute_s_per_step: float = 0.0
    #: Host-compute: the host CPU's time on the routed experts it computes (0: none, or the
    #: step is above the crossover and they are copied to the GPU, which is link time).
    est_cpu_s_per_step: float = 0.0

    @classmethod
    def of(cls, traffic: Traffic, inputs: PlanInputs, kv: KvModel | None, spec_tokens: int,
           *, pipelined: bool) -> "Estimate":
        accept = inputs.accept_rate if inputs.accept_rate is not None else DEFAULT_ACCEPT_RATE
        settings = StepSettings(inputs.link_gbps, inputs.vram_gbps, inputs.batch, spec_tokens,
                                accept, inputs.context, inputs.uva_read_gbps, inputs.compute_tflops,
                                inputs.decode_read_gbps, inputs.host_cpu_gbps, inputs.host_cpu_tflops,
                                inputs.host_handoff_s, inputs.ranks)
        return cls(**step_cost(traffic, settings, kv, pipelined=pipelined))


@dataclass(frozen=True)
class VllmBaseline:
    """vLLM's own ``cpu_offload_gb``: parameters of the layer stack, in model order (with
    ``cpu_offload_params``, only those whose names hold one of its segments)."""

    cpu_offload_gb: float
    offloaded_bytes: int
    offloaded_tensors: int
    #: Decoder layers with at least one parameter on the host.
    layers_touched: tuple[int, ...]
    device_bytes: int
    fits: bool
    est: Estimate
    #: vLLM's ``cpu_offload_params`` (empty: every parameter is eligible).
    cpu_offload_params: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        """The vLLM setting, as a user would pass it."""
        return f"cpu_offload_gb={self.cpu_offload_gb:g}" + (
            f", cpu_offload_params={','.join(self.cpu_offload_params)}" if self.cpu_offload_params else "")


@dataclass(frozen=True)
class PlannedModel:
    """The model a plan was made for, and how it is recognised."""

    source: str
    #: ``safetensors`` (headers of a local checkpoint), ``hub`` (headers read from a hub id,
    #: which vLLM downloads), ``manifest``, or ``config`` (sizes estimated).
    kind: str
    architectures: tuple[str, ...]
    #: A hash of every tensor's name, dtype and shape (see :func:`planner.model_fingerprint`).
    fingerprint: str
    num_tensors: int
    total_bytes: int
    tie_word_embeddings: bool
    num_hidden_layers: int | None
    #: MTP layers the model declares (the default number of draft tokens).
    num_mtp_layers: int = 0
    #: KV-cache bytes per token and per sequence, from the config (None: unknown).
    kv: KvModel | None = None


@dataclass(frozen=True)
class Alternative:
    """Another placement priced on the same input (with or without speculative decoding)."""

    label: str
    strategy: Strategy
    cold_on_host_bytes: int
    prefetch_bytes: int
    hot_layer_indices: tuple[int, ...]
    est: Estimate
    uva_bytes: int = 0
    host_compute_bytes: int = 0



#: How the host CPU's work and the GPU's work of a host-compute layer are priced: one after
#: the other (the layer's weighted sum is the next layer's input, and the GPU waits for it).
HOST_COMPUTE_OVERLAP = "none: the CPU's and the GPU's work of a layer are sequential"


@dataclass(frozen=True)
class HostCompute:
    """What the runtime needs to serve a plan's host-compute experts, all derived from the
    plan's inputs and groups (and stated in the plan file, where reading checks it):
    the CPU kernel's format (one per plan: routed experts and dense MLPs computed on the host
    share it), the crossover (the most tokens per step the CPU computes, one for every
    host-compute group: the largest step at which the CPU path of all of them together beats
    copying them; above it the step copies the distinct experts it uses, and the MLPs, over
    the link and computes them on the GPU), the threads each rank's kernel runs with, the rates and the hand-off it was priced at."""

    #: The CPU kernel's format (a key of ``selective_offload.cpu_kernels.claimed.CLAIMED``).
    format: str
    crossover_tokens: int
    #: Threads per rank; ``None``: all physical cores of one NUMA node (split between ranks).
    threads: int | None
    ranks: int
    cpu_gbps: float
    cpu_gbps_source: str
    cpu_tflops: float
    cpu_tflops_source: str
    handoff_s: float
    handoff_source: str
    overlap: str = HOST_COMPUTE_OVERLAP
    #: A split LM head's own crossover (``estimate.host.crossover_sets``: the most logits per step
    #: its CPU part computes; above it its host rows are copied to the device); ``None``
    #: without one.
    head_crossover_tokens: int | None = None

    @classmethod
    def of(cls, fmt: str, inputs: PlanInputs, experts: "tuple[ExpertsRead, ...] | list[ExpertsRead]") -> "HostCompute":
        settings = StepSettings(inputs.link_gbps, inputs.vram_gbps, inputs.batch, 0, DEFAULT_ACCEPT_RATE, 0,
                                inputs.uva_read_gbps, inputs.compute_tflops, inputs.decode_read_gbps,
                                inputs.host_cpu_gbps, inputs.host_cpu_tflops, inputs.host_handoff_s, inputs.ranks)
        layers, *heads = crossover_sets(experts)
        return cls(format=fmt, crossover_tokens=host_compute_crossover(layers, settings),
                   head_crossover_tokens=host_compute_crossover(heads[0], settings) if heads else None,
                   threads=inputs.threads_per_rank, ranks=inputs.ranks,
                   cpu_gbps=float(inputs.host_cpu_gbps), cpu_gbps_source=inputs.cpu_gbps_source,
                   cpu_tflops=float(inputs.host_cpu_tflops),
                   cpu_tflops_source="assumed" if inputs.cpu_tflops is None else "given",
                   handoff_s=float(inputs.host_handoff_s),
                   handoff_source="assumed" if inputs.handoff_s is None else "given")

    def describe(self) -> str:
        """One line for a plan's notes and its rendering."""
        threads = ("all physical cores of one NUMA node" if self.threads is None
                   else f"{self.threads} thread{'s' if self.threads != 1 else ''}")
        if self.ranks > 1:
            threads = (f"{self.ranks} ranks, each its own host-compute unit on its share of the experts (its shard of each MLP) with "
                       + ("the node's physical cores split between them" if self.threads is None
                          else f"{threads} each") + f"; the host's memory bandwidth shared ({self.cpu_gbps:g} GB/s "
                       f"in all, {self.cpu_gbps / self.ranks:.3g} GB/s per rank)")
        else:
            threads = f"one CPU pool: {threads}"
        rate = {"assumed": "assumed: the reference host's, a 2-channel DDR5 machine; measure yours with "
                           "`selective-offload probe` or give --cpu-gbps",
                "measured": "measured by `selective-offload probe`", "flag": "--cpu-gbps"}[self.cpu_gbps_source]
        return (f"host-compute ({self.format}): the host CPU computes the routed experts and dense MLPs it holds at "
                f"{self.cpu_gbps:g} GB/s ({rate}); {threads}; crossover {self.crossover_tokens} tokens per step "
                f"(one for all of them: above it the distinct experts a step uses, and the MLPs, are copied over the "
                f"link and computed on the GPU; "
                + ("" if self.head_crossover_tokens is None else
                   f"the split LM head's own: {self.head_crossover_tokens} logits per step; ")
                + f"CPU matmul {self.cpu_tflops:g} TFLOP/s {self.cpu_tflops_source}, hand-off "
                f"{self.handoff_s * 1e6:.0f} us per layer {self.handoff_source}); overlap {self.overlap}")
