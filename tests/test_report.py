"""The placement report on small torch models: matching, verdicts and the 1% rule."""

from __future__ import annotations

import torch
from torch import nn

from selective_offload.checkpoint import Checkpoint, TensorInfo, tensor_nbytes
from selective_offload.planner import PlanInputs, make_plan
from selective_offload.report import PlacementReport, build_report, check_plan_matches, group_key
from selective_offload.errors import PlanError
from selective_offload.vllm_glue.offloader import select_layers

import pytest


class Layer(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.qkv_proj = nn.Linear(n, 3 * n, bias=False)  # fused, as vLLM loads q/k/v


class Inner(nn.Module):
    def __init__(self, n, layers):
        super().__init__()
        self.embed_tokens = nn.Embedding(64, n)
        self.layers = nn.ModuleList(Layer(n) for _ in range(layers))


class Model(nn.Module):
    def __init__(self, n=16, layers=4):
        super().__init__()
        self.model = Inner(n, layers)
        self.visual = nn.Sequential(nn.Linear(n, n), nn.Linear(n, n))
        self.lm_head = nn.Linear(n, 64, bias=False)


def checkpoint_of(n=16, layers=4) -> Checkpoint:
    """Checkpoint names as Hugging Face writes them (separate q/k/v, model.visual)."""
    spec = {"model.embed_tokens.weight": [64, n], "lm_head.weight": [64, n]}
    for i in range(layers):
        for proj in ("q_proj", "k_proj", "v_proj"):
            spec[f"model.layers.{i}.self_attn.{proj}.weight"] = [n, n]
    for i in range(2):
        spec[f"model.visual.{i}.weight"] = [n, n]
        spec[f"model.visual.{i}.bias"] = [n]
    tensors = {k: TensorInfo(k, "F32", tuple(v), tensor_nbytes("F32", v)) for k, v in spec.items()}
    return Checkpoint("test", "manifest", tensors, {"tie_word_embeddings": False})


def plan_for(ckpt, **kw):
    return make_plan(ckpt, PlanInputs(device_memory_bytes=ckpt.total_bytes, kv_cache_bytes=0,
                                      reserve_bytes=0, all_cold=True, **kw))


def test_group_keys_survive_vllm_renames():
    segs = ("embed_tokens", "visual")
    assert group_key("model.visual", segs) == group_key("visual.0", segs) == ("cold", "visual")
    assert group_key("model.layers.3", segs) == group_key("language_model.model.layers.3.qkv_proj", segs)
    assert group_key("model.norm", segs) == group_key("language_model.model.norm", segs)


def test_report_ok_when_the_cold_set_is_where_planned():
    model, plan = Model(), plan_for(checkpoint_of())
    cold = {id(p) for p in [*model.model.embed_tokens.parameters(), *model.visual.parameters()]}
    report = build_report(model, plan, compute_device=torch.device("cpu"), host_cold_params=cold,
                          host_hot_params=set())
    assert report.ok, report.problems
    assert report.landed_host_cold_bytes == plan.host_cold_bytes
    assert report.unplanned == {}


def test_silent_non_offload_is_reported():
    """The cold set stays on the device: the report names the groups and is not ok."""
    model, plan = Model(), plan_for(checkpoint_of())
    embed_only = {id(p) for p in model.model.embed_tokens.parameters()}
    report = build_report(model, plan, compute_device=torch.device("cpu"), host_cold_params=embed_only,
                          host_hot_params=set())
    assert not report.ok
    assert "model.visual" in report.problems[0]
    assert report.misplaced_cold_bytes == sum(p.numel() * 4 for p in model.visual.parameters())
    assert "PLAN NOT REALISED" in report.render()


def test_under_one_percent_is_tolerated(tmp_path):
    model, plan = Model(), plan_for(checkpoint_of(n=64))
    model = Model(n=64)
    cold = {id(p) for p in [*model.model.embed_tokens.parameters(), *model.visual.parameters()]}
    cold.discard(id(model.visual[1].bias))  # 256 bytes of ~50 kB
    report = build_report(model, plan, compute_device=torch.device("cpu"), host_cold_params=cold,
                          host_hot_params=set())
    assert report.ok and report.misplaced_cold_bytes == 64 * 4
    report.save(tmp_path / "r.json")
    assert PlacementReport.load(tmp_path / "r.json") == report


def test_plan_for_another_model_names_the_difference():
    plan = plan_for(checkpoint_of(layers=4))
    with pytest.raises(PlanError, match="another model.*model.layers.3"):
        check_plan_matches(plan, [g.group for g in plan.groups if g.group != "model.layers.3"], "here")


def test_select_layers_streams_only_the_planned_indices():
    built = []

    def layers():
        for i in range(6):
            built.append(i)
            yield f"layer{i}"

    every: list = []
    picked = []
    for module in select_layers(layers(), [1, 4], every):
        picked.append((module, list(built)))  # what had been built when each was handed over
    assert picked == [("layer1", [0, 1]), ("layer4", [0, 1, 2, 3, 4])]
    assert every == [f"layer{i}" for i in range(6)]
