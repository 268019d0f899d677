"""What-if, not a plan: each reference plan's host-compute work split between the GPU and the
CPU of every layer at once, priced by the same step model (est).

The planner places host-compute work a layer at a time: a layer's routed experts (or its
dense MLP) are computed either on the device or on the host CPU, and the two never work at
the same time (the layer's output is the next layer's input). The lever this prices is the
one KTransformers and SGLang's KT wrapper use: every layer keeps a share of those bytes on
the device and the GPU computes the picks that land there while the CPU computes the rest,
joined before the layer's output is used. Spread evenly over the layers, the device's reads
hide under the CPU's time, and the VRAM the whole layers held (and, for the dense plan, the
prefetch offloader's buffers) holds shares instead. Nothing in selective-offload builds this
yet: the glue would need vLLM's fused-MoE layer built with a device subset of its experts
(as expert parallelism builds it) and the host function forked beside the GPU's share on
a second CUDA stream. This file says what it would be worth before that is built.

The share is one fraction for every layer: the VRAM left for those bytes once everything
else the plan keeps on the device is resident (nothing prefetched), over their total
(``estimate.ExpertsRead.device_share``; the step model's rule for a split layer is
``estimate.device_share_time``). Every figure is an estimate at the reference laptop's link
and VRAM rates and the reference host's assumed 55 GB/s, like ``moe_reference_plans.py``.

    .venv/bin/python benchmarks/split_whatif.py [--out benchmarks/results]

Writes ``split-whatif-est-<date>.json`` and ``.md``; tests/unit/planner/test_split_whatif.py
recomputes the figures and checks them against the newest such file.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # this checkout's selective_offload

from _common import est_main  # noqa: E402
from moe_reference_plans import case_checkpoints  # noqa: E402
from selective_offload.checkpoint import load_checkpoint  # noqa: E402
from selective_offload.estimate import EXPERTS_CPU, ExpertsRead, flops_per_token  # noqa: E402
from selective_offload.names import layer_of  # noqa: E402
from selective_offload.plan_format import GroupKind, Placement  # noqa: E402
from selective_offload.plan_format.parts import Estimate  # noqa: E402
from selective_offload.planner import PlanInputs, make_plan  # noqa: E402
from selective_offload.sizes import GB, GiB  # noqa: E402

#: The dense reference (docs/usage/planning.md): the bundled Qwen3.8-27B-FP8 manifest on a
#: 24 GiB card, without and with MTP (K=1, at the plan's published acceptance), and the
#: targets of the dense-MLP work for each.
DENSE = Path(__file__).resolve().parent.parent / "selective_offload" / "data" / "qwen3.8-27b-fp8.manifest.json"
DENSE_CASES = (("Qwen3.8-27B-FP8, batch 1", {}, 7.0), ("Qwen3.8-27B-FP8, MTP K=1", {"speculative": "mtp",
                                                                                     "spec_tokens": 1}, 12.0))


def _mlp_bytes(checkpoint) -> dict[int, tuple[int, dict[str, int]]]:
    """Per decoder layer: its dense MLP's bytes and bytes by dtype (``model.layers.N.mlp.*``)."""
    out: dict[int, tuple[int, dict[str, int]]] = {}
    for name, t in checkpoint.tensors.items():
        where = layer_of(name)
        if where is None or ".mlp." not in name[len(where[0]):] or ".experts." in name:
            continue
        total, by_dtype = out.get(where[1], (0, {}))
        by_dtype[t.dtype] = by_dtype.get(t.dtype, 0) + t.nbytes
        out[where[1]] = (total + t.nbytes, by_dtype)
    return out


def split(plan, checkpoint) -> dict:
    """The plan's traffic with every layer's host-compute work (routed experts, else the dense
    MLP) split at one device share, nothing prefetched; its estimate and the share."""
    traffic = plan.traffic()
    stack = sorted((g for g in plan.groups if g.kind == GroupKind.LAYER), key=lambda g: g.layer_index)
    experts = [e for e in traffic.experts if e.num_experts > 1]
    layers = [b for b, _ in traffic.layers]
    if experts:
        units = [dataclasses.replace(e, where=EXPERTS_CPU) for e in experts]
        kept = [e for e in traffic.experts if e.num_experts == 1]
    else:  # dense: every layer's MLP, out of its layer group where the plan left it there
        mlps = _mlp_bytes(checkpoint)
        split_out = {g.layer_index for g in plan.groups if g.kind == GroupKind.MLP}
        units, kept = [], []
        for i, g in enumerate(stack):
            nbytes, by_dtype = mlps[g.layer_index]
            if g.layer_index not in split_out:
                layers[i] -= nbytes
            units.append(ExpertsRead(i, nbytes, 1, 1, EXPERTS_CPU, flops_per_token(by_dtype)))
    # every byte the plan does not leave cold or absent would be resident beside the shares
    hot = {Placement.DEVICE, Placement.HOST_HOT, Placement.HOST_UVA, Placement.HOST_COMPUTE}
    resident = sum(g.bytes for g in plan.groups if g.placement in hot)
    total = sum(u.nbytes for u in units)
    room = plan.weight_budget_bytes - plan.est_transient_device_bytes - (resident - total)
    share = min(max(room / total, 0.0), 1.0) if total else 0.0
    units = [dataclasses.replace(u, device_share=share) for u in units]
    whatif = dataclasses.replace(traffic, layers=tuple((b, False) for b in layers), experts=tuple(units + kept))
    est = Estimate.of(whatif, plan.inputs, plan.model.kv, plan.spec_tokens, pipelined=True)
    return {"device_share": round(share, 4), "device_share_gb": round(share * total / GB, 3),
            "host_gb": round((1 - share) * total / GB, 3), "est_step_ms": round(est.est_step_s * 1e3, 1),
            "est_cpu_ms": round(est.est_cpu_s_per_step * 1e3, 1), "est_tok_s": round(est.est_tok_s, 2)}


def _row(label: str, gib: int, target: float, plan, checkpoint) -> dict:
    return {"case": label, "device_memory_gib": gib, "target_tok_s": target,
            "plan": {"est_step_ms": round(plan.est.est_step_s * 1e3, 1), "est_tok_s": round(plan.est.est_tok_s, 2),
                     "host_compute_groups": sum(1 for g in plan.groups if g.placement == Placement.HOST_COMPUTE),
                     "hot_layers": len(plan.hot_layer_indices)},
            "split": split(plan, checkpoint)}


def whatif_rows(workdir: Path) -> list[dict]:
    rows = []
    for label, gib, target, checkpoint in case_checkpoints(workdir):
        rows.append(_row(label, gib, target, make_plan(checkpoint, PlanInputs(device_memory_bytes=gib * GiB)),
                         checkpoint))
    checkpoint = load_checkpoint(DENSE)
    for label, workload, target in DENSE_CASES:
        plan = make_plan(checkpoint, PlanInputs(device_memory_bytes=24 * GiB, **workload))
        rows.append(_row(label, 24, target, plan, checkpoint))
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| case, card | the plan (est tok/s) | split at once: device share | its bytes on the host | est CPU / step | "
             "est tok/s | target |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        p, s = r["plan"], r["split"]
        lines.append(f"| {r['case']}, {r['device_memory_gib']} GiB | {p['est_tok_s']:.2f} | "
                     f"{s['device_share']:.3f} ({s['device_share_gb']:.2f} GB) | {s['host_gb']:.2f} GB | "
                     f"{s['est_cpu_ms']:.1f} ms | {s['est_tok_s']:.2f} | {r['target_tok_s']:g} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    return est_main(argv, __doc__, "split-whatif-est", whatif_rows, markdown, "rows",
                    "What-if: host-compute work split between the GPU and the CPU of each layer at once (est, "
                    "not built; reference laptop link and VRAM, host kernel 55 GB/s assumed)")

if __name__ == "__main__":
    raise SystemExit(main())
