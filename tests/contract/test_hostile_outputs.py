"""The files `plan` writes (``-o``, ``--png``, ``--svg``), under paths a hostile or unlucky
user gives: each is tried for real before any work (selective_offload/outputs.py), and a
failure while writing at the end (a full disk) is one line, exit 2, with the user's files
left as they were. Each case is the user's call, ``main([...])`` on the bundled model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("matplotlib", reason="the pictures need matplotlib (the `picture` extra)")

from selective_offload import outputs  # noqa: E402
from selective_offload.cli import main  # noqa: E402
from selective_offload.plan_format import Plan  # noqa: E402

FULL = Path("/dev/full")
needs_dev_full = pytest.mark.skipif(not FULL.exists(), reason="/dev/full (a disk that is always full) is Linux's")


@pytest.fixture
def planned(monkeypatch) -> list:
    """The models planned in this test: a refusal "before any work" plans none (a spy on
    the make_plan that ``plan``'s options are planned with, which still plans)."""
    from selective_offload import cli, plan_options

    calls: list = []
    real = plan_options.make_plan

    def spy(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(plan_options, "make_plan", spy)
    monkeypatch.setattr(cli, "make_plan", spy)
    return calls


def plan(capsys, *argv):
    code = main(["plan", "qwen3.8-27b-fp8", "--device-memory", "24GiB", "--host-memory", "none", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_refusal(code, out, err, *expected):
    assert code == 2, (code, err)
    assert err.startswith("selective-offload: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err and not out, (out, err)
    for text in expected:
        assert text in err, err


def leftovers(directory: Path) -> list[str]:
    """Temporary files a write left behind (outputs.temporary_name's)."""
    return sorted(p.name for p in directory.iterdir() if p.name.startswith(".so-"))


def test_a_picture_into_proc_is_refused_before_any_work(capsys, tmp_path, planned):
    code, out, err = plan(capsys, "-o", str(tmp_path / "plan.json"), "--png", "/proc/picture.png")
    assert_one_line_refusal(code, out, err, "--png /proc/picture.png: cannot be written")
    assert planned == []
    assert not (tmp_path / "plan.json").exists()  # refused before the plan was made and written


def test_a_picture_onto_a_directory_is_refused_before_any_work(capsys, tmp_path, planned):
    (tmp_path / "picture.png").mkdir()
    code, out, err = plan(capsys, "-o", str(tmp_path / "plan.json"), "--png", str(tmp_path / "picture.png"))
    assert_one_line_refusal(code, out, err, "picture.png: is a directory; name a file in it")
    assert planned == []
    assert not (tmp_path / "plan.json").exists()


@needs_dev_full
def test_a_picture_onto_a_full_device_is_refused_before_any_work(capsys, tmp_path, planned):
    (tmp_path / "picture.svg").symlink_to(FULL)
    code, out, err = plan(capsys, "-o", str(tmp_path / "plan.json"), "--svg", str(tmp_path / "picture.svg"))
    assert_one_line_refusal(code, out, err, "picture.svg: is not a regular file")
    assert planned == []
    assert not (tmp_path / "plan.json").exists() and (tmp_path / "picture.svg").resolve() == FULL


def test_a_plan_output_into_proc_is_refused_before_any_work(capsys, tmp_path, planned):
    code, out, err = plan(capsys, "-o", "/proc/plan.json", "--png", str(tmp_path / "picture.png"))
    assert_one_line_refusal(code, out, err, "-o /proc/plan.json: cannot be written")
    assert planned == []
    assert not (tmp_path / "picture.png").exists()


def test_two_outputs_naming_one_file_are_refused(capsys, tmp_path):
    code, out, err = plan(capsys, "-o", str(tmp_path / "x.png"), "--png", str(tmp_path / "x.png"))
    assert_one_line_refusal(code, out, err, "name the same file")


@needs_dev_full
def test_a_disk_full_while_writing_the_picture_is_one_line_and_leaves_the_users_files_as_they_were(
        capsys, tmp_path, monkeypatch, planned):
    """The disk fills after the paths were tried: the picture's temporary file is made to
    land on /dev/full (the kernel's ENOSPC, not a stand-in), and neither the picture nor the
    plan asked for with it replaces the user's files, and no temporary file is left."""
    (tmp_path / "plan.json").write_text("the user's old plan\n")
    (tmp_path / "picture.svg").write_text("the user's old picture\n")
    real = outputs.temporary_name
    calls: dict[str, int] = {}

    def fills_up(path: Path) -> Path:
        calls[path.name] = calls.get(path.name, 0) + 1
        if path.name == "picture.svg" and calls[path.name] > 1:  # the trial passed; the disk is full now
            full = tmp_path / ".so-full.tmp"
            if not full.is_symlink():
                full.symlink_to(FULL)
            return full
        return real(path)

    monkeypatch.setattr(outputs, "temporary_name", fills_up)
    code, out, err = plan(capsys, "-o", str(tmp_path / "plan.json"), "--svg", str(tmp_path / "picture.svg"))
    assert_one_line_refusal(code, out, err, "--svg", "picture.svg: cannot be written (No space left on device)",
                            "nothing was written")
    assert calls["picture.svg"] == 2 and len(planned) == 1, calls  # it failed at the end, after planning
    assert (tmp_path / "plan.json").read_text() == "the user's old plan\n"
    assert (tmp_path / "picture.svg").read_text() == "the user's old picture\n"
    assert leftovers(tmp_path) == []


def test_the_plan_and_its_pictures_are_written_whole_and_replace_old_files(capsys, tmp_path):
    (tmp_path / "plan.json").write_text("old\n")
    code, out, err = plan(capsys, "-o", str(tmp_path / "plan.json"), "--png", str(tmp_path / "p.png"),
                          "--svg", str(tmp_path / "p.svg"))
    assert code == 0, err
    assert Plan.load(tmp_path / "plan.json").model.source.startswith("bundled")
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert b"<svg" in (tmp_path / "p.svg").read_bytes()[:2000]
    assert leftovers(tmp_path) == []
    assert f"picture: {tmp_path / 'p.png'}, {tmp_path / 'p.svg'}" in out


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory")
def test_a_picture_in_a_read_only_directory_is_refused_before_any_work(capsys, tmp_path, planned):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        code, out, err = plan(capsys, "-o", str(tmp_path / "plan.json"), "--png", str(locked / "p.png"))
    finally:
        locked.chmod(0o700)
    assert_one_line_refusal(code, out, err, "p.png: cannot be written (Permission denied)")
    assert planned == []
    assert not (tmp_path / "plan.json").exists()


@pytest.mark.parametrize("workdir,says", [
    ("{file}", "is not a folder; name a folder"),
    ("/dev/null", "is not a folder; name a folder"),
    ("/proc/selective-offload-demo", "cannot be written"),
    pytest.param("/sys/kernel", "cannot be written",  # a folder that exists, where not even root may add a file
                 marks=pytest.mark.skipif(not Path("/sys/kernel").is_dir(), reason="/sys/kernel is Linux's")),
])
def test_a_demo_folder_that_cannot_be_written_is_one_line_before_vllm_starts(capsys, tmp_path, workdir, says):
    """The demo's folder is tried before vLLM is imported or a model is built; a file of the
    user's named as the folder is left as it was."""
    theirs = tmp_path / "notes.txt"
    theirs.write_text("mine")
    code = main(["demo", "--workdir", workdir.format(file=theirs)])
    err = capsys.readouterr().err
    assert code == 2 and says in err and len(err.strip().splitlines()) == 1
    assert theirs.read_text() == "mine"
