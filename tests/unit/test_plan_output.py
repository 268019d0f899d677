"""What `selective-offload plan` prints by default: the verdict first, the totals a user checks
against nvidia-smi and free, the estimate, and a `next:` line whose commands run; the rest
behind --verbose and --explain, and no caveat block in the output or in the plan file."""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import replace

import pytest

from helpers import save_tiny_qwen3
from selective_offload import cli, plan_options, render
from selective_offload.cli import build_parser, main
from selective_offload.cpu_kernels import claimed
from selective_offload.plan_format import EST_IGNORES, EST_MODEL, Plan
from selective_offload.render import MIN_PRICED_MODEL_BYTES, priced, render_plan
from selective_offload.sizes import fmt_bytes

REFERENCE = ["plan", "qwen3.8-27b-fp8", "--device-memory", "24GiB"]


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def planned(capsys, *argv) -> Plan:
    code, out, err = run(capsys, *argv, "--json")
    assert code in (0, cli.EXIT_INFEASIBLE), err
    return Plan.from_dict(json.loads(out))


def next_commands(out: str) -> list[str]:
    """The commands after ``next:``, a command broken over lines (each ending `` \\``)
    joined back into one."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("next:"))
    commands, open_ = [], False
    for line in [lines[start].removeprefix("next:")] + lines[start + 1:]:
        if not line.startswith(" ") and commands:
            break
        part = line.strip()
        joined = part.removesuffix("\\").rstrip()
        commands[-1:] = [commands[-1] + " " + joined] if open_ else commands[-1:] + [joined]
        open_ = part.endswith("\\")
    return commands


def test_the_reference_plan_says_its_verdict_first_in_at_most_20_lines_of_80_columns(capsys, monkeypatch):
    """With the block FP8 kernel claimed, so the view has its host-compute line too (whether it
    is claimed is the benchmark's verdict: test_claimed.py)."""
    monkeypatch.setitem(claimed.CLAIMED, "fp8-block", True)
    monkeypatch.setattr(plan_options, "machine_ram_bytes", lambda: 64 << 30)
    code, out, err = run(capsys, *REFERENCE)
    assert code == 0, err
    plan = planned(capsys, *REFERENCE)
    lines = out.splitlines()
    assert lines[0] == f"qwen3.8-27b-fp8 on a 24 GiB card: fits with {fmt_bytes(plan.host_bytes)} on the host"
    assert len(lines) <= 20, out
    assert max(len(line) for line in lines) <= 80, out
    # device memory as nvidia-smi adds it up, host bytes of whose RAM
    used = (plan.device_bytes + plan.device_share_bytes + plan.prefetch_buffer_bytes + plan.est_transient_device_bytes
            + plan.inputs.kv_cache_bytes + plan.inputs.reserve_bytes)
    # of what a 24 GiB card keeps free after the CUDA context (the card class's figure, est)
    assert plan.inputs.card_bytes < plan.inputs.device_memory_bytes
    assert f"= {fmt_bytes(used)} of {fmt_bytes(plan.inputs.card_bytes)} (free est of the 24 GiB card)" in out
    assert used <= plan.inputs.card_bytes
    host = next(line for line in lines if line.startswith("host "))
    free = (64 << 30) - plan.inputs.host_headroom_bytes  # the system's and vLLM's headroom kept
    assert host.startswith(f"host   {fmt_bytes(plan.host_bytes)} of {fmt_bytes(free)} free of "
                           f"{fmt_bytes(64 << 30).strip()} RAM (this machine's)")
    # the estimate rows: vLLM's baseline and this plan, tok/s and the speed-up, with the rates' source
    base = next(line for line in lines if line.startswith("vLLM cpu_offload_gb="))
    mine = next(line for line in lines if line.startswith("this plan "))
    assert f"{plan.vllm_cpu_offload_gb.est.est_tok_s:.2f}" in base.split() and f"{plan.est.est_tok_s:.2f}" in mine.split()
    assert f"{plan.est.est_tok_s / plan.vllm_cpu_offload_gb.est.est_tok_s:.2f}x" in mine
    assert "rates  link 13.9, VRAM 472 GB/s: reference laptop's; run selective-offload probe" in lines
    record = plan.host_compute
    assert any(line.startswith(f"cpu    {record.format} at {record.cpu_gbps:g} GB/s ({record.cpu_gbps_source})")
               and f"crossover {record.crossover_tokens} tokens/step" in line for line in lines)
    # one formatter: adaptive units, no "0.000 GB" (the plan keeps no device share and prefetches layers)
    assert not plan.device_share_bytes and "device share" not in out.split("more:")[0] and "0.000 GB" not in out
    assert plan.hot_layer_indices and f"{fmt_bytes(plan.prefetch_bytes)} prefetched" in out
    assert fmt_bytes(plan.prefetch_buffer_bytes).strip().endswith("MB") and fmt_bytes(plan.prefetch_buffer_bytes) in out
    code, verbose, _ = run(capsys, *REFERENCE, "--verbose")
    assert "0.000 GB" not in verbose and "model.norm" in verbose and "kB" in verbose


def test_the_next_line_saves_the_plan_and_serves_it_with_the_args_given(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, _ = run(capsys, *REFERENCE, "--verbose", "--batch", "2")
    assert code == 0
    save, serve, *_ = next_commands(out)
    words = shlex.split(save)
    assert words[:2] == ["selective-offload", "plan"]
    args = build_parser().parse_args(words[1:])
    assert (args.model, args.device_memory, args.batch, args.output, args.verbose) == (
        "qwen3.8-27b-fp8", "24GiB", 2, "plan.json", False)
    assert main(words[1:]) == 0
    capsys.readouterr()
    assert Plan.load(tmp_path / "plan.json") == planned(capsys, *REFERENCE, "--batch", "2")
    assert shlex.split(serve)[:3] == ["SELECTIVE_OFFLOAD_PLAN=plan.json", "vllm", "serve"]
    # -o given: the plan is saved, only the serve command is next, its path quoted
    target = tmp_path / "my plans" / "p.json"
    target.parent.mkdir()
    code, out, _ = run(capsys, *REFERENCE, "-o", str(target))
    commands = next_commands(out)
    assert not any(c.startswith("selective-offload") for c in commands)
    assert shlex.split(commands[0])[:3] == [f"SELECTIVE_OFFLOAD_PLAN={target}", "vllm", "serve"]


def test_a_checkpoint_directory_is_what_vllm_serve_is_given(capsys, tmp_path):
    model = save_tiny_qwen3(tmp_path / "my model")
    # a step of 128 tokens: at vLLM's default 2048 a tiny MLP's copy above the crossover would hold
    # more activations than the model has weights
    argv = ("plan", str(model), "--device-memory", "5MB", "--kv-cache", "0", "--reserve", "0",
            "--max-model-len", "128", "--max-seqs", "1", "--max-num-batched-tokens", "128")
    code, out, _ = run(capsys, *argv)
    assert code == 0
    save, serve = next_commands(out)[:2]
    assert build_parser().parse_args(shlex.split(save)[1:]).model == str(model)
    words = shlex.split(serve)
    # the KV cache the plan kept beside the weights it fitted, and (its MLPs computed on the
    # host) CUDA graphs capped at its crossover
    plan = planned(capsys, *argv)
    assert plan.deficit_bytes > 0
    assert words[1:] == ["vllm", "serve", str(model), "--max-model-len", "128",
                         "--kv-cache-memory-bytes", str(plan.inputs.kv_cache_bytes),
                         "--max-cudagraph-capture-size", str(plan.host_compute.crossover_tokens)]


def test_no_caveat_block_by_default_nor_in_the_plan_file_and_explain_shows_it(capsys, tmp_path):
    target = tmp_path / "plan.json"
    code, out, _ = run(capsys, *REFERENCE, "-o", str(target))
    assert code == 0
    assert "They ignore" not in out and not any(item[:40] in out for item in EST_IGNORES)
    data = json.loads(target.read_text())
    assert "est_ignores" not in data and data["est_model"] == EST_MODEL
    assert "They ignore" not in target.read_text()
    code, explained, _ = run(capsys, *REFERENCE, "--explain")
    flowed = " ".join(line.strip() for line in explained.splitlines())  # --explain wraps at 80 columns
    assert all(f"- {item}" in flowed for item in EST_IGNORES) and EST_MODEL in explained
    assert all(len(line) <= 80 for line in explained.splitlines())


def test_a_model_too_small_to_mean_anything_gets_no_tok_s(capsys, tmp_path):
    model = save_tiny_qwen3(tmp_path / "tiny")
    for extra in ([], ["--verbose"]):
        code, out, _ = run(capsys, "plan", str(model), "--device-memory", "5MB", "--kv-cache", "0",
                           "--reserve", "0", *extra)
        assert code == 0
        assert "no tok/s" in out
        assert not re.search(r"tok/s\s", out.replace("no tok/s", "")) and "speed-up" not in out, out
    plan = planned(capsys, "plan", str(model), "--device-memory", "5MB", "--kv-cache", "0", "--reserve", "0")
    assert not priced(plan)
    at = replace(plan, model=replace(plan.model, total_bytes=MIN_PRICED_MODEL_BYTES))
    assert priced(at) and "tok/s" in render_plan(at)
    below = replace(plan, model=replace(plan.model, total_bytes=MIN_PRICED_MODEL_BYTES - 1))
    assert not priced(below) and "no tok/s" in render_plan(below)


def test_plan_help_is_grouped_one_or_two_lines_an_option(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")  # argparse wraps --help to the terminal's width
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    out = capsys.readouterr().out
    for group in ("card and budget:", "machine rates", "workload:", "vLLM:", "output:"):
        assert f"\n{group}" in out, group
    blocks: list[list[str]] = []
    for line in out.splitlines():
        if line.startswith("  -"):
            blocks.append([line])
        elif blocks and blocks[-1] and line.startswith(" " * 24) and line.strip():
            blocks[-1].append(line)
        elif blocks:
            blocks.append([])  # a blank line or a group's title ends the option
    options = [b for b in blocks if b]
    assert len(options) >= 30

    def help_lines(block: list[str]) -> int:
        first = block[0]
        return (1 if len(first) > 24 and first[22:24] == "  " and first[24] != " " else 0) + len(block) - 1

    too_long = [b[0].split()[0] for b in options if help_lines(b) > 2]
    assert not too_long, too_long
    assert all(help_lines(b) >= 1 for b in options)



def test_a_model_is_named_by_its_folder(tmp_path):
    model = save_tiny_qwen3(tmp_path / "My-Model")
    assert render.model_name(str(model / "config.json")) == "My-Model"
    assert render.model_name(str(model / "model.safetensors")) == "My-Model"
    assert render.model_name(str(model) + "/") == "My-Model"
    assert render.model_name("selective_offload/data/qwen3.8-27b-fp8.manifest.json") == "qwen3.8-27b-fp8"
    assert render.model_name("Qwen/Qwen3-8B@main") == "Qwen/Qwen3-8B@main"  # a hub id as typed


def test_an_infeasible_plan_prints_no_tok_s_and_each_fix_it_offers_fits(capsys, monkeypatch):
    """On a 25 GB box the reference on an 8 GiB card falls short of host RAM: line 1 says
    so, nothing is priced, and each flag the fix offers makes the plan fit."""
    monkeypatch.setattr(plan_options, "machine_ram_bytes", lambda: 25 * 10**9)
    argv = ["plan", "qwen3.8-27b-fp8", "--device-memory", "8GiB"]
    code, out, _ = run(capsys, *argv)
    lines = out.splitlines()
    assert code == cli.EXIT_INFEASIBLE and lines[0].endswith(" short of host RAM"), out
    assert "tok/s" not in out and "speed-up" not in out and "next:" not in out
    fix = " ".join(line[7:] for line in lines[1:] if line.startswith(("fix ", "       "))
                   and not line.startswith("device")).split("device ")[0]
    offered = re.findall(r"--(host|device)-memory (\d+GiB)", fix)
    assert [flag for flag, _ in offered] == ["device", "host"], fix
    assert "--kv-cache" not in fix  # 1 GiB KV + 2 GiB reserve cannot free the bytes short
    for flag, value in offered:
        code, out, _ = run(capsys, *argv[:2], *(argv[2:] if flag == "host" else []), f"--{flag}-memory", value)
        assert code == 0, (flag, value, out)
    # a device shortfall a smaller KV cache closes: offered, and it does
    plan = planned(capsys, "plan", "qwen3.8-27b-fp8", "--device-memory", "4GiB", "--host-memory", "none")
    assert plan.shortfall_bytes and plan.shortfall_bytes < plan.inputs.reserve_bytes
    code, out, _ = run(capsys, "plan", "qwen3.8-27b-fp8", "--device-memory", "4GiB", "--host-memory", "none")
    assert "less --kv-cache or --reserve" in out and "--host-memory" not in out.split("device ")[0]
    code, _, _ = run(capsys, "plan", "qwen3.8-27b-fp8", "--device-memory", "4GiB", "--host-memory", "none",
                     "--reserve", "0")
    assert code == 0


@pytest.mark.parametrize("card,flags,offered", [
    ("4GiB", [], "6GiB"),
    # 24 GiB would hold it as given, not as a 24 GiB card's class margin and context leave it
    ("21GiB", ["--kv-cache", "17GiB", "--reserve", "3.5GiB"], "25GiB")])
def test_the_device_memory_a_fix_offers_is_the_smallest_that_fits(capsys, card, flags, offered):
    argv = ["plan", "qwen3.8-27b-fp8", "--host-memory", "none", *flags, "--device-memory"]
    code, out, _ = run(capsys, *argv, card)
    assert code == cli.EXIT_INFEASIBLE and f"fix    --device-memory {offered} (all it" in out, out
    smaller = f"{int(offered[:-3]) - 1}GiB"
    assert [run(capsys, *argv, size)[0] for size in (offered, smaller)] == [0, cli.EXIT_INFEASIBLE]


def test_a_vllm_baseline_over_the_host_ram_is_marked(capsys):
    argv = ["plan", "qwen3.8-27b-fp8", "--device-memory", "24GiB", "--host-memory", "24GiB"]
    code, out, _ = run(capsys, *argv)
    base = next(line for line in out.splitlines() if line.startswith("vLLM cpu_offload_gb="))
    assert code == 0 and "(over" not in base
    code, out, _ = run(capsys, *argv, "--cpu-offload-gb", "20")
    plan = planned(capsys, *argv, "--cpu-offload-gb", "20")
    assert plan.vllm_cpu_offload_gb.offloaded_bytes > plan.inputs.host_available_bytes >= plan.host_bytes
    base = next(line for line in out.splitlines() if line.startswith("vLLM cpu_offload_gb=20"))
    assert code == 0 and base.endswith("(over host RAM)") and len(base) <= 80, base


def test_verbose_is_detail_not_the_summary_twice(capsys):
    code, out, _ = run(capsys, *REFERENCE, "--verbose")
    assert code == 0
    lines = out.splitlines()
    assert max(len(line) for line in lines) <= render.DETAIL_WIDTH, max(lines, key=len)
    assert out.count("estimate (bytes / bandwidth)") == 1 and out.count("tok/s") == 1
    assert sum(line.startswith("device ") for line in lines) == 1
    assert "step parts (est)" in out and "model.embed_tokens" in out


def test_a_published_figure_is_cited_under_explain_only(capsys, tmp_path):
    """gpt-oss-120b (its config alone) on a 24 GiB card: llama.cpp's published figure is
    context for --explain, not a row of the default view."""
    import transformers

    from helpers import write_config

    mxfp4 = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    config = transformers.GptOssConfig(num_hidden_layers=36, num_local_experts=128, num_experts_per_tok=4,
                                       hidden_size=2880, intermediate_size=2880, num_attention_heads=64,
                                       num_key_value_heads=8, head_dim=64, vocab_size=201088,
                                       tie_word_embeddings=False)
    folder = tmp_path / "gpt-oss-120b"
    folder.mkdir()
    path = write_config(folder, config, "GptOssForCausalLM", quantization_config=mxfp4, experts_per_token=4)
    argv = ["plan", str(path), "--device-memory", "24GiB", "--host-memory", "none"]
    code, out, _ = run(capsys, *argv)
    assert code == 0 and out.startswith("gpt-oss-120b on a 24 GiB card: fits with ")
    assert "llama.cpp" not in out
    code, explained, _ = run(capsys, *argv, "--explain")
    cited = explained.split("llama.cpp published: ", 1)
    assert len(cited) == 2 and all(len(line) <= 80 for line in cited[1].split("\nmore:")[0].splitlines())
