"""The README's first command, `selective-offload demo`, as a user's first run sees it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm


def test_the_demo_runs_cleanly_and_matches_plain_vllm(tmp_path):
    """Two spawned engines (plan applied by the plugin, then plain vLLM); a successful run
    prints the plan, the report and text, and no traceback."""
    exe = Path(sys.executable).with_name("selective-offload")
    assert exe.is_file(), f"the selective-offload console script is not installed beside {sys.executable}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SELECTIVE_OFFLOAD_", "VLLM_"))}
    out = subprocess.run([exe, "demo", "--workdir", str(tmp_path)], env=env, capture_output=True,
                         text=True, timeout=600)
    output = out.stdout + out.stderr
    assert out.returncode == 0, output[-3000:]
    assert "Traceback" not in output and "WARNING" not in output, output
    assert "strategy  cold_offload" in out.stdout
    assert "placement matches the plan" in out.stdout
    assert "built on the host: 1.0 MB, moved after loading: 0 B" in out.stdout
    texts = [line for line in out.stdout.splitlines() if line.startswith("  'baba bebe bibi bobo' -> '")]
    assert len(texts) == 1 and len(texts[0].split("-> ")[1].split()) == 12
    assert out.stdout.rstrip().endswith("outputs identical to plain vLLM: yes")
