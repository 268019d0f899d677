"""CUDA graph sizes for a plan that computes on the host CPU: at or below its crossover.

A step above the crossover copies the weights its routing picks to the device, which no
CUDA graph can capture; :func:`cap_graphs_at_crossover` trims the worker's own graph sizes
while it loads, so a server started with vLLM's defaults (``SELECTIVE_OFFLOAD_PLAN=auto``
always is) starts.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import PlanError
from ..plan_format import GroupKind, Plan, Serving


def cap_graphs_at_crossover(plan: Plan | None, vllm_config: Any, device: torch.device) -> str | None:
    """On CUDA, graph sizes above the crossover cannot be captured (a step there copies the
    weights its routing picks: see HostExperts). The worker's own config is trimmed to the
    sizes at or below the crossover before the engine captures any (vLLM reads
    ``cudagraph_capture_sizes`` and ``max_cudagraph_capture_size`` after loading, when its
    graph dispatcher or manager is initialised), so ``vllm serve`` with its defaults starts;
    steps above run without a graph. Returns the note that says so (``None``: nothing to
    cap). A crossover of 0 (every step copies) is refused, naming enforce_eager."""
    if plan is None or plan.host_compute is None or device.type != "cuda":
        return None
    compilation = getattr(vllm_config, "compilation_config", None)
    sizes = sorted(getattr(compilation, "cudagraph_capture_sizes", None) or [])
    enforce_eager = getattr(getattr(vllm_config, "model_config", None), "enforce_eager", False)
    crossover = plan.host_compute.crossover_tokens
    if enforce_eager or not sizes or sizes[-1] <= crossover:
        return None
    what = ("routed experts" if any(g.kind == GroupKind.EXPERTS and g.serving == Serving.COMPUTE
                                     for g in plan.groups) else "dense MLPs")
    kept = [n for n in sizes if n <= crossover]
    if not kept:
        raise PlanError(f"vLLM would capture CUDA graphs of {sizes[0]} to {sizes[-1]} tokens, and the plan computes "
                        f"{what} on the host at no step size (crossover {crossover}): every step copies the weights "
                        "it uses, which a graph cannot capture; start vLLM with enforce_eager (--enforce-eager)")
    compilation.cudagraph_capture_sizes = kept
    compilation.max_cudagraph_capture_size = kept[-1]
    replay = getattr(compilation, "decoder_replay_cudagraph_capture_sizes", None)
    if replay:
        compilation.decoder_replay_cudagraph_capture_sizes = [n for n in replay if n <= crossover]
    return (f"CUDA graphs capped at the plan's crossover: {len(kept)} sizes up to {kept[-1]} tokens of vLLM's "
            f"{len(sizes)} up to {sizes[-1]} (the plan computes {what} on the host up to {crossover} tokens per "
            "step; a larger step copies the weights it uses, which a graph cannot capture, so it runs without one)")
