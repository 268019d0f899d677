"""The compiled host-compute kernel against the pure-torch reference, every format.

Tolerance: where the kernel keeps everything in float32 (plain C, and bf16 and block FP8
on the builds without AVX512-BF16) it agrees with the float32 reference to float32
rounding over a dot product: rtol 1e-4 and atol 1e-4 of the output's largest magnitude
(observed: near 1e-7). The AVX512-BF16 build holds the tokens and the activation between
the two projections in bf16 (as vLLM's device kernels do), which costs bf16's rounding
(2^-9 relative) once per element: rtol 1e-2 and atol 1e-2 of the largest magnitude
(observed: near 2e-3). Every SIMD build multiplies MXFP4 and int4 weights with int8 tokens
and activations (per block of 32, as llama.cpp does for these weights; on 512 bits with
AVX512-VNNI, else on 256): there the oracle is the reference with its vectors rounded the same way
(``int8_vectors``), and the same tolerance covers a value that rounds to the other side of
a step (observed: 1e-7 where none does, under 8e-3 where one does); what int8 costs
against the float reference is its own test. A wrong layout or a lost pick moves outputs
by their own size. Every build this CPU can run is checked; the shapes cover each path's
whole chunks and its tails.
"""

from __future__ import annotations

import pytest
import torch
from makers import experts, routing

from selective_offload import cpu_kernels as ck
from selective_offload.cpu_kernels import build, reference

# (H, I): bf16 304 = 2*128 + 32 + 16 and 176 = 128 + 32 + 16 (176 also leaves the up
# projection's last work item part of JB rows); mxfp4 224 = 128 + 64 + 32; fp8 208 = 3*64 +
# 16; int4 (groups of 32) 224 and 160 = 128 + 32.
SHAPES = {"bf16": (304, 176), "mxfp4": (224, 192), "fp8-block": (208, 96), "int4": (224, 160)}
BLOCK = (64, 64)  # fp8: I = 96 is not a multiple of 64, so w13's up half starts a new block row


def close(got, want, lib=None, fmt=None):
    lib = lib or ck.library()
    int8 = fmt in ("mxfp4", "int4") and bool(lib.so_int8_mxfp4())
    tol = 1e-2 if lib.so_bf16_activations() or int8 else 1e-4
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * float(want.abs().max().clamp(min=1e-6)))


def oracle(x, ids, tw, w, act, lib=None, **kw):
    """The reference, with the vectors rounded as this build's kernel rounds them."""
    int8 = w.fmt in ("mxfp4", "int4") and bool((lib or ck.library()).so_int8_mxfp4())
    return reference.moe_reference(x, ids, tw, w, act, int8_vectors=int8, **kw)


def make(fmt, E=6, bias=None, seed=0):
    H, I = SHAPES[fmt]
    return experts(fmt, E, H, I, bias=bias, seed=seed, block=BLOCK)


def cpu_has(flag: str) -> bool:
    return any(flag in line.split() for line in open("/proc/cpuinfo") if line.startswith("flags"))


#: Each build a CPU can get, compiled here by turning features off: AVX-512 without BF16
#: (bf16 and block FP8 in float32, MXFP4 and int4 on the 512-bit int8 path: Ice Lake,
#: Cascade Lake), AVX-512 without VNNI as well (the 256-bit int8 path in an AVX-512 build:
#: Skylake-X), AVX2 (the 256-bit int8 path: Haswell to Zen 3), AVX2 with AVX-VNNI (Alder Lake),
#: plain C. A build "without VNNI" turns AVX-VNNI off too: compilers give -march=native both.
VARIANTS = {"native": (), "avx512-f32": ("-mno-avx512bf16",),
            "avx512-no-vnni": ("-mno-avx512bf16", "-mno-avx512vnni", "-mno-avxvnni"),
            "avx2": ("-mno-avx512f", "-mno-avxvnni"), "avx2-vnni": ("-mno-avx512f", "-mavxvnni"), "plain-c": ("-DSO_NO_SIMD",)}


@pytest.fixture(scope="module", params=list(VARIANTS))
def lib(request):
    if request.param == "avx2" and not cpu_has("avx2"):
        pytest.skip("this CPU has no AVX2")
    if request.param == "avx2-vnni" and not cpu_has("avx_vnni"):
        pytest.skip("this CPU has no AVX-VNNI")
    if request.param == "avx512-f32" and not (cpu_has("avx512f") and cpu_has("avx512_bf16")):
        pytest.skip("this CPU has no AVX512-BF16, so the native build is already the float32 AVX-512 one")
    if request.param == "avx512-no-vnni" and not (cpu_has("avx512f") and cpu_has("avx512_vnni")):
        pytest.skip("this CPU has no AVX512-VNNI, so the native build is already the one without it")
    lib = build.load(VARIANTS[request.param], quiet=True)
    if request.param == "plain-c":
        assert lib.so_simd_level() == 0 and not lib.so_int8_mxfp4()
    if request.param in ("avx2", "avx2-vnni"):
        assert lib.so_simd_level() == 256 and lib.so_int8_mxfp4() == 256
    if request.param in ("avx512-f32", "avx512-no-vnni"):
        width = 512 if request.param == "avx512-f32" else 256
        assert lib.so_simd_level() == 512 and not lib.so_bf16_activations() and lib.so_int8_mxfp4() == width
    return lib


@pytest.mark.parametrize("fmt", ["bf16", "mxfp4", "fp8-block", "int4"])
@pytest.mark.parametrize("kind", ck.weights.KINDS)
def test_every_format_matches_the_reference(lib, fmt, kind):
    act = ck.Activation(kind)
    for bias in (None, "bf16", "f32"):
        w = make(fmt, bias=bias)
        H = w.hidden
        for T, K, seed in ((1, 1, 0), (1, 4, 1), (3, 2, 2), (9, 3, 3)):
            ids, tw = routing(T, K, w.num_experts, seed)
            for x in (torch.randn(T, H).bfloat16(), torch.randn(T, H)):
                want = oracle(x, ids, tw, w, act, lib)
                got = ck.moe(x, ids, tw, w, act, threads=2, library_=lib)
                close(got, want, lib, fmt)
                assert want.abs().max() > 0


@pytest.mark.parametrize("zeros", [False, True], ids=["symmetric", "zero-points"])
@pytest.mark.parametrize("group, H, I, scale_dtype", [(64, 192, 320, torch.float16), (128, 384, 256, torch.bfloat16),
                                                     (128, 256, 640, torch.float16), (32, 96, 32, torch.float16)])
def test_int4_groups_and_scale_dtypes_match_the_reference(lib, group, H, I, scale_dtype, zeros):
    """int4 with each group size the kernel reads differently (32 and 64: a scale per
    block of 32; 128: one per chunk of 128), both scale dtypes, symmetric groups and zero
    points (AWQ's), rows ending in whole and part chunks."""
    w = experts("int4", 5, H, I, seed=group + H, group=group, scale_dtype=scale_dtype, zeros=zeros)
    assert w.block == (group, group)
    act = ck.Activation("silu")
    for T, K in ((1, 2), (6, 3)):
        ids, tw = routing(T, K, w.num_experts, T + H)
        x = torch.randn(T, H).bfloat16()
        want = oracle(x, ids, tw, w, act, lib)
        close(ck.moe(x, ids, tw, w, act, threads=2, library_=lib), want, lib, "int4")
        assert want.abs().max() > 0


def cpu_vendor() -> str:
    return next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("vendor_id")), "")


def test_bf16_rows_prefetch_by_vendor_and_compute_alike_either_way():
    """The AVX512-BF16 build's bf16 row walk prefetches in software on Intel and not on AMD
    (chosen when the library loads; moe.c says why): the choice is the vendor's, and the
    two copies of the walk compute the same sums."""
    lib = ck.library()
    if not lib.so_bf16_activations():
        assert lib.so_bf16_prefetch() == 0  # no such walk on this build
        pytest.skip("this CPU has no AVX512-BF16: its build has one bf16 walk, in float32")
    assert lib.so_bf16_prefetch() == (cpu_vendor() != "AuthenticAMD")
    chosen = lib.so_bf16_prefetch()
    w, act = make("bf16", bias="f32"), ck.Activation("silu")
    ids, tw = routing(5, 3, w.num_experts, 7)
    x = torch.randn(5, w.hidden).bfloat16()
    outs = []
    try:
        for on in (1, 0):
            lib.so_set_bf16_prefetch(on)
            assert lib.so_bf16_prefetch() == on
            outs.append(ck.moe(x, ids, tw, w, act, threads=2, library_=lib))
    finally:
        lib.so_set_bf16_prefetch(chosen)
    assert torch.equal(outs[0], outs[1])
    close(outs[0], oracle(x, ids, tw, w, act, lib), lib)


def int8_build(lib):
    """``lib`` where it has the int8 path (every SIMD build: 512 or 256 bits)."""
    if not lib.so_int8_mxfp4():
        pytest.skip("this build (plain C) has no int8 MXFP4 path")
    return lib


@pytest.mark.parametrize("H, I", [(256, 160), (160, 192), (192, 224), (224, 128), (608, 544), (1088, 512)])
def test_the_int8_mxfp4_path_reads_every_tail_of_a_row(lib, H, I):
    """A row's last chunk of 128 holds 0-3 whole blocks of 32 (gpt-oss's 2880 ends in two):
    each count, in the tokens' rows (H) and the activation's (I), for one token and for a
    batch that fills the four-token step and leaves one over; and rows of four chunks and
    more, whose chunks the kernel sums in four independent sums before the tail."""
    lib = int8_build(lib)
    w = experts("mxfp4", 5, H, I, bias="f32", seed=H + I)
    act = ck.Activation("swigluoai")
    for T, K in ((1, 2), (5, 1)):
        ids, tw = routing(T, K, w.num_experts, T, negative=False)
        x = torch.randn(T, H).bfloat16()
        want = oracle(x, ids, tw, w, act, lib)
        close(ck.moe(x, ids, tw, w, act, library_=lib), want, lib, "mxfp4")
        assert want.abs().max() > 0


def test_the_int8_mxfp4_path_reads_no_scale_past_a_row(lib):
    """The last expert's last rows end in a part chunk, with their scale tensors followed
    by 0xFF bytes in memory (e8m0's NaN code): a four-byte scale load there that were not
    masked would multiply the absent blocks' zeros by infinity."""
    lib = int8_build(lib)
    H, I, E = 224, 160, 3  # w13 rows end in three blocks of their last chunk, w2 rows in one
    w = experts("mxfp4", E, H, I, seed=3)

    def followed_by_ff(t):
        room = torch.full((t.numel() + 64,), 0xFF, dtype=torch.uint8)
        room[: t.numel()] = t.reshape(-1)
        return room[: t.numel()].view(t.shape)

    guarded = ck.ExpertWeights("mxfp4", w.w13, w.w2, followed_by_ff(w.w13_scale), followed_by_ff(w.w2_scale))
    x = torch.randn(2, H).bfloat16()
    ids, tw = torch.tensor([[E - 1], [E - 1]], dtype=torch.int32), torch.ones(2, 1)
    act = ck.Activation("silu")
    got = ck.moe(x, ids, tw, guarded, act, library_=lib)
    assert torch.isfinite(got).all()
    close(got, oracle(x, ids, tw, w, act, lib), lib, "mxfp4")


def _misplaced_scales(w):
    """``w`` with its w13 scales (and int4's w2 scales) moved one group along."""
    roll = {"w13_scale": w.w13_scale.roll(1, -1)}
    if w.fmt == "int4":
        roll["w2_scale"] = w.w2_scale.roll(1, -1)
    return ck.ExpertWeights(w.fmt, **{**w.tensors(), **roll})


@pytest.mark.parametrize("fmt", ["mxfp4", "int4"])
def test_int8_vectors_cost_little_against_the_float_reference(lib, fmt):
    """What int8 tokens and activations cost: within 5e-2 of the largest output of the
    float32 reference (observed for MXFP4: up to 3e-2 on these random experts, whose codes
    are uniform over e2m1's range; int4 here in groups of 128), and nearer to it than to the
    same experts with their scales moved one group along."""
    lib = int8_build(lib)
    if fmt == "mxfp4":
        w, act, (T, K) = make("mxfp4", bias="bf16"), ck.Activation("swigluoai"), (4, 3)
    else:
        w, act, (T, K) = experts("int4", 4, 256, 384, seed=11, group=128), ck.Activation("silu"), (3, 2)
    ids, tw = routing(T, K, w.num_experts, 7)
    x = torch.randn(T, w.hidden).bfloat16()
    got = ck.moe(x, ids, tw, w, act, library_=lib)
    want = reference.moe_reference(x, ids, tw, w, act)
    peak = float(want.abs().max())
    assert float((got - want).abs().max()) <= 5e-2 * peak
    assert float((got - reference.moe_reference(x, ids, tw, _misplaced_scales(w), act)).abs().max()) > 5e-2 * peak


@pytest.mark.parametrize("fmt", ["bf16", "mxfp4", "fp8-block", "int4"])
def test_host_mask_and_negative_ids_leave_those_picks_to_the_device(fmt):
    w = make(fmt, bias="bf16")
    ids, tw = routing(6, 3, w.num_experts, 4)
    x = torch.randn(6, w.hidden).bfloat16()
    act = ck.Activation("silu")
    mask = torch.tensor([True, False, True, True, False, True])
    got = ck.moe(x, ids, tw, w, act, host_mask=mask, threads=1)
    close(got, oracle(x, ids, tw, w, act, host_mask=mask))
    # The masked-off picks are exactly what is missing: host part + device part = all.
    device_ids = torch.where(mask[ids.clamp(min=0)] | (ids < 0), torch.full_like(ids, -1), ids)
    rest = ck.moe(x, device_ids, tw, w, act, threads=1)
    close(got + rest, ck.moe(x, ids, tw, w, act, threads=1))
    # A token whose picks are all elsewhere gets zeros.
    none = ck.moe(x, torch.full_like(ids, -1), tw, w, act)
    assert torch.equal(none, torch.zeros_like(none))


def test_each_pick_is_weighted_and_summed():
    """Two picks of the same token: the output is the weighted sum of the two experts'
    outputs, each computed alone with weight 1."""
    w = make("bf16", bias="f32")
    x = torch.randn(1, w.hidden).bfloat16()
    act = ck.Activation("silu")
    one = [ck.moe(x, torch.tensor([[e]], dtype=torch.int32), torch.ones(1, 1), w, act) for e in (2, 5)]
    both = ck.moe(x, torch.tensor([[2, 5]], dtype=torch.int32), torch.tensor([[0.25, 0.75]]), w, act)
    close(both, 0.25 * one[0] + 0.75 * one[1])
    assert not torch.allclose(one[0], one[1])


@pytest.mark.parametrize("fmt", ["bf16", "mxfp4", "fp8-block"])
def test_swigluoai_clamps_gate_and_up_at_the_limit(fmt):
    """Inputs large enough that most gate and up values pass the limit of 7: the kernel
    follows the clamped reference, and the unclamped one is far from it."""
    w = make(fmt)
    # bf16 tokens (as vLLM passes them): with up-projection outputs in the thousands, a
    # token rounded to bf16 by the kernel would move them by more than the clamp window.
    # Seeded: an up output in the thousands moves across the clamp window with one int8
    # step of one token element, so the oracle must round as the kernel rounds (it does:
    # test_reference's int8_blocks test), and the outcome must not hang on the tests before.
    x = (torch.randn(2, w.hidden, generator=torch.Generator().manual_seed(7)) * 60).bfloat16()
    ids, tw = routing(2, 2, w.num_experts, 5, negative=False)
    act = ck.Activation("swigluoai", alpha=1.702, limit=7.0)
    got = ck.moe(x, ids, tw, w, act)
    close(got, oracle(x, ids, tw, w, act))
    unclamped = oracle(x, ids, tw, w, ck.Activation("swigluoai", limit=None))
    assert (got - unclamped).abs().max() > 0.1 * unclamped.abs().max()
    close(ck.moe(x, ids, tw, w, ck.Activation("swigluoai", limit=None)), unclamped)


def test_an_id_past_the_experts_is_one_line():
    w = make("bf16")
    x = torch.randn(1, w.hidden)
    with pytest.raises(ValueError, match="expert id >= the number of experts"):
        ck.moe(x, torch.tensor([[w.num_experts]]), torch.ones(1, 1), w, ck.Activation("silu"))


def test_a_job_reruns_on_new_inputs_written_in_place():
    """What a CUDA graph does: the same job (its struct, its tensors) run again after new
    tokens and picks are copied into its inputs; function_pointer and address are what
    cudaLaunchHostFunc takes, and calling the pointer with the address runs the job."""
    import ctypes

    w = make("mxfp4", bias="bf16")
    act = ck.Activation("swigluoai")
    x = torch.zeros(2, w.hidden)
    ids = torch.zeros(2, 2, dtype=torch.int64)
    tw = torch.zeros(2, 2)
    out = torch.empty(2, w.hidden)
    job = ck.MoEJob(x, ids, tw, w, act, out=out, threads=2)
    assert job.address == ctypes.addressof(job.job) and job.function_pointer
    host_fn = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(job.function_pointer)
    for seed in (0, 1):
        new_ids, new_tw = routing(2, 2, w.num_experts, seed)
        x.copy_(torch.randn(2, w.hidden))
        ids.copy_(new_ids)
        tw.copy_(new_tw)
        host_fn(job.address)
        assert job.status == 0
        close(out, oracle(x, ids, tw, w, act))
        out.zero_()
        assert job.run() is out
        close(out, oracle(x, ids, tw, w, act))


def test_bad_arguments_are_one_line():
    w = make("bf16")
    act = ck.Activation("silu")
    x, ids, tw = torch.randn(1, w.hidden), torch.zeros(1, 2, dtype=torch.int32), torch.ones(1, 2)
    cases = [
        (dict(x=torch.randn(1, w.hidden + 1)), "x is"),
        (dict(ids=ids.float()), "topk_ids is"),
        (dict(tw=torch.ones(1, 3)), "topk_weights is"),
        (dict(out=torch.empty(1, w.hidden, dtype=torch.bfloat16)), "out is"),
        (dict(mask=torch.ones(w.num_experts + 1, dtype=torch.bool)), "host_mask is"),
    ]
    for change, message in cases:
        with pytest.raises(ValueError, match=message) as e:
            ck.moe(change.get("x", x), change.get("ids", ids), change.get("tw", tw), w, act, out=change.get("out"),
                   host_mask=change.get("mask"))
        assert "\n" not in str(e.value)
    if torch.cuda.is_available():  # pragma: no cover - no CUDA here
        with pytest.raises(ValueError, match="host \\(CPU\\) tensors only"):
            ck.moe(x.cuda(), ids, tw, w, act)
    strided = ck.ExpertWeights("bf16", w.w13.transpose(1, 2).contiguous().transpose(1, 2), w.w2)
    with pytest.raises(ValueError, match="w13 is not contiguous"):
        ck.moe(x, ids, tw, strided, act)
    meta = torch.empty(1, w.hidden, device="meta")
    with pytest.raises(ValueError, match="host \\(CPU\\) tensors only"):
        ck.moe(meta, ids, tw, w, act)


def test_weights_in_another_layout_are_refused_naming_the_tensor():
    w = make("mxfp4")
    cases = [
        (dict(w13=w.w13.view(torch.int8)), "mxfp4 w13: got torch.int8"),
        (dict(w13_scale=w.w13_scale[:, :-1]), "mxfp4 w13_scale: got torch.uint8 \\[6, 383, 7\\], expected"),
        (dict(w13_scale=None), "mxfp4 w13_scale: missing"),
        (dict(w2_bias=torch.zeros(6, 5)), "mxfp4 w2_bias: got"),
    ]
    base = dict(w13=w.w13, w2=w.w2, w13_scale=w.w13_scale, w2_scale=w.w2_scale)
    for change, message in cases:
        with pytest.raises(ValueError, match=message) as e:
            ck.ExpertWeights("mxfp4", **{**base, **change})
        assert "\n" not in str(e.value)
    f = make("fp8-block")
    with pytest.raises(ValueError, match="fp8-block w13_scale: got torch.float32"):
        ck.ExpertWeights("fp8-block", f.w13, f.w2, f.w13_scale, f.w2_scale, block=(128, 128))
    q = make("int4")
    for change, message in [(dict(w13_scale=None), "int4 w13_scale: missing does not split 224 columns"),
                            (dict(w2_scale=q.w2_scale[:, :, :3]), "int4 w2_scale: .* does not split 160 columns"),
                            (dict(w13_scale=q.w13_scale.float()), "int4 w13_scale: got torch.float32"),
                            (dict(w2_scale=q.w2_scale.half()), "w13_scale is torch.bfloat16 and w2_scale torch.float16"),
                            (dict(w13=q.w13.view(torch.int8)), "int4 w13: got torch.int8")]:
        with pytest.raises(ValueError, match=message):
            ck.ExpertWeights("int4", **{**dict(w13=q.w13, w2=q.w2, w13_scale=q.w13_scale, w2_scale=q.w2_scale), **change})
    with pytest.raises(ValueError, match="use one of"):
        ck.ExpertWeights("fp4", w.w13, w.w2)


def test_sizes_count_weights_scales_and_biases():
    w = make("mxfp4", bias="bf16")
    E, H, I = 6, 224, 192
    assert (w.num_experts, w.hidden, w.intermediate) == (E, H, I)
    per = 2 * I * H // 2 + H * I // 2 + 2 * I * H // 32 + H * I // 32 + 2 * (2 * I + H)
    assert w.expert_bytes == per and w.nbytes == E * per


@pytest.mark.parametrize("tokens", [1, 3, 4, 9])
def test_the_rows_walk_dots_a_bf16_matrix_with_every_token_as_the_float_reference(lib, tokens):
    """An LM head's host rows (``cpu_kernels.rows``): 200 rows (three blocks of 64 and a
    part) of 304 columns (the bf16 walk's whole chunks and its tail), tokens in chunks of
    four and a rest, bf16 or float32 tokens, one thread or two: each output is its row dotted
    with its token. A row written to another row's place, or a token's sums to another
    token's, moves outputs by their own size."""
    g = torch.Generator().manual_seed(tokens)
    w = torch.randn(200, 304, generator=g).to(torch.bfloat16)
    x = torch.randn(tokens, 304, generator=g)
    for xs in (x, x.to(torch.bfloat16)):
        # the AVX512-BF16 build holds the tokens in bf16, the others in float32
        want = (xs.to(torch.bfloat16).float() if lib.so_bf16_activations() else xs.float()) @ w.float().T
        for threads in (1, 2):
            close(ck.rows(xs, w, threads=threads, library_=lib), want, lib)


def test_the_rows_walk_takes_float32_to_torch_and_refuses_what_it_does_not_read():
    w, x = torch.randn(40, 64), torch.randn(2, 64)
    torch.testing.assert_close(ck.rows(x, w), x @ w.T, rtol=0, atol=0)  # float32: torch's own op, exact
    for bad, match in (((x, w.half()), "float16"), ((torch.randn(2, 63), w.bfloat16()), "do not multiply"),
                       ((x[None], w.bfloat16()), "do not multiply")):
        with pytest.raises(ValueError, match=match):
            ck.rows(*bad)


def test_a_rows_job_runs_by_its_function_pointer_as_a_cuda_host_function_would():
    """The split LM head's host part on CUDA is a host function (``cudaLaunchHostFunc``) that
    calls the job's C entry with the job's address, no Python between: called so here, it
    fills the job's output with the rows' dot products; a job whose struct C and Python
    disagree on would write elsewhere."""
    import ctypes

    w = torch.randn(130, 304).to(torch.bfloat16)
    x = torch.randn(3, 304).to(torch.bfloat16)
    out = torch.full((3, 130), float("nan"))
    job = ck.RowsJob(x, w, out, threads=2)
    ctypes.CFUNCTYPE(None, ctypes.c_void_p)(job.function_pointer)(job.address)
    assert job.job.status == 0
    close(out, x.float() @ w.float().T)
    with pytest.raises(ValueError, match="expected float32"):
        ck.RowsJob(x, w, torch.empty(3, 129), threads=1)
