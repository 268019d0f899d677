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
  device with transformers: an estimate, labelled so.

Byte sizes come from the header's ``data_offsets`` where there is a header, and from shape
and dtype otherwise; the two are checked against each other so a corrupt header is caught
here and not in the middle of a vLLM load.

The package, one job per module (imports run down this list, never up)::

    load.py         load_checkpoint: which reader a path or hub id needs (the only dispatcher)
    hub.py          a hub id: the local cache, else headers over HTTP (huggingface_hub)
    from_config.py  a config alone: the model built on the meta device (transformers)
    manifest.py     read and write manifests
    headers.py      safetensors shard headers: entries, spans, directories and indexes
    base.py         Checkpoint, the JSON reader and require_complete that all sources share
    facts.py        ModelFacts: the config facts the planner uses

The tensor facts (dtype bits, :class:`TensorInfo`, :func:`tensor_nbytes`) live in
:mod:`selective_offload.tensors`, shared with :mod:`selective_offload.quantization`, and are
re-exported here.
"""

from __future__ import annotations

from ..tensors import DTYPE_BITS, MAX_DIM, TensorInfo, check_shape, tensor_nbytes
from .base import Checkpoint, read_json, require_complete
from .facts import ModelFacts
from .from_config import manifest_from_config
from .headers import INDEX_NAME, MAX_HEADER_BYTES, check_spans, read_shard_header
from .hub import hub_checkpoint, parse_hub_id
from .load import load_checkpoint
from .manifest import manifest_text, read_manifest, write_manifest

__all__ = [
    "DTYPE_BITS", "INDEX_NAME", "MAX_DIM", "MAX_HEADER_BYTES", "Checkpoint", "ModelFacts", "TensorInfo",
    "check_shape", "check_spans", "hub_checkpoint", "load_checkpoint", "manifest_from_config", "parse_hub_id",
    "read_json", "read_manifest", "read_shard_header", "require_complete", "tensor_nbytes", "write_manifest",
    "manifest_text",
]
