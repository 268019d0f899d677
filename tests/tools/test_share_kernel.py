"""The native device share's kernel (selective_offload/wrappers/share_kernel.py) against the reference, under
Triton's interpreter in a process of its own (Triton decides interpretation when it is
imported, for the whole process; this one imports vLLM).

The cases cover what the kernel must get right to be measured on a GPU at all: MXFP4's codes
and scales with gpt-oss's biases and clamped, interleaved swiglu; bf16 with silu; picks
outside the share (host experts and -1) contributing nothing; GELU(tanh)-gated experts
(Gemma 4) in both formats; sizes that leave partial
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
from selective_offload.wrappers import share_kernel
from benchmarks.host_compute.layers import Shape, activation, make_weights
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
case("mxfp4-repeated", Shape("oss", "mxfp4", 8, 4, 64, 64, "swigluoai", True), 2, 12, 32, 64)
case("mxfp4-clamped", Shape("oss", "mxfp4", 8, 2, 64, 64, "swigluoai", True), 4, 2, 32, 64, 7.0, 40.0)
case("mxfp4-unclamped", Shape("oss", "mxfp4", 6, 3, 64, 64, "swigluoai", True), 2, 3, 32, 64, None)
case("bf16-one-token", Shape("qwen", "bf16", 16, 4, 80, 48, "silu", False), 6, 1, 32, 64)
case("bf16-tokens", Shape("qwen", "bf16", 16, 4, 64, 32, "silu", False), 4, 6, 16, 32)
case("mxfp4-gelu-tanh", Shape("gemma", "mxfp4", 8, 2, 64, 64, "gelu_tanh", False), 4, 3, 32, 64)
case("bf16-gelu-tanh", Shape("gemma", "bf16", 16, 4, 64, 48, "gelu_tanh", False), 5, 4, 16, 32)
"""

#: HostExperts with an MXFP4 share held as stored, once through the CPU stand-in and once
#: through the share kernel (``share_kernel`` set, as a CUDA share sets it; the kernel under
#: the interpreter): both against the reference, and the kernel counted as called. Run
#: after :data:`CASES`, in the same interpreter.
THROUGH_THE_LAYER = r"""
from selective_offload.wrappers.host_compute import HostExperts

calls = []
kernel = share_kernel.moe_native
share_kernel.moe_native = lambda *a, **k: calls.append(1) or kernel(*a, **k)
shape = Shape("oss", "mxfp4", 8, 4, 64, 64, "swigluoai", True)
w, act = make_weights(shape, seed=3), activation(shape)
gen = torch.Generator().manual_seed(4)
x = torch.randn(3, 64, generator=gen).to(torch.bfloat16)
ids = torch.stack([torch.randperm(8, generator=gen)[:4] for _ in range(3)]).to(torch.int32)
tw = torch.softmax(torch.randn(3, 4, generator=gen), -1)
want = reference.moe_reference(x, ids, tw, w, act)
layer = HostExperts("g", w, act, crossover_tokens=8, threads=1, device=torch.device("cpu"),
                    device_share=reference.held_share(w, 3, "cpu", native=True))
assert not layer.share_kernel
stand_in = layer(x, ids, tw).float()
layer.share_kernel = True
through_kernel = layer(x, ids, tw).float()
scale = float(want.abs().max())
picks = int(((ids >= 0) & (ids < 3)).sum())
print(json.dumps({"case": "through-the-layer", "calls": len(calls), "picks": picks,
                  "stand_in": float((stand_in - want).abs().max()) / scale, "kernel": float((through_kernel - want).abs().max()) / scale,
                  "apart": float((through_kernel - stand_in).abs().max()) / scale}))
"""

#: float32 sums in another order than the reference's.
TOL = 1e-5


@pytest.fixture(scope="module")
def interpreted():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", CASES + THROUGH_THE_LAYER], capture_output=True, text=True,
                          timeout=300, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return {r["case"]: r for r in map(json.loads, proc.stdout.splitlines())}


@pytest.fixture
def results(interpreted):
    return {name: r for name, r in interpreted.items() if name != "through-the-layer"}


def test_the_share_kernel_computes_the_shares_picks_as_the_reference_does(results):
    assert set(results) == {"mxfp4-one-token", "mxfp4-tokens", "mxfp4-repeated", "mxfp4-clamped", "mxfp4-unclamped", "bf16-one-token",
                            "bf16-tokens", "mxfp4-gelu-tanh", "bf16-gelu-tanh"}
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


#: Without the interpreter: a share on the CPU is refused in one line, before any launch.
REFUSED = r"""
import sys
import torch
from selective_offload.wrappers import share_kernel
from benchmarks.host_compute.layers import Shape, activation, make_weights
shape = Shape("oss", "mxfp4", 8, 2, 64, 64, "swigluoai", True)
held = share_kernel.native_share(make_weights(shape, seed=3), 4, "cpu")
share_kernel.moe_native(torch.zeros(1, 64, dtype=torch.bfloat16), torch.zeros(1, 2, dtype=torch.int32),
                        torch.ones(1, 2), held, activation(shape))
"""


def test_without_cuda_or_the_interpreter_the_kernel_refuses_in_one_line():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.run([sys.executable, "-c", REFUSED], capture_output=True, text=True, timeout=120, cwd=REPO,
                          env=env)
    assert proc.returncode != 0
    assert "TRITON_INTERPRET=1" in proc.stderr.strip().splitlines()[-1], proc.stderr[-2000:]


#: Compiled ahead for NVIDIA targets with Triton's own compiler and ptxas (no GPU needed):
#: one JSON line per (target, format), the cubin's size and the PTX's target line.
COMPILED = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from selective_offload.wrappers import share_kernel as sk
for cc in (89, 90):
    for mxfp4 in (True, False):
        w = "*u8" if mxfp4 else "*bf16"
        up = {"x_ptr": "*fp32", "ids_ptr": "*i32", "w_ptr": w, "s_ptr": w, "b_ptr": "*bf16", "act_ptr": "*fp32",
              "H": "i32", "I": "i32", "SLOTS": "i32", "K": "i32", "alpha": "fp32", "limit": "fp32"}
        down = {"act_ptr": "*fp32", "ids_ptr": "*i32", "tw_ptr": "*fp32", "w_ptr": w, "s_ptr": w, "b_ptr": "*bf16",
                "y_ptr": "*fp32", "H": "i32", "I": "i32", "SLOTS": "i32"}
        flags = {"MXFP4": mxfp4, "BIAS": mxfp4, "BLOCK_R": 32, "BLOCK_K": 256}
        for fn, sig, consts in ((sk._up, up, {**flags, "SWIGLU": mxfp4, "GELU": not mxfp4, "CLAMP": mxfp4}), (sk._down, down, flags)):
            sig = {**sig, **{name: "constexpr" for name in consts}}
            k = triton.compile(triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts),
                               target=GPUTarget("cuda", cc, 32))
            target = next(line for line in k.asm["ptx"].splitlines() if line.startswith(".target"))
            print(json.dumps({"cc": cc, "mxfp4": mxfp4, "fn": fn.__name__, "cubin": len(k.asm["cubin"]),
                              "target": target}))
"""


def test_the_kernels_compile_for_the_gpus_a_plan_names():
    """The proxy for "it builds on the card" that a CPU can give: Triton's NVIDIA backend
    lowers both kernels, both formats, to cubins for sm_89 and sm_90."""
    from triton.backends.nvidia import compiler as nvidia

    try:
        for cc in (89, 90):
            nvidia.get_ptxas(cc)
    except Exception as exc:  # the wheel ships ptxas; a build without it cannot compile ahead
        pytest.skip(f"Triton's NVIDIA backend has no ptxas here: {exc}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(REPO), TRITON_DEFAULT_FP_FUSION="1")
    proc = subprocess.run([sys.executable, "-c", COMPILED], capture_output=True, text=True, timeout=300, cwd=REPO,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert {(r["cc"], r["mxfp4"], r["fn"]) for r in rows} == {
        (cc, m, fn) for cc in (89, 90) for m in (True, False) for fn in ("_up", "_down")}
    for r in rows:
        assert r["cubin"] > 0 and f"sm_{r['cc']}" in r["target"], r


def test_the_layer_hands_its_share_to_the_kernel_as_the_kernel_expects(interpreted):
    r = interpreted["through-the-layer"]
    assert r["calls"] == 1 and r["picks"] > 0, r  # the stand-in called no kernel; the kernel path called it once
    # the host part is the int8 CPU kernel's either way (test_vllm_mxfp4's tolerance); the
    # share's two paths part only by float32 sums in another order, before bf16's rounding
    assert r["stand_in"] <= 0.05 and r["kernel"] <= 0.05, r
    assert r["apart"] <= 0.01, r
