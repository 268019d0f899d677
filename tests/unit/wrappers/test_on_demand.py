"""On-demand towers: host-resident between calls, onloaded block by block, exact outputs.

Without CUDA the compute device is the CPU: an "onload" is then a real copy into a fresh
CPU tensor (the same code path as a host-to-device copy, minus the side stream), so the
order of onloads and releases and the transient bytes are observable here.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn

from selective_offload.wrappers import (
    NON_BLOCK,
    OffloadError,
    find_block_list,
    offload_on_demand,
)

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda") if CUDA else torch.device("cpu")
HIDDEN = 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.mlp = nn.Sequential(
            nn.Linear(HIDDEN, 2 * HIDDEN), nn.GELU(), nn.Linear(2 * HIDDEN, HIDDEN)
        )

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class Tower(nn.Module):
    """A small vision-tower-like stack: patch embedding, blocks, final norm, a buffer."""

    def __init__(self, depth: int = 4) -> None:
        super().__init__()
        self.patch_embed = nn.Linear(8, HIDDEN)
        self.blocks = nn.ModuleList(Block() for _ in range(depth))
        self.merger = nn.ModuleList([nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, HIDDEN)])
        self.norm = nn.LayerNorm(HIDDEN)
        self.register_buffer("pos", torch.randn(HIDDEN))

    def forward(self, x):
        x = self.patch_embed(x) + self.pos
        for block in self.blocks:
            x = block(x)
        for layer in self.merger:
            x = layer(x)
        return self.norm(x)


def make_tower(seed: int = 0, depth: int = 4) -> Tower:
    torch.manual_seed(seed)
    tower = Tower(depth)
    for p in tower.parameters():  # LayerNorm starts at 1/0: make every tensor matter
        p.data.normal_()
    return tower.eval()


def nbytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


def inputs(seed: int = 1) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.randn(3, 5, 8)


@pytest.mark.parametrize("mode", [contextlib.nullcontext, torch.inference_mode], ids=["grad", "inference-mode"])
def test_outputs_equal_the_unwrapped_module_call_after_call(mode):
    """vLLM runs the model under torch.inference_mode(); onloaded copies are made there."""
    reference = make_tower().to(DEVICE)
    tower = make_tower()
    offload_on_demand(tower, DEVICE)
    x = inputs().to(DEVICE)
    with mode():
        assert torch.equal(tower(x), reference(x)) and torch.equal(tower(x), reference(x))


def test_tensors_point_at_host_copies_between_calls():
    tower = make_tower()
    handle = offload_on_demand(tower, DEVICE)
    hosts = {id(t): t.data_ptr() for t in [*tower.parameters(), *tower.buffers()]}
    tower(inputs().to(DEVICE))
    after = {id(t): t.data_ptr() for t in [*tower.parameters(), *tower.buffers()]}
    assert after == hosts and handle.transient_device_bytes == 0


def test_all_tensors_are_in_host_memory():
    tower = make_tower().to(DEVICE)
    offload_on_demand(tower, DEVICE)
    assert {t.device.type for t in [*tower.parameters(), *tower.buffers()]} == {"cpu"}


def test_blocks_run_from_onloaded_copies_not_host_memory():
    tower = make_tower()
    handle = offload_on_demand(tower, DEVICE)
    host_ptr = tower.blocks[2].norm.weight.data_ptr()
    seen = []
    tower.blocks[2].register_forward_pre_hook(lambda m, a: seen.append(m.norm.weight.data_ptr()))
    tower(inputs().to(DEVICE))
    assert seen and seen[0] != host_ptr and handle.stats.calls == 1


def test_blocks_are_onloaded_in_order_with_the_next_prefetched():
    tower = make_tower(depth=3)
    handle = offload_on_demand(tower, DEVICE)
    tower(inputs().to(DEVICE))
    assert handle.events == [
        ("onload", NON_BLOCK),
        ("prefetch", "blocks.0"),
        ("prefetch", "blocks.1"),
        ("release", "blocks.0"),
        ("prefetch", "blocks.2"),
        ("release", "blocks.1"),
        ("release", "blocks.2"),
        ("release", NON_BLOCK),
    ]


def test_next_block_is_resident_while_the_current_one_runs():
    tower = make_tower()
    offload_on_demand(tower, DEVICE)
    host_ptr = tower.blocks[2].norm.weight.data_ptr()
    seen = []
    tower.blocks[1].register_forward_hook(
        lambda m, a, o: seen.append(tower.blocks[2].norm.weight.data_ptr())
    )
    tower(inputs().to(DEVICE))
    assert seen[0] != host_ptr


@pytest.mark.parametrize("prefetch,blocks", [(True, 2), (False, 1)])
def test_peak_transient_bytes_are_the_blocks_held_at_once_plus_the_rest(prefetch, blocks):
    tower = make_tower(depth=5)
    block = nbytes(tower.blocks[0])
    rest = nbytes(tower) - 5 * block
    handle = offload_on_demand(tower, DEVICE, prefetch=prefetch)
    tower(inputs().to(DEVICE))
    assert handle.stats.peak_transient_device_bytes == rest + blocks * block


def test_module_without_block_list_is_onloaded_whole():
    mlp = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    handle = offload_on_demand(mlp, DEVICE)
    mlp(torch.randn(2, 8, device=DEVICE))
    assert handle.events == [("onload", NON_BLOCK), ("release", NON_BLOCK)]
    assert handle.stats.peak_transient_device_bytes == nbytes(mlp)


def test_block_list_is_the_largest_list_of_similar_children():
    assert find_block_list(make_tower())[0] == "blocks"


def test_block_list_is_found_below_the_top_level():
    class Wrapper(nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = nn.Module()
            self.encoder.layers = nn.ModuleList(Block() for _ in range(3))

    assert find_block_list(Wrapper())[0] == "encoder.layers"


def test_a_list_of_mixed_children_is_not_a_block_list():
    mixed = nn.Module()
    mixed.layers = nn.ModuleList([nn.Linear(64, 64), nn.LayerNorm(64)])
    assert find_block_list(mixed) is None


def test_blocks_can_be_named_explicitly():
    tower = make_tower()
    handle = offload_on_demand(tower, DEVICE, blocks="merger")
    assert list(handle.group_bytes()) == [NON_BLOCK, "merger.0", "merger.1"]


def test_naming_a_non_list_as_blocks_is_refused():
    with pytest.raises(OffloadError, match="not an nn.ModuleList"):
        offload_on_demand(make_tower(), DEVICE, blocks="norm")


def test_a_tensor_shared_by_two_blocks_stays_onloaded_for_the_whole_call():
    tower = make_tower()
    tower.blocks[3].norm.weight = tower.blocks[0].norm.weight
    reference = copy.deepcopy(tower).to(DEVICE)
    handle = offload_on_demand(tower, DEVICE)
    x = inputs().to(DEVICE)
    assert torch.equal(tower(x), reference(x))
    assert handle.group_bytes()["blocks.0"] < handle.group_bytes()["blocks.1"]


def test_bytes_moved_are_counted_per_call():
    tower = make_tower()
    handle = offload_on_demand(tower, DEVICE)
    x = inputs().to(DEVICE)
    tower(x)
    tower(x)
    stats = handle.stats
    total = nbytes(tower)
    counters = (stats.host_bytes, stats.bytes_moved_last_call, stats.bytes_moved_total, stats.calls)
    assert counters == (total, total, 2 * total, 2)


def test_an_exception_in_forward_still_releases_everything():
    tower = make_tower()
    handle = offload_on_demand(tower, DEVICE)
    with pytest.raises(RuntimeError):
        tower(torch.randn(2, 7, device=DEVICE))  # wrong width for patch_embed
    assert handle.transient_device_bytes == 0


def test_load_state_dict_keeps_host_residency_and_new_values():
    tower = make_tower(seed=0)
    handle = offload_on_demand(tower, DEVICE)
    ptrs = [p.data_ptr() for p in tower.parameters()]
    source = make_tower(seed=5)
    tower.load_state_dict(source.state_dict())
    assert [p.data_ptr() for p in tower.parameters()] == ptrs
    x = inputs()
    expected = source.to(DEVICE)(x.to(DEVICE))
    assert torch.equal(tower(x.to(DEVICE)), expected) and handle.stats.calls == 1


def test_load_state_dict_with_assign_keeps_host_residency():
    tower = make_tower(seed=0)
    handle = offload_on_demand(tower, DEVICE)
    source = make_tower(seed=5)
    tower.load_state_dict(copy.deepcopy(source).to(DEVICE).state_dict(), assign=True)
    x = inputs()
    assert {p.device.type for p in tower.parameters()} == {"cpu"}
    assert torch.equal(tower(x.to(DEVICE)), source.to(DEVICE)(x.to(DEVICE)))
    assert handle.stats.host_bytes == nbytes(tower)


def test_state_dict_is_unchanged_by_offloading():
    tower = make_tower()
    before = {k: v.clone() for k, v in tower.state_dict().items()}
    offload_on_demand(tower, DEVICE)
    after = tower.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[k].cpu(), v) for k, v in before.items())


def test_offloading_twice_with_same_settings_returns_the_same_handle():
    tower = make_tower()
    assert offload_on_demand(tower, DEVICE) is offload_on_demand(tower, DEVICE)


def test_offloading_twice_with_other_settings_is_refused():
    tower = make_tower()
    offload_on_demand(tower, DEVICE)
    with pytest.raises(OffloadError, match="already offloaded"):
        offload_on_demand(tower, DEVICE, prefetch=False)


def test_offloading_a_parent_of_an_offloaded_module_is_refused():
    tower = make_tower()
    offload_on_demand(tower.blocks[0], DEVICE)
    with pytest.raises(OffloadError, match="submodule 'blocks.0'"):
        offload_on_demand(tower, DEVICE)


def test_detach_keeps_the_parameter_objects_and_values():
    tower = make_tower()
    params = list(tower.parameters())
    values = [p.detach().clone() for p in params]
    offload_on_demand(tower, DEVICE).detach()
    assert all(a is b for a, b in zip(tower.parameters(), params))
    assert all(torch.equal(p.detach().cpu(), v) for p, v in zip(params, values))


def test_detach_removes_every_hook():
    tower = make_tower()
    offload_on_demand(tower, DEVICE).detach()
    modules = [tower, *tower.blocks]
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in modules)
    assert not tower._load_state_dict_post_hooks


def test_detach_allows_offloading_again():
    tower = make_tower()
    first = offload_on_demand(tower, DEVICE)
    first.detach()
    assert offload_on_demand(tower, DEVICE) is not first


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device: restoring device placement")
def test_detach_puts_tensors_back_on_their_original_device():
    tower = make_tower().cuda()
    offload_on_demand(tower, "cuda").detach()
    assert {p.device.type for p in tower.parameters()} == {"cuda"}


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device: pinned host memory")
def test_host_copies_are_pinned_on_cuda():
    tower = make_tower()
    offload_on_demand(tower, "cuda")
    assert all(p.is_pinned() for p in tower.parameters())


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device: device memory accounting")
def test_device_memory_returns_to_baseline_after_a_call():
    tower = make_tower()
    offload_on_demand(tower, "cuda")
    x = inputs().cuda()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    out = tower(x)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - before == out.numel() * out.element_size()

