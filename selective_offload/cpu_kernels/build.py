"""Compile moe.c once per machine and load it.

Why compile on the user's machine and not ship a wheel: the kernel is built with
``-march=native`` so it uses the vector units this CPU has (AVX-512, AVX2, or plain C),
and it stays a pure-Python package with no new dependency. The system compiler (``$CC``,
else ``cc``, else ``gcc``) builds it on first use into a cache folder whose name is the
SHA-256 of everything the binary depends on (moe.c and the parts it includes, the flags,
the compiler's version and this CPU's flags), so an edited source, another compiler or
another CPU gets its own build and never a stale one. The library is written to a temporary file and
renamed into place, so processes building at the same time each end with a whole file.

torch is imported before the library is loaded: torch ships its own ``libgomp.so.1``,
and a library linked with ``-fopenmp`` that is loaded afterwards binds to the OpenMP
runtime already in the process (one thread pool, not two); :func:`openmp_runtimes` lists
what is mapped so a test can check it.

A missing compiler or a failed compile is :class:`KernelUnavailable`, one line saying
what to install, or to keep the experts on the device reading them from the host (UVA).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch  # noqa: F401  (loaded first: its libgomp is the process's OpenMP runtime)

from ..errors import UserError
from ..options import ENV_KERNEL_CACHE

SOURCE = Path(__file__).with_name("moe.c")
#: The folder of the parts moe.c includes (``*.h``: one translation unit), searched by the
#: compiler (-I) so a copy of moe.c elsewhere still builds against them.
PARTS = Path(__file__).parent
LIBRARY = "libso_cpu_kernels.so"
#: An undeclared function is an error, as GCC 14 makes it: a path compiled only on other
#: CPUs (the variants tests/unit/cpu_kernels builds) must not call what it lacks.
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-Werror=implicit-function-declaration")
ADVICE = ("install a C compiler with OpenMP (Debian/Ubuntu: apt-get install gcc; Fedora: dnf install gcc), "
          "or keep these experts host-uva (the device reads them from host memory)")


class KernelUnavailable(UserError):
    """The host-compute CPU kernel cannot be built or loaded here; the message says why."""


def cache_root() -> Path:
    env = os.environ.get(ENV_KERNEL_CACHE, "").strip()
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME", "").strip() or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "selective-offload" / "kernels"


def compiler() -> str:
    """The compiler's path: ``$CC`` when set (it must exist), else ``cc`` or ``gcc`` on PATH."""
    named = os.environ.get("CC", "").strip()
    if named:
        found = shutil.which(named.split()[0])
        if not found:
            raise KernelUnavailable(f"host-compute CPU kernels: CC={named!r} is not a program on PATH; "
                                    f"set CC to a C compiler or unset it; or {ADVICE}")
        return found
    for name in ("cc", "gcc"):
        found = shutil.which(name)
        if found:
            return found
    raise KernelUnavailable(f"host-compute CPU kernels: no C compiler (cc or gcc) on PATH; {ADVICE}")


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return ""


def _compiler_version(cc: str) -> str:
    try:
        proc = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelUnavailable(f"host-compute CPU kernels: the compiler {cc} does not run ({e}); {ADVICE}") from None
    if proc.returncode:
        raise KernelUnavailable(f"host-compute CPU kernels: `{cc} --version` exited {proc.returncode}; {ADVICE}")
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


def library_path(extra_flags: tuple[str, ...] = ()) -> tuple[Path, str, tuple[str, ...]]:
    """Where this machine's build lives (built or not), the compiler, and the flags."""
    cc = compiler()
    flags = FLAGS + tuple(extra_flags)
    key = cache_key(sources_text(), flags, _compiler_version(cc), _cpu_flags())
    return cache_root() / key / LIBRARY, cc, flags


def build(extra_flags: tuple[str, ...] = (), quiet: bool = False) -> Path:
    """The compiled library's path, compiling it first when this key has no build yet."""
    path, cc, flags = library_path(extra_flags)
    if path.is_file():
        return path
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise KernelUnavailable(f"host-compute CPU kernels: cannot make the cache folder {path.parent} ({e.strerror}); "
                                f"set {ENV_KERNEL_CACHE} to a writable folder") from None
    if not quiet:
        print(f"selective-offload: compiling the host-compute CPU kernels once ({os.path.basename(cc)} "
              f"{' '.join(flags)}) into {path.parent}", file=sys.stderr, flush=True)
    fd, tmp = tempfile.mkstemp(prefix=LIBRARY + ".", suffix=".tmp", dir=path.parent)
    os.close(fd)
    cmd = [cc, *flags, "-I", str(PARTS), "-o", tmp, str(SOURCE), "-lm"]
    try:
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.SubprocessError) as e:
            raise KernelUnavailable(f"host-compute CPU kernels: the compiler {cc} did not run ({e}); {ADVICE}") from None
        if proc.returncode:
            first = next((line for line in proc.stderr.splitlines() if "error" in line), proc.stderr.strip()[:200])
            raise KernelUnavailable(f"host-compute CPU kernels: `{os.path.basename(cc)} {' '.join(flags)}` failed: "
                                    f"{first.strip()[:300]}; {ADVICE}")
        os.replace(tmp, path)  # atomic: a concurrent builder's rename replaces a whole file with a whole file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def load(extra_flags: tuple[str, ...] = (), quiet: bool = False) -> ctypes.CDLL:
    path = build(extra_flags, quiet)
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise KernelUnavailable(f"host-compute CPU kernels: {path} does not load ({e}); delete it to rebuild, "
                                f"or {ADVICE}") from None
    _declare(lib)
    return lib


def _declare(lib: ctypes.CDLL) -> None:
    i64, vp = ctypes.c_int64, ctypes.c_void_p
    lib.so_moe_job_size.restype = i64
    lib.so_moe_job_size.argtypes = []
    lib.so_simd_level.restype = i64
    lib.so_simd_level.argtypes = []
    lib.so_bf16_activations.restype = i64
    lib.so_bf16_activations.argtypes = []
    lib.so_int8_mxfp4.restype = i64
    lib.so_int8_mxfp4.argtypes = []
    lib.so_bf16_prefetch.restype = i64
    lib.so_bf16_prefetch.argtypes = []
    lib.so_set_bf16_prefetch.restype = None
    lib.so_set_bf16_prefetch.argtypes = [i64]
    lib.so_moe_workspace_bytes.restype = i64
    lib.so_moe_workspace_bytes.argtypes = [i64] * 5
    lib.so_moe_job_run.restype = None
    lib.so_moe_job_run.argtypes = [vp]
    lib.so_read_sum.restype = ctypes.c_double
    lib.so_read_sum.argtypes = [vp, i64, i64]
    lib.so_rows_bf16.restype = i64
    lib.so_rows_bf16.argtypes = [vp, i64, i64, vp, i64, i64, vp, i64]
    lib.so_rows_job_size.restype = i64
    lib.so_rows_job_size.argtypes = []
    lib.so_rows_job_run.restype = None
    lib.so_rows_job_run.argtypes = [vp]


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
