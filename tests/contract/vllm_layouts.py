"""Run vLLM's own post-processing functions on the CPU and print the layouts they leave.

Run in a subprocess with vLLM 0.33's sources first on ``sys.path`` (see
tests/contract/test_vllm_layouts.py); prints one JSON object: oracle name -> dtype, shape,
stride, storage offset, for the ``dims`` of each ``builders.LAYOUT_CASES`` entry. Where a
function calls a CUDA op only to quantize values (``ops.scaled_fp8_quant``), a torch
stand-in computes them (named below); the layout is vLLM's own code's.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from builders import LAYOUT_CASES  # noqa: E402


def scaled_fp8_quant_stand_in(x, scale=None, *args, **kwargs):
    """Stands for the CUDA op: values only, contiguous output as the op allocates it."""
    return (x / scale).to(torch.float8_e4m3fn), scale


def main() -> None:
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.quantization.utils import fp8_utils
    from vllm.model_executor.layers.quantization.utils.w8a8_utils import convert_to_channelwise

    ops.scaled_fp8_quant = scaled_fp8_quant_stand_in
    fp8 = torch.float8_e4m3fn

    def w(d):
        return torch.randn(d["n"], d["k"]).to(fp8)

    def tensor(d):
        return fp8_utils.process_fp8_weight_tensor_strategy(w(d), torch.rand(d["shards"]) + 0.5,
                                                            [d["n"] // d["shards"]] * d["shards"])

    def moe(d):
        return fp8_utils.process_fp8_weight_tensor_strategy_moe(
            torch.randn(d["e"], 2 * d["i"], d["h"]).to(fp8), torch.rand(d["e"], 2) + 0.5, d["i"], d["e"],
            is_act_and_mul=True)

    def cutlass_padded(d):
        from types import SimpleNamespace

        from vllm.model_executor.kernels.linear.scaled_mm.cutlass import CutlassFP8ScaledMMLinearKernel as K

        layer = torch.nn.Module()
        layer.weight = torch.nn.Parameter(w(d).t(), requires_grad=False)  # (K, N), as the method leaves it
        layer.weight_scale = torch.nn.Parameter(torch.rand(()), requires_grad=False)
        me = SimpleNamespace(layer_param_names=("weight", "weight_scale", "input_scale", "input_scale_ub"),
                             padded_weight_loader=K.padded_weight_loader, _pad_to_alignment=K._pad_to_alignment)
        K.process_weights_after_loading(me, layer)
        return layer.weight.data

    oracles = {
        "fp8_tensor": lambda d: tensor(d)[0],
        "fp8_tensor_scale": lambda d: tensor(d)[1],
        "fp8_channel": lambda d: fp8_utils.process_fp8_weight_channel_strategy(w(d), torch.rand(d["n"], 1))[0],
        "channelwise": lambda d: convert_to_channelwise(torch.rand(len(d["widths"])), d["widths"]),
        "fp8_block": lambda d: fp8_utils.process_fp8_weight_block_strategy(w(d), torch.rand(d["n"] // 128,
                                                                                             d["k"] // 128))[0],
        "fp8_block_scale": lambda d: fp8_utils.process_fp8_weight_block_strategy(
            w(d), torch.rand(d["n"] // 128, d["k"] // 128))[1],
        "cutlass_padded": cutlass_padded,
        "fp8_moe": lambda d: moe(d)[0],
        "fp8_moe_scale": lambda d: moe(d)[1],
    }
    out = {}
    for case in LAYOUT_CASES:
        if case.oracle is None:
            continue
        try:
            t = oracles[case.oracle](case.dims)
            out[case.oracle] = dict(dtype=str(t.dtype), shape=list(t.shape), stride=list(t.stride()),
                                    offset=t.storage_offset())
        except Exception as e:  # reported, and the test fails on it
            out[case.oracle] = dict(error=f"{type(e).__name__}: {e}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
