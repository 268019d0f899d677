"""A dense MLP split by intermediate channels (cpu_kernels.channels): the host's part and the
device's share, rearranged in the MLP's own storage, add up to the whole MLP, for every
format a dense MLP is computed in; the host part on the compiled kernel, the share on the
torch path the device runs."""

from __future__ import annotations

import pytest
import torch

from selective_offload import cpu_kernels
from selective_offload.cpu_kernels import Activation
from selective_offload.cpu_kernels.channels import split_channels
from selective_offload.cpu_kernels.reference import held_share, moe_picked, moe_reference
from selective_offload.cpu_kernels.weights import ExpertWeights, random_experts

H, I = 256, 512


def one_token_each(tokens: int):
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, H, generator=g).to(torch.bfloat16)
    return x, torch.zeros(tokens, 1, dtype=torch.int32), torch.ones(tokens, 1)


def with_zeros(w: ExpertWeights) -> ExpertWeights:
    """The int4 MLP with AWQ-style zero points (a byte per group for each pair of rows)."""
    g = torch.Generator().manual_seed(5)
    zeros = {n: torch.randint(0, 256, (1, getattr(w, n[:-6]).shape[1] // 2, getattr(w, n[:-6] + "_scale").shape[2]),
                              generator=g, dtype=torch.uint8) for n in ("w13_zeros", "w2_zeros")}
    return ExpertWeights("int4", w.w13, w.w2, w13_scale=w.w13_scale, w2_scale=w.w2_scale, **zeros)


CASES = {"bf16": lambda: random_experts("bf16", 1, H, I), "fp8-block": lambda: random_experts("fp8-block", 1, H, I),
         "int4": lambda: random_experts("int4", 1, H, I), "int4-zeros": lambda: with_zeros(random_experts("int4", 1, H, I))}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("n", [128, 384])
def test_the_host_part_and_the_share_add_up_to_the_mlp(case, n):
    weights = CASES[case]()
    act = Activation("silu")
    x, ids, w = one_token_each(3)
    whole = moe_reference(x, ids, w, weights, act)
    storage = weights.w13.untyped_storage().data_ptr()
    host, share = split_channels(weights, n)
    assert host.intermediate == I - n and share.intermediate == n and host.fmt == share.fmt == weights.fmt
    # the same storage, the host's part first (what the page-locked arena and the kernel read)
    assert host.w13.data_ptr() == storage == host.w13.untyped_storage().data_ptr()
    assert share.w13.data_ptr() == storage + host.w13.numel() * host.w13.element_size()
    got = moe_reference(x, ids, w, host, act) + moe_picked(x, ids, w, held_share(share, 1, "cpu"), act)
    # the share is held and multiplied in bf16 (the host part here in float32): bf16's rounding
    torch.testing.assert_close(got, whole, rtol=2e-2, atol=2e-2 * float(whole.abs().max()))


@pytest.mark.parametrize("case", ["bf16", "fp8-block", "int4"])
def test_the_host_part_on_the_compiled_kernel(case):
    try:
        cpu_kernels.library()
    except cpu_kernels.KernelUnavailable as exc:
        pytest.skip(f"the CPU kernel cannot be built here: {exc}")
    weights = CASES[case]()
    act = Activation("silu")
    x, ids, w = one_token_each(2)
    whole = moe_reference(x, ids, w, weights, act)
    host, share = split_channels(weights, 128)
    got = cpu_kernels.moe(x, ids, w, host, act, threads=1) + moe_picked(x, ids, w, held_share(share, 1, "cpu"), act)
    scale = float(whole.abs().max())
    assert float((got - whole).abs().max()) <= 2e-2 * scale  # the kernel rounds to bf16 / int8 on the way


def test_a_cut_inside_a_block_or_a_bias_is_refused():
    with pytest.raises(ValueError, match="cannot be cut after channel 64"):
        split_channels(random_experts("fp8-block", 1, H, I), 64)
    with pytest.raises(ValueError, match="0 < n < 512"):
        split_channels(random_experts("bf16", 1, H, I), I)
    w = random_experts("bf16", 1, H, I)
    biased = ExpertWeights("bf16", w.w13, w.w2, w13_bias=torch.zeros(1, 2 * I, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="biases"):
        split_channels(biased, 128)
