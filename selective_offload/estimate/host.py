"""The host CPU's part of a step (est): what a host-compute group (routed experts, a dense
MLP, a split LM head's rows) costs on the CPU and copied to the GPU, its device share, and
the crossover between the two (see the package's docstring for the model)."""

from __future__ import annotations

from typing import Callable, Mapping

from .traffic import (
    EXPERTS_CPU,
    PARAM_BITS,
    ExpertsRead,
    StepSettings,
    decode_read_rate,
    expert_read_fraction,
    flops_per_token,
)

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


def copied_bytes(nbytes: int, rows_on_device: int, rows: int) -> int:
    """A split LM head's bytes a step above its crossover copies: its host rows alone."""
    return nbytes * (rows - rows_on_device) // rows


def dequantizing_bytes(w13: int, w2: int) -> int:
    """Device bytes the copied path holds while it dequantizes one expert whose w13 and w2
    take ``w13`` and ``w2`` bytes in bf16 (``cpu_kernels.reference._one_expert``): each
    matrix is made from a working copy of its own size (its 4-bit codes looked up as bf16
    from an int32 widening of the packed bytes, or an FP8 weight widened to bf16), w13
    first and held while w2 is made; scales and zero points are a group's few bytes."""
    return max(2 * w13, w13 + 2 * w2)


def dequantized_expert_bytes(dims: tuple[int, ...], dtype_bytes: Mapping[str, int], num_experts: int) -> int:
    """:func:`dequantizing_bytes` of one expert of a quantized host-compute group: from the
    kernel's dims ``(H, I)`` (``GroupPlan.kernel_dims``: w13 is [2I, H] and w2 [H, I], as the
    kernel reads them, routed experts at the sizes vLLM pads them to), or, where the config
    does not say them, from the group's stored bytes (its parameters counted as
    :func:`flops_per_token` counts them, est: two thirds in w13, one in w2)."""
    if len(dims) == 2:
        hidden, inner = dims
        return dequantizing_bytes(2 * 2 * inner * hidden, 2 * hidden * inner)
    bf16 = flops_per_token(dtype_bytes) / max(1, num_experts)  # 2 bytes a parameter
    return int(dequantizing_bytes(int(bf16 * 2 / 3), int(bf16 / 3)))


def copied_activation_bytes(tokens: int, dims: tuple[int, ...], experts_per_token: int = 1,
                            num_experts: int = 1) -> int:
    """Device bytes the copied path's activations hold in a step of ``tokens`` tokens (est),
    for experts of the kernel's dims ``(H, I)``: the float32 sums [T, H] beside one expert's
    working set (``cpu_kernels.reference._expert_sums``) for the n tokens that pick it
    (uniform routing, as the step model assumes: n = T k / E, at most T; a dense MLP's every
    token): its gate/up product [n, 2I] in float32 and the activation's float32 temporaries
    (16 n I bytes), or that product with the down product and its weighted copy [n, H] in
    float32 (8 n I + 8 n H); with two or more picks a token, the next expert's products made
    while the last one's are still bound (20 n I + 6 n H). Held to torch's profiler on the
    path in tests/unit/cpu_kernels/test_copied_transient.py; 0 without the dims."""
    if len(dims) != 2 or tokens <= 0:
        return 0
    hidden, inner = dims
    n = min(tokens, -(-tokens * experts_per_token // max(1, num_experts)))
    one = max(16 * n * inner, 8 * n * (inner + hidden))
    if experts_per_token > 1:
        one = max(one, n * (20 * inner + 6 * hidden))
    return 4 * tokens * hidden + one


def copied_step_bytes(nbytes: int, num_experts: int, dtype_bytes: Mapping[str, int], fmt: str | None,
                      dims: tuple[int, ...] = (), tokens: int = 0, experts_per_token: int = 1, ranks: int = 1) -> int:
    """Device bytes one host-compute group holds on each rank's device in a step above the
    crossover (est): vLLM's profile run is such a step (``max_num_batched_tokens`` tokens,
    ``tokens`` here, every expert picked), in which the worker copies the group's host
    experts (or MLP, or head rows) to the device and computes them there one expert at a
    time, each dequantized to bf16 first when the format is quantized
    (``wrappers.host_compute.HostExperts._on_device``). At most the group's bytes (a device
    share is not copied; counted anyway) plus what dequantizing one expert of the kernel's
    dims ``dims`` holds (:func:`dequantized_expert_bytes`) and the step's activations
    (:func:`copied_activation_bytes`). Under tensor parallelism (``ranks``) each rank copies
    and computes its shard of the intermediate size: its share of the bytes, of one expert's
    and of the activations' intermediate width."""
    ranks = max(1, ranks)
    shard = (dims[0], -(-dims[1] // ranks)) if len(dims) == 2 else dims
    dequantized = (0 if fmt in (None, "bf16", "f32")
                   else dequantized_expert_bytes(shard, dtype_bytes, num_experts * ranks))
    return -(-nbytes // ranks) + dequantized + copied_activation_bytes(tokens, shard, experts_per_token, num_experts)


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
    flops = e.flops_per_token * tokens
    # The CPU's share of the picks (all of them unless some are resident on the device): by
    # the measured hit rate of the device share where a routing profile chose it, else uniform.
    on_host = 1.0 - e.hit
    host = read * on_host / ranks / host_rate(settings)
    cpu = max(host, flops * on_host / ranks / cpu_flop_s) + settings.handoff_s
    # Copied, the host's picks move COPIED_PATH_TRAFFIC times their bytes; the share, its own.
    share = device_share_traffic(e, max(1, round(tokens)))[0] if e.share > 0.0 else 0.0
    moved = read * on_host * e.copied_traffic + share
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
    from ..tensors import DTYPE_BITS

    if native:
        return int(sum(dtype_bytes.values()))

    bits = {dtype: PARAM_BITS.get(dtype, DTYPE_BITS.get(dtype, 16)) for dtype in dtype_bytes}
    return int(sum(nbytes * max(bits[dtype], SHARE_MIN_BITS) / bits[dtype] for dtype, nbytes in dtype_bytes.items()))


def share_gathers(tokens: int, experts_per_token: int, share_experts: float) -> bool:
    """Whether the device share's path gathers each pick slot's expert (``True``) or reads
    every expert of the share once (``False``) for a step of ``tokens`` tokens: it gathers
    up to :data:`SHARE_GATHER_TOKENS` tokens (the gathered experts are a step's transient
    device memory) when the gathers move fewer bytes than reading the share once."""
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
        picked = share_experts * expert_read_fraction(e.num_experts, e.experts_per_token, tokens)
        return picked * per_expert, tokens * e.experts_per_token * e.hit * per_pick
    if e.num_experts > 1 and share_gathers(tokens, e.experts_per_token, share_experts):
        slots = tokens * e.experts_per_token
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
        return cpu < gpu

    loses = _fewest_tokens(lambda t: not cpu_wins(t))
    return MAX_CROSSOVER_TOKENS if loses is None else loses - 1


def crossover_sets(units: "tuple[ExpertsRead, ...] | list[ExpertsRead]") -> "list[list[ExpertsRead]]":
    """The host-compute units that share a crossover: every unit of the layer stack together
    (a step serves all of a plan's experts and MLPs one way), and each unit outside it alone
    (the split LM head: a step's logits, one matmul whose CPU part turns compute-bound at far
    fewer tokens than a layer's experts, so it leaves the CPU at its own crossover)."""
    inside = [e for e in units if e.layer >= 0]
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
        return sum(e.flops_per_token * t for e in experts) / (settings.cpu_tflops * 1e12) >= read

    return _fewest_tokens(bound)
