"""vLLM's pure-Python sources for a release this machine cannot install (no vLLM import).

The CUDA release of vLLM (``vllm==0.33.0``) cannot be installed beside the CPU build
the tests run, but its wheel's ``.py`` modules import beside the CPU torch (without the
compiled parts), which is enough to check the contract the glue relies on
(``tests/contract/check_vllm_contract.py``). This fetches the wheel once per machine,
with pip, into a cache, and extracts ``vllm/**/*.py`` into ``<cache>/src``.

Cache: ``~/.cache/selective-offload/vllm-<version>/`` (``SELECTIVE_OFFLOAD_VLLM_CACHE``
names another base directory; the ``vllm-<version>`` folder goes under it). It holds

- the wheel, as pip saved it (kept, so a lost extraction is redone without the network;
  pip's own HTTP cache is bypassed, so the wheel is not stored twice);
- ``src/vllm/...``, the extracted modules;
- ``src.complete``, written last: without it ``src`` is half-made and is extracted
  again, never used.

A wheel downloaded elsewhere is reused only by putting it in the cache directory.

Library: ``ensure_vllm_sources("0.33.0") -> (Path to src, None)`` or ``(None, reason)``
with a one-line reason (no network, pip's error, a broken wheel). CLI: prints the src
path on success (exit 0), the reason on stderr otherwise (exit 1)::

    python scripts/vllm_sources.py [--version 0.33.0] [--cache-dir DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import Callable, Iterator

ENV_CACHE = "SELECTIVE_OFFLOAD_VLLM_CACHE"
DEFAULT_VERSION = "0.33.0"
STAMP = "src.complete"
#: Importing the modules the contract checks read needs no package data: only ``.py``
#: files are extracted (checked by tests/contract/check_vllm_contract.py, which imports
#: everything it checks from the extracted tree).
EXTRACT_SUFFIXES = (".py",)


def cache_dir_for(version: str, base: str | os.PathLike | None = None) -> Path:
    """Where ``version``'s wheel and sources live."""
    if base is None:
        base = os.environ.get(ENV_CACHE) or Path.home() / ".cache" / "selective-offload"
    return Path(base).expanduser() / f"vllm-{version}"


_NETWORK = re.compile(r"\[Errno -?\d+\] [^\"')]+|Name or service not known|Network is unreachable|"
                      r"timed out|SSLError|ProxyError")


def _one_line(text: str) -> str:
    """What went wrong, from pip's output: its last ERROR line (else its last line), and
    the connection error behind it when the index could not be reached."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("ERROR:")]
    line = errors[-1] if errors else lines[-1] if lines else "no output"
    network = _NETWORK.search(text)
    if network:
        line += f" (the package index could not be reached: {network.group(0).strip()})"
    return line[:300]


@contextlib.contextmanager
def _locked(cache: Path) -> Iterator[None]:
    """One fetch/extraction per cache at a time, across processes."""
    with open(cache / ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _wheels(cache: Path, version: str) -> list[Path]:
    return sorted(cache.glob(f"vllm-{version}-*.whl"))


def _usable_wheel(cache: Path, version: str) -> Path | None:
    """A complete wheel already in the cache (a truncated one is removed)."""
    for wheel in _wheels(cache, version):
        try:
            with zipfile.ZipFile(wheel) as zf:
                if f"vllm-{version}.dist-info/RECORD" in zf.namelist():
                    return wheel
        except (zipfile.BadZipFile, OSError):
            pass
        wheel.unlink(missing_ok=True)
    return None


def _download(cache: Path, version: str, log: Callable[[str], None]) -> tuple[Path | None, str | None]:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--progress-bar", "off", "--retries", "2", "--no-cache-dir", f"vllm=={version}", "-d", str(cache)]
    log(f"vllm_sources: fetching vllm=={version}'s wheel (a few hundred MB; 336 MB for 0.33.0) "
        f"into {cache} with pip ...")
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    except subprocess.TimeoutExpired:
        return None, f"pip download vllm=={version} did not finish in 30 minutes"
    except OSError as exc:
        return None, f"cannot run pip ({exc})"
    if proc.returncode != 0:
        return None, f"pip download vllm=={version} failed: {_one_line(proc.stderr or proc.stdout)}"
    wheel = _usable_wheel(cache, version)
    if wheel is None:
        return None, f"pip download vllm=={version} saved no complete vllm-{version}-*.whl in {cache}"
    took = time.monotonic() - start
    log(f"vllm_sources: fetched {wheel.name} ({wheel.stat().st_size / 1e6:.0f} MB) in {took:.1f} s")
    return wheel, None


def _extract(wheel: Path, cache: Path) -> int:
    """Extract ``vllm/**/*.py`` into ``cache/src`` (via a temporary folder); return the count."""
    tmp = cache / f"src.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    count = 0
    with zipfile.ZipFile(wheel) as zf:
        for info in zf.infolist():
            name = info.filename
            if info.is_dir() or not name.startswith("vllm/") or not name.endswith(EXTRACT_SUFFIXES):
                continue
            if ".." in Path(name).parts:
                continue
            zf.extract(info, tmp)
            count += 1
    src = cache / "src"
    shutil.rmtree(src, ignore_errors=True)
    tmp.rename(src)
    return count


def ensure_vllm_sources(version: str = DEFAULT_VERSION, *, cache_dir: str | os.PathLike | None = None,
                        log: Callable[[str], None] | None = None) -> tuple[Path | None, str | None]:
    """``(src, None)`` with ``src/vllm`` importable, or ``(None, one-line reason)``.

    ``cache_dir`` is the base directory (default: ``$SELECTIVE_OFFLOAD_VLLM_CACHE`` or
    ``~/.cache/selective-offload``); ``log`` gets the progress lines (default: stderr).
    """
    if log is None:
        def log(line: str) -> None:
            print(line, file=sys.stderr, flush=True)
    cache = cache_dir_for(version, cache_dir)
    src, stamp = cache / "src", cache / STAMP
    try:
        cache.mkdir(parents=True, exist_ok=True)
        with _locked(cache):
            if stamp.is_file() and (src / "vllm" / "__init__.py").is_file():
                return src, None
            stamp.unlink(missing_ok=True)  # whatever is in src/ is not known to be whole
            wheel = _usable_wheel(cache, version)
            if wheel is None:
                wheel, reason = _download(cache, version, log)
                if wheel is None:
                    return None, reason
            count = _extract(wheel, cache)
            if not (src / "vllm" / "__init__.py").is_file():
                return None, f"{wheel.name} has no vllm/__init__.py"
            stamp.write_text(json.dumps({"wheel": wheel.name, "files": count}) + "\n")
            return src, None
    except (OSError, zipfile.BadZipFile) as exc:
        return None, f"cannot prepare vLLM {version}'s sources in {cache}: {exc}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", default=DEFAULT_VERSION, help="vLLM release (default %(default)s)")
    parser.add_argument("--cache-dir", default=None,
                        help=f"base cache directory (default: ${ENV_CACHE} or ~/.cache/selective-offload)")
    args = parser.parse_args(argv)
    src, reason = ensure_vllm_sources(args.version, cache_dir=args.cache_dir)
    if src is None:
        print(f"vllm_sources: {reason}", file=sys.stderr)
        return 1
    print(src)
    return 0


if __name__ == "__main__":
    sys.exit(main())
