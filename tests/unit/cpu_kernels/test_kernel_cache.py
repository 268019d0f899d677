"""The kernel cache loads only what this user (or root) built, whole: each test makes the
user's call (``python -m selective_offload.cpu_kernels build``, or ``library()`` in a
process of its own, so a crash such as SIGBUS is a failed test, not a dead suite) against
a cache folder of its own (SELECTIVE_OFFLOAD_KERNEL_CACHE), never the user's.

A planted library is compiled with a constructor that writes a marker file: the marker
says whether the library was loaded, since loading runs it."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from helpers import REPO
from selective_offload.cpu_kernels import build, cache

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="no C compiler (cc or gcc) on PATH to build the kernel")
ENV = "SELECTIVE_OFFLOAD_KERNEL_CACHE"
NOBODY = 65534
AS_ROOT = os.geteuid() == 0

LOAD = """
    from selective_offload import cpu_kernels as ck
    try:
        lib = ck.library()
    except ck.KernelUnavailable as e:
        print(type(e).__name__, e)  # the typed error a caller catches
        raise SystemExit(2)
    print("loaded", lib.so_simd_level(), lib.so_moe_job_size())
"""


def _env(root: Path, **more: str) -> dict:
    env = {**os.environ, ENV: str(root), **more}
    if "CC" not in more:
        env.pop("CC", None)
    return env


def cli(root: Path, user: int | None = None, **more: str) -> subprocess.CompletedProcess:
    """``python -m selective_offload.cpu_kernels build`` as the user (or as ``user``)."""
    return _run([sys.executable, "-m", "selective_offload.cpu_kernels", "build"], _env(root, **more), user)


def load(root: Path, user: int | None = None, **more: str) -> subprocess.CompletedProcess:
    """``library()`` in a process of its own, as the user (or as ``user``)."""
    return _run([sys.executable, "-c", textwrap.dedent(LOAD)], _env(root, **more), user)


def _drop(user: int):
    def drop():
        os.setgroups([])
        os.setgid(user)
        os.setuid(user)
    return drop


def _as(user: int, python: str, env: dict) -> dict:
    """The environment another user's process runs with: this suite's packages on its path
    when its interpreter is not this one (this one may live in a folder only root reads)."""
    env = {**env, "HOME": env.get(ENV, "/nonexistent"), "PYTHONDONTWRITEBYTECODE": "1"}
    if python != sys.executable:
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), *(p for p in sys.path if p.endswith("site-packages"))])
    return env


@functools.cache
def other_python() -> str | None:
    """An interpreter ``NOBODY`` can run that imports torch and this package: this one, or
    the system's of the same version; None when there is none (or this is not root)."""
    if not AS_ROOT:
        return None
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for python in (sys.executable, shutil.which(version, path="/usr/bin:/bin") or ""):
        if not python:
            continue
        try:
            done = subprocess.run([python, "-c", "import torch, selective_offload"], capture_output=True,
                                  env=_as(NOBODY, python, dict(os.environ)), cwd="/", timeout=120,
                                  preexec_fn=_drop(NOBODY))
        except OSError:
            continue
        if done.returncode == 0:
            return python
    return None


def _run(cmd: list[str], env: dict, user: int | None) -> subprocess.CompletedProcess:
    if user is not None:
        python = other_python()
        assert python, "no interpreter another user can run"
        cmd, env = [python, *cmd[1:]], _as(user, python, env)
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=300,
                          preexec_fn=_drop(user) if user is not None else None)


def one_line(proc: subprocess.CompletedProcess) -> str:
    """The error line of a refused build (after the line saying it compiles, if it began)."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr[-2000:])
    lines = proc.stderr.splitlines()
    assert "Traceback" not in proc.stderr and proc.stderr.endswith("\n") and lines, proc.stderr[-2000:]
    assert all(line.startswith("selective-offload: compiling ") for line in lines[:-1]), proc.stderr[-2000:]
    return lines[-1]


def built(root: Path, monkeypatch) -> Path:
    """This machine's build, made in ``root`` by the package itself."""
    monkeypatch.setenv(ENV, str(root))
    monkeypatch.delenv("CC", raising=False)
    return build.build(quiet=True)


def key_path(root: Path, monkeypatch) -> Path:
    monkeypatch.setenv(ENV, str(root))
    monkeypatch.delenv("CC", raising=False)
    return build.library_path()[0]


def compile_so(tmp_path: Path, name: str, body: str) -> Path:
    source = tmp_path / f"{name}.c"
    source.write_text(body)
    out = tmp_path / f"{name}.so"
    subprocess.run([shutil.which("cc") or "gcc", "-shared", "-fPIC", "-o", str(out), str(source)], check=True)
    return out


PLANTED = """
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen(getenv("PLANTED_MARKER") ? getenv("PLANTED_MARKER") : "/dev/null", "w");
    if (f) { fputs("the planted library ran in the user's process", f); fclose(f); }
}
""" + "".join(f"long {name}(void) {{ return 0; }}\n" for name in sorted(build.SYMBOLS))


def plant(path: Path, lib: Path) -> None:
    """``lib`` at ``path`` with a record that matches it, as a planter who can write there would."""
    path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(lib, path)
    data = path.read_bytes()
    cache.write_record(path, data, cache.elf_exports(data), ["cc"])


def record(path: Path) -> dict:
    return json.loads(cache.record_path(path).read_text())


def whole(path: Path) -> bool:
    data = path.read_bytes()
    return hashlib.sha256(data).hexdigest() == record(path)["sha256"] and build.SYMBOLS <= cache.elf_exports(data)


@pytest.mark.parametrize("where", ["cache", "build-folder", "library"])
def test_a_library_planted_where_others_can_write_is_refused_and_never_run(tmp_path, monkeypatch, where):
    """A library with every entry point and a matching record, at this machine's key, in a
    cache folder (or build folder, or file) its group may write: refused in one line naming
    the folder and the variable, as the CLI's exit 2 and as a typed error; its constructor
    never runs."""
    root = tmp_path / "cache"
    path = key_path(root, monkeypatch)
    plant(path, compile_so(tmp_path, "planted", PLANTED))
    target = {"cache": root, "build-folder": path.parent, "library": path}[where]
    target.chmod(target.stat().st_mode | stat.S_IWGRP)
    marker = tmp_path / "marker"
    for proc in (cli(root, PLANTED_MARKER=str(marker)), load(root, PLANTED_MARKER=str(marker))):
        assert not marker.exists(), "the planted library was loaded: its constructor ran"
        message = one_line(proc) if proc.args[1] == "-m" else proc.stdout
        assert str(root) in message and ENV in message and "writable by its group" in message, message
        assert str(target) in message and f"chmod -R go-w {root}" in message, message  # the user's own: theirs to fix
    assert proc.returncode == 2 and proc.stdout.startswith("KernelCacheRefused ")
    from selective_offload import cpu_kernels
    assert issubclass(cpu_kernels.KernelCacheRefused, cpu_kernels.KernelUnavailable)


@pytest.mark.skipif(not AS_ROOT, reason="needs root to make a cache another user owns")
def test_a_cache_another_user_owns_is_refused_and_never_run(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    path = key_path(root, monkeypatch)
    plant(path, compile_so(tmp_path, "planted", PLANTED))
    for p in (root, path.parent, path, cache.record_path(path)):
        os.chown(p, NOBODY, NOBODY)
    marker = tmp_path / "marker"
    message = one_line(cli(root, PLANTED_MARKER=str(marker)))
    assert not marker.exists(), "the planted library was loaded: its constructor ran"
    assert "owned by" in message and str(root) in message and ENV in message and "chmod" not in message


def test_a_truncated_library_is_built_again_not_loaded(tmp_path, monkeypatch):
    """Loading a library cut short kills the process with SIGBUS; it is built again."""
    root = tmp_path / "cache"
    path = built(root, monkeypatch)
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size // 2)
    proc = load(root)
    assert proc.returncode == 0 and proc.stdout.startswith("loaded "), (proc.returncode, proc.stderr[-2000:])
    assert f"is {size // 2} bytes where its build recorded {size}" in proc.stderr
    assert path.stat().st_size == size and whole(path)


def test_a_changed_library_is_built_again(tmp_path, monkeypatch):
    """Same size, other bytes (the compiler's note rewritten): not what the build recorded."""
    root = tmp_path / "cache"
    path = built(root, monkeypatch)
    data = path.read_bytes()
    at = data.index(b"GCC: ") if b"GCC: " in data else len(data) - 8
    path.write_bytes(data[:at] + b"XXXXX" + data[at + 5:])
    proc = cli(root)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "does not match the checksum its build recorded" in proc.stderr
    assert path.read_bytes() == data and whole(path)


@pytest.mark.parametrize("recorded", [True, False], ids=["with-its-record", "without-a-record"])
def test_a_library_without_the_kernels_symbols_is_built_again(tmp_path, monkeypatch, recorded):
    """A valid shared object at the key without the kernel's entry points (loaded, it was a
    traceback): built again, whether a record matches it or none does."""
    root = tmp_path / "cache"
    path = key_path(root, monkeypatch)
    other = compile_so(tmp_path, "other", "int something_else(void) { return 1; }\n")
    path.parent.mkdir(parents=True)
    shutil.copy(other, path)
    if recorded:
        data = path.read_bytes()
        cache.write_record(path, data, cache.elf_exports(data), ["cc"])
    proc = load(root)
    assert proc.returncode == 0 and proc.stdout.startswith("loaded "), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    if recorded:
        assert "lacks the kernel's entry points" in proc.stderr
    assert whole(path)


def test_a_folder_where_the_library_goes_is_built_over(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    path = key_path(root, monkeypatch)
    (path / "inside").mkdir(parents=True)
    proc = load(root)
    assert proc.returncode == 0 and proc.stdout.startswith("loaded "), proc.stderr[-2000:]
    assert "is a folder" in proc.stderr and path.is_file() and whole(path)


def test_a_compiler_that_makes_nothing_is_one_line_and_leaves_nothing(tmp_path):
    """``CC=true`` exits 0 and writes no library: refused, no empty library left behind for
    the next run to trip over, and the next run says the same."""
    root = tmp_path / "cache"
    for _ in range(2):
        message = one_line(cli(root, CC="true"))
        assert "the compiler `true` exited 0 but made an empty file" in message and "set CC" in message
        assert not [p for p in root.rglob("*") if p.is_file()], "nothing of the failed build is left"


def test_cc_is_split_as_build_tools_split_it(tmp_path):
    """``CC="ccache gcc"``: the launcher runs the compiler (a stand-in launcher named ccache,
    that logs its arguments and runs them, where ccache is not installed)."""
    root = tmp_path / "cache"
    bindir = tmp_path / "bin"
    bindir.mkdir()
    log = tmp_path / "launcher.log"
    more = {"CCACHE_DIR": str(tmp_path / "ccache")}
    if shutil.which("ccache") is None:
        launcher = bindir / "ccache"
        launcher.write_text(f'#!/bin/sh\necho "$@" >> "{log}"\nexec "$@"\n')
        launcher.chmod(0o755)
        more["PATH"] = f"{bindir}{os.pathsep}{os.environ['PATH']}"
    compiler = "gcc" if shutil.which("gcc") else "cc"
    proc = cli(root, CC=f"ccache {compiler}", **more)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"(ccache {compiler} -O3" in proc.stderr
    path = Path(proc.stdout.strip().split(": ", 1)[1])
    assert whole(path)
    if log.exists():
        assert any(line.startswith(f"{compiler} -O3 -march=native") for line in log.read_text().splitlines())


def _read_only(root: Path) -> None:
    for p in sorted(root.rglob("*"), reverse=True) + [root]:
        p.chmod(p.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))


def _listing(root: Path) -> list:
    return sorted((str(p), p.stat().st_mode, p.stat().st_size) for p in root.rglob("*"))


@pytest.fixture
def shared_root(tmp_path):
    """A folder another user can reach (pytest's own tmp folders are its user's alone), and
    who that user is: as root, ``NOBODY``; else the user running the suite, the cache made
    read-only to them."""
    if not AS_ROOT:
        yield tmp_path, None
        return
    if other_python() is None:
        pytest.skip("as root, no interpreter with torch that another user (nobody) can run")
    top = Path(tempfile.mkdtemp(prefix="so-kernel-cache-"))
    top.chmod(0o755)
    try:
        yield top, NOBODY
    finally:
        for p in [top, *top.rglob("*")]:
            if p.is_dir() and not p.is_symlink():
                p.chmod(0o755)
        shutil.rmtree(top)


def test_a_read_only_cache_prebuilt_by_root_or_another_user_is_used(shared_root, monkeypatch):
    """Built (by root, under umask 077, where root runs the suite) and made read-only, the
    cache serves a user who cannot write it: loaded, nothing written."""
    top, user = shared_root
    root = top / "cache"
    old = os.umask(0o077)
    try:
        built(root, monkeypatch)
    finally:
        os.umask(old)
    _read_only(root)
    before = _listing(root)
    proc = load(root, user=user)
    assert proc.returncode == 0 and proc.stdout.startswith("loaded "), proc.stdout + proc.stderr[-2000:]
    assert proc.stderr == "" and _listing(root) == before


def test_a_damaged_build_in_a_cache_the_user_cannot_write_is_one_line(shared_root, monkeypatch):
    """Never a traceback, a SIGBUS, or advice to delete a file the user cannot delete."""
    top, user = shared_root
    root = top / "cache"
    path = built(root, monkeypatch)
    with open(path, "r+b") as f:
        f.truncate(100)
    _read_only(root)
    message = one_line(cli(root, user=user))
    assert str(path.parent) in message and ENV in message and "cannot be written by this user" in message
    assert "delete" not in message.lower()


def _no_compiler(tmp_path: Path) -> dict:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    os.symlink(sys.executable, bindir / "python")
    return {"PATH": str(bindir)}


def test_a_user_without_a_compiler_loads_a_build_made_here_for_this_cpu(tmp_path, monkeypatch):
    """Someone with a compiler (root at install) built the cache; a user with none (no cc,
    no gcc on PATH) loads that build, checked; a build of other flags is not taken."""
    root = tmp_path / "cache"
    monkeypatch.setenv(ENV, str(root))
    monkeypatch.delenv("CC", raising=False)
    other = build.build(("-DSO_NO_SIMD",), quiet=True)
    message = one_line(cli(root, **_no_compiler(tmp_path)))
    assert "no C compiler" in message and list(root.iterdir()) == [other.parent]
    path = build.build(quiet=True)
    proc = cli(root, PATH=str(tmp_path / "bin"))
    assert proc.returncode == 0 and proc.stdout == f"host-compute CPU kernels: {path}\n", proc.stderr[-2000:]
    assert proc.stderr == ""


def test_processes_building_at_once_compile_once_and_each_loads_a_whole_build(tmp_path):
    """Three engines starting together on an empty cache: one compiles, under the build
    folder's lock; the others wait for it and load its build (the record matches)."""
    root = tmp_path / "cache"
    env = _env(root)
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(LOAD)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env, cwd=REPO) for _ in range(3)]
    done = [(p.wait(timeout=300), p.stdout.read(), p.stderr.read()) for p in procs]
    for rc, out, err in done:
        assert rc == 0 and out.startswith("loaded "), (rc, out, err[-2000:])
    assert sum(err.count("compiling the host-compute CPU kernels") for _, _, err in done) == 1
    (path,) = root.glob(f"*/{build.LIBRARY}")
    assert whole(path)
