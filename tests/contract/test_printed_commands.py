"""Every command selective-offload prints for the user to run (``plan``'s ``next:`` lines,
the probe's ``for planning`` line) runs as printed in a POSIX shell, with paths that hold
spaces and quotes, across the lines it is wrapped over: each block is checked by
``bash -n`` and then run by bash with stand-in ``vllm`` and ``selective-offload`` programs
first on ``PATH`` (shell scripts that record the argv and the environment they were
given, in place of a server that cannot start here), and what they got is compared with
what was planned."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
from pathlib import Path

import pytest

from builders import gpu_profile
from selective_offload.cli import build_parser, main
from selective_offload.probe.profile import Profile

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash to run the printed commands")

#: A folder name with a space, a single and a double quote.
AWKWARD = "it's a \"model\" dir"


def stand_ins(tmp_path: Path) -> tuple[Path, Path]:
    """A folder of stand-in programs (``vllm``, ``selective-offload``), each writing its
    argv (NUL-separated) and SELECTIVE_OFFLOAD_PLAN to ``records/<name>``."""
    bin_dir, records = tmp_path / "bin", tmp_path / "records"
    bin_dir.mkdir()
    records.mkdir()
    for name in ("vllm", "selective-offload"):
        script = bin_dir / name
        script.write_text("#!/bin/sh\n"
                          f"printf '%s\\0' \"$@\" > '{records}/{name}.argv'\n"
                          f"printf '%s' \"${{SELECTIVE_OFFLOAD_PLAN-unset}}\" > '{records}/{name}.env'\n")
        script.chmod(0o755)
    return bin_dir, records


def recorded(records: Path, name: str) -> tuple[list[str], str]:
    argv = (records / f"{name}.argv").read_bytes().split(b"\0")[:-1]
    return [a.decode() for a in argv], (records / f"{name}.env").read_text()


def run_in_bash(block: str, bin_dir: Path, cwd: Path) -> None:
    syntax = subprocess.run(["bash", "-n"], input=block, capture_output=True, text=True)
    assert syntax.returncode == 0, (block, syntax.stderr)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    env.pop("SELECTIVE_OFFLOAD_PLAN", None)
    ran = subprocess.run(["bash", "-e"], input=block, capture_output=True, text=True, env=env, cwd=cwd)
    assert ran.returncode == 0, (block, ran.stderr)


def tiny_checkpoint(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
        "vocab_size": 1000}))
    mlp, embed = 64 * 128 * 2, 1000 * 64 * 2
    header = json.dumps({"model.layers.0.mlp.down_proj.weight": {
        "dtype": "BF16", "shape": [64, 128], "data_offsets": [0, mlp]},
        "model.embed_tokens.weight": {"dtype": "BF16", "shape": [1000, 64], "data_offsets": [mlp, mlp + embed]},
        "lm_head.weight": {"dtype": "BF16", "shape": [1000, 64], "data_offsets": [mlp + embed, mlp + 2 * embed]},
    }).encode()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * (mlp + 2 * embed))
    return folder


def next_block(out: str) -> str:
    """The lines after ``next:`` (its label and indent taken off), as the user pastes them."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("next:"))
    block = []
    for line in lines[start:]:
        if block and not line.startswith("       "):
            break
        block.append(line[7:])
    return "\n".join(block) + "\n"


@pytest.mark.parametrize("with_output", [True, False])
def test_the_next_commands_run_as_printed_with_spaces_and_quotes_in_every_path(capsys, tmp_path, with_output):
    model = tiny_checkpoint(tmp_path / AWKWARD / "Model X")
    work = tmp_path / "work dir"
    work.mkdir()
    plan_file = tmp_path / AWKWARD / "my plan's \"final\".json"
    argv = ["plan", str(model), "--device-memory", "24GiB", "--host-memory", "none", "--max-model-len", "4096",
            "--max-seqs", "2", "--moe-backend", "triton"] + (["-o", str(plan_file)] if with_output else [])
    bin_dir, records = stand_ins(tmp_path)
    # it fits whole: plain vLLM serves it, with no plan named and none saved
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "plain `vllm serve` needs no plan" in out.splitlines()[0]
    run_in_bash(next_block(out), bin_dir, work)
    served, env = recorded(records, "vllm")
    assert env == "unset" and served[:2] == ["serve", str(model)]
    assert not (records / "selective-offload.argv").exists()
    # the embedding sent to the host: the plan saved, then named to vLLM
    argv.append("--all-cold")
    assert main(argv) == 0
    out = capsys.readouterr().out
    block = next_block(out)
    assert len(block.splitlines()) > 1 and block.splitlines()[0].endswith("\\"), block  # wrapped
    run_in_bash(block, bin_dir, work)
    served, env = recorded(records, "vllm")
    expected_plan = str(plan_file) if with_output else "plan.json"
    assert env == expected_plan
    assert served[:2] == ["serve", str(model)]
    assert served[served.index("--max-model-len") + 1] == "4096"
    assert served[served.index("--moe-backend") + 1] == "triton"
    if not with_output:
        saved, _ = recorded(records, "selective-offload")
        args = build_parser().parse_args(saved)
        assert (args.model, args.output, args.max_seqs, args.all_cold) == (str(model), "plan.json", 2, True)


@pytest.mark.parametrize("gpu", [True, False])
def test_the_probes_line_for_planning_runs_as_printed(tmp_path, gpu):
    """A profile with the host kernels measured, of a GPU and without one: the line is a
    ``selective-offload plan MODEL ...`` command whose flags ``plan`` takes, and the remarks
    (the CPU kernels' rates, no GPU) are on lines of their own, never run."""
    profile = gpu_profile(cpu_kernel_gbps={"bf16": 30.0, "mxfp4": 12.5}, cpu_threads=8, host_read_gbps=40.0)
    if not gpu:
        profile = Profile.from_dict({**profile.to_dict(), "device": None, "link_gbps_pinned": None,
                                     "link_gbps_pageable": None, "vram_gbps": None, "uva_read_gbps": None,
                                     "decode_read_gbps": None, "matmul_tflops": None, "matmul_dtype": None,
                                     "device_memory_total_bytes": None, "device_memory_free_bytes": None,
                                     "compute_capability": None, "handoff_s": None,
                                     "no_link_reason": "no CUDA device", "h2d_pinned_samples_s": {},
                                     "h2d_pageable_samples_s": {}, "d2d_samples_s": {}, "uva_read_samples_s": {}})
    lines = profile.render().splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("  for planning   "))
    command = lines[at].removeprefix("  for planning   ")
    bin_dir, records = stand_ins(tmp_path)
    run_in_bash(command + "\n", bin_dir, tmp_path)
    argv, _ = recorded(records, "selective-offload")
    args = build_parser().parse_args(argv)
    assert (args.command, args.model, args.cpu_threads) == ("plan", "MODEL", 8)
    if gpu:
        assert (args.link_gbps, args.vram_gbps) == ("52.3", "3900")
    remarks = [line.strip() for line in lines[at + 1:] if line.startswith(" " * 17)]
    assert remarks[0].startswith("(--cpu-gbps: the CPU kernels' rate above")
    assert any(r.startswith("no GPU, so no link or VRAM") for r in remarks) == (not gpu)
