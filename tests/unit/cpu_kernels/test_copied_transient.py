"""The path above the crossover holds, while it dequantizes an expert, what the plan's ledger
prices for it (``estimate.host.dequantized_expert_bytes``, from the kernel's dims: a line of
``est transient``).

Measured, not recomputed: torch's profiler records every allocation and free the copied
path (``cpu_kernels.reference.moe_copied``, what the worker runs on the device above the
crossover) makes in a step of one token picking one expert; their running sum's highest
point is what the step held at once. The CPU build allocates what the device would: the
same operators, the same dtypes and shapes."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from selective_offload.cpu_kernels import Activation
from selective_offload.cpu_kernels.reference import moe_copied
from selective_offload.cpu_kernels.weights import random_experts
from selective_offload.estimate.host import copied_step_bytes, dequantized_expert_bytes

#: The kernel's dims of the experts measured: (H, I), as ``GroupPlan.kernel_dims`` says them.
H, I = 256, 512
#: How far the measured peak may be from the priced one: the one token's activations and a
#: group's scales are a few kB beside the expert's megabyte.
TOLERANCE = 0.02


def peak_bytes(run) -> int:
    """The most bytes ``run()`` held allocated at once (what it allocated before returning
    and freed counts while it was held)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    held = peak = 0
    for _, nbytes in sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                            if e.name() == "[memory]"):
        held += nbytes
        peak = max(peak, held)
    return peak


def copied_step(fmt: str):
    weights = random_experts(fmt, 2, H, I, seed=1)
    x = torch.randn(1, H)
    ids, picks = torch.tensor([[1]]), torch.ones(1, 1)
    moe_copied(x, ids, picks, weights, Activation("silu"))  # the lookup tables, made once per device
    return lambda: moe_copied(x, ids, picks, weights, Activation("silu"))


@pytest.mark.parametrize("fmt", ["int4", "mxfp4", "fp8-block"])
def test_dequantizing_an_expert_holds_what_the_ledger_prices_from_the_kernels_dims(fmt):
    priced = dequantized_expert_bytes((H, I), {}, 1)
    assert priced == 8 * H * I  # w13 [2I, H] and its working copy in bf16, or w13 and w2 with w2's
    measured = peak_bytes(copied_step(fmt))
    assert abs(measured - priced) <= TOLERANCE * priced, (fmt, measured, priced)


def test_bf16_experts_are_multiplied_as_copied_and_the_ledger_adds_nothing():
    """No copy of the expert is made (its 6 H I bytes in bf16): what the step holds is the
    token's activations and the CPU matmul's own scratch (about 140 kB here)."""
    measured = peak_bytes(copied_step("bf16"))
    assert copied_step_bytes(1000, 8, {"BF16": 1000}, "bf16", (H, I)) == 1000
    assert measured < 6 * H * I // 4, measured


def test_without_the_kernels_dims_the_stored_bytes_price_the_same_expert():
    """A plan whose config does not say the dims: one expert's parameters counted from its
    stored bytes (int4: 4 bits each, its bf16 scales a parameter each: est) give about the
    same figure."""
    params = 3 * H * I
    stored = {"U8": params // 2, "BF16": 2 * params // 32}  # the codes, a scale per group of 32
    from_bytes = dequantized_expert_bytes((), stored, 1)
    assert 8 * H * I <= from_bytes <= 1.1 * 8 * H * I, from_bytes


@pytest.mark.parametrize("tokens, hidden, inner, k", [(64, 256, 512, 1), (128, 256, 128, 1), (64, 512, 256, 2),
                                                     (256, 256, 256, 2)])
def test_a_steps_activations_on_the_copied_path_are_what_the_ledger_prices(tokens, hidden, inner, k):
    """Every token of a step picking the same k experts (k of E = k: n = T tokens each): what
    bf16 experts hold is the step's activations alone (nothing to dequantize), within 10% of
    ``copied_activation_bytes`` (its indices and routing weights are the rest)."""
    from selective_offload.estimate.host import copied_activation_bytes

    weights = random_experts("bf16", 4, hidden, inner, seed=1)
    x = torch.randn(tokens, hidden).bfloat16()
    ids = torch.zeros(tokens, k, dtype=torch.long)
    ids[:, 1:] = 1
    picks = torch.ones(tokens, k)
    moe_copied(x, ids, picks, weights, Activation("silu"))
    measured = peak_bytes(lambda: moe_copied(x, ids, picks, weights, Activation("silu")))
    priced = copied_activation_bytes(tokens, (hidden, inner), k, k)  # the k experts every token picks
    assert abs(measured - priced) <= 0.1 * measured, (measured, priced)
