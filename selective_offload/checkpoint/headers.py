"""Safetensors shards read by their headers alone: a directory, an index, one shard.

The planner needs each tensor's name and byte size, which a shard's header holds (8 bytes
of length and a few KB of JSON); tensor data is never read, so a large checkpoint is read
in milliseconds and shards whose data has not been downloaded yet still plan (they are
recorded as incomplete: fine to plan, not to load). Every header entry is checked as
safetensors checks it (typed fields, whole bytes, a byte span that matches the shape and
dtype, spans that tile the data with no gap or overlap), so a corrupt shard is refused
here, naming the file, and not in the middle of a vLLM load. The hub reader (:mod:`.hub`)
fetches bytes and hands them here: :func:`check_header_length`, :func:`parse_header`,
:func:`index_weight_map` and :func:`collect_shards` are the one set of rules for a header
and an index, whether they came from disk or over HTTP.
"""

from __future__ import annotations

import math
import os
import struct
from pathlib import Path
from typing import Any, Iterable

from .. import jsonio
from ..errors import CheckpointError, cut
from ..tensors import DTYPE_BITS, MAX_DIM, TensorInfo, check_shape, tensor_nbytes
from .base import Checkpoint, read_json

INDEX_NAME = "model.safetensors.index.json"
#: A header larger than this is not a safetensors header (the format caps it at 100 MB).
MAX_HEADER_BYTES = 100_000_000


def check_header_length(header_len: int, size: int | None, where: str) -> None:
    """The length prefix of a shard's header, read from disk or over HTTP, within the format's
    bound and inside the file (``size`` is ``None`` when a server does not say it)."""
    if header_len > MAX_HEADER_BYTES:
        raise CheckpointError(f"{where}header length {header_len} is more than the {MAX_HEADER_BYTES} bytes a "
                              "safetensors header may hold; the shard is corrupt or not safetensors: fetch it again")
    if size is not None and 8 + header_len > size:
        raise CheckpointError(
            f"{where}header length {header_len} runs past the end of the "
            f"{size}-byte file; the shard is truncated or not safetensors: fetch it again"
        )


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
            check_header_length(header_len, size, where)
            return f.read(header_len), header_len, size
    except OSError as exc:
        raise CheckpointError(f"{where}cannot read: {exc.strerror or exc}") from None


def tensor_entry(name: str, entry: Any, where: str, path: Path) -> tuple[TensorInfo, int, int]:
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
    raw, header_len, size = _read_header_bytes(path)
    return parse_header(raw, header_len, size, f"{path}: ", path)


def parse_header(raw: bytes, header_len: int, size: int | None, where: str,
                 path: Path) -> tuple[dict[str, TensorInfo], bool]:
    """A shard's JSON header bytes (``header_len`` of them, read from disk or over HTTP) as its
    tensors, and whether the ``size``-byte file holds all their data (``None``: not known, as
    from a server that does not say). The one parser of a header, whatever it came from, so
    a hostile hub answer is refused as a corrupt local shard is. ``path`` is what each
    :class:`TensorInfo` names as its shard."""
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
            tensors[name], begin, end = tensor_entry(name, entry, where, path)
            spans.append((begin, end, name))
    data_end = check_spans(spans, where)
    if size is None:
        return tensors, True
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
        if begin != start:
            what = (f"overlaps {previous!r}, which ends at {start}" if begin < start and previous is not None
                    else f"leaves a gap: the data before it ends at {start}")
            raise CheckpointError(f"{where}tensor {name[:80]!r} at [{begin}, {end}] {what}; safetensors refuses "
                                  "tensors that do not follow each other; the shard is corrupt: fetch it again")
        start, previous = end, name
    return start


def shard_name_problem(name: object) -> str | None:
    """What is wrong with a shard name from an index (a local one or the hub's), or ``None``.
    A shard is a file of the checkpoint itself: a relative path inside it, with no ``..``
    segment, no empty or absolute part and no backslash, ending in ``.safetensors``; an entry
    that climbs out would plan another checkpoint's header, which vLLM never loads."""
    if not isinstance(name, str) or not name:
        return "a shard name that is not a non-empty string"
    shown = cut(repr(name), 84)
    parts = name.split("/")
    if name.startswith("/") or "\\" in name or any(p in ("", ".", "..") for p in parts):
        return f"shard {shown} is not a file inside the checkpoint (absolute, '..', '.', empty part or backslash)"
    if not name.endswith(".safetensors"):
        return f"shard {shown} is not a .safetensors file"
    return None


def index_weight_map(index: Any, where: str) -> dict[str, str]:
    """The ``weight_map`` of a parsed shard index (a local file's or the hub's), every entry a
    shard inside the checkpoint (:func:`shard_name_problem`); ``where`` names the index."""
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{where}: has no 'weight_map' object; fix or re-fetch it")
    for value in weight_map.values():
        problem = shard_name_problem(value)
        if problem:
            raise CheckpointError(f"{where}: maps a tensor to {problem}; fix or re-fetch the index")
    return weight_map


def collect_shards(shards: Iterable[tuple[str, str, dict[str, TensorInfo], bool]],
                   weight_map: dict[str, str] | None, index_where: str) -> tuple[dict[str, TensorInfo], list[str]]:
    """Every shard's tensors (each shard as its name in the checkpoint, as messages name it,
    its tensors and whether its data is all there) as one map, and the incomplete shards, with the checks every
    reader of shards applies, on disk or on the hub: no tensor in two shards, and an index
    (``weight_map``, or ``None``) that maps each tensor to the shard that holds it."""
    tensors: dict[str, TensorInfo] = {}
    holder: dict[str, str] = {}
    incomplete: list[str] = []
    for shard, shown, shard_tensors, complete in shards:
        for name, info in shard_tensors.items():
            if name in tensors:
                raise CheckpointError(
                    f"{shown}: tensor {name[:80]!r} is also in {tensors[name].shard}; "
                    "the checkpoint mixes two downloads: remove the stray shard"
                )
            tensors[name], holder[name] = info, shard
        if not complete:
            incomplete.append(shown)
    if weight_map is not None:
        for name, shard_name in weight_map.items():
            if holder.get(name) != shard_name:
                raise CheckpointError(
                    f"{index_where}: maps {name[:80]!r} to {shard_name[:80]}, but that shard's header "
                    "does not hold it; the index and shards disagree: re-fetch them"
                )
    return tensors, incomplete


def read_safetensors_dir(directory: str | os.PathLike) -> Checkpoint:
    """Read every shard header of a checkpoint directory, and its ``config.json``."""
    directory = Path(directory)
    index_path = directory / INDEX_NAME
    weight_map: dict[str, str] | None = None
    if index_path.is_file():
        weight_map = index_weight_map(read_json(index_path, "the shard index"), str(index_path))
        shard_names = sorted(set(weight_map.values()))
        missing = [s for s in shard_names if not (directory / s).is_file()]
        if missing:
            raise CheckpointError(
                f"{index_path}: names {len(missing)} shard(s) that are not in {directory} "
                f"(first: {missing[0]}); finish the download"
            )
    else:
        shard_names = sorted(p.name for p in directory.glob("*.safetensors"))
    if not shard_names:
        raise CheckpointError(
            f"{directory}: no *.safetensors shards here; point at a checkpoint directory, "
            "a manifest (.json) or a config.json"
        )
    shards = ((s, str(directory / s), *read_shard_header(directory / s)) for s in shard_names)
    tensors, incomplete = collect_shards(shards, weight_map, str(index_path))
    config_path = directory / "config.json"
    config = read_json(config_path, "config.json") if config_path.is_file() else {}
    return Checkpoint(str(directory), "safetensors", tensors, config, incomplete)


def read_safetensors_file(path: str | os.PathLike) -> Checkpoint:
    """Read one ``.safetensors`` shard given by itself, and the ``config.json`` beside it."""
    path = Path(path)
    tensors, complete = read_shard_header(path)
    config_path = path.parent / "config.json"
    config = read_json(config_path, "config.json") if config_path.is_file() else {}
    return Checkpoint(str(path), "safetensors", tensors, config, [] if complete else [str(path)])
