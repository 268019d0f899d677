"""Names a hub or an index hands us, refused in one line as the user meets them: repo ids
huggingface_hub itself refuses, shard index entries that climb out of the checkpoint, and a
config whose architecture name is megabytes long (each used to be a traceback, a plan of
another checkpoint's header, or a 10-million-character error line)."""

from __future__ import annotations

import json
import posixpath

import pytest
from hypothesis import given
from hypothesis import strategies as st

import selective_offload
from helpers import nothing_applied, write_header_only
from selective_offload.checkpoint.headers import INDEX_NAME, shard_name_problem
from selective_offload.cli import EXIT_USAGE, main
from selective_offload.errors import UserError


def refused(capsys, *argv) -> str:
    code = main([str(a) for a in argv])
    _, err = capsys.readouterr()
    assert code == EXIT_USAGE, err
    assert err.count("\n") == 1 and err.startswith("selective-offload: error: ") and len(err) < 1000, err[:2000]
    return err


@pytest.mark.parametrize("repo_id", ["org/..", "a--b/c", "org/.hidden", "org/name.", "org/" + "n" * 200])
def test_a_repo_id_huggingface_hub_refuses_is_one_line(capsys, monkeypatch, tmp_path, repo_id):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    err = refused(capsys, "plan", repo_id, "--device-memory", "8GiB")
    assert "not a hub id huggingface_hub accepts" in err


@pytest.mark.parametrize("repo_id", ["org/..", "a--b/c", "org/.hidden"])
def test_a_repo_id_huggingface_hub_refuses_is_one_line_through_enable(monkeypatch, tmp_path, repo_id,
                                                                      nothing_enabled):
    """The same ids handed to ``enable()`` and ``plan()`` from Python (a ``HFValidationError``
    traceback through ``enable()`` before): a :class:`UserError` of one line, nothing applied."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(UserError, match="not a hub id huggingface_hub accepts") as caught:
        selective_offload.plan(repo_id, device_memory="8GiB")
    message = str(caught.value)
    assert "\n" not in message and len(message) < 1000 and repo_id in message, message[:2000]
    with pytest.raises(UserError) as caught:
        selective_offload.enable(repo_id)
    assert "\n" not in str(caught.value) and len(str(caught.value)) < 1000, str(caught.value)[:2000]
    assert nothing_applied()


def test_an_index_entry_outside_the_checkpoint_is_refused(capsys, tmp_path):
    """The index maps a tensor to a shard of another directory, which exists: the plan would be
    made from that header, which vLLM never loads."""
    other = tmp_path / "other"
    other.mkdir()
    write_header_only(other / "model.safetensors", {"w": ("BF16", [4, 4])})
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}))
    (model / INDEX_NAME).write_text(json.dumps({"weight_map": {"w": "../other/model.safetensors"}}))
    err = refused(capsys, "plan", model, "--device-memory", "8GiB")
    assert "not a file inside the checkpoint" in err and INDEX_NAME in err


def test_an_architecture_name_of_megabytes_is_cut_in_its_line(capsys, tmp_path):
    config = {"architectures": ["A" * 10_000_000], "model_type": "qwen3"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    err = refused(capsys, "plan", tmp_path / "config.json", "--device-memory", "8GiB")
    assert "does not know the architecture 'AAAA" in err and "..." in err


@given(st.text(alphabet=st.sampled_from("ab./\\-_") | st.characters(), max_size=40))
def test_a_shard_name_is_accepted_only_when_it_stays_inside_the_checkpoint(name):
    problem = shard_name_problem(name)
    if problem is None:
        assert name.endswith(".safetensors")
        inside = posixpath.normpath(posixpath.join("/ckpt", name))
        assert inside.startswith("/ckpt/") and "\\" not in name
    else:
        assert "\n" not in problem and len(problem) < 200
