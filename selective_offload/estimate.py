"""What one decode step costs, estimated from bytes and bandwidths: the traffic model.

A decode step of a memory-bound model reads every resident weight once from VRAM, every
offloaded weight once over the link, and each sequence's KV cache. The levers that
change what that costs per generated token are priced here; every figure is an estimate
(``est_``), and :data:`~selective_offload.plan_format.EST_IGNORES` says what it leaves out.

- **Overlap and rate, as each mechanism moves bytes.** vLLM's prefetch offloader copies
  the next offloaded layer with the copy engine (the pinned copy rate) while the layers
  between it and the previous offloaded layer compute, so an offloaded layer costs about
  ``max(its copy, the compute it hides behind)`` plus its own compute, not the sum
  (:func:`pipelined_step_s`). Bulk ``cpu_offload_gb``, the
  UVA embedding and experts read in place are read by the kernels through UVA: in line,
  no overlap (:func:`inline_step_s`), at the UVA read rate, which is below the copy rate
  (:data:`DEFAULT_UVA_READ_FACTOR`, or what ``selective-offload probe`` measured).
- **Decode reads of VRAM.** A step's weights and KV are read by decode kernels (GEMVs and
  small GEMMs, attention), which reach a fraction of a box's datasheet or saturating-read
  rate (:data:`DEFAULT_DECODE_READ_FACTOR`), unless the rate given is one measured the way
  decode reads (the probe's matrix-vector product: :func:`decode_read_rate`).
- **Compute.** Given the card's matmul rate, each layer costs at least its FLOPs at the
  step's tokens (:func:`flops_per_token`); without one, compute is not priced.
- **Batch.** ``N`` concurrent sequences share one pass over the weights (and one trip of
  every offloaded byte over the link); each adds its own embedding rows and KV reads.
- **Speculative decoding.** An MTP head drafts ``K`` tokens (``K`` passes over the head and
  the LM head it shares), then one target pass verifies ``K + 1`` tokens per sequence.
  With a per-token acceptance rate ``a``, a step yields on average
  ``E(K, a) = (1 - a**(K + 1)) / (1 - a)`` tokens per sequence (the accepted prefix plus
  the target's own next token; :func:`expected_tokens_per_step`). Speculation pays when
  ``E(K, a) / (step + draft) > 1 / step_without``; the head's bytes also displace decoder
  layers to the host, which the placement prices.
- **Routed experts (MoE).** A token runs ``k`` of a layer's ``E`` routed experts, so a
  step of ``T`` tokens (batch x tokens verified per sequence) reads the experts that at
  least one of them was routed to: ``E * (1 - (1 - k/E)**T)`` of them, assuming uniform
  routing (:func:`expert_read_fraction`, the one place that says so). Experts read in
  place from host memory through UVA cross the link at that fraction, in line; experts
  resident on the device are read from VRAM at that fraction; experts inside a layer the
  prefetch offloader copies cross the link whole.
- **Routed experts computed on the host CPU (host-compute).** The experts live in host
  memory; at a step of ``T`` tokens the host reads the distinct experts the step uses at the
  host kernel's rate and computes them (at least their FLOPs at the CPU's matmul rate), with
  a fixed hand-off per layer (hidden states and top-k down, the weighted sum back). Above a
  crossover ``T`` the same distinct experts are instead copied over the link at the pinned
  copy rate and computed on the GPU by torch ops (:func:`host_compute_crossover`). The CPU's
  work and the GPU's work of a layer are sequential (the layer's output is the next layer's
  input, and the GPU waits for the sum). The copy engine does not wait: the prefetch
  offloader's next copy runs behind the CPU's time as behind the GPU's, but the copy and
  the CPU kernel both read host memory, so that stretch takes at least their host reads
  one after the other at the kernel's rate (:func:`pipelined_step_s`). Ranks sharing the
  host (tensor or expert parallel) each compute their share with their share of the host's
  memory bandwidth.
  With a device share, part of each layer is also held on the device and the GPU computes
  the picks that land there while the CPU computes the rest; the layer costs the longer of
  the two, the GPU's part priced by the bytes its torch path moves
  (:func:`device_share_traffic`: held in bf16, a decode step's pick slots gathered; MXFP4
  experts held as stored, each picked one read once by the share kernel).
- **KV cache.** Bytes per token from the model's attention layers (KV heads x head dim,
  MLA's latent, sliding windows capped at their window) plus the fixed state of
  linear-attention layers (:class:`KvModel`); a step reads each sequence's context.

Default acceptance rate: :data:`DEFAULT_ACCEPT_RATE`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

from .acceptance import (  # noqa: F401  (a step's tokens under speculation; re-exported here)
    ACCEPTANCE_DEFAULTS, DEFAULT_ACCEPT_RATE, GENERIC_ACCEPTANCE, MAX_DRAFT_TOKENS, AcceptanceDefault,
    acceptance_default, expected_tokens_per_step)
from .kv_model import KV_DTYPE_BYTES, KvModel  # noqa: F401  (a step reads its KV; both re-exported here)

#: Kernels reading host memory in place through UVA (vLLM's ``cpu_offload_gb``, the UVA
#: embedding, experts read in place) reach this fraction of the pinned copy rate, when no
#: probe measured it (``selective-offload probe``: ``uva_read_gbps``). It is the reference
#: laptop's arithmetic (docs/design/reference-measurements.md: ``cpu_offload_gb=10``, 10.77 GB read in line at 1.05
#: tok/s measured with 13.9 GB/s pinned copies; the 20 GB left on the device, read at
#: :data:`DEFAULT_DECODE_READ_FACTOR` of its 472 GB/s, take 48 ms of the 952 ms step, which
#: leaves 905 ms for 10.77 GB: 0.86 of the copy rate), so it CALIBRATES the model on that
#: point rather than validates it, and moves with the decode factor. Other
#: published figures agree in direction only: kernels' host reads reach less than the copy
#: engine and fall as the buffer grows (NVIDIA/nvbandwidth issue #42: an A100's
#: ``host_to_device_memcpy_sm`` 25.13 GB/s at 1 GiB, 16.50 GB/s at 20 GiB; issue #24: an
#: H100's 35.2 GB/s host-to-device against 52.8 GB/s device-to-host, both by SMs).
# mutation: uva-factor-1
DEFAULT_UVA_READ_FACTOR = 0.86

#: Decode kernels read VRAM at this fraction of a box's datasheet (peak) or saturating-read
#: rate, when no rate measured the way decode reads is given (``--decode-read-gbps``, the
#: probe's ``decode_read_gbps``). CALIBRATED on one published point: vLLM 0.15.1 decoding
#: nvidia/Llama-3.3-70B-Instruct-NVFP4 resident on a DGX Spark at 4.0-4.2 tok/s
#: (NVIDIA/dgx-spark-playbooks issue #79) against the 232 GB/s a saturating-read kernel
#: measures there (antirez/ds4 issue #773) gives 0.70-0.735; the middle, rounded. VALIDATED
#: (benchmarks/published.json, est/measured in benchmarks/results/published.md) on
#: gpt-oss-120b on the same box and image (resident MoE), and on two other boxes and vLLM
#: releases against their datasheet rates: Llama-3.1-8B bf16 at batch 1 on an A100 40GB
#: (vLLM 0.23.0, about 75 tok/s, "roughly 77% of the memory-bandwidth ceiling") and on an
#: H100 80GB HBM3 (vLLM 0.21.0, 6.48 ms median time per output token). Published decode
#: runs sit between 0.60 and 0.78 of a datasheet rate, so this is a default, not a law:
#: the probe measures the box's own.
# mutation: decode-factor-1
DEFAULT_DECODE_READ_FACTOR = 0.72


def decode_read_rate(vram_gbps: float, decode_read_gbps: float | None = None) -> float:
    """GB/s at which a decode step reads VRAM: ``decode_read_gbps`` when measured the way
    decode reads (or given), else ``vram_gbps`` (a datasheet or saturating-read figure) x
    :data:`DEFAULT_DECODE_READ_FACTOR`."""
    # mutation: decode-factor-on-measured
    return decode_read_gbps if decode_read_gbps is not None else vram_gbps * DEFAULT_DECODE_READ_FACTOR


def expert_read_fraction(num_experts: int, experts_per_token: int, tokens: int | float, *,
                         routing: "tuple[float, ...] | None" = None) -> float:
    """The share of a MoE layer's routed-expert bytes that a step of ``tokens`` tokens reads
    (est): the expected share of experts at least one token is routed to.

    Uniform routing (the default) gives each expert the chance ``k/E`` per token, so the
    share is ``1 - (1 - k/E)**T``: ``k/E`` at one token, approaching 1 as tokens grow.
    ``routing`` is room for a measured profile (each expert's share of the routing choices,
    summing to ``k``): ``mean(1 - (1 - p_i)**T)``; nothing measures one yet. Every MoE price
    (the planner, the bulk and segment baselines, the benchmarks) goes through here.
    """
    if num_experts <= 0 or experts_per_token <= 0:
        return 1.0
    t = max(float(tokens), 0.0)
    if routing is not None:
        return sum(1.0 - (1.0 - min(max(p, 0.0), 1.0)) ** t for p in routing) / len(routing) if routing else 1.0
    # mutation: expert-read-whole
    p = min(experts_per_token / num_experts, 1.0)
    return 1.0 - (1.0 - p) ** t


#: The host kernel rate a plan assumes when neither a probe nor ``--cpu-gbps`` gives one
#: (GB/s of expert weights read by the CPU kernel at batch 1): the reference host's, a
#: 2-channel DDR5 machine (the issue's stated assumption, not a measurement). A plan that
#: uses it labels it ``assumed``.
# mutation: reference-cpu-rate-unlabelled
REFERENCE_CPU_GBPS = 55.0
#: The CPU's matmul rate for the crossover when neither a probe nor ``--cpu-tflops`` gives
#: one (TFLOP/s): an assumption of about a third of the AVX2 FMA peak of a laptop CPU with 8
#: performance cores (8 x 32 FLOP/cycle x 4 GHz ~ 1 TFLOP/s fp32) once weights are
#: dequantized in the loop; it only decides where prefill and large batches leave the CPU.
ASSUMED_CPU_TFLOPS = 0.3
#: The per-layer hand-off when the probe has not measured one (seconds): two small pinned
#: copies (hidden states and top-k to the host, the weighted sum back) and a stream
#: synchronisation, assumed about 10 microseconds each (no published figure; the probe
#: measures it as ``handoff_s``).
ASSUMED_HANDOFF_S = 30e-6
#: A device share is held on the device at least this wide (bits a parameter): a quantized
#: or 8-bit checkpoint's share in bf16, a float32 one as it is. The GPU computes it with torch
#: ops (``cpu_kernels.reference.moe_picked``), which read such a weight once per matmul; a
#: quantized share would be dequantized at every step, many times its bytes in memory traffic.
#: Routed experts of :data:`NATIVE_SHARE_FORMATS` are the exception.
SHARE_MIN_BITS = 16
#: Formats whose routed experts a device share holds as the checkpoint stores them: the GPU
#: computes them with a kernel that reads them there by the router's ids
#: (``wrappers.share_kernel``), each expert a step picks read once (:func:`device_share_traffic`).
#: bf16 needs no such kernel to be held at its own width; block FP8 and int4 have none.
# mutation: native-share-formats-empty
NATIVE_SHARE_FORMATS = frozenset({"mxfp4"})
#: The device share's path gathers each pick slot's expert up to this many tokens per step
#: (:func:`share_gathers`), at this many times the expert's held bytes: the gather reads and
#: writes it, the matmul reads the copy.
SHARE_GATHER_TOKENS = 8
SHARE_GATHER_TRAFFIC = 3
#: Above the crossover the worker copies a step's experts to the device and computes them
#: with torch ops (``cpu_kernels.reference.moe_copied``): bf16 as it is, a quantized format
#: dequantized to bf16 an expert at a time. Bytes of VRAM traffic per copied byte, by CPU
#: format (est: the ops' reads and writes counted on the path,
#: ``tests/unit/cpu_kernels/test_share_traffic.py``); a fused kernel reading the format where
#: it lies would move about one.
COPIED_PATH_TRAFFIC = {"bf16": 1.0, "fp8-block": 9.0, "int4": 24.0, "mxfp4": 25.0}
#: The most tokens per step the crossover search considers (a step of more tokens than
#: this is prefill of a long prompt, always copied to the GPU when the CPU loses earlier).
MAX_CROSSOVER_TOKENS = 1 << 20


@dataclass(frozen=True)
class LayerCost:
    """One decoder layer in a step: the time it takes (its weights and KV read from VRAM,
    and the host CPU's part where it computes some of the layer there, est) and, when it is
    offloaded, the time its copy over the link takes. ``host_s`` and ``copy_host_s`` are the
    host memory's share of those: the bytes the CPU kernel reads, and the bytes the copy
    reads from host memory, each at the host kernel's rate."""

    compute_s: float
    copy_s: float = 0.0
    host_s: float = 0.0
    copy_host_s: float = 0.0


def pipelined_step_s(layers: list[LayerCost], other_s: float) -> tuple[float, float]:
    """Step time with the prefetch offloader, and how much link time it hides.

    Each offloaded layer's copy starts when the previous offloaded layer has finished (vLLM
    0.33's ``PrefetchOffloader`` forks its copy stream from the compute stream after that
    layer's forward: the copy reuses the device slot that layer read) and overlaps
    everything computed from there up to it: the layers in between and, cyclically across
    steps, the tail of one step (``other_s``: LM head, sampling) and the head of the next.
    So the step is the sum, over those segments, of ``max(copy, compute of the segment)``,
    plus the offloaded layers' own compute, which no copy hides.

    A segment whose layers compute on the host CPU hides the copy behind the CPU's time
    too (the copy engine does not wait for the host), but both read host memory: the
    segment also takes at least the copy's and the CPU kernel's host reads one after the
    other at the host's rate (``copy_host_s + sum(host_s)``), so a copied byte costs the
    CPU's work what a byte it reads itself does.
    """
    offloaded = [i for i, layer in enumerate(layers) if layer.copy_s > 0]
    compute = sum(layer.compute_s for layer in layers) + other_s
    if not offloaded:
        return compute, 0.0
    step = 0.0
    for n, j in enumerate(offloaded):
        prev = offloaded[n - 1]
        # wraps around for the first: from the last offloaded layer through the step's end
        # mutation: prefetch-before-slot-free
        span = layers[prev + 1:] + layers[:j] if n == 0 else layers[prev + 1:j]
        segment = sum(l.compute_s for l in span) + (other_s if n == 0 else 0.0)
        host = sum(l.host_s for l in span)
        # mutation: copy-host-contention-ignored
        shared = layers[j].copy_host_s + host if host > 0 else 0.0
        # mutation: no-overlap
        step += max(layers[j].copy_s, segment, shared) + layers[prev].compute_s
    link = sum(layers[j].copy_s for j in offloaded)
    return step, compute + link - step


def inline_step_s(device_read_s: float, uva_read_s: float) -> float:
    """Bulk ``cpu_offload_gb``: kernels read offloaded weights through UVA, in line."""
    return device_read_s + uva_read_s


@dataclass(frozen=True)
class Traffic:
    """The bytes one decode pass moves, by where they are read from (a placement's view)."""

    #: Decoder layers in stack order: (bytes read per pass, whether it is offloaded and
    #: prefetched over the link).
    layers: tuple[tuple[int, bool], ...] = ()
    #: Other resident bytes read every pass (the LM head, a tied embedding, norms).
    other_device_bytes: int = 0
    #: Bytes of one embedding row, gathered on the host (per token) or read on the device.
    row_bytes_host: int = 0
    row_bytes_device: int = 0
    #: Bulk cpu_offload_gb: bytes the kernels read through UVA, in line, every pass.
    uva_bytes: int = 0
    #: Speculative decoding: bytes each draft pass reads (the MTP head and the LM head).
    draft_bytes: int = 0
    #: Routed experts of MoE layers, priced by the tokens of the step (see :class:`ExpertsRead`).
    experts: tuple["ExpertsRead", ...] = ()
    #: FLOPs per token (:func:`flops_per_token`): of each decoder layer's dense part (in
    #: ``layers`` order), of the other resident modules read every pass (the LM head), and
    #: of one draft pass (the MTP head and the LM head).
    layer_flops: tuple[float, ...] = ()
    other_flops: float = 0.0
    draft_flops: float = 0.0


#: Where a layer's routed experts are read from: VRAM, a prefetched copy of the whole layer,
#: host memory in place through UVA (in line), or host memory by the host CPU (host-compute).
EXPERTS_DEVICE, EXPERTS_PREFETCHED, EXPERTS_UVA, EXPERTS_CPU = "device", "prefetched", "uva", "cpu"


@dataclass(frozen=True)
class ExpertsRead:
    """The routed experts of one MoE layer in a step: the layer's position in
    :attr:`Traffic.layers`, their bytes, E and k, and where they are read from."""

    layer: int
    nbytes: int
    num_experts: int
    experts_per_token: int
    where: str = EXPERTS_DEVICE
    #: FLOPs one token spends in this layer's routed experts (its k experts, est).
    flops_per_token: float = 0.0
    #: Host-compute only: the share of the group's bytes that is also resident on the device,
    #: computed there by the GPU while the CPU computes the rest of the step's picks (a split
    #: of the layer's work between the two, est; 0: the CPU computes every pick).
    device_share: float = 0.0
    #: The group's bytes as a device share holds them (:func:`share_held_bytes`); 0:
    #: :attr:`nbytes`.
    held_nbytes: int = 0
    #: The device share is held as stored and read by the share kernel (:func:`share_native`).
    share_native: bool = False
    #: Host-compute only: bytes of VRAM traffic per byte copied to the device above the
    #: crossover (:data:`COPIED_PATH_TRAFFIC` of the plan's CPU format).
    copied_traffic: float = 1.0

    def read_bytes(self, tokens: float) -> float:
        return self.nbytes * expert_read_fraction(self.num_experts, self.experts_per_token, tokens)

    @property
    def share(self) -> float:
        """:attr:`device_share`, held to [0, 1]."""
        return min(max(self.device_share, 0.0), 1.0)


@dataclass(frozen=True)
class StepSettings:
    link_gbps: float
    vram_gbps: float
    batch: int = 1
    spec_tokens: int = 0
    accept_rate: float = DEFAULT_ACCEPT_RATE
    #: Average context of a sequence in the step (KV read per sequence); 0: not priced.
    context_tokens: int = 0
    #: Kernels reading host memory in place through UVA; ``None``: ``link_gbps`` x
    #: :data:`DEFAULT_UVA_READ_FACTOR`.
    uva_gbps: float | None = None
    #: The card's matmul rate for the weights' format (TFLOP/s); ``None``: compute not priced.
    compute_tflops: float | None = None
    #: The rate decode kernels read VRAM at, measured so; ``None``: ``vram_gbps`` x
    #: :data:`DEFAULT_DECODE_READ_FACTOR` (:func:`decode_read_rate`).
    decode_read_gbps: float | None = None
    #: Host-compute: the host kernel's rate (GB/s of weights read), the CPU's matmul rate
    #: (TFLOP/s), the per-layer hand-off (s) and the ranks sharing the host.
    cpu_gbps: float = REFERENCE_CPU_GBPS
    cpu_tflops: float = ASSUMED_CPU_TFLOPS
    handoff_s: float = ASSUMED_HANDOFF_S
    ranks: int = 1


#: Bits one parameter takes in a stored dtype, for counting parameters (and so FLOPs) from
#: bytes: 8-bit containers of quantized checkpoints hold two 4-bit values in U8 (NVFP4,
#: MXFP4 blocks, bitsandbytes nf4) and eight in I32 (GPTQ, AWQ ``qweight``). Scales stored
#: beside them are counted as parameters too (a few percent at most).
# mutation: packed-params-not-counted
PARAM_BITS = {"U8": 4, "I32": 4, "U32": 4, "F4": 4}


def flops_per_token(dtype_bytes: Mapping[str, int]) -> float:
    """2 FLOPs (a multiply and an add) per parameter, parameters counted from stored bytes
    by dtype (:data:`PARAM_BITS` for packed containers, else the dtype's width; est)."""
    from .tensors import DTYPE_BITS

    params = sum(nbytes * 8 / PARAM_BITS.get(dtype, DTYPE_BITS.get(dtype, 16)) for dtype, nbytes in dtype_bytes.items())
    return 2.0 * params


def copied_bytes(nbytes: int, rows_on_device: int, rows: int) -> int:
    """A split LM head's bytes a step above its crossover copies: its host rows alone."""
    return nbytes * (rows - rows_on_device) // rows


def copied_step_bytes(nbytes: int, num_experts: int, dtype_bytes: Mapping[str, int], fmt: str | None) -> int:
    """Device bytes one host-compute group holds in a step above the crossover (est): vLLM's
    profile run is such a step (``max_num_batched_tokens`` tokens, every expert picked), in
    which the worker copies the group's host experts (or MLP, or head rows) to the device
    and computes them there one expert at a time, each dequantized to bf16 first when the
    format is quantized (``wrappers.host_compute.HostExperts._on_device``). At most the
    group's bytes (a device share is not copied; counted anyway) plus one expert in bf16."""
    # mutation: copied-transient-without-dequantized
    dequantized = 0 if fmt in (None, "bf16", "f32") else int(flops_per_token(dtype_bytes) / max(1, num_experts))
    return nbytes + dequantized


def host_rate(settings: StepSettings) -> float:
    """One rank's share of the host kernel rate (bytes/s): its CPU reads' and its copies'."""
    return settings.cpu_gbps * 1e9 / max(1, settings.ranks)


def host_compute_time(e: "ExpertsRead", tokens: float, settings: StepSettings) -> tuple[float, float, float]:
    """One host-compute group in a step of ``tokens`` tokens (est): its time on the CPU,
    its time copied over the link and computed on the GPU, and the host memory's share of
    the first (its bytes at the kernel's rate). :func:`host_compute_times` says how."""
    ranks = max(1, settings.ranks)
    cpu_flop_s = settings.cpu_tflops * 1e12 / ranks
    link = settings.link_gbps * 1e9
    vram = decode_read_rate(settings.vram_gbps, settings.decode_read_gbps) * 1e9
    gpu_flop_s = settings.compute_tflops * 1e12 if settings.compute_tflops else None
    read = e.read_bytes(tokens)
    # mutation: mlp-flops-times-tokens-dropped
    flops = e.flops_per_token * tokens
    # The CPU's share of the picks (all of them unless some are resident on the device).
    # mutation: device-share-read-by-cpu
    on_host = 1.0 - e.share
    host = read * on_host / ranks / host_rate(settings)
    # mutation: cpu-rate-ignored
    cpu = max(host, flops * on_host / ranks / cpu_flop_s) + settings.handoff_s
    # Copied, the host's picks move COPIED_PATH_TRAFFIC times their bytes; the share, its own.
    share = device_share_traffic(e, max(1, round(tokens)))[0] if e.share > 0.0 else 0.0
    # mutation: copied-path-read-once
    moved = read * on_host * e.copied_traffic + share
    # mutation: crossover-cpu-rate-both-sides
    gpu = read * on_host / link + max(moved / vram, flops / gpu_flop_s if gpu_flop_s else 0.0) + settings.handoff_s
    return cpu, gpu, host


def share_native(fmt: str | None, experts: bool) -> bool:
    """Whether a host-compute group's device share is held as stored and read by the share
    kernel: routed experts (not a dense MLP's channels) of a :data:`NATIVE_SHARE_FORMATS` format."""
    return experts and fmt in NATIVE_SHARE_FORMATS


def share_held_bytes(dtype_bytes: Mapping[str, int], native: bool = False) -> int:
    """Bytes a group takes held as a device share: its stored bytes when ``native``
    (:func:`share_native`), else its parameters (counted from stored bytes by dtype as
    :func:`flops_per_token` counts them, scales included: est), each at least
    :data:`SHARE_MIN_BITS` wide."""
    from .tensors import DTYPE_BITS

    # mutation: native-share-held-wide
    if native:
        return int(sum(dtype_bytes.values()))

    bits = {dtype: PARAM_BITS.get(dtype, DTYPE_BITS.get(dtype, 16)) for dtype in dtype_bytes}
    return int(sum(nbytes * max(bits[dtype], SHARE_MIN_BITS) / bits[dtype] for dtype, nbytes in dtype_bytes.items()))


def share_gathers(tokens: int, experts_per_token: int, share_experts: float) -> bool:
    """Whether the device share's path gathers each pick slot's expert (``True``) or reads
    every expert of the share once (``False``) for a step of ``tokens`` tokens: it gathers
    up to :data:`SHARE_GATHER_TOKENS` tokens (the gathered experts are a step's transient
    device memory) when the gathers move fewer bytes than reading the share once."""
    # mutation: share-gathers-when-dearer
    return tokens <= SHARE_GATHER_TOKENS and SHARE_GATHER_TRAFFIC * tokens * experts_per_token < share_experts


def device_share_traffic(e: "ExpertsRead", tokens: int) -> tuple[float, float]:
    """Bytes of VRAM traffic and FLOPs of the GPU's part of a host-compute group with a device
    share, in a step of ``tokens`` tokens (est): what ``cpu_kernels.reference.moe_picked``
    moves on the held share. Gathering, each of the step's ``tokens x k`` pick slots copies
    its expert and reads the copy (:data:`SHARE_GATHER_TRAFFIC` times its held bytes: slots
    whose pick lands on the host compute expert 0 with weight zero, as fixed shapes need);
    otherwise every expert of the share is read once and computed for every token. A dense
    MLP's share is one expert every token takes: read once. A share held as stored
    (:attr:`ExpertsRead.share_native`: ``wrappers.share_kernel``) reads each of its experts
    the step picks once (the share's experts times the chance a step picks one:
    :func:`expert_read_fraction`) and computes only the slots that picked them."""
    per_expert = (e.held_nbytes or e.nbytes) / e.num_experts
    share_experts = e.share * e.num_experts
    per_pick = e.flops_per_token / max(1, e.experts_per_token)  # one token's FLOPs in one expert
    if e.share_native and e.num_experts > 1:
        # mutation: native-share-read-whole
        picked = share_experts * expert_read_fraction(e.num_experts, e.experts_per_token, tokens)
        return picked * per_expert, tokens * e.experts_per_token * e.share * per_pick
    if e.num_experts > 1 and share_gathers(tokens, e.experts_per_token, share_experts):
        slots = tokens * e.experts_per_token
        # mutation: share-gather-priced-as-one-read
        return SHARE_GATHER_TRAFFIC * slots * per_expert, slots * per_pick
    return share_experts * per_expert, tokens * share_experts * per_pick


def device_share_time(e: "ExpertsRead", tokens: float, settings: StepSettings) -> tuple[float, float]:
    """The GPU's time on the device share of a host-compute group (est), and the bytes its
    path moves in VRAM (:func:`device_share_traffic`): those bytes at the decode read rate,
    at least its FLOPs at the GPU's matmul rate when given. It runs while the CPU computes
    the rest (the two are joined before the layer's output is used), so a layer costs the
    longer of the two, not both."""
    if e.share <= 0.0:
        return 0.0, 0.0
    vram = decode_read_rate(settings.vram_gbps, settings.decode_read_gbps) * 1e9
    gpu_flop_s = settings.compute_tflops * 1e12 if settings.compute_tflops else None
    traffic, flops = device_share_traffic(e, max(1, round(tokens)))
    return max(traffic / vram, flops / gpu_flop_s if gpu_flop_s else 0.0), traffic


def host_compute_times(experts: "tuple[ExpertsRead, ...] | list[ExpertsRead]", tokens: float,
                       settings: StepSettings) -> tuple[float, float]:
    """What a step of ``tokens`` tokens costs the host-compute experts (est), both ways: on
    the CPU (each rank reads its share of the distinct experts the step uses at its share of
    the host's kernel rate, and computes at least its share of their FLOPs at its share of
    the CPU's matmul rate), and copied over the link at the pinned copy rate and computed on
    the GPU (:data:`COPIED_PATH_TRAFFIC` times their bytes moved in VRAM, at least their FLOPs
    at the GPU's rate when given).
    Each layer adds one hand-off either way (the routing decision is on the host for both)."""
    cpu = gpu = 0.0
    for e in experts:
        c, g, _ = host_compute_time(e, tokens, settings)
        cpu, gpu = cpu + c, gpu + g
    return cpu, gpu


def host_compute_crossover(experts: "tuple[ExpertsRead, ...] | list[ExpertsRead]", settings: StepSettings) -> int:
    """The largest number of tokens per step at which computing the host-compute experts on
    the CPU is still cheaper than copying the distinct experts the step uses over the link
    and computing them on the GPU (:func:`host_compute_times`); 0 when the CPU loses even at
    one token. The first crossing is found by doubling then bisection: under uniform
    routing the copy's bytes level off as tokens grow while the CPU's FLOPs keep growing, so
    once the CPU loses it keeps losing. At most :data:`MAX_CROSSOVER_TOKENS`."""
    experts = [e for e in experts if e.where == EXPERTS_CPU]
    if not experts:
        return 0

    def cpu_wins(t: int) -> bool:
        cpu, gpu = host_compute_times(experts, t, settings)
        # mutation: crossover-ties-to-cpu
        return cpu < gpu

    loses = _fewest_tokens(lambda t: not cpu_wins(t))
    return MAX_CROSSOVER_TOKENS if loses is None else loses - 1


def crossover_sets(units: "tuple[ExpertsRead, ...] | list[ExpertsRead]") -> "list[list[ExpertsRead]]":
    """The host-compute units that share a crossover: every unit of the layer stack together
    (a step serves all of a plan's experts and MLPs one way), and each unit outside it alone
    (the split LM head: a step's logits, one matmul whose CPU part turns compute-bound at far
    fewer tokens than a layer's experts, so it leaves the CPU at its own crossover)."""
    inside = [e for e in units if e.layer >= 0]
    # mutation: head-crossover-shared
    return ([inside] if inside else []) + [[e] for e in units if e.layer < 0]


def _fewest_tokens(holds: Callable[[int], bool]) -> int | None:
    """The fewest tokens per step, up to :data:`MAX_CROSSOVER_TOKENS`, at which ``holds``
    (false, then true for good as tokens grow) is true, by doubling then bisection; ``None``
    when the doubling passes the bound first."""
    if holds(1):
        return 1
    good, bad = 1, 2  # holds(good) is false
    while bad <= MAX_CROSSOVER_TOKENS and not holds(bad):
        good, bad = bad, bad * 2
    if bad > MAX_CROSSOVER_TOKENS:
        return None
    while bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (good, mid) if holds(mid) else (mid, bad)
    return bad


def host_compute_bound_tokens(experts: "tuple[ExpertsRead, ...] | list[ExpertsRead]", settings: StepSettings) -> int | None:
    """The fewest tokens per step at which the host-compute groups' FLOPs at the CPU's matmul
    rate take at least as long as reading their bytes at the host kernel's rate (est): below
    it a step of more tokens (a batch, a verify step of K + 1) costs the CPU the same bytes,
    above it K + 1 times the FLOPs. Ranks divide both sides alike, so it does not depend on
    them. ``None``: no host-compute group, or not within :data:`MAX_CROSSOVER_TOKENS`."""
    experts = [e for e in experts if e.where == EXPERTS_CPU and e.flops_per_token > 0]
    if not experts:
        return None

    def bound(t: int) -> bool:
        read = sum(e.read_bytes(t) for e in experts) / (settings.cpu_gbps * 1e9)
        # mutation: compute-bound-flops-untimed
        return sum(e.flops_per_token * t for e in experts) / (settings.cpu_tflops * 1e12) >= read

    return _fewest_tokens(bound)


def step_cost(traffic: Traffic, settings: StepSettings, kv: KvModel | None, *, pipelined: bool) -> dict[str, float]:
    """The est_ figures of one step: link, VRAM and compute time, hidden link time, draft
    time, step time, tokens per step and tok/s (total and per sequence). ``pipelined``:
    the prefetch offloader's overlap (selective); otherwise every byte is paid in line (bulk).

    Each mechanism moves bytes at its own rate: the prefetch offloader's copies at the
    pinned copy rate (``link_gbps``), kernels reading host memory in place (bulk
    ``cpu_offload_gb``, the UVA embedding, experts read in place) at the UVA read rate, and
    VRAM at the rate decode kernels read it (:func:`decode_read_rate`). With
    a matmul rate, every layer (and the LM head, and each draft pass) costs at least its
    FLOPs at the step's tokens over that rate."""
    gb_link = settings.link_gbps * 1e9
    gb_vram = decode_read_rate(settings.vram_gbps, settings.decode_read_gbps) * 1e9
    gb_uva = (settings.uva_gbps if settings.uva_gbps is not None else settings.link_gbps * DEFAULT_UVA_READ_FACTOR) * 1e9
    flop_s = settings.compute_tflops * 1e12 if settings.compute_tflops else None
    n, k = max(1, settings.batch), max(0, settings.spec_tokens)
    tokens_per_pass = n * (k + 1)

    def compute_s(flops: float, tokens: float) -> float:
        return flops * tokens / flop_s if flop_s else 0.0

    kv_s = (n * kv.bytes_per_seq(settings.context_tokens) / gb_vram) if kv is not None and settings.context_tokens else 0.0
    rows_link_s = traffic.row_bytes_host * (tokens_per_pass + k * n) / gb_uva
    # Per layer: bytes read from VRAM, bytes copied over the link by the prefetch offloader,
    # and FLOPs per token.
    reads = [float(b) for b, _ in traffic.layers]
    copies = [float(b) if host else 0.0 for b, host in traffic.layers]
    flops = [float(f) for f in traffic.layer_flops] if len(traffic.layer_flops) == len(reads) else [0.0] * len(reads)
    uva_bytes = float(traffic.uva_bytes)
    on_cpu = [e for e in traffic.experts if e.where == EXPERTS_CPU]
    cpu_s = host_link_s = share_read_s = 0.0
    # Per layer, the CPU's time and its host reads' share of it (below the crossover).
    layer_cpu, layer_host = [0.0] * len(reads), [0.0] * len(reads)
    cpu_elsewhere_s = 0.0  # of groups outside the layer stack: paid in line
    for units in crossover_sets(on_cpu):
        # Below the crossover the CPU computes them, in line with the layer's GPU work (the
        # layer's output is the next layer's input); above it they are copied and computed
        # on the GPU (the copy is link time, in line).
        crossover = host_compute_crossover(units, settings)
        if tokens_per_pass <= crossover:
            for e in units:
                cpu, _, host = host_compute_time(e, tokens_per_pass, settings)
                share, moved = device_share_time(e, tokens_per_pass, settings)
                share_read_s += moved / gb_vram
                cpu_s += cpu
                # The device share runs beside the CPU: the layer waits for the longer.
                # mutation: device-share-not-overlapped
                both = max(cpu, share)
                if 0 <= e.layer < len(reads):
                    layer_cpu[e.layer] += both
                    layer_host[e.layer] += host
                else:
                    cpu_elsewhere_s += both
        else:
            host_link_s += host_compute_times(units, tokens_per_pass, settings)[1]
    for e in traffic.experts:
        if e.where == EXPERTS_CPU:
            continue
        # mutation: expert-tokens-ignored
        read = e.read_bytes(tokens_per_pass)
        flops[e.layer] += e.flops_per_token
        if e.where == EXPERTS_UVA:
            uva_bytes += read
        else:
            reads[e.layer] += read
            if e.where == EXPERTS_PREFETCHED:
                copies[e.layer] += e.nbytes
    # mutation: uva-at-copy-rate
    uva_s = uva_bytes / gb_uva
    copies_s = sum(copies) / gb_link
    layer_read_s = sum(reads) / gb_vram
    other_read_s = (traffic.other_device_bytes + traffic.row_bytes_device * tokens_per_pass) / gb_vram
    other_s = max(other_read_s, compute_s(traffic.other_flops, tokens_per_pass))
    draft_s = k * max(traffic.draft_bytes / gb_vram, compute_s(traffic.draft_flops, n))
    link_s = copies_s + rows_link_s + uva_s + host_link_s
    vram_s = layer_read_s + other_read_s + kv_s + share_read_s
    per_layer_kv = kv_s / len(traffic.layers) if traffic.layers else 0.0
    # A layer takes the longer of reading its weights (and its share of the KV) and its FLOPs.
    # mutation: compute-not-priced
    layer_s = [max(r / gb_vram + per_layer_kv, compute_s(f, tokens_per_pass)) for r, f in zip(reads, flops)]
    compute = (sum(compute_s(f, tokens_per_pass) for f in flops) + compute_s(traffic.other_flops, tokens_per_pass)
               + k * compute_s(traffic.draft_flops, n))
    if pipelined:
        # A layer's CPU time is part of the layer, so the next offloaded layer's copy runs
        # behind it too, reading host memory beside the CPU kernel (pipelined_step_s).
        rate = host_rate(settings)
        # mutation: copies-not-hidden-by-cpu
        costs = [LayerCost(t + cpu, c / gb_link, host, c / rate)
                 for t, c, cpu, host in zip(layer_s, copies, layer_cpu, layer_host)]
        core, hidden = pipelined_step_s(costs, other_s + (0.0 if traffic.layers else kv_s))
        # UVA reads are paid in line: they share the link with the prefetch copies, so
        # they hide no copy and no copy hides them.
        # mutation: uva-hidden-by-prefetch
        step = core + rows_link_s + uva_s + draft_s + cpu_elsewhere_s + host_link_s
    else:
        hidden = 0.0
        device_s = sum(layer_s) + other_s + (0.0 if traffic.layers else kv_s)
        step = inline_step_s(device_s, link_s) + draft_s + cpu_s
    # mutation: batch-not-shared
    tokens = n * expected_tokens_per_step(k, settings.accept_rate)
    tok_s = tokens / step if step > 0 else float("inf")
    return {"est_link_s_per_step": link_s, "est_vram_s_per_step": vram_s, "est_step_s": step, "est_tok_s": tok_s,
            "est_tokens_per_step": tokens, "est_tok_s_per_seq": tok_s / n, "est_hidden_link_s_per_step": hidden,
            "est_draft_s_per_step": draft_s, "est_compute_s_per_step": compute, "est_cpu_s_per_step": cpu_s}
