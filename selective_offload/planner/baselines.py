"""vLLM's own offload, priced on the same step model: the baselines a plan is compared with.

vLLM offers two settings without this extension: ``cpu_offload_gb`` (whole
parameters of the decoder layers, in model order, until the GiB budget is met) and
``cpu_offload_params`` (with it, only parameters whose name holds one of the
given segments, such as ``experts``). :func:`price_cpu_offload` prices either from the groups of
:mod:`.grouping`, with its traffic per step, and :func:`baseline_notes` says when the
selective plan does not beat one and why. Nothing here places a group; :mod:`.make` asks for
the baselines once the placement is made.
"""

from __future__ import annotations

import math

from ..checkpoint import Checkpoint, TensorInfo
from ..estimate.traffic import EXPERTS_DEVICE, EXPERTS_UVA, ExpertsRead, Traffic, expert_read_fraction, flops_per_token
from ..kv_model import KvModel
from ..names import EMBED_SEGMENTS, NEVER_COLD_SEGMENTS, experts_prefix, has_segment, layer_of
from ..plan_format import (
    LAYER_KINDS,
    Estimate,
    GroupKind,
    Plan,
    PlanInputs,
    Role,
    Strategy,
    VllmBaseline,
    read_flops,
)
from ..sizes import GiB
from .grouping import Group, allocated


def price_cpu_offload(groups: list[Group], checkpoint: Checkpoint, inputs: PlanInputs,
               deficit_bytes: int, kv: KvModel | None = None, spec_tokens: int = 0,
               params: tuple[str, ...] = ()) -> VllmBaseline:
    """What vLLM's ``cpu_offload_gb`` would take: whole parameters of the decoder layers,
    in model order, until the GiB budget is met; with ``params`` (vLLM's
    ``cpu_offload_params``, such as ``("experts",)``) only the parameters whose name holds
    one of them as whole segments, as vLLM matches them. It is UVA zero-copy: the kernels
    read the host parameters in place every step, so a host-resident routed-expert tensor
    crosses the link only for the experts the step routes to (the plan's read fraction)."""
    if inputs.vllm_cpu_offload_gb is not None:
        gb = float(inputs.vllm_cpu_offload_gb)
    else:
        gb = float(max(0, math.ceil(deficit_bytes / GiB)))
    max_bytes = int(gb * GiB)  # vLLM: int(cpu_offload_gb * 1024**3)
    layer_names = {g.name: g.layer_index for g in groups if g.kind == GroupKind.LAYER}
    by_layer: dict[int, list[TensorInfo]] = {i: [] for i in layer_names.values()}
    for t in allocated(checkpoint, inputs).values():  # vLLM offloads its parameters as it allocated them
        layer = layer_of(t.name)
        if layer is not None and f"{layer[0]}.{layer[1]}" in layer_names:
            by_layer[layer[1]].append(t)
    offloaded = count = 0
    touched: list[int] = []
    per_layer: dict[int, int] = {}
    experts_per_layer: dict[int, int] = {}
    for index in sorted(by_layer):
        for t in sorted(by_layer[index], key=lambda t: t.name):
            if offloaded >= max_bytes:
                break
            if params and not any(f".{p}." in f".{t.name}." for p in params):  # vLLM's segment match
                continue
            offloaded += t.nbytes
            into = experts_per_layer if experts_prefix(t.name) is not None else per_layer
            into[index] = into.get(index, 0) + t.nbytes
            count += 1
            if not touched or touched[-1] != index:
                touched.append(index)
    # vLLM keeps its own host tables (n-gram embeddings) on the host in this run too.
    loaded = sum(g.nbytes for g in groups if g.role != Role.ABSENT and not g.vllm_host)
    device = loaded - offloaded
    return VllmBaseline(
        cpu_offload_gb=gb, offloaded_bytes=offloaded, offloaded_tensors=count,
        layers_touched=tuple(touched), device_bytes=device, cpu_offload_params=tuple(params),
        fits=device <= inputs.weight_budget_bytes,
        est=Estimate.of(_cpu_offload_traffic(groups, per_layer, inputs, experts_per_layer), inputs, kv, spec_tokens,
                        pipelined=False),
    )


def _experts_reads(groups: list[Group], host_by_layer: dict[int, int]) -> tuple[ExpertsRead, ...]:
    """Each MoE layer's routed experts as the step model reads them: ``host_by_layer`` of
    their bytes from host memory through UVA, the rest from VRAM."""
    stack = sorted(g.layer_index for g in groups if g.kind == GroupKind.LAYER)
    position = {index: i for i, index in enumerate(stack)}
    reads = []
    for g in groups:
        if g.kind != GroupKind.EXPERTS or g.layer_index not in position:
            continue
        host = min(g.nbytes, host_by_layer.get(g.layer_index, 0))
        flops = flops_per_token(g.dtype_bytes) * expert_read_fraction(g.num_experts, g.experts_per_token, 1)
        for nbytes, where in ((g.nbytes - host, EXPERTS_DEVICE), (host, EXPERTS_UVA)):
            if nbytes:
                reads.append(ExpertsRead(position[g.layer_index], nbytes, g.num_experts, g.experts_per_token, where,
                                         flops * nbytes / g.nbytes))
    return tuple(reads)


def _cpu_offload_traffic(groups: list[Group], uva_by_layer: dict[int, int], inputs: PlanInputs,
                  uva_experts_by_layer: dict[int, int] | None = None) -> Traffic:
    """vLLM's cpu_offload_gb bytes per pass: everything on the device but the UVA bytes, which the
    kernels read over the link in line (the embedding stays on the device); routed experts
    on the host are read at the step's read fraction."""
    stack = sorted((g for g in groups if g.kind == GroupKind.LAYER), key=lambda g: g.layer_index)
    layers = tuple((g.est_read_bytes_per_step - uva_by_layer.get(g.layer_index, 0), False) for g in stack)
    experts = _experts_reads(groups, uva_experts_by_layer or {})
    other = row = draft = 0
    other_flops = draft_flops = 0.0
    for g in groups:
        if g.kind in LAYER_KINDS or g.role == Role.ABSENT:
            continue
        if g.mtp:
            draft += g.nbytes
            draft_flops += flops_per_token(g.dtype_bytes)
        elif has_segment(g.name, EMBED_SEGMENTS) and g.role == Role.COLD:
            row += g.est_read_bytes_per_step
        else:
            other += g.est_read_bytes_per_step
            other_flops += read_flops(g.dtype_bytes, g.est_read_bytes_per_step, g.nbytes)
    head = sum(g.est_read_bytes_per_step for g in groups if has_segment(g.name, NEVER_COLD_SEGMENTS))
    head_flops = sum(flops_per_token(g.dtype_bytes) for g in groups if has_segment(g.name, NEVER_COLD_SEGMENTS))
    speculating = inputs.speculative == "mtp"
    return Traffic(layers, other, 0, row, sum(uva_by_layer.values()), (draft + head) if speculating else 0, experts,
                   tuple(flops_per_token(g.dtype_bytes) for g in stack), other_flops,
                   (draft_flops + head_flops) if speculating else 0.0)


#: Step times within this share of each other are a tie (the estimate is not finer).
TIE = 1e-3


def baseline_notes(plan: Plan) -> list[str]:
    """A note for each vLLM baseline the plan does not beat, saying why it may not."""
    notes = []
    for baseline in plan.baselines:
        if not baseline.fits or plan.strategy == Strategy.INFEASIBLE:
            continue
        mine, theirs = plan.est.est_step_s, baseline.est.est_step_s
        if theirs > mine * (1 + TIE):
            continue
        why = []
        if plan.hot_layer_indices or plan.est_transient_device_bytes:
            why.append("its prefetch buffers and transients cost device memory vLLM's cpu_offload_gb does not need")
        if plan.uva_bytes:
            why.append("a layer's routed experts go to the host whole, where vLLM's budget takes single tensors")
        times = f"est {mine * 1e3:.1f} ms against {theirs * 1e3:.1f} ms per step"
        if theirs >= mine * (1 - TIE):
            notes.append(f"selective matches vLLM's {baseline.label} here ({times}): both read the same bytes over "
                         "the link")
        else:
            notes.append(f"selective is not estimated faster than vLLM's {baseline.label} here ({times}"
                         + (f": {'; '.join(why)}" if why else "") + "); consider vLLM's own offload for this card")
    return notes
