"""Every plan the planner makes for the reference MoE models, on each card it is told,
is one the glue's kernel check accepts (config-only checkpoints, no hub).

For each card and model: the plan is made with ``compute_capability`` set, and each experts
group it serves ``uva`` goes through ``experts.check_kernel`` with the kernel the table
says vLLM 0.33 builds for that method on that card (the method object is a stand-in named
as vLLM's class: building vLLM's quantized MoE methods needs CUDA here; which kernel they
pick is checked against vLLM's own oracles in tests/contract/test_kernel_table.py).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import transformers
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.activation import GeluAndMul, SiluAndMul
from vllm.model_executor.layers.fused_moe.activation import MoEActivation

from helpers import _TINY as TINY
from helpers import (
    TINY_DENSE_STEP,
    TINY_HOST_COMPUTE,
    TINY_MOE_FAMILIES,
    copy_room,
    loaded_bytes,
    workspace_room,
    write_config,
)
from selective_offload.checkpoint import load_checkpoint
from selective_offload.errors import PlanError
from selective_offload.planner import PlanInputs, kernels, make_plan
from selective_offload.sizes import GiB
from selective_offload.vllm_glue import auto_plan, experts, host_compute, host_mlp

MXFP4 = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
FP8_BLOCK = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]}
QWEN3_30B = dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
                 num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                 vocab_size=151936, tie_word_embeddings=False)


def gpt_oss(layers, experts_):
    """huggingface.co/openai/gpt-oss-20b and gpt-oss-120b, config.json."""
    return (transformers.GptOssConfig(num_hidden_layers=layers, num_local_experts=experts_, num_experts_per_tok=4,
                                      hidden_size=2880, intermediate_size=2880, num_attention_heads=64,
                                      num_key_value_heads=8, head_dim=64, vocab_size=201088, tie_word_embeddings=False),
            "GptOssForCausalLM", {"quantization_config": MXFP4, "experts_per_token": 4})


#: (label, config builder, device memory in GiB): the issue's reference plans.
MODELS = {
    "gpt-oss-20b": (lambda: gpt_oss(24, 32), 8),
    "gpt-oss-120b": (lambda: gpt_oss(36, 128), 24),
    "Qwen3-30B-A3B": (lambda: (transformers.Qwen3MoeConfig(**QWEN3_30B), "Qwen3MoeForCausalLM", {}), 24),
    "Qwen3-30B-A3B-FP8": (lambda: (transformers.Qwen3MoeConfig(**QWEN3_30B), "Qwen3MoeForCausalLM",
                                   {"quantization_config": FP8_BLOCK}), 24),
}
CARDS = ("8.6", "8.9", "9.0", "12.0")


def plan_for(tmp_path, model, card):
    """The plan of ``model`` for ``card`` with host-compute off: these tests check the glue's
    UVA kernel check, which host-compute groups do not go through."""
    build, gib = MODELS[model]
    config, arch, extra = build()
    checkpoint = load_checkpoint(write_config(tmp_path, config, arch, **extra))
    return checkpoint, make_plan(checkpoint, PlanInputs(device_memory_bytes=gib * GiB, compute_capability=card,
                                                      host_compute=False))


def method_standin(method: str, kernel: str):
    """An object named as vLLM's quant method for ``method``, its ``experts_cls`` named ``kernel``."""
    name = {"unquantized": "UnquantizedFusedMoEMethod", "fp8-block": "Fp8MoEMethod", "mxfp4": "GptOssMxfp4MoEMethod"}
    standin = type(name[method], (), {"block_quant": method == "fp8-block"})()
    standin.experts_cls = type(kernel, (), {})
    return standin


@pytest.mark.parametrize("card", CARDS)
@pytest.mark.parametrize("model", MODELS)
def test_no_plan_is_one_the_glue_refuses(tmp_path, model, card):
    checkpoint, plan = plan_for(tmp_path, model, card)
    assert plan.inputs.compute_capability == card
    method = kernels.method_of_config(checkpoint.config)
    kernel = kernels.kernel_for(method, card)
    uva = [g for g in plan.groups if g.serving == "uva"]
    for g in uva:
        experts.check_kernel(g.group, method_standin(method, kernel), torch.device("cuda"), card=card)
    if kernels.pick(method, card).moves:
        assert plan.strategy != "infeasible"
    else:  # the kernel's weights are not Parameters: no layer with routed experts leaves the device
        layers = {g.layer_index for g in plan.groups if g.kind == "experts"}
        assert not [g.group for g in plan.groups if g.layer_index in layers and g.serving in ("prefetch", "uva")]
        assert any("not Parameters" in n and "stays resident" in n for n in plan.notes)
    # Not vacuous: where the kernel reads UVA the plan does use it, and where it does not, the
    # glue would have refused a served uva group (and the plan says why it has none).
    assert bool(uva) == kernels.reads_uva(kernel)
    if not uva:
        with pytest.raises(PlanError):
            experts.check_kernel("g", method_standin(method, kernel), torch.device("cuda"), card=card)
        assert any(f"picks {kernel}" in n and "not known to read UVA" in n for n in plan.notes)


def test_gpt_oss_on_sm90_is_planned_without_uva_and_told_the_setting_that_allows_it(tmp_path):
    _, plan = plan_for(tmp_path, "gpt-oss-120b", "9.0")
    note = next(n for n in plan.notes if n.startswith("routed experts:"))
    assert "OAITritonMxfp4ExpertsMonolithic" in note and "with --moe-backend marlin vLLM picks MarlinExperts" in note
    assert "unpriced" in note and "global" in note  # the switch moves the device-resident layers too


def test_a_plan_without_a_card_says_which_it_assumed(tmp_path):
    build, gib = MODELS["gpt-oss-20b"]
    config, arch, extra = build()
    plan = make_plan(load_checkpoint(write_config(tmp_path, config, arch, **extra)),
                     PlanInputs(device_memory_bytes=gib * GiB, host_compute=False))
    assert plan.inputs.compute_capability is None and plan.inputs.card == kernels.DEFAULT_CARD
    assert any(n.startswith(f"card: compute capability {kernels.DEFAULT_CARD} (assumed") for n in plan.notes)
    # mutation check: the assumed card is the one the experts were planned for
    assert any(g.serving == "uva" for g in plan.groups)


def test_auto_reads_the_card_from_the_worker(monkeypatch):
    assert auto_plan.card_of_worker(torch.device("cpu")) is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert auto_plan.card_of_worker(torch.device("cuda")) == "9.0"


def _method(model: str) -> str | None:
    return kernels.method_of_config({"quantization_config": MODELS[model][0]()[2].get("quantization_config")})


#: The (model, card) pairs whose default kernel does not read UVA and for which a setting gives one that does.
ADVISED = [(m, c) for m in MODELS for c in CARDS
           if not kernels.reads_uva(kernels.kernel_for(_method(m), c)) and kernels.advice(_method(m), c)]


def test_some_reference_plans_need_a_setting():
    assert ADVISED  # else the test below checks nothing


@pytest.mark.parametrize("model,card", ADVISED)
def test_the_advice_in_the_plan_gives_a_plan_that_reads_experts_through_uva_and_that_the_glue_accepts(
        tmp_path, model, card):
    """Advice that works: where the default kernel does not read UVA, the note names a setting
    and the ``plan`` flag for it; the plan made with that setting serves experts uva, and
    the glue accepts them with the kernel vLLM 0.33 builds under that setting."""
    checkpoint, plan = plan_for(tmp_path, model, card)
    method = kernels.method_of_config(checkpoint.config)
    assert method == _method(model)
    fix = kernels.advice(method, card)
    note = next(n for n in plan.notes if n.startswith("routed experts:"))
    assert f"`plan {kernels.PLAN_FLAGS[fix]}`" in note, note
    build, gib = MODELS[model]
    advised = make_plan(checkpoint, PlanInputs(device_memory_bytes=gib * GiB, compute_capability=card,
                                               moe_setting=fix, host_compute=False))
    uva = [g for g in advised.groups if g.serving == "uva"]
    assert uva, f"{model} on SM {card} under {fix}: no experts read through UVA"
    kernel = kernels.kernel_for(method, card, fix)
    for g in uva:
        experts.check_kernel(g.group, method_standin(method, kernel), torch.device("cuda"), card=card)
    note = next(n for n in advised.notes if n.startswith("routed experts:"))
    assert f"under {fix}" in note and f"start vLLM with {fix}" in note, note


def test_auto_plans_for_the_server_s_moe_setting(monkeypatch):
    import types

    import vllm.envs as envs

    def server(backend):
        return types.SimpleNamespace(kernel_config=types.SimpleNamespace(moe_backend=backend))

    monkeypatch.setattr(envs, "VLLM_USE_DEEP_GEMM", True, raising=False)
    assert auto_plan.setting_of_server(server("auto")) == kernels.AUTO
    assert auto_plan.setting_of_server(server("triton")) == kernels.TRITON
    assert auto_plan.setting_of_server(server("flashinfer_cutlass")) == kernels.AUTO  # not in the table
    monkeypatch.setattr(envs, "VLLM_USE_DEEP_GEMM", False, raising=False)
    assert auto_plan.setting_of_server(server("auto")) == kernels.DEEP_GEMM_OFF


def test_a_plan_with_experts_on_the_host_made_for_another_card_is_refused_before_load(tmp_path):
    checkpoint, plan = plan_for(tmp_path, "gpt-oss-20b", "8.9")
    assert any(g.serving == "uva" for g in plan.groups)
    cuda = torch.device("cuda")
    experts.refuse_another_card(plan, cuda, card="8.9")  # its own card
    experts.refuse_another_card(plan, torch.device("cpu"))  # the CPU build: no kernel table
    with pytest.raises(PlanError, match=r"made for compute capability 8.9 and this card is 9.0: .*"
                                        r"plan --compute-capability 9.0") as err:
        experts.refuse_another_card(plan, cuda, card="9.0")
    assert "\n" not in str(err.value)
    assumed = make_plan(checkpoint, PlanInputs(device_memory_bytes=8 * GiB, host_compute=False))
    with pytest.raises(PlanError, match="made without a card, assuming compute capability 8.9"):
        experts.refuse_another_card(assumed, cuda, card="12.0")


def test_auto_on_the_cpu_build_makes_room_for_the_experts_vllm_pads(tmp_path):
    """Without a device memory limit (the CPU build) the plan made at engine start is resident:
    the room it is given is the model as vLLM allocates it on the plan's card, gpt-oss's MXFP4
    experts padded to 3072 x 2944 (planner.allocation), not the checkpoint's bytes."""
    import json
    import types

    from helpers import write_header_only
    from selective_offload.options import RunOptions

    E, H = 8, 2880
    tensors = {"model.embed_tokens.weight": ("BF16", [1024, H]), "lm_head.weight": ("BF16", [1024, H]),
               "model.norm.weight": ("BF16", [H])}
    for i in range(2):
        p = f"model.layers.{i}"
        tensors.update({f"{p}.self_attn.q_proj.weight": ("BF16", [4096, H]),
                        f"{p}.self_attn.o_proj.weight": ("BF16", [H, 4096]),
                        f"{p}.mlp.router.weight": ("BF16", [E, H]),
                        f"{p}.mlp.experts.gate_up_proj_blocks": ("U8", [E, 2 * H, H // 32, 16]),
                        f"{p}.mlp.experts.gate_up_proj_scales": ("U8", [E, 2 * H, H // 32]),
                        f"{p}.mlp.experts.gate_up_proj_bias": ("BF16", [E, 2 * H]),
                        f"{p}.mlp.experts.down_proj_blocks": ("U8", [E, H, H // 32, 16]),
                        f"{p}.mlp.experts.down_proj_scales": ("U8", [E, H, H // 32]),
                        f"{p}.mlp.experts.down_proj_bias": ("BF16", [E, H])})
    write_header_only(tmp_path / "model.safetensors", tensors)
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": H, "intermediate_size": H,
        "num_hidden_layers": 2, "num_local_experts": E, "num_experts_per_tok": 2, "num_attention_heads": 64,
        "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 1024, "tie_word_embeddings": False,
        "quantization_config": {"quant_method": "mxfp4"}}))
    config = types.SimpleNamespace(
        cache_config=types.SimpleNamespace(kv_cache_memory_bytes=None, cache_dtype="auto", gpu_memory_utilization=0.9),
        model_config=types.SimpleNamespace(model=str(tmp_path), max_model_len=64), speculative_config=None)
    plan, _ = auto_plan.plan_at_start(RunOptions("auto"), config, config.model_config, torch.device("cpu"))
    padded = [g for g in plan.groups if g.kind == "experts"]
    assert padded and all(g.bytes == E * (3 * 3072 * 2944 * 17 // 32 + (2 * 2944 + 3072) * 2) for g in padded)
    assert plan.model.total_bytes > load_checkpoint(tmp_path).total_bytes
    assert plan.strategy == "resident" and not plan.deficit_bytes


# ---- host-compute: every family x card, no computed group the worker's activation check refuses

#: Families as tiny config-only checkpoints (transformers' own config classes): the MoE ones the
#: engine tests build, and the ones issue #61 names, wide enough that the cold set does not close
#: the budget; ``gemma3-erf`` and ``mixtral-clamped`` are the refused cases (erf GELU MLPs; silu
#: experts clamped at a swiglu_limit, as vLLM 0.33 builds EXAONE-MoE's from that key).
HOST_FAMILIES = {
    **{name: (config, arch, {**extra, "intermediate_size": 512}) for name, (config, arch, extra) in
       TINY_MOE_FAMILIES.items()},
    "llama4": ("Llama4TextConfig", "Llama4ForCausalLM", dict(intermediate_size=512, intermediate_size_mlp=512,
                                                              num_local_experts=8, num_experts_per_tok=1)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(intermediate_size=1024)),
    "gemma3-erf": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(intermediate_size=1024, hidden_activation="gelu")),
    "gemma4": ("Gemma4TextConfig", "Gemma4ForCausalLM", dict(intermediate_size=256, num_experts=8, top_k_experts=2,
                                                              moe_intermediate_size=512, enable_moe_block=True)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        intermediate_size=1024, moe_intermediate_size=512, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=1, n_group=1, topk_group=1, kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=16,
        qk_nope_head_dim=16, v_head_dim=32)),
    "glm4_5": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(
        intermediate_size=1024, moe_intermediate_size=512, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
        first_k_dense_replace=1, n_group=1, topk_group=1, num_nextn_predict_layers=1)),
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM", dict(intermediate_size=512, num_local_experts=8,
                                                                      num_experts_per_tok=2)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(intermediate_size=1024)),
    "mixtral-clamped": ("MixtralConfig", "MixtralForCausalLM", dict(intermediate_size=512, num_local_experts=8,
                                                                     num_experts_per_tok=2, swiglu_limits=[7.0, 7.0])),
}
#: What vLLM 0.33 builds, read from its model code (not from cpu_kernels.capability): the routed
#: experts' MoEActivation and router weight on the input (gpt_oss.py:400; gemma4.py:655;
#: llama4.py:139, top-1; exaone_moe.py:138 and its swiglu_limit; FusedMoE's default, silu), and
#: the dense MLPs' act-and-mul (get_act_and_mul_fn of the config's hidden_activation / hidden_act).
EXPERTS_BUILT = {"gpt_oss": dict(activation="swigluoai"), "gemma4": dict(activation="gelu_tanh"),
                 "llama4": dict(activation="silu", apply_router_weight_on_input=True),
                 "mixtral-clamped": dict(activation="silu", swiglu_limit=7.0)}
MLP_BUILT = {"gemma3": ("GeluAndMul", "tanh"), "gemma3-erf": ("GeluAndMul", "none"), "gemma4": ("GeluAndMul", "tanh")}
#: Families whose plans compute no layer on the host at these sizes, and why: the refused ones,
#: and those the planner keeps on the device for reasons of its own (issue #61's other parts).
NOT_COMPUTED = {"gemma3-erf": "do not compute these dense MLPs: its activation is gelu (GELU with erf",
                "mixtral-clamped": "do not compute these routed experts: vLLM clamps its silu gate and up at 7",
                "gemma4": None}


@pytest.fixture(scope="module", params=list(HOST_FAMILIES))
def host_family(request, tmp_path_factory):
    config_cls, arch, extra = HOST_FAMILIES[request.param]
    # 8 layers: the room a step above the crossover holds is one layer's, which 2 tiny layers
    # would not outweigh (a family stating its layer types states them for 8)
    if "layer_types" in extra:
        extra = {**extra, "layer_types": extra["layer_types"] * 4}
    config = getattr(transformers, config_cls)(**{**TINY, "num_hidden_layers": 8, **extra})
    path = write_config(tmp_path_factory.mktemp(request.param), config, arch)
    return request.param, load_checkpoint(path)


def built_layer(family: str, group, checkpoint):
    """The layer vLLM builds for ``group``, as the worker's check reads it: a stand-in holding
    vLLM's own activation objects (a RoutedExperts needs a TP group; attributes as 0.33's)."""
    if group.kind == "experts":
        built = {"activation": "silu", **EXPERTS_BUILT.get(family, {})}
        return SimpleNamespace(**{**built, "activation": MoEActivation(built["activation"])},
                               top_k=checkpoint.facts.experts_per_token)
    name, approximate = MLP_BUILT.get(family, ("SiluAndMul", None))
    with set_current_vllm_config(VllmConfig()):
        act_fn = GeluAndMul(approximate=approximate) if name == "GeluAndMul" else SiluAndMul()
    return SimpleNamespace(act_fn=act_fn, gate_up_proj=SimpleNamespace(bias=None), down_proj=SimpleNamespace(bias=None))


def test_no_family_is_planned_compute_where_the_worker_refuses_it(host_family):
    """Each family on each card of the kernel table: every group the plan serves ``compute``
    passes the worker's own check (host_compute.activation_of, host_mlp.mlp_activation) on the
    layer vLLM builds for it; a family the kernels do not compute is planned without it, and
    the plan says why."""
    family, checkpoint = host_family
    computed = set()
    # the tiny replicas' steps (helpers): a dense model's MLPs are read whole by every token
    step = TINY_HOST_COMPUTE["max_num_batched_tokens"] if checkpoint.facts.num_experts else TINY_DENSE_STEP
    inputs = {**TINY_HOST_COMPUTE, "max_num_batched_tokens": step}
    for card in kernels.CARDS:
        room = copy_room(checkpoint, tokens=step) + workspace_room(checkpoint, compute_capability=card, **inputs)
        plan = make_plan(checkpoint, PlanInputs(device_memory_bytes=int(loaded_bytes(checkpoint) * 0.5) + room,
                                                kv_cache_bytes=0, reserve_bytes=0, compute_capability=card, **inputs))
        for g in (g for g in plan.groups if g.serving == "compute" and g.kind in ("experts", "mlp")):
            layer = built_layer(family, g, checkpoint)
            check = host_compute.activation_of if g.kind == "experts" else host_mlp.mlp_activation
            check(g.group, layer)
            computed.add(g.kind)
        if NOT_COMPUTED.get(family):
            assert any(NOT_COMPUTED[family] in n for n in plan.notes), plan.notes
    assert bool(computed) == (family not in NOT_COMPUTED), (family, computed)
    refused = [g for g in ("model.layers.0.mlp",) if family == "gemma3-erf"]
    for group in refused:  # not vacuous: the worker refuses what the plan left out
        with pytest.raises(PlanError, match="its activation is gelu"):
            host_mlp.mlp_activation(group, built_layer(family, SimpleNamespace(kind="mlp"), checkpoint))


def test_the_table_reads_the_language_models_config_of_a_multimodal_checkpoint():
    """Llama-4 Scout's and Gemma 4's configs keep the language model under ``text_config``
    (its model_type, top-k and activation): the table reads it there, as vLLM does."""
    from selective_offload.cpu_kernels import capability

    scout = {"model_type": "llama4", "text_config": {"model_type": "llama4_text", "hidden_act": "silu"}}
    layer = capability.experts_of_config(scout, 1)
    assert layer.router_weight_on_input and capability.refusal(layer) is None
    assert "routes 2 experts per token" in capability.refusal(capability.experts_of_config(scout, 2))
    gemma4 = {"model_type": "gemma4", "hidden_act": "silu",
              "text_config": {"model_type": "gemma4_text", "hidden_activation": "gelu_pytorch_tanh"}}
    assert capability.kernel_activation(capability.experts_of_config(gemma4, 8)).kind == "gelu_tanh"
    assert capability.kernel_activation(capability.mlp_of_config(gemma4)).kind == "gelu_tanh"
    assert "relu2, ungated" in capability.refusal(capability.experts_of_config({"model_type": "nemotron_h"}, 6))
    exaone = capability.experts_of_config({"model_type": "exaone_moe", "swiglu_limits": [0.0, 7.0, 0.0]}, 8)
    assert exaone.clamp_limit == 7.0 and "clamps its silu gate" in capability.refusal(exaone)
