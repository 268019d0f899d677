"""Routed experts in host memory, read in place by the fused-MoE kernel through UVA views.

At batch 1 a MoE decode step reads only the top-k routed experts of each layer. A plan
that serves a layer's experts ``uva`` keeps them in host memory and lets the kernel
read the experts it routes to over the link, inside the kernel, with no copy per step
(vLLM's own cpu_offload_gb reads host weights the same way). One load, for each such group:

1. **construction**: vLLM builds the routed experts in ``RoutedExperts.__init__`` (its
   ``layer_name`` is the FusedMoE ``prefix``, the plan's group as the model names it, compared
   by :meth:`names.ModelNames.key`); :class:`ConstructOnHost` allocates them on the
   host, so they never take device memory, not even transiently, and its ledger proves it;
2. **loading**: vLLM's ``weight_loader`` copies the checkpoint into that host storage;
3. **post-processing**: a quant method that can post-process on the host does so in place
   (``requires_device_loading = False``: no ``device_loading_context`` round trip); one
   that needs the device does so one layer at a time (the transient, one layer's experts,
   is noted), and its results come back to host memory of their exact size, never to
   torch's pinned allocator (which rounds each block up to a power of two);
4. **after loading**: each parameter is page-locked in place at its exact size
   (:class:`PageLockedLedger`), then on CUDA replaced by a UVA device view of itself
   (vLLM's ``get_accelerator_view_from_cpu_tensor``) and marked
   ``_vllm_is_uva_offloaded``, as vLLM's UVA offloader marks its own. The marker is what
   vLLM reads: ``device_loading_context`` re-offloads a marked parameter that a later
   post-processing replaced, and the Triton fused-MoE kernel groups each expert's tokens
   for marked weights instead of reading an expert once per (token, expert) pair. The
   parameter objects stay the same (``.data`` is swapped), so whatever holds them (the
   kernel's quant config holds the biases) sees the views. A view is an ordinary device
   tensor at a fixed address: CUDA graphs capture it.

On the CPU build host memory is device memory: there is no view to make, but the routing,
the ledger and the report still prove where the experts were built and are.

This is our own UVA path, not vLLM's offloader (vLLM keeps one offloader per model); it
composes with the exact-layer prefetch offloader for hot dense layers because they touch
disjoint modules (a plan serves an experts group ``prefetch`` exactly when its layer is).

Which fused-MoE kernels read UVA views (vLLM 0.33, read from its sources). The kernel is
the quant method's ``experts_cls``, chosen when the layer is built, so a plan is refused
right after construction, before any weight loads, when the kernel is not one of these:

=====================================  =======  ==================================================
kernel (``experts_cls``)               uva      why
=====================================  =======  ==================================================
``TritonExperts`` (unquantized, FP8    yes      vLLM reads host weights through it itself: its
W8A8 and block FP8, INT8 via Triton)            ``_weights_host_resident`` checks the UVA marker
CPU build kernels (``CPU*Experts``)    yes      no UVA: host memory is the compute device's memory
Marlin (MXFP4/NVFP4/WNA16 W4A16)       no       vLLM PR #56118: "b_q_weight is not on GPU" for
                                                host weights; UVA views not verified
FlashInfer TRTLLM / CUTLASS,           no       weights shuffled for TMA-driven kernels; reading
DeepGEMM, CUTLASS, triton_kernels               mapped host memory through them is not verified
(gpt-oss MXFP4), AITER, MoonEP, XPU
=====================================  =======  ==================================================

An unquantized layer on CUDA can be sent to Triton with ``moe_backend="triton"``
(``--moe-backend triton``). Quantized methods that post-process on the device (FP8 on
Triton) take step 3's one-layer-at-a-time path; it is unit-tested on a CPU proxy here, not
run on a GPU yet.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from ..errors import PlanError
from ..names import ModelNames, group_key
from ..plan import GroupKind, Placement, Plan
from ..sizes import fmt_bytes
from ..wrappers.page_locked import PageLockedLedger, PinPolicy
from .host_resident import to_host_exact

#: The attribute vLLM's UVA offloader sets on a parameter it turned into a UVA view, and
#: that vLLM reads (``device_loading_context``; the Triton fused-MoE kernel in 0.33).
UVA_MARKER = "_vllm_is_uva_offloaded"
#: Fused-MoE kernels that read expert weights through UVA views (see the table above).
UVA_KERNELS = frozenset({"TritonExperts"})
#: The argument of ``RoutedExperts.__init__`` that carries the FusedMoE ``prefix``.
PREFIX_ARGUMENT = "layer_name"
#: Quant methods that post-process routed experts in place on the host, for the kernels
#: the check accepts (for Triton's the unquantized method only makes the weights
#: contiguous; the CPU build repacks them on the host). Any other runs on the device.
IN_PLACE_METHODS = frozenset({"UnquantizedFusedMoEMethod"})
#: What the report says serves a group served ``uva``.
MECHANISM_VIEW = "uva (the fused-MoE kernel reads the routed experts in place through a device view)"
MECHANISM_CPU = "uva (host memory is the device's memory here: the kernel reads the experts in place, no view)"


def uva_groups(plan: Plan | None) -> list[str]:
    """The experts groups the plan places in host memory, read through UVA."""
    if plan is None:
        return []
    return [g.group for g in plan.groups if g.kind == GroupKind.EXPERTS and g.placement == Placement.HOST_UVA]


@dataclass
class ExpertsLoad:
    """What one main-model load does to the plan's uva-served experts, for the report."""

    #: The group's key in the model (``ModelNames.key``) -> group name, for every uva-served experts group.
    groups: dict[tuple, str]
    #: The cold segments as the model spells them.
    cold_segments: frozenset[str]
    #: Module name of each ``RoutedExperts`` built for a group -> the group.
    modules: dict[str, str] = field(default_factory=dict)
    #: ``id()`` of expert parameters built on the host (at construction, or post-processed
    #: on the host from such), and of the final uva-served parameters.
    routed: set[int] = field(default_factory=set)
    params: set[int] = field(default_factory=set)
    #: Group -> how its post-processing ran, and the largest device transient of one layer.
    post_processing: dict[str, str] = field(default_factory=dict)
    transient_bytes: int = 0
    #: Group -> the mechanism line of the report.
    mechanisms: dict[str, str] = field(default_factory=dict)
    #: Names (relative to the experts module) of parameters it holds that belong to a module
    #: outside it too (vLLM's runner passes the router's score-correction bias in): never
    #: moved or viewed here. Names, not ids: post-processing frees parameters, and ids are reused.
    shared: frozenset[str] = frozenset()

    @classmethod
    def of(cls, plan: Plan | None, names: ModelNames = ModelNames()) -> "ExpertsLoad | None":
        groups = uva_groups(plan)
        if not groups:
            return None
        segments = plan.inputs.cold_segments
        return cls({names.key(g, segments): g for g in groups}, names.segments(segments))

    def group_of(self, prefix: str) -> str | None:
        """The uva-served group a FusedMoE ``prefix`` (vLLM's name) builds, or ``None``."""
        return self.groups.get(group_key(prefix, self.cold_segments))

    def is_expert_module(self, name: str) -> bool:
        return any(name == m or name.startswith(m + ".") for m in self.modules)


def refuse_before_load(xl: ExpertsLoad | None, device: torch.device, policy: PinPolicy | None) -> None:
    """A plan of uva-served experts that cannot run here, refused before anything is built."""
    if xl is None or device.type != "cuda":
        return
    if policy is not None and not policy.locks:
        raise PlanError(f"the plan reads the routed experts of {next(iter(xl.groups.values()))} through UVA, which "
                        f"needs page-locked host memory, and here {policy.reason}; allow pinned memory, or plan "
                        "the experts on the device")


def routing_kwargs(xl: ExpertsLoad | None, routed_experts_cls: type) -> dict[str, Any]:
    """:class:`ConstructOnHost` arguments that build the uva-served experts on the host."""
    if xl is None:
        return {}
    # mutation: experts-not-routed
    return dict(modules=xl.group_of, named_by={routed_experts_cls: PREFIX_ARGUMENT})


def _kernel(method: Any) -> str:
    cls = getattr(method, "experts_cls", None)
    return getattr(cls, "__name__", "") if cls is not None else ""


def check_kernel(group: str, method: Any, device: torch.device) -> None:
    """Refuse, with one line, a uva-served group whose fused-MoE kernel does not read UVA views."""
    if device.type == "cpu":
        return  # the CPU build: host memory is the kernel's memory, no view involved
    kernel = _kernel(method)
    # mutation: experts-kernel-check-off
    if kernel in UVA_KERNELS:
        return
    backend = (getattr(method, "unquantized_backend", None) or getattr(method, "fp8_backend", None)
               or getattr(method, "mxfp4_backend", None) or getattr(method, "nvfp4_backend", None))
    chosen = f"{kernel or 'an unknown kernel'}" + (f" ({getattr(backend, 'value', backend)})" if backend else "")
    raise PlanError(f"{group}: vLLM chose {chosen} for {type(method).__name__}, a fused-MoE kernel not known to read "
                    "host memory through UVA views (only Triton's is); start vLLM with moe_backend='triton' "
                    "(--moe-backend triton) where the method allows it, or plan these experts on the device")


def find_modules(model: nn.Module, xl: ExpertsLoad, routed_experts_cls: type) -> None:
    """Record the built ``RoutedExperts`` module of each uva-served group."""
    for name, module in model.named_modules():
        if isinstance(module, routed_experts_cls):
            group = xl.group_of(getattr(module, PREFIX_ARGUMENT, "") or name)
            if group is not None:
                xl.modules[name] = group
    outside = {id(p) for n, p in model.named_parameters(remove_duplicate=False)
               if not xl.is_expert_module(n.rsplit(".", 1)[0])}
    xl.shared = frozenset(n for m in xl.modules for n, p in model.get_submodule(m).named_parameters()
                          if id(p) in outside)


def after_construction(model: nn.Module, xl: ExpertsLoad, routed_storages: set[int], device: torch.device) -> None:
    """Check each experts module's kernel, record what was built on the host (by the
    routing ledger's storages), and take over its post-processing."""
    for name, group in xl.modules.items():
        module = model.get_submodule(name)
        method = module.quant_method
        check_kernel(group, method, device)
        xl.routed |= {id(p) for p in own_parameters(module, xl) if _storage(p) in routed_storages}
        on_device = device.type != "cpu" and type(method).__name__ not in IN_PLACE_METHODS
        take_over_post_processing(module, method, group, xl, device if on_device else None)


def own_parameters(module: nn.Module, xl: ExpertsLoad) -> list[nn.Parameter]:
    """The experts module's own parameters (not those it shares with the rest of the layer)."""
    # mutation: router-bias-viewed
    return [p for n, p in module.named_parameters() if n not in xl.shared]


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def take_over_post_processing(module: nn.Module, method: Any, group: str, xl: ExpertsLoad,
                              device: torch.device | None,
                              onload: Callable[[torch.Tensor, torch.device], torch.Tensor] | None = None) -> None:
    """Run ``method``'s post-processing of ``module`` without vLLM's round trip.

    vLLM's ``device_loading_context`` would copy the layer to the device and back into
    torch's pinned allocator (blocks rounded up to a power of two); it is turned off
    (``requires_device_loading = False``) and replaced by this: with ``device`` None the
    method runs in place on the host; otherwise the layer alone is onloaded (the
    transient), post-processed, and every parameter comes back to host memory of its
    exact size. Either way a layer built on the host stays counted as built there.
    ``onload`` moves a tensor to the device (``Tensor.to``; a test passes a recording proxy).
    """
    original = method.process_weights_after_loading
    move = onload or (lambda t, d: t.to(d))
    # mutation: experts-post-processing-round-trip
    method.requires_device_loading = False

    def process_weights_after_loading(layer: nn.Module) -> None:
        before = {n: p for n, p in layer.named_parameters() if n not in xl.shared}  # held: no id reused
        built_on_host = bool(before) and all(id(p) in xl.routed for p in before.values())
        kept = {id(p) for p in before.values() if id(p) in xl.routed}
        xl.routed -= {id(p) for p in before.values()}
        if device is not None:
            transient = 0
            for p in before.values():
                transient += p.numel() * p.element_size()
                p.data = move(p.data, device)
            xl.transient_bytes = max(xl.transient_bytes, transient)
            xl.post_processing[group] = (f"post-processed on the device one layer at a time (a transient of "
                                         f"{fmt_bytes(transient)})")
        else:
            xl.post_processing[group] = "post-processed in place on the host"
        original(layer)
        for p in own_parameters(layer, xl):
            if p.device.type != "cpu" and not getattr(p, UVA_MARKER, False):
                p.data = to_host_exact(p.data)
            if built_on_host or id(p) in kept:
                xl.routed.add(id(p))

    method.process_weights_after_loading = process_weights_after_loading


def attach(model: nn.Module, xl: ExpertsLoad, device: torch.device, page_locked: PageLockedLedger | None,
           accelerator_view: Callable[[torch.Tensor], torch.Tensor]) -> set[int]:
    """Page-lock each uva-served expert parameter in place and, on CUDA, make it a UVA view
    marked as vLLM marks its own. Returns the parameters' ``id()``."""
    views = device.type == "cuda"
    for name, group in xl.modules.items():
        module = model.get_submodule(name)
        held = []
        for p in own_parameters(module, xl):
            if getattr(p, UVA_MARKER, False):  # already a view (a reload)
                xl.params.add(id(p))
                continue
            if p.device.type != "cpu":
                p.data = to_host_exact(p.data)  # not built on the host: the report counts it as moved
            held.append(p.data)
            locked = page_locked.lock(p.data, group) if page_locked is not None else False
            if views:
                if not (locked or p.data.is_pinned()):
                    raise PlanError(f"{group}: {name} could not be page-locked, so the kernel cannot read it "
                                    "through UVA; allow pinned memory, or plan these experts on the device")
                mark_uva_view(p, accelerator_view)
            xl.params.add(id(p))
        if page_locked is not None and held:
            page_locked.release_with(module, held)
        how = xl.post_processing.get(group, "")
        xl.mechanisms[group] = (MECHANISM_VIEW if views else MECHANISM_CPU) + (f"; {how}" if how else "")
    return set(xl.params)


def mark_uva_view(param: nn.Parameter, accelerator_view: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """``param`` becomes a device view of its own page-locked host storage, marked as
    vLLM's UVA offloader marks its parameters (the object stays the same)."""
    # mutation: uva-view-not-made
    param.data = accelerator_view(param.data)
    # mutation: uva-not-marked
    setattr(param, UVA_MARKER, True)


def notes_for(xl: ExpertsLoad | None) -> list[str]:
    if xl is None or not xl.transient_bytes:
        return []
    return [f"routed experts post-processed on the device one layer at a time: a transient of up to "
            f"{fmt_bytes(xl.transient_bytes)} of device memory during loading"]
