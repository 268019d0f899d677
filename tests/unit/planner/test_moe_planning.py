"""Mixture-of-experts at expert level: which tensors are routed experts, how a MoE layer is
split into its experts group and the rest, what a step reads of them (k of E per token,
E(1 - (1 - k/E)^T) for T tokens), and the plan format that carries them."""

from __future__ import annotations

import json

import pytest
import torch

from builders import MB, inputs, make_ckpt
from selective_offload.checkpoint import ModelFacts
from selective_offload.errors import PlanError
from selective_offload.estimate.traffic import expert_read_fraction
from selective_offload.names import experts_prefix, group_key, group_keys
from selective_offload.plan_format import Plan
from selective_offload.planner import PlanInputs, group_tensors, make_plan

E, K = 8, 2


def moe(layers: int = 4, *, dense_first: int = 1, fused: bool = True, shared: bool = True, **config):
    """A MoE model in round numbers: embed/lm_head 100 MB each, attention 10 MB a layer,
    routed experts 80 MB a MoE layer (8 experts of 10 MB), a shared expert 4 MB, the first
    ``dense_first`` layers dense (a 20 MB MLP, as DeepSeek's first_k_dense_replace)."""
    spec = {
        "model.embed_tokens.weight": ("BF16", [1000, 50_000]),
        "lm_head.weight": ("BF16", [1000, 50_000]),
        "model.norm.weight": ("BF16", [500]),
    }
    for i in range(layers):
        spec[f"model.layers.{i}.self_attn.qkv.weight"] = ("BF16", [1000, 5000])
        spec[f"model.layers.{i}.input_layernorm.weight"] = ("BF16", [500])
        if i < dense_first:
            spec[f"model.layers.{i}.mlp.gate_proj.weight"] = ("BF16", [1000, 10_000])
            continue
        spec[f"model.layers.{i}.mlp.gate.weight"] = ("BF16", [E, 500])
        if shared:
            spec[f"model.layers.{i}.mlp.shared_experts.up_proj.weight"] = ("BF16", [1000, 2000])
        if fused:
            spec[f"model.layers.{i}.mlp.experts.gate_up_proj"] = ("BF16", [E, 1000, 3000])
            spec[f"model.layers.{i}.mlp.experts.down_proj"] = ("BF16", [E, 1000, 2000])
        else:
            for e in range(E):
                spec[f"model.layers.{i}.mlp.experts.{e}.gate_up_proj.weight"] = ("BF16", [1000, 3000])
                spec[f"model.layers.{i}.mlp.experts.{e}.down_proj.weight"] = ("BF16", [1000, 2000])
    return make_ckpt(spec, **{"num_experts": E, "num_experts_per_tok": K, "num_hidden_layers": layers, **config})


def by_name(plan_or_groups):
    groups = plan_or_groups.groups if isinstance(plan_or_groups, Plan) else plan_or_groups
    return {(g.group if hasattr(g, "group") else g.name): g for g in groups}


# ---- the naming rule


@pytest.mark.parametrize("name, prefix", [
    ("model.layers.3.mlp.experts.gate_up_proj", "model.layers.3.mlp.experts"),
    ("model.layers.3.mlp.experts.17.down_proj.weight", "model.layers.3.mlp.experts"),
    ("model.layers.3.mlp.experts.gate_up_proj_blocks", "model.layers.3.mlp.experts"),
    ("language_model.model.layers.3.feed_forward.experts.w13_weight",
     "language_model.model.layers.3.feed_forward.experts"),
    ("model.layers.3.block_sparse_moe.experts.0.w1.weight", "model.layers.3.block_sparse_moe.experts"),
    ("model.layers.3.mlp.shared_experts.gate_proj.weight", None),
    ("model.layers.3.feed_forward.shared_expert.down_proj.weight", None),
    ("model.layers.3.mlp.gate.weight", None),
    ("model.layers.3.mlp.gate_proj.weight", None),
    ("model.experts.weight", None),  # not inside a decoder layer
    # Granite-MoE's fused experts: the group vLLM's mapper loads them into
    ("model.layers.3.block_sparse_moe.input_linear.weight", "model.layers.3.block_sparse_moe.experts"),
    ("model.layers.3.block_sparse_moe.output_linear", "model.layers.3.block_sparse_moe.experts"),
    ("model.layers.3.shared_mlp.input_linear.weight", None),  # GraniteMoeShared's dense shared MLP
    # an FP8 Granite 4.0-H's scales, which vLLM's load_weights maps onto the same fused experts
    ("model.layers.3.block_sparse_moe.input_linear.weight_scale", "model.layers.3.block_sparse_moe.experts"),
    ("model.layers.3.block_sparse_moe.output_linear.weight_scale", "model.layers.3.block_sparse_moe.experts"),
])
def test_routed_experts_are_a_whole_experts_segment_inside_a_layer(name, prefix):
    assert experts_prefix(name) == prefix


def test_an_experts_key_falls_back_to_its_layer_for_plans_without_expert_groups():
    assert group_key("model.layers.3.mlp.experts.w13_weight", ()) == ("experts", 3)
    assert group_keys("model.layers.3.mlp.experts.w13_weight", ()) == (("experts", 3), ("layer", 3))
    # a shared expert is under the layer's mlp: an mlp group first (a dense layer's, never a MoE
    # layer's), then the layer, which holds it in every plan
    assert group_keys("model.layers.3.mlp.shared_experts.w", ()) == (("mlp", 3), ("layer", 3))
    assert group_keys("model.layers.3.self_attn.w", ()) == (("layer", 3),)


# ---- E and k from the config


@pytest.mark.parametrize("config, expected", [
    ({"num_experts": 128, "num_experts_per_tok": 8}, (128, 8)),                      # Qwen3-MoE
    ({"num_local_experts": 32, "experts_per_token": 4}, (32, 4)),                    # gpt-oss
    ({"n_routed_experts": 256, "num_experts_per_tok": 8}, (256, 8)),                 # DeepSeek-V3, GLM-4 MoE
    ({"text_config": {"num_local_experts": 16, "num_experts_per_tok": 1}}, (16, 1)),  # Llama 4
    ({"num_experts": 128, "top_k_experts": 8}, (128, 8)),                            # Gemma 4
    ({"num_experts": None, "top_k_experts": None}, (None, None)),                    # a dense Gemma 4
])
def test_experts_and_top_k_come_from_the_config_under_any_of_their_names(config, expected):
    facts = ModelFacts.from_config(config)
    assert (facts.num_experts, facts.experts_per_token) == expected


# ---- the read fraction


def test_one_token_reads_k_of_e_and_many_tokens_approach_all():
    assert expert_read_fraction(32, 4, 1) == pytest.approx(4 / 32)
    assert expert_read_fraction(128, 8, 4) == pytest.approx(1 - (1 - 8 / 128) ** 4)
    assert expert_read_fraction(8, 2, 1000) == pytest.approx(1.0)
    assert expert_read_fraction(8, 8, 1) == 1.0


def test_a_uniform_routing_profile_gives_the_uniform_fraction_and_a_skewed_one_less():
    uniform = (K / E,) * E
    assert expert_read_fraction(E, K, 4, routing=uniform) == pytest.approx(expert_read_fraction(E, K, 4))
    skewed = (0.5, 0.5, 0.5, 0.5, 0.0, 0.0, 0.0, 0.0)  # sums to k = 2: half the experts never used
    assert expert_read_fraction(E, K, 4, routing=skewed) < expert_read_fraction(E, K, 4)


# ---- the split


@pytest.mark.parametrize("fused", [True, False], ids=["fused-3d", "per-expert"])
def test_a_moe_layer_is_its_experts_group_and_the_rest(fused):
    g = by_name(group_tensors(moe(fused=fused), inputs(10_000)))
    experts, layer = g["model.layers.1.mlp.experts"], g["model.layers.1"]
    assert (experts.kind, experts.role, experts.layer_index) == ("experts", "hot", 1)
    assert (experts.num_experts, experts.experts_per_token) == (E, K)
    assert experts.nbytes == 80 * MB and experts.est_read_bytes_per_step == 80 * MB * K // E
    # Attention, norms, router and the shared expert stay in the layer group, read whole.
    assert layer.nbytes == 10 * MB + 1000 + E * 1000 + 4 * MB == layer.est_read_bytes_per_step
    assert (layer.num_experts, layer.experts_per_token) == (0, 0)
    # A dense layer (first_k_dense_replace) has no experts group.
    assert "model.layers.0.mlp.experts" not in g and g["model.layers.0"].nbytes == 30 * MB + 1000


def test_e_comes_from_the_headers_when_they_show_it():
    ckpt = moe(num_experts=64)  # the config disagrees with the tensors (8 experts)
    assert by_name(group_tensors(ckpt, inputs(10_000)))["model.layers.1.mlp.experts"].num_experts == E


def test_without_a_top_k_in_the_config_every_expert_is_priced_as_read():
    ckpt = moe(num_experts_per_tok=None)
    plan = make_plan(ckpt, inputs(10_000))
    experts = by_name(plan)["model.layers.1.mlp.experts"]
    assert experts.experts_per_token == E and experts.est_read_bytes_per_step == experts.bytes
    assert any("no experts per token" in n for n in plan.notes)


def test_a_prefetched_layer_takes_its_experts_with_it():
    """The prefetch offloader copies a whole layer module, experts included, and its
    buffers need a slot for every parameter the layer has (experts too). Here nothing
    fits, and every layer prefetched leaves the smallest shortfall."""
    ckpt = moe(layers=8, dense_first=0)
    plan = make_plan(ckpt, inputs((ckpt.total_bytes - 900 * MB) / MB))
    g = by_name(plan)
    assert plan.strategy == "infeasible" and plan.hot_layer_indices == tuple(range(8))
    for i in plan.hot_layer_indices:
        assert g[f"model.layers.{i}"].serving == g[f"model.layers.{i}.mlp.experts"].serving == "prefetch"
    assert plan.prefetch_buffer_bytes >= 80 * MB + 14 * MB


def test_routed_experts_read_through_uva_close_the_deficit_before_whole_layers():
    """At batch 1 a step reads k/E = 1/4 of the experts it keeps on the host: far cheaper
    than copying whole layers, which also need device buffers of a layer's size."""
    ckpt = moe(layers=8)
    plan = make_plan(ckpt, inputs((ckpt.total_bytes - 250 * MB) / MB))
    assert plan.strategy == "hot_offload" and not plan.hot_layer_indices
    # The cold set (the 100 MB embedding) first, then the fewest experts groups: 2 of 80 MB.
    assert plan.cold_on_host_bytes == 100 * MB and plan.uva_bytes == 160 * MB
    for baseline in plan.baselines:
        assert baseline.est.est_step_s > plan.est.est_step_s


def test_when_experts_alone_cannot_close_the_deficit_dense_layers_are_prefetched():
    ckpt = moe(layers=8, dense_first=6)
    plan = make_plan(ckpt, inputs((ckpt.total_bytes - 300 * MB) / MB))
    g = by_name(plan)
    assert plan.uva_bytes == 160 * MB and plan.hot_layer_indices
    assert all(g[f"model.layers.{i}"].serving == "prefetch" for i in plan.hot_layer_indices)
    assert plan.strategy == "hot_offload" and plan.shortfall_bytes == 0


# ---- the plan format


@pytest.fixture
def moe_plan():
    """Routed experts of two layers through UVA, three dense layers prefetched."""
    ckpt = moe(layers=8, dense_first=6)
    plan = make_plan(ckpt, inputs((ckpt.total_bytes - 300 * MB) / MB))
    assert plan.uva_bytes and plan.hot_layer_indices
    return ckpt, plan


def test_a_plan_round_trips_its_expert_groups(moe_plan, tmp_path):
    _, plan = moe_plan
    data = json.loads(plan.to_json())
    assert data["format"] == "selective-offload/plan-v5"
    experts = next(g for g in data["groups"] if g["group"] == "model.layers.7.mlp.experts")
    assert (experts["kind"], experts["num_experts"], experts["experts_per_token"]) == ("experts", E, K)
    assert (experts["role"], experts["location"], experts["serving"]) == ("hot", "host", "uva")
    path = tmp_path / "plan.json"
    plan.save(path)
    assert Plan.load(path) == plan


def _load(data, tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    return Plan.load(path)


def _edit(plan, name, **fields):
    data = json.loads(plan.to_json())
    data.pop("totals")
    next(g for g in data["groups"] if g["group"] == name).update(fields)
    return data


@pytest.mark.parametrize("fields, match", [
    ({"location": "host", "serving": "uva"}, "serving uva is for groups of kind experts"),
], ids=["uva-on-a-layer"])
def test_uva_is_only_for_routed_experts(moe_plan, tmp_path, fields, match):
    _, plan = moe_plan
    with pytest.raises(PlanError, match=match):
        _load(_edit(plan, "model.layers.0", **fields), tmp_path)


@pytest.mark.parametrize("fields, match", [
    ({"experts_per_token": 9}, "1 <= experts_per_token <= num_experts"),
    ({"num_experts": 0}, "1 <= experts_per_token <= num_experts"),
    ({"role": "cold"}, "a group of role cold cannot be served uva"),
    ({"layer_index": None}, "a group of kind experts or layer or mlp, and only such a group, has a layer_index"),
    ({"est_read_bytes_per_step": 1}, r"reads 2 of its 8 routed experts \(est\), so est_read_bytes_per_step must be"),
    ({"group": "model.layers.7.mlp"}, "a group of kind experts is the routed experts module of one layer"),
])
def test_an_experts_group_is_checked(moe_plan, tmp_path, fields, match):
    _, plan = moe_plan
    with pytest.raises(PlanError, match=match):
        _load(_edit(plan, "model.layers.7.mlp.experts", **fields), tmp_path)


def test_expert_counts_belong_to_experts_groups_only(moe_plan, tmp_path):
    _, plan = moe_plan
    with pytest.raises(PlanError, match="num_experts and experts_per_token are for kind experts only"):
        _load(_edit(plan, "model.layers.7", num_experts=8), tmp_path)


def test_experts_are_served_prefetch_exactly_when_their_layer_is(tmp_path):
    plan = make_plan(moe(layers=4), inputs(10_000))  # resident
    data = _edit(plan, "model.layers.1", location="host", serving="prefetch")
    data.update(hot_layer_indices=[1], strategy="hot_offload")
    with pytest.raises(PlanError, match="served prefetch exactly when their layer is"):
        _load(data, tmp_path)
    data = _edit(plan, "model.layers.2.mlp.experts", location="host", serving="prefetch")
    with pytest.raises(PlanError, match="served prefetch exactly when their layer is"):
        _load(data, tmp_path)


def test_routed_experts_without_their_layer_are_refused(moe_plan, tmp_path):
    _, plan = moe_plan
    data = json.loads(plan.to_json())
    data.pop("totals")
    data["groups"] = [g for g in data["groups"] if g["group"] != "model.layers.7"]
    with pytest.raises(PlanError, match="no layer group has layer_index 7"):
        _load(data, tmp_path)


def test_experts_read_in_place_are_host_bytes_priced_at_the_read_fraction(tmp_path):
    plan = make_plan(moe(layers=4), inputs(10_000))  # resident: no prefetch overlap to account for
    data = _edit(plan, "model.layers.2.mlp.experts", location="host", serving="uva")
    data["strategy"] = "hot_offload"
    edited = _load(data, tmp_path)
    g = by_name(edited)["model.layers.2.mlp.experts"]
    assert g.on_host and edited.uva_bytes == g.bytes == 80 * MB
    assert g.est_link_bytes_per_step == 80 * MB * K // E
    # Read in line over the link instead of from VRAM: the layer's k/E share of 80 MB.
    # read by the kernels in place: at the UVA read rate, not the copy rate
    uva, vram = edited.inputs.uva_read_gbps * 1e9, edited.inputs.vram_read_gbps * 1e9
    added = 80 * MB * K / E * (1 / uva - 1 / vram)
    assert edited.est.est_step_s == pytest.approx(plan.est.est_step_s + added, rel=1e-9)


def test_cpu_offload_offload_reads_only_the_routed_experts_of_host_expert_tensors():
    """vLLM's cpu_offload_gb is UVA: a host expert tensor crosses the link only for the
    experts the step routes to, so its bytes per step are far below what it offloads."""
    ckpt = moe(layers=8, dense_first=0, shared=False)
    plan = make_plan(ckpt, inputs((ckpt.total_bytes - 500 * MB) / MB))
    cpu_offload = plan.vllm_cpu_offload_gb
    assert cpu_offload is not None and cpu_offload.offloaded_bytes >= 500 * MB
    link = plan.inputs.link_gbps * 1e9
    assert cpu_offload.est.est_link_s_per_step * link < 0.5 * cpu_offload.offloaded_bytes
    # Read whole, the same bytes would cost every offloaded byte over the link.
    assert cpu_offload.est.est_link_s_per_step * link > K / E * 0.8 * cpu_offload.offloaded_bytes


def test_when_a_vllm_baseline_is_faster_the_plan_says_so_and_why():
    """A layer's routed experts go to the host whole; vLLM's segment selection takes single
    tensors up to its GiB budget. With one 16 GB experts group where 2 GB would do, the
    segment selection reads less per step, and the plan says so."""
    spec = {"model.embed_tokens.weight": ("BF16", [1000, 50_000]), "lm_head.weight": ("BF16", [1000, 50_000])}
    for i in range(4):
        spec[f"model.layers.{i}.self_attn.qkv.weight"] = ("BF16", [1000, 5000])
        spec[f"model.layers.{i}.mlp.experts.gate_up_proj"] = ("BF16", [E, 10_000, 60_000])
        spec[f"model.layers.{i}.mlp.experts.down_proj"] = ("BF16", [E, 10_000, 40_000])
    ckpt = make_ckpt(spec, num_experts=E, num_experts_per_tok=K)
    plan = make_plan(ckpt, inputs((ckpt.total_bytes - 2100 * MB) / MB))
    segments = plan.vllm_cpu_offload_params
    assert segments is not None and segments.cpu_offload_params == ("experts",) and segments.fits
    assert segments.est.est_step_s < plan.est.est_step_s
    assert any(n.startswith("selective is not estimated faster than vLLM's cpu_offload_gb=2, cpu_offload_params="
                            "experts") and "routed experts go to the host whole" in n for n in plan.notes)


# ---- the landing report treats an experts group like any group


class _Experts(torch.nn.Module):
    """vLLM's FusedMoE holds a layer's routed experts as two 3-D parameters."""

    def __init__(self, hidden, inter):
        super().__init__()
        self.w13_weight = torch.nn.Parameter(torch.zeros(E, 2 * inter, hidden))
        self.w2_weight = torch.nn.Parameter(torch.zeros(E, hidden, inter))


class _MoeLayer(torch.nn.Module):
    def __init__(self, hidden, inter):
        super().__init__()
        self.self_attn = torch.nn.Module()
        self.self_attn.qkv_proj = torch.nn.Linear(hidden, 3 * hidden, bias=False)
        self.mlp = torch.nn.Module()
        self.mlp.gate = torch.nn.Linear(hidden, E, bias=False)
        self.mlp.experts = _Experts(hidden, inter)


class _MoeModel(torch.nn.Module):
    def __init__(self, hidden=16, inter=32, layers=4):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.embed_tokens = torch.nn.Embedding(64, hidden)
        self.model.layers = torch.nn.ModuleList(_MoeLayer(hidden, inter) for _ in range(layers))
        self.lm_head = torch.nn.Linear(hidden, 64, bias=False)


def _moe_checkpoint(hidden=16, inter=32, layers=4, dtype="F32", **config):
    spec = {"model.embed_tokens.weight": (dtype, [64, hidden]), "lm_head.weight": (dtype, [64, hidden])}
    for i in range(layers):
        for proj in ("q_proj", "k_proj", "v_proj"):
            spec[f"model.layers.{i}.self_attn.{proj}.weight"] = (dtype, [hidden, hidden])
        spec[f"model.layers.{i}.mlp.gate.weight"] = (dtype, [E, hidden])
        spec[f"model.layers.{i}.mlp.experts.gate_up_proj"] = (dtype, [E, 2 * inter, hidden])
        spec[f"model.layers.{i}.mlp.experts.down_proj"] = (dtype, [E, hidden, inter])
    return make_ckpt(spec, num_experts=E, num_experts_per_tok=K, num_hidden_layers=layers, **config)


def _uva_report(model, plan, uva_layers):
    from selective_offload.report import build_report

    uva = {id(p) for i in uva_layers for p in model.model.layers[i].mlp.experts.parameters()}
    cold = {id(p) for p in model.model.embed_tokens.parameters()} if plan.cold_on_host_bytes else set()
    return build_report(model, plan, compute_device=torch.device("cpu"), cold_on_host_params=cold,
                        prefetch_params=set(), uva_params=uva, routed_names=None)


@pytest.fixture
def uva_plan():
    ckpt = _moe_checkpoint()
    one_group = E * 3 * 32 * 16 * 4
    plan = make_plan(ckpt, PlanInputs(device_memory_bytes=ckpt.total_bytes - 64 * 16 * 4 - one_group,
                                      kv_cache_bytes=0, reserve_bytes=0))
    uva = [g.layer_index for g in plan.groups if g.serving == "uva"]
    assert uva == [0] and plan.hot_layer_indices == ()
    return plan, uva


def test_the_report_finds_routed_experts_on_the_host_as_planned(uva_plan):
    plan, uva = uva_plan
    model = _MoeModel()
    report = _uva_report(model, plan, uva)
    assert report.ok, report.problems
    landing = report.landing("model.layers.0.mlp.experts")
    assert (landing.planned, landing.actual) == ("uva", "uva")
    assert report.landed_uva_bytes == report.loaded_uva_bytes == report.planned_uva_bytes
    assert report.landing("model.layers.1.mlp.experts").actual == "resident"
    assert report.unplanned == {}


def test_the_report_judges_host_computed_experts(uva_plan):
    """A bf16 checkpoint's host experts are computed on the host CPU: found in the host
    experts it computes, they land as planned; left with the device, they do not."""
    from selective_offload.report import build_report

    ckpt = _moe_checkpoint(dtype="BF16", torch_dtype="bfloat16")
    one_group = E * 3 * 32 * 16 * 2
    plan = make_plan(ckpt, PlanInputs(device_memory_bytes=ckpt.total_bytes - 64 * 16 * 2 - one_group,
                                      kv_cache_bytes=0, reserve_bytes=0, cpu_gbps=55.0, cpu_gbps_source="flag",
                                      handoff_s=1e-9))
    computed = [g.layer_index for g in plan.groups if g.serving == "compute"]
    assert computed and plan.host_compute is not None
    model = _MoeModel()
    cold = {id(p) for p in model.model.embed_tokens.parameters()} if plan.cold_on_host_bytes else set()

    def report(layers):
        params = {id(p) for i in layers for p in model.model.layers[i].mlp.experts.parameters()}
        return build_report(model, plan, compute_device=torch.device("cpu"), cold_on_host_params=cold,
                            prefetch_params=set(), host_compute_params=params, routed_names=None)

    good = report(computed)
    assert good.ok, good.problems
    landing = good.landing(f"model.layers.{computed[0]}.mlp.experts")
    assert (landing.planned, landing.actual) == ("compute", "compute")
    assert good.landed_host_compute_bytes == good.loaded_host_compute_bytes > 0
    assert "compute on host: planned" in good.render()
    bad = report([])
    assert not bad.ok and bad.misplaced_compute_bytes == good.loaded_host_compute_bytes
    assert any("of compute bytes (as loaded) did not land where planned" in p for p in bad.problems)


def test_the_report_says_when_routed_experts_stayed_on_the_device(uva_plan):
    plan, _ = uva_plan
    report = _uva_report(_MoeModel(), plan, [])
    assert not report.ok
    assert any("of uva bytes (as loaded) did not land where planned" in p and "model.layers.0.mlp.experts" in p
               for p in report.problems)


def test_a_plan_without_expert_groups_counts_vllm_experts_in_their_layer():
    from selective_offload.report import build_report

    ckpt = _moe_checkpoint()
    plan = make_plan(ckpt, PlanInputs(device_memory_bytes=ckpt.total_bytes, kv_cache_bytes=0, reserve_bytes=0))
    data = json.loads(plan.to_json())
    # As format v2 grouped a MoE layer: its routed experts inside the layer group, read whole.
    layers = {g["layer_index"]: g for g in data["groups"] if g["kind"] == "layer"}
    for e in (g for g in data["groups"] if g["kind"] == "experts"):
        layer = layers[e["layer_index"]]
        layer["bytes"] += e["bytes"]
        layer["num_tensors"] += e["num_tensors"]
        layer["est_read_bytes_per_step"] = layer["bytes"]
    data["groups"] = [g for g in data["groups"] if g["kind"] != "experts"]
    for g in data["groups"]:
        g.pop("dtype_bytes")
        g.pop("num_experts", None), g.pop("experts_per_token", None)
    data.pop("totals")
    old = Plan.from_dict(data)
    model = _MoeModel()
    report = build_report(model, old, compute_device=torch.device("cpu"), cold_on_host_params=set(),
                          prefetch_params=set())
    assert report.unplanned == {} and report.landing("model.layers.0").num_params == 4


# ---- sparse-read tables vLLM keeps in host memory itself


@pytest.mark.parametrize("arch, field, table", [
    ("DeepseekV41ForCausalLM", "engram_layer_ids", "engram.embed"),
    ("Qwen4ExpForCausalLM", "ple_layer_ids", "ple.ngram_embedding.shard_0"),
])
def test_ngram_tables_vllm_keeps_on_the_host_are_counted_there(arch, field, table):
    """vLLM 0.33's EngramConfig.cpu_offload (on by default) keeps these tables in pinned
    host memory for the architectures config/engram.py lists: they are not device bytes,
    in the plan or in the cpu_offload_gb baseline, and close no deficit the plan has to pay for."""
    spec = {"model.embed_tokens.weight": ("BF16", [1000, 50_000]), "lm_head.weight": ("BF16", [1000, 50_000])}
    for i in range(4):
        spec[f"model.layers.{i}.self_attn.qkv.weight"] = ("BF16", [1000, 25_000])
    spec[f"model.layers.1.{table}.weight"] = ("F8_E4M3", [300_000, 1000])  # 300 MB
    declared = make_ckpt(dict(spec), architectures=[arch], **{field: [1]})
    plan = make_plan(declared, inputs(10_000))
    g = by_name(plan)[f"model.layers.1.{table.split('.shard_')[0]}"]
    assert (g.role, g.serving, g.bytes) == ("cold", "gather", 300 * MB)
    assert plan.device_bytes == declared.total_bytes - 300 * MB and plan.strategy == "cold_offload"
    assert "EngramConfig.cpu_offload" in g.reason
    # Without the config field the same tensors are ordinary layer bytes.
    undeclared = make_plan(make_ckpt(dict(spec), architectures=[arch]), inputs(10_000))
    assert undeclared.strategy == "resident" and by_name(undeclared)["model.layers.1"].bytes == 350 * MB


def test_vllm_names_an_engram_table_embed_tokens_and_it_is_still_not_the_embedding():
    assert group_key("model.layers.3.engram.embed_tokens.weight", ("embed_tokens",)) == ("host-table", 3)
    assert group_key("model.embed_tokens.weight", ("embed_tokens",)) == ("cold", "embed_tokens")
