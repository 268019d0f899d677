"""What selective-offload's vLLM glue relies on, checked against one vLLM source tree.

Run in a subprocess with the tree first on ``sys.path`` (and torch and this project
importable), e.g. for the CUDA release's extracted sources::

    PYTHONPATH=<src>:<repo root> python tests/contract/check_vllm_contract.py \\
        --expect-tree <src>/vllm --expect-version 0.33.0

It checks vLLM's side of the contract (what vLLM provides), not the glue's behaviour.
One line per check, ``ok NAME`` or ``FAIL NAME: reason`` (``note NAME: ...`` lines carry
what a reader should know but does not fail), then a summary; the exit status is 1 when
any check failed, 2 when vLLM is not the expected tree (every check is then reported
FAIL, so none goes missing silently).

Each check says in a comment whether it is a behaviour check (vLLM's code is run on CPU,
with small stand-ins where it would need CUDA or an initialised distributed group) or a
source check (``inspect.getsource`` / ``ast``, where running it needs a GPU, a model or a
process group). The CUDA wheel's compiled parts are absent here; nothing below needs
them.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import inspect
import os
import sys
import textwrap
import time
import traceback
import types
from pathlib import Path
from typing import Any, Callable, Iterator

# The CUDA release cannot detect a platform here (its distribution metadata is not
# installed, and there is no GPU); its CPU platform code is pure Python and serves for
# building configs and layers. The installed CPU build detects the same platform.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.pop("VLLM_PP_LAYER_PARTITION", None)  # get_pp_indices is checked on its default split
os.environ.pop("SELECTIVE_OFFLOAD_PLAN", None)   # the project's plugin must stay inert here

CHECKS: list[tuple[str, Callable[[], None]]] = []
NOTES: list[str] = []


def check(name: str):
    def register(fn: Callable[[], None]) -> Callable[[], None]:
        CHECKS.append((name, fn))
        return fn
    return register


def note(name: str, text: str) -> None:
    NOTES.append(f"note {name}: {text}")


class Contract(AssertionError):
    """A broken expectation, with a one-line reason."""


def expect(cond: Any, reason: str) -> None:
    if not cond:
        raise Contract(reason)


# --------------------------------------------------------------------------- helpers

def params(fn: Callable) -> list[str]:
    return list(inspect.signature(fn).parameters)


def source(obj: Any) -> str:
    return textwrap.dedent(inspect.getsource(obj))


def dotted(node: ast.AST) -> str:
    return ast.unparse(node)


def assign_targets(obj: Any) -> set[str]:
    """Every ``a.b.c = ...`` target in ``obj``'s source, as text."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(source(obj))):
        if isinstance(node, ast.Assign):
            out |= {dotted(t) for t in node.targets}
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            out.add(dotted(node.target))
    return out


def calls(obj: Any) -> list[ast.Call]:
    return [n for n in ast.walk(ast.parse(source(obj))) if isinstance(n, ast.Call)]


def called_names(obj: Any) -> set[str]:
    return {dotted(c.func) for c in calls(obj)}


@contextlib.contextmanager
def patched(owner: Any, attr: str, value: Any) -> Iterator[None]:
    missing = object()
    old = owner.__dict__.get(attr, missing) if isinstance(owner, type) else getattr(owner, attr, missing)
    setattr(owner, attr, value)
    try:
        yield
    finally:
        if old is missing:
            delattr(owner, attr)
        else:
            setattr(owner, attr, old)


def under(path: str | None, root: Path) -> bool:
    return path is not None and Path(path).resolve().is_relative_to(root)


# --------------------------------------------------------------------------- the checks

TREE: Path = Path()


@check("resolve_targets")
def _resolve_targets() -> None:
    # Behaviour: the glue's own resolution, against this tree.
    import vllm

    from selective_offload.vllm_glue import compat

    targets = compat.resolve_targets()
    expect(targets.vllm_version == vllm.__version__,
           f"resolved vLLM {targets.vllm_version}, imported {vllm.__version__}")
    for field in dataclasses.fields(targets):
        obj = getattr(targets, field.name)
        if isinstance(obj, str):
            continue
        module = obj if isinstance(obj, types.ModuleType) else sys.modules[obj.__module__]
        expect(under(getattr(module, "__file__", None), TREE),
               f"Targets.{field.name} comes from {getattr(module, '__file__', None)}, not {TREE}")


@check("load_model_signature")
def _load_model_signature() -> None:
    # Signature: the glue's hook is load_model(self, vllm_config, model_config, prefix="")
    # and calls the original positionally in that order.
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    sig = inspect.signature(BaseModelLoader.load_model)
    names = list(sig.parameters)
    expect(names == ["self", "vllm_config", "model_config", "prefix"],
           f"BaseModelLoader.load_model{sig}")
    expect(sig.parameters["prefix"].default == "", f"prefix defaults to {sig.parameters['prefix'].default!r}")
    expect(all(p.kind is p.POSITIONAL_OR_KEYWORD for p in sig.parameters.values()),
           f"BaseModelLoader.load_model{sig} has keyword-only or positional-only parameters")


@check("loader_hook_points")
def _loader_hook_points() -> None:
    # Behaviour: the glue rebinds base_loader.initialize_model and
    # base_loader.process_weights_after_loading; BaseModelLoader.create_model/load_model
    # must look those names up in base_loader at call time. Run load_model on CPU with
    # both names rebound to recorders (torch.accelerator.empty_cache is stubbed: this
    # CPU torch has no accelerator).
    import torch
    from vllm.config import LoadConfig, VllmConfig
    from vllm.model_executor.model_loader import base_loader
    from vllm.model_executor.model_loader import utils as loader_utils

    expect(base_loader.initialize_model is loader_utils.initialize_model,
           "base_loader.initialize_model is not model_loader.utils.initialize_model")
    expect(base_loader.process_weights_after_loading is loader_utils.process_weights_after_loading,
           "base_loader.process_weights_after_loading is not model_loader.utils.process_weights_after_loading")
    events: list[tuple] = []

    class Loader(base_loader.BaseModelLoader):
        def download_model(self, model_config):
            pass

        def load_weights(self, model, model_config):
            events.append(("load_weights", model))

    built = torch.nn.Linear(2, 2)

    def initialize_model(*args, **kwargs):
        events.append(("initialize_model", args, kwargs))
        return built

    def process_weights_after_loading(*args, **kwargs):
        events.append(("process_weights_after_loading", args, kwargs))

    vllm_config = VllmConfig()
    model_config = types.SimpleNamespace(dtype=torch.float32)
    with patched(base_loader, "initialize_model", initialize_model), \
            patched(base_loader, "process_weights_after_loading", process_weights_after_loading), \
            patched(torch.accelerator, "empty_cache", lambda: None):
        try:
            model = Loader(LoadConfig()).load_model(vllm_config=vllm_config, model_config=model_config,
                                                     prefix="draft")
        except Exception as exc:
            if not any(e[0] == "initialize_model" for e in events):
                raise Contract("BaseModelLoader.load_model did not call the rebound "
                               f"base_loader.initialize_model (it raised {type(exc).__name__}: {exc})") from exc
            raise
    kinds = [e[0] for e in events]
    expect(kinds == ["initialize_model", "load_weights", "process_weights_after_loading"],
           f"load_model ran {kinds}")
    _, args, kwargs = events[0]
    bound = inspect.signature(loader_utils.initialize_model).bind(*args, **kwargs).arguments
    expect(bound.get("vllm_config") is vllm_config and bound.get("model_config") is model_config
           and bound.get("prefix") == "draft",
           f"initialize_model got {sorted(bound)} (not this vllm_config, model_config and prefix)")
    _, args, kwargs = events[2]
    bound = inspect.signature(loader_utils.process_weights_after_loading).bind(*args, **kwargs).arguments
    expect(list(bound) == ["model", "model_config", "target_device"],
           f"process_weights_after_loading's parameters are {list(bound)}")
    expect(bound["model"] is built and bound["model_config"] is model_config,
           "process_weights_after_loading did not get the built model and its model_config")
    expect(model is built, "load_model did not return the model create_model built")
    expect("initialize_model" in called_names(base_loader.BaseModelLoader.create_model),
           "BaseModelLoader.create_model does not call initialize_model")


@check("loaders_inherit_load_model")
def _loaders_inherit_load_model() -> None:
    # Behaviour (class attributes): the loaders behind the usual load formats go through
    # the hooked BaseModelLoader.load_model. Loaders that override it are listed as a note.
    import vllm.model_executor.model_loader as ml

    base = ml.BaseModelLoader.load_model
    for name in ("DefaultModelLoader", "DummyModelLoader", "RunaiModelStreamerLoader", "ShardedStateLoader"):
        cls = getattr(ml, name)
        expect(cls.load_model is base, f"{name} overrides load_model")
    overriding = sorted(n for n in getattr(ml, "__all__", dir(ml))
                        if isinstance(getattr(ml, n, None), type)
                        and issubclass(getattr(ml, n), ml.BaseModelLoader)
                        and getattr(ml, n).load_model is not base)
    for name in overriding:  # the glue guards them, reading vllm_config from kwargs or args[0]
        load_model = getattr(ml, name).load_model
        expect(params(load_model)[:2] == ["self", "vllm_config"], f"{name}.load_model{inspect.signature(load_model)}")
    note("loaders_inherit_load_model",
         f"these loaders override load_model (the glue's hook does not run): {', '.join(overriding) or 'none'}")


@check("post_processing_in_place")
def _post_processing_in_place() -> None:
    # Behaviour: utils.process_weights_after_loading wraps a quant method's post-processing
    # in device_loading_context unless the method (instance) says
    # requires_device_loading = False, which is what the glue sets on cold modules. The
    # context is replaced by a recorder and the target is the meta device, so nothing moves.
    import torch
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
    from vllm.model_executor.model_loader import utils as loader_utils

    default = vars(QuantizeMethodBase).get("requires_device_loading", "absent")
    expect(default is True, f"QuantizeMethodBase.requires_device_loading is {default!r}")
    expect("requires_device_loading" in source(loader_utils.process_weights_after_loading),
           "process_weights_after_loading does not read requires_device_loading")
    cold = VocabParallelEmbedding(64, 4, disable_tp=True, prefix="model.embed_tokens")
    hot = VocabParallelEmbedding(64, 4, disable_tp=True, prefix="model.other")
    processed: list[str] = []
    entered: list[str] = []
    for name, layer in (("cold", cold), ("hot", hot)):
        layer.quant_method.process_weights_after_loading = (
            lambda _layer, name=name: processed.append(name))
    cold.quant_method.requires_device_loading = False

    @contextlib.contextmanager
    def device_loading_context(module, target_device):
        entered.append("cold" if module is cold else "hot" if module is hot else type(module).__name__)
        yield module

    model = torch.nn.ModuleDict({"cold": cold, "hot": hot})
    model_config = types.SimpleNamespace(dtype=torch.float32, quantization=None,
                                         word_embeddings_untied_by_checkpoint=False)
    with patched(loader_utils, "device_loading_context", device_loading_context):
        loader_utils.process_weights_after_loading(model, model_config, torch.device("meta"))
    expect(sorted(processed) == ["cold", "hot"], f"post-processed: {processed}")
    expect(entered == ["hot"], f"device_loading_context was entered for {entered} (expected only the "
                               "method without requires_device_loading = False)")
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    # The glue recognises the unquantized methods by class name.
    expect((UnquantizedEmbeddingMethod.__name__, UnquantizedLinearMethod.__name__)
           == ("UnquantizedEmbeddingMethod", "UnquantizedLinearMethod"), "unquantized method names changed")


@check("mpclient_init_signature")
def _mpclient_init_signature() -> None:
    # Signature (MPClient starts engine processes; it is not built here): the glue reads
    # vllm_config from kwargs or args[1].
    from vllm.v1.engine.core_client import MPClient

    names = params(MPClient.__init__)
    expect(names[:4] == ["self", "asyncio_mode", "vllm_config", "executor_class"],
           f"MPClient.__init__{inspect.signature(MPClient.__init__)}")


@check("engine_args_load_plugins")
def _engine_args_load_plugins() -> None:
    # Behaviour: EngineArgs.__post_init__ loads the general plugins (the glue's entry
    # point), looked up in vllm.plugins at call time. The loader is replaced by a counter.
    import vllm.plugins as plugins
    from vllm.engine.arg_utils import EngineArgs

    count: list[int] = []
    with patched(plugins, "load_general_plugins", lambda: count.append(1)):
        EngineArgs(model="/nonexistent/selective-offload-contract-check")
    expect(count, "EngineArgs(...) did not call vllm.plugins.load_general_plugins")
    expect("load_general_plugins" in called_names(EngineArgs.__post_init__),
           "EngineArgs.__post_init__ does not call load_general_plugins")


@check("plugins_loaded_before_called")
def _plugins_loaded_before_called() -> None:
    # Behaviour: load_general_plugins marks the plugins loaded (vllm.plugins.plugins_loaded)
    # before it calls them, so a plugin that raises is not called again in the process
    # unless the mark is cleared; cleared, the next call loads them again. The glue's
    # plugin clears it when it refuses an engine start (vllm_glue/plugin.py). The plugins
    # are replaced by one that raises once.
    import vllm.plugins as plugins

    calls: list[int] = []

    def refusing() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("refused")

    with patched(plugins, "plugins_loaded", False), \
            patched(plugins, "load_plugins_by_group", lambda group: {"glue": refusing}):
        try:
            plugins.load_general_plugins()
        except RuntimeError:
            pass
        expect(plugins.plugins_loaded is True, "load_general_plugins no longer marks the plugins loaded first")
        plugins.load_general_plugins()
        expect(calls == [1], f"a marked process called the plugins again: {calls}")
        plugins.plugins_loaded = False
        plugins.load_general_plugins()
        expect(calls == [1, 1], f"clearing plugins_loaded did not load the plugins again: {calls}")


@check("prefetch_offloader")
def _prefetch_offloader() -> None:
    # Signature and class attributes: PrefetchOffloader.__init__ makes a torch.cuda.Stream,
    # so it is not built here.
    from vllm.model_executor.offloader import base as offloader_base
    from vllm.model_executor.offloader.prefetch import PrefetchOffloader

    expect(issubclass(PrefetchOffloader, offloader_base.BaseOffloader), "not a BaseOffloader")
    init = inspect.signature(PrefetchOffloader.__init__).parameters
    wanted = ["group_size", "num_in_group", "prefetch_step", "offload_params", "mode"]
    expect(all(n in init for n in wanted),
           f"PrefetchOffloader.__init__{inspect.signature(PrefetchOffloader.__init__)} lacks "
           f"{[n for n in wanted if n not in init]}")
    for name in ("wrap_modules", "post_init"):
        expect(name in vars(PrefetchOffloader), f"PrefetchOffloader does not define {name}")
    expect(params(PrefetchOffloader.wrap_modules)[:3] == ["self", "modules_generator", "prefix"],
           f"wrap_modules{inspect.signature(PrefetchOffloader.wrap_modules)}")
    expect(getattr(PrefetchOffloader, "supports_tower_offload", False) is False,
           "PrefetchOffloader.supports_tower_offload is true (towers would be handed to wrap_modules)")
    for name in ("get_offloader", "set_offloader"):
        expect(callable(getattr(offloader_base, name, None)), f"offloader.base.{name} is missing")


@check("prefetch_offloader_internals")
def _prefetch_offloader_internals() -> None:
    # What the glue's exact-size locking of hot layers reads and sets (offloader.py), from
    # the sources (the classes need CUDA to build): each _ModuleOffloader keeps its module
    # and a dict of per-parameter offloaders; each of those keeps its host copy in
    # _cpu_storage, reaches the parameter through _param, and in post_init keeps a host
    # copy that is_pinned() (registered memory is) instead of pinning a new one.
    from vllm.model_executor.offloader import prefetch

    module_init = source(prefetch._ModuleOffloader.__init__)
    expect("self.module = module" in module_init and "self._param_offloaders" in module_init,
           "_ModuleOffloader no longer keeps module / _param_offloaders")
    cpu = prefetch._CpuParamOffloader
    expect(isinstance(vars(prefetch._BaseParamOffloader).get("_param"), property), "_param is not a property")
    update = source(cpu._update_cpu_storage_from_param)
    expect("is_pinned()" in update and "self._cpu_storage = param.data" in update,
           "_update_cpu_storage_from_param no longer keeps a pinned host copy as it is")
    expect("self._cpu_storage = " in source(cpu._offload_to_cpu_internal), "_cpu_storage is not set at wrap time")
    post_init = source(prefetch.PrefetchOffloader.post_init)
    expect("sync_cpu_storage" in post_init, "PrefetchOffloader.post_init no longer syncs host storage")


@check("make_layers")
def _make_layers() -> None:
    # Behaviour: make_layers, with a stand-in pipeline group (rank 1 of 2) and a recording
    # offloader set through set_offloader, as the glue sets its own: wrap_modules gets a
    # generator of this rank's layers only, no prefix, and is called directly from
    # make_layers, whose frame holds prefix / start_layer / end_layer (the glue's offloader
    # reads them to pick the plan's stack and map global layer indices to local ones).
    import torch
    import vllm.distributed.parallel_state as parallel_state
    from vllm.distributed.utils import get_pp_indices
    from vllm.model_executor.models import utils as model_utils
    from vllm.model_executor.offloader import base as offloader_base

    seen: dict[str, Any] = {}

    class Recorder(offloader_base.BaseOffloader):
        def wrap_modules(self, modules_generator, prefix: str = ""):
            caller = sys._getframe(1)  # the glue reads make_layers' locals from this frame
            seen["caller"] = caller.f_code.co_name
            seen["locals"] = {k: caller.f_locals.get(k) for k in ("prefix", "start_layer", "end_layer")}
            seen["generator"] = inspect.isgenerator(modules_generator)
            seen["prefix"] = prefix
            modules = list(modules_generator)
            seen["count"] = len(modules)
            return modules

    built: list[str] = []

    def layer_fn(prefix: str) -> torch.nn.Module:
        built.append(prefix)
        return torch.nn.Identity()

    group = types.SimpleNamespace(rank_in_group=1, world_size=2, is_first_rank=False, is_last_rank=True)
    previous = offloader_base.get_offloader()
    offloader_base.set_offloader(Recorder())
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(patched(parallel_state, "get_pp_group", lambda: group))
            if hasattr(model_utils, "get_pp_group"):
                stack.enter_context(patched(model_utils, "get_pp_group", lambda: group))
            start, end, modules = model_utils.make_layers(5, layer_fn, "model.layers")
    finally:
        offloader_base.set_offloader(previous)
    expect((start, end) == get_pp_indices(5, 1, 2) == (3, 5),
           f"make_layers gave ({start}, {end}); get_pp_indices(5, 1, 2) = {get_pp_indices(5, 1, 2)}")
    expect(seen, "make_layers did not call get_offloader().wrap_modules")
    expect(seen["caller"] == "make_layers", f"wrap_modules was called from {seen['caller']}, not make_layers")
    expect(seen["locals"] == {"prefix": "model.layers", "start_layer": 3, "end_layer": 5},
           f"make_layers' frame holds {seen['locals']} when it calls wrap_modules "
           "(the glue reads prefix, start_layer and end_layer there)")
    expect(seen["generator"], "wrap_modules was not given a generator")
    expect(seen["prefix"] == "", f"wrap_modules got prefix {seen['prefix']!r}")
    expect(built == ["model.layers.3", "model.layers.4"] and seen["count"] == 2,
           f"wrap_modules got {seen['count']} layers built as {built} (expected this rank's: 3, 4)")
    kinds = [type(m).__name__ for m in modules]
    expect(kinds == ["PPMissingLayer"] * 3 + ["Identity"] * 2, f"make_layers returned {kinds}")
    expect("get_pp_indices" in called_names(model_utils.make_layers), "make_layers does not call get_pp_indices")


@check("get_pp_indices")
def _get_pp_indices() -> None:
    # Behaviour: a pure function of its arguments (VLLM_PP_LAYER_PARTITION unset).
    from vllm.distributed.utils import get_pp_indices

    sig = inspect.signature(get_pp_indices)
    expect(list(sig.parameters)[:3] == ["num_hidden_layers", "pp_rank", "pp_size"]
           and all(p.default is not p.empty for p in list(sig.parameters.values())[3:]),
           f"get_pp_indices{sig}")
    expect(get_pp_indices(10, 0, 1) == (0, 10), f"get_pp_indices(10, 0, 1) = {get_pp_indices(10, 0, 1)}")
    for n, size in ((10, 2), (7, 3), (64, 4)):
        spans = [get_pp_indices(n, r, size) for r in range(size)]
        expect(spans[0][0] == 0 and spans[-1][1] == n and all(a[1] == b[0] for a, b in zip(spans, spans[1:])),
               f"get_pp_indices({n}, r, {size}) = {spans}: not contiguous spans covering 0..{n}")


def _shadow(calls_: list) -> Callable:
    import torch.nn.functional as F

    def embedding(layer, ids):  # the glue shadows quant_method.embedding per instance
        calls_.append((layer, ids.clone()))
        return F.embedding(ids, layer.weight)
    return embedding


@check("embedding_quant_method_call")
def _embedding_quant_method_call() -> None:
    # Behaviour: at tensor-parallel size 1, VocabParallelEmbedding.forward looks up through
    # self.quant_method.embedding(self, ids), so an instance attribute on the method shadows it.
    import torch
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    layer = VocabParallelEmbedding(100, 8, disable_tp=True, prefix="model.embed_tokens")
    with torch.no_grad():  # values, not the allocator's leftovers (a NaN never equals itself)
        layer.weight.normal_()
    seen: list = []
    layer.quant_method.embedding = _shadow(seen)
    ids = torch.tensor([3, 99, 0])
    out = layer(ids)
    expect(len(seen) == 1 and seen[0][0] is layer and torch.equal(seen[0][1], ids),
           f"forward called quant_method.embedding {len(seen)} times / not with (layer, ids)")
    expect(torch.equal(out, layer.weight[ids]), "forward did not return the method's lookup")


@check("embedding_fused_flag")
def _embedding_fused_flag() -> None:
    # Behaviour: use_fused_embedding is a plain attribute set in __init__ (true for an
    # unquantized layer at TP > 1 on CUDA), and forward reads it at call time: true ->
    # vLLM's fused kernel, never quant_method.embedding; false -> the masked path through
    # quant_method.embedding. CUDA is a stand-in platform during construction; TP=2 is a
    # stand-in parallel_group (rank 1); the fused kernel is a recorder.
    import torch
    from vllm.model_executor.layers import vocab_parallel_embedding as vpe

    cpu_layer = vpe.VocabParallelEmbedding(100, 8, disable_tp=True)
    expect("use_fused_embedding" in vars(cpu_layer), "__init__ does not set self.use_fused_embedding")
    expect(cpu_layer.use_fused_embedding is False, "use_fused_embedding is true at TP=1")

    real = vpe.current_platform

    class CudaPlatform:
        def __getattr__(self, name):
            return getattr(real, name)

        def is_cuda(self):
            return True

    group = types.SimpleNamespace(rank_in_group=1, world_size=2, all_reduce=lambda t: t)
    with patched(vpe, "current_platform", CudaPlatform()):
        layer = vpe.VocabParallelEmbedding(100, 8, prefix="model.embed_tokens", parallel_group=group)
    expect(layer.tp_size == 2, f"tp_size {layer.tp_size}")
    expect(layer.use_fused_embedding is True,
           "use_fused_embedding is false for an unquantized TP=2 layer on CUDA")
    with torch.no_grad():  # values, not the allocator's leftovers (a NaN never equals itself)
        layer.weight.normal_()
    shadow: list = []
    fused: list = []
    layer.quant_method.embedding = _shadow(shadow)

    def vocab_parallel_embedding(ids, weight, *args):
        fused.append(ids.clone())
        return torch.zeros(ids.shape[0], weight.shape[1], dtype=weight.dtype)

    ids = torch.tensor([0, 70, 99])  # rank 1 holds ids 64..99 (+ padding) as local 0..63
    with patched(vpe, "ops", types.SimpleNamespace(vocab_parallel_embedding=vocab_parallel_embedding)):
        layer(ids)
        expect(len(fused) == 1 and not shadow,
               f"with use_fused_embedding true: fused kernel {len(fused)}x, quant_method.embedding {len(shadow)}x")
        layer.use_fused_embedding = False
        out = layer(ids)
    expect(len(fused) == 1 and len(shadow) == 1,
           f"with use_fused_embedding set false afterwards: fused kernel {len(fused) - 1}x, "
           f"quant_method.embedding {len(shadow)}x")
    expect(torch.equal(shadow[0][1], torch.tensor([0, 6, 35])),
           f"quant_method.embedding got ids {shadow[0][1].tolist()} (expected this shard's local ids [0, 6, 35])")
    expect(torch.equal(out[0], torch.zeros(8)) and torch.equal(out[1], layer.weight[6]),
           "ids outside the shard were not zeroed / local rows not returned")


@check("parallel_lm_head")
def _parallel_lm_head() -> None:
    # Behaviour (class relation): the glue routes VocabParallelEmbedding by class but never
    # a ParallelLMHead, which must therefore be a subclass it can exclude.
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    expect(issubclass(ParallelLMHead, VocabParallelEmbedding), "ParallelLMHead is not a VocabParallelEmbedding")


@check("unquantized_embedding_method")
def _unquantized_embedding_method() -> None:
    # Behaviour: UnquantizedEmbeddingMethod.embedding(layer, input_) is a row lookup.
    import torch
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        UnquantizedEmbeddingMethod,
        VocabParallelEmbedding,
    )

    expect(params(UnquantizedEmbeddingMethod.embedding) == ["self", "layer", "input_"],
           f"UnquantizedEmbeddingMethod.embedding{inspect.signature(UnquantizedEmbeddingMethod.embedding)}")
    layer = VocabParallelEmbedding(64, 4, disable_tp=True)
    expect(type(layer.quant_method) is UnquantizedEmbeddingMethod,
           f"an unquantized layer's method is {type(layer.quant_method).__name__}")
    torch.nn.init.normal_(layer.weight)
    ids = torch.tensor([5, 1, 5])
    expect(torch.equal(layer.quant_method.embedding(layer, ids), layer.weight[ids]), "not a row lookup")


@check("spec_decode_share_v1")
def _spec_decode_share_v1() -> None:
    # Source (running it needs a target model, a drafter and a process group): the V1
    # proposer swaps the target's embedding and head into the drafter at these paths.
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer as P

    for method, target in (("_maybe_share_embeddings", "self.model.model.embed_tokens"),
                           ("_maybe_share_lm_head", "self.model.lm_head")):
        fn = getattr(P, method, None)
        expect(fn is not None, f"SpecDecodeBaseProposer.{method} is missing")
        expect(target in assign_targets(fn), f"{method} does not assign {target}")
    names = called_names(P.load_model)
    for method in ("self._maybe_share_embeddings", "self._maybe_share_lm_head"):
        expect(method in names, f"SpecDecodeBaseProposer.load_model does not call {method}")


@check("spec_decode_share_v2")
def _spec_decode_share_v2() -> None:
    # Source (as above), Model Runner V2: maybe_share_target_embed replaces the drafter's
    # inner embed_tokens with the target's.
    from vllm.v1.worker.gpu.spec_decode.eagle import utils as eagle_utils

    fn = getattr(eagle_utils, "maybe_share_target_embed", None)
    expect(fn is not None, "v1/worker/gpu/spec_decode/eagle/utils.py has no maybe_share_target_embed")
    expect(any(t.endswith(".embed_tokens") for t in assign_targets(fn)),
           "maybe_share_target_embed assigns no .embed_tokens")
    expect("maybe_share_target_embed" in called_names(eagle_utils.load_eagle_model),
           "load_eagle_model does not call maybe_share_target_embed")


@check("draft_model_config")
def _draft_model_config() -> None:
    # Behaviour + source: SpeculativeConfig has draft_model_config; get_model hands the
    # model_config it is given (the same object) to BaseModelLoader.load_model (run, with
    # load_model replaced by a recorder as the glue replaces it); the V1 and V2 drafter
    # loads pass speculative_config.draft_model_config there; vLLM itself tells a drafter
    # load by that identity.
    import torch
    from vllm.config import LoadConfig, SpeculativeConfig, VllmConfig
    from vllm.model_executor import model_loader as ml
    from vllm.model_executor.model_loader.weight_cache import ipc_loader
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
    from vllm.v1.worker.gpu.spec_decode.eagle import utils as eagle_utils

    fields = {f.name for f in dataclasses.fields(SpeculativeConfig)}
    for name in ("draft_model_config", "target_model_config"):
        expect(name in fields, f"SpeculativeConfig has no {name} field")
    got: list = []

    def load_model(self, vllm_config, model_config, prefix=""):
        got.append((vllm_config, model_config, prefix))
        return torch.nn.Identity()

    vllm_config = VllmConfig()
    draft = types.SimpleNamespace(name="draft ModelConfig")
    with patched(ml.BaseModelLoader, "load_model", load_model):
        ml.get_model(vllm_config=vllm_config, model_config=draft, load_config=LoadConfig(load_format="dummy"))
    expect(len(got) == 1 and got[0][0] is vllm_config and got[0][1] is draft,
           "get_model did not pass this model_config object to BaseModelLoader.load_model")
    v1 = [c for c in calls(SpecDecodeBaseProposer._get_model) if dotted(c.func) == "get_model"]
    expect(any(dotted(k.value) == "self.speculative_config.draft_model_config"
               for c in v1 for k in c.keywords if k.arg == "model_config"),
           "V1 SpecDecodeBaseProposer._get_model does not pass model_config=self.speculative_config.draft_model_config")
    v2 = source(eagle_utils.load_eagle_model)
    expect("draft_model_config = speculative_config.draft_model_config" in v2
           and "model_config=draft_model_config" in v2,
           "V2 load_eagle_model does not load with speculative_config.draft_model_config")
    expect("model_config is spec.draft_model_config" in inspect.getsource(ipc_loader),
           "vLLM's IpcModelLoader no longer tells a drafter by model_config is spec.draft_model_config")


@check("compute_hash_additional_config")
def _compute_hash_additional_config() -> None:
    # Behaviour: VllmConfig() builds on CPU; additional_config is a dict by default and its
    # content (not its identity) changes compute_hash, the compile cache key.
    from vllm.config import VllmConfig

    config = VllmConfig()
    expect(isinstance(config.additional_config, dict),
           f"additional_config is {type(config.additional_config).__name__}, not a dict")
    base = config.compute_hash()
    config.additional_config["selective_offload"] = "plan-a"
    a = config.compute_hash()
    config.additional_config["selective_offload"] = "plan-b"
    b = config.compute_hash()
    config.additional_config = {"selective_offload": "plan-a"}
    a2 = config.compute_hash()
    expect(len({base, a, b}) == 3, "compute_hash does not change with additional_config's content")
    expect(a == a2, "compute_hash of equal additional_config differs")
    expect("additional_config" in source(VllmConfig.compute_hash), "compute_hash does not read additional_config")


@check("compilation_config")
def _compilation_config() -> None:
    # Behaviour: the fields and enum members the glue reads to tell eager from graphs (by
    # the member's name), and the encoder compile/graph flags it refuses on-demand towers under.
    from vllm.config import CompilationConfig, CompilationMode, CUDAGraphMode, VllmConfig

    expect(hasattr(CompilationMode, "NONE") and hasattr(CUDAGraphMode, "NONE"),
           "CompilationMode.NONE / CUDAGraphMode.NONE missing")
    config = CompilationConfig(mode=CompilationMode.NONE, cudagraph_mode=CUDAGraphMode.NONE)
    expect(config.mode == CompilationMode.NONE and config.cudagraph_mode == CUDAGraphMode.NONE,
           f"CompilationConfig kept mode={config.mode}, cudagraph_mode={config.cudagraph_mode}")
    for flag in ("compile_mm_encoder", "cudagraph_mm_encoder"):  # the glue refuses on-demand towers under them
        expect(getattr(config, flag, None) is False, f"CompilationConfig.{flag} is {getattr(config, flag, 'absent')!r}")
    expect(CUDAGraphMode.NONE.name == "NONE", "CUDAGraphMode.NONE is not named NONE")
    default = VllmConfig().compilation_config
    expect(hasattr(VllmConfig(), "lora_config"), "VllmConfig has no lora_config")
    expect(isinstance(default.mode, CompilationMode) and isinstance(default.cudagraph_mode, CUDAGraphMode),
           f"VllmConfig().compilation_config: mode {default.mode!r}, cudagraph_mode {default.cudagraph_mode!r}")


@check("cudagraph_sizes_after_load")
def _cudagraph_sizes_after_load() -> None:
    # Source: the worker caps the graph sizes of a host-compute plan at its crossover in its
    # own CompilationConfig while loading (graphs.cap_graphs_at_crossover). That holds
    # because vLLM's graph dispatcher reads the sizes from that config when its keys are
    # initialised (after loading, before capture), not when it is built.
    from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher

    expect("cudagraph_capture_sizes" not in source(CudagraphDispatcher.__init__),
           "CudagraphDispatcher.__init__ reads cudagraph_capture_sizes (the worker's cap at load would come late)")
    padded = source(CudagraphDispatcher._compute_bs_to_padded_graph_size)
    expect("self.compilation_config.cudagraph_capture_sizes" in padded
           and "self.compilation_config.max_cudagraph_capture_size" in padded,
           "CudagraphDispatcher no longer pads batches from compilation_config's capture sizes")
    expect("self._compute_bs_to_padded_graph_size" in called_names(CudagraphDispatcher.initialize_cudagraph_keys),
           "initialize_cudagraph_keys does not compute the padded sizes from the config")


@check("routed_experts_uva")
def _routed_experts_uva() -> None:
    # Source and behaviour: what the served uva experts path relies on. RoutedExperts is built
    # with the FusedMoE prefix as ``layer_name`` and allocates its weights in __init__
    # (create_weights), so construction routing finds it on the stack; the quant method
    # names its kernel in ``experts_cls`` when built (the glue's kernel check); vLLM marks
    # UVA views with the marker the glue sets, and reads it.
    import torch
    from vllm.model_executor.layers.fused_moe import layer as moe_layer
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    from vllm.model_executor.model_loader import utils as loader_utils
    from vllm.model_executor.offloader import uva

    from selective_offload.planner import kernels
    from selective_offload.vllm_glue import experts

    expect(experts.PREFIX_ARGUMENT in params(RoutedExperts.__init__),
           f"RoutedExperts.__init__ takes no {experts.PREFIX_ARGUMENT}")
    expect("layer_name = prefix" in source(moe_layer.FusedMoEFactory),
           "FusedMoEFactory no longer passes its prefix as the RoutedExperts layer_name")
    expect("self.quant_method.create_weights" in source(RoutedExperts.__init__),
           "RoutedExperts.__init__ no longer creates the expert weights")
    expect(any("self.experts_cls" in t for t in assign_targets(UnquantizedFusedMoEMethod.__init__)),
           "UnquantizedFusedMoEMethod.__init__ no longer sets experts_cls")
    expect(kernels.method_of_vllm(UnquantizedFusedMoEMethod.__new__(UnquantizedFusedMoEMethod)) == "unquantized",
           "unquantized MoE method renamed")
    for where, obj in (("device_loading_context", loader_utils.device_loading_context),
                       ("UVAOffloader", uva.UVAOffloader)):
        expect(f'"{experts.UVA_MARKER}"' in source(obj) and f"p.{experts.UVA_MARKER} = True" in source(obj),
               f"{where} no longer sets and reads the UVA marker {experts.UVA_MARKER}")
    try:
        from vllm.model_executor.layers.fused_moe.fused_moe import _weights_host_resident
    except ImportError:
        note("routed_experts_uva", "this vLLM's Triton fused-MoE does not read the UVA marker (0.33 does)")
        return
    w = torch.nn.Parameter(torch.zeros(2, 2), requires_grad=False)
    expect(not _weights_host_resident(w, w), "an unmarked weight counts as host-resident")
    experts.mark_uva_view(w, lambda t: t)  # the identity stands in for the device view
    expect(_weights_host_resident(w, w), "the Triton kernel does not see the glue's UVA marker")
    from vllm.model_executor.layers.fused_moe.experts import triton_moe

    expect("_weights_host_resident" in source(triton_moe.TritonExperts.apply),
           "TritonExperts.apply no longer checks for host-resident weights")
    from vllm.model_executor.layers.fused_moe.experts import marlin_moe

    expect(set(experts.UVA_KERNELS) <= {triton_moe.TritonExperts.__name__, marlin_moe.MarlinExperts.__name__},
           "TritonExperts or MarlinExperts renamed")
    # Source: vLLM's own UVA offload hands Marlin views after a device repack: a UVA-marked
    # parameter replaced during post-processing is copied back to pinned host memory and
    # made a view again (the evidence for MarlinExperts in the kernel table).
    expect("get_accelerator_view_from_cpu_tensor" in source(loader_utils.device_loading_context),
           "device_loading_context no longer re-offloads replaced UVA parameters as views")


@check("step_host_sync")
def _step_host_sync() -> None:
    # Source: where the glue raises on a failed host-compute job
    # (vllm_glue.host_compute.check_at_step_sync wraps Worker.sample_tokens). Every step's
    # output leaves the worker through Worker.sample_tokens, from either model runner; a
    # synchronous output has synchronised in _bookkeeping_sync (_to_list's event, or the
    # rejection sampler's parse), an asynchronous one synchronises in its get_output, which
    # the executors call before the tokens go on.
    import ast as _ast

    from vllm.v1.outputs import AsyncModelRunnerOutput
    from vllm.v1.worker import gpu_model_runner, gpu_worker

    expect(params(gpu_worker.Worker.sample_tokens) == ["self", "grammar_output"],
           f"Worker.sample_tokens{inspect.signature(gpu_worker.Worker.sample_tokens)}")
    expect("self.model_runner.sample_tokens" in called_names(gpu_worker.Worker.sample_tokens),
           "Worker.sample_tokens no longer returns the model runner's sample_tokens")
    runner = gpu_model_runner.GPUModelRunner
    expect("self._bookkeeping_sync" in called_names(runner.sample_tokens),
           "GPUModelRunner.sample_tokens no longer calls _bookkeeping_sync")
    expect(any(isinstance(n, _ast.If) and _ast.unparse(n.test) == "not self.use_async_scheduling"
               and _ast.unparse(n.body[0]) == "return output" for n in _ast.walk(_ast.parse(source(runner.sample_tokens)))),
           "GPUModelRunner.sample_tokens no longer returns its synchronous output once synchronised")
    bookkeeping = called_names(runner._bookkeeping_sync)
    expect("self._to_list" in bookkeeping and "RejectionSampler.parse_output" in bookkeeping,
           "_bookkeeping_sync no longer reads the sampled tokens with _to_list / parse_output")
    expect(any(name.endswith(".synchronize") for name in called_names(runner._to_list)),
           "GPUModelRunner._to_list no longer waits for the sampled tokens")
    asyncs = [gpu_model_runner.AsyncGPUModelRunnerOutput]
    try:
        from vllm.v1.worker.gpu import async_utils
        from vllm.v1.worker.gpu import model_runner as mrv2
    except ImportError as exc:
        note("step_host_sync", f"the second model runner does not import here ({exc})")
    else:
        asyncs.append(async_utils.AsyncOutput)
        expect("AsyncOutput" in called_names(mrv2.GPUModelRunner.sample_tokens),
               "MRV2's sample_tokens no longer returns an AsyncOutput")
    for cls in asyncs:
        expect(issubclass(cls, AsyncModelRunnerOutput), f"{cls.__name__} is no AsyncModelRunnerOutput")
        expect(params(cls.get_output) == ["self"], f"{cls.__name__}.get_output{inspect.signature(cls.get_output)}")
        body = _ast.parse(source(cls.get_output)).body[0].body
        first_sync = next((i for i, n in enumerate(body) if ".synchronize()" in _ast.unparse(n)), None)
        first_list = next((i for i, n in enumerate(body) if ".tolist()" in _ast.unparse(n)), None)
        expect(first_sync is not None and first_list is not None and first_sync < first_list,
               f"{cls.__name__}.get_output no longer synchronises before it builds the token lists")
    from vllm.v1.executor import multiproc_executor, uniproc_executor

    for module in (uniproc_executor, multiproc_executor):
        expect("get_output()" in inspect.getsource(module), f"{module.__name__} no longer calls get_output()")


@check("start_up_end")
def _start_up_end() -> None:
    # Source: where the glue raises on a host-compute job that failed before serving and
    # starts the counts again (vllm_glue.host_compute.make_start_check wraps
    # compile_or_warm_up_model of Worker and of every worker class that overrides it). The
    # engine core calls it last of its executor's methods at start, after the profile run
    # (determine_available_memory) and the KV caches; the executor runs it on every worker;
    # the GPU worker's compile warm-ups, graph capture and sampler warm-up run inside it;
    # the CPU worker is a Worker (its override is hooked when its module is imported).
    from vllm.v1.engine import core
    from vllm.v1.executor import abstract
    from vllm.v1.worker import cpu_worker, gpu_worker

    body = source(core.EngineCore._initialize_kv_caches)
    at = {name: body.find(f"self.model_executor.{name}(")
          for name in ("determine_available_memory", "initialize_from_config", "compile_or_warm_up_model")}
    expect(min(at.values()) >= 0, f"EngineCore._initialize_kv_caches no longer calls {[n for n, i in at.items() if i < 0]}")
    expect(body.rfind("self.model_executor.") == at["compile_or_warm_up_model"]
           and at["compile_or_warm_up_model"] > max(at["determine_available_memory"], at["initialize_from_config"]),
           "EngineCore._initialize_kv_caches calls its executor after compile_or_warm_up_model")
    expect('"compile_or_warm_up_model"' in source(abstract.Executor.compile_or_warm_up_model),
           "Executor.compile_or_warm_up_model no longer runs the workers' compile_or_warm_up_model")
    worker = gpu_worker.Worker
    names = called_names(worker.compile_or_warm_up_model) | (
        called_names(worker._compile_or_warm_up_model) if hasattr(worker, "_compile_or_warm_up_model") else set())
    expect({"self.model_runner.capture_model", "self.model_runner._dummy_run"} <= names,
           "Worker.compile_or_warm_up_model no longer captures the graphs and warms the sampler up itself")
    expect(issubclass(cpu_worker.CPUWorker, worker), "CPUWorker is no longer a Worker")


@check("output_rank")
def _output_rank() -> None:
    # Source: whose step output vLLM reads (vllm_glue.host_compute.is_output_rank, which ends
    # any other rank's worker on a failed job). The executor asks one rank for the output of
    # execute_model and sample_tokens, world_size - tp * pcp (TP rank 0 of the last pipeline
    # stage); a worker hands its output, or its exception, back only when it is that rank.
    from vllm.v1.executor import multiproc_executor

    executor = multiproc_executor.MultiprocExecutor
    rank = source(executor._get_output_rank)
    expect(all(word in rank for word in ("self.world_size", "tensor_parallel_size", "prefill_context_parallel_size")),
           "MultiprocExecutor._get_output_rank is no longer world_size - tp * pcp")
    for method in (executor.execute_model, executor.sample_tokens):
        expect("unique_reply_rank=self.output_rank" in source(method),
               f"MultiprocExecutor.{method.__name__} no longer asks the output rank alone")
    expect("self.rank == output_rank" in source(multiproc_executor.WorkerProc._execute_worker_rpc),
           "WorkerProc._execute_worker_rpc no longer hands back the output rank's output alone")


@check("routing_counters")
def _routing_counters() -> None:
    # Source and signatures: where the routing counters count (vllm_glue.routing wraps each
    # MoERunner's router.select_experts on the router object, and a monolithic layer's
    # forward_monolithic), when they are zeroed (compile_or_warm_up_model of both workers,
    # after the profile run and before the first served step) and when a spawned worker
    # writes them into the report (Worker.shutdown, which both executors call).
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.model_executor.layers.fused_moe.router.fused_moe_router import FusedMoERouter
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner
    from vllm.v1.engine import core
    from vllm.v1.worker import cpu_worker, gpu_worker

    expect(params(FusedMoERouter.select_experts) == ["self", "hidden_states", "router_logits", "topk_indices_dtype",
                                                     "input_ids"],
           f"FusedMoERouter.select_experts{inspect.signature(FusedMoERouter.select_experts)}")
    expect("self._select_experts" in called_names(FusedMoERouter.select_experts)
           and "return topk_weights, topk_ids" in source(FusedMoERouter.select_experts),
           "FusedMoERouter.select_experts no longer returns _select_experts' (topk_weights, topk_ids)")
    expect(params(FusedMoERouter._select_experts)[:3] == ["self", "hidden_states", "router_logits"]
           and "input_ids" in params(FusedMoERouter._select_experts),
           f"FusedMoERouter._select_experts{inspect.signature(FusedMoERouter._select_experts)}")
    forward = source(MoERunner._apply_quant_method)
    expect("self.router.select_experts(" in forward and "self.routed_experts.forward_monolithic(" in forward,
           "MoERunner._apply_quant_method no longer routes through router.select_experts (modular) or "
           "routed_experts.forward_monolithic (monolithic)")
    expect(isinstance(inspect.getattr_static(MoERunner, "layer_id"), property) and "self.router" in
           assign_targets(MoERunner.__init__), "MoERunner has no layer_id property or router attribute")
    expect(params(RoutedExperts.forward_monolithic)[:3] == ["self", "x", "router_logits"],
           f"RoutedExperts.forward_monolithic{inspect.signature(RoutedExperts.forward_monolithic)}")
    for worker in (gpu_worker.Worker, cpu_worker.CPUWorker):
        expect("compile_or_warm_up_model" in vars(worker) and params(worker.compile_or_warm_up_model) == ["self"],
               f"{worker.__name__} has no compile_or_warm_up_model(self) of its own")
    expect(params(gpu_worker.Worker.shutdown) == ["self"] and "shutdown" not in vars(cpu_worker.CPUWorker),
           "Worker.shutdown(self) is no longer the one shutdown of both workers")
    from vllm.v1.executor import multiproc_executor, uniproc_executor

    expect("self.worker.shutdown()" in source(multiproc_executor.WorkerProc.shutdown)
           and "worker.shutdown()" in source(uniproc_executor.UniProcExecutor.shutdown),
           "the executors no longer shut their workers down through Worker.shutdown")
    init = source(core.EngineCore._initialize_kv_caches)
    expect(init.index("determine_available_memory") < init.index("compile_or_warm_up_model()"),
           "EngineCore no longer warms the model up after its profile run")


@check("reload_restore_device")
def _reload_restore_device() -> None:
    # Source: where the glue has a compute-served layer rebuilt in host memory on a reload
    # (vllm_glue.host_compute.reload_on_host): the layerwise reload keeps each layer's
    # recorded info in LAYERWISE_INFO and materialises the layer under its restore_device.
    from vllm.model_executor.model_loader.reload import layerwise, meta

    expect(isinstance(getattr(layerwise, "LAYERWISE_INFO", None), dict) or hasattr(layerwise.LAYERWISE_INFO, "get"),
           "reload.layerwise.LAYERWISE_INFO is gone")
    expect("with info.restore_device" in source(meta.materialize_layer),
           "materialize_layer no longer builds the layer under its recorded restore_device")
    expect("materialize_layer" in called_names(layerwise._layerwise_process),
           "_layerwise_process no longer materialises the layer it reloads")
    # ... and post-processes it through a QuantizeMethodBase only (the split head's method
    # is registered as one: vllm_glue.host_head.install_head), before it copies the values
    # into the tensors kept (the head's device rows are refilled from the rebuilt layer)
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    process = source(layerwise._layerwise_process)
    expect("isinstance(quant_method, QuantizeMethodBase)" in process and callable(QuantizeMethodBase.register),
           "_layerwise_process no longer post-processes a layer whose method is a (registered) QuantizeMethodBase")
    expect(0 <= process.find("process_weights_after_loading(layer)") < process.find("_copy_and_restore_kernel_tensors("),
           "_layerwise_process no longer post-processes the rebuilt layer before copying it into the kept tensors")


@check("reload_in_place")
def _reload_in_place() -> None:
    # Source: what the glue's UVA views rely on across a reload (experts.view_again).
    # vLLM's reload_weights copies the reloaded, post-processed values into the tensors it
    # restores (the views, at their addresses); replace_parameter keeps the Parameter (and
    # so the glue's record) when it rebinds ``.data`` (0.33; the CPU build 0.32 registers a
    # new Parameter, and has no views).
    from vllm.model_executor import utils as executor_utils
    from vllm.model_executor.model_loader.reload import inplace, layerwise

    expect({"initialize_layerwise_reload", "finalize_layerwise_reload"} <= called_names(inplace.reload_weights),
           "reload_weights no longer reloads layer by layer")
    expect("param.data.copy_" in source(layerwise._copy_and_restore_kernel_tensors)
           and "_place_kernel_tensors" in called_names(layerwise._copy_and_restore_kernel_tensors),
           "the layerwise reload no longer copies into the tensors it restores")
    expect("quant_method.process_weights_after_loading" in called_names(layerwise._layerwise_process),
           "the layerwise reload no longer runs the quant method's post-processing (the glue's hook)")
    keeps = "old_param.data = new_tensor" in source(executor_utils.replace_parameter)
    if not keeps:
        note("reload_in_place", "replace_parameter registers a new Parameter here (0.33 keeps it)")


@check("model_class_names")
def _model_class_names() -> None:
    # The glue reads the model class before it is built (get_model_architecture) and maps
    # the plan's checkpoint names through its hf_to_vllm_mapper's rename-only variant:
    # gpt-oss builds the checkpoint's model.embed_tokens as model.embedding, and says so there.
    from vllm.model_executor.model_loader.utils import get_model_architecture
    from vllm.model_executor.models import gpt_oss

    from selective_offload.names import model_names
    from selective_offload.vllm_glue.model_names import class_mapping

    expect(params(get_model_architecture)[:1] == ["model_config"], "get_model_architecture no longer takes model_config")
    expect("self.embedding = VocabParallelEmbedding(" in source(gpt_oss.GptOssModel),
           "GptOssModel no longer builds its embedding as model.embedding")
    mapper = gpt_oss.GptOssForCausalLM.hf_to_vllm_mapper
    expect(callable(getattr(mapper, "get_rename_mapper", None)), "WeightsMapper has no get_rename_mapper")
    mapping, where = class_mapping(gpt_oss.GptOssForCausalLM)
    expect(mapping is not None and "hf_to_vllm_mapper" in where, "GptOssForCausalLM has no hf_to_vllm_mapper")
    layer = "model.layers.0."
    tensors = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
               *(layer + t for t in ("input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.sinks",
                                     "mlp.router.weight", "mlp.router.bias", "mlp.experts.gate_up_proj",
                                     "mlp.experts.gate_up_proj_bias", "mlp.experts.down_proj",
                                     "mlp.experts.down_proj_bias"))]
    groups = ["model.embed_tokens", "model.norm", "lm_head", "model.layers.0", "model.layers.0.mlp.experts"]
    names = model_names(groups, tensors, mapping, ("embed_tokens",), where)
    expect(dict(names.renamed) == {"model.embed_tokens": "model.embedding"},
           f"gpt-oss's names map otherwise: {dict(names.renamed)}")
    expect(mapping(layer + "mlp.experts.gate_up_proj") == layer + "mlp.experts.w13_weight",
           "gpt-oss's routed experts are no longer named experts.w13_weight")


@check("no_foreign_vllm_modules")
def _no_foreign_vllm_modules() -> None:
    # Last: every vllm module the checks imported came from the tree under test.
    foreign = sorted(name for name, module in list(sys.modules.items())
                     if (name == "vllm" or name.startswith("vllm.")) and module is not None
                     and getattr(module, "__file__", None) and not under(module.__file__, TREE))
    expect(not foreign, f"{len(foreign)} vllm modules from elsewhere, e.g. {foreign[:3]}")


# --------------------------------------------------------------------------- main

def _version_matches(version: str, expected: str) -> bool:
    return version == expected or version.startswith((expected + ".", expected + "+"))


def _tree(expect_tree: Path, expect_version: str) -> str | None:
    """Why vllm is not the tree under test (None when it is)."""
    try:
        import vllm
    except Exception as exc:  # noqa: BLE001 - any import failure is the reason
        return f"import vllm failed: {type(exc).__name__}: {exc}"
    path = Path(vllm.__file__).resolve().parent
    if path != expect_tree:
        return f"vllm was imported from {path}, not {expect_tree}"
    if not _version_matches(vllm.__version__, expect_version):
        return f"vllm.__version__ is {vllm.__version__}, expected {expect_version}"
    return None


def main(argv: list[str] | None = None) -> int:
    global TREE
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--expect-tree", required=True, type=Path,
                        help="the vllm package directory that must be imported")
    parser.add_argument("--expect-version", required=True,
                        help="vllm.__version__, exactly or as a prefix (0.32 matches 0.32.0)")
    args = parser.parse_args(argv)
    TREE = args.expect_tree.resolve()
    start = time.monotonic()
    problem = _tree(TREE, args.expect_version)
    if problem is not None:
        print(f"FAIL tree: {problem}")
        for name, _ in CHECKS:
            print(f"FAIL {name}: not run (vllm is not the tree under test)")
        return 2
    import vllm

    print("ok tree", flush=True)
    print(f"note tree: vLLM {vllm.__version__} from {TREE}", flush=True)
    failed = 0
    for name, fn in CHECKS:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - every failure is reported, one line each
            failed += 1
            where = traceback.extract_tb(exc.__traceback__)[-1]
            reason = str(exc) if isinstance(exc, Contract) else (
                f"{type(exc).__name__}: {exc} (at {Path(where.filename).name}:{where.lineno})")
            print(f"FAIL {name}: {' '.join(reason.split())}", flush=True)
        else:
            print(f"ok {name}", flush=True)
        for line in NOTES:
            print(line, flush=True)
        NOTES.clear()
    print(f"{len(CHECKS) - failed}/{len(CHECKS)} vLLM contract checks passed against {vllm.__version__} "
          f"in {time.monotonic() - start:.1f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
