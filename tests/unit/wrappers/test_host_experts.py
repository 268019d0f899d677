"""HostExperts: the host path at or below the crossover, the device path above it, on the
real CPU kernel. Here the "device" is the CPU (no CUDA): the device path still copies only
the distinct experts a step routes to and computes them with the reference's torch ops,
which is what it does on a GPU."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from selective_offload import cpu_kernels
from selective_offload.cpu_kernels import Activation, ExpertWeights
from selective_offload.cpu_kernels.reference import dequantize, held_share, moe_picked, moe_reference
from selective_offload.cpu_kernels.weights import random_experts
from selective_offload.estimate.host import share_gathers
from selective_offload.wrappers.host_compute import HostExperts, register, share_kernel_computes

E, H, I, K = 8, 64, 32, 2



@pytest.fixture(autouse=True, scope="module")
def kernel_built():
    try:
        cpu_kernels.library()
    except cpu_kernels.KernelUnavailable as exc:
        pytest.skip(f"the CPU kernel cannot be built here: {exc}")


def bf16_weights(seed: int = 0, bias: bool = False) -> ExpertWeights:
    g = torch.Generator().manual_seed(seed)
    def r(*shape):
        return (torch.randn(*shape, generator=g) * 0.1).to(torch.bfloat16)
    return ExpertWeights("bf16", r(E, 2 * I, H), r(E, H, I), w13_bias=r(E, 2 * I) if bias else None,
                         w2_bias=r(E, H) if bias else None)


def routing(tokens: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(tokens)]).to(torch.int32)
    w = torch.rand(tokens, K, generator=g)
    return x, ids, w / w.sum(-1, keepdim=True)


def experts(crossover: int = 4, **kw) -> HostExperts:
    return HostExperts("model.layers.0.mlp.experts", kw.pop("weights", bf16_weights()), kw.pop("activation", Activation("silu")),
                       crossover_tokens=crossover, threads=1, device=torch.device("cpu"), **kw)


@pytest.mark.parametrize("tokens", [1, 4, 5, 17])
def test_both_paths_compute_the_reference(tokens):
    """At or below the crossover the host kernel serves the step, above it the device
    path; both give the reference's sum (bf16 output, so a bf16 tolerance)."""
    he = experts(crossover=4)
    x, ids, w = routing(tokens)
    out = he(x, ids, w)
    want = moe_reference(x, ids, w, he.weights, he.activation)
    assert out.dtype == x.dtype and out.shape == x.shape
    torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-3)
    on_host = tokens <= 4
    assert (he.counts.host.steps, he.counts.device.steps) == ((1, 0) if on_host else (0, 1))
    assert (he.counts.host.tokens if on_host else he.counts.device.tokens) == tokens


def test_crossover_is_inclusive_and_counts_accumulate():
    he = experts(crossover=3)
    for tokens in (1, 3, 4, 3, 9):
        he(*routing(tokens, seed=tokens))
    assert (he.counts.host.steps, he.counts.host.tokens) == (3, 7)
    assert (he.counts.device.steps, he.counts.device.tokens) == (2, 13)
    assert he.counts.host.per_step_s() > 0


def test_the_host_path_counts_each_distinct_expert_once():
    he = experts(crossover=8)
    x, ids, w = routing(6)
    he(x, ids, w)
    assert he.counts.host_bytes == len(set(ids.flatten().tolist())) * he.weights.expert_bytes


def test_picks_of_experts_elsewhere_add_nothing_on_either_path():
    """Experts not in the host set (another rank's, or device-resident) and ids < 0 are
    left to whoever holds them: the same as the reference with those picks removed."""
    mask = torch.tensor([i % 2 == 0 for i in range(E)])
    for tokens in (2, 12):
        he = experts(crossover=4, host_mask=mask)
        x, ids, w = routing(tokens)
        ids[0, 0] = -1
        dropped = torch.where(mask[ids.clamp(min=0).long()] & (ids >= 0), ids, torch.full_like(ids, -1))
        want = moe_reference(x, dropped, w, he.weights, he.activation)
        torch.testing.assert_close(he(x, ids, w).float(), want, rtol=2e-2, atol=2e-3)


def test_gpt_oss_activation_and_biases_on_both_paths():
    act = Activation("swigluoai", alpha=1.702, limit=7.0)
    for tokens in (1, 9):
        he = experts(crossover=4, weights=bf16_weights(bias=True), activation=act)
        x, ids, w = routing(tokens)
        want = moe_reference(x, ids, w, he.weights, act)
        # above the crossover bf16 weights multiply bf16 activations, as a GPU's fused MoE does
        atol = 2e-3 if tokens <= 4 else 1e-2 * want.abs().max().item()
        torch.testing.assert_close(he(x, ids, w).float(), want, rtol=2e-2, atol=atol)


def test_the_device_path_copies_only_the_experts_the_step_uses(monkeypatch):
    he = experts(crossover=0)
    x, ids, w = routing(3)
    seen = []
    real = he._experts_on_device
    monkeypatch.setattr(he, "_experts_on_device", lambda used: seen.append(sorted(used.tolist())) or real(used))
    he(x, ids, w)
    assert seen == [sorted(set(ids.flatten().tolist()))]


def test_the_device_path_copies_runs_of_experts_from_views_of_the_host_weights():
    """Each run of consecutive experts a step uses is one copy whose source is a view of the
    page-locked weights themselves (on a GPU: a DMA at the pinned rate); nothing gathers them
    on the host first, which would copy them twice, the second time from pageable memory."""
    he = experts(crossover=0)
    storages = {t.untyped_storage().data_ptr() for t in he.weights.tensors().values()}
    seen: list[tuple[str, int | None]] = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            src = args[1].untyped_storage().data_ptr() if func.__name__.startswith("copy_") else None
            seen.append((func._schema.name, src))
            return func(*args, **(kwargs or {}))

    used = torch.tensor([1, 2, 3, 6])  # two runs: 1-3 and 6
    with Ops():
        sub = he._experts_on_device(used)
    copies = [src for name, src in seen if name == "aten::copy_"]
    assert not [name for name, _ in seen if name in ("aten::index_select", "aten::index", "aten::gather")]
    assert len(copies) == 2 * len(he.weights.tensors()) and set(copies) <= storages
    for name, t in he.weights.tensors().items():
        assert torch.equal(getattr(sub, name), t[used])


def test_int4_zero_points_travel_with_their_experts_above_the_crossover():
    """AWQ's zero points are per expert like its codes and scales: the device path copies
    them with the step's experts."""

    g = torch.Generator().manual_seed(3)
    weights = random_experts("int4", E, 256, 64)  # groups of 32: 8 per w13 row, 2 per w2 row
    weights = replace(weights, w13_zeros=torch.randint(0, 256, (E, 64, 8), generator=g, dtype=torch.uint8),
                      w2_zeros=torch.randint(0, 256, (E, 128, 2), generator=g, dtype=torch.uint8))
    he = HostExperts("model.layers.0.mlp.experts", weights, Activation("silu"), crossover_tokens=0, threads=1,
                     device=torch.device("cpu"))
    x, ids, w = torch.randn(2, 256, generator=g), torch.tensor([[0, 5], [5, 2]], dtype=torch.int32), torch.rand(2, 2)
    assert ids.unique().numel() < E
    want = moe_reference(x, ids, w, weights, he.activation)
    torch.testing.assert_close(he(x, ids, w).float(), want, rtol=0.0, atol=2e-2 * want.abs().max().item())


def test_a_negative_crossover_is_refused():
    with pytest.raises(ValueError, match="crossover"):
        experts(crossover=-1)


@pytest.mark.parametrize("tokens", [1, 3, 9])
def test_float32_experts_as_a_float32_engine_holds_them(tokens):
    """vLLM holds unquantized experts in the engine's dtype: a float32 engine's experts are
    served by the kernel's f32 format, to float32 accuracy."""
    w = bf16_weights(seed=4)
    f32 = ExpertWeights("f32", w.w13.float(), w.w2.float())
    he = experts(crossover=4, weights=f32)
    x, ids, wt = routing(tokens)
    x = x.float()
    torch.testing.assert_close(he(x, ids, wt), moe_reference(x, ids, wt, f32, he.activation), rtol=1e-5, atol=1e-6)


def test_the_op_is_opaque_to_torch_compile():
    """vLLM compiles the model with fullgraph: the host experts run as one registered op,
    and the compiled function gives the eager result."""
    he = experts(crossover=4)
    key = register(he)
    x, ids, w = routing(2)

    def layer(x, ids, w):
        return torch.ops.selective_offload.experts_on_host(x * 2, ids, w, key) + 1

    compiled = torch.compile(layer, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x, ids, w), layer(x, ids, w))
    assert he.counts.host.steps == 2


# ---- a device share: the first experts held on the device, computed there beside the host


@pytest.mark.parametrize("held", [None, (6, 2, 7)])
@pytest.mark.parametrize("tokens", [1, 4, 9])
def test_a_device_share_computes_its_picks_and_the_host_the_rest_on_both_paths(tokens, held):
    """Three of eight experts copied to the "device" (the CPU here): the first three, or the
    three a routing profile chose (``held``, share slot by slot). The sum is the reference's
    over every pick, the host counts only the bytes of the experts it computed, and the
    share counts the picks that landed on it."""
    weights = bf16_weights(bias=True)
    share = held_share(weights, 3, "cpu", ids=held)
    assert share.w13.data_ptr() != weights.w13.data_ptr() and share.num_experts == 3
    on_device = set(held or range(3))
    assert torch.equal(share.w2[0], weights.w2[(held or (0,))[0]])
    act = Activation("swigluoai", alpha=1.702, limit=7.0)
    he = experts(crossover=4, weights=weights, activation=act, device_share=share, share_ids=held)
    x, ids, w = routing(tokens)
    want = moe_reference(x, ids, w, weights, act)
    # the share multiplies in bf16 (moe_picked): bf16's rounding of the float32 sum
    torch.testing.assert_close(he(x, ids, w).float(), want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))
    assert int(he.share_picks) == sum(i in on_device for i in ids.flatten().tolist())
    if tokens <= 4:
        assert he.counts.host_bytes == len(set(ids.flatten().tolist()) - on_device) * weights.expert_bytes


def test_a_share_with_every_pick_on_it_leaves_the_host_nothing_to_add():
    weights = bf16_weights()
    he = experts(crossover=4, weights=weights, device_share=held_share(weights, 2, "cpu"))
    x, ids, w = routing(2)
    ids = torch.tensor([[0, 1], [1, 0]], dtype=torch.int32)
    want = moe_reference(x, ids, w, weights, he.activation)
    torch.testing.assert_close(he(x, ids, w).float(), want, rtol=2e-2, atol=2e-3)
    assert he.counts.host_bytes == 0 and int(he.share_picks) == 4


def test_an_expert_id_past_the_layers_experts_reads_no_share_slot():
    """An id of E or more (an EPLB physical id, a sentinel) contributes nothing on the share
    and faults nowhere: indexing the slot map with it is a device-side assert on CUDA."""
    weights = bf16_weights()
    share = held_share(weights, 3, "cpu", ids=(5, 2, 7))
    he = experts(crossover=4, weights=weights, device_share=share, share_ids=(5, 2, 7))
    x, _, w = routing(2)
    ids = torch.tensor([[5, 8], [11, 2]], dtype=torch.int32)
    got = he._on_share(x, ids, w)
    want = he._on_share(x, torch.tensor([[5, -1], [-1, 2]], dtype=torch.int32), w)
    assert torch.equal(got, want) and int(he.share_picks) == 4


@pytest.mark.parametrize("fmt", ["bf16", "mxfp4", "fp8-block", "int4", "f32"])
def test_a_held_share_is_its_experts_in_bf16_in_storage_of_its_own(fmt):
    """``held_share``: the first experts dequantized to bf16 (what the device reads once per
    matmul; float32 weights stay float32), biases kept; a refill writes a new split into the
    same tensors."""
    held = "f32" if fmt == "f32" else "bf16"
    dtype = torch.float32 if fmt == "f32" else torch.bfloat16
    weights = random_experts(fmt, 8, 128, 64, seed=3)
    share = held_share(weights, 5, "cpu")
    assert share.fmt == held and share.num_experts == 5 and share.w13.dtype == share.w2.dtype == dtype
    for name in ("w13", "w2"):
        want = dequantize(weights, name)[:5]
        torch.testing.assert_close(getattr(share, name).float(), want, rtol=2 ** -8, atol=0)  # bf16 rounding only
    ptr = share.w13.data_ptr()
    other = random_experts(fmt, 8, 128, 64, seed=4)
    assert held_share(other, 5, "cpu", into=share) is share and share.w13.data_ptr() == ptr
    torch.testing.assert_close(share.w2.float(), dequantize(other, "w2")[:5], rtol=2 ** -8, atol=0)
    with pytest.raises(ValueError, match=f"not 4 {held} experts of this shape"):
        held_share(other, 4, "cpu", into=share)
    with pytest.raises(ValueError, match="a share of 1 to 8 experts, not 9"):
        held_share(weights, 9, "cpu")


@pytest.mark.parametrize("fmt", ["mxfp4", "fp8-block", "int4"])
def test_the_share_path_refuses_weights_not_held(fmt):
    """A share in a quantized format is refused where it is handed over (the layer's host
    experts: MXFP4 only as the layer's own experts, as stored, for the share kernel) and
    where the torch path would compute it, not dequantized at every step."""
    weights = random_experts(fmt, 8, 128, 64)
    with pytest.raises(ValueError, match="hold the share in bf16 first"):
        moe_picked(torch.zeros(1, 128), torch.zeros(1, 2, dtype=torch.int32), torch.ones(1, 2), weights,
                   Activation("silu"))
    other = random_experts("bf16" if fmt == "mxfp4" else fmt, 8, 128, 64)  # not the layer's own format
    with pytest.raises(ValueError, match=f"a {fmt} device share; hold it in bf16 first"):
        HostExperts("g", other, Activation("silu"), crossover_tokens=4, threads=1, device=torch.device("cpu"),
                    device_share=random_experts(fmt, 3, 128, 64))


@pytest.mark.parametrize("crossover", [16, 0])
def test_an_mxfp4_share_held_as_stored_is_a_copy_and_its_picks_match_the_reference(crossover):
    """gpt-oss's MXFP4 experts with a share of their first 3 held as stored (copies: the
    host's tensors are not the device's), computed on either side of the crossover: the layer's
    sum is the reference's over every pick (the host's and the share's, picks past the share
    masked off the share's side), to bf16's rounding; the share counted every pick it took."""

    g = torch.Generator().manual_seed(1)
    weights = random_experts("mxfp4", 8, 128, 64, seed=5)
    weights = replace(weights, w13_bias=(torch.randn(8, 128, generator=g) * 0.1).to(torch.bfloat16),
                      w2_bias=(torch.randn(8, 128, generator=g) * 0.1).to(torch.bfloat16))
    act = Activation("swigluoai", alpha=1.702, limit=7.0)
    share = held_share(weights, 3, "cpu", native=True)
    assert share.fmt == "mxfp4" and share.nbytes == 3 * weights.expert_bytes
    for name, t in share.tensors().items():
        host = getattr(weights, name)
        assert torch.equal(t, host[:3]) and t.untyped_storage().data_ptr() != host.untyped_storage().data_ptr(), name
    layer = HostExperts("g", weights, act, crossover_tokens=crossover, threads=1, device=torch.device("cpu"),
                        device_share=share)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 128, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(8, generator=g)[:4] for _ in range(5)]).to(torch.int32)
    ids[0, 0], ids[1, 1] = 1, 7
    tw = torch.softmax(torch.randn(5, 4, generator=g), -1)
    got = layer(x, ids, tw).float()
    want = moe_reference(x, ids, tw, weights, act)
    assert (got - want).abs().max() <= 0.02 * want.abs().max()
    assert int(layer.share_picks) == int(((ids >= 0) & (ids < 3)).sum())


@pytest.mark.parametrize("tokens", [1, 3, 12])
def test_the_share_path_matches_the_reference_without_a_synchronisation(tokens):
    """``moe_picked`` (what a CUDA graph captures: no routing-dependent shape) against the
    reference over the picks inside the share: gathered at 1 and 3 tokens, every expert of
    the share at 12 (``estimate.host.share_gathers``); picks past the share and negative ids add
    nothing. Its matmuls run in bf16, so it is held to bf16's rounding of the float32 sum."""
    weights = random_experts("bf16", 32, 128, 64, seed=3)
    share = held_share(weights, 28, "cpu")
    assert share_gathers(tokens, 2, 28) == (tokens < 12)
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 128, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(32, generator=g)[:2] for _ in range(tokens)]).to(torch.int32)
    ids[0, 1] = -1
    w = torch.rand(tokens, 2, generator=g)
    inside = torch.where((ids >= 0) & (ids < 28), ids, torch.full_like(ids, -1))
    want = moe_reference(x, inside, w, weights, Activation("silu"))
    got = moe_picked(x, ids, w, share, Activation("silu"))
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))


def test_a_share_held_as_stored_goes_to_the_share_kernel_on_cuda_only():
    """The rule the layer dispatches by (the CPU cannot run the CUDA side; the device a share
    names is what it can see): MXFP4 on CUDA to the kernel; on the CPU to the stand-in; a bf16
    share to torch's ops wherever it lies."""
    assert share_kernel_computes("mxfp4", torch.device("cuda", 0)) and share_kernel_computes("mxfp4", "cuda")
    assert not share_kernel_computes("mxfp4", "cpu")
    assert not share_kernel_computes("bf16", "cuda") and not share_kernel_computes("f32", "cuda")
