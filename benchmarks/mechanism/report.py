"""The Markdown of the GPU mechanism check: its asserts and every section's figures, from
the results ``benchmarks.mechanism`` writes as JSON.

Why a module of its own: the report reads only the results dict, so a results file from
a GPU run renders here without running anything. A section whose fixture failed has no
figures (``None``): its heading says so, and the asserts table holds the failure.
"""

from __future__ import annotations

import json
import statistics

from benchmarks.common import fmt, md_table, routed_expert_rows


def _fmt(value, digits: int = 1) -> str:
    return fmt(value, digits)


def _table(headers: list[str], rows: list[list]) -> list[str]:
    """The table's lines, a blank one last."""
    return md_table(headers, rows).split("\n")


def _measures(title: str, values: dict) -> str:
    rows = [[k, _fmt(v, 4) if isinstance(v, float) or v is None else v] for k, v in values.items()]
    return "\n".join([title, "", *_table(["measure", "value"], rows)])


def _not_measured(key: str) -> list[str]:
    return [f"## {key}: not measured (its fixture failed; see the asserts)", ""]


def _gather(emb: dict) -> list[str]:
    return [
        f"## Embedding gather ({emb['vocab']} x {emb['hidden']} bf16)",
        "",
        *_table(
            ["tokens/step", "bytes moved", "device gather us", "host gather us",
             "UVA gather us", "UVA kernel only us"],
            [[r["tokens"], r["row_bytes_moved"], _fmt(r["device_gather_us"]),
              _fmt(r["host_gather_us"]), _fmt(r["uva_gather_us"]),
              _fmt(r["uva_kernel_only_us"])] for r in emb["gather"]],
        ),
    ]


def _tp_lookup(tp: dict) -> list[str]:
    return [
        _measures(f"## Masked TP lookup, host shard against device shard "
                  f"(rank {tp['rank']} of {tp['tp_size']}: rows {tp['shard_rows'][0]}-"
                  f"{tp['shard_rows'][1] - 1} of {tp['vocab']} x {tp['hidden']} bf16)",
                  {k: v for k, v in tp.items() if k != "lookup"}),
        *_table(
            ["tokens/step", "ids in the shard", "masked device lookup us",
             "masked host lookup us"],
            [[r["tokens"], r["ids_in_shard"], _fmt(r["masked_device_lookup_us"]),
              _fmt(r["masked_host_lookup_us"])] for r in tp["lookup"]],
        ),
    ]


def _tower(tower: list[dict]) -> list[str]:
    return [
        "## Tower onload vs size",
        "",
        *_table(
            ["blocks", "tower MB", "resident us", "on-demand us", "overhead us",
             "onload GB/s", "peak transient MB (ledger)", "peak device MB (measured)"],
            [[r["depth"], _fmt(r["tower_bytes"] / 1e6), _fmt(r["resident_forward_us"], 0),
              _fmt(r["on_demand_forward_us"], 0), _fmt(r["onload_overhead_us"], 0),
              _fmt(r["effective_onload_gb_per_s"], 2),
              _fmt(r["peak_transient_device_bytes_ledger"] / 1e6),
              _fmt(None if r["peak_device_bytes_measured"] is None
                   else r["peak_device_bytes_measured"] / 1e6)]
             for r in tower],
        ),
    ]


def _bandwidth(bandwidth: dict) -> list[str]:
    return [
        "## Copy bandwidth",
        "",
        *_table(["measure", "value"],
                [[k, _fmt(v, 2) if isinstance(v, float) else v]
                 for k, v in bandwidth.items()]),
    ]


def markdown(results: dict) -> str:
    cuda = results["cuda"]
    setting = "CUDA" if cuda else "no CUDA: CPU figures, device asserts skipped"

    def part(key: str, render) -> list[str]:
        data = results.get(key)
        return _not_measured(key) if data is None else render(data)

    lines = [
        f"# Offload mechanism check: {results['device']}",
        "",
        f"Date {results['date']}, torch {results['torch']}, "
        f"{'small' if results['small'] else 'full'} sizes, {setting}; whole run "
        f"{results['wall_s']:.0f} s. Times are medians of per-call wall time with the device "
        "synchronised around each call (measured, not estimated)."
        + ("" if cuda else f" CPU run with {results['cpu_threads']} torch thread: the figures "
           "show that the code runs, not what a GPU does."),
        "",
        "## Asserts",
        "",
        *_table(["check", "status", "detail"],
                [[r["name"], r["status"], r["detail"]] for r in results["asserts"]]),
        *part("embedding", _gather),
        *part("tp_lookup", _tp_lookup),
        *part("drafter", lambda d: [_measures("## A drafter's shared embedding and LM head (built on the host, "
                                              "freed when replaced by the target's)", d)]),
        *part("explicit_device", lambda d: [_measures("## Explicit-device and shared allocations inside a cold "
                                                      "module", d)]),
        _measures("## CUDA load paths (registration and UVA view, post-processing round trip, "
                  "prefetch offloader post_init)",
                  {k: json.dumps(v) for k, v in (results.get("cuda_paths") or {}).items()}),
        *part("tower", _tower),
        *part("bandwidth", _bandwidth),
        *part("host_memory", lambda hm: host_memory_markdown(hm, cuda)),
        *routed_experts_markdown(results.get("routed_experts")),
        *layouts_markdown(results.get("layouts")),
        *fused_moe_markdown(results.get("fused_moe")),
    ]
    return "\n".join(lines)


def routed_experts_markdown(r: dict | None) -> list[str]:
    if not r:
        return []
    e = r["reads"]
    return [f"## Routed experts: k of E through a UVA view against a whole-layer copy ({r['shape']}: "
            f"{e['num_experts']} experts top-{e['experts_per_token']}, {e['expert_bytes'] / 1e6:.2f} MB an expert; "
            f"{e['uva']})", "", *_table(*routed_expert_rows(e))]


def layouts_markdown(r: dict | None) -> list[str]:
    """Issue 26's arena checks (CUDA only: nothing measured without it)."""
    if not r:
        return []
    return [_measures("## Layouts through the arena (FP8 `.t()` into CUTLASS, adjacent heap tensors, a hot layer)",
                      {k: json.dumps(v) for k, v in r.items()})]


def fused_moe_markdown(r: dict | None) -> list[str]:
    """The fused-MoE stand-in on UVA views against device copies, graph replays timed."""
    if not r or not (r.get("rows") or r.get("error")):
        return []
    shape = r["shape"]
    rows = [[x["phase"], x["tokens"], x.get("distinct_experts", "n/a"), _fmt(x.get("uva_replay_us")),
             _fmt(x.get("device_replay_us")), _fmt(x.get("uva_over_device"), 2), x.get("bit_equal", "n/a"),
             x.get("error", "")] for x in r["rows"]]
    return [f"## Fused-MoE stand-in (for TritonExperts) on UVA views under CUDA graph replay, per layer "
            f"({shape['moe_experts']} experts, hidden {shape['moe_hidden']}, intermediate {shape['moe_inter']}, "
            f"top-{shape['moe_top_k']}, bf16)", "",
            *([f"Not measured: {r['error']}", ""] if r.get("error") else []),
            *_table(["phase", "tokens", "experts read", "UVA replay us", "device replay us", "UVA / device",
                     "bit-equal", "error"], rows)]


def host_memory_markdown(hm: dict, cuda: bool) -> list[str]:
    def med(rows, key, digits=2):
        vals = [r[key] for r in rows or [] if r.get(key) is not None]
        return _fmt(statistics.median(vals), digits) if vals else "n/a"

    def ratio(value):
        return _fmt(value, 4)

    rows = []
    for r in hm["sets"]:
        a, b = r["rounding"], r["exact"]
        rows.append([r["set"], r["tensors"], _fmt(r["planned_bytes"] / 1e6),
                     _fmt(a[0]["page_locked_bytes"] / 1e6) if a and a[0]["page_locked_bytes"] is not None else "n/a",
                     ratio(r["ratio_rounding"]), ratio(r["est_ratio_rounding"]),
                     med(a, "alloc_and_lock_s", 3), med(a, "h2d_gb_per_s", 1),
                     _fmt(b[0]["page_locked_bytes"] / 1e6) if b else "n/a", ratio(r["ratio_exact"]),
                     med(b, "alloc_and_lock_s", 3), med(b, "h2d_gb_per_s", 1),
                     ratio(r["recorded"]["ratio"])])
    o = hm["overall"]
    rows.append(["**overall**", sum(r["tensors"] for r in hm["sets"]), _fmt(o["planned_bytes"] / 1e6),
                 "", ratio(o["ratio_rounding"]), ratio(o["est_ratio_rounding"]), "", "", "",
                 ratio(o["ratio_exact"]), "", "", ""])
    rss = []
    for r in hm["sets"]:
        for key, label in (("rounding", "(a) torch pinned"), ("exact", "(b) registered")):
            for x in r[key] or []:
                rss.append([r["set"], label, x["order"], _fmt(x["rss_growth_at_alloc_mb"]),
                            _fmt(x["rss_growth_after_fill_mb"]), _fmt(x["alloc_and_lock_s"], 3),
                            _fmt(x["release_s"], 3), _fmt(x["largest_enqueue_us"], 0),
                            _fmt(x["largest_copy_us"], 0)])
    return [
        "## Page-locked host memory against planned host bytes",
        "",
        "Each set allocated two ways, freed in between: (a) torch's caching host allocator "
        "(`torch.empty(..., pin_memory=True)`; page-locked bytes from "
        "`torch.cuda.host_memory_stats()[\"allocated_bytes.current\"]` before and after, its cache "
        "emptied first: the rounded block sizes); (b) pageable `torch.empty` registered in place "
        "through `PageLockedLedger(PinPolicy.decide(cuda=True))` (`cudaHostRegister`; bytes from "
        "the ledger). Ratio = page-locked / planned bytes. `est` ratio: every tensor rounded up "
        "to a power of two (what torch's allocator is documented to do). The recording-registrar "
        "column is the ledger's bookkeeping with a stand-in registrar (runs without CUDA). Times "
        f"are medians over {hm['repeats']} repetitions in alternating order (alloc+lock: "
        "allocating and page-locking, first touch included; H2D: every tensor of the set copied "
        "with `non_blocking=True`, one sync; the largest copy's enqueue is timed queued behind a "
        "~25 ms GPU spin, `torch.cuda._sleep`, which an async copy does not wait for). "
        f"PYTORCH_ALLOC_CONF: {hm['pytorch_alloc_conf'] or 'unset'}."
        + ("" if cuda else " No CUDA here: (a) and (b) are skipped, the est and recording columns "
           "still run (small form: every dimension divided by " f"{hm['shrink']})."),
        "",
        *_table(["set", "tensors", "planned MB", "(a) page-locked MB", "ratio_rounding",
                 "est ratio (pow2)", "(a) alloc+lock s", "(a) H2D GB/s", "(b) page-locked MB",
                 "ratio_exact", "(b) alloc+lock s", "(b) H2D GB/s", "recording registrar ratio"],
                rows),
        *(["Per run: process RSS growth (informational), times, and the largest tensor's copy "
           "call returning (enqueue) against the copy completing.", "",
           *_table(["set", "way", "order", "RSS growth at alloc MB", "RSS growth after fill MB",
                    "alloc+lock s", "release s", "largest copy enqueue us", "largest copy done us (behind the spin)"],
                   rss)] if rss else []),
    ]
