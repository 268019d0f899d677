"""From a ``quantization_config`` to a scheme, and from a scheme to one parameter's tensors:
the two tables that name every method's parser and every layout, and the rules applied
before any layout runs.

:func:`scheme_from_config` finds the method (``quant_method``, or inferred for older
bitsandbytes and ModelOpt configs) and hands the config to that method's parser;
:func:`quantized_tensors` decides whether a parameter is quantized at all (its kind, the
LM head and embeddings, the exclusion lists, a ``groups`` scheme's targets) and only then
asks the scheme's layout for its tensors. Method modules know nothing of each other or of
this table, so adding a method is one module and one line in each table.
"""

from __future__ import annotations

from typing import Any, Mapping

from ..errors import CheckpointError, cut
from ..jsonio import json_text, json_type
from ..tensors import TensorInfo, tensor_nbytes
from .awq import awq_tensors, parse_awq
from .base import KINDS, Builder, QuantScheme
from .bitsandbytes import bnb4_tensors, bnb8_tensors, parse_bnb
from .compressed_tensors import ct_tensors, parse_compressed_tensors
from .exclusion import group_for, is_embedding, is_excluded, is_head
from .fp8 import fp8_tensors, parse_fbgemm_fp8, parse_fp8
from .gptq import gptq_tensors, parse_gptq
from .modelopt import mxfp8_tensors, nvfp4_tensors, parse_modelopt
from .mxfp4 import mxfp4_tensors, parse_mxfp4
from .packed import packed_tensors, parse_unknown
from .reader import ACTION, FIX, ConfigReader, where_prefix

#: ``quant_method`` (lower case, ``_`` as ``-``) -> its parser.
PARSERS = {
    "fp8": parse_fp8,
    "fbgemm-fp8": parse_fbgemm_fp8,
    "mxfp4": parse_mxfp4,
    "modelopt": parse_modelopt,
    "modelopt-fp4": parse_modelopt,
    "modelopt-mxfp8": parse_modelopt,
    "nvfp4": parse_modelopt,
    "awq": parse_awq,
    "awq-marlin": parse_awq,
    "gptq": parse_gptq,
    "gptq-marlin": parse_gptq,
    "bitsandbytes": parse_bnb,
    "compressed-tensors": parse_compressed_tensors,
}

#: ``QuantScheme.layout`` -> the function that adds one parameter's tensors (``groups``
#: is resolved to a member scheme first; ``none`` leaves the parameter as it is).
LAYOUT_FUNCS = {
    "fp8": fp8_tensors, "mxfp4": mxfp4_tensors, "nvfp4": nvfp4_tensors, "mxfp8": mxfp8_tensors,
    "awq": awq_tensors, "gptq": gptq_tensors, "bnb4": bnb4_tensors, "bnb8": bnb8_tensors,
    "ct": ct_tensors, "packed": packed_tensors,
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

    if is_embedding(name):
        return unchanged
    if is_head(name) and not scheme.quantize_lm_head:
        return unchanged
    if is_excluded(scheme.exclude, name, kind):
        return unchanged
    if scheme.layout == "groups":
        sub = group_for(scheme, name, kind)
        if sub is None:
            return unchanged
        scheme = sub
        if is_excluded(scheme.exclude, name, kind):
            return unchanged
    if scheme.experts_only and kind != "experts":
        return unchanged
    func = LAYOUT_FUNCS.get(scheme.layout)
    if func is None:
        return unchanged

    if kind == "linear":
        lead: tuple[int, ...] = ()
        out, inp = shape
    else:
        lead = (shape[0],)
        out, inp = (shape[2], shape[1]) if transposed else (shape[1], shape[2])
    builder = Builder(name, lead)
    func(builder, scheme, out, inp, dtype)
    return builder.out


def scheme_from_config(quantization_config: Mapping | None, where: str) -> tuple[QuantScheme | None, list[str]]:
    """The :class:`QuantScheme` of a config's ``quantization_config``, and notes.

    ``None`` (and no notes) when the config has no quantization_config. Notes say what was
    assumed. An unrecognised method: a note naming it and the bits assumed when the config
    gives a bit width (``bits`` / ``num_bits`` / ``weight_bits``); otherwise
    :class:`CheckpointError` (one line: what method, that its size cannot be estimated, and
    to plan from the checkpoint's safetensors headers or a manifest instead). ``where``
    prefixes every message (the config's path).
    """
    where = where_prefix(where)
    if quantization_config is None:
        return None, []
    if not isinstance(quantization_config, Mapping):
        raise CheckpointError(
            f"{where}quantization_config is {json_type(quantization_config)} "
            f"{cut(json_text(quantization_config), 60)}, not an object, so the quantized checkpoint's size "
            f"cannot be estimated; {FIX}"
        )
    cfg = quantization_config
    if not cfg:
        return None, []
    method = cfg.get("quant_method")
    if method is None:
        method = _infer_method(cfg)
    if not isinstance(method, str) or not method:
        raise CheckpointError(
            f"{where}quantization_config has quant_method {cut(json_text(method), 60)}, not a method name, "
            f"so the quantized checkpoint's size cannot be estimated; {ACTION}"
        )
    key = method.lower().replace("_", "-")
    parser = PARSERS.get(key)
    reader = ConfigReader(cfg, where, method)
    if parser is None:
        return parse_unknown(reader, method)
    return parser(reader)


def _infer_method(cfg: Mapping[str, Any]) -> Any:
    """The method of a quantization_config without ``quant_method`` (older bitsandbytes
    configs; ModelOpt's hf_quant_config layout), else ``None``."""
    if any(cfg.get(k) for k in ("load_in_4bit", "_load_in_4bit", "load_in_8bit", "_load_in_8bit")):
        return "bitsandbytes"
    if isinstance(cfg.get("quantization"), Mapping) and "quant_algo" in cfg["quantization"]:
        return "modelopt"
    return None
