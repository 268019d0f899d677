"""The host-resident embedding: bit-exact with F.embedding, never on the device.

On a machine without CUDA the compute device is the CPU itself, so "the device" below is
the CPU and "host memory" is unpinned; the code path (ids to host, gather into the staging
buffer, copy out) is the same one a GPU runs. Tests that need a real CUDA device are marked.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from selective_offload.errors import UserError
from selective_offload.wrappers import (
    HostEmbedding,
    HostGather,
    OffloadError,
    TiedWeightError,
    host_gather,
    move_module_weight_to_host,
    refuse_if_tied,
)

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(
    not CUDA, reason="needs a CUDA device: pinned memory, UVA and device transfers"
)
DEVICE = torch.device("cuda") if CUDA else torch.device("cpu")


def make_embedding(rows=64, dim=16, dtype=torch.float32, seed=0) -> nn.Embedding:
    torch.manual_seed(seed)
    emb = nn.Embedding(rows, dim)
    emb.weight.data = torch.randn(rows, dim).to(dtype)
    return emb


def reference(emb: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """What a device-resident embedding returns."""
    return F.embedding(ids.to(DEVICE), emb.weight.detach().to(DEVICE))


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.cpu().view(torch.uint8), b.cpu().view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(7,), (3, 5), (1,)])
def test_output_is_bitwise_f_embedding(dtype, shape):
    emb = make_embedding(dtype=dtype)
    expected = reference(emb, ids := torch.randint(0, 64, shape))
    host = HostEmbedding.from_embedding(make_embedding(dtype=dtype), DEVICE)
    assert bitwise_equal(host(ids), expected)


def test_fp8_weight_gather_is_bit_exact():
    emb = make_embedding(dtype=torch.float8_e4m3fn)
    ids = torch.randint(0, 64, (4, 3))
    expected = emb.weight.detach().view(torch.uint8)[ids]
    out = HostEmbedding.from_embedding(emb, DEVICE)(ids)
    assert out.dtype == torch.float8_e4m3fn
    assert torch.equal(out.cpu().view(torch.uint8), expected)


@pytest.mark.parametrize("shape", [(0,), (2, 0)])
def test_empty_input_gives_empty_rows(shape):
    host = HostEmbedding.from_embedding(make_embedding(), DEVICE)
    out = host(torch.empty(shape, dtype=torch.long))
    assert out.shape == (*shape, 16)


@pytest.mark.parametrize("bad", [64, 1000, -1])
def test_out_of_range_id_raises_index_error(bad):
    host = HostEmbedding.from_embedding(make_embedding(), DEVICE)
    with pytest.raises(IndexError, match="index out of range"):
        host(torch.tensor([0, bad, 1]))


def test_int32_ids_match_int64_ids():
    host = HostEmbedding.from_embedding(make_embedding(), DEVICE)
    ids = torch.randint(0, 64, (9,))
    assert torch.equal(host(ids.int()), host(ids))


def test_float_ids_are_refused():
    host = HostEmbedding.from_embedding(make_embedding(), DEVICE)
    with pytest.raises(TypeError, match="int64 or int32"):
        host(torch.tensor([1.0, 2.0]))


def test_ids_on_the_compute_device_are_accepted():
    emb = make_embedding()
    expected = reference(emb, ids := torch.randint(0, 64, (5,)))
    host = HostEmbedding.from_embedding(emb, DEVICE)
    assert torch.equal(host(ids.to(DEVICE)), expected)


def test_weight_stays_in_host_memory():
    host = HostEmbedding.from_embedding(make_embedding(), DEVICE)
    host(torch.tensor([1, 2]))
    assert host.weight.device.type == "cpu"


def test_staging_buffer_is_reused_for_equal_or_smaller_batches():
    gather = HostGather(DEVICE)
    weight = make_embedding().weight
    gather(weight, torch.randint(0, 64, (8,)))
    first = gather.staging.data_ptr()
    gather(weight, torch.randint(0, 64, (8,)))
    gather(weight, torch.randint(0, 64, (3,)))
    assert gather.staging.data_ptr() == first


def test_staging_buffer_grows_for_a_larger_batch():
    gather = HostGather(DEVICE)
    weight = make_embedding().weight
    gather(weight, torch.randint(0, 64, (4,)))
    small = gather.staging.numel()
    gather(weight, torch.randint(0, 64, (40,)))
    assert gather.staging.numel() >= 40 * 16 * 4 > small


def test_earlier_outputs_survive_later_calls():
    """The output must be a copy, never a view of the reused staging buffer."""
    emb = make_embedding()
    host = HostEmbedding.from_embedding(make_embedding(), DEVICE)
    first_ids = torch.tensor([1, 2, 3])
    first = host(first_ids)
    host(torch.tensor([10, 11, 12]))
    assert torch.equal(first, reference(emb, first_ids))


def test_host_gather_function_matches_shard_lookup():
    """vLLM's vocab-parallel forward maps ids to shard-local rows, then looks them up."""
    shard = make_embedding(rows=32).weight.detach()
    local_ids = torch.tensor([[0, 31, 5], [0, 0, 7]])
    staging = torch.empty(6 * 16 * 4, dtype=torch.uint8)
    out = host_gather(shard, local_ids, DEVICE, staging)
    assert torch.equal(out, F.embedding(local_ids.to(DEVICE), shard.to(DEVICE)))


def test_host_gather_refuses_a_too_small_staging_buffer():
    shard = make_embedding().weight.detach()
    with pytest.raises(OffloadError, match="staging buffer holds"):
        host_gather(shard, torch.tensor([1, 2]), DEVICE, torch.empty(8, dtype=torch.uint8))


def test_stats_count_one_row_per_token():
    host = HostEmbedding.from_embedding(make_embedding(), DEVICE)
    host(torch.tensor([1, 2, 3]))
    host(torch.tensor([4]))
    stats = host.stats
    row_bytes = 16 * 4
    counters = (stats.host_bytes, stats.bytes_moved_last_call, stats.bytes_moved_total, stats.calls)
    assert counters == (64 * row_bytes, row_bytes, 4 * row_bytes, 2)


def test_a_failed_lookup_is_not_counted():
    host = HostEmbedding.from_embedding(make_embedding(), DEVICE)
    with pytest.raises(IndexError):
        host(torch.tensor([99]))
    assert host.stats.calls == 0


def test_state_dict_keys_are_those_of_the_embedding():
    emb = make_embedding()
    keys = list(emb.state_dict())
    assert list(HostEmbedding.from_embedding(emb, DEVICE).state_dict()) == keys


def test_load_state_dict_writes_into_host_storage():
    host = HostEmbedding.from_embedding(make_embedding(seed=0), DEVICE)
    storage = host.weight.data_ptr()
    host.load_state_dict(make_embedding(seed=1).state_dict())
    assert host.weight.device.type == "cpu" and host.weight.data_ptr() == storage


def test_load_state_dict_with_assign_keeps_host_residency():
    host = HostEmbedding.from_embedding(make_embedding(seed=0), DEVICE)
    incoming = make_embedding(seed=1)
    host.load_state_dict({"weight": incoming.weight.detach().to(DEVICE)}, assign=True)
    assert host.weight.device.type == "cpu"
    assert torch.equal(host(torch.tensor([3])), reference(incoming, torch.tensor([3])))


def test_weight_loader_full_copy_lands_on_host_tensor():
    host = HostEmbedding.from_embedding(make_embedding(), DEVICE)
    param, storage = host.weight, host.weight.data_ptr()
    loaded = torch.randn(64, 16)
    param.data.copy_(loaded)
    assert param.data_ptr() == storage and torch.equal(param.detach(), loaded)


def test_weight_loader_slice_copy_lands_on_host_tensor():
    """vLLM's vocab-parallel loader copies a shard into a slice of param.data."""
    host = HostEmbedding.from_embedding(make_embedding(), DEVICE)
    shard = torch.randn(10, 16)
    host.weight.data[20:30].copy_(shard)
    assert torch.equal(host(torch.arange(20, 30)).cpu(), shard)


def test_move_to_host_keeps_parameter_object_and_attributes():
    emb = make_embedding()
    param = emb.weight
    param.weight_loader = lambda p, w: p.data.copy_(w)
    param.output_dim = 0
    moved = move_module_weight_to_host(emb)
    assert moved is param and emb.weight is param
    assert param.output_dim == 0 and callable(param.weight_loader)


def test_move_to_host_refuses_a_missing_attribute():
    with pytest.raises(OffloadError, match="no tensor attribute 'bias'"):
        move_module_weight_to_host(nn.Embedding(4, 2), "bias")


@pytest.mark.parametrize("head_weight,refused", [
    (lambda w: w, "embed_tokens.weight and lm_head.weight"),  # tied: one Parameter
    (lambda w: nn.Parameter(w.data), ""),  # another Parameter, same storage
    (lambda w: nn.Parameter(w.detach().clone()), None),  # untied, of equal shape: accepted
], ids=["tied", "sharing-storage", "untied"])
def test_tied_weights_are_refused_naming_both_modules(head_weight, refused):
    emb = make_embedding()
    lm_head = nn.Linear(16, 64, bias=False)
    lm_head.weight = head_weight(emb.weight)
    if refused is None:
        refuse_if_tied(emb, lm_head)
    else:
        with pytest.raises(TiedWeightError, match=refused):
            refuse_if_tied(emb, lm_head)


def test_tied_error_is_a_user_error_and_a_value_error():
    assert issubclass(TiedWeightError, UserError) and issubclass(TiedWeightError, ValueError)


def test_from_embedding_refuses_a_tied_lm_head():
    emb = make_embedding()
    lm_head = nn.Linear(16, 64, bias=False)
    lm_head.weight = emb.weight
    with pytest.raises(TiedWeightError):
        HostEmbedding.from_embedding(emb, DEVICE, lm_head=lm_head)


def test_max_norm_embedding_is_refused():
    with pytest.raises(OffloadError, match="max_norm"):
        HostEmbedding.from_embedding(nn.Embedding(8, 4, max_norm=1.0), DEVICE)


def test_rewrapping_with_same_settings_returns_the_same_module():
    host = HostEmbedding.from_embedding(make_embedding(), DEVICE)
    assert HostEmbedding.from_embedding(host, DEVICE) is host


def test_rewrapping_with_other_settings_is_refused():
    host = HostEmbedding.from_embedding(make_embedding(), DEVICE)
    with pytest.raises(OffloadError, match="already host-resident"):
        HostEmbedding.from_embedding(host, DEVICE, mode="uva", view_factory=lambda t: t)


def test_weight_moved_off_the_host_is_reported_not_used():
    """Fake: with no CUDA here, a meta tensor stands in for "moved to the device"."""
    host = HostEmbedding.from_embedding(make_embedding(), DEVICE)
    host.weight = nn.Parameter(torch.empty(64, 16, device="meta"))
    with pytest.raises(OffloadError, match="not in host memory"):
        host(torch.tensor([1]))
    assert host.stats.host_bytes == 0


def test_uva_mode_uses_an_injected_view_factory_once_per_storage():
    """Fake: no CUDA here, so the 'device view' is the host tensor itself; what is tested
    is that the factory is called once and reused until the host storage changes."""
    calls = []

    def fake_view(host: torch.Tensor) -> torch.Tensor:
        calls.append(host.data_ptr())
        return host

    emb = make_embedding()
    host = HostEmbedding.from_embedding(make_embedding(), "cpu", mode="uva", view_factory=fake_view)
    host(torch.tensor([1, 2]))
    out = host(torch.tensor([[5, 6]]))
    host.weight.data = host.weight.data.clone()
    host(torch.tensor([1]))
    assert torch.equal(out, F.embedding(torch.tensor([[5, 6]]), emb.weight.detach()))
    assert len(calls) == 2


def test_uva_mode_checks_bounds():
    """Fake view factory (the host tensor itself): no CUDA device here."""
    host = HostEmbedding.from_embedding(
        make_embedding(), "cpu", mode="uva", view_factory=lambda t: t
    )
    with pytest.raises(IndexError):
        host(torch.tensor([64]))


@pytest.mark.skipif(CUDA, reason="checks the error raised where CUDA is absent")
def test_uva_without_cuda_or_view_factory_is_refused():
    with pytest.raises(OffloadError, match="mode='uva' needs a CUDA device"):
        HostEmbedding.from_embedding(make_embedding(), "cpu", mode="uva")


@pytest.mark.skipif(CUDA, reason="checks the error raised where CUDA is absent")
def test_pinning_without_cuda_is_refused():
    with pytest.raises(OffloadError, match="cannot be pinned"):
        HostEmbedding.from_embedding(make_embedding(), "cpu", pin=True)


def test_unknown_mode_is_refused():
    with pytest.raises(OffloadError, match="unknown gather mode"):
        HostGather(DEVICE, mode="zero-copy")


@needs_cuda
def test_host_weight_is_pinned_on_cuda():
    host = HostEmbedding.from_embedding(make_embedding(), "cuda")
    assert host.weight.is_pinned() and host.gather.staging is None


@needs_cuda
def test_building_never_allocates_the_weight_on_the_device():
    emb = make_embedding(rows=4096, dim=256)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    HostEmbedding.from_embedding(emb, "cuda")
    assert torch.cuda.memory_allocated() - before == 0


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_host_gather_matches_device_embedding(dtype):
    emb = make_embedding(dtype=dtype)
    ids = torch.randint(0, 64, (3, 7), device="cuda")
    expected = F.embedding(ids, emb.weight.detach().cuda())
    out = HostEmbedding.from_embedding(emb, "cuda")(ids)
    assert out.device.type == "cuda" and bitwise_equal(out, expected)


@needs_cuda
def test_cuda_uva_gather_matches_device_embedding():
    emb = make_embedding(dtype=torch.bfloat16)
    ids = torch.randint(0, 64, (11,), device="cuda")
    expected = F.embedding(ids, emb.weight.detach().cuda())
    host = HostEmbedding.from_embedding(emb, "cuda", mode="uva")
    assert bitwise_equal(host(ids), expected)


@needs_cuda
def test_cuda_uva_view_reads_host_memory_in_place():
    host = HostEmbedding.from_embedding(make_embedding(), "cuda", mode="uva")
    host(torch.tensor([1], device="cuda"))
    host.weight.data[1].fill_(7.0)  # a host write the device must see without a copy
    assert torch.equal(host(torch.tensor([1], device="cuda")).cpu(), torch.full((1, 16), 7.0))
