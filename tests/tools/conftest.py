import json
import os
import subprocess
import sys
import tarfile

import pytest

from helpers import REPO


@pytest.fixture(scope="session")
def small_run(tmp_path_factory):
    """One `bash benchmarks/gpu_run.sh --small --pack` into a temporary directory: the
    folder, its summary and its output. Tests of a section's --small/--smoke output read it
    from here rather than run the section again."""
    out = tmp_path_factory.mktemp("gpu-run")
    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("OUT", None)
    proc = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_run.sh"), "--small", "--pack", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    summary_path = next(out.glob("gpu-run-*-small.json"))
    return out, json.loads(summary_path.read_text()), proc.stdout


@pytest.fixture(scope="session")
def small_run_files(small_run, tmp_path_factory):
    """The sections' own files of :func:`small_run`, unpacked into a folder of their own."""
    out, summary, _ = small_run
    files = tmp_path_factory.mktemp("gpu-run-files")
    with tarfile.open(out / f"{summary['stem']}.tar.gz") as tar:
        tar.extractall(files, filter="data")
    return files
