"""What a vLLM server must be told to run a plan as it was priced.

A plan is made for a budget (the card less the KV cache and the reserve) and, when it
computes on the host CPU, for steps up to its crossover. vLLM's defaults assume neither:
it sizes the KV cache from ``gpu_memory_utilization`` (0.9 of the card, less the weights
and the activations it profiles), which leaves a plan that fills its budget too little or
no KV cache at all; and it captures CUDA graphs of up to 512 tokens, which the worker
refuses above a host-compute plan's crossover; and it sizes its fused-MoE workspace for
``max_num_batched_tokens`` tokens, 8192 for the ``LLM`` class and on a card of 70 GiB or more,
where a plan priced it for fewer (:data:`~selective_offload.plan_format.vocabulary.ASSUMED_BATCHED_TOKENS`).
:func:`engine_settings` is all three, as vLLM's engine arguments: ``plan``'s serve command passes them as flags, ``enable()`` returns them.
"""

from __future__ import annotations

from typing import Any

from ..plan_format import Plan


def vllm_default_graph_tokens(card: str) -> int:
    """The most tokens vLLM 0.33 captures a CUDA graph for when not told
    (``VllmConfig._set_cudagraph_sizes``: 1024 on the compute capability 10.x family, else
    512; fewer only when ``max_num_seqs`` is small)."""
    return 1024 if card.split(".")[0] == "10" else 512


def graph_cap(plan: Plan) -> int | None:
    """The most tokens a CUDA graph of a server running ``plan`` may hold, where vLLM's
    default would capture more: a host-compute plan's crossover (a step above it copies the
    weights it uses over the link, routed experts as its routing picks them, which no graph
    can capture, so the worker refuses larger graphs). ``None``: vLLM's default stands."""
    record = plan.host_compute
    if record is not None and record.crossover_tokens < vllm_default_graph_tokens(plan.inputs.card):
        return record.crossover_tokens
    return None


def engine_settings(plan: Plan) -> dict[str, Any]:
    """vLLM's engine arguments that make the server match ``plan``: the KV cache the plan
    kept (``kv_cache_memory_bytes``, which vLLM then reserves instead of sizing one from
    ``gpu_memory_utilization``) where the plan moved weights off the device to fit its
    budget, and the CUDA graph cap of :func:`graph_cap`. A plan whose weights all fit
    leaves vLLM's own KV sizing alone (it gives the KV cache what is left). A plan made
    without ``--max-model-len`` kept a KV cache of a size, not of a context: vLLM is told to
    fit its context to it (``max_model_len=-1``, its auto-fit) rather than refuse to start
    when the model's own context does not fit. A plan that priced vLLM's fused-MoE workspace
    priced it for a step of ``inputs.batched_tokens`` tokens: vLLM is told that step
    (``max_num_batched_tokens``), not its default for the entry point and card."""
    settings: dict[str, Any] = {}
    if plan.deficit_bytes > 0 and plan.inputs.kv_cache_bytes > 0:
        settings["kv_cache_memory_bytes"] = plan.inputs.kv_cache_bytes
        if plan.inputs.max_model_len is None:  # vLLM fits the context to that KV cache (-1: auto-fit)
            settings["max_model_len"] = -1
    if plan.est_vllm_workspace_bytes:
        settings["max_num_batched_tokens"] = plan.inputs.batched_tokens
    cap = graph_cap(plan)
    if cap is not None:
        settings["compilation_config"] = {"max_cudagraph_capture_size": cap}
    return settings


def serve_flags(plan: Plan) -> list[str]:
    """:func:`engine_settings` as ``vllm serve`` flags."""
    settings = engine_settings(plan)
    flags = ["--max-model-len", "auto"] if settings.get("max_model_len") == -1 else []
    if "kv_cache_memory_bytes" in settings:
        flags += ["--kv-cache-memory-bytes", str(settings["kv_cache_memory_bytes"])]
    if "max_num_batched_tokens" in settings:
        flags += ["--max-num-batched-tokens", str(settings["max_num_batched_tokens"])]
    if "compilation_config" in settings:
        flags += ["--max-cudagraph-capture-size", str(settings["compilation_config"]["max_cudagraph_capture_size"])]
    return flags
