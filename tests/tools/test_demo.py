"""The README's first command, `selective-offload demo`, as a user's first run sees it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

#: What the suite's own fixtures (tests/conftest.py) point at its temporary folders: kept in
#: the demo's environment, so the demo writes no file of the user's.
SUITE_REDIRECTIONS = ("SELECTIVE_OFFLOAD_LAST_REPORT", "SELECTIVE_OFFLOAD_PROFILE", "SELECTIVE_OFFLOAD_KERNEL_CACHE")


def demo_env() -> dict[str, str]:
    """The environment a user's first run has (no plan, no vLLM settings of the suite's),
    less nothing the suite set to keep its files out of ``~/.cache``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SELECTIVE_OFFLOAD_", "VLLM_"))}
    env.update({k: os.environ[k] for k in SUITE_REDIRECTIONS if k in os.environ})
    return env


def test_the_demo_keeps_the_suites_redirections():
    """The suite set each of them (a run without them would write the user's files)."""
    env = demo_env()
    assert all(env.get(k) == os.environ[k] for k in SUITE_REDIRECTIONS)
    home_cache = str(Path.home() / ".cache" / "selective-offload")
    assert not any(env[k].startswith(home_cache) for k in SUITE_REDIRECTIONS)


def test_the_demo_runs_cleanly_and_matches_plain_vllm(tmp_path):
    """Two spawned engines (plan applied by the plugin, then plain vLLM); a successful run
    prints the plan, the report and text, and no traceback."""
    exe = Path(sys.executable).with_name("selective-offload")
    assert exe.is_file(), f"the selective-offload console script is not installed beside {sys.executable}"
    record = Path.home() / ".cache" / "selective-offload" / "last-report"
    before = record.stat().st_mtime_ns if record.exists() else None
    out = subprocess.run([exe, "demo", "--workdir", str(tmp_path)], env=demo_env(), capture_output=True,
                         text=True, timeout=600)
    output = out.stdout + out.stderr
    assert out.returncode == 0, output[-3000:]
    assert "Traceback" not in output and "WARNING" not in output, output
    lines = out.stdout.splitlines()
    # each section's verdict first: the plan's (no tok/s for a model this small), then the report's
    plan_at = next(i for i, line in enumerate(lines) if line.startswith("== plan for "))
    assert lines[plan_at + 1].startswith("the demo's tiny Qwen3 on a ") and ": fits with " in lines[plan_at + 1]
    assert lines[plan_at + 1].endswith(" on the host")  # no strategy word
    assert "no tok/s" in out.stdout and not re.search(r"\d\s*tok/s|tok/s\s+\d|speed-up", out.stdout)
    assert "They ignore" not in out.stdout
    report_at = lines.index("== landing report (from the engine's worker process)")
    assert lines[report_at + 1] == "placement matches the plan"
    assert "built on the host: 1.0 MB, moved after loading: 0 B" in out.stdout
    texts = [line for line in out.stdout.splitlines() if line.startswith("  'baba bebe bibi bobo' -> '")]
    assert len(texts) == 1 and len(texts[0].split("-> ")[1].split()) == 12
    assert out.stdout.rstrip().endswith("outputs identical to plain vLLM: yes")
    # the report path went to the suite's record, never the user's
    assert (record.stat().st_mtime_ns if record.exists() else None) == before
    assert Path(os.environ["SELECTIVE_OFFLOAD_LAST_REPORT"]).is_file()
