"""Files the CLI writes for the user (a plan ``-o``, a manifest, ``--png`` / ``--svg``): tried
for real before any work, written whole or not at all.

A check of names alone misses what only the file system knows (``/proc`` refuses new files,
a read-only mount, a name too long), so :func:`check_output_file` creates and removes a
trial file beside the target, as the report path is tried (:mod:`.options`), and refuses a
target that is a directory or not a regular file (``/dev/full``, a pipe): the output is
renamed over its target, which must replace nothing but a regular file. :func:`write_files`
writes every output to a temporary file beside its target and renames them only when all
were written, so a full disk at the end leaves the user's files as they were (never half a
picture, and no plan without the picture asked for with it).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

from .errors import UserError, cut
from .options import temporary_name

#: A name longer than this is cut in messages (the rest says nothing a user needs).
SHOWN_NAME = 200


def _write_trial(trial: Path) -> None:
    """Write a byte to ``trial`` and remove it: what the file system says when an output is
    written for real (OSError), said before any work."""
    try:
        # mutation: output-path-no-trial, output-dir-no-trial
        with open(trial, "wb") as f:
            f.write(b"\n")
    finally:
        trial.unlink(missing_ok=True)


def check_output_file(path: str | os.PathLike, flag: str) -> Path:
    """Refuse, before any work, an output ``path`` (given with ``flag``) that cannot be
    written: one line saying why and what to name instead."""
    target, named = Path(path), cut(str(path), SHOWN_NAME)
    try:
        if target.is_dir():
            raise UserError(f"{flag} {named}: is a directory; name a file in it, like "
                            f"{cut(str(target / ('out' + target.suffix)), SHOWN_NAME)}")
        if target.exists() and not target.is_file():
            raise UserError(f"{flag} {named}: is not a regular file (a device, a pipe or a socket), and "
                            "the output replaces its file; name a regular file")
        parent = target.absolute().parent
        if not parent.is_dir():
            raise UserError(f"{flag} {named}: the directory {cut(str(parent), SHOWN_NAME)} does not exist; "
                            "create it or "
                            "name another file")
        _write_trial(temporary_name(target))
    except OSError as exc:  # /proc, a read-only mount, a name too long, a loop of links
        raise UserError(f"{flag} {named}: cannot be written ({exc.strerror or exc}); name a file in a "
                        "writable directory on a normal file system") from None
    return target


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


def write_files(outputs: Sequence[tuple[str, str | os.PathLike, bytes]]) -> None:
    """Write each ``(flag, path, data)``: all to temporary files beside their targets first,
    then renamed over them; a failure (a full disk) is one line, and no target is touched
    unless every output was written."""
    staged: list[tuple[Path, Path]] = []
    try:
        for flag, path, data in outputs:
            target, named = Path(path), cut(str(path), SHOWN_NAME)
            tmp = temporary_name(target)
            staged.append((tmp, target))
            try:
                # mutation: output-written-in-place
                with open(tmp, "wb") as f:
                    f.write(data)
            except OSError as exc:
                raise UserError(f"{flag} {named}: cannot be written ({exc.strerror or exc}); nothing was "
                                "written: free space or name a file elsewhere") from None
        for (tmp, target), (flag, path, _) in zip(staged, outputs):
            named = cut(str(path), SHOWN_NAME)
            if target.exists() and not target.is_file():
                raise UserError(f"{flag} {named}: became something other than a regular file while "
                                "planning; it was not replaced")
            try:
                os.replace(tmp, target)
            except OSError as exc:
                raise UserError(f"{flag} {named}: cannot be replaced ({exc.strerror or exc}); name a "
                                "file in a writable directory") from None
    finally:
        for tmp, _ in staged:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
