"""A plan that cannot be applied stops vLLM with its reason as the last line the user sees,
through ``LLM(...)`` with spawned engine processes (vLLM's default).

The engine core and its worker are separate processes: an error raised there reaches the
caller as vLLM's generic "Engine core initialization failed". The glue writes the reason
to the report file in the worker and raises it again in the calling process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

import selective_offload
from helpers import ENGINE_ARGS, REPO, last_line, save_tiny_qwen3, tight_plan
from selective_offload.errors import PlanError

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def model(tiny_qwen3):
    return tiny_qwen3


def test_a_plan_for_another_model_stops_llm_before_any_engine_process(model, tmp_path, monkeypatch):
    """enable() could not know the model LLM() would get; the check runs when the engine
    is about to start, in this process."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    other = save_tiny_qwen3(tmp_path / "other", seed=6, vocab_size=2048)
    from vllm import LLM

    selective_offload.enable(tight_plan(model))
    try:
        with pytest.raises(PlanError, match="the plan was made for another model.*first difference: "
                                            "model.embed_tokens is 524.3 kB of BF16 in the plan"):
            LLM(model=str(other), **ENGINE_ARGS)
    finally:
        selective_offload.disable()


SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
if __name__ == "__main__":
    import selective_offload
    from helpers import ENGINE_ARGS, hot_layer_plan
    args = selective_offload.enable(hot_layer_plan({model!r}), strict=True)
    from vllm import LLM
    LLM(**args, **ENGINE_ARGS)
"""


def test_a_worker_error_is_the_last_line_of_llm(model, tmp_path):
    """Strict mode, a plan the CPU build cannot realise (hot layers need CUDA): the worker
    refuses it; the user's program ends with that reason, not with vLLM's generic line."""
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(SCRIPT.format(tests=str(REPO / "tests"), model=str(model))))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SELECTIVE_OFFLOAD_")}
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert last_line(out.stderr).startswith(
        "selective_offload.errors.PlanError: the plan was not realised (strict mode): the plan puts 2 hot "
        "layers on the host, but vLLM's prefetch offloader needs CUDA"), out.stderr[-3000:]
