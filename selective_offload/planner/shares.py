"""Device shares: a host-compute layer split between the GPU and the CPU.

A layer computed on the host a layer at a time leaves the GPU waiting while the CPU works
(the layer's output is the next layer's input). With a device share, every layer's
host-compute work is on the host and part of each layer's bytes is also copied to the
device, where the GPU computes it while the CPU computes the rest; the layer waits for the
longer (``estimate.host.device_share_time``). The device's reads then hide under the CPU's time
instead of adding to the step, and every layer's CPU work shrinks alike. KTransformers'
``gpu_experts_mask`` and SGLang's KT wrapper split MoE layers this way.

- **Routed experts** (:func:`expert_shares`): the same number of each layer's first
  experts on the device; with a routing profile, each layer's busiest experts instead, their
  measured hit rate priced (:func:`by_routing`).
- **A dense MLP** (:func:`channel_shares`): the same number of each layer's first
  intermediate channels (gate and up rows, down columns), whole scale blocks or groups.
- **The LM head** (:func:`head_share`), beside either: the CPU waits idle while the GPU
  reads the LM head at the end of the step, so the head's last vocabulary rows are
  computed there (from a host copy of the head) while the GPU computes its first rows; the
  split is where the two take about as long, and the device memory the host's rows free
  goes to the layers' shares. Taken only where the step model prices it faster.

The room the same share of every layer leaves holds part of one more expert (or block of
channels) a layer; the first layers take one more each while it holds it (:func:`_fill`),
so no device memory the plan could use is left idle.

Routed experts of an MXFP4 checkpoint are held on the device as stored and computed by the
share kernel, which reads each picked expert there once (``wrappers.share_kernel``,
``estimate.host.NATIVE_SHARE_FORMATS``); any other share is held in bf16 (the GPU computes it with
torch ops that read bf16 once, where a quantized share would be dequantized at every step:
``estimate.host.SHARE_MIN_BITS``). A share is as large as the device memory the
placement leaves once every layer's work is on the host and nothing is prefetched; the step
model prices what its path moves (``estimate.host.device_share_traffic``), so a share whose
gathers cost the GPU more than the CPU saves is not kept. The host keeps every byte too (a layer's experts, or
an MLP's projections, are one tensor each there), so the host memory checked must hold all
of them. Each function returns the candidate placement and its shares, or ``None``; the
caller keeps whichever placement the step model prices faster.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Mapping

from ..checkpoint import Checkpoint
from ..estimate.host import device_share_time, host_compute_time, share_held_bytes, share_native
from ..estimate.traffic import EXPERTS_CPU, ExpertsRead, StepSettings, decode_read_rate, flops_per_token
from ..names import NEVER_COLD_SEGMENTS, has_segment
from ..plan_format import GroupKind, PlanInputs, Serving
from .grouping import group_tensors
from .kernels import quantization_config
from .placement import Placing, host_shortfall

if TYPE_CHECKING:
    from ..plan_format import Plan
    from ..routing import RoutingProfile

#: Channels a dense MLP's share is a multiple of, at least: a block FP8 checkpoint's 128-row
#: blocks (and its block columns), int4's groups (whichever is larger, as a common multiple).
CHANNEL_ALIGN = 128


def _room(trial: Placing, inputs: PlanInputs) -> int | None:
    """Device bytes the trial placement leaves free; ``None`` when its host bytes do not fit."""
    if host_shortfall(trial, inputs):  # every layer's bytes on the host must fit its memory too
        return None
    return -trial.over_budget()


def expert_shares(p: Placing, inputs: PlanInputs, fmt: str | None,
                  reserved: int = 0) -> tuple[Placing, dict[str, tuple[int, int]]] | None:
    """Every decoder layer's routed experts computed on the host, and the first ``m`` of each
    also on the device, as many as the room holds (``m`` < E) held as the plan's CPU format
    ``fmt`` holds a share (``estimate.host.share_native``). ``reserved``: device bytes the room
    keeps for another share (the LM head's rows, :func:`head_share`)."""
    experts = [g for g in p.groups if g.kind == GroupKind.EXPERTS and not g.mtp
               and p.where[g.name] in (Serving.RESIDENT, Serving.COMPUTE)]
    if not any(p.where[g.name] == Serving.COMPUTE for g in experts):
        return None
    trial = p.like(p.groups)
    trial.where = {**p.where, **{g.name: Serving.COMPUTE for g in experts}}
    trial.transient, trial.buffers = p.transient, 0
    room = _room(trial, inputs)
    if room is None:
        return None
    room -= reserved
    native = share_native(fmt, True)
    counts = _fill([(share_held_bytes(g.dtype_bytes, native) - g.growth, g.num_experts) for g in experts], room, 1,
                   min(g.num_experts for g in experts) - 1)
    return (trial, {g.name: (m, 0) for g, m in zip(experts, counts) if m}) if any(counts) else None


def _fill(groups: list[tuple[int, int]], room: int, step: int, most: int) -> list[int]:
    """Units of each group on the device: :func:`_most_that_fit`'s ``n`` of every group,
    then ``step`` more for each group in order, while the room that leaves holds them."""
    n = _most_that_fit(groups, room, step, most)
    counts, left = [n] * len(groups), room - sum(nbytes * n // units for nbytes, units in groups)
    if n + step > most:
        return counts
    for i, (nbytes, units) in enumerate(groups):
        more = nbytes * (n + step) // units - nbytes * n // units
        if more > left:
            break
        counts[i], left = n + step, left - more
    return counts


def _most_that_fit(groups: list[tuple[int, int]], room: int, step: int, most: int) -> int:
    """The largest multiple of ``step``, at most ``most``, such that that many units of every
    group (``(bytes, units)``: its bytes over its experts or channels, rounded down) fit in
    ``room`` bytes together; 0 when not even one step does."""
    per_unit = sum(nbytes / units for nbytes, units in groups)
    n = min(int(room // per_unit) // step * step if room > 0 else 0, most // step * step)
    while n > 0 and sum(nbytes * n // units for nbytes, units in groups) > room:
        n -= step
    return max(n, 0)


def intermediate_size(config: Mapping[str, Any]) -> int | None:
    """A dense model's MLP intermediate size from its config (or its ``text_config``)."""
    text = config.get("text_config") if isinstance(config.get("text_config"), Mapping) else {}
    value = config.get("intermediate_size", text.get("intermediate_size"))
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def expert_intermediate_size(config: Mapping[str, Any]) -> int | None:
    """One routed expert's intermediate size from a MoE config (``moe_intermediate_size``,
    else ``intermediate_size``, as gpt-oss names it), or its ``text_config``'s."""
    text = config.get("text_config") if isinstance(config.get("text_config"), Mapping) else {}
    for key in ("moe_intermediate_size", "intermediate_size"):
        value = config.get(key, text.get(key))
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def channel_align(config: Mapping[str, Any]) -> int:
    """The multiple a dense MLP's share of channels is cut at: :data:`CHANNEL_ALIGN`, or a
    common multiple with the checkpoint's FP8 blocks or int4 groups when they are larger."""
    qc = quantization_config(config)
    sizes = [CHANNEL_ALIGN]
    block = qc.get("weight_block_size")
    if isinstance(block, (list, tuple)):
        sizes += [b for b in block if isinstance(b, int) and b > 0]
    group = qc.get("group_size", qc.get("q_group_size"))
    if isinstance(group, int) and group > 0:
        sizes.append(group)
    return math.lcm(*sizes)


def channel_shares(checkpoint: Checkpoint, inputs: PlanInputs, p: Placing,
                   fmt: str | None, reserved: int = 0) -> tuple[Placing, dict[str, tuple[int, int]]] | None:
    """Every dense layer's MLP computed on the host (a group of its own), the rest of each
    layer resident, nothing prefetched, and the first ``n`` intermediate channels of every
    MLP also on the device (``n`` a multiple of :func:`channel_align`, below I). Only for a
    placement that already serves hot bytes from the host: a model the device holds (with
    its cold set on the host) stays resident. ``reserved``: as :func:`expert_shares`'."""
    I = intermediate_size(checkpoint.config)
    align = channel_align(checkpoint.config)
    hot_on_host = any(w in (Serving.COMPUTE, Serving.PREFETCH) for w in p.where.values())
    if fmt is None or I is None or I <= align or not hot_on_host:  # only where the cold set was not enough
        return None
    groups = group_tensors(checkpoint, inputs, split_mlp=True)
    trial = p.like(groups)
    for g in groups:
        if g.kind == GroupKind.MLP:
            trial.where[g.name] = Serving.COMPUTE
        elif g.kind == GroupKind.LAYER:
            trial.where[g.name] = Serving.RESIDENT
        elif g.name in p.where:
            trial.where[g.name] = p.where[g.name]
    trial.transient, trial.buffers = p.transient, 0
    mlps = [g for g in groups if g.kind == GroupKind.MLP]
    room = _room(trial, inputs)
    room = None if room is None else room - reserved
    if not mlps or room is None or room <= 0:
        return None
    counts = _fill([(share_held_bytes(g.dtype_bytes) - g.growth, I) for g in mlps], room, align, I - 1)
    return (trial, {g.name: (n, I) for g, n in zip(mlps, counts) if n}) if any(counts) else None


#: Vocabulary rows the LM head's device share is a multiple of (vLLM pads a vocabulary to a
#: multiple of 64 rows).
HEAD_ROWS_ALIGN = 128


def head_share(checkpoint: Checkpoint, inputs: PlanInputs, p: Placing) -> tuple[str, int, int] | None:
    """The LM head split by its vocabulary rows: ``(group, rows on the device, rows)``, the
    device's rows a multiple of :data:`HEAD_ROWS_ALIGN` where the slower of the GPU's part
    and the CPU's (with its hand-off) is quickest at the plan's step (est); ``None`` when no
    split beats the GPU reading the whole head. Only a bf16 head of its own (not tied to the
    embedding), one rank, no speculative decoding (a draft pass reads the head too)."""
    if not inputs.head_share or inputs.ranks != 1 or inputs.speculative or checkpoint.facts.tie_word_embeddings:
        return None
    heads = [g for g in p.groups if g.kind == GroupKind.MODULE and has_segment(g.name, NEVER_COLD_SEGMENTS)
             and p.where[g.name] == Serving.RESIDENT]
    weight = checkpoint.tensors.get(f"{heads[0].name}.weight") if len(heads) == 1 else None
    if weight is None or heads[0].num_tensors != 1 or weight.dtype != "BF16" or len(weight.shape) != 2:
        return None
    g, rows = heads[0], int(weight.shape[0])
    settings = StepSettings(inputs.link_gbps, inputs.vram_gbps, inputs.batch, cpu_gbps=inputs.host_cpu_gbps,
                            cpu_tflops=inputs.host_cpu_tflops, handoff_s=inputs.host_handoff_s,
                            decode_read_gbps=inputs.decode_read_gbps, compute_tflops=inputs.compute_tflops)

    def slower(on_device: int) -> float:
        e = ExpertsRead(-1, g.nbytes, 1, 1, EXPERTS_CPU, flops_per_token(g.dtype_bytes),
                        device_share=on_device / rows, held_nbytes=g.nbytes)
        return max(host_compute_time(e, inputs.batch, settings)[0], device_share_time(e, inputs.batch, settings)[0])

    candidates = range(HEAD_ROWS_ALIGN, rows, HEAD_ROWS_ALIGN)
    if not candidates:
        return None
    best = min(candidates, key=slower)
    whole = g.nbytes / (decode_read_rate(inputs.vram_gbps, inputs.decode_read_gbps) * 1e9)
    return (g.name, best, rows) if slower(best) < whole else None


def by_routing(plan: "Plan", profile: "RoutingProfile | None") -> "Plan":
    """``plan`` with each host-compute layer's device share holding the ``m`` experts
    ``profile`` counted busiest in that layer (instead of its first ``m``), and the share's
    hit rate (the share of the layer's picks they took) priced from the counts (est); the
    profile is checked against the plan's model first (its MoE layers and expert counts).
    The share sizes stay those the planner chose under uniform routing. Without a profile,
    a plan with expert shares says they are its first experts, priced as uniform routing."""
    experts = [g for g in plan.groups if g.kind == GroupKind.EXPERTS]
    shared = [g for g in experts if g.device_experts]
    if profile is None:
        if not shared:
            return plan
        return replace(plan, notes=plan.notes + (
            "device shares: each layer's first experts, priced as uniform routing (no routing profile; "
            "`plan --routing FILE` puts the busiest experts there and prices their measured hit rate)",))
    profile.check_layers({g.layer_index: g.num_experts for g in experts},
                         required=frozenset(g.layer_index for g in experts if not g.mtp))
    groups = tuple(replace(g, device_expert_ids=profile.busiest(g.layer_index, g.device_experts),
                           est_device_hit_rate=profile.hit_rate(g.layer_index,
                                                                profile.busiest(g.layer_index, g.device_experts)))
                   if g.device_experts else g for g in plan.groups)
    # the planner's line on the shares said which experts: now the busiest, not the first
    said = tuple(n.replace("keeps its first ", "keeps its busiest ") if "routed experts" in n else n for n in plan.notes)
    ordered = replace(plan, groups=groups, notes=said)
    hits = [g.est_device_hit_rate for g in groups if g.device_experts]
    uniform = [g.device_share for g in shared]
    line = (f"device shares: each layer's busiest experts by the routing profile ({profile.source_text()}); "
            f"est hit rate {min(hits):.1%} to {max(hits):.1%} of a layer's picks (uniform: {min(uniform):.1%} to "
            f"{max(uniform):.1%}), est {ordered.est.est_tok_s:.3g} tok/s (uniform: {plan.est.est_tok_s:.3g})"
            if shared else f"routing profile ({profile.source_text()}): no layer has a device share to order")
    # a layer the profile counted nothing in (a kernel the counter did not see) is not "busiest"
    silent = [g.layer_index for g in shared if not sum(profile.layers[g.layer_index])]
    unmeasured = (f"routing profile: layers {', '.join(map(str, silent))} counted no picks; their shares hold the "
                  "first experts, priced as uniform routing",) if silent else ()
    return replace(ordered, notes=ordered.notes + (line,) + unmeasured)
