"""Config-only plans of real MoE models, checked against arithmetic done here by hand: the
routed experts of each MoE layer found and sized, E and k read from the config, a step
priced by what it reads of them, and every vLLM baseline the plan prints beaten or matched.

Configs are built with transformers' own config classes (no hub) from the dimensions each
model's published ``config.json`` states (the source is named at each one).
"""

from __future__ import annotations

import json

import pytest
import transformers

from helpers import REPO, write_config
from selective_offload.checkpoint import load_checkpoint
from selective_offload.planner import TIE, PlanInputs, make_plan
from selective_offload.sizes import GiB

LINK = 13.9e9  # the reference laptop's link (docs/design/reference-measurements.md), which the plans default to
UVA = 0.86 * LINK  # kernels reading host memory in place: the default UVA read rate (estimate/traffic.py)


def plan_of(path, gib, **inputs):
    """The plan of the config at ``path`` on a ``gib`` card; host-compute off unless asked for
    (these tests check the UVA arithmetic; the reference plans below are host-compute plans)."""
    inputs.setdefault("host_compute", False)
    return make_plan(load_checkpoint(path), PlanInputs(device_memory_bytes=gib * GiB, **inputs))


def experts_groups(plan):
    return [g for g in plan.groups if g.kind == "experts"]


def assert_beats_or_matches_every_baseline(plan):
    assert plan.strategy != "infeasible" and plan.baselines
    for baseline in plan.baselines:
        if baseline.fits:
            assert plan.est.est_step_s <= baseline.est.est_step_s * (1 + TIE), baseline.label


def uva_link_bytes(plan):
    """What the routed experts on the host cost a batch-1 step: k/E of their bytes."""
    return sum(g.bytes * g.experts_per_token / g.num_experts for g in plan.groups if g.serving == "uva")


# ---- gpt-oss (huggingface.co/openai/gpt-oss-20b and gpt-oss-120b, config.json): hidden 2880,
# expert intermediate 2880, 64 query heads, 8 KV heads of 64, vocab 201088; MXFP4 experts.

MXFP4 = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}


def gpt_oss(tmp_path, layers, experts):
    config = transformers.GptOssConfig(num_hidden_layers=layers, num_local_experts=experts, num_experts_per_tok=4,
                                       hidden_size=2880, intermediate_size=2880, num_attention_heads=64,
                                       num_key_value_heads=8, head_dim=64, vocab_size=201088,
                                       tie_word_embeddings=False)
    return write_config(tmp_path, config, "GptOssForCausalLM", quantization_config=MXFP4, experts_per_token=4)


def gpt_oss_experts_bytes(experts, hidden=3072, intermediate=2944):
    """One layer's routed experts as vLLM 0.33 allocates them: gate_up (2I x H) and down
    (H x I) per expert at 4.25 bits (MXFP4 and its scales), plus their bf16 biases (2I and
    H). The plans here are for the default card (SM 8.9), where vLLM picks Marlin for MXFP4
    and pads gpt-oss's hidden 2880 to 3072 and intermediate 2880 to 2944
    (oracle/mxfp4.py:865-870); the checkpoint holds them at 2880 x 2880."""
    return experts * (3 * hidden * intermediate * 4.25 / 8 + (2 * intermediate + hidden) * 2)


def test_gpt_oss_20b_on_8_gib_reads_top_4_of_32_experts_instead_of_whole_layers(tmp_path):
    """The issue's case: the whole-layer plan put 17 layers on the prefetch path at est
    1.71 tok/s. Now the experts of the layers that must go are read in place, 4 of 32."""
    plan = plan_of(gpt_oss(tmp_path, 24, 32), 8)
    groups = experts_groups(plan)
    assert len(groups) == 24 and all((g.num_experts, g.experts_per_token) == (32, 4) for g in groups)
    assert groups[0].bytes == pytest.approx(gpt_oss_experts_bytes(32), rel=1e-6)
    assert not plan.hot_layer_indices  # no whole-layer pricing
    uva = [g for g in groups if g.serving == "uva"]
    assert uva and plan.cold_on_host_bytes > 0  # the embedding went first
    # The cold set and the fewest experts groups close the deficit.
    need = plan.deficit_bytes - plan.cold_on_host_bytes
    assert len(uva) == -(-need // groups[0].bytes)
    # Per step: 4/32 of the host experts over the link, plus one embedding row.
    row = 2880 * 2
    assert plan.est.est_link_s_per_step == pytest.approx((uva_link_bytes(plan) + row) / UVA, rel=1e-6)
    assert plan.est.est_tok_s > 1.71 * 5
    assert_beats_or_matches_every_baseline(plan)
    # The cpu_offload_gb baseline reads its host experts top-k too: far from every offloaded byte.
    assert plan.vllm_cpu_offload_gb.est.est_link_s_per_step < 0.5 * plan.vllm_cpu_offload_gb.offloaded_bytes / LINK
    # Segment selection offloads only routed experts (read top-k), cpu_offload_gb attention too (read whole).
    assert plan.vllm_cpu_offload_params.est.est_step_s < plan.vllm_cpu_offload_gb.est.est_step_s


def test_gpt_oss_120b_on_the_24_gib_laptop(tmp_path):
    plan = plan_of(gpt_oss(tmp_path, 36, 128), 24)
    groups = experts_groups(plan)
    assert len(groups) == 36 and all((g.num_experts, g.experts_per_token) == (128, 4) for g in groups)
    assert groups[0].bytes == pytest.approx(gpt_oss_experts_bytes(128), rel=1e-6)  # ~1.69 GB a layer
    assert plan.uva_bytes and not plan.hot_layer_indices
    assert plan.est.est_link_s_per_step == pytest.approx((uva_link_bytes(plan) + 2880 * 2) / UVA, rel=1e-6)
    assert_beats_or_matches_every_baseline(plan)


# ---- Qwen3-MoE (huggingface.co/Qwen/Qwen3-30B-A3B, config.json): 48 layers, hidden 2048,
# expert intermediate 768, 128 experts, 8 per token, 32 heads, 4 KV heads of 128, vocab 151936.

QWEN3_30B = dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
                 num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                 vocab_size=151936)
QWEN3_EXPERTS = 128 * 3 * 2048 * 768 * 2  # gate, up, down per expert, bf16


def test_qwen3_30b_a3b_splits_every_layer_and_reads_8_of_128(tmp_path):
    path = write_config(tmp_path, transformers.Qwen3MoeConfig(**QWEN3_30B, tie_word_embeddings=False),
                 "Qwen3MoeForCausalLM")
    plan = plan_of(path, 24)
    groups = experts_groups(plan)
    assert [g.layer_index for g in groups] == list(range(48))
    assert all(g.bytes == QWEN3_EXPERTS and (g.num_experts, g.experts_per_token) == (128, 8) for g in groups)
    assert all(g.est_read_bytes_per_step == QWEN3_EXPERTS // 16 for g in groups)
    assert_beats_or_matches_every_baseline(plan)
    # Batch 8: a step reads 1 - (1 - 8/128)^8 of the host experts, not 8/128.
    batched = plan_of(path, 24, batch=8)
    share = 1 - (1 - 8 / 128) ** 8
    host = sum(g.bytes for g in batched.groups if g.serving == "uva")
    assert batched.est.est_link_s_per_step == pytest.approx((host * share + 8 * 2048 * 2) / UVA, rel=1e-6)
    assert_beats_or_matches_every_baseline(batched)


def test_qwen3_vl_30b_a3b_finds_the_experts_under_its_language_model(tmp_path):
    """Qwen3-VL-MoE keeps the Qwen3-MoE text model (same dimensions) under
    ``model.language_model``, beside a vision tower (huggingface.co/Qwen/Qwen3-VL-30B-A3B-Instruct)."""
    config = transformers.Qwen3VLMoeConfig(text_config=QWEN3_30B, tie_word_embeddings=False)
    plan = plan_of(write_config(tmp_path, config, "Qwen3VLMoeForConditionalGeneration"), 24)
    groups = experts_groups(plan)
    assert len(groups) == 48 and groups[0].group == "model.language_model.layers.0.mlp.experts"
    assert all(g.bytes == QWEN3_EXPERTS and (g.num_experts, g.experts_per_token) == (128, 8) for g in groups)
    assert plan.serving_of("model.visual") in ("gather", "on-demand")
    assert_beats_or_matches_every_baseline(plan)


# ---- Llama 4 Scout (huggingface.co/meta-llama/Llama-4-Scout-17B-16E, config.json): 48 layers,
# hidden 5120, expert intermediate 8192, 16 experts, 1 per token, a shared expert every layer.


def test_llama4_scout_keeps_its_shared_expert_in_the_layer(tmp_path):
    text = dict(hidden_size=5120, intermediate_size=8192, intermediate_size_mlp=16384, num_hidden_layers=48,
                num_attention_heads=40, num_key_value_heads=8, head_dim=128, num_local_experts=16,
                num_experts_per_tok=1, vocab_size=202048, interleave_moe_layer_step=1)
    config = transformers.Llama4Config(text_config=text)
    data = config.to_dict()
    data.pop("tie_word_embeddings", None)
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**data, "architectures": ["Llama4ForConditionalGeneration"]}))
    plan = plan_of(path, 80)
    groups = experts_groups(plan)
    assert len(groups) == 48 and groups[0].group == "language_model.model.layers.0.feed_forward.experts"
    assert all(g.bytes == 16 * 3 * 5120 * 8192 * 2 and (g.num_experts, g.experts_per_token) == (16, 1)
               for g in groups)
    layer = next(g for g in plan.groups if g.group == "language_model.model.layers.0")
    shared = 3 * 5120 * 8192 * 2  # the shared expert: read by every token, so in the layer
    assert layer.bytes > shared
    assert_beats_or_matches_every_baseline(plan)


# ---- GLM-4 MoE (huggingface.co/zai-org/GLM-4.5-Air, config.json): 46 layers, the first dense
# (first_k_dense_replace=1), hidden 4096, 128 routed experts of 1408, 8 per token, 1 shared.


def test_glm4_moe_leaves_its_first_dense_layer_whole(tmp_path):
    config = transformers.Glm4MoeConfig(hidden_size=4096, intermediate_size=10944, moe_intermediate_size=1408,
                                        num_hidden_layers=46, num_attention_heads=96, num_key_value_heads=8,
                                        head_dim=128, n_routed_experts=128, n_shared_experts=1,
                                        num_experts_per_tok=8, first_k_dense_replace=1, vocab_size=151552,
                                        num_nextn_predict_layers=1, tie_word_embeddings=False)
    plan = plan_of(write_config(tmp_path, config, "Glm4MoeForCausalLM"), 24)
    groups = experts_groups(plan)
    assert [g.layer_index for g in groups] == list(range(1, 46))
    assert all(g.bytes == 128 * 3 * 4096 * 1408 * 2 and (g.num_experts, g.experts_per_token) == (128, 8)
               for g in groups)
    assert_beats_or_matches_every_baseline(plan)


# ---- DeepSeek-V3 (huggingface.co/deepseek-ai/DeepSeek-V3, config.json): 61 layers, the first 3
# dense, MLA, 256 routed experts of 2048, 8 per token, 1 shared; FP8 with 128 x 128 block scales.


def test_deepseek_v3_fp8_experts_and_the_issue_arithmetic(tmp_path):
    config = transformers.DeepseekV3Config(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1,
        n_routed_experts=256, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128,
        qk_nope_head_dim=128, first_k_dense_replace=3, num_nextn_predict_layers=1, tie_word_embeddings=False)
    path = write_config(tmp_path, config, "DeepseekV3ForCausalLM", quantization_config={
        "quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]})
    plan = plan_of(path, 80)
    groups = experts_groups(plan)
    assert [g.layer_index for g in groups] == list(range(3, 61))  # the MTP layer (61) stays whole and absent
    weights = 256 * 3 * 7168 * 2048  # one byte each
    scales = 256 * 3 * (7168 // 128) * (2048 // 128) * 4
    assert all(g.bytes == pytest.approx(weights + scales, rel=1e-3) for g in groups)
    assert all((g.num_experts, g.experts_per_token) == (256, 8) for g in groups)
    assert_beats_or_matches_every_baseline(plan)
    assert plan.est.est_tok_s > 1.5 * plan.vllm_cpu_offload_gb.est.est_tok_s


# ---- Gemma 4 26B A4B: transformers 5 knows its MoE block (experts directly under the layer,
# beside a dense MLP). Dimensions as apxml.com/models/gemma-4-26b-a4b lists them (a third-party
# summary of the config: 30 layers, hidden 2112, 128 experts of 704, 8 per token).


def test_gemma4_a4b_experts_sit_directly_under_the_layer(tmp_path):
    text = dict(hidden_size=2112, intermediate_size=2112, num_hidden_layers=30, num_attention_heads=16,
                num_key_value_heads=8, head_dim=256, enable_moe_block=True, num_experts=128, top_k_experts=8,
                moe_intermediate_size=704, vocab_size=262144)
    plan = plan_of(write_config(tmp_path, transformers.Gemma4Config(text_config=text), "Gemma4ForConditionalGeneration"), 24)
    groups = experts_groups(plan)
    assert len(groups) == 30 and groups[0].group == "model.language_model.layers.0.experts"
    assert all(g.bytes == 128 * 3 * 2112 * 704 * 2 and (g.num_experts, g.experts_per_token) == (128, 8)
               for g in groups)
    assert_beats_or_matches_every_baseline(plan)


# ---- docs/usage/moe.md's MoE reference plans come from a results file the script writes


def test_the_moe_reference_results_and_the_docs_are_what_the_planner_says(tmp_path):
    """benchmarks/planning/moe_plans.py wrote the newest moe-plans-est-*.json; the planner
    still says the same, every plan beats or matches the vLLM baselines beside it, and the
    table in docs/usage/moe.md is that file's table."""
    import sys

    root = REPO
    sys.path.insert(0, str(root))
    from benchmarks.planning import moe_plans as moe_reference_plans

    newest = root / "benchmarks" / "results" / "moe-plans-est.json"
    recorded = json.loads(newest.read_text())["plans"]
    assert moe_reference_plans.reference_plans(tmp_path) == recorded
    for case in recorded:
        *baselines, selective = case["rows"]
        assert selective["fits"] and all(selective["est_step_ms"] <= b["est_step_ms"] for b in baselines if b["fits"])
    table = newest.with_suffix(".md").read_text()
    page = (root / "docs" / "usage" / "moe.md").read_text()
    missing = [line for line in table.splitlines() if line.startswith("| ") and line not in page]
    assert not missing, missing
    assert f"benchmarks/results/{newest.with_suffix('.md').name}" in page  # the page names the file it quotes
    # the prose on the 4-bit build quotes its plan, and the host rate its target needs or,
    # where its kernel is not claimed (no host-compute), that it is not
    gptq = next(c for c in recorded if "GPTQ" in c["model"])
    assert f"{gptq['rows'][-1]['est_tok_s']:.2f} tok/s" in page
    if gptq["est_cpu_gbps_for_target"] is None:
        assert gptq["no_host_compute"] and "int4 is not claimed" in page
    else:
        assert f"{gptq['est_cpu_gbps_for_target']:g} GB/s" in page


def test_a_48_layer_moe_plan_renders_in_a_few_rows(tmp_path):
    """Layers placed alike fold (with their experts) into a row each; placements that
    alternate through the stack fold by placement, their layers listed below."""
    from selective_offload.render import render_plan

    path = write_config(tmp_path, transformers.Qwen3MoeConfig(**QWEN3_30B, tie_word_embeddings=False),
                 "Qwen3MoeForCausalLM")
    text = render_plan(plan_of(path, 24), verbose=True)
    table = next(chunk for chunk in text.split("\n\n") if chunk.startswith("group")).splitlines()
    assert len(table) < 12, table
    assert any("mlp.experts of those" in row and " host     uva " in row for row in table)
    # the card's 23.15 GiB (a 24 GB card's, less its context): one layer and one GiB more than on 24 GiB
    assert "routed experts in host memory, read in place through UVA (33 layers" in text
    assert "vLLM cpu_offload_gb=37,\n  cpu_offload_params=experts" in text and "vLLM cpu_offload_params " in text


def test_the_summary_says_why_host_experts_are_not_computed_on_the_host(tmp_path, monkeypatch):
    """A MoE plan that computes none of its host experts on the CPU says why in its default
    view (the planner's own cause, ``Plan.host_compute_declined``); a plan that computes them
    shows its kernel line instead; llama.cpp's figure for computing them there is under --explain."""
    from selective_offload.cpu_kernels import claimed
    from selective_offload.render import anchor_lines, summary

    path = write_config(tmp_path, transformers.Qwen3MoeConfig(**QWEN3_30B, tie_word_embeddings=False),
                        "Qwen3MoeForCausalLM")
    off = plan_of(path, 24)  # --no-host-compute
    assert off.host_compute_declined == "host-compute is off for this plan (--no-host-compute)"
    lines = summary(off)
    cpu = lines.index(next(line for line in lines if line.startswith("cpu    ")))
    assert " ".join(" ".join(lines[cpu:]).split()).startswith(
        "cpu not used: host-compute is off for this plan (--no-host-compute)")
    monkeypatch.setitem(claimed.CLAIMED, "bf16", False)
    unclaimed = plan_of(path, 24, host_compute=True)
    assert unclaimed.host_compute_declined.startswith("the bf16 CPU kernel is not claimed fast by the committed")
    assert "not used: the bf16 CPU kernel is not claimed" in " ".join(" ".join(summary(unclaimed)).split())
    monkeypatch.setitem(claimed.CLAIMED, "bf16", True)
    computed = plan_of(path, 24, host_compute=True)
    assert computed.host_compute_declined is None
    lines = summary(computed)
    assert any(line.startswith("cpu    bf16 at ") for line in lines) and "not used" not in "\n".join(lines)
    # llama.cpp's published figure (one for an 8 GB card), broken between words to 80 columns
    assert not any("llama.cpp" in line for line in summary(plan_of(path, 8, host_compute=True)))
    lines = anchor_lines(plan_of(path, 8, host_compute=True))
    first = next(i for i, line in enumerate(lines) if line.startswith("llama.cpp published: 36.7 tok/s"))
    anchor = lines[first:next((i for i in range(first + 1, len(lines)) if not lines[i].startswith("       ")),
                              len(lines))]
    assert len(anchor) > 1 and max(len(line) for line in anchor) <= 80, anchor
    assert " ".join(" ".join(anchor).split()).endswith("AlexsJones/llmfit PR #755)")


def test_the_estimate_rows_of_a_plan_with_both_vllm_baselines_keep_to_80_columns(tmp_path):
    """A MoE plan is priced against both of vLLM's settings: the second's label breaks after
    its comma, its figures on the line below, and this plan's two speed-ups, too wide for
    the row, go on a line of their own, each still there."""
    from selective_offload.render import summary

    path = write_config(tmp_path, transformers.Qwen3MoeConfig(**QWEN3_30B, tie_word_embeddings=False),
                        "Qwen3MoeForCausalLM")
    plan = plan_of(path, 24, host_compute=True)
    assert len(plan.baselines) == 2
    lines = summary(plan)
    top = lines.index(next(line for line in lines if line.startswith("estimate (bytes / bandwidth)")))
    rows = lines[top:lines.index(next(line for line in lines if line.startswith("rates ")))]
    assert max(len(line) for line in rows) <= 80, rows
    params = next(b for b in plan.baselines if b.cpu_offload_params)
    at = rows.index(next(line for line in rows if line.startswith("vLLM ") and line.endswith(",")))
    assert (rows[at] + " " + rows[at + 1].strip()).startswith(f"vLLM {params.label} ")
    assert f"{params.est.est_tok_s:.2f}" in rows[at + 1].split()
    speedups = next(line for line in rows if "est speed-up:" in line)
    assert all(f"{plan.est.est_tok_s / b.est.est_tok_s:.2f}x {'cpu_offload_params' if b.cpu_offload_params else 'cpu_offload_gb'}"
               in speedups for b in plan.baselines)
