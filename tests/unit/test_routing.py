"""Routing profiles: the worker's counters (torch only: the op a captured graph replays), the
report's counts saved by `selective-offload report --routing`, read back through the one
bounded reader, and bad profiles refused in one line (exit 2 from the CLI)."""

from __future__ import annotations

import json

import pytest
import torch

from selective_offload.cli import main
from selective_offload.errors import UserError
from selective_offload.report import LandingReport
from selective_offload.routing import RoutingProfile, load_routing
from selective_offload.vllm_glue.routing import LayerCounter, RoutingCounters, count_picks, zero_after_warm_up


def counters_after(steps, experts=8, k=2, device="cpu") -> RoutingCounters:
    """Two layers' counters after ``steps`` (each a [T, k] tensor of ids; layer 1 sees them reversed)."""
    c = RoutingCounters(model="tiny-moe", vllm_version="0.32.0", device_experts={0: 3, 1: 3})
    for layer in (0, 1):
        c.layers[layer] = LayerCounter(layer, f"model.layers.{layer}.mlp.experts",
                                       torch.zeros(experts, dtype=torch.long, device=device),
                                       torch.ones(4, dtype=torch.long, device=device), k)
    for ids in steps:
        c.layers[0].add(ids.to(device))
        c.layers[1].add((experts - 1 - ids).to(device))
    return c


def test_the_counters_count_every_pick_of_any_step_size_as_bincount_does():
    g = torch.Generator().manual_seed(0)
    steps = [torch.randint(0, 8, (t, 2), generator=g, dtype=torch.int32) for t in (1, 3, 17, 1, 40)]
    c = counters_after(steps)
    everything = torch.cat([s.reshape(-1) for s in steps]).long()
    assert c.layers[0].values() == torch.bincount(everything, minlength=8).tolist()
    assert c.layers[1].values() == torch.bincount(7 - everything, minlength=8).tolist()
    assert c.layers[0].ones.shape[0] >= 80  # grown outside capture, kept for the next steps
    c.zero()
    assert sum(c.layers[0].values()) == 0


def test_the_counters_restart_when_vllms_warm_up_returns():
    """vLLM's profile run (before) and warm-up (inside ``compile_or_warm_up_model``) route
    dummy tokens; the hook around that method zeroes the counters as it returns, so only
    served steps count. (The CPU build's engine with a fixed KV cache runs neither, so the
    engine tests cannot show this.) ``warm_up`` stands for vLLM's method: it routes."""
    c = counters_after([])

    def warm_up(worker):
        c.layers[0].add(torch.tensor([[1, 2]] * 8))
        return "warmed up"

    c.layers[1].add(torch.tensor([[3, 4]]))  # the profile run
    assert zero_after_warm_up(lambda: c)(warm_up)(object()) == "warmed up"
    assert sum(c.layers[0].values()) == sum(c.layers[1].values()) == 0
    c.layers[0].add(torch.tensor([[5, 6]]))  # the first served step
    assert c.layers[0].values() == [0, 0, 0, 0, 0, 1, 1, 0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a captured CUDA graph needs a CUDA device")
def test_the_count_replays_inside_a_captured_cuda_graph():
    ids = torch.zeros(4, 2, dtype=torch.int64, device="cuda")
    counts = torch.zeros(8, dtype=torch.long, device="cuda")
    ones = torch.ones(64, dtype=torch.long, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        count_picks(counts, ids, ones)
    counts.zero_()
    for step in ([[1, 2]] * 4, [[5, 5], [1, 7], [0, 1], [2, 2]]):
        ids.copy_(torch.tensor(step))
        graph.replay()
    torch.cuda.synchronize()
    assert counts.tolist() == [1, 6, 6, 0, 0, 2, 0, 1]


def test_report_routing_saves_the_counts_as_a_profile_that_round_trips(tmp_path, capsys):
    steps = [torch.tensor([[6, 2]] * 5 + [[7, 0]]), torch.tensor([[6, 7], [2, 1]])]
    counters = counters_after(steps)
    report = LandingReport("fp", "cpu", True, routing=counters.as_report())
    report.save(tmp_path / "report.json")
    target = tmp_path / "routing.json"
    code = main(["report", str(tmp_path / "report.json"), "--routing", str(target), "--workload", "two steps"])
    out = capsys.readouterr().out
    assert code == 0
    assert out.splitlines()[0] == "routing: 8 tokens routed (two steps) on tiny-moe, vLLM 0.32.0"
    # layer 0: 16 picks, the busiest 3 (2 and 6 tied: the lower id first, then 7) take 14 of them
    assert "layer 0: 16 picks of 8 experts; the busiest 3 (2, 6, 7) take 87.5% (uniform: 37.5%)" in out
    profile = load_routing(target)
    assert profile.layers[0] == tuple(counters.layers[0].values()) and profile.layers[1] == tuple(
        counters.layers[1].values())
    assert (profile.model, profile.vllm_version, profile.tokens, profile.workload) == (
        "tiny-moe", "0.32.0", 8, "two steps")
    assert RoutingProfile.from_dict(json.loads(target.read_text()), "again") == profile
    # written only over a routing profile: a file of the user's there is refused, untouched
    mine = tmp_path / "notes.json"
    mine.write_text('{"mine": 1}\n')
    assert main(["report", str(tmp_path / "report.json"), "--routing", str(mine)]) == 2
    assert mine.read_text() == '{"mine": 1}\n'


def test_a_report_without_counts_is_refused_in_one_line(tmp_path, capsys):
    LandingReport("fp", "cpu", True).save(tmp_path / "report.json")
    assert main(["report", str(tmp_path / "report.json"), "--routing", str(tmp_path / "r.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert "holds no routing counts" in err and "SELECTIVE_OFFLOAD_ROUTING=1" in err and "\n" not in err
    assert not (tmp_path / "r.json").exists()


GOOD = {"format": "selective-offload/routing-v1", "source": {"model": "m", "vllm_version": "0.32.0", "tokens": 3},
        "layers": {"0": [1, 2, 3]}}


@pytest.mark.parametrize("edit, match", [
    (lambda d: d.update(format="selective-offload/plan-v5"), "not a routing profile"),
    (lambda d: d.update(layers={"zero": [1]}), "is not a layer index"),
    (lambda d: d.update(layers={"0": [1, -2]}), "layers.0 is .* but must be a list of integers from 0"),
    (lambda d: d.update(layers={"0": []}), "layers.0 is \\[\\], but must be a list of counts"),
    (lambda d: d.update(layers={}), "at least one layer's counts"),
    (lambda d: d["source"].update(tokens="many"), "source.tokens"),
])
def test_a_bad_profile_is_refused_in_one_line_naming_the_field(tmp_path, edit, match):
    data = json.loads(json.dumps(GOOD))
    edit(data)
    path = tmp_path / "routing.json"
    path.write_text(json.dumps(data))
    with pytest.raises(UserError, match=match) as info:
        load_routing(path)
    assert "\n" not in str(info.value) and "report --routing" in str(info.value)


def test_plan_routing_refuses_a_profile_that_is_not_of_the_model(tmp_path, capsys):
    """The bundled reference model is dense: a profile of MoE layers is not its own (exit 2, one line)."""
    path = tmp_path / "routing.json"
    path.write_text(json.dumps(GOOD))
    code = main(["plan", "qwen3.8-27b-fp8", "--device-memory", "24GiB", "--routing", str(path)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and f"--routing {path}: layer 0 is no MoE layer of this model (its MoE layers: none)" in err
    assert "\n" not in err
    path.write_text("{not json")
    assert main(["plan", "qwen3.8-27b-fp8", "--device-memory", "24GiB", "--routing", str(path)]) == 2
    assert "--routing" in capsys.readouterr().err
