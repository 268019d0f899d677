"""A Hugging Face hub id (``ORG/NAME[@REVISION]``) as a checkpoint, without its weights.

vLLM users name models by hub id, and planning needs only what the safetensors headers
and ``config.json`` say, which the hub serves before any weight is downloaded. So:

* when the snapshot is in the local Hugging Face cache with every shard, its headers are
  read from disk, as for any checkpoint directory;
* otherwise ``config.json`` and the shard index are fetched (a few kB each), and each
  shard's header is read with HTTP range requests: a first one for the first 100 kB, a
  second only when the header is larger. A repository without safetensors is planned from
  its ``config.json`` alone (an estimate, labelled so).

What the hub sends is input like any other: the bytes are parsed by the readers a local
checkpoint goes through (:func:`.headers.parse_header`, :func:`.headers.index_weight_map`,
:func:`.base.parse_json`: bounded size, depth and integers, typed entries, shards confined
to the repository), never trusted because a library parsed them. Each read is bounded in
bytes (a server that ignores a range is read only as far as the header) and in wall-clock
time (:data:`HEADER_DEADLINE_S`, :data:`FILE_DEADLINE_S`), and every failure is one line
naming the server and the file.

huggingface_hub builds the URLs, the auth headers and the HTTP session, so ``HF_ENDPOINT``,
``HF_TOKEN``, ``HF_HUB_CACHE`` and ``HF_HUB_OFFLINE`` mean what they mean for vLLM and
transformers (``HF_HUB_DOWNLOAD_TIMEOUT`` bounds each wait of the socket). Nothing is
written to the cache: the headers are read each time, the weights are vLLM's to download.
Offline and not cached is one line saying so. ``huggingface_hub`` is imported only for a
hub id: the core stays usable on checkpoints without it and without touching the network.
The source dispatcher (:mod:`.load`) calls :func:`hub_checkpoint` when a path does not
exist.
"""

from __future__ import annotations

import re
import struct
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from .. import jsonio
from ..errors import CheckpointError, cut
from ..tensors import TensorInfo
from .base import Checkpoint, parse_json, read_json
from .from_config import manifest_from_config
from .headers import (
    INDEX_NAME,
    check_header_length,
    collect_shards,
    index_weight_map,
    parse_header,
    read_safetensors_dir,
)

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
        where = f"{_label(repo_id, revision)}: the cached {INDEX_NAME} ({cut(str(snapshot / INDEX_NAME), 200)})"
        index = index_weight_map(read_json(snapshot / INDEX_NAME, "the shard index"), where)
        shards = set(index.values())
        return snapshot if shards and all((snapshot / s).is_file() for s in shards) else None
    return snapshot if (snapshot / SINGLE_FILE).is_file() else None


#: Wall-clock seconds for one shard's header, both its range requests together. Header
#: reads are a few kB to a few MB, so a server still sending after this is stalled or
#: dripping (each read's own timeout, ``HF_HUB_DOWNLOAD_TIMEOUT``, never fires on a byte
#: every few seconds); :meth:`_HubFiles.read` stops there (past it by at most one wait of
#: the socket) and says so in one line.
HEADER_DEADLINE_S = 60.0
#: Wall-clock seconds for ``config.json`` or the shard index, each a few kB.
FILE_DEADLINE_S = 60.0
#: The first range request of a shard asks for this many bytes, as huggingface_hub's own
#: header reader does: most headers fit, so one request reads them; a larger one takes a
#: second request for the rest.
FIRST_READ = 100_000


class _HubFiles:
    """Bytes of one repository's files over HTTP, each read bounded in bytes and in time.

    huggingface_hub builds the URL (``HF_ENDPOINT``), the headers (``HF_TOKEN`` or the
    stored login) and the session (its proxies and certificates); the bytes are read here,
    streamed and stopped at what was asked for, so a server that ignores a range request
    (``200`` and the whole file) costs the header's bytes and no more, and a server that
    drips them fails at the deadline, not when it pleases. What the bytes mean is left to
    :mod:`.headers` and :mod:`.base`, the readers a local checkpoint goes through.
    """

    def __init__(self, repo_id: str, revision: str | None) -> None:
        from huggingface_hub import constants
        from huggingface_hub.utils import build_hf_headers, get_session

        self.repo_id, self.label = repo_id, _label(repo_id, revision)
        self.revision = revision or constants.DEFAULT_REVISION
        self.endpoint = constants.ENDPOINT
        self.session = get_session()
        # Raw bytes: a compressed answer could inflate past any bound while it is decoded.
        self.headers = {**build_hf_headers(), "Accept-Encoding": "identity"}
        self.read_timeout = float(constants.HF_HUB_DOWNLOAD_TIMEOUT)
        #: The commit the hub's first answer names (``X-Repo-Commit``), for :meth:`pin`.
        self.commit: str | None = None

    def url(self, filename: str) -> str:
        from huggingface_hub import hf_hub_url

        return hf_hub_url(self.repo_id, filename, revision=self.revision)

    def read(self, filename: str, start: int, stop: int | None, deadline: float, budget_s: float,
             what: str, enough: Callable[[bytes], int | None] | None = None) -> tuple[bytes, int | None] | None:
        """Bytes ``[start, stop)`` of ``filename`` (``stop=None``: the whole file, at most
        :data:`..jsonio.MAX_FILE_BYTES`) and the file's size when the server says it;
        ``None`` when the repository has no such file. ``deadline`` is a ``time.monotonic()``
        (``budget_s`` the deadline a message names, ``what`` the read): it is checked after
        every chunk, and each wait of the socket is at most ``HF_HUB_DOWNLOAD_TIMEOUT`` and
        at most what was left of the deadline when the request began, so a dripping or
        silent server is stopped by the deadline plus at most one such wait. ``enough``: given
        the bytes read so far of an answer that is the whole file (``200``: the server
        ignored the range), how many of the file's first bytes are needed once it can tell
        (a header's length prefix): the answer is closed there, not read to ``stop``."""
        limit = (stop - start) if stop is not None else jsonio.MAX_FILE_BYTES + 1
        headers = dict(self.headers)
        if stop is not None:
            headers["Range"] = f"bytes={start}-{stop - 1}"
        url = self.url(filename)
        server = _server(url)
        try:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            with self.session.stream("GET", url, headers=headers,
                                     timeout=min(self.read_timeout, left)) as response:
                server = _server(str(response.url))
                self.commit = self.commit or response.headers.get("X-Repo-Commit")
                if not self._found(response, filename, server):
                    return None
                encoding = response.headers.get("Content-Encoding", "identity").strip().lower()
                if encoding not in ("", "identity"):
                    raise CheckpointError(f"{self.label}: {server} sent {filename} encoded as {cut(encoding, 40)!r} "
                                          "although it was asked for the plain bytes; check HF_ENDPOINT or the proxy")
                skip, size = self._placed(response, start, stop, filename, server)
                whole = stop is not None and response.status_code != 206 and enough is not None
                data, head, wanted = bytearray(), bytearray(), limit
                for chunk in response.iter_raw():
                    if whole and len(head) < 8 + start:  # the file from byte 0: its prefix says where the header ends
                        head += chunk[:8 + start - len(head)]
                        needed = enough(bytes(head[:8])) if len(head) >= 8 else None
                        if needed is not None:
                            wanted = max(0, min(limit, needed - start))
                    if skip:
                        taken = min(skip, len(chunk))
                        chunk, skip = chunk[taken:], skip - taken
                    data += chunk[:wanted - len(data)]
                    if len(data) >= wanted:
                        break
                    if time.monotonic() > deadline:
                        raise TimeoutError
        except TimeoutError:
            raise CheckpointError(self._too_slow(server, filename, what, budget_s)) from None
        except CheckpointError:
            raise
        except Exception as exc:  # httpx's transport errors are not OSErrors
            if "timeout" in type(exc).__name__.lower() and time.monotonic() >= deadline - 0.05:
                raise CheckpointError(self._too_slow(server, filename, what, budget_s)) from None
            if not _transport_error(exc):
                raise
            raise CheckpointError(f"{self.label}: cannot read {filename} from {server} ({cut(_root_cause(exc), 200)}); "
                                  "check the network or HF_ENDPOINT, or set HF_HUB_OFFLINE=1 to use only the cache"
                                  ) from None
        if stop is None and len(data) > jsonio.MAX_FILE_BYTES:
            raise CheckpointError(f"{self.label}: {server} sent more than {jsonio.MAX_FILE_BYTES} bytes of {filename}, "
                                  f"which is not {what}; check HF_ENDPOINT")
        return bytes(data), size

    def _too_slow(self, server: str, filename: str, what: str, budget_s: float) -> str:
        return (f"{self.label}: {server} did not send {what} of {filename} within {budget_s:g} s (the deadline "
                "for it); the server is stalled or too slow: retry later, or check the network or HF_ENDPOINT")

    def _found(self, response: Any, filename: str, server: str) -> bool:
        """Whether the answer holds the file (``False``: the repository has no such file);
        the hub's other refusals, by its ``X-Error-Code``, as one line each."""
        status, code = response.status_code, response.headers.get("X-Error-Code", "")
        if status in (200, 206):
            return True
        if code == "GatedRepo":
            raise CheckpointError(f"{self.label}: the model is gated; accept its terms on the hub and set HF_TOKEN "
                                  "(or run `hf auth login`)")
        if code == "RevisionNotFound":
            raise CheckpointError(f"{self.label}: no revision {self.revision[:80]!r} in {self.repo_id} on "
                                  f"{self.endpoint}")
        if code == "RepoNotFound" or status == 401:
            raise CheckpointError(f"{self.label}: no such model on {self.endpoint} (or it is private: set HF_TOKEN), "
                                  "and no such file or directory here")
        if status == 404:
            return False
        raise CheckpointError(f"{self.label}: {server} answered HTTP {status} for {filename}; check HF_ENDPOINT, "
                              "HF_TOKEN or the network, or retry later")

    def _placed(self, response: Any, start: int, stop: int | None, filename: str,
                server: str) -> tuple[int, int | None]:
        """How many leading bytes of the body come before ``start``, and the file's size when
        the answer says it: a ``206`` must start where asked; a ``200`` is the file from its
        first byte (a server that ignores ranges), read only as far as asked."""
        if stop is not None and response.status_code == 206:
            m = re.fullmatch(r"bytes (\d{1,20})-(\d{1,20})/(\d{1,20}|\*)",
                             response.headers.get("Content-Range", "").strip())
            if m is None or int(m.group(1)) != start:
                raise CheckpointError(f"{self.label}: {server} answered the range request for bytes {start}- of "
                                      f"{filename} with Content-Range "
                                      f"{cut(response.headers.get('Content-Range', ''), 60)!r}; check HF_ENDPOINT")
            return 0, None if m.group(3) == "*" else int(m.group(3))
        length = response.headers.get("Content-Length", "").strip()
        return start, int(length) if length.isdigit() and len(length) <= 20 else None

    def header(self, filename: str) -> tuple[dict[str, TensorInfo], bool] | None:
        """One shard's tensors, read by range requests of its first bytes (the length prefix and
        the header, never past them) and parsed by :func:`.headers.parse_header`; ``None``
        when the repository has no such shard."""
        where = f"{self.label}/{filename}: "
        deadline = time.monotonic() + HEADER_DEADLINE_S
        got = self.read(filename, 0, FIRST_READ, deadline, HEADER_DEADLINE_S, "the header", _header_end)
        if got is None:
            return None
        head, size = got
        if len(head) < 8:
            raise CheckpointError(f"{where}the hub sent {len(head)} bytes, too short for a safetensors header; "
                                  "the shard on the hub is not safetensors")
        (header_len,) = struct.unpack("<Q", head[:8])
        check_header_length(header_len, size, where)
        if 8 + header_len > len(head):
            rest = self.read(filename, len(head), 8 + header_len, deadline, HEADER_DEADLINE_S, "the header",
                             _header_end)
            head += rest[0] if rest is not None else b""
        if len(head) < 8 + header_len:
            raise CheckpointError(f"{where}the hub sent {len(head)} bytes, fewer than the {header_len}-byte header "
                                  "its length prefix names; the shard on the hub is truncated")
        return parse_header(head[8:8 + header_len], header_len, size, where, Path(filename))

    def pin(self, revision: str | None) -> None:
        """Read the remaining files at ``revision`` (the commit the first answer named), so the
        headers are those of the config's commit even when a branch moves meanwhile."""
        if revision and re.fullmatch(r"[0-9a-f]{40}", revision):
            self.revision = revision


def _header_end(prefix: bytes) -> int:
    """Where a safetensors header ends, from the file's first 8 bytes (its length prefix)."""
    return 8 + struct.unpack("<Q", prefix[:8])[0]


def _server(url: str) -> str:
    """The scheme, host and port of ``url``: the server a message names."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    return cut(f"{parts.scheme}://{parts.netloc}", 120)


def _transport_error(exc: BaseException) -> bool:
    from huggingface_hub.errors import OfflineModeIsEnabled

    return isinstance(exc, (OSError, OfflineModeIsEnabled)) or type(exc).__module__.startswith(("httpx", "httpcore"))


def remote_checkpoint(repo_id: str, revision: str | None) -> Checkpoint:
    """``config.json`` and the shard index fetched, each shard's header by range requests,
    all parsed by the readers a local checkpoint goes through."""
    from huggingface_hub import constants

    label = _label(repo_id, revision)
    if constants.is_offline_mode():
        raise CheckpointError(f"{label}: not in the local Hugging Face cache ({constants.HF_HUB_CACHE}) with its "
                              "config.json and every safetensors shard, and HF_HUB_OFFLINE is set; unset it to read "
                              "the headers from the hub, or download the model first")
    files = _HubFiles(repo_id, revision)
    got = files.read("config.json", 0, None, time.monotonic() + FILE_DEADLINE_S, FILE_DEADLINE_S, "config.json")
    if got is None:
        raise CheckpointError(f"{label}: the repository has no config.json, so it is not a transformers "
                              "model vLLM can load")
    config = parse_json(got[0], f"{label}/config.json", "config.json")
    if not isinstance(config, dict):
        raise CheckpointError(f"{label}/config.json: config.json is not a JSON object")
    files.pin(files.commit)
    got = files.read(INDEX_NAME, 0, None, time.monotonic() + FILE_DEADLINE_S, FILE_DEADLINE_S, "the shard index")
    weight_map = None if got is None else index_weight_map(
        parse_json(got[0], f"{label}/{INDEX_NAME}", "the shard index"), f"{label}/{INDEX_NAME}")
    names = sorted(set(weight_map.values())) if weight_map is not None else [SINGLE_FILE]
    shards = []
    for name in names:
        header = files.header(name)
        if header is None:
            if weight_map is None:  # neither an index nor model.safetensors: an estimate from the config
                return replace(manifest_from_config(f"{label}/config.json", config), source=label)
            raise CheckpointError(f"{label}/{INDEX_NAME}: names shard {cut(name, 80)!r}, which the repository does "
                                  "not have; the repository is incomplete")
        shards.append((name, f"{label}/{name}", *header))
    tensors, incomplete = collect_shards(shards, weight_map, f"{label}/{INDEX_NAME}")
    if incomplete:
        raise CheckpointError(f"{incomplete[0]}: the shard on the hub is shorter than its header says, so vLLM "
                              "could not load it; the repository is corrupt")
    # Kind "hub": the plan records that its model is named by hub id (vLLM downloads it), not
    # a local directory that may be missing from where the plan is used.
    return Checkpoint(label, "hub", tensors, config)


def _root_cause(exc: BaseException) -> str:
    """The first line of the innermost cause (``[Errno 111] Connection refused``), not the
    wrapper's paragraph."""
    while (exc.__cause__ or exc.__context__) is not None:
        exc = exc.__cause__ or exc.__context__
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
