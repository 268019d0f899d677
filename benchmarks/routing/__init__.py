"""The routing counters' cost on the card this runs on: the op the worker adds to every MoE
layer's router when it counts the routing (``selective_offload.vllm_glue.routing.count_picks``:
one ``index_add_`` of the step's top-k ids into a per-layer int64 counter), beside the
router's own top-k over the same logits, at decode and prefill sizes.

Timed two ways on CUDA, torch only (no vLLM): eagerly (each call's launch included), and
inside a captured CUDA graph of the router's top-k alone and of the top-k followed by the
count, replayed (the graph vLLM replays for a decode step holds both), whose difference is
what counting adds to a graph replay. On the CPU (the suite's ``--small`` run) the eager
times only, labelled as the CPU's.

    python3 -m benchmarks.routing [--small] [--out benchmarks/results]

Writes ``routing-<cuda|cpu>-<machine>.json`` and ``.md`` (``...-small`` with ``--small``).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from benchmarks.common import RESULTS_DIR, device_name, md_table, median_us, result_stem, today, write_results

#: (experts, experts per token): gpt-oss-120b's and Qwen3-30B-A3B's routers.
ROUTERS = ((128, 4), (128, 8))
#: Tokens per step: decode at batch 1 and 16, a prefill chunk.
TOKENS = (1, 16, 2048)


def measure(experts: int, k: int, tokens: int, cuda: bool, iters: int) -> dict:
    import torch

    from selective_offload.vllm_glue.routing import count_picks

    device = "cuda" if cuda else "cpu"
    logits = torch.randn(tokens, experts, device=device)
    counts = torch.zeros(experts, dtype=torch.long, device=device)
    ones = torch.ones(tokens * k, dtype=torch.long, device=device)
    ids = torch.topk(logits, k, dim=-1).indices

    def route():
        return torch.topk(logits, k, dim=-1).indices

    row = {"experts": experts, "k": k, "tokens": tokens,
           "topk_us": median_us(route, iters, cuda), "count_us": median_us(lambda: count_picks(counts, ids, ones),
                                                                            iters, cuda)}
    if cuda:
        graphs = {}
        for name, body in (("topk", route), ("topk_count", lambda: count_picks(counts, route(), ones))):
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                body()  # warm up outside the capture
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                body()
            graphs[name] = median_us(graph.replay, iters, cuda)
        row["graph_topk_us"], row["graph_topk_count_us"] = graphs["topk"], graphs["topk_count"]
        row["graph_count_us"] = graphs["topk_count"] - graphs["topk"]
    counts.zero_()
    count_picks(counts, ids, ones)
    row["counts_right"] = bool(torch.equal(counts.cpu(), torch.bincount(ids.reshape(-1).cpu(), minlength=experts)))
    return row


def markdown(result: dict) -> str:
    cuda = result["cuda"]
    headers = ["experts", "k", "tokens", "top-k us (eager)", "count us (eager)"]
    if cuda:
        headers += ["graph: top-k us", "graph: top-k + count us", "count in the graph us"]
    rows = []
    for r in result["rows"]:
        row = [r["experts"], r["k"], r["tokens"], f"{r['topk_us']:.1f}", f"{r['count_us']:.1f}"]
        if cuda:
            row += [f"{r['graph_topk_us']:.1f}", f"{r['graph_topk_count_us']:.1f}", f"{r['graph_count_us']:.1f}"]
        rows.append(row)
    where = "on the GPU" if cuda else "on the CPU (no CUDA device: eager times only)"
    return (f"# Routing counters {where}: {result['device']}, {result['date']}\n\n"
            "Median microseconds a call (each call synchronised: launch included).\n\n" + md_table(headers, rows))


def main(argv: list[str] | None = None) -> int:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="fewer repetitions (seconds); the files are named ...-small")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = ap.parse_args(argv)
    started = time.perf_counter()
    cuda = torch.cuda.is_available()
    iters = 5 if args.small else 200
    rows = [measure(e, k, t, cuda, iters) for e, k in ROUTERS for t in TOKENS]
    result = {"benchmark": "routing", "date": today(), "device": device_name(cuda), "cuda": cuda,
              "torch": torch.__version__, "small": args.small, "rows": rows,
              "wall_s": round(time.perf_counter() - started, 2)}
    text = markdown(result)
    print(text)
    stem = result_stem("routing", cuda, result["device"]) + ("-small" if args.small else "")
    paths = write_results(args.out, stem, result, text)
    print(f"wrote {paths[0]} and {paths[1]}")
    return 0 if all(r["counts_right"] for r in rows) else 1
