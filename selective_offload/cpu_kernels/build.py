"""Compile moe.c once per machine, check the build, and load it.

Why compile on the user's machine and not ship a wheel: the kernel is built with
``-march=native`` so it uses the vector units this CPU has (AVX-512, AVX2, or plain C),
and it stays a pure-Python package with no new dependency. The system compiler (``$CC``,
split into words as build tools split it, so ``CC="ccache gcc"`` works; else ``cc``, else
``gcc``) builds it on first use into a cache folder whose name is the SHA-256 of
everything the binary depends on (moe.c and the parts it includes, the flags, the
compiler's version and this CPU's flags), so an edited source, another compiler or
another CPU gets its own build and never a stale one.

A build is loaded only when it is this user's (or root's) and whole (``cache``): the cache
folder and all in it are owned by this user or root and writable by no one else, and the
library matches the size, SHA-256 and entry points its build recorded beside it. A build
that fails those checks is made again (or refused in one line when the folder is not
this user's to write); a folder that others could write is refused, never loaded from.
The library is written to a temporary file, checked (a compiler that exits 0 without
making a library is refused, leaving nothing behind), renamed into place, and its record
written atomically after it, under a lock on its folder, so processes building at the
same time each end with a whole, recorded build. Folders and files are made readable by
everyone and writable by their owner only, whatever the umask: a cache built by root (at
install) serves every user.

The kernels run on their own thread pool (``pool.h``: pthreads, pinned, asleep between
jobs), not on OpenMP's; the library still links the OpenMP runtime, for the places torch's
runtime was given (the cores vLLM's CPU worker binds its threads to, the pool's default)
and for the ``-DSO_OPENMP`` build the benchmark times the pool against. torch is imported
before the library is loaded: torch ships its own ``libgomp.so.1``, and a library linked
with ``-fopenmp`` that is loaded afterwards binds to the OpenMP runtime already in the
process (one runtime, not two); :func:`openmp_runtimes` lists what is mapped so a test can
check it.

A missing compiler or a failed compile is :class:`KernelUnavailable`, one line saying
what to install, or to keep the experts on the device reading them from the host (UVA);
a cache that is not this user's alone is :class:`KernelCacheRefused`.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch  # noqa: F401  (loaded first: its libgomp is the process's OpenMP runtime)

from ..options import ENV_KERNEL_CACHE
from . import cache
from .cache import KernelCacheRefused, KernelUnavailable

__all__ = ["KernelCacheRefused", "KernelUnavailable", "build", "load", "library_path", "cache_root", "compiler"]

SOURCE = Path(__file__).with_name("moe.c")
#: The folder of the parts moe.c includes (``*.h``: one translation unit), searched by the
#: compiler (-I) so a copy of moe.c elsewhere still builds against them.
PARTS = Path(__file__).parent
LIBRARY = "libso_cpu_kernels.so"
#: An undeclared function is an error, as GCC 14 makes it: a path compiled only on other
#: CPUs (the variants tests/unit/cpu_kernels builds) must not call what it lacks.
FLAGS = ("-O3", "-march=native", "-fopenmp", "-pthread", "-shared", "-fPIC", "-Werror=implicit-function-declaration")
ADVICE = ("install a C compiler with OpenMP (Debian/Ubuntu: apt-get install gcc; Fedora: dnf install gcc), "
          "or keep these experts served uva (the device reads them from host memory)")
_I64, _VP = ctypes.c_int64, ctypes.c_void_p
#: The library's entry points, their result and argument types: a build must export them all.
ENTRIES: dict[str, tuple[object, list]] = {
    "so_moe_job_size": (_I64, []),
    "so_simd_level": (_I64, []),
    "so_bf16_activations": (_I64, []),
    "so_int8_mxfp4": (_I64, []),
    "so_bf16_prefetch": (_I64, []),
    "so_set_bf16_prefetch": (None, [_I64]),
    "so_moe_workspace_bytes": (_I64, [_I64] * 5),
    "so_moe_job_run": (None, [_VP]),
    "so_read_sum": (ctypes.c_double, [_VP, _I64, _I64]),
    "so_rows_bf16": (_I64, [_VP, _I64, _I64, _VP, _I64, _I64, _VP, _I64, _VP, _I64]),
    "so_rows_job_size": (_I64, []),
    "so_rows_job_run": (None, [_VP]),
    "so_failures": (_I64, []),
    "so_last_failure": (_I64, []),
    "so_pool_set_cpus": (_I64, [_VP, _I64]),
    "so_pool_cpus": (_I64, [_VP, _I64]),
    "so_pool_workers": (_I64, []),
    "so_pool_tids": (_I64, [_VP, _I64]),
    "so_pool_set_spin_ns": (None, [_I64]),
    "so_pool_spin_ns": (_I64, []),
    "so_omp_places": (_I64, [_VP, _I64]),
    "so_last_failed_job": (_VP, []),
}
SYMBOLS = frozenset(ENTRIES)
#: The descriptors of the loaded libraries, kept open: each was loaded by its
#: ``/proc/self/fd`` name, which must not name another file while the process lives.
_HELD: list[int] = []


def cache_root() -> Path:
    env = os.environ.get(ENV_KERNEL_CACHE, "").strip()
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME", "").strip() or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "selective-offload" / "kernels"


def compiler() -> tuple[str, ...]:
    """The compiler's command: ``$CC`` when set, split as a shell splits it (its first word
    must be a program: ``ccache gcc`` runs gcc through ccache), else ``cc`` or ``gcc`` on PATH."""
    named = os.environ.get("CC", "").strip()
    if named:
        try:
            words = shlex.split(named)
        except ValueError as e:
            raise KernelUnavailable(f"host-compute CPU kernels: CC={named!r} cannot be split into words ({e}); "
                                    f"set CC to a C compiler or unset it; or {ADVICE}") from None
        found = shutil.which(words[0]) if words else None
        if not found:
            raise KernelUnavailable(f"host-compute CPU kernels: CC={named!r} is not a program on PATH; "
                                    f"set CC to a C compiler or unset it; or {ADVICE}")
        return (found, *words[1:])
    for name in ("cc", "gcc"):
        found = shutil.which(name)
        if found:
            return (found,)
    raise KernelUnavailable(f"host-compute CPU kernels: no C compiler (cc or gcc) on PATH; {ADVICE}")


def _said(cc: tuple[str, ...]) -> str:
    """The compiler as a message names it: CC's words, the program by its name."""
    return " ".join([os.path.basename(cc[0]), *cc[1:]])


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return ""


def _compiler_version(cc: tuple[str, ...]) -> str:
    try:
        proc = subprocess.run([*cc, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelUnavailable(f"host-compute CPU kernels: the compiler {_said(cc)} does not run ({e}); "
                                f"{ADVICE}") from None
    if proc.returncode:
        raise KernelUnavailable(f"host-compute CPU kernels: `{_said(cc)} --version` exited {proc.returncode}; {ADVICE}")
    return proc.stdout


def cache_key(source: str, flags: tuple[str, ...], version: str, cpu_flags: str) -> str:
    h = hashlib.sha256()
    for part in (source, "\0".join(flags), version, cpu_flags):
        h.update(part.encode())
        h.update(b"\0\0")
    return h.hexdigest()


def sources_text() -> str:
    """moe.c and every part beside it that it may include, named: what a build compiles."""
    parts = sorted(PARTS.glob("*.h"))
    return SOURCE.read_text() + "".join(f"\0{p.name}\0{p.read_text()}" for p in parts)


def library_path(extra_flags: tuple[str, ...] = ()) -> tuple[Path, tuple[str, ...], tuple[str, ...]]:
    """Where this machine's build lives (built or not), the compiler's command, and the flags."""
    cc = compiler()
    flags = FLAGS + tuple(extra_flags)
    key = cache_key(sources_text(), flags, _compiler_version(cc), _cpu_flags())
    return cache_root() / key / LIBRARY, cc, flags


def build(extra_flags: tuple[str, ...] = (), quiet: bool = False) -> Path:
    """The checked library's path, compiling it first when this key has no whole build."""
    path, fd = _built(extra_flags, quiet)
    os.close(fd)
    return path


def load(extra_flags: tuple[str, ...] = (), quiet: bool = False) -> ctypes.CDLL:
    """The checked build, loaded from the very file that was checked."""
    path, fd = _built(extra_flags, quiet)
    try:
        lib = ctypes.CDLL(cache.fd_path(fd, path))
    except OSError as e:
        os.close(fd)
        raise KernelUnavailable(f"host-compute CPU kernels: {path} does not load ({e}); set {ENV_KERNEL_CACHE} "
                                f"to an empty folder of your own to build it again, or {ADVICE}") from None
    _HELD.append(fd)
    for name, (result, arguments) in ENTRIES.items():
        entry = getattr(lib, name)
        entry.restype, entry.argtypes = result, arguments
    return lib


def _built(extra_flags: tuple[str, ...], quiet: bool) -> tuple[Path, int]:
    """This key's library, checked, and an open descriptor of it; built first when its
    build is missing or not whole."""
    try:
        path, cc, flags = library_path(extra_flags)
    except KernelUnavailable:
        found = _prebuilt(FLAGS + tuple(extra_flags))  # no compiler here: a build someone made, if any
        if found is None:
            raise
        return found
    root = cache_root()
    cache.check_folder(root)
    opened = cache.open_verified(root, path, SYMBOLS)
    if isinstance(opened, int):
        return path, opened
    with _locked(root, path.parent, path, opened):
        opened = cache.open_verified(root, path, SYMBOLS)  # another process may have built it meanwhile
        if isinstance(opened, str):
            _compile(path, cc, flags, opened, quiet)
            opened = cache.open_verified(root, path, SYMBOLS)
    if isinstance(opened, str):
        raise KernelUnavailable(f"host-compute CPU kernels: the build {path} {opened} just after it was made; "
                                f"set {ENV_KERNEL_CACHE} to a folder of your own")
    return path, opened


def _builds(flags: tuple[str, ...]) -> dict:
    """What a build is made from, but its compiler: these sources, these flags, this CPU."""
    return {"sources": cache.digest(sources_text().encode()), "flags": list(flags),
            "cpu": cache.digest(_cpu_flags().encode())}


def _prebuilt(flags: tuple[str, ...]) -> tuple[Path, int] | None:
    """For a user without a compiler: a build in the cache made (by any compiler: its key,
    which holds the compiler's version, cannot be made here) from these sources with these
    flags on a CPU with these flags, checked as every build is; None when there is none."""
    root = cache_root()
    cache.check_folder(root)
    want = _builds(flags)
    try:
        folders = sorted(p for p in root.iterdir() if p.is_dir())
    except OSError:
        return None
    for folder in folders:
        path = folder / LIBRARY
        record = cache.read_record(root, path)
        if isinstance(record, dict) and record.get("builds") == want:
            opened = cache.open_verified(root, path, SYMBOLS)
            if isinstance(opened, int):
                return path, opened
    return None


def _cannot_write(path: Path, problem: str, folder: Path, why: str) -> KernelUnavailable:
    """The one line for a build that must be made again where this user cannot write."""
    return KernelUnavailable(f"host-compute CPU kernels: the build {path} {problem}, and {folder} cannot be "
                             f"written by this user to build it ({why}); set {ENV_KERNEL_CACHE} to a folder "
                             f"of your own")


class _locked:
    """The build folder, made when missing (readable by all, writable by its owner), and
    held under an exclusive lock while one process builds into it."""

    def __init__(self, root: Path, folder: Path, path: Path, problem: str):
        self.args = root, folder, path, problem
        self.fd = -1

    def __enter__(self):
        root, folder, path, problem = self.args
        missing = [p for p in (folder, *folder.parents) if not p.exists()]
        for made in reversed(missing):
            try:
                os.mkdir(made, 0o755)
                os.chmod(made, 0o755)  # whatever the umask: a cache built by root serves every user
            except FileExistsError:
                pass  # made meanwhile by another process
            except OSError as e:
                raise _cannot_write(path, problem, folder, e.strerror) from None
        if missing:
            cache.check_folder(root)
        if not os.access(folder, os.W_OK | os.X_OK):
            raise _cannot_write(path, problem, folder, "no write permission")
        self.fd = os.open(folder, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
        return False


def _compile(path: Path, cc: tuple[str, ...], flags: tuple[str, ...], problem: str, quiet: bool) -> None:
    """Compile into a temporary file beside ``path``, check what the compiler made, put it in
    place and record it. Nothing of a failed build is left behind."""
    folder = path.parent
    if not quiet:
        again = "" if problem == "is missing" else f" again (the build there {problem})"
        print(f"selective-offload: compiling the host-compute CPU kernels once{again} ({_said(cc)} "
              f"{' '.join(flags)}) into {folder}", file=sys.stderr, flush=True)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{LIBRARY}.", suffix=".tmp", dir=folder)
    except OSError as e:
        raise _cannot_write(path, problem, folder, e.strerror) from None
    os.close(fd)
    cmd = [*cc, *flags, "-I", str(PARTS), "-o", tmp, str(SOURCE), "-lm"]
    try:
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.SubprocessError) as e:
            raise KernelUnavailable(f"host-compute CPU kernels: the compiler {_said(cc)} did not run ({e}); "
                                    f"{ADVICE}") from None
        if proc.returncode:
            first = next((line for line in proc.stderr.splitlines() if "error" in line), proc.stderr.strip()[:200])
            raise KernelUnavailable(f"host-compute CPU kernels: `{_said(cc)} {' '.join(flags)}` failed: "
                                    f"{first.strip()[:300]}; {ADVICE}")
        data = Path(tmp).read_bytes()
        exports = _made(data, cc)
        os.chmod(tmp, 0o755)
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)  # a folder where the library goes: nothing a build made
            os.replace(tmp, path)  # atomic: a reader sees the old file or the new one, whole
            cache.write_record(path, data, exports, [*cc, *flags], _builds(flags))
        except OSError as e:
            raise _cannot_write(path, problem, folder, e.strerror) from None
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)


def _made(data: bytes, cc: tuple[str, ...]) -> frozenset[str]:
    """The entry points of what the compiler made; one line when it made no such library
    (``CC=true`` exits 0 and leaves the empty output file)."""
    try:
        exports = cache.elf_exports(data)
        missing = sorted(SYMBOLS - exports)
        if missing:
            raise ValueError(f"it lacks the kernel's entry points ({', '.join(missing[:3])})")
    except ValueError as e:
        what = "an empty file" if not data else f"a file that is no kernel library ({e})"
        raise KernelUnavailable(f"host-compute CPU kernels: the compiler `{_said(cc)}` exited 0 but made {what}; "
                                f"set CC to a C compiler (gcc or clang) or unset it; or {ADVICE}") from None
    return exports


def openmp_runtimes() -> list[str]:
    """The OpenMP runtime libraries mapped into this process (from /proc/self/maps)."""
    found = []
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        parts = line.split()
        name = os.path.basename(parts[-1]) if len(parts) >= 6 else ""
        if name.startswith(("libgomp", "libiomp", "libomp")) and parts[-1] not in found:
            found.append(parts[-1])
    return found
