"""A failed C job is loud on every path: run by Python it raises at once; run through its
function pointer, as a CUDA host function runs it (which cannot raise and is not waited
for), it fills its output with NaN (never the previous step's sums) and the next Python
that checks (each host step, each step's logits) raises. Here the jobs are called through
their function pointers with ctypes, on the CPU, as the CUDA driver would call them."""

from __future__ import annotations

import ctypes

import pytest
import torch
from torch import nn

from selective_offload import cpu_kernels
from selective_offload.cpu_kernels import Activation, ExpertWeights, JobFailed, raise_if_failed
from selective_offload.vllm_glue.experts import raise_on_failed_jobs

E, H, I, K, T = 4, 32, 32, 2, 3
HOST_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)  # cudaHostFn_t


@pytest.fixture(autouse=True)
def kernel_built():
    try:
        cpu_kernels.library()
    except cpu_kernels.KernelUnavailable as exc:
        pytest.skip(f"the CPU kernel cannot be built here: {exc}")
    raise_if_failed()  # nothing left over from another test


def as_host_function(job) -> None:
    HOST_FN(job.function_pointer)(job.address)


def moe_job():
    g = torch.Generator().manual_seed(0)
    w = ExpertWeights("bf16", (torch.randn(E, 2 * I, H, generator=g) * 0.1).bfloat16(),
                      (torch.randn(E, H, I, generator=g) * 0.1).bfloat16())
    x = torch.randn(T, H, generator=g).bfloat16()
    ids = torch.tensor([[0, 1], [2, 3], [1, 2]], dtype=torch.int32)
    weights = torch.full((T, K), 0.5)
    out = torch.empty(T, H)
    return cpu_kernels.MoEJob(x, ids, weights, w, Activation("silu"), out=out, threads=1), ids, out


def test_a_failed_job_run_as_a_host_function_leaves_nan_not_the_last_sums_and_raises_next():
    job, ids, out = moe_job()
    as_host_function(job)
    assert job.status == 0 and torch.isfinite(out).all()
    raise_if_failed()  # a good run: nothing to raise
    ids[1, 0] = E  # an expert id the layer does not have: the C code refuses the job
    as_host_function(job)
    assert job.status == 1
    assert torch.isnan(out).all()  # not the previous step's sums
    with pytest.raises(JobFailed, match="expert id >= the number of experts"):
        raise_if_failed("model.layers.0.mlp.experts")
    raise_if_failed()  # raised once
    ids[1, 0] = 3
    as_host_function(job)
    assert job.status == 0 and torch.isfinite(out).all()


def test_a_failed_rows_job_is_loud_too():
    w = torch.randn(40, H).bfloat16()
    out = torch.zeros(2, 40)
    job = cpu_kernels.RowsJob(torch.randn(2, H).bfloat16(), w, out, threads=1)
    job.job.x_dtype = 7  # no dtype the walk reads
    as_host_function(job)
    assert job.job.status == 3 and torch.isnan(out).all()
    with pytest.raises(JobFailed, match="lm_head"):
        raise_if_failed("lm_head")


def test_a_job_run_by_python_raises_at_once_and_once():
    job, ids, out = moe_job()
    ids[0, 1] = E + 5
    with pytest.raises(ValueError, match="expert id"):
        job.run()
    assert torch.isnan(out).all()
    raise_if_failed()  # already raised by run()


def test_the_worker_checks_every_steps_logits():
    """vLLM computes the logits every step outside its graphs: the worker's check there
    raises on a job a graph's host function failed, before the step's logits are used."""

    class Model(nn.Module):
        def compute_logits(self, hidden):
            return hidden * 2

    model = Model()
    raise_on_failed_jobs(model)
    raise_on_failed_jobs(model)  # once
    hidden = torch.ones(2)
    torch.testing.assert_close(model.compute_logits(hidden), hidden * 2)
    job, ids, _ = moe_job()
    ids[2, 1] = -7 + 2 * E + 100
    as_host_function(job)
    with pytest.raises(JobFailed, match="1 host-compute kernel job"):
        model.compute_logits(hidden)
    torch.testing.assert_close(model.compute_logits(hidden), hidden * 2)


def test_the_next_host_step_queued_raises_before_it_touches_the_stream():
    """On CUDA each host step is queued by HostFunction.enqueue; a failure an earlier host
    function left is raised there first, before anything is queued (checked on the CPU: the
    raise comes before the first CUDA call)."""
    from selective_offload.wrappers.host_compute import HostExperts
    from selective_offload.wrappers.host_function import HostFunction

    job, ids, _ = moe_job()
    weights = ExpertWeights("bf16", job.tensors["w13"], job.tensors["w2"])
    layer = HostExperts("model.layers.3.mlp.experts", weights, Activation("silu"), crossover_tokens=4, threads=1,
                        device=torch.device("cpu"))
    ids[0, 0] = E
    as_host_function(job)
    with pytest.raises(JobFailed, match="model.layers.3.mlp.experts"):
        HostFunction(layer).enqueue(torch.zeros(1, H), torch.zeros(1, K, dtype=torch.int32), torch.ones(1, K))
