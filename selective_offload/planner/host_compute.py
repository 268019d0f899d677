"""Host-compute in planning: which CPU kernel format a checkpoint's routed experts are in,
whether that format has a kernel the committed benchmark claims fast, and the plan's notes
on it (why a format stays host-uva, the rates, the crossover, the threads).

The planner's quant methods (:mod:`.kernels`' names) map to the CPU kernels' formats
(:data:`CPU_FORMATS`); the verdict per format is ``selective_offload.cpu_kernels.claimed``'s
(one dict, the benchmark's). Nothing here prices a step: the step model
(:func:`selective_offload.estimate.host_compute_times`) does, and the placement
(:func:`.placement.place_hot`) chooses.
"""

from __future__ import annotations

from typing import Any, Mapping

from ..plan import HostCompute

#: The planner's quant methods (:data:`.kernels.METHODS`) -> the CPU kernel formats
#: (``cpu_kernels.claimed.CLAIMED``'s keys): unquantized bf16/fp16 experts are read by the
#: bf16 kernel, gpt-oss MXFP4 by the MXFP4 one, block FP8 by the block FP8 one, W4A16 int4
#: (GPTQ, AWQ, compressed-tensors) by the int4 one. Per-tensor FP8, NVFP4 and INT8 W8A8
#: have no CPU kernel format at all.
CPU_FORMATS = {"unquantized": "bf16", "mxfp4": "mxfp4", "fp8-block": "fp8-block", "wna16": "int4"}


def cpu_format(method: str | None, config: Mapping[str, Any] | None = None) -> str | None:
    """The CPU kernel format of experts quantized by ``method`` (``None``: none exists).
    Unquantized fp32 experts are not bf16: no CPU format."""
    if method == "unquantized" and config is not None:
        text = config.get("text_config") if isinstance(config.get("text_config"), Mapping) else {}
        dtype = str(config.get("torch_dtype") or config.get("dtype") or text.get("torch_dtype") or "bfloat16")
        if dtype.removeprefix("torch.") in ("float32", "float64"):
            return None
    return CPU_FORMATS.get(method or "")


def model_cpu_format(checkpoint: Any) -> str | None:
    """The CPU kernel format of a checkpoint's routed experts (from its config's quantization)."""
    from .kernels import method_of_config

    return cpu_format(method_of_config(checkpoint.config), checkpoint.config)


def claimed(fmt: str | None) -> bool:
    """Whether ``fmt`` has a CPU kernel the committed benchmark claims fast."""
    if fmt is None:
        return False
    from ..cpu_kernels.claimed import CLAIMED

    # mutation: unclaimed-format-placed
    return CLAIMED.get(fmt) is True


def unclaimed_reason(method: str | None, fmt: str | None) -> str:
    """Why a method's experts are not offered host-compute (for the plan's notes and the group's reason)."""
    if fmt is None:
        return (f"no CPU kernel format for {method or 'this quantization method'} experts (host-compute has "
                f"{', '.join(sorted(set(CPU_FORMATS.values())))}), so host experts are served uva")
    return (f"the {fmt} CPU kernel is not claimed fast by the committed benchmark "
            "(selective_offload/cpu_kernels/claimed.py), so host experts are served uva, not computed on the host")


def host_compute_notes(record: HostCompute | None, tokens: int) -> list[str]:
    """The plan's lines on host-compute: the rates and their sources, the thread split, the
    crossover, and whether this plan's own step (``tokens`` per step) is above it."""
    if record is None:
        return []
    lines = [record.describe()]
    if tokens > record.crossover_tokens:
        lines.append(f"a decode step of this plan ({tokens} tokens) is above the crossover "
                     f"({record.crossover_tokens}): its host experts are copied over the link and computed on the GPU")
    return lines
