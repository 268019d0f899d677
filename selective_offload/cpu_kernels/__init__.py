"""Routed experts of an MoE layer computed on the host CPU at decode (host-compute).

At batch 1 a token reads k experts' weights once, so a host that holds an expert can
compute it in about the time its bytes take to read from host memory, instead of moving
them over the link to the device. torch's own CPU paths reach that for bf16 but not for
the quantised formats (they dequantise into memory first), so this sub-package carries a
small C kernel (``moe.c``, compiled once per machine by the system compiler, see
``build``) that dequantises in registers while it streams the weights, for the layouts
vLLM's create_weights allocates (int4: held row-major, see ``weights``). It
imports no vLLM.

    out[t] = sum_j topk_weights[t, j] * (W2[e] @ act(W13[e] @ x[t] + b13[e]) + b2[e]),
    e = topk_ids[t, j], over the picks with e >= 0 and host_mask[e] set (the device
    computes the others); float32 [T, H]. Sums are float32; where the CPU has
    AVX512-BF16 the tokens and the activation between the projections are held in bf16
    (as vLLM's device kernels hold them), elsewhere in float32.

``CLAIMED`` (from ``claimed``) says which formats the project claims a fast kernel for:
those whose committed benchmark (``benchmarks/cpu_kernels/``, the result file
``CLAIM_SOURCE``) read the weights at no less than ``CLAIM_BAR`` of the machine's read
bandwidth at batch 1. A test keeps the table and the file in agreement. A plan made from a
probe of its host is claimed there instead (``claimed.verdict``).
"""

from __future__ import annotations

from . import build, reference
from .build import KernelCacheRefused, KernelUnavailable, openmp_runtimes
from .claimed import CLAIM_BAR, CLAIM_SOURCE, CLAIMED
from .kernel import TORCH_FORMATS, JobFailed, MoEJob, RowsJob, library, moe, raise_if_failed, read_gbps, rows
from .weights import FORMATS, Activation, ExpertWeights

__all__ = ["FORMATS", "CLAIMED", "CLAIM_BAR", "CLAIM_SOURCE", "Activation", "ExpertWeights", "KernelCacheRefused", "KernelUnavailable",
           "JobFailed", "MoEJob", "RowsJob", "TORCH_FORMATS", "library", "raise_if_failed", "moe", "read_gbps",
           "reference", "rows", "unavailable_reason", "openmp_runtimes", "build"]


def unavailable_reason(fmt: str, again: bool = False) -> str | None:
    """None when the compiled kernel serves ``fmt`` on this machine, else one line why not
    (``again``: a build or load that failed earlier in this process is tried once more).
    Whether it is claimed fast is :func:`claimed.verdict`'s to say, for a plan (the plan's
    reader asks it); the probe measures every format this says is served."""
    if fmt not in FORMATS:
        return f"host-compute: unknown format {fmt!r}; the formats are {', '.join(FORMATS)}"
    if fmt in TORCH_FORMATS:
        return None
    try:
        library(again)
    except KernelUnavailable as e:
        return str(e)
    return None
