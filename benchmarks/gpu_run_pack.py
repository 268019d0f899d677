"""A GPU run's results packed to leave the GPU machine, and back into the tree.

Why a module of its own: a run's results should leave the GPU machine as a few small files
with plain names in one flat folder (at most 8 files of at most 16 MiB each: easy to copy
by hand, to keep as a batch job's output or a CI artifact). ``pack`` folds a run's results into one archive
beside its summary and log, ``check_returnable`` says what would not come back, and
``import_results`` copies a returned run's JSON and Markdown into ``benchmarks/results/``
(``gpu_run.py --import``). The driver calls these; they know nothing of its sections.
"""

from __future__ import annotations

import re
import tarfile
from pathlib import Path
from typing import Callable

#: At most this many files, each at most this size, are left in $OUT: a run's results travel as a few
#: small files (a summary, its Markdown, the console log, one archive of every section's output).
RETURN_LIMITS = {"files": 8, "file_bytes": 16 << 20}
SAFE_NAME = re.compile(r"^[A-Za-z0-9._-]+$")


def pack(out: Path, stem: str, log: Callable[[str], None]) -> list[str]:
    """One .tar.gz of every file in ``out``; then only it, the summary and the log stay."""
    keep = {f"{stem}.json", f"{stem}.md", f"{stem}.log"}
    tar_path = out / f"{stem}.tar.gz"
    files = sorted(p for p in out.iterdir() if p.is_file() and p != tar_path)
    with tarfile.open(tar_path, "w:gz") as tar:
        for p in files:
            tar.add(p, arcname=p.name)
    for p in files:
        if p.name not in keep:
            # mutation: gpu-run-pack-keeps-all
            p.unlink()
    left = sorted(p.name for p in out.iterdir())
    log(f"packed {len(files)} files into {tar_path.name}; {out} holds {', '.join(left)}")
    return left


def check_returnable(out: Path) -> list[str]:
    """What breaks the packed form's rules (too many files, too large, odd names)."""
    files = [p for p in out.rglob("*") if p.is_file()]
    problems = [f"{len(files)} files, more than {RETURN_LIMITS['files']}"] if len(files) > RETURN_LIMITS["files"] else []
    problems += [f"{p.name}: {p.stat().st_size} bytes, over 16 MiB" for p in files
                 if p.stat().st_size > RETURN_LIMITS["file_bytes"]]
    problems += [f"{p.name}: a name with characters other than letters, digits, '.', '_', '-'" for p in files
                 if not SAFE_NAME.match(p.name)]
    return problems


def import_results(path: Path, results: Path) -> list[str]:
    """Copy the JSON and Markdown of a packed run (or a results directory) into ``results``."""
    copied = []
    results.mkdir(parents=True, exist_ok=True)
    if path.is_dir():
        tars = sorted(path.glob("gpu-run-*.tar.gz"))
        if tars:
            return import_results(tars[-1], results)
        for p in sorted(path.iterdir()):
            if p.is_file() and p.suffix in (".json", ".md") and SAFE_NAME.match(p.name):
                (results / p.name).write_bytes(p.read_bytes())
                copied.append(p.name)
        return copied
    with tarfile.open(path, "r:*") as tar:
        for m in tar.getmembers():
            name = m.name
            if m.isfile() and "/" not in name and SAFE_NAME.match(name) and name.endswith((".json", ".md")):
                (results / name).write_bytes(tar.extractfile(m).read())
                copied.append(name)
    return copied
