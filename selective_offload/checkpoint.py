"""What a checkpoint holds, read from its safetensors headers, a manifest, or a config alone.

The planner needs each tensor's name and byte size and a handful of ``config.json`` facts.
All three sources give the same :class:`Checkpoint`:

* a directory of ``*.safetensors`` shards (one file or many, with or without
  ``model.safetensors.index.json``): only the headers are read (8 bytes of length and a
  few KB of JSON per shard), never tensor data, so a 30 GB checkpoint is read in
  milliseconds and shards whose data has not been downloaded yet still plan;
* a manifest (JSON: tensor name -> shape and dtype, plus the config), written by
  :func:`write_manifest` or by hand, to plan without any weights;
* a ``config.json`` alone, turned into a manifest by building the model on the meta
  device (accelerate's ``init_empty_weights`` and transformers): an estimate, labelled so.

Byte sizes come from the header's ``data_offsets`` where there is a header, and from shape
and dtype otherwise; the two are checked against each other so a corrupt header is caught
here and not in the middle of a vLLM load.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import struct
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, Mapping

from . import jsonio
from .errors import CheckpointError
from .names import VLLM_HOST_TABLES
from .quantization import quantized_tensors, scheme_from_config
# The tensor facts live in .tensors (quantization reads them too); re-exported for callers.
from .tensors import DTYPE_BITS, MAX_DIM, TensorInfo, check_shape, tensor_nbytes  # noqa: F401

MANIFEST_FORMAT = "selective-offload/manifest-v1"
INDEX_NAME = "model.safetensors.index.json"
#: A header larger than this is not a safetensors header (the format caps it at 100 MB).
MAX_HEADER_BYTES = 100_000_000


#: Routed experts per MoE layer (E) and experts each token is routed to (k), as families name them.
_NUM_EXPERTS_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_routed_experts")
_EXPERTS_PER_TOKEN_KEYS = ("num_experts_per_tok", "experts_per_token", "num_experts_per_token", "top_k_experts",
                           "moe_top_k", "moe_topk", "top_k")
_MTP_KEYS = ("num_nextn_predict_layers", "mtp_num_hidden_layers", "num_mtp_layers", "n_mtp_layers", "mtp_num_layers")


@dataclass(frozen=True)
class ModelFacts:
    """The ``config.json`` facts the planner uses. Unknown values are ``None``.

    Whether the embedding is tied to the LM head decides whether it is cold or hot, so it
    is resolved as vLLM resolves it: the language model's own config (``text_config``)
    first, then the top level; when neither states it, the checkpoint decides (no
    ``lm_head`` tensor: the embedding is the head), or, planning from a config alone,
    transformers' default for that architecture. A checkpoint that says untied but stores
    no ``lm_head`` is tied whatever it says (the head must come from somewhere).
    """

    architectures: tuple[str, ...] = ()
    model_type: str | None = None
    tie_word_embeddings: bool = False
    num_hidden_layers: int | None = None
    hidden_size: int | None = None
    vocab_size: int | None = None
    has_vision: bool = False
    has_audio: bool = False
    num_mtp_layers: int = 0
    #: Routed experts per MoE layer (E) and top-k (k), when the config declares them.
    num_experts: int | None = None
    experts_per_token: int | None = None
    #: The config declares sparse-read tables vLLM keeps in host memory itself (n-gram /
    #: per-layer embeddings, ``names.VLLM_HOST_TABLES``).
    vllm_host_tables: bool = False
    #: Where the tie flag came from (``text_config``, ``config``, ``checkpoint``, ``default``).
    tie_source: str = "default"
    notes: tuple[str, ...] = ()

    @classmethod
    def from_config(cls, config: Mapping[str, Any], tensor_names: Iterable[str] | None = None,
                    resolved: Any = None) -> "ModelFacts":
        """Facts from the raw ``config.json`` (and, when given, the checkpoint's tensor
        names, or transformers' resolved config object for defaults it does not state)."""
        text = config.get("text_config") or {}
        if not isinstance(text, Mapping):
            text = {}
        resolved_text = resolved.get_text_config() if resolved is not None else None

        def pick(*keys: str) -> Any:
            # The text model's own value wins over the top level: multimodal configs keep
            # the language model's sizes (and often its tie flag) under text_config.
            for source in (text, config):
                for key in keys:
                    if source.get(key) is not None:
                        return source[key]
            for obj in (resolved_text, resolved):
                for key in keys:
                    if obj is not None and getattr(obj, key, None) is not None:
                        return getattr(obj, key)
            return None

        tie, source, notes = _resolve_tie(text, config, tensor_names, resolved_text, resolved)
        architectures = config.get("architectures")
        model_type = config.get("model_type")
        return cls(
            architectures=tuple(a for a in architectures if isinstance(a, str))
            if isinstance(architectures, list) else (),
            model_type=model_type if isinstance(model_type, str) else None,
            tie_word_embeddings=tie,
            num_hidden_layers=_count(pick("num_hidden_layers", "num_layers", "n_layer")),
            hidden_size=_count(pick("hidden_size", "d_model", "n_embd")),
            vocab_size=_count(pick("vocab_size")),
            has_vision=any(k in config for k in ("vision_config", "visual", "vision_tower")),
            has_audio="audio_config" in config,
            num_mtp_layers=_count(pick(*_MTP_KEYS)) or 0,
            num_experts=_positive_int(pick(*_NUM_EXPERTS_KEYS)),
            experts_per_token=_positive_int(pick(*_EXPERTS_PER_TOKEN_KEYS)),
            # mutation: host-tables-on-device
            vllm_host_tables=_declares_host_tables(architectures, pick),
            tie_source=source,
            notes=tuple(notes),
        )


def _declares_host_tables(architectures: Any, pick) -> bool:
    arch = architectures[0] if isinstance(architectures, list) and architectures else None
    field = VLLM_HOST_TABLES.get(arch, (None,))[0] if isinstance(arch, str) else None
    return bool(field and pick(field))


def _positive_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 < value <= MAX_DIM else None


def _count(value: Any) -> int | None:
    """A count from a config (layers, sizes): a whole number from 0 up, else unknown (a
    hand-edited config's ``"32"`` or ``1e400`` must not reach arithmetic)."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_DIM:
        return value
    return None


def _resolve_tie(text: Mapping, config: Mapping, tensor_names, resolved_text, resolved) -> tuple[bool, str, list[str]]:
    stated = next(((bool(src["tie_word_embeddings"]), label) for src, label in
                   ((text, "text_config"), (config, "config"))
                   if src.get("tie_word_embeddings") is not None), None)
    if tensor_names is not None:
        names = list(tensor_names)
        has_head = any("lm_head" in n.split(".") for n in names)
        has_embed = any("embed_tokens" in n.split(".") for n in names)
        if stated is None:
            return (not has_head and has_embed), "checkpoint", []
        if not stated[0] and has_embed and not has_head:
            return True, "checkpoint", ["the config says the embeddings are not tied, but the checkpoint stores no "
                                        "lm_head: the embedding is the LM head's weight (tied)"]
        return stated[0], stated[1], []
    if stated is not None:
        return stated[0], stated[1], []
    for obj, label in ((resolved_text, "transformers' default (text config)"), (resolved, "transformers' default")):
        value = getattr(obj, "tie_word_embeddings", None) if obj is not None else None
        if value is not None:
            return bool(value), label, []
    # mutation: tie-default-true
    return False, "default", []


@dataclass
class Checkpoint:
    """Every tensor of a model (name -> :class:`TensorInfo`) and its config."""

    source: str
    #: ``safetensors``, ``manifest`` or ``config`` (the last is an estimate).
    kind: str
    tensors: dict[str, TensorInfo]
    config: dict[str, Any] = field(default_factory=dict)
    #: Shards whose data is shorter than their header says (header-only or partly
    #: downloaded): fine for planning, not for loading.
    incomplete_shards: list[str] = field(default_factory=list)

    #: Facts resolved when the checkpoint was made (a config-only estimate carries
    #: transformers' resolved values); otherwise computed from the config and the tensors.
    resolved_facts: ModelFacts | None = None

    @property
    def facts(self) -> ModelFacts:
        if self.resolved_facts is None:
            names = self.tensors.keys() if self.tensors else None
            self.resolved_facts = ModelFacts.from_config(self.config, names)
        return self.resolved_facts

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def to_manifest(self) -> dict[str, Any]:
        return {
            "format": MANIFEST_FORMAT,
            "source": self.source,
            "kind": self.kind,
            "config": self.config,
            "tensors": {
                t.name: {"dtype": t.dtype, "shape": list(t.shape)}
                for t in self.tensors.values()
            },
        }


# --------------------------------------------------------------------------- shards


def _read_header_bytes(path: Path) -> tuple[bytes, int, int]:
    """The raw JSON header of a shard, its length and the file size: 8 + header bytes read."""
    where = f"{path}: "
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(
                    f"{where}file is {size} bytes, too short for a safetensors header; "
                    "the download is incomplete: fetch the shard again"
                )
            (header_len,) = struct.unpack("<Q", head)
            if header_len > MAX_HEADER_BYTES or 8 + header_len > size:
                raise CheckpointError(
                    f"{where}header length {header_len} runs past the end of the "
                    f"{size}-byte file; the shard is truncated or not safetensors: fetch it again"
                )
            # mutation: header-read-all, header-read-builtin
            return f.read(header_len), header_len, size
    except OSError as exc:
        raise CheckpointError(f"{where}cannot read: {exc.strerror or exc}") from None


def _tensor_entry(name: str, entry: Any, where: str, path: Path) -> tuple[TensorInfo, int, int]:
    """One header entry as a :class:`TensorInfo`, with its data span checked against its
    size, as safetensors checks it (typed fields, whole bytes)."""
    at = f"{where}tensor {name[:80]!r}: "
    offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
    if not isinstance(entry, dict) or "dtype" not in entry or "shape" not in entry or not (
            isinstance(offsets, list) and len(offsets) == 2 and all(
                isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= MAX_DIM for x in offsets)):
        raise CheckpointError(
            f"{where}tensor {name[:80]!r} lacks a valid dtype, shape or data_offsets; "
            "the shard is corrupt: fetch it again"
        )
    dtype = entry["dtype"]
    shape = check_shape(entry["shape"], at)
    begin, end = offsets
    expected = tensor_nbytes(dtype, shape, where=at)
    if math.prod(shape) * DTYPE_BITS[dtype] % 8:
        raise CheckpointError(f"{at}{math.prod(shape)} elements of {dtype} are not a whole number of bytes, which "
                              "safetensors refuses; the shard is corrupt")
    if end < begin or end - begin != expected:
        raise CheckpointError(
            f"{where}tensor {name!r} has data_offsets [{begin}, {end}] but its shape "
            f"{list(shape)} and dtype {dtype} need {expected} bytes; the shard is corrupt"
        )
    return TensorInfo(name, dtype, shape, expected, str(path)), begin, end


def read_shard_header(path: str | os.PathLike) -> tuple[dict[str, TensorInfo], bool]:
    """Read one shard's header; return its tensors and whether all their data is present.

    Reads the 8-byte length and the JSON header, nothing else. Raises
    :class:`CheckpointError` naming the file for a truncated or corrupt header.
    """
    path = Path(path)
    where = f"{path}: "
    raw, header_len, size = _read_header_bytes(path)
    try:
        header = jsonio.parse(raw)
    except ValueError as exc:
        raise CheckpointError(
            f"{where}header is not valid JSON ({exc}); the shard is corrupt: fetch it again"
        ) from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{where}header is not a JSON object; the shard is corrupt")

    tensors: dict[str, TensorInfo] = {}
    spans: list[tuple[int, int, str]] = []
    for name, entry in header.items():
        if name != "__metadata__":
            tensors[name], begin, end = _tensor_entry(name, entry, where, path)
            spans.append((begin, end, name))
    data_end = check_spans(spans, where)
    available = size - 8 - header_len
    if data_end < available:
        raise CheckpointError(f"{where}{available - data_end} bytes follow the last tensor's data, which safetensors "
                              "refuses (the header does not describe the file); the shard is corrupt: fetch it again")
    return tensors, data_end <= available


def check_spans(spans: list[tuple[int, int, str]], where: str) -> int:
    """The tensors' data spans tile the data from byte 0 with no gap and no overlap, as
    safetensors requires (sorted by offsets, each begins where the last ended: an overlap
    hidden behind a zero-size tensor is caught too). Returns where the data ends."""
    start, previous = 0, None
    for begin, end, name in sorted(spans):
        # mutation: spans-not-contiguous
        if begin != start:
            what = (f"overlaps {previous!r}, which ends at {start}" if begin < start and previous is not None
                    else f"leaves a gap: the data before it ends at {start}")
            raise CheckpointError(f"{where}tensor {name[:80]!r} at [{begin}, {end}] {what}; safetensors refuses "
                                  "tensors that do not follow each other; the shard is corrupt: fetch it again")
        start, previous = end, name
    return start


def _read_json(path: Path, what: str) -> Any:
    try:
        return jsonio.read(path)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read {what}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise CheckpointError(f"{path}: {what} is not valid JSON ({exc}); fix or re-fetch it") from None


def require_complete(checkpoint: Checkpoint) -> None:
    """Refuse to load a checkpoint whose shards hold less data than their headers say
    (truncated, or still downloading): fine to plan, not to run."""
    if checkpoint.incomplete_shards:
        raise CheckpointError(
            f"{checkpoint.incomplete_shards[0]}: the shard is shorter than its header says"
            + (f" (and {len(checkpoint.incomplete_shards) - 1} more shards)" if len(checkpoint.incomplete_shards) > 1
               else "") + ", so vLLM cannot load it; finish the download or fetch the shard again")


def read_safetensors_dir(directory: str | os.PathLike) -> Checkpoint:
    """Read every shard header of a checkpoint directory, and its ``config.json``."""
    directory = Path(directory)
    index_path = directory / INDEX_NAME
    weight_map: dict[str, str] | None = None
    if index_path.is_file():
        index = _read_json(index_path, "the shard index")
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index_path}: has no 'weight_map' object; fix or re-fetch it")
        shard_names = sorted(set(weight_map.values()))
        missing = [s for s in shard_names if not (directory / s).is_file()]
        if missing:
            raise CheckpointError(
                f"{index_path}: names {len(missing)} shard(s) that are not in {directory} "
                f"(first: {missing[0]}); finish the download"
            )
        shards = [directory / s for s in shard_names]
    else:
        shards = sorted(directory.glob("*.safetensors"))
    if not shards:
        raise CheckpointError(
            f"{directory}: no *.safetensors shards here; point at a checkpoint directory, "
            "a manifest (.json) or a config.json"
        )

    tensors: dict[str, TensorInfo] = {}
    incomplete: list[str] = []
    for shard in shards:
        shard_tensors, complete = read_shard_header(shard)
        for name, info in shard_tensors.items():
            if name in tensors:
                raise CheckpointError(
                    f"{shard}: tensor {name!r} is also in {tensors[name].shard}; "
                    "the checkpoint mixes two downloads: remove the stray shard"
                )
            tensors[name] = info
        if not complete:
            incomplete.append(str(shard))
    if weight_map is not None:
        for name, shard_name in weight_map.items():
            info = tensors.get(name)
            if info is None or Path(info.shard).name != shard_name:
                raise CheckpointError(
                    f"{index_path}: maps {name!r} to {shard_name}, but that shard's header "
                    "does not hold it; the index and shards disagree: re-fetch them"
                )

    config_path = directory / "config.json"
    config = _read_json(config_path, "config.json") if config_path.is_file() else {}
    return Checkpoint(str(directory), "safetensors", tensors, config, incomplete)


# --------------------------------------------------------------------------- manifests


def read_manifest(path: str | os.PathLike) -> Checkpoint:
    path = Path(path)
    data = _read_json(path, "the manifest")
    if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT:
        raise CheckpointError(
            f"{path}: not a selective-offload manifest (expected \"format\": "
            f"\"{MANIFEST_FORMAT}\"); write one with `selective-offload manifest`"
        )
    entries = data.get("tensors")
    if not isinstance(entries, dict) or not entries:
        raise CheckpointError(f"{path}: the manifest lists no tensors")
    tensors: dict[str, TensorInfo] = {}
    for name, entry in entries.items():
        if not isinstance(entry, dict) or "dtype" not in entry or "shape" not in entry:
            raise CheckpointError(
                f"{path}: tensor {name[:80]!r} needs a \"dtype\" and an integer \"shape\" list"
            )
        dtype, shape = entry["dtype"], check_shape(entry["shape"], f"{path}: tensor {name[:80]!r}: ")
        nbytes = tensor_nbytes(dtype, shape, where=f"{path}: tensor {name[:80]!r}: ")
        tensors[name] = TensorInfo(name, dtype, shape, nbytes)
    config = data.get("config") or {}
    return Checkpoint(str(data.get("source") or path), data.get("kind") or "manifest",
                      tensors, dict(config))


def write_manifest(checkpoint: Checkpoint, path: str | os.PathLike) -> None:
    Path(path).write_text(json.dumps(checkpoint.to_manifest(), indent=1) + "\n")


_TORCH_TO_SAFETENSORS = {
    "float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64",
    "int8": "I8", "uint8": "U8", "int32": "I32", "int64": "I64", "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
}


def manifest_from_config(config_path: str | os.PathLike) -> Checkpoint:
    """Estimate a checkpoint's tensors from its ``config.json`` alone.

    The model class named in ``architectures`` is built on the meta device (no memory,
    no weights, buffers included), and its parameters are listed as a checkpoint of the
    config's dtype would store them. Why this is an estimate: a quantized checkpoint's
    sizes come from its ``quantization_config`` (see :mod:`.quantization`), and an MTP
    head the config declares but transformers does not build is estimated from a decoder
    layer's shapes; both are labelled in the plan's notes.
    """
    config_path = Path(config_path)
    raw = _read_json(config_path, "config.json")
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
               f"{arch!r} (model_type {model_type!r}), so its tensors cannot be estimated from the config; "
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
    # mutation: fp8-experts-skipped
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
    # mutation: mtp-not-estimated
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


# --------------------------------------------------------------------------- dispatch


def load_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Read whatever ``path`` is: a shard directory, a single shard, a manifest, a config,
    or (when no such path exists) a Hugging Face hub id ``ORG/NAME[@REVISION]``."""
    if not Path(path).exists():
        from .hub import hub_checkpoint  # the network only for a hub id

        found = hub_checkpoint(str(path))
        if found is not None:
            return found
    path = Path(path)
    if not path.exists():
        raise CheckpointError(
            f"{path}: no such file or directory; give a checkpoint directory, a manifest "
            "(.json), a config.json or a Hugging Face hub id (ORG/NAME[@REVISION])"
        )
    if path.is_dir():
        return read_safetensors_dir(path)
    if path.suffix == ".safetensors":
        tensors, complete = read_shard_header(path)
        config_path = path.parent / "config.json"
        config = _read_json(config_path, "config.json") if config_path.is_file() else {}
        return Checkpoint(str(path), "safetensors", tensors, config, [] if complete else [str(path)])
    if path.suffix == ".json":
        data = _read_json(path, "the file")
        if isinstance(data, dict) and data.get("format") == MANIFEST_FORMAT:
            return read_manifest(path)
        if isinstance(data, dict) and ("architectures" in data or "model_type" in data):
            return manifest_from_config(path)
        raise CheckpointError(
            f"{path}: neither a selective-offload manifest nor a model config.json"
        )
    raise CheckpointError(
        f"{path}: not a checkpoint directory, .safetensors shard, manifest or config.json"
    )
