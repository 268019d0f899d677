"""The reference's dequantisation against a straightforward one written here from the
formats' definitions (bit by bit, element by element), and its activations against the
formulas; the kernel is tested against the reference, so the reference is tested alone."""

from __future__ import annotations

import math

import torch
from makers import experts, routing

from selective_offload import cpu_kernels as ck
from selective_offload.cpu_kernels import reference


def e2m1(code: int) -> float:
    sign = -1.0 if code & 8 else 1.0
    exp, man = (code >> 1) & 3, code & 1
    return sign * (man * 0.5 if exp == 0 else 2.0 ** (exp - 1) * (1 + man / 2))


def test_mxfp4_is_low_nibble_first_with_e8m0_scales_per_32():
    w = experts("mxfp4", 2, 64, 32, seed=3)
    got = reference.dequantize(w, "w13")
    E, R, C = 2, 64, 64
    for e in range(E):
        for r in range(0, R, 7):
            for c in range(C):
                byte = int(w.w13[e, r, c // 2])
                code = byte & 0xF if c % 2 == 0 else byte >> 4
                want = e2m1(code) * 2.0 ** (int(w.w13_scale[e, r, c // 32]) - 127)
                assert got[e, r, c].item() == want, (e, r, c)
    assert reference.dequantize(w, "w2").shape == (2, 64, 32)


def test_int4_is_low_nibble_first_less_eight_times_its_group_scale():
    """GPTQ's uint4b8 in row-major bytes: element 2i is byte i's low nibble, its value the
    nibble less 8, times the scale of its group of 64 columns."""
    w = experts("int4", 2, 128, 64, seed=5, group=64, scale_dtype=torch.float16)
    got = reference.dequantize(w, "w13")
    for e in range(2):
        for r in range(0, 128, 9):
            for c in range(128):
                byte = int(w.w13[e, r, c // 2])
                code = byte & 0xF if c % 2 == 0 else byte >> 4
                assert got[e, r, c].item() == (code - 8) * float(w.w13_scale[e, r, c // 64]), (e, r, c)
    assert reference.dequantize(w, "w2").shape == (2, 128, 64)


def test_int4_zero_points_pair_rows_in_a_byte():
    """Zero points (AWQ's): row 2m's in a byte's low nibble, row 2m+1's in its high one, a
    byte per group; the value is the nibble less its group's zero point, times the scale."""
    w = experts("int4", 2, 64, 64, seed=6, group=32, zeros=True)
    got = reference.dequantize(w, "w13")
    for e in range(2):
        for r in range(0, 128, 5):
            for c in range(0, 64, 3):
                byte = int(w.w13[e, r, c // 2])
                code = byte & 0xF if c % 2 == 0 else byte >> 4
                zb = int(w.w13_zeros[e, r // 2, c // 32])
                zero = zb & 0xF if r % 2 == 0 else zb >> 4
                assert got[e, r, c].item() == (code - zero) * float(w.w13_scale[e, r, c // 32]), (e, r, c)


def test_fp8_block_scales_follow_vllms_block_rows_per_shard():
    """w13's gate and up halves each start a new block row (vLLM's scale is
    2 * ceil(I / block) rows): with I = 48 and blocks of 32, the up half's first row is
    in block row 2, not 1."""
    E, H, I, bn, bk = 2, 80, 48, 32, 32
    w = experts("fp8-block", E, H, I, block=(bn, bk), seed=4)
    got13, got2 = reference.dequantize(w, "w13"), reference.dequantize(w, "w2")
    plain13, plain2 = w.w13.float(), w.w2.float()  # torch's own float8_e4m3fn decoding
    per_shard = math.ceil(I / bn)
    for e in range(E):
        for r in range(2 * I):
            shard, within = divmod(r, I)
            for c in range(0, H, 5):
                want = plain13[e, r, c] * w.w13_scale[e, shard * per_shard + within // bn, c // bk]
                assert got13[e, r, c] == want
        for r in range(0, H, 3):
            for c in range(I):
                assert got2[e, r, c] == plain2[e, r, c] * w.w2_scale[e, r // bn, c // bk]


def test_bf16_is_its_float_value_and_a_subset_of_experts_is_those_experts():
    w = experts("bf16", 4, 32, 16)
    assert torch.equal(reference.dequantize(w, "w2"), w.w2.float())
    some = torch.tensor([3, 1])
    assert torch.equal(reference.dequantize(w, "w13", some), w.w13.float()[[3, 1]])


def test_activations_are_the_formulas():
    h = torch.randn(3, 8) * 10
    g, u = h[:, :4], h[:, 4:]
    assert torch.allclose(reference.activate(h, ck.Activation("silu")), g * torch.sigmoid(g) * u)
    g, u = h[:, 0::2].clamp(max=7.0), h[:, 1::2].clamp(-7.0, 7.0)
    want = (u + 1) * g * torch.sigmoid(1.702 * g)
    assert torch.allclose(reference.activate(h, ck.Activation("swigluoai")), want)


def test_the_reference_is_the_sum_over_picks_written_out():
    w = experts("bf16", 4, 32, 16, bias="f32")
    ids, tw = routing(3, 2, 4, 7)
    x = torch.randn(3, 32)
    act = ck.Activation("silu")
    got = reference.moe_reference(x, ids, tw, w, act)
    for t in range(3):
        want = torch.zeros(32)
        for j in range(2):
            e = int(ids[t, j])
            if e < 0:
                continue
            h = w.w13[e].float() @ x[t] + w.w13_bias[e]
            y = w.w2[e].float() @ (torch.nn.functional.silu(h[:16]) * h[16:]) + w.w2_bias[e]
            want += tw[t, j] * y
        assert torch.allclose(got[t], want, atol=1e-5)


def test_int8_blocks_scale_by_127_over_the_largest_rounded_once_as_the_kernel_does():
    """Each block of 32 is scaled by 127 / its largest magnitude, that quotient rounded once
    to float32 as the kernel's ``127.0f / amax`` is (not torch's scalar / tensor, the
    reciprocal times 127, rounded twice), then rounded to the nearest integer: over many
    bf16 blocks some products land a last bit from a half step, where the two ways differ
    and the oracle would disagree with the kernel by a whole int8 step."""
    g = torch.Generator().manual_seed(3)
    v = (torch.randn(4096, 32, generator=g) * 60).bfloat16().float()
    amax = v.abs().amax(-1, keepdim=True)
    inv = (127.0 / amax.double()).float()  # a correctly rounded float32 quotient
    want = torch.round(v * inv) * (amax / 127.0)
    assert torch.equal(reference.int8_blocks(v.flatten()).view(4096, 32), want)
