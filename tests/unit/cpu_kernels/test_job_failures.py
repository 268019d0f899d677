"""A failed C job is loud on every path: run by Python it raises at once; run through its
function pointer, as a CUDA host function runs it (which cannot raise and is not waited
for), it fills its output with NaN (never the previous step's sums) and the worker raises
at the step's host synchronisation (``Worker.sample_tokens``, wrapped by the glue), naming
the group. Here the jobs are called through their function pointers with ctypes, on the
CPU, as the CUDA driver would call them. The jobs also count their own runs there, which
is what the report's host steps read (a CUDA graph's replays run no Python)."""

from __future__ import annotations

import ctypes

import pytest
import torch

from selective_offload import cpu_kernels
from selective_offload.cpu_kernels import Activation, ExpertWeights, JobFailed, raise_if_failed
from selective_offload.vllm_glue.host_compute import check_at_step_sync

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


def test_the_failure_names_the_group_and_what_to_do_in_one_line():
    job, ids, _ = moe_job()
    job.name("model.layers.7.mlp.experts")
    ids[0, 0] = E
    as_host_function(job)
    with pytest.raises(JobFailed) as err:
        raise_if_failed()
    line = str(err.value)
    assert "\n" not in line and line.startswith("model.layers.7.mlp.experts: ")
    assert "tokens are not returned" in line and "plan the group served uva or on the device" in line


class _SyncOutput:
    """What a runner without asynchronous scheduling returns (vLLM's ``ModelRunnerOutput``
    has no ``get_output``): the step already synchronised."""

    sampled_token_ids = [[5]]


def _async_output_class():
    """A subclass of vLLM's own ``AsyncModelRunnerOutput``, standing in for the CUDA
    runners' (``AsyncGPUModelRunnerOutput``, MRV2's ``AsyncOutput``: they need CUDA
    streams): ``get_output`` is where they synchronise and build the token lists."""
    from vllm.v1.outputs import AsyncModelRunnerOutput

    class AsyncOutput(AsyncModelRunnerOutput):
        def __init__(self, job=None):
            self.job = job

        def get_output(self):
            if self.job is not None:  # the step's host function runs before the copy event
                as_host_function(self.job)
            return _SyncOutput()

    return AsyncOutput


def test_a_step_that_failed_raises_at_its_host_sync_on_both_kinds_of_output():
    """The wrapped ``Worker.sample_tokens``: a synchronous output is checked as it is
    returned; an asynchronous one when its ``get_output`` has synchronised (the host
    function ran), never earlier, and its token lists are not returned."""
    AsyncOutput = _async_output_class()
    outputs = []

    class Worker:
        def sample_tokens(self, grammar_output):
            return outputs.pop()

    Worker.sample_tokens = check_at_step_sync(Worker.sample_tokens)
    worker = Worker()
    job, ids, _ = moe_job()
    job.name("model.layers.2.mlp.experts")

    outputs.append(_SyncOutput())
    assert worker.sample_tokens(None).sampled_token_ids == [[5]]  # nothing failed
    ids[0, 0] = E
    as_host_function(job)  # the step's device work, done before the runner returned
    outputs.append(_SyncOutput())
    with pytest.raises(JobFailed, match="model.layers.2.mlp.experts"):
        worker.sample_tokens(None)

    pending = AsyncOutput(job)  # the host function has not run yet when sample_tokens returns
    outputs.append(pending)
    assert worker.sample_tokens(None) is pending
    with pytest.raises(JobFailed, match="model.layers.2.mlp.experts"):
        pending.get_output()
    ids[0, 0] = 1
    outputs.append(AsyncOutput(job))
    assert worker.sample_tokens(None).get_output().sampled_token_ids == [[5]]


def test_the_job_counts_its_own_runs_and_tokens_with_no_python_on_the_way():
    """A CUDA graph replays the host function with no Python: the job a layer made for a
    step shape (the one its host function runs) counts every run through the function
    pointer, and the layer's report reads those counters."""
    from selective_offload.wrappers.host_compute import HostExperts

    job, ids, _ = moe_job()
    weights = ExpertWeights("bf16", job.tensors["w13"], job.tensors["w2"])
    layer = HostExperts("model.layers.3.mlp.experts", weights, Activation("silu"), crossover_tokens=4, threads=1,
                        device=torch.device("cpu"))
    slot = layer.slot(torch.zeros(T, H, dtype=torch.bfloat16), ids, pinned=False)  # made once, as at capture
    slot.ids.copy_(ids)
    slot.weights.fill_(0.5)
    for _ in range(5):
        as_host_function(slot.job)
    assert (slot.job.runs, slot.job.tokens, slot.job.experts_read) == (5, 5 * T, 5 * E)
    served = layer.counts.as_dict()
    assert (served["host_steps"], served["host_tokens"]) == (5, 5 * T)
    assert served["host_bytes"] == 5 * E * weights.expert_bytes  # every expert picked once a run


def test_a_rows_job_counts_its_runs_and_its_bytes():
    from selective_offload.wrappers.host_compute import ServingCounts

    w = torch.randn(40, H).bfloat16()
    job = cpu_kernels.RowsJob(torch.randn(2, H).bfloat16(), w, torch.zeros(2, 40), threads=1)
    counts = ServingCounts()
    counts.add_job(job, bytes_per_run=40 * H * 2)
    for _ in range(3):
        as_host_function(job)
    assert counts.as_dict()["host_steps"] == 3 and counts.as_dict()["host_tokens"] == 6
    assert counts.host_bytes == 3 * 40 * H * 2


#: One step of a worker of a parallel engine, in a process of its own: vLLM's real
#: ``Worker.sample_tokens`` wrapped by the glue, a real C job failing as its host function
#: runs. The worker object is a stand-in for the rank identity only (its ``rank`` and vLLM's
#: real ``ParallelConfig``; a real ``Worker`` needs a device and a distributed world), and
#: its ``model_runner`` for the CUDA runner's step (it runs the job's host function, as the
#: step's device work, and returns an output of the kind given).
RANK_STEP = r"""
import logging, sys, types
sys.path.insert(0, sys.argv[1])
handler = logging.StreamHandler(sys.stderr)
handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
logging.getLogger("vllm.selective_offload").addHandler(handler)
from test_job_failures import E, _async_output_class, _SyncOutput, as_host_function, moe_job
from vllm.config import ParallelConfig
from vllm.v1.worker.gpu_worker import Worker
from selective_offload.cpu_kernels import JobFailed
from selective_offload.vllm_glue.host_compute import check_at_step_sync

sample_tokens = check_at_step_sync(Worker.sample_tokens)

def step(rank, fail, output, **parallel):
    job, ids, _ = moe_job()
    job.name("model.layers.2.mlp.experts")
    if fail:
        ids[0, 0] = E
    def run(grammar_output):
        as_host_function(job)
        return output
    worker = types.SimpleNamespace(rank=rank, parallel_config=ParallelConfig(**parallel),
                                   model_runner=types.SimpleNamespace(sample_tokens=run))
    return sample_tokens(worker, None)

for case in sys.argv[2:]:
    rank, fail, kind, tp, pp = case.split(",")
    output = _SyncOutput() if kind == "sync" else _async_output_class()(None)
    try:
        step(int(rank), fail == "fail", output, tensor_parallel_size=int(tp), pipeline_parallel_size=int(pp))
        print("RETURNED", case, flush=True)
    except JobFailed:
        print("RAISED", case, flush=True)
"""


def test_a_failed_job_on_a_rank_whose_output_vllm_does_not_read_ends_its_worker(tmp_path):
    """vLLM's executor reads one rank's step output (TP rank 0 of the last pipeline stage)
    and only logs another rank's exception; that rank's NaN partial sums still reach the
    output rank's tokens. So on any other rank a failed job ends the worker process (exit
    1, its one line logged), on both kinds of output, when ``sample_tokens`` returns; the
    output rank raises as before, and a clean step on another rank returns."""
    import os
    import subprocess
    import sys

    import selective_offload

    root = os.path.dirname(os.path.dirname(selective_offload.__file__))  # this checkout's package, not another
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}

    def run(*cases):
        r = subprocess.run([sys.executable, "-c", RANK_STEP, os.path.dirname(__file__), *cases], capture_output=True,
                           text=True, timeout=300, cwd=tmp_path, env=env)
        return r.returncode, r.stdout + r.stderr, r.stderr

    code, out, err = run("0,fail,sync,2,1", "3,ok,async,2,2", "1,fail,sync,2,1", "1,ok,sync,2,1")
    assert "RAISED 0,fail,sync,2,1" in out  # TP rank 0: the output rank raises
    assert "RETURNED 3,ok,async,2,2" in out  # TP rank 1 of the last stage: nothing failed
    assert code == 1, out
    assert "RETURNED 1,fail" not in out and "1,ok,sync" not in out  # the process ended at the failed step
    line = next(line for line in err.splitlines() if "model.layers.2.mlp.experts:" in line)
    assert line.startswith("ERROR ") and "not the rank whose output vLLM reads" in line and "plan the group served uva" in line
    code, out, _ = run("0,fail,async,1,2")  # the first pipeline stage, an output still on its way
    assert code == 1 and "RETURNED" not in out and "not the rank whose output vLLM reads" in out, out
