"""A checkpoint estimated from its ``config.json`` alone, by building the model on the meta device.

When there are no headers to read (no weights downloaded, or a hub repository without
safetensors), transformers builds the model class ``architectures`` names on the meta
device, and its parameters are listed as ``save_pretrained`` would write them. That is an
estimate, and labelled so: a quantized checkpoint's tensors come from its
``quantization_config`` (:mod:`..quantization`), and an MTP head the config declares but
transformers does not build is estimated from a decoder layer's shapes. The facts are
resolved with transformers' defaults (:class:`~.facts.ModelFacts`). transformers and
torch are imported only when a config is read.
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, cut
from ..quantization import quantized_tensors, scheme_from_config
from ..tensors import TensorInfo, tensor_nbytes
from .base import Checkpoint, read_json
from .facts import ModelFacts

_TORCH_TO_SAFETENSORS = {
    "float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64",
    "int8": "I8", "uint8": "U8", "int32": "I32", "int64": "I64", "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
}


def manifest_from_config(config_path: str | os.PathLike, raw: Any = None) -> Checkpoint:
    """Estimate a checkpoint's tensors from its ``config.json`` alone.

    The model class named in ``architectures`` is built on the meta device (no memory,
    no weights, buffers included), and its parameters are listed as a checkpoint of the
    config's dtype would store them. Why this is an estimate: a quantized checkpoint's
    sizes come from its ``quantization_config`` (see :mod:`.quantization`), and an MTP
    head the config declares but transformers does not build is estimated from a decoder
    layer's shapes; both are labelled in the plan's notes. ``raw`` is the config when it was
    already read (from the hub: ``config_path`` then only names it in messages).
    """
    config_path = Path(config_path)
    if raw is None:
        raw = read_json(config_path, "config.json")
    if not isinstance(raw, dict):
        raise CheckpointError(f"{config_path}: config.json is not a JSON object")
    scheme, quant_notes = scheme_from_config(raw.get("quantization_config"), str(config_path))
    config, model_cls = _transformers_config(config_path, raw)
    with _quiet_library() as caught:
        model = _meta_model(model_cls, config, raw)
    facts = ModelFacts.from_config(raw, None, config)
    tensors = _listed_tensors(model, facts, scheme)
    tensors, mtp_notes = _estimate_unbuilt_mtp(tensors, facts, raw)
    if scheme is not None:
        quant_notes.insert(0, f"quantized sizes estimated for {scheme.description} from quantization_config")
    notes = list(facts.notes) + quant_notes + mtp_notes + _warning_notes(caught)
    return Checkpoint(str(config_path), "config", tensors, raw,
                      resolved_facts=replace(facts, notes=tuple(notes)))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _transformers_config(config_path: Path, raw: dict[str, Any]):
    """transformers' config object for ``raw`` and the model class its architecture names."""
    try:
        import transformers
        from transformers import CONFIG_MAPPING
    except ImportError as exc:  # pragma: no cover - a declared dependency
        raise CheckpointError(f"planning from a config needs transformers ({exc})") from None
    architectures, model_type = raw.get("architectures"), raw.get("model_type")
    if not (isinstance(architectures, list) and architectures and all(isinstance(a, str) for a in architectures)):
        raise CheckpointError(
            f"{config_path}: \"architectures\" is {json.dumps(architectures)[:60]}, but must name the model class "
            "transformers builds, like [\"Qwen3ForCausalLM\"]; add it, or plan from the checkpoint's safetensors "
            "headers or a manifest instead")
    if not isinstance(model_type, str):
        raise CheckpointError(f"{config_path}: \"model_type\" is {json.dumps(model_type)[:60]}, but must be a string "
                              "like \"qwen3\"; add it, or plan from the checkpoint's headers or a manifest instead")
    arch = architectures[0]
    unknown = (f"{config_path}: transformers {transformers.__version__} does not know the architecture "
               f"{cut(repr(arch))} (model_type {cut(repr(model_type))}), so its tensors cannot be estimated from the "
               "config; "
               "plan from the checkpoint's safetensors headers or a manifest instead")
    if not model_type or model_type not in CONFIG_MAPPING:
        raise CheckpointError(unknown)
    model_cls = getattr(transformers, arch, None) if arch else None
    if model_cls is None:
        raise CheckpointError(unknown)
    try:
        with _quiet_library():
            config = CONFIG_MAPPING[model_type].from_dict(
                {k: v for k, v in raw.items() if k not in ("auto_map", "transformers_version")})
    except Exception as exc:  # transformers raises many types for a config it cannot read
        raise CheckpointError(f"{config_path}: transformers cannot read this config ({_first_line(exc)})") from None
    return config, model_cls


@contextlib.contextmanager
def _quiet_library():
    """Capture transformers' warnings and log lines while it builds: the plan reports them."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            yield caught
        finally:
            hf_logging.set_verbosity(level)


def _warning_notes(caught) -> list[str]:
    messages = list(dict.fromkeys(str(w.message).strip().splitlines()[0] for w in caught if str(w.message).strip()))
    if not messages:
        return []
    return [f"transformers warned {len(messages)} time(s) while building the model on the meta device "
            f"(first: {messages[0][:160]})"]


def _meta_model(model_cls, config, raw: dict[str, Any]):
    """The model built on the meta device: parameters *and* buffers, so nothing is allocated
    (accelerate's init_empty_weights leaves buffers real, which for some models is GBs)."""
    import torch

    dtype = getattr(torch, str(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"), torch.bfloat16)
    try:
        with torch.device("meta"):
            try:
                return model_cls._from_config(config, dtype=dtype)
            except TypeError:  # transformers < 4.56 names it torch_dtype
                return model_cls._from_config(config, torch_dtype=dtype)
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"transformers could not build {model_cls.__name__} from this config on the meta "
                              f"device ({_first_line(exc)}); plan from the checkpoint's headers or a manifest "
                              "instead") from None


def _listed_tensors(model, facts: ModelFacts, scheme=None) -> dict[str, TensorInfo]:
    """What save_pretrained would write for ``model``, in safetensors dtypes, with quantized
    parameters as their quantization method stores them (``scheme``)."""
    import torch

    modules = dict(model.named_modules())
    # A tied output embedding is not saved (save_pretrained drops it); list it once.
    # On the meta device the tie may not be made, so the resolved flag decides.
    skip: set[str] = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    skip -= {n for n, _ in model.named_parameters()}
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if facts.tie_word_embeddings and output is not None:
        skip |= {f"{n}.weight" for n, mod in modules.items() if mod is output}
    tensors: dict[str, TensorInfo] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if name in skip:
            continue
        st_dtype = _TORCH_TO_SAFETENSORS.get(str(tensor.dtype).removeprefix("torch."), "BF16")
        shape = tuple(tensor.shape)
        if scheme is None:
            tensors[name] = TensorInfo(name, st_dtype, shape, tensor_nbytes(st_dtype, shape))
            continue
        owner = modules.get(name.rsplit(".", 1)[0]) if "." in name else None
        kind = _param_kind(name, tensor, owner, torch)
        for info in quantized_tensors(scheme, name, shape, st_dtype, kind,
                                      transposed=bool(getattr(owner, "is_transposed", False))):
            tensors[info.name] = info
    return tensors


def _param_kind(name: str, tensor, owner, torch) -> str:
    """``linear`` (a linear layer's 2-D weight), ``experts`` (a fused MoE expert weight, 3-D
    in transformers 5) or ``other`` (embeddings, norms, biases, the LM head...)."""
    if name.endswith(".weight") and isinstance(owner, torch.nn.Linear) and tensor.dim() == 2:
        return "linear"
    if tensor.dim() == 3 and "experts" in name.split("."):
        return "experts"
    return "other"


def _estimate_unbuilt_mtp(tensors: dict[str, TensorInfo], facts: ModelFacts,
                          raw: dict[str, Any]) -> tuple[dict[str, TensorInfo], list[str]]:
    """An MTP head the config declares (``num_nextn_predict_layers``, ``mtp_num_hidden_layers``)
    but transformers does not build, estimated as the checkpoint stores it: per MTP layer, a
    decoder layer's tensors plus its input projection and norms. The embedding and LM head
    the head uses are the target's (vLLM shares them), so they are not counted again."""
    n, layers, hidden = facts.num_mtp_layers, facts.num_hidden_layers, facts.hidden_size
    if not n or layers is None or not hidden:
        return tensors, []
    stacks = {}
    for name in tensors:
        parts = name.split(".")
        for i, seg in enumerate(parts[:-1]):
            if seg == "layers" and parts[i + 1].isdigit():
                stacks.setdefault(".".join(parts[:i + 1]), set()).add(int(parts[i + 1]))
                break
    if not stacks or any(seg in ("mtp", "mtp_layers") for name in tensors for seg in name.split(".")):
        return tensors, []
    stack, indices = max(stacks.items(), key=lambda kv: len(kv[1]))
    if max(indices) >= layers:
        return tensors, []
    last = f"{stack}.{max(indices)}."
    template = {name[len(last):]: t for name, t in tensors.items() if name.startswith(last)}
    deepseek_style = any(raw.get(k) or (raw.get("text_config") or {}).get(k) for k in ("num_nextn_predict_layers",))
    out = dict(tensors)
    dtype = next(iter(template.values())).dtype if template else "BF16"

    def add(name: str, shape: tuple[int, ...]) -> None:
        out[name] = TensorInfo(name, dtype, shape, tensor_nbytes(dtype, shape))

    for i in range(n):
        base = f"{stack}.{layers + i}." if deepseek_style else f"mtp.layers.{i}."
        for suffix, t in template.items():
            out[base + suffix] = TensorInfo(base + suffix, t.dtype, t.shape, t.nbytes)
        if deepseek_style:
            for norm in ("enorm", "hnorm", "shared_head.norm"):
                add(f"{base}{norm}.weight", (hidden,))
            add(f"{base}eh_proj.weight", (hidden, 2 * hidden))
    if not deepseek_style:
        for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            add(f"mtp.{norm}.weight", (hidden,))
        add("mtp.fc.weight", (hidden, 2 * hidden))
    added = sum(t.nbytes for name, t in out.items() if name not in tensors)
    key = "num_nextn_predict_layers" if deepseek_style else "mtp_num_hidden_layers"
    return out, [f"the MTP head the config declares ({key}={n}) is not built by transformers: estimated as "
                 f"{n} decoder layer(s) plus its projection and norms ({added / 1e9:.3f} GB, an estimate; the "
                 "embedding and LM head it uses are the target's)"]
