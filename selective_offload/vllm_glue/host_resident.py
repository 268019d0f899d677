"""Modules the plan keeps in host memory, through vLLM's post-processing: no device round trip.

After loading, ``process_weights_after_loading`` (vLLM's model_loader/utils.py) wraps each
quant method whose ``requires_device_loading`` is true (the default) in
``device_loading_context``: every host parameter of the module is copied to the device,
post-processed, and copied back into a *new* host tensor pinned through torch's caching
allocator (rounded up to a power of two, and kept locked in torch's cache once freed). For
a module the plan put on the host that is a device transient of the module's size, a
second page-locked copy, and a storage the report no longer recognises.

:func:`keep_on_host` takes the host-resident modules (cold groups, a drafter's shared
embedding and LM head, hot layers, and routed MoE experts) and, for each quant method
among them:

- a method that post-processes in place (:data:`IN_PLACE_METHODS`: the unquantized
  embedding and linear methods, which leave a CUDA weight untouched) is told so
  (``requires_device_loading = False``): vLLM's context is skipped and the parameter keeps
  its storage;
- any other method (it may repack or quantize with device kernels) is also taken out of
  vLLM's context, and its ``process_weights_after_loading`` runs inside
  :func:`one_module_on_device` instead: this module's host parameters go to the device,
  are post-processed, and come back to *exact-size pageable* host memory (the owner page-
  locks it in place afterwards); vLLM calls methods one module at a time, so the device
  transient is one module, which the planner counts (``est_post_process_transient``).

Routed modules are tracked as module objects and parameter names, never by storage address
(post-processing gives a parameter new storage, or a new Parameter object): see
:class:`HostResident`.
"""

from __future__ import annotations

import weakref
from typing import Callable, Iterable

import torch
from torch import nn

from ..wrappers.layout import device_copy_like, host_copy_like

#: Quant methods whose post-processing leaves a CUDA weight where it is (read in vLLM
#: 0.33's sources; their names are checked by tests/contract/check_vllm_contract.py).
IN_PLACE_METHODS = frozenset({"UnquantizedEmbeddingMethod", "UnquantizedLinearMethod"})

#: Set on each quant method :func:`keep_on_host` handled: how it post-processes now.
MARK = "_selective_offload_on_host"
IN_PLACE, ONE_MODULE = "in place", "on the device, one module at a time"


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``, its layout kept (:mod:`~selective_offload.wrappers.layout`)."""
    return device_copy_like(t, device)


def to_host_exact(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in a pageable host tensor of exactly its span, its layout kept (never
    torch's pinned, rounded allocator: the owner page-locks it in place)."""
    return host_copy_like(t)


def one_module_on_device(module: nn.Module, device: torch.device, run: Callable[[], None],
                         record: Callable[[int], None] | None = None) -> None:
    """Run ``run`` (a quant method's post-processing of ``module``) with ``module``'s host
    parameters on ``device``, then bring the same names back to exact-size host memory.

    Mirrors vLLM's ``device_loading_context`` (parameters created by the method stay where
    the method put them) except for the way back. ``record`` gets the device transient.
    """
    if device.type == "cpu":
        run()
        return
    names = [n for n, p in module.named_parameters() if p.device.type == "cpu"]
    params = dict(module.named_parameters())
    transient = 0
    for n in names:
        p = params[n]
        transient += p.numel() * p.element_size()
        p.data = to_device(p.data, device)
    if record is not None:
        record(transient)
    try:
        run()
    finally:
        after = dict(module.named_parameters())
        for n in names:
            p = after.get(n)
            if p is not None and p.device.type != "cpu":
                p.data = to_host_exact(p.data)


def keep_on_host(modules: Iterable[tuple[str, nn.Module]], device: torch.device,
                 record: Callable[[int], None] | None = None,
                 in_place: frozenset[str] = IN_PLACE_METHODS) -> list[str]:
    """Keep ``modules`` (name, module) in host memory through vLLM's post-processing.

    Call it after construction, before ``process_weights_after_loading`` (vLLM's target
    device as ``device``); pass every module whose parameters live on the host (a module
    without a quant method is skipped). Idempotent. Returns one note per module whose
    method must post-process on the device (one module at a time, back to exact-size host
    memory). ``record`` receives each such module's device transient in bytes when it
    happens. ``in_place`` names the quant method classes known to post-process where the
    weights are (a caller that knows more, such as routed MoE experts, passes its own).
    """
    notes: list[str] = []
    for name, module in modules:
        method = getattr(module, "quant_method", None)
        if method is None or getattr(method, MARK, None):
            continue
        if type(method).__name__ in in_place:
            method.requires_device_loading = False
            setattr(method, MARK, IN_PLACE)
            continue
        if not getattr(method, "requires_device_loading", True):
            setattr(method, MARK, IN_PLACE)
            continue
        original = method.process_weights_after_loading

        def process(layer, _original=original):
            one_module_on_device(layer, device, lambda: _original(layer), record)

        method.process_weights_after_loading = process
        method.requires_device_loading = False
        setattr(method, MARK, ONE_MODULE)
        notes.append(f"{name}: {type(method).__name__} post-processes on the device, one module at a time, "
                     "and returns to exact-size host memory")
    return notes


class HostResident:
    """Modules built in host memory, tracked as objects (weakly), not by storage address.

    Post-processing may give a parameter new storage, or replace the Parameter; the module
    object and the parameter's name survive both. :meth:`params` reads the module's
    parameters as they are now.
    """

    def __init__(self) -> None:
        self._modules: "weakref.WeakKeyDictionary[nn.Module, str]" = weakref.WeakKeyDictionary()

    def add(self, name: str, module: nn.Module) -> None:
        self._modules[module] = name

    def discard(self, module: nn.Module) -> None:
        self._modules.pop(module, None)

    def __contains__(self, module: object) -> bool:
        try:
            return module in self._modules
        except TypeError:
            return False

    def __len__(self) -> int:
        return len(self._modules)

    def within(self, root: nn.Module) -> list[tuple[str, nn.Module]]:
        """The tracked modules ``root`` still holds, by their name in ``root``."""
        return [(n, m) for n, m in root.named_modules() if m in self]

    def params(self, root: nn.Module) -> list[tuple[str, nn.Parameter]]:
        """The tracked modules' own parameters that ``root`` still holds, as they are now."""
        return [(f"{n}.{pn}" if n else pn, p) for n, m in self.within(root)
                for pn, p in m.named_parameters(recurse=False)]
