"""The decode emulation's Markdown: the batch-1 table, the batch sweep, speculative
verification and routed experts, from the result ``decode_emulation.py`` writes as JSON.

Why a module of its own: the report reads only the result dict, so a result from another
machine (or one given CUDA-only fields, as a test does) renders without running anything.
"""

from __future__ import annotations

from _common import fmt, md_table, routed_expert_rows


def markdown(r: dict) -> str:
    bw, plan, cap = r["bandwidth"], r["plan"], r["cap"]
    rows = []
    for c in r["configs"]:
        if c["status"] != "measured":
            rows.append([c["config"], c["status"]] + [""] * 8)
            continue
        s = c["step_s"]
        est = f"{c['est_step_s'] * 1e3:.2f}"
        if "est_step_s_overlapped" in c:
            est += f" (overlapped {c['est_step_s_overlapped'] * 1e3:.2f})"
        rows.append([
            c["config"], "measured" + ("" if c["capped"] else " (no cap)"),
            f"{c['link_bytes_per_step'] / 1e6:.1f}", f"{c['device_read_bytes_per_step'] / 1e6:.1f}",
            f"{s['median'] * 1e3:.2f} ({s['min'] * 1e3:.2f}-{s['max'] * 1e3:.2f})", est,
            fmt(c["measured_over_est"]), fmt(c["tok_s"], 1),
            "n/a" if c.get("peak_device_bytes") is None else f"{c['peak_device_bytes'] / 1e9:.2f}",
            {True: "yes", False: "NO", None: "n/a"}[c.get("under_cap")],
        ])
    speed = ""
    if "speedup_selective_over_bulk" in r:
        speed = (f"\nSelective over bulk: **{r['speedup_selective_over_bulk']:.2f}x** measured, "
                 f"{r['est_speedup_selective_over_bulk']:.2f}x est.\n")
    where = ("" if r["cuda"] else
             " No CUDA: the \"device\" is the CPU (link = host memory copy, streams are no-ops, "
             "prefetch is a synchronous copy), so the figures show that the code runs and how "
             "the prediction tracks bytes, not what a GPU does.")
    return (
        f"# Decode-step emulation: {r['model']} under a {r['device_memory_bytes'] / 2**30:g} GiB cap, "
        f"{r['device']}\n\n"
        f"Date {r['date']}, torch {r['torch']}, scale {r['scale']:g} (hidden {r['hidden']}), "
        f"{r['torch_threads']} torch thread(s); whole run {r['wall_s']:.0f} s; {r['load_note']}.{where}\n\n"
        f"Bandwidths measured first: link {bw['link_gbps']:.2f} GB/s (pinned copy), device read "
        f"{bw['device_read_gbps']:.2f} GB/s (bf16 GEMV)"
        + (f", UVA read {bw['uva_read_gbps']:.2f} GB/s" if bw.get("uva_read_gbps") else "")
        + f". Cap {cap['cap_bytes'] / 1e9:.3f} GB: "
        + ("binds (an allocation just over it fails)" if cap["binds"] else
           "does NOT bind" if cap["binds"] is False else cap.get("note", "n/a"))
        + f".\n\nPlan (bundled manifest, full scale): {plan['strategy']}, hot layers "
        f"{plan['hot_layer_indices']}, est step {plan['est_step_s_full_scale'] * 1e3:.0f} ms; bulk "
        f"cpu_offload_gb={plan['bulk_cpu_offload_gb']:g} ({plan['bulk_offloaded_bytes'] / 1e9:.2f} GB), "
        f"est step {plan['bulk_est_step_s_full_scale'] * 1e3:.0f} ms (with the bandwidths above).\n\n"
        + md_table(["config", "status", "link MB/step", "device MB/step", "step ms median (min-max)",
                    "est step ms", "measured/est", "tok/s", "peak device GB", "under cap"], rows)
        + speed
        + "\nest = link bytes / link rate + device bytes / device rate (bulk's link rate is the UVA "
          "read rate on CUDA, the device read rate on the CPU); it ignores launch overhead (64+ small kernels per step dominate at "
          "small scales), the argmax and the host gather's device-to-host sync.\n"
        + markdown_sweep(r) + markdown_verification(r) + markdown_experts(r)
    )


def markdown_experts(r: dict) -> str:
    section = r.get("routed_experts") or {}
    if "skipped" in section:
        return f"\n## Routed experts\n\nSkipped: {section['skipped']}.\n"
    parts = ["\n## Routed experts: k of E read through a UVA view against a whole-layer copy\n\n"
             "Distinct experts the step's tokens route to (uniform random top-k), each read once in place by "
             "a GEMV through a device view of pinned host memory (uva), against copying the whole layer "
             "first (copy, what the prefetch offloader moves) and device-resident reads; est distinct = "
             "E x expert_read_fraction.\n"]
    for name, e in section.get("shapes", {}).items():
        parts.append(f"\n{name} ({e['num_experts']} experts top-{e['experts_per_token']}, "
                     f"{e['expert_bytes'] / 1e6:.2f} MB an expert at this scale; {e['uva']}):\n\n")
        parts.append(md_table(*routed_expert_rows(e)))
    return "".join(parts)


def _ms(s: dict | None) -> str:
    if not s:
        return ""
    return f"{s['median'] * 1e3:.2f} ({s['min'] * 1e3:.2f}-{s['max'] * 1e3:.2f})"


def _cap_cell(c: dict) -> list[str]:
    return ["n/a" if c.get("peak_device_bytes") is None else f"{c['peak_device_bytes'] / 1e9:.2f}",
            {True: "yes", False: "NO", None: "n/a"}[c.get("under_cap")]]


def markdown_sweep(r: dict) -> str:
    sweep = r.get("batch_sweep") or {}
    head = "\n## Batch sweep: the same placements, b sequences x 1 token per step\n\n"
    if sweep.get("skipped"):
        return head + f"Skipped: {sweep['skipped']}.\n"
    rows = []
    for c in sweep["configs"]:
        if c.get("status") != "measured":
            rows.append([c["config"], "", c.get("status", "")] + [""] * 8)
            continue
        for p in c["rows"]:
            if p["status"] != "measured":
                rows.append([c["config"], p["batch"], p["status"]] + [""] * 8)
                continue
            rows.append([c["config"] + ("" if c["capped"] else " (no cap)"), p["batch"], "measured",
                         _ms(p["step_s"]), f"{p['est_step_s'] * 1e3:.2f}", fmt(p["measured_over_est"]),
                         fmt(p["per_seq_tok_s"], 1), fmt(p["total_tok_s"], 1), fmt(p["est_total_tok_s"], 1)]
                        + _cap_cell(c))
    speed = sweep.get("speedup_selective_over_bulk") or {}
    line = ("\nSelective over bulk, total tok/s: "
            + ", ".join(f"batch {b}: **{v:.2f}x**" for b, v in speed.items()) + ".\n") if speed else ""
    return (head + f"{sweep['steps']} timed steps per point (after one warm-up), median (min-max); one "
            "matrix product per weight for every batch, 1 included (the batch-1 table above uses a "
            "matrix-vector product). "
            "est total tok/s = b / est step: the weights' bytes do not grow with the batch, so est is an "
            "upper bound that larger batches fall behind (compute, and here no attention or KV reads: a "
            "real batch reads each sequence's KV cache too). Peak device memory and the cap: over the "
            "configuration's batch-1 and sweep steps together.\n\n"
            + md_table(["config", "batch", "status", "step ms median (min-max)", "est step ms", "measured/est",
                        "tok/s per sequence", "tok/s total", "est tok/s total", "peak device GB", "under cap"],
                       rows)
            + line)


def markdown_verification(r: dict) -> str:
    v = r.get("verification") or {}
    head = "\n## Speculative decoding: K drafts, K + 1 tokens verified in one pass\n\n"
    if v.get("skipped"):
        return head + f"Skipped: {v['skipped']}.\n"
    plan = v["plan"]
    rows = []
    for c in v["configs"]:
        if c.get("status") != "measured":
            rows.append([c["config"], "", c.get("status", "")] + [""] * 9)
            continue
        for p in c["rows"]:
            if p["status"] != "measured":
                rows.append([c["config"], p["k"], p["status"]] + [""] * 9)
                continue
            def acceptance(key: str) -> str:
                if key not in p:
                    return "n/a" if p["k"] else ""  # K = 0: no drafts to accept
                return "never" if p[key] is None else fmt(p[key])
            rows.append([
                c["config"] + ("" if c["capped"] else " (no cap)"), p["k"], p["tokens_verified"],
                _ms(p["step_s"]), _ms(p["draft_s"]) or "none", f"{p['est_step_s'] * 1e3:.2f}",
                fmt(p.get("break_even_tokens_per_step")), fmt(p.get("est_break_even_tokens_per_step")),
                acceptance("break_even_accept_rate"),
                fmt(p.get("break_even_tokens_vs_plain_plan")),
                acceptance("break_even_accept_rate_vs_plain_plan"),
                fmt(p["max_tok_s"], 1),
            ])
    bulk = (f"bulk cpu_offload_gb={plan['bulk_cpu_offload_gb']:g}" if plan.get("bulk_cpu_offload_gb") is not None
            else "no bulk baseline")
    return (
        head
        + f"Placements re-planned with speculative=\"mtp\": the MTP head "
          f"({plan['mtp_bytes_full_scale'] / 1e9:.2f} GB at full scale) on the {plan['mtp_placement']}, hot layers "
          f"{plan['hot_layer_indices']}, {bulk}. A step: K draft passes (each: one embedding row, one pass over "
          "the head's bytes, the LM head, an argmax; the head's bytes as one matrix), then K + 1 tokens through "
          f"one pass over the weights. K = 0 is a plain step on this placement. {v['steps']} timed steps per "
          "point, median (min-max); drafts timed alone too.\n\n"
        + md_table(["config", "K", "tokens verified", "step ms (drafts + verify)", "drafts alone ms",
                    "est step ms", "break-even tokens/step", "est break-even", "break-even acceptance",
                    "break-even tokens/step vs plain plan", "acceptance vs plain plan",
                    "tok/s if all accepted"], rows)
        + "\nBreak-even tokens/step: step time / the K = 0 step on the same placement, the tokens a "
          "verification step must yield on average (accepted drafts + 1) to match plain decoding there; "
          "vs plain plan: / the batch-1 step of the plan made without MTP (what turning MTP on must beat, "
          f"the head's bytes displacing layers included; from the {v.get('plain_plan_reference')}). Acceptance: the per-draft acceptance rate that "
          "yields those tokens when acceptances are independent, E(K, a) = (1 - a^(K+1)) / (1 - a); "
          "never: more than K + 1 tokens would be needed. est = the bytes of the verify pass and of K "
          "drafts over their rates.\n"
        + "".join(f"\n{c['config']}: peak device {c['peak_device_bytes'] / 1e9:.2f} GB, under cap "
                  f"{ {True: 'yes', False: 'NO', None: 'n/a'}[c.get('under_cap')] }."
                  for c in v["configs"] if c.get("peak_device_bytes") is not None)
        + ("\n" if r["cuda"] else "")
    )
