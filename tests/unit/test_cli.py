"""`selective-offload plan` and `manifest`: output, JSON, exit codes, one-line errors."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import types
from dataclasses import fields

import pytest

from helpers import save_tiny_qwen3, write_header_only, write_raw_header
from selective_offload.cli import EXIT_INFEASIBLE, EXIT_USAGE, build_parser, main
from selective_offload.cpu_kernels import claimed
from selective_offload.plan_options import PlanOptions, option_docs
from selective_offload.planner import Plan


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_bundled_reference_verbose_prints_table_and_cpu_offload_gb_comparison(capsys):
    code, out, err = run(capsys, "plan", "qwen3.8-27b-fp8", "--device-memory", "24GiB", "--cpu-offload-gb", "10",
                         "--verbose")
    assert code == 0, err
    embed = next(line for line in out.splitlines() if line.startswith("model.embed_tokens"))
    assert embed.split()[3:6] == ["cold", "host", "gather"]
    assert "lm_head" in out
    assert "vLLM cpu_offload_gb=10" in out
    assert "strategy  hot_offload" in out
    assert "step parts (est)" in out and "cpu_offload_gb takes " in out
    assert "They ignore" not in out and "leaves out:" not in out  # --explain's


def test_plan_json_and_output_file_agree(capsys, tmp_path):
    target = tmp_path / "plan.json"
    code, out, _ = run(capsys, "plan", "qwen3.8-27b-fp8", "--device-memory", "24GiB", "--json", "-o", str(target))
    assert code == 0
    printed = json.loads(out)
    assert printed == json.loads(target.read_text())
    plan = Plan.load(target)
    assert plan.strategy == "hot_offload"
    assert (plan.hot_layer_indices or plan.device_share_bytes) and plan.est.est_tok_s > 0


def test_plan_real_checkpoint_dir(capsys, tmp_path):
    save_tiny_qwen3(tmp_path)
    code, out, err = run(capsys, "plan", str(tmp_path), "--device-memory", "5MB",
                         "--kv-cache", "0", "--reserve", "0", "--verbose")
    assert code == 0, err
    assert "model.layers.0" in out and "model.embed_tokens" in out


def test_plan_from_config_alone_is_labelled(capsys, tmp_path):
    save_tiny_qwen3(tmp_path)
    code, out, err = run(capsys, "plan", str(tmp_path / "config.json"), "--device-memory", "8GiB")
    assert code == 0, err
    # named by its folder, not the config.json path typed
    assert out.splitlines()[0].startswith(f"{tmp_path.name} on a 8 GiB card: ")
    assert "sizes  estimated from config.json alone (no shard headers read)" in out.splitlines()
    code, out, err = run(capsys, "plan", str(tmp_path / "config.json"), "--device-memory", "8GiB", "--verbose")
    assert "planned from config.json alone" in out and "manifest_from_config" not in out


def test_infeasible_plan_exits_3_with_its_reason_on_line_1(capsys):
    """By how much on the first line, what to change on the lines after it; no command to
    apply it; short enough to read in a terminal when both device and host memory fall short."""
    code, out, _ = run(capsys, "plan", "qwen3.8-27b-fp8", "--device-memory", "4GiB", "--host-memory", "none")
    assert code == EXIT_INFEASIBLE
    lines = out.splitlines()
    plan = Plan.from_dict(json.loads(run(capsys, "plan", "qwen3.8-27b-fp8", "--device-memory", "4GiB",
                                         "--host-memory", "none", "--json")[1]))
    assert lines[0] == f"qwen3.8-27b-fp8 on a 4 GiB card: INFEASIBLE: {plan.shortfall_bytes / 1e9:.3f} GB short of " \
                       "device memory"
    assert lines[1].startswith("fix    --device-memory 6GiB (all it") and "--kv-cache" in " ".join(lines[1:3])
    assert "next:" not in out
    code, out, _ = run(capsys, "plan", "qwen3.8-27b-fp8", "--device-memory", "24GiB", "--host-memory", "4GiB")
    lines = out.splitlines()
    assert code == EXIT_INFEASIBLE and lines[0].endswith(" GB short of host RAM")
    assert "short of device memory" not in lines[0]
    assert "--host-memory " in " ".join(lines[1:4]) and "--host-memory: 4.295 GB" in " ".join(lines[1:4])
    code, out, _ = run(capsys, "plan", "qwen3.8-27b-fp8", "--device-memory", "4GiB", "--host-memory", "4GiB")
    lines = out.splitlines()
    assert "short of device memory, " in lines[0] and lines[0].endswith("short of host RAM")
    assert len(lines[0]) <= 110 and all(len(line) <= 80 for line in lines[1:])
    code, out, _ = run(capsys, "plan", "qwen3.8-27b-fp8", "--device-memory", "4GiB", "--verbose")
    assert "strategy  infeasible" in out


def test_manifest_command_writes_a_plannable_manifest(capsys, tmp_path):
    save_tiny_qwen3(tmp_path / "m")
    code, out, _ = run(capsys, "manifest", str(tmp_path / "m"), "-o", str(tmp_path / "man.json"))
    assert code == 0 and "wrote" in out
    code, out, _ = run(capsys, "plan", str(tmp_path / "man.json"), "--device-memory", "8GiB")
    assert code == 0 and out.splitlines()[0] == "man on a 8 GiB card: fits whole on the device; plain `vllm serve` needs no plan"


def _bad_inputs(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    trunc = tmp_path / "trunc"
    trunc.mkdir()
    write_raw_header(trunc / "m.safetensors", {"x": {}}, declared_len=99_999)
    badjson = tmp_path / "badjson"
    badjson.mkdir()
    write_raw_header(badjson / "m.safetensors", b"{nope")
    overlap = tmp_path / "overlap"
    overlap.mkdir()
    write_raw_header(overlap / "m.safetensors", {
        "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
        "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}})
    dtype = tmp_path / "dtype"
    dtype.mkdir()
    write_raw_header(dtype / "m.safetensors", {"a": {"dtype": "Q3", "shape": [4], "data_offsets": [0, 4]}})
    good = tmp_path / "good"
    good.mkdir()
    write_header_only(good / "m.safetensors", {"model.layers.0.w": ("BF16", [4])})
    return {
        "missing path": ([str(tmp_path / "nope"), "--device-memory", "24GiB"], "no such file"),
        "no shards": ([str(empty), "--device-memory", "24GiB"], "no *.safetensors"),
        "truncated header": ([str(trunc), "--device-memory", "24GiB"], "runs past the end"),
        "invalid json": ([str(badjson), "--device-memory", "24GiB"], "not valid JSON"),
        "overlapping offsets": ([str(overlap), "--device-memory", "24GiB"], "overlap"),
        "unknown dtype": ([str(dtype), "--device-memory", "24GiB"], "unknown dtype 'Q3'"),
        "unparsable size": ([str(good), "--device-memory", "24 gigs"], "cannot read '24 gigs'"),
        "negative bandwidth": ([str(good), "--device-memory", "24GiB", "--link-gbps", "-3"], "from 0.001 to"),
        "zero device": ([str(good), "--device-memory", "0"], "more than 0"),
        "no room for weights": ([str(good), "--device-memory", "2GiB"], "leave nothing"),
        "bad cold list": ([str(good), "--device-memory", "8GiB", "--cold-segments", "model.visual"], "single name"),
        "bad cpu_offload_gb": ([str(good), "--device-memory", "8GiB", "--cpu-offload-gb", "ten"], "--cpu-offload-gb"),
        "bare size": ([str(good), "--device-memory", "24"], "--device-memory 24: give a unit, e.g. 24GiB"),
    }


@pytest.mark.parametrize("case", [
    "missing path", "no shards", "truncated header", "invalid json", "overlapping offsets",
    "unknown dtype", "unparsable size", "negative bandwidth", "zero device", "no room for weights", "bad cold list", "bad cpu_offload_gb",
    "bare size",
])
def test_bad_input_is_one_line_exit_2_no_traceback(capsys, tmp_path, case):
    argv, expected = _bad_inputs(tmp_path)[case]
    code, out, err = run(capsys, "plan", *argv)
    assert code == EXIT_USAGE
    assert expected in err
    assert err.count("\n") == 1 and err.startswith("selective-offload: error: ")
    assert "Traceback" not in err


def test_plan_help_explains_units(capsys):
    with pytest.raises(SystemExit) as done:
        main(["plan", "--help"])
    out = capsys.readouterr().out
    assert done.value.code == 0
    for needle in ("--device-memory", "GiB", "GB/s", "--speculative", "--kv-cache", "--json"):
        assert needle in out


def test_console_script_error_exit_code(tmp_path):
    """The installed command, as a user runs it: one line, exit 2."""
    exe = shutil.which("selective-offload") or f"{sys.executable} -m selective_offload.cli"
    proc = subprocess.run([*exe.split(), "plan", str(tmp_path / "nope"), "--device-memory", "1GiB"],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("selective-offload: error:")


def test_an_integrated_gpu_is_named_in_the_plan_output(capsys, monkeypatch):
    """This machine has no GPU: torch's device queries are stood in for, to show what a
    DGX Spark or Jetson user sees."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index: types.SimpleNamespace(name="NVIDIA GB10", is_integrated=True))
    code, out, _ = run(capsys, "plan", "qwen3.8-27b-fp8", "--device-memory", "24GiB")
    assert code == 0
    assert "note: this machine's GPU (NVIDIA GB10) is integrated, one memory with the host: the" in out
    assert "would free no device memory here" in out
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index: types.SimpleNamespace(name="NVIDIA H200", is_integrated=False))
    code, out, _ = run(capsys, "plan", "qwen3.8-27b-fp8", "--device-memory", "24GiB")
    assert "is integrated" not in out


def test_speculative_plan_shows_both_placements_and_recommends_one(capsys):
    code, out, _ = run(capsys, "plan", "qwen3.8-27b-fp8", "--device-memory", "24GiB", "--speculative", "mtp",
                       "--no-host-compute", "--verbose")
    assert code == 0
    # no K and no acceptance given: the Qwen3.x family's published rate, and the K the
    # step model finds fastest on this (link-bound) placement, the largest considered
    assert "this plan (MTP K=4 a=0.65)" in out
    assert "note: acceptance 0.65: the published rate for the Qwen3.x MTP head (" in out
    assert "note: draft tokens: K=4 is estimated fastest at acceptance 0.65" in out
    assert "note: est tok/s at acceptance 0.48/0.65/0.91 (the Qwen3.x MTP head's published range" in out
    assert "  without speculative decoding" in out
    assert "note: recommended: MTP speculative decoding (est " in out and "breaks even at acceptance" in out
    code, out, _ = run(capsys, "plan", "qwen3.8-27b-fp8", "--device-memory", "24GiB", "--speculative", "mtp:3",
                       "--accept-rate", "0.1", "--verbose")
    assert "MTP K=3 a=0.10" in out and "note: recommended: no speculative decoding" in out
    assert "note: draft tokens: no speculation is estimated fastest at acceptance 0.10" in out
    assert "the recommendation flips to K=" in out and "note: acceptance" not in out  # given, not the family's


@pytest.mark.parametrize("argv,match", [
    (["--speculative", "eagle"], "--speculative: 'eagle' is not understood"),
    (["--max-model-len", "4096"], "--max-model-len 4096 sizes the KV cache only with --max-seqs"),
    (["--batch", "0"], "--batch: batch 0 must be from 1 to"),
    (["--accept-rate", "1.5"], "acceptance rate 1.5 must be between 0 and 1"),
    (["--cpu-gbps", "-5"], "--cpu-gbps: '-5' GB/s must be a number of GB/s from"),
    (["--cpu-gbps", "fast"], "--cpu-gbps: cannot read 'fast'"),
    (["--cpu-threads", "0"], "--cpu-threads: 0 must be a whole number from 1 to"),
    (["--cpu-tflops", "0"], "--cpu-tflops: '0' must be a positive number of TFLOP/s"),
    (["--ranks", "0"], "--ranks: 0 must be a whole number from 1 to"),
    (["--cpu-threads", "2", "--ranks", "4"], "--cpu-threads 2 cannot be split between --ranks 4"),
])
def test_bad_economics_flags_are_one_line(capsys, argv, match):
    code, _, err = run(capsys, "plan", "qwen3.8-27b-fp8", "--device-memory", "24GiB", *argv)
    assert code == EXIT_USAGE and match in err and err.count("\n") == 1


def test_the_note_names_only_the_reference_rates_a_plan_took(capsys, tmp_path, monkeypatch):
    """Without a probe of a GPU, a rate given as a flag is the user's: the note says only the
    others are the reference laptop's (it once named both whatever was given)."""
    monkeypatch.setenv("SELECTIVE_OFFLOAD_PROFILE", str(tmp_path / "none.json"))

    def notes(*argv):
        code, out, _ = run(capsys, "plan", "qwen3.8-27b-fp8", "--device-memory", "24GiB", "--json", *argv)
        assert code == 0
        return [n for n in json.loads(out)["notes"] if "reference laptop's" in n]

    assert notes("--vram-gbps", "900") == [
        "link 13.9 GB/s is the reference laptop's (no `selective-offload probe` profile of a GPU here): "
        "measure yours with `selective-offload probe`"]
    assert [n.split(" is the ")[0] for n in notes("--link-gbps", "25")] == ["VRAM 472.0 GB/s"]
    assert notes("--link-gbps", "25", "--vram-gbps", "900") == []
    assert notes()[0].startswith("link 13.9 GB/s and VRAM 472.0 GB/s are the reference laptop's")


def test_probe_writes_a_profile_that_plan_uses(capsys, tmp_path, monkeypatch):
    """Here (no GPU) the probe measures host memcpy and says there is no link, so plan keeps
    the reference bandwidths and says where they come from; a GPU machine's profile (written
    by hand here) supplies the link, VRAM and device memory."""
    monkeypatch.setenv("SELECTIVE_OFFLOAD_PROFILE", str(tmp_path / "profile.json"))
    code, out, _ = run(capsys, "probe", "--quick")
    assert code == 0 and (tmp_path / "profile.json").is_file() and "no link" in out.lower()
    code, out, _ = run(capsys, "plan", "qwen3.8-27b-fp8", "--device-memory", "24GiB", "--verbose")
    assert "link 13.9 GB/s and VRAM 472.0 GB/s are the reference laptop's" in " ".join(out.split())
    profile = json.loads((tmp_path / "profile.json").read_text())
    profile.update(device="NVIDIA H200", link_gbps_pinned=52.0, link_gbps_pageable=20.0, vram_gbps=3900.0,
                   device_memory_total_bytes=150_000_000_000, device_memory_free_bytes=149_000_000_000,
                   no_link_reason=None)
    (tmp_path / "profile.json").write_text(json.dumps(profile))
    code, out, _ = run(capsys, "plan", "qwen3.8-27b-fp8", "--json")
    plan = json.loads(out)
    assert (plan["inputs"]["link_gbps"], plan["inputs"]["vram_gbps"], plan["inputs"]["device_memory_bytes"]) == (
        52.0, 3900.0, 150_000_000_000)
    assert any("measured by `selective-offload probe`" in n for n in plan["notes"])


def test_the_kv_trade_off_is_printed_with_the_model_sized_cache(capsys):
    """64 full-attention layers x 4 KV heads x 256 x 2 (K, V) x 2 B = 262,144 B per token:
    one 4096-token sequence is 1.074 GB, and N of them N times that."""
    code, out, _ = run(capsys, "plan", "qwen3.8-27b-fp8", "--device-memory", "24GiB", "--max-model-len", "4096",
                       "--max-seqs", "4", "--verbose")
    assert code == 0
    assert "KV cache 1.074 GB (est): 4 sequence(s)" not in out  # 4 sequences: 4.295 GB
    assert "note: KV cache 4.295 GB (est): 4 sequence(s) of 4096 tokens at 262.1 kB/token" in out
    rows = {int(line.split()[0]): line.split() for line in out.split("KV cache trade-off", 1)[1].splitlines()[2:7]}
    assert sorted(rows) == [1, 2, 4, 8, 16]
    assert [float(rows[n][1]) for n in (1, 2, 4)] == [1.074, 2.147, 4.295]


def test_plan_lists_host_compute_mlps_and_no_host_compute_turns_them_off(capsys, monkeypatch):
    monkeypatch.setitem(claimed.CLAIMED, "fp8-block", True)
    code, out, err = run(capsys, "plan", "qwen3.8-27b-fp8", "--device-memory", "24GiB", "--json")
    assert code == 0, err
    plan = Plan.from_dict(json.loads(out))
    mlps = [g for g in plan.groups if g.kind == "mlp"]
    assert mlps and all(g.serving == "compute" for g in mlps) and plan.host_compute.format == "fp8-block"
    code, out, err = run(capsys, "plan", "qwen3.8-27b-fp8", "--device-memory", "24GiB", "--verbose")
    assert code == 0, err
    assert f"dense MLPs in host memory, computed there by the host CPU ({len(mlps)} layers" in out
    assert "mlp of those" in out or any(line.startswith(mlps[0].group) for line in out.splitlines())
    code, out, err = run(capsys, "plan", "qwen3.8-27b-fp8", "--device-memory", "24GiB", "--json", "--no-host-compute")
    assert code == 0, err
    off = Plan.from_dict(json.loads(out))
    assert not any(g.kind == "mlp" for g in off.groups) and off.host_compute is None and off.hot_layer_indices


def test_every_plan_option_is_a_flag_made_from_its_field_with_its_docstring_as_help():
    """PlanOptions is the one source: each field is one `plan` flag (and a keyword of
    selective_offload.plan()), its help the docstring under the field, nothing else plans."""

    parser = build_parser()
    plan_parser = next(a for a in parser._subparsers._group_actions[0].choices.values() if a.prog.endswith(" plan"))
    flags = {a.option_strings[0]: a for a in plan_parser._actions if a.option_strings}
    docs = option_docs()
    for f in fields(PlanOptions):
        action = flags.pop(f"--{f.name.replace('_', '-')}")
        assert action.dest == f.name and action.default == f.default and action.help == docs[f.name]
        assert docs[f.name] and "{" not in docs[f.name] and "\n" not in docs[f.name]
    assert set(flags) == {"-h", "-o", "--json", "-v", "--explain", "--png", "--svg"}, set(flags)
