"""Every file selective-offload writes for the user, under one rule: a plan (``plan -o``,
``Plan.save``), a manifest, a picture (``--png`` / ``--svg``), a probe profile, a placement
report and the last-report record all go through :func:`resolve_outputs` and
:func:`write_outputs` (the set-up script's log keeps the same rule in shell, and the kernel
cache has its own).

* **Resolved once, before any work.** Each path is made absolute with its links and
  ``..`` resolved, and that resolved path is the one checked, tried and written. Two names
  for one file (``-o sub/../same.svg --svg same.svg``, a link, a hard link) are refused
  before anything is read or planned.
* **Never a file it did not write.** An existing target is replaced only when it is a file
  of the same kind this project wrote, recognised by its own mark: a JSON file's
  ``format`` (``selective-offload/plan-v5``, ``.../manifest-v1``, ``.../profile-v1``,
  ``.../report-v3``), a picture's metadata (:data:`PICTURE_MARK`), the record's one
  absolute path. An empty file holds nothing and may be replaced. Anything else (the
  model's ``config.json``, a weight shard, the user's notes, a directory, a device, a pipe)
  is refused in one line naming the flag and the path as given.
* **Never inside the checkpoint being planned.** ``plan`` and ``manifest`` refuse an output
  inside the model's directory (the directory named, that of a shard or of a
  ``config.json`` beside shards, the hub cache's folder of a hub id): vLLM reads every file
  there as the model's.
* **Tried for real, written whole.** A trial file is created and removed beside each target
  (what only the file system knows: ``/proc``, a read-only mount, a name too long), and
  every output is written to a temporary file beside its target and renamed over it only
  when all were written, so a full disk at the end leaves the user's files as they were.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from . import jsonio
from .errors import UserError, cut

#: A name longer than this is cut in messages (the rest says nothing a user needs).
SHOWN_NAME = 200

#: The metadata a picture this project draws carries (PNG ``Software``, SVG ``Creator``):
#: what recognises it as one of ours when it is drawn again.
PICTURE_MARK = "selective-offload plan picture"
#: How far into a picture its mark is looked for (matplotlib writes it near the top).
PICTURE_HEAD_BYTES = 64 * 1024
#: The most a last-report record holds (one path).
RECORD_BYTES = 16384


def _json_format(path: Path) -> str | None:
    """The ``format`` a JSON object file names, or ``None`` (not JSON, not an object, no format)."""
    try:
        with open(path, "rb") as f:
            first = f.read(64).lstrip()
        if not first.startswith(b"{"):
            return None  # a weight shard, a picture, text: never parsed whole
        data = jsonio.read(path)
    except (OSError, ValueError, RecursionError):
        return None
    found = data.get("format") if isinstance(data, dict) else None
    return found if isinstance(found, str) else None


def _json_kind(prefix: str) -> Callable[[Path], bool]:
    def recognise(path: Path) -> bool:
        found = _json_format(path)
        return found is not None and found.startswith(prefix)
    return recognise


def _picture(signature: bytes) -> Callable[[Path], bool]:
    def recognise(path: Path) -> bool:
        try:
            with open(path, "rb") as f:
                head = f.read(PICTURE_HEAD_BYTES)
        except OSError:
            return False
        return head.startswith(signature) and PICTURE_MARK.encode() in head
    return recognise


def _record(path: Path) -> bool:
    try:
        text = jsonio.read_text(path, max_bytes=RECORD_BYTES).strip()
    except (OSError, ValueError):
        return False
    return len(text.splitlines()) == 1 and text.startswith("/")


#: What each kind of output is called in a message, and how a file of it is recognised.
KINDS: dict[str, tuple[str, Callable[[Path], bool]]] = {
    "plan": ("plan", _json_kind("selective-offload/plan-v")),
    "manifest": ("manifest", _json_kind("selective-offload/manifest-")),
    "profile": ("probe profile", _json_kind("selective-offload/profile-")),
    "report": ("landing report", _json_kind("selective-offload/report-")),
    "routing": ("routing profile", _json_kind("selective-offload/routing-")),
    "png": ("plan picture", _picture(b"\x89PNG\r\n\x1a\n")),
    "svg": ("plan picture", _picture(b"<?xml")),
    "record": ("last-report record", _record),
}


def ours(path: str | os.PathLike, kind: str) -> bool:
    """Whether the file at ``path`` may be replaced by an output of ``kind``: nothing there,
    an empty regular file, or a file of that kind this project wrote."""
    path = Path(path)
    try:
        if not path.exists():
            return True
        if not path.is_file():
            return False
        if path.stat().st_size == 0:
            return True
    except OSError:
        return False
    return KINDS[kind][1](path)


@dataclass(frozen=True)
class Output:
    """One file to write: the ``flag`` (or variable) that named it, the name as ``given``
    (for messages), the ``path`` resolved once (the one checked and written), its ``kind``."""

    flag: str
    given: str
    path: Path
    kind: str

    @property
    def named(self) -> str:
        if not self.flag:
            return cut(self.given, SHOWN_NAME)
        return f"{self.flag}{'' if self.flag.endswith('=') else ' '}{cut(self.given, SHOWN_NAME)}"


def temporary_name(path: Path) -> Path:
    """The temporary file an output is written to before it is renamed over ``path``:
    beside it (a rename is atomic within one file system), and short whatever the target's
    name, so it always fits where the target fits."""
    return path.with_name(f".so-{os.getpid()}-{abs(hash(path.name)) % 10**8}.tmp")


def _write_trial(trial: Path) -> None:
    """Write a byte to ``trial`` and remove it: what the file system says when an output is
    written for real (OSError), said before any work."""
    try:
        with open(trial, "wb") as f:
            f.write(b"\n")
    finally:
        trial.unlink(missing_ok=True)


def model_directories(model: str | os.PathLike) -> list[Path]:
    """The folders whose files are the checkpoint ``model`` names, resolved: a checkpoint
    directory, the directory of a shard, of a ``config.json`` beside shards, the hub
    cache's folder of a hub id; none for a manifest or a config alone (files of their own)
    or a bundled name."""
    text = str(model)
    path = Path(text).expanduser()
    try:
        if path.is_dir():
            return [path.resolve()]
        if path.is_file():  # a shard, or a config.json: its folder when that holds the weights
            folder = path.resolve().parent
            return [folder] if path.suffix == ".safetensors" or any(folder.glob("*.safetensors")) else []
    except OSError:
        return []
    from .checkpoint.hub import parse_hub_id

    parsed = parse_hub_id(text)
    if parsed is None:
        return []
    try:
        from huggingface_hub import constants
    except ImportError:
        return []
    return [Path(os.path.realpath(Path(constants.HF_HUB_CACHE) / f"models--{parsed[0].replace('/', '--')}"))]


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def _resolved(flag: str, given: str) -> Path:
    try:
        return Path(os.path.realpath(Path(given).expanduser()))
    except (OSError, ValueError) as exc:  # a loop of links, a NUL in the name
        raise UserError(f"{flag} {cut(given, SHOWN_NAME)}: cannot be used ({getattr(exc, 'strerror', None) or exc}); "
                        "name a file in a writable directory") from None


def _same_file(a: Path, b: Path) -> bool:
    if a == b:
        return True
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def _check(out: Output, models: list[Path]) -> None:
    target, named, what = out.path, out.named, KINDS[out.kind][0]
    if target.is_dir():
        raise UserError(f"{named}: is a directory; name a file in it, like "
                        f"{cut(str(Path(out.given) / ('out' + target.suffix)), SHOWN_NAME)}")
    if target.exists() and not target.is_file():
        raise UserError(f"{named}: is not a regular file (a device, a pipe or a socket), and the output replaces "
                        "its file; name a regular file")
    for folder in models:
        if _inside(target, folder):
            raise UserError(f"{named}: is inside the checkpoint being planned ({cut(str(folder), SHOWN_NAME)}), "
                            "whose files vLLM reads as the model's; write it elsewhere")
    if not ours(target, out.kind):
        raise UserError(f"{named}: exists and is not a {what} selective-offload wrote, so it is not replaced; "
                        "name a new file (or move that one away yourself)")
    parent = target.parent
    if parent.exists() and not parent.is_dir():
        raise UserError(f"{named}: cannot be written: {cut(str(parent), SHOWN_NAME)} is not a directory; name a "
                        "file in a directory")
    if not parent.is_dir():
        raise UserError(f"{named}: the directory {cut(str(parent), SHOWN_NAME)} does not exist; create it or name "
                        "another file")
    _write_trial(temporary_name(target))


def resolve_outputs(named: Sequence[tuple[str, str | os.PathLike | None, str]], *,
                    model: str | os.PathLike | None = None) -> list[Output]:
    """Each ``(flag, path, kind)`` (a ``None`` path skipped) resolved once and checked,
    before any work: two names for one file, a target inside ``model``'s checkpoint, a
    file that is not this project's of that kind, a directory, a device, a missing folder
    or a place the file system refuses, each one line naming the flag and the path."""
    outputs = [Output(flag, str(path), _resolved(flag, str(path)), kind) for flag, path, kind in named
               if path is not None]
    for i, a in enumerate(outputs):
        for b in outputs[:i]:
            if _same_file(a.path, b.path):
                raise UserError(f"{b.named} and {a.named} name the same file ({cut(str(b.path), SHOWN_NAME)}); "
                                "name a file for each")
    models = model_directories(model) if model is not None else []
    for out in outputs:
        try:
            _check(out, models)
        except OSError as exc:  # /proc, a read-only mount, a name too long
            raise UserError(f"{out.named}: cannot be written ({exc.strerror or exc}); name a file in a writable "
                            "directory on a normal file system") from None
    return outputs


def check_output_file(path: str | os.PathLike, flag: str, kind: str,
                      model: str | os.PathLike | None = None) -> Output:
    """One output, resolved and checked (:func:`resolve_outputs`); ``flag`` ending in ``=``
    names an environment variable (``SELECTIVE_OFFLOAD_PROFILE=``)."""
    return resolve_outputs([(flag, path, kind)], model=model)[0]


def check_output_dir(path: str | os.PathLike, flag: str) -> Path:
    """Make the folder ``path`` (given with ``flag``) and try a file in it, before any work:
    a file, a device or an unwritable place is one line saying what to name instead."""
    target, named = Path(path), cut(str(path), SHOWN_NAME)
    try:
        if target.exists() and not target.is_dir():
            raise UserError(f"{flag} {named}: is not a folder; name a folder (it is made if missing)")
        target.mkdir(parents=True, exist_ok=True)
        _write_trial(temporary_name(target / "trial"))
    except OSError as exc:  # /proc, a read-only mount, a name too long
        raise UserError(f"{flag} {named}: cannot be written ({exc.strerror or exc}); name a folder on a "
                        "writable file system") from None
    return target


def write_outputs(items: Sequence[tuple[Output, bytes]]) -> None:
    """Write each ``(output, data)``: all to temporary files beside their resolved targets
    first, then renamed over them; a failure (a full disk, a target that became another
    kind of file meanwhile) is one line, and no target is touched unless every output was
    written."""
    staged: list[tuple[Path, Output]] = []
    try:
        for out, data in items:
            tmp = temporary_name(out.path)
            staged.append((tmp, out))
            try:
                with open(tmp, "wb") as f:
                    f.write(data)
            except OSError as exc:
                raise UserError(f"{out.named}: cannot be written ({exc.strerror or exc}); nothing was written: "
                                "free space or name a file elsewhere") from None
        for _, out in staged:
            if out.path.exists() and not out.path.is_file():
                raise UserError(f"{out.named}: became something other than a regular file while planning; it was "
                                "not replaced")
            if not ours(out.path, out.kind):
                raise UserError(f"{out.named}: became a file selective-offload did not write while planning; it was "
                                "not replaced")
        for tmp, out in staged:
            try:
                os.replace(tmp, out.path)
            except OSError as exc:
                raise UserError(f"{out.named}: cannot be replaced ({exc.strerror or exc}); name a file in a "
                                "writable directory") from None
    finally:
        for tmp, _ in staged:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass


def write_files(outputs: Sequence[tuple[str, str | os.PathLike, bytes, str]], *,
                model: str | os.PathLike | None = None) -> list[Output]:
    """Each ``(flag, path, data, kind)`` resolved, checked and written whole (the two steps
    above together, for a writer with nothing to do between them)."""
    resolved = resolve_outputs([(flag, path, kind) for flag, path, _, kind in outputs], model=model)
    write_outputs([(out, data) for out, (_, _, data, _) in zip(resolved, outputs)])
    return resolved
