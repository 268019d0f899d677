"""What the kernel cache may hold, and the checks a build passes before it is loaded.

Loading a shared object runs its constructors in this process, so the cache loads only
what this user (or root, for a cache prebuilt at install) built:

- the cache folder and everything in it are owned by this user or by root and writable by
  no one else (group and others have no write bit), else :class:`KernelCacheRefused`,
  one line naming the folder and ``SELECTIVE_OFFLOAD_KERNEL_CACHE``;
- each build has a record beside it (:data:`RECORD`, written atomically after the build):
  the library's size and SHA-256, and the entry points it exports;
- a library is opened once, checked from that open file (owner, mode, size, checksum, and
  the kernel's entry points read from its ELF dynamic symbol table without loading it:
  a truncated file, a shared object without the symbols or a folder at its path is a
  problem to rebuild, never a SIGBUS or a traceback) and loaded from the same open file
  (``/proc/self/fd``), so what is checked is what is loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import pwd
import stat
import struct
from pathlib import Path

from ..errors import UserError
from ..options import ENV_KERNEL_CACHE


class KernelUnavailable(UserError):
    """The host-compute CPU kernel cannot be built or loaded here; the message says why."""


class KernelCacheRefused(KernelUnavailable):
    """The kernel cache holds something this user did not build (or that others could
    replace), so nothing in it is loaded; the message names the folder and the variable."""


#: The record of one build, beside its library.
RECORD_SUFFIX = ".record.json"
RECORD_FORMAT = "selective-offload kernel build 1"
MAX_RECORD_BYTES = 65536
#: Mode bits no one but the owner may hold on anything in the cache.
FOREIGN_WRITE = stat.S_IWGRP | stat.S_IWOTH


def record_path(library: Path) -> Path:
    return library.with_name(library.name + RECORD_SUFFIX)


def _owner(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def _trusted_uids() -> tuple[int, int]:
    return (os.geteuid(), 0)


def unsafe(st: os.stat_result) -> str | None:
    """Why an entry with this stat may hold someone else's code, or None."""
    if st.st_uid not in _trusted_uids():
        return f"owned by {_owner(st.st_uid)}"
    if not stat.S_ISLNK(st.st_mode) and st.st_mode & FOREIGN_WRITE:
        return "writable by " + ("group and others" if st.st_mode & stat.S_IWGRP and st.st_mode & stat.S_IWOTH
                                 else "its group" if st.st_mode & stat.S_IWGRP else "others")
    return None


def refuse(root: Path, path: Path, why: str) -> KernelCacheRefused:
    """The one line for an entry of the cache that is not this user's or root's alone."""
    what = "the kernel cache" if path == root else f"{path} in the kernel cache"
    mine = False
    try:
        mine = why.startswith("writable") and os.stat(root).st_uid == os.geteuid()
    except OSError:
        pass
    # A build made where others could write is made again once the folder is closed: only
    # builds recorded by this package are loaded, and it never makes them writable by others.
    fix = f"`chmod -R go-w {root}`, or " if mine else ""
    return KernelCacheRefused(
        f"host-compute CPU kernels: {what} {root} is {why}, so a library in it may not be this user's build "
        f"and is not loaded; {fix}set {ENV_KERNEL_CACHE} to a folder of your own")


def check_folder(root: Path) -> None:
    """Refuse ``root`` unless it and everything in it (two levels: the build folders and
    their files) are owned by this user or root and writable by no one else. A root that
    does not exist yet passes (the build makes it)."""
    try:
        st = os.stat(root)
    except FileNotFoundError:
        return
    except OSError as e:
        raise KernelCacheRefused(f"host-compute CPU kernels: the kernel cache {root} cannot be read ({e.strerror}); "
                                 f"set {ENV_KERNEL_CACHE} to a folder of your own") from None
    if not stat.S_ISDIR(st.st_mode):
        raise KernelCacheRefused(f"host-compute CPU kernels: the kernel cache {root} is not a folder; "
                                 f"set {ENV_KERNEL_CACHE} to a folder of your own")
    why = unsafe(st)
    if why:
        raise refuse(root, root, why)
    _check_entries(root, root, depth=2)


def _check_entries(root: Path, folder: Path, depth: int) -> None:
    try:
        entries = list(os.scandir(folder))
    except OSError as e:
        raise KernelCacheRefused(f"host-compute CPU kernels: {folder} in the kernel cache {root} cannot be read "
                                 f"({e.strerror}); set {ENV_KERNEL_CACHE} to a folder of your own") from None
    for entry in entries:
        try:
            st = entry.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue  # removed meanwhile (a build's temporary file)
        why = unsafe(st)
        if why:
            raise refuse(root, Path(entry.path), why)
        if depth > 1 and stat.S_ISDIR(st.st_mode):
            _check_entries(root, Path(entry.path), depth - 1)


def elf_exports(data: bytes) -> frozenset[str]:
    """The names a shared object defines in its dynamic symbol table, read from its bytes
    without loading it. ``ValueError`` (the reason) when ``data`` is not a whole ELF shared
    object: too short, cut inside its tables, or without a dynamic symbol table."""
    try:
        return _elf_exports(data)
    except struct.error as e:  # a field that points past the end, however it is damaged
        raise ValueError(f"its ELF tables point past its end ({e})") from None


def _elf_exports(data: bytes) -> frozenset[str]:
    if len(data) < 52 or data[:4] != b"\x7fELF" or data[4] not in (1, 2) or data[5] not in (1, 2):
        raise ValueError("it is not an ELF file")
    wide, order = data[4] == 2, "<" if data[5] == 1 else ">"
    header = struct.Struct(order + ("HHIQQQIHHHHHH" if wide else "HHIIIIIHHHHHH"))
    if len(data) < 16 + header.size:
        raise ValueError("it is cut inside its ELF header")
    e_type, *_, shoff, _flags, _ehsize, _phentsize, _phnum, shentsize, shnum, _shstrndx = header.unpack_from(data, 16)
    if e_type != 3:
        raise ValueError("it is not a shared object")
    section = struct.Struct(order + ("IIQQQQIIQQ" if wide else "IIIIIIIIII"))
    if shentsize != section.size or shnum == 0 or shoff + shnum * section.size > len(data):
        raise ValueError("it is cut before the end of its section table (a truncated file)")
    sections = [section.unpack_from(data, shoff + i * section.size) for i in range(shnum)]
    symbol = struct.Struct(order + ("IBBHQQ" if wide else "IIIBBH"))
    for _name, kind, _f, _a, offset, size, link, *_ in sections:
        if kind != 11:  # SHT_DYNSYM
            continue
        if offset + size > len(data) or link >= len(sections):
            raise ValueError("it is cut inside its dynamic symbol table (a truncated file)")
        str_offset, str_size = sections[link][4], sections[link][5]
        if str_offset + str_size > len(data):
            raise ValueError("it is cut inside its symbol names (a truncated file)")
        names = data[str_offset:str_offset + str_size]
        found = set()
        for i in range(size // symbol.size):
            fields = symbol.unpack_from(data, offset + i * symbol.size)
            name, info, shndx = (fields[0], fields[1], fields[3]) if wide else (fields[0], fields[3], fields[5])
            if shndx == 0 or info >> 4 == 0:  # undefined here, or local
                continue
            end = names.find(b"\0", name)
            if end > name:
                found.add(names[name:end].decode("utf-8", "replace"))
        return frozenset(found)
    raise ValueError("it has no dynamic symbol table")


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write_record(library: Path, data: bytes, symbols: frozenset[str], command: list[str],
                 builds: dict | None = None) -> None:
    """The build's record beside ``library``, written to a temporary file and renamed into
    place (readable by all, as the library is: a cache prebuilt by root serves everyone).
    ``builds``: what it was built from (sources, flags, CPU), for a user without a compiler."""
    record = {"format": RECORD_FORMAT, "library": library.name, "size": len(data), "sha256": digest(data),
              "symbols": sorted(symbols), "command": command, "builds": builds}
    path = record_path(library)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "w") as f:
            json.dump(record, f, indent=1)
            f.write("\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)


def _read_all(fd: int, limit: int) -> bytes:
    chunks, total = [], 0
    while total <= limit and (chunk := os.read(fd, min(1 << 20, limit + 1 - total))):
        chunks.append(chunk)
        total += len(chunk)
    return b"".join(chunks)


def _open_checked(root: Path, path: Path) -> tuple[int, os.stat_result] | str:
    """``path`` opened read-only without following a link, and its stat; or the problem
    (missing, a folder, a link, not a regular file) as words. An entry that is not this
    user's or root's alone is refused, not reported."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return "is missing"
    except OSError as e:
        if os.path.islink(path):
            return "is a symbolic link"
        return f"cannot be opened ({e.strerror})"
    st = os.fstat(fd)
    why = unsafe(st)
    if why:
        os.close(fd)
        raise refuse(root, path, why)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        return "is a folder" if stat.S_ISDIR(st.st_mode) else "is not a regular file"
    return fd, st


def read_record(root: Path, library: Path) -> dict | str:
    """The build's record, or the problem with it as words."""
    opened = _open_checked(root, record_path(library))
    if isinstance(opened, str):
        return f"its build record {opened}"
    fd, _ = opened
    try:
        raw = _read_all(fd, MAX_RECORD_BYTES)
    finally:
        os.close(fd)
    try:
        record = json.loads(raw) if len(raw) <= MAX_RECORD_BYTES else None
    except (ValueError, UnicodeDecodeError):
        record = None
    if (not isinstance(record, dict) or record.get("format") != RECORD_FORMAT
            or type(record.get("size")) is not int or not isinstance(record.get("sha256"), str)):
        return "its build record is not one this package writes"
    return record


def open_verified(root: Path, library: Path, symbols: frozenset[str]) -> int | str:
    """An open file descriptor of ``library`` once it is checked against its record (size,
    SHA-256) and exports ``symbols``; else the problem as words (for a rebuild or a one-line
    error). The caller loads the descriptor (:func:`fd_path`) and closes it."""
    opened = _open_checked(root, library)
    if isinstance(opened, str):
        return opened
    fd, st = opened
    try:
        problem = _problem(root, library, fd, st, symbols)
    except BaseException:
        os.close(fd)
        raise
    if problem is not None:
        os.close(fd)
        return problem
    return fd


def _problem(root: Path, library: Path, fd: int, st: os.stat_result, symbols: frozenset[str]) -> str | None:
    record = read_record(root, library)
    if isinstance(record, str):
        return record
    if st.st_size != record["size"]:
        return f"is {st.st_size} bytes where its build recorded {record['size']} (a damaged file)"
    data = _read_all(fd, st.st_size)
    if digest(data) != record["sha256"]:
        return "does not match the checksum its build recorded (a changed file)"
    try:
        exported = elf_exports(data)
    except ValueError as e:
        return f"is not a library the kernel can load: {e}"
    missing = sorted(symbols - exported)
    if missing:
        return f"lacks the kernel's entry points ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''})"
    return None


def fd_path(fd: int, fallback: Path) -> str:
    """The name that loads exactly the open file ``fd`` (Linux: ``/proc/self/fd/N``)."""
    name = f"/proc/self/fd/{fd}"
    return name if os.path.exists(name) else str(fallback)
