"""A Hugging Face hub id (``ORG/NAME[@REVISION]``) as a checkpoint, without its weights.

vLLM users name models by hub id, and planning needs only what the safetensors headers
and ``config.json`` say, which the hub serves before any weight is downloaded. So:

* when the snapshot is in the local Hugging Face cache with every shard, its headers are
  read from disk, as for any checkpoint directory;
* otherwise ``huggingface_hub.get_safetensors_metadata`` reads each shard's header with
  HTTP range requests (its first request asks for the first 100 kB of a shard, a second
  one only when the header is larger), and ``config.json`` (and the shard index) are
  downloaded into the cache, a few kB each. A repository without safetensors is planned
  from its ``config.json`` alone (an estimate, labelled so).

``huggingface_hub`` does the talking, so ``HF_ENDPOINT``, ``HF_TOKEN``, ``HF_HUB_CACHE``
and ``HF_HUB_OFFLINE`` mean what they mean for vLLM and transformers. Offline and not
cached is one line saying so. ``huggingface_hub`` is imported only for a hub id: the core
stays usable on checkpoints without it and without touching the network. The shard
headers are checked by :func:`.headers.tensor_entry`, as a local shard's are; the source
dispatcher (:mod:`.load`) calls :func:`hub_checkpoint` when a path does not exist.
"""

from __future__ import annotations

import contextlib
import logging
import re
from pathlib import Path

from ..errors import CheckpointError
from ..tensors import TensorInfo
from .base import Checkpoint, read_json
from .from_config import manifest_from_config
from .headers import INDEX_NAME, read_safetensors_dir, shard_name_problem, tensor_entry

SINGLE_FILE = "model.safetensors"
#: ``ORG/NAME`` or ``ORG/NAME@REVISION`` as the hub spells them (no leading dot or slash,
#: exactly one slash in the id): anything else is a path.
_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<rev>[\w./-]+))?$")


def parse_hub_id(text: str) -> tuple[str, str | None] | None:
    """``(repo_id, revision)`` when ``text`` reads as a hub id, else ``None``."""
    m = _HUB_ID.match(text)
    if m is None or m.group("repo").endswith((".json", ".safetensors")):
        return None
    return m.group("repo"), m.group("rev")


def hub_checkpoint(text: str) -> Checkpoint | None:
    """The checkpoint a hub id names, or ``None`` when ``text`` is not a hub id."""
    parsed = parse_hub_id(text)
    if parsed is None:
        return None
    try:
        import huggingface_hub  # noqa: F401
    except ImportError:
        raise CheckpointError(f"{text}: no such file or directory, and reading it as a Hugging Face hub id needs "
                              "huggingface_hub (pip install huggingface_hub)") from None
    repo_id, revision = parsed
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        # mutation: hub-id-unvalidated
        validate_repo_id(repo_id)
    except HFValidationError as exc:
        raise CheckpointError(f"{text[:120]}: no such file or directory, and not a hub id huggingface_hub accepts "
                              f"({' '.join(str(exc).split())[:200]})") from None
    cached = cached_snapshot(repo_id, revision)
    if cached is not None:
        return read_safetensors_dir(cached)
    return remote_checkpoint(repo_id, revision)


def _label(repo_id: str, revision: str | None) -> str:
    return repo_id + (f"@{revision}" if revision else "")


def cached_snapshot(repo_id: str, revision: str | None) -> Path | None:
    """The cached snapshot directory of ``repo_id`` at ``revision`` when it holds the config
    and every safetensors shard; ``None`` otherwise (a cache with only the config and the
    index, as a header-only read leaves it, is not a checkpoint to read)."""
    from huggingface_hub import try_to_load_from_cache

    config = try_to_load_from_cache(repo_id, "config.json", revision=revision)
    if not isinstance(config, str):
        return None
    snapshot = Path(config).parent
    if (snapshot / INDEX_NAME).is_file():
        index = read_json(snapshot / INDEX_NAME, "the shard index")
        shards = set((index.get("weight_map") or {}).values()) if isinstance(index, dict) else set()
        # mutation: hub-partial-cache-read
        return snapshot if shards and all((snapshot / s).is_file() for s in shards) else None
    return snapshot if (snapshot / SINGLE_FILE).is_file() else None


def remote_checkpoint(repo_id: str, revision: str | None) -> Checkpoint:
    """Headers over HTTP range requests, ``config.json`` downloaded into the cache."""
    from huggingface_hub import constants, get_safetensors_metadata, hf_hub_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        NotASafetensorsRepoError,
        OfflineModeIsEnabled,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
        SafetensorsParsingError,
    )

    label = _label(repo_id, revision)
    # mutation: hub-offline-not-checked
    if constants.is_offline_mode():
        raise CheckpointError(f"{label}: not in the local Hugging Face cache ({constants.HF_HUB_CACHE}) with its "
                              "config.json and every safetensors shard, and HF_HUB_OFFLINE is set; unset it to read "
                              "the headers from the hub, or download the model first")
    try:
        with _quiet_retries():
            try:
                config_path = hf_hub_download(repo_id, "config.json", revision=revision)
            except RemoteEntryNotFoundError:
                raise CheckpointError(f"{label}: the repository has no config.json, so it is not a transformers "
                                      "model vLLM can load") from None
            try:
                meta = get_safetensors_metadata(repo_id, revision=revision)
            except NotASafetensorsRepoError:
                return manifest_from_config(config_path)
    except GatedRepoError:
        raise CheckpointError(f"{label}: the model is gated; accept its terms on the hub and set HF_TOKEN "
                              "(or run `hf auth login`)") from None
    except RevisionNotFoundError:
        raise CheckpointError(f"{label}: no revision {revision!r} in {repo_id} on {constants.ENDPOINT}") from None
    except RepositoryNotFoundError:
        raise CheckpointError(f"{label}: no such model on {constants.ENDPOINT} (or it is private: set HF_TOKEN), "
                              "and no such file or directory here") from None
    except SafetensorsParsingError as exc:
        raise CheckpointError(f"{label}: a shard header on the hub is not valid safetensors ({exc})") from None
    except OfflineModeIsEnabled:
        raise CheckpointError(f"{label}: not in the local Hugging Face cache and HF_HUB_OFFLINE is set") from None
    except Exception as exc:  # httpx's transport errors are not OSErrors
        transport = type(exc).__module__.startswith(("httpx", "httpcore"))
        if not isinstance(exc, (HfHubHTTPError, OSError)) and not transport:
            raise
        raise CheckpointError(f"{label}: cannot read it from {constants.ENDPOINT} ({_root_cause(exc)}); check the "
                              "network or HF_ENDPOINT, or set HF_HUB_OFFLINE=1 to use only the cache") from None

    tensors: dict[str, TensorInfo] = {}
    for filename in sorted(meta.files_metadata):
        problem = shard_name_problem(filename)
        if problem:
            raise CheckpointError(f"{label}: the repository's shard index names {problem}; vLLM could not load it")
        where = f"{label}/{filename}: "
        for name, info in meta.files_metadata[filename].tensors.items():
            if name in tensors:
                raise CheckpointError(f"{where}tensor {name!r} is also in {tensors[name].shard}; the repository "
                                      "mixes two checkpoints")
            # As a shard's JSON header holds them (lists), so the same checks apply.
            entry = {"dtype": info.dtype, "shape": list(info.shape), "data_offsets": list(info.data_offsets)}
            tensors[name], _, _ = tensor_entry(name, entry, where, Path(filename))
    config = read_json(Path(config_path), "config.json")
    # Kind "hub": the plan records that its model is named by hub id (vLLM downloads it), not
    # a local directory that may be missing from where the plan is used.
    # mutation: hub-kind-safetensors
    return Checkpoint(label, "hub", tensors, config if isinstance(config, dict) else {})


def _root_cause(exc: BaseException) -> str:
    """The first line of the innermost cause (``[Errno 111] Connection refused``), not the
    wrapper's paragraph."""
    while (exc.__cause__ or exc.__context__) is not None:
        exc = exc.__cause__ or exc.__context__
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


@contextlib.contextmanager
def _quiet_retries():
    """huggingface_hub logs a warning per retry and draws a progress bar per file list; the
    outcome is what the user needs (one line, and the CLI's own progress lines on a long
    read), so both are held back while it works."""
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars
    from huggingface_hub.utils import logging as hub_logging

    logger = hub_logging.get_logger("huggingface_hub")
    level = logger.level
    bars_were_off = are_progress_bars_disabled()
    logger.setLevel(logging.ERROR)
    disable_progress_bars()
    try:
        yield
    finally:
        logger.setLevel(level)
        if not bars_were_off:
            enable_progress_bars()
