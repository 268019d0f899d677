"""What every checkpoint source gives: a :class:`Checkpoint`, and the checks all sources share.

A :class:`Checkpoint` is every tensor's name, dtype, shape and byte size plus the raw
config, whichever reader made it (:mod:`.headers` for safetensors shards and hub headers,
:mod:`.manifest` for a manifest, :mod:`.from_config` for a config alone). It lives apart
from the readers so that each reader imports it and none imports another reader for it.
:func:`read_json` is the one way the readers open a JSON file (an unreadable or invalid
file is a :class:`CheckpointError` naming it), :func:`parse_json` its twin for fetched bytes; :func:`require_complete` is what the engine
side asks before loading.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import jsonio
from ..errors import CheckpointError
from ..tensors import TensorInfo
from .facts import ModelFacts

MANIFEST_FORMAT = "selective-offload/manifest-v1"


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


def read_json(path: Path, what: str) -> Any:
    try:
        return jsonio.read(path)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read {what}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise CheckpointError(f"{path}: {what} is not valid JSON ({exc}); fix or re-fetch it") from None


def parse_json(raw: bytes, where: str, what: str) -> Any:
    """:func:`read_json` for bytes already fetched (a hub answer), by the same bounded parser
    and with the same message; ``where`` names where they came from."""
    try:
        return jsonio.parse(raw)
    except ValueError as exc:
        raise CheckpointError(f"{where}: {what} is not valid JSON ({exc}); fix or re-fetch it") from None


def require_complete(checkpoint: Checkpoint) -> None:
    """Refuse to load a checkpoint whose shards hold less data than their headers say
    (truncated, or still downloading): fine to plan, not to run."""
    if checkpoint.incomplete_shards:
        raise CheckpointError(
            f"{checkpoint.incomplete_shards[0]}: the shard is shorter than its header says"
            + (f" (and {len(checkpoint.incomplete_shards) - 1} more shards)" if len(checkpoint.incomplete_shards) > 1
               else "") + ", so vLLM cannot load it; finish the download or fetch the shard again")
