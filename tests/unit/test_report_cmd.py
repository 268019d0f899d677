"""`selective-offload report` run as a user runs it: a subprocess of the CLI on report files
written the way the engine's worker ranks write them (LandingReport.save, rank files)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest

from helpers import REPO
from selective_offload.cli import main
from selective_offload.options import RunOptions
from selective_offload.report import GroupLanding, LandingReport, rank_path
from selective_offload.vllm_glue.session import save_report

ROOT = REPO


def run_cli(*args, env=None, real=False):
    """``selective-offload ARGS`` with ``env`` added to the environment: ``real``, in a
    subprocess as a user runs it (a hang is bounded by its timeout); else ``cli.main`` in
    this process, its exit code and output read the same way (no interpreter start-up)."""
    if real:
        environ = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
                   **(env or {})}
        return subprocess.run([sys.executable, "-m", "selective_offload.cli", *args], capture_output=True,
                              text=True, env=environ, timeout=120)
    out, err = io.StringIO(), io.StringIO()
    with mock.patch.dict(os.environ, env or {}), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def a_report(problems=()) -> LandingReport:
    groups = [GroupLanding("model.embed_tokens", "gather", "gather", 2048, host_bytes=2048,
                           routed_bytes=2048, num_params=1, mechanism="host gather"),
              GroupLanding("model.layers.0", "device", "device", 4096, device_bytes=4096, num_params=3)]
    return LandingReport("fp", "cuda:0", False, groups, planned_cold_on_host_bytes=2048,
                           loaded_cold_on_host_bytes=2048, landed_cold_on_host_bytes=2048, problems=list(problems))


def test_report_renders_and_exits_0_when_the_placement_matches(tmp_path):
    a_report().save(tmp_path / "report.json")
    proc = run_cli("report", str(tmp_path / "report.json"), real=True)
    assert proc.returncode == 0, proc.stderr
    assert "model.embed_tokens" in proc.stdout and "host gather" in proc.stdout
    lines = proc.stdout.splitlines()
    assert lines[0] == "placement matches the plan"  # the verdict first, then whose report it is
    assert str(tmp_path / "report.json") in lines[1]


def test_report_merges_rank_files_and_exits_1_when_a_rank_misplaced(tmp_path):
    """Rank 0 is fine, rank 1 is not: the merged verdict is rank 1's, as the engine's."""
    path = tmp_path / "report.json"
    a_report().save(rank_path(path, 0))
    a_report(["1 kB of cold bytes did not land where planned"]).save(rank_path(path, 1))
    proc = run_cli("report", str(path))
    assert proc.returncode == 1, proc.stderr
    assert "PLAN NOT REALISED: rank1: 1 kB of cold bytes did not land where planned" in proc.stdout
    assert proc.stdout.splitlines()[0].startswith("placement does NOT match the plan (1 problem below)")
    as_json = run_cli("report", str(path), "--json")
    assert as_json.returncode == 1
    data = json.loads(as_json.stdout)
    assert data["ok"] is False and data["ranks"]["rank1"]["ok"] is False and data["path"] == str(path)


def test_a_load_stopped_by_a_user_error_exits_1(tmp_path):
    LandingReport.failed("the plan is for another model", None, "cuda:0").save(tmp_path / "report.json")
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
    assert not_yet.returncode == 2 and "no landing report there yet" in not_yet.stderr
    a_report().save(options.report_path)
    proc = run_cli("report", env=env)
    assert proc.returncode == 0 and f"landing report {options.report_path} " in proc.stdout.splitlines()[1], (
        proc.stderr)
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


# --------------------------------------------------------------------------- hostile report files (issue 29)


def one_line_error(proc) -> str:
    """The one line of a refused input (exit 2, nothing on stdout, no traceback)."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert proc.stdout == "" and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("selective-offload: error: "), proc.stderr
    return lines[0]


def test_a_report_field_of_another_type_is_exit_2_in_text_and_in_json(tmp_path):
    """A group's byte count written as a string crashed the table with exit 1 (the "does not
    match" status) while --json said "ok": true; both are one line and exit 2 now."""
    path = tmp_path / "report.json"
    a_report().save(path)
    data = json.loads(path.read_text())
    data["groups"][0]["host_bytes"] = "2048"
    path.write_text(json.dumps(data))
    for args in (["report", str(path)], ["report", str(path), "--json"]):
        line = one_line_error(run_cli(*args))
        assert str(path) in line and "groups[0].host_bytes" in line and "must be an integer" in line


def written_by_ranks(path: Path, ranks, world_size) -> None:
    for k in ranks:
        report = a_report()
        report.world_size = world_size
        report.save(rank_path(path, k))


def test_a_missing_rank_is_named_and_the_placement_does_not_match(tmp_path):
    """Ranks 0, 1 and 3 of four wrote a report, rank 2 none: that is not "matches the plan"."""
    path = tmp_path / "report.json"
    written_by_ranks(path, (0, 1, 3), 4)
    proc = run_cli("report", str(path))
    assert proc.returncode == 1, proc.stderr
    assert ("PLAN NOT REALISED: rank 2 of the world of 4 wrote no report (report.json.rank2 is missing)"
            in proc.stdout)
    assert proc.stdout.startswith("placement does NOT match the plan (1 problem below)\n")
    data = json.loads(run_cli("report", str(path), "--json").stdout)
    assert data["ok"] is False and any("rank 2" in p for p in data["problems"])


def test_a_rank_file_with_a_leading_zero_is_named_as_a_duplicate(tmp_path):
    """``.rank01`` beside ``.rank1`` (a copy, a stale file) is rank 1 twice: named, not merged silently."""
    path = tmp_path / "report.json"
    written_by_ranks(path, (0, 1), 2)
    (tmp_path / "report.json.rank01").write_text((tmp_path / "report.json.rank1").read_text())
    proc = run_cli("report", str(path))
    assert proc.returncode == 1, proc.stderr
    assert "report.json.rank01 is not a name a worker writes" in proc.stdout
    assert "rank 1 has 2 report files (report.json.rank01, report.json.rank1)" in proc.stdout


def test_a_rank_beyond_the_world_and_disagreeing_world_sizes_are_named(tmp_path):
    path = tmp_path / "report.json"
    written_by_ranks(path, (0, 1), 2)
    written_by_ranks(path, (2,), 4)  # a previous, larger engine's file
    out = run_cli("report", str(path)).stdout
    assert "the rank files disagree on the world size (report.json: 2, report.json.rank1: 2, report.json.rank2: 4)" in out
    assert "rank 3 of the world of 4 wrote no report" in out


def test_reports_without_a_world_size_still_read_and_a_gap_is_named(tmp_path):
    """Reports of the release before the world size was recorded: read as before; a gap below
    the highest rank found is still a problem."""
    path = tmp_path / "report.json"
    for k in (0, 1, 3):
        data = a_report().to_dict()
        del data["world_size"]
        rank_path(path, k).write_text(json.dumps(data))
    proc = run_cli("report", str(path))
    assert proc.returncode == 1 and "rank 2 wrote no report (report.json.rank2 is missing, rank 3's is there)" in proc.stdout
    rank_path(path, 3).unlink()
    assert run_cli("report", str(path)).returncode == 0


def test_each_rank_records_the_world_size_it_ran_in(tmp_path):
    """The glue's save stamps the world size (1 here: no distributed group)."""
    save_report(a_report(), str(tmp_path / "report.json"))
    assert LandingReport.load(tmp_path / "report.json").world_size == 1


@pytest.mark.parametrize("case", ["binary", "fifo", "directory", "huge", "control characters", "two lines"])
def test_a_last_report_record_that_is_not_one_path_of_text_is_one_line(tmp_path, case):
    """The record ``report`` reads with no path given: a FIFO used to hang, binary bytes to
    raise a traceback. Every kind is one line naming the record, without blocking."""
    record = tmp_path / "last-report"
    if case == "binary":
        record.write_bytes(b"\xff\xfe/tmp/report.json\n")
    elif case == "fifo":
        os.mkfifo(record)
    elif case == "directory":
        record.mkdir()
    elif case == "huge":
        record.write_text("/tmp/" + "a" * 100_000 + "\n")
    elif case == "control characters":
        record.write_text("/tmp/rep\x00ort.json\n")
    else:
        record.write_text("/tmp/a.json\n/tmp/b.json\n")
    proc = run_cli("report", env={"SELECTIVE_OFFLOAD_LAST_REPORT": str(record), "SELECTIVE_OFFLOAD_REPORT": ""},
                   real=case == "fifo")  # a FIFO that blocks would hang this process
    line = one_line_error(proc)
    assert str(record) in line
    expected = {"binary": "not UTF-8 text", "fifo": "not a regular file", "directory": "not a regular file",
                "huge": "larger than", "control characters": "control characters", "two lines": "more than one line"}
    assert expected[case] in line
