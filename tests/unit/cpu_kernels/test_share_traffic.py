"""The device share's path, and the path above the crossover, move what the step model
prices (``estimate.host.device_share_traffic``, ``estimate.host.COPIED_PATH_TRAFFIC``).

The planner keeps a device share only where the GPU's part, priced from the bytes the path
moves, hides under the CPU's, and sets the crossover where the copied path's bytes cost more
than the CPU's time; those bytes are counted here on the paths themselves. A byte
ledger (a dispatch mode) adds up every operator's inputs and outputs as it runs, as each
operator is one kernel reading and writing memory on a GPU, eager or replayed from a
captured graph; views move nothing, and a gather reads what it writes. The CPU build runs
the same operators the device would."""

from __future__ import annotations

import makers
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from selective_offload.cpu_kernels import Activation
from selective_offload.cpu_kernels.reference import held_share, moe_copied, moe_picked, moe_reference
from selective_offload.cpu_kernels.weights import random_experts
from selective_offload.estimate.host import COPIED_PATH_TRAFFIC, device_share_traffic, share_gathers
from selective_offload.estimate.traffic import ExpertsRead

H, I = 2048, 512
GATHERS = {"aten::index_select", "aten::index", "aten::gather"}


def _bytes(values) -> int:
    return sum(t.numel() * t.element_size() for t in tree_flatten(values)[0] if isinstance(t, torch.Tensor))


class ByteLedger(TorchDispatchMode):
    """Bytes each operator reads and writes, summed."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            name = func._schema.name
            self.bytes += 2 * _bytes(out) if name in GATHERS else _bytes((args, kwargs)) + _bytes(out)
        return out


def moved(tokens: int, experts: int, share: int, k: int, bias: bool = False) -> tuple[int, float]:
    """(bytes the path moved, bytes the step model prices) for one step."""
    weights = random_experts("fp8-block", experts, H, I, seed=1)
    held = held_share(weights, share, "cpu")
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, H, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)]).to(torch.int32)
    w = torch.rand(tokens, k, generator=g)
    with ByteLedger() as ledger:
        moe_picked(x, ids, w, held, Activation("silu"))
    e = ExpertsRead(0, weights.nbytes, experts, k, "cpu", device_share=share / experts,
                    held_nbytes=held.nbytes * experts // share)
    return ledger.bytes, device_share_traffic(e, tokens)[0]


@pytest.mark.parametrize("tokens,experts,share,k", [
    (1, 32, 28, 2),   # decode: two pick slots gathered
    (4, 32, 28, 2),   # a few tokens: eight slots gathered
    (9, 32, 28, 2),   # past the gather bound: every expert of the share read once
    (1, 32, 4, 2),    # gathering would cost more than the share: read once
    (3, 1, 1, 1),     # a dense MLP's share: one expert every token takes
])
def test_the_share_path_moves_what_the_step_model_prices(tokens, experts, share, k):
    got, priced = moved(tokens, experts, share, k)
    assert share_gathers(tokens, k, share) == (tokens <= 4 and share == 28)
    # the model prices the weights; the tokens, activations and sums add a little
    assert priced <= got <= 1.25 * priced, (got, priced)


@pytest.mark.parametrize("fmt,zeros", [(f, False) for f in sorted(COPIED_PATH_TRAFFIC)] + [("int4", True)])
@pytest.mark.parametrize("tokens", [3, 16])
def test_the_copied_path_moves_what_the_crossover_prices(fmt, zeros, tokens):
    # Above the crossover a step's experts, once copied, are computed by moe_copied on the
    # device; the crossover prices that as COPIED_PATH_TRAFFIC times the copied bytes, with
    # or without zero points (AWQ's, groups of 128 as GPTQ's)
    experts, k = 8, 2
    weights = (makers.experts(fmt, experts, H, I, group=128, zeros=True) if zeros
               else random_experts(fmt, experts, H, I, seed=2))
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, H, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)]).to(torch.int32)
    ids[0, 0] = -1  # a pick of another's experts: nothing computed for it
    with ByteLedger() as ledger:
        moe_copied(x, ids, torch.rand(tokens, k, generator=g), weights, Activation("silu"))
    used = ids[ids >= 0].unique().numel()
    priced = COPIED_PATH_TRAFFIC[fmt] * weights.expert_bytes * used
    assert priced <= ledger.bytes <= 1.25 * priced, (fmt, ledger.bytes / (weights.expert_bytes * used))


@pytest.mark.parametrize("fmt,kw", [("bf16", {}), ("mxfp4", {}), ("int4", {}), ("int4", dict(zeros=True)),
                                     ("int4", dict(scale_dtype=torch.float16, group=64)), ("fp8-block", {}),
                                     ("fp8-block", dict(block=(64, 96)))])  # 256 columns: not whole blocks
def test_the_copied_path_sums_what_the_reference_sums(fmt, kw):
    # quantized weights dequantized to bf16 (each value times its scale, in bf16) and bf16
    # matmuls round; a wrong nibble, zero point or scale moves the sums by whole units
    weights = makers.experts(fmt, 8, 256, 64, seed=3, **kw)
    ids, w = makers.routing(5, 2, 8)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(0))
    got = moe_copied(x, ids, w, weights, Activation("silu"))
    want = moe_reference(x, ids, w, weights, Activation("silu"))
    assert torch.allclose(got, want, rtol=0.0, atol=2e-2 * want.abs().max().item())
    assert not torch.allclose(got, torch.zeros_like(got))


def test_float32_experts_copied_are_the_reference_exactly():
    weights = random_experts("f32", 8, 256, 64, seed=3)
    ids, w = makers.routing(5, 2, 8)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(0))
    assert torch.equal(moe_copied(x, ids, w, weights, Activation("silu")),
                       moe_reference(x, ids, w, weights, Activation("silu")))
