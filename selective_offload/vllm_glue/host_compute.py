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

GPTQ's and AWQ's int4 weights are the one layout changed: their create_weights pack along
the input dimension first, which a row walk cannot stream, so each tensor is rewritten
row-major in its own storage (:func:`int4_rows`), the same bytes in the page-locked arena,
and again after a reload. compressed-tensors' int4 (``pack-quantized``) is row-major
already and is read as loaded. 4-bit groups without act-order: symmetric (value = nibble
- 8), or AWQ's with zero points.

Which vLLM quant methods are served, and in which CPU format: :data:`FORMATS` (read from
vLLM 0.33's ``create_weights`` of each; checked by tests/contract). A method not listed,
or a format without a claimed kernel, is refused right after construction, in one line.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import torch
from torch import nn

from .. import cpu_kernels
from ..cpu_kernels import Activation, ExpertWeights
from ..cpu_kernels.channels import split_channels
from ..cpu_kernels.reference import held_share
from ..errors import PlanError
from ..estimate import share_native
from ..plan_format import GroupKind, Placement, Plan
from ..planner import kernels
from ..wrappers.host_buffers import HostBuffers
from ..wrappers.host_compute import HostExperts

#: The table's method (``kernels.method_of_vllm``) -> the CPU kernel's format, by the dtype
#: vLLM loads the weights in (unquantized experts are in the model's dtype).
FORMATS: dict[str, dict[torch.dtype | None, str]] = {
    "unquantized": {torch.bfloat16: "bf16", torch.float32: "f32"},
    "mxfp4": {None: "mxfp4"},
    "fp8-block": {None: "fp8-block"},
    "wna16": {None: "int4"},
}
#: The W4A16 methods whose create_weights layout :func:`int4_rows` reads (vLLM 0.33's
#: auto_gptq.py, and the names before its rename), for experts and for linears.
GPTQ_METHODS = ("AutoGPTQMoEMethod", "GPTQMarlinMoEMethod", "AutoGPTQLinearMethod", "GPTQMarlinLinearMethod")
#: The same for AWQ (the CPU build serves its linears by AutoAWQMarlinLinearMethod).
AWQ_METHODS = ("AutoAWQMoEMethod", "AWQMarlinMoEMethod", "AutoAWQLinearMethod", "AutoAWQMarlinLinearMethod",
               "AWQMarlinLinearMethod")
#: AWQ packs eight output columns per int32 in this order: nibble i holds column AWQ_ORDER[i].
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
#: compressed-tensors' W4A16 experts method and linear scheme, whose layout is the kernel's
#: (``weight_packed`` [.., N, K/8] int32 and ``weight_scale`` [.., N, K/g], row-major).
CT_INT4 = ("CompressedTensorsWNA16MoEMethod", "CompressedTensorsWNA16")
#: vLLM's activations the CPU kernel computes, by ``MoEActivation`` value.
ACTIVATIONS = {"silu": "silu", "swigluoai": "swigluoai"}
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
                        f"have no format for {what}; plan them host-uva or on the device")
    if fmt == "int4":
        refuse_unread_int4(group, method)
    refuse_unserved(f"{group}: the plan computes these routed experts on the host CPU in {fmt}", fmt, device)
    return fmt


def refuse_unread_int4(group: str, method: Any, what: str = "these routed experts") -> None:
    """W4A16 weights the int4 kernel reads: GPTQ's, AWQ's or compressed-tensors' layout,
    4-bit groups of a multiple of 32 columns (or one per channel), symmetric or with AWQ's
    zero points, no act-order; anything else one line."""
    name = type(method).__name__
    if name in CT_INT4:
        bits, sym, group_size = method.num_bits, bool(method.symmetric), method.group_size
        act_order = getattr(getattr(method, "weight_quant", None), "actorder", None) == "group"
    elif name in AWQ_METHODS:  # zero points the kernel reads: "symmetric" for its purpose
        qc = method.quant_config
        bits, sym, group_size, act_order = qc.weight_bits, bool(qc.zero_point), qc.group_size, False
    else:
        qc = getattr(method, "quant_config", None)
        bits = getattr(getattr(qc, "quant_type", None), "size_bits", None)
        sym, group_size = bool(getattr(qc, "is_sym", False)), getattr(qc, "group_size", None)
        act_order = bool(getattr(qc, "desc_act", False))
    why = None
    if name not in GPTQ_METHODS + AWQ_METHODS + CT_INT4:
        why = f"{name}'s layout (the int4 kernel reads GPTQ's, AWQ's and compressed-tensors')"
    elif bits != 4 or not sym:
        why = (f"{bits}-bit AWQ weights{'' if sym else ' without zero points'}" if name in AWQ_METHODS else
               f"{bits}-bit {'symmetric' if sym else 'asymmetric (zero points)'} weights")
    elif act_order:
        why = "act-order groups"
    elif not isinstance(group_size, int) or (group_size != -1 and group_size % 32):
        why = f"groups of {group_size} columns (the kernel reads multiples of 32)"
    if why is not None:
        raise PlanError(f"{group}: the plan computes {what} on the host CPU in int4, and the int4 kernel "
                        f"reads 4-bit groups (symmetric, or AWQ's with zero points), not {why}; plan them "
                        "host-uva or on the device")


def _unpack_awq(q: torch.Tensor) -> torch.Tensor:
    """AWQ's [.., rows, N/8] int32 as [.., rows, N] codes in column order."""
    nibbles = torch.stack([(q >> (4 * i)) & 0xF for i in range(8)], dim=-1)
    inverse = [AWQ_ORDER.index(c) for c in range(8)]
    return nibbles[..., inverse].flatten(-2).to(torch.uint8)


def awq_rows_in_place(q: torch.Tensor, scale: torch.Tensor, zeros: torch.Tensor | None):
    """One AWQ weight as the int4 kernel reads it, rewritten in its own storages: qweight
    ([E, K, N/8] or [K, N/8] int32, eight output columns per word in AWQ's order) as
    row-major nibbles [E, N, K/2], scales ([.., K/g, N]) as [E, N, K/g], and qzeros ([..,
    K/g, N/8], the same packing) as a byte per group for each pair of rows [E, N/2, K/g]
    (row 2m's zero point in the low nibble): each the same bytes as before."""
    q3, s3 = (q, scale) if q.dim() == 3 else (q.unsqueeze(0), scale.unsqueeze(0))
    E, K, packed = q3.shape
    codes = _unpack_awq(q3).transpose(1, 2)  # [E, N, K]
    # mutation: awq-rows-not-rewritten
    q3.view(-1).view(torch.uint8).copy_((codes[..., 0::2] | (codes[..., 1::2] << 4)).reshape(-1))
    s3.view(-1).copy_(s3.transpose(1, 2).contiguous().view(-1))
    N = packed * 8
    out = [q3.view(-1).view(torch.uint8).view(E, N, K // 2), s3.view(E, N, s3.shape[1])]
    if zeros is None:
        return *out, None
    z3 = zeros if zeros.dim() == 3 else zeros.unsqueeze(0)
    z = _unpack_awq(z3).transpose(1, 2)  # [E, N, K/g]
    z3.view(-1).view(torch.uint8).copy_((z[:, 0::2] | (z[:, 1::2] << 4)).reshape(-1))
    return *out, z3.view(-1).view(torch.uint8).view(E, N // 2, z.shape[-1])


def rows_in_place(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One GPTQ weight as the int4 kernel reads it, rewritten in its own storage: qweight
    ([E, K/8, N] or [K/8, N] int32, 8 nibbles of consecutive inputs per word) and scales
    ([E, K/g, N] or [K/g, N]) transposed row-major (the output's rows, their inputs
    consecutive: a word's nibbles are then bytes in the order the kernel reads, low nibble
    first). Returns uint8 [E, N, K/2] and scales [E, N, K/g] (E = 1 for a linear)."""
    q3, s3 = (q, scale) if q.dim() == 3 else (q.unsqueeze(0), scale.unsqueeze(0))
    E, packed, N = q3.shape
    # mutation: gptq-rows-not-transposed
    q3.view(-1).copy_(q3.transpose(1, 2).contiguous().view(-1))
    s3.view(-1).copy_(s3.transpose(1, 2).contiguous().view(-1))
    return q3.view(-1).view(torch.uint8).view(E, N, packed * 4), s3.view(E, N, s3.shape[1])


def _rewritten(which: str, q: torch.Tensor, scale: torch.Tensor, zeros: Any, awq: bool) -> dict[str, torch.Tensor]:
    """``which``'s tensors (``w13`` or ``w2``) for the int4 kernel, GPTQ's or AWQ's (with its
    zero points, when it holds them) rewritten in place."""
    if not awq:
        return dict(zip((which, f"{which}_scale"), rows_in_place(q, scale)))
    z = zeros.data if isinstance(zeros, torch.Tensor) else None
    return dict(zip((which, f"{which}_scale", f"{which}_zeros"), awq_rows_in_place(q, scale, z)))


def int4_rows(module: nn.Module, awq: bool, shared: frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
    """GPTQ's or AWQ's experts as the int4 kernel reads them, each of w13/w2 rewritten in
    place (:func:`rows_in_place`, :func:`awq_rows_in_place`). Idempotent: a module already
    rewritten is read as it is."""
    done = getattr(module, "_selective_offload_int4_rows", None)
    if done is not None:
        return done
    out = {}
    for which in ("w13", "w2"):
        out.update(_rewritten(which, getattr(module, f"{which}_qweight").data, getattr(module, f"{which}_scales").data,
                              getattr(module, f"{which}_qzeros", None), awq))
    loaded = getattr(module, "_loaded_expert_biases", ())
    for name in ("w13_bias", "w2_bias"):
        t = getattr(module, name, None)
        if isinstance(t, torch.Tensor) and name in loaded and name not in shared:
            out[name] = t.data
    module._selective_offload_int4_rows = out
    return out


def refuse_unserved(what: str, fmt: str, device: torch.device) -> None:
    """``fmt`` served here, or a one-line refusal that starts with ``what``: its kernel
    built and claimed, and on CUDA one with a C job a host function can run."""
    reason = cpu_kernels.unavailable_reason(fmt)
    if reason is None and fmt in cpu_kernels.TORCH_FORMATS and device.type == "cuda":
        reason = ("float32 weights are computed by torch's ops, with no C job a CUDA host function could run; "
                  "serve the model in bf16 (--dtype bfloat16)")
    if reason is not None:
        raise PlanError(f"{what}, and {reason}")


def activation_of(group: str, module: nn.Module) -> Activation:
    act = getattr(getattr(module, "activation", None), "value", getattr(module, "activation", None))
    kind = ACTIVATIONS.get(str(act))
    if kind is None:
        raise PlanError(f"{group}: the CPU kernels do not compute the {act} activation; plan these routed "
                        "experts host-uva or on the device")
    if kind == "swigluoai":
        config = getattr(module, "moe_config", None)
        alpha = getattr(config, "swiglu_alpha", None)
        limit = getattr(config, "swiglu_limit", None)
        return Activation("swigluoai", alpha=1.702 if alpha is None else float(alpha),
                          limit=7.0 if limit is None else float(limit))
    return Activation("silu")


def refuse_unsupported(group: str, method: Any, module: nn.Module, device: torch.device) -> None:
    """What the host path cannot honour, refused right after construction."""
    format_of(group, method, module, device)
    activation_of(group, module)
    if getattr(module, "apply_router_weight_on_input", False):
        raise PlanError(f"{group}: vLLM applies this layer's router weights to the input (Llama-4 style), which "
                        "the CPU kernels do not; plan these routed experts host-uva or on the device")


def threads_of(setting: Any, device: torch.device = torch.device("cpu")) -> int | None:
    """The plan's threads per rank; unstated, the physical cores of the NUMA node vLLM binds
    this worker to (the probe's count, the plan's default) split between the ranks. ``None``
    with one rank on vLLM's CPU build: the kernel takes torch's intra-op threads, which its
    CPU worker binds to its cores. Not on CUDA: vLLM 0.33's GPU worker leaves torch one
    thread for serving (``set_torch_threads_for_runtime``), so the count is the cores',
    stated, less the one vLLM's engine thread runs on (the kernel's threads inherit the
    worker's binding)."""
    # mutation: cuda-threads-from-torch
    if setting.threads is not None or (setting.ranks <= 1 and torch.device(device).type != "cuda"):
        return setting.threads
    from ..probe.host_compute import physical_cores_of_one_node

    per_rank = physical_cores_of_one_node() // setting.ranks
    # mutation: engine-thread-given-no-core
    return max(1, per_rank - 1 if torch.device(device).type == "cuda" else per_rank)


def refuse_other_ranks(plan: Plan | None, vllm_config: Any) -> None:
    """A plan priced for another number of ranks sharing the host (its threads and its
    share of the host's bandwidth) refused before anything is built."""
    if plan is None or plan.host_compute is None:
        return
    parallel = getattr(vllm_config, "parallel_config", None)
    ranks = int(getattr(parallel, "tensor_parallel_size", 1) or 1) * int(getattr(parallel, "data_parallel_size", 1) or 1)
    # mutation: host-compute-ranks-unchecked
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

        def __init__(self, original: Any, experts: HostExperts):
            nn.Module.__init__(self)
            FusedMoEMethodBase.__init__(self, original.moe)
            object.__setattr__(self, "original", original)
            object.__setattr__(self, "experts", experts)
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
            if self.experts.weights.fmt == "int4" and not hasattr(layer, "w13_weight_packed"):
                layer.__dict__.pop("_selective_offload_int4_rows", None)
                int4_rows(layer, type(self.original).__name__ in AWQ_METHODS)
            refill_share(self.experts)  # the device's copy of the first experts follows
            return None

        def apply(self, layer, x, topk_weights, topk_ids, shared_experts=None, shared_experts_input=None):
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
                          # mutation: device-share-ignored
                          device_share=held_share(weights, on_device, device, native=share_native(fmt, True))
                          if on_device else None)
    # mutation: host-compute-not-installed
    module._replace_quant_method(method_class()(method, experts))
    return experts


def experts_per_token(group: str, module: nn.Module, planned: Any) -> int:
    """The picks per token vLLM routes this layer with (its ``top_k``), else the plan's k."""
    k = getattr(module, "top_k", None)
    if not isinstance(k, int) or k <= 0:
        k = getattr(planned, "experts_per_token", 0) or getattr(getattr(module, "moe_config", None),
                                                                 "experts_per_token", 0)
    if not k:
        raise PlanError(f"{group}: vLLM built these routed experts without a top_k the host's buffers "
                        "can be sized for; plan them host-uva or on the device")
    return int(k)


def refill_share(experts: HostExperts) -> None:
    """A reload copies the checkpoint into the host tensors in place: hold the device
    share's experts again (bf16, or MXFP4 as stored), into the device tensors a captured
    graph holds. A dense MLP's share is split again by :func:`resplit_after_reload`."""
    share = experts.share
    if share is None or experts.share_channels:
        return
    native = share.fmt == experts.weights.fmt and share.fmt not in ("bf16", "f32")
    # mutation: share-not-refilled-after-reload
    held_share(experts.weights, share.num_experts, share.w13.device, native=native, into=share)


def mechanism(experts: HostExperts) -> str:
    threads = experts.threads or "all"
    share = experts.share
    return (f"{MECHANISM}: kernel {experts.weights.fmt}, {threads} threads; steps of more than "
            f"{experts.crossover_tokens} tokens copy the experts they use to the device"
            + ("" if share is None else f"; {_share_words(experts)} also on {share.w13.device} "
               f"({share.nbytes} bytes), computed there beside the CPU"))


def _share_words(experts: HostExperts) -> str:
    share = experts.share
    return (f"channels 0-{share.intermediate - 1}" if experts.share_channels
            else f"experts 0-{share.num_experts - 1}")


def live_counters(experts: HostExperts):
    """What the report shows of ``experts``, read when asked; holds the counts, never the
    weights (the model belongs to vLLM and is released with it)."""
    counts, fixed = experts.counts, {"crossover_tokens": experts.crossover_tokens, "kernel": experts.weights.fmt,
                                     "threads": experts.threads}
    share = experts.share
    if share is None:
        return lambda: {"host_compute": counts.as_dict(), **fixed}
    fixed["device_share"] = {"what": _share_words(experts), "bytes": share.nbytes, "device": str(share.w13.device)}
    picks = experts.share_picks
    return lambda: {"host_compute": {**counts.as_dict(), "device_share_picks": int(picks.item())}, **fixed}


# --------------------------------------------------------------------------- dense MLPs

#: A dense MLP's fused projections as vLLM builds them (Qwen2/Qwen3/Llama/Mistral MLPs:
#: ``gate_up_proj`` a MergedColumnParallelLinear of [gate; up], ``down_proj`` a
#: RowParallelLinear, ``act_fn`` SiluAndMul).
MLP_PARTS = ("gate_up_proj", "down_proj")
#: The linear methods the CPU kernels read, by ``type(quant_method).__name__`` and weight dtype.
LINEAR_FORMATS: dict[str, dict[torch.dtype | None, str]] = {
    "UnquantizedLinearMethod": {torch.bfloat16: "bf16", torch.float32: "f32"},
    "Fp8LinearMethod": {None: "fp8-block"},
    "AutoGPTQLinearMethod": {None: "int4"},
    "GPTQMarlinLinearMethod": {None: "int4"},
    "CompressedTensorsLinearMethod": {None: "int4"},  # its W4A16 scheme only (mlp_format)
    **{name: {None: "int4"} for name in AWQ_METHODS if "Linear" in name},
}


def mlp_format(group: str, mlp: nn.Module, device: torch.device) -> str:
    """The CPU kernel's format for a dense MLP's projections, or a one-line refusal."""
    parts = [getattr(mlp, name, None) for name in MLP_PARTS]
    if any(p is None or not hasattr(p, "quant_method") for p in parts):
        raise PlanError(f"{group}: the plan computes this MLP on the host CPU, and vLLM built it as "
                        f"{type(mlp).__name__} without fused gate_up_proj and down_proj linears; plan it on the device")
    act = type(getattr(mlp, "act_fn", None)).__name__
    if act != "SiluAndMul":
        raise PlanError(f"{group}: the CPU kernels compute SiLU-gated MLPs, and this one's activation is {act}; "
                        "plan it on the device")
    formats = set()
    for part in parts:
        method = type(part.quant_method).__name__
        by_dtype = LINEAR_FORMATS.get(method, {})
        weight = next((t for t in (getattr(part, n, None) for n in ("weight", "qweight", "weight_packed"))
                       if isinstance(t, torch.Tensor)), None)
        dtype = None if weight is None else weight.dtype
        fmt = by_dtype.get(dtype if None not in by_dtype else None)
        if fmt == "fp8-block" and not getattr(part.quant_method, "block_quant", False):
            fmt = None
        scheme = getattr(part, "scheme", None)
        if method == "CompressedTensorsLinearMethod" and type(scheme).__name__ not in CT_INT4:
            fmt = None
        if fmt == "int4":
            refuse_unread_int4(group, scheme if scheme is not None else part.quant_method, "this MLP")
        if fmt is None:
            raise PlanError(f"{group}: the CPU kernels have no format for {method} with {dtype} weights; plan this "
                            "MLP on the device")
        formats.add(fmt)
    if len(formats) != 1:
        raise PlanError(f"{group}: its projections are in different formats ({', '.join(sorted(formats))}); plan this "
                        "MLP on the device")
    fmt = formats.pop()
    refuse_unserved(f"{group}: the plan computes this MLP on the host CPU in {fmt}", fmt, device)
    return fmt


def mlp_weights(group: str, mlp: nn.Module, fmt: str) -> ExpertWeights:
    """The MLP as one expert: W13 = gate_up_proj's [gate; up] rows, W2 = down_proj's."""
    gate_up, down = mlp.gate_up_proj, mlp.down_proj
    for part in (gate_up, down):
        if getattr(part, "bias", None) is not None:
            raise PlanError(f"{group}: {type(part).__name__} has a bias, which the host MLP does not add; plan this "
                            "MLP on the device")

    def scale(part: nn.Module) -> torch.Tensor | None:
        t = getattr(part, "weight_scale_inv", None)
        return None if t is None else t.data.unsqueeze(0)

    if fmt == "int4":
        return ExpertWeights(fmt, **mlp_rows(mlp))
    block = getattr(gate_up.quant_method, "weight_block_size", None)
    extra = {"block": tuple(block)} if fmt == "fp8-block" and block else {}
    try:
        return ExpertWeights(fmt, gate_up.weight.data.unsqueeze(0), down.weight.data.unsqueeze(0),
                             w13_scale=scale(gate_up), w2_scale=scale(down), **extra)
    except ValueError as exc:
        raise PlanError(f"{group}: its weights are not in the layout the CPU kernel reads ({exc}); plan this MLP "
                        "on the device") from None


def mlp_rows(mlp: nn.Module) -> dict[str, torch.Tensor]:
    """An int4 MLP as one expert: compressed-tensors' projections as loaded, GPTQ's and AWQ's
    rewritten in place (:func:`rows_in_place`, :func:`awq_rows_in_place`); idempotent, as
    :func:`int4_rows`."""
    parts = (("w13", mlp.gate_up_proj), ("w2", mlp.down_proj))
    if all(isinstance(getattr(p, "weight_packed", None), torch.Tensor) for _, p in parts):  # compressed-tensors
        return {k: v for which, p in parts for k, v in ((which, p.weight_packed.data.view(torch.uint8).unsqueeze(0)),
                                                        (f"{which}_scale", p.weight_scale.data.unsqueeze(0)))}
    done = getattr(mlp, "_selective_offload_int4_rows", None)
    if done is None:
        done = {}
        for which, part in parts:
            done.update(_rewritten(which, part.qweight.data, part.scales.data, getattr(part, "qzeros", None),
                                   type(part.quant_method).__name__ in AWQ_METHODS))
        mlp._selective_offload_int4_rows = done
    return done


def relayout_after_reload(mlp: nn.Module) -> None:
    """A reload copies GPTQ's layout into the same tensors and then runs each projection's
    post-processing (kept as loaded here): rewrite the MLP's rows again after it."""
    for part in (mlp.gate_up_proj, mlp.down_proj):
        method = part.quant_method
        original = method.process_weights_after_loading

        def process_weights_after_loading(layer, _original=original):
            _original(layer)
            # mutation: int4-reload-not-rewritten
            mlp.__dict__.pop("_selective_offload_int4_rows", None)
            if layer is mlp.down_proj:  # both projections reloaded: the MLP's rows again
                mlp_rows(mlp)

        method.process_weights_after_loading = process_weights_after_loading


def split_mlp(group: str, weights: ExpertWeights, channels: int,
              device: torch.device) -> tuple[ExpertWeights, ExpertWeights | None]:
    """The MLP's host part and its device share (the first ``channels`` channels held on
    ``device``: :func:`cpu_kernels.reference.held_share`), rearranged in the MLP's own storage
    (:func:`cpu_kernels.channels.split_channels`); without a share, the MLP as it is and ``None``."""
    if not channels:
        return weights, None
    try:
        host, share = split_channels(weights, channels)
    except ValueError as exc:
        raise PlanError(f"{group}: the plan keeps the first {channels} channels of this MLP on the device, and they "
                        f"cannot be split off here ({exc}); plan with --no-device-share") from None
    # mutation: channel-share-not-copied
    return host, held_share(share, 1, device)


def resplit_after_reload(group: str, mlp: nn.Module, experts: HostExperts, fmt: str, channels: int) -> None:
    """A reload copies the checkpoint's layout into the same tensors (and GPTQ's rows are
    rewritten again by :func:`relayout_after_reload`): split them again in place, the host
    part where the kernel reads it, and hold the new share in the device tensors a
    captured graph holds."""
    down = mlp.down_proj
    original = down.quant_method.process_weights_after_loading

    def process_weights_after_loading(layer, _original=original):
        _original(layer)
        # mutation: channel-resplit-skipped
        if layer is down:  # both projections reloaded
            host, share = split_channels(mlp_weights(group, mlp, fmt), channels)  # it fitted at install
            experts.weights = host
            held_share(share, 1, experts.share.w13.device, into=experts.share)

    down.quant_method.process_weights_after_loading = process_weights_after_loading


def install_mlp(group: str, mlp: nn.Module, plan: Plan, device: torch.device,
                buffers: HostBuffers | None = None) -> HostExperts:
    """Serve the dense MLP ``mlp`` on the host CPU from now on: an MoE of one expert that
    every token takes, through the same host experts and op as routed experts. With tensor
    parallelism each rank computes its shard and the partial sums are all-reduced, as
    ``down_proj`` (a RowParallelLinear) would."""
    from ..wrappers.host_compute import register

    fmt = mlp_format(group, mlp, device)
    setting = plan.host_compute
    if setting is None:
        raise PlanError(f"{group}: the plan computes this MLP on the host but states no crossover (host_compute); "
                        "make the plan again")
    planned = plan.group_of(group)
    channels = planned.device_channels if planned is not None else 0
    weights, share = split_mlp(group, mlp_weights(group, mlp, fmt), channels, device)
    experts = HostExperts(group, weights, Activation("silu"), crossover_tokens=setting.crossover_tokens,
                          threads=threads_of(setting, device), device=device, device_share=share, share_channels=True,
                          buffers=buffers, experts_per_token=1)
    if fmt == "int4" and not isinstance(getattr(mlp.gate_up_proj, "weight_packed", None), torch.Tensor):
        relayout_after_reload(mlp)  # GPTQ's rows, rewritten at install
    if channels:
        resplit_after_reload(group, mlp, experts, fmt, channels)
    key = register(experts)
    down = mlp.down_proj
    reduce = bool(getattr(down, "reduce_results", True)) and int(getattr(down, "tp_size", 1) or 1) > 1

    def forward(x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        tokens = flat.shape[0]
        ids = torch.zeros((tokens, 1), dtype=torch.int32, device=flat.device)
        weights = torch.ones((tokens, 1), dtype=torch.float32, device=flat.device)
        out = torch.ops.selective_offload.experts_on_host(flat, ids, weights, key)
        # mutation: host-mlp-not-reduced
        if reduce:
            from vllm.distributed import tensor_model_parallel_all_reduce

            out = tensor_model_parallel_all_reduce(out)
        return out.reshape(x.shape)

    # mutation: host-mlp-not-installed
    mlp.forward = forward
    mlp._selective_offload_host_mlp = experts  # the model holds the host experts, as it holds the MLP
    return experts
