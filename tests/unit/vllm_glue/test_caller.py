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
from helpers import save_tiny_qwen3, tight_plan
from selective_offload.vllm_glue import caller, patches

pytestmark = pytest.mark.usefixtures("nothing_enabled")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return (save_tiny_qwen3(tmp_path_factory.mktemp("a"), seed=4),
            save_tiny_qwen3(tmp_path_factory.mktemp("b"), seed=4))


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
