"""What a decode step moves and the rates it is read at (est): the step model's inputs
(:class:`Traffic`, :class:`ExpertsRead`, :class:`StepSettings`), the default rate factors,
and the two rules every price shares (:func:`decode_read_rate`, :func:`expert_read_fraction`).
The model itself is :mod:`.step`; the host CPU's part, :mod:`.host`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from ..acceptance import DEFAULT_ACCEPT_RATE

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
DEFAULT_UVA_READ_FACTOR = 0.86

#: Decode kernels read VRAM at this fraction of a box's datasheet (peak) or saturating-read
#: rate, when no rate measured the way decode reads is given (``--decode-read-gbps``, the
#: probe's ``decode_read_gbps``). CALIBRATED on one published point: vLLM 0.15.1 decoding
#: nvidia/Llama-3.3-70B-Instruct-NVFP4 resident on a DGX Spark at 4.0-4.2 tok/s
#: (NVIDIA/dgx-spark-playbooks issue #79) against the 232 GB/s a saturating-read kernel
#: measures there (antirez/ds4 issue #773) gives 0.70-0.735; the middle, rounded. VALIDATED
#: (benchmarks/planning/published.json, est/measured in benchmarks/results/published.md) on
#: gpt-oss-120b on the same box and image (resident MoE), and on two other boxes and vLLM
#: releases against their datasheet rates: Llama-3.1-8B bf16 at batch 1 on an A100 40GB
#: (vLLM 0.23.0, about 75 tok/s, "roughly 77% of the memory-bandwidth ceiling") and on an
#: H100 80GB HBM3 (vLLM 0.21.0, 6.48 ms median time per output token). Published decode
#: runs sit between 0.60 and 0.78 of a datasheet rate, so this is a default, not a law:
#: the probe measures the box's own.
DEFAULT_DECODE_READ_FACTOR = 0.72


def decode_read_rate(vram_gbps: float, decode_read_gbps: float | None = None) -> float:
    """GB/s at which a decode step reads VRAM: ``decode_read_gbps`` when measured the way
    decode reads (or given), else ``vram_gbps`` (a datasheet or saturating-read figure) x
    :data:`DEFAULT_DECODE_READ_FACTOR`."""
    return decode_read_gbps if decode_read_gbps is not None else vram_gbps * DEFAULT_DECODE_READ_FACTOR


def expert_read_fraction(num_experts: int, experts_per_token: int, tokens: int | float, *,
                         routing: "tuple[float, ...] | None" = None) -> float:
    """The share of a MoE layer's routed-expert bytes that a step of ``tokens`` tokens reads
    (est): the expected share of experts at least one token is routed to.

    Uniform routing (the default) gives each expert the chance ``k/E`` per token, so the
    share is ``1 - (1 - k/E)**T``: ``k/E`` at one token, approaching 1 as tokens grow.
    ``routing`` is room for a measured profile (each expert's share of the routing choices,
    summing to ``k``): ``mean(1 - (1 - p_i)**T)``; nothing measures one yet. Every MoE price
    (the planner, the cpu_offload_gb and cpu_offload_params baselines, the benchmarks) goes through here.
    """
    if num_experts <= 0 or experts_per_token <= 0:
        return 1.0
    t = max(float(tokens), 0.0)
    if routing is not None:
        return sum(1.0 - (1.0 - min(max(p, 0.0), 1.0)) ** t for p in routing) / len(routing) if routing else 1.0
    p = min(experts_per_token / num_experts, 1.0)
    return 1.0 - (1.0 - p) ** t


#: The host kernel rate a plan assumes when neither a probe nor ``--cpu-gbps`` gives one
#: (GB/s of expert weights read by the CPU kernel at batch 1): the reference host's, a
#: 2-channel DDR5 machine (the issue's stated assumption, not a measurement). A plan that
#: uses it labels it ``assumed``.
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
    #: vLLM's cpu_offload_gb: bytes the kernels read through UVA, in line, every pass.
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
    #: Host-compute only: the share of the layer's picks that land on its device share, as a
    #: routing profile measured it (est); ``None``: :attr:`device_share` (uniform routing).
    hit_rate: float | None = None

    def read_bytes(self, tokens: float) -> float:
        return self.nbytes * expert_read_fraction(self.num_experts, self.experts_per_token, tokens)

    @property
    def share(self) -> float:
        """:attr:`device_share`, held to [0, 1]."""
        return min(max(self.device_share, 0.0), 1.0)

    @property
    def hit(self) -> float:
        """The share of the picks the device share computes: :attr:`hit_rate` where measured,
        else :attr:`share` (uniform routing), held to [0, 1]."""
        return self.share if self.hit_rate is None else min(max(self.hit_rate, 0.0), 1.0)


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
PARAM_BITS = {"U8": 4, "I32": 4, "U32": 4, "F4": 4}


def flops_per_token(dtype_bytes: Mapping[str, int]) -> float:
    """2 FLOPs (a multiply and an add) per parameter, parameters counted from stored bytes
    by dtype (:data:`PARAM_BITS` for packed containers, else the dtype's width; est)."""
    from ..tensors import DTYPE_BITS

    params = sum(nbytes * 8 / PARAM_BITS.get(dtype, DTYPE_BITS.get(dtype, 16)) for dtype, nbytes in dtype_bytes.items())
    return 2.0 * params
