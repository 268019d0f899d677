"""The card a plan is made for: ``plan --compute-capability``, the probe's, the plan file's
optional ``compute_capability`` (plans without it still read), and a bad value refused in
one line."""

from __future__ import annotations

import json

import pytest

from selective_offload.cli import main
from selective_offload.errors import PlanError
from selective_offload.plan_format import Plan, PlanInputs
from selective_offload.planner import kernels
from selective_offload.sizes import GiB


def plan(capsys, *argv):
    code = main(["plan", "qwen3.8-27b-fp8", "--device-memory", "24GiB", "--host-memory", "none", "--json", *argv])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if code == 0 else err)


def test_the_cli_takes_the_card_as_torch_spells_it(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("SELECTIVE_OFFLOAD_PROFILE", str(tmp_path / "none.json"))
    code, data = plan(capsys, "--compute-capability", "9.0")
    assert code == 0 and data["inputs"]["compute_capability"] == "9.0"
    code, data = plan(capsys)
    assert code == 0 and data["inputs"]["compute_capability"] is None
    for bad in ("sm90", "9", "9.0.1", "x.y", ""):
        code, err = plan(capsys, "--compute-capability", bad)
        assert code == 2 and "--compute-capability: compute capability" in err, err
        assert err.count("\n") == 1 and "like 8.9" in err, err


def test_the_probe_s_card_is_taken(capsys, tmp_path, monkeypatch):
    from builders import gpu_profile

    gpu_profile(compute_capability="9.0").save(tmp_path / "p.json")
    monkeypatch.setenv("SELECTIVE_OFFLOAD_PROFILE", str(tmp_path / "p.json"))
    assert plan(capsys)[1]["inputs"]["compute_capability"] == "9.0"
    assert plan(capsys, "--compute-capability", "12.0")[1]["inputs"]["compute_capability"] == "12.0"


def test_a_plan_file_keeps_the_card_and_one_without_it_still_reads(tmp_path):
    from selective_offload.checkpoint import load_checkpoint
    from selective_offload.cli import BUNDLED
    from selective_offload.planner import make_plan

    made = make_plan(load_checkpoint(BUNDLED["qwen3.8-27b-fp8"]), PlanInputs(device_memory_bytes=24 * GiB,
                                                                      compute_capability="12.0"))
    made.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json").inputs.compute_capability == "12.0"
    data = json.loads((tmp_path / "plan.json").read_text())
    del data["inputs"]["compute_capability"]
    (tmp_path / "old.json").write_text(json.dumps(data))
    old = Plan.load(tmp_path / "old.json")
    assert old.inputs.compute_capability is None and old.inputs.card == kernels.DEFAULT_CARD


def test_inputs_refuse_a_card_spelled_otherwise():
    with pytest.raises(PlanError, match="must be spelled '9.0'"):
        PlanInputs(device_memory_bytes=24 * GiB, compute_capability="09.0").validate()
    with pytest.raises(PlanError, match="like 8.9"):
        PlanInputs(device_memory_bytes=24 * GiB, compute_capability="sm_90").validate()


def test_a_card_between_the_table_s_columns_uses_its_family_or_none():
    assert kernels.kernel_for("mxfp4", "12.1") == kernels.kernel_for("mxfp4", "12.0")
    assert kernels.kernel_for("mxfp4", "7.0") is None and not kernels.pick("mxfp4", "7.0").reads_uva
    # the pre-Ada cards are columns of their own: an A100 builds Marlin for MXFP4, as an SM 8.6 card
    assert kernels.kernel_for("mxfp4", "8.0") == kernels.kernel_for("mxfp4", "8.6") == "MarlinExperts"


def test_the_cli_takes_the_server_s_moe_setting_and_the_plan_file_keeps_it(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("SELECTIVE_OFFLOAD_PROFILE", str(tmp_path / "none.json"))
    for argv, setting in ((("--moe-backend", "triton"), kernels.TRITON), (("--no-deep-gemm",), kernels.DEEP_GEMM_OFF),
                          (("--moe-backend", "marlin", "--no-deep-gemm"), kernels.MARLIN), ((), kernels.AUTO)):
        code, data = plan(capsys, *argv)
        assert code == 0 and data["inputs"]["moe_setting"] == setting, argv
    assert kernels.PLAN_FLAGS.keys() == set(kernels.SETTINGS)
    code, err = plan(capsys, "--moe-backend", "flashinfer")
    assert code == 2 and err.startswith("selective-offload") and "--moe-backend: 'flashinfer'" in err, err
    assert err.count("\n") == 1, err


def test_a_plan_file_with_a_setting_it_does_not_know_is_refused_in_one_line(tmp_path):
    from selective_offload.checkpoint import load_checkpoint
    from selective_offload.cli import BUNDLED
    from selective_offload.planner import make_plan

    made = make_plan(load_checkpoint(BUNDLED["qwen3.8-27b-fp8"]), PlanInputs(device_memory_bytes=24 * GiB,
                                                                      moe_setting=kernels.TRITON))
    made.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json").inputs.moe_setting == kernels.TRITON
    data = json.loads((tmp_path / "plan.json").read_text())
    data["inputs"]["moe_setting"] = "--moe-backend deep_gemm"
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(PlanError, match="MoE setting '--moe-backend deep_gemm': use one of") as err:
        Plan.load(tmp_path / "bad.json")
    assert "\n" not in str(err.value)
