"""A decode step of a Qwen3.8-27B-FP8-sized model in plain torch, under a 24 GiB cap:
vLLM-style bulk offload against the selective placement, measured against bytes/bandwidth;
then the same placements at larger batches, and speculative decoding's verification step.

Why: the claim that selective offload beats ``cpu_offload_gb`` is a claim about bytes over
the link per step. This checks it on a GPU where vLLM cannot be installed (or before it
is): random weights with the reference checkpoint's byte counts, the planner's own
placement decisions (``make_plan`` on the bundled manifest), and the project's mechanism
pieces (``HostGather`` for the embedding, ``cuda_view_of_pinned`` for UVA reads).

The step. Every resident byte is read once per step, as a bandwidth-bound decode step
does: each decoder layer is one uint8 buffer of the layer's byte count (0.38 GB of FP8
weights), read as a bf16 matrix [rows, hidden] by one matrix-vector product (so an FP8
layer is emulated by a bf16 matrix of the same bytes: twice the bytes per element, half
the elements; the bytes read are exact, the FLOPs are not). Then the LM head (bf16,
248320 x 5120) and an argmax give the next token, whose embedding row starts the next
step. Attention, KV cache and activations beyond one vector are left out. A step of
``n`` tokens is the same pass with ``n`` rows: one matrix product per weight (``x @ W.T``),
every weight byte still crossing once (when the GEMM's tile covers the ``n`` rows).

Configurations (all from the plan for ``--device-memory``, default 24 GiB, scaled):

- ``bulk``: vLLM's ``cpu_offload_gb`` as the planner prices it (``plan.bulk``): the first
  bytes of the layer stack in model order live in pinned host memory and are read in
  place every step through a UVA device view (zero-copy, as vLLM's UVA offloader does);
  the embedding, LM head and vision tower stay on the device.
- ``selective``: the plan itself: the embedding in pinned host memory read by
  ``HostGather`` (one row per token crosses the link), the vision tower on the host (not
  read by a text step, so not allocated here), the LM head resident, and the plan's exact
  hot layers in pinned memory, prefetched on a side stream into ``prefetch_step`` static
  device slots (the next hot layer's copy overlaps the resident layers before it).
- ``resident``: everything on the device, no cap; run only when the device has room (a
  reference for the device-bandwidth term).

Sections:

1. **Batch 1** (the table it always had): first it measures the link (pinned
   host-to-device copy), the UVA read rate and the device read rate (the same
   matrix-vector product over resident memory); then it predicts each configuration's step
   time from its bytes (``est_``: link bytes / link rate + device bytes / device rate, the
   planner's formula; for ``selective`` also the fully overlapped bound max(link, device))
   and reports measured against predicted.
2. **Batch sweep** (``--batches``, default 1,4,16,64): the same built placements, a step
   of ``b`` sequences x 1 token; per-sequence tok/s (1 / step) and total tok/s (b / step)
   against est (the bytes barely grow with ``b``: est total tok/s is b / est step, the
   planner's upper bound). Attention and KV reads, which grow with the batch, are not
   emulated.
3. **Speculative verification** (``--draft-k``, default 1,2,3): placements re-planned for
   MTP speculative decoding (``make_plan(..., speculative="mtp")``: the MTP head resident,
   more layers hot). A step drafts ``K`` tokens, each one pass over an MTP-sized matrix
   (the head's bytes: its decoder layer and ``fc``) plus the LM head, its embedding row
   read the way the configuration reads the embedding, then verifies ``K + 1`` tokens in
   one pass over the weights. ``K = 0`` is a plain step on this placement. Reported: time
   per step (drafts included), the drafts alone, and the tokens per step a verification
   must yield to break even: against the plain step on this placement, and against the
   batch-1 step of the plan made without MTP (what turning MTP on must beat); with the
   per-token acceptance rate that yields them if acceptances are independent,
   ``E(K, a) = (1 - a**(K + 1)) / (1 - a)``.
4. **Routed experts** (``--experts``, default on): one MoE layer's routed experts in
   pinned host memory (Qwen3-30B-A3B's and gpt-oss-120b's shapes, scaled), a step of T
   tokens (1, 4, 16) reading the distinct experts its tokens route to in place through a
   UVA view inside a kernel, against copying the whole layer to the device first (what a
   prefetch offloader moves) and against device-resident reads
   (``_common.routed_expert_reads``). On CUDA this measures the UVA read efficiency the
   planner's host-uva price assumes; on the CPU "UVA" is a plain read (no link).

The cap: ``torch.cuda.set_per_process_memory_fraction(cap / total)``, checked to bind (an
allocation just over the cap must fail) and checked after each configuration and section
(peak allocated <= cap). Without CUDA the "device" is the CPU: streams are no-ops, prefetch
is a plain copy, the cap cannot be checked, and figures only show that the code runs.

``--scale`` multiplies every byte count (and shrinks hidden by its square root), so the
CPU path runs at 1% by default; on a GPU the default is the full size (``--small``: 1%,
fewer steps, seconds anywhere). ``--max-seconds`` bounds the timed steps of all sections
together (allocation and filling come on top, a few seconds per 10 GB; six placements are
built at most).

The pieces: ``emulated_model.py`` (the shape, the placements, the step),
``emulation_estimate.py`` (est from bytes, the break-even arithmetic),
``emulation_sections.py`` (the sections, timed under the cap) and ``emulation_report.py``
(the Markdown); this script plans, caps, runs the sections and writes the results.

    python benchmarks/decode_emulation.py [--scale 1.0] [--device-memory 24GiB]
        [--steps 20] [--batches 1,4,16,64] [--draft-k 1,2,3] [--sweep-steps 10]
        [--max-seconds 240] [--small] [--out benchmarks/results]
"""

from __future__ import annotations
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import (  # noqa: E402
    RESULTS_DIR, device_name, fill_random, load_1min, measure_link_gbps, measure_read_gbps, result_stem,
    shared_note, today, write_results,
)
from emulated_model import Shape  # noqa: E402
from emulation_report import markdown  # noqa: E402
from emulation_sections import (  # noqa: E402
    Budget, Ctx, measure_placement, measure_routed_experts, measure_verification,
)

MODEL = "qwen3.8-27b-fp8"


def _ints(text: str, flag: str, least: int) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{flag} takes whole numbers separated by commas, got {text!r}") from None
    if any(v < least for v in values):
        raise ValueError(f"{flag} values must be at least {least}, got {text!r}")
    return sorted(set(values))



def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=float, default=None,
                    help="multiply every byte count (default 1.0 on CUDA, 0.01 on the CPU)")
    ap.add_argument("--device-memory", default="24GiB", help="the card to emulate (default 24GiB)")
    ap.add_argument("--steps", type=int, default=20, help="timed decode steps per configuration at batch 1")
    ap.add_argument("--batches", default="1,4,16,64",
                    help="batch sizes of the batch sweep, comma-separated ('' skips it)")
    ap.add_argument("--draft-k", default="1,2,3",
                    help="draft tokens K of the verification section, comma-separated ('' skips it)")
    ap.add_argument("--sweep-steps", type=int, default=10,
                    help="timed steps per point of the batch sweep and the verification section")
    ap.add_argument("--max-seconds", type=float, default=240.0,
                    help="bound on the timed steps of all sections together")
    ap.add_argument("--small", action="store_true",
                    help="scale 0.01, 5 steps, 3 per sweep point (seconds, on a GPU or the CPU)")
    ap.add_argument("--smoke", action="store_true", help="scale 0.0005, 3 steps (seconds, for the tests)")
    ap.add_argument("--no-experts", dest="experts", action="store_false",
                    help="skip the routed-experts section")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR)
    return ap.parse_args(argv)


def measure_bandwidths(probe: int, cuda: bool, device) -> dict:
    """The link (pinned copy), the device read rate (bf16 GEMV) and on CUDA the UVA read
    rate (the same GEMV through a view of pinned host memory), over ``probe`` bytes."""
    import torch

    bw = {"probe_bytes": probe, "link_gbps": measure_link_gbps(probe, cuda),
          "device_read_gbps": measure_read_gbps(probe, cuda)}
    if cuda:
        from selective_offload.wrappers import cuda_view_of_pinned

        from selective_offload.probe import gemv_read_s

        host = fill_random(torch.empty(probe, dtype=torch.uint8, pin_memory=True))
        view = cuda_view_of_pinned(host, device).view(torch.bfloat16).view(-1, 4096)
        bw["uva_read_gbps"] = view.numel() * 2 / gemv_read_s(view, repeats=5, warmup=2, cuda=device, cols=4096) / 1e9
        del host, view
    else:
        bw["note"] = "no CUDA: link and device are both host memory here"
    print(f"bandwidths: {bw}", flush=True)
    return bw


def plan_mtp(ckpt, device_memory: int, device_memory_text: str, bw: dict, scale: float, ks: list[int],
             sweep_steps: int) -> tuple[dict, object, Shape | None]:
    """The MTP plan of the verification section and its shape, or the reason there is none
    (``verify["skipped"]``): (the section's result so far, the plan, its shape)."""
    from selective_offload.errors import UserError
    from selective_offload.planner import PlanInputs, make_plan

    verify: dict = {"draft_k": ks, "steps": sweep_steps, "configs": []}
    plan = shape = None
    if not ks:
        verify["skipped"] = "--draft-k is empty"
        return verify, plan, shape
    try:
        plan = make_plan(ckpt, PlanInputs(device_memory_bytes=device_memory, link_gbps=bw["link_gbps"],
                                          vram_gbps=bw["device_read_gbps"],
                                          decode_read_gbps=bw["device_read_gbps"], speculative="mtp",
                                          host_compute=False))
    except (TypeError, ValueError, UserError) as err:
        verify["skipped"] = f"no plan for MTP speculative decoding: {str(err).splitlines()[0]}"
    if plan is not None:
        shape = Shape.from_plan(plan, scale)
        if plan.strategy == "infeasible":
            verify["skipped"] = f"the plan for MTP speculative decoding is infeasible at {device_memory_text}"
        elif not shape.mtp_bytes:
            verify["skipped"] = "the checkpoint has no MTP head to draft with"
        elif shape.mtp_placement != "device":
            verify["skipped"] = (f"the plan puts the MTP head at {shape.mtp_placement}; the emulation "
                                 "drafts from a head on the device only")
    if plan is not None and "skipped" not in verify:
        verify["plan"] = {
            "strategy": plan.strategy, "hot_layer_indices": list(plan.hot_layer_indices),
            "mtp_bytes_full_scale": sum(g.bytes for g in plan.groups
                                        if getattr(g, "mtp", False) and g.placement != "absent"),
            "mtp_placement": shape.mtp_placement,
            "host_hot_bytes": plan.host_hot_bytes,
            "bulk_cpu_offload_gb": plan.bulk.cpu_offload_gb if plan.bulk else None,
            "bulk_offloaded_bytes": plan.bulk.offloaded_bytes if plan.bulk else None,
        }
    return verify, plan, shape


def set_cap(cap: int, cuda: bool, device) -> dict:
    """Cap the device at ``cap`` bytes (torch's per-process memory fraction) and check that
    it binds: an allocation just over it must fail. Without CUDA there is nothing to cap."""
    import torch

    cap_info: dict = {"cap_bytes": cap}
    if cuda:
        total = torch.cuda.get_device_properties(device).total_memory
        cap_info["device_total_bytes"] = total
        cap_info["fraction"] = min(1.0, cap / total)
        torch.cuda.set_per_process_memory_fraction(cap_info["fraction"], device)
        try:
            torch.empty(cap + (64 << 20), dtype=torch.uint8, device=device)
            cap_info["binds"] = False
        except torch.OutOfMemoryError:
            cap_info["binds"] = True
        torch.cuda.empty_cache()
    else:
        cap_info["binds"] = None
        cap_info["note"] = "no CUDA: host memory is the device; the cap cannot be set or checked"
    return cap_info


def plan_summary(plan) -> dict:
    """What the result records of the plan the placements follow (full-scale figures)."""
    return {"strategy": plan.strategy, "hot_layer_indices": list(plan.hot_layer_indices),
            "host_cold_bytes": plan.host_cold_bytes, "host_hot_bytes": plan.host_hot_bytes,
            "prefetch_buffer_bytes": plan.prefetch_buffer_bytes,
            "est_step_s_full_scale": plan.est.est_step_s,
            "bulk_cpu_offload_gb": plan.bulk.cpu_offload_gb,
            "bulk_offloaded_bytes": plan.bulk.offloaded_bytes,
            "bulk_est_step_s_full_scale": plan.bulk.est.est_step_s}


def plain_steps(configs: list[dict], sweeps: list[dict], verify: dict) -> dict[str, float]:
    """The plain step each verification placement is compared with: the sweep's batch 1
    (the same matrix-product kernels), else the batch-1 section's; which one is recorded."""
    plain = {c["config"]: c["step_s"]["median"] for c in configs if c["status"] == "measured"}
    verify["plain_plan_reference"] = "batch-1 section (torch.mv)"
    for sw in sweeps:
        one = next((p for p in sw["rows"] if p["batch"] == 1 and p["status"] == "measured"), None)
        if one is not None:
            plain[sw["config"]] = one["step_s"]["median"]
            verify["plain_plan_reference"] = "batch sweep, batch 1"
    return plain


def speedups(result: dict, configs: list[dict], sweeps: list[dict], batches: list[int]) -> None:
    """Selective over bulk, measured and est, at batch 1 and across the sweep."""
    bulk = next((c for c in configs if c["config"] == "bulk" and c["status"] == "measured"), None)
    sel = next((c for c in configs if c["config"] == "selective" and c["status"] == "measured"), None)
    if bulk and sel:
        result["speedup_selective_over_bulk"] = bulk["step_s"]["median"] / sel["step_s"]["median"]
        result["est_speedup_selective_over_bulk"] = bulk["est_step_s"] / sel["est_step_s"]
    if batches:
        by = {(s["config"], p["batch"]): p for s in sweeps for p in s["rows"] if p.get("status") == "measured"}
        result["batch_sweep"]["speedup_selective_over_bulk"] = {
            str(b): by[("bulk", b)]["step_s"]["median"] / by[("selective", b)]["step_s"]["median"]
            for b in batches if ("bulk", b) in by and ("selective", b) in by}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from selective_offload.errors import UserError
    from selective_offload.sizes import parse_size

    try:
        device_memory = parse_size(args.device_memory, "--device-memory")
        batches = _ints(args.batches, "--batches", 1)
        ks = _ints(args.draft_k, "--draft-k", 1)
    except (UserError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    import torch

    from selective_offload.checkpoint import load_checkpoint
    from selective_offload.cli import BUNDLED
    from selective_offload.planner import PlanInputs, make_plan

    cuda = torch.cuda.is_available()
    quick = args.smoke or args.small
    scale = args.scale if args.scale is not None else (
        0.0005 if args.smoke else 0.01 if args.small else (1.0 if cuda else 0.01))
    steps = 3 if args.smoke else 5 if args.small else args.steps
    sweep_steps = 3 if quick else args.sweep_steps
    if not (0 < scale <= 1) or steps < 1 or sweep_steps < 1 or args.max_seconds <= 0:
        print("error: --scale must be in (0, 1], --steps, --sweep-steps and --max-seconds positive",
              file=sys.stderr)
        return 2
    if not cuda:
        torch.set_num_threads(1)  # steadier on a shared machine; the bandwidths use it too
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    started, load_before = time.perf_counter(), load_1min()

    # ---- bandwidths, then the plan made with them
    bw = measure_bandwidths(max(1 << 20, int((1 << 30) * scale)), cuda, device)
    ckpt = load_checkpoint(BUNDLED[MODEL])
    plan = make_plan(ckpt, PlanInputs(device_memory_bytes=device_memory, link_gbps=bw["link_gbps"],
                                      vram_gbps=bw["device_read_gbps"], decode_read_gbps=bw["device_read_gbps"],
                                      # the prefetch placement: host-compute is the host-compute section's
                                      host_compute=False))
    if plan.strategy == "infeasible" or plan.bulk is None:
        print(f"error: the plan for {args.device_memory} is {plan.strategy}; nothing to compare", file=sys.stderr)
        return 2
    shape = Shape.from_plan(plan, scale)
    verify, mtp, shape_mtp = plan_mtp(ckpt, device_memory, args.device_memory, bw, scale, ks, sweep_steps)
    cap_info = set_cap(int(device_memory * scale), cuda, device)

    def fits_resident(s: Shape) -> bool:
        return not cuda or s.loaded_bytes() < 0.85 * torch.cuda.mem_get_info(device)[0]

    names = ["bulk", "selective"] + (["resident"] if fits_resident(shape) else [])
    vnames = []
    if "skipped" not in verify:
        vnames = (["bulk"] if mtp.bulk is not None else []) + ["selective"] \
            + (["resident"] if fits_resident(shape_mtp) else [])
    weight = len(names) * (steps + sweep_steps * len(batches)) + len(vnames) * sweep_steps * (1 + 2 * len(ks))
    ctx = Ctx(cuda, device, cap_info, bw, Budget(args.max_seconds, weight), plan.inputs.prefetch_step)

    configs, sweeps = [], []
    for name in names:
        row, sweep = measure_placement(ctx, name, plan, shape, steps, batches, sweep_steps)
        configs.append(row)
        if batches:
            sweeps.append(sweep)
    plain = plain_steps(configs, sweeps, verify)
    for name in vnames:
        verify["configs"].append(measure_verification(ctx, name, mtp, shape_mtp, ks, sweep_steps,
                                                      plain.get(name)))

    experts_section = measure_routed_experts(cuda, device, scale, quick) if args.experts else {
        "skipped": "--no-experts"}

    result = {
        "routed_experts": experts_section,
        "benchmark": "decode-emulation", "date": today(), "device": device_name(cuda), "cuda": cuda,
        "torch": torch.__version__, "torch_threads": torch.get_num_threads(), "smoke": args.smoke,
        "small": args.small, "model": MODEL, "scale": scale, "hidden": shape.hidden,
        "device_memory_bytes": device_memory, "steps": steps,
        "bandwidth": bw, "cap": cap_info, "plan": plan_summary(plan),
        "configs": configs,
        "batch_sweep": {"batches": batches, "steps": sweep_steps, "configs": sweeps}
        if batches else {"batches": [], "skipped": "--batches is empty"},
        "verification": verify,
        "wall_s": time.perf_counter() - started,
    }
    result["load_note"] = shared_note(load_before, load_1min())
    speedups(result, configs, sweeps, batches)
    suffix = "-smoke" if args.smoke else "-small" if args.small else ""
    stem = result_stem("decode-emulation", cuda, result["device"]) + suffix
    paths = write_results(args.out, stem, result, markdown(result))
    print(f"wrote {paths[0]} and {paths[1]}")
    sections = configs + sweeps + verify["configs"]
    failed = any(c.get("under_cap") is False for c in sections) or cap_info.get("binds") is False
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
