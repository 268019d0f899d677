"""Routed experts are priced at the sizes vLLM 0.33 allocates them for the kernel it picks on
the plan's card (``planner.allocation``, ``kernels.ROUND_UP``), checked against arithmetic
done here by hand: gpt-oss's MXFP4 experts (hidden 2880, intermediate 2880) are padded to
3072 x 2944 for Marlin on SM 8.6 and kept as stored for OAI triton_kernels on SM 9.0.
tests/contract/test_kernel_table.py holds the same sizes to vLLM 0.33's own round-up.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import transformers

from helpers import write_config
from selective_offload.checkpoint import load_checkpoint
from selective_offload.errors import PlanError, UserError
from selective_offload.estimate.traffic import EXPERTS_CPU
from selective_offload.model_match import check_plan_matches_model, differences
from selective_offload.plan_format import Plan
from selective_offload.planner import PlanInputs, kernels, make_plan
from selective_offload.planner.allocation import tensor_dims
from selective_offload.sizes import GiB

MXFP4 = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
LAYERS, EXPERTS = 4, 16


def mxfp4_expert(hidden, intermediate):
    """One gpt-oss expert as vLLM allocates it at these sizes: gate_up (2I x H) and down (H x I)
    as MXFP4 codes (half a byte) and e8m0 scales (a byte per 32), plus bf16 biases (2I and H)."""
    codes_and_scales = 3 * hidden * intermediate * 17 // 32
    return codes_and_scales, (2 * intermediate + hidden) * 2


def gpt_oss(tmp_path):
    config = transformers.GptOssConfig(num_hidden_layers=LAYERS, num_local_experts=EXPERTS, num_experts_per_tok=4,
                                       hidden_size=2880, intermediate_size=2880, num_attention_heads=64,
                                       num_key_value_heads=8, head_dim=64, vocab_size=4096, tie_word_embeddings=False)
    return load_checkpoint(write_config(tmp_path, config, "GptOssForCausalLM", quantization_config=MXFP4))


def experts(plan):
    return [g for g in plan.groups if g.kind == "experts"]


def test_gpt_oss_experts_are_priced_padded_for_marlin_on_sm_8_6_and_as_stored_on_sm_9_0(tmp_path):
    checkpoint = gpt_oss(tmp_path)
    marlin = make_plan(checkpoint, PlanInputs(device_memory_bytes=80 * GiB, compute_capability="8.6"))
    triton = make_plan(checkpoint, PlanInputs(device_memory_bytes=80 * GiB, compute_capability="9.0"))
    padded, stored = mxfp4_expert(3072, 2944), mxfp4_expert(2880, 2880)
    assert sum(padded) == 14431744 and sum(stored) == 13236480  # +9.03% an expert
    for g in experts(marlin):
        assert g.bytes == EXPERTS * sum(padded)
        assert dict(g.dtype_bytes) == {"BF16": EXPERTS * padded[1], "U8": EXPERTS * padded[0]}
    for g in experts(triton):  # OAI triton_kernels' post-processing holds the biases in float32
        assert g.bytes == EXPERTS * (stored[0] + 2 * stored[1])
        assert dict(g.dtype_bytes) == {"BF16": EXPERTS * 2 * stored[1], "U8": EXPERTS * stored[0]}
    # the checkpoint's own bytes: what the SM 9.0 plan holds less its float32 biases' second
    # half, and less the padding on SM 8.6
    extra = LAYERS * EXPERTS * (sum(padded) - sum(stored))
    assert triton.model.total_bytes == checkpoint.total_bytes + LAYERS * EXPERTS * stored[1]
    assert marlin.model.total_bytes == checkpoint.total_bytes + extra
    assert any("triton_kernels hold the routed experts' biases in float32" in n for n in triton.notes)
    assert not any("post-processing" in n for n in marlin.notes)  # Marlin MXFP4 keeps scales and biases as sized
    # each plan says so, and each is a plan for this checkpoint (the model check prices alike)
    note = next(n for n in marlin.notes if "priced at the sizes vLLM 0.33 allocates" in n)
    assert "MarlinExperts on SM 8.6: hidden 2880 -> 3072, intermediate 2880 -> 2944" in note and "9.03%" in note
    assert not any("priced at the sizes vLLM 0.33 allocates" in n for n in triton.notes)
    assert check_plan_matches_model(marlin, checkpoint) == []
    assert check_plan_matches_model(triton, checkpoint) == []


def test_gpt_oss_experts_on_sm_10_0_are_padded_for_trtllm_with_float32_biases(tmp_path):
    """FlashInfer TRT-LLM serves MXFP4 experts on SM 10.0: padded to (256, 128), and its
    post-processing casts their biases to float32 (oracle/mxfp4.py's TRTLLM_BACKENDS branch)."""
    checkpoint = gpt_oss(tmp_path)
    trtllm = make_plan(checkpoint, PlanInputs(device_memory_bytes=80 * GiB, compute_capability="10.0"))
    padded = mxfp4_expert(3072, 2944)  # hidden 2880 -> 3072 (256), intermediate 2880 -> 2944 (128)
    for g in experts(trtllm):
        assert g.bytes == EXPERTS * (padded[0] + 2 * padded[1])
        assert dict(g.dtype_bytes) == {"BF16": EXPERTS * 2 * padded[1], "U8": EXPERTS * padded[0]}
    assert any("FlashInfer TRT-LLM hold the routed experts' biases in float32" in n for n in trtllm.notes)
    assert check_plan_matches_model(trtllm, checkpoint) == []


def test_host_memory_the_device_share_and_the_cpus_bytes_are_the_padded_experts(tmp_path):
    """A host-compute plan on SM 8.6: every byte of routed experts it puts in host memory, in
    a device share, or before the CPU in a step, is an expert at 3072 x 2944."""
    checkpoint = gpt_oss(tmp_path)
    plan = make_plan(checkpoint, PlanInputs(device_memory_bytes=4 * GiB, compute_capability="8.6"))
    per_expert = sum(mxfp4_expert(3072, 2944))
    computed = [g for g in experts(plan) if g.serving == "compute"]
    assert computed and all(g.bytes == EXPERTS * per_expert for g in computed)
    head = sum(g.bytes for g in plan.groups if g.kind == "module" and g.serving == "compute")
    assert plan.host_compute_bytes == len(computed) * EXPERTS * per_expert + head
    shared = [g for g in computed if g.device_experts]
    assert shared, "the plan keeps a device share"
    for g in shared:
        assert plan.share_bytes(g) == g.device_experts * per_expert  # MXFP4 shares are held as stored
    # the step model prices each layer's CPU part from the padded experts too
    cpu = [e for e in plan.traffic().experts if e.where == EXPERTS_CPU and e.layer >= 0]
    assert len(cpu) == len(computed) and all(e.nbytes == EXPERTS * per_expert for e in cpu)


def test_unquantized_experts_are_padded_to_128_intermediate_channels_on_sm_10_0_only(tmp_path):
    """vLLM's FlashInfer TRT-LLM bf16 kernel (SM 10.0) rounds the intermediate size up to 128
    (oracle/unquantized.py:391-392); Triton (SM 8.9) takes it as it is."""
    config = transformers.Qwen3MoeConfig(hidden_size=256, intermediate_size=512, moe_intermediate_size=96,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=64, num_experts=8, num_experts_per_tok=2, vocab_size=1024,
                                         tie_word_embeddings=False)
    checkpoint = load_checkpoint(write_config(tmp_path, config, "Qwen3MoeForCausalLM"))
    for card, intermediate in (("8.9", 96), ("10.0", 128)):
        plan = make_plan(checkpoint, PlanInputs(device_memory_bytes=8 * GiB, compute_capability=card))
        assert [g.bytes for g in experts(plan)] == [8 * 3 * 256 * intermediate * 2] * 2, card


#: The sizes vLLM 0.33 allocates gpt-oss's experts at on each card, by hand from its sources:
#: Marlin (SM 7.5 and up, quantization/utils/marlin_utils_fp4.py:34-35) and FlashInfer
#: TRT-LLM (SM 10.x) pad to 3072 x 2944 (oracle/mxfp4.py:865-873); OAI triton_kernels, which
#: vLLM prefers on SM 9.0 only (fused_moe/experts/gpt_oss_triton_kernels_moe.py:41-53, and
#: ordered after Marlin on SM 12.x, oracle/mxfp4.py:426-433), keeps 2880 (a multiple of 64).
VLLM_GPT_OSS_SIZES = {"7.5": (3072, 2944), "8.0": (3072, 2944), "8.6": (3072, 2944), "8.7": (3072, 2944),
                      "8.9": (3072, 2944), "9.0": (2880, 2880), "10.0": (3072, 2944), "10.3": (3072, 2944),
                      "12.0": (3072, 2944), "12.1": (3072, 2944)}


@pytest.mark.parametrize("card", sorted({*kernels.CARDS, *kernels.OFF_TABLE_CARDS}))
def test_every_card_is_priced_at_vllms_padded_sizes_or_refused(tmp_path, card):
    """On every card the kernel table knows, and on the ones vLLM can see that it has no column
    for, a gpt-oss plan's experts cost what vLLM allocates there, or the planner refuses the
    card in one line naming --compute-capability (never the checkpoint's unpadded bytes)."""
    checkpoint = gpt_oss(tmp_path)
    inputs = PlanInputs(device_memory_bytes=4 * GiB, compute_capability=card)
    try:
        plan = make_plan(checkpoint, inputs)
    except UserError as exc:
        assert "--compute-capability" in str(exc) and "\n" not in str(exc)
        assert card not in kernels.CARDS  # a card the table has is always planned
        return
    weights, biases = mxfp4_expert(*VLLM_GPT_OSS_SIZES[card])
    # float32 biases: triton_kernels (SM 9.0) and FlashInfer TRT-LLM (the SM 10.x family)
    per_expert = weights + biases * (2 if card in ("9.0", "10.0", "10.3") else 1)
    assert [g.bytes for g in experts(plan)] == [EXPERTS * per_expert] * LAYERS, card


def test_a_card_off_the_table_plans_unquantized_experts_as_stored(tmp_path):
    """Unquantized experts pad only for FlashInfer TRT-LLM (the SM 10.x family, the table's
    10.0 column), so a card the table has no column for (SM 7.0) still gets a plan, at the
    checkpoint's sizes."""
    config = transformers.Qwen3MoeConfig(hidden_size=256, intermediate_size=512, moe_intermediate_size=96,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=64, num_experts=8, num_experts_per_tok=2, vocab_size=1024,
                                         tie_word_embeddings=False)
    checkpoint = load_checkpoint(write_config(tmp_path, config, "Qwen3MoeForCausalLM"))
    plan = make_plan(checkpoint, PlanInputs(device_memory_bytes=8 * GiB, compute_capability="7.0"))
    assert [g.bytes for g in experts(plan)] == [8 * 3 * 256 * 96 * 2] * 2


@pytest.mark.parametrize("name, shape, dims", [
    ("gate_up_proj_blocks", (32, 5760, 90, 16), "HI"),   # gpt-oss MXFP4, fused [E, 2I, H/32, 16]
    ("gate_up_proj_bias", (32, 5760), "I"),              # the gate/up output: intermediate
    ("down_proj_bias", (32, 2880), "H"),                 # the down output: hidden
    ("17.down_proj.weight", (2048, 768), "HI"),          # one expert's module
    ("3.up_proj.bias", (768,), "I"),
    ("w13_g_idx", (8, 2048), "H"),                       # act order indexes the gate/up input
    ("w2_g_idx", (8, 768), "I"),
    ("w13_weight_scale", (8,), ""),                      # one scale per expert
])
def test_a_tensor_follows_the_sizes_its_projection_reads_and_writes(name, shape, dims):
    assert tensor_dims(name, shape) == dims


def fp8_dense(n: int, k: int, layers: int = 2):
    """A block-FP8 dense model: per layer an MLP up projection [n, k] and its [n/128, k/128]
    float32 block scales, as such checkpoints store them (``weight_scale_inv``)."""
    from builders import make_ckpt

    spec = {"model.embed_tokens.weight": ("BF16", [1000, 1024]), "lm_head.weight": ("BF16", [1000, 1024])}
    for i in range(layers):
        spec[f"model.layers.{i}.mlp.up_proj.weight"] = ("F8_E4M3", [n, k])
        spec[f"model.layers.{i}.mlp.up_proj.weight_scale_inv"] = ("F32", [-(-n // 128), -(-k // 128)])
    return make_ckpt(spec, num_hidden_layers=layers, hidden_size=k, intermediate_size=n,
                     quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]})


@pytest.mark.parametrize("n, k, pn, pk", [(5120, 17920, 5120, 17920), (1000, 1000, 1024, 1024)])
def test_marlin_fp8_linears_are_priced_at_their_bf16_scales_on_a_pre_ada_card(n, k, pn, pk):
    """On SM 8.6 (no FP8 arithmetic) vLLM 0.33 serves FP8 linears with Marlin: each weight
    repacked at Marlin's tile (n to 64 and k to 128, or n to 128 and k to 64, the cheaper), its
    block scales held as bf16 groups of 128 inputs by every output, [pk/128, pn]. On SM 8.9 they
    stay as stored. By hand here; tests/contract/check_kernel_table.py runs vLLM's own."""
    checkpoint = fp8_dense(n, k)
    ada = make_plan(checkpoint, PlanInputs(device_memory_bytes=80 * GiB, compute_capability="8.9"))
    ampere = make_plan(checkpoint, PlanInputs(device_memory_bytes=80 * GiB, compute_capability="8.6"))
    stored = n * k + 4 * -(-n // 128) * -(-k // 128)
    held = pn * pk + 2 * (pk // 128) * pn
    layer = {g.layer_index: g for g in ada.groups if g.kind == "layer"}[0]
    assert layer.bytes == stored
    layer = {g.layer_index: g for g in ampere.groups if g.kind == "layer"}[0]
    assert layer.bytes == held
    assert ampere.model.total_bytes - ada.model.total_bytes == 2 * (held - stored)
    note = next(n for n in ampere.notes if n.startswith("vLLM post-processing on SM 8.6: Marlin FP8 linears hold"))
    assert f"{2 * (held - stored) / 1e6:.1f} MB more" in note
    assert not any("post-processing" in n for n in ada.notes)
    check_plan_matches_model(ampere, checkpoint)  # the model check groups it alike


def fp8_moe(hidden: int = 1024, inner: int = 512, layers: int = 4, num: int = 8):
    """A block-FP8 MoE as Qwen3-MoE-FP8 stores it: per layer an FP8 attention projection and
    ``num`` experts of FP8 gate/up [I, H] and down [H, I] modules, each with its float32
    [out/128, in/128] block scales (``weight_scale_inv``)."""
    from builders import make_ckpt

    spec = {"model.embed_tokens.weight": ("BF16", [1000, hidden]), "lm_head.weight": ("BF16", [1000, hidden])}
    for i in range(layers):
        linears = {"self_attn.o_proj": [hidden, hidden]}
        for e in range(num):
            linears |= {f"mlp.experts.{e}.{proj}": shape for proj, shape in (
                ("gate_proj", [inner, hidden]), ("up_proj", [inner, hidden]), ("down_proj", [hidden, inner]))}
        for name, shape in linears.items():
            spec[f"model.layers.{i}.{name}.weight"] = ("F8_E4M3", shape)
            spec[f"model.layers.{i}.{name}.weight_scale_inv"] = ("F32", [shape[0] // 128, shape[1] // 128])
    return make_ckpt(spec, num_experts=num, num_experts_per_tok=2, num_hidden_layers=layers, hidden_size=hidden,
                     moe_intermediate_size=inner,
                     quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]})


@pytest.mark.parametrize("device_mb, serving", [(30, "compute"), (45, "uva"), (200, "resident")])
def test_fp8_experts_are_priced_as_served_computed_as_loaded_else_post_processed(device_mb, serving):
    """On SM 8.6 Marlin post-processes block-FP8 experts to bf16 [K/128, N] scales: an expert
    of H 1024, I 512 holds 3 x 8192 bytes of scales there against 3 x 128 stored. Experts the
    host CPU computes keep the layout as loaded (the glue never post-processes them), so the
    plan's host bytes, copied transient and CPU reads are the stored bytes; experts read
    through UVA are post-processed on the device and come back at Marlin's size. The growth
    is a named line of the ledger where it is allocated (the resident attention's on the
    device, uva experts' in host memory), never in a computed group's. Marlin's repack of a
    layer it post-processes on the device (resident, or uva and onloaded whole for it) holds
    w13 repacked twice (a list of experts and their ``torch.cat``) and one expert's int32
    copy beside the loaded weights: the worker's load-time peak, a line of the ledger beyond
    the step's transient, which it never coexists with."""
    checkpoint = fp8_moe()
    plan = make_plan(checkpoint, PlanInputs(device_memory_bytes=device_mb * 1_000_000, kv_cache_bytes=0,
                                            reserve_bytes=0, compute_capability="8.6", device_share=False,
                                            head_share=False, host_compute=serving == "compute",
                                            max_num_batched_tokens=64))
    stored = 8 * 3 * (1024 * 512 + 4 * 8 * 4)  # per layer: 8 experts' weights and float32 block scales
    grown = 8 * 3 * (2 * 8 * 512 - 4 * 8 * 4)  # Marlin's bf16 scales [K/128, N] for gate, up and down
    attention = 2 * 8 * 1024 - 4 * 8 * 8  # the o_proj's, on the device
    hosted = experts(plan)
    assert {g.serving for g in hosted} == {serving} and len(hosted) == 4
    assert all(g.bytes == stored + grown and g.post_processing_bytes == grown for g in hosted)
    lines = {(line.name, line.where): line.bytes for line in plan.ledger()}
    on_device = 4 * attention + (4 * grown if serving == "resident" else 0)
    assert lines[("vLLM post-processing", "device")] == on_device
    assert lines[("resident weights", "device")] + on_device == plan.device_bytes
    embed = 1000 * 1024 * 2  # gathered from the host (resident with the rest on a large card)
    repack = 2 * 8 * 2 * 512 * 1024 + 2 * 512 * 1024
    load = {"compute": 0, "uva": repack + stored, "resident": repack}[serving]
    assert plan.est_load_transient_device_bytes == load
    assert lines[("est load-time transient", "device")] == max(0, load - plan.est_transient_device_bytes)
    assert plan.shortfall_bytes == 0
    if serving == "resident":
        assert plan.device_bytes == 4 * (stored + grown + 1024 * 1024 + 64 * 4 + attention) + 2 * embed
    elif serving == "compute":
        assert all(g.served_bytes == stored for g in hosted)
        assert plan.host_compute_bytes == 4 * stored and lines[("vLLM post-processing", "page-locked")] == 0
        assert lines[("host weights", "page-locked")] == 4 * stored + embed
        # one expert dequantized (w13 twice), and a 64-token step's activations with 2 picks a token of
        # 8 (16 tokens an expert): the float32 sums, and two experts' products in float32
        activations = 4 * 64 * 1024 + 16 * (20 * 512 + 6 * 1024)
        assert plan.est_transient_device_bytes == stored + 8 * 1024 * 512 + activations
        cpu = [e for e in plan.traffic().experts if e.where == EXPERTS_CPU]
        assert [e.nbytes for e in cpu] == [stored] * 4
    else:
        assert plan.uva_bytes == 4 * (stored + grown) and lines[("vLLM post-processing", "page-locked")] == 4 * grown
        assert lines[("host weights", "page-locked")] == 4 * stored + embed
    assert check_plan_matches_model(plan, checkpoint) == []
    back = Plan.from_dict(json.loads(plan.to_json()))
    assert back.groups == plan.groups and back.ledger() == plan.ledger()
    # the model check holds each group's growth to this checkpoint's on the plan's card
    edited = replace(plan, groups=tuple(replace(g, post_processing_bytes=0) if g.kind == "experts" else g
                                        for g in plan.groups))
    assert any("vLLM's post-processing adds 0 bytes to it in the plan and" in d
               for d in differences(edited, checkpoint))
    data = json.loads(plan.to_json())
    data["groups"][2]["post_processing_bytes"] = data["groups"][2]["bytes"] + 1
    with pytest.raises(PlanError, match="post_processing_bytes .* is not between 0 and its"):
        Plan.from_dict(data)
