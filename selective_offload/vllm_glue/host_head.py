"""The LM head served ``compute``: its vocabulary rows split between the GPU and the host CPU.

A plan that serves the LM head ``compute`` (a group of kind module, ``device_channels`` of
its ``intermediate`` vocabulary rows on the device: ``planner.shares.head_share``) has it
built in host memory at construction, like the host-compute experts (the same load:
:class:`~.experts.ExpertsLoad`), page-locked there, and its first rows copied to the device.
After loading, its quant method is replaced by :class:`HeadRowsMethod`, whose ``apply``
hands the hidden states to :class:`~selective_offload.wrappers.host_rows.HostRows`. That is
vLLM's own seam: ``LogitsProcessor`` projects the hidden states through
``lm_head.quant_method.apply`` (0.32 and 0.33), then gathers and trims the vocabulary
padding as for any head. vLLM computes logits outside its CUDA graphs, so no graph capture
is involved.

Refused in one line: a head vLLM built quantized or in another dtype, a vocabulary smaller
than the plan's device rows, and an LM head vLLM 0.33 projects in another dtype than the
model's (``--hf-overrides '{"head_dtype": "float32"}'``: it then reads ``lm_head.weight``
itself, past the quant method).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..errors import PlanError
from ..plan_format import GroupKind, Plan, Serving
from ..wrappers.host_buffers import HostBuffers
from ..wrappers.host_rows import HostRows
from .host_compute import reload_on_host, thread_facts, threads_of, threads_words

#: The quant methods of an unquantized head (a quant config that leaves the head alone
#: hands out the linear one), by class name.
HEAD_METHODS = ("UnquantizedEmbeddingMethod", "UnquantizedLinearMethod")
MECHANISM = "compute (the host CPU computes the LM head's last vocabulary rows where they live)"


def head_groups(plan: Plan | None) -> list[str]:
    """The LM head groups the plan splits between the device and the host CPU."""
    if plan is None:
        return []
    return [g.group for g in plan.groups if g.kind == GroupKind.MODULE and g.serving == Serving.COMPUTE]


def check_head(group: str, head: nn.Module, model: nn.Module | None = None) -> None:
    """Refuse, in one line, a head the split cannot serve (see the module docstring)."""
    method = getattr(head, "quant_method", None)
    weight = getattr(head, "weight", None)
    if type(method).__name__ not in HEAD_METHODS or not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise PlanError(f"{group}: the plan splits this LM head between the device and the host CPU, and vLLM built "
                        f"it with {type(method).__name__}; only an unquantized head is split: plan with "
                        "--no-head-share or for this checkpoint")
    if weight.dtype not in (torch.bfloat16, torch.float32):
        raise PlanError(f"{group}: the plan splits this LM head, and vLLM holds it in {weight.dtype}; serve the "
                        "model in bf16, or plan with --no-head-share")
    head_dtype = getattr(getattr(model, "logits_processor", None), "head_dtype", None)
    if head_dtype is not None and head_dtype != weight.dtype:
        raise PlanError(f"{group}: vLLM projects the LM head in {head_dtype} (head_dtype) and reads its weight "
                        "itself, past the split the plan makes; drop the head_dtype override, or plan with "
                        "--no-head-share")


class HeadRowsMethod:
    """The LM head's quant method once it is split: ``apply`` runs :class:`HostRows` (the
    original is kept for anything else vLLM asks of it)."""

    def __init__(self, original: Any, rows: HostRows):
        self.original = original
        self.rows = rows

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        out = self.rows(flat)
        if bias is not None:
            out = out + bias
        return out.reshape(*x.shape[:-1], out.shape[-1])

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """A reload: the checkpoint was loaded into the layer's weight (the original's
        post-processing, taken over, keeps it as loaded); the device's rows follow it, from
        the layer's weight as it is now: vLLM's layer-by-layer reload runs this on the
        layer it rebuilt, before it copies the new values into the host weight."""
        self.original.process_weights_after_loading(layer)
        self.rows.refresh(layer.weight.data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.original, name)


def install_head(group: str, head: nn.Module, plan: Plan, device: torch.device,
                 model: nn.Module | None = None, buffers: HostBuffers | None = None) -> HostRows:
    """Serve ``head`` split from now on: its page-locked host weight stays where it is, the
    plan's first rows are copied to ``device``, and its quant method is replaced."""
    check_head(group, head, model)
    setting, planned = plan.host_compute, plan.group_of(group)
    if setting is None or planned is None or not planned.device_channels:
        raise PlanError(f"{group}: the plan computes this LM head on the host but states no split or crossover; "
                        "make the plan again")
    weight = head.weight.data
    if planned.device_channels >= weight.shape[0]:
        raise PlanError(f"{group}: the plan keeps {planned.device_channels} vocabulary rows on the device, and vLLM "
                        f"built {weight.shape[0]} here; make the plan again for this model")
    crossover = setting.head_crossover_tokens if setting.head_crossover_tokens is not None else setting.crossover_tokens
    rows = HostRows(group, weight, planned.device_channels, crossover_tokens=crossover, device=device,
                    threads=threads_of(setting, device), buffers=buffers)
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    # vLLM's layer-by-layer reload post-processes a layer only through a QuantizeMethodBase
    QuantizeMethodBase.register(HeadRowsMethod)
    head.quant_method = HeadRowsMethod(head.quant_method, rows)
    rows.thread_facts = thread_facts(rows.threads, setting)
    reload_on_host(head)
    return rows


def mechanism(rows: HostRows) -> str:
    facts = getattr(rows, "thread_facts", None)
    threads = threads_words(facts) if facts else f"{rows.threads or 'all'} threads"
    return (f"{MECHANISM}: rows {rows.device_rows}-{rows.device_rows + rows.host_rows - 1} on the host CPU "
            f"({threads}), rows 0-{rows.device_rows - 1} on {rows.device_weight.device} beside "
            f"it; steps of more than {rows.crossover_tokens} tokens copy the host's rows to the device")


def live_counters(rows: HostRows):
    """What the report shows of the split head, read when asked (the counts, never the weights)."""
    counts = rows.counts
    fixed = {"crossover_tokens": rows.crossover_tokens, "kernel": "bf16 rows", "threads": rows.threads,
             **getattr(rows, "thread_facts", {}),
             "read": "LM head rows",
             "device_share": {"what": f"rows 0-{rows.device_rows - 1}", "device": str(rows.device_weight.device),
                              "bytes": rows.device_weight.numel() * rows.device_weight.element_size()}}
    return lambda: {"host_compute": counts.as_dict(), **fixed}
