"""Host-compute in planning: which CPU kernel format a checkpoint's routed experts are in,
whether that format has a kernel the committed benchmark claims fast, and the plan's notes
on it (why a format stays served uva, the rates, the crossover, the threads).

The planner's quant methods (:mod:`.kernels`' names) map to the CPU kernels' formats
(:data:`CPU_FORMATS`); the verdict per format is ``selective_offload.cpu_kernels.claimed``'s
(one dict, the benchmark's). Nothing here prices a step: the step model
(:func:`selective_offload.estimate.host.host_compute_times`) does, and the placement
(:func:`.placement.place_hot`) chooses.
"""

from __future__ import annotations

from typing import Any, Mapping

from ..plan_format import HostCompute
from ..plan_format.vocabulary import SERVED_UVA

#: The planner's quant methods (:data:`.kernels.METHODS`) -> the CPU kernel formats
#: (``cpu_kernels.claimed.CLAIMED``'s keys): unquantized bf16/fp16 experts are read by the
#: bf16 kernel, gpt-oss MXFP4 by the MXFP4 one, block FP8 by the block FP8 one, W4A16 int4
#: (GPTQ, AWQ and compressed-tensors in the layouts :func:`int4_read` names) by the int4
#: one. Per-tensor FP8, NVFP4 and INT8 W8A8 have no CPU kernel format at all.
CPU_FORMATS = {"unquantized": "bf16", "mxfp4": "mxfp4", "fp8-block": "fp8-block", "wna16": "int4"}


#: The same for a dense layer's MLP (its gate, up and down projections): MXFP4 quantizes
#: only routed experts (gpt-oss), so a dense MLP beside them has no format known here.
MLP_CPU_FORMATS = {method: fmt for method, fmt in CPU_FORMATS.items() if method != "mxfp4"}


def mlp_cpu_format(method: str | None, config: Mapping[str, Any] | None = None) -> str | None:
    """The CPU kernel format of a dense MLP's weights quantized by ``method`` (``None``: none)."""
    fmt = cpu_format(method, config)
    return fmt if method in MLP_CPU_FORMATS else None


#: Why a W4A16 checkpoint has no CPU format when :func:`int4_read` says no.
INT4_UNREAD = ("the int4 CPU kernel does not read this W4A16 layout (it reads GPTQ's and compressed-tensors' "
               "symmetric groups and AWQ GEMM's zero points, in groups of a multiple of 32, without act-order)")


def mlp_unclaimed_note(fmt: str | None, mlp_bytes: int, link_gbps: float, cpu_gbps: float,
                       method: str | None = None, inputs: Any = None) -> str:
    """Why a dense model's MLPs are not offered host-compute, and the alternative priced (a
    bf16 host copy of block FP8 or int4 weights: more bytes for the CPU to read per step)."""
    if fmt is None and method == "wna16":
        return f"host-compute: {INT4_UNREAD}: the dense MLPs are resident or prefetched with their layer"
    if fmt is None:
        return ("host-compute: the dense MLPs' weights have no CPU kernel format (host-compute has "
                f"{', '.join(sorted(set(MLP_CPU_FORMATS.values())))}): they are resident or prefetched with their layer")
    line = f"host-compute: {claim_of(fmt, inputs)[1]}, so no dense MLP is computed on the host"
    if fmt in ("fp8-block", "int4") and mlp_bytes:
        factor = 2 if fmt == "fp8-block" else 4
        copy = factor * mlp_bytes
        line += (f"; the alternative, a bf16 host copy of each MLP ({factor}x its {mlp_bytes / 1e9:.3f} GB: "
                 f"{copy / 1e9:.3f} GB), would cost the CPU {copy / (cpu_gbps * 1e9) * 1e3:.1f} ms per layer per step "
                 f"at {cpu_gbps:g} GB/s against {mlp_bytes / (cpu_gbps * 1e9) * 1e3:.1f} ms in {fmt} and "
                 f"{mlp_bytes / (link_gbps * 1e9) * 1e3:.1f} ms to copy the same MLP over the link (est; not offered)")
    return line


def cpu_format(method: str | None, config: Mapping[str, Any] | None = None) -> str | None:
    """The CPU kernel format of experts quantized by ``method`` (``None``: none exists).
    Unquantized fp32 experts are not bf16: no CPU format."""
    if method == "unquantized" and config is not None:
        text = config.get("text_config") if isinstance(config.get("text_config"), Mapping) else {}
        dtype = str(config.get("torch_dtype") or config.get("dtype") or text.get("torch_dtype") or "bfloat16")
        if dtype.removeprefix("torch.") in ("float32", "float64"):
            return None
    if method == "wna16" and config is not None and not int4_read(config):
        return None
    return CPU_FORMATS.get(method or "")


def int4_read(config: Mapping[str, Any]) -> bool:
    """Whether the int4 kernel reads a W4A16 checkpoint's layout: 4-bit groups of a multiple
    of 32 columns (or one per channel), no act-order, stored by GPTQ in symmetric groups or
    AWQ (GEMM, with its zero points; the glue rewrites both row-major) or compressed-tensors'
    symmetric ``pack-quantized`` (read as loaded)."""
    from .kernels import quantization_config

    qc = quantization_config(config)
    method = str(qc.get("quant_method", "")).lower().replace("_", "-")
    if method == "compressed-tensors":
        groups = [g for g in (qc.get("config_groups") or {}).values() if isinstance(g, Mapping)]
        w = (groups[0].get("weights") or {}) if len(groups) == 1 else {}
        strategy = w.get("strategy")
        group = w.get("group_size") if strategy == "group" else (-1 if strategy == "channel" else None)
        return (str(qc.get("format") or groups[0].get("format") or "") == "pack-quantized" and w.get("num_bits") == 4
                and w.get("symmetric", True) is True and w.get("actorder") != "group" and isinstance(group, int)
                and (group == -1 or group % 32 == 0)) if w else False
    if method in ("awq", "awq-marlin"):
        group = qc.get("group_size", qc.get("q_group_size", 128))
        return (qc.get("bits", qc.get("w_bit")) == 4 and qc.get("zero_point", True) is True
                and str(qc.get("version", "gemm")).lower() == "gemm" and isinstance(group, int) and group > 0
                and group % 32 == 0)
    group = qc.get("group_size", 128)
    return (method in ("gptq", "gptq-marlin", "auto-gptq") and qc.get("bits") == 4 and qc.get("sym", True) is True
            and not qc.get("desc_act", False) and isinstance(group, int) and (group == -1 or group % 32 == 0))


def not_computed(checkpoint: Any, kind: str) -> str | None:
    """Why the host kernels do not compute this checkpoint's routed experts (``kind``
    ``"experts"``) or dense MLPs (``"mlp"``), from its config as vLLM builds the layers,
    by the table the worker checks (:mod:`..cpu_kernels.capability`); None when they do."""
    from ..cpu_kernels import capability
    from ..names import mlp_prefix

    if kind == capability.EXPERTS:
        layer = capability.experts_of_config(checkpoint.config, checkpoint.facts.experts_per_token)
    else:
        layer = capability.mlp_of_config(checkpoint.config, [n for n in checkpoint.tensors if mlp_prefix(n)])
    why = capability.refusal(layer)
    what = "routed experts" if kind == capability.EXPERTS else "dense MLPs"
    return None if why is None else f"the CPU kernels do not compute these {what}: {why}"


def model_cpu_format(checkpoint: Any) -> str | None:
    """The CPU kernel format of a checkpoint's routed experts (from its config's quantization)."""
    from .kernels import method_of_config

    return cpu_format(method_of_config(checkpoint.config), checkpoint.config)


def claim_of(fmt: str | None, inputs: Any = None) -> tuple[bool, str]:
    """Whether ``fmt``'s CPU kernel is claimed fast for a plan of ``inputs``, and by what
    (``cpu_kernels.claimed.verdict``): on this host when the probe measured its rate and the
    host's read rate, else by the committed benchmark."""
    from ..cpu_kernels.claimed import verdict_for

    return verdict_for(fmt, inputs)


def claimed(fmt: str | None, inputs: Any = None) -> bool:
    """Whether ``fmt`` has a CPU kernel claimed fast for a plan of ``inputs`` (:func:`claim_of`)."""
    if fmt is None:
        return False
    return claim_of(fmt, inputs)[0] is True


def unclaimed_reason(method: str | None, fmt: str | None, inputs: Any = None) -> str:
    """Why a method's experts are not offered host-compute (for the plan's notes and the group's reason)."""
    if fmt is None and method == "wna16":
        return f"{INT4_UNREAD}, {SERVED_UVA}"
    if fmt is None:
        return (f"no CPU kernel format for {method or 'this quantization method'} experts (host-compute has "
                f"{', '.join(sorted(set(CPU_FORMATS.values())))}), {SERVED_UVA}")
    return f"{claim_of(fmt, inputs)[1]}, {SERVED_UVA}, not computed on the host"


def host_compute_notes(record: HostCompute | None, tokens: int, bound_tokens: int | None = None,
                       mlps: int = 0, shares: tuple[int, tuple[int, ...], int, int, bool, str] | None = None
                       ) -> list[str]:
    """The plan's lines on host-compute: the rates and their sources, the thread split, the
    crossover, the tokens per step at which the CPU turns compute-bound (a verify step of
    K + 1 tokens costs it K + 1 times the FLOPs on the same bytes), and whether this plan's
    own step (``tokens`` per step) is above the crossover. ``shares``: the device shares
    (layers, experts or channels on the device of each, of how many, their device bytes,
    whether they are dense MLPs' channels, how they are held: ``in bf16`` or ``as stored``)."""
    if record is None:
        return []
    lines = [record.describe()]
    if shares:
        layers, on_device, of, nbytes, channels, held = shares
        done = "those channels" if channels else "the picks that land there"
        lines.append(f"host-compute: each of the {layers} layers keeps its {share_words(on_device, of, channels)} "
                     f"on the device as well ({nbytes / 1e9:.3f} GB in all, held {held}): "
                     f"the GPU computes {done} while the CPU computes the rest, and the layer waits for the longer "
                     "(est)")
    if mlps:
        lines.append(f"host-compute: the MLPs of {mlps} dense layer{'s' if mlps != 1 else ''} are computed on the "
                     "host CPU (one expert every token takes); their attention, norms and KV stay on the GPU")
    if bound_tokens is not None:
        lines.append(f"host-compute: the CPU turns compute-bound at {bound_tokens} tokens per step (est: below it "
                     f"the step reads the same host bytes whatever its tokens; this plan's step is {tokens})")
    if tokens > record.crossover_tokens:
        lines.append(f"a decode step of this plan ({tokens} tokens) is above the crossover "
                     f"({record.crossover_tokens}): its host experts are copied over the link and computed on the GPU")
    return lines


def share_words(counts: tuple[int, ...], of: int, channels: bool) -> str:
    """Each shared layer's part on the device in words: ``first 40 of 128 routed experts``,
    and where the first layers hold one more (``planner.shares``), how many (``(41 in the
    first 29 layers)``)."""
    low, high = min(counts), max(counts)
    said = ["gate and up rows, down columns"] if channels else []
    if high != low:
        said.append(f"{high} in the first {sum(1 for c in counts if c == high)} layers")
    return (f"first {low} of {of} {'MLP channels' if channels else 'routed experts'}"
            + (f" ({'; '.join(said)})" if said else ""))


def declined_share_note(shares: tuple[int, tuple[int, ...], int, int, bool, str], rates: tuple[float, float] | None,
                        tokens: int) -> str:
    """Why the plan keeps no device share where the device had room for one: the share it
    priced (:func:`host_compute_notes`' ``shares``) and, when given, its rate and the rate of
    the placement kept (tok/s)."""
    layers, on_device, of, nbytes, channels, held = shares
    priced = (f"priced at {rates[0]:.2f} tok/s against {rates[1]:.2f} without it" if rates
              else "priced slower than the placement without it")
    return (f"host-compute: no device share: the room left holds, in each of the {layers} layers, "
            f"its {share_words(on_device, of, channels)}, {nbytes / 1e9:.3f} GB held {held}, {priced} "
            f"at {tokens} token(s) per step (est: docs/design/step-model.md prices the share's path on the GPU)")


def head_words(g) -> str:
    """The LM head split between the GPU and the CPU (a group served compute with
    ``device_channels`` of its ``intermediate`` vocabulary rows on the device), in words."""
    host = g.intermediate - g.device_channels
    return (f"LM head {g.group}: its last {host} of {g.intermediate} vocabulary rows computed by the host CPU "
            f"(the host kernel's bf16 row walk over a host copy of the head), the first {g.device_channels} on the "
            "device beside it")


def head_note(g) -> str:
    """The plan's note on its split LM head (:func:`head_words`): why it pays."""
    return (f"host-compute: {head_words(g)}: the CPU is otherwise idle while the GPU reads the head at the end of "
            "a step, so the two parts are sized to take about as long (est), and the device memory the host's rows "
            "free holds more of the layers' device shares; above its own crossover (host_compute.head_crossover_tokens: "
            "its CPU part turns compute-bound at far fewer logits per step than a layer's experts) the host's rows "
            "are copied to the device and computed there")
