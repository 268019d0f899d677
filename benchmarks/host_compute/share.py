"""The host-compute section's device-share measurement (``benchmarks.host_compute`` runs it after
the contention): one MoE layer with its first experts held on the device (in bf16, as the
worker holds them), the GPU computing the picks that land there while the host CPU computes
the rest. What it is for is
:func:`device_share`'s docstring; beside it, the same share held in the checkpoint's own
format and computed by the share kernel (:func:`native_part`).
"""

from __future__ import annotations

import os

from benchmarks.host_compute.layers import (
    ROUTINGS,
    TOL_BF16,
    TOL_F32,
    Shape,
    _reason,
    activation,
    capture,
    check,
    copier,
    distinct,
    make_inputs,
    timed,
)
from benchmarks.host_compute.sections import Ctx

#: The share of a layer's experts held on the device: about the share the planner gives the
#: bf16 reference plan on its card (docs/usage/moe.md's table).
SHARE = 0.3
#: Rows per program the native kernel is timed with; the fastest is its time.
NATIVE_BLOCK_ROWS = (16, 32, 64)


def device_share(ctx: Ctx, shape: Shape, weights) -> dict:
    """One token's layer served three ways, each a graph replay on CUDA (eager without):
    the whole layer on the host CPU (``whole``); the same with the first experts also on the
    device (``shared``: :class:`HostExperts` with ``device_share``, its host path on a side
    stream forked from the current one, the device share on the current stream meanwhile);
    and its two parts alone: the host path over the experts off the share (``host_part``)
    and the share's torch path on the device (``share_part``). ``overlap`` is (host_part +
    share_part - shared) / the shorter part: 1 when the GPU's share hides under the CPU's
    time, as the plan's estimate prices it, 0 when the two run one after the other.

    Without CUDA the "device" is the CPU and the two parts run in turn: the section checks
    the code path and the sum, not the overlap."""
    if not ctx.kernel_ok:
        return {"status": ctx.kernel}
    import torch

    from selective_offload import cpu_kernels
    from selective_offload.estimate.host import device_share_traffic
    from selective_offload.estimate.traffic import ExpertsRead
    from selective_offload.wrappers.host_compute import HostExperts

    act = activation(shape)
    on_device = max(1, round(SHARE * shape.experts))
    if on_device >= shape.experts:
        return {"status": f"{shape.name} has {shape.experts} experts: no share leaves the host any"}
    share = cpu_kernels.reference.held_share(weights, on_device, ctx.device)
    mask = torch.ones(shape.experts, dtype=torch.bool)
    mask[:on_device] = False

    def made(**kw):
        return HostExperts(shape.name, weights, act, crossover_tokens=1, threads=ctx.threads, device=ctx.device, **kw)

    whole, shared, host_part = made(), made(device_share=share), made(host_mask=mask)
    sets = make_inputs(shape, 1, 2 if ctx.small else ROUTINGS, seed=31)
    on = [tuple(t.to(ctx.device) for t in s) for s in sets]
    x_in, i_in, w_in = (t.clone() for t in on[0])

    def share_part(x, i, w):
        return cpu_kernels.reference.moe_picked(x, i, w, share, act)

    ref = cpu_kernels.reference.moe_reference(*sets[0], weights, act,
                                              int8_vectors=ctx.int8_mxfp4 and shape.fmt in ("mxfp4", "int4"))
    ctx.checks.append({"shape": shape.name, **check("device_share", 1, shared(*on[0]), ref, TOL_BF16)})
    out: dict = {"status": "measured", "shape": shape.name, "tokens": 1, "experts": shape.experts,
                 "on_device": on_device, "share_bytes": share.nbytes, "graph": ctx.cuda,
                 # what the step model prices the share's path at (bytes it moves, est): share_part's
                 # time against it is the rate the path reached, to set beside the card's decode reads
                 "share_traffic_bytes_est": device_share_traffic(ExpertsRead(
                     0, weights.nbytes, shape.experts, shape.k, "cpu", device_share=on_device / shape.experts,
                     held_nbytes=share.nbytes * shape.experts // on_device), 1)[0]}
    budget = 0.02
    for name, fn in (("whole", whole), ("shared", shared), ("host_part", host_part), ("share_part", share_part)):
        if ctx.cuda:  # a graph per path, fed by copying each routing into its captured inputs
            graph, _ = capture(lambda fn=fn: fn(x_in, i_in, w_in))
            out[f"{name}_s"] = timed(lambda j: graph.replay(), len(on), ctx.iters, True, ctx.deadline(budget),
                                     prepare=copier((x_in, i_in, w_in), on))
        else:
            out[f"{name}_s"] = timed(lambda j, fn=fn: fn(*on[j]), len(on), ctx.iters, False, ctx.deadline(budget))
    med = {k: out[f"{k}_s"]["median"] for k in ("whole", "shared", "host_part", "share_part")}
    shorter = min(med["host_part"], med["share_part"])
    out["overlap"] = (med["host_part"] + med["share_part"] - med["shared"]) / shorter if shorter else None
    out["shared_over_whole"] = med["shared"] / med["whole"] if med["whole"] else None
    out["share_part_gbps"] = out["share_traffic_bytes_est"] / med["share_part"] / 1e9 if med["share_part"] else None
    try:
        out["native"] = native_part(ctx, shape, weights, on_device, sets, on, med["share_part"])
    except Exception as exc:
        out["native"] = {"status": _reason(exc)}
    return out


def native_part(ctx: Ctx, shape: Shape, weights, on_device: int, sets, on, share_part_s: float) -> dict:
    """The same share held on the device as the checkpoint stores it (MXFP4 codes and scales,
    or bf16) and computed by ``wrappers.share_kernel.moe_native``, which reads each picked
    expert where it lies (what plans for MXFP4 checkpoints hold and run), against
    ``share_part`` (the bf16 share's torch path). Its rate is the bytes it reads (the stored
    bytes of the routing's distinct picks inside the share, averaged over the routings) over
    its time, to set beside the card's decode read rate, at which a plan prices such a share
    (``estimate.host.device_share_traffic``). Checked against the reference over the share's
    picks, with one pick of each token forced into the share.

    Without CUDA the kernel runs under Triton's interpreter (this section's process imports
    no other Triton code): checked, not timed."""
    import torch

    from selective_offload import cpu_kernels

    if not ctx.cuda:
        os.environ["TRITON_INTERPRET"] = "1"  # before Triton is first imported (share_kernel's docstring)
    try:
        from selective_offload.wrappers import share_kernel
    except ImportError as exc:
        return {"status": f"skipped: {exc}"}
    if shape.fmt not in share_kernel.FORMATS:
        return {"status": f"skipped: the share kernel reads {' and '.join(share_kernel.FORMATS)}, not {shape.fmt}"}
    act = activation(shape)
    held = share_kernel.native_share(weights, on_device, ctx.device)
    x, ids, tw = sets[0]
    ids = ids.clone()
    ids[:, 0] = torch.arange(ids.shape[0], dtype=ids.dtype) % on_device
    inside = torch.arange(shape.experts) < on_device
    ref = cpu_kernels.reference.moe_reference(x, ids, tw, weights, act, host_mask=inside)
    got = share_kernel.moe_native(x.to(ctx.device), ids.to(ctx.device), tw.to(ctx.device), held, act)
    ctx.checks.append({"shape": shape.name, **check("device_share_native", 1, got, ref, TOL_F32)})
    picked = [distinct(torch.where(i < on_device, i, -1)) * weights.expert_bytes for _, i, _ in sets]
    out: dict = {"status": "checked under Triton's interpreter (no CUDA): not timed" if not ctx.cuda else "measured",
                 "held_bytes": held.nbytes, "read_bytes_mean": sum(picked) / len(picked)}
    if not ctx.cuda:
        return out
    x_in, i_in, w_in = (t.clone() for t in on[0])
    prepare = copier((x_in, i_in, w_in), on)
    times = {}
    for rows in NATIVE_BLOCK_ROWS:
        graph, _ = capture(lambda rows=rows: share_kernel.moe_native(x_in, i_in, w_in, held, act, block_rows=rows))
        times[rows] = timed(lambda j: graph.replay(), len(on), ctx.iters, True, ctx.deadline(0.01), prepare=prepare)
    best = min(times, key=lambda r: times[r]["median"])
    med = times[best]["median"]
    out.update(block_rows=best, native_s=times[best], native_s_by_block_rows={str(r): t for r, t in times.items()},
               native_gbps=out["read_bytes_mean"] / med / 1e9 if med else None,
               native_over_share_part=med / share_part_s if share_part_s else None)
    return out
