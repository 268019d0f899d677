"""Dense MLPs served ``compute``: a layer's whole MLP on the host CPU, as an MoE of one
expert every token takes, through the same host experts and op as routed experts
(:mod:`.host_compute`); its first channels optionally held on the device as a share.
Which vLLM linear methods are served, and in which CPU format: :data:`LINEAR_FORMATS`."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ..cpu_kernels import Activation, ExpertWeights, capability
from ..cpu_kernels.channels import split_channels
from ..cpu_kernels.reference import held_share
from ..errors import PlanError
from ..plan_format import Plan
from ..wrappers.host_buffers import HostBuffers
from ..wrappers.host_compute import HostExperts
from .host_compute import refuse_unserved, reload_on_host, thread_facts, threads_of
from .int4_layouts import AWQ_METHODS, CT_INT4, mlp_rows, refuse_unread_int4

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
    mlp_activation(group, mlp)
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


#: vLLM's act-and-mul modules by the registry name :mod:`..cpu_kernels.capability` reads
#: (``GeluAndMul`` by its ``approximate``).
MLP_ACTIVATIONS = {("SiluAndMul", None): "silu", ("GeluAndMul", "tanh"): "gelu_pytorch_tanh",
                   ("GeluAndMul", "none"): "gelu"}


def mlp_activation(group: str, mlp: nn.Module) -> Activation:
    """The kernel's activation for the dense MLP vLLM built, or a one-line refusal (the
    same table the planner reads: :func:`..cpu_kernels.capability.refusal`)."""
    act_fn = getattr(mlp, "act_fn", None)
    name = type(act_fn).__name__
    name = MLP_ACTIVATIONS.get((name, getattr(act_fn, "approximate", None)), name)
    bias = any(getattr(getattr(mlp, part, None), "bias", None) is not None for part in MLP_PARTS)
    layer = capability.HostLayer(capability.MLP, name, bias=bias)
    why = capability.refusal(layer)
    if why is not None:
        raise PlanError(f"{group}: the CPU kernels do not compute this MLP: {why}; plan it on the device")
    return capability.kernel_activation(layer)


def mlp_weights(group: str, mlp: nn.Module, fmt: str) -> ExpertWeights:
    """The MLP as one expert: W13 = gate_up_proj's [gate; up] rows, W2 = down_proj's."""
    gate_up, down = mlp.gate_up_proj, mlp.down_proj

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


def after_both_reloaded(mlp: nn.Module, action: Callable[[], None]) -> None:
    """Run ``action`` when vLLM's layer-by-layer reload has post-processed both of the
    MLP's projections, whichever comes last: the reload finishes each projection as soon as
    its own weights are in, in the checkpoint's key order (sorted: ``down_proj`` before
    ``gate_proj``/``up_proj``), so the first one done must not touch the other, which is
    still on the meta device then. The one finishing last has its new values in the tensors
    its post-processing sees, the other's already copied back into the tensors kept."""
    parts = (mlp.gate_up_proj, mlp.down_proj)
    done: set[int] = set()
    for part in parts:
        method = part.quant_method
        original = method.process_weights_after_loading

        def process_weights_after_loading(layer, _original=original):
            _original(layer)
            done.add(id(layer))
            if all(id(p) in done for p in parts):
                done.clear()
                action()

        method.process_weights_after_loading = process_weights_after_loading


def relayout_after_reload(mlp: nn.Module) -> None:
    """A reload copies GPTQ's layout into the same tensors and then runs each projection's
    post-processing (kept as loaded here): rewrite the MLP's rows again after both."""

    def relayout() -> None:
        mlp.__dict__.pop("_selective_offload_int4_rows", None)
        mlp_rows(mlp)

    after_both_reloaded(mlp, relayout)


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
    return host, held_share(share, 1, device)


def resplit_after_reload(group: str, mlp: nn.Module, experts: HostExperts, fmt: str, channels: int) -> None:
    """A reload copies the checkpoint's layout into the same tensors (and GPTQ's rows are
    rewritten again by :func:`relayout_after_reload`): split them again in place, the host
    part where the kernel reads it, and hold the new share in the device tensors a
    captured graph holds, once both projections are reloaded (:func:`after_both_reloaded`).
    vLLM's layer-by-layer reload copies the last projection's split values into its own
    tensors after this: the host experts keep reading those, at the same offsets, never
    the rebuilt copy."""

    def resplit() -> None:
        _, share = split_channels(mlp_weights(group, mlp, fmt), channels)  # in place; it fitted at install
        held_share(share, 1, experts.share.w13.device, into=experts.share)

    after_both_reloaded(mlp, resplit)


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
    experts = HostExperts(group, weights, mlp_activation(group, mlp), crossover_tokens=setting.crossover_tokens,
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
        if reduce:
            from vllm.distributed import tensor_model_parallel_all_reduce

            out = tensor_model_parallel_all_reduce(out)
        return out.reshape(x.shape)

    mlp.forward = forward
    mlp._selective_offload_host_mlp = experts  # the model holds the host experts, as it holds the MLP
    experts.thread_facts = thread_facts(experts.threads, setting)
    reload_on_host(mlp)
    return experts
