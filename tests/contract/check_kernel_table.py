"""Run vLLM 0.33's own MoE quant methods and kernel oracles for every row of
``selective_offload.planner.kernels`` and say, per row, what vLLM picked.

Run in a subprocess with 0.33's extracted sources first on ``sys.path`` (see
tests/contract/test_kernel_table.py). One line per row: ``ok ROW``, ``FAIL ROW: why``, or
``notrun ROW: why`` (then the row must be one the table lists in ``NOT_RUN``); then ``ok
advice ...`` / ``FAIL advice ...`` for each card and method whose default kernel does not
read UVA: the advised setting applied to the oracle must give a kernel that does.

Stand-ins, each for what cannot exist here (no GPU, the CUDA wheel's compiled parts absent):

- the platform: vLLM's own ``CudaPlatformBase`` with ``get_device_capability`` answering the
  row's card (its compiled-op import, ``vllm._C_stable_libtorch``, is an empty module). Modules
  are imported under the CPU platform first (their import-time probes call compiled ops), then
  ``current_platform`` is switched to the stand-in: the oracles read it at call time;
- the optional kernel packages the CUDA wheel ships or requires (flashinfer-python,
  vendored DeepGEMM and triton_kernels, humming-kernels): their ``has_*`` probes answer yes.
  Whether each kernel supports the card and the layer is still vLLM's own code;
- every ``functools`` cache in vLLM is cleared between rows (capability probes are cached);
- for the host post-processing check, tensor parallelism is one rank
  (``vllm.distributed.get_tensor_model_parallel_world_size`` answers 1: no process group here).

Then ``ok sizes ROW | SHAPE`` / ``FAIL sizes ...`` (or ``refused sizes ...`` where vLLM
refuses the layer at that shape) for every row vLLM builds, on gpt-oss's
(hidden 2880, intermediate 2880) and Qwen3-30B-A3B's (2048, 768) shapes: the row's quant
method's own ``maybe_roundup_sizes`` (what ``RoutedExperts`` calls before ``create_weights``)
must give the sizes ``kernels.allocated_sizes`` gives, and the bytes its ``create_weights``
allocates at those sizes (on the meta device, four experts) must be the bytes
``planner.allocation`` prices for the same layer at the shape's own sizes, and, where a
reference checkpoint has the layout (gpt-oss's MXFP4 and bf16 experts, Qwen3-MoE's bf16
ones), the bytes it prices for the checkpoint's own tensors (``..., the checkpoint's layout
too``).

Then ``ok off-table METHOD | SM CARD | SHAPE`` / ``FAIL off-table ...`` (``refused off-table``
where vLLM builds no kernel for the layer) for each method on each card of the table's
``OFF_TABLE_CARDS`` (compute capabilities vLLM can see that have no column of their own):
either the planner refuses the card (``kernels.sizes_known``), or vLLM's own selection and
round-up on that card give the sizes and bytes the planner prices, as for the rows above
(the pre-Ada cards 7.5 to 8.7 are columns of the table, run as its rows).

Then ``ok workspace KERNEL | SHAPE`` / ``FAIL workspace ...`` for each kernel of
``allocation.WORKSPACE_KERNELS`` on both shapes (gpt-oss's at Marlin's padded sizes): 0.33's own
``FusedMoEKernelModularImpl._allocate_buffers`` for that kernel, run twice (two layers) at a
step of 64 tokens against 0.33's own ``WorkspaceManager`` on the host, must hold one buffer
of the bytes ``allocation.fused_moe_workspace_bytes`` prices (one per process, not per layer).
Stand-in: ``torch.accelerator.empty_cache`` (the manager calls it before growing) is a no-op,
as there is no accelerator here.

Then ``ok post-processing CASE`` / ``FAIL post-processing ...``: what vLLM 0.33's
post-processing leaves where it grows what ``create_weights`` allocated, against
``allocation.post_processed_tensors``. Marlin FP8 runs 0.33's own
``prepare_fp8_layer_for_marlin`` (a dense linear, block and per-tensor, aligned and at a shape
Marlin pads) and ``prepare_fp8_moe_layer_for_marlin`` (routed experts, block, an intermediate
size Marlin pads) on host tensors; its repack, ``ops.gptq_marlin_repack``, is a CUDA op, so a
stand-in returns a tensor of the repacked shape (``marlin_repacked_nk``'s inverse), and every
scale is vLLM's own arithmetic. OAI triton_kernels' float32 expert biases (MXFP4 on SM 9.0)
need triton_kernels, which does not import here: the rule is read from 0.33's source
(``convert_gpt_oss_weight_to_mxfp4_moe_kernel_format``'s TRITON branch casts both biases to
float32), as this line says; FlashInfer TRT-LLM's (MXFP4 on SM 10.x) likewise, from the
TRTLLM branch of both conversions.

Then ``ok host-post-processing ...`` / ``FAIL ...`` for each pair in the table's
``HOST_POST_PROCESSING``: 0.33's own ``create_weights`` and ``process_weights_after_loading``
run on host tensors (card 8.9, where vLLM builds that kernel), and every parameter must stay
on the host with its bytes and strides.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
import sys
import types
from types import SimpleNamespace

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.pop("SELECTIVE_OFFLOAD_PLAN", None)
for _name in ("VLLM_USE_DEEP_GEMM", "VLLM_MOE_USE_DEEP_GEMM"):
    os.environ.pop(_name, None)

import torch  # noqa: E402

sys.modules["vllm._C_stable_libtorch"] = types.ModuleType("vllm._C_stable_libtorch")
import vllm.platforms as platforms  # noqa: E402
from vllm.platforms.cpu import CpuPlatform  # noqa: E402
from vllm.platforms.cuda import CudaPlatformBase  # noqa: E402
from vllm.platforms.interface import DeviceCapability  # noqa: E402

from selective_offload.planner import allocation, kernels  # noqa: E402
from selective_offload.tensors import TensorInfo  # noqa: E402


class StandInCuda(CudaPlatformBase):
    """vLLM's CUDA platform, on the row's card."""

    capability = (8, 9)

    @classmethod
    def get_device_capability(cls, device_id: int = 0) -> DeviceCapability:
        return DeviceCapability(*cls.capability)

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return "stand-in"


class Switch:
    """``current_platform`` for every module, delegating to the CPU platform while modules
    import and to :class:`StandInCuda` after."""

    def __init__(self, target) -> None:
        object.__setattr__(self, "target", target)

    def __getattr__(self, name):
        return getattr(object.__getattribute__(self, "target"), name)


SWITCH = Switch(CpuPlatform())
platforms._current_platform = SWITCH
ORACLES = ("unquantized", "fp8", "mxfp4", "int_wna16", "nvfp4", "int8")
for _o in ORACLES:  # import every kernel module the oracles can pick, under the CPU platform
    _m = importlib.import_module(f"vllm.model_executor.layers.fused_moe.oracle.{_o}")
    for _enum in [v for v in vars(_m).values() if isinstance(v, type) and v.__module__ == _m.__name__
                  and hasattr(v, "__members__")]:
        for _b in _enum:
            try:
                _m.backend_to_kernel_cls(_b)
            except Exception:  # noqa: BLE001 - a backend with no kernel classes of its own
                pass

from compressed_tensors.quantization import QuantizationArgs  # noqa: E402
from vllm.config import VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.model_executor.layers.fused_moe.layer import FusedMoEFactory  # noqa: E402
from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts  # noqa: E402
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod  # noqa: E402
from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (  # noqa: E402
    compressed_tensors_moe_w8a8_int8 as ct_int8,
)
from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (
    compressed_tensors_moe_wna16 as ct_wna16,
)
from vllm.model_executor.layers.quantization.fp8 import Fp8Config  # noqa: E402
from vllm.model_executor.layers.quantization.modelopt import ModelOptNvFp4Config, ModelOptNvFp4FusedMoE  # noqa: E402
from vllm.model_executor.layers.quantization.mxfp4 import GptOssMxfp4MoEMethod  # noqa: E402

AVAILABLE = {"has_flashinfer", "has_flashinfer_moe", "has_flashinfer_cutlass_fused_moe",
             "has_flashinfer_trtllm_fused_moe", "has_deep_gemm", "has_triton_kernels", "has_humming"}
PREFIX = "model.layers.0.mlp.experts"


def moe_config(activation: str, has_bias: bool, hidden: int, inter: int, experts: int, top_k: int):
    """vLLM's FusedMoEConfig as its FusedMoEFactory makes it (built under the CPU platform)."""
    with set_current_vllm_config(VllmConfig()), torch.device("meta"):
        runner = FusedMoEFactory(num_experts=experts, top_k=top_k, hidden_size=hidden, intermediate_size=inter,
                                 tp_size=1, dp_size=1, pcp_size=1, params_dtype=torch.bfloat16,
                                 activation=activation, has_bias=has_bias, prefix=PREFIX)
    return runner.routed_experts.moe_config


QWEN3 = moe_config("silu", False, 2048, 768, 128, 8)        # Qwen3-30B-A3B's experts
GPT_OSS = moe_config("swigluoai", True, 2880, 2880, 32, 4)  # gpt-oss-20b's experts


def to_standin() -> None:
    object.__setattr__(SWITCH, "target", StandInCuda())
    for name, module in list(sys.modules.items()):
        if name.startswith("vllm") and module is not None:
            for attr in AVAILABLE & set(vars(module)):
                if callable(vars(module)[attr]):
                    setattr(module, attr, lambda: True)


def clear_caches() -> None:
    for name, module in list(sys.modules.items()):
        if name.startswith("vllm") and module is not None:
            for value in list(vars(module).values()):
                if isinstance(value, functools._lru_cache_wrapper):
                    value.cache_clear()


def layer_of(config) -> RoutedExperts:
    layer = RoutedExperts.__new__(RoutedExperts)
    torch.nn.Module.__init__(layer)
    layer.moe_config = config
    return layer


def build(method: str, moe_backend: str):
    """vLLM's quant method for ``method`` (its constructor runs the oracle)."""
    if method == "mxfp4":
        return GptOssMxfp4MoEMethod(dataclasses.replace(GPT_OSS, moe_backend=moe_backend))
    config = dataclasses.replace(QWEN3, moe_backend=moe_backend)
    if method == "unquantized":
        return UnquantizedFusedMoEMethod(config)
    if method in ("fp8-tensor", "fp8-block"):
        block = [128, 128] if method == "fp8-block" else None
        return Fp8Config(True, "dynamic", None, block).get_quant_method(layer_of(config), PREFIX)
    if method == "wna16":
        weights = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=128)
        return ct_wna16.CompressedTensorsWNA16MoEMethod(weights, None, config)
    if method == "int8":
        weights = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel")
        acts = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)
        return ct_int8.CompressedTensorsW8A8Int8MoEMethod(weights, acts, config)
    if method == "nvfp4":
        return ModelOptNvFp4FusedMoE(ModelOptNvFp4Config(is_checkpoint_nvfp4_serialized=True), config)
    raise KeyError(method)


def oracle(method: str, card: str, setting: str) -> str:
    """The kernel class vLLM builds; raises what vLLM raises."""
    StandInCuda.capability = tuple(int(x) for x in card.split("."))
    env, moe_backend = {}, "auto"
    if setting == kernels.DEEP_GEMM_OFF:
        env = {"VLLM_USE_DEEP_GEMM": "0"}
    elif setting.startswith("--moe-backend "):
        moe_backend = setting.split()[-1]
    os.environ.update(env)
    clear_caches()
    config = VllmConfig()
    object.__setattr__(config, "model_config", SimpleNamespace(
        quantization_config=None, hf_text_config=SimpleNamespace(model_type="stand-in")))
    try:
        with set_current_vllm_config(config):
            return build(method, moe_backend).experts_cls.__name__
    finally:
        for key in env:
            os.environ.pop(key, None)


#: The shapes the sizes are checked on: (label, hidden, intermediate).
SHAPES = (("gpt-oss", 2880, 2880), ("Qwen3-30B-A3B", 2048, 768))
EXPERTS = 4


def built(method: str, card: str, setting: str):
    """The row's quant method as vLLM builds it (its oracle run for the row's card and setting)."""
    StandInCuda.capability = tuple(int(x) for x in card.split("."))
    moe_backend = setting.split()[-1] if setting.startswith("--moe-backend ") else "auto"
    if setting == kernels.DEEP_GEMM_OFF:
        os.environ["VLLM_USE_DEEP_GEMM"] = "0"
    clear_caches()
    config = VllmConfig()
    object.__setattr__(config, "model_config", SimpleNamespace(
        quantization_config=None, hf_text_config=SimpleNamespace(model_type="stand-in")))
    try:
        with set_current_vllm_config(config):
            return build(method, moe_backend), config
    finally:
        os.environ.pop("VLLM_USE_DEEP_GEMM", None)


def allocated_layer(quant, config, hidden: int, intermediate: int, unpadded: int) -> dict[str, TensorInfo]:
    """The parameters 0.33's ``create_weights`` allocates for ``quant`` at these sizes
    (meta device; ``unpadded``: the hidden size before the round-up, as ``RoutedExperts``
    passes it), as the planner's tensors (under an experts module's name)."""
    layer = layer_of(quant.moe)
    with set_current_vllm_config(config), torch.device("meta"):
        quant.create_weights(layer, num_experts=EXPERTS, hidden_size=hidden,
                             intermediate_size_per_partition=intermediate, params_dtype=torch.bfloat16,
                             weight_loader=lambda *a, **k: None, unpadded_hidden_size=unpadded,
                             global_num_experts=EXPERTS)
    tensors = {}
    for name, t in [*layer.named_parameters(), *layer.named_buffers()]:
        tensors[f"{PREFIX}.{name}"] = TensorInfo(f"{PREFIX}.{name}", str(t.dtype), tuple(t.shape),
                                                 t.numel() * t.element_size())
    return tensors


def checkpoint_layout(method: str, shape: str, hidden: int, intermediate: int) -> dict[str, TensorInfo] | None:
    """The routed experts of one layer as a checkpoint stores them (``EXPERTS`` of them), for
    the layouts the reference models ship: gpt-oss's MXFP4 blocks, scales and bf16 biases;
    fused bf16 ``[E, in, out]`` experts as transformers saves gpt-oss's (no biases: the
    unquantized rows are built without them); Qwen3-MoE's bf16 module per expert. ``None``
    for a method and shape no reference checkpoint has."""
    from selective_offload.tensors import tensor_nbytes

    h, i, e = hidden, intermediate, EXPERTS
    if method == "mxfp4" and shape == "gpt-oss":
        layout = {"gate_up_proj_blocks": ("U8", [e, 2 * i, h // 32, 16]),
                  "gate_up_proj_scales": ("U8", [e, 2 * i, h // 32]), "gate_up_proj_bias": ("BF16", [e, 2 * i]),
                  "down_proj_blocks": ("U8", [e, h, i // 32, 16]), "down_proj_scales": ("U8", [e, h, i // 32]),
                  "down_proj_bias": ("BF16", [e, h])}
    elif method == "unquantized" and shape == "gpt-oss":
        layout = {"gate_up_proj": ("BF16", [e, h, 2 * i]), "down_proj": ("BF16", [e, i, h])}
    elif method == "unquantized":
        layout = {f"{x}.{proj}.weight": ("BF16", [i, h] if proj != "down_proj" else [h, i])
                  for x in range(e) for proj in ("gate_proj", "up_proj", "down_proj")}
    else:
        return None
    return {f"{PREFIX}.{n}": TensorInfo(f"{PREFIX}.{n}", d, tuple(dims), tensor_nbytes(d, dims))
            for n, (d, dims) in layout.items()}


def sizes(method: str, card: str, setting: str, kernel: str, hidden: int, intermediate: int, shape: str = "") -> str:
    """What vLLM allocates when its round-up and allocation for the row agree with the
    planner's, else what differs (``vLLM ...``)."""
    import vllm.distributed as distributed
    import vllm.model_executor.parameter as parameter

    distributed.get_tensor_model_parallel_world_size = lambda: 1  # no process group here
    parameter.get_tensor_model_parallel_rank = lambda: 0
    parameter.get_tensor_model_parallel_world_size = lambda: 1
    quant, config = built(method, card, setting)
    with set_current_vllm_config(config):
        got = tuple(quant.maybe_roundup_sizes(hidden, intermediate, torch.bfloat16, quant.moe.moe_parallel_config))
    mine = kernels.allocated_sizes(method, kernel, hidden, intermediate)
    if got != mine:
        return f"vLLM rounds ({hidden}, {intermediate}) up to {got}, the planner to {mine}"
    vllm_bytes = sum(t.nbytes for t in allocated_layer(quant, config, *got, hidden).values())
    padding = allocation.Padding(method, kernel, card, hidden, intermediate, *mine)
    stored = allocated_layer(quant, config, hidden, intermediate, hidden)
    priced = sum(t.nbytes for t in allocation.allocated_tensors(stored, padding).values())
    if priced != vllm_bytes:
        return (f"vLLM allocates {vllm_bytes / EXPERTS:g} bytes per expert at {got}, the planner prices "
                f"{priced / EXPERTS:g}")
    stored = checkpoint_layout(method, shape, hidden, intermediate)
    if stored is not None:  # the checkpoint's own tensors, priced by the planner, against vLLM's allocation
        if sum(t.nbytes for t in stored.values()) != sum(t.nbytes for t in allocated_layer(
                quant, config, hidden, intermediate, hidden).values()):
            return "vLLM allocates other bytes than the checkpoint holds at the checkpoint's own sizes"
        priced = sum(t.nbytes for t in allocation.allocated_tensors(stored, padding).values())
        if priced != vllm_bytes:
            return (f"vLLM allocates {vllm_bytes / EXPERTS:g} bytes per expert at {got}, the planner prices the "
                    f"checkpoint's experts at {priced / EXPERTS:g}")
    return f"{vllm_bytes // EXPERTS} bytes per expert at {got}" + (", the checkpoint's layout too" if stored else "")


def host_post_processing(method: str, kernel: str) -> str:
    """Run 0.33's post-processing of ``method`` for ``kernel`` on host tensors; '' when every
    parameter stays on the host with its bytes and strides, else what changed."""
    import vllm.distributed as distributed

    distributed.get_tensor_model_parallel_world_size = lambda: 1
    StandInCuda.capability = (8, 9)
    clear_caches()
    config = VllmConfig()
    object.__setattr__(config, "model_config", SimpleNamespace(
        quantization_config=None, hf_text_config=SimpleNamespace(model_type="stand-in")))
    with set_current_vllm_config(config):
        quant = build(method, "auto")
        if quant.experts_cls.__name__ != kernel:
            return f"vLLM built {quant.experts_cls.__name__} on SM 8.9, not {kernel}"
        layer = layer_of(dataclasses.replace(QWEN3, moe_backend="auto"))
        quant.create_weights(layer, num_experts=4, hidden_size=256, intermediate_size_per_partition=128,
                             params_dtype=torch.bfloat16, weight_loader=lambda *a, **k: None)
        if method == "fp8-block":
            layer.weight_block_size = [128, 128]
        torch.manual_seed(0)
        for p in layer.parameters():
            p.data = (torch.rand(p.shape) + 0.5).to(p.dtype)
        before = {n: (p.data.clone(), p.stride()) for n, p in layer.named_parameters()}
        quant.process_weights_after_loading(layer)
        for n, p in layer.named_parameters():
            data, stride = before.get(n, (None, None))
            if p.device.type != "cpu":
                return f"{n} went to {p.device}"
            if data is None or p.stride() != stride or not torch.equal(p.data.flatten().view(torch.uint8),
                                                                       data.flatten().view(torch.uint8)):
                return f"{n} changed (shape {tuple(p.shape)}, stride {p.stride()})"
    return ""


def workspace(kernel: str, hidden: int, intermediate: int, top_k: int, activation: str, tokens: int = 64) -> str:
    """What 0.33's modular kernel asks its workspace manager for, for two layers of ``kernel``
    at ``tokens`` tokens, against what the planner prices; '' when they agree."""
    from vllm.model_executor.layers.fused_moe import modular_kernel as mk
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.experts.marlin_moe import MarlinExperts
    from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts
    from vllm.v1.worker import workspace as ws

    torch.accelerator.empty_cache = lambda: None  # no accelerator here (see the module docstring)
    cls = {"MarlinExperts": MarlinExperts, "TritonExperts": TritonExperts}[kernel]
    # N as each kernel's moe_problem_size reads it: Marlin's intermediate, Triton's w1 rows (2I)
    n = intermediate if kernel == "MarlinExperts" else 2 * intermediate
    ws.init_workspace_manager(torch.device("cpu"))
    layer = SimpleNamespace(fused_experts=object.__new__(cls), prepare_finalize=SimpleNamespace(
        allocate_fused_expert_output=lambda *a, **k: None))
    for _ in range(2):  # two layers of the model: one process, one buffer
        mk.FusedMoEKernelModularImpl._allocate_buffers(layer, torch.bfloat16, torch.device("cpu"), tokens, tokens, n,
                                                       hidden, top_k, 32, 32, None, MoEActivation(activation))
    held = [w for w in ws.current_workspace_manager()._current_workspaces if w is not None]
    mine = allocation.fused_moe_workspace_bytes(tokens, top_k, hidden, intermediate)
    if len(held) != 1 or held[0].numel() != mine:
        return f"vLLM holds {[w.numel() for w in held]} bytes, the planner prices {mine}"
    return ""


def post_processing() -> list[tuple[str, str]]:
    """(case, '' or what differs) for each post-processing rule of ``planner.allocation``."""
    import inspect

    import vllm._custom_ops as ops
    from vllm.model_executor.layers.fused_moe.oracle import mxfp4 as oracle_mxfp4
    from vllm.model_executor.layers.quantization.utils import marlin_utils_fp8 as mf8

    def repack(b_q_weight, size_k, size_n, num_bits, **_):  # stand-in: the repacked shape, no data
        return torch.zeros((size_k // 16, size_n * 16 // (32 // num_bits)), dtype=torch.int32)

    ops.gptq_marlin_repack = repack
    mf8.ops.gptq_marlin_repack = repack
    out = []

    def nbytes(*ts) -> int:
        return sum(t.numel() * t.element_size() for t in ts)

    def dense(n: int, k: int, block: bool) -> str:
        layer = torch.nn.Module()
        layer.weight = torch.nn.Parameter(torch.zeros(n, k, dtype=torch.float8_e4m3fn), requires_grad=False)
        if block:
            layer.weight_scale_inv = torch.nn.Parameter(torch.ones(-(-n // 128), -(-k // 128)), requires_grad=False)
            layer.weight_block_size = [128, 128]
        else:
            layer.weight_scale = torch.nn.Parameter(torch.ones(1), requires_grad=False)
            layer.weight = torch.nn.Parameter(layer.weight.data.t(), requires_grad=False)  # (K, N), size_k_first
        layer.output_size_per_partition, layer.input_size_per_partition = n, k
        layer.orig_dtype, layer.bias = torch.bfloat16, None
        scale = "weight_scale_inv" if block else "weight_scale"
        stored = {"l.weight": TensorInfo("l.weight", "F8_E4M3", (n, k), n * k),
                  f"l.{scale}": TensorInfo(f"l.{scale}", "F32", tuple(getattr(layer, scale).shape),
                                           nbytes(getattr(layer, scale)))}
        mf8.prepare_fp8_layer_for_marlin(layer, size_k_first=not block)
        got = nbytes(layer.weight, getattr(layer, scale))
        post = allocation.PostProcessing("fp8-block" if block else "fp8-tensor", "8.6", None, True,
                                         (128, 128) if block else None, None)
        mine = sum(t.nbytes for t in allocation.post_processed_tensors(stored, post).values())
        return "" if got == mine else f"vLLM holds {got} bytes, the planner prices {mine}"

    def fp8_moe_layer(e: int, hidden: int, inter: int) -> tuple:
        """A block-FP8 MoE layer as 0.33's Marlin preparation takes it: (layer, w13, w2, w13's
        scales, w2's scales), zeros and ones."""
        layer = torch.nn.Module()
        layer.num_experts, layer.hidden_size, layer.intermediate_size_per_partition = e, hidden, inter
        layer.weight_block_size, layer.orig_dtype = [128, 128], torch.bfloat16
        w13 = torch.zeros(e, 2 * inter, hidden, dtype=torch.float8_e4m3fn)
        w2 = torch.zeros(e, hidden, inter, dtype=torch.float8_e4m3fn)
        s13, s2 = torch.ones(e, 2 * inter // 128, hidden // 128), torch.ones(e, hidden // 128, -(-inter // 128))
        return layer, w13, w2, s13, s2

    def experts(e: int, hidden: int, inter: int) -> str:
        layer, w13, w2, s13, s2 = fp8_moe_layer(e, hidden, inter)
        with set_current_vllm_config(VllmConfig()):
            got = nbytes(*mf8.prepare_fp8_moe_layer_for_marlin(layer, w13, w2, s13, s2))
        stored = {}
        for x in range(e):  # the checkpoint's per-expert modules
            for proj, (n, k) in (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)),
                                 ("down_proj", (hidden, inter))):
                name = f"{PREFIX}.{x}.{proj}"
                stored[f"{name}.weight"] = TensorInfo(f"{name}.weight", "F8_E4M3", (n, k), n * k)
                shape = (-(-n // 128), -(-k // 128))
                stored[f"{name}.weight_scale_inv"] = TensorInfo(f"{name}.weight_scale_inv", "F32", shape,
                                                                4 * shape[0] * shape[1])
        post = allocation.PostProcessing("fp8-block", "8.6", "MarlinExperts", False, (128, 128),
                                         kernels.round_up(inter, 128))
        mine = sum(t.nbytes for t in allocation.post_processed_tensors(stored, post).values())
        return "" if got == mine else f"vLLM holds {got} bytes, the planner prices {mine}"

    def repack(e: int, hidden: int, inter: int) -> str:
        """The most bytes 0.33's Marlin FP8 MoE post-processing allocates beside the loaded
        layer (torch's profiler, the allocations it made and still held at their peak)."""
        from torch.profiler import ProfilerActivity, profile

        layer, w13, w2, s13, s2 = fp8_moe_layer(e, hidden, inter)
        with set_current_vllm_config(VllmConfig()), profile(activities=[ProfilerActivity.CPU],
                                                            profile_memory=True) as prof:
            mf8.prepare_fp8_moe_layer_for_marlin(layer, w13, w2, s13, s2)
        held = got = 0
        for _, n in sorted((ev.start_ns(), ev.nbytes()) for ev in prof.profiler.kineto_results.events()
                           if ev.name() == "[memory]"):
            held += n
            got = max(got, held)
        mine = allocation.marlin_fp8_moe_repack_bytes(e, hidden, inter, kernels.round_up(inter, 128))
        return "" if abs(got - mine) <= 0.02 * got else f"vLLM's repack peaks at {got} bytes, the planner prices {mine}"

    for case, run in (("marlin-fp8 dense block 5120x17920", lambda: dense(5120, 17920, True)),
                      ("marlin-fp8 dense block 1000x1000 (padded)", lambda: dense(1000, 1000, True)),
                      ("marlin-fp8 dense tensor 2048x768", lambda: dense(2048, 768, False)),
                      ("marlin-fp8 experts block 2048/768", lambda: experts(2, 2048, 768)),
                      ("marlin-fp8 experts block 2048/640 (padded)", lambda: experts(2, 2048, 640)),
                      ("marlin-fp8 experts repack transient 2048/768", lambda: repack(4, 2048, 768)),
                      ("marlin-fp8 experts repack transient 2048/704 (padded)", lambda: repack(4, 2048, 704))):
        try:
            out.append((case, run()))
        except Exception as exc:  # noqa: BLE001 - what could not run says so
            out.append((case, f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"))
    source = inspect.getsource(oracle_mxfp4.convert_gpt_oss_weight_to_mxfp4_moe_kernel_format)
    triton = source.split("elif mxfp4_backend in TRITON_BACKENDS:", 1)[-1].split("elif ", 1)[0]
    read = ("w13_bias = w13_bias.to(torch.float32)" in triton and "w2_bias = w2_bias.to(torch.float32)" in triton)
    post = allocation.PostProcessing("mxfp4", "9.0", "OAITritonMxfp4ExpertsMonolithic", False, None, None)
    bias = {f"{PREFIX}.gate_up_proj_bias": TensorInfo(f"{PREFIX}.gate_up_proj_bias", "BF16", (4, 5760), 4 * 5760 * 2)}
    doubled = allocation.post_processed_tensors(bias, post)[f"{PREFIX}.gate_up_proj_bias"].nbytes == 4 * 5760 * 4
    out.append(("triton-mxfp4 expert biases float32 (read from the source)",
                "" if read and doubled else f"source casts to float32: {read}; the planner doubles them: {doubled}"))
    # FlashInfer TRT-LLM (SM 10.x) casts them too, in both conversions (gpt-oss's and the generic one)
    generic = inspect.getsource(oracle_mxfp4.convert_weight_to_mxfp4_moe_kernel_format)
    branches = [source.split("elif mxfp4_backend in TRTLLM_BACKENDS:", 1)[-1].split("\n    elif ", 1)[0],
                generic.split("if mxfp4_backend in TRTLLM_BACKENDS:", 1)[-1].split("\n    elif ", 1)[0]]
    read = all("w13_bias = w13_bias.data.to(torch.float32)" in b and "w2_bias = w2_bias.data.to(torch.float32)" in b
               for b in branches)
    card = next(c for c in kernels.CARDS if c.startswith("10."))
    kernel = kernels.pick("mxfp4", card, kernels.AUTO).kernel
    post = allocation.PostProcessing("mxfp4", card, kernel, False, None, None)
    doubled = allocation.post_processed_tensors(bias, post)[f"{PREFIX}.gate_up_proj_bias"].nbytes == 4 * 5760 * 4
    out.append((f"trtllm-mxfp4 expert biases float32 on SM {card} ({kernel}, read from the source)",
                "" if read and doubled and kernel == "TrtLlmMxfp4ExpertsMonolithic"
                else f"source casts to float32: {read}; the planner doubles them: {doubled}; kernel {kernel}"))
    return out


def main() -> int:
    to_standin()
    failed = 0
    for (method, setting), row in kernels.KERNELS.items():
        for card, expected in zip(kernels.CARDS, row):
            label = f"{method} | {setting} | SM {card}"
            try:
                got = oracle(method, card, setting)
            except ModuleNotFoundError as exc:
                print(f"notrun {label}: {exc}", flush=True)
                continue
            except (ValueError, NotImplementedError) as exc:
                got = kernels.REFUSED
                why = " ".join(str(exc).split())[:160]
            else:
                why = ""
            if got == expected:
                print(f"ok {label}", flush=True)
            else:
                failed += 1
                print(f"FAIL {label}: the table says {expected}, vLLM built {got} {why}".rstrip(), flush=True)
    for method in kernels.METHODS:
        for card in kernels.CARDS:
            if kernels.reads_uva(kernels.kernel_for(method, card)):
                continue
            fix = kernels.advice(method, card)
            label = f"advice {method} | SM {card} | {fix}"
            try:
                got = oracle(method, card, fix) if fix else None
            except Exception as exc:  # noqa: BLE001 - the advice must build a kernel
                got = f"{type(exc).__name__}: {exc}"
            if fix and kernels.reads_uva(got):
                print(f"ok {label}", flush=True)
            else:
                failed += 1
                print(f"FAIL {label}: vLLM built {got}, which does not read UVA", flush=True)
    for (method, setting), row in kernels.KERNELS.items():
        for card, kernel in zip(kernels.CARDS, row):
            if kernel == kernels.REFUSED or (method, setting, card) in kernels.NOT_RUN:
                continue
            for shape, hidden, intermediate in SHAPES:
                label = f"{method} | {setting} | SM {card} | {shape}"
                try:
                    said = sizes(method, card, setting, kernel, hidden, intermediate, shape)
                except ValueError as exc:  # vLLM refuses the layer at this shape: nothing to price
                    print(f"refused sizes {label}: {' '.join(str(exc).split())[:200]}", flush=True)
                    continue
                except Exception as exc:  # noqa: BLE001 - what could not run says so
                    said = f"FAIL: {type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
                if said.startswith(("vLLM ", "FAIL")):
                    failed += 1
                    print(f"FAIL sizes {label}: {said.removeprefix('FAIL: ')}", flush=True)
                else:
                    print(f"ok sizes {label}: {said}", flush=True)
    for method in kernels.METHODS:  # the cards the table has no column of its own for
        for card in kernels.OFF_TABLE_CARDS:
            for shape, hidden, intermediate in SHAPES:
                label = f"{method} | SM {card} | {shape}"
                if not kernels.sizes_known(method, card):
                    print(f"ok off-table {label}: the planner refuses the card", flush=True)
                    continue
                try:
                    said = sizes(method, card, kernels.AUTO, kernels.kernel_for(method, card), hidden, intermediate,
                                 shape)
                except (ValueError, NotImplementedError) as exc:  # vLLM refuses the layer on that card
                    print(f"refused off-table {label}: {' '.join(str(exc).split())[:200]}", flush=True)
                    continue
                except Exception as exc:  # noqa: BLE001 - what could not run says so
                    said = f"FAIL: {type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
                if said.startswith(("vLLM ", "FAIL")):
                    failed += 1
                    print(f"FAIL off-table {label}: {said.removeprefix('FAIL: ')}", flush=True)
                else:
                    print(f"ok off-table {label}: {said}", flush=True)
    for kernel in sorted(allocation.WORKSPACE_KERNELS):
        for shape, hidden, intermediate, top_k, activation in (("gpt-oss", 3072, 2944, 4, "swigluoai"),
                                                               ("Qwen3-30B-A3B", 2048, 768, 8, "silu")):
            failed += verdict(f"workspace {kernel} | {shape}",
                              lambda: workspace(kernel, hidden, intermediate, top_k, activation))
    for case, why in post_processing():
        failed += verdict(f"post-processing {case}", lambda: why)
    for method, kernel in sorted(kernels.HOST_POST_PROCESSING):
        failed += verdict(f"host-post-processing {method} | {kernel}", lambda: host_post_processing(method, kernel))
    return 1 if failed else 0


def verdict(label: str, check) -> int:
    """Print ``ok LABEL`` or ``FAIL LABEL: why`` for a check that returns what vLLM disagrees
    on ("" when nothing) or raises (what could not run, or needed a device, says so); 1 on FAIL."""
    try:
        why = check()
    except Exception as exc:  # noqa: BLE001 - what could not run says so
        why = f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
    print(f"FAIL {label}: {why}" if why else f"ok {label}", flush=True)
    return 1 if why else 0


if __name__ == "__main__":
    sys.exit(main())
