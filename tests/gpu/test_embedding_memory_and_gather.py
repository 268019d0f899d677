"""A host-resident embedding of the reference size (248320 x 5120 bf16, 2.54 GB at full
size) adds no device memory where a device-resident one adds its full size, its weight is
pinned, and the host gather and the UVA gather return exactly what ``F.embedding`` on the
device weight does, for 1 to 4096 tokens. The fixture also times the three gathers (the
results' "Embedding gather" table)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.common import median_us
from mechanism import TOKENS_PER_STEP, bitwise_equal, needs_cuda, records, sync
from selective_offload.wrappers import HostEmbedding, cuda_view_of_pinned

DEVICE_SIZED = "device-resident embedding allocates its size on the device"
HOST_NOTHING = "host-resident embedding allocates nothing on the device"
DROPS = "device memory drops by the host bytes"
PINNED = "host weight storage is pinned"
UVA_VIEW = "UVA view of pinned memory can be built"


def host_gather(tokens: int) -> str:
    return f"host gather == device F.embedding ({tokens} tokens)"


def uva_gather(tokens: int) -> str:
    return f"UVA gather == device F.embedding ({tokens} tokens)"


@pytest.fixture(scope="module")
def embedding(cfg, cuda, device, results):
    """The table built on the device, on the host (and on CUDA as a UVA view), each
    gather compared with the device's and timed; the tables are freed on return."""
    vocab, hidden, dtype = cfg["vocab"], cfg["hidden"], torch.bfloat16
    weight_bytes = vocab * hidden * 2
    print(f"embedding {vocab} x {hidden} bf16 = {weight_bytes / 1e9:.3f} GB")
    sync(cuda)
    before = torch.cuda.memory_allocated() if cuda else 0
    resident = nn.Embedding(vocab, hidden, dtype=dtype, device=device)
    sync(cuda)
    resident_delta = (torch.cuda.memory_allocated() - before) if cuda else None

    cpu_module = nn.Embedding(vocab, hidden, dtype=dtype, device="meta")
    cpu_module.weight = nn.Parameter(resident.weight.detach().to("cpu"), requires_grad=False)
    sync(cuda)
    before = torch.cuda.memory_allocated() if cuda else 0
    host = HostEmbedding.from_embedding(cpu_module, device)
    sync(cuda)
    host_delta = (torch.cuda.memory_allocated() - before) if cuda else None

    result = {"vocab": vocab, "hidden": hidden, "dtype": "bfloat16", "weight_bytes": weight_bytes,
              "device_resident_build_device_bytes": resident_delta,
              "host_resident_build_device_bytes": host_delta}
    seen = SimpleNamespace(weight_bytes=weight_bytes, resident_delta=resident_delta, host_delta=host_delta,
                           host_bytes=host.stats.host_bytes, host_pinned=host.weight.is_pinned() if cuda else None,
                           uva_error=None, view_at_host_address=None, view_device=None,
                           host_equal={}, uva_equal={})
    if cuda:
        stats = torch.cuda.host_memory_stats()
        result["pinned_host_reserved_bytes"] = stats.get("reserved_bytes.current",
                                                         stats.get("reserved_bytes.all.current"))

    uva = view = None
    if cuda:
        try:
            uva = HostEmbedding.from_embedding(cpu_module, device, mode="uva")
            view = cuda_view_of_pinned(uva.weight.data, device)
        except Exception as err:  # noqa: BLE001 -- a failed check (below); timing goes on
            seen.uva_error = repr(err)
            uva = view = None
        else:
            seen.view_at_host_address = view.data_ptr() == uva.weight.data_ptr() and view.device == device
            seen.view_device = view.device

    gen = torch.Generator().manual_seed(0)
    rows = []
    for tokens in TOKENS_PER_STEP:
        ids = torch.randint(0, vocab, (tokens,), generator=gen).to(device)
        expected = F.embedding(ids, resident.weight.detach())
        seen.host_equal[tokens] = bitwise_equal(host(ids), expected)
        if uva is not None:
            seen.uva_equal[tokens] = bitwise_equal(uva(ids), expected)

        def time_us(fn):
            return median_us(fn, cfg["iters"], cuda)

        with torch.no_grad():
            row = {
                "tokens": tokens,
                "row_bytes_moved": tokens * hidden * 2,
                "device_gather_us": time_us(lambda: F.embedding(ids, resident.weight)),
                "host_gather_us": time_us(lambda: host(ids)),
                "uva_gather_us": time_us(lambda: uva(ids)) if uva is not None else None,
                "uva_kernel_only_us": (
                    time_us(lambda: torch.index_select(view, 0, ids)) if view is not None else None
                ),
            }
        rows.append(row)
        print(row)
    result["gather"] = rows
    results["embedding"] = result
    return seen  # the tables (and the closures that read them) are freed here


@records(DEVICE_SIZED)
@needs_cuda("the device memory an embedding allocates is counted by the CUDA allocator")
def test_a_device_resident_embedding_allocates_its_size_on_the_device(embedding, checks):
    e = embedding
    checks.check(DEVICE_SIZED, e.resident_delta >= e.weight_bytes, f"{e.resident_delta} >= {e.weight_bytes} bytes")


@records(HOST_NOTHING, DROPS)
@needs_cuda("the device memory an embedding allocates is counted by the CUDA allocator")
def test_a_host_resident_embedding_allocates_nothing_on_the_device(embedding, checks):
    e = embedding
    checks.check(HOST_NOTHING, e.host_delta == 0, f"{e.host_delta} bytes")
    checks.check(DROPS, e.resident_delta - e.host_delta >= e.host_bytes,
                 f"{e.resident_delta - e.host_delta} vs host_bytes {e.host_bytes}")


@records(PINNED)
@needs_cuda("pinned host memory is CUDA's")
def test_the_host_weight_storage_is_pinned(embedding, checks):
    checks.check(PINNED, embedding.host_pinned)


@records(UVA_VIEW)
@needs_cuda("a UVA view maps pinned host memory into the device's address space")
def test_a_uva_view_of_pinned_memory_is_built_at_the_host_address(embedding, checks):
    e = embedding
    if e.uva_error is not None:
        checks.check(UVA_VIEW, False, e.uva_error)
    checks.check(UVA_VIEW, e.view_at_host_address, f"device view at the host address, on {e.view_device}")


def test_the_host_gather_equals_f_embedding_on_the_device(embedding, checks):
    for tokens in TOKENS_PER_STEP:
        checks.check(host_gather(tokens), embedding.host_equal[tokens])


@records(*(uva_gather(t) for t in TOKENS_PER_STEP))
@needs_cuda("a UVA view maps pinned host memory into the device's address space")
def test_the_uva_gather_equals_f_embedding_on_the_device(embedding, checks):
    if embedding.uva_error is not None:
        pytest.skip(f"the UVA view could not be built: {embedding.uva_error}")
    for tokens in TOKENS_PER_STEP:
        checks.check(uva_gather(tokens), embedding.uva_equal[tokens])
