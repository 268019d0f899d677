"""Construction-time routing: cold modules are allocated on the host, never on the device.

The "device" here is PyTorch's meta device, standing in for a GPU that cannot exist on
this machine: a module built under ``with torch.device("meta")`` allocates nothing real,
so any parameter that comes out as a CPU tensor was routed by ConstructOnHost.
"""

from __future__ import annotations

import torch
from torch import nn

from selective_offload.wrappers.construct_on_host import ConstructOnHost


class Linear(nn.Module):
    def __init__(self, n: int, prefix: str = ""):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n, n))
        self.norm = nn.LayerNorm(n)  # built without a prefix of its own


class Embedding(nn.Module):
    def __init__(self, n: int, prefix: str = ""):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(16, n))


class LMHead(Embedding):
    pass


class Tower(nn.Module):
    def __init__(self, prefix: str = ""):
        super().__init__()
        self.blocks = nn.ModuleList(Linear(4, prefix=f"{prefix}.blocks.{i}") for i in range(2))


class Model(nn.Module):
    def __init__(self, prefix: str = ""):
        super().__init__()
        self.embed_tokens = Embedding(8)  # like vLLM's Llama: no prefix passed
        self.visual = Tower(prefix="visual")
        self.visualise = Linear(8, prefix="model.visualise")
        self.layer = Linear(8, prefix="model.layers.0")
        self.lm_head = LMHead(8, prefix="lm_head")


def build(segments, **kwargs):
    with torch.device("meta"):
        mode = ConstructOnHost(segments, **kwargs)
        with mode:
            model = Model()
    return model, mode


def devices(model):
    return {name: p.device.type for name, p in model.named_parameters()}


def test_prefixed_cold_modules_are_built_on_the_host():
    model, mode = build({"visual"})
    got = devices(model)
    assert all(got[n] == "cpu" for n in got if n.startswith("visual."))
    assert got["visualise.weight"] == "meta" and got["layer.weight"] == "meta"
    assert mode.routed == {"visual": 2 * (4 * 4 + 4 + 4) * 4}


def test_unprefixed_embedding_is_routed_by_class_but_the_lm_head_subclass_is_not():
    model, mode = build({"embed_tokens"}, class_segments={Embedding: "embed_tokens"}, never=(LMHead,))
    got = devices(model)
    assert got["embed_tokens.weight"] == "cpu"
    assert got["lm_head.weight"] == "meta"
    assert mode.routed == {"embed_tokens": 16 * 8 * 4}


def test_segments_not_in_the_plan_stay_on_the_device():
    model, mode = build({"audio_tower"}, class_segments={Embedding: "embed_tokens"})
    assert set(devices(model).values()) == {"meta"}
    assert mode.routed == {}


def is_cold_under(*segments):
    return lambda name: any(seg in name.split(".") for seg in segments)


def test_routed_storages_are_exactly_the_cold_parameters_built_on_the_host():
    """The ledger the report uses to tell "built on the host" from "moved after loading":
    it names the storages of the routed parameters, and nothing routed as a temporary."""
    model, mode = build({"visual"})
    result = mode.finish(model, is_cold_under("visual"))
    routed = result.storages
    visual = {p.untyped_storage().data_ptr() for n, p in model.named_parameters() if n.startswith("visual.")}
    assert routed == visual and len(routed) == 6 and result.moved_back_bytes == 0
    # A parameter moved to the host afterwards (a new CPU allocation) is not in the ledger.
    moved = torch.empty(8, 8, device="cpu")
    assert moved.untyped_storage().data_ptr() not in routed


def test_mode_leaves_other_factories_and_explicit_host_tensors_alone():
    with torch.device("meta"), ConstructOnHost({"visual"}):
        x = torch.empty(3)
        y = torch.ones(2, device="cpu")
    assert x.device.type == "meta" and y.device.type == "cpu"


# ---- only the cold module's own tensors stay on the host

_CACHE: dict = {}
_WORKSPACE: list = []


class Rotary(nn.Module):
    """Built through a process-wide cache, as vLLM's get_rope() does: whoever asks first
    builds it, everyone with the same key shares it."""

    def __init__(self):
        super().__init__()
        self.register_buffer("cos_sin_cache", torch.ones(32), persistent=False)


def get_rotary():
    if "rope" not in _CACHE:
        _CACHE["rope"] = Rotary()
    return _CACHE["rope"]


class TowerBlock(nn.Module):
    def __init__(self, prefix: str = ""):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(4, 4))
        self.rotary = get_rotary()
        # An explicit-device workspace kept in a module global, as FlashInfer's ViT one.
        if not _WORKSPACE:
            _WORKSPACE.append(torch.zeros(64, dtype=torch.uint8, device="meta"))
        self.global_table = torch.arange(8.0)  # not a parameter or buffer...
        _CACHE["table"] = self.global_table  # ...but held by a module-global cache


class LanguageLayer(nn.Module):
    def __init__(self, prefix: str = ""):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(4, 4))
        self.rotary = get_rotary()  # the tower built it first: shared


class Shared(nn.Module):
    def __init__(self):
        super().__init__()
        self.visual = TowerBlock(prefix="visual")
        self.layer = LanguageLayer(prefix="model.layers.0")


def test_explicit_devices_and_shared_caches_stay_on_the_device():
    """The tower's own weight is built on the host; an explicit-device workspace is left
    on the device; a cached submodule the tower built first but the language model shares
    goes back to the device after construction. A tensor only a module-global cache holds
    is moved back in place on CUDA; torch cannot swap a storage to the meta device that
    stands in for it here, so here it is reported as left on the host."""
    _CACHE.clear()
    _WORKSPACE.clear()
    with torch.device("meta"):
        mode = ConstructOnHost({"visual"})
        with mode:
            model = Shared()
    assert _WORKSPACE[0].device.type == "meta"
    assert model.visual.weight.device.type == "cpu"
    assert model.layer.rotary is model.visual.rotary  # one module, reachable from both
    assert model.visual.rotary.cos_sin_cache.device.type == "cpu"  # routed while building
    assert _CACHE["table"].device.type == "cpu"
    result = mode.finish(model, is_cold_under("visual"))
    assert model.visual.rotary.cos_sin_cache.device.type == "meta"
    assert model.layer.rotary.cos_sin_cache is model.visual.rotary.cos_sin_cache
    assert model.visual.weight.device.type == "cpu"
    assert result.storages == {model.visual.weight.untyped_storage().data_ptr()}
    assert result.moved_back_bytes == 32 * 4
    assert result.left_on_host_bytes == 8 * 4 and _CACHE["table"].device.type == "cpu"


# ---- an exact module, named by another argument (a MoE layer's routed experts)

class Experts(nn.Module):
    """Like vLLM's RoutedExperts: its prefix arrives as ``layer_name``, and a helper
    without a prefix allocates its weights."""

    def __init__(self, layer_name: str):
        super().__init__()
        self.w13 = nn.Parameter(torch.empty(4, 8, 2))


class MoeLayer(nn.Module):
    def __init__(self, prefix: str):
        super().__init__()
        self.gate = Linear(2, prefix=f"{prefix}.gate")
        self.experts = Experts(f"{prefix}.experts")


def test_an_exact_module_named_by_another_argument_is_built_on_the_host():
    """Only the planned layer's experts: found by the class's ``layer_name``, matched by the
    ``modules`` rule; the layer's gate (its own prefix) and other layers' experts stay."""
    wanted = {"model.layers.1.mlp.experts": "experts-1"}
    with torch.device("meta"):
        mode = ConstructOnHost((), modules=wanted.get, named_by={Experts: "layer_name"})
        with mode:
            layers = [MoeLayer(prefix=f"model.layers.{i}.mlp") for i in range(2)]
    assert layers[1].experts.w13.device.type == "cpu"
    assert layers[0].experts.w13.device.type == "meta" and layers[1].gate.weight.device.type == "meta"
    assert mode.routed == {"experts-1": 4 * 8 * 2 * 4}
