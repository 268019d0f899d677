"""What a plan is made for: the card, the run and the rates, as :class:`PlanInputs`.

The planner places groups against these inputs, the step model prices a placement with
them, and every plan carries them, so a plan read elsewhere is judged against what it was
made for. :meth:`PlanInputs.validate` is the inputs' own contract (sizes, rates and counts
in range), checked whether the inputs came from the command line, from Python or from a
plan file (:mod:`.io` reads them; :mod:`.checks` validates them first when it checks a plan).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from .. import jsonio
from ..errors import PlanError, cut
from ..estimate.traffic import (
    ASSUMED_CPU_TFLOPS,
    ASSUMED_HANDOFF_S,
    DEFAULT_UVA_READ_FACTOR,
    REFERENCE_CPU_GBPS,
    decode_read_rate,
)
from ..kv_model import KV_DTYPE_BYTES
from ..names import DEFAULT_COLD_SEGMENTS
from ..sizes import MAX_GBPS, MAX_TFLOPS, MIN_GBPS, GiB
from .vocabulary import (
    ASSUMED_BATCHED_TOKENS,
    DEFAULT_KV_CACHE_BYTES,
    DEFAULT_RESERVE_BYTES,
    HOST_HEADROOM_BYTES,
    MAX_PLAN_INT,
    MAX_PLAN_NUMBER,
    REFERENCE_LINK_GBPS,
    REFERENCE_VRAM_GBPS,
)

#: The card a plan assumes when none is given: the reference laptop's class (an RTX 4090
#: Laptop GPU, Ada, compute capability 8.9).
DEFAULT_CARD = "8.9"


#: The settings of the vLLM server that change which fused-MoE kernel it builds, as a plan
#: names them: vLLM's default, DeepGEMM turned off, and the two backends the project's
#: UVA path accepts (``selective_offload.planner.kernels`` has what each builds per card).
MOE_SETTINGS = ("auto", "VLLM_USE_DEEP_GEMM=0", "--moe-backend triton", "--moe-backend marlin")


#: Where a plan's host kernel rate (and its CPU matmul rate, and its hand-off) came from:
#: the probe's profile of this machine, a flag, or the stated assumption (the reference
#: host's 55 GB/s; :data:`~selective_offload.estimate.traffic.REFERENCE_CPU_GBPS`).
CPU_SOURCES = ("measured", "flag", "assumed")
#: Bounds on the host-compute inputs: threads of one host, ranks sharing it, a hand-off.
MAX_CPU_THREADS = 4096
MAX_RANKS = 1024
MAX_HANDOFF_S = 1.0
#: Bounds on the workload: far above any server's, low enough that arithmetic on them stays exact.
MAX_BATCH = 1 << 16
MAX_TOKENS = 1 << 26
#: Bounds on the cold segment list: each is one module name segment, like ``visual``.
MAX_COLD_SEGMENTS = 64
MAX_SEGMENT_CHARS = 100


class InputError(PlanError):
    """A :class:`PlanInputs` field out of range; ``field`` names it, so a caller that took the
    value under another name (a command-line flag, a keyword) can say which of its own it was."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def moe_setting(backend: str = "auto", deep_gemm: bool = True) -> str:
    """The :data:`MOE_SETTINGS` entry for vLLM's ``moe_backend`` and ``VLLM_USE_DEEP_GEMM``:
    a chosen backend decides the kernel whatever DeepGEMM's switch says."""
    backend = str(backend or "auto").lower().replace("-", "_")
    if backend != "auto":
        return f"--moe-backend {backend}"
    return "auto" if deep_gemm else "VLLM_USE_DEEP_GEMM=0"


def parse_card(text: object) -> str:
    """A compute capability as ``torch.cuda.get_device_capability`` spells it (major.minor,
    like ``"8.9"``), checked; raises ``ValueError`` with one line otherwise."""
    parts = str(text).strip().split(".")
    if len(parts) != 2 or not all(p.isascii() and p.isdigit() and len(p) <= 2 for p in parts):
        raise ValueError(f"compute capability {cut(repr(text), 83)} must be major.minor as "
                         "torch.cuda.get_device_capability "
                         f"gives it, like 8.9 (an RTX 4090 Laptop GPU) or 12.0")
    return f"{int(parts[0])}.{int(parts[1])}"


@dataclass(frozen=True)
class PlanInputs:
    """What the plan is made for. Bytes are bytes; bandwidths are decimal GB/s."""

    device_memory_bytes: int
    kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES
    #: Activations, CUDA graphs and allocator slack (the CUDA context is in ``card_bytes``).
    reserve_bytes: int = DEFAULT_RESERVE_BYTES
    link_gbps: float = REFERENCE_LINK_GBPS
    vram_gbps: float = REFERENCE_VRAM_GBPS
    #: ``None``, or ``"mtp"`` for MTP speculative decoding (loads the ``mtp.*`` head).
    speculative: str | None = None
    cold_segments: tuple[str, ...] = DEFAULT_COLD_SEGMENTS
    #: Device slots the prefetch offloader keeps per offloaded parameter.
    prefetch_step: int = 1
    #: vLLM's ``cpu_offload_gb`` (GiB) to price the cpu_offload_gb baseline at; ``None`` picks the
    #: smallest whole number that covers the deficit.
    vllm_cpu_offload_gb: float | None = None
    #: Put every cold module on the host even when fewer would close the deficit: cold
    #: bytes cost (almost) no link time, and what they free goes to the KV cache.
    all_cold: bool = False
    #: Host memory (RAM) the host bytes must fit in; ``None``: not checked.
    host_memory_bytes: int | None = None
    #: Of ``host_memory_bytes``, what the operating system and vLLM's processes keep
    #: (:data:`~selective_offload.plan_format.vocabulary.HOST_HEADROOM_BYTES`, est; 0 in
    #: plans made before this field).
    host_headroom_bytes: int = HOST_HEADROOM_BYTES
    #: Concurrent decode sequences a step serves (they share one pass over the weights).
    batch: int = 1
    #: Draft tokens per step with speculative decoding; ``None``: the MTP head's layer count.
    spec_tokens: int | None = None
    #: Per-token acceptance rate of the drafts; ``None``: the published rate of the model's
    #: family (``estimate.acceptance_default``), which planning fills in.
    accept_rate: float | None = None
    #: With both, the KV cache is sized from the model (replacing ``kv_cache_bytes``).
    max_model_len: int | None = None
    max_seqs: int | None = None
    kv_cache_dtype: str = "auto"
    #: Average context of a sequence during decode, for KV reads per step; ``None``: half
    #: of ``max_model_len`` when given, else KV reads are not priced.
    context_tokens: int | None = None
    #: Kernels reading host memory in place through UVA (vLLM's ``cpu_offload_gb``, the UVA
    #: embedding, experts read in place), GB/s; ``None``: ``link_gbps`` x
    #: ``estimate.traffic.DEFAULT_UVA_READ_FACTOR`` (see :attr:`uva_read_gbps`).
    uva_gbps: float | None = None
    #: The card's dense matmul rate for the weights' format (TFLOP/s), so a layer costs at
    #: least its FLOPs; ``None``: compute is not priced (the plan says so).
    compute_tflops: float | None = None
    #: The rate decode kernels read VRAM at, measured the way decode reads (the probe's
    #: matrix-vector product, ``--decode-read-gbps``), GB/s; ``None``: ``vram_gbps`` (a
    #: datasheet or saturating-read figure) x ``estimate.traffic.DEFAULT_DECODE_READ_FACTOR``.
    decode_read_gbps: float | None = None
    #: The card's compute capability, as ``torch.cuda.get_device_capability`` spells it
    #: ("8.9"): which fused-MoE kernel vLLM picks for the routed experts depends on it
    #: (:mod:`selective_offload.planner.kernels`); ``None``: the plan assumes
    #: ``kernels.DEFAULT_CARD`` and says so.
    compute_capability: str | None = None
    #: The vLLM setting the server runs with that changes the fused-MoE kernel
    #: (:data:`MOE_SETTINGS`): the plan is made for the kernel that setting builds.
    moe_setting: str = "auto"
    #: Host-compute (routed experts computed by the host CPU): the host kernel's rate, GB/s of
    #: expert weights read at batch 1 (``--cpu-gbps``, the probe's per-format rate); ``None``:
    #: the reference host's, :data:`~selective_offload.estimate.traffic.REFERENCE_CPU_GBPS`, assumed.
    cpu_gbps: float | None = None
    #: Where ``cpu_gbps`` came from (:data:`CPU_SOURCES`); ``assumed`` exactly when it is ``None``.
    cpu_gbps_source: str = "assumed"
    #: The host's read rate the probe measured beside ``cpu_gbps`` (GB/s; only with
    #: ``cpu_gbps_source`` ``measured``): the kernel is claimed fast on this host when
    #: ``cpu_gbps`` is at least ``cpu_kernels.claimed.CLAIM_BAR`` of it
    #: (``cpu_kernels.claimed.verdict``); ``None``: the committed benchmark's verdict.
    cpu_read_gbps: float | None = None
    #: Threads of the one CPU pool (physical cores of one NUMA node) the host kernel runs
    #: with; ``None``: all physical cores of one NUMA node, as the runtime finds them.
    cpu_threads: int | None = None
    #: The CPU's matmul rate (TFLOP/s) for the crossover; ``None``: assumed
    #: (:data:`~selective_offload.estimate.traffic.ASSUMED_CPU_TFLOPS`).
    cpu_tflops: float | None = None
    #: The per-layer hand-off (seconds); ``None``: assumed
    #: (:data:`~selective_offload.estimate.traffic.ASSUMED_HANDOFF_S`); the probe measures it.
    handoff_s: float | None = None
    #: Ranks sharing this host (tensor or expert parallel): each computes its own share of
    #: the host experts with its share of the threads and of the host's memory bandwidth.
    ranks: int = 1
    #: Whether the planner may serve routed experts compute (False: ``--no-host-compute``, for
    #: a runtime without the CPU kernels; host experts are then read through UVA).
    host_compute: bool = True
    #: Whether the planner may keep a device share of the host-compute layers (False:
    #: ``--no-device-share``; every layer's experts or MLP are then on the host or the device).
    device_share: bool = True
    #: Whether the planner may split the LM head between the device and the host CPU beside a
    #: device share (False: ``--no-head-share``; the head stays whole on the device).
    head_share: bool = True
    #: The device memory the plan fits in: what a card of ``device_memory_bytes``'s class
    #: keeps free after the CUDA context, or the probe's measurement
    #: (:func:`selective_offload.planner.cards.card_memory`, the one rule); ``None``:
    #: ``device_memory_bytes`` as it is (plans made before this field).
    usable_device_bytes: int | None = None
    #: Where ``usable_device_bytes`` came from, in words (the plan's view shows it).
    usable_from: str | None = None
    #: vLLM's ``max_num_batched_tokens``, the largest step it runs, for which its fused-MoE
    #: workspace is priced; ``None``: :data:`ASSUMED_BATCHED_TOKENS` (est).
    max_num_batched_tokens: int | None = None

    @property
    def batched_tokens(self) -> int:
        """The step the fused-MoE workspace is priced for (:attr:`max_num_batched_tokens`)."""
        return self.max_num_batched_tokens or ASSUMED_BATCHED_TOKENS

    @property
    def host_available_bytes(self) -> int | None:
        """Host memory the plan's host bytes may take: the RAM less the headroom (``None``:
        not checked)."""
        if self.host_memory_bytes is None:
            return None
        return max(0, self.host_memory_bytes - self.host_headroom_bytes)

    @property
    def card_bytes(self) -> int:
        """The device memory the weights, KV cache and reserve must fit in."""
        return self.device_memory_bytes if self.usable_device_bytes is None else self.usable_device_bytes

    @property
    def host_cpu_gbps(self) -> float:
        """The host kernel rate the step model uses: given (measured or a flag), else assumed."""
        return self.cpu_gbps if self.cpu_gbps is not None else REFERENCE_CPU_GBPS

    @property
    def host_cpu_tflops(self) -> float:
        return self.cpu_tflops if self.cpu_tflops is not None else ASSUMED_CPU_TFLOPS

    @property
    def host_handoff_s(self) -> float:
        return self.handoff_s if self.handoff_s is not None else ASSUMED_HANDOFF_S

    @property
    def threads_per_rank(self) -> int | None:
        """Threads each rank's host kernel runs with: the pool split between the ranks
        (``None``: all physical cores of one NUMA node, split so by the runtime)."""
        return None if self.cpu_threads is None else max(1, self.cpu_threads // self.ranks)

    @property
    def weight_budget_bytes(self) -> int:
        return self.card_bytes - self.kv_cache_bytes - self.reserve_bytes

    @property
    def card(self) -> str:
        """The compute capability the plan is made for: given, else :data:`DEFAULT_CARD`."""
        return self.compute_capability or DEFAULT_CARD

    @property
    def uva_read_gbps(self) -> float:
        """The UVA read rate the step model uses: given, else a published fraction of the link."""
        return self.uva_gbps if self.uva_gbps is not None else self.link_gbps * DEFAULT_UVA_READ_FACTOR

    @property
    def vram_read_gbps(self) -> float:
        """The VRAM rate the step model uses: decode reads measured, else a fraction of ``vram_gbps``."""
        return decode_read_rate(self.vram_gbps, self.decode_read_gbps)

    @property
    def context(self) -> int:
        """Tokens of context each sequence's KV read covers in a step (0: not priced)."""
        if self.context_tokens is not None:
            return self.context_tokens
        return self.max_model_len // 2 if self.max_model_len else 0

    def validate(self) -> None:
        self._check_types()
        if self.device_memory_bytes <= 0:
            raise PlanError("device memory must be more than 0 bytes; give it like --device-memory 24GiB")
        usable = self.usable_device_bytes
        if usable is not None and not 0 < usable <= self.device_memory_bytes:
            raise PlanError(f"usable device memory {usable} must be more than 0 bytes and at most the "
                            f"{self.device_memory_bytes} of the card; make the plan again")
        for label, value in (("link", self.link_gbps), ("VRAM", self.vram_gbps), ("UVA read", self.uva_gbps),
                             ("decode read", self.decode_read_gbps)):
            if value is None and label in ("UVA read", "decode read"):
                continue  # derived from the link / VRAM rate by their default factors
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not MIN_GBPS <= value <= MAX_GBPS:
                raise PlanError(f"{label} bandwidth {cut(repr(value), 83)} GB/s must be a number from {MIN_GBPS:g} to "
                                f"{MAX_GBPS:g} GB/s, like 13.9")
        tflops = self.compute_tflops
        if tflops is not None and (isinstance(tflops, bool) or not isinstance(tflops, (int, float))
                                   or not 0 < tflops <= MAX_TFLOPS):
            raise PlanError(f"compute rate {cut(repr(tflops), 83)} TFLOP/s must be a positive number of at most "
                            f"{MAX_TFLOPS:g}")
        self._check_host_compute()
        if self.kv_cache_bytes < 0 or self.reserve_bytes < 0:
            raise PlanError("KV cache and reserve sizes must be zero or more bytes")
        if self.weight_budget_bytes <= 0:
            raise PlanError(
                f"KV cache ({self.kv_cache_bytes / GiB:.2f} GiB) and reserve ({self.reserve_bytes / GiB:.2f} GiB) "
                f"leave nothing of {self.card_bytes / GiB:.2f} GiB of device memory for weights"
                + (f" ({self.usable_from})" if self.usable_from else "") + "; "
                "lower --kv-cache or --reserve, or give the card's real memory"
            )
        if self.speculative not in (None, "mtp"):
            raise PlanError(f"speculative decoding {cut(repr(self.speculative), 83)} is not planned for; "
                            "use 'mtp' or none")
        if self.prefetch_step < 1:
            raise InputError("prefetch_step", f"prefetch step {self.prefetch_step} must be 1 or more")
        if self.vllm_cpu_offload_gb is not None and not (
            self.vllm_cpu_offload_gb >= 0 and math.isfinite(self.vllm_cpu_offload_gb)
        ):
            raise PlanError(f"vllm_cpu_offload_gb {cut(repr(self.vllm_cpu_offload_gb), 83)} must be 0 or more")
        if not self.cold_segments:
            raise PlanError("the cold segment list is empty; give at least one segment, or plan without offload")
        if not 1 <= self.batch <= MAX_BATCH:
            raise InputError("batch", f"batch {self.batch} must be from 1 to {MAX_BATCH} concurrent sequences")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise InputError("max_num_batched_tokens",
                             f"max_num_batched_tokens {self.max_num_batched_tokens} must be 1 or more, like 8192")
        if self.spec_tokens is not None and not 1 <= self.spec_tokens <= 16:
            raise InputError("spec_tokens",
                             f"speculative draft tokens {self.spec_tokens} must be between 1 and 16, like mtp:2")
        if self.accept_rate is not None and not 0.0 <= self.accept_rate <= 1.0:
            raise InputError("accept_rate",
                             f"acceptance rate {cut(repr(self.accept_rate), 83)} must be between 0 and 1, like 0.85")
        for name, label, value, least, most in (
                ("max_model_len", "max model length", self.max_model_len, 1, MAX_TOKENS),
                ("max_seqs", "max sequences", self.max_seqs, 1, MAX_BATCH),
                ("context_tokens", "context tokens", self.context_tokens, 0, MAX_TOKENS)):
            if value is not None and not least <= value <= most:
                raise InputError(name, f"{label} {value} must be a whole number from {least} to {most}")
        if self.context_tokens is not None and self.max_model_len is not None and self.context_tokens > self.max_model_len:
            raise InputError("context_tokens", f"context tokens {self.context_tokens} is beyond max_model_len "
                             f"{self.max_model_len}: no sequence holds more tokens than that")
        if self.max_seqs is not None and self.batch > self.max_seqs:
            raise InputError("batch", f"batch {self.batch} is above max_seqs {self.max_seqs}: the server decodes at most "
                             "that many sequences together")
        if self.kv_cache_dtype not in KV_DTYPE_BYTES:
            raise PlanError(f"KV cache dtype {cut(repr(self.kv_cache_dtype), 83)}: use one of "
                            f"{', '.join(KV_DTYPE_BYTES)}")
        if self.host_headroom_bytes < 0:
            raise PlanError(f"host headroom {self.host_headroom_bytes} must be zero or more bytes")
        if self.host_memory_bytes is not None and self.host_memory_bytes <= 0:
            raise PlanError(f"host memory {self.host_memory_bytes} must be more than 0 bytes, like --host-memory 64GiB")
        if self.compute_capability is not None:
            try:
                card = parse_card(self.compute_capability)
            except ValueError as exc:
                raise PlanError(str(exc)) from None
            if card != self.compute_capability:
                raise PlanError(f"compute capability {cut(repr(self.compute_capability), 83)} must be spelled "
                                f"{cut(repr(card), 83)}")
        if self.moe_setting not in MOE_SETTINGS:
            raise PlanError(f"MoE setting {cut(repr(self.moe_setting), 83)}: use one of "
                            f"{', '.join(map(repr, MOE_SETTINGS))} "
                            "(--moe-backend triton|marlin, --no-deep-gemm)")
        if len(self.cold_segments) > MAX_COLD_SEGMENTS:
            raise InputError("cold_segments", f"{len(self.cold_segments)} cold segments are more than "
                             f"{MAX_COLD_SEGMENTS}; name the few a decode step does not read, like visual")
        bad = [s for s in self.cold_segments if not s or "." in s or len(s) > MAX_SEGMENT_CHARS]
        if bad:
            raise InputError("cold_segments", f"cold segment {cut(repr(bad[0]), 83)} must be one name segment without "
                             f"dots, of at most {MAX_SEGMENT_CHARS} characters, like visual")

    def _check_host_compute(self) -> None:
        """The host-compute inputs in range, and the rate's source agreeing with whether one is given."""
        rate = self.cpu_gbps
        if rate is not None and (isinstance(rate, bool) or not isinstance(rate, (int, float))
                                 or not MIN_GBPS <= rate <= MAX_GBPS):
            raise PlanError(f"host kernel rate {cut(repr(rate), 83)} GB/s must be a number from {MIN_GBPS:g} to "
                            f"{MAX_GBPS:g} GB/s, like --cpu-gbps 55")
        if self.cpu_gbps_source not in CPU_SOURCES:
            raise PlanError(f"cpu_gbps_source {cut(repr(self.cpu_gbps_source), 83)}: use one of "
                            f"{', '.join(CPU_SOURCES)}")
        if (rate is None) != (self.cpu_gbps_source == "assumed"):
            raise PlanError(f"cpu_gbps_source {cut(repr(self.cpu_gbps_source), 83)} does not fit cpu_gbps "
                            f"{cut(repr(rate), 83)}: "
                            "'assumed' exactly when no rate is given (measured or flag otherwise)")
        read = self.cpu_read_gbps
        if read is not None and (isinstance(read, bool) or not isinstance(read, (int, float))
                                 or not MIN_GBPS <= read <= MAX_GBPS):
            raise PlanError(f"host read rate {cut(repr(read), 83)} GB/s must be a number from {MIN_GBPS:g} to "
                            f"{MAX_GBPS:g} GB/s")
        if read is not None and self.cpu_gbps_source != "measured":
            raise PlanError(f"cpu_read_gbps {read:g} comes with a kernel rate the probe measured (cpu_gbps_source "
                            f"'measured'), not {cut(repr(self.cpu_gbps_source), 40)}; delete it, or probe again")
        tflops = self.cpu_tflops
        if tflops is not None and (isinstance(tflops, bool) or not isinstance(tflops, (int, float))
                                   or not 0 < tflops <= MAX_TFLOPS):
            raise PlanError(f"CPU matmul rate {cut(repr(tflops), 83)} TFLOP/s must be a positive number of at most "
                            f"{MAX_TFLOPS:g}, like --cpu-tflops 0.5")
        threads = self.cpu_threads
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int)
                                    or not 1 <= threads <= MAX_CPU_THREADS):
            raise PlanError(f"CPU threads {cut(repr(threads), 83)} must be a whole number from 1 to {MAX_CPU_THREADS}, "
                            "like --cpu-threads 8")
        handoff = self.handoff_s
        if handoff is not None and (isinstance(handoff, bool) or not isinstance(handoff, (int, float))
                                    or not 0 <= handoff <= MAX_HANDOFF_S):
            raise PlanError(f"hand-off {cut(repr(handoff), 83)} s must be a number from 0 to {MAX_HANDOFF_S:g} seconds")
        ranks = self.ranks
        if isinstance(ranks, bool) or not isinstance(ranks, int) or not 1 <= ranks <= MAX_RANKS:
            raise PlanError(f"ranks {cut(repr(ranks), 83)} must be a whole number from 1 to {MAX_RANKS}, "
                            "like --ranks 2")
        if threads is not None and threads < ranks:
            raise PlanError(f"{threads} CPU threads cannot be split between {ranks} ranks; give at least one "
                            "thread per rank")

    def _check_types(self) -> None:
        """Every integer field an integer in range, every number finite: a Plan built in
        Python gets the checks a plan file gets from its reader."""
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None or f.name in ("link_gbps", "vram_gbps"):
                continue
            if f.type in ("int", "int | None"):
                if isinstance(value, bool) or not isinstance(value, int) or abs(value) > MAX_PLAN_INT:
                    raise PlanError(f"{f.name} {cut(repr(value), 83)} must be an integer of at most {MAX_PLAN_INT}")
            elif f.type in ("float", "float | None"):
                if (isinstance(value, bool) or not isinstance(value, (int, float))
                        or not jsonio.finite_number(value, MAX_PLAN_NUMBER)):
                    raise PlanError(f"{f.name} {cut(repr(value), 83)} must be a finite number")
            elif f.type == "bool" and not isinstance(value, bool):
                raise PlanError(f"{f.name} {cut(repr(value), 83)} must be True or False")
            elif f.type == "str" and not isinstance(value, str):
                raise PlanError(f"{f.name} {cut(repr(value), 83)} must be a string")
        if not isinstance(self.cold_segments, (tuple, list)) or not all(isinstance(s, str) for s in self.cold_segments):
            raise PlanError(f"cold_segments {cut(repr(self.cold_segments), 83)} must be a list of name segments")
