"""The host-compute kernel's activations are vLLM's: its reference (which the kernel is
tested against) gives what vLLM's own native activations give on the same up-projection
output, for the layouts each model family uses (silu and Gemma's gelu_tanh: gate then up;
gpt-oss's swigluoai: gate and up interleaved, clamped at the limit)."""

from __future__ import annotations

import types

import pytest
import torch

from selective_offload import cpu_kernels as ck
from selective_offload.cpu_kernels import reference

pytestmark = pytest.mark.vllm

activation = pytest.importorskip("vllm.model_executor.layers.activation", reason="vLLM is not installed")


def test_silu_is_vllms_silu_and_mul():
    h = torch.randn(5, 2 * 24) * 4
    want = activation.SiluAndMul.forward_native(h)
    torch.testing.assert_close(reference.activate(h, ck.Activation("silu")), want, rtol=1e-6, atol=1e-6)


def test_gelu_tanh_is_vllms_gelu_and_mul_with_the_tanh_approximation():
    """Gemma's ``gelu_pytorch_tanh`` (dense MLPs) and ``MoEActivation.GELU_TANH`` (Gemma 4's
    experts); the erf GELU differs by more than the tolerance, so the test tells them apart."""
    h = torch.randn(5, 2 * 24) * 4
    want = activation.GeluAndMul.forward_native(types.SimpleNamespace(approximate="tanh"), h)
    got = reference.activate(h, ck.Activation("gelu_tanh"))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    erf = activation.GeluAndMul.forward_native(types.SimpleNamespace(approximate="none"), h)
    assert (got - erf).abs().max() > 1e-4


@pytest.mark.parametrize("alpha, limit", [(1.702, 7.0), (1.0, 3.0)])
def test_swigluoai_is_vllms_swigluoai_and_mul(alpha, limit):
    h = torch.randn(5, 2 * 24) * 10  # many values past the limit
    op = types.SimpleNamespace(alpha=alpha, limit=limit)  # forward_native reads only these
    want = activation.SwigluOAIAndMul.forward_native(op, h)
    got = reference.activate(h, ck.Activation("swigluoai", alpha=alpha, limit=limit))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert (h.abs() > limit).any()


@pytest.mark.parametrize("kind", ["silu", "swigluoai", "gelu_tanh"])
def test_the_kernel_computes_w2_of_vllms_activation(kind):
    """One bf16 expert, one token: the compiled kernel gives w2 @ vLLM's act(w13 @ x)."""
    g = torch.Generator().manual_seed(0)
    E, H, I = 2, 64, 32
    w = ck.ExpertWeights("bf16", (torch.randn(E, 2 * I, H, generator=g) * 0.5).bfloat16(),
                         (torch.randn(E, H, I, generator=g) * 0.5).bfloat16())
    x = (torch.randn(1, H, generator=g) * 3).bfloat16()  # as vLLM passes tokens
    h = x.float() @ w.w13[1].float().T
    if kind == "silu":
        act = activation.SiluAndMul.forward_native(h)
    elif kind == "gelu_tanh":
        act = activation.GeluAndMul.forward_native(types.SimpleNamespace(approximate="tanh"), h)
    else:
        act = activation.SwigluOAIAndMul.forward_native(types.SimpleNamespace(alpha=1.702, limit=7.0), h)
    want = act @ w.w2[1].float().T
    got = ck.moe(x, torch.tensor([[1]]), torch.ones(1, 1), w, ck.Activation(kind))
    # The AVX512-BF16 build holds the activation in bf16 (as vLLM's device kernels do).
    tol = 1e-2 if ck.library().so_bf16_activations() else 1e-4
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * float(want.abs().max()))
