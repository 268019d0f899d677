"""The GPU run's headline figures: what each proves, and how it is read from a section's JSON.

Why a module of its own: the driver (``benchmarks.gpu``) computes these ratios into its
summary, and the tables of docs/benchmarks.md (``benchmarks.tables``) list the same families and rows from the
summaries it finds in ``benchmarks/results/``. Both import them from here; this module
reads result files' data and imports neither of them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from benchmarks.common import fmt


@dataclass(frozen=True)
class Family:
    """A headline figure: which section measures it, what it proves, and how to read it
    from the section's JSON (a list of rows, or a string: the reason it was not measured)."""

    key: str
    section: str
    label: str
    proves: str
    read: Callable[[dict], "list[dict] | str"]


def _row(label: str, measured, est=None, note: str = "") -> dict:
    return {"label": label, "measured": measured, "est": est, "note": note}


def _med(s: dict | None) -> float | None:
    return None if not s else s.get("median")


def uva_over_copy_sizes(d: dict) -> list[dict] | str:
    if not d.get("cuda"):
        return d.get("uva") or "no CUDA"
    return [_row(f"{r['bytes'] / 2**30:.2f} GiB", r.get("uva_over_copy"), None,
                 r["error"] if "error" in r else
                 f"UVA GEMV {r['uva_gemv_gbps']:.2f}, copy {r['copy_gbps']:.2f} GB/s"
                 + ("" if r.get("uva_equals_device") else "; the view's result DIFFERS from the device copy's"))
            for r in d.get("rows", [])] or "no sizes measured"


def uva_over_copy_probe(d: dict) -> list[dict] | str:
    if d.get("no_link_reason"):
        return d["no_link_reason"]
    keys = sorted(k for k, v in d.items() if "uva" in k and k.endswith("gbps") and isinstance(v, (int, float)))
    if not keys:
        return "this probe does not measure a UVA read rate (no `*uva*_gbps` field in its profile)"
    return [_row(f"{k} / link_gbps_pinned", d[k] / d["link_gbps_pinned"], None,
                 f"{d[k]:.2f} / {d['link_gbps_pinned']:.2f} GB/s") for k in keys]


def pageable_over_pinned(d: dict) -> list[dict] | str:
    if d.get("no_link_reason"):
        return d["no_link_reason"]
    return [_row("host-to-device copy", d["link_gbps_pageable"] / d["link_gbps_pinned"], None,
                 f"pageable {d['link_gbps_pageable']:.2f}, pinned {d['link_gbps_pinned']:.2f} GB/s, "
                 f"VRAM {d['vram_gbps']:.0f} GB/s")]


def page_locked_over_planned(d: dict) -> list[dict] | str:
    hm = d.get("host_memory") or {}
    if not hm.get("overall"):
        return "no host-memory section in the mechanism results"
    o = hm["overall"]
    if not d.get("cuda"):
        return ("no CUDA: nothing is page-locked without a GPU (est for torch's pinned blocks: "
                f"{fmt(o.get('est_ratio_rounding'), 4)})")
    return [_row("exact registration (the project's host weights)", o.get("ratio_exact"), 1.0),
            _row("torch's pinned blocks (vLLM's own pins)", o.get("ratio_rounding"), o.get("est_ratio_rounding"),
                 "est: every tensor rounded up to a power of two")]


def _gather_ratio(d: dict, key: str) -> list[dict] | str:
    path = next((p for p in d.get("paths", []) if p["key"] == key), None)
    if path is None or path["status"] != "measured":
        return path["status"] if path else f"no {key} path in the gather results"
    rows = [r for r in d.get("rows", []) if r.get(f"{key}_s") and r.get("device_s")]
    picked = [r for r in rows if r["tokens"] in (1, max(x["tokens"] for x in rows))] if rows else []
    return [_row(f"{r['tokens']} token(s) per step", _med(r[f"{key}_s"]) / _med(r["device_s"]), None,
                 f"{_med(r[f'{key}_s']) * 1e6:.1f} us vs {_med(r['device_s']) * 1e6:.1f} us") for r in picked] \
        or "no rows"


def uva_embedding_over_device(d: dict) -> list[dict] | str:
    """The glue's UVA lookup called eagerly and replayed from a CUDA graph (where a failed
    capture or a wrong replay is the row's note)."""
    rows = []
    for key, how in (("uva_embedding", "eager"), ("uva_embedding_graph", "CUDA graph replay")):
        got = _gather_ratio(d, key)
        if isinstance(got, str):
            if key == "uva_embedding":
                return got  # no UVA view at all (no CUDA)
            rows.append(_row(how, None, None, got))
        else:
            rows += [{**r, "label": f"{how}, {r['label']}"} for r in got]
    return rows


def uva_moe_over_device(d: dict) -> list[dict] | str:
    """The fused-MoE stand-in's graph replay on UVA views over the same on device copies."""
    moe = d.get("fused_moe") or {}
    if not d.get("cuda"):
        return "no CUDA: UVA views and CUDA graphs need a GPU"
    if moe.get("error"):
        return moe["error"]
    rows = []
    for r in moe.get("rows", []):
        note = r.get("error") or (f"UVA {r['uva_replay_us']:.0f} us, device {r['device_replay_us']:.0f} us"
                                  + ("" if r.get("bit_equal") else "; the UVA replay DIFFERS from the device copy's"))
        label = f"{r['phase']} ({r['tokens']} token(s)), {r.get('distinct_experts', '?')} experts read"
        rows.append(_row(label, r.get("uva_over_device"), None, note))
    return rows or "no fused-MoE phase was measured"


def host_compute_over_uva(d: dict) -> list[dict] | str:
    """Per layer shape at one token: the host path (graph replay, else eager) over the
    UVA path and over resident experts; the hand-off and the crossover in the note."""
    if not d.get("cuda"):
        return ("no CUDA: the host path's stream hand-off and UVA views need a GPU (kernel here: "
                f"{(d.get('kernel') or {}).get('status', 'unknown')})")
    handoff = {r["what"].split(" ")[0]: _med(r.get("graph_s")) for r in (d.get("handoff") or {}).get("rows", [])}
    failed = [f"{c.get('shape')} {c['path']} T={c['tokens']}" for c in d.get("correctness", []) if not c.get("ok")]
    rows = []
    for layer in d.get("layers", []):
        one = next((r for r in layer.get("rows", []) if r["tokens"] == 1), {})
        key = "host_graph_s" if one.get("host_graph_s") else "host_eager_s"
        host, uva, res = _med(one.get(key)), _med(one.get("uva_s")), _med(one.get("resident_s"))
        name = f"{layer['shape']} ({layer['fmt']}), 1 token, {'graph replay' if key == 'host_graph_s' else 'eager'}"
        if host is None:
            st = layer.get("status", {})
            rows.append(_row(name, None, None, one.get("host_graph_error") or st.get("host_graph") or "not measured"))
            continue
        cross = (layer.get("crossover") or {}).get("tokens")
        hand = handoff.get(layer["shape"])
        note = f"host {host * 1e6:.0f} us, " + (f"UVA {uva * 1e6:.0f} us" if uva else "no UVA row") \
            + (f", resident {res * 1e6:.0f} us" if res else "") \
            + (f"; hand-off (graph, empty job) {hand * 1e6:.0f} us" if hand else "") \
            + f"; host path wins up to T = {cross}" + (f"; correctness FAILED: {', '.join(failed)}" if failed else "")
        rows.append(_row(f"{name}: host / UVA", host / uva if uva else None, None, note))
        rows.append(_row(f"{name}: host / resident", host / res if res else None))
    return rows or "no layer measured"


def _cuda_part(d: dict, key: str, why_cuda: str) -> dict | str:
    """The run's ``key`` part when a GPU measured it, else the one line why not."""
    part = d.get(key) or {}
    if not d.get("cuda"):
        return f"no CUDA: {why_cuda}"
    if part.get("status") != "measured":
        return f"not measured: {part.get('status', 'not reached')}"
    return part


def host_mlp_over_copy(d: dict) -> list[dict] | str:
    """A dense layer at one token: its MLP on the host CPU (attention on the GPU, one graph)
    over the same layer with its MLP's bytes copied over the link."""
    dense = _cuda_part(d, "dense_layer", "the hand-off inside a layer and the link copy need a GPU")
    if isinstance(dense, str):
        return dense
    note = (f"attention {dense['attention_s']['median'] * 1e6:.0f} us, MLP on the host "
            f"{dense['mlp_host_s']['median'] * 1e6:.0f} us, its {dense['mlp_bytes'] / 1e6:.0f} MB copied "
            f"{dense['mlp_copy_s']['median'] * 1e6:.0f} us")
    return [_row(f"{dense['shape']}, 1 token: layer with its MLP on the host / with it copied",
                 dense["host_over_prefetch"], None, note)]


def host_reads_together(d: dict) -> list[dict] | str:
    """The CPU kernel's and the page-locked copies' rates while both read host memory, over
    the kernel's rate alone: 1.0 is what the estimate prices for a prefetch copy run behind
    the CPU's time."""
    c = _cuda_part(d, "contention", "the copy engine's reads of host memory need a GPU")
    if isinstance(c, str):
        return c
    note = (f"kernel {c['kernel_gbps_alone']:.1f} GB/s alone, {c['kernel_gbps_beside']:.1f} beside copies at "
            f"{c['copy_gbps_beside']:.1f} GB/s ({c['copy_gbps_alone']:.1f} alone)")
    return [_row(f"{c['shape']}, 1 token: kernel + copies together / kernel alone", c["model_ratio"], 1.0, note)]


def native_share_over_bf16_share(d: dict) -> list[dict] | str:
    """One MoE layer's device share at one token: held as the checkpoint stores it and read in
    place by the share kernel (what plans for MXFP4 checkpoints use), over held in bf16 and
    computed by the torch path (what plans for the other formats use); beside it the step model's ratio of the two
    paths' bytes (the native kernel's
    reads over the bf16 path's priced traffic), which is what it would be at one rate."""
    s = _cuda_part(d, "device_share", "the share's kernels run on a GPU")
    if isinstance(s, str):
        return s
    n = s.get("native") or {}
    if n.get("status") != "measured":
        return f"not measured: {n.get('status', 'not reached')}"
    note = (f"{n['native_gbps']:.0f} GB/s of {n['read_bytes_mean'] / 1e6:.1f} MB a step, {n['block_rows']} rows a "
            f"program; the bf16 share {s['share_part_gbps']:.0f} GB/s on its priced traffic")
    return [_row(f"{s['shape']}, {s['on_device']} of {s['experts']} experts, 1 token: native share / bf16 share",
                 n["native_over_share_part"], n["read_bytes_mean"] / s["share_traffic_bytes_est"], note)]


def lm_head_split_over_whole(d: dict) -> list[dict] | str:
    """One token's logits with gpt-oss's LM head split (its last rows on the host CPU, the
    others on the GPU meanwhile) over the whole head on the GPU; beside it what the step model
    prices the split at against the whole head, at the rates the two parts reached here."""
    s = _cuda_part(d, "lm_head_split", "the split's two parts run at once only beside a GPU")
    if isinstance(s, str):
        return s
    med = {k: s[f"{k}_s"]["median"] for k in ("whole", "host_part", "device_part")}
    note = (f"{s['host_rows']} of {s['rows']} rows on the host CPU at {s['host_part_gbps']:.1f} GB/s, the device's at "
            f"{s['device_part_gbps']:.0f} GB/s, overlap {s['overlap']:.2f}")
    return [_row(f"LM head {s['rows']}x{s['hidden']}, 1 token: split / whole on the GPU", s["split_over_whole"],
                 max(med["host_part"], med["device_part"]) / med["whole"], note)]


FAMILIES: tuple[Family, ...] = (
    Family("uva_over_copy_sizes", "uva-read", "UVA read rate / copy rate, by buffer size",
           "whether a kernel reading page-locked host memory in place keeps the copy engine's rate up to the size "
           "of a real offload (the largest size: the reference plan's cpu_offload_gb)", uva_over_copy_sizes),
    Family("uva_over_copy_probe", "probe", "UVA read rate / pinned copy rate (probe)",
           "the rate `plan` would price in-kernel host reads at, measured where plans are made", uva_over_copy_probe),
    Family("pageable_over_pinned", "probe", "pageable / pinned copy rate",
           "what page-locking host weights is worth: the copy rate pageable memory gets", pageable_over_pinned),
    Family("page_locked_over_planned", "mechanism", "page-locked / planned host bytes",
           "whether host weights lock exactly their bytes (no power-of-two rounding), and how much more torch's "
           "pinned blocks (vLLM's own pins) lock",
           page_locked_over_planned),
    Family("uva_embedding_over_device", "gather", "UVA embedding / device embedding, time per lookup",
           "that the glue's UVA embedding is graph-safe (a captured lookup replayed with new ids reads the right "
           "rows) and what it costs a step against a resident table", uva_embedding_over_device),
    Family("uva_moe_over_device", "mechanism", "fused-MoE on UVA experts / on device copies, time per layer",
           "what reading a layer's routed experts in place from host memory costs a decode step and a 2048-token "
           "prefill against device-resident experts (CUDA graph replays; a Triton stand-in for vLLM's TritonExperts)",
           uva_moe_over_device),
    Family("host_compute_over_uva", "host-compute", "host-compute / UVA, time per MoE layer at decode",
           "whether computing a layer's routed experts on the host CPU (only hidden states cross the link, handed "
           "off on the stream inside a CUDA graph) beats the GPU reading them from host memory in place, for "
           "gpt-oss-20b's MXFP4 and Qwen3-30B-A3B's bf16 layers, and up to how many tokens a step",
           host_compute_over_uva),
    Family("host_mlp_over_copy", "host-compute", "dense layer, MLP on the host CPU / MLP copied over the link",
           "whether computing a dense layer's MLP on the host CPU (attention on the GPU, one hand-off inside a "
           "captured graph) beats carrying its bytes over the link as a prefetched layer does, for "
           "Qwen3.8-27B-FP8's block FP8 MLP", host_mlp_over_copy),
    Family("host_reads_together", "host-compute", "host reads: CPU kernel + prefetch copies together / kernel alone",
           "whether a prefetch copy run behind the CPU's time costs the CPU kernel what the estimate prices (1.0: "
           "host memory serves the two one byte after the other at the kernel's rate)", host_reads_together),
    Family("native_share_over_bf16_share", "host-compute",
           "device share in the checkpoint's format / in bf16, time per MoE layer at decode",
           "whether a device share held as the checkpoint stores it and read in place by id (the share kernel, "
           "selective_offload/wrappers/share_kernel.py) is cheaper for the GPU than a bf16 share, as the step "
           "model prices it: what the MXFP4 plans' shares rest on",
           native_share_over_bf16_share),
    Family("lm_head_split_over_whole", "host-compute", "LM head split with the host CPU / whole on the GPU, time per step",
           "whether computing the LM head's last vocabulary rows on the host CPU while the GPU computes the others "
           "(part of the gpt-oss-120b plan's estimate) saves the step time the plan prices",
           lm_head_split_over_whole),
    Family("preflight_free_over_need", "preflight", "pre-flight: free device memory after the CUDA context / plan's need",
           "whether the reference plans, made again for this card (its compute capability, free memory and class), "
           "fit what it has free: the plan-level half of the worker's pre-flight (1 or more: fits)",
           # its reader lives with its section
           lambda d: __import__("benchmarks.preflight", fromlist=["free_over_need"]).free_over_need(d)),
    Family("host_gather_over_device", "gather", "host gather / device embedding, time per lookup",
           "what the eager host gather costs a step against a resident table", lambda d: _gather_ratio(d, "host")),
)


def ratios(sections: list[dict], out: Path) -> list[dict]:
    """Each family's rows from its section's JSON, or one row saying why it is not measured."""
    by_name = {s["name"]: s for s in sections}
    result = []
    for fam in FAMILIES:
        entry = {"key": fam.key, "section": fam.section, "label": fam.label, "proves": fam.proves,
                 "rows": [], "source": None, "not_measured": None}
        sec = by_name.get(fam.section)
        jsons = [n for n in (sec or {}).get("files", []) if n.endswith(".json")]
        if sec is None:
            entry["not_measured"] = f"the {fam.section} section was not run"
        elif not jsons:
            entry["not_measured"] = f"the {fam.section} section {sec['status']} before writing results"
        else:
            entry["source"] = jsons[0]
            try:
                got = fam.read(json.loads((out / jsons[0]).read_text()))
            except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError) as exc:
                got = f"could not read {jsons[0]}: {type(exc).__name__}: {exc}"
            if isinstance(got, str):
                entry["not_measured"] = got
            else:
                entry["rows"] = got
        result.append(entry)
    return result


def _cell(value) -> str:
    if value is None:
        return ""
    return fmt(value, 3) if isinstance(value, float) else str(value)


def ratio_rows(families: list[dict], source_link: Callable[[str], str] = lambda s: f"`{s}`") -> list[list[str]]:
    """The headline table's rows: figure, measured, est, from."""
    rows = []
    for f in families:
        if f["not_measured"]:
            rows.append([f["label"], f"not measured: {f['not_measured']}", "", ""])
            continue
        for r in f["rows"]:
            label = f"{f['label']}: {r['label']}"
            measured = ("n/a" if r["measured"] is None else _cell(r["measured"])) + (
                f" ({r['note']})" if r.get("note") else "")
            rows.append([label, measured, _cell(r["est"]), source_link(f["source"])])
    return rows

