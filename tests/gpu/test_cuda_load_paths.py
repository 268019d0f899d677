"""The CUDA load paths the CPU build never takes (issue 16): memory registered with
``cudaHostRegister`` reads as pinned and vLLM's (or torch's) UVA view reads it in place (a
host write shows through; no device or torch-pinned bytes added); vLLM's
``device_loading_context`` on a host embedding is run and its effect recorded (new storage?
pinned? torch-pinned bytes added), then the same post-processing with ``keep_on_host``
leaves storage and pinned bytes alone; the exact prefetch offloader over small layers
leaves nothing in torch's pinned cache after ``post_init`` and the hot layers registered
within 1.05x of their bytes, and they compute what the resident layers do. All need CUDA;
all but the first need vLLM too (skipped, with that reason, where it is not importable)."""

from __future__ import annotations

import gc
import json
from types import SimpleNamespace

import pytest
import torch
from stand_ins import make_layers
from torch import nn

from mechanism import (
    NO_VLLM_REASON,
    host_allocator_bytes,
    host_empty_cache,
    nbytes,
    needs_cuda,
    records,
    storage_ptr,
)
from selective_offload.wrappers import cuda_view_of_pinned
from selective_offload.wrappers.page_locked import PageLockedLedger, PinPolicy

CUDA_PATH_CHECKS = (
    "registered memory is_pinned and its UVA view reads it in place (no private copy)",
    "vLLM's device_loading_context on a host embedding: storage and pinned bytes recorded",
    "keep_on_host: vLLM's post-processing leaves a host embedding's storage and pinned bytes alone",
    "hot layers after the exact prefetch offloader's post_init: page-locked within 1.05x, torch's cache empty",
    "hot layers after post_init compute what the resident layers do",
)


def _vllm_patched_tp():
    """vLLM's layer modules with a one-rank tensor-parallel group (no process group here)."""
    import vllm.model_executor.layers.vocab_parallel_embedding as vpe
    import vllm.model_executor.parameter as parameter

    for module in (vpe, parameter):
        module.get_tensor_model_parallel_rank = lambda: 0
        module.get_tensor_model_parallel_world_size = lambda: 1
    return vpe


def registration_and_view(cfg: dict, device: torch.device, seen: SimpleNamespace, out: dict) -> None:
    """1. cudaHostRegister in place, is_pinned(), and a UVA view with no private copy."""
    n = cfg["vocab"] * cfg["hidden"] // 8
    table = torch.empty(n, dtype=torch.bfloat16)
    table.copy_(torch.arange(n, dtype=torch.float32).remainder_(251).to(torch.bfloat16))
    ledger = PageLockedLedger(PinPolicy.decide(cuda=True))
    host_empty_cache()
    host_before, dev_before = host_allocator_bytes(), torch.cuda.memory_allocated(device)
    ledger.lock(table, "table")
    pinned = table.is_pinned()
    try:
        try:
            from vllm.utils.torch_utils import get_accelerator_view_from_cpu_tensor as view_of
            out["uva_view_by"] = "vllm"
        except ImportError:
            view_of, out["uva_view_by"] = cuda_view_of_pinned, "torch"
        view = view_of(table)
        torch.cuda.synchronize()
        table[0] = 7.0  # a write on the host must show through the view: the same memory
        in_place = (view.device.type == "cuda" and view.data_ptr() == table.data_ptr()
                    and float(view[0].item()) == 7.0 and torch.equal(view[1:4096].cpu(), table[1:4096]))
        out["uva"] = {"bytes": n * 2, "is_pinned": pinned, "same_address": view.data_ptr() == table.data_ptr(),
                      "torch_pinned_delta": (host_allocator_bytes() or 0) - (host_before or 0),
                      "device_allocated_delta": torch.cuda.memory_allocated(device) - dev_before}
        seen.uva = (pinned and in_place and out["uva"]["torch_pinned_delta"] == 0
                    and out["uva"]["device_allocated_delta"] == 0, json.dumps(out["uva"]))
        del view
    except Exception as err:  # noqa: BLE001 - a failed check; the run goes on
        seen.uva = (False, repr(err))
    ledger.unlock(table.untyped_storage().data_ptr())
    del table


def post_processing_round_trip(cfg: dict, device: torch.device, vpe, seen: SimpleNamespace, out: dict) -> None:
    """2. vLLM's round trip on a host embedding, then the same load with keep_on_host."""
    import vllm.model_executor.model_loader.utils as loader_utils

    from selective_offload.vllm_glue.host_resident import keep_on_host

    config = type("Cfg", (), {"word_embeddings_untied_by_checkpoint": False, "quantization": None,
                              "dtype": torch.bfloat16})()
    for label, keep in (("vllm", False), ("keep_on_host", True)):
        try:
            with torch.device("cpu"):
                layer = vpe.VocabParallelEmbedding(cfg["vocab"] // 8, cfg["hidden"], params_dtype=torch.bfloat16)
            model = nn.ModuleDict({"embed_tokens": layer})
            if keep:
                keep_on_host(list(model.named_modules()), device)
            host_empty_cache()
            before = (storage_ptr(layer.weight), layer.weight.is_pinned(), host_allocator_bytes())
            loader_utils.process_weights_after_loading(model, config, device)
            gc.collect()
            after = (storage_ptr(layer.weight), layer.weight.is_pinned(), host_allocator_bytes())
            out[f"round_trip_{label}"] = {
                "bytes": nbytes(layer.weight), "storage_changed": before[0] != after[0],
                "pinned_after": after[1], "device": str(layer.weight.device),
                "torch_pinned_delta": (after[2] or 0) - (before[2] or 0)}
            row = out[f"round_trip_{label}"]
            ok = (row["device"] == "cpu" and not row["storage_changed"] and row["torch_pinned_delta"] == 0
                  if keep else row["device"] == "cpu")
            seen.round_trip[label] = (ok, json.dumps(row))
            del layer, model
        except Exception as err:  # noqa: BLE001
            seen.round_trip[label] = (False, repr(err))


def prefetch_post_init(cfg: dict, device: torch.device, seen: SimpleNamespace, out: dict) -> None:
    """3. Page-locked bytes around the prefetch offloader's post_init, small layers."""
    from vllm.model_executor.offloader.prefetch import PrefetchOffloader

    from selective_offload.vllm_glue.offloader import make_exact_prefetch_offloader

    try:
        hidden = cfg["hot_rows"]
        torch.manual_seed(0)
        reference = [nn.Sequential(nn.Linear(hidden, 3 * hidden), nn.GELU(), nn.Linear(3 * hidden, hidden)).to(
            device, torch.bfloat16) for _ in range(4)]
        ledger = PageLockedLedger(PinPolicy.decide(cuda=True))
        host_empty_cache()
        base_pinned = host_allocator_bytes() or 0
        offloader = make_exact_prefetch_offloader(PrefetchOffloader, [1, 3], 1, "model.layers", 4, page_locked=ledger)
        copies = [None] * 4

        def build(i):
            layer = nn.Sequential(nn.Linear(hidden, 3 * hidden), nn.GELU(), nn.Linear(3 * hidden, hidden)).to(
                device, torch.bfloat16)
            layer.load_state_dict(reference[i].state_dict())
            copies[i] = layer
            return layer

        layers = nn.ModuleList(make_layers(4, "model.layers", offloader, build))
        host = sum(nbytes(p) for i in (1, 3) for p in layers[i].parameters())
        after_wrap = (host_allocator_bytes() or 0) - base_pinned
        offloader.post_init()
        torch.cuda.synchronize()
        after = (host_allocator_bytes() or 0) - base_pinned
        locked = ledger.locked_bytes
        out["prefetch"] = {"host_bytes": host, "torch_pinned_after_wrap": after_wrap,
                           "torch_pinned_after_post_init": after, "registered_after_post_init": locked,
                           "ratio": (locked + after) / host}
        seen.post_init = (after == 0 and host <= locked + after <= 1.05 * host, json.dumps(out["prefetch"]))

        from vllm.model_executor.offloader import base as offloader_base

        x = torch.randn(8, hidden, device=device, dtype=torch.bfloat16)
        y, ref = x, x
        previous = offloader_base.get_offloader()
        offloader_base.set_offloader(offloader)  # the prefetch ops find it there
        try:
            with torch.no_grad():
                for i in range(4):
                    y, ref = layers[i](y), reference[i](ref)
            torch.cuda.synchronize()
        finally:
            offloader_base.set_offloader(previous)
        seen.compute = (torch.equal(y, ref), f"max abs diff {float((y - ref).abs().max())}")
    except Exception as err:  # noqa: BLE001
        seen.error = repr(err)


@pytest.fixture(scope="module")
def cuda_paths(cfg, device, results):
    """The three paths in order, figures first (``results["cuda_paths"]``); what each
    check needs, and which imports of vLLM failed (their checks are skipped)."""
    out: dict = {}
    results["cuda_paths"] = out
    seen = SimpleNamespace(uva=None, vllm_missing=None, prefetch_missing=None, round_trip={},
                           post_init=None, compute=None, error=None)
    registration_and_view(cfg, device, seen, out)
    try:
        vpe = _vllm_patched_tp()
        import vllm.model_executor.model_loader.utils  # noqa: F401

        import selective_offload.vllm_glue.host_resident  # noqa: F401
    except ImportError as err:
        seen.vllm_missing = seen.prefetch_missing = repr(err)
        return seen
    post_processing_round_trip(cfg, device, vpe, seen, out)
    try:
        import vllm.model_executor.offloader.prefetch  # noqa: F401

        import selective_offload.vllm_glue.offloader  # noqa: F401
    except ImportError as err:
        seen.prefetch_missing = repr(err)
        return seen
    prefetch_post_init(cfg, device, seen, out)
    return seen


def needs_vllm(missing: str | None) -> None:
    if missing is not None:
        pytest.skip(f"{NO_VLLM_REASON}: {missing}")


@records(CUDA_PATH_CHECKS[0])
@needs_cuda("cudaHostRegister and a UVA view are CUDA's")
def test_registered_memory_is_pinned_and_its_uva_view_reads_it_in_place(cuda_paths, checks):
    checks.check(CUDA_PATH_CHECKS[0], *cuda_paths.uva)


@records(CUDA_PATH_CHECKS[1])
@needs_cuda("vLLM's device round trip in post-processing moves weights to a CUDA device and back")
def test_vllms_device_loading_context_on_a_host_embedding_is_recorded(cuda_paths, checks):
    needs_vllm(cuda_paths.vllm_missing)
    checks.check(CUDA_PATH_CHECKS[1], *cuda_paths.round_trip["vllm"])


@records(CUDA_PATH_CHECKS[2])
@needs_cuda("vLLM's device round trip in post-processing moves weights to a CUDA device and back")
def test_keep_on_host_leaves_a_host_embeddings_storage_and_pinned_bytes_alone(cuda_paths, checks):
    needs_vllm(cuda_paths.vllm_missing)
    checks.check(CUDA_PATH_CHECKS[2], *cuda_paths.round_trip["keep_on_host"])


@records(CUDA_PATH_CHECKS[3])
@needs_cuda("the prefetch offloader copies to a CUDA device")
def test_the_exact_prefetch_offloader_page_locks_its_hot_layers_within_1_05x(cuda_paths, checks):
    needs_vllm(cuda_paths.prefetch_missing)
    checks.check(CUDA_PATH_CHECKS[3], *(cuda_paths.post_init or (False, cuda_paths.error)))


@records(CUDA_PATH_CHECKS[4])
@needs_cuda("the prefetch offloader copies to a CUDA device")
def test_hot_layers_after_post_init_compute_what_the_resident_layers_do(cuda_paths, checks):
    needs_vllm(cuda_paths.prefetch_missing)
    checks.check(CUDA_PATH_CHECKS[4], *(cuda_paths.compute or (False, cuda_paths.error)))
