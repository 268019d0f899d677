"""``SELECTIVE_OFFLOAD_PLAN=auto`` as a user misconfigures it: device memory that is zero,
negative, nonsense or thousands of characters is refused naming the variable, before any
engine starts; a plan made at engine start that cannot fit says it is infeasible, by how
much, and which of the engine's settings to change (not the CLI's flags)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import selective_offload
from builders import gpu_profile
from helpers import nothing_applied, save_tiny_qwen3, save_tiny_qwen3_moe
from selective_offload.errors import PlanError, UserError
from selective_offload.options import ENV_DEVICE_MEMORY, ENV_PLAN, RunOptions, device_memory_from_env
from selective_offload.probe.profile import PROFILE_ENV
from selective_offload.vllm_glue import plugin
from selective_offload.vllm_glue.auto_plan import plan_at_start


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return save_tiny_qwen3(tmp_path_factory.mktemp("tiny"), seed=5)


def engine_config(model_dir, **cache):
    """A stand-in for vLLM's VllmConfig: the few attributes plan_at_start reads (no engine
    starts; the engine test tests/engine/test_vllm_auto.py runs the real one)."""
    cache_config = SimpleNamespace(**{"kv_cache_memory_bytes": None, "cache_dtype": "auto",
                                      "gpu_memory_utilization": 0.9, **cache})
    return SimpleNamespace(cache_config=cache_config, speculative_config=None,
                           model_config=SimpleNamespace(model=str(model_dir), max_model_len=64))


@pytest.mark.parametrize("value,says", [
    ("0", "must be more than 0"),
    ("0.0001", "=0.0001: give a unit, e.g. 0.0001GiB"),
    ("24", "=24: give a unit, e.g. 24GiB"),
    ("-1", "cannot read '-1' as a size"),
    ("-24GiB", "cannot read '-24GiB' as a size"),
    ("lots", "cannot read 'lots' as a size"),
    ("1e400", "must be a size from"),
    ("9" * 5000, "(5000 characters) is not a size"),
])
def test_device_memory_that_is_not_a_size_is_refused_naming_the_variable(value, says, monkeypatch):
    message = ""
    with pytest.raises(UserError) as info:
        device_memory_from_env({ENV_DEVICE_MEMORY: value})
    message = str(info.value)
    assert ENV_DEVICE_MEMORY in message and says in message, message
    assert "\n" not in message and len(message) < 300, message[:300]
    # As the user meets it: the plugin (SELECTIVE_OFFLOAD_PLAN=auto in the environment, the
    # first process vLLM starts) and enable("auto") both refuse before any engine exists.
    monkeypatch.setenv(ENV_PLAN, "auto")
    monkeypatch.setenv(ENV_DEVICE_MEMORY, value)
    with pytest.raises(UserError, match=ENV_DEVICE_MEMORY):
        plugin.register()
    monkeypatch.delenv(ENV_PLAN)
    with pytest.raises(UserError, match=ENV_DEVICE_MEMORY):
        selective_offload.enable("auto")
    assert nothing_applied()


def test_an_infeasible_plan_at_engine_start_says_by_how_much_and_what_to_change(model, monkeypatch):
    config = engine_config(model)
    monkeypatch.setenv(ENV_DEVICE_MEMORY, str(2 * 2**30 + 200_000))  # the reserve + a little: no room for layers
    with pytest.raises(PlanError) as info:
        plan_at_start(RunOptions("auto"), config, config.model_config, torch.device("cpu"))
    message = str(info.value)
    assert message.startswith(f"{ENV_PLAN}=auto: the plan made at engine start for {model}"), message
    assert "is infeasible: " in message and " GB more device memory is needed" in message, message
    shortfall = float(message.split("is infeasible: ")[1].split(" GB")[0])
    assert shortfall > 0
    assert f"raise {ENV_DEVICE_MEMORY}" in message and "max_model_len" in message, message
    assert "--" not in message and "\n" not in message  # the engine's settings, not the CLI's flags
    # With more of the same variable the same model fits: the advice was the right one.
    monkeypatch.setenv(ENV_DEVICE_MEMORY, "64GiB")
    plan, _ = plan_at_start(RunOptions("auto"), config, config.model_config, torch.device("cpu"))
    assert plan.strategy == "resident"


def test_the_plan_made_at_engine_start_takes_the_probes_host_kernel_rates(tmp_path, monkeypatch):
    """A profile of this host (``selective-offload probe``) that measured the bf16 kernel, the
    read rate, the hand-off and the threads it timed the kernel with: the plan made at engine
    start takes them into its inputs, as a plan made with the CLI from the same profile does (they price
    host-compute and decide its claim on
    this host: test_host_compute.py); without the profile, neither."""
    model = save_tiny_qwen3_moe(tmp_path / "moe", seed=5)
    profile = gpu_profile(cpu_kernel_gbps={"bf16": 30.0}, cpu_threads=2, host_read_gbps=40.0, handoff_s=12e-6)
    profile.save(tmp_path / "profile.json")
    monkeypatch.setenv(ENV_DEVICE_MEMORY, "64GiB")
    config = engine_config(model)
    monkeypatch.setenv(PROFILE_ENV, str(tmp_path / "absent.json"))
    plain, _ = plan_at_start(RunOptions("auto"), config, config.model_config, torch.device("cpu"))
    assert (plain.inputs.cpu_gbps, plain.inputs.cpu_gbps_source, plain.inputs.cpu_read_gbps) == (None, "assumed", None)
    assert plain.inputs.handoff_s is None and plain.inputs.cpu_threads is None
    monkeypatch.setenv(PROFILE_ENV, str(tmp_path / "profile.json"))
    plan, _ = plan_at_start(RunOptions("auto"), config, config.model_config, torch.device("cpu"))
    assert (plan.inputs.cpu_gbps, plan.inputs.cpu_gbps_source, plan.inputs.cpu_read_gbps) == (30.0, "measured", 40.0)
    assert plan.inputs.handoff_s == 12e-6 and plan.inputs.cpu_threads == 2  # the threads the rates were timed with
