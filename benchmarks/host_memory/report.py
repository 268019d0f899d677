"""The host-memory benchmark's Markdown, from the result ``benchmarks.host_memory`` writes as
JSON.

Why a module of its own: the report reads only the result dict (the per-engine samples'
peaks, the comparison, the plan's landing report), so a recorded result renders here
without starting an engine.
"""

from __future__ import annotations

from benchmarks.common import fmt, md_table


def _mb_spread(s: dict) -> str:
    if s.get("median") is None:
        return "n/a"
    return f"{s['median'] / 1e6:.0f} ({s['min'] / 1e6:.0f}-{s['max'] / 1e6:.0f})"


def markdown(r: dict) -> str:
    m = r["model"]
    rows = []
    for c in r["configs"]:
        if c["status"] != "measured":
            rows.append([c["name"], f"failed: {'; '.join(e for e in c['errors'] if e)}"] + [""] * 5)
            continue
        rows.append([c["name"], _mb_spread(c["peak_rss_bytes"]), _mb_spread(c["peak_rss_load_bytes"]),
                     _mb_spread(c["peak_rss_generate_bytes"]), _mb_spread(c["rss_loaded_bytes"]),
                     _mb_spread(c["hwm_sum_bytes"]),
                     f"{fmt(c['load_s']['median'], 1)} ({fmt(c['load_s']['min'], 1)}-{fmt(c['load_s']['max'], 1)})"])
    cmp = r["comparison"]
    lines = [
        f"# Host memory of an engine: cold plan against plain vLLM, {r['machine']}",
        "",
        f"Date {r['date']}, vLLM {r['vllm']}, torch {r['torch']}, "
        f"{'CUDA (' + r['device'] + ')' if r['cuda'] else 'CPU build, no GPU'}; "
        f"{'smoke run: ' if r['smoke'] else ''}random Qwen3 built here (vocab {m['config']['vocab_size']} x "
        f"hidden {m['config']['hidden_size']}, {m['config']['num_hidden_layers']} layers, untied), checkpoint "
        f"{m['checkpoint_bytes'] / 1e6:.1f} MB in bf16, embedding {m['embedding_checkpoint_bytes'] / 1e6:.1f} MB "
        f"in the checkpoint and {m['embedding_engine_bytes'] / 1e6:.1f} MB as the engine holds it (engine dtype "
        f"{m['engine_dtype']}); {r['repeats']} engine(s) per configuration in alternating order, "
        f"{r['prompts']} prompts x {r['max_tokens']} tokens; "
        + (f"{r['cpu_threads']} CPU thread(s) per engine; " if r["cpu_threads"] else "")
        + f"whole run {r['wall_s']:.0f} s; {r['load_note']}.",
        "",
        "Resident set of the engine's process tree, MB, median (min-max):",
        "",
        md_table(["config", "peak (whole run)", "peak while loading", "peak while generating",
                  "at end of load", "sum of per-process VmHWM (upper bound)", "load s"], rows),
    ]
    if cmp:
        p, d = cmp["peak_rss_bytes"], cmp["paired_peak_ratio"]
        lines += [
            f"**selective / plain, peak RSS: {p['ratio']:.3f}** (medians; "
            f"{p['difference_bytes'] / 1e6:+.0f} MB, {p['difference_over_embedding']:+.2f}x the embedding's "
            f"{m['embedding_engine_bytes'] / 1e6:.0f} MB); paired by repetition {fmt(d['median'], 3)} "
            f"({fmt(d['min'], 3)}-{fmt(d['max'], 3)}). While loading: "
            f"{cmp['peak_rss_load_bytes']['ratio']:.3f} ({cmp['peak_rss_load_bytes']['difference_bytes'] / 1e6:+.0f} MB); "
            f"while generating: {cmp['peak_rss_generate_bytes']['ratio']:.3f} "
            f"({cmp['peak_rss_generate_bytes']['difference_bytes'] / 1e6:+.0f} MB); at end of load: "
            f"{cmp['rss_loaded_bytes']['ratio']:.3f} ({cmp['rss_loaded_bytes']['difference_bytes'] / 1e6:+.0f} MB). "
            f"Noise: the peaks of identical plain engines spanned "
            f"{cmp['noise_bytes']['plain_max_minus_min'] / 1e6:.0f} MB, the plan's "
            f"{cmp['noise_bytes']['selective_max_minus_min'] / 1e6:.0f} MB. Generated tokens identical across "
            f"all engines: {'yes' if cmp['same_tokens'] else 'NO'}.",
            "",
        ]
    if cmp.get("by_process"):
        lines += ["Where the difference lives, peak RSS per process (MB, medians):", "",
                  md_table(["process", "plain", "selective", "difference"],
                           [[x["process"], fmt(x["plain_peak_bytes"] / 1e6, 0), fmt(x["selective_peak_bytes"] / 1e6, 0),
                             f"{x['difference_bytes'] / 1e6:+.1f}"] for x in cmp["by_process"]])]
    runs = []
    for name in ("plain", "selective"):
        for i, x in enumerate(next(c for c in r["configs"] if c["name"] == name)["runs"]):
            if x["status"] != "measured":
                continue
            procs = ", ".join(f"{p['name']} {p['peak_rss_bytes'] / 1e6:.0f}"
                              + (f" (transient, {p['samples']} samples: not summed)" if p["transient"] else "")
                              for p in x["processes"])
            runs.append([f"{name} r{i + 1}", "first" if r["order"][i][0] == name else "second",
                         fmt(x["peak_rss_bytes"] / 1e6, 0), fmt(x["peak_rss_load_bytes"] / 1e6, 0),
                         fmt(x["peak_rss_generate_bytes"] / 1e6, 0), procs, x["samples"],
                         fmt(x["sample_interval_ms"], 1)])
    lines += ["Per engine (MB; per-process peaks by process name):", "",
              md_table(["engine", "order", "peak", "peak loading", "peak generating", "process peaks",
                        "samples", "interval ms"], runs)]
    rep = r.get("report")
    if rep:
        hm = rep.get("host_memory") or {}
        lines += [f"The plan's landing report (last engine): ok {rep['ok']}, "
                  f"{rep['landed_cold_on_host_bytes'] / 1e6:.1f} MB of cold bytes on the host, host-memory "
                  f"policy {hm.get('policy', 'n/a')} ({hm.get('reason', '')}), page-locked "
                  f"{hm.get('page_locked_bytes', 'n/a')} B, RSS of the process that loaded the model, at the report: "
                  f"{fmt((hm.get('resident_set_bytes') or 0) / 1e6, 0)} MB"
                  + (f"; problems: {'; '.join(rep['problems'])}" if rep["problems"] else "") + ".", ""]
    lines += [f"Method: {r['method']}", "", r["shows"], ""]
    return "\n".join(lines)
