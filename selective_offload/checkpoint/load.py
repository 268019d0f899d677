"""The one entry point for a model's tensors: :func:`load_checkpoint` picks the reader for a source.

A user names a model as a directory of shards, one shard, a manifest, a ``config.json``
or a Hugging Face hub id; this module decides which it is and hands it to the reader that
knows it (:mod:`.headers`, :mod:`.manifest`, :mod:`.from_config`, :mod:`.hub`). It only
dispatches: the readers never import it, so the imports run one way (load -> readers ->
base -> facts). The hub reader touches the network only for a path that does not exist and
reads as a hub id.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import CheckpointError
from .base import MANIFEST_FORMAT, Checkpoint, read_json
from .from_config import manifest_from_config
from .headers import read_safetensors_dir, read_safetensors_file
from .hub import hub_checkpoint
from .manifest import read_manifest


def load_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Read whatever ``path`` is: a shard directory, a single shard, a manifest, a config,
    or (when no such path exists) a Hugging Face hub id ``ORG/NAME[@REVISION]``."""
    if not Path(path).exists():
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
        return read_safetensors_file(path)
    if path.suffix == ".json":
        data = read_json(path, "the file")
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
