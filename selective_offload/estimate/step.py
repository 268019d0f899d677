"""One decode step from its traffic (est): each mechanism's bytes at its rate, the prefetch
offloader's overlap, the host CPU's part in line, batch and speculation
(:func:`step_cost`; the package's docstring says how)."""

from __future__ import annotations

from dataclasses import dataclass

from ..acceptance import expected_tokens_per_step
from ..kv_model import KvModel
from .host import (
    crossover_sets,
    device_share_time,
    host_compute_crossover,
    host_compute_time,
    host_compute_times,
    host_rate,
)
from .traffic import (
    DEFAULT_UVA_READ_FACTOR,
    EXPERTS_CPU,
    EXPERTS_PREFETCHED,
    EXPERTS_UVA,
    StepSettings,
    Traffic,
    decode_read_rate,
)


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
        span = layers[prev + 1:] + layers[:j] if n == 0 else layers[prev + 1:j]
        segment = sum(l.compute_s for l in span) + (other_s if n == 0 else 0.0)
        host = sum(l.host_s for l in span)
        shared = layers[j].copy_host_s + host if host > 0 else 0.0
        step += max(layers[j].copy_s, segment, shared) + layers[prev].compute_s
    link = sum(layers[j].copy_s for j in offloaded)
    return step, compute + link - step


def inline_step_s(device_read_s: float, uva_read_s: float) -> float:
    """vLLM's ``cpu_offload_gb``: kernels read offloaded weights through UVA, in line."""
    return device_read_s + uva_read_s


def step_cost(traffic: Traffic, settings: StepSettings, kv: KvModel | None, *, pipelined: bool) -> dict[str, float]:
    """The est_ figures of one step: link, VRAM and compute time, hidden link time, draft
    time, step time, tokens per step and tok/s (total and per sequence). ``pipelined``:
    the prefetch offloader's overlap (selective); otherwise every byte is paid in line (vLLM's cpu_offload_gb).

    Each mechanism moves bytes at its own rate: the prefetch offloader's copies at the
    pinned copy rate (``link_gbps``), kernels reading host memory in place (vLLM's
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
        read = e.read_bytes(tokens_per_pass)
        flops[e.layer] += e.flops_per_token
        if e.where == EXPERTS_UVA:
            uva_bytes += read
        else:
            reads[e.layer] += read
            if e.where == EXPERTS_PREFETCHED:
                copies[e.layer] += e.nbytes
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
    layer_s = [max(r / gb_vram + per_layer_kv, compute_s(f, tokens_per_pass)) for r, f in zip(reads, flops)]
    compute = (sum(compute_s(f, tokens_per_pass) for f in flops) + compute_s(traffic.other_flops, tokens_per_pass)
               + k * compute_s(traffic.draft_flops, n))
    if pipelined:
        # A layer's CPU time is part of the layer, so the next offloaded layer's copy runs
        # behind it too, reading host memory beside the CPU kernel (pipelined_step_s).
        rate = host_rate(settings)
        costs = [LayerCost(t + cpu, c / gb_link, host, c / rate)
                 for t, c, cpu, host in zip(layer_s, copies, layer_cpu, layer_host)]
        core, hidden = pipelined_step_s(costs, other_s + (0.0 if traffic.layers else kv_s))
        # UVA reads are paid in line: they share the link with the prefetch copies, so
        # they hide no copy and no copy hides them.
        step = core + rows_link_s + uva_s + draft_s + cpu_elsewhere_s + host_link_s
    else:
        hidden = 0.0
        device_s = sum(layer_s) + other_s + (0.0 if traffic.layers else kv_s)
        step = inline_step_s(device_s, link_s) + draft_s + cpu_s
    tokens = n * expected_tokens_per_step(k, settings.accept_rate)
    tok_s = tokens / step if step > 0 else float("inf")
    return {"est_link_s_per_step": link_s, "est_vram_s_per_step": vram_s, "est_step_s": step, "est_tok_s": tok_s,
            "est_tokens_per_step": tokens, "est_tok_s_per_seq": tok_s / n, "est_hidden_link_s_per_step": hidden,
            "est_draft_s_per_step": draft_s, "est_compute_s_per_step": compute, "est_cpu_s_per_step": cpu_s}
