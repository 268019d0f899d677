"""What every method shares: the :class:`QuantScheme` a parser builds, and the builder a
layout fills with the tensors of one parameter.

A method's module (``fp8``, ``mxfp4``, ``modelopt``, ``awq``, ``gptq``, ``bitsandbytes``,
``compressed_tensors``, ``packed``) turns its ``quantization_config`` into a
``QuantScheme`` and, from it, adds one parameter's stored tensors to a :class:`Builder`.
The scheme is plain data so that the dispatcher can pick a layout by its ``layout`` name,
and the builder is the one place that names a tensor and counts its bytes, so no layout
can name its scales differently for experts than for linear layers.

Tensor names
    A parameter ``X.weight`` gives ``X.<suffix>`` (``X.weight_scale_inv``, ``X.qweight``,
    ``X.weight.absmax``...). A fused experts parameter (``...experts.gate_up_proj``, no
    ``.weight``) gives ``<name>_<suffix>`` with the leading ``weight`` dropped, as
    transformers 5 names them (``gate_up_proj_scale_inv``, gpt-oss ``gate_up_proj_blocks``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..tensors import TensorInfo, tensor_nbytes

#: What :func:`~selective_offload.quantization.quantized_tensors` accepts as ``kind``.
KINDS = ("linear", "experts", "other")

#: Layouts the dispatcher knows (``QuantScheme.layout``).
LAYOUTS = ("fp8", "mxfp4", "nvfp4", "mxfp8", "awq", "gptq", "bnb4", "bnb8", "ct", "packed",
           "groups", "none")


@dataclass(frozen=True)
class QuantScheme:
    """How a checkpoint's quantized weights are stored: built by ``scheme_from_config``.

    ``layout`` picks the tensors; the other fields are its parameters. Fields a layout
    does not use keep their defaults.
    """

    #: ``fp8``, ``mxfp4``, ``nvfp4``, ``mxfp8``, ``compressed-tensors``, ``awq``, ``gptq``,
    #: ``bitsandbytes-4bit``, ``bitsandbytes-8bit``, ``modelopt`` (mixed precision), or the
    #: config's own name for a method this package does not know.
    method: str
    #: One line for the plan's notes, e.g. ``FP8 e4m3, 128x128 block scales``.
    description: str
    #: One of :data:`LAYOUTS`.
    layout: str = "none"
    #: Bits of each stored weight value.
    bits: int = 16
    #: ``tensor``, ``channel``, ``group``, ``block`` or ``tensor_group``: what one scale covers.
    strategy: str = "tensor"
    #: Input elements per scale (``group``/``tensor_group``; bitsandbytes' absmax block).
    group_size: int | None = None
    #: ``(rows, cols)`` of one scale (``block``).
    block_size: tuple[int, int] | None = None
    #: safetensors dtype of the stored weight (FP8 and compressed-tensors naive formats).
    weight_dtype: str | None = None
    #: safetensors dtype of the weight scales; ``None``: the parameter's own dtype.
    scale_dtype: str | None = None
    #: Name of the weight-scale tensor (``weight_scale`` or ``weight_scale_inv``).
    scale_name: str = "weight_scale"
    #: ``False``: zero points are stored (asymmetric), where the layout has them optionally.
    symmetric: bool = True
    #: Static activation scales are stored (``input_scale`` / ``input_global_scale``).
    static_input_scale: bool = False
    #: Activation-order index stored (GPTQ always; compressed-tensors ``actorder: group``).
    g_idx: bool = False
    #: compressed-tensors format (``pack-quantized``, ``float-quantized`` ...).
    format: str | None = None
    #: bitsandbytes 4-bit: ``nf4`` or ``fp4``; absmax quantized again (double quant).
    quant_type: str | None = None
    double_quant: bool = False
    #: bitsandbytes 4-bit storage dtype of the packed weight.
    storage_dtype: str = "U8"
    #: Weights are not stored scaled (compressed-tensors ``dynamic`` weights: no scale).
    dynamic_weights: bool = False
    #: Only fused MoE expert weights are quantized (MXFP4 / gpt-oss).
    experts_only: bool = False
    #: The LM head is quantized too (GPTQ ``lm_head: true``).
    quantize_lm_head: bool = False
    #: Exclusion entries, in the forms :mod:`.exclusion` lists.
    exclude: tuple[str, ...] = ()
    #: ``groups`` layout: (targets, scheme or ``None`` for unquantized) in config order;
    #: compressed-tensors ``config_groups`` and ModelOpt mixed-precision layers.
    groups: tuple[tuple[tuple[str, ...], QuantScheme | None], ...] = ()


def tensor_name(param: str, suffix: str) -> str:
    """The checkpoint name of ``suffix`` for ``param`` (see the module docstring)."""
    if param.endswith(".weight"):
        return param[: -len("weight")] + suffix
    if suffix == "weight":
        return param
    if suffix.startswith(("weight_", "weight.")):
        return param + suffix[len("weight"):]
    return f"{param}_{suffix}"


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Builder:
    """Collects the tensors of one parameter; ``lead`` is ``(num_experts,)`` or ``()``."""

    def __init__(self, name: str, lead: tuple[int, ...]):
        self.name, self.lead, self.out = name, lead, []

    def add(self, suffix: str, dtype: str, shape: tuple[int, ...]) -> None:
        """A tensor of ``shape`` per matrix (stacked over experts)."""
        full = self.lead + tuple(shape)
        name = tensor_name(self.name, suffix)
        self.out.append(TensorInfo(name, dtype, full, tensor_nbytes(dtype, full)))

    def scalar(self, suffix: str, dtype: str = "F32") -> None:
        """One value per matrix: ``[]`` for a linear layer, ``[num_experts]`` for experts."""
        self.add(suffix, dtype, ())


def scale_shape(scheme: QuantScheme, out: int, inp: int) -> tuple[int, ...]:
    """The weight-scale shape ``scheme.strategy`` gives an ``[out, in]`` matrix."""
    if scheme.strategy in ("channel", "token"):
        return (out, 1)
    if scheme.strategy in ("group", "tensor_group"):
        return (out, cdiv(inp, scheme.group_size or inp))
    if scheme.strategy == "block":
        bo, bi = scheme.block_size or (128, 128)
        return (cdiv(out, bo), cdiv(inp, bi))
    return ()


def group_count(s: QuantScheme, inp: int) -> int:
    """Scale groups along the input (AWQ, GPTQ, the unknown-method estimate): one without
    a group size (per channel)."""
    return cdiv(inp, s.group_size) if s.group_size and s.group_size > 0 else 1
