"""Real cards and hosts: ``--device-memory 24GiB`` names a card class, planned for what such
a card keeps free after the CUDA context (or the probe's measurement); the host check keeps
headroom for the system and vLLM; a host-compute plan prices the copy a step above its
crossover holds on the device. Each figure is recomputed by hand from the table's row."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from test_host_compute import COPY_MB, EXPERTS_BYTES, computed, moe, plan_of

from builders import MB, gpu_profile, toy
from selective_offload.errors import PlanError
from selective_offload.plan_format import Plan
from selective_offload.plan_options import PlanOptions, plan_model
from selective_offload.planner import PlanInputs, make_plan
from selective_offload.planner.cards import CARDS, CONTEXT_EST_BYTES, card_memory
from selective_offload.render import render_plan
from selective_offload.sizes import GB, GiB


def test_a_nominal_size_is_planned_as_what_its_class_reports_less_the_context():
    # the 24 GB class: 23.64 GiB reported to torch (published), less its 0.5% margin for cards
    # reporting less (est: 0.12 GiB) and a 0.49 GiB context (est)
    usable, source = card_memory(24 * GiB)
    assert usable == round(23.64 * GiB) - round(0.005 * 24 * GiB) - round(0.49 * GiB)
    assert "card class 24 GB" in source and "23.64 GiB" in source and "context (est)" in source
    assert "0.12 GiB margin" in source
    assert card_memory(24 * GB)[0] == 24 * GB  # 24 GB (decimal) is the class too, never more than given
    # a size that names no class is the memory free to the worker, as given
    assert card_memory(23 * GiB + 5) == (23 * GiB + 5, card_memory(23 * GiB + 5)[1])
    assert "as given" in card_memory(50 * MB)[1]
    # a row without a published figure says it is an estimate
    estimated = [c for c in CARDS if c.estimate]
    assert estimated and all("est " in card_memory(c.nominal_gib * GiB)[1] for c in estimated)
    assert all("est " not in card_memory(c.nominal_gib * GiB)[1].split("(")[0] for c in CARDS if not c.estimate)


def test_the_probes_measurement_of_the_class_wins_and_the_view_says_which():
    # a probed 24 GB card: 25.38e9 bytes reported, 24.6e9 free after the probe's context
    probed = gpu_profile(device="NVIDIA GeForce RTX 4090", device_memory_total_bytes=25_380_000_000,
                         device_memory_free_bytes=24_600_000_000)
    args = PlanOptions(device_memory="24GiB")
    plan = plan_model(str(toy_path()), args, probed).plan
    assert plan.inputs.card_bytes == 24_600_000_000 and plan.inputs.usable_from.startswith("measured")
    assert plan.weight_budget_bytes == 24_600_000_000 - plan.inputs.kv_cache_bytes - plan.inputs.reserve_bytes
    assert "planned for 24.600 GB (measured" in render_plan(plan, verbose=True)
    # another class than the probed card's: the table's row
    other = plan_model(str(toy_path()), PlanOptions(device_memory="16GiB"), probed).plan
    assert other.inputs.usable_from.startswith("card class 16 GB")


def toy_path():
    """The bundled reference's manifest: a plan of real size for the tests above."""
    from selective_offload.plan_options import BUNDLED

    return BUNDLED["qwen3.8-27b-fp8"]


def test_the_budget_is_the_usable_memory_and_a_plan_file_keeps_it():
    plan = make_plan(toy(), PlanInputs(device_memory_bytes=24 * GiB))
    usable = round(23.64 * GiB) - round(0.005 * 24 * GiB) - CONTEXT_EST_BYTES
    assert plan.inputs.card_bytes == usable
    assert plan.weight_budget_bytes == usable - plan.inputs.kv_cache_bytes - plan.inputs.reserve_bytes
    back = Plan.from_dict(json.loads(plan.to_json()))
    assert back.inputs.card_bytes == usable and back.inputs.usable_from == plan.inputs.usable_from
    # a plan written before the field: the nominal card, as it was planned
    old = json.loads(plan.to_json())
    del old["inputs"]["usable_device_bytes"], old["inputs"]["usable_from"]
    old["totals"]["weight_budget_bytes"] = 24 * GiB - plan.inputs.kv_cache_bytes - plan.inputs.reserve_bytes
    old["totals"]["deficit_bytes"] += usable - 24 * GiB
    assert Plan.from_dict(old).weight_budget_bytes == 24 * GiB - plan.inputs.kv_cache_bytes - plan.inputs.reserve_bytes
    bad = json.loads(plan.to_json())
    bad["inputs"]["usable_device_bytes"] = 25 * GiB
    with pytest.raises(PlanError, match="usable device memory"):
        Plan.from_dict(bad)


def test_the_host_check_keeps_headroom_and_names_the_flag():
    ckpt = moe(4)
    fits = plan_of(ckpt, ckpt.total_bytes / MB - 300, host_memory_bytes=10 * GiB)
    host = fits.host_bytes  # 340 MB: the embedding and 3 layers' experts, and the worker's buffers
    assert fits.strategy == "hot_offload" and fits.inputs.host_headroom_bytes == 6 * GiB
    # RAM for the host bytes, but not for them and the headroom: infeasible, and the view says why
    tight = plan_of(ckpt, ckpt.total_bytes / MB - 300, host_memory_bytes=6 * GiB + host - 1)
    assert tight.strategy == "infeasible" and tight.host_shortfall_bytes == 1
    text = render_plan(tight)
    assert "short of host RAM" in text.splitlines()[0]
    assert "--host-memory 7GiB (a host with that much RAM; --host-memory: " in " ".join(text.split())
    assert "kept for the system and vLLM, est" in " ".join(text.split())
    with pytest.raises(PlanError, match="more host memory is needed"):
        tight.require_feasible()
    # page-locked and pageable counted apart (the plan's ledger): the kernel's workspace is pageable
    assert fits.host_page_locked_bytes + fits.host_pageable_bytes == host
    assert fits.host_pageable_bytes == fits.host_compute_workspace_bytes  # none for bf16 here


def test_a_step_above_the_crossover_holds_a_layers_copy_and_the_dequantized_expert():
    ckpt = moe(4)
    plan = plan_of(ckpt, ckpt.total_bytes / MB - 300)
    assert computed(plan) and plan.est_transient_device_bytes == EXPERTS_BYTES == COPY_MB * MB  # bf16: nothing more
    assert plan.shortfall_bytes == 0
    assert plan.device_bytes + plan.est_transient_device_bytes <= plan.weight_budget_bytes
    # fp8 blocks: the layer's experts as stored and one expert dequantized to bf16, w13 and
    # its working copy (twice w13's bf16 bytes). The config says no sizes: the expert's
    # parameters from its stored bytes (5e6, 1e7 bytes in bf16), two thirds of them in w13.
    fp8 = moe(4, quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]})
    quantized = plan_of(fp8, fp8.total_bytes / MB - 300)
    group = computed(quantized)[0]
    assert not group.kernel_dims
    assert quantized.est_transient_device_bytes == group.bytes + 2 * 6_666_666
    # Where it says them, from the kernel's dims (H 1000, I 1500): w13 [3000, 1000] in bf16, twice,
    # and the activations of the engine's largest step (64 tokens here, 2 picks a token of 8: 16
    # tokens an expert): the float32 sums [T, H] and two experts' float32 products (20 n I + 6 n H)
    sized = moe(4, quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]}, hidden_size=1000,
                moe_intermediate_size=1500)
    dims = plan_of(sized, sized.total_bytes / MB - 300, max_num_batched_tokens=64)
    group = computed(dims)[0]
    assert group.kernel_dims == (1000, 1500)
    assert dims.est_transient_device_bytes == group.bytes + 2 * 3000 * 1000 * 2 + 4 * 64 * 1000 + 16 * (
        20 * 1500 + 6 * 1000)
    # a plan that states no transient for its copy is refused when read
    data = json.loads(plan.to_json())
    data["est_transient_device_bytes"] = 0
    with pytest.raises(PlanError, match="est_transient_device_bytes 0 cannot be right"):
        Plan.from_dict(data)
    # and a plan priced without it would not fit the card it was made for
    assert replace(plan, est_transient_device_bytes=0).shortfall_bytes == 0
    lean = plan_of(ckpt, ckpt.total_bytes / MB - 300 - COPY_MB)
    assert lean.est_transient_device_bytes == EXPERTS_BYTES and lean.shortfall_bytes == 0
    assert len(computed(lean)) > len(computed(plan))  # the copy's room came from one more layer on the host


@pytest.mark.parametrize("gib", [8, 24])
def test_a_plan_for_a_class_passes_the_pre_flight_of_its_lowest_reporting_card(gib):
    """A card of the class reporting its lowest published figure less the class's margin (24
    GB: 23.64 - 0.12 GiB, so a card at 23.60 GiB is covered) keeps that less the context free;
    the worker's pre-flight (vLLM having built the plan's resident weights) lets the plan through
    there."""
    from selective_offload.planner.cards import card_class, lowest_covered_bytes, margin_bytes
    from selective_offload.vllm_glue import preflight

    cpu = __import__("torch").device("cpu")
    card = card_class(gib * GiB)
    plan = make_plan(load_bundled(), PlanInputs(device_memory_bytes=gib * GiB))
    assert plan.strategy != "infeasible"
    need = preflight.need_of(plan, built=plan.device_bytes)
    lowest_free = lowest_covered_bytes(card) - CONTEXT_EST_BYTES
    assert lowest_free < card.reported_bytes - CONTEXT_EST_BYTES - margin_bytes(card) // 2  # below the table's figure
    if gib == 24:
        assert lowest_free <= round(23.60 * GiB) - CONTEXT_EST_BYTES
    fitted, line = preflight.check(plan, need, lowest_free, None, False, cpu)
    assert fitted is plan and "short" not in line
    # the plan says the margin it left
    assert f"{margin_bytes(card) / GiB:.2f} GiB margin" in plan.inputs.usable_from


def load_bundled():
    from selective_offload.checkpoint import load_checkpoint

    return load_checkpoint(toy_path())


def test_an_ecc_cards_measurement_below_the_class_figure_is_trusted():
    # a 16 GB T4 (ECC) reports 14.56 GiB to torch, below the 16 GB row's usable figure: the
    # probe's measurement is what the card holds, never the class's consumer figure
    total, free = round(14.56 * GiB), round(14.2 * GiB)
    usable, source = card_memory(16 * GiB, measured_total=total, measured_free=free)
    assert usable <= free and source.startswith("measured")
    assert card_memory(16 * GiB)[0] > total  # the consumer row alone would overshoot this card
    # a 48 GB L40 (44.40 GiB) and a 24 GB A30 (23.53 GiB) likewise
    for nominal, reported in ((48, 44.40), (24, 23.53)):
        got = card_memory(nominal * GiB, round(reported * GiB), round(reported * GiB) - GiB // 2)
        assert got[0] == round(reported * GiB) - GiB // 2
    # a smaller class's card (a 12 GB one) is not the 16 GB class: the table's row
    assert card_memory(16 * GiB, round(11.8 * GiB), round(11.3 * GiB))[1].startswith("card class 16 GB")
