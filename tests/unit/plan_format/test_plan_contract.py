"""The plan file is a contract: every field a user can get wrong fails with one line that
names the field and the fix; derived totals are never trusted; versions are explicit."""

from __future__ import annotations

import json

import pytest

from builders import inputs, toy
from selective_offload.errors import PlanError
from selective_offload.plan_format import PLAN_FORMAT, Location, Plan, Serving, Strategy
from selective_offload.planner import make_plan


@pytest.fixture
def data():
    """A cold_offload plan (embedding on the host) as the JSON a user would edit."""
    plan = make_plan(toy(num_hidden_layers=8), inputs(560))
    assert plan.strategy == Strategy.COLD_OFFLOAD and plan.cold_on_host_groups == ["model.embed_tokens"]
    return json.loads(plan.to_json())


def group(data, name):
    return next(g for g in data["groups"] if g["group"] == name)


def load(data, tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    return Plan.load(path)


def one_line_error(data, tmp_path, match):
    with pytest.raises(PlanError, match=match) as info:
        load(data, tmp_path)
    message = str(info.value)
    assert "\n" not in message and str(tmp_path / "plan.json") in message
    return message


@pytest.mark.parametrize("typo", ["host_cold", "gpu", "Gather", None, 3])
def test_a_misspelt_serving_is_refused_naming_the_group(data, tmp_path, typo):
    group(data, "model.embed_tokens")["serving"] = typo
    message = one_line_error(data, tmp_path, r"serving of group model.embed_tokens")
    assert "resident, gather, on-demand, prefetch, uva, compute, none" in message and "fix the spelling" in message


@pytest.mark.parametrize("typo", ["gpu", "Host", None])
def test_a_misspelt_location_is_refused_naming_the_group(data, tmp_path, typo):
    group(data, "model.embed_tokens")["location"] = typo
    message = one_line_error(data, tmp_path, r"location of group model.embed_tokens")
    assert "device, host, absent" in message and "fix the spelling" in message


def test_a_location_the_serving_does_not_keep_is_refused(data, tmp_path):
    group(data, "model.embed_tokens")["location"] = "device"
    one_line_error(data, tmp_path, r"model.embed_tokens\): location is device, but a group served gather lives "
                                   r"in host")


def test_a_host_embedding_is_gathered_and_a_tower_is_served_on_demand(data, tmp_path):
    """gather vs on-demand follows from the group, and a plan that states the other is refused."""
    embed = group(data, "model.embed_tokens")
    assert (embed["kind"], embed["role"], embed["location"], embed["serving"]) == \
        ("component", "cold", "host", "gather")
    embed["serving"] = "on-demand"
    one_line_error(data, tmp_path, r"model.embed_tokens\): serving is on-demand, but a cold component group on "
                                   r"the host is served gather")


@pytest.mark.parametrize("field,value,match", [
    ("role", "cool", "role of group model.embed_tokens.*cold, hot, absent"),
    ("kind", "tower", "kind of group model.embed_tokens.*layer, component, module"),
    ("bytes", -1, "bytes of group model.embed_tokens.*integer >= 0"),
    ("bytes", 1.5, "bytes of group model.embed_tokens.*integer"),
    ("bytes", True, "bytes of group model.embed_tokens.*integer"),
    ("est_read_bytes_per_step", "10 kB", "est_read_bytes_per_step of group model.embed_tokens"),
    ("mtp", "no", "mtp of group model.embed_tokens.*true or false"),
])
def test_every_group_field_is_typed(data, tmp_path, field, value, match):
    group(data, "model.embed_tokens")[field] = value
    one_line_error(data, tmp_path, match)


def test_role_and_serving_must_agree(data, tmp_path):
    layer = group(data, "model.layers.0")
    layer.update(location="host", serving="on-demand")
    one_line_error(data, tmp_path,
                   r"model.layers.0: a group of role hot cannot be served on-demand \(only resident, prefetch, uva, compute\)")
    layer.update(location="device", serving="resident")
    group(data, "model.norm").update(location="host", serving="prefetch")
    one_line_error(data, tmp_path, "model.norm: serving prefetch is for groups of kind experts or layer, and this one is module")


def test_an_edited_group_with_stale_totals_is_caught(data, tmp_path):
    """Moving the embedding back to the device is a valid placement, but the totals still
    say it is on the host; and without the totals the plan no longer fits its budget."""
    group(data, "model.embed_tokens").update(location="device", serving="resident")
    one_line_error(data, tmp_path, r"device_bytes says 540001000 but the groups add up to 640001000 \(was a "
                                   r"group edited\?\); delete the \"totals\" object")
    del data["totals"]
    one_line_error(data, tmp_path, r"strategy is cold_offload, but the groups placed on the device need 0\.\d+ GB more")


def test_totals_and_estimates_are_derived_from_the_groups(data, tmp_path):
    del data["totals"]
    data["est"] = {"est_link_s_per_step": 99.0, "est_vram_s_per_step": 0, "est_step_s": 0, "est_tok_s": 0}
    group(data, "model.embed_tokens")["est_link_bytes_per_step"] = 10**12  # derived: ignored
    plan = load(data, tmp_path)
    assert plan.cold_on_host_bytes == group(data, "model.embed_tokens")["bytes"]
    assert plan.est.est_link_s_per_step == pytest.approx(plan.groups[0].est_read_bytes_per_step / (0.86 * 13.9e9))


@pytest.mark.parametrize("hot,match", [
    ([2], r"hot_layer_indices \[2\] disagree with the groups served prefetch \(layers \[\]\)"),
    (["1"], "hot_layer_indices.*a list of layer indices"),
])
def test_hot_layer_indices_agree_with_the_groups(data, tmp_path, hot, match):
    data["hot_layer_indices"] = hot
    one_line_error(data, tmp_path, match)


def test_layer_index_inside_the_model(data, tmp_path):
    group(data, "model.layers.7").update(group="model.layers.70", layer_index=70)
    one_line_error(data, tmp_path, "layer_index 70 is outside the model's 8 layers")
    group(data, "model.layers.70").update(group="model.layers.7")
    group(data, "model.layers.7")["layer_index"] = None
    one_line_error(data, tmp_path, "kind is layer but layer_index is null")


@pytest.mark.parametrize("strategy,match", [
    ("resident", "strategy is resident, but it places groups on the host"),
    ("hot_offload", "strategy is hot_offload, but it places no decoder layer and no routed experts on the host"),
    ("infeasible", "strategy is infeasible, but it fits the weight budget"),
    ("fast", "strategy is \"fast\", but must be one of resident, cold_offload, hot_offload, infeasible"),
])
def test_the_strategy_matches_the_placement(data, tmp_path, strategy, match):
    data["strategy"] = strategy
    one_line_error(data, tmp_path, match)


@pytest.mark.parametrize("inputs_value,match", [
    (None, "inputs: must be an object, not null"),
    ({"device_memory_bytes": "24GiB"}, "inputs.device_memory_bytes is \"24GiB\", but must be an integer >= 1"),
])
def test_inputs_are_validated(data, tmp_path, inputs_value, match):
    data["inputs"] = inputs_value
    one_line_error(data, tmp_path, match)


def test_inputs_that_leave_no_room_for_weights(data, tmp_path):
    data["inputs"]["kv_cache_bytes"] = data["inputs"]["device_memory_bytes"]
    one_line_error(data, tmp_path, "inputs: KV cache .* leave nothing")


def test_a_missing_field_is_named(data, tmp_path):
    del group(data, "model.embed_tokens")["role"]
    one_line_error(data, tmp_path, "groups\\[0\\].role of group model.embed_tokens is missing")


def test_a_newer_format_says_upgrade_or_replan(data, tmp_path):
    data["format"] = "selective-offload/plan-v9"
    message = one_line_error(data, tmp_path, "plan format v9 is newer than this selective-offload")
    assert "(reads v5): upgrade selective-offload or re-plan" in message


def test_not_a_plan_at_all(tmp_path):
    (tmp_path / "plan.json").write_text(json.dumps({"format": "selective-offload/manifest-v1"}))
    with pytest.raises(PlanError, match="not a selective-offload plan"):
        Plan.load(tmp_path / "plan.json")


def test_unknown_fields_are_tolerated_with_a_note(data, tmp_path):
    data["comment"] = "hand-tuned"
    group(data, "model.layers.3")["owner"] = "me"
    plan = load(data, tmp_path)
    assert any("field 'comment'" in n for n in plan.load_notes)
    assert any("groups[4].owner of group model.layers.3" in n for n in plan.load_notes)


def test_what_is_written_is_the_current_format(data):
    assert data["format"] == PLAN_FORMAT == "selective-offload/plan-v5"
    embed = group(data, "model.embed_tokens")
    assert (embed["location"], embed["serving"]) == (Location.HOST, Serving.GATHER) == ("host", "gather")
    assert "placement" not in embed and "cls" not in embed


def test_the_lm_head_can_never_be_marked_cold(data, tmp_path):
    head = group(data, "lm_head")
    head.update(role="cold", kind="component", location="host", serving="on-demand")
    del data["totals"]
    one_line_error(data, tmp_path, "group lm_head is marked cold, but the LM head is read in full every step")
