"""Small models, checkpoints and plans that several test modules build the same way.

Kept here rather than imported from one test module into another, so a test file can move
between tier folders without breaking its neighbours' imports.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from selective_offload.checkpoint import Checkpoint, TensorInfo, tensor_nbytes
from selective_offload.planner import PlanInputs, make_plan
from selective_offload.probe import Profile
from selective_offload.sizes import GiB

MiB = 1 << 20

# ------------------------------------------------------------ checkpoints in round numbers

MB = 1_000_000


def make_ckpt(spec: dict[str, tuple[str, list[int]]], **config) -> Checkpoint:
    tensors = {n: TensorInfo(n, d, tuple(s), tensor_nbytes(d, s)) for n, (d, s) in spec.items()}
    return Checkpoint("test", "manifest", tensors, {"tie_word_embeddings": False, **config})


def toy(layers: int = 8, *, vision: bool = True, mtp: bool = True, **config) -> Checkpoint:
    """A model in round numbers: embed/lm_head 100 MB each, layers 50 MB, visual 40 MB
    (4 blocks of 9 MB + 4 MB), mtp 30 MB. All BF16 (2 bytes per element)."""
    spec = {
        "model.embed_tokens.weight": ("BF16", [1000, 50_000]),
        "lm_head.weight": ("BF16", [1000, 50_000]),
        "model.norm.weight": ("BF16", [500]),
    }
    for i in range(layers):
        spec[f"model.layers.{i}.mlp.w.weight"] = ("BF16", [1000, 25_000])
    if vision:
        for b in range(4):
            spec[f"model.visual.blocks.{b}.w"] = ("BF16", [1000, 4500])
        spec["model.visual.merger.w"] = ("BF16", [1000, 2000])
    if mtp:
        spec["mtp.layers.0.w"] = ("BF16", [1000, 15_000])
    return make_ckpt(spec, **config)


def inputs(budget_mb: float, **kw) -> PlanInputs:
    """Inputs of a ``budget_mb`` card with nothing kept back. Host-compute is off unless asked
    for (``host_compute=True``): the tests built on this helper are about the UVA and prefetch
    menu; tests/unit/planner/test_host_compute.py prices host-compute."""
    kw.setdefault("host_compute", False)
    return PlanInputs(device_memory_bytes=int(budget_mb * MB), kv_cache_bytes=0, reserve_bytes=0, **kw)


# ------------------------------------------------- a torch model and its checkpoint names

class Layer(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.qkv_proj = nn.Linear(n, 3 * n, bias=False)  # fused, as vLLM loads q/k/v


class Inner(nn.Module):
    def __init__(self, n, layers):
        super().__init__()
        self.embed_tokens = nn.Embedding(64, n)
        self.layers = nn.ModuleList(Layer(n) for _ in range(layers))
        self.visualise = nn.Linear(n, n, bias=False)  # not the `visual` tower: hot, on the device


class Model(nn.Module):
    def __init__(self, n=16, layers=4):
        super().__init__()
        self.model = Inner(n, layers)
        self.visual = nn.Sequential(nn.Linear(n, n), nn.Linear(n, n))
        self.lm_head = nn.Linear(n, 64, bias=False)


def checkpoint_of(n=16, layers=4, dtype="F32") -> Checkpoint:
    """Checkpoint names as Hugging Face writes them (separate q/k/v, model.visual)."""
    spec = {"model.embed_tokens.weight": [64, n], "lm_head.weight": [64, n], "model.visualise.weight": [n, n]}
    for i in range(layers):
        for proj in ("q_proj", "k_proj", "v_proj"):
            spec[f"model.layers.{i}.self_attn.{proj}.weight"] = [n, n]
    for i in range(2):
        spec[f"model.visual.{i}.weight"] = [n, n]
        spec[f"model.visual.{i}.bias"] = [n]
    tensors = {k: TensorInfo(k, dtype, tuple(v), tensor_nbytes(dtype, v)) for k, v in spec.items()}
    return Checkpoint("test", "manifest", tensors, {"tie_word_embeddings": False, "num_hidden_layers": layers})


def plan_for(ckpt, **kw):
    return make_plan(ckpt, PlanInputs(device_memory_bytes=ckpt.total_bytes, kv_cache_bytes=0,
                                      reserve_bytes=0, all_cold=True, **kw))


def cold_ids(model):
    return {id(p) for p in [*model.model.embed_tokens.parameters(), *model.visual.parameters()]}


# ---------------------------------------- the layouts vLLM 0.33 post-processes weights into

V033 = "vllm 0.33.0 vllm/"  # the prefix of each ``where`` below (the CUDA wheel's sources)


@dataclass(frozen=True)
class LayoutCase:
    """One layout a post-processed weight has in vLLM 0.33, built here with random values.

    ``where`` is the file and line that makes the layout. ``oracle`` names the function of
    vLLM 0.33 that tests/contract/vllm_layouts.py runs on the CPU with these ``dims`` (its
    result must have exactly this layout); without one, the layout is written down from the
    source (it needs a GPU, ROCm or DeepGEMM's compiled library to run).
    """

    name: str
    method: str
    where: str
    build: Callable[[dict], "torch.Tensor"]
    dims: dict = field(default_factory=dict)
    oracle: str | None = None

    def tensor(self) -> "torch.Tensor":
        return self.build(self.dims)


def _rand(shape, dtype, seed=0):
    import torch

    gen = torch.Generator().manual_seed(seed)
    if dtype in (torch.int32, torch.int8, torch.uint8):
        lo, hi = (-100, 100) if dtype != torch.uint8 else (0, 255)
        return torch.randint(lo, hi, shape, generator=gen, dtype=dtype)
    return torch.randn(shape, generator=gen).to(dtype)


def _fp8():
    import torch

    return torch.float8_e4m3fn


def _packed_ue8m0(d):
    """DeepGEMM's get_mn_major_tma_aligned_packed_ue8m0_tensor: int32 (g, mn, ceil(sf_k/4)),
    strides (packed_k * align(mn, 4), 1, align(mn, 4)), squeezed for one group."""
    import torch

    g, mn, packed_k = d["groups"], d["mn"], -(-d["sf_k"] // 4)
    aligned = -(-mn // 4) * 4
    base = _rand((g * packed_k * aligned,), torch.int32, 3)
    out = base.as_strided((g, mn, packed_k), (packed_k * aligned, 1, aligned))
    return out.squeeze(0) if d["squeeze"] else out


def _layout_cases() -> list[LayoutCase]:
    import torch

    bf16, f32 = torch.bfloat16, torch.float32
    return [
        LayoutCase("unquantized-linear", "UnquantizedLinearMethod (weights left as loaded)",
                   V033 + "model_executor/layers/linear.py:207", lambda d: _rand((96, 64), bf16)),
        LayoutCase("fp8-per-tensor-weight", "Fp8LinearMethod, per-tensor (CUTLASS / torch._scaled_mm): (K, N) = .t()",
                   V033 + "model_executor/layers/quantization/utils/fp8_utils.py:1478",
                   lambda d: _rand((d["n"], d["k"]), _fp8()).t(), dict(n=512, k=256, shards=2), "fp8_tensor"),
        LayoutCase("fp8-per-tensor-scale", "Fp8LinearMethod, per-tensor: the shards' max scale, 0-d",
                   V033 + "model_executor/layers/quantization/utils/w8a8_utils.py:79",
                   lambda d: _rand((), f32), dict(n=512, k=256, shards=2), "fp8_tensor_scale"),
        LayoutCase("fp8-channel-weight", "compressed-tensors W8A8 FP8 per-channel: (K, N) = .t()",
                   V033 + "model_executor/layers/quantization/utils/fp8_utils.py:1497",
                   lambda d: _rand((d["n"], d["k"]), _fp8()).t(), dict(n=384, k=128), "fp8_channel"),
        LayoutCase("channelwise-scale", "CUTLASS/Triton scaled_mm, a fused module's per-tensor scales per channel",
                   V033 + "model_executor/layers/quantization/utils/w8a8_utils.py:61",
                   lambda d: _rand((sum(d["widths"]), 1), f32), dict(widths=[64, 32, 32]), "channelwise"),
        LayoutCase("fp8-block-weight", "Fp8LinearMethod, block-wise (Triton/CUTLASS block kernels)",
                   V033 + "model_executor/layers/quantization/utils/fp8_utils.py:1500",
                   lambda d: _rand((d["n"], d["k"]), _fp8()), dict(n=512, k=256), "fp8_block"),
        LayoutCase("fp8-block-scale", "Fp8LinearMethod, block-wise: fp32 (N/128, K/128) scales",
                   V033 + "model_executor/layers/quantization/utils/fp8_utils.py:1500",
                   lambda d: _rand((d["n"] // 128, d["k"] // 128), f32), dict(n=512, k=256), "fp8_block_scale"),
        LayoutCase("cutlass-padded-fp8-weight", "CutlassFP8ScaledMMLinearKernel: K and N padded to 16, column-major",
                   V033 + "model_executor/kernels/linear/scaled_mm/cutlass.py:218",
                   lambda d: _rand((-(-d["n"] // 16) * 16, -(-d["k"] // 16) * 16), _fp8()).t(),
                   dict(n=90, k=120), "cutlass_padded"),
        LayoutCase("int8-w8a8-weight", "CutlassInt8ScaledMMLinearKernel (compressed-tensors W8A8 INT8): .t()",
                   V033 + "model_executor/kernels/linear/scaled_mm/cutlass.py:55",
                   lambda d: _rand((d["n"], d["k"]), torch.int8).t(), dict(n=256, k=128)),
        LayoutCase("deepgemm-ue8m0-scale", "DeepGEMM block FP8 linear on SM100/SM120: packed UE8M0, MN-major, "
                   "TMA-aligned (padding between columns)",
                   V033 + "utils/deep_gemm.py:587 (transform_sf_into_required_layout, from fp8_utils.py:1185); "
                   "the layout is DeepGEMM's csrc/jit_kernels/impls/smxx_layout.hpp "
                   "get_mn_major_tma_aligned_packed_ue8m0_tensor", _packed_ue8m0,
                   dict(groups=1, mn=250, sf_k=10, squeeze=True)),
        LayoutCase("deepgemm-moe-ue8m0-scale", "DeepGEMM block FP8 MoE on SM100/SM120: the grouped packed scales",
                   V033 + "model_executor/layers/quantization/utils/fp8_utils.py:1263 (prepare_fp8_moe_layer_for_"
                   "deepgemm); DeepGEMM's smxx_layout.hpp as above", _packed_ue8m0,
                   dict(groups=4, mn=250, sf_k=8, squeeze=False)),
        LayoutCase("rocm-padded-fp8-weight", "Fp8LinearMethod on ROCm (VLLM_ROCM_FP8_PADDING): a padded row sliced "
                   "back, then .t(): gaps between columns",
                   V033 + "model_executor/layers/quantization/utils/fp8_utils.py:1291",
                   lambda d: _rand((d["n"], d["k"] + 256), _fp8())[..., :d["k"]].t(), dict(n=64, k=512)),
        LayoutCase("unquantized-moe-weight", "UnquantizedFusedMoEMethod (Triton): (E, 2I, H), copied back in place",
                   V033 + "model_executor/layers/fused_moe/unquantized_fused_moe_method.py:224",
                   lambda d: _rand((4, 128, 64), bf16)),
        LayoutCase("rocm-padded-moe-weight", "UnquantizedFusedMoEMethod on ROCm (VLLM_ROCM_MOE_PADDING): sliced rows",
                   V033 + "model_executor/layers/fused_moe/unquantized_fused_moe_method.py:161",
                   lambda d: _rand((4, 64, 256 + 128), bf16)[..., :256]),
        LayoutCase("fp8-moe-weight", "Fp8MoEMethod, per-tensor (Triton): w13 requantized in place",
                   V033 + "model_executor/layers/quantization/utils/fp8_utils.py:1537",
                   lambda d: _rand((d["e"], 2 * d["i"], d["h"]), _fp8()), dict(e=4, i=64, h=128), "fp8_moe"),
        LayoutCase("fp8-moe-scale", "Fp8MoEMethod, per-tensor (Triton): one scale per expert, the shards' max",
                   V033 + "model_executor/layers/quantization/utils/fp8_utils.py:1545",
                   lambda d: _rand((d["e"],), f32), dict(e=4, i=64, h=128), "fp8_moe_scale"),
        LayoutCase("fp8-block-moe-scale", "Fp8MoEMethod, block-wise (Triton): fp32 (E, 2I/128, H/128), as created",
                   V033 + "model_executor/layers/quantization/fp8.py:615",
                   lambda d: _rand((4, 2, 1), f32)),
        # Not produced by an accepted method of vLLM 0.33; the invariant covers them all the same.
        LayoutCase("sliced-with-offset", "a slice of a larger storage (offset and gaps)", "-",
                   lambda d: _rand((10, 12), f32)[3:7, 2:9]),
        LayoutCase("expanded", "stride 0 (an expanded scale): the span is one element per expanded run", "-",
                   lambda d: _rand((4, 1), f32).expand(4, 8)),
        LayoutCase("overlapping", "rows that overlap (as_strided): the span is shorter than the elements", "-",
                   lambda d: _rand((20,), bf16).as_strided((6, 4), (2, 1), 1)),
    ]


#: Every layout the layout invariant is tested over (tests/unit/wrappers/test_layout.py).
LAYOUT_CASES = _layout_cases()


# ------------------------------------------------------------------ a GPU-shaped profile

def gpu_profile(**changes) -> Profile:
    """A hand-written H200-like profile (what a probe on a GPU writes)."""
    base = Profile(
        machine="Intel(R) Xeon(R) Platinum 8480+ (x86_64)", date="2026-12-01T10:00:00+00:00",
        torch_version="2.9.0+cu128", device="NVIDIA H200", integrated=False,
        link_gbps_pinned=52.3, link_gbps_pageable=19.8, vram_gbps=3900.0,
        device_memory_total_bytes=150_119_071_744, device_memory_free_bytes=149_000_000_000,
        host_memcpy_gbps=20.5, no_link_reason=None,
        h2d_pinned_samples_s={64 * MiB: 0.0013, GiB: 0.0205},
        h2d_pageable_samples_s={64 * MiB: 0.0035, GiB: 0.0542},
        d2d_samples_s={64 * MiB: 0.000036, GiB: 0.000551},
        host_memcpy_samples_s={64 * MiB: 0.0066, GiB: 0.105},
        repeats=5,
    )
    return dataclasses.replace(base, **changes)
