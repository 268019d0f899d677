"""A speculative drafter's own embedding and LM head (routed by class with
``ConstructOnHost((), force=...)``, as the glue does) allocate no device memory: the device
peak grows by the drafter's own layer only; once they are replaced by the target's, their
host storages are freed (weak references to the storages). Without CUDA the meta device
stands in for the GPU where placement is the point (the drafter's own layer)."""

from __future__ import annotations

import gc
import time
from types import SimpleNamespace

import pytest
import torch
from stand_ins import DrafterLike, EmbeddingLike, LMHeadLike

from mechanism import allocated, nbytes, needs_cuda, records, rss_bytes, storage_ptr, storage_ref
from selective_offload.wrappers.construct_on_host import ConstructOnHost

PEAK = "building the drafter grows the device peak by its own layer only"


@pytest.fixture(scope="module")
def drafter(cfg, cuda, device, results):
    """A drafter built under the glue's routing, finished, then given the target's modules
    as vLLM's drafter setup does; what each step left where, as it was then."""
    vocab, hidden = cfg["vocab"], cfg["hidden"]
    # The meta device stands in for the GPU without CUDA: anything not routed lands there.
    target = device if cuda else torch.device("meta")
    shared_bytes = 2 * vocab * hidden * 2
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base = allocated(cuda)
    start = time.perf_counter()
    mode = ConstructOnHost((), force=((LMHeadLike, "lm_head"), (EmbeddingLike, "embed_tokens")))
    with torch.device(target), mode:
        drafter = DrafterLike(vocab, hidden)
    build_s = time.perf_counter() - start
    after_build = allocated(cuda)
    peak_growth = (torch.cuda.max_memory_allocated() - base) if cuda else None
    fc_bytes = nbytes(drafter.fc.weight)
    vocab_names = {n for n, m in drafter.named_modules() if isinstance(m, EmbeddingLike)}
    result = mode.finish(drafter, lambda n: any(n == v or n.startswith(v + ".") for v in vocab_names))
    shared = (drafter.embed_tokens.weight, drafter.lm_head.weight)
    seen = SimpleNamespace(
        target=target, shared_bytes=shared_bytes, fc_bytes=fc_bytes, routed=dict(mode.routed),
        shared_devices=[w.device.type for w in shared], fc_device=drafter.fc.weight.device,
        finish_kept=(result.storages == {storage_ptr(w) for w in shared}
                     and result.moved_back_bytes == 0 and result.left_on_host_bytes == 0),
        finish_storages=len(result.storages), moved_back=result.moved_back_bytes,
        peak_growth=peak_growth, allocated_growth=None if base is None else after_build - base)

    # The load writes the host copies (touch them, so the RSS figure means something).
    for w in shared:
        w.zero_()
    refs = [storage_ref(w) for w in shared]
    del shared, w
    alive = all(r() is not None for r in refs)  # the drafter still holds them
    rss_before = rss_bytes()
    # vLLM's drafter setup: the target's embedding and LM head replace the drafter's.
    with torch.device(target):
        target_embed = EmbeddingLike(vocab, hidden, prefix="model.embed_tokens")
        target_head = LMHeadLike(vocab, hidden, prefix="lm_head")
    start = time.perf_counter()
    drafter.embed_tokens, drafter.lm_head = target_embed, target_head
    gc.collect()
    release_s = time.perf_counter() - start
    rss_after = rss_bytes()
    freed = alive and all(r() is None for r in refs)
    seen.alive, seen.freed = alive, freed
    seen.released, seen.refs = sum(r() is None for r in refs), len(refs)
    seen.reads_target = (drafter.embed_tokens.weight is target_embed.weight
                         and drafter.lm_head.weight.device.type == target.type)
    seen.embed_device = drafter.embed_tokens.weight.device
    out = {"vocab": vocab, "hidden": hidden, "shared_bytes": shared_bytes,
           "routed_bytes": dict(mode.routed), "own_layer_bytes": fc_bytes,
           "device_peak_growth_bytes": peak_growth,
           "device_allocated_growth_bytes": None if base is None else after_build - base,
           "build_s": build_s, "release_s": release_s, "host_storages_released": freed,
           # Informational: RSS depends on the allocator returning pages to the system.
           "rss_drop_bytes_informational": (None if None in (rss_before, rss_after)
                                            else rss_before - rss_after)}
    print(out)
    del drafter, target_embed, target_head
    results["drafter"] = out
    return seen


def test_the_drafters_embedding_and_lm_head_are_built_in_host_memory(drafter, checks):
    d = drafter
    checks.check("drafter's embedding and LM head are built in host memory (force, any prefix)",
                 all(t == "cpu" for t in d.shared_devices)
                 and d.routed == {"lm_head": d.shared_bytes // 2, "embed_tokens": d.shared_bytes // 2},
                 f"{d.shared_devices}, routed {d.routed}")


def test_the_drafters_own_layer_is_built_on_the_device(drafter, checks):
    checks.check("drafter's own layer is built on the device",
                 drafter.fc_device.type == drafter.target.type, f"on {drafter.fc_device}")


def test_finish_keeps_the_shared_weights_on_the_host_and_moves_nothing_back(drafter, checks):
    d = drafter
    checks.check("finish keeps the shared weights on the host and moves nothing back", d.finish_kept,
                 f"{d.finish_storages} storages, moved back {d.moved_back} B")


@records(PEAK)
@needs_cuda("the device peak is the CUDA allocator's")
def test_building_the_drafter_grows_the_device_peak_by_its_own_layer_only(drafter, checks):
    d, bound = drafter, 1 << 20
    checks.check(PEAK, d.peak_growth - d.fc_bytes < bound and d.allocated_growth >= d.fc_bytes,
                 f"peak +{d.peak_growth} B = layer {d.fc_bytes} B + {d.peak_growth - d.fc_bytes} B "
                 f"(< {bound} B; the shared modules are {d.shared_bytes} B)")


def test_replacing_them_by_the_targets_frees_the_host_copies(drafter, checks):
    d = drafter
    checks.check("replacing them by the target's frees the host copies",
                 d.freed, f"held before: {d.alive}; {d.released}/{d.refs} "
                 f"storages released after ({d.shared_bytes} B)")


def test_the_drafter_then_reads_the_targets_device_weights(drafter, checks):
    checks.check("the drafter then reads the target's device weights", drafter.reads_target,
                 f"on {drafter.embed_device}")
