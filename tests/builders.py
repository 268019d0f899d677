"""Small models, checkpoints and plans that several test modules build the same way.

Kept here rather than imported from one test module into another, so a test file can move
between tier folders without breaking its neighbours' imports.
"""

from __future__ import annotations

import copy
import dataclasses

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


#: v4's servings in v3's placements (written here, not taken from the package, so the
#: package's own v3 mapping is checked against an independent one).
_V3_PLACEMENT = {"resident": "device", "gather": "host-cold", "on-demand": "host-cold", "prefetch": "host-hot",
                 "uva": "host-uva", "none": "absent"}


def as_v3(data):
    """The v3 twin of a v4 plan's JSON: ``cls``, ``kind: cold``, ``placement``, ``bulk`` and
    ``bulk_segments``, as selective-offload wrote them before plan format v4."""
    v3 = copy.deepcopy(data)
    v3["format"] = "selective-offload/plan-v3"
    for new, old in (("vllm_cpu_offload_gb", "bulk"), ("vllm_cpu_offload_params", "bulk_segments")):
        if new in v3:
            v3[old] = v3.pop(new)
    if "vllm_cpu_offload_gb" in v3["inputs"]:
        v3["inputs"]["bulk_cpu_offload_gb"] = v3["inputs"].pop("vllm_cpu_offload_gb")
    for g in v3["groups"]:
        g["cls"] = g.pop("role")
        g["kind"] = "cold" if g["kind"] == "component" else g["kind"]
        del g["location"]
        g["placement"] = _V3_PLACEMENT[g.pop("serving")]
    return v3
