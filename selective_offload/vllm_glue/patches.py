"""The hooks into vLLM's model loading that realise a plan, and the report that proves it.

Lifecycle inside a vLLM worker (one call of ``BaseModelLoader.load_model`` for the main
model; a speculative drafter's later call is left alone):

1. before anything is built: the plan is checked against the checkpoint's headers (a plan
   for another model is an error), and when it names hot layers the exact-layer prefetch
   offloader replaces the one the model runner made (``set_offloader``), so the
   ``make_layers`` call inside construction hands it the decoder layers;
2. construction (``initialize_model``): :class:`ConstructOnHost` routes every allocation of
   a planned cold module to the host, pinned on CUDA; the cold modules' unquantized
   methods are told to post-process in place (``requires_device_loading = False``), so
   ``process_weights_after_loading`` does not copy them to the device and back;
3. weights load through vLLM's own ``weight_loader``s, straight into host storage;
4. after loading: the embedding's lookup becomes a host row gather (eager) or a read
   through a UVA device view (when CUDA graphs are captured); towers get on-demand onload;
   the placement report is built, logged, written, and raised on in strict mode.

Every hook is installed by :func:`apply` and removed by :func:`remove`; both are
idempotent, and :mod:`.compat` resolves all targets before the first one is touched.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..checkpoint import load_checkpoint
from ..errors import PlanError
from ..planner import Plan, group_tensors
from ..report import PlacementReport, build_report, check_plan_matches, group_key
from ..wrappers import HostGather, offload_on_demand, refuse_if_tied
from ..wrappers.construct_on_host import ConstructOnHost, cold_prefix_of
from .compat import Targets
from .offloader import make_exact_prefetch_offloader

try:  # vLLM's logger, so lines carry its format and reach its handlers in workers.
    from vllm.logger import init_logger

    logger = init_logger("vllm.selective_offload")
except ImportError:  # pragma: no cover - this module is only imported with vLLM present
    import logging

    logger = logging.getLogger("selective_offload")

EMBEDDING_MODES = ("auto", "host", "uva")


@dataclass(frozen=True)
class Settings:
    plan: Plan
    plan_path: str
    strict: bool = False
    report_path: str | None = None
    #: ``host`` gather, ``uva`` device view, or ``auto``: UVA when CUDA graphs are
    #: captured (a host gather is host work and cannot be in a graph), host otherwise.
    embedding_mode: str = "auto"

    @property
    def host_cold_segments(self) -> frozenset[str]:
        segments = self.plan.inputs["cold_segments"]
        return frozenset(group_key(g.group, segments)[1] for g in self.plan.groups
                         if g.placement == "host-cold")


@dataclass
class _Load:
    """What one main-model load did, for the report."""

    settings: Settings
    device: torch.device
    constructed: bool = False
    routed: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    drafter_expected: bool = False
    loaded_bytes: dict[str, int] = field(default_factory=dict)
    dtype: str = ""


_settings: Settings | None = None
_targets: Targets | None = None
_originals: dict[str, object] = {}
_active: _Load | None = None
#: The last main-model load (model, load, cold params, hot params), for the drafter's turn.
_main: tuple | None = None
#: The gathers behind the custom op, by handle (the op takes an int, not an object).
_gathers: list[HostGather] = []
#: Handles of what the last load attached, so tests and `remove` can inspect or undo it.
last_report: PlacementReport | None = None
attached: dict[str, object] = {}
attached_modules: dict[str, nn.Module] = {}


# --------------------------------------------------------------------------- custom op

@torch.library.custom_op("selective_offload::host_gather", mutates_args=())
def _host_gather_op(ids: torch.Tensor, weight: torch.Tensor, handle: int) -> torch.Tensor:
    """Opaque to torch.compile: the gather's host work and staging buffer stay out of graphs."""
    return _gathers[handle](weight, ids)


@_host_gather_op.register_fake
def _(ids: torch.Tensor, weight: torch.Tensor, handle: int) -> torch.Tensor:
    return ids.new_empty((*ids.shape, weight.shape[-1]), dtype=weight.dtype)


# --------------------------------------------------------------------------- apply / remove

def apply(settings: Settings, targets: Targets) -> None:
    """Install the hooks (or just swap the settings when they are installed already)."""
    global _settings, _targets
    _settings, _targets = settings, targets
    if _originals:
        return
    loader_cls = targets.BaseModelLoader
    _originals["load_model"] = loader_cls.load_model
    _originals["initialize_model"] = targets.base_loader.initialize_model
    _originals["process_weights_after_loading"] = targets.base_loader.process_weights_after_loading
    loader_cls.load_model = _make_load_model(_originals["load_model"])
    targets.base_loader.initialize_model = _make_initialize_model(_originals["initialize_model"])
    targets.base_loader.process_weights_after_loading = _make_post_process(
        _originals["process_weights_after_loading"])


def remove() -> None:
    global _settings
    if _originals and _targets is not None:
        _targets.BaseModelLoader.load_model = _originals.pop("load_model")
        _targets.base_loader.initialize_model = _originals.pop("initialize_model")
        _targets.base_loader.process_weights_after_loading = _originals.pop("process_weights_after_loading")
    _settings = None


def is_applied() -> bool:
    return bool(_originals) and _settings is not None


# --------------------------------------------------------------------------- hooks

def _make_load_model(original):
    def load_model(self, vllm_config, model_config, prefix: str = ""):
        global _active
        settings = _settings
        if settings is None or _active is not None:
            return original(self, vllm_config, model_config, prefix)
        if model_config is not vllm_config.model_config:
            # A speculative drafter (an MTP head): the plan keeps it resident; the report
            # is made again with its parameters counted for the plan's MTP group.
            drafter = original(self, vllm_config, model_config, prefix)
            if _main is not None:
                _finish(*_main, drafter=drafter)
            return drafter
        _check_against_checkpoint(settings.plan, model_config.model)
        load_config = vllm_config.load_config
        device = torch.device(load_config.device or vllm_config.device_config.device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        load = _Load(settings, device, dtype=str(model_config.dtype).removeprefix("torch."))
        offloader = _install_hot_offloader(settings, load)
        _active = load
        try:
            model = original(self, vllm_config, model_config, prefix)
        finally:
            _active = None
        if not load.constructed:
            load.problems.append(
                f"{type(self).__name__} built the model without vLLM's initialize_model, so cold "
                "modules were not routed to the host at construction"
            )
        cold_params = _attach_cold(model, load, vllm_config)
        hot_params = {id(p) for m in getattr(offloader, "offloaded_modules", []) for p in m.parameters()}
        load.drafter_expected = vllm_config.speculative_config is not None
        _finish(model, load, cold_params, hot_params)
        return model

    return load_model


def _make_initialize_model(original):
    def initialize_model(*args, **kwargs):
        load = _active
        if load is None or load.constructed:
            return original(*args, **kwargs)
        mode = ConstructOnHost(load.settings.host_cold_segments,
                               pin_memory=load.device.type == "cuda",
                               class_segments={_targets.VocabParallelEmbedding: "embed_tokens"},
                               never=(_targets.ParallelLMHead,))
        with mode:
            model = original(*args, **kwargs)
        load.constructed = True
        load.routed = dict(mode.routed)
        _keep_post_processing_on_host(model, load)
        return model

    return initialize_model


def _make_post_process(original):
    def process_weights_after_loading(model, *args, **kwargs):
        load = _active
        if load is not None:
            # Bytes as loaded: post-processing may repack a weight into another object
            # (vLLM's CPU build does, for oneDNN), leaving an empty parameter behind.
            load.loaded_bytes = {n: p.numel() * p.element_size()
                                 for n, p in model.named_parameters(remove_duplicate=False)}
        return original(model, *args, **kwargs)

    return process_weights_after_loading


def _keep_post_processing_on_host(model: nn.Module, load: _Load) -> None:
    """Stop ``process_weights_after_loading`` from copying cold modules to the device.

    vLLM wraps each quant method's post-processing in ``device_loading_context``, which
    moves CPU parameters to the device and back. Unquantized methods can post-process in
    place, so they are told not to; a quantized method keeps its per-module round trip
    (a transient of one module, noted in the report).
    """
    segments = load.settings.host_cold_segments
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is None or cold_prefix_of(name, segments) is None:
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


def _install_hot_offloader(settings: Settings, load: _Load):
    layers = settings.plan.hot_layer_indices
    if not layers:
        return None
    if load.device.type != "cuda" or not torch.cuda.is_available():
        load.problems.append(
            f"the plan puts {len(layers)} hot layers on the host, but vLLM's prefetch offloader needs "
            f"CUDA and this worker computes on {load.device}; those layers stay resident"
        )
        return None
    offloader = make_exact_prefetch_offloader(_targets.PrefetchOffloader, layers,
                                              settings.plan.inputs["prefetch_step"])
    _targets.offloader_base.set_offloader(offloader)
    return offloader


def _check_against_checkpoint(plan: Plan, model: str) -> None:
    path = Path(str(model))
    if not path.is_dir():
        logger.warning("selective-offload: %s is not a local directory, so the plan is checked "
                       "against the loaded model only", model)
        return
    checkpoint = load_checkpoint(path)
    names = [g.name for g in group_tensors(checkpoint, plan.make_inputs())]
    check_plan_matches(plan, names, str(path))


def _embedding_mode(settings: Settings, device: torch.device, vllm_config) -> str:
    mode = settings.embedding_mode
    if mode != "auto":
        return mode
    eager = bool(getattr(vllm_config.model_config, "enforce_eager", False))
    return "uva" if device.type == "cuda" and not eager else "host"


def _attach_cold(model: nn.Module, load: _Load, vllm_config) -> set[int]:
    """Give each planned cold module its runtime wrapper; return the ids of host params."""
    segments = load.settings.host_cold_segments
    roots = [(n, m) for n, m in model.named_modules() if n and cold_prefix_of(n, segments) == n]
    heads = [(n, m) for n, m in model.named_modules() if isinstance(m, _targets.ParallelLMHead)]
    owned: set[int] = set()
    attached.clear()
    attached_modules.clear()
    for name, module in roots:
        attached_modules[name] = module
        if name.rsplit(".", 1)[-1] not in load.routed and load.constructed:
            load.notes.append(f"{name}: its class took no prefix, so it was built on the device "
                              "and moved to the host after loading (a transient of its size)")
        if isinstance(module, _targets.VocabParallelEmbedding) and not isinstance(module, _targets.ParallelLMHead):
            for head_name, head in heads:
                refuse_if_tied(module, head, embedding_name=name, lm_head_name=head_name)
            attached[name] = _install_host_embedding(module, load, vllm_config)
        else:
            attached[name] = offload_on_demand(module, device=load.device)
        owned |= {id(p) for p in module.parameters() if p.device.type == "cpu" or getattr(p, "_selective_offload_uva", False)}
    return owned


def _install_host_embedding(layer: nn.Module, load: _Load, vllm_config):
    weight = layer.weight
    if weight.device.type != "cpu":
        weight.data = weight.data.to("cpu")
    mode = _embedding_mode(load.settings, load.device, vllm_config)
    if mode == "uva":
        # The weight itself becomes a device view of pinned host memory: vLLM's own lookup
        # (F.embedding) then reads the rows over the link, inside CUDA graphs too.
        host = weight.data if weight.data.is_pinned() else weight.data.pin_memory()
        weight.data = _targets.accelerator_view(host)
        weight._selective_offload_uva = True
        load.notes.append(f"{layer.prefix or 'embedding'}: UVA view (CUDA graphs are captured)")
        return weight
    gather = HostGather(load.device)
    _gathers.append(gather)
    handle = len(_gathers) - 1

    def embedding(layer_: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return torch.ops.selective_offload.host_gather(ids, layer_.weight, handle)

    # An instance attribute shadows UnquantizedEmbeddingMethod.embedding: the vocab-parallel
    # masking in VocabParallelEmbedding.forward stays vLLM's.
    layer.quant_method.embedding = embedding
    return gather


def _finish(model: nn.Module, load: _Load, cold_params: set[int], hot_params: set[int],
            drafter: nn.Module | None = None) -> None:
    global last_report, _main
    _main = (model, load, cold_params, hot_params)
    settings = load.settings
    report = build_report(model, settings.plan, compute_device=load.device,
                          host_cold_params=cold_params, host_hot_params=hot_params, notes=load.notes,
                          drafter=drafter, drafter_expected=load.drafter_expected,
                          loaded_bytes=load.loaded_bytes)
    report.problems[:0] = load.problems
    planned, landed = report.planned_host_cold_bytes, report.landed_host_cold_bytes
    if planned and landed and abs(landed / planned - round(landed / planned)) < 0.01 and round(landed / planned) != 1:
        report.notes.append(f"vLLM holds this model in {load.dtype}, wider than the checkpoint: landed bytes "
                            f"are {landed / planned:.0f}x the planned ones, which count the checkpoint")
    last_report = report
    rank = int(os.environ.get("RANK", "0") or 0)
    if settings.report_path and rank == 0:
        report.save(settings.report_path)
    text = report.render()
    if report.ok:
        logger.info("%s", text)
        return
    logger.warning("%s", text)
    if settings.strict:
        raise PlanError("the plan was not realised (strict mode): " + "; ".join(report.problems))
