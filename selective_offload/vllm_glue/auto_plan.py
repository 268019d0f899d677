"""``SELECTIVE_OFFLOAD_PLAN=auto``: the plan made inside the worker, from the real card.

Where a plan file is made ahead (``selective-offload plan``), someone had to know the
card's memory, the KV cache vLLM will want and the link. At engine start the worker knows
them: the device memory vLLM may use (total x ``gpu_memory_utilization``), the KV cache
(``kv_cache_memory_bytes`` when set, else one sequence of ``max_model_len`` tokens: the
least vLLM will start with; what remains goes to the KV cache anyway), speculative
settings from the engine's config, and the link, the per-layer hand-off and the host CPU
kernel rates measured by ``selective-offload probe`` on this machine (else the reference
laptop's link, the assumed hand-off and the reference host's kernel rate). So ``vllm serve MODEL`` with one
environment variable is all a user does. The plan is written beside the report and shown
in it.

On the CPU build there is no device memory to fit in: the plan is resident unless
``SELECTIVE_OFFLOAD_DEVICE_MEMORY`` says how much device memory to plan for (used by the
tests, and to rehearse a card's plan on a machine without one).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..checkpoint import load_checkpoint
from ..errors import PlanError, UserError
from ..kv_model import KV_DTYPE_BYTES, KvModel
from ..options import ENV_DEVICE_MEMORY, ENV_PLAN, device_memory_from_env
from ..plan_format import DEFAULT_RESERVE_BYTES, Plan, PlanInputs
from ..plan_format.inputs import DEFAULT_CARD, MOE_SETTINGS, moe_setting
from ..plan_options import with_measured_cpu_rate
from ..planner import kernels, make_plan
from ..planner.allocation import ASSUMED_BATCHED_TOKENS, model_device_bytes
from ..planner.cards import card_memory
from ..probe import load_profile, plan_bandwidths, plan_defaults
from ..sizes import GiB
from . import preflight


def device_memory_for(vllm_config, device: torch.device, checkpoint_bytes: int, kv_bytes: int,
                      reserve_bytes: int) -> tuple[int, str]:
    """The device memory the plan fits in, and where that figure came from."""
    override = device_memory_from_env()
    if override is not None:
        return override, f"{ENV_DEVICE_MEMORY}={os.environ[ENV_DEVICE_MEMORY].strip()}"
    if device.type == "cuda" and torch.cuda.is_available():
        _, total = torch.cuda.mem_get_info(device)
        share = float(getattr(vllm_config.cache_config, "gpu_memory_utilization", 0.9) or 0.9)
        return int(total * share), f"{total / GiB:.2f} GiB on {device} x gpu_memory_utilization {share}"
    # No device memory limit (the CPU build): everything fits.
    return checkpoint_bytes + kv_bytes + reserve_bytes, f"no device memory limit on {device}: the plan is resident"


def measured_usable(device: torch.device, device_memory: int) -> tuple[int, str] | None:
    """On CUDA, the smaller of ``device_memory`` and what the card has free now, after this
    worker's CUDA context (the card's real size, measured: ``planner.cards``); ``None``
    elsewhere (the planner's card rule then applies to the figure given)."""
    if device.type != "cuda" or not torch.cuda.is_available() or device_memory_from_env() is not None:
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return min(int(free), device_memory), f"measured: {free / GiB:.2f} GiB free after the CUDA context, at engine start"


def card_of_worker(device: torch.device) -> str | None:
    """The worker's compute capability ("8.9") when it is a CUDA device, else ``None`` (the
    plan then says which card it assumed)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return kernels.card_of(torch.cuda.get_device_capability(device))


def kv_bytes_for(vllm_config, checkpoint) -> tuple[int, str]:
    explicit = getattr(vllm_config.cache_config, "kv_cache_memory_bytes", None)
    if explicit:
        return int(explicit), "kv_cache_memory_bytes"
    dtype = str(getattr(vllm_config.cache_config, "cache_dtype", "auto") or "auto")
    kv = KvModel.from_config(checkpoint.config, KV_DTYPE_BYTES.get(dtype, 2))
    length = int(vllm_config.model_config.max_model_len)
    if kv is None:
        return 1 * GiB, "1 GiB (the config does not say enough to size the KV cache)"
    return kv.cache_bytes(length, 1), f"one sequence of max_model_len {length} ({kv.description})"


def setting_of_server(vllm_config) -> str:
    """The MoE setting this server runs with (its ``moe_backend`` and ``VLLM_USE_DEEP_GEMM``),
    in the plan's vocabulary; a backend the plan's table does not know is planned as vLLM's
    default, and the glue's check at load decides on the kernel vLLM really builds."""
    import vllm.envs as envs

    backend = str(getattr(getattr(vllm_config, "kernel_config", None), "moe_backend", "auto") or "auto")
    setting = moe_setting(backend, deep_gemm=bool(envs.VLLM_USE_DEEP_GEMM))
    return setting if setting in MOE_SETTINGS else "auto"


def _what_to_change(memory_from: str) -> str:
    """The engine's settings that give the plan more room, the device memory's source first."""
    memory = (f"raise {ENV_DEVICE_MEMORY} toward the card's memory" if memory_from.startswith(ENV_DEVICE_MEMORY)
              else "raise gpu_memory_utilization, use a larger card")
    return f"{memory}, lower max_model_len or kv_cache_memory_bytes, or serve a smaller checkpoint"


def plan_at_start(settings_options, vllm_config, model_config, device: torch.device) -> tuple[Plan, list[str]]:
    """Plan the checkpoint vLLM is loading for this card; write it beside the report."""
    model_dir = Path(str(model_config.model))
    if not model_dir.is_dir():
        raise PlanError(f"SELECTIVE_OFFLOAD_PLAN=auto plans from the checkpoint's headers, and {model_dir} is not a "
                        "local directory; download it first, or make a plan with `selective-offload plan`")
    checkpoint = load_checkpoint(model_dir)
    kv_bytes, kv_from = kv_bytes_for(vllm_config, checkpoint)
    card, setting = card_of_worker(device), setting_of_server(vllm_config)
    # the bytes vLLM holds for the model on this card (routed experts padded for its kernel,
    # post-processed, and its fused-MoE workspace)
    tokens = preflight.batched_tokens_of(vllm_config)  # the engine's own step, for its fused-MoE workspace
    allocated = model_device_bytes(checkpoint.config, checkpoint.tensors, card or DEFAULT_CARD, setting,
                                   tokens or ASSUMED_BATCHED_TOKENS)
    device_memory, memory_from = device_memory_for(vllm_config, device, allocated, kv_bytes, DEFAULT_RESERVE_BYTES)
    profile = load_profile()
    link, vram, link_from = plan_bandwidths(profile)
    measured = plan_defaults(profile)  # the UVA read and matmul rates the probe measured, if it did
    spec = vllm_config.speculative_config
    mtp = spec is not None and "mtp" in str(getattr(spec, "method", "") or "")
    usable = measured_usable(device, device_memory)
    inputs = PlanInputs(
        usable_device_bytes=usable[0] if usable else None, usable_from=usable[1] if usable else None,
        compute_capability=card,
        moe_setting=setting,
        device_memory_bytes=device_memory, kv_cache_bytes=kv_bytes,
        link_gbps=link, vram_gbps=vram, uva_gbps=measured["uva_gbps"], compute_tflops=measured["compute_tflops"],
        decode_read_gbps=measured["decode_read_gbps"],
        handoff_s=measured["handoff_s"],  # the per-layer hand-off the probe timed on this card
        cpu_threads=measured["cpu_threads"],  # the pool the probe timed the host kernels with
        speculative="mtp" if mtp else None,
        spec_tokens=int(getattr(spec, "num_speculative_tokens", 0) or 0) or None if mtp else None,
        max_num_batched_tokens=tokens,
    )
    usable_bytes = usable[0] if usable else card_memory(device_memory)[0]  # the planner's rule (planner.cards)
    budget = usable_bytes - kv_bytes - DEFAULT_RESERVE_BYTES
    if budget <= 0:  # PlanInputs would name the CLI's flags; here the inputs are the engine's
        raise PlanError(f"SELECTIVE_OFFLOAD_PLAN=auto: device memory {usable_bytes / GiB:.2f} GiB ({memory_from}) "
                        f"leaves nothing for weights after the KV cache {kv_bytes / GiB:.2f} GiB ({kv_from}) and "
                        f"the {DEFAULT_RESERVE_BYTES / GiB:.0f} GiB reserve; "
                        + (f"raise {ENV_DEVICE_MEMORY} to the card's memory" if memory_from.startswith(ENV_DEVICE_MEMORY)
                           else "lower max_model_len or kv_cache_memory_bytes"))
    # The host kernel's rate for the model's format and the host's read rate, where the probe
    # measured them: they price host-compute and decide its claim on this host.
    inputs = with_measured_cpu_rate(inputs, checkpoint, profile)
    plan = make_plan(checkpoint, inputs)
    # The rule enable() applies to a plan it is given: an infeasible plan is not run.
    plan.require_feasible(f"{ENV_PLAN}=auto: the plan made at engine start for {model_dir} ({memory_from})",
                          _what_to_change(memory_from))
    notes = [f"plan made at engine start: device memory {device_memory / GiB:.2f} GiB ({memory_from}); KV cache "
             f"{kv_bytes / GiB:.2f} GiB ({kv_from}); {link_from}; strategy {plan.strategy}"]
    if settings_options.report_path:
        path = Path(settings_options.report_path).with_name("plan.json")
        try:  # never over a file of the user's (outputs.py): the plan is then only in the report
            plan.save(path)
            notes.append(f"the plan is written to {path}")
        except UserError as exc:
            notes.append(f"the plan is not written: {exc}")
    return plan, notes
