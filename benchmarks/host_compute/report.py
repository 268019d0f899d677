"""The host-compute section's Markdown (``benchmarks.host_compute`` writes it beside the JSON)."""

from __future__ import annotations

from benchmarks.common import fmt, md_table
from benchmarks.host_compute.head import markdown_lines as head_lines
from benchmarks.host_compute.layers import TOL_BF16, TOL_F32


def _us(s: dict | None) -> str:
    return "n/a" if not s or s.get("median") is None else f"{s['median'] * 1e6:.1f}"


def markdown(r: dict) -> str:
    lines = [f"# Host-compute: one MoE layer's routed experts on the host CPU: {r['device']}", "",
             f"Date {r['date']}, torch {r['torch']}, host CPU {r['machine']} ({r['threads']} threads = physical "
             f"cores; {r['logical_cpus']} logical CPUs); {'tiny shapes (--small)' if r['small'] else 'real shapes'}; "
             f"kernel: {r['kernel']['status']}; whole run {r['wall_s']:.0f} s; {r['load_note']}. Times are medians "
             "of per-call wall time (us), the device synchronised around each call. Measured, not estimated."
             + ("" if r["complete"] else " INCOMPLETE: the run stopped before every part was measured."), ""]
    bw = r["bandwidth"]
    lines += ["## The host CPU: read bandwidth and the kernel's weights rate", "",
              md_table(["layer", "T", "distinct experts", "kernel us", "kernel weights GB/s",
                        f"host read GB/s ({bw['threads']} threads)", "kernel / read"],
                       [[L["shape"], x["tokens"], fmt(x["distinct_experts"], 1), _us(x.get("kernel_s")),
                         fmt(x.get("kernel_weights_gbps")), fmt(bw.get("read_gbps")),
                         fmt(x["kernel_weights_gbps"] / bw["read_gbps"], 3)
                         if x.get("kernel_weights_gbps") and bw.get("read_gbps") else "n/a"]
                        for L in r["layers"] for x in L["rows"]])]
    if bw["status"] != "measured":
        lines += [f"Read bandwidth: {bw['status']}.", ""]
    h = r["handoff"]
    lines += ["## Hand-off per layer", "", f"Status: {h['status']}.", ""]
    if h["rows"]:
        lines += [md_table(["what", "eager us", "graph replay us", "error"],
                           [[x["what"], _us(x.get("eager_s")), _us(x.get("graph_s")), x.get("error", "")]
                            for x in h["rows"]])]
    for L in r["layers"]:
        st = L["status"]
        lines += [f"## {L['shape']} ({L['fmt']}, {L['experts']} experts top-{L['k']}, H {L['hidden']}, "
                  f"I {L['intermediate']}): decode time per layer", "",
                  f"Expert {L['expert_bytes'] / 1e6:.2f} MB, layer {L['layer_bytes'] / 1e6:.1f} MB; UVA read rate "
                  f"{fmt(L.get('uva_read_gbps'))} GB/s. Crossover (the host path beats every device path up to): "
                  + (f"T = {L['crossover']['tokens']}" if L["crossover"]["tokens"] else L["crossover"]["note"]) + ".",
                  "",
                  md_table(["T", "distinct experts", "host eager", "host graph", "device path (copy)", "UVA",
                            "resident", "UVA floor", "host graph / UVA", "errors"],
                           [[x["tokens"], fmt(x["distinct_experts"], 1), _us(x.get("host_eager_s")),
                             _us(x.get("host_graph_s")), _us(x.get("device_path_s")), _us(x.get("uva_s")),
                             _us(x.get("resident_s")),
                             f"{x['uva_floor_s'] * 1e6:.1f}" if x.get("uva_floor_s") else "n/a",
                             fmt(ratio(x, "host_graph_s", "uva_s"), 3),
                             "; ".join(f"{k}: {v}" for k, v in x.items() if k.endswith("_error"))]
                            for x in L["rows"]])]
        why: dict[str, list[str]] = {}
        for k, v in st.items():
            if v != "measured":
                why.setdefault(v, []).append(f"`{k}`")
        if why:
            lines += ["Not measured: " + "; ".join(f"{', '.join(ks)} ({v})" for v, ks in why.items()) + ".", ""]
    sweep = [[t["shape"], x["threads"], _us(x.get("kernel_s")), _us(x.get("host_graph_s")),
              x.get("host_graph_error", "" if t["host_graph"] == "measured" else t["host_graph"])]
             for t in r["threads_sweep"] if t["status"] == "measured" for x in t["rows"]]
    lines += ["## Threads: one token's layer at several thread counts", "",
              md_table(["layer", "threads", "kernel us", "host graph us", "note"], sweep) if sweep else
              f"Not measured: {r['threads_sweep'][0]['status'] if r['threads_sweep'] else 'not reached'}.\n"]
    o = r["overlap"]
    lines += ["## Overlap: the host path beside independent GPU work", ""]
    if o["status"] != "measured":
        lines += [f"Status: {o['status']}.", ""]
    else:
        lines += [md_table(["layer", "host path us", "GPU work us", "sum us", "other stream us", "overlap",
                            "same stream us", "overlap"],
                           [[o["shape"], f"{o['host_s'] * 1e6:.1f}", f"{o['gpu_s'] * 1e6:.1f}",
                             f"{o['sum_s'] * 1e6:.1f}", f"{o['other_stream_s'] * 1e6:.1f}",
                             fmt(o["other_stream_overlap"], 2), f"{o['same_stream_s'] * 1e6:.1f}",
                             fmt(o["same_stream_overlap"], 2)]]),
                  f"GPU work: {o['matmul']} x {o['matmul_reps']}. Overlap: (sum - together) / the shorter part "
                  "(1: fully hidden, 0: serialised).", ""]
    c = r.get("contention") or {"status": "not reached"}
    lines += ["## Contention: the kernel and copies reading host memory together", ""]
    if c["status"] != "measured":
        lines += [f"Status: {c['status']}.", ""]
    else:
        lines += [md_table(["layer", "kernel threads", "kernel GB/s alone", "beside copies", "copies GB/s alone",
                            "beside the kernel", "together / kernel alone"],
                           [[c["shape"], str(c["kernel_threads"]), fmt(c["kernel_gbps_alone"], 2),
                             fmt(c["kernel_gbps_beside"], 2), fmt(c["copy_gbps_alone"], 2),
                             fmt(c["copy_gbps_beside"], 2), fmt(c["model_ratio"], 2)]]),
                  f"Copies: {c['copier']}, {c['copy_bytes'] >> 20} MiB each. The plan's estimate serves a "
                  "prefetch copy and the CPU kernel one byte after the other at the kernel's rate (1.00 in "
                  "the last column); above it the estimate is conservative, below it optimistic.", ""]
    s = r.get("device_share") or {"status": "not reached"}
    lines += ["## Device share: the first experts on the device, computed there beside the CPU", ""]
    if s["status"] != "measured":
        lines += [f"Status: {s['status']}.", ""]
    else:
        lines += [md_table(["layer", "experts on the device", "whole layer on the host us", "with the share us",
                            "host part alone us", "share alone us", "overlap", "shared / whole"],
                           [[s["shape"], f"{s['on_device']} of {s['experts']} ({s['share_bytes'] / 1e6:.3g} MB)",
                             _us(s["whole_s"]), _us(s["shared_s"]), _us(s["host_part_s"]), _us(s["share_part_s"]),
                             fmt(s["overlap"], 2), fmt(s["shared_over_whole"], 3)]]),
                  f"One token, {'graph replays' if s['graph'] else 'eager calls (no CUDA: the share runs on the CPU, in turn)'}. "
                  "Overlap: (host part + share - with the share) / the shorter part (1: the share hidden under the "
                  "CPU's time, as the plan prices it; 0: one after the other).", ""]
        n = s.get("native") or {"status": "not reached"}
        if n["status"] != "measured":
            lines += [f"The same share held as the checkpoint stores it ({s['shape']}'s format), computed by the "
                      f"share kernel that reads it in place (selective_offload/wrappers/share_kernel.py): {n['status']}.", ""]
        else:
            lines += [f"The same share held as the checkpoint stores it ({n['held_bytes'] / 1e6:.3g} MB), computed by "
                      f"the share kernel that reads each picked expert in place (wrappers/share_kernel.py, "
                      f"{n['block_rows']} rows a program): {_us(n['native_s'])} us, "
                      f"{fmt(n['native_gbps'], 1)} GB/s of the {n['read_bytes_mean'] / 1e6:.3g} MB it reads a step "
                      f"on average, {fmt(n['native_over_share_part'], 3)} of the bf16 share's time. A plan for an "
                      "MXFP4 checkpoint prices its share at the card's decode read rate: set the rate beside it.", ""]
    lines += head_lines(r)
    d = r.get("dense_layer") or {"status": "not reached"}
    lines += ["## A dense layer: attention on the GPU, its MLP on the host CPU", ""]
    if d["status"] != "measured":
        lines += [f"Status: {d['status']}.", ""]
    else:
        a = d["attention"]
        lines += [f"{d['shape']}: MLP {d['mlp_bytes'] / 1e6:.1f} MB (block FP8 codes and scales); attention "
                  f"{a['heads']} query heads, {a['kv_heads']} KV heads, head_dim {a['head_dim']}, a "
                  f"{a['context']}-token KV cache, its projections {a['bytes'] / 1e6:.1f} MB in bf16 on the device; "
                  f"one token; {'graph replays' if d['graph'] else 'eager calls (no CUDA)'}. The prefetch row is the "
                  f"attention plus the MLP's bytes copied {d['copy']} in line (none hidden behind other layers).", "",
                  md_table(["attention us", "MLP on the host us", "layer, MLP on the host us",
                            "MLP copied us (GB/s)", "layer, MLP copied us", "host / copied"],
                           [[_us(d["attention_s"]), _us(d["mlp_host_s"]), _us(d["layer_host_s"]),
                             f"{_us(d['mlp_copy_s'])} ({fmt(d.get('mlp_copy_gbps'))})",
                             f"{d['layer_prefetch_s'] * 1e6:.1f}", fmt(d["host_over_prefetch"], 3)]])]
    lines += ["## Correctness", "",
              f"max |path - reference| <= tol x max |reference|, the reference on the CPU; tol {TOL_F32:g} for "
              f"float32 paths, {TOL_BF16:g} for paths that round to bf16 (the kernel's too where it holds the "
              f"activation in bf16: {'yes' if r['kernel'].get('bf16_activations') else 'no'} here); the host paths "
              f"of an MXFP4 or int4 layer against the reference with its vectors rounded to int8 as the kernel's "
              f"are, at the bf16 tolerance ({'yes' if r['kernel'].get('int8_mxfp4') else 'no'} here).", "",
              md_table(["layer", "path", "T", "max abs err", "max abs ref", "tol", "ok"],
                       [[c["shape"], c["path"], c["tokens"], fmt(c.get("max_abs_err"), 6),
                         fmt(c.get("max_abs_ref"), 3), fmt(c.get("tol"), 4) if c.get("tol") else c.get("note", ""),
                         "yes" if c["ok"] else "NO"] for c in r["correctness"]])]
    return "\n".join(lines)


def ratio(row: dict, top: str, bottom: str) -> float | None:
    a, b = (row.get(top) or {}).get("median"), (row.get(bottom) or {}).get("median")
    return a / b if a and b else None
