"""The host-compute section's LM head split (``benchmarks.host_compute`` runs it after the device
share): gpt-oss's LM head with the rows its reference plan leaves the host CPU, the GPU
computing the others meanwhile. What it is for is :func:`lm_head_split`'s docstring.
"""

from __future__ import annotations

from benchmarks.host_compute.layers import TOL_BF16, check, timed
from benchmarks.host_compute.sections import Ctx

#: gpt-oss's LM head (vocabulary x hidden, bf16) and the vocabulary rows its reference plan
#: keeps on the device (benchmarks/results/moe-plans-est.md: the last 27776 of
#: 201088 on the host CPU); a small head with the same split for --small.
HEAD, DEVICE_ROWS = (201088, 2880), 173312
SMALL_HEAD, SMALL_DEVICE_ROWS = (1024, 256), 896


def lm_head_split(ctx: Ctx) -> dict:
    """One token's logits three ways, each timed as the worker runs it (eager: vLLM computes
    logits outside its graphs): the whole head read by the GPU (``whole``, what a plan without
    the split does); the head split (``split``: :class:`HostRows`, the hidden state down, the
    device's rows on the GPU meanwhile, the host's rows by the CPU's row walk, their logits
    up); and its two parts alone: the device's rows (``device_part``) and the host's rows on
    the CPU from a host token (``host_part``). ``overlap`` is (host part + device part -
    split) / the shorter part: 1 when the GPU's rows hide under the CPU's time, as the plan
    prices the split, 0 when they run one after the other; ``split_over_whole`` below 1 is
    the step time the split saves. The parts' rates (bytes over time) set beside the plan's
    host kernel and decode read rates.

    Without CUDA the "device" is the CPU and the parts run in turn: the section checks the
    code path and the sum, not the overlap."""
    if not ctx.kernel_ok:
        return {"status": ctx.kernel}
    import torch
    import torch.nn.functional as F

    from selective_offload.wrappers.host_rows import HostRows

    (rows, hidden), on_device = (SMALL_HEAD, SMALL_DEVICE_ROWS) if ctx.small else (HEAD, DEVICE_ROWS)
    host = torch.empty(rows, hidden, dtype=torch.bfloat16, pin_memory=ctx.cuda).uniform_(-0.05, 0.05)
    whole = host.to(ctx.device, copy=True)
    split = HostRows("lm_head", host, on_device, crossover_tokens=1, device=ctx.device, threads=ctx.threads)
    x = torch.randn(1, hidden, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16).to(ctx.device)
    x_host = x.cpu()
    ref = F.linear(x_host.float(), host.float())
    ctx.checks.append({"shape": f"LM head {rows}x{hidden}", **check("lm_head_split", 1, split(x), ref, TOL_BF16)})
    budget = 0.02
    paths = {"whole": lambda j: F.linear(x, whole), "split": lambda j: split(x),
             "device_part": lambda j: F.linear(x, split.device_weight),
             "host_part": lambda j: split._host_rows(x_host)}
    out: dict = {"status": "measured", "rows": rows, "hidden": hidden, "device_rows": on_device,
                 "host_rows": rows - on_device, "threads": ctx.threads, "graph": False}
    for name, fn in paths.items():
        out[f"{name}_s"] = timed(fn, 1, ctx.iters, ctx.cuda, ctx.deadline(budget))
    med = {k: out[f"{k}_s"]["median"] for k in paths}
    shorter = min(med["host_part"], med["device_part"])
    out["overlap"] = (med["host_part"] + med["device_part"] - med["split"]) / shorter if shorter else None
    out["split_over_whole"] = med["split"] / med["whole"] if med["whole"] else None
    out["host_part_gbps"] = (rows - on_device) * hidden * 2 / med["host_part"] / 1e9 if med["host_part"] else None
    out["device_part_gbps"] = on_device * hidden * 2 / med["device_part"] / 1e9 if med["device_part"] else None
    out["whole_gbps"] = rows * hidden * 2 / med["whole"] / 1e9 if med["whole"] else None
    return out


def markdown_lines(r: dict) -> list[str]:
    """The section's part of the host-compute markdown."""
    s = r.get("lm_head_split") or {"status": "not reached"}
    lines = ["## The LM head split: its last rows on the host CPU, the others on the GPU meanwhile", ""]
    if s["status"] != "measured":
        return lines + [f"Status: {s['status']}.", ""]
    from benchmarks.common import fmt, md_table

    def us(t: dict) -> str:
        return f"{t['median'] * 1e6:.1f}"

    return lines + [
        md_table(["head", "rows on the device", "whole on the device us (GB/s)", "split us", "device part us (GB/s)",
                  "host part us (GB/s)", "overlap", "split / whole"],
                 [[f"{s['rows']}x{s['hidden']} bf16", f"{s['device_rows']} of {s['rows']}",
                   f"{us(s['whole_s'])} ({fmt(s['whole_gbps'], 1)})", us(s["split_s"]),
                   f"{us(s['device_part_s'])} ({fmt(s['device_part_gbps'], 1)})",
                   f"{us(s['host_part_s'])} ({fmt(s['host_part_gbps'], 1)})", fmt(s["overlap"], 2),
                   fmt(s["split_over_whole"], 3)]]),
        "One token, eager calls as the worker makes them (vLLM computes logits outside its graphs)"
        + ("" if r.get("cuda") else "; no CUDA: the device's rows run on the CPU, in turn") + ". Overlap: (host part "
        "+ device part - split) / the shorter part (1: the GPU's rows hidden under the CPU's time, as the plan prices "
        "the split).", ""]
