"""Progress lines for long steps (selective_offload/progress.py): the demo's engine start and
the CLI's long reads of MODEL."""

from __future__ import annotations

import io
import json
import time

import transformers

from selective_offload import cli, plan_options
from selective_offload.progress import progress


def test_a_step_says_what_runs_ticks_and_says_when_done():
    out = io.StringIO()
    with progress("starting the engine", every_s=0.1, note="it takes a while", stream=out):
        assert out.getvalue() == "starting the engine (it takes a while)\n"  # before the body runs
        time.sleep(0.35)
    lines = out.getvalue().splitlines()
    assert lines[1:-1] and all(line.startswith("  ... starting the engine: ") for line in lines[1:-1])
    assert lines[-1].startswith("starting the engine: done in ")


def test_a_quick_step_that_asks_for_a_delay_prints_nothing():
    out = io.StringIO()
    with progress("reading", after_s=0.5, stream=out):
        pass
    assert out.getvalue() == ""
    with progress("reading", after_s=0.05, every_s=10, stream=out):
        time.sleep(0.2)
    assert out.getvalue().splitlines() == ["reading ...", "reading: done in 0 s"]


def test_plan_from_a_large_config_says_it_is_building_on_stderr(tmp_path, monkeypatch, capsys):
    """The CLI's read of a config (a meta-device build) reports on stderr once it outlasts
    PROGRESS_AFTER_S (0 here: the tiny config builds at once), leaving stdout's JSON alone."""
    config = transformers.Qwen3Config(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16).to_dict()
    config["architectures"] = ["Qwen3ForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    monkeypatch.setattr(plan_options, "PROGRESS_AFTER_S", 0.001)
    status = cli.main(["plan", str(tmp_path / "config.json"), "--device-memory", "1GiB", "--kv-cache", "0",
                       "--reserve", "0", "--json"])
    out, err = capsys.readouterr()
    assert status == 0 and json.loads(out)["model"]["kind"] == "config"
    what = f"building the model of {tmp_path / 'config.json'} on the meta device to list its tensors"
    assert err.splitlines()[0] == f"{what} ..." and err.splitlines()[-1].startswith(f"{what}: done in ")


def test_a_step_that_fails_does_not_say_done():
    out = io.StringIO()
    try:
        with progress("reading", stream=out):
            raise ValueError("bad")
    except ValueError:
        pass
    assert out.getvalue() == "reading\n"
