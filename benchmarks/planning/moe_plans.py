"""MoE reference plans: what `selective-offload plan` says for real MoE configs, beside the
two vLLM offloads a user could run instead (vLLM's ``cpu_offload_gb`` and segment selection
``cpu_offload_params=experts``) and the plan without host-compute (routed experts read
through UVA), on the cards docs/usage/moe.md names. Every figure is an estimate (est_) from bytes and
bandwidths (the reference laptop's link and VRAM, and a stated host kernel rate: the
reference host's, ``estimate.traffic.REFERENCE_CPU_GBPS``, assumed), not a measurement. llama.cpp's
published rate for the same model on a card of the same size is shown beside it where the
project has one (``selective_offload.anchors``; another engine, host and format). Where a
plan keeps a device share, the plan without one is shown beside it.

Configs are built from each model's published ``config.json`` dimensions with transformers'
own config classes (no download); tensor sizes come from the model built on the meta device,
as ``selective-offload plan config.json`` does.

    .venv/bin/python -m benchmarks.planning moe-plans [--out benchmarks/results]

Writes ``moe-plans-est.json`` and ``.md`` (the date inside); ``tests/unit/planner/test_moe_configs.py``
recomputes the figures and checks them against that file, and the table of docs/usage/moe.md against it.

    .venv/bin/python -m benchmarks.planning moe-plans --manifests benchmarks/planning/reference_manifests

writes the MoE reference checkpoints the GPU run re-plans (:data:`MANIFESTS`) as manifests
instead: the GPU machine's image has torch but not transformers, which building a config's
tensors needs (tests/tools/test_gpu_preflight.py holds the files to these configs).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from benchmarks.common import est_main  # noqa: E402
from selective_offload.anchors import anchors_for  # noqa: E402
from selective_offload.checkpoint import load_checkpoint  # noqa: E402
from selective_offload.estimate.traffic import ASSUMED_CPU_TFLOPS, ASSUMED_HANDOFF_S, REFERENCE_CPU_GBPS  # noqa: E402
from selective_offload.planner import PlanInputs, make_plan  # noqa: E402
from selective_offload.planner.allocation import allocated_tensors, experts_bytes, padding_for  # noqa: E402
from selective_offload.planner.host_compute import share_words  # noqa: E402
from selective_offload.sizes import GB, GiB  # noqa: E402

MXFP4 = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}


def _gpt_oss(layers: int, experts: int):
    """huggingface.co/openai/gpt-oss-20b and gpt-oss-120b, config.json."""
    import transformers

    config = transformers.GptOssConfig(num_hidden_layers=layers, num_local_experts=experts, num_experts_per_tok=4,
                                       hidden_size=2880, intermediate_size=2880, num_attention_heads=64,
                                       num_key_value_heads=8, head_dim=64, vocab_size=201088,
                                       tie_word_embeddings=False)
    return config, "GptOssForCausalLM", {"quantization_config": MXFP4, "experts_per_token": 4}


def _qwen3_30b_a3b():
    """huggingface.co/Qwen/Qwen3-30B-A3B, config.json."""
    import transformers

    config = transformers.Qwen3MoeConfig(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                                         num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                                         head_dim=128, num_experts=128, num_experts_per_tok=8, vocab_size=151936,
                                         tie_word_embeddings=False)
    return config, "Qwen3MoeForCausalLM", {}


#: A W4A16 build in the layout the int4 kernel reads: GPTQ's 4-bit symmetric groups of 128
#: inputs, no act-order.
GPTQ_INT4 = {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False}


def _qwen3_30b_a3b_gptq():
    config, arch, _ = _qwen3_30b_a3b()
    return config, arch, {"quantization_config": GPTQ_INT4}


#: (label, config builder, device memory in GiB, the project's target for the host-compute
#: plan in tok/s, set beside llama.cpp's published figures: docs/usage/moe.md). The last
#: case's target is llama.cpp's own published figure for a 4-bit build of the same model on
#: an 8 GB card (Q4_K_M, every expert on the CPU: selective_offload.anchors), to beat.
CASES = (
    ("gpt-oss-20b (MXFP4)", lambda: _gpt_oss(24, 32), 8, 40.0),
    ("gpt-oss-120b (MXFP4)", lambda: _gpt_oss(36, 128), 24, 30.0),
    ("Qwen3-30B-A3B (bf16)", _qwen3_30b_a3b, 24, 18.0),
    ("Qwen3-30B-A3B (GPTQ int4)", _qwen3_30b_a3b_gptq, 8, 36.7),
)


def rate_for(target_tok_s: float, est, layers: int, handoff_s: float, cpu_gbps: float) -> float | None:
    """The host kernel rate (GB/s) at which the same placement reaches ``target_tok_s``
    (est): the step's CPU bytes over the time the target leaves them once the device's part
    and the hand-offs are paid; None when those alone exceed the target's step. ``layers``:
    the host-compute units, one hand-off each (a split LM head is one more)."""
    handoffs = layers * handoff_s
    cpu_bytes = (est.est_cpu_s_per_step - handoffs) * cpu_gbps * 1e9
    left = 1.0 / target_tok_s - (est.est_step_s - est.est_cpu_s_per_step) - handoffs
    return cpu_bytes / left / 1e9 if left > 0 and cpu_bytes > 0 else None


def _est(est) -> dict:
    return {"est_link_ms": round(est.est_link_s_per_step * 1e3, 1), "est_step_ms": round(est.est_step_s * 1e3, 1),
            "est_tok_s": round(est.est_tok_s, 2)}


def _computed_row(plan) -> dict:
    """A host-compute plan's row: which layers' experts the host CPU computes, the device
    share of each (when the plan keeps one), and what else is offloaded."""
    computed = [g for g in plan.groups if g.serving == "compute" and g.layer_index is not None]
    uva_left = sorted(g.layer_index for g in plan.groups if g.serving == "uva")
    shared = [g.device_experts for g in computed if g.device_experts]
    hot = f" + {len(plan.hot_layer_indices)} hot layers" if plan.hot_layer_indices else ""
    hot += "".join(f", the LM head's last {g.intermediate - g.device_channels} of {g.intermediate} vocabulary rows "
                   "computed on the host CPU beside the device's" for g in plan.groups
                   if g.kind == "module" and g.serving == "compute")
    if computed:
        config = (f"selective: cold set + routed experts of {len(computed)} layers computed on the host CPU"
                  + (f", {'each' if len(shared) == len(computed) else f'{len(shared)} of them:'} layer's "
                     f"{share_words(tuple(shared), computed[0].num_experts, False)} also on the device "
                     f"({plan.device_share_bytes / GB:.2f} GB)" if shared else "")
                  + (f" + {len(uva_left)} through UVA" if uva_left else "") + hot)
    else:  # the planner declined host-compute: say why rather than "0 layers computed"
        config = (f"selective: cold set + routed experts of {len(uva_left)} layers through UVA{hot}, none computed "
                  f"on the host ({_why_no_host_compute(plan) or 'the plan computes nothing there'})")
    return {"config": config, "host_gb": round(plan.host_bytes / GB, 2), "fits": plan.strategy != "infeasible",
            **_est(plan.est), "est_cpu_ms": round(plan.est.est_cpu_s_per_step * 1e3, 1)}


def _why_no_host_compute(plan) -> str | None:
    """Why a plan computes nothing on the host (its cause, without the parenthesised
    details; None when it gives none)."""
    declined = plan.host_compute_declined
    return declined.split("(", 1)[0].strip() if declined else None


#: The reference cases the GPU run's pre-flight section (``benchmarks.preflight``) re-plans on
#: its card, by label -> their manifest's file name under :data:`MANIFEST_DIR`.
MANIFESTS = {"gpt-oss-20b (MXFP4)": "gpt-oss-20b.manifest.json",
             "gpt-oss-120b (MXFP4)": "gpt-oss-120b.manifest.json",
             "Qwen3-30B-A3B (bf16)": "qwen3-30b-a3b-bf16.manifest.json"}
MANIFEST_DIR = Path(__file__).resolve().parent / "reference_manifests"


def write_manifests(directory: Path) -> list[Path]:
    """Write :data:`MANIFESTS` (each case's checkpoint as its config builds it) into ``directory``."""
    import tempfile

    from selective_offload.checkpoint import write_manifest

    directory.mkdir(parents=True, exist_ok=True)
    written = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, _, _, checkpoint in case_checkpoints(Path(tmp)):
            if label in MANIFESTS:
                checkpoint.source = f"benchmarks/planning/moe_plans.py: {label}"
                write_manifest(checkpoint, directory / MANIFESTS[label])
                written.append(directory / MANIFESTS[label])
    return written


def case_checkpoints(workdir: Path):
    """Each case's label, card (GiB), target and config-only checkpoint (its config.json
    written into ``workdir``)."""
    for label, build, gib, target in CASES:
        config, arch, extra = build()
        data = {**config.to_dict(), "architectures": [arch], "torch_dtype": "bfloat16", **extra}
        path = workdir / f"{arch}-{gib}.json"
        path.write_text(json.dumps(data))
        yield label, gib, target, load_checkpoint(path)


def reference_plans(workdir: Path) -> list[dict]:
    """One entry per case: the model, the card, the vLLM baselines, the plan without
    host-compute and the host-compute plan as rows (host bytes, est link and step time, est
    tok/s; the host-compute plan last), its crossover, and the llama.cpp anchors of the model."""
    out = []
    for label, gib, target, checkpoint in case_checkpoints(workdir):
        plan = make_plan(checkpoint, PlanInputs(device_memory_bytes=gib * GiB))
        uva_plan = make_plan(checkpoint, PlanInputs(device_memory_bytes=gib * GiB, host_compute=False))
        experts = [g for g in plan.groups if g.kind == "experts"]
        rows = [{"config": f"vLLM `{b.label}`", "host_gb": round(b.offloaded_bytes / GB, 2), "fits": b.fits,
                 **_est(b.est)} for b in plan.baselines]
        uva = sorted(g.layer_index for g in uva_plan.groups if g.serving == "uva")
        rows.append({"config": f"selective, no host-compute: cold set + routed experts of {len(uva)} layers "
                               "through UVA" + (f" + {len(uva_plan.hot_layer_indices)} hot layers"
                                                if uva_plan.hot_layer_indices else ""),
                     "host_gb": round(uva_plan.host_bytes / GB, 2), "fits": uva_plan.strategy != "infeasible",
                     **_est(uva_plan.est)})
        if any(g.device_experts for g in plan.groups):  # the same without a device share, beside it
            whole = make_plan(checkpoint, PlanInputs(device_memory_bytes=gib * GiB, device_share=False))
            rows.append(_computed_row(whole))
        rows.append(_computed_row(plan))
        computed = sorted(g.layer_index for g in plan.groups if g.serving == "compute" and g.layer_index is not None)
        record = plan.host_compute
        units = len(computed) + sum(1 for g in plan.groups if g.kind == "module" and g.serving == "compute")
        need = rate_for(target, plan.est, units, ASSUMED_HANDOFF_S, REFERENCE_CPU_GBPS) if computed else None
        anchors = anchors_for(plan.model.architectures, plan.model.num_hidden_layers, experts[0].num_experts)
        out.append({"model": label, "device_memory_gib": gib, "total_gb": round(plan.model.total_bytes / GB, 2),
                    "num_experts": experts[0].num_experts, "experts_per_token": experts[0].experts_per_token,
                    "moe_layers": len(experts), "rows": rows,
                    "crossover_tokens": record.crossover_tokens if record else None,
                    "target_tok_s": target, "est_cpu_gbps_for_target": round(need, 1) if need else None,
                    "cpu_format": record.format if record else None,
                    "experts_allocated": _allocated(checkpoint, plan.inputs),
                    "device_ledger": _device_ledger(plan),
                    # why nothing is computed on the host, when nothing is: the plan's own note
                    "no_host_compute": None if record else _why_no_host_compute(plan),
                    "llama_cpp": [{"tok_s": a.tok_s, "card_gb": a.card_gb, "setup": a.setup, "source": a.source,
                                   "same_card": a.card_gb == gib} for a in anchors]})
    return out


def _allocated(checkpoint, inputs) -> dict:
    """The sizes vLLM 0.33 allocates the routed experts at on the plan's card (the planner
    prices those: ``planner.allocation``), and how many more bytes that is than stored."""
    padding = padding_for(checkpoint.config, inputs.card, inputs.moe_setting)
    stored = experts_bytes(checkpoint.tensors)
    allocated = experts_bytes(allocated_tensors(checkpoint.tensors, padding))
    return {"card": inputs.card, "kernel": padding.kernel, "hidden": [padding.hidden, padding.hidden_to],
            "intermediate": [padding.intermediate, padding.intermediate_to],
            "extra_pct": round((allocated / stored - 1) * 100, 2)}


def _device_ledger(plan) -> dict:
    """The host-compute plan's device lines (the plan's ledger), the card's usable memory it
    was made for (the card class's row: its margin and context, ``planner.cards``), and what
    the lines, KV cache and reserve leave of it."""
    lines = {line.name: line.bytes for line in plan.ledger() if line.where == "device"}
    return {"lines": lines, "usable_bytes": plan.inputs.card_bytes, "usable_from": plan.inputs.usable_from,
            "kv_cache_bytes": plan.inputs.kv_cache_bytes, "reserve_bytes": plan.inputs.reserve_bytes,
            "left_bytes": plan.weight_budget_bytes - plan.device_ledger_bytes}


def _anchor_cell(p: dict) -> str:
    same = [a for a in p["llama_cpp"] if a["same_card"]]
    if same:
        return "; ".join(f"{a['tok_s']:g} ({a['source']})" for a in same)
    others = [a for a in p["llama_cpp"]]
    if others:
        return "none on this card size (" + "; ".join(
            f"{a['tok_s']:g} on {str(a['card_gb']) + ' GB' if a['card_gb'] else 'the CPU alone'}, {a['source']}"
            for a in others) + ")"
    return "none"


def markdown(plans: list[dict]) -> str:
    lines = ["| model, card | offload | host bytes | est link / step | est step | est tok/s |",
             "|---|---|---|---|---|---|"]
    for p in plans:
        where = f"{p['model']}, {p['device_memory_gib']} GiB"
        for r in p["rows"]:
            lines.append(f"| {where} | {r['config']} | {r['host_gb']:.2f} GB | {r['est_link_ms']:.1f} ms | "
                         f"{r['est_step_ms']:.1f} ms | {r['est_tok_s']:.2f}{'' if r['fits'] else ' (does not fit)'} |")
    lines += ["", "| model, card | host-compute format | crossover (tokens per step) | est CPU / step | "
                  "target tok/s (est host kernel rate it needs) | llama.cpp published, same card size (tok/s) |",
              "|---|---|---|---|---|---|"]
    for p in plans:
        fmt = p["cpu_format"] or f"none: {p.get('no_host_compute') or 'the plan computes nothing on the host'}"
        need = p["est_cpu_gbps_for_target"]
        lines.append(f"| {p['model']}, {p['device_memory_gib']} GiB | {fmt} | {p['crossover_tokens'] or '-'} | "
                     f"{p['rows'][-1]['est_cpu_ms']:.1f} ms | {p['target_tok_s']:g} "
                     f"({f'{need:g} GB/s' if need else '-'}) | {_anchor_cell(p)} |")
    lines += ["", "Routed experts are priced at the sizes vLLM 0.33 allocates them at on the plan's card "
              "(hidden and intermediate, stored -> allocated):", ""]
    for p in plans:
        a = p["experts_allocated"]
        (h0, h1), (i0, i1) = a["hidden"], a["intermediate"]
        lines.append(f"- {p['model']}, SM {a['card']}, {a['kernel']}: hidden {h0} -> {h1}, intermediate {i0} -> "
                     f"{i1}" + (f", {a['extra_pct']:.2f}% more bytes of routed experts than stored"
                                if a["extra_pct"] else ", as stored"))
    lines += ["", "The host-compute plans' device ledger (GB), against the card's usable memory less the KV cache "
              "and the reserve (the last row of each model in the first table):", "",
              "| model, card | " + " | ".join(LEDGER_COLUMNS) + " | usable | left |",
              "|---|" + "---|" * (len(LEDGER_COLUMNS) + 2)]
    for p in plans:
        d = p["device_ledger"]
        cells = [f"{d['lines'].get(name, 0) / GB:.2f}" for name in LEDGER_COLUMNS]
        lines.append(f"| {p['model']}, {p['device_memory_gib']} GiB | " + " | ".join(cells)
                     + f" | {d['usable_bytes'] / GB:.2f} | {d['left_bytes'] / 1e6:.0f} MB |")
    usable = {p["device_ledger"]["usable_from"] for p in plans}
    lines += [""] + [f"- usable: {u}" for u in sorted(usable)]
    return "\n".join(lines) + "\n"


#: The device lines of a plan's ledger the table shows, in the ledger's order.
LEDGER_COLUMNS = ("resident weights", "device shares", "prefetch buffers", "est transient",
                  "est vLLM fused-MoE workspace")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--manifests"] and len(args) == 2:
        for path in write_manifests(Path(args[1])):
            print(f"wrote {path}")
        return 0
    return est_main(argv, __doc__, "moe-plans-est", reference_plans, markdown, "plans",
                    "MoE reference plans (est, reference laptop link and VRAM, host kernel "
                    f"{REFERENCE_CPU_GBPS:g} GB/s assumed)", link_gbps=13.9, vram_gbps=472.0,
                    cpu_gbps=REFERENCE_CPU_GBPS, cpu_gbps_source="assumed (the reference host's)",
                    cpu_tflops=ASSUMED_CPU_TFLOPS, handoff_s=ASSUMED_HANDOFF_S)
