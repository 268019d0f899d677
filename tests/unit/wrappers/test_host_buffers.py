"""HostBuffers: one staging slot and one kernel workspace per process, shared by every
host-compute unit and every step size, each step's job over the first bytes of them, on
the real CPU kernel. Here the "device" is the CPU (no CUDA), so the slot is pageable; on
CUDA the same slot is page-locked and the same jobs run as host functions."""

from __future__ import annotations

import ctypes

import pytest
import torch
import torch.nn.functional as F

from selective_offload import cpu_kernels, worker_buffers
from selective_offload.cpu_kernels import Activation, ExpertWeights
from selective_offload.cpu_kernels.reference import moe_reference
from selective_offload.wrappers import host_buffers
from selective_offload.wrappers.host_buffers import HostBuffers
from selective_offload.wrappers.host_compute import HostExperts
from selective_offload.wrappers.host_rows import HostRows

E, H, I, K = 8, 64, 32, 2
CPU = torch.device("cpu")


@pytest.fixture(autouse=True, scope="module")
def kernel_built():
    try:
        cpu_kernels.library()
    except cpu_kernels.KernelUnavailable as exc:
        pytest.skip(f"the CPU kernel cannot be built here: {exc}")


def weights(seed: int, experts: int = E, intermediate: int = I) -> ExpertWeights:
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return (torch.randn(*shape, generator=g) * 0.1).to(torch.bfloat16)

    return ExpertWeights("bf16", r(experts, 2 * intermediate, H), r(experts, H, intermediate))


def routing(tokens: int, seed: int, experts: int = E, k: int = K):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)]).to(torch.int32)
    w = torch.rand(tokens, k, generator=g)
    return x, ids, w / w.sum(-1, keepdim=True)


@pytest.fixture
def counted(monkeypatch):
    """Every staging and workspace allocation, counted at its one site."""
    made = {"staging": [], "workspace": []}
    staging, workspace = host_buffers.allocate_staging, host_buffers.allocate_workspace

    def count_staging(nbytes, pinned, page_locked=None):
        made["staging"].append(nbytes)
        return staging(nbytes, pinned, page_locked)

    def count_workspace(nbytes):
        made["workspace"].append(nbytes)
        return workspace(nbytes)

    monkeypatch.setattr(host_buffers, "allocate_staging", count_staging)
    monkeypatch.setattr(host_buffers, "allocate_workspace", count_workspace)
    return made


def test_every_layer_and_step_size_uses_the_one_slot_and_workspace_and_computes_the_reference(counted):
    """Two layers of different shapes (E, I and k), steps of every size up to the crossover
    in both orders: one staging slot and one workspace made, every job's buffers at the slot's
    own addresses (a smaller step: a prefix), and each sum the reference's, so a smaller step
    after a larger one reads none of the larger one's rows."""
    buffers = HostBuffers(pinned=False)
    first = HostExperts("model.layers.0.mlp.experts", weights(0), Activation("silu"), crossover_tokens=4, threads=1,
                        device=CPU, buffers=buffers, experts_per_token=K)
    second = HostExperts("model.layers.1.mlp.experts", weights(1, experts=16, intermediate=48), Activation("silu"),
                         crossover_tokens=4, threads=1, device=CPU, buffers=buffers, experts_per_token=3)
    for tokens in (4, 1, 3, 2, 4, 1):
        for layer, experts, k in ((first, E, K), (second, 16, 3)):
            x, ids, w = routing(tokens, seed=tokens * 7 + k, experts=experts, k=k)
            out = layer(x, ids, w)
            torch.testing.assert_close(out.float(), moe_reference(x, ids, w, layer.weights, layer.activation),
                                       rtol=2e-2, atol=2e-3)
    assert len(counted["staging"]) == len(counted["workspace"]) == 1
    base, space = buffers.staging.data_ptr(), buffers.workspace.data_ptr()
    slots = list(first._slots.values()) + list(second._slots.values())
    assert len(slots) == 8  # a job per layer and step size ...
    offsets = worker_buffers.Staging.of(buffers.units).offsets()
    for slot in slots:  # ... all over the same bytes
        assert [t.data_ptr() - base for t in (slot.x, slot.ids, slot.weights, slot.out)] == list(offsets)
        assert slot.job.workspace.data_ptr() == space
        assert slot.job.job.workspace == space


def test_the_buffers_are_the_ledgers_sizes_for_the_largest_step(counted):
    """The slot and workspace are exactly what worker_buffers prices for the units reserved:
    the largest step of each (its crossover), the largest of them all."""
    buffers = HostBuffers(pinned=False)
    HostExperts("a", weights(0), Activation("silu"), crossover_tokens=6, threads=1, device=CPU, buffers=buffers,
                experts_per_token=K)
    HostExperts("b", weights(1, experts=16, intermediate=48), Activation("silu"), crossover_tokens=3, threads=1,
                device=CPU, buffers=buffers, experts_per_token=4)
    head = HostRows("lm_head", torch.randn(300, H).to(torch.bfloat16), 100, crossover_tokens=2, device=CPU,
                    threads=1, buffers=buffers)
    units = [worker_buffers.Unit.experts(6, K, E, H, I), worker_buffers.Unit.experts(3, 4, 16, H, 48),
             worker_buffers.Unit.rows(2, H, 200)]
    head(torch.randn(1, H).to(torch.bfloat16))  # the first step makes them
    assert counted["staging"] == [worker_buffers.staging_bytes(units)]
    assert counted["workspace"] == [worker_buffers.workspace_bytes(units)]
    assert worker_buffers.staging_bytes(units) == (worker_buffers.align(6 * H * 4) + 2 * worker_buffers.align(6 * K * 4)
                                                   + worker_buffers.align(2 * 200 * 4))  # the head's logits: the widest


def test_the_split_head_and_the_layers_share_the_slot(counted):
    buffers = HostBuffers(pinned=False)
    layer = HostExperts("a", weights(0), Activation("silu"), crossover_tokens=4, threads=1, device=CPU,
                        buffers=buffers, experts_per_token=K)
    w = (torch.randn(300, H) * 0.1).to(torch.bfloat16)
    head = HostRows("lm_head", w, 100, crossover_tokens=3, device=CPU, threads=1, buffers=buffers)
    for tokens in (3, 1):
        x = routing(tokens, seed=tokens)[0]
        layer(*routing(tokens, seed=tokens))
        torch.testing.assert_close(head(x).float(), F.linear(x.float(), w.float()), rtol=2 ** -7, atol=1e-3)
    assert len(counted["staging"]) == 1
    slot = head._slots[(1, H)]
    assert slot.x.data_ptr() == buffers.staging.data_ptr() == layer._slots[(1, K, torch.bfloat16)].x.data_ptr()
    assert slot.job.job.workspace == buffers.workspace.data_ptr()


def test_fixed_buffers_never_move_once_made():
    """A captured graph holds the buffers' addresses: a unit larger than them installed after
    the first step is refused, where one that fits is taken."""
    buffers = HostBuffers(pinned=False)
    layer = HostExperts("a", weights(0), Activation("silu"), crossover_tokens=4, threads=1, device=CPU,
                        buffers=buffers, experts_per_token=K)
    layer(*routing(2, seed=0))
    HostExperts("b", weights(1), Activation("silu"), crossover_tokens=4, threads=1, device=CPU, buffers=buffers,
                experts_per_token=K)
    with pytest.raises(RuntimeError, match="larger than the buffers"):
        HostExperts("c", weights(2), Activation("silu"), crossover_tokens=9, threads=1, device=CPU, buffers=buffers,
                    experts_per_token=K)


def test_the_workspace_formula_is_the_kernels():
    lib = cpu_kernels.library()
    for shape in [(1, 1, 1, 1, 1), (1, 4, 128, 2880, 2880), (352, 4, 128, 2880, 2880), (7, 8, 60, 2048, 768),
                  (5, 1, 1, 5120, 17408), (3, 2, 9, 100, 33)]:
        assert worker_buffers.moe_workspace_bytes(*shape) == lib.so_moe_workspace_bytes(*shape), shape


def test_the_rows_job_runs_in_a_given_workspace():
    """The rows walk reorders its tokens into the workspace given (it reads them back from
    there: a workspace filled with garbage between two runs changes nothing)."""
    w = (torch.randn(70, H) * 0.1).to(torch.bfloat16)
    x = torch.randn(3, H).to(torch.bfloat16)
    space = torch.empty(worker_buffers.rows_workspace_bytes(3, H), dtype=torch.uint8)
    out = torch.empty(3, 70)
    job = cpu_kernels.RowsJob(x, w, out, threads=1, workspace=space)
    assert job.job.workspace == space.data_ptr() and job.job.workspace_bytes == space.numel()
    space.fill_(0xFF)
    first = job.run().clone()
    assert (space != 0xFF).any()  # the tokens went there
    space.fill_(0xFF)
    torch.testing.assert_close(job.run(), first)
    torch.testing.assert_close(first, F.linear(x.float(), w.float()), rtol=2 ** -7, atol=1e-3)
    assert ctypes.sizeof(type(job.job)) == job.lib.so_rows_job_size()
