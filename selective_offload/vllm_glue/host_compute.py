"""Routed experts served ``compute``: vLLM's router on the device, the experts on the host CPU.

A plan that serves a layer's routed experts ``compute`` keeps them in host memory, as a
``uva`` plan does (built there at construction, page-locked in one arena), and has the
host CPU compute them where they live (:class:`~selective_offload.wrappers.host_compute.HostExperts`).
vLLM's structure is kept: its ``MoERunner`` runs the router (``select_experts``), the
shared experts and the reduction as for any layer; only the quant method of this layer's
``RoutedExperts`` is replaced, after loading, by :class:`HostComputeMethod`, whose
``apply`` hands the tokens' hidden states and top-k to the host experts. That is vLLM's
own seam between routing and the expert kernels (``RoutedExperts.forward_modular`` calls
``quant_method.apply`` with the router's choice), the one SGLang's KTransformers wrapper
uses too.

Post-processing is not run for these experts: every fused-MoE kernel's post-processing
repacks for that kernel (Marlin tiles, padded scales), and the CPU kernel reads the layout
``create_weights`` made, the checkpoint's own. Steps above the crossover copy those bytes
to the device and compute them there with plain torch ops, not vLLM's fused kernel.
GPTQ's and AWQ's int4 layouts are the one exception, rewritten in place
(:mod:`.int4_layouts`). Dense MLPs on the host CPU: :mod:`.host_mlp`, through the same host
experts and the helpers here (:func:`refuse_unserved`, :func:`threads_of`).

Which vLLM quant methods are served, and in which CPU format: :data:`FORMATS` (read from
vLLM 0.33's ``create_weights`` of each; checked by tests/contract). A method not listed,
or a format without a claimed kernel, is refused right after construction, in one line.
"""

from __future__ import annotations

import os
import sys
from functools import lru_cache
from typing import Any

import torch
from torch import nn

from .. import cpu_kernels
from ..cpu_kernels import Activation, ExpertWeights, capability
from ..cpu_kernels.reference import held_share
from ..errors import PlanError
from ..estimate.host import share_native
from ..log import logger
from ..plan_format import Plan
from ..planner import kernels
from ..wrappers.host_buffers import HostBuffers
from ..wrappers.host_compute import HostExperts
from .int4_layouts import AWQ_METHODS, int4_rows, refuse_unread_int4

#: The table's method (``kernels.method_of_vllm``) -> the CPU kernel's format, by the dtype
#: vLLM loads the weights in (unquantized experts are in the model's dtype).
FORMATS: dict[str, dict[torch.dtype | None, str]] = {
    "unquantized": {torch.bfloat16: "bf16", torch.float32: "f32"},
    "mxfp4": {None: "mxfp4"},
    "fp8-block": {None: "fp8-block"},
    "wna16": {None: "int4"},
}
MECHANISM = "compute (the host CPU computes the routed experts where they live)"


def format_of(group: str, method: Any, module: nn.Module, device: torch.device = torch.device("cpu")) -> str:
    """The CPU kernel's format for ``module``'s experts, or a one-line refusal."""
    name = kernels.method_of_vllm(method)
    by_dtype = FORMATS.get(name or "")
    dtype = getattr(getattr(module, "w13_weight", None), "dtype", None)
    fmt = None if by_dtype is None else by_dtype.get(dtype if None not in by_dtype else None)
    if fmt is None:
        what = f"{type(method).__name__}" + (f" with {dtype} weights" if name == "unquantized" else "")
        raise PlanError(f"{group}: the plan computes these routed experts on the host CPU, and the CPU kernels "
                        f"have no format for {what}; plan them served uva or on the device")
    if fmt == "int4":
        refuse_unread_int4(group, method)
    refuse_unserved(f"{group}: the plan computes these routed experts on the host CPU in {fmt}", fmt, device)
    return fmt


def refuse_unserved(what: str, fmt: str, device: torch.device) -> None:
    """``fmt`` served here, or a one-line refusal that starts with ``what``: its kernel
    built and claimed, and on CUDA one with a C job a host function can run."""
    reason = cpu_kernels.unavailable_reason(fmt)
    if reason is None and fmt in cpu_kernels.TORCH_FORMATS and device.type == "cuda":
        reason = ("float32 weights are computed by torch's ops, with no C job a CUDA host function could run; "
                  "serve the model in bf16 (--dtype bfloat16)")
    if reason is not None:
        raise PlanError(f"{what}, and {reason}")


def layer_of(module: nn.Module) -> capability.HostLayer:
    """The routed experts vLLM built, as :mod:`..cpu_kernels.capability` describes a layer:
    its ``MoEActivation``, where its router weight is applied, its top-k, a clamp."""
    act = getattr(getattr(module, "activation", None), "value", getattr(module, "activation", None))
    config = getattr(module, "moe_config", None)
    limit = getattr(module, "swiglu_limit", None)
    k = getattr(module, "top_k", None) or getattr(config, "experts_per_token", None)
    return capability.HostLayer(capability.EXPERTS, str(act),
                                router_weight_on_input=bool(getattr(module, "apply_router_weight_on_input", False)),
                                experts_per_token=k if isinstance(k, int) else None,
                                clamp_limit=limit if limit is not None else getattr(config, "swiglu_limit", None))


def activation_of(group: str, module: nn.Module) -> Activation:
    """The kernel's activation for ``module``'s experts, or a one-line refusal (the same
    table the planner reads: :func:`..cpu_kernels.capability.refusal`)."""
    layer = layer_of(module)
    why = capability.refusal(layer)
    if why is not None:
        raise PlanError(f"{group}: the CPU kernels do not compute these routed experts: {why}; plan them served uva "
                        "or on the device")
    config = getattr(module, "moe_config", None)
    return capability.kernel_activation(layer, getattr(config, "swiglu_alpha", None), layer.clamp_limit)


def refuse_unsupported(group: str, method: Any, module: nn.Module, device: torch.device) -> None:
    """What the host path cannot honour, refused right after construction."""
    format_of(group, method, module, device)
    activation_of(group, module)


def threads_of(setting: Any, device: torch.device = torch.device("cpu")) -> int | None:
    """The plan's threads per rank; unstated, the physical cores of the NUMA node vLLM binds
    this worker to (the probe's count, the plan's default) split between the ranks bound
    with it (:func:`rank_affinities`; all of them where vLLM made no world). ``None``
    with one rank on vLLM's CPU build: the kernel takes torch's intra-op threads, which its
    CPU worker binds to its cores. Not on CUDA: vLLM 0.33's GPU worker leaves torch one
    thread for serving (``set_torch_threads_for_runtime``), so the count is the cores',
    stated, less the one vLLM's engine thread runs on (the kernel's threads inherit the
    worker's binding)."""
    if setting.ranks > 1:
        pin_to_rank_cores(setting.ranks)
    if setting.threads is not None or (setting.ranks <= 1 and torch.device(device).type != "cuda"):
        return setting.threads
    from ..probe.host_compute import physical_cores_of_one_node

    gathered = rank_affinities() if setting.ranks > 1 else None
    sharing = (len(cpu_kernels.cores.sharing_ranks([set(a) for a in gathered[1]], gathered[0])) if gathered
               else setting.ranks)
    per_rank = physical_cores_of_one_node() // sharing
    return max(1, per_rank - 1 if torch.device(device).type == "cuda" else per_rank)


def thread_facts(threads: int | None, setting: Any) -> dict[str, int]:
    """What this rank's host-compute jobs run with, beside what the plan priced: ``threads``
    (a job's count: :func:`threads_of`'s, torch's where that is ``None``),
    ``planned_threads`` (the plan's per rank: ``--cpu-threads`` / ``--ranks``, or
    unstated one node's physical cores split between the ranks, as its estimate divides
    the host's rates) and ``pool_cores`` (the cores this rank's kernel pool is pinned to: a
    rank vLLM binds to a node of its own keeps that node whole; 0: not pinned, or no C
    kernel loaded)."""
    from ..probe.host_compute import physical_cores_of_one_node

    planned = setting.threads if setting.threads is not None else max(
        1, physical_cores_of_one_node() // max(1, setting.ranks))
    lib = cpu_kernels.kernel._LIB  # never built for this: a float32 model runs no C job
    return {"threads": int(threads) if threads else torch.get_num_threads(), "planned_threads": int(planned),
            "pool_cores": len(cpu_kernels.kernel.pool_cpus(lib)) if lib is not None else 0}


def threads_words(facts: dict[str, int]) -> str:
    """:func:`thread_facts` in words, saying when the threads differ from the plan's."""
    words = f"{facts['threads']} threads" + (f" on {facts['pool_cores']} pinned cores" if facts["pool_cores"] else "")
    if facts["threads"] != facts["planned_threads"]:
        words += (f" (the plan priced {facts['planned_threads']} per rank; this rank runs what vLLM's binding "
                  f"and the engine thread leave it)")
    return words


#: :func:`rank_affinities` once gathered (a process's ranks and bindings do not change).
_AFFINITIES: list[tuple[int, tuple[frozenset[int], ...]]] = []


def rank_affinities() -> tuple[int, tuple[frozenset[int], ...]] | None:
    """This rank's index among the ranks on its host, and each of those ranks' CPU affinity
    set (``os.sched_getaffinity``: vLLM's ``--numa-bind`` or the CPU build's binding), in
    rank order: gathered once, over vLLM's world group (its CPU group), at the first
    install, which every rank reaches in the same order. None before vLLM made its world
    (one process: nothing to split)."""
    if _AFFINITIES:
        return _AFFINITIES[0]
    try:
        from vllm.distributed.parallel_state import get_world_group

        group = get_world_group()
        import socket

        import torch.distributed as dist

        mine = (socket.gethostname(), sorted(cpu_kernels.cores.allowed_cpus()))
        everyone: list[Any] = [None] * group.world_size
        dist.all_gather_object(everyone, mine, group=group.cpu_group)
    except (AssertionError, AttributeError, ImportError, RuntimeError):
        return None
    here = [i for i, (host, _) in enumerate(everyone) if host == mine[0]]
    _AFFINITIES.append((here.index(group.rank_in_group), tuple(frozenset(everyone[i][1]) for i in here)))
    return _AFFINITIES[0]


def pin_to_rank_cores(ranks: int) -> None:
    """With several ranks sharing the host, this rank's kernel pool is pinned to cores no
    other rank's pool runs on (:func:`.cores.rank_cores`): the ranks whose CPU affinity
    sets overlap split the cores the library pins to by default in equal slices; a rank
    bound apart (vLLM's ``--numa-bind``: each rank on its own node) keeps its cores whole."""
    gathered = rank_affinities() if ranks > 1 else None
    if gathered is None:
        return
    rank, affinities = gathered
    cpu_kernels.kernel.set_pool_cpus(
        cpu_kernels.cores.rank_cores(cpu_kernels.kernel.default_pool_cpus(), [set(a) for a in affinities], rank))


def refuse_other_ranks(plan: Plan | None, vllm_config: Any) -> None:
    """A plan priced for another number of ranks sharing the host (its threads and its
    share of the host's bandwidth) refused before anything is built."""
    if plan is None or plan.host_compute is None:
        return
    parallel = getattr(vllm_config, "parallel_config", None)
    ranks = int(getattr(parallel, "tensor_parallel_size", 1) or 1) * int(getattr(parallel, "data_parallel_size", 1) or 1)
    if ranks != plan.host_compute.ranks:
        raise PlanError(f"the plan computes routed experts on the host for {plan.host_compute.ranks} rank(s) sharing "
                        f"its cores and memory, and this engine runs {ranks}; make the plan again with "
                        f"`selective-offload plan --ranks {ranks}`")


def weights_of(module: nn.Module, fmt: str, shared: frozenset[str] = frozenset(),
               block: Any = None, method: Any = None) -> ExpertWeights:
    """The module's expert tensors, as loaded (no post-processing), for the CPU kernel."""
    def get(*names: str) -> torch.Tensor | None:
        for n in names:
            t = getattr(module, n, None)
            if isinstance(t, torch.Tensor) and n not in shared:
                return t.data
        return None

    if fmt == "int4" and isinstance(getattr(module, "w13_weight_packed", None), torch.Tensor):
        # compressed-tensors: the kernel's layout as loaded
        return ExpertWeights(fmt=fmt, w13=get("w13_weight_packed").view(torch.uint8),
                             w2=get("w2_weight_packed").view(torch.uint8), w13_scale=get("w13_weight_scale"),
                             w2_scale=get("w2_weight_scale"), w13_bias=get("w13_bias"), w2_bias=get("w2_bias"))
    if fmt == "int4":
        return ExpertWeights(fmt=fmt, **int4_rows(module, type(method).__name__ in AWQ_METHODS, shared))
    extra = {"block": tuple(block)} if fmt == "fp8-block" and block else {}
    return ExpertWeights(fmt=fmt, w13=get("w13_weight"), w2=get("w2_weight"),
                         w13_scale=get("w13_weight_scale_inv", "w13_weight_scale"),
                         w2_scale=get("w2_weight_scale_inv", "w2_weight_scale"),
                         w13_bias=get("w13_bias"), w2_bias=get("w2_bias"), **extra)


def host_mask_of(module: nn.Module) -> torch.Tensor | None:
    """With expert parallelism, the experts this rank holds (vLLM's ``expert_map``)."""
    expert_map = getattr(module, "expert_map", None)
    return None if expert_map is None else expert_map.to("cpu") >= 0


@lru_cache(maxsize=1)
def method_class() -> type:
    """:class:`HostComputeMethod`, a subclass of vLLM's ``FusedMoEMethodBase`` (made on
    first use, so importing this module needs no vLLM)."""
    from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase

    from ..wrappers.host_compute import register

    class HostComputeMethod(FusedMoEMethodBase, nn.Module):
        """A layer's routed experts computed on the host CPU: ``apply`` gets the router's
        top-k, as every modular method does, and returns the weighted sum (the runner
        adds the shared experts and reduces, as for any method). A module, as vLLM's own
        methods are (``RoutedExperts`` holds its method as a child); it holds no
        parameters, and neither the replaced method nor the experts become children."""

        def __init__(self, original: Any, experts: HostExperts, shared: frozenset[str] = frozenset()):
            nn.Module.__init__(self)
            FusedMoEMethodBase.__init__(self, original.moe)
            object.__setattr__(self, "original", original)
            object.__setattr__(self, "experts", experts)
            object.__setattr__(self, "shared", shared)
            self.key = register(experts)

        def create_weights(self, *args, **kwargs):  # the weights were made by the original method
            raise AssertionError("HostComputeMethod replaces a quant method after loading")

        def get_fused_moe_quant_config(self, layer):
            return None

        @property
        def is_monolithic(self) -> bool:
            return False

        @property
        def topk_indices_dtype(self):
            return None

        def process_weights_after_loading(self, layer) -> None:
            # A reload copies into the same host tensors, in the checkpoint's layout: the
            # one layout changed at install (GPTQ's and AWQ's int4) is rewritten again.
            fmt = self.experts.weights.fmt
            if fmt == "int4" and not hasattr(layer, "w13_weight_packed"):
                layer.__dict__.pop("_selective_offload_int4_rows", None)
                int4_rows(layer, type(self.original).__name__ in AWQ_METHODS)
            # The device share's copy of its experts follows, from the layer's tensors as they
            # are now: vLLM's reload_weights runs this on the layer it rebuilt and loaded,
            # before it copies the new values into the tensors the host experts read.
            if self.experts.share is not None and not self.experts.share_channels:
                refill_share(self.experts, weights_of(layer, fmt, self.shared,
                                                      getattr(self.original, "weight_block_size", None), self.original))
            return None

        def apply(self, layer, x, topk_weights, topk_ids, shared_experts=None, shared_experts_input=None):
            if getattr(layer, "apply_router_weight_on_input", False):  # top-1 (capability): as vLLM's prepare step
                x, topk_weights = x * topk_weights.to(x.dtype), torch.ones_like(topk_weights)
            ids = topk_ids
            expert_map = getattr(layer, "expert_map", None)
            if expert_map is not None:  # global ids -> this rank's; -1 for another rank's
                ids = expert_map[topk_ids.long()]
            return torch.ops.selective_offload.experts_on_host(x, ids, topk_weights, self.key)

    return HostComputeMethod


def install(group: str, module: nn.Module, method: Any, plan: Plan, device: torch.device,
            shared: frozenset[str] = frozenset(), buffers: HostBuffers | None = None) -> HostExperts:
    """Serve ``module``'s routed experts on the host CPU from now on (after its parameters
    are page-locked where they are): the quant method is replaced, the weights kept."""
    fmt = format_of(group, method, module, device)
    setting = plan.host_compute
    if setting is None:
        raise PlanError(f"{group}: the plan computes these routed experts on the host but states no crossover "
                        f"(host_compute); make the plan again")
    weights = weights_of(module, fmt, shared, getattr(method, "weight_block_size", None), method)
    host_mask = host_mask_of(module)
    planned = plan.group_of(group)
    on_device = planned.device_experts if planned is not None else 0
    held = planned.device_experts_held if on_device else ()  # the plan's experts (the first, or the busiest)
    if on_device and host_mask is not None:
        raise PlanError(f"{group}: the plan keeps a device share of {on_device} of these routed experts, and vLLM "
                        "runs them expert-parallel; plan without expert parallelism (a device share is planned for "
                        "one rank)")
    if on_device >= weights.num_experts:
        raise PlanError(f"{group}: the plan keeps a device share of {on_device} routed experts, and vLLM built "
                        f"{weights.num_experts} here; make the plan again for this model")
    experts = HostExperts(group, weights, activation_of(group, module), crossover_tokens=setting.crossover_tokens,
                          threads=threads_of(setting, device), device=device, host_mask=host_mask,
                          buffers=buffers, experts_per_token=experts_per_token(group, module, planned),
                          device_share=held_share(weights, on_device, device, native=share_native(fmt, True),
                                                  ids=held) if on_device else None, share_ids=held or None)
    experts.thread_facts = thread_facts(experts.threads, setting)
    module._replace_quant_method(method_class()(method, experts, shared))
    reload_on_host(module)
    return experts


def reload_on_host(module: nn.Module) -> None:
    """vLLM's layer-by-layer reload (``reload_weights``; ``model_loader/reload``) rebuilds
    each layer (each module holding parameters) on the device recorded when the model was
    built (``restore_device``, the default device: CUDA), loads the new weights into it,
    post-processes it and copies the values into the tensors kept. For a module served
    ``compute`` (routed experts, a dense MLP's projections, the split LM head) that would
    put it whole on the device, which the plan does not count; ``module`` and everything
    in it are rebuilt in host memory instead (their quant methods, the glue's, keep the
    weights as loaded). Nothing to do where vLLM recorded no metadata."""
    try:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    except ImportError:
        return
    for part in module.modules():
        info = LAYERWISE_INFO.get(part)
        if info is not None:
            info.restore_device = torch.device("cpu")


def experts_per_token(group: str, module: nn.Module, planned: Any) -> int:
    """The picks per token vLLM routes this layer with (its ``top_k``), else the plan's k."""
    k = getattr(module, "top_k", None)
    if not isinstance(k, int) or k <= 0:
        k = getattr(planned, "experts_per_token", 0) or getattr(getattr(module, "moe_config", None),
                                                                 "experts_per_token", 0)
    if not k:
        raise PlanError(f"{group}: vLLM built these routed experts without a top_k the host's buffers "
                        "can be sized for; plan them served uva or on the device")
    return int(k)


def refill_share(experts: HostExperts, source: ExpertWeights | None = None) -> None:
    """After a reload: hold the device share's experts again (bf16, or MXFP4 as stored),
    from ``source`` (the reloaded layer's tensors; the host experts' own by default), into
    the device tensors a captured graph holds. A dense MLP's share is split again by
    :func:`resplit_after_reload`."""
    share = experts.share
    if share is None or experts.share_channels:
        return
    native = share.fmt == experts.weights.fmt and share.fmt not in ("bf16", "f32")
    held_share(experts.weights if source is None else source, share.num_experts, share.w13.device, native=native,
               into=share, ids=experts.share_ids)


def mechanism(experts: HostExperts) -> str:
    facts = getattr(experts, "thread_facts", None)
    threads = threads_words(facts) if facts else f"{experts.threads or 'all'} threads"
    share = experts.share
    return (f"{MECHANISM}: kernel {experts.weights.fmt}, {threads}; steps of more than "
            f"{experts.crossover_tokens} tokens copy the experts they use to the device"
            + ("" if share is None else f"; {_share_words(experts)} also on {share.w13.device} "
               f"({share.nbytes} bytes), computed there beside the CPU"))


def _share_words(experts: HostExperts) -> str:
    share = experts.share
    if experts.share_channels:
        return f"channels 0-{share.intermediate - 1}"
    ids = experts.share_ids
    return (f"experts 0-{share.num_experts - 1}" if ids == tuple(range(len(ids)))
            else f"experts {', '.join(map(str, ids))}")


def live_counters(experts: HostExperts):
    """What the report shows of ``experts``, read when asked; holds the counts, never the
    weights (the model belongs to vLLM and is released with it)."""
    counts, fixed = experts.counts, {"crossover_tokens": experts.crossover_tokens, "kernel": experts.weights.fmt,
                                     "threads": experts.threads, **getattr(experts, "thread_facts", {})}
    share = experts.share
    if share is None:
        return lambda: {"host_compute": counts.as_dict(), **fixed}
    fixed["device_share"] = {"what": _share_words(experts), "bytes": share.nbytes, "device": str(share.w13.device)}
    picks = experts.share_picks
    return lambda: {"host_compute": {**counts.as_dict(), "device_share_picks": int(picks.item())}, **fixed}


# ------------------------------------------------- the end of start-up: failures, then counts

#: Where the report's host-compute counts start once the engine has started.
SERVED_SINCE = "the end of vLLM's start-up (its profile run and warm-up steps not counted)"


def make_start_check(get_session: Any):
    """``Worker.compile_or_warm_up_model`` (``vllm.v1.worker.gpu_worker``, and every worker
    class that overrides it: the CPU build's ``CPUWorker``), wrapped. It is the last call
    vLLM's engine core makes of its workers before serving (``EngineCore``'s
    ``_initialize_kv_caches``: after the profile run of ``determine_available_memory``, and
    itself the compile warm-ups, CUDA graph capture and the sampler's warm-up): once it
    returns, and the device work it queued has run (a warm-up's host functions), a
    host-compute job that failed meanwhile raises here, in one line
    (:func:`cpu_kernels.raise_if_failed`), so the engine does not start, and every
    host-compute layer's counts start again (:data:`SERVED_SINCE`), so that the report's
    steps are served steps."""

    def wrap(original):
        def compile_or_warm_up_model(self, *args, **kwargs):
            result = original(self, *args, **kwargs)
            if torch.cuda.is_initialized():
                torch.cuda.synchronize()
            cpu_kernels.raise_if_failed(at_start=True)
            session = get_session()
            for attached in (session.attached.values() if session is not None else ()):
                reset = getattr(attached.wrapper(), "reset_counts", None)
                if callable(reset):
                    reset(SERVED_SINCE)
            return result

        compile_or_warm_up_model.__wrapped__ = original
        compile_or_warm_up_model.__name__ = getattr(original, "__name__", "compile_or_warm_up_model")
        compile_or_warm_up_model.__doc__ = getattr(original, "__doc__", None)
        return compile_or_warm_up_model

    return wrap


# ------------------------------------------------------------ failed jobs, at each step's sync

def check_at_step_sync(original: Any) -> Any:
    """``Worker.sample_tokens`` (``vllm.v1.worker.gpu_worker``; the CPU build's ``CPUWorker``
    inherits it), wrapped so that a host-compute job that failed makes its step raise
    (:func:`cpu_kernels.raise_if_failed`: one line naming the group and what to do) at the
    step's host synchronisation: after the step's device work has completed (so a CUDA host
    function the step queued, in a captured graph or not, has run) and before its sampled
    tokens leave the worker. Every path of both model runners returns its step's output
    here:

    - a ``ModelRunnerOutput`` (no asynchronous scheduling; the CPU build): the runner has
      already synchronised, in ``GPUModelRunner._bookkeeping_sync`` (``_to_list``: an
      event's ``synchronize()``; ``RejectionSampler.parse_output`` with speculative tokens),
      so the check runs now;
    - an ``AsyncModelRunnerOutput`` (asynchronous scheduling: ``AsyncGPUModelRunnerOutput``;
      vLLM's second model runner: ``AsyncOutput``, which it always returns): its tokens are
      still on their way; its ``get_output`` is wrapped, on that object, to check after its
      copy event's ``synchronize()``, before the lists it builds are returned.

    That holds on the rank whose output vLLM's executor reads (:func:`is_output_rank`). On
    every other rank of a tensor- or pipeline-parallel engine vLLM reads no output and only
    logs an exception, yet a failed job's NaN partial sums reach the output rank through the
    all-reduce while that rank's own count stays clean: there the check runs as
    ``sample_tokens`` returns, in every mode (:func:`end_if_failed`), and ends the worker.

    A job that failed while vLLM profiled or warmed up (outside any step) is raised at the
    end of start-up (:func:`make_start_check`)."""

    def sample_tokens(self, *args, **kwargs):
        output = original(self, *args, **kwargs)
        if not is_output_rank(self):
            end_if_failed(self, output)
            return output
        get_output = getattr(output, "get_output", None)
        if callable(get_output):
            def get_output_checked():
                result = get_output()
                cpu_kernels.raise_if_failed()
                return result

            output.get_output = get_output_checked
        else:
            cpu_kernels.raise_if_failed()
        return output

    sample_tokens.__wrapped__ = original
    sample_tokens.__name__ = getattr(original, "__name__", "sample_tokens")
    sample_tokens.__doc__ = getattr(original, "__doc__", None)
    return sample_tokens


def is_output_rank(worker: Any) -> bool:
    """Whether vLLM's executor reads this worker's step output: the rank its
    ``_get_output_rank`` names (``world_size - tensor_parallel_size *
    prefill_context_parallel_size``, TP rank 0 of the last pipeline stage; vLLM 0.33's
    ``MultiprocExecutor`` sends ``execute_model`` and ``sample_tokens`` with that
    ``unique_reply_rank``). Read from the worker's ``rank`` and ``parallel_config``; a
    worker without them (one rank) is its own output rank."""
    parallel, rank = getattr(worker, "parallel_config", None), getattr(worker, "rank", None)
    if parallel is None or rank is None:
        return True
    world = int(getattr(parallel, "world_size", 1) or 1)
    group = int(getattr(parallel, "tensor_parallel_size", 1) or 1) * int(
        getattr(parallel, "prefill_context_parallel_size", 1) or 1)
    return world <= 1 or int(rank) % world == world - group


def end_if_failed(worker: Any, output: Any) -> None:
    """On a rank whose step output vLLM does not read: wait for the step's device work when
    its output is still on its way (asynchronous, or none on an earlier pipeline stage; a
    ``ModelRunnerOutput`` was made after the runner's own synchronisation), then, when a
    job failed, log the failure's one line at error level and end this worker process
    (``os._exit(1)``). Raising would not do: vLLM's worker only logs an exception of a rank
    it reads no output from and takes the next step, while the output rank, its own count
    clean, returns the tokens the NaN partial sums made. vLLM's executor watches its
    workers' processes and fails the engine when one ends."""
    if (output is None or callable(getattr(output, "get_output", None))) and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    try:
        cpu_kernels.raise_if_failed()
    except cpu_kernels.JobFailed as e:
        logger.error("selective-offload: %s; this worker (rank %s) is not the rank whose output vLLM reads, so it "
                     "ends its process for vLLM to stop the engine", e, getattr(worker, "rank", "?"))
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(1)
