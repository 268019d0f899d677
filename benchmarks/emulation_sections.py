"""The decode emulation's measured sections: batch 1 and the batch sweep on one placement,
speculative verification on one placement of the MTP plan, and routed-expert reads.

Why a module of its own: each section builds a placement (``emulated_model.build``) under
the device cap, times its steps against a shared time budget, records peak device memory
against the cap, and frees it before the next; ``decode_emulation.py`` decides what to
run and writes the results, ``emulation_report.py`` renders them.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass

from _common import EXPERT_SHAPES, routed_expert_reads, spread, time_s
from emulated_model import Runner, Shape, build
from emulation_estimate import break_even_accept, draft_bytes, predict


def timed(fn, steps: int, cuda: bool, deadline: float, warmup: int = 2) -> list[float]:
    import torch

    with torch.no_grad():
        return time_s(fn, steps, cuda, warmup=warmup, deadline=deadline)


class Budget:
    """``--max-seconds`` shared by every timed point, in proportion to its planned steps."""

    def __init__(self, seconds: float, weight: float) -> None:
        self.end, self.left = time.perf_counter() + seconds, weight

    def deadline(self, weight: float) -> float:
        now = time.perf_counter()
        share = max(0.0, self.end - now) * weight / max(self.left, weight)
        self.left -= weight
        return now + share

    def skip(self, weight: float) -> None:
        self.left -= weight


@dataclass
class Ctx:
    cuda: bool
    device: object
    cap_info: dict
    bw: dict
    budget: Budget
    prefetch_step: int


def _cap_for(ctx: Ctx, capped: bool) -> None:
    import torch

    if ctx.cuda:
        torch.cuda.set_per_process_memory_fraction(ctx.cap_info["fraction"] if capped else 1.0, ctx.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(ctx.device)


def _peak(ctx: Ctx, row: dict, capped: bool, key: str = "peak_device_bytes") -> None:
    import torch

    if ctx.cuda:
        peak = torch.cuda.max_memory_allocated(ctx.device)
        row[key] = peak
        if capped:
            row["under_cap"] = peak <= ctx.cap_info["cap_bytes"] and row.get("under_cap", True)
        else:
            row["under_cap"] = None


def _free(ctx: Ctx) -> None:
    import torch

    gc.collect()
    if ctx.cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        getattr(torch._C, "_host_emptyCache", lambda: None)()


def _build_capped(ctx: Ctx, name: str, plan, shape: Shape):
    """Build one placement under its device cap (every placement but ``resident`` is capped):
    ``(model, runner, seconds to build, None)``, or ``(None, None, None, the OOM's first line)``
    when it does not fit the cap."""
    import torch

    _cap_for(ctx, name != "resident")
    t0 = time.perf_counter()
    try:
        emu = build(name, plan, shape, ctx.cuda, ctx.device)
        runner = Runner(emu, ctx.prefetch_step, ctx.cuda, ctx.device)
    except torch.OutOfMemoryError as err:
        return None, None, None, str(err).splitlines()[0]
    return emu, runner, time.perf_counter() - t0, None


def measure_placement(ctx: Ctx, name: str, plan, shape: Shape, steps: int, batches: list[int],
                      sweep_steps: int) -> tuple[dict, dict | None]:
    """Section 1 (batch 1) and section 2 (the batch sweep) on one built placement."""
    import torch

    row: dict = {"config": name}
    sweep: dict = {"config": name, "rows": []}
    capped = name != "resident"
    emu, runner, build_s, error = _build_capped(ctx, name, plan, shape)
    if error is not None:
        row.update(status="does not fit the cap", error=error)
        sweep.update(status=row["status"])
        ctx.budget.skip(steps + sweep_steps * len(batches))
        return row, sweep
    row["build_s"] = build_s
    row.update(predict(emu, ctx.bw))
    times = timed(lambda: runner.decode_step(1), steps, ctx.cuda, ctx.budget.deadline(steps))
    s = spread(times)
    row.update(status="measured", capped=capped, step_s=s, tok_s=1.0 / s["median"],
               measured_over_est=s["median"] / row["est_step_s"])
    if "est_step_s_overlapped" in row:
        row["measured_over_est_overlapped"] = s["median"] / row["est_step_s_overlapped"]
    _peak(ctx, row, capped)
    row["host_pinned_bytes"] = emu.arena.buffer.numel()
    print(f"{name}: step {s['median'] * 1e3:.2f} ms (est {row['est_step_s'] * 1e3:.2f} ms)", flush=True)

    sweep.update(status="measured", capped=capped)
    runner.matvec = False
    for n, b in enumerate(batches):
        point: dict = {"batch": b}
        try:
            times = timed(lambda: runner.decode_step(b), sweep_steps, ctx.cuda,
                          ctx.budget.deadline(sweep_steps), warmup=1)
        except torch.OutOfMemoryError as err:
            point.update(status="does not fit the cap", error=str(err).splitlines()[0])
            sweep["rows"].append(point)
            ctx.budget.skip(sweep_steps * (len(batches) - n - 1))
            break  # a larger batch needs more; the prefetcher's cycle is broken anyway
        s = spread(times)
        est = predict(emu, ctx.bw, tokens=b)
        point.update(status="measured", step_s=s, per_seq_tok_s=1.0 / s["median"],
                     total_tok_s=b / s["median"], est_step_s=est["est_step_s"],
                     est_total_tok_s=b / est["est_step_s"],
                     measured_over_est=s["median"] / est["est_step_s"])
        sweep["rows"].append(point)
        print(f"{name} batch {b}: step {s['median'] * 1e3:.2f} ms, {b / s['median']:.1f} tok/s in all",
              flush=True)
    _peak(ctx, sweep, capped)
    runner = emu = None  # noqa: F841 (frees the placement before the next is built)
    _free(ctx)
    return row, sweep


def measure_verification(ctx: Ctx, name: str, plan, shape: Shape, ks: list[int], steps: int,
                         plain_step_s: float | None) -> dict:
    """Section 3 on one placement of the MTP plan: K = 0 (a plain step), then each K."""
    import torch

    out: dict = {"config": name, "rows": []}
    capped = name != "resident"
    points = [0] + ks
    weight = steps * (len(points) + len(ks))
    emu, runner, build_s, error = _build_capped(ctx, name, plan, shape)
    if error is not None:
        out.update(status="does not fit the cap", error=error)
        ctx.budget.skip(weight)
        return out
    runner.matvec = False
    out.update(status="measured", capped=capped, build_s=build_s,
               host_pinned_bytes=emu.arena.buffer.numel())
    base = predict(emu, ctx.bw)
    dev_b, link_b = draft_bytes(emu)
    out.update(link_bytes_per_step=base["link_bytes_per_step"],
               device_read_bytes_per_step=base["device_read_bytes_per_step"],
               draft_device_bytes=dev_b, draft_link_bytes=link_b)
    est_draft_one = dev_b / (ctx.bw["device_read_gbps"] * 1e9) + link_b / (ctx.bw["link_gbps"] * 1e9)
    k0 = None
    for k in points:
        point: dict = {"k": k, "tokens_verified": k + 1}
        try:
            s = spread(timed(lambda: runner.spec_step(k), steps, ctx.cuda, ctx.budget.deadline(steps), warmup=1))
            d = (spread(timed(lambda: runner.drafts(k), steps, ctx.cuda, ctx.budget.deadline(steps), warmup=1))
                 if k else None)
        except torch.OutOfMemoryError as err:
            point.update(status="does not fit the cap", error=str(err).splitlines()[0])
            out["rows"].append(point)
            break
        est = predict(emu, ctx.bw, tokens=k + 1)["est_step_s"] + k * est_draft_one
        point.update(status="measured", step_s=s, draft_s=d, est_step_s=est, est_draft_s=k * est_draft_one,
                     measured_over_est=s["median"] / est, max_tok_s=(k + 1) / s["median"])
        if k == 0:
            k0 = point
        # Acceptance rates only where there are drafts to accept (K >= 1).
        if k0 is not None:
            need = s["median"] / k0["step_s"]["median"]
            point.update(break_even_tokens_per_step=need, est_break_even_tokens_per_step=est / k0["est_step_s"])
            if k:
                point["break_even_accept_rate"] = break_even_accept(k, need)
        if plain_step_s:
            need = s["median"] / plain_step_s
            point["break_even_tokens_vs_plain_plan"] = need
            if k:
                point["break_even_accept_rate_vs_plain_plan"] = break_even_accept(k, need)
        out["rows"].append(point)
        print(f"{name} K={k}: step {s['median'] * 1e3:.2f} ms"
              + (f" (drafts {d['median'] * 1e3:.2f} ms)" if d else "")
              + (f", break even at {point['break_even_tokens_per_step']:.2f} tokens/step"
                 if "break_even_tokens_per_step" in point else ""), flush=True)
    _peak(ctx, out, capped)
    runner = emu = None  # noqa: F841 (frees the placement before the next is built)
    _free(ctx)
    return out


def measure_routed_experts(cuda: bool, device, scale: float, quick: bool) -> dict:
    """Section 4: each reference MoE layer's routed experts, scaled like everything else."""
    out = {"shapes": {}}
    for name, shape in EXPERT_SHAPES.items():
        expert_bytes = max(1 << 16, int(shape["expert_bytes"] * scale))
        out["shapes"][name] = routed_expert_reads(shape["num_experts"], shape["experts_per_token"], expert_bytes,
                                                  cuda, tokens=(1, 4) if quick else (1, 4, 16),
                                                  iters=3 if quick else 10, device=device)
        print(f"routed experts {name}: {[(p['tokens'], p['uva_speedup_over_copy']) for p in out['shapes'][name]['rows']]}",
              flush=True)
    return out
