"""The worker's routing counters: how often each routed expert of each MoE layer is picked.

Opt-in (``SELECTIVE_OFFLOAD_ROUTING=1``, ``enable(..., routing=True)``). After loading, every
MoE layer of the model (vLLM's ``MoERunner``, whatever the plan serves it with) gets an int64
tensor of one counter per expert on the layer's device, and its router's ``select_experts``
(``FusedMoERouter.select_experts``, the one call every modular path routes through in
vLLM 0.32 and 0.33: ``MoERunner._forward_impl``) is wrapped, on that router object, to add
the step's top-k ids into it (:func:`count_picks`). A layer whose quant method is monolithic
(its kernel routes inside) is counted by running its router's ``_select_experts`` beside
the kernel, the routing computed twice.

The counters exclude vLLM's profile run and warm-up: they are zeroed when the worker's
``compile_or_warm_up_model`` returns (:func:`zero_after_warm_up`), after which only served
steps run. The landing report reads them (one host copy each, when it is asked for:
never during a step) as :func:`report_routing`'s object, which
``selective-offload report --routing`` saves as a profile (:mod:`selective_offload.routing`).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

#: Picks counted per ``index_add_`` without growing the ones buffer (grown outside capture).
INITIAL_SLOTS = 8192


def count_picks(counts: torch.Tensor, topk_ids: torch.Tensor, ones: torch.Tensor) -> None:
    """Add one to ``counts[e]`` for every pick of expert ``e`` in ``topk_ids`` (any shape).

    Safe inside a captured CUDA graph: one ``index_add_`` kernel, in place, into a tensor
    allocated before capture, reading the ids through a view (a reshape of the router's
    contiguous output) and a view of a ones buffer also allocated before, as long as the
    step's picks (a shape the graph fixes). So nothing is allocated during capture, and no
    shape depends on the ids' values (``torch.bincount`` would size its output by the
    largest id: a host synchronisation). No host synchronisation either: the kernel is
    queued on the current stream after the router's own."""
    ids = topk_ids.reshape(-1)
    if ids.dtype not in (torch.int32, torch.int64):  # index_add_ takes these two only
        ids = ids.to(torch.int64)
    counts.index_add_(0, ids, ones[:ids.shape[0]])


@dataclass
class LayerCounter:
    """One MoE layer's counters (one per expert) on its device."""

    layer: int
    name: str
    counts: torch.Tensor
    ones: torch.Tensor
    experts_per_token: int

    def add(self, topk_ids: torch.Tensor) -> None:
        n = topk_ids.numel()
        if n > self.ones.shape[0] and not _capturing(self.ones.device):
            self.ones = torch.ones(max(n, 2 * self.ones.shape[0]), dtype=torch.long, device=self.ones.device)
        if n > self.ones.shape[0]:  # inside a capture, larger than any step before: a buffer for this graph
            count_picks(self.counts, topk_ids, torch.ones(n, dtype=torch.long, device=self.ones.device))
            return
        count_picks(self.counts, topk_ids, self.ones)

    def values(self) -> list[int]:
        return [int(v) for v in self.counts.tolist()]


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


@dataclass
class RoutingCounters:
    """Every counted layer of one model, by decoder layer index."""

    layers: dict[int, LayerCounter] = field(default_factory=dict)
    #: The routers wrapped: (router, the attribute set on it), undone by :meth:`detach`.
    wrapped: list = field(default_factory=list)
    model: str = ""
    vllm_version: str = ""
    #: The plan's device share per layer (its expert count), for the summary's N.
    device_experts: dict[int, int] = field(default_factory=dict)

    def zero(self) -> None:
        for c in self.layers.values():
            c.counts.zero_()

    def as_report(self) -> dict[str, Any]:
        """The report's ``routing`` object: the counts as they are now (one host copy each)."""
        layers = {c.layer: c.values() for c in self.layers.values()}
        ks = {c.layer: c.experts_per_token for c in self.layers.values()}
        tokens = max((sum(v) // max(1, ks[i]) for i, v in layers.items()), default=0)
        return {"source": {"model": self.model, "vllm_version": self.vllm_version, "tokens": tokens,
                           "workload": ""},
                "experts_per_token": {str(i): k for i, k in sorted(ks.items())},
                "layers": {str(i): v for i, v in sorted(layers.items())},
                "device_experts": {str(i): n for i, n in sorted(self.device_experts.items())}}


def _runners(model: nn.Module):
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    for name, module in model.named_modules():
        if isinstance(module, MoERunner):
            yield name, module


def attach(model: nn.Module, device: torch.device, model_name: str, vllm_version: str,
           device_experts: dict[int, int] | None = None) -> RoutingCounters:
    """Counters on every MoE layer of ``model`` (each router wrapped on its own object)."""
    counters = RoutingCounters(model=model_name, vllm_version=vllm_version, device_experts=dict(device_experts or {}))
    for name, runner in _runners(model):
        layer = runner.layer_id
        config = runner.moe_config
        experts = int(config.num_experts)
        k = int(config.experts_per_token)
        dev = torch.device(getattr(config, "device", None) or device)
        counter = LayerCounter(layer, name, torch.zeros(experts, dtype=torch.long, device=dev),
                               torch.ones(INITIAL_SLOTS, dtype=torch.long, device=dev), k)
        counters.layers[layer] = counter
        _wrap(runner, counter, counters)
    return counters


def _wrap(runner: Any, counter: LayerCounter, counters: RoutingCounters) -> None:
    router = runner.router
    ref = weakref.ref(counter)
    if runner.routed_experts.quant_method.is_monolithic:
        experts = runner.routed_experts
        original = experts.forward_monolithic

        def forward_monolithic(x, router_logits, *args, **kwargs):
            c = ref()
            if c is not None:
                c.add(router._select_experts(x, router_logits, input_ids=kwargs.get("input_ids"))[1])
            return original(x, router_logits, *args, **kwargs)

        experts.forward_monolithic = forward_monolithic
        counters.wrapped.append((experts, "forward_monolithic"))
        return
    select = router.select_experts

    def select_experts(*args, **kwargs):
        weights, ids = select(*args, **kwargs)
        c = ref()
        if c is not None:
            c.add(ids)
        return weights, ids

    router.select_experts = select_experts
    counters.wrapped.append((router, "select_experts"))


def detach(counters: RoutingCounters) -> None:
    for owner, attr in counters.wrapped:
        owner.__dict__.pop(attr, None)
    counters.wrapped.clear()


def zero_after_warm_up(get_counters):
    """``compile_or_warm_up_model`` of vLLM's GPU and CPU workers, wrapped to zero the
    routing counters when it returns: the profile run and the warm-up (and CUDA graph
    capture) are not served steps. ``get_counters``: the session's counters, or ``None``."""

    def wrap(original):
        def compile_or_warm_up_model(self, *args, **kwargs):
            result = original(self, *args, **kwargs)
            counters = get_counters()
            if counters is not None:
                counters.zero()
            return result

        compile_or_warm_up_model.__wrapped__ = original
        return compile_or_warm_up_model

    return wrap


def save_at_shutdown(get_session):
    """``Worker.shutdown`` (vLLM's GPU worker; the CPU build's inherits it), wrapped to write
    the report once more before the worker goes, with the routing counters (and every
    wrapper's counters) as they are then: the report file of an engine in another process
    otherwise holds those of the load. Nothing is written without routing counters; a
    failure to write is logged (the report's writer says why) and never stops the shutdown."""

    def wrap(original):
        def shutdown(self, *args, **kwargs):
            s = get_session()
            if s is not None and s.routing is not None and s.report is not None:
                try:
                    s.live_report()
                except Exception as exc:  # noqa: BLE001 - the worker's shutdown must go on
                    from ..log import logger

                    logger.warning("selective-offload: the routing counts were not written at shutdown: %s", exc)
            return original(self, *args, **kwargs)

        shutdown.__wrapped__ = original
        return shutdown

    return wrap
