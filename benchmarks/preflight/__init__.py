"""The plan-level half of the worker's pre-flight, on the card this runs on: what vLLM 0.33
allocates for gpt-oss's experts there, what the card has free after its CUDA context, and
whether the reference plans, re-planned for that card, fit it.

Three parts, in one process with torch only (no vLLM; the GPU run blocks it):

1. **The card and the experts' shapes.** The card's compute capability
   (``torch.cuda.get_device_capability``) picks the fused-MoE kernel vLLM 0.33 builds for
   MXFP4 (``selective_offload.planner.kernels``: Marlin on SM 8.6 / 8.9 / 12.0, OAI
   triton_kernels on SM 9.0, FlashInfer TRT-LLM on SM 10.0), and that kernel's round-up
   (``kernels.ROUND_UP``) the sizes vLLM allocates the routed experts at. For
   gpt-oss-20b's and gpt-oss-120b's expert tensors (their reference manifests) the section
   prints, per expert, the checkpoint's shape and bytes beside the shape vLLM's
   ``create_weights`` allocates (``w13_weight`` [2 x intermediate, hidden / 2] ...) and its
   bytes, and checks those bytes against the planner's own price
   (``planner.allocation.allocated_bytes``).
2. **Free memory after the CUDA context.** The context is made (a one-element tensor on
   the device), then ``torch.cuda.mem_get_info()`` (free, total) is recorded beside the
   card's total from its properties and the card class it is sold as (est: that total
   rounded up to a whole GiB).
3. **The plan-level pre-flight verdict.** Each reference plan (gpt-oss-120b on 24 GiB,
   gpt-oss-20b on 8 GiB, Qwen3-30B-A3B bf16 on 24 GiB: ``benchmarks.planning.moe_plans.MANIFESTS``;
   Qwen3.8-27B-FP8 on 24 GiB: the bundled manifest) is made again for this card, with its
   compute capability, twice: for the free memory measured after the context, and for the
   card class (``--device-memory <N>GiB``, as a user would give it). Its device ledger (the
   plan's totals: device-resident weights, device shares, the above-crossover transient,
   the prefetch buffers, and the KV cache: what ``Plan.shortfall_bytes`` prices against the
   weight budget, plus the KV cache) is set against the free memory measured: fits, with
   what is left for the plan's reserve (activations, CUDA graphs, allocator slack), or
   short by how much.

This is the plan-level half of the worker's pre-flight: the worker's own check
(``selective_offload/vllm_glue/``) sums the parameters as vLLM built them and its buffers
after construction, which needs vLLM and so cannot run on a GPU machine without it; the
plan's ledger is what that sum is held to.

Without a CUDA device (the CPU build, the suite's ``--small`` run) nothing is measured: the
card is the plan's default (``plan_format.inputs.DEFAULT_CARD``, labelled as such), the free
memory is "not measured (no CUDA device)", and the verdicts are made against a stand-in:
each reference plan's own nominal card size, named as such in every row.

    python3 -m benchmarks.preflight [--small] [--out benchmarks/results]

Writes ``preflight-<cuda|cpu>-<machine>.json`` and ``.md``; ``--small`` does the same
(the section is seconds either way) and names the files ``...-small``.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

from benchmarks.common import RESULTS_DIR, device_name, md_table, result_stem, today, write_results  # noqa: E402
from benchmarks.planning.moe_plans import MANIFEST_DIR, MANIFESTS  # noqa: E402
from selective_offload.checkpoint import read_manifest  # noqa: E402
from selective_offload.errors import PlanError  # noqa: E402
from selective_offload.names import experts_prefix  # noqa: E402
from selective_offload.plan_format.inputs import DEFAULT_CARD  # noqa: E402
from selective_offload.plan_options import BUNDLED  # noqa: E402
from selective_offload.planner import PlanInputs, make_plan  # noqa: E402
from selective_offload.planner.allocation import allocated_bytes, padding_for, tensor_dims  # noqa: E402
from selective_offload.sizes import GiB  # noqa: E402
from selective_offload.tensors import tensor_nbytes  # noqa: E402

#: The models whose expert shapes are printed, by their manifest's reference label.
GPT_OSS = ("gpt-oss-20b (MXFP4)", "gpt-oss-120b (MXFP4)")

#: The reference plans re-planned on the card: (label, manifest path, nominal card GiB).
REFERENCE_PLANS = (
    ("gpt-oss-120b (MXFP4)", MANIFEST_DIR / MANIFESTS["gpt-oss-120b (MXFP4)"], 24),
    ("gpt-oss-20b (MXFP4)", MANIFEST_DIR / MANIFESTS["gpt-oss-20b (MXFP4)"], 8),
    ("Qwen3-30B-A3B (bf16)", MANIFEST_DIR / MANIFESTS["Qwen3-30B-A3B (bf16)"], 24),
    ("Qwen3.8-27B-FP8", BUNDLED["qwen3.8-27b-fp8"], 24),
)

#: gpt-oss checkpoint tensor (under ``...mlp.experts.``) -> the parameter vLLM 0.33's
#: ``GptOssMxfp4MoEMethod.create_weights`` allocates for it (quantization/mxfp4.py:200-291).
VLLM_NAMES = {"gate_up_proj_blocks": "w13_weight", "gate_up_proj_scales": "w13_weight_scale",
              "gate_up_proj_bias": "w13_bias", "down_proj_blocks": "w2_weight",
              "down_proj_scales": "w2_weight_scale", "down_proj_bias": "w2_bias"}

NO_CUDA = "not measured (no CUDA device)"


# --------------------------------------------------------------------------- 1. the card, the shapes


def card_of_device(cuda: bool) -> dict:
    """The card's compute capability, or the plan's default card without CUDA (labelled)."""
    if cuda:
        import torch

        major, minor = torch.cuda.get_device_capability(0)
        return {"card": f"{major}.{minor}", "source": "torch.cuda.get_device_capability"}
    return {"card": DEFAULT_CARD, "source": f"no CUDA device: the plan's default card, SM {DEFAULT_CARD} "
                                            "(plan_format.inputs.DEFAULT_CARD)"}


def _allocated_shape(relative: str, shape: tuple[int, ...], padding) -> tuple[int, ...]:
    """One expert's shape as vLLM allocates it (the checkpoint's axes, ``shape`` without the
    experts axis): the output axis (the first) scaled to the allocated output size, the first
    input axis (the packed blocks' count) to the allocated input size."""
    up = relative.startswith("gate_up")
    out_n, out_d = (padding.intermediate_to, padding.intermediate) if up else (padding.hidden_to, padding.hidden)
    in_n, in_d = (padding.hidden_to, padding.hidden) if up else (padding.intermediate_to, padding.intermediate)
    scaled = [shape[0] * out_n // out_d]
    if len(shape) > 1:
        scaled.append(shape[1] * in_n // in_d)
    return tuple(scaled + list(shape[2:]))


def expert_shapes(card: str, manifests: dict[str, Path] | None = None) -> list[dict]:
    """For gpt-oss-20b and gpt-oss-120b on ``card``: the kernel vLLM 0.33 picks for MXFP4, the
    experts' sizes stored and allocated, and per expert tensor one expert's shape and bytes
    as stored and as vLLM allocates them, beside the planner's price of the latter."""
    manifests = manifests or {label: MANIFEST_DIR / MANIFESTS[label] for label in GPT_OSS}
    out = []
    for label, path in manifests.items():
        checkpoint = read_manifest(path)
        padding = padding_for(checkpoint.config, card, "auto")
        layer = next(experts_prefix(n) for n in checkpoint.tensors if experts_prefix(n))
        rows, stored_total, allocated_total = [], 0, 0
        for name, t in checkpoint.tensors.items():
            if experts_prefix(name) != layer:
                continue
            relative = name[len(layer) + 1:]
            experts, per_expert = t.shape[0], tuple(t.shape[1:])
            shape = _allocated_shape(relative, per_expert, padding)
            allocated = tensor_nbytes(t.dtype, shape)
            # the planner's price of this tensor, per expert (allocation.allocated_bytes)
            planner = allocated_bytes(relative, t, padding) // experts
            vllm_shape = [shape[0]] + ([math.prod(shape[1:])] if len(shape) > 1 else [])
            rows.append({"tensor": relative, "vllm_parameter": VLLM_NAMES.get(relative, "?"), "dtype": t.dtype,
                         "dims": tensor_dims(relative, t.shape), "checkpoint_shape": list(per_expert),
                         "checkpoint_bytes": t.nbytes // experts, "allocated_shape": list(shape),
                         "vllm_shape": vllm_shape, "allocated_bytes": allocated, "planner_bytes": planner,
                         "equals_planner": allocated == planner})
            stored_total += t.nbytes // experts
            allocated_total += allocated
        out.append({"model": label, "card": card, "kernel": padding.kernel,
                    "hidden": [padding.hidden, padding.hidden_to],
                    "intermediate": [padding.intermediate, padding.intermediate_to], "tensors": rows,
                    "bytes_per_expert": {"checkpoint": stored_total, "allocated": allocated_total},
                    "extra_pct": round((allocated_total / stored_total - 1) * 100, 2)})
    return out


# --------------------------------------------------------------------------- 2. free memory after the context


def context_memory(cuda: bool) -> dict:
    """``torch.cuda.mem_get_info()`` after the CUDA context is made, beside the card's total;
    without CUDA, that it was not measured."""
    if not cuda:
        return {"measured": False, "why": NO_CUDA}
    import torch

    started = time.perf_counter()
    torch.cuda.init()
    torch.ones(1, device="cuda").add_(1)  # the context, and the caching allocator's first block
    torch.cuda.synchronize()
    context_s = time.perf_counter() - started
    free, total = torch.cuda.mem_get_info(0)
    props_total = torch.cuda.get_device_properties(0).total_memory
    return {"measured": True, "free_bytes": free, "total_bytes": total, "properties_total_bytes": props_total,
            "used_after_context_bytes": total - free, "torch_reserved_bytes": torch.cuda.memory_reserved(0),
            "context_s": round(context_s, 3), "est_card_class_gib": card_class_gib(props_total)}


def card_class_gib(total_bytes: int) -> int:
    """The card class a card is sold as (est): its total rounded up to a whole GiB (a 24 GB
    card reports about 23.6 GiB, an 80 GB H100 about 79.2 GiB)."""
    return max(1, math.ceil(total_bytes / GiB))


# --------------------------------------------------------------------------- 3. the pre-flight verdicts


def device_need(plan) -> dict:
    """The plan's device ledger: what it puts on the device before the first step."""
    parts = {"device_bytes": plan.device_bytes, "device_share_bytes": plan.device_share_bytes,
             "est_transient_device_bytes": plan.est_transient_device_bytes,
             "prefetch_buffer_bytes": plan.prefetch_buffer_bytes, "kv_cache_bytes": plan.inputs.kv_cache_bytes}
    return {**parts, "need_bytes": sum(parts.values())}


def verdict(need: int, free: int) -> str:
    left = free - need
    if left >= 0:
        return f"fits: {left / GiB:.2f} GiB left"
    return f"short by {-left / GiB:.2f} GiB"


def preflight(card: str, memory: dict, plans=REFERENCE_PLANS) -> list[dict]:
    """Each reference plan made again for ``card``, for the free memory after the context and
    for the card class, its device ledger against the free memory (the CPU build: against the
    plan's nominal card, a stand-in named in each row)."""
    rows = []
    for label, path, nominal_gib in plans:
        checkpoint = read_manifest(path)
        if memory.get("measured"):
            free, against = memory["free_bytes"], "free memory after the CUDA context (measured)"
            targets = (("free after context", free),
                       (f"card class {memory['est_card_class_gib']} GiB (est)", memory["est_card_class_gib"] * GiB))
        else:
            free = nominal_gib * GiB
            against = f"stand-in: the reference plan's nominal {nominal_gib} GiB card ({NO_CUDA})"
            targets = ((f"reference card {nominal_gib} GiB (stand-in)", free),)
        for planned_for, device_memory in targets:
            row = {"model": label, "reference_gib": nominal_gib, "planned_for": planned_for,
                   "device_memory_bytes": device_memory, "card": card, "free_bytes": free, "against": against}
            try:
                plan = make_plan(checkpoint, PlanInputs(device_memory_bytes=device_memory, compute_capability=card))
            except (PlanError, ValueError) as exc:
                rows.append({**row, "error": str(exc).splitlines()[0], "fits": None})
                continue
            need = device_need(plan)
            rows.append({**row, **need, "strategy": str(plan.strategy), "shortfall_bytes": plan.shortfall_bytes,
                         "reserve_bytes": plan.inputs.reserve_bytes, "host_bytes": plan.host_bytes,
                         "est_tok_s": round(plan.est.est_tok_s, 2), "fits": need["need_bytes"] <= free,
                         "left_bytes": free - need["need_bytes"], "verdict": verdict(need["need_bytes"], free),
                         "reserve_covered": free - need["need_bytes"] >= plan.inputs.reserve_bytes})
    return rows


# --------------------------------------------------------------------------- output


def free_over_need(d: dict) -> list[dict] | str:
    """The GPU run's headline rows (``benchmarks.gpu.figures``' preflight family, read from this
    section's JSON ``d``): each reference plan made again for the card, the free memory
    after the CUDA context over the plan's device ledger (1 or more: it fits), the verdict in
    the note; without CUDA, the one line why not."""
    card = d.get("card") or {}
    if not (d.get("memory") or {}).get("measured"):
        return (f"no CUDA device: free memory after the CUDA context not measured (the section's file checks each "
                f"plan against its reference card's nominal size, a stand-in, on SM {card.get('card', '?')})")
    rows = []
    for p in d.get("plans", []):
        label = f"{p['model']}, planned for {p['planned_for']}, SM {p['card']}"
        if "error" in p:
            rows.append({"label": label, "measured": None, "est": None, "note": p["error"]})
            continue
        rows.append({"label": label, "measured": p["free_bytes"] / p["need_bytes"], "est": None,
                     "note": f"{p['verdict']}; need {p['need_bytes'] / GiB:.2f} GiB (weights, shares, transient, "
                             f"prefetch, KV), free {p['free_bytes'] / GiB:.2f} GiB"})
    return rows or "no reference plan was made"


def _gib(n) -> str:
    return "n/a" if n is None else f"{n / GiB:.2f}"


def markdown(r: dict) -> str:
    card, mem = r["card"], r["memory"]
    lines = [f"# Pre-flight on the card: {r['device']}", "",
             f"Date {r['date']}, torch {r['torch']}, {r['wall_s']:.1f} s. The plan-level half of the worker's "
             "pre-flight (the worker's own check needs vLLM); plans and sizes are the planner's (est where labelled), "
             + ("the free memory is measured." if mem.get("measured") else
                f"the free memory is {NO_CUDA}: each plan is checked against its reference card's nominal size, a "
                "stand-in."), "",
             f"**Card:** SM {card['card']} ({card['source']}).", ""]
    if mem.get("measured"):
        lines += [f"**After the CUDA context** (`torch.cuda.mem_get_info`): free {_gib(mem['free_bytes'])} GiB of "
                  f"{_gib(mem['total_bytes'])} GiB ({mem['free_bytes']} of {mem['total_bytes']} bytes); "
                  f"{_gib(mem['used_after_context_bytes'])} GiB in use; device properties' total "
                  f"{_gib(mem['properties_total_bytes'])} GiB, card class {mem['est_card_class_gib']} GiB (est); "
                  f"context made in {mem['context_s']:.2f} s.", ""]
    else:
        lines += [f"**After the CUDA context:** {mem['why']}.", ""]
    lines += ["## Routed experts of gpt-oss as vLLM 0.33 allocates them on this card", ""]
    for m in r["expert_shapes"]:
        (h0, h1), (i0, i1) = m["hidden"], m["intermediate"]
        b = m["bytes_per_expert"]
        lines += [f"{m['model']}, SM {m['card']}: {m['kernel']}; hidden {h0} -> {h1}, intermediate {i0} -> {i1}; "
                  f"{b['checkpoint']} -> {b['allocated']} bytes per expert per layer ({m['extra_pct']:+.2f}%)", ""]
        lines.append(md_table(
            ["tensor", "vLLM parameter", "dtype", "checkpoint shape", "checkpoint bytes", "allocated shape (vLLM's)",
             "allocated bytes", "= planner's price"],
            [[t["tensor"], t["vllm_parameter"], t["dtype"], t["checkpoint_shape"], t["checkpoint_bytes"],
              f"{t['allocated_shape']} ({t['vllm_shape']})", t["allocated_bytes"],
              "yes" if t["equals_planner"] else f"NO ({t['planner_bytes']})"] for t in m["tensors"]]))
    lines += ["## Reference plans made for this card: device ledger against the free memory", ""]
    rows = []
    for p in r["plans"]:
        if "error" in p:
            rows.append([p["model"], p["planned_for"], "", "", "", "", "", _gib(p["free_bytes"]), p["error"]])
            continue
        rows.append([p["model"], p["planned_for"], p["strategy"],
                     _gib(p["device_bytes"] + p["device_share_bytes"]),
                     _gib(p["est_transient_device_bytes"] + p["prefetch_buffer_bytes"]), _gib(p["kv_cache_bytes"]),
                     _gib(p["need_bytes"]), _gib(p["free_bytes"]),
                     p["verdict"] + ("" if p["reserve_covered"] or not p["fits"] else
                                     f" (less than the plan's {_gib(p['reserve_bytes'])} GiB reserve)")])
    lines.append(md_table(["model", "planned for", "strategy", "weights + shares GiB", "transient + prefetch GiB (est)",
                           "KV GiB", "need GiB", "free GiB", "verdict"], rows))
    lines += ["need: the plan's device-resident weights and device shares, its above-crossover transient and "
              "prefetch buffers (est), and its KV cache; free: "
              + ("`torch.cuda.mem_get_info` after the CUDA context; 'card class': the plan made for "
                 "`--device-memory <N>GiB`, as a user would give the card" if mem.get("measured") else
                 "each reference plan's nominal card size, a stand-in (no CUDA device)")
              + "; what is left holds the plan's reserve (activations, CUDA graphs, allocator slack).", ""]
    return "\n".join(lines)


def run(args) -> int:
    import torch

    started = time.perf_counter()
    cuda = torch.cuda.is_available()
    card = card_of_device(cuda)
    memory = context_memory(cuda)
    result = {"benchmark": "preflight", "date": today(), "device": device_name(cuda), "cuda": cuda,
              "torch": torch.__version__, "small": args.small, "card": card, "memory": memory,
              "expert_shapes": expert_shapes(card["card"]), "plans": preflight(card["card"], memory)}
    result["wall_s"] = round(time.perf_counter() - started, 2)
    stem = result_stem("preflight", cuda, result["device"]) + ("-small" if args.small else "")
    text = markdown(result)
    print(text)
    paths = write_results(args.out, stem, result, text)
    print(f"wrote {paths[0]} and {paths[1]}")
    ok = all(t["equals_planner"] for m in result["expert_shapes"] for t in m["tensors"])
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="the same work (seconds); the files are named ...-small")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR)
    return run(ap.parse_args(argv))
