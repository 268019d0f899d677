"""The native device-share prototype (benchmarks/share_kernel.py) against the reference, under
Triton's interpreter in a process of its own (Triton decides interpretation when it is
imported, for the whole process; this one imports vLLM).

The cases cover what the kernel must get right to be measured on a GPU at all: MXFP4's codes
and scales with gpt-oss's biases and clamped, interleaved swiglu; bf16 with silu; picks
outside the share (host experts and -1) contributing nothing; sizes that leave partial
blocks of rows and columns; several tokens sharing an expert.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from helpers import REPO

#: Run under the interpreter: one JSON line per case, the kernel's largest difference from
#: the reference over the share's picks, relative to the reference's largest magnitude.
CASES = r"""
import json, sys
from dataclasses import replace
import torch
sys.path.insert(0, "benchmarks")
import share_kernel
from host_compute_layers import Shape, activation, make_weights
from selective_offload.cpu_kernels import reference

def case(name, shape, share, tokens, block_rows, block_k, limit=7.0, x_scale=1.0):
    w = make_weights(shape, seed=3)
    act = replace(activation(shape), limit=limit) if shape.activation == "swigluoai" else activation(shape)
    gen = torch.Generator().manual_seed(tokens)
    x = (torch.randn(tokens, shape.hidden, generator=gen) * x_scale).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(shape.experts, generator=gen)[:shape.k] for _ in range(tokens)]).to(torch.int32)
    ids[:, 0] = torch.arange(tokens) % share          # every token picks inside the share
    ids[0, -1] = -1                                   # and one slot picks nothing
    tw = torch.softmax(torch.randn(tokens, shape.k, generator=gen), -1)
    held = share_kernel.native_share(w, share, "cpu")
    got = share_kernel.moe_native(x, ids, tw, held, act, block_rows=block_rows, block_k=block_k)
    inside = torch.arange(shape.experts) < share
    want = reference.moe_reference(x, ids, tw, w, act, host_mask=inside)
    outside = reference.moe_reference(x, ids, tw, w, act, host_mask=~inside)
    scale = float(want.abs().max())
    unclamped = reference.moe_reference(x, ids, tw, w, replace(act, limit=None), host_mask=inside)
    print(json.dumps({"case": name, "err": float((got - want).abs().max()) / scale, "ref": scale,
                      "outside_ref": float(outside.abs().max()),
                      "clamped": float((unclamped - want).abs().max()) / scale, "held": held.nbytes, "stored": w.expert_bytes * share}))

case("mxfp4-one-token", Shape("oss", "mxfp4", 8, 4, 96, 64, "swigluoai", True), 3, 1, 16, 64)
case("mxfp4-tokens", Shape("oss", "mxfp4", 8, 2, 64, 96, "swigluoai", True), 5, 5, 64, 32)
case("mxfp4-clamped", Shape("oss", "mxfp4", 8, 2, 64, 64, "swigluoai", True), 4, 2, 32, 64, 7.0, 40.0)
case("mxfp4-unclamped", Shape("oss", "mxfp4", 6, 3, 64, 64, "swigluoai", True), 2, 3, 32, 64, None)
case("bf16-one-token", Shape("qwen", "bf16", 16, 4, 80, 48, "silu", False), 6, 1, 32, 64)
case("bf16-tokens", Shape("qwen", "bf16", 16, 4, 64, 32, "silu", False), 4, 6, 16, 32)
"""

#: float32 sums in another order than the reference's.
TOL = 1e-5


@pytest.fixture(scope="module")
def results():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", CASES], capture_output=True, text=True, timeout=300, cwd=REPO,
                          env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return {r["case"]: r for r in map(json.loads, proc.stdout.splitlines())}


def test_the_share_kernel_computes_the_shares_picks_as_the_reference_does(results):
    assert set(results) == {"mxfp4-one-token", "mxfp4-tokens", "mxfp4-clamped", "mxfp4-unclamped", "bf16-one-token",
                            "bf16-tokens"}
    for name, r in results.items():
        assert r["ref"] > 0.01, name  # picks landed in the share
        assert r["err"] <= TOL, r
    # the large case's activations reach gpt-oss's limit, so the clamp is part of what matched
    assert results["mxfp4-clamped"]["clamped"] > 100 * TOL


def test_picks_outside_the_share_contribute_nothing_and_the_share_is_held_as_stored(results):
    for name, r in results.items():
        # the cases' host picks weigh something: the kernel matching the share's picks alone
        # (the test above) is what keeps them out
        assert r["outside_ref"] > 0.01, name
        assert r["held"] == r["stored"], name


def test_without_cuda_or_the_interpreter_the_kernel_refuses_in_one_line():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, 'benchmarks'); import share_kernel"],
                          capture_output=True, text=True, timeout=120, cwd=REPO, env=env)
    assert proc.returncode != 0
    assert "TRITON_INTERPRET=1" in proc.stderr.strip().splitlines()[-1]
