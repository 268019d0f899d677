"""Manifests: a checkpoint's tensor list (name -> shape and dtype) and config as one JSON file.

A manifest lets a model be planned without any weights: :func:`write_manifest` writes one
from any :class:`~.base.Checkpoint` (``selective-offload manifest``), or it is written by
hand. Reading one checks each entry as a header entry is checked (a dtype safetensors
knows, a shape of whole numbers) and computes the byte sizes from shape and dtype, since a
manifest has no data offsets.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..errors import CheckpointError
from ..tensors import TensorInfo, check_shape, tensor_nbytes
from .base import MANIFEST_FORMAT, Checkpoint, read_json


def read_manifest(path: str | os.PathLike) -> Checkpoint:
    path = Path(path)
    data = read_json(path, "the manifest")
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


def manifest_text(checkpoint: Checkpoint) -> str:
    """The manifest of ``checkpoint`` as the file holds it."""
    return json.dumps(checkpoint.to_manifest(), indent=1) + "\n"


def write_manifest(checkpoint: Checkpoint, path: str | os.PathLike) -> None:
    """Write the manifest to ``path`` by the rule every output follows (:mod:`..outputs`):
    never over a file that is not a manifest this project wrote, and whole or not at all."""
    from ..outputs import write_files

    write_files([("manifest", path, manifest_text(checkpoint).encode(), "manifest")])
