"""Building the kernel: a missing or broken compiler is one line (and unavailable_reason
says it), the cache key follows the source, builds land atomically in the cache folder,
and the library shares torch's OpenMP runtime."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

from helpers import REPO
from selective_offload.cpu_kernels import build


def python(code: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=300)


REASONS = """
    import json, sys
    from selective_offload import cpu_kernels as ck
    print(json.dumps({f: ck.unavailable_reason(f) for f in ck.FORMATS}))
    try:
        ck.library()
    except ck.KernelUnavailable as e:
        print(json.dumps(str(e)))
"""


@pytest.mark.parametrize("how", ["no-cc-on-path", "bogus-CC"])
def test_no_compiler_is_one_line_naming_what_to_install(tmp_path, how):
    env = {**os.environ, "SELECTIVE_OFFLOAD_KERNEL_CACHE": str(tmp_path / "cache")}
    if how == "no-cc-on-path":
        bindir = tmp_path / "bin"
        bindir.mkdir()
        os.symlink(sys.executable, bindir / "python")
        env["PATH"] = str(bindir)
        env.pop("CC", None)
    else:
        env["CC"] = "no-such-compiler-xyz"
    proc = python(REASONS, env)
    assert proc.returncode == 0, proc.stderr
    reasons = json.loads(proc.stdout.splitlines()[0])
    message = json.loads(proc.stdout.splitlines()[1])
    for fmt in ("bf16", "mxfp4", "fp8-block", "int4"):
        assert reasons[fmt] == message
    assert "\n" not in message and "served uva" in message and "apt-get install gcc" in message
    assert ("no C compiler" in message) if how == "no-cc-on-path" else ("CC='no-such-compiler-xyz'" in message)
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("*.so"))
    cli = subprocess.run([sys.executable, "-m", "selective_offload.cpu_kernels", "build"], capture_output=True,
                         text=True, env=env, cwd=REPO, timeout=300)
    assert cli.returncode == 2 and cli.stderr.count("\n") == 1 and "Traceback" not in cli.stderr


def test_a_compile_that_fails_is_one_line(tmp_path):
    fake = tmp_path / "cc"
    fake.write_text("#!/bin/sh\nif [ \"$1\" = --version ]; then echo fake-cc 1.0; exit 0; fi\n"
                    "echo 'moe.c:1:1: error: this compiler refuses everything' >&2; exit 1\n")
    fake.chmod(0o755)
    env = {**os.environ, "SELECTIVE_OFFLOAD_KERNEL_CACHE": str(tmp_path / "cache"), "CC": str(fake)}
    proc = python(REASONS, env)
    assert proc.returncode == 0, proc.stderr
    message = json.loads(proc.stdout.splitlines()[1])
    assert "failed" in message and "refuses everything" in message and "\n" not in message
    assert not list((tmp_path / "cache").rglob("*tmp*")), "the failed build's temporary file is removed"


def test_the_cache_key_follows_source_flags_compiler_and_cpu():
    base = build.cache_key("int x;", build.FLAGS, "gcc 12", "flags : avx2")
    assert base == build.cache_key("int x;", build.FLAGS, "gcc 12", "flags : avx2")
    others = {build.cache_key("int y;", build.FLAGS, "gcc 12", "flags : avx2"),
              build.cache_key("int x;", build.FLAGS + ("-DX",), "gcc 12", "flags : avx2"),
              build.cache_key("int x;", build.FLAGS, "gcc 13", "flags : avx2"),
              build.cache_key("int x;", build.FLAGS, "gcc 12", "flags : avx2 avx512f")}
    assert base not in others and len(others) == 4


def test_an_edited_source_builds_into_its_own_folder(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("SELECTIVE_OFFLOAD_KERNEL_CACHE", str(cache))
    first = build.build(quiet=True)
    source = tmp_path / "moe.c"
    source.write_text(build.SOURCE.read_text() + "\nint so_edited_marker(void) { return 7; }\n")
    monkeypatch.setattr(build, "SOURCE", source)
    second = build.build(quiet=True)
    assert first.parent != second.parent and first.parent.parent == second.parent.parent == cache
    assert first.name == second.name == "libso_cpu_kernels.so"
    left = [p for p in cache.rglob("*") if p.is_file() and p.name not in (build.LIBRARY, build.LIBRARY + ".record.json")]
    assert not left, "no temporary file left"
    assert build.build(quiet=True) == second  # built once


def test_an_edited_part_builds_into_its_own_folder_and_is_compiled(tmp_path, monkeypatch):
    """moe.c includes its row kernels from parts beside it: editing one is a new build,
    and the build compiles the edited part (its new symbol is in the library)."""
    import ctypes

    monkeypatch.setenv("SELECTIVE_OFFLOAD_KERNEL_CACHE", str(tmp_path / "cache"))
    first = build.build(quiet=True)
    src = tmp_path / "src"
    src.mkdir()
    for part in [build.SOURCE, *build.PARTS.glob("*.h")]:
        shutil.copy(part, src / part.name)
    assert (src / "rows_int8.h").is_file()
    with open(src / "rows_int8.h", "a") as f:
        f.write("\nint so_edited_part(void) { return 11; }\n")
    monkeypatch.setattr(build, "SOURCE", src / "moe.c")
    monkeypatch.setattr(build, "PARTS", src)
    second = build.build(quiet=True)
    assert second.parent != first.parent
    assert ctypes.CDLL(str(second)).so_edited_part() == 11


def test_the_kernel_adds_no_openmp_runtime_and_binds_to_torchs():
    """In a process of torch alone, loading the kernel maps no OpenMP runtime beside
    torch's own (the kernel's threads are torch's pool). Run apart: in this process other
    libraries (sentencepiece, imported by vLLM's tokenizers) map runtimes of their own."""
    code = ("import os, torch\n"
            "from selective_offload.cpu_kernels import build, library\n"
            "before = build.openmp_runtimes()\n"
            "library()\n"
            "after = build.openmp_runtimes()\n"
            "assert after == before and len(after) == 1, (before, after)\n"
            "assert os.path.dirname(torch.__file__) in after[0], after\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_build_command_compiles_once_and_prints_where(tmp_path):
    env = {**os.environ, "SELECTIVE_OFFLOAD_KERNEL_CACHE": str(tmp_path)}
    cmd = [sys.executable, "-m", "selective_offload.cpu_kernels", "build"]
    first = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert first.returncode == 0, first.stderr
    path = first.stdout.strip().split(": ", 1)[1]
    assert os.path.isfile(path) and path.startswith(str(tmp_path))
    assert first.stderr.count("compiling the host-compute CPU kernels once") == 1
    again = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert again.returncode == 0 and again.stderr == "" and again.stdout == first.stdout


@pytest.mark.skipif(shutil.which("objdump") is None, reason="objdump (binutils) is not installed to read the build")
def test_the_avx2_int8_path_uses_avx_vnni_where_the_cpu_has_it():
    """The AVX2 build's MXFP4 and int4 rows make their four-product sums with one vpdpbusd
    on 256 bits where the CPU has AVX-VNNI (Intel since Alder Lake), else with vpmaddubsw
    and vpmaddwd. This CPU may have neither that build nor that instruction, so both are
    compiled for it and read, not run (the kernel tests run the one this CPU has)."""
    def instructions(*flags: str) -> str:
        path = build.build(("-mno-avx512f", *flags), quiet=True)
        return subprocess.run(["objdump", "-d", str(path)], capture_output=True, text=True, check=True).stdout

    with_vnni, without = instructions("-mavxvnni"), instructions("-mno-avxvnni")
    assert re.search(r"vpdpbusd.*%ymm", with_vnni)
    assert not re.search(r"vpdpbusd", without) and re.search(r"vpmaddubsw.*%ymm", without)
