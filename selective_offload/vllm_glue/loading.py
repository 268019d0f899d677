"""Hooks in vLLM's worker: build, load and wrap the model as the plan says, then report.

One call of ``BaseModelLoader.load_model`` for the main model:

1. before anything is built: what the plan cannot survive is refused (an on-demand tower
   under vLLM's encoder compilation or encoder CUDA graphs; LoRA on a host-gather
   embedding); the plan is checked against the checkpoint; its identity goes into
   ``additional_config`` (vLLM's compile-cache key); when it names hot layers the
   exact-layer prefetch offloader replaces the one the model runner made;
2. construction (``initialize_model``): :class:`ConstructOnHost` routes every allocation of
   a planned cold module to the host, pinned on CUDA, then gives back to the device what
   is shared with hot modules or cached outside the model; unquantized methods of cold
   modules post-process in place (``requires_device_loading = False``);
3. weights load through vLLM's own ``weight_loader``s, straight into host storage;
4. after loading: the embedding becomes a host gather or a UVA view, towers onload on
   demand; the report is built (routing included), logged, written, and raised on in
   strict mode. A user error on the way is written to the report file, then raised.

A speculative drafter's load (recognised as vLLM recognises it: its model config is the
speculative config's draft model config) builds the modules vLLM will replace by the
target's (``embed_tokens``, ``lm_head``) in host memory, so they never take device memory;
the report counts the drafter's own bytes after that sharing, at the main model's first
step. A loader that overrides ``load_model`` never reaches these hooks: it is caught and
reported as a plan that was not applied.
"""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from ..errors import PlanError, UserError
from ..names import EMBED_SEGMENTS, cold_prefix, cold_segment, has_segment
from ..plan_format import COLD_SERVINGS, GroupKind
from ..report import LandingReport, build_report, judge_host_memory
from ..wrappers import offload_on_demand, refuse_if_tied
from ..wrappers.construct_on_host import ConstructOnHost
from ..wrappers.page_locked import PageLockedLedger, PinPolicy, resident_set_bytes, torch_pinned_bytes
from . import experts, host_compute, model_names, preflight, routing
from .auto_plan import plan_at_start
from .caller import check_model, stamp_compile_key
from .embedding import embedding_mode, graphs_captured, install_host_embedding
from .graphs import cap_graphs_at_crossover
from .host_resident import MARK, ONE_MODULE, HostResident, keep_on_host, to_device
from .offloader import make_exact_prefetch_offloader
from .session import Attached, Load, Main, Session, Settings, logger, save_report

GetSession = Callable[[], "Session | None"]


def is_drafter_load(vllm_config, model_config) -> bool:
    """vLLM's own test: a drafter is loaded with the speculative config's draft model config
    (some drafters also swap it into the VllmConfig they pass, so compare with that too)."""
    if model_config is not vllm_config.model_config:
        return True
    spec = vllm_config.speculative_config
    return (spec is not None and model_config is getattr(spec, "draft_model_config", None)
            and model_config is not getattr(spec, "target_model_config", None))


# --------------------------------------------------------------------------- load_model

def make_load_model(get_session: GetSession):
    def wrap(original):
        def load_model(self, vllm_config, model_config, prefix: str = ""):
            s = get_session()
            if s is None or s.active is not None or s.drafting:
                return original(self, vllm_config, model_config, prefix)
            s.loads += 1
            try:
                if is_drafter_load(vllm_config, model_config):
                    return _load_drafter(s, original, self, vllm_config, model_config, prefix)
                return _load_main(s, original, self, vllm_config, model_config, prefix)
            except UserError as exc:
                record_error(s, str(exc), vllm_config)
                raise

        return load_model

    return wrap


def make_override_guard(get_session: GetSession):
    """For a loader class that overrides ``load_model``: the hooks above never run for it,
    so a load through it is reported as a plan that was not applied (strict: an error)."""

    def wrap(original):
        def load_model(self, *args, **kwargs):
            s = get_session()
            if s is None:
                return original(self, *args, **kwargs)
            before = s.loads
            model = original(self, *args, **kwargs)
            if s.loads == before:
                vllm_config = kwargs.get("vllm_config", args[0] if args else None)
                _not_applied(s, f"vLLM's {type(self).__name__} builds and loads the model itself (it overrides "
                                "load_model), so the plan was not applied and nothing was offloaded; use the "
                                "default load format", vllm_config)
            return model

        return load_model

    return wrap


def _not_applied(s: Session, reason: str, vllm_config) -> None:
    device = str(getattr(getattr(vllm_config, "device_config", None), "device", "") or "")
    report = LandingReport.failed(reason, s.settings.plan, device)
    report.error, report.problems = None, [reason]
    if s.settings.options.strict:
        report.error = f"the plan was not realised (strict mode): {reason}"
    s.report = report
    if s.settings.options.report_path:
        save_report(report, s.settings.options.report_path)
    logger.warning("%s", report.render())
    if report.error:
        raise PlanError(report.error)


def _load_main(s: Session, original, loader, vllm_config, model_config, prefix):
    load_config = vllm_config.load_config
    device = torch.device(load_config.device or vllm_config.device_config.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    start_notes: list[str] = []
    if s.settings.auto:  # SELECTIVE_OFFLOAD_PLAN=auto: plan here, from the real card, for this model
        plan, start_notes = plan_at_start(s.settings.options, vllm_config, model_config, device)
        s.settings = Settings(plan, s.settings.options)
    settings = s.settings
    load = Load(settings, device, dtype=str(model_config.dtype).removeprefix("torch."),
                pipeline_ranks=int(getattr(vllm_config.parallel_config, "pipeline_parallel_size", 1) or 1),
                page_locked=PageLockedLedger(pin_policy(s, device)))
    refuse_what_the_plan_cannot_survive(s, vllm_config, device, load.page_locked.policy)
    load.names, names_notes = model_names.names_for(settings.plan, model_config)
    load.experts = experts.ExpertsLoad.of(settings.plan, load.names)
    experts.refuse_before_load(load.experts, device, load.page_locked.policy)
    experts.refuse_another_card(settings.plan, device)
    graphs = cap_graphs_at_crossover(settings.plan, vllm_config, device)
    host_compute.refuse_other_ranks(settings.plan, vllm_config)
    load.notes += start_notes + names_notes + ([graphs] if graphs else [])
    load.notes += check_model(settings.plan, str(model_config.model))
    load.notes += list(settings.plan.load_notes)
    note = stamp_compile_key(settings, vllm_config)
    if note:
        load.notes.append(note)
    offloader = _install_hot_offloader(s, load)
    load.hot_offloader = offloader
    # Both read before vLLM builds anything: construction already holds what it builds (on
    # the host too: vLLM zeroes the experts it makes), which the plan's needs count again.
    load.device_free = preflight.device_free_bytes(device)
    load.host_available = preflight.host_available_bytes()
    load.batched_tokens = preflight.batched_tokens_of(vllm_config)
    s.active = load
    try:
        model = original(loader, vllm_config, model_config, prefix)
    finally:
        s.active = None
    if not load.constructed:
        load.problems.append(
            f"{type(loader).__name__} built the model without vLLM's initialize_model, so cold "
            "modules were not routed to the host at construction"
        )
    if offloader is not None and offloader._wrapped is None:
        load.problems.append(f"vLLM never built the plan's layer stack with make_layers, so its "
                             f"{len(offloader.layer_indices)} hot layers stay on the device")
    cold_params = _attach_cold(s, model, load, vllm_config)
    if load.experts is not None:  # the plan the pre-flight left (auto: perhaps with less device share)
        experts.attach(model, load.experts, load.device, load.page_locked, s.targets.accelerator_view,
                       load.settings.plan)
        for group, host in load.experts.compute.items():  # their counters, live, in the report
            s.attached[group] = Attached(weakref.ref(host), load.experts.mechanisms[group],
                                         live=load.experts.counters[group])
    s.routing = None
    if settings.options.routing:  # counted from the first served step (zeroed after warm-up)
        shares = {g.layer_index: g.device_experts for g in load.settings.plan.groups if g.device_experts}
        s.routing = routing.attach(model, load.device, str(model_config.model), s.targets.vllm_version, shares)
    hot_params = {id(p) for m in getattr(offloader, "offloaded_modules", []) for p in m.parameters()}
    load.drafter_expected = vllm_config.speculative_config is not None
    finish(s, model, load, cold_params, hot_params)
    return model


def pin_policy(s: Session, device: torch.device) -> PinPolicy:
    """vLLM's own pin policy (``is_pin_memory_available``, false under WSL; the
    ``VLLM_WEIGHT_OFFLOADING_DISABLE_PIN_MEMORY`` override) and whether the GPU is
    integrated (one memory with the host)."""
    import vllm.envs as envs

    cuda = device.type == "cuda" and torch.cuda.is_available()
    integrated = cuda and bool(getattr(torch.cuda.get_device_properties(device), "is_integrated", False))
    return PinPolicy.decide(cuda=cuda, pin_available=bool(s.targets.pin_memory_available()),
                            disabled_by_env=bool(envs.VLLM_WEIGHT_OFFLOADING_DISABLE_PIN_MEMORY),
                            integrated=integrated)


def refuse_what_the_plan_cannot_survive(s: Session, vllm_config, device: torch.device,
                                        policy: PinPolicy | None = None) -> None:
    """Settings under which the plan's mechanism would silently not run, refused up front."""
    plan = s.settings.plan
    towers = [g.group for g in plan.groups
              if g.serving in COLD_SERVINGS and not has_segment(g.group, EMBED_SEGMENTS)]
    cc = getattr(vllm_config, "compilation_config", None)
    compiled = [flag for flag in ("compile_mm_encoder", "cudagraph_mm_encoder") if getattr(cc, flag, False)]
    if towers and compiled:
        raise PlanError(f"the plan onloads {towers[0]} on demand, which vLLM's {' and '.join(compiled)} cannot "
                        "run (a compiled or graph-captured encoder skips the hooks that bring its blocks to the "
                        "device); turn them off, or plan that tower on the device (--cold-segments without it)")
    embeds = [g.group for g in plan.groups
              if g.serving in COLD_SERVINGS and has_segment(g.group, EMBED_SEGMENTS)]
    mode = embedding_mode(s.settings.options, device, vllm_config)
    if embeds and getattr(vllm_config, "lora_config", None) is not None and mode == "host":
        raise PlanError(f"LoRA adapters on {embeds[0]} allocate their weights on the embedding weight's device, "
                        "which is the host with the host gather; use embedding_mode='uva' "
                        "(SELECTIVE_OFFLOAD_EMBEDDING=uva) on CUDA, or plan the embedding on the device")
    if embeds and mode == "host" and device.type == "cuda" and graphs_captured(vllm_config):
        raise PlanError(f"the host gather of {embeds[0]} is host work, which a CUDA graph cannot capture, and "
                        "this engine captures CUDA graphs; use SELECTIVE_OFFLOAD_EMBEDDING=uva (or auto), or "
                        "enforce_eager=True")
    if embeds and mode == "uva" and policy is not None and not policy.locks:
        raise PlanError(f"the UVA view of {embeds[0]} needs page-locked host memory, and here {policy.reason}; "
                        "use the host gather (SELECTIVE_OFFLOAD_EMBEDDING=host, with enforce_eager so no CUDA "
                        "graph captures it), or allow pinned memory")


def _install_hot_offloader(s: Session, load: Load):
    plan = s.settings.plan
    layers = plan.hot_layer_indices
    if not layers:
        return None
    if load.device.type != "cuda" or not torch.cuda.is_available():
        load.problems.append(
            f"the plan puts {len(layers)} hot layers on the host, but vLLM's prefetch offloader needs "
            f"CUDA and this worker computes on {load.device}; those layers stay resident"
        )
        return None
    stack = next(g.group.rsplit(".", 1)[0] for g in plan.groups if g.kind == GroupKind.LAYER)
    offloader = make_exact_prefetch_offloader(s.targets.PrefetchOffloader, list(layers), plan.inputs.prefetch_step,
                                              stack, plan.model.num_hidden_layers, page_locked=load.page_locked,
                                              on_post_init=lambda: judge_after_post_init(s, load))
    s.targets.offloader_base.set_offloader(offloader)
    return offloader


# --------------------------------------------------------------------------- the drafter

def _load_drafter(s: Session, original, loader, vllm_config, model_config, prefix):
    """Build the drafter with the modules vLLM will replace by the target's in host memory,
    and count its bytes once that sharing is done (at the main model's first step)."""
    s.drafting = True
    try:
        drafter = original(loader, vllm_config, model_config, prefix)
    finally:
        s.drafting = False
    _keep_what_the_drafter_owns(s, drafter, main_device(s, vllm_config))
    main = s.main
    model = main.model() if main is not None else None
    if model is not None:
        _recount_at_first_step(s, model, drafter)
    return drafter


def main_device(s: Session, vllm_config) -> torch.device:
    if s.main is not None:
        return s.main.load.device
    return torch.device(vllm_config.load_config.device or vllm_config.device_config.device)


def _keep_what_the_drafter_owns(s: Session, drafter: nn.Module, device: torch.device) -> None:
    """An EAGLE drafter whose checkpoint has its own embedding or LM head says so while
    loading (``has_own_embed_tokens`` / ``has_own_lm_head``); vLLM may then keep it, and
    compares it with the target's on one device before deciding. Those go to the device
    now, as vLLM would have built them; what it surely replaces stays on the host."""
    t = s.targets
    own_embed = bool(getattr(drafter, "has_own_embed_tokens", False))
    own_head = bool(getattr(drafter, "has_own_lm_head", False))
    if not (own_embed or own_head):
        return
    for name, module in s.drafter_routed.within(drafter):
        head = isinstance(module, t.ParallelLMHead)
        if (head and own_head) or (not head and own_embed and isinstance(module, t.VocabParallelEmbedding)):
            for p in module.parameters():
                p.data = to_device(p.data, device)
            s.drafter_routed.discard(module)
            if name in s.drafter_routed_modules:
                s.drafter_routed_modules.remove(name)


def _recount_at_first_step(s: Session, model: nn.Module, drafter: nn.Module) -> None:
    drafter_ref = weakref.ref(drafter)
    handle = None

    def recount(_module, _args) -> None:
        handle.remove()
        drafter_now, main = drafter_ref(), s.main
        if drafter_now is None or main is None:
            return
        kept = s.drafter_routed.params(drafter_now)
        for _, p in kept:
            p.data = to_device(p.data, main.load.device)
        if kept:
            main.load.notes.append(
                f"the drafter kept its own {', '.join(n for n, _ in kept[:3])} (vLLM did not share them with the "
                f"target): built in host memory, moved to the device at the first step")
        elif s.drafter_routed_modules:
            main.load.notes.append(
                f"the drafter's {', '.join(s.drafter_routed_modules)} were built in host memory and replaced by "
                "the target's after loading: they took no device memory")
        finish(s, model, main.load, main.cold_params, main.hot_params, drafter=drafter_now)

    handle = model.register_forward_pre_hook(recount)


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


# --------------------------------------------------------------------------- construction

def make_initialize_model(get_session: GetSession):
    def wrap(original):
        def initialize_model(*args, **kwargs):
            s = get_session()
            if s is not None and s.drafting:
                return _construct_drafter(s, original, args, kwargs)
            load = s.active if s is not None else None
            if load is None or load.constructed:
                return original(*args, **kwargs)
            segments = load.cold_segments
            # Pageable allocations of exactly their size; page-locked in place after loading
            # (page_locked.py: pin_memory=True would round each block up to a power of two).
            mode = ConstructOnHost(segments, pin_memory=False,
                                   class_segments={s.targets.VocabParallelEmbedding: EMBED_SEGMENTS[0]},
                                   never=(s.targets.ParallelLMHead,),
                                   **experts.routing_kwargs(load.experts, s.targets.RoutedExperts))
            with mode:
                model = original(*args, **kwargs)
            load.constructed = True
            model_names.refuse_unnamed(model, load.names, load.settings.plan)
            xl = load.experts
            if xl is not None:
                experts.find_modules(model, xl, s.targets.RoutedExperts)
            is_expert = experts.expert_names(model, xl) if xl is not None else (lambda name: False)
            result = mode.finish(model, lambda name: cold_prefix(name, segments) is not None or is_expert(name))
            load.routed_names = result.names
            if result.moved_back_bytes:
                load.notes.append(f"{result.moved_back_bytes} B built under a cold module but shared with the rest "
                                  "of the model (a cached submodule) went back to the device")
            if result.left_on_host_bytes:
                load.problems.append(f"{result.left_on_host_bytes} B built under a cold module are held outside the "
                                     "model and could not be moved back to the device")
            _keep_post_processing_on_host(model, load)
            if xl is not None:
                experts.after_construction(model, xl, result.storages, load.device)
            _preflight(s, load, model, result.storages)
            return model

        return initialize_model

    return wrap


def _preflight(s: Session, load: Load, model: nn.Module, on_host) -> None:
    """Before vLLM loads a byte of weights: what this load is about to hold, against the
    device's free memory and the host's available memory, both read before construction
    (:mod:`.preflight`); under ``auto`` the plan may give up device share to fit."""
    plan = load.settings.plan
    need = preflight.need_of(plan, preflight.built_on_device(model, load.device, set(on_host)), load.batched_tokens)
    fitted, line = preflight.check(plan, need, load.device_free, load.host_available,
                                   load.settings.auto, load.device)
    load.notes.append(line)
    if fitted is not plan:
        load.settings = s.settings = Settings(fitted, load.settings.options)
        if load.settings.options.report_path:  # the plan made at engine start, as it is applied
            fitted.save(Path(load.settings.options.report_path).with_name("plan.json"))


def _construct_drafter(s: Session, original, args, kwargs):
    """The drafter's embedding and LM head (every ``VocabParallelEmbedding``) in host memory:
    vLLM replaces them by the target's after loading, so they need no device memory."""
    t = s.targets
    mode = ConstructOnHost((), force=((t.ParallelLMHead, "lm_head"), (t.VocabParallelEmbedding, "embed_tokens")))
    with mode:
        drafter = original(*args, **kwargs)
    target = torch.get_default_device()  # where vLLM builds (and post-processes) the drafter
    vocab = {n for n, m in drafter.named_modules() if isinstance(m, t.VocabParallelEmbedding)}
    result = mode.finish(drafter, lambda name: any(name == v or name.startswith(v + ".") for v in vocab))
    s.drafter_routed = HostResident()
    routed = sorted(n for n in vocab if all(_ptr(p) in result.storages for p in drafter.get_submodule(n).parameters()))
    for n in routed:
        s.drafter_routed.add(n, drafter.get_submodule(n))
    s.drafter_routed_modules = routed
    # vLLM post-processes the drafter on the device; these stay where they were built.
    keep_on_host([(n, m) for v in routed for n, m in drafter.get_submodule(v).named_modules(prefix=v)], target)
    return drafter


def make_post_process(get_session: GetSession):
    def wrap(original):
        def process_weights_after_loading(model, *args, **kwargs):
            s = get_session()
            load = s.active if s is not None else None
            if load is not None or (s is not None and s.drafting):
                # Bytes as loaded: post-processing may repack a weight into another object
                # (vLLM's CPU build does, for oneDNN), leaving an empty parameter behind.
                sizes = {n: p.numel() * p.element_size() for n, p in model.named_parameters(remove_duplicate=False)}
                if load is not None:
                    load.loaded_bytes = sizes
                else:
                    s.drafter_loaded_bytes = sizes
            return original(model, *args, **kwargs)

        return process_weights_after_loading

    return wrap


def _cold_modules(model: nn.Module, segments) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if n and cold_prefix(n, segments) is not None]


def _keep_post_processing_on_host(model: nn.Module, load: Load) -> None:
    """Keep cold modules and hot layers where they are through ``process_weights_after_loading``
    (:func:`host_resident.keep_on_host`: no device round trip, unless a quant method needs
    the device, and then one module at a time, back to exact-size host memory)."""
    cold = _cold_modules(model, load.cold_segments)
    if load.device.type == "cpu":
        # vLLM's CPU build repacks linear weights for oneDNN and drops the parameter;
        # keep cold modules on plain F.linear so their weights stay parameters the
        # on-demand wrapper moves and the report counts (towers are not hot paths).
        for _, module in cold:
            if getattr(module, "quant_method", None) is not None:
                module._cpu_skip_gemm_dispatch = True
    hot_layers = {id(m) for m in getattr(load.hot_offloader, "offloaded_modules", [])}
    hot = [(f"{name}.{n}" if n else name, m)
           for name, layer in model.named_modules() if id(layer) in hot_layers
           for n, m in layer.named_modules()]

    def record(nbytes: int) -> None:
        load.post_process_transient = max(load.post_process_transient, nbytes)

    load.notes.extend(keep_on_host(cold + hot, load.device, record))


def _post_processing(module: nn.Module) -> str:
    """How the cold module's quant methods post-process, read from the methods themselves."""
    methods = [m.quant_method for m in module.modules() if getattr(m, "quant_method", None) is not None]
    if not methods:
        return ""
    one = [type(m).__name__ for m in methods if getattr(m, MARK, None) == ONE_MODULE]
    vllm = [type(m).__name__ for m in methods if getattr(m, "requires_device_loading", True)]
    if vllm:
        return f"; post-processed through vLLM's device round trip ({vllm[0]})"
    return f"; post-processed on the device, one module at a time ({one[0]})" if one else "; post-processed in place"


# --------------------------------------------------------------------------- after loading

def _hookable(module: nn.Module) -> bool:
    """Whether module hooks run for this module's calls: vLLM's ``@support_torch_compile``
    replaces a class's ``__call__`` with one that calls ``forward`` directly."""
    return type(module).__call__ is nn.Module.__call__


def _attach_tower(module: nn.Module, name: str, device: torch.device,
                  page_locked: PageLockedLedger | None = None) -> tuple[Any, str]:
    if not _hookable(module):
        raise PlanError(f"{name} ({type(module).__name__}) is compiled by vLLM (@support_torch_compile replaces "
                        "its __call__, so module hooks never run) and cannot be onloaded on demand; plan it on "
                        "the device (--cold-segments without its segment)")
    lock = dict(page_locked=page_locked, name=name) if page_locked else {}
    wrapper = offload_on_demand(module, device=device, **lock)
    blocks = wrapper.block_list_name
    if blocks and not all(_hookable(b) for b in wrapper.block_list):
        wrapper.detach()
        wrapper = offload_on_demand(module, device=device, blocks=None, **lock)
        compiled = type(next(b for b in module.get_submodule(blocks) if not _hookable(b))).__name__
        return wrapper, (f"on demand, whole: its blocks ({compiled}) are compiled by vLLM and skip module "
                         "hooks, so they cannot onload one by one")
    return wrapper, f"on demand, block by block ({blocks})" if blocks else "on demand, whole"


def whole_tower_over_budget(plan, group: str, mechanism: str) -> list[str]:
    """A tower onloaded whole holds all of it on the device while it runs: a problem when
    the plan budgeted less (it counted two blocks, not knowing vLLM compiles them)."""
    if not mechanism.startswith("on demand, whole"):
        return []
    found = plan.group_of(group)
    planned = found.bytes if found is not None else 0
    if planned <= plan.est_transient_device_bytes:
        return []
    return [f"{group} onloads whole ({planned} B while it runs) but the plan budgets {plan.est_transient_device_bytes} "
            "B of tower transient; make the plan again (this model's tower is budgeted whole now), or plan the "
            "tower on the device"]


def _attach_cold(s: Session, model: nn.Module, load: Load, vllm_config) -> set[int]:
    """Give each planned cold module its runtime wrapper; return the ids of host params."""
    t = s.targets
    segments = load.cold_segments
    roots = [(n, m) for n, m in _cold_modules(model, segments) if cold_prefix(n, segments) == n]
    heads = [(n, m) for n, m in model.named_modules() if isinstance(m, t.ParallelLMHead)]
    plan_groups = {cold_segment(load.names.model_name(g), segments): g for g in load.settings.plan.cold_on_host_groups}
    mode = embedding_mode(load.settings.options, load.device, vllm_config)
    owned: set[int] = set()
    s.attached.clear()
    for name, module in roots:
        group = plan_groups.get(cold_segment(name, segments), name)
        host_before = [p.data for p in module.parameters() if p.device.type == "cpu"]
        if isinstance(module, t.VocabParallelEmbedding) and not isinstance(module, t.ParallelLMHead):
            for head_name, head in heads:
                refuse_if_tied(module, head, embedding_name=name, lm_head_name=head_name)
            wrapper, mechanism = install_host_embedding(module, load.device, mode, t.accelerator_view,
                                                        load.page_locked, group)
            events, host_bytes = None, module.weight.numel() * module.weight.element_size()
        else:
            wrapper, mechanism = _attach_tower(module, group, load.device, load.page_locked)
            events, host_bytes = wrapper.events, wrapper.stats.host_bytes
            load.problems.extend(whole_tower_over_budget(load.settings.plan, group, mechanism))
        if load.page_locked is not None:  # unlocked when vLLM releases the model
            # A UVA view's table stays registered: a captured CUDA graph may hold its address.
            uva = any(getattr(p, "_selective_offload_uva", False) for p in module.parameters())
            load.page_locked.release_with(module, host_before + [p.data for p in module.parameters()
                                                                 if p.device.type == "cpu"], keep_registered=uva)
        s.attached[group] = Attached(weakref.ref(wrapper), mechanism + _post_processing(module),
                                     getattr(wrapper, "ledger", None), events, host_bytes)
        owned |= {id(p) for p in module.parameters()
                  if p.device.type == "cpu" or getattr(p, "_selective_offload_uva", False)}
    return owned


def record_error(s: Session, error: str, vllm_config) -> None:
    """Write a user error to the report file, so the calling process can raise it."""
    device = str(getattr(getattr(vllm_config, "device_config", None), "device", "") or "")
    existing = s.report if s.report is not None and s.report.error == error else None
    report = existing or LandingReport.failed(error, s.settings.plan, device)
    report.error = error
    s.report = report
    if s.settings.options.report_path:
        save_report(report, s.settings.options.report_path)


def judge_after_post_init(s: Session, load: Load) -> None:
    """The prefetch offloader's ``post_init`` ran (hot layers page-locked at their final,
    exact size, torch's cached pinned blocks released): the report again, host memory
    judged now (strict mode raises here, before the engine serves)."""
    load.post_init_done = True
    main = s.main
    model = main.model() if main is not None and main.load is load else None
    if model is not None:
        finish(s, model, load, main.cold_params, main.hot_params)


def finish(s: Session, model: nn.Module, load: Load, cold_params: set[int], hot_params: set[int],
           drafter: nn.Module | None = None) -> None:
    """Build the report, log and write it; raise in strict mode when it is not ok."""
    s.main = Main(weakref.ref(model), load, cold_params, hot_params)
    settings = load.settings
    xl = load.experts
    report = build_report(model, settings.plan, compute_device=load.device,
                          cold_on_host_params=cold_params, prefetch_params=hot_params,
                          routed_names=load.routed_names, notes=list(load.notes) + experts.notes_for(xl),
                          drafter=drafter, drafter_expected=load.drafter_expected,
                          loaded_bytes=load.loaded_bytes, drafter_loaded_bytes=s.drafter_loaded_bytes,
                          mechanisms={**{g: a.mechanism for g, a in s.attached.items()},
                                      **(xl.mechanisms if xl is not None else {})},
                          pipeline_part=load.pipeline_ranks > 1,
                          uva_params=xl.params if xl is not None else frozenset(),
                          host_compute_params=xl.compute_params if xl is not None else frozenset(),
                          routed_uva_params=xl.routed if xl is not None else None, names=load.names)
    report.problems[:0] = load.problems
    report.transfers = s.transfers()
    if s.routing is not None:
        report.routing = s.routing.as_report()
    if load.post_process_transient:
        report.notes.append(f"post-processing on the device took a transient of up to "
                            f"{load.post_process_transient} B (one host module at a time)")
    if load.hot_offloader is not None and not load.post_init_done:
        # vLLM's prefetch offloader settles the hot layers' host storage in post_init
        # (after this load): page-locked memory is judged then (judge_after_post_init).
        report.notes.append("page-locked host memory is judged after the prefetch offloader's post_init")
    elif load.page_locked is not None:
        ledger = load.page_locked
        judge_host_memory(report, policy=str(ledger.policy.path), reason=ledger.policy.reason,
                          locked_by_how=ledger.by_how(), locked_by_purpose=ledger.by_purpose(),
                          torch_pinned_bytes=torch_pinned_bytes(), resident_set_bytes=resident_set_bytes())
    if report.loaded_cold_on_host_bytes != report.planned_cold_on_host_bytes and report.planned_cold_on_host_bytes:
        report.notes.append(f"vLLM holds the cold groups in {load.dtype or 'its dtype'}: "
                            f"{report.loaded_cold_on_host_bytes / report.planned_cold_on_host_bytes:.2f}x the "
                            "checkpoint bytes the plan counts")
    if not report.ok and settings.options.strict:
        report.error = "the plan was not realised (strict mode): " + "; ".join(report.problems)
    s.report = report
    if settings.options.report_path:
        save_report(report, settings.options.report_path)
    text = report.render()
    if report.ok:
        logger.info("%s", text)
        return
    logger.warning("%s", text)
    if report.error:
        raise PlanError(report.error)
