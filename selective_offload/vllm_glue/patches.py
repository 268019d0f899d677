"""The hooks into vLLM that realise a plan, and the report that proves it.

In the process that starts the engine (``LLM(...)``, ``vllm serve``'s API server), before
any engine process exists:

0. the plan is checked against the checkpoint vLLM was asked to load (a plan for another
   model is an error the user sees last, not buried in a worker's traceback); if the
   engine then fails to start because of the plan, the worker's one-line reason, read
   from the report file, is raised instead of vLLM's generic "Engine core initialization
   failed".

Inside a vLLM worker (one call of ``BaseModelLoader.load_model`` for the main model; a
speculative drafter's later call is counted, not changed):

1. before anything is built: the plan is checked again, and when it names hot layers the
   exact-layer prefetch offloader replaces the one the model runner made
   (``set_offloader``), so the ``make_layers`` call inside construction hands it the
   decoder layers;
2. construction (``initialize_model``): :class:`ConstructOnHost` routes every allocation of
   a planned cold module to the host, pinned on CUDA, and keeps a ledger of what it
   routed; the cold modules' unquantized methods are told to post-process in place
   (``requires_device_loading = False``), so ``process_weights_after_loading`` does not
   copy them to the device and back;
3. weights load through vLLM's own ``weight_loader``s, straight into host storage;
4. after loading: the embedding's lookup becomes a host row gather (eager) or a read
   through a UVA device view (when CUDA graphs are captured); towers get on-demand onload;
   the placement report is built (routing included), logged, written, and raised on in
   strict mode. A user error on the way is written to the report file, then raised.

All state lives in one :class:`Session`, made by :func:`apply` and dropped by
:func:`remove`; :mod:`.compat` resolves every hook target before the first is touched.
The wrappers' state (a gather's staging buffer, a tower's hooks) belongs to the modules
they wrap and goes when the model goes.
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from ..checkpoint import load_checkpoint
from ..errors import PlanError, UserError
from ..model_match import check_plan_matches_model
from ..names import EMBED_SEGMENTS, cold_prefix, cold_segment
from ..options import RunOptions
from ..plan import Plan
from ..report import PlacementReport, build_report
from ..wrappers import HostGather, offload_on_demand, refuse_if_tied
from ..wrappers.construct_on_host import ConstructOnHost
from .compat import Targets
from .offloader import make_exact_prefetch_offloader

try:  # vLLM's logger, so lines carry its format and reach its handlers in workers.
    from vllm.logger import init_logger

    logger = init_logger("vllm.selective_offload")
except ImportError:  # pragma: no cover - this module is only imported with vLLM present
    import logging

    logger = logging.getLogger("selective_offload")


@dataclass(frozen=True)
class Settings:
    plan: Plan
    options: RunOptions

    @property
    def host_cold_segments(self) -> frozenset[str]:
        segments = self.plan.inputs.cold_segments
        return frozenset(cold_segment(g, segments) for g in self.plan.host_cold_groups) - {None}


@dataclass
class _Load:
    """What one main-model load did, for the report."""

    settings: Settings
    device: torch.device
    constructed: bool = False
    routed_storages: set[int] = field(default_factory=set)
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    drafter_expected: bool = False
    loaded_bytes: dict[str, int] = field(default_factory=dict)
    dtype: str = ""


@dataclass
class _Attached:
    """A wrapper the glue attached to a cold group. The wrapper belongs to the model and is
    held weakly; its counters (a small ledger, and a tower's last-call events) are kept, so
    they can still be reported after the model is gone."""

    wrapper: "weakref.ref[Any]"
    mechanism: str
    ledger: Any = None
    events: list | None = None
    host_bytes: int = 0

    def counters(self) -> dict[str, Any]:
        if self.ledger is None:
            return {}
        wrapper = self.wrapper()
        if wrapper is not None and hasattr(wrapper, "stats") and not callable(wrapper.stats):
            self.host_bytes = wrapper.stats.host_bytes  # a tower: host bytes as they are now
        out = vars(self.ledger.snapshot(self.host_bytes)).copy()
        if self.events is not None:
            out["last_call_events"] = [list(e) for e in self.events]
        return out


@dataclass
class _Main:
    """The last main model loaded in this process, for the drafter's turn and live counters."""

    model: "weakref.ref[nn.Module]"
    load: _Load
    cold_params: set[int]
    hot_params: set[int]


@dataclass
class Session:
    """Everything the glue holds between :func:`apply` and :func:`remove`."""

    settings: Settings
    targets: Targets
    #: (owner, attribute) -> the original object, restored by :func:`remove`.
    originals: dict[tuple[Any, str], Any] = field(default_factory=dict)
    active: _Load | None = None
    main: _Main | None = None
    attached: dict[str, _Attached] = field(default_factory=dict)
    report: PlacementReport | None = None

    def transfers(self) -> dict[str, dict[str, Any]]:
        """Each attached wrapper's counters, now."""
        return {group: c for group, a in self.attached.items() if (c := a.counters())}

    def live_report(self) -> PlacementReport | None:
        """The report of the model loaded in this process, with the counters as they are now."""
        if self.report is None:
            return None
        self.report.transfers = self.transfers()
        self.report.transfers_as_of = "now"
        if self.settings.options.report_path:
            self.report.save(self.settings.options.report_path)  # the file keeps the latest counters
        return self.report


_session: Session | None = None
#: The gathers behind the custom op, by handle (the op takes an int, not an object). Held
#: weakly: each embedding layer holds its own gather, so its staging buffer lives exactly
#: as long as the model.
_gathers: "weakref.WeakValueDictionary[int, HostGather]" = weakref.WeakValueDictionary()
_handles = itertools.count()


def session() -> Session | None:
    return _session


# --------------------------------------------------------------------------- custom op

@torch.library.custom_op("selective_offload::host_gather", mutates_args=())
def _host_gather_op(ids: torch.Tensor, weight: torch.Tensor, handle: int) -> torch.Tensor:
    """Opaque to torch.compile: the gather's host work and staging buffer stay out of graphs."""
    return _gathers[handle](weight, ids)


@_host_gather_op.register_fake
def _(ids: torch.Tensor, weight: torch.Tensor, handle: int) -> torch.Tensor:
    return ids.new_empty((*ids.shape, weight.shape[-1]), dtype=weight.dtype)


# --------------------------------------------------------------------------- apply / remove

def _hooks(targets: Targets) -> list[tuple[Any, str, Callable]]:
    return [
        (targets.BaseModelLoader, "load_model", _make_load_model),
        (targets.base_loader, "initialize_model", _make_initialize_model),
        (targets.base_loader, "process_weights_after_loading", _make_post_process),
        (targets.MPClient, "__init__", _make_engine_start),
    ]


def apply(settings: Settings, targets: Targets) -> Session:
    """Install the hooks (or swap the settings when they are installed already)."""
    global _session
    if _session is not None:
        # A new plan for the engines started from now on: nothing of the last one carries over.
        _session.settings, _session.report, _session.main = settings, None, None
        _session.attached.clear()
        return _session
    new = Session(settings, targets)
    for owner, attr, make in _hooks(targets):
        original = getattr(owner, attr)
        new.originals[(owner, attr)] = original
        setattr(owner, attr, make(original))
    _session = new
    return new


def remove() -> None:
    """Restore every hooked object and drop the session (idempotent)."""
    global _session
    if _session is None:
        return
    for (owner, attr), original in _session.originals.items():
        setattr(owner, attr, original)
    _session = None


def is_applied() -> bool:
    return _session is not None


# --------------------------------------------------------------------------- the calling process

def _make_engine_start(original):
    """``MPClient.__init__``: runs in the process that starts the engine, before it exists."""

    def __init__(self, *args, **kwargs):
        s = _session
        if s is None:
            return original(self, *args, **kwargs)
        vllm_config = kwargs.get("vllm_config", args[1] if len(args) > 1 else None)
        model = getattr(getattr(vllm_config, "model_config", None), "model", None)
        if model is not None:
            for note in check_model(s.settings.plan, str(model)):
                logger.info("selective-offload: %s", note)
        report_path = s.settings.options.report_path
        if report_path:
            Path(report_path).unlink(missing_ok=True)  # a stale report must not speak for this engine
        try:
            return original(self, *args, **kwargs)
        except Exception:
            reason = worker_error(report_path)
            if reason is None:
                raise
        raise PlanError(reason)

    return __init__


def check_model(plan: Plan, model: str) -> list[str]:
    """Check ``plan`` against the checkpoint at ``model`` when it is a local directory."""
    if not Path(model).is_dir():
        return [f"{model} is not a local directory: the plan is checked against the loaded model only"]
    return check_plan_matches_model(plan, load_checkpoint(model))


def worker_error(report_path: str | None) -> str | None:
    """The user error a worker wrote to the report file, if any."""
    if not report_path or not Path(report_path).is_file():
        return None
    try:
        return PlacementReport.load(report_path).error
    except PlanError:
        return None


# --------------------------------------------------------------------------- worker hooks

def _make_load_model(original):
    def load_model(self, vllm_config, model_config, prefix: str = ""):
        s = _session
        if s is None or s.active is not None:
            return original(self, vllm_config, model_config, prefix)
        try:
            if model_config is not vllm_config.model_config:
                return _load_drafter(s, original, self, vllm_config, model_config, prefix)
            return _load_main(s, original, self, vllm_config, model_config, prefix)
        except UserError as exc:
            _record_error(s, str(exc), vllm_config)
            raise

    return load_model


def _load_drafter(s: Session, original, loader, vllm_config, model_config, prefix):
    """A speculative drafter (an MTP head): the plan keeps it resident; the report is made
    again with its parameters counted for the plan's MTP group."""
    drafter = original(loader, vllm_config, model_config, prefix)
    main = s.main
    model = main.model() if main is not None else None
    if model is not None:
        _finish(s, model, main.load, main.cold_params, main.hot_params, drafter=drafter)
    return drafter


def _load_main(s: Session, original, loader, vllm_config, model_config, prefix):
    settings = s.settings
    load_config = vllm_config.load_config
    device = torch.device(load_config.device or vllm_config.device_config.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    load = _Load(settings, device, dtype=str(model_config.dtype).removeprefix("torch."))
    load.notes += check_model(settings.plan, str(model_config.model))
    load.notes += list(settings.plan.load_notes)
    offloader = _install_hot_offloader(s, load)
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
    cold_params = _attach_cold(s, model, load, vllm_config)
    hot_params = {id(p) for m in getattr(offloader, "offloaded_modules", []) for p in m.parameters()}
    load.drafter_expected = vllm_config.speculative_config is not None
    _finish(s, model, load, cold_params, hot_params)
    return model


def _make_initialize_model(original):
    def initialize_model(*args, **kwargs):
        s = _session
        load = s.active if s is not None else None
        if load is None or load.constructed:
            return original(*args, **kwargs)
        mode = ConstructOnHost(load.settings.host_cold_segments,
                               pin_memory=load.device.type == "cuda",
                               class_segments={s.targets.VocabParallelEmbedding: EMBED_SEGMENTS[0]},
                               never=(s.targets.ParallelLMHead,))
        with mode:
            model = original(*args, **kwargs)
        load.constructed = True
        load.routed_storages = mode.routed_storages(model)
        _keep_post_processing_on_host(model, load)
        return model

    return initialize_model


def _make_post_process(original):
    def process_weights_after_loading(model, *args, **kwargs):
        s = _session
        load = s.active if s is not None else None
        if load is not None:
            # Bytes as loaded: post-processing may repack a weight into another object
            # (vLLM's CPU build does, for oneDNN), leaving an empty parameter behind.
            load.loaded_bytes = {n: p.numel() * p.element_size()
                                 for n, p in model.named_parameters(remove_duplicate=False)}
        return original(model, *args, **kwargs)

    return process_weights_after_loading


def _cold_modules(model: nn.Module, segments) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if n and cold_prefix(n, segments) is not None]


def _keep_post_processing_on_host(model: nn.Module, load: _Load) -> None:
    """Stop ``process_weights_after_loading`` from copying cold modules to the device.

    vLLM wraps each quant method's post-processing in ``device_loading_context``, which
    moves CPU parameters to the device and back. Unquantized methods can post-process in
    place, so they are told not to; a quantized method keeps its per-module round trip
    (a transient of one module, noted in the report).
    """
    for name, module in _cold_modules(model, load.settings.host_cold_segments):
        method = getattr(module, "quant_method", None)
        if method is None:
            continue
        if load.device.type == "cpu":
            # vLLM's CPU build repacks linear weights for oneDNN and drops the parameter;
            # keep cold modules on plain F.linear so their weights stay parameters the
            # on-demand wrapper moves and the report counts (towers are not hot paths).
            module._cpu_skip_gemm_dispatch = True
        if type(method).__name__ in ("UnquantizedEmbeddingMethod", "UnquantizedLinearMethod"):
            method.requires_device_loading = False
        elif getattr(method, "requires_device_loading", False):
            load.notes.append(f"{name}: {type(method).__name__} post-processes on the device, one "
                              "module at a time (a transient of that module's size)")


def _post_processing(module: nn.Module) -> str:
    """How the cold module's quant methods post-process, read from the methods themselves."""
    methods = [m.quant_method for m in module.modules() if getattr(m, "quant_method", None) is not None]
    if not methods:
        return ""
    on_device = [type(m).__name__ for m in methods if getattr(m, "requires_device_loading", True)]
    return ("; post-processed in place" if not on_device
            else f"; post-processed on the device ({on_device[0]})")


def _install_hot_offloader(s: Session, load: _Load):
    layers = s.settings.plan.hot_layer_indices
    if not layers:
        return None
    if load.device.type != "cuda" or not torch.cuda.is_available():
        load.problems.append(
            f"the plan puts {len(layers)} hot layers on the host, but vLLM's prefetch offloader needs "
            f"CUDA and this worker computes on {load.device}; those layers stay resident"
        )
        return None
    offloader = make_exact_prefetch_offloader(s.targets.PrefetchOffloader, list(layers),
                                              s.settings.plan.inputs.prefetch_step)
    s.targets.offloader_base.set_offloader(offloader)
    return offloader


def _embedding_mode(options: RunOptions, device: torch.device, vllm_config) -> str:
    if options.embedding_mode != "auto":
        return options.embedding_mode
    eager = bool(getattr(vllm_config.model_config, "enforce_eager", False))
    return "uva" if device.type == "cuda" and not eager else "host"


def _attach_cold(s: Session, model: nn.Module, load: _Load, vllm_config) -> set[int]:
    """Give each planned cold module its runtime wrapper; return the ids of host params."""
    segments = load.settings.host_cold_segments
    roots = [(n, m) for n, m in _cold_modules(model, segments) if cold_prefix(n, segments) == n]
    heads = [(n, m) for n, m in model.named_modules() if isinstance(m, s.targets.ParallelLMHead)]
    plan_groups = {cold_segment(g, segments): g for g in load.settings.plan.host_cold_groups}
    owned: set[int] = set()
    s.attached.clear()
    for name, module in roots:
        group = plan_groups.get(cold_segment(name, segments), name)
        if isinstance(module, s.targets.VocabParallelEmbedding) and not isinstance(module, s.targets.ParallelLMHead):
            for head_name, head in heads:
                refuse_if_tied(module, head, embedding_name=name, lm_head_name=head_name)
            wrapper, mechanism = _install_host_embedding(s, module, load, vllm_config)
            events, host_bytes = None, module.weight.numel() * module.weight.element_size()
        else:
            wrapper = offload_on_demand(module, device=load.device)
            blocks = wrapper.block_list_name
            mechanism = f"on demand, block by block ({blocks})" if blocks else "on demand, whole"
            events, host_bytes = wrapper.events, wrapper.stats.host_bytes
        s.attached[group] = _Attached(weakref.ref(wrapper), mechanism + _post_processing(module),
                                      getattr(wrapper, "ledger", None), events, host_bytes)
        owned |= {id(p) for p in module.parameters()
                  if p.device.type == "cpu" or getattr(p, "_selective_offload_uva", False)}
    return owned


def _install_host_embedding(s: Session, layer: nn.Module, load: _Load, vllm_config) -> tuple[Any, str]:
    weight = layer.weight
    if weight.device.type != "cpu":
        weight.data = weight.data.to("cpu")
    if _embedding_mode(load.settings.options, load.device, vllm_config) == "uva":
        # The weight itself becomes a device view of pinned host memory: vLLM's own lookup
        # (F.embedding) then reads the rows over the link, inside CUDA graphs too.
        host = weight.data if weight.data.is_pinned() else weight.data.pin_memory()
        weight.data = s.targets.accelerator_view(host)
        weight._selective_offload_uva = True
        return weight, "UVA view (the gather kernel reads rows over the link)"
    gather = HostGather(load.device)
    handle = next(_handles)
    _gathers[handle] = gather
    layer._selective_offload_gather = gather  # the layer owns its gather and staging buffer

    def embedding(layer_: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return torch.ops.selective_offload.host_gather(ids, layer_.weight, handle)

    # An instance attribute shadows UnquantizedEmbeddingMethod.embedding: the vocab-parallel
    # masking in VocabParallelEmbedding.forward stays vLLM's.
    layer.quant_method.embedding = embedding
    return gather, "host gather (one row per token crosses the link)"


def _rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _record_error(s: Session, error: str, vllm_config) -> None:
    """Write a user error to the report file, so the calling process can raise it."""
    path = s.settings.options.report_path
    device = str(getattr(getattr(vllm_config, "device_config", None), "device", "") or "")
    existing = s.report if s.report is not None and s.report.error == error else None
    report = existing or PlacementReport.failed(error, s.settings.plan, device)
    report.error = error
    s.report = report
    if path:
        try:
            report.save(path)
        except OSError as exc:  # the reason must still reach the user, through the raise
            logger.error("selective-offload: cannot write %s: %s", path, exc)


def _finish(s: Session, model: nn.Module, load: _Load, cold_params: set[int], hot_params: set[int],
            drafter: nn.Module | None = None) -> None:
    s.main = _Main(weakref.ref(model), load, cold_params, hot_params)
    settings = load.settings
    report = build_report(model, settings.plan, compute_device=load.device,
                          host_cold_params=cold_params, host_hot_params=hot_params,
                          routed_storages=load.routed_storages, notes=load.notes,
                          drafter=drafter, drafter_expected=load.drafter_expected,
                          loaded_bytes=load.loaded_bytes,
                          mechanisms={g: a.mechanism for g, a in s.attached.items()})
    report.problems[:0] = load.problems
    report.transfers = s.transfers()
    if report.loaded_host_cold_bytes != report.planned_host_cold_bytes and report.planned_host_cold_bytes:
        report.notes.append(f"vLLM holds the cold groups in {load.dtype or 'its dtype'}: "
                            f"{report.loaded_host_cold_bytes / report.planned_host_cold_bytes:.2f}x the "
                            "checkpoint bytes the plan counts")
    if not report.ok and settings.options.strict:
        report.error = "the plan was not realised (strict mode): " + "; ".join(report.problems)
    s.report = report
    if settings.options.report_path and _rank() == 0:
        report.save(settings.options.report_path)
    text = report.render()
    if report.ok:
        logger.info("%s", text)
        return
    logger.warning("%s", text)
    if report.error:
        raise PlanError(report.error)
