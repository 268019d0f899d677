"""The files `plan` writes (``-o``, ``--png``, ``--svg``), under paths a hostile or unlucky
user gives: each is tried for real before any work (selective_offload/outputs.py), and a
failure while writing at the end (a full disk) is one line, exit 2, with the user's files
left as they were. Each case is the user's call, ``main([...])`` on the bundled model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("matplotlib", reason="the pictures need matplotlib (the `picture` extra)")

import json
import struct
import subprocess
import sys

import selective_offload
from selective_offload import outputs, plan_options
from selective_offload.cli import main
from selective_offload.errors import UserError
from selective_offload.options import RunOptions
from selective_offload.plan_format import Plan
from selective_offload.planner import tradeoff
from selective_offload.report import LandingReport, remove_reports

FULL = Path("/dev/full")
needs_dev_full = pytest.mark.skipif(not FULL.exists(), reason="/dev/full (a disk that is always full) is Linux's")


@pytest.fixture
def planned(monkeypatch) -> list:
    """The models planned in this test: a refusal "before any work" plans none (a spy on
    the make_plan that ``plan``'s options are planned with, which still plans)."""
    calls: list = []
    real = plan_options.make_plan

    def spy(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(plan_options, "make_plan", spy)
    monkeypatch.setattr(tradeoff, "make_plan", spy)
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


@pytest.mark.parametrize("outputs_,says", [
    ("-o {t}/plan.json --png /proc/picture.png", "--png /proc/picture.png: cannot be written"),
    ("-o {t}/plan.json --png {t}/picture.png", "picture.png: is a directory; name a file in it"),
    pytest.param("-o {t}/plan.json --svg {t}/picture.svg", "picture.svg: is not a regular file", marks=needs_dev_full),
    ("-o /proc/plan.json --png {t}/new.png", "-o /proc/plan.json: cannot be written"),
    pytest.param("-o {t}/plan.json --png {t}/locked/p.png", "p.png: cannot be written (Permission denied)",
                 marks=pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory")),
], ids=["picture-into-proc", "picture-onto-a-directory", "picture-onto-a-full-device", "plan-into-proc",
        "picture-in-a-read-only-directory"])
def test_an_output_that_cannot_be_written_is_refused_before_any_work(capsys, tmp_path, planned, outputs_, says):
    """Refused before the plan is made, and the other file asked for is not written."""
    (tmp_path / "picture.png").mkdir()  # a directory where a file is named (--png picture.png)
    (tmp_path / "picture.svg").symlink_to(FULL)  # a full device (--svg picture.svg)
    (tmp_path / "locked").mkdir(mode=0o500)  # a read-only directory
    try:
        code, out, err = plan(capsys, *outputs_.format(t=tmp_path).split())
    finally:
        (tmp_path / "locked").chmod(0o700)
    assert_one_line_refusal(code, out, err, says)
    assert planned == [] and not (tmp_path / "plan.json").exists() and not (tmp_path / "new.png").exists()
    assert (tmp_path / "picture.png").is_dir() and (tmp_path / "picture.svg").resolve() == FULL


def test_two_outputs_naming_one_file_are_refused(capsys, tmp_path):
    code, out, err = plan(capsys, "-o", str(tmp_path / "x.png"), "--png", str(tmp_path / "x.png"))
    assert_one_line_refusal(code, out, err, "name the same file")


@needs_dev_full
def test_a_disk_full_while_writing_the_picture_is_one_line_and_leaves_the_users_files_as_they_were(
        capsys, tmp_path, monkeypatch, planned):
    """The disk fills after the paths were tried: the picture's temporary file is made to
    land on /dev/full (the kernel's ENOSPC, not a stand-in), and neither the picture nor the
    plan asked for with it replaces the user's files, and no temporary file is left."""
    code, _, err = plan(capsys, "-o", str(tmp_path / "plan.json"), "--svg", str(tmp_path / "picture.svg"),
                        "--batch", "2")
    assert code == 0, err
    old_plan, old_picture = (tmp_path / "plan.json").read_bytes(), (tmp_path / "picture.svg").read_bytes()
    planned.clear()
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
    assert (tmp_path / "plan.json").read_bytes() == old_plan
    assert (tmp_path / "picture.svg").read_bytes() == old_picture
    assert leftovers(tmp_path) == []


def test_the_plan_and_its_pictures_are_written_whole_and_replace_old_files(capsys, tmp_path):
    """Files this project wrote (an earlier plan and its pictures) and an empty file are
    replaced whole."""
    (tmp_path / "p.svg").touch()
    code, out, err = plan(capsys, "-o", str(tmp_path / "plan.json"), "--png", str(tmp_path / "p.png"),
                          "--batch", "2")
    assert code == 0, err
    assert Plan.load(tmp_path / "plan.json").inputs.batch == 2
    code, out, err = plan(capsys, "-o", str(tmp_path / "plan.json"), "--png", str(tmp_path / "p.png"),
                          "--svg", str(tmp_path / "p.svg"))
    assert code == 0, err
    assert Plan.load(tmp_path / "plan.json").model.source.startswith("bundled")
    assert Plan.load(tmp_path / "plan.json").inputs.batch == 1
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert b"<svg" in (tmp_path / "p.svg").read_bytes()[:2000]
    assert leftovers(tmp_path) == []
    assert f"picture: {tmp_path / 'p.png'}, {tmp_path / 'p.svg'}" in out


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


# ---- one rule for every file written: nothing of the user's replaced, nothing inside the
# checkpoint planned, one file named once (selective_offload/outputs.py)


def tiny_checkpoint(root: Path) -> Path:
    """A header-only checkpoint directory of the user's: its config and one shard."""
    model = root / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}))
    header = json.dumps({"model.layers.0.mlp.w": {"dtype": "BF16", "shape": [4, 4], "data_offsets": [0, 32]}}).encode()
    (model / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 32)
    return model


def files_of(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("command,target", [
    ("plan", "config.json"), ("plan", "model.safetensors"), ("plan", "plan.json"),
    ("manifest", "model.safetensors"), ("manifest", "config.json"), ("manifest", "m.json")])
def test_an_output_inside_the_checkpoint_planned_is_refused_and_the_model_left_as_it_was(
        capsys, tmp_path, planned, command, target):
    model = tiny_checkpoint(tmp_path)
    before = files_of(model)
    extra = ["--device-memory", "24GiB", "--host-memory", "none"] if command == "plan" else []
    code = main([command, str(model), *extra, "-o", str(model / target)])
    out, err = capsys.readouterr()
    assert_one_line_refusal(code, out, err, f"-o {model / target}: is inside the checkpoint being planned")
    assert files_of(model) == before and planned == []


def test_a_shard_or_config_planned_keeps_its_folder_too(capsys, tmp_path, planned):
    model = tiny_checkpoint(tmp_path)
    for named in (model / "model.safetensors", model / "config.json"):
        code = main(["plan", str(named), "--device-memory", "24GiB", "--host-memory", "none",
                     "-o", str(model / "sub" / ".." / "plan.json")])
        out, err = capsys.readouterr()
        assert_one_line_refusal(code, out, err, "is inside the checkpoint being planned")
    assert not (model / "plan.json").exists() and planned == []


@pytest.mark.parametrize("flag,name", [("-o", "plan.json"), ("--png", "p.png"), ("--svg", "p.svg")])
def test_a_file_of_the_users_is_not_replaced(capsys, tmp_path, planned, flag, name):
    """A JSON file that is not a plan, a picture matplotlib drew for someone else: each is
    the user's, refused before any work and left as it was."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    theirs = tmp_path / name
    if name.endswith(".json"):
        theirs.write_text('{"format": "my-notes", "keep": true}\n')
    else:
        fig = plt.figure()
        fig.savefig(theirs)
        plt.close(fig)
    before = theirs.read_bytes()
    args = ["-o", str(tmp_path / "mine.json")] if flag != "-o" else []
    code, out, err = plan(capsys, *args, flag, str(theirs))
    assert_one_line_refusal(code, out, err, f"{flag} {theirs}: exists and is not a")
    assert theirs.read_bytes() == before and planned == []
    assert not (tmp_path / "mine.json").exists()


def test_a_manifest_is_not_replaced_by_a_plan_nor_a_plan_by_a_manifest(capsys, tmp_path):
    assert main(["manifest", "qwen3.8-27b-fp8", "-o", str(tmp_path / "m.json")]) == 0
    capsys.readouterr()
    code, out, err = plan(capsys, "-o", str(tmp_path / "m.json"))
    assert_one_line_refusal(code, out, err, "exists and is not a plan selective-offload wrote")
    code, out, err = plan(capsys, "-o", str(tmp_path / "p.json"))
    assert code == 0, err
    code = main(["manifest", "qwen3.8-27b-fp8", "-o", str(tmp_path / "p.json")])
    assert code == 2 and "exists and is not a manifest selective-offload wrote" in capsys.readouterr().err
    assert Plan.load(tmp_path / "p.json")  # still the plan
    assert main(["manifest", "qwen3.8-27b-fp8", "-o", str(tmp_path / "m.json")]) == 0  # its own: replaced


@pytest.mark.parametrize("spell", ["{d}/sub/../same.svg", "{d}/./same.svg", "{d}/link.svg", "{d}/hard.svg"])
def test_two_names_for_one_file_are_refused_before_any_work(capsys, tmp_path, planned, spell):
    """``..``, ``.``, a symbolic and a hard link: each resolved once, before any plan is made."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "same.svg").touch()
    (tmp_path / "link.svg").symlink_to(tmp_path / "same.svg")
    os.link(tmp_path / "same.svg", tmp_path / "hard.svg")
    code = main(["plan", "qwen3.8-27b-fp8", "--device-memory", "24GiB", "--host-memory", "none",
                 "-o", str(tmp_path / "same.svg"), "--svg", spell.format(d=tmp_path)])
    out, err = capsys.readouterr()
    assert_one_line_refusal(code, out, err, f"-o {tmp_path / 'same.svg'} and --svg {spell.format(d=tmp_path)} name "
                                            f"the same file ({tmp_path / 'same.svg'})")
    assert planned == [] and (tmp_path / "same.svg").read_bytes() == b""


def test_probe_never_replaces_what_the_profile_variable_names_unless_it_is_a_profile(tmp_path, monkeypatch):
    """``probe`` without ``-o`` writes where SELECTIVE_OFFLOAD_PROFILE points: a JSON file
    that is not a profile is refused before measuring; a profile the probe wrote is
    replaced. Run as the user runs it, in a subprocess."""
    root = Path(__file__).resolve().parents[2]
    theirs = tmp_path / "settings.json"
    theirs.write_text('{"theme": "dark"}\n')
    env = {**os.environ, "PYTHONPATH": str(root), "SELECTIVE_OFFLOAD_PROFILE": str(theirs)}
    run = [sys.executable, "-m", "selective_offload.cli", "probe", "--quick", "--device", "cpu"]
    proc = subprocess.run(run, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == (f"selective-offload: error: SELECTIVE_OFFLOAD_PROFILE={theirs}: exists and is "
                                   "not a probe profile selective-offload wrote, so it is not replaced; name a new "
                                   "file (or move that one away yourself)")
    assert theirs.read_text() == '{"theme": "dark"}\n' and not proc.stdout
    ours_ = tmp_path / "profile.json"
    env["SELECTIVE_OFFLOAD_PROFILE"] = str(ours_)
    for _ in range(2):  # made, then replaced
        proc = subprocess.run(run, capture_output=True, text=True, env=env, timeout=300)
        assert proc.returncode == 0, proc.stderr
    assert '"format": "selective-offload/profile-v1"' in ours_.read_text()


def test_the_engine_report_never_replaces_nor_removes_a_file_of_the_users(tmp_path):
    """SELECTIVE_OFFLOAD_REPORT naming the user's file: refused before any model is built,
    and the start-of-engine clean-up of old reports leaves it."""
    theirs = tmp_path / "config.json"
    theirs.write_text('{"model_type": "qwen3"}\n')
    with pytest.raises(UserError, match="exists and is not a landing report selective-offload wrote"):
        RunOptions(plan_path="plan.json", report_path=str(theirs)).validate()
    remove_reports(theirs)
    with pytest.raises(OSError, match="not a landing report"):
        LandingReport("f", "cpu", True).save(theirs)
    assert theirs.read_text() == '{"model_type": "qwen3"}\n'
    mine = tmp_path / "report.json"
    LandingReport("f", "cpu", True).save(mine)
    RunOptions(plan_path="plan.json", report_path=str(mine)).validate()
    remove_reports(mine)
    assert not mine.exists()


def test_plan_save_from_python_never_replaces_a_file_of_the_users(tmp_path):
    made = selective_offload.plan("qwen3.8-27b-fp8", device_memory="24GiB", host_memory="none")
    theirs = tmp_path / "config.json"
    theirs.write_text("{}\n")
    with pytest.raises(UserError, match="exists and is not a plan selective-offload wrote"):
        made.save(theirs)
    assert theirs.read_text() == "{}\n"
    made.save(tmp_path / "plan.json")
    made.save(tmp_path / "plan.json")  # its own: replaced
    assert Plan.load(tmp_path / "plan.json") == made
