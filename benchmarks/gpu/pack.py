"""A GPU run's results packed to leave the GPU machine, and back into the tree.

Why a module of its own: a run's results leave the GPU machine most easily as a few files
with plain names in one flat folder. ``pack`` folds a run's results into one archive
beside its summary and log, and ``import_results`` copies a returned run's JSON and Markdown into ``benchmarks/results/``
(``python -m benchmarks.gpu --import``). The driver calls these; they know nothing of its sections.
"""

from __future__ import annotations

import re
import tarfile
from pathlib import Path
from typing import Callable

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
            p.unlink()
    left = sorted(p.name for p in out.iterdir())
    log(f"packed {len(files)} files into {tar_path.name}; {out} holds {', '.join(left)}")
    return left


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
