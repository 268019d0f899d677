"""A dense MLP's device share in the glue: the MLP's own linears' weights split in place
(host channels first), the share copied to the device, and a reload (the checkpoint's layout
copied into the same tensors, then each projection's post-processing) split again, so the
host kernel and the device copy read what they read before. The "device" is the CPU here."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from builders import make_ckpt
from helpers import TINY_HOST_COMPUTE, reload_like_vllm
from selective_offload.cpu_kernels import Activation, ExpertWeights
from selective_offload.cpu_kernels.reference import moe_reference
from selective_offload.errors import PlanError
from selective_offload.planner import PlanInputs, make_plan
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


def mlp_plan():
    """Two dense layers of this file's MLP shape planned short of their size: both MLPs
    computed on the host, the first 256 and 128 of their channels also on the device."""
    spec = {"model.embed_tokens.weight": ("BF16", [4096, H]), "lm_head.weight": ("BF16", [4096, H]),
            "model.norm.weight": ("BF16", [H])}
    for i in range(2):
        spec[f"model.layers.{i}.self_attn.qkv_proj.weight"] = ("BF16", [3 * H, H])
        for name, shape in (("gate_proj", [I, H]), ("up_proj", [I, H]), ("down_proj", [H, I])):
            spec[f"model.layers.{i}.mlp.{name}.weight"] = ("BF16", shape)
    ckpt = make_ckpt(spec, num_hidden_layers=2, hidden_size=H, intermediate_size=I)
    # a step of 8 tokens: the copied path's activations at a larger one outweigh these MLPs
    return make_plan(ckpt, PlanInputs(device_memory_bytes=int(ckpt.total_bytes * 0.62), kv_cache_bytes=0,
                                      reserve_bytes=0, **{**TINY_HOST_COMPUTE, "max_num_batched_tokens": 8}))


@pytest.mark.parametrize("order", [("down_proj", "gate_up_proj"), ("gate_up_proj", "down_proj")],
                         ids=["checkpoint-order", "gate-up-first"])
def test_vllms_reload_rebuilds_a_host_mlp_in_host_memory_and_splits_it_again(order):
    """vLLM records at construction the device its layer-by-layer reload rebuilds each layer
    on (the default device: CUDA on a GPU; meta stands in for it here). An MLP the glue
    serves ``compute`` has its projections rebuilt in host memory instead, so the MLP never
    lands on the device, which the plan does not count; vLLM's own reload then runs
    through, the host part is read from the linears' own storage and the device share
    holds the new channels. The reload finishes each projection as its weights come in, in
    the checkpoint's key order (sorted: ``down_proj`` first), so the split waits for both."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info, record_metadata_for_reloading

    plan = mlp_plan()
    group = "model.layers.0.mlp"
    assert plan.group_of(group).serving == "compute" and plan.group_of(group).device_channels == 256, plan.notes
    mlp, _ = float_mlp()
    for part in (mlp.gate_up_proj, mlp.down_proj):
        part.quant_method = UnquantizedLinearMethod()
        part.quant_method.process_weights_after_loading = lambda layer: None  # kept as loaded, as the glue does
    with set_current_vllm_config(VllmConfig()):
        mlp.act_fn = SiluAndMul()
    model = nn.Module()
    model.mlp = mlp
    with torch.device("meta"):
        record_metadata_for_reloading(model)
    cpu = torch.device("cpu")
    experts = host_mlp.install_mlp(group, mlp, plan, cpu)
    assert all(get_layerwise_info(m).restore_device == cpu for m in (mlp.gate_up_proj, mlp.down_proj))

    _, new = float_mlp(seed=1)
    reload_like_vllm(model, {f"mlp.{name}.weight": new[name] for name in order})
    x, ids, w = torch.randn(3, H), torch.zeros(3, 1, dtype=torch.int32), torch.ones(3, 1)
    want = moe_reference(x, ids, w, ExpertWeights("f32", new["gate_up_proj"][None], new["down_proj"][None]),
                         Activation("silu"))
    torch.testing.assert_close(experts(x, ids, w), want, rtol=1e-5, atol=1e-5)
    assert experts.weights.w2.data_ptr() == mlp.down_proj.weight.data_ptr()  # no second copy of the layer
