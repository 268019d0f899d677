"""`selective-offload report` run as a user runs it: a subprocess of the CLI on report files
written the way the engine's worker ranks write them (PlacementReport.save, rank files)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from selective_offload.options import RunOptions
from selective_offload.report import GroupLanding, PlacementReport, rank_path
from helpers import REPO

ROOT = REPO


def run_cli(*args, env=None):
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               **(env or {})}
    return subprocess.run([sys.executable, "-m", "selective_offload.cli", *args], capture_output=True,
                          text=True, env=environ, timeout=120)


def a_report(problems=()) -> PlacementReport:
    groups = [GroupLanding("model.embed_tokens", "host_cold", "host_cold", 2048, host_bytes=2048,
                           routed_bytes=2048, num_params=1, mechanism="host gather"),
              GroupLanding("model.layers.0", "device", "device", 4096, device_bytes=4096, num_params=3)]
    return PlacementReport("fp", "cuda:0", False, groups, planned_host_cold_bytes=2048,
                           loaded_host_cold_bytes=2048, landed_host_cold_bytes=2048, problems=list(problems))


def test_report_renders_and_exits_0_when_the_placement_matches(tmp_path):
    a_report().save(tmp_path / "report.json")
    proc = run_cli("report", str(tmp_path / "report.json"))
    assert proc.returncode == 0, proc.stderr
    assert "model.embed_tokens" in proc.stdout and "host gather" in proc.stdout
    assert proc.stdout.rstrip().endswith("placement matches the plan")


def test_report_merges_rank_files_and_exits_1_when_a_rank_misplaced(tmp_path):
    """Rank 0 is fine, rank 1 is not: the merged verdict is rank 1's, as the engine's."""
    path = tmp_path / "report.json"
    a_report().save(rank_path(path, 0))
    a_report(["1 kB of cold bytes did not land where planned"]).save(rank_path(path, 1))
    proc = run_cli("report", str(path))
    assert proc.returncode == 1, proc.stderr
    assert "PLAN NOT REALISED: rank1: 1 kB of cold bytes did not land where planned" in proc.stdout
    assert "placement does NOT match the plan" in proc.stdout
    as_json = run_cli("report", str(path), "--json")
    assert as_json.returncode == 1
    data = json.loads(as_json.stdout)
    assert data["ok"] is False and data["ranks"]["rank1"]["ok"] is False and data["path"] == str(path)


def test_a_load_stopped_by_a_user_error_exits_1(tmp_path):
    PlacementReport.failed("the plan is for another model", None, "cuda:0").save(tmp_path / "report.json")
    proc = run_cli("report", str(tmp_path / "report.json"))
    assert proc.returncode == 1 and "PLAN NOT APPLIED: the plan is for another model" in proc.stdout


def test_report_defaults_to_the_path_the_plugin_recorded(tmp_path, monkeypatch):
    """The plugin's default report file is in a new temporary directory per run; setting the
    options up records it, and `report` without a path reads that record."""
    record = tmp_path / "last-report"
    env = {"SELECTIVE_OFFLOAD_LAST_REPORT": str(record), "SELECTIVE_OFFLOAD_REPORT": ""}
    monkeypatch.setenv("SELECTIVE_OFFLOAD_LAST_REPORT", str(record))
    options = RunOptions("plan.json").with_default_report()
    assert record.read_text().strip() == options.report_path
    not_yet = run_cli("report", env=env)
    assert not_yet.returncode == 2 and "no placement report there yet" in not_yet.stderr
    a_report().save(options.report_path)
    proc = run_cli("report", env=env)
    assert proc.returncode == 0 and proc.stdout.startswith(f"{options.report_path}:"), proc.stderr
    # A report file named in this shell's environment wins over the record.
    named = tmp_path / "named.json"
    a_report(["x"]).save(named)
    assert run_cli("report", env={**env, "SELECTIVE_OFFLOAD_REPORT": str(named)}).returncode == 1


@pytest.mark.parametrize("case", ["missing", "not a report", "no record"])
def test_bad_input_is_one_line_and_exit_2(tmp_path, case):
    args, env = ["report", str(tmp_path / "nope.json")], {}
    if case == "not a report":
        (tmp_path / "nope.json").write_text('{"format": "something else"}')
    if case == "no record":
        args = ["report"]
        env = {"SELECTIVE_OFFLOAD_LAST_REPORT": str(tmp_path / "absent"), "SELECTIVE_OFFLOAD_REPORT": ""}
    proc = run_cli(*args, env=env)
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1 and proc.stderr.startswith("selective-offload: error: ")
    assert "Traceback" not in proc.stderr
