"""The plan's notes about its placement: why it is infeasible, what was assumed, what bounds it.

Notes are text for the user, kept apart from the arithmetic that produced them: a placement
(:mod:`.placement`) that does not fit the device or the host, the routed experts' E or k
that :mod:`.grouping` had to assume, a plan made from config.json alone, and (with a matmul
rate given) whether the step is bound by compute, VRAM reads or the link. The baselines'
notes are :mod:`.baselines`', the speculation's are :mod:`.speculation`'s.
"""

from __future__ import annotations

from ..checkpoint import Checkpoint
from ..plan_format import Estimate, GroupKind, PlanInputs
from ..sizes import GB
from .grouping import Group, experts_notes
from .placement import HOST_SERVINGS, Placing, host_bytes, host_shortfall


def plan_notes(groups: list[Group], checkpoint: Checkpoint, placing: Placing, inputs: PlanInputs) -> list[str]:
    notes = []
    shortfall, host_short = max(0, placing.over_budget()), host_shortfall(placing, inputs)
    if not any(g.kind == GroupKind.LAYER for g in groups):
        notes.append("no decoder layer stack (`...layers.N.`) found: only cold modules can be offloaded")
    if shortfall > 0:
        kept = [g for g in groups if g.kind == GroupKind.LAYER and placing.where[g.name] not in HOST_SERVINGS]
        notes.append(
            f"infeasible: {shortfall / GB:.3f} GB more device memory is needed even with every "
            + ("cold module and every decoder layer on the host; " if not kept else
               f"cold module and every decoder layer that can move on the host ({len(kept)} with routed experts "
               "stay resident: see the routed-experts note for the setting that moves them); ")
            + "use a larger card, a smaller KV cache, or a smaller checkpoint"
        )
    if host_short > 0:
        notes.append(
            f"infeasible: the plan puts {host_bytes(placing) / GB:.3f} GB in host memory, "
            f"{host_short / GB:.3f} GB more than the {inputs.host_available_bytes / GB:.3f} GB the "
            f"{inputs.host_memory_bytes / GB:.3f} GB of RAM (--host-memory) leaves beside the "
            f"{inputs.host_headroom_bytes / GB:.3f} GB kept for the operating system and vLLM's processes (est): "
            "use a machine with more RAM, a larger card, or a smaller checkpoint"
        )
    notes += experts_notes(checkpoint, inputs)
    if checkpoint.kind == "config":
        notes.append("planned from config.json alone: tensor sizes are an estimate (from the model built on the meta device)")
    notes += checkpoint.facts.notes
    return notes


def compute_note(est: Estimate, tflops: float) -> str:
    """What bounds the step, in one line for the plan's notes (est): its FLOPs at the matmul
    rate, its VRAM reads, or its link time, whichever is largest."""
    compute, vram, link = est.est_compute_s_per_step, est.est_vram_s_per_step, est.est_link_s_per_step
    if compute > max(vram, link):
        kind = ("compute-bound: layers are priced at their compute, and fewer host bytes or a faster link will "
                "not speed it up as much as the bytes suggest")
    elif link >= vram:
        kind = "link-bound: the host bytes decide the step"
    else:
        kind = "memory-bound: the VRAM reads decide the step"
    return (f"{kind} (the step's FLOPs take {compute * 1e3:.1f} ms at {tflops:g} TFLOP/s, its VRAM reads "
            f"{vram * 1e3:.1f} ms, the link {link * 1e3:.1f} ms; est)")
