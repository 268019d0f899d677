"""Is this plan for this model? Checked by tensor bytes, dtypes and shapes, not only names."""

from __future__ import annotations

import pytest

from selective_offload.checkpoint import Checkpoint, TensorInfo, tensor_nbytes
from selective_offload.errors import PlanError
from selective_offload.model_match import check_plan_matches_model, differences
from selective_offload.planner import PlanInputs, make_plan


def ckpt(source="a", vocab=64, dtype="BF16", q_shape=(16, 16), prefix="model", extra=None, tie=False):
    spec = {f"{prefix}.embed_tokens.weight": (dtype, [vocab, 16]), "lm_head.weight": (dtype, [vocab, 16]),
            f"{prefix}.layers.0.q.weight": (dtype, list(q_shape)), f"{prefix}.layers.1.q.weight": (dtype, [16, 16]),
            f"{prefix}.norm.weight": (dtype, [16])}
    spec.update(extra or {})
    tensors = {n: TensorInfo(n, d, tuple(s), tensor_nbytes(d, s)) for n, (d, s) in spec.items()}
    return Checkpoint(source, "manifest", tensors, {"tie_word_embeddings": tie, "num_hidden_layers": 2})


def plan_of(c):
    return make_plan(c, PlanInputs(device_memory_bytes=c.total_bytes, kv_cache_bytes=0, reserve_bytes=0,
                                   all_cold=True))


def first_difference(plan, other):
    with pytest.raises(PlanError) as info:
        check_plan_matches_model(plan, other)
    message = str(info.value)
    assert message.startswith(f"the plan was made for another model: it is for {plan.model.source} ")
    assert f"this is {other.source} " in message and "\n" not in message
    return message.split("first difference: ", 1)[1]


def test_the_same_model_passes_on_the_fingerprint():
    assert check_plan_matches_model(plan_of(ckpt()), ckpt()) == []


def test_another_dtype_is_named_with_both_sizes():
    diff = first_difference(plan_of(ckpt()), ckpt("b", dtype="F32"))
    assert diff.startswith("model.embed_tokens is 2.0 kB of BF16 in the plan and 4.1 kB of F32 here")
    assert "(and 4 more)" in diff


def test_another_vocabulary_is_named():
    diff = first_difference(plan_of(ckpt()), ckpt("b", vocab=128))
    assert diff.startswith("model.embed_tokens is 2.0 kB of BF16 in the plan and 4.1 kB of BF16 here")


def test_same_bytes_other_shapes_are_caught():
    diff = first_difference(plan_of(ckpt()), ckpt("b", q_shape=(8, 32)))
    assert diff.startswith("model.layers.0 has the same bytes but other tensor shapes or names here")


def test_a_group_missing_or_added_is_named():
    diff = first_difference(plan_of(ckpt(extra={"model.visual.w": ("BF16", [4])})), ckpt("b"))
    assert diff.startswith("model.visual (8 B) is in the plan but not in this model")
    diff = first_difference(plan_of(ckpt()), ckpt("b", extra={"model.visual.w": ("BF16", [4])}))
    assert diff.startswith("model.visual (8 B) is in this model but not in the plan")


def test_another_tensor_count_is_named():
    diff = first_difference(plan_of(ckpt()), ckpt("b", extra={"model.layers.1.k.weight": ("BF16", [0])}))
    assert diff.startswith("model.layers.1 has 1 tensors in the plan and 2 here")


def test_a_class_change_is_named_with_the_reason():
    diff = first_difference(plan_of(ckpt()), ckpt("b", tie=True))
    assert diff.startswith("model.embed_tokens is cold in the plan and hot here (tie_word_embeddings")


def test_names_that_differ_only_by_wrappers_still_match():
    """A plan made from `model.language_model.*` names (transformers 5's layout) applies to
    a checkpoint that writes `model.*`: every group has the same tensors."""
    notes = check_plan_matches_model(plan_of(ckpt(prefix="model.language_model")), ckpt("b"))
    assert len(notes) == 1 and "every group has the same tensors" in notes[0]
    assert differences(plan_of(ckpt(prefix="model.language_model")), ckpt("b")) == []


def test_a_config_estimate_says_to_plan_from_the_headers():
    plan = plan_of(ckpt())
    estimated = make_plan(Checkpoint("config.json", "config", ckpt().tensors, ckpt().config),
                          plan.inputs)
    with pytest.raises(PlanError, match="estimated from a config.json: plan from the downloaded checkpoint"):
        check_plan_matches_model(estimated, ckpt("b", dtype="F32"))
