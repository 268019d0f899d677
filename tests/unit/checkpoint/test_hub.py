"""Planning by Hugging Face hub id (ORG/NAME[@REVISION]) as a user runs it: the CLI in a
subprocess, pointed by HF_ENDPOINT at a loopback server that speaks the hub's file API
(tests/hub_server.py) for a tiny sharded Qwen3 the test saves. The real hub is
unreachable from the test machines (and a test must not depend on it), so the server
stands in for it; huggingface_hub itself does the talking, as it would with the hub."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO
from hub_server import COMMIT, FakeHub
from selective_offload.checkpoint import INDEX_NAME, load_checkpoint
from selective_offload.checkpoint.hub import parse_hub_id
from selective_offload.planner import PlanInputs, make_plan

ROOT = REPO
REPO = "tiny-org/tiny-qwen3"
#: The first range request for a shard's header (bytes 0-99999), as huggingface_hub's own.
FIRST_RANGE = 100_000
PLAN_ARGS = ("--device-memory", "8MiB", "--kv-cache", "0", "--reserve", "0")


def save_tiny(directory: Path, **overrides) -> Path:
    """A random 4-layer Qwen3 in bf16, saved in shards larger than huggingface_hub's first
    range request, so a whole-shard read would show in the bytes served."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=256,
                  tie_word_embeddings=False)
    config.update(overrides)
    Qwen3ForCausalLM(Qwen3Config(**config)).to(torch.bfloat16).save_pretrained(directory, max_shard_size="2MB")
    assert len(list(directory.glob("*.safetensors"))) > 1, "a sharded checkpoint"
    return directory


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("hub-model"))


def cli(*args, hub: FakeHub | None, hf_home: Path, **env):
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               "HF_HOME": str(hf_home), "HF_HUB_DISABLE_TELEMETRY": "1", "NO_PROXY": "127.0.0.1",
               "HF_ENDPOINT": hub.url if hub else "http://127.0.0.1:9", **env}
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN", "HF_HUB_CACHE"):
        if name not in env:
            environ.pop(name, None)
    return subprocess.run([sys.executable, "-m", "selective_offload.cli", *args], capture_output=True, text=True,
                          env=environ, timeout=180)


def plan_json(proc) -> dict:
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_hub_ids_and_paths_are_told_apart():
    assert parse_hub_id("Qwen/Qwen3-8B") == ("Qwen/Qwen3-8B", None)
    assert parse_hub_id("Qwen/Qwen3-8B@v1.0") == ("Qwen/Qwen3-8B", "v1.0")
    for path in ("/models/x", "./a/b", "a/b/c", "model", "a/plan.json", "a/model.safetensors"):
        assert parse_hub_id(path) is None, path


def test_plan_by_hub_id_reads_only_the_headers(model_dir, tmp_path):
    """The plan made over HTTP is the plan made from the directory, and of each shard only
    huggingface_hub's header range was served; the token in HF_TOKEN was sent."""
    local = plan_json(cli("plan", str(model_dir), *PLAN_ARGS, "--json", hub=None, hf_home=tmp_path / "hf"))
    with FakeHub({REPO: model_dir}) as hub:
        remote = plan_json(cli("plan", REPO, *PLAN_ARGS, "--json", hub=hub, hf_home=tmp_path / "hf",
                               HF_TOKEN="hf_test_token"))
        # Nothing was written to the cache (the headers are read, the weights are vLLM's to
        # download). A cache holding config.json and the index but no shard (as `hf download`
        # of those two leaves it) is no snapshot to read either: the headers come over HTTP again.
        assert not [p for p in (tmp_path / "hf").rglob("*") if p.is_file()], "a header-only read writes no cache"
        code = (f"from huggingface_hub import hf_hub_download as d\n"
                f"for f in ('config.json', {INDEX_NAME!r}): d({REPO!r}, f)")
        subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                       env={**os.environ, "HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf")})
        hub.served.clear()
        again = plan_json(cli("plan", REPO, *PLAN_ARGS, "--json", hub=hub, hf_home=tmp_path / "hf"))
        assert all(hub.served[f"{REPO}/{shard.name}"] for shard in model_dir.glob("*.safetensors"))
    assert again["groups"] == remote["groups"]
    assert remote["model"]["source"] == REPO
    assert remote["model"]["fingerprint"] == local["model"]["fingerprint"]
    assert remote["groups"] == local["groups"] and remote["strategy"] == local["strategy"]
    shards = sorted(model_dir.glob("*.safetensors"))
    for shard in shards:
        header_end = 8 + struct.unpack("<Q", shard.read_bytes()[:8])[0]
        served = hub.served[f"{REPO}/{shard.name}"]
        assert header_end <= served <= max(FIRST_RANGE, header_end), (shard.name, served)
        assert served < shard.stat().st_size / 5, ("weights were read", shard.name, served)
    assert all(rng for method, path, rng in hub.requests if method == "GET" and path.endswith(".safetensors"))
    assert hub.authorization == {"Bearer hf_test_token"}


def test_revision_manifest_and_the_local_cache(model_dir, tmp_path):
    """ORG/NAME@COMMIT resolves; `manifest` takes a hub id; once the snapshot is in the
    cache, offline planning reads it there without a request."""
    hf_home = tmp_path / "hf"
    with FakeHub({REPO: model_dir}) as hub:
        proc = cli("manifest", f"{REPO}@{COMMIT}", "-o", str(tmp_path / "m.json"), hub=hub, hf_home=hf_home)
        assert proc.returncode == 0, proc.stderr
        manifest = json.loads((tmp_path / "m.json").read_text())
        assert set(manifest["tensors"]) == set(load_checkpoint(model_dir).tensors)
        # Every file downloaded into the cache (the layout `hf download` and vLLM leave),
        # file by file: the loopback server does not speak the hub's listing API.
        env = {"HF_ENDPOINT": hub.url, "HF_HOME": str(hf_home)}
        files = sorted(p.name for p in model_dir.iterdir())
        code = f"from huggingface_hub import hf_hub_download as d\nfor f in {files!r}: d({REPO!r}, f)"
        subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, check=True, capture_output=True)
        hub.requests.clear()
        cached = cli("plan", REPO, *PLAN_ARGS, "--json", hub=hub, hf_home=hf_home,
                     HF_HUB_OFFLINE="1")
        assert not hub.requests
    plan = plan_json(cached)
    assert Path(plan["model"]["source"]).parent.name == "snapshots"


@pytest.mark.parametrize("case,expected", [
    ("offline", f"{REPO}: not in the local Hugging Face cache ({{hf_home}}/hub) with its config.json"),
    ("no repo", "tiny-org/absent: no such model on http://127.0.0.1:"),
    ("no revision", f"{REPO}@v9: no revision 'v9' in {REPO}"),
    ("unreachable", f"{REPO}: cannot read config.json from http://127.0.0.1:9"),
])
def test_hub_failures_are_one_line_and_exit_2(model_dir, tmp_path, case, expected):
    args = {"offline": [REPO], "no repo": ["tiny-org/absent"], "no revision": [f"{REPO}@v9"],
            "unreachable": [REPO]}[case]
    env = {"HF_HUB_OFFLINE": "1"} if case == "offline" else {}
    with FakeHub({REPO: model_dir}) as hub:
        proc = cli("plan", *args, *PLAN_ARGS, hub=None if case == "unreachable" else hub,
                   hf_home=tmp_path / "hf", HF_HUB_ETAG_TIMEOUT="2", HF_HUB_DOWNLOAD_TIMEOUT="2", **env)
    assert proc.returncode == 2, proc.stderr
    expected = expected.format(hf_home=tmp_path / "hf")
    *waiting, last = proc.stderr.strip().splitlines()
    assert last.startswith(f"selective-offload: error: {expected}"), proc.stderr
    assert "Traceback" not in proc.stderr
    # Before the error, only the progress lines of a read that outlasts a couple of seconds
    # (huggingface_hub retries an unreachable endpoint for about 20 s).
    assert all(line.startswith(("reading ", "  ... reading ")) for line in waiting), waiting
    assert case == "unreachable" or not waiting
    if case == "offline":
        assert not hub.requests


def test_enable_takes_a_hub_id(model_dir, tmp_path):
    """plan(ORG/NAME, device_memory=...) plans from the hub's headers and enable() hands vLLM
    the id; enable(plan, model=ORG/NAME) checks the plan against them; a plan for another
    model is refused; a bare hub id in the plan's place is refused, naming the calls that plan
    it. Run in a subprocess: huggingface_hub reads HF_ENDPOINT at import."""
    ckpt = load_checkpoint(model_dir)
    make_plan(ckpt, PlanInputs(device_memory_bytes=ckpt.total_bytes, kv_cache_bytes=0, reserve_bytes=0)) \
        .save(tmp_path / "plan.json")
    other = save_tiny(tmp_path / "other", vocab_size=2048)
    code = f"""
import selective_offload
from selective_offload.errors import PlanError
print(selective_offload.enable(selective_offload.plan({REPO!r}, device_memory="8MiB", kv_cache="0", reserve="0",
                                                      host_memory="none")))
selective_offload.disable()
print(selective_offload.enable({str(tmp_path / 'plan.json')!r}, model={REPO!r}))
selective_offload.disable()
try:
    selective_offload.enable({str(tmp_path / 'plan.json')!r}, model="tiny-org/other")
except PlanError as exc:
    print("refused:", exc)
try:
    selective_offload.enable({REPO!r})
except PlanError as exc:
    print("refused:", exc)
"""
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               "HF_HOME": str(tmp_path / "hf"), "NO_PROXY": "127.0.0.1", "HF_HUB_DISABLE_TELEMETRY": "1"}
    with FakeHub({REPO: model_dir, "tiny-org/other": other}) as hub:
        environ["HF_ENDPOINT"] = hub.url
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environ, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0] == f"{{'model': {REPO!r}}}" and lines[1] == f"{{'model': {REPO!r}}}"
    assert lines[2].startswith("refused: ") and "model.embed_tokens" in lines[2]
    assert lines[3] == (f"refused: {REPO}: is a Hugging Face hub id, not a plan; enable(selective_offload.plan("
                        f"{REPO!r}, device_memory='24GiB')) plans it here, enable('auto', model={REPO!r}) in the "
                        "worker from the real card") and len(lines) == 4


def test_a_repository_without_safetensors_is_planned_from_its_config(model_dir, tmp_path):
    """No model.safetensors and no index: the config alone, an estimate labelled so; no
    config.json at all: one line."""
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_bytes((model_dir / "config.json").read_bytes())
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "README.md").write_text("weights elsewhere\n")
    with FakeHub({"tiny-org/cfg": tmp_path / "cfg", "tiny-org/bare": tmp_path / "bare"}) as hub:
        plan = plan_json(cli("plan", "tiny-org/cfg", *PLAN_ARGS, "--json", hub=hub, hf_home=tmp_path / "hf"))
        bare = cli("plan", "tiny-org/bare", *PLAN_ARGS, hub=hub, hf_home=tmp_path / "hf")
    assert plan["model"]["kind"] == "config"
    assert bare.returncode == 2 and bare.stderr.strip() == (
        "selective-offload: error: tiny-org/bare: the repository has no config.json, so it is not a transformers "
        "model vLLM can load")
