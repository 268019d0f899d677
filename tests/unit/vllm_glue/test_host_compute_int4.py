"""int4 experts for the host's int4 kernel, against vLLM's own parts: the layer's tensors
made by vLLM's ``AutoGPTQMoEMethod.create_weights`` (its real shapes, K-first), filled by
vLLM's GPTQ oracle (``gptq_quantize_weights``: the dequantized weights it rounds to, and
``gptq_pack``: the checkpoint's packing), which the glue rewrites row-major in their own
storage; and ``CompressedTensorsWNA16MoEMethod.create_weights``' (N-first), filled by the
compressed-tensors library, read as loaded. The kernel's output is checked against the MoE
computed with vLLM's dequantized weights. vLLM's CPU build has no int4 MoE kernel on a CPU
without AMX, so no engine runs int4 experts here (tests/engine/test_vllm_int4.py runs int4
MLPs); the layout is what these tests pin down."""

from __future__ import annotations

from fractions import Fraction
from types import SimpleNamespace

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize
from torch import nn

from selective_offload import cpu_kernels as ck
from selective_offload.errors import PlanError
from selective_offload.planner import host_compute as planned
from selective_offload.vllm_glue import host_compute, host_mlp, int4_layouts

E, H, I = 4, 256, 192


def gptq_config(**overrides):
    from vllm.model_executor.layers.quantization.auto_gptq import AutoGPTQConfig

    return AutoGPTQConfig.from_config({"bits": 4, "group_size": 64, "desc_act": False, "sym": True,
                                       "quant_method": "gptq", **overrides})


def gptq_method(qc):
    from vllm.model_executor.layers.quantization.auto_gptq import AutoGPTQMoEMethod

    method = object.__new__(AutoGPTQMoEMethod)  # its __init__ picks a device kernel; the layout is create_weights'
    method.quant_config, method.moe, method.input_dtype = qc, SimpleNamespace(w13_num_shards=2), None
    return method


@pytest.fixture(scope="module")
def layer():
    """A layer as vLLM builds and loads it, and vLLM's dequantized weights (float32)."""
    from vllm.model_executor.layers.quantization.utils.quant_utils import gptq_pack, gptq_quantize_weights
    from vllm.scalar_type import scalar_types

    qc = gptq_config()
    method = gptq_method(qc)
    module = nn.Module()
    type(method).create_weights(method, module, E, H, I, torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    ref = {"w13": [], "w2": []}
    for which, (rows, cols) in (("w13", (2 * I, H)), ("w2", (H, I))):
        q, s = getattr(module, f"{which}_qweight").data, getattr(module, f"{which}_scales").data
        for e in range(E):
            w = (torch.randn(rows, cols, generator=g) * 0.1).bfloat16()
            w_ref, w_q, w_s = gptq_quantize_weights(w.T.contiguous(), scalar_types.uint4b8, 64)  # [K, N], as GPTQ
            q[e].copy_(gptq_pack(w_q, 4, cols, rows))
            s[e].copy_(w_s)
            ref[which].append(w_ref.T.float())
    return SimpleNamespace(module=module, method=method, w13=torch.stack(ref["w13"]), w2=torch.stack(ref["w2"]))


def test_vllms_gptq_layout_is_rewritten_in_place_and_read_as_vllm_dequantizes_it(layer, monkeypatch):
    # served here whatever the claim (the plan's reader holds a plan to its claim): the layout
    ptrs = {n: p.data_ptr() for n, p in layer.module.named_parameters()}
    assert tuple(layer.module.w13_qweight.shape) == (E, H // 8, 2 * I)  # vLLM's K-first layout
    assert host_compute.format_of("g", layer.method, layer.module) == "int4"
    w = host_compute.weights_of(layer.module, "int4")
    assert w.fmt == "int4" and w.block == (64, 64)
    assert w.w13.data_ptr() == ptrs["w13_qweight"] and w.w2_scale.data_ptr() == ptrs["w2_scales"]
    assert {n: p.data_ptr() for n, p in layer.module.named_parameters()} == ptrs  # no new storage
    assert w.w13_bias is None and w.w2_bias is None  # vLLM's zero biases, not loaded from the checkpoint
    # vLLM's dequantized weights are bf16 products ((q - 8) * s rounded), the reference's float32
    torch.testing.assert_close(ck.reference.dequantize(w, "w13"), layer.w13, rtol=2 ** -8, atol=0)
    torch.testing.assert_close(ck.reference.dequantize(w, "w2"), layer.w2, rtol=2 ** -8, atol=0)
    assert host_compute.weights_of(layer.module, "int4").w13.data_ptr() == w.w13.data_ptr()  # read once

    # the kernel against the MoE computed with vLLM's dequantized weights
    x = torch.randn(3, H).bfloat16()
    ids = torch.tensor([[0, 3], [1, 2], [3, 1]], dtype=torch.int32)
    tw = torch.rand(3, 2)
    want = ck.reference.moe_reference(x, ids, tw, ck.ExpertWeights("f32", layer.w13, layer.w2), ck.Activation("silu"))
    got = ck.moe(x, ids, tw, w, ck.Activation("silu"))
    assert float((got - want).abs().max()) <= 5e-2 * float(want.abs().max())


@pytest.mark.parametrize("overrides, why", [
    (dict(sym=False), "asymmetric"), (dict(desc_act=True), "act-order"), (dict(bits=8), "8-bit"),
])
def test_int4_the_kernel_cannot_read_is_refused_in_one_line(overrides, why):
    # vLLM refuses act-order, and its CPU build 4-bit asymmetric GPTQ, at the config itself:
    # the glue's own check is set on a config vLLM made
    qc = gptq_config(**{k: v for k, v in overrides.items() if k not in ("sym", "desc_act")})
    if "sym" in overrides:
        qc.is_sym = False
    if "desc_act" in overrides:
        qc.desc_act = True
    with pytest.raises(PlanError, match=f"reads 4-bit groups .*, not .*{why}") as e:
        int4_layouts.refuse_unread_int4("model.layers.0.mlp.experts", gptq_method(qc))
    assert "\n" not in str(e.value) and "served uva" in str(e.value)
    other = SimpleNamespace(quant_config=gptq_config())
    with pytest.raises(PlanError, match="SimpleNamespace's layout"):
        int4_layouts.refuse_unread_int4("g", other)


def test_the_planner_offers_int4_only_for_the_layout_the_glue_reads():
    def config(**qc):
        return {"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True,
                                        "desc_act": False, **qc}}

    assert planned.cpu_format("wna16", config()) == "int4"
    assert planned.cpu_format("wna16", config(group_size=-1)) == "int4"
    for bad in (dict(sym=False), dict(desc_act=True), dict(group_size=48), dict(quant_method="compressed-tensors")):
        assert planned.cpu_format("wna16", config(**bad)) is None, bad
    awq = {"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
                                   "version": "gemm"}}
    assert planned.cpu_format("wna16", awq) == "int4"
    for bad in (dict(version="gemv"), dict(zero_point=False), dict(group_size=48)):
        assert planned.cpu_format("wna16", {"quantization_config": {**awq["quantization_config"], **bad}}) is None, bad

    def ct(fmt="pack-quantized", **weights):
        w = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128, **weights}
        return {"quantization_config": {"quant_method": "compressed-tensors", "format": fmt,
                                        "config_groups": {"group_0": {"targets": ["Linear"], "weights": w}}}}

    assert planned.cpu_format("wna16", ct()) == "int4"
    assert planned.cpu_format("wna16", ct(strategy="channel", group_size=None)) == "int4"
    for bad in (dict(symmetric=False), dict(actorder="group"), dict(group_size=48)):
        assert planned.cpu_format("wna16", ct(**bad)) is None, bad
    assert planned.cpu_format("wna16", ct(fmt="marlin-24")) is None
    assert planned.unclaimed_reason("wna16", None).startswith("the int4 CPU kernel does not read this W4A16 layout")
    assert "does not read this W4A16 layout" in planned.mlp_unclaimed_note(None, 0, 13.9, 55.0, "wna16")


def test_a_reload_in_gptqs_layout_is_rewritten_again():
    """A reload copies the checkpoint's K-first tensors into the same storage and runs each
    projection's post-processing: the hook the glue installs rewrites the MLP's rows again,
    into the same storage, so the kernel reads what it read before."""
    from vllm.model_executor.layers.quantization.utils.quant_utils import gptq_pack

    g = torch.Generator().manual_seed(1)
    mlp = nn.Module()
    packed = {}
    for name, (k, n) in (("gate_up_proj", (H, 2 * I)), ("down_proj", (I, H))):
        part = nn.Module()
        codes = torch.randint(0, 16, (k, n), generator=g)
        packed[name] = (gptq_pack(codes, 4, k, n), (torch.rand(k // 64, n, generator=g) + 0.5).bfloat16())
        part.qweight = nn.Parameter(packed[name][0].clone(), False)
        part.scales = nn.Parameter(packed[name][1].clone(), False)
        part.quant_method = SimpleNamespace(process_weights_after_loading=lambda layer: None)
        setattr(mlp, name, part)
    first = {k: v.clone() for k, v in int4_layouts.mlp_rows(mlp).items()}
    host_mlp.relayout_after_reload(mlp)
    for name in ("gate_up_proj", "down_proj"):  # the reload, in module order
        part = getattr(mlp, name)
        part.qweight.data.copy_(packed[name][0])
        part.scales.data.copy_(packed[name][1])
        part.quant_method.process_weights_after_loading(part)
    again = int4_layouts.mlp_rows(mlp)
    assert again["w13"].data_ptr() == mlp.gate_up_proj.qweight.data_ptr()
    for k, v in first.items():
        assert torch.equal(again[k], v), k


def test_compressed_tensors_experts_are_read_as_vllm_loads_them():
    """compressed-tensors' W4A16 experts in vLLM's ``CompressedTensorsWNA16MoEMethod``
    create_weights layout (N-first, its ``weight_packed`` and ``weight_scale``), filled by
    the installed compressed-tensors library (its ``quantize`` and ``pack_to_int32``): read
    as loaded, no byte moved, and dequantized as the library dequantizes them."""

    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (
        compressed_tensors_moe_wna16 as ct_moe,
    )

    cls = ct_moe.CompressedTensorsWNA16MoEMethod
    method = object.__new__(cls)  # its __init__ picks a device kernel; the layout is create_weights'
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=64)
    method.moe = SimpleNamespace(is_act_and_mul=True, has_bias=False)
    method.num_bits, method.symmetric, method.strategy, method.group_size = 4, True, "group", 64
    method.packed_factor, method.weight_quant = Fraction(32, 4), args
    module = nn.Module()
    cls.create_weights(method, module, E, H, I, torch.bfloat16)
    assert tuple(module.w13_weight_packed.shape) == (E, 2 * I, H // 8)  # vLLM's N-first layout
    g = torch.Generator().manual_seed(2)
    want = {}
    for which, (rows, cols) in (("w13", (2 * I, H)), ("w2", (H, I))):
        deq = []
        for e in range(E):
            w = torch.randn(rows, cols, generator=g) * 0.1
            scale = (w.unflatten(-1, (-1, 64)).abs().amax(-1) / 7.5).bfloat16()
            q = quantize(w, scale, torch.zeros_like(scale, dtype=torch.int8), args, dtype=torch.int8)
            getattr(module, f"{which}_weight_packed").data[e].copy_(pack_to_int32(q, 4))
            getattr(module, f"{which}_weight_scale").data[e].copy_(scale)
            deq.append(dequantize(q, scale.float(), None, args, dtype=torch.float32))
        want[which] = torch.stack(deq)
    ptrs = {n: p.data_ptr() for n, p in module.named_parameters()}
    w = host_compute.weights_of(module, "int4")
    assert w.block == (64, 64) and w.w13.data_ptr() == ptrs["w13_weight_packed"]
    assert {n: p.data_ptr() for n, p in module.named_parameters()} == ptrs
    torch.testing.assert_close(ck.reference.dequantize(w, "w13"), want["w13"], rtol=0, atol=0)
    torch.testing.assert_close(ck.reference.dequantize(w, "w2"), want["w2"], rtol=0, atol=0)
    int4_layouts.refuse_unread_int4("g", method)
    method.symmetric = False
    with pytest.raises(PlanError, match="asymmetric"):
        int4_layouts.refuse_unread_int4("g", method)


def awq_layer():
    """AWQ experts in vLLM's AutoAWQMoEMethod create_weights layout (K-first, eight output
    columns per int32 in AWQ's order), quantized with zero points and packed by vLLM's own
    oracle (quantize_weights, awq_pack), and vLLM's dequantized weights."""
    from vllm.model_executor.layers.quantization.auto_awq import AutoAWQConfig, AutoAWQMoEMethod
    from vllm.model_executor.layers.quantization.utils.quant_utils import awq_pack, quantize_weights
    from vllm.scalar_type import scalar_types

    qc = AutoAWQConfig.from_config({"bits": 4, "group_size": 64, "zero_point": True, "quant_method": "awq"})
    method = object.__new__(AutoAWQMoEMethod)
    method.quant_config, method.moe, method.input_dtype = qc, SimpleNamespace(w13_num_shards=2), None
    module = nn.Module()
    AutoAWQMoEMethod.create_weights(method, module, E, H, I, torch.bfloat16)
    g = torch.Generator().manual_seed(4)
    ref = {}
    for which, (rows, cols) in (("w13", (2 * I, H)), ("w2", (H, I))):
        deq = []
        for e in range(E):
            w = (torch.randn(cols, rows, generator=g) * 0.1).bfloat16()  # [K, N], as AWQ holds it
            w_ref, w_q, w_s, w_zp = quantize_weights(w, scalar_types.uint4, 64, zero_points=True)
            getattr(module, f"{which}_qweight").data[e].copy_(awq_pack(w_q, 4, cols, rows))
            getattr(module, f"{which}_qzeros").data[e].copy_(awq_pack(w_zp, 4, cols // 64, rows))
            getattr(module, f"{which}_scales").data[e].copy_(w_s)
            deq.append(w_ref.T.float())
        ref[which] = torch.stack(deq)
    return method, module, ref


def test_vllms_awq_layout_is_rewritten_in_place_with_its_zero_points(monkeypatch):
    monkeypatch.setitem(ck.claimed.CLAIMED, "int4", True)
    method, module, ref = awq_layer()
    assert tuple(module.w13_qweight.shape) == (E, H, 2 * I // 8)  # vLLM's layout: output columns packed
    ptrs = {n: p.data_ptr() for n, p in module.named_parameters()}
    assert host_compute.format_of("g", method, module) == "int4"
    w = host_compute.weights_of(module, "int4", method=method)
    assert w.w13_zeros is not None and w.w13_zeros.data_ptr() == ptrs["w13_qzeros"]
    assert {n: p.data_ptr() for n, p in module.named_parameters()} == ptrs  # no new storage
    torch.testing.assert_close(ck.reference.dequantize(w, "w13"), ref["w13"], rtol=2 ** -8, atol=0)
    torch.testing.assert_close(ck.reference.dequantize(w, "w2"), ref["w2"], rtol=2 ** -8, atol=0)
    x = torch.randn(3, H).bfloat16()
    ids = torch.tensor([[0, 3], [1, 2], [3, 1]], dtype=torch.int32)
    tw = torch.rand(3, 2)
    want = ck.reference.moe_reference(x, ids, tw, ck.ExpertWeights("f32", ref["w13"], ref["w2"]), ck.Activation("silu"))
    got = ck.moe(x, ids, tw, w, ck.Activation("silu"))
    assert float((got - want).abs().max()) <= 5e-2 * float(want.abs().max())
    method.quant_config.zero_point = False
    with pytest.raises(PlanError, match="4-bit AWQ weights without zero points"):
        int4_layouts.refuse_unread_int4("g", method)
