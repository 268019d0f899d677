"""What a quantized checkpoint stores for each parameter, from its ``quantization_config``.

Planning from a ``config.json`` alone lists the parameters of the unquantized model (built
on the meta device). A quantized checkpoint does not hold those tensors: it holds packed
weights plus scales, zero points and index tensors, whose names and byte sizes depend on
the method. This module turns the config's ``quantization_config`` into a
:class:`QuantScheme` (:func:`scheme_from_config`) and each parameter into the tensors a
checkpoint of that method stores for it (:func:`quantized_tensors`). Neither torch nor
vLLM is imported: it is arithmetic on shapes.

Which parameters are quantized
    Only ``"linear"`` weights (2-D ``[out, in]``) and ``"experts"`` weights (3-D fused MoE
    ``[num_experts, out, in]``, or ``[num_experts, in, out]`` with ``transposed=True`` as
    gpt-oss stores them). ``"other"`` parameters (embeddings, norms, biases, convolutions),
    any parameter whose module path has an LM-head or embedding segment (``lm_head``,
    ``embed_tokens``, ``embed_out``, ...), and anything the config excludes come back as
    one unchanged tensor. GPTQ's ``lm_head: true`` is the one opt-in that quantizes the LM
    head. MXFP4 (gpt-oss) quantizes expert weights only.

Exclusion lists
    ``modules_to_not_convert``, ``ignore``, ``ignored_layers``, ``llm_int8_skip_modules``
    and ModelOpt's ``exclude_modules``. An entry is matched against the parameter's module
    name (and, for fused experts, the per-expert names a checkpoint uses, e.g.
    ``model.layers.3.mlp.experts.0.gate_proj`` for ``...experts.gate_up_proj``):

    * ``re:PATTERN``: a regular expression matched at the start of the name (as
      compressed-tensors does);
    * an entry with ``*``, ``?`` or ``[``: a shell wildcard (ModelOpt, gpt-oss) matching the
      module or anything below it;
    * anything else: a dot-separated run of name segments, anywhere in the name. So
      ``model.visual`` excludes ``model.visual.blocks.0.attn.qkv.weight``, ``visual`` alone
      excludes every parameter with a ``visual`` segment, and ``mlp.gate`` excludes
      ``model.layers.0.mlp.gate.weight`` but ``model.visualise`` is not ``model.visual``.

Tensor names
    A parameter ``X.weight`` gives ``X.<suffix>`` (``X.weight_scale_inv``, ``X.qweight``,
    ``X.weight.absmax``...). A fused experts parameter (``...experts.gate_up_proj``, no
    ``.weight``) gives ``<name>_<suffix>`` with the leading ``weight`` dropped, as
    transformers 5 names them (``gate_up_proj_scale_inv``, gpt-oss ``gate_up_proj_blocks``);
    real MoE checkpoints of most methods store experts one by one, see approximations.

Byte sizes are exact for the layouts below; what is approximated:

* Fused experts are listed as one stacked tensor per kind (leading dimension
  ``num_experts``) where most checkpoints (all but gpt-oss MXFP4) store one tensor per
  expert and projection. Per-expert scalars become one ``[num_experts]`` tensor; a fused
  ``gate_up_proj`` counts one set of scalars per expert where the checkpoint has two, and
  block/group scales along a fused output dimension round up once instead of twice.
* AWQ: the GEMM layout (``qweight [in, out*bits/32]``) for every ``version``; GEMV and
  Marlin variants differ in shape by padding only.
* GPTQ: ``g_idx`` is always stored (AutoGPTQ and GPTQModel save it with or without
  ``desc_act``); GPTQModel's per-module ``dynamic`` overrides are not modelled.
* bitsandbytes 4-bit: the packed quant-state JSON (``quant_state.bitsandbytes__nf4``) is
  rebuilt the way bitsandbytes writes it, but its float ``nested_offset`` varies by a few
  characters; the 4-bit block size is bitsandbytes' default 64 unless the config names one.
* FP8 ``scale_fmt: ue8m0`` checkpoints are counted with F32 scales.
* compressed-tensors: weight scales take the model's dtype (``BF16``) unless the group
  names a ``scale_dtype``; sparsity compression (2:4 bitmask, ``marlin-24``) is not
  modelled (sizes as if dense-quantized, with a note); KV-cache scales (``k_scale``,
  ``v_scale``, a few bytes per layer) are not listed for any method.
* A method this module does not know, when the config gives a bit width: weights packed
  at that width, one F16 scale per ``group_size`` inputs (per output row without a group
  size), noted as an assumption.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any, Iterable, Mapping

from .tensors import DTYPE_BITS, TensorInfo, tensor_nbytes
from .errors import CheckpointError

__all__ = ["KINDS", "QuantScheme", "is_excluded", "quantized_tensors", "scheme_from_config"]

#: What :func:`quantized_tensors` accepts as ``kind``.
KINDS = ("linear", "experts", "other")

#: Module-name segments of the LM head and embeddings: never quantized by default.
HEAD_SEGMENTS = frozenset({"lm_head", "embed_out"})
EMBEDDING_SEGMENTS = frozenset({"embed_tokens", "embed_in", "wte", "wpe", "word_embeddings",
                                "tok_embeddings", "embed_positions"})

#: Layouts :func:`quantized_tensors` knows (``QuantScheme.layout``).
LAYOUTS = ("fp8", "mxfp4", "nvfp4", "mxfp8", "awq", "gptq", "bnb4", "bnb8", "ct", "packed",
           "groups", "none")


@dataclass(frozen=True)
class QuantScheme:
    """How a checkpoint's quantized weights are stored: built by :func:`scheme_from_config`.

    ``layout`` picks the tensors; the other fields are its parameters. Fields a layout
    does not use keep their defaults.
    """

    #: ``fp8``, ``mxfp4``, ``nvfp4``, ``mxfp8``, ``compressed-tensors``, ``awq``, ``gptq``,
    #: ``bitsandbytes-4bit``, ``bitsandbytes-8bit``, ``modelopt`` (mixed precision), or the
    #: config's own name for a method this module does not know.
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
    #: Exclusion entries, in the forms the module docstring lists.
    exclude: tuple[str, ...] = ()
    #: ``groups`` layout: (targets, scheme or ``None`` for unquantized) in config order;
    #: compressed-tensors ``config_groups`` and ModelOpt mixed-precision layers.
    groups: tuple[tuple[tuple[str, ...], QuantScheme | None], ...] = ()


# --------------------------------------------------------------------------- matching


_GLOB_CHARS = frozenset("*?[")


def _segments_match(entry: str, name: str) -> bool:
    """``entry``'s dot-separated segments appear as a contiguous run in ``name``'s."""
    want = [s for s in entry.strip(".").split(".") if s]
    have = name.split(".")
    if not want:
        return False
    n = len(want)
    return any(have[i:i + n] == want for i in range(len(have) - n + 1))


def _entry_matches(entry: str, name: str) -> bool:
    if entry.startswith("re:"):
        try:
            return re.match(entry[3:], name) is not None
        except re.error:
            return False
    if _GLOB_CHARS & set(entry):
        return fnmatchcase(name, entry) or fnmatchcase(name, entry + ".*")
    return _segments_match(entry, name)


def _module_names(name: str, kind: str) -> list[str]:
    """The names an exclusion entry or a target may use for parameter ``name``: its module,
    the parameter itself and, for fused experts, the per-expert names checkpoints use."""
    names = [name]
    if name.endswith(".weight"):
        names.insert(0, name[: -len(".weight")])
    elif kind == "experts" and "." in name:
        parent, leaf = name.rsplit(".", 1)
        names.append(parent)
        names.append(f"{parent}.0.{leaf}")
        if leaf == "gate_up_proj":
            names += [f"{parent}.0.gate_proj", f"{parent}.0.up_proj"]
    return names


def is_excluded(entries: Iterable[str], name: str, kind: str = "linear") -> bool:
    """Whether parameter ``name`` is matched by one of ``entries`` (an exclusion list)."""
    names = _module_names(name, kind)
    return any(_entry_matches(e, n) for e in entries for n in names)


def _module_segments(name: str) -> list[str]:
    segments = name.split(".")
    return segments[:-1] if len(segments) > 1 else segments


def _is_head(name: str) -> bool:
    return any(s in HEAD_SEGMENTS for s in _module_segments(name))


def _is_embedding(name: str) -> bool:
    return any(s in EMBEDDING_SEGMENTS for s in _module_segments(name))


def _is_class_target(target: str) -> bool:
    """``Linear``, ``Qwen3MoeSparseMoeBlock``...: a module class, not a module name."""
    return not target.startswith("re:") and "." not in target and target[:1].isupper()


def _group_for(scheme: QuantScheme, name: str, kind: str) -> QuantScheme | None:
    """The config group that quantizes ``name``: one naming it (by ``re:`` or module name)
    wins over a class target (``Linear`` covers linear layers and the per-expert linears of
    fused experts; other classes are not modelled); ``None`` when no group targets it."""
    names = _module_names(name, kind)
    for targets, sub in scheme.groups:
        if any(_entry_matches(t, n) for t in targets if not _is_class_target(t) for n in names):
            return sub
    for targets, sub in scheme.groups:
        if "Linear" in targets:
            return sub
    return None


# --------------------------------------------------------------------------- tensors


def _tensor_name(param: str, suffix: str) -> str:
    """The checkpoint name of ``suffix`` for ``param`` (see the module docstring)."""
    if param.endswith(".weight"):
        return param[: -len("weight")] + suffix
    if suffix == "weight":
        return param
    if suffix.startswith(("weight_", "weight.")):
        return param + suffix[len("weight"):]
    return f"{param}_{suffix}"


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class _Builder:
    """Collects the tensors of one parameter; ``lead`` is ``(num_experts,)`` or ``()``."""

    def __init__(self, name: str, lead: tuple[int, ...]):
        self.name, self.lead, self.out = name, lead, []

    def add(self, suffix: str, dtype: str, shape: tuple[int, ...]) -> None:
        """A tensor of ``shape`` per matrix (stacked over experts)."""
        full = self.lead + tuple(shape)
        name = _tensor_name(self.name, suffix)
        self.out.append(TensorInfo(name, dtype, full, tensor_nbytes(dtype, full)))

    def scalar(self, suffix: str, dtype: str = "F32") -> None:
        """One value per matrix: ``[]`` for a linear layer, ``[num_experts]`` for experts."""
        self.add(suffix, dtype, ())


def _scale_shape(scheme: QuantScheme, out: int, inp: int) -> tuple[int, ...]:
    if scheme.strategy in ("channel", "token"):
        return (out, 1)
    if scheme.strategy in ("group", "tensor_group"):
        return (out, _cdiv(inp, scheme.group_size or inp))
    if scheme.strategy == "block":
        bo, bi = scheme.block_size or (128, 128)
        return (_cdiv(out, bo), _cdiv(inp, bi))
    return ()


def _fp8(b: _Builder, s: QuantScheme, out: int, inp: int, dtype: str) -> None:
    b.add("weight", s.weight_dtype or "F8_E4M3", (out, inp))
    shape = _scale_shape(s, out, inp)
    if s.strategy == "channel":
        shape = (out,)
    b.add(s.scale_name, s.scale_dtype or "F32", shape)
    if s.static_input_scale:
        b.scalar("input_scale")


def _mxfp4(b: _Builder, s: QuantScheme, out: int, inp: int, dtype: str) -> None:
    groups = _cdiv(inp, 32)
    b.add("weight_blocks", "U8", (out, groups, 16))
    b.add("weight_scales", "U8", (out, groups))


def _nvfp4(b: _Builder, s: QuantScheme, out: int, inp: int, dtype: str) -> None:
    b.add("weight", "U8", (out, _cdiv(inp, 2)))
    b.add("weight_scale", "F8_E4M3", (out, _cdiv(inp, s.group_size or 16)))
    b.scalar("weight_scale_2")
    if s.static_input_scale:
        b.scalar("input_scale")


def _mxfp8(b: _Builder, s: QuantScheme, out: int, inp: int, dtype: str) -> None:
    b.add("weight", "F8_E4M3", (out, inp))
    b.add("weight_scale", "U8", (out, _cdiv(inp, 32)))


def _ngroups(s: QuantScheme, inp: int) -> int:
    return _cdiv(inp, s.group_size) if s.group_size and s.group_size > 0 else 1


def _awq(b: _Builder, s: QuantScheme, out: int, inp: int, dtype: str) -> None:
    packed_out = _cdiv(out * s.bits, 32)
    groups = _ngroups(s, inp)
    b.add("qweight", "I32", (inp, packed_out))
    b.add("qzeros", "I32", (groups, packed_out))
    b.add("scales", "F16", (groups, out))


def _gptq(b: _Builder, s: QuantScheme, out: int, inp: int, dtype: str) -> None:
    groups = _ngroups(s, inp)
    b.add("qweight", "I32", (_cdiv(inp * s.bits, 32), out))
    b.add("qzeros", "I32", (groups, _cdiv(out * s.bits, 32)))
    b.add("scales", "F16", (groups, out))
    b.add("g_idx", "I32", (inp,))


_TORCH_DTYPE_NAMES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}


def _bnb_quant_state(s: QuantScheme, out: int, inp: int, dtype: str) -> int:
    """Length of bitsandbytes' packed quant-state JSON (``QuantState.as_dict(packed=True)``)."""
    state: dict[str, Any] = {
        "quant_type": s.quant_type or "nf4",
        "blocksize": s.group_size or 64,
        "dtype": _TORCH_DTYPE_NAMES.get(dtype, "float16"),
        "shape": [out, inp],
    }
    if s.double_quant:
        # A float32 mean written by Python: typically 17-20 characters.
        state.update(nested_blocksize=256, nested_dtype="float32", nested_offset=0.012345678901234567)
    return len(json.dumps(state).encode())


def _bnb4(b: _Builder, s: QuantScheme, out: int, inp: int, dtype: str) -> None:
    numel = out * inp
    per_element = 2 * DTYPE_BITS[s.storage_dtype] // 8  # 4-bit values per stored element
    b.add("weight", s.storage_dtype, (_cdiv(numel, per_element), 1))
    blocks = _cdiv(numel, s.group_size or 64)
    if s.double_quant:
        b.add("weight.absmax", "U8", (blocks,))
    else:
        b.add("weight.absmax", "F32", (blocks,))
    b.add("weight.quant_map", "F32", (16,))
    if s.double_quant:
        b.add("weight.nested_absmax", "F32", (_cdiv(blocks, 256),))
        b.add("weight.nested_quant_map", "F32", (256,))
    b.add(f"weight.quant_state.bitsandbytes__{s.quant_type or 'nf4'}", "U8",
          (_bnb_quant_state(s, out, inp, dtype),))


def _bnb8(b: _Builder, s: QuantScheme, out: int, inp: int, dtype: str) -> None:
    b.add("weight", "I8", (out, inp))
    b.add("SCB", "F32", (out,))
    b.scalar("weight_format", "U8")


def _ct(b: _Builder, s: QuantScheme, out: int, inp: int, dtype: str) -> None:
    fmt = s.format or "naive-quantized"
    scale_dtype = s.scale_dtype or (dtype if dtype in ("BF16", "F16", "F32") else "F16")
    scale_shape = _scale_shape(s, out, inp)
    if s.strategy == "tensor":
        scale_shape = (1,)
    if fmt in ("nvfp4-pack-quantized", "mxfp4-pack-quantized"):
        b.add("weight_packed", "U8", (out, _cdiv(inp, 2)))
        if fmt == "nvfp4-pack-quantized":
            b.add("weight_scale", s.scale_dtype or "F8_E4M3", scale_shape)
            b.add("weight_global_scale", "F32", (1,))
        else:
            b.add("weight_scale", s.scale_dtype or "U8", scale_shape)
        if s.static_input_scale:
            b.add("input_global_scale", "F32", (1,))
        return
    if fmt == "pack-quantized":
        pack = 32 // s.bits
        b.add("weight_packed", "I32", (out, _cdiv(inp, pack)))
        if not s.dynamic_weights:
            b.add("weight_scale", scale_dtype, scale_shape)
        b.add("weight_shape", "I64", (2,))
        if not s.symmetric:
            if s.strategy in ("group", "channel"):
                b.add("weight_zero_point", "I32", (_cdiv(out, pack), scale_shape[1]))
            else:
                b.add("weight_zero_point", "I8", scale_shape)
    else:  # naive-quantized, int-quantized, float-quantized, mxfp8-quantized, dense
        if fmt == "dense":
            b.add("weight", dtype, (out, inp))
        elif s.weight_dtype:
            b.add("weight", s.weight_dtype, (out, inp))
        if not s.dynamic_weights:
            mx = fmt == "mxfp8-quantized"
            b.add("weight_scale", s.scale_dtype or ("U8" if mx else scale_dtype), scale_shape)
        if not s.symmetric:
            b.add("weight_zero_point", "I8" if s.weight_dtype != "F8_E4M3" else "F8_E4M3", scale_shape)
    if s.g_idx:
        b.add("weight_g_idx", "I32", (inp,))
    if s.static_input_scale:
        b.add("input_scale", dtype if dtype in ("BF16", "F16", "F32") else "F16", (1,))


def _packed(b: _Builder, s: QuantScheme, out: int, inp: int, dtype: str) -> None:
    b.add("weight", "U8", (out, _cdiv(inp * s.bits, 8)))
    b.add("weight_scale", "F16", (out, _ngroups(s, inp)))


_LAYOUT_FUNCS = {
    "fp8": _fp8, "mxfp4": _mxfp4, "nvfp4": _nvfp4, "mxfp8": _mxfp8, "awq": _awq,
    "gptq": _gptq, "bnb4": _bnb4, "bnb8": _bnb8, "ct": _ct, "packed": _packed,
}


def quantized_tensors(
    scheme: QuantScheme,
    name: str,
    shape: tuple[int, ...],
    dtype: str,
    kind: str,
    *,
    transposed: bool = False,
) -> list[TensorInfo]:
    """The checkpoint tensors for one parameter.

    ``name`` is the parameter's full name (e.g. ``model.layers.3.mlp.down_proj.weight``),
    ``dtype`` its unquantized safetensors dtype (``BF16``), ``kind`` one of ``"linear"``
    (the 2-D ``[out, in]`` weight of a linear layer), ``"experts"`` (a 3-D fused MoE
    expert weight ``[num_experts, out, in]``, as transformers 5 stores experts;
    ``transposed=True`` for ``[num_experts, in, out]``, the experts modules whose
    ``is_transposed`` is set, e.g. gpt-oss), ``"other"`` (embeddings, norms, biases,
    convolutions, lm_head...). Parameters the method does not quantize (``other``, the LM
    head, the embedding, and anything matched by the config's exclusion lists) come back
    as one unchanged :class:`TensorInfo`. Raises :class:`ValueError` for an unknown kind
    or a shape of the wrong rank for its kind (a caller's mistake, not the user's).
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, not {kind!r}")
    shape = tuple(int(d) for d in shape)
    unchanged = [TensorInfo(name, dtype, shape, tensor_nbytes(dtype, shape))]
    if kind == "other":
        return unchanged
    rank = 2 if kind == "linear" else 3
    if len(shape) != rank:
        raise ValueError(f"{name}: a {kind!r} weight has {rank} dimensions, not shape {list(shape)}")

    if _is_embedding(name):
        return unchanged
    if _is_head(name) and not scheme.quantize_lm_head:
        return unchanged
    if is_excluded(scheme.exclude, name, kind):
        return unchanged
    if scheme.layout == "groups":
        sub = _group_for(scheme, name, kind)
        if sub is None:
            return unchanged
        scheme = sub
        if is_excluded(scheme.exclude, name, kind):
            return unchanged
    if scheme.experts_only and kind != "experts":
        return unchanged
    func = _LAYOUT_FUNCS.get(scheme.layout)
    if func is None:
        return unchanged

    if kind == "linear":
        lead: tuple[int, ...] = ()
        out, inp = shape
    else:
        lead = (shape[0],)
        out, inp = (shape[2], shape[1]) if transposed else (shape[1], shape[2])
    builder = _Builder(name, lead)
    func(builder, scheme, out, inp, dtype)
    return builder.out


# --------------------------------------------------------------------------- configs


_ACTION = "plan from the checkpoint's safetensors headers or a manifest instead"

_FP8_DTYPES = {"e4m3": "F8_E4M3", "float8_e4m3fn": "F8_E4M3", "e5m2": "F8_E5M2", "float8_e5m2": "F8_E5M2"}
_TORCH_TO_ST = {
    "float32": "F32", "float16": "F16", "bfloat16": "BF16", "float8_e4m3fn": "F8_E4M3",
    "uint8": "U8", "int8": "I8", "float8_e8m0fnu": "F8_E8M0",
}


def _short(value: Any) -> str:
    text = repr(value).replace("\n", " ")
    return text if len(text) <= 60 else text[:57] + "..."


class _Reader:
    """Typed reads from a quantization_config mapping; bad values raise one-line errors."""

    def __init__(self, cfg: Mapping[str, Any], where: str, method: str):
        self.cfg, self.where, self.method = cfg, where, method

    def fail(self, problem: str) -> CheckpointError:
        return CheckpointError(
            f"{self.where}quantization_config ({self.method}): {problem}; fix config.json or {_ACTION}"
        )

    def get(self, *keys: str, cfg: Mapping[str, Any] | None = None) -> Any:
        cfg = self.cfg if cfg is None else cfg
        for key in keys:
            if cfg.get(key) is not None:
                return cfg[key]
        return None

    def get_int(self, *keys: str, default: int | None = None, cfg: Mapping[str, Any] | None = None,
            minimum: int | None = 1, allow: tuple[int, ...] = ()) -> int | None:
        value = self.get(*keys, cfg=cfg)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise self.fail(f"{keys[0]} must be an integer, not {_short(value)}")
        try:
            number = int(value)
        except ValueError:
            raise self.fail(f"{keys[0]} must be an integer, not {_short(value)}") from None
        if minimum is not None and number < minimum and number not in allow:
            raise self.fail(f"{keys[0]} must be at least {minimum}, not {number}")
        return number

    def get_bool(self, *keys: str, default: bool = False, cfg: Mapping[str, Any] | None = None) -> bool:
        value = self.get(*keys, cfg=cfg)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.fail(f"{keys[0]} must be true or false, not {_short(value)}")
        return value

    def get_str(self, *keys: str, default: str | None = None, cfg: Mapping[str, Any] | None = None) -> str | None:
        value = self.get(*keys, cfg=cfg)
        if value is None:
            return default
        if not isinstance(value, str):
            raise self.fail(f"{keys[0]} must be a string, not {_short(value)}")
        return value

    def names(self, *keys: str, cfg: Mapping[str, Any] | None = None) -> tuple[str, ...]:
        """Every entry of every list named by ``keys`` (exclusion lists)."""
        cfg = self.cfg if cfg is None else cfg
        entries: list[str] = []
        for key in keys:
            value = cfg.get(key)
            if value is None:
                continue
            if isinstance(value, str):
                value = [value]
            if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
                raise self.fail(f"{key} must be a list of module names, not {_short(value)}")
            entries += value
        return tuple(dict.fromkeys(entries))


def _where_prefix(where: str) -> str:
    if not where:
        return ""
    return where if where.endswith(": ") else f"{where.rstrip(': ')}: "


def scheme_from_config(quantization_config: Mapping | None, where: str) -> tuple[QuantScheme | None, list[str]]:
    """The :class:`QuantScheme` of a config's ``quantization_config``, and notes.

    ``None`` (and no notes) when the config has no quantization_config. Notes say what was
    assumed. An unrecognised method: a note naming it and the bits assumed when the config
    gives a bit width (``bits`` / ``num_bits`` / ``weight_bits``); otherwise
    :class:`CheckpointError` (one line: what method, that its size cannot be estimated, and
    to plan from the checkpoint's safetensors headers or a manifest instead). ``where``
    prefixes every message (the config's path).
    """
    where = _where_prefix(where)
    if quantization_config is None:
        return None, []
    if not isinstance(quantization_config, Mapping):
        raise CheckpointError(
            f"{where}quantization_config is {type(quantization_config).__name__} "
            f"{_short(quantization_config)}, not an object, so the quantized checkpoint's size "
            f"cannot be estimated; fix config.json or {_ACTION}"
        )
    cfg = quantization_config
    if not cfg:
        return None, []
    method = cfg.get("quant_method")
    if method is None:
        method = _infer_method(cfg)
    if not isinstance(method, str) or not method:
        raise CheckpointError(
            f"{where}quantization_config has quant_method {_short(method)}, not a method name, "
            f"so the quantized checkpoint's size cannot be estimated; {_ACTION}"
        )
    key = method.lower().replace("_", "-")
    parser = _PARSERS.get(key)
    reader = _Reader(cfg, where, method)
    if parser is None:
        return _unknown(reader, method)
    return parser(reader)


def _infer_method(cfg: Mapping[str, Any]) -> Any:
    """The method of a quantization_config without ``quant_method`` (older bitsandbytes
    configs; ModelOpt's hf_quant_config layout), else ``None``."""
    if any(cfg.get(k) for k in ("load_in_4bit", "_load_in_4bit", "load_in_8bit", "_load_in_8bit")):
        return "bitsandbytes"
    if isinstance(cfg.get("quantization"), Mapping) and "quant_algo" in cfg["quantization"]:
        return "modelopt"
    return None


def _unknown(r: _Reader, method: str) -> tuple[QuantScheme, list[str]]:
    bits = r.get("bits", "num_bits", "weight_bits", "w_bit")
    if bits is None:
        raise CheckpointError(
            f"{r.where}quantization_config: quant_method {method!r} is not supported, so the "
            f"quantized checkpoint's size cannot be estimated from config.json; {_ACTION}"
        )
    bits = r.get_int("bits", "num_bits", "weight_bits", "w_bit")
    if bits > 32:
        raise r.fail(f"bit width {bits} is not a weight bit width")
    group = r.get_int("group_size", "q_group_size", minimum=1, allow=(-1,))
    per = f"one F16 scale per {group} inputs" if group and group > 0 else "one F16 scale per output row"
    scheme = QuantScheme(
        method=method,
        description=f"{method}: assumed {bits}-bit packed weights, {per}",
        layout="packed", bits=bits, strategy="group" if group and group > 0 else "channel",
        group_size=group if group and group > 0 else None,
        exclude=r.names("modules_to_not_convert", "ignore", "ignored_layers"),
    )
    note = (
        f"{r.where}quantization_config: method {method!r} is not modelled; its linear and "
        f"expert weights are estimated as {bits}-bit ({per}), everything else unchanged; "
        f"for exact sizes {_ACTION}"
    )
    return scheme, [note]


# ---- fp8


def _parse_fp8(r: _Reader) -> tuple[QuantScheme, list[str]]:
    notes: list[str] = []
    fmt = r.get_str("fmt", default="e4m3").lower()
    weight_dtype = _FP8_DTYPES.get(fmt)
    if weight_dtype is None:
        raise r.fail(f"fmt {fmt!r} is not an FP8 format (e4m3 or e5m2)")
    activation = r.get_str("activation_scheme")
    if activation is None:
        activation = "dynamic"
        notes.append(f"{r.where}quantization_config (fp8) names no activation_scheme; "
                     "assumed dynamic (no input_scale tensors)")
    activation = activation.lower()
    if activation not in ("dynamic", "static"):
        raise r.fail(f"activation_scheme {activation!r} is neither dynamic nor static")
    block = r.get("weight_block_size")
    exclude = r.names("ignored_layers", "modules_to_not_convert")
    e = weight_dtype.removeprefix("F8_").lower()
    if block is not None:
        if (not isinstance(block, (list, tuple)) or len(block) != 2
                or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in block)):
            raise r.fail(f"weight_block_size must be two positive integers, not {_short(block)}")
        bo, bi = block
        return QuantScheme(
            method="fp8", description=f"FP8 {e}, {bo}x{bi} block scales", layout="fp8", bits=8,
            strategy="block", block_size=(bo, bi), weight_dtype=weight_dtype,
            scale_name="weight_scale_inv", static_input_scale=activation == "static", exclude=exclude,
        ), notes
    static = activation == "static"
    return QuantScheme(
        method="fp8",
        description=f"FP8 {e}, per-tensor scales" + (", static activation scales" if static else ""),
        layout="fp8", bits=8, strategy="tensor", weight_dtype=weight_dtype,
        static_input_scale=static, exclude=exclude,
    ), notes


def _parse_fbgemm_fp8(r: _Reader) -> tuple[QuantScheme, list[str]]:
    return QuantScheme(
        method="fp8", description="FP8 e4m3 (FBGEMM), per-channel scales", layout="fp8", bits=8,
        strategy="channel", weight_dtype="F8_E4M3", exclude=r.names("modules_to_not_convert"),
    ), []


# ---- mxfp4


def _parse_mxfp4(r: _Reader) -> tuple[QuantScheme, list[str]]:
    return QuantScheme(
        method="mxfp4", description="MXFP4 e2m1 MoE experts, e8m0 scale per 32; other weights unquantized",
        layout="mxfp4", bits=4, strategy="group", group_size=32, experts_only=True,
        exclude=r.names("modules_to_not_convert"),
    ), []


# ---- modelopt


def _modelopt_algo(r: _Reader, algo: str, group: int | None, exclude: tuple[str, ...]) -> QuantScheme:
    algo = algo.upper()
    if algo in ("NVFP4", "W4A16_NVFP4"):
        g = group or 16
        w4a16 = algo == "W4A16_NVFP4"
        return QuantScheme(
            method="nvfp4",
            description=f"NVFP4 e2m1 (ModelOpt), FP8 scale per {g} + FP32 global scale"
                        + (", 16-bit activations" if w4a16 else ""),
            layout="nvfp4", bits=4, strategy="tensor_group", group_size=g,
            static_input_scale=not w4a16, exclude=exclude,
        )
    if algo == "FP8":
        return QuantScheme(
            method="fp8", description="FP8 e4m3 (ModelOpt), per-tensor scales, static activation scales",
            layout="fp8", bits=8, strategy="tensor", weight_dtype="F8_E4M3",
            static_input_scale=True, exclude=exclude,
        )
    if algo == "FP8_PER_CHANNEL_PER_TOKEN":
        return QuantScheme(
            method="fp8", description="FP8 e4m3 (ModelOpt), per-channel scales",
            layout="fp8", bits=8, strategy="channel", weight_dtype="F8_E4M3", exclude=exclude,
        )
    if algo in ("FP8_PB_WO", "FP8_BLOCK_SCALES"):
        return QuantScheme(
            method="fp8", description="FP8 e4m3 (ModelOpt), 128x128 block scales",
            layout="fp8", bits=8, strategy="block", block_size=(128, 128),
            weight_dtype="F8_E4M3", exclude=exclude,
        )
    if algo == "MXFP8":
        return QuantScheme(
            method="mxfp8", description="MXFP8 e4m3 (ModelOpt), e8m0 scale per 32",
            layout="mxfp8", bits=8, strategy="group", group_size=32, exclude=exclude,
        )
    raise CheckpointError(
        f"{r.where}quantization_config: ModelOpt quant_algo {algo!r} is not supported, so the "
        f"quantized checkpoint's size cannot be estimated from config.json; {_ACTION}"
    )


def _parse_modelopt(r: _Reader) -> tuple[QuantScheme, list[str]]:
    inner = r.cfg.get("quantization")
    section = inner if isinstance(inner, Mapping) else r.cfg
    algo = r.get_str("quant_algo", cfg=section) or r.get_str("quant_algo")
    if algo is None:
        method = r.method.lower().replace("_", "-")
        algo = {"modelopt-fp4": "NVFP4", "nvfp4": "NVFP4", "modelopt-mxfp8": "MXFP8"}.get(method)
    if algo is None:
        raise r.fail("names no quant_algo")
    group = r.get_int("group_size", cfg=section) or r.get_int("group_size")
    # vLLM never quantizes these vision modules of a ModelOpt checkpoint.
    exclude = r.names("exclude_modules", "ignore", cfg=section) + r.names("exclude_modules", "ignore") \
        + ("vision_tower", "vision_model")
    exclude = tuple(dict.fromkeys(exclude))
    if algo.upper() != "MIXED_PRECISION":
        return _modelopt_algo(r, algo, group, exclude), []
    layers = r.get("quantized_layers", cfg=section) or r.get("quantized_layers")
    if not isinstance(layers, Mapping) or not layers:
        raise r.fail("quant_algo MIXED_PRECISION needs a quantized_layers object")
    groups = []
    for module, spec in layers.items():
        if not isinstance(spec, Mapping) or not isinstance(spec.get("quant_algo"), str):
            raise r.fail(f"quantized_layers[{module!r}] has no quant_algo")
        sub = _modelopt_algo(r, spec["quant_algo"], r.get_int("group_size", cfg=spec) or group, ())
        groups.append(((str(module),), sub))
    algos = sorted({sub.description.split(" (")[0] for _, sub in groups})
    return QuantScheme(
        method="modelopt", description=f"ModelOpt mixed precision ({', '.join(algos)} by layer)",
        layout="groups", exclude=exclude, groups=tuple(groups),
    ), []


# ---- awq / gptq


def _parse_awq(r: _Reader) -> tuple[QuantScheme, list[str]]:
    notes: list[str] = []
    bits = r.get_int("bits", "w_bit")
    if bits is None:
        bits = 4
        notes.append(f"{r.where}quantization_config (awq) names no bits; assumed 4")
    group = r.get_int("group_size", "q_group_size", allow=(-1,))
    if group is None:
        group = 128
        notes.append(f"{r.where}quantization_config (awq) names no group_size; assumed 128")
    if bits > 8:
        raise r.fail(f"bits {bits} is more than AWQ packs (at most 8)")
    g = f"group {group}" if group > 0 else "per channel"
    return QuantScheme(
        method="awq", description=f"AWQ int{bits}, {g}, F16 scales, packed zeros",
        layout="awq", bits=bits, strategy="group" if group > 0 else "channel",
        group_size=group if group > 0 else None, symmetric=False,
        exclude=r.names("modules_to_not_convert"),
    ), notes


def _parse_gptq(r: _Reader) -> tuple[QuantScheme, list[str]]:
    notes: list[str] = []
    bits = r.get_int("bits")
    if bits is None:
        bits = 4
        notes.append(f"{r.where}quantization_config (gptq) names no bits; assumed 4")
    if bits > 8:
        raise r.fail(f"bits {bits} is more than GPTQ packs (at most 8)")
    group = r.get_int("group_size", allow=(-1,))
    if group is None:
        group = 128
        notes.append(f"{r.where}quantization_config (gptq) names no group_size; assumed 128")
    desc_act = r.get_bool("desc_act")
    if r.cfg.get("dynamic"):
        notes.append(f"{r.where}quantization_config (gptq): per-module 'dynamic' overrides are not "
                     "modelled; every quantized module is counted with the top-level bits and group size")
    g = f"group {group}" if group > 0 else "per channel"
    return QuantScheme(
        method="gptq",
        description=f"GPTQ int{bits}, {g}, F16 scales, packed zeros" + (", act-order" if desc_act else ""),
        layout="gptq", bits=bits, strategy="group" if group > 0 else "channel",
        group_size=group if group > 0 else None, symmetric=r.get_bool("sym", default=True), g_idx=True,
        quantize_lm_head=r.get_bool("lm_head"),
        exclude=r.names("modules_to_not_convert"),
    ), notes


# ---- bitsandbytes


_BNB_STORAGE = {"uint8": "U8", "int8": "I8", "bfloat16": "BF16", "float16": "F16", "float32": "F32"}


def _parse_bnb(r: _Reader) -> tuple[QuantScheme, list[str]]:
    four = r.get_bool("load_in_4bit") or r.get_bool("_load_in_4bit")
    eight = r.get_bool("load_in_8bit") or r.get_bool("_load_in_8bit")
    exclude = r.names("llm_int8_skip_modules", "modules_to_not_convert")
    if four:
        quant_type = (r.get_str("bnb_4bit_quant_type", default="fp4") or "fp4").lower()
        if quant_type not in ("nf4", "fp4"):
            raise r.fail(f"bnb_4bit_quant_type {quant_type!r} is neither nf4 nor fp4")
        storage_name = (r.get_str("bnb_4bit_quant_storage", default="uint8") or "uint8").removeprefix("torch.")
        storage = _BNB_STORAGE.get(storage_name)
        if storage is None:
            raise r.fail(f"bnb_4bit_quant_storage {storage_name!r} is not a storage dtype bitsandbytes packs into")
        double = r.get_bool("bnb_4bit_use_double_quant")
        blocksize = r.get_int("bnb_4bit_blocksize", "blocksize", default=64)
        return QuantScheme(
            method="bitsandbytes-4bit",
            description=f"bitsandbytes {quant_type}, absmax per {blocksize} weights"
                        + (" (double-quantized)" if double else ""),
            layout="bnb4", bits=4, strategy="group", group_size=blocksize, quant_type=quant_type,
            double_quant=double, storage_dtype=storage, exclude=exclude,
        ), []
    if eight:
        return QuantScheme(
            method="bitsandbytes-8bit", description="bitsandbytes LLM.int8, I8 weights, F32 scale per row",
            layout="bnb8", bits=8, strategy="channel", exclude=exclude,
        ), []
    raise r.fail("sets neither load_in_4bit nor load_in_8bit")


# ---- compressed-tensors


_CT_FORMATS = ("dense", "int-quantized", "float-quantized", "naive-quantized", "pack-quantized",
               "nvfp4-pack-quantized", "mxfp4-pack-quantized", "mxfp8-quantized")
_CT_STRATEGIES = ("tensor", "channel", "group", "block", "tensor_group", "token")


def _ct_infer_format(weights: Mapping[str, Any], bits: int, wtype: str, group: int | None,
                     has_inputs: bool, scale_dtype: str | None) -> str:
    """compressed-tensors' own format choice (``infer_module_format``'s priority order)."""
    if wtype == "float" and bits == 4:
        return "mxfp4-pack-quantized" if group == 32 else "nvfp4-pack-quantized"
    if wtype == "float" and bits == 8 and group == 32 and scale_dtype == "U8":
        return "mxfp8-quantized"
    if wtype == "int" and not has_inputs:
        return "pack-quantized"
    if wtype == "int":
        return "int-quantized"
    return "float-quantized"


def _ct_group(r: _Reader, gname: str, group: Any, top_format: str | None,
              notes: list[str]) -> tuple[tuple[str, ...], QuantScheme | None]:
    if not isinstance(group, Mapping):
        raise r.fail(f"config_groups[{gname!r}] is not an object")
    targets = r.names("targets", cfg=group)
    if not targets:
        raise r.fail(f"config_groups[{gname!r}] has no targets")
    weights = group.get("weights")
    if weights is None:
        return targets, None  # activations only: weights stay as they are
    if not isinstance(weights, Mapping):
        raise r.fail(f"config_groups[{gname!r}].weights is not an object")
    bits = r.get_int("num_bits", cfg=weights)
    if bits is None or bits > 16:
        raise r.fail(f"config_groups[{gname!r}].weights needs num_bits between 1 and 16")
    wtype = (r.get_str("type", cfg=weights, default="int") or "int").lower()
    if wtype not in ("int", "float"):
        raise r.fail(f"config_groups[{gname!r}].weights.type {wtype!r} is neither int nor float")
    group_size = r.get_int("group_size", cfg=weights, allow=(-1,))
    strategy = r.get_str("strategy", cfg=weights)
    if strategy is None:
        strategy = "tensor" if group_size is None else ("channel" if group_size == -1 else "group")
    strategy = strategy.lower()
    if strategy not in _CT_STRATEGIES:
        raise r.fail(f"config_groups[{gname!r}].weights.strategy {strategy!r} is not one of {', '.join(_CT_STRATEGIES)}")
    if strategy in ("group", "tensor_group") and not (group_size and group_size > 0):
        raise r.fail(f"config_groups[{gname!r}].weights has strategy {strategy} but no group_size")
    block = None
    if strategy == "block":
        raw = weights.get("block_structure")
        if (not isinstance(raw, (list, tuple)) or len(raw) != 2
                or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in raw)):
            raise r.fail(f"config_groups[{gname!r}].weights.block_structure must be two positive integers, "
                          f"not {_short(raw)}")
        block = (raw[0], raw[1])
    raw_scale = r.get_str("scale_dtype", cfg=weights)
    scale_dtype = _TORCH_TO_ST.get(raw_scale.removeprefix("torch.")) if raw_scale else None
    inputs = group.get("input_activations")
    has_inputs = isinstance(inputs, Mapping)
    fmt = r.get_str("format", cfg=group) or top_format
    if fmt in (None, "mixed-precision"):
        fmt = _ct_infer_format(weights, bits, wtype, group_size, has_inputs, scale_dtype)
    if fmt not in _CT_FORMATS:
        note = (f"{r.where}quantization_config (compressed-tensors): format {fmt!r} is not modelled; "
                f"{wtype}{bits} weights counted as {bits}-bit packed with their scales")
        if note not in notes:
            notes.append(note)
        fmt = "pack-quantized" if wtype == "int" and bits <= 8 else "naive-quantized"
    if fmt == "pack-quantized" and (wtype != "int" or bits > 8):
        raise r.fail(f"config_groups[{gname!r}] is pack-quantized but its weights are {wtype}{bits}")
    weight_dtype = None
    if fmt not in ("pack-quantized", "nvfp4-pack-quantized", "mxfp4-pack-quantized", "dense"):
        weight_dtype = "F8_E4M3" if wtype == "float" and bits == 8 else ("I8" if bits <= 8 else "I16")
    if not has_inputs:
        static_inputs = False
    elif fmt in ("nvfp4-pack-quantized", "mxfp4-pack-quantized"):
        static_inputs = inputs.get("strategy") == "tensor_group"  # input_global_scale
    else:
        static_inputs = inputs.get("dynamic", False) is False  # input_scale
    actorder = weights.get("actorder")
    desc = _ct_description(fmt, wtype, bits, strategy, group_size, block)
    return targets, QuantScheme(
        method="compressed-tensors", description=desc, layout="ct", bits=bits, strategy=strategy,
        group_size=group_size if group_size and group_size > 0 else None, block_size=block,
        weight_dtype=weight_dtype, scale_dtype=scale_dtype,
        symmetric=r.get_bool("symmetric", cfg=weights, default=True),
        static_input_scale=bool(static_inputs), g_idx=actorder in ("group", True), format=fmt,
        dynamic_weights=weights.get("dynamic") is True,
    )


def _ct_description(fmt: str, wtype: str, bits: int, strategy: str, group: int | None,
                    block: tuple[int, int] | None) -> str:
    if fmt == "nvfp4-pack-quantized":
        return "NVFP4 e2m1 (compressed-tensors), FP8 scale per 16 + FP32 global scale"
    if fmt == "mxfp4-pack-quantized":
        return "MXFP4 e2m1 (compressed-tensors), e8m0 scale per 32"
    if fmt == "mxfp8-quantized":
        return "MXFP8 e4m3 (compressed-tensors), e8m0 scale per 32"
    per = {"tensor": "per-tensor", "channel": "per-channel", "group": f"group {group}",
           "tensor_group": f"group {group} + global", "token": "per-token"}.get(strategy, "")
    if strategy == "block" and block:
        per = f"{block[0]}x{block[1]} block"
    kind = {"float": "fp", "int": "int"}[wtype]
    return f"compressed-tensors {fmt} {kind}{bits}, {per} scales"


def _parse_compressed_tensors(r: _Reader) -> tuple[QuantScheme, list[str]]:
    notes: list[str] = []
    top_format = r.get_str("format")
    groups_cfg = r.get("config_groups")
    exclude = r.names("ignore")
    sparsity = r.get("sparsity_config")
    if isinstance(sparsity, Mapping) and sparsity.get("format") not in (None, "dense"):
        notes.append(f"{r.where}quantization_config (compressed-tensors): sparsity format "
                     f"{sparsity.get('format')!r} is not modelled; weights counted as dense")
    if groups_cfg is None or (isinstance(groups_cfg, Mapping) and not groups_cfg):
        return QuantScheme(
            method="compressed-tensors", description="compressed-tensors without quantization groups (weights unchanged)",
            layout="groups", exclude=exclude,
        ), notes
    if not isinstance(groups_cfg, Mapping):
        raise r.fail(f"config_groups must be an object, not {_short(groups_cfg)}")
    groups = tuple(_ct_group(r, str(name), group, top_format, notes) for name, group in groups_cfg.items())
    descriptions = list(dict.fromkeys(sub.description for _, sub in groups if sub is not None))
    description = "; ".join(descriptions) or "compressed-tensors, activations only (weights unchanged)"
    return QuantScheme(
        method="compressed-tensors", description=description, layout="groups",
        exclude=exclude, groups=groups,
    ), notes


_PARSERS = {
    "fp8": _parse_fp8,
    "fbgemm-fp8": _parse_fbgemm_fp8,
    "mxfp4": _parse_mxfp4,
    "modelopt": _parse_modelopt,
    "modelopt-fp4": _parse_modelopt,
    "modelopt-mxfp8": _parse_modelopt,
    "nvfp4": _parse_modelopt,
    "awq": _parse_awq,
    "awq-marlin": _parse_awq,
    "gptq": _parse_gptq,
    "gptq-marlin": _parse_gptq,
    "bitsandbytes": _parse_bnb,
    "compressed-tensors": _parse_compressed_tensors,
}
