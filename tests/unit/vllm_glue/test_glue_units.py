"""The glue's decisions that a CPU engine cannot reach, checked on vLLM's own classes.

vLLM's CUDA-only branches (the fused tensor-parallel embedding kernel, CUDA graphs,
pipeline-parallel ranks) are never taken by the CPU build's engines, so each is driven
here directly: on vLLM's real ``VocabParallelEmbedding`` and ``CompilationConfig``, with
a stand-in only where the real thing needs a GPU, said in each test.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from selective_offload.errors import PlanError
from selective_offload.options import RunOptions
from selective_offload.vllm_glue.embedding import embedding_mode, graphs_captured, install_host_embedding
from selective_offload.vllm_glue.loading import _attach_tower, is_drafter_load
from selective_offload.vllm_glue.offloader import local_indices, make_exact_prefetch_offloader, stack_name

# ---- tensor parallel: the fused lookup would skip the host gather

def test_a_host_embedding_under_tensor_parallel_takes_the_masked_path(monkeypatch):
    """vLLM's VocabParallelEmbedding as rank 1 of 2 (its rank functions patched: no process
    group here), with ``use_fused_embedding`` on as vLLM sets it on CUDA. The fused kernel
    is CUDA-only, so a stand-in records that it was called. Unwrapped, the layer takes the
    fused path; with the host gather installed it takes the masked path: the gather sees
    shard-local ids and rows of the other shard come out zero."""
    import vllm.model_executor.layers.vocab_parallel_embedding as vpe

    monkeypatch.setattr(vpe, "get_tensor_model_parallel_rank", lambda: 1)
    monkeypatch.setattr(vpe, "get_tensor_model_parallel_world_size", lambda: 2)
    fused_calls = []

    def fused_kernel(*args, **kwargs):
        fused_calls.append(args)
        raise RuntimeError("the fused CUDA kernel")

    monkeypatch.setattr(vpe.ops, "vocab_parallel_embedding", fused_kernel)
    layer = vpe.VocabParallelEmbedding(64, 8)
    layer.reduce_results = False  # no process group to all-reduce over
    with torch.no_grad():
        layer.weight.copy_(torch.arange(32 * 8, dtype=torch.float32).view(32, 8))
    layer.use_fused_embedding = True
    with pytest.raises(RuntimeError, match="fused CUDA kernel"):
        layer(torch.tensor([1, 40]))
    gather, mechanism = install_host_embedding(layer, torch.device("cpu"), "host", None)
    assert layer.use_fused_embedding is False and "fused TP lookup turned off" in mechanism
    out = layer(torch.tensor([1, 40, 63]))
    assert len(fused_calls) == 1 and gather.ledger.calls == 1
    assert out[0].eq(0).all()  # id 1 lives on rank 0
    assert out[1, :2].tolist() == [64.0, 65.0] and out[2, :2].tolist() == [248.0, 249.0]  # local rows 8, 31


# ---- which lookup under which compilation settings

@pytest.mark.parametrize("cudagraph_mode,eager,device,expected", [
    ("NONE", False, "cuda", "host"),            # compiled but no graphs: the host gather is fine
    ("FULL_AND_PIECEWISE", False, "cuda", "uva"),
    ("PIECEWISE", False, "cuda", "uva"),
    ("FULL_AND_PIECEWISE", False, "cpu", "host"),
])
def test_auto_mode_follows_the_cuda_graph_mode_in_force(cudagraph_mode, eager, device, expected):
    from vllm.config import CompilationConfig
    from vllm.config.compilation import CUDAGraphMode

    config = SimpleNamespace(compilation_config=CompilationConfig(cudagraph_mode=CUDAGraphMode[cudagraph_mode]),
                             model_config=SimpleNamespace(enforce_eager=eager))
    assert graphs_captured(config) is (cudagraph_mode != "NONE")
    assert embedding_mode(RunOptions("p"), torch.device(device), config) == expected
    assert embedding_mode(RunOptions("p", embedding_mode="host"), torch.device(device), config) == "host"


# ---- speculative drafters

def test_drafters_are_recognised_as_vllm_recognises_them():
    """The shapes of vLLM 0.33's calls (config objects compared by identity):
    V1 EAGLE/MTP pass the target's VllmConfig and the draft ModelConfig;
    V1 DraftModelProposer and V2 StandaloneAR swap the draft ModelConfig into the VllmConfig
    (v1/spec_decode/draft_model.py:81-112); ngram's draft config is the target's own."""
    target, draft = object(), object()
    spec = SimpleNamespace(draft_model_config=draft, target_model_config=target)
    main = SimpleNamespace(model_config=target, speculative_config=spec)
    assert not is_drafter_load(main, target)
    assert is_drafter_load(main, draft)
    swapped = SimpleNamespace(model_config=draft, speculative_config=spec)
    assert is_drafter_load(swapped, draft)
    ngram = SimpleNamespace(model_config=target,
                            speculative_config=SimpleNamespace(draft_model_config=target, target_model_config=target))
    assert not is_drafter_load(ngram, target)
    assert not is_drafter_load(SimpleNamespace(model_config=target, speculative_config=None), target)


# ---- towers vLLM compiles

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Linear(4, 4)

    def forward(self, x):
        return self.w(x)


class CompiledBlock(Block):
    """Like a class under vLLM's @support_torch_compile: its __call__ goes to forward
    directly, so module hooks never run."""

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)


class Tower(nn.Module):
    def __init__(self, block=Block):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.blocks = nn.ModuleList(block() for _ in range(3))

    def forward(self, x):
        x = self.proj(x)
        for b in self.blocks:
            x = b(x)
        return x


class CompiledTower(Tower):
    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)


def test_a_tower_with_compiled_blocks_onloads_whole():
    wrapper, mechanism = _attach_tower(Tower(CompiledBlock), "visual", torch.device("cpu"))
    assert wrapper.block_list_name is None
    assert mechanism.startswith("on demand, whole: its blocks (CompiledBlock) are compiled by vLLM")
    wrapper, mechanism = _attach_tower(Tower(), "visual", torch.device("cpu"))
    assert mechanism == "on demand, block by block (blocks)"


def test_a_compiled_tower_is_refused():
    with pytest.raises(PlanError, match="visual \\(CompiledTower\\) is compiled by vLLM .* cannot be onloaded on demand"):
        _attach_tower(CompiledTower(), "visual", torch.device("cpu"))


# ---- pipeline parallel and other stacks: which layers the exact offloader takes

def test_global_layer_indices_map_to_each_pipeline_rank():
    plan = [5, 11, 15]
    assert local_indices(plan, 0, 8) == [5]       # rank 0 of 2 holds layers 0-7
    assert local_indices(plan, 8, 16) == [3, 7]   # rank 1 holds 8-15, numbered from 0
    assert stack_name("language_model.model.layers") == stack_name("model.layers") == "layers"
    assert stack_name("model.encoder.layers") == "encoder.layers"


class RecordingPrefetchOffloader:
    """Stands in for vLLM's PrefetchOffloader, whose __init__ creates a CUDA stream: it
    records the modules wrap_modules hands it, as the real one offloads them."""

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.given: list = []

    def wrap_modules(self, modules_generator, prefix=""):
        self.given += list(modules_generator)
        return self.given


def make_layers(num_hidden_layers, prefix, offloader, start_layer, end_layer):
    """The shape of vLLM's make_layers (model_executor/models/utils.py): this rank's
    layers only, handed to wrap_modules as a generator with no indices."""
    return offloader.wrap_modules(f"{prefix}.{i}" for i in range(start_layer, end_layer))


def test_the_offloader_takes_the_plan_layers_of_this_pipeline_rank_only():
    offloader = make_exact_prefetch_offloader(RecordingPrefetchOffloader, [5, 11, 15], 1, "model.layers", 16)
    every = make_layers(16, "language_model.model.layers", offloader, 8, 16)
    assert offloader.given == ["language_model.model.layers.11", "language_model.model.layers.15"]
    assert offloader.local_indices == [3, 7] and len(every) == 8


def test_an_encoder_stack_built_first_is_left_resident():
    """Whisper-style models (and audio towers) build another stack with make_layers before
    the language model's: the plan's decoder indices must not land on it."""
    offloader = make_exact_prefetch_offloader(RecordingPrefetchOffloader, [1, 3], 1, "model.decoder.layers", 4)
    encoder = make_layers(4, "model.encoder.layers", offloader, 0, 4)
    assert offloader.given == [] and len(encoder) == 4
    make_layers(4, "model.decoder.layers", offloader, 0, 4)
    assert offloader.given == ["model.decoder.layers.1", "model.decoder.layers.3"]
    make_layers(4, "model.decoder.layers", offloader, 0, 4)  # a second call: left resident
    assert len(offloader.given) == 2


def test_a_wrap_modules_call_from_outside_make_layers_is_never_the_plan_stack():
    """Ultravox builds its Whisper tower's layers with wrap_modules directly (no make_layers
    frame), before the language model, and with as many layers: it stays resident, and the
    language model's stack built next by make_layers takes the plan's hot layers."""
    offloader = make_exact_prefetch_offloader(RecordingPrefetchOffloader, [1], 1, "model.layers", 4)
    tower = offloader.wrap_modules(iter(["whisper.0", "whisper.1", "whisper.2", "whisper.3"]))
    assert offloader.given == [] and len(tower) == 4 and offloader._wrapped is None
    make_layers(4, "language_model.model.layers", offloader, 0, 4)
    assert offloader.given == ["language_model.model.layers.1"]


def test_an_eagle_drafter_that_owns_its_embedding_keeps_it_on_the_device(monkeypatch):
    """vLLM's EAGLE drafters set has_own_embed_tokens / has_own_lm_head while loading when
    their checkpoint has them; vLLM may then keep them and compares them with the target's
    on one device. Those leave the host-routed set (and go to the device; the CPU here);
    a drafter without the flags keeps both routed, to be replaced by the target's."""
    import vllm.model_executor.layers.vocab_parallel_embedding as vpe

    from selective_offload.vllm_glue.host_resident import HostResident
    from selective_offload.vllm_glue.loading import _keep_what_the_drafter_owns

    monkeypatch.setattr(vpe, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(vpe, "get_tensor_model_parallel_world_size", lambda: 1)

    class Drafter(nn.Module):
        def __init__(self, **flags):
            super().__init__()
            self.model = nn.Module()
            self.model.embed_tokens = vpe.VocabParallelEmbedding(64, 8)
            self.lm_head = vpe.ParallelLMHead(64, 8)
            for k, v in flags.items():
                setattr(self, k, v)

    def session_for(drafter):
        routed = HostResident()
        routed.add("lm_head", drafter.lm_head)
        routed.add("model.embed_tokens", drafter.model.embed_tokens)
        return SimpleNamespace(
            targets=SimpleNamespace(ParallelLMHead=vpe.ParallelLMHead, VocabParallelEmbedding=vpe.VocabParallelEmbedding),
            drafter_routed=routed, drafter_routed_modules=["lm_head", "model.embed_tokens"])

    mtp = Drafter()
    s = session_for(mtp)
    _keep_what_the_drafter_owns(s, mtp, torch.device("cpu"))
    assert s.drafter_routed_modules == ["lm_head", "model.embed_tokens"] and len(s.drafter_routed) == 2
    eagle = Drafter(has_own_embed_tokens=True, has_own_lm_head=False)
    s = session_for(eagle)
    # vLLM's post-processing may give the weights new storage (device_loading_context's
    # copy back): the routed modules are still recognised (tracked as objects, not addresses).
    for p in eagle.parameters():
        p.data = p.data.clone()
    _keep_what_the_drafter_owns(s, eagle, torch.device("cpu"))
    assert s.drafter_routed_modules == ["lm_head"]
    assert [n for n, _ in s.drafter_routed.params(eagle)] == ["lm_head.weight"]
