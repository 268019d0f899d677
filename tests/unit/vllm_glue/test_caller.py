"""The engine-start hook (``MPClient.__init__``, vllm_glue/caller.py) checks a plan against
the model vLLM was asked for before any engine process exists, unless enable() checked it
against that model already: one check before the engine starts, one in the worker.

vLLM's own ``MPClient.__init__`` starts engine processes; the hook is wrapped around a
stand-in that records the call instead (the only stand-in here: what it stands for is an
engine start)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import selective_offload
from helpers import CountedChecks, save_tiny_qwen3, tight_plan
from selective_offload.errors import PlanError
from selective_offload.options import RunOptions
from selective_offload.vllm_glue import caller, compat, patches

pytestmark = pytest.mark.usefixtures("nothing_enabled")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return (save_tiny_qwen3(tmp_path_factory.mktemp("a"), seed=4),
            save_tiny_qwen3(tmp_path_factory.mktemp("b"), seed=4))


def starter():
    """The engine-start hook around a stand-in for MPClient.__init__; the starts it let through."""
    started = []
    start = caller.make_engine_start(patches.session)(lambda self, *args, **kwargs: started.append(args))

    def engine_start(name):
        config = SimpleNamespace(model_config=SimpleNamespace(model=str(name)), additional_config={})
        start(object(), False, config)

    return engine_start, started


def test_a_plan_enable_checked_against_the_model_is_not_checked_again_at_engine_start(models, monkeypatch):
    model, copy = models
    checked = []
    real = caller.check_model
    monkeypatch.setattr(caller, "check_model", lambda plan, m: checked.append(m) or real(plan, m))
    started = []
    start = caller.make_engine_start(patches.session)(lambda self, *args, **kwargs: started.append(args))

    def engine_start(name):
        config = SimpleNamespace(model_config=SimpleNamespace(model=str(name)), additional_config={})
        start(object(), False, config)

    selective_offload.enable(tight_plan(model), model=model)
    engine_start(model)
    engine_start(f"{model}/.")  # another spelling of the same directory
    assert checked == [] and len(started) == 2
    engine_start(copy)  # a model enable() did not see: checked here, before any engine process
    assert checked == [str(copy)] and len(started) == 3
    selective_offload.enable(tight_plan(model))  # no model=: checked against the folder it was made from
    engine_start(model)
    assert checked == [str(copy)]


@pytest.mark.parametrize("model_given", [True, False])
def test_before_any_engine_the_plan_is_checked_exactly_once(models, model_given):
    """enable() with model=, or without (against the folder the plan was made from), then the
    engine started for that model: one check, in enable(), none at the start."""
    model, _ = models
    engine_start, started = starter()
    with CountedChecks() as checks:
        selective_offload.enable(tight_plan(model), **({"model": model} if model_given else {}))
        engine_start(model)
    assert checks == ["enable"] and len(started) == 1


def test_a_plan_installed_without_enable_is_checked_once_at_the_engine_start(models):
    """The plugin's path (``vllm serve`` with SELECTIVE_OFFLOAD_PLAN): nothing checked the
    plan before, so the engine's start does, once."""
    model, _ = models
    plan = tight_plan(model)
    patches.apply(patches.Settings(plan, RunOptions("plan.json", False, None, "auto")), compat.resolve_targets())
    engine_start, started = starter()
    with CountedChecks() as checks:
        engine_start(model)
    assert checks == ["engine start"] and len(started) == 1


def test_a_mismatched_plan_is_refused_at_the_engine_start_in_one_line(models, tmp_path):
    """A model enable() did not see, and not the plan's: refused before any engine process,
    in one line that names both models and the first difference."""
    model, _ = models
    other = save_tiny_qwen3(tmp_path / "other", seed=4, vocab_size=2048)
    engine_start, started = starter()
    selective_offload.enable(tight_plan(model))
    with CountedChecks() as checks, pytest.raises(PlanError) as info:
        engine_start(other)
    message = str(info.value)
    assert checks == ["engine start"] and started == []
    assert message.startswith("the plan was made for another model: ") and "\n" not in message
    assert f"this is {other} " in message and "first difference: model.embed_tokens" in message
