"""A dense MLP's device share in the glue: the MLP's own linears' weights split in place
(host channels first), the share copied to the device, and a reload (the checkpoint's layout
copied into the same tensors, then each projection's post-processing) split again, so the
host kernel and the device copy read what they read before. The "device" is the CPU here."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from selective_offload.cpu_kernels import Activation
from selective_offload.cpu_kernels.reference import moe_reference
from selective_offload.errors import PlanError
from selective_offload.vllm_glue import host_mlp
from selective_offload.wrappers.host_compute import HostExperts

H, I = 128, 512


def float_mlp(seed: int = 0) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """An MLP as vLLM builds a Qwen3 one (gate_up_proj [2I, H], down_proj [H, I]), float32
    (the engine's dtype here), and the checkpoint's tensors a reload copies back."""
    g = torch.Generator().manual_seed(seed)
    mlp, loaded = nn.Module(), {}
    for name, shape in (("gate_up_proj", (2 * I, H)), ("down_proj", (H, I))):
        part = nn.Module()
        loaded[name] = torch.randn(*shape, generator=g) * 0.05
        part.weight = nn.Parameter(loaded[name].clone(), requires_grad=False)
        part.bias = None
        part.quant_method = SimpleNamespace(process_weights_after_loading=lambda layer: None)
        setattr(mlp, name, part)
    return mlp, loaded


def test_a_split_mlp_computes_the_whole_and_a_reload_is_split_again():
    mlp, loaded = float_mlp()
    cpu = torch.device("cpu")
    whole = host_mlp.mlp_weights("m", mlp, "f32")
    act = Activation("silu")
    x = torch.randn(3, H)
    ids, w = torch.zeros(3, 1, dtype=torch.int32), torch.ones(3, 1)
    want = moe_reference(x, ids, w, whole, act)
    weights, share = host_mlp.split_mlp("m", whole, 128, cpu)
    assert weights.w13.data_ptr() == mlp.gate_up_proj.weight.data_ptr()  # the host part is the linear's storage
    assert share.w13.untyped_storage().data_ptr() != mlp.gate_up_proj.weight.untyped_storage().data_ptr()
    experts = HostExperts("m", weights, act, crossover_tokens=4, threads=1, device=cpu, device_share=share,
                          share_channels=True)
    before = experts(x, ids, w)
    torch.testing.assert_close(before, want, rtol=1e-5, atol=1e-5)
    host_mlp.resplit_after_reload("m", mlp, experts, "f32", 128)
    for name in ("gate_up_proj", "down_proj"):  # the reload, in module order
        part = getattr(mlp, name)
        part.weight.data.copy_(loaded[name])
        part.quant_method.process_weights_after_loading(part)
    assert torch.equal(experts(x, ids, w), before)
    assert int(experts.share_picks) == 6


def test_a_share_that_cuts_a_block_is_one_line():
    mlp, _ = float_mlp()
    with pytest.raises(PlanError, match=r"m: the plan keeps the first 600 channels .*--no-device-share") as info:
        host_mlp.split_mlp("m", host_mlp.mlp_weights("m", mlp, "f32"), 600, torch.device("cpu"))
    assert "\n" not in str(info.value)
