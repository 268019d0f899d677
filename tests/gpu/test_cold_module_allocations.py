"""Inside a cold (``visual``) module, an explicit-device workspace stays on the device, a
rotary module from a process-wide cache that a hot layer shares and a tensor only a
module-global cache holds go back to the device at ``finish`` (in place), the module's own
weight stays in pinned host memory, and ``finish`` reports the bytes it moved back, which
is what device memory grows by. Without CUDA the meta device stands in for the GPU; torch
cannot swap a storage to meta in place, so there the globally held tensor is checked to be
reported as left on the host instead."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import stand_ins
import torch
from stand_ins import SharedModel

from mechanism import allocated, needs_cuda, records, storage_ptr
from selective_offload.wrappers.construct_on_host import ConstructOnHost

MOVED_BACK = "finish reports the bytes it moved back"
PINNED = "cold module's own weight is pinned"
GLOBAL_IN_PLACE = "tensor held only by a module-global cache is moved back in place"
CONSTRUCTION = "construction allocates only the workspace and the hot layer on the device"
FINISH_GROWTH = "device memory grows at finish by the bytes reported moved back"


def clear_caches() -> None:
    stand_ins.ROPE_CACHE.clear()
    stand_ins.WORKSPACE.clear()
    stand_ins.GLOBAL_TABLES.clear()


@pytest.fixture(scope="module")
def cold_module(cfg, cuda, device, results):
    """A model whose cold module is built first (so it builds the shared caches), routed,
    then finished; where each tensor was right after ``finish``."""
    target = device if cuda else torch.device("meta")
    clear_caches()
    workspace_bytes = cfg["workspace_bytes"]
    cold_bytes = cfg["cold_rows"] * cfg["cold_cols"] * 2
    hot_bytes = cfg["hot_rows"] * cfg["hot_cols"] * 2
    rope_bytes = cfg["rope_positions"] * cfg["rope_dim"] * 4
    table_bytes = cfg["table_elems"] * 4
    base = allocated(cuda)
    start = time.perf_counter()
    mode = ConstructOnHost({"visual"}, pin_memory=cuda)
    with torch.device(target), mode:
        model = SharedModel(cfg, target)
    build_s = time.perf_counter() - start
    after_build = allocated(cuda)
    table = stand_ins.GLOBAL_TABLES["table"]
    routed_rope = model.visual.rotary.cos_sin_cache.device.type == "cpu"
    start = time.perf_counter()
    result = mode.finish(model, lambda n: "visual" in n.split("."))
    finish_s = time.perf_counter() - start
    after_finish = allocated(cuda)
    workspace = stand_ins.WORKSPACE[0]
    rope = model.visual.rotary.cos_sin_cache
    seen = SimpleNamespace(
        cuda=cuda, target=target, workspace_device=workspace.device,
        weight_device=model.visual.weight.device,
        weight_routed=(model.visual.weight.device.type == "cpu"
                       and result.storages == {storage_ptr(model.visual.weight)}),
        weight_pinned=model.visual.weight.is_pinned() if cuda else None,
        rope_device=rope.device,
        rope_shared=(routed_rope and rope.device.type == target.type
                     and model.layer.rotary is model.visual.rotary
                     and stand_ins.ROPE_CACHE[(cfg["rope_positions"], cfg["rope_dim"])] is model.visual.rotary
                     and model.layer.rotary.cos_sin_cache is rope),
        table_device=table.device, table_same=stand_ins.GLOBAL_TABLES["table"] is table,
        moved_back=result.moved_back_bytes, left_on_host=result.left_on_host_bytes,
        rope_bytes=rope_bytes, table_bytes=table_bytes, cold_bytes=cold_bytes,
        workspace_bytes=workspace_bytes, hot_bytes=hot_bytes,
        build_growth=None if base is None else after_build - base,
        finish_growth=None if base is None else after_finish - after_build)
    out = {"cold_weight_bytes": cold_bytes, "hot_weight_bytes": hot_bytes,
           "workspace_bytes": workspace_bytes, "rope_cache_bytes": rope_bytes,
           "global_table_bytes": table_bytes, "routed_bytes": dict(mode.routed),
           "moved_back_bytes": result.moved_back_bytes,
           "left_on_host_bytes": result.left_on_host_bytes,
           "device_growth_at_construction_bytes": None if base is None else after_build - base,
           "device_growth_at_finish_bytes": None if base is None else after_finish - after_build,
           "build_s": build_s, "finish_s": finish_s}
    print(out)
    del model, workspace, rope, table
    clear_caches()
    results["explicit_device"] = out
    return seen


def test_an_explicit_device_workspace_inside_a_cold_module_stays_on_the_device(cold_module, checks):
    c = cold_module
    checks.check("explicit-device workspace inside a cold module stays on the device",
                 c.workspace_device.type == c.target.type,
                 f"on {c.workspace_device}" + ("" if c.cuda else " (meta stands in for the GPU)"))


def test_the_cold_modules_own_weight_is_built_in_host_memory(cold_module, checks):
    checks.check("cold module's own weight is built in host memory", cold_module.weight_routed,
                 f"on {cold_module.weight_device}")


@records(PINNED)
@needs_cuda("pinned host memory is CUDA's")
def test_the_cold_modules_own_weight_is_pinned(cold_module, checks):
    checks.check(PINNED, cold_module.weight_pinned)


def test_a_shared_cached_rotary_buffer_is_back_on_the_device_after_finish(cold_module, checks):
    checks.check("shared cached rotary module's buffer is back on the device after finish",
                 cold_module.rope_shared,
                 f"built on the host (cold module first), now on {cold_module.rope_device}, one object")


@records(GLOBAL_IN_PLACE)
@needs_cuda("torch cannot swap a storage to the meta device in place, which stands in for the GPU without one")
def test_a_tensor_held_only_by_a_module_global_cache_is_moved_back_in_place(cold_module, checks):
    c = cold_module
    checks.check(GLOBAL_IN_PLACE, c.table_same and c.table_device.type == "cuda",
                 f"on {c.table_device}, the same object")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here: the tensor is moved back in place instead")
def test_without_cuda_a_globally_held_tensor_is_reported_as_left_on_the_host(cold_module, checks):
    c = cold_module
    checks.check("tensor held only by a module-global cache is reported as left on the host "
                 "(meta cannot swap storage in place)",
                 c.left_on_host == c.table_bytes and c.table_device.type == "cpu",
                 f"{c.left_on_host} B")


def test_finish_reports_the_bytes_it_moved_back(cold_module, checks):
    c = cold_module
    if c.cuda:
        checks.check(MOVED_BACK, c.moved_back == c.rope_bytes + c.table_bytes and c.left_on_host == 0,
                     f"{c.moved_back} B = rope {c.rope_bytes} + table {c.table_bytes}")
    else:  # the global table stays on the host (above): only the rotary cache moves back
        checks.check(MOVED_BACK, c.moved_back == c.rope_bytes, f"{c.moved_back} B = rope {c.rope_bytes} B")


@records(CONSTRUCTION)
@needs_cuda("device memory is counted by the CUDA allocator")
def test_construction_allocates_only_the_workspace_and_the_hot_layer_on_the_device(cold_module, checks):
    c, bound = cold_module, 1 << 20
    checks.check(CONSTRUCTION, 0 <= c.build_growth - (c.workspace_bytes + c.hot_bytes) < bound,
                 f"+{c.build_growth} B vs {c.workspace_bytes + c.hot_bytes} B "
                 f"(cold weight {c.cold_bytes} B, rope {c.rope_bytes} B routed)")


@records(FINISH_GROWTH)
@needs_cuda("device memory is counted by the CUDA allocator")
def test_device_memory_grows_at_finish_by_the_bytes_reported_moved_back(cold_module, checks):
    c, bound = cold_module, 1 << 20
    checks.check(FINISH_GROWTH, abs(c.finish_growth - c.moved_back) < bound,
                 f"+{c.finish_growth} B vs {c.moved_back} B")
