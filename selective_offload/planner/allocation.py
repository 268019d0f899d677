"""The bytes vLLM 0.33 allocates for a checkpoint's routed experts on the plan's card.

vLLM rounds the experts' hidden and intermediate sizes up to what the kernel it picks needs
before it allocates them (:data:`.kernels.ROUND_UP`): gpt-oss's 2880 x 2880 MXFP4 experts are
allocated at hidden 3072 and intermediate 2944 for Marlin (SM 7.5 to 8.9, 12.0) and FlashInfer
TRT-LLM (SM 10.0), 9.03% more bytes per expert than the checkpoint holds, and unchanged for
OAI triton_kernels (SM 9.0). Every place a plan prices routed experts (the device, a device
share, host memory read through UVA or computed by the host CPU, the CPU's bytes per step,
vLLM's own offload priced beside it) prices those bytes: the glue serves vLLM's parameters as
vLLM built them, padding included (host-compute experts are allocated on the host at the
padded size too, and the CPU kernel reads the padded layout; the padding is zeros).

Each routed-experts tensor keeps its checkpoint name and shape; only its bytes change, by
the projection it belongs to: a gate/up projection reads the hidden size and writes the
intermediate one, a down projection the other way round. A tensor with two or more
dimensions per expert (weights, blocks, block scales) scales with both sizes, a bias with
its output size only, an act-order index (``g_idx``) with its input size only, a scalar with
neither. The arithmetic is exact for the layouts vLLM allocates (held to vLLM's own
``create_weights`` in tests/contract/check_kernel_table.py).

TP=1, no expert parallelism, as :mod:`.kernels`' table: with more ranks vLLM rounds each
rank's partition, which this does not price.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import Any, Mapping

from ..errors import UserError
from ..names import experts_prefix
from ..plan_format.vocabulary import ASSUMED_BATCHED_TOKENS
from ..tensors import TensorInfo
from .kernels import CARDS, PRE_ADA, allocated_sizes, method_of_config, pick, round_up, sizes_known

#: Name tokens of a gate/up projection and of a down projection (gpt-oss ``gate_up_proj``,
#: per-expert ``gate_proj`` / ``up_proj`` / ``down_proj``, Mixtral ``w1`` / ``w3`` / ``w2``,
#: vLLM's own ``w13`` / ``w2``).
UP_TOKENS = frozenset({"gate", "up", "w1", "w3", "w13"})
DOWN_TOKENS = frozenset({"down", "w2"})


@dataclass(frozen=True)
class Padding:
    """The routed experts' sizes in the checkpoint and as vLLM 0.33 allocates them."""

    method: str | None
    kernel: str | None
    card: str
    hidden: int
    intermediate: int
    hidden_to: int
    intermediate_to: int

    @property
    def pads(self) -> bool:
        return (self.hidden_to, self.intermediate_to) != (self.hidden, self.intermediate)

    def scale(self, dims: str) -> tuple[int, int]:
        """The ratio (numerator, denominator) a tensor's bytes grow by, for ``dims``: ``"HI"``
        (both sizes), ``"H"``, ``"I"`` or ``""``."""
        num = den = 1
        if "H" in dims:
            num, den = num * self.hidden_to, den * self.hidden
        if "I" in dims:
            num, den = num * self.intermediate_to, den * self.intermediate
        return num, den

    def note(self, stored: int, allocated: int) -> str:
        """The plan's note on the sizes it priced (``stored`` and ``allocated``: the routed
        experts' bytes in the checkpoint and as vLLM allocates them)."""
        grow = allocated / stored - 1 if stored else 0.0
        return (f"routed experts: priced at the sizes vLLM 0.33 allocates them for {self.kernel} on SM {self.card}: "
                f"hidden {self.hidden} -> {self.hidden_to}, intermediate {self.intermediate} -> "
                f"{self.intermediate_to} (its kernel's round-up: {grow * 100:.2f}% more bytes of routed experts "
                "than the checkpoint holds), on the device, in a device share, in host memory and in the CPU's bytes "
                "per step alike")


def expert_sizes(config: Mapping[str, Any]) -> tuple[int, int] | None:
    """The routed experts' hidden and intermediate sizes from a ``config.json`` (the text
    model's first): ``hidden_size``, and ``moe_intermediate_size`` else ``intermediate_size``."""
    text = config.get("text_config")
    sources = [s for s in (text, config) if isinstance(s, Mapping)]

    def first(*keys: str) -> int | None:
        for source in sources:
            for key in keys:
                value = source.get(key)
                if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                    return value
        return None

    hidden, intermediate = first("hidden_size"), first("moe_intermediate_size", "intermediate_size")
    return (hidden, intermediate) if hidden and intermediate else None


def padding_for(config: Mapping[str, Any], card: str, setting: str) -> Padding | None:
    """The padding vLLM 0.33 gives the routed experts of a model with ``config`` on ``card``
    under ``setting``; ``None`` when their sizes are not in the config."""
    sizes = expert_sizes(config)
    if sizes is None:
        return None
    method = method_of_config(config)
    if not sizes_known(method, card, setting):
        raise UserError(
            f"compute capability {card} is not in the kernel table, and vLLM 0.33 rounds {method} routed experts "
            "up by the kernel it picks (gpt-oss's 2880 to 3072 / 2944 for Marlin), so the bytes it allocates on "
            f"that card are not known: plan for a card the table has (--compute-capability {', '.join(CARDS)}; "
            "10.x and 12.x plan as 10.0 and 12.0)")
    kernel = pick(method, card, setting).kernel
    return Padding(method, kernel, card, *sizes, *allocated_sizes(method, kernel, *sizes))


def tensor_dims(relative: str, shape: tuple[int, ...]) -> str:
    """Which of the experts' sizes a routed-experts tensor's bytes follow (see the module's
    docstring): ``relative`` is its name under the experts module (``gate_up_proj_blocks``,
    ``17.down_proj.weight``)."""
    tokens = set(re.split(r"[._]", relative))
    fused = not relative.split(".")[0].isdigit()  # [E, ...] in one tensor, else one expert's
    rank = len(shape) - (1 if fused and shape else 0)
    if rank >= 2:
        return "HI"
    if rank == 0:
        return ""
    up, down = bool(tokens & UP_TOKENS), bool(tokens & DOWN_TOKENS)
    if "idx" in tokens:  # an input-channel index (act order)
        return "H" if up and not down else "I" if down and not up else "HI"
    if "bias" in tokens:  # the output's
        return "I" if up and not down else "H" if down and not up else "HI"
    return ""  # one value per expert (a per-tensor scale)


def allocated_bytes(relative: str, t: TensorInfo, padding: Padding) -> int:
    """Bytes vLLM allocates for the routed-experts tensor ``t`` (rounded up to whole bytes)."""
    num, den = padding.scale(tensor_dims(relative, t.shape))
    return -(-t.nbytes * num // den)


def allocated_tensors(tensors: Mapping[str, TensorInfo], padding: Padding | None) -> dict[str, TensorInfo]:
    """``tensors`` with every routed-experts tensor at the bytes vLLM allocates for it
    (names and shapes as the checkpoint has them)."""
    if padding is None or not padding.pads:
        return dict(tensors)
    out = {}
    for name, t in tensors.items():
        prefix = experts_prefix(name)
        out[name] = t if prefix is None else replace(t, nbytes=allocated_bytes(name[len(prefix) + 1:], t, padding))
    return out


def experts_bytes(tensors: Mapping[str, TensorInfo]) -> int:
    """Bytes of every routed-experts tensor of ``tensors``."""
    return sum(t.nbytes for name, t in tensors.items() if experts_prefix(name) is not None)


# ---- vLLM's fused-MoE workspace: one per process, for the largest step

#: Kernels whose scratch vLLM 0.33 takes from its workspace manager: the modular kernel's
#: ``_allocate_buffers`` (``fused_moe/modular_kernel.py:1124-1221``) asks
#: ``current_workspace_manager().get_simultaneous`` for the kernel's ``workspace_shapes``,
#: and the manager keeps one buffer per process (per micro-batch and lane; one of each by
#: default) at the largest size any layer asked for, locked after warm-up
#: (``v1/worker/workspace.py:181-280``, ``gpu_model_runner.py:6510``): not per layer.
WORKSPACE_KERNELS = frozenset({"MarlinExperts", "TritonExperts"})
#: The workspace manager's alignment of each buffer it hands out (``workspace.py:193``).
WORKSPACE_ALIGN = 256


def workspace_at(nbytes: int, priced_tokens: int, tokens: int) -> int:
    """A fused-MoE workspace priced at ``nbytes`` for ``priced_tokens`` tokens, at ``tokens``:
    both of its buffers grow in proportion to the step (:func:`fused_moe_workspace_bytes`),
    each rounded up to :data:`WORKSPACE_ALIGN` once more at most."""
    if not nbytes or tokens == priced_tokens:
        return nbytes
    return -(-nbytes * tokens // priced_tokens) + 2 * WORKSPACE_ALIGN


def fused_moe_workspace_bytes(tokens: int, top_k: int, hidden: int, intermediate: int, act_bytes: int = 2) -> int:
    """The bytes vLLM 0.33's workspace manager holds for a gated fused-MoE layer computed by
    ``MarlinExperts`` or ``TritonExperts`` at ``tokens`` tokens: workspace13 ``M*topk x
    max(I, H)`` sharing its storage with the output ``M x H``, and workspace2 ``M*topk x
    max(2I, H)``, in the activations' dtype, each rounded up to 256 bytes
    (``experts/marlin_moe.py:691-721``, ``experts/triton_moe.py:240-255`` with the gated
    activation's ``N // 2``; ``modular_kernel.py:1188``; ``workspace.py:193``)."""
    m = tokens * top_k
    first = max(m * max(intermediate, hidden), tokens * hidden) * act_bytes
    second = m * max(2 * intermediate, hidden) * act_bytes
    return round_up(first, WORKSPACE_ALIGN) + round_up(second, WORKSPACE_ALIGN)


@dataclass(frozen=True)
class Workspace:
    """vLLM's fused-MoE workspace a plan prices: its bytes, and for what."""

    nbytes: int
    kernel: str
    tokens: int
    hidden: int
    intermediate: int
    top_k: int

    def note(self) -> str:
        return (f"device: vLLM's fused-MoE workspace, one per process for {self.kernel}, priced at "
                f"{self.nbytes / 1e6:.1f} MB (est: a step of {self.tokens} tokens, vLLM's max_num_batched_tokens "
                f"the plan is made for, top-{self.top_k} of experts at hidden {self.hidden}, intermediate "
                f"{self.intermediate})")


def top_k_of(config: Mapping[str, Any]) -> int | None:
    """Experts per token from a ``config.json`` (the text model's first)."""
    for source in (config.get("text_config"), config):
        if isinstance(source, Mapping):
            for key in ("num_experts_per_tok", "experts_per_token", "moe_topk", "num_experts_per_token"):
                value = source.get(key)
                if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                    return value
    return None


def workspace_for(config: Mapping[str, Any], card: str, setting: str,
                  tokens: int = ASSUMED_BATCHED_TOKENS) -> Workspace | None:
    """The fused-MoE workspace vLLM 0.33 keeps for a model with ``config`` on ``card`` under
    ``setting`` (at its allocated sizes, :func:`padding_for`); ``None`` when the model has no
    routed experts, or their kernel is not one of :data:`WORKSPACE_KERNELS`."""
    padding, k = padding_for(config, card, setting), top_k_of(config)
    if padding is None or k is None or padding.kernel not in WORKSPACE_KERNELS:
        return None
    return Workspace(fused_moe_workspace_bytes(tokens, k, padding.hidden_to, padding.intermediate_to),
                     padding.kernel, tokens, padding.hidden_to, padding.intermediate_to, k)


# ---- what vLLM's post-processing leaves, where it grows what create_weights allocated

#: Cards whose FP8 linears vLLM 0.33 serves with Marlin, weight-only: no FP8 arithmetic
#: before Ada (``MarlinFP8ScaledMMLinearKernel``, ``kernels/linear/scaled_mm/marlin.py``;
#: ``Fp8LinearMethod`` picks it on a card without ``has_device_capability(89)``).
FP8_MARLIN_DENSE_CARDS = PRE_ADA
#: Marlin FP8 scales are held in the model's dtype (``scales.to(layer.orig_dtype)``): bf16.
MARLIN_SCALE_BYTES = 2
SCALE_NAMES = ("weight_scale_inv", "weight_scale")


def marlin_padded_nk(n: int, k: int, group: int) -> tuple[int, int]:
    """vLLM 0.33's ``marlin_padded_nk`` (``quantization/utils/marlin_utils.py:222-244``): the
    cheaper of (n to 64, k to lcm(128, group)) and (n to 128, k to lcm(64, group))."""
    g = group if group > 0 else 1
    candidates = ((round_up(n, 64), round_up(k, math.lcm(128, g))), (round_up(n, 128), round_up(k, math.lcm(64, g))))
    return min(candidates, key=lambda nk: (nk[0] * nk[1], nk[0] + nk[1]))


def marlin_fp8_bytes(n: int, k: int, group: int, moe: bool) -> tuple[int, int]:
    """The bytes of one FP8 weight ``[n, k]`` and of its scales after vLLM 0.33's Marlin
    post-processing: the weight repacked at its padded size (1 byte each), the scales as
    groups of ``group`` inputs (a block's width; -1: one per output channel) by every output,
    in bf16 (``prepare_fp8_layer_for_marlin``, ``marlin_utils_fp8.py:103-214``; a routed
    expert's ``prepare_fp8_moe_layer_for_marlin``, ``:233-365``, pads only its intermediate
    size, to ``lcm(64, group)``: ``n`` of a gate/up projection, ``k`` of a down one; the
    caller passes it padded)."""
    pn, pk = (n, k) if moe else marlin_padded_nk(n, k, group)
    groups = pk // group if group > 0 else 1
    return pn * pk, groups * pn * MARLIN_SCALE_BYTES


#: MXFP4 experts kernels whose post-processing casts the routed experts' biases to float32
#: (``convert_gpt_oss_weight_to_mxfp4_moe_kernel_format`` and
#: ``convert_weight_to_mxfp4_moe_kernel_format`` of ``fused_moe/oracle/mxfp4.py``): OAI
#: triton_kernels (the ``TRITON_BACKENDS`` branch; SM 9.0) and FlashInfer TRT-LLM (the
#: ``TRTLLM_BACKENDS`` branch, ``:1026-1027`` and ``:1674-1678``; SM 10.0). Marlin keeps them in
#: the model's dtype (``marlin_utils_fp4.prepare_moe_mxfp4_layer_for_marlin``).
F32_BIAS_KERNELS = frozenset({"OAITritonMxfp4ExpertsMonolithic", "TrtLlmMxfp4ExpertsMonolithic"})


@dataclass(frozen=True)
class PostProcessing:
    """What vLLM 0.33's post-processing changes in the bytes of a checkpoint's tensors on
    the plan's card: Marlin FP8 (dense linears on a pre-Ada card; routed experts wherever
    MarlinExperts serves FP8), or float32 expert biases (MXFP4 where OAI triton_kernels or
    FlashInfer TRT-LLM serves it: :data:`F32_BIAS_KERNELS`)."""

    method: str | None
    card: str
    experts_kernel: str | None
    dense_marlin: bool
    block: tuple[int, int] | None
    intermediate_to: int | None
    #: The routed experts' hidden and (allocated) intermediate sizes; 0 where not known.
    hidden: int = 0
    intermediate: int = 0

    @property
    def experts_marlin_fp8(self) -> bool:
        return self.method in ("fp8-block", "fp8-tensor") and self.experts_kernel == "MarlinExperts"

    @property
    def experts_f32_bias(self) -> bool:
        return self.method == "mxfp4" and self.experts_kernel in F32_BIAS_KERNELS

    def repack_bytes(self, num_experts: int) -> int:
        """:func:`marlin_fp8_moe_repack_bytes` of one layer of ``num_experts`` routed experts
        where Marlin post-processes FP8 experts on this card; 0 elsewhere."""
        if not self.experts_marlin_fp8 or not self.hidden or not self.intermediate:
            return 0
        return marlin_fp8_moe_repack_bytes(num_experts, self.hidden, self.intermediate, self.intermediate_to)

    @property
    def changes(self) -> bool:
        return self.dense_marlin or self.experts_marlin_fp8 or self.experts_f32_bias

    def what(self, experts: bool = True) -> str:
        """In words (``experts``: whether the model has routed experts)."""
        parts = []
        marlin_experts = self.experts_marlin_fp8 and experts
        if self.dense_marlin or marlin_experts:
            where = ("linears and routed experts" if self.dense_marlin and marlin_experts
                     else "linears" if self.dense_marlin else "routed experts")
            layout = "[K/128, N]" if self.block else "[1, N]"
            parts.append(f"Marlin FP8 {where} hold their scales in bf16 as {layout} (weights repacked, padded "
                         "to Marlin's tiles)")
        if self.experts_f32_bias and experts:
            who = "OAI triton_kernels" if self.experts_kernel.startswith("OAITriton") else "FlashInfer TRT-LLM"
            parts.append(f"{who} hold the routed experts' biases in float32")
        return "; ".join(parts)


def post_processing_for(config: Mapping[str, Any], card: str, setting: str) -> PostProcessing:
    """What vLLM 0.33's post-processing does to a model with ``config`` on ``card`` under ``setting``."""
    from .kernels import quantization_config

    method = method_of_config(config)
    kernel = pick(method, card, setting).kernel if sizes_known(method, card, setting) else None
    qc = quantization_config(config)
    block = qc.get("weight_block_size")
    block = tuple(block) if isinstance(block, (list, tuple)) and len(block) == 2 else None
    padding = padding_for(config, card, setting) if method in ("fp8-block", "fp8-tensor") else None
    inter = None
    if padding is not None:
        group = block[1] if block else -1
        inter = round_up(padding.intermediate_to, math.lcm(64, group if group > 0 else 1))
    return PostProcessing(method, card, kernel, method in ("fp8-block", "fp8-tensor") and card in FP8_MARLIN_DENSE_CARDS,
                          block, inter, *((padding.hidden_to, padding.intermediate_to) if padding else (0, 0)))


def marlin_fp8_moe_repack_bytes(experts: int, hidden: int, inter: int, inter_to: int) -> int:
    """The most bytes vLLM 0.33's ``prepare_fp8_moe_layer_for_marlin`` (``marlin_utils_fp8.py:
    228-330``) allocates beside one routed-experts layer's loaded FP8 weights, which the layer
    holds until ``Fp8MoEMethod._setup_kernel`` replaces them (``quantization/fp8.py:680-696``):
    the weights padded to Marlin's intermediate size when it pads (``inter`` -> ``inter_to``),
    then w13 repacked expert by expert into a list and ``torch.cat`` into one tensor beside
    it, with the last expert's transposed int32 copy still held; w2 the same once w13's list is
    gone (always the smaller: w2 is half of w13). Scales are a group's few bytes beside them.
    Held exactly to 0.33's own function's allocations in tests/contract/check_kernel_table.py."""
    w13, w2 = experts * 2 * inter_to * hidden, experts * hidden * inter_to
    pads = inter_to != inter
    at_w13 = (w13 + w2 if pads else 0) + 2 * w13 + 2 * inter_to * hidden
    at_w2 = (w2 if pads else 0) + w13 + 2 * w2 + hidden * inter_to
    return max(at_w13, at_w2)


def post_processed_tensors(tensors: Mapping[str, TensorInfo], post: PostProcessing) -> dict[str, TensorInfo]:
    """``tensors`` at the bytes vLLM 0.33 holds after post-processing (names and shapes as
    the checkpoint has them): each FP8 weight that Marlin serves and its scale (the scale
    tensor carries the change of both), each routed-experts bias in float32 where OAI
    triton_kernels serves them."""
    if not post.changes:
        return dict(tensors)
    out = dict(tensors)
    for name, t in tensors.items():
        prefix = experts_prefix(name)
        if post.experts_f32_bias and prefix is not None and "bias" in re.split(r"[._]", name[len(prefix) + 1:]) \
                and t.dtype.upper() in ("BF16", "F16"):
            out[name] = replace(t, nbytes=t.nbytes * 2)
            continue
        if not name.endswith(".weight") or t.dtype.upper() not in ("F8_E4M3", "FLOAT8_E4M3FN") or len(t.shape) != 2:
            continue
        marlin = post.experts_marlin_fp8 if prefix is not None else post.dense_marlin
        scale = next((name[:-len("weight")] + s for s in SCALE_NAMES if name[:-len("weight")] + s in tensors), None)
        if not marlin or scale is None:
            continue
        n, k = t.shape
        group = post.block[1] if post.block else -1
        if prefix is not None and post.intermediate_to:  # an expert pads its intermediate size only
            up = bool(set(re.split(r"[._]", name[len(prefix) + 1:])) & UP_TOKENS)
            n, k = (post.intermediate_to, k) if up else (n, post.intermediate_to)
        weight, scales = marlin_fp8_bytes(n, k, group, prefix is not None)
        out[scale] = replace(tensors[scale], nbytes=(weight - t.nbytes) + scales)
    return out


def post_processing_growth(tensors: Mapping[str, TensorInfo], post: PostProcessing) -> int:
    """Bytes vLLM's post-processing adds to ``tensors`` (0 where it changes nothing)."""
    return sum(t.nbytes for t in post_processed_tensors(tensors, post).values()) - sum(
        t.nbytes for t in tensors.values())


def model_device_bytes(config: Mapping[str, Any], tensors: Mapping[str, TensorInfo], card: str, setting: str,
                       tokens: int = ASSUMED_BATCHED_TOKENS) -> int:
    """Every byte vLLM 0.33 holds on ``card`` for a model all resident: its tensors at the
    sizes it allocates and post-processes them to, and its fused-MoE workspace for a step of
    ``tokens`` tokens (vLLM's ``max_num_batched_tokens``)."""
    held = post_processed_tensors(allocated_tensors(tensors, padding_for(config, card, setting)),
                                  post_processing_for(config, card, setting))
    experts = any(experts_prefix(name) is not None for name in tensors)
    workspace = workspace_for(config, card, setting, tokens) if experts else None
    return sum(t.nbytes for t in held.values()) + (workspace.nbytes if workspace else 0)
