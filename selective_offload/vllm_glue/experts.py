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
3. **post-processing**: a quant method that can post-process on the host (the kernel
   table's ``HOST_POST_PROCESSING``: unquantized and block FP8 on Triton) does so in place
   (``requires_device_loading = False``: no ``device_loading_context`` round trip); one
   that needs the device does so one layer at a time (the transient, one layer's experts,
   is noted), and its results come back to host memory of their exact size, never to
   torch's pinned allocator (which rounds each block up to a power of two);
4. **after loading**: each experts module's parameters are packed into one page-aligned
   arena and page-locked with one registration (``PageLockedLedger.lock_together``: no
   page shared with another registration, so small scale tensors that post-processing
   reallocated side by side on the heap are all locked; each keeps its layout), checked
   with ``is_pinned()``, then on CUDA each is replaced by a UVA device view of itself
   (vLLM's ``get_accelerator_view_from_cpu_tensor``) and marked
   ``_vllm_is_uva_offloaded``, as vLLM's UVA offloader marks its own. The arena stays
   registered for the process's life (a captured CUDA graph may hold a view's address
   after the module is gone). A marker is re-checked against the view recorded beside it
   (:func:`is_live_view`), never trusted alone: vLLM's ``replace_parameter`` keeps the
   Parameter object, marker included, when a reload gives it new data. The marker is what
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

Which fused-MoE kernels read UVA views is one table, the planner's
(:mod:`selective_offload.planner.kernels`: vLLM 0.33's kernel per method, card and setting,
checked against its oracles, and the evidence for each kernel that reads UVA views). The
kernel is the quant method's ``experts_cls``, chosen when the layer is built, so a plan is
refused right after construction, before any weight loads, when the table says the kernel
does not; the refusal names the setting under which vLLM picks one that does. Other
quantized methods post-process on the device one layer at a time (step 3), as vLLM's own UVA
offload does for Marlin (the table's evidence); unit-tested on a CPU proxy here, not run on a GPU yet.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from ..errors import PlanError
from ..names import ModelNames, group_key
from ..plan_format import GroupKind, Plan, Serving
from ..planner import kernels
from ..sizes import fmt_bytes
from ..wrappers.host_buffers import HostBuffers
from ..wrappers.layout import layout_of
from ..wrappers.page_locked import PageLockedLedger, PinPolicy
from . import host_compute, host_head, host_mlp
from .auto_plan import card_of_worker
from .host_resident import to_device, to_host_exact
from .model_names import first_names

#: The attribute vLLM's UVA offloader sets on a parameter it turned into a UVA view, and
#: that vLLM reads (``device_loading_context``; the Triton fused-MoE kernel in 0.33).
UVA_MARKER = "_vllm_is_uva_offloaded"
#: Fused-MoE kernels that read expert weights through UVA views: the planner's table's.
UVA_KERNELS = kernels.UVA_KERNELS
#: Set beside the marker on each parameter :func:`attach` made a view: the view's address,
#: its layout and the page-locked host tensor it reads (what :func:`is_live_view` checks).
VIEW_RECORD = "_selective_offload_uva_view"
#: The argument of ``RoutedExperts.__init__`` that carries the FusedMoE ``prefix``.
PREFIX_ARGUMENT = "layer_name"
#: What the report says serves a group served ``uva``.
MECHANISM_VIEW = "uva (the fused-MoE kernel reads the routed experts in place through a device view)"
MECHANISM_CPU = "uva (host memory is the device's memory here: the kernel reads the experts in place, no view)"


def uva_groups(plan: Plan | None) -> list[str]:
    """The experts groups the plan places in host memory, read through UVA."""
    if plan is None:
        return []
    return [g.group for g in plan.groups if g.kind == GroupKind.EXPERTS and g.serving == Serving.UVA]


def compute_groups(plan: Plan | None) -> list[str]:
    """The experts groups the plan places in host memory, computed there by the host CPU
    (:mod:`.host_compute`): built and page-locked as the uva-served ones, never viewed."""
    if plan is None:
        return []
    return [g.group for g in plan.groups if g.kind == GroupKind.EXPERTS and g.serving == Serving.COMPUTE]


def mlp_groups(plan: Plan | None) -> list[str]:
    """The dense MLPs the plan computes on the host CPU (a group of kind ``mlp`` exists only
    so served): built and page-locked on the host as the experts are, run as one expert."""
    if plan is None:
        return []
    return [g.group for g in plan.groups if g.kind == "mlp" and g.serving == Serving.COMPUTE]


@dataclass
class ExpertsLoad:
    """What one main-model load does to the plan's host experts (served uva or compute), for the report."""

    #: The group's key in the model (``ModelNames.key``) -> group name, for every host experts group.
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
    #: Group -> what the report reads of a compute-served group's wrapper, live (its counters).
    counters: dict[str, Any] = field(default_factory=dict)
    #: Names (relative to the experts module) of parameters it holds that belong to a module
    #: outside it too (vLLM's runner passes the router's score-correction bias in): never
    #: moved or viewed here. Names, not ids: post-processing frees parameters, and ids are reused.
    shared: frozenset[str] = frozenset()
    #: The groups served compute (the rest are served uva), and each one's host experts;
    #: of them, the dense MLPs.
    computed: frozenset[str] = frozenset()
    mlps: frozenset[str] = frozenset()
    #: Of them, the LM head split between the device and the host CPU (:mod:`.host_head`).
    heads: frozenset[str] = frozenset()
    compute: dict[str, Any] = field(default_factory=dict)
    #: ``id()`` of the final parameters of the compute-served groups.
    compute_params: set[int] = field(default_factory=set)
    #: The one staging slot and workspace every compute-served group of this load shares
    #: (``wrappers.host_buffers``), made by :func:`attach`.
    buffers: HostBuffers | None = None
    #: vLLM's view helper, kept on CUDA so a reload's post-processing can view again (:func:`view_again`).
    accelerator_view: Callable[[torch.Tensor], torch.Tensor] | None = None

    @classmethod
    def of(cls, plan: Plan | None, names: ModelNames = ModelNames()) -> "ExpertsLoad | None":
        mlps, heads = mlp_groups(plan), host_head.head_groups(plan)
        computed = compute_groups(plan) + mlps + heads
        groups = uva_groups(plan) + computed
        if not groups:
            return None
        segments = plan.inputs.cold_segments
        return cls({names.key(g, segments): g for g in groups}, names.segments(segments), computed=frozenset(computed),
                   mlps=frozenset(mlps), heads=frozenset(heads))

    def is_computed(self, group: str) -> bool:
        return group in self.computed

    def group_of(self, prefix: str) -> str | None:
        """The host group a constructing module's ``prefix`` (vLLM's name) builds, or
        ``None``: a FusedMoE's experts; a dense MLP's linears (``model.layers.0.mlp.gate_up_proj``
        is in group ``model.layers.0.mlp``, by the names rule)."""
        return self.groups.get(group_key(prefix, self.cold_segments))

    def is_expert_module(self, name: str) -> bool:
        return any(name == m or name.startswith(m + ".") for m in self.modules)


def refuse_before_load(xl: ExpertsLoad | None, device: torch.device, policy: PinPolicy | None) -> None:
    """A plan of uva-served experts that cannot run here, refused before anything is built."""
    if xl is None or device.type != "cuda":
        return
    viewed = [g for g in xl.groups.values() if not xl.is_computed(g)]
    if viewed and policy is not None and not policy.locks:
        raise PlanError(f"the plan reads the routed experts of {viewed[0]} through UVA, which "
                        f"needs page-locked host memory, and here {policy.reason}; allow pinned memory, or plan "
                        "the experts on the device")


def refuse_another_card(plan: Plan | None, device: torch.device, card: str | None = None) -> None:
    """A plan whose routed experts leave the device, made for another card than this one,
    refused before anything is built: which fused-MoE kernel vLLM builds, and so whether
    the experts can be read in place or moved at all, depends on the card (the kernel
    table); a plan made for another one may place them where this card's kernel cannot
    serve them. ``card``: this device's compute capability (read from it when not given)."""
    if plan is None or device.type != "cuda":
        return
    host = [g.group for g in plan.groups if g.kind == GroupKind.EXPERTS and g.serving in
            (Serving.UVA, Serving.PREFETCH)]
    card = card or card_of_worker(device)
    if not host or card is None or card == plan.inputs.card:
        return
    made = "made for" if plan.inputs.compute_capability else "made without a card, assuming"
    raise PlanError(f"the plan was {made} compute capability {plan.inputs.card} and this card is {card}: the routed "
                    f"experts it puts on the host ({host[0]}, ...) are served by the kernel vLLM picks per card; make "
                    f"the plan again with `selective-offload plan --compute-capability {card}`, or use "
                    "SELECTIVE_OFFLOAD_PLAN=auto")


def routing_kwargs(xl: ExpertsLoad | None, routed_experts_cls: type) -> dict[str, Any]:
    """:class:`ConstructOnHost` arguments that build the uva-served experts on the host."""
    if xl is None:
        return {}
    return dict(modules=xl.group_of, named_by={routed_experts_cls: PREFIX_ARGUMENT})


def _kernel(method: Any) -> str:
    cls = getattr(method, "experts_cls", None)
    return getattr(cls, "__name__", "") if cls is not None else ""


def check_kernel(group: str, method: Any, device: torch.device, card: str | None = None) -> None:
    """Refuse, with one line, a uva-served group whose fused-MoE kernel does not read UVA
    views by the planner's table, naming a setting under which vLLM picks one that does.
    ``card``: the device's compute capability (read from it when not given)."""
    if device.type == "cpu":
        return  # the CPU build: host memory is the kernel's memory, no view involved
    kernel = _kernel(method)
    if kernels.reads_uva(kernel):
        return
    card = card or card_of_worker(device)
    name = kernels.method_of_vllm(method)
    fix = kernels.advice(name, card) if card else None
    backend = (getattr(method, "unquantized_backend", None) or getattr(method, "fp8_backend", None)
               or getattr(method, "mxfp4_backend", None) or getattr(method, "nvfp4_backend", None))
    chosen = f"{kernel or 'an unknown kernel'}" + (f" ({getattr(backend, 'value', backend)})" if backend else "")
    on = f" on SM {card}" if card else ""
    how = (f"start vLLM with {fix} (vLLM then picks {kernels.kernel_for(name, card, fix)}, which does)" if fix
           else "no setting makes vLLM 0.33 pick one that does for this method on this card" if card
           else "the card's compute capability is not known here, so no setting is named")
    raise PlanError(f"{group}: vLLM chose {chosen} for {type(method).__name__}{on}, a fused-MoE kernel not known "
                    f"to read host memory through UVA views; {how}, or plan these experts on the device "
                    f"(selective-offload plan --compute-capability {card or 'MAJOR.MINOR'} does)")


def find_modules(model: nn.Module, xl: ExpertsLoad, routed_experts_cls: type) -> None:
    """Record the built ``RoutedExperts`` module of each uva-served group, by its name in
    the layer stack (:func:`.model_names.first_names`)."""
    name_of = first_names(model)
    for listed, module in model.named_modules():
        name = name_of(listed)
        if isinstance(module, routed_experts_cls):
            group = xl.group_of(getattr(module, PREFIX_ARGUMENT, "") or name)
            if group is not None:
                xl.modules[name] = group
        elif xl.mlps and xl.group_of(name) in xl.mlps and not xl.is_expert_module(name):
            xl.modules[name] = xl.group_of(name)  # the MLP itself (its linears come after it, inside it)
        elif xl.heads and xl.group_of(name) in xl.heads:
            xl.modules[name] = xl.group_of(name)  # the LM head
    is_expert = expert_names(model, xl)
    outside = {id(p) for n, p in model.named_parameters(remove_duplicate=False)
               if not is_expert(n.rsplit(".", 1)[0])}
    xl.shared = frozenset(n for m in xl.modules for n, p in model.get_submodule(m).named_parameters()
                          if id(p) in outside)


def expert_names(model: nn.Module, xl: ExpertsLoad) -> Callable[[str], bool]:
    """Whether a module name of ``model`` is in a module :func:`find_modules` recorded, by
    any name the model lists it under (a decoder layer listed twice is one layer:
    :func:`.model_names.first_names`)."""
    name_of = first_names(model)
    return lambda name: xl.is_expert_module(name_of(name))


def after_construction(model: nn.Module, xl: ExpertsLoad, routed_storages: set[int], device: torch.device) -> None:
    """Check each experts module's kernel, record what was built on the host (by the
    routing ledger's storages), and take over its post-processing."""
    for name, group in xl.modules.items():
        module = model.get_submodule(name)
        xl.routed |= {id(p) for p in own_parameters(module, xl) if _storage(p) in routed_storages}
        if group in xl.heads:
            host_head.check_head(group, module, model)
            take_over_post_processing(module, module.quant_method, group, xl, None, run_original=False)
            continue
        if group in xl.mlps:
            host_mlp.mlp_format(group, module, device)
            for part in host_mlp.MLP_PARTS:
                linear = getattr(module, part)
                take_over_post_processing(linear, linear.quant_method, group, xl, None, run_original=False)
            continue
        method = module.quant_method
        if xl.is_computed(group):
            host_compute.refuse_unsupported(group, method, module, device)
            take_over_post_processing(module, method, group, xl, None, run_original=False)
            continue
        check_kernel(group, method, device)
        # Where vLLM's post-processing needs no device (the table's), it runs in place on the
        # host; the CPU build repacks on the host anyway.
        on_device = device.type != "cpu" and not kernels.post_processes_on_host(kernels.method_of_vllm(method),
                                                                               _kernel(method))
        take_over_post_processing(module, method, group, xl, device if on_device else None)


def own_parameters(module: nn.Module, xl: ExpertsLoad) -> list[nn.Parameter]:
    """The experts module's own parameters (not those it shares with the rest of the layer)."""
    return [p for n, p in module.named_parameters() if n not in xl.shared]


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def take_over_post_processing(module: nn.Module, method: Any, group: str, xl: ExpertsLoad,
                              device: torch.device | None,
                              onload: Callable[[torch.Tensor, torch.device], torch.Tensor] | None = None,
                              run_original: bool = True) -> None:
    """Run ``method``'s post-processing of ``module`` without vLLM's round trip.

    vLLM's ``device_loading_context`` would copy the layer to the device and back into
    torch's pinned allocator (blocks rounded up to a power of two); it is turned off
    (``requires_device_loading = False``) and replaced by this: with ``device`` None the
    method runs in place on the host; otherwise the layer alone is onloaded (the
    transient), post-processed, and every parameter comes back to host memory of its
    exact size. Either way a layer built on the host stays counted as built there.
    ``onload`` moves a tensor to the device (``Tensor.to``; a test passes a recording proxy).
    With ``run_original`` false the method's post-processing is not run at all: the
    weights stay as loaded, the layout the host CPU kernel reads (:mod:`.host_compute`).
    """
    original = method.process_weights_after_loading
    move = onload or to_device
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
        elif not run_original:
            xl.post_processing[group] = "kept as loaded (the CPU kernel reads the checkpoint's layout)"
        else:
            xl.post_processing[group] = "post-processed in place on the host"
        if run_original:
            original(layer)
        for name, p in layer.named_parameters():
            if name in xl.shared:
                continue
            if not view_again(p, f"{group}: {name}", xl.accelerator_view) and p.device.type != "cpu" \
                    and not is_live_view(p):
                p.data = to_host_exact(p.data)
            if built_on_host or id(p) in kept:
                xl.routed.add(id(p))

    method.process_weights_after_loading = process_weights_after_loading


def attach(model: nn.Module, xl: ExpertsLoad, device: torch.device, page_locked: PageLockedLedger | None,
           accelerator_view: Callable[[torch.Tensor], torch.Tensor], plan: Plan | None = None) -> set[int]:
    """Page-lock each host experts module's parameters in one arena (one registration,
    no page shared with another); on CUDA make each uva-served one a UVA view marked as
    vLLM marks its own, and hand each compute-served one to the host CPU
    (:func:`.host_compute.install`), every one sharing one staging slot and workspace
    (:class:`HostBuffers`, page-locked through ``page_locked`` on CUDA). Returns the
    uva-served parameters' ``id()``."""
    if xl.buffers is None:
        xl.buffers = HostBuffers(pinned=device.type == "cuda", page_locked=page_locked)
    if device.type == "cuda":
        xl.accelerator_view = accelerator_view  # a reload's post-processing views again (view_again)
    buffers = xl.buffers
    for name, group in xl.modules.items():
        module = model.get_submodule(name)
        computed = xl.is_computed(group)
        views = device.type == "cuda" and not computed
        params = []
        for p in own_parameters(module, xl):
            if views and is_live_view(p):  # a reload that left the view in place
                xl.params.add(id(p))
                continue
            if p.device.type != "cpu":
                p.data = to_host_exact(p.data)  # not built on the host: the report counts it as moved
            params.append(p)
        if page_locked is not None and params:
            # Small scale tensors reallocated on the heap share pages: registered one at a
            # time, the second of two on one page is refused (CUDA error 712).
            page_locked.lock_together(params, group)
        hosts = [p.data for p in params]
        if computed:
            experts = (host_head.install_head(group, module, plan, device, model, buffers=buffers)
                       if group in xl.heads else
                       host_mlp.install_mlp(group, module, plan, device, buffers=buffers) if group in xl.mlps else
                       host_compute.install(group, module, module.quant_method, plan, device, xl.shared,
                                            buffers=buffers))
            xl.compute[group] = experts
            xl.compute_params |= {id(p) for p in params}
            if page_locked is not None and hosts:
                page_locked.release_with(module, hosts, keep_registered=device.type == "cuda")
            how = xl.post_processing.get(group, "")
            served = host_head if group in xl.heads else host_compute  # the head's wrapper, or the experts'
            xl.mechanisms[group] = served.mechanism(experts) + (f"; {how}" if how else "")
            xl.counters[group] = served.live_counters(experts)
            continue
        for p, host in zip(params, hosts):
            if views:
                pinned = page_locked.pinned(host) if page_locked is not None else host.is_pinned()
                if not pinned:
                    raise PlanError(f"{group}: {name} is not page-locked after registration (is_pinned() is false), "
                                    "so the kernel cannot read it through UVA; allow pinned memory, or plan these "
                                    "experts on the device")
                mark_uva_view(p, accelerator_view)
            xl.params.add(id(p))
        if page_locked is not None and hosts:
            # A captured CUDA graph may still read a view after the module is collected.
            page_locked.release_with(module, hosts, keep_registered=views)
        how = xl.post_processing.get(group, "")
        xl.mechanisms[group] = (MECHANISM_VIEW if views else MECHANISM_CPU) + (f"; {how}" if how else "")
    return set(xl.params)


def mark_uva_view(param: nn.Parameter, accelerator_view: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """``param`` becomes a device view of its own page-locked host storage, marked as
    vLLM's UVA offloader marks its parameters (the object stays the same), and the view
    recorded (:func:`is_live_view`)."""
    host = param.data
    param.data = accelerator_view(host)
    setattr(param, UVA_MARKER, True)
    setattr(param, VIEW_RECORD, (param.data_ptr(), layout_of(param.data), host))


def view_again(param: nn.Parameter, name: str, accelerator_view: Callable[[torch.Tensor], torch.Tensor] | None) -> bool:
    """After a reload: whether ``param`` was a UVA view whose data the reload replaced
    (vLLM's ``replace_parameter`` keeps the Parameter object, marker and record included,
    when a post-processing run again gives it new data), and if so, view it again. The new
    bytes are copied into the page-locked host storage the view read, and the view is made
    again over that storage: the same address, so a captured CUDA graph reads the new bytes.
    A reload that changed the weight's shape or dtype cannot be served at that address:
    refused in one line. (vLLM's own ``reload_weights`` copies the reloaded values into
    the tensors it restores, the views themselves, so their parameters stay live views.)"""
    record = getattr(param, VIEW_RECORD, None)
    if record is None or accelerator_view is None or is_live_view(param):
        return False
    host, new = record[2], param.data
    if (new.dtype, tuple(new.shape)) != (host.dtype, tuple(host.shape)):
        raise PlanError(f"{name}: a weight reload made it {new.dtype} {list(new.shape)}, and its UVA view reads "
                        f"{host.dtype} {list(host.shape)} at a fixed address (captured CUDA graphs hold it); "
                        "restart the engine to serve these weights")
    with torch.no_grad():
        host.copy_(new)
    param.data = host
    mark_uva_view(param, accelerator_view)
    return True


def is_live_view(param: nn.Parameter) -> bool:
    """Whether ``param`` still is the UVA view :func:`mark_uva_view` made: the marker is
    checked against the storage, never trusted alone. vLLM's ``replace_parameter`` keeps
    the Parameter object (and so its marker) when a reload gives it new data."""
    record = getattr(param, VIEW_RECORD, None)
    if record is None or not getattr(param, UVA_MARKER, False):
        return False
    return param.data_ptr() == record[0] and layout_of(param.data) == record[1]


def notes_for(xl: ExpertsLoad | None) -> list[str]:
    if xl is None or not xl.transient_bytes:
        return []
    return [f"routed experts post-processed on the device one layer at a time: a transient of up to "
            f"{fmt_bytes(xl.transient_bytes)} of device memory during loading"]
