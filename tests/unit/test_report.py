"""The landing report on small torch models: matching, verdicts, routing and the 1% rule."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from builders import Model, checkpoint_of, cold_ids, make_ckpt, plan_for
from selective_offload.errors import PlanError
from selective_offload.names import model_names
from selective_offload.report import TOLERANCE, LandingReport, build_report, judge_host_memory, rank_path
from selective_offload.vllm_glue.offloader import select_layers


def report_of(model, plan, cold, **kw):
    return build_report(model, plan, compute_device=torch.device("cpu"), cold_on_host_params=cold,
                        prefetch_params=set(), **kw)


def test_report_ok_when_the_cold_set_is_where_planned():
    model, plan = Model(), plan_for(checkpoint_of())
    report = report_of(model, plan, cold_ids(model))
    assert report.ok, report.problems
    assert report.landed_cold_on_host_bytes == report.loaded_cold_on_host_bytes == plan.cold_on_host_bytes
    assert report.unplanned == {}


def test_segment_rule_where_the_report_uses_it():
    """`model.visualise` is its own hot group on the device, not part of the `visual` tower:
    a substring match would count its bytes as cold ones left on the device."""
    model, plan = Model(), plan_for(checkpoint_of())
    assert plan.serving_of("model.visualise") == "resident"
    report = report_of(model, plan, cold_ids(model))
    assert report.ok, report.problems
    visualise = report.landing("model.visualise")
    assert (visualise.actual, visualise.device_bytes) == ("resident", 16 * 16 * 4)
    assert report.landing("model.visual").num_params == 4


def test_the_report_says_how_each_group_is_served():
    """The report speaks the plan's words: the embedding gathered, the tower on demand; a
    tower left on the device is resident there."""
    model, plan = Model(), plan_for(checkpoint_of())
    embed_only = {id(p) for p in model.model.embed_tokens.parameters()}
    rows = {line.split()[0]: line.split()[1:3] for line in report_of(model, plan, embed_only).render().splitlines()
            if line.startswith("model.")}
    assert rows["model.embed_tokens"] == ["gather", "gather"] and rows["model.visual"] == ["on-demand", "resident"]


def test_silent_non_offload_is_reported():
    """The cold set stays on the device: the report names the groups and is not ok."""
    model, plan = Model(), plan_for(checkpoint_of())
    embed_only = {id(p) for p in model.model.embed_tokens.parameters()}
    report = report_of(model, plan, embed_only)
    assert not report.ok
    assert "model.visual" in report.problems[0]
    assert report.misplaced_cold_bytes == sum(p.numel() * 4 for p in model.visual.parameters())
    assert "PLAN NOT REALISED" in report.render()


def _misplace(model, names):
    cold = cold_ids(model)
    params = dict(model.named_parameters())
    for name in names:
        cold.discard(id(params[name]))
    return cold, sum(params[n].numel() * 4 for n in names)


def test_under_one_percent_is_tolerated(tmp_path):
    model, plan = Model(n=64), plan_for(checkpoint_of(n=64))
    cold, off = _misplace(model, ["visual.1.bias"])
    report = report_of(model, plan, cold)
    assert off < TOLERANCE * report.loaded_cold_on_host_bytes
    assert report.ok and report.misplaced_cold_bytes == off
    report.save(tmp_path / "r.json")
    assert LandingReport.load(tmp_path / "r.json") == report


def test_just_over_one_percent_is_a_problem():
    model, plan = Model(n=64), plan_for(checkpoint_of(n=64))
    cold, off = _misplace(model, ["visual.0.bias", "visual.1.bias"])
    report = report_of(model, plan, cold)
    assert TOLERANCE * report.loaded_cold_on_host_bytes < off < 1.1 * TOLERANCE * report.loaded_cold_on_host_bytes
    assert not report.ok
    assert "model.visual" in report.problems[0]


def test_bytes_are_compared_as_loaded_not_as_in_the_checkpoint():
    """A bf16 plan in a float32 engine: the same 256 misplaced bytes are 1.03% of the
    checkpoint bytes but 0.52% of the bytes as loaded, which is what landed elsewhere."""
    model, plan = Model(n=64), plan_for(checkpoint_of(n=64, dtype="BF16"))
    cold, off = _misplace(model, ["visual.1.bias"])
    report = report_of(model, plan, cold)
    assert report.loaded_cold_on_host_bytes == 2 * plan.cold_on_host_bytes
    assert off > TOLERANCE * plan.cold_on_host_bytes
    assert report.ok, report.problems
    everything_left, _ = _misplace(model, [n for n, _ in model.visual.named_parameters(prefix="visual")])
    failed = report_of(model, plan, everything_left)
    tower = sum(p.numel() * 4 for p in model.visual.parameters())
    assert f"{tower / 1e3:.1f} kB of cold bytes (as loaded)" in failed.problems[0]
    assert f"of the {report.loaded_cold_on_host_bytes / 1e3:.1f} kB the plan puts on the host" in failed.problems[0]


def test_cold_bytes_moved_after_loading_are_a_problem():
    """Routing is part of the verdict: cold bytes on the host that routing did not build
    there were on the device at construction."""
    model, plan = Model(), plan_for(checkpoint_of())
    cold = cold_ids(model)
    embed = "model.embed_tokens.weight"
    tower = {f"visual.{n}" for n, _ in model.visual.named_parameters()}
    routed = report_of(model, plan, cold, routed_names={embed} | tower)
    assert routed.ok and routed.unrouted_cold_bytes == 0
    assert routed.landing("model.visual").routed_bytes == routed.landing("model.visual").host_bytes
    unrouted = report_of(model, plan, cold, routed_names=tower)
    assert not unrouted.ok
    assert unrouted.unrouted_cold_bytes == 64 * 16 * 4
    assert unrouted.landing("model.embed_tokens").moved_bytes == 64 * 16 * 4
    assert "moved to the host only after loading (model.embed_tokens)" in unrouted.problems[0]


def test_a_failed_load_report_round_trips_with_its_reason(tmp_path):
    report = LandingReport.failed("the plan was made for another model: ...", None, "cpu")
    report.save(tmp_path / "r.json")
    loaded = LandingReport.load(tmp_path / "r.json")
    assert not loaded.ok and loaded.error.startswith("the plan was made for another model")
    assert loaded.render().splitlines()[0] == "PLAN NOT APPLIED: the plan was made for another model: ..."


def test_a_report_file_of_another_format_is_refused(tmp_path):
    (tmp_path / "r.json").write_text('{"format": "something-else"}')
    with pytest.raises(PlanError, match="not a landing report"):
        LandingReport.load(tmp_path / "r.json")


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


def test_pipeline_ranks_each_hold_a_part_and_the_merge_finds_every_group(tmp_path):
    """With pipeline parallelism each rank builds part of the model (vLLM puts
    PPMissingLayer where the rest would be): a rank's missing groups are left to the
    merge, which takes each group from the rank that holds it and flags any no rank holds."""
    plan = plan_for(checkpoint_of())
    first, last = Model(), Model()
    first.model.layers = nn.ModuleList([first.model.layers[0], first.model.layers[1]])
    del first.lm_head
    del last.model.embed_tokens, last.model.visualise, last.visual
    last.model.layers = nn.ModuleList([nn.Module(), nn.Module(), last.model.layers[2], last.model.layers[3]])
    reports = [report_of(part, plan, cold_ids(first) if part is first else set(), pipeline_part=True)
               for part in (first, last)]
    assert reports[0].on_other_ranks == ["model.layers.2", "model.layers.3", "lm_head"]
    assert all(r.ok for r in reports), [r.problems for r in reports]
    for rank, report in enumerate(reports):
        report.save(rank_path(tmp_path / "r.json", rank))
    merged = LandingReport.load(tmp_path / "r.json")
    assert merged.ok and merged.on_other_ranks == [] and set(merged.ranks) == {"rank1"}
    assert merged.landing("lm_head").actual == "resident" and merged.landing("model.layers.3").num_params == 1
    # A group neither rank holds is a problem of the merged report.
    (tmp_path / "r.json.rank1").unlink()
    assert LandingReport.load(tmp_path / "r.json").problems == [
        f"group {name} is on no pipeline rank" for name in ("lm_head", "model.layers.2", "model.layers.3")]


def _judged(policy, *, cold=1000, registered=0, torch_pinned=None, host_is_device=False):
    report = LandingReport("f", "cuda:0", host_is_device, landed_cold_on_host_bytes=cold)
    judge_host_memory(report, policy=policy, reason=f"because {policy}",
                      locked_by_how={"registered": registered} if registered else {},
                      locked_by_purpose={"model.embed_tokens": registered}, torch_pinned_bytes=torch_pinned,
                      resident_set_bytes=5_000_000)
    return report


@pytest.mark.parametrize("registered,torch_pinned,verdict", [
    (1000, 0, "ok"),            # exact registration: 1.00x
    (1000, 50, "ok"),           # a staging buffer: 1.05x, on the line
    (1000, 60, "warning"),      # 1.06x
    (1000, 250, "warning"),     # 1.25x, on the limit
    (1000, 251, "problem"),     # 1.251x: over the 1.25x limit
])
def test_page_locked_ratio_verdicts(registered, torch_pinned, verdict):
    report = _judged("register", registered=registered, torch_pinned=torch_pinned)
    assert report.host_memory["page_locked_bytes"] == registered + torch_pinned
    assert report.host_memory["page_locked_to_host_ratio"] == pytest.approx((registered + torch_pinned) / 1000)
    warned = any(n.startswith("warning: page-locked host memory") for n in report.notes)
    assert (verdict, report.ok, warned) in {("ok", True, False), ("warning", True, True), ("problem", False, False)}
    if verdict == "problem":
        assert "(limit 1.25x)" in report.problems[0]


def test_an_integrated_gpu_is_said_to_save_nothing():
    report = _judged("unified")
    assert report.ok and report.host_memory["page_locked_to_host_ratio"] is None
    assert report.notes == ["because unified: the 1.0 kB the plan puts on the host save no device memory here"]


def test_pageable_host_weights_are_noted_on_a_gpu_not_on_the_cpu_build():
    assert _judged("pageable").notes == ["host weights are not page-locked: because pageable"]
    assert _judged("pageable", host_is_device=True).notes == []


def test_a_group_the_model_names_otherwise_is_matched_by_its_name_in_the_model():
    """vLLM's gpt-oss builds the checkpoint's ``model.embed_tokens`` as ``model.embedding``:
    through the model's names the report finds the embedding's bytes in its planned group
    (the report keeps the plan's name); without them they are in no group and the
    embedding group is missing."""
    model, ckpt = Model(), checkpoint_of()
    plan = plan_for(ckpt)
    model.model.embedding = model.model.embed_tokens
    del model.model.embed_tokens
    names = model_names([g.group for g in plan.groups], ckpt.tensors,
                        lambda n: n.replace("model.embed_tokens.weight", "model.embedding.weight"),
                        plan.inputs.cold_segments, "a gpt-oss-like model")
    cold = {id(p) for p in [*model.model.embedding.parameters(), *model.visual.parameters()]}
    report = report_of(model, plan, cold, names=names)
    assert report.ok, report.problems
    embedding = report.landing("model.embed_tokens")
    assert (embedding.actual, embedding.host_bytes, embedding.num_params) == ("gather", 64 * 16 * 4, 1)
    unmapped = report_of(model, plan, cold)
    assert "model.embedding.weight" in unmapped.unplanned and not unmapped.ok


def test_the_plan_and_the_report_say_the_same_serving_for_every_group_kind():
    """One source for the word: a group's serving in the plan file is what the report's row
    says, planned and landed, for every kind: a decoder layer and the LM head resident, the
    embedding gathered, the tower onloaded on demand, and a cold table of kind module (an
    n-gram table vLLM keeps on the host), gathered: the report once said on-demand for it."""
    model, n = Model(), 16
    model.model.layers[1].engram = nn.Module()
    model.model.layers[1].engram.embed = nn.Embedding(64, n)
    spec = {name: ("F32", list(p.shape)) for name, p in model.named_parameters()}
    plan = plan_for(make_ckpt(spec, architectures=["DeepseekV41ForCausalLM"], engram_layer_ids=[1],
                              tie_word_embeddings=False, num_hidden_layers=4))
    written = {g["group"]: g["serving"] for g in plan.to_dict()["groups"]}
    kinds = {(g.kind, written[g.group]) for g in plan.groups}
    assert {("module", "gather"), ("component", "gather"), ("component", "on-demand"), ("layer", "resident"),
            ("module", "resident")} <= kinds
    cold = cold_ids(model) | {id(p) for p in model.model.layers[1].engram.parameters()}
    report = report_of(model, plan, cold)
    assert report.ok, report.problems
    rows = {line.split()[0]: line.split()[1:3] for line in report.render().splitlines() if line.split()
            and line.split()[0] in written}
    for g in plan.groups:
        landing = report.landing(g.group)
        assert (landing.planned, landing.actual) == (written[g.group], written[g.group]), g.group
        if written[g.group] != "resident":
            assert rows[g.group] == [written[g.group]] * 2, g.group
