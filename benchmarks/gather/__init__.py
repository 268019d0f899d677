"""What reading the token embedding from host memory costs per token, against reading it
from device memory, for 1 to 4096 tokens per step.

Why it matters: the planner calls the embedding cold because a decode step reads one row
per token (10 KB at hidden 5120 in bf16) out of a 2.54 GB table, so moving the table to
the host should cost next to nothing. This measures that "next to nothing" for each way
the project can read the rows, labelled as the JSON and the table label them:

- ``device``: ``F.embedding`` on a resident table (what plain vLLM does).
- ``host``: the glue's eager path, :class:`selective_offload.wrappers.HostGather` with
  ``mode="host"``: ids to the host, bounds check, rows gathered into a pinned staging
  buffer, one copy of those rows to the device.
- ``uva_embedding`` (CUDA only): the glue's UVA path (``install_host_embedding`` with
  ``mode="uva"``, chosen when vLLM captures CUDA graphs): the weight's ``.data`` becomes a
  device view of the pinned host table (here made by
  :func:`~selective_offload.wrappers.cuda_view_of_pinned`; the glue uses vLLM's equivalent
  op) and vLLM's own ``F.embedding`` reads the rows through it, over the link.
- ``uva_embedding_graph`` (CUDA only): the same lookup captured in a CUDA graph (one graph
  per token count over a static ids buffer, replayed after copying the ids in, as vLLM
  replays its captured batch sizes): checks that the UVA read is graph-safe (bit-exact
  after replay with new ids) and times a replay. A capture that fails, or a replay that
  differs, is recorded as the path's status instead of stopping the run.
- ``uva_index_select`` (CUDA only): ``HostGather(mode="uva")``, the wrapper's UVA mode,
  which the glue does not use: ids to the device, a bounds check (one device-to-host
  sync), then ``index_select`` on the same kind of view.

Batch 1 decode is 1 token per step; prefill and large batches are the thousands.

Without CUDA the "device" is the CPU: the device and host rows both read host memory, so
the difference is the host gather's own overhead (staging, an extra copy, Python), not a
link; no UVA view can be made, so the UVA rows are skipped, with the reason recorded.

    .venv/bin/python -m benchmarks.gather [--vocab N] [--hidden N] [--iters N]
                                                [--smoke] [--out benchmarks/results]

Writes ``gather-<cpu|cuda>-<machine>.json`` and ``.md``. Planning time (header
reading and ``make_plan``) is a separate script: ``benchmarks/planning/timing.py``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from benchmarks.common import (  # noqa: E402
    RESULTS_DIR,
    device_name,
    fill_random,
    fmt,
    load_1min,
    md_table,
    result_stem,
    shared_note,
    spread,
    time_s,
    today,
    write_results,
)

TOKENS = (1, 4, 16, 64, 256, 1024, 4096)

#: Each way of reading the rows: its key in the JSON (``<key>_s``, ``<key>_us_per_token``),
#: its column label, and what it is.
PATHS = (
    ("device", "device F.embedding", "F.embedding on a resident device table (plain vLLM)"),
    ("host", "host gather (glue, eager)",
     'HostGather(mode="host"): ids to the host, rows gathered into a pinned staging buffer, '
     "one copy to the device (the glue's path without CUDA graphs)"),
    ("uva_embedding", "UVA F.embedding (glue, graphs)",
     "F.embedding on a weight whose .data is a device view of the pinned host table (the "
     "glue's UVA path: vLLM's own lookup reads the rows over the link)"),
    ("uva_embedding_graph", "UVA F.embedding, CUDA graph replay",
     "the glue's UVA lookup captured in a CUDA graph (static ids buffer, one graph per token count), "
     "replayed after copying new ids in: what runs when vLLM captures CUDA graphs"),
    ("uva_index_select", "UVA index_select (HostGather uva)",
     'HostGather(mode="uva"): ids to the device, a bounds check (one device-to-host sync), '
     "index_select on a device view of the pinned table (the wrapper's mode; not the glue's path)"),
)
UVA_PATHS = ("uva_embedding", "uva_embedding_graph", "uva_index_select")
NO_CUDA_REASON = "skipped: no CUDA device (a UVA view of pinned host memory needs one)"
NO_GRAPH_REASON = "skipped: no CUDA device (a CUDA graph needs one)"


def cuda_graphed(fn, example):
    """``fn`` captured in a CUDA graph over a static copy of ``example`` (warmed up on a side
    stream first, as torch asks); the returned call copies its ids into the static buffer
    and replays the graph, returning the graph's own output buffer."""
    import torch

    static = example.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn(static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(static)

    def replay(ids):
        static.copy_(ids)
        graph.replay()
        return out

    replay.graph = graph  # held as long as the call is
    return replay


def run(vocab: int, hidden: int, iters: int, tokens: tuple[int, ...], view=None, graph=None) -> dict:
    """Time every path at each token count. ``view`` makes the device view of the pinned
    table (default on CUDA: ``cuda_view_of_pinned``) and ``graph`` captures a lookup
    (default on CUDA: :func:`cuda_graphed`); without CUDA the UVA paths are skipped unless
    stand-ins are passed, as the tests do to run their code."""
    import torch
    import torch.nn.functional as F

    from selective_offload.wrappers import HostGather, cuda_view_of_pinned

    cuda = torch.cuda.is_available()
    if not cuda:
        torch.set_num_threads(1)  # steadier figures on a shared machine
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = torch.bfloat16
    host_table = fill_random(torch.empty(vocab, hidden, dtype=dtype, pin_memory=cuda))
    device_table = host_table.to(device) if cuda else host_table.clone()
    host = HostGather(device, mode="host")
    if view is None and cuda:
        view = lambda t: cuda_view_of_pinned(t, device)  # noqa: E731
    if graph is None and cuda:
        graph = cuda_graphed
    status = {"device": "measured", "host": "measured"}
    uva_weight = uva = None
    if view is None:
        status.update({k: NO_CUDA_REASON for k in UVA_PATHS})
    else:
        # The glue's UVA path, as install_host_embedding builds it: the Parameter keeps its
        # identity, its .data becomes the device view; F.embedding then reads through it.
        uva_weight = torch.nn.Parameter(host_table, requires_grad=False)
        uva_weight.data = view(host_table)
        if uva_weight.data_ptr() != host_table.data_ptr() or uva_weight.device != device:
            raise SystemExit("the UVA view is a copy, not a view of the pinned table")
        uva = HostGather(device, mode="uva", view_factory=view)
        status.update({k: "measured" for k in UVA_PATHS})
        if graph is None:
            status["uva_embedding_graph"] = NO_GRAPH_REASON

    calls = {
        "device": lambda ids: F.embedding(ids, device_table),
        "host": lambda ids: host(host_table, ids),
        "uva_embedding": lambda ids: F.embedding(ids, uva_weight),
        "uva_index_select": lambda ids: uva(host_table, ids),
    }
    replays: dict = {}
    calls["uva_embedding_graph"] = lambda ids: replays[ids.numel()](ids)
    measured = [k for k, _, _ in PATHS if status[k] == "measured"]
    gen = torch.Generator().manual_seed(1)
    rows = []
    for n in tokens:
        ids = torch.randint(0, vocab, (n,), generator=gen).to(device)
        row: dict = {"tokens": n, "bytes_moved": n * hidden * 2}
        with torch.no_grad():
            expected = F.embedding(ids, device_table)
            if "uva_embedding_graph" in measured:
                failed = graph_failure(graph, calls["uva_embedding"], calls["device"], ids, vocab, replays)
                if failed:
                    status["uva_embedding_graph"] = failed
                    measured.remove("uva_embedding_graph")
            for key in [k for k in measured[1:] if k != "uva_embedding_graph"]:
                if not torch.equal(calls[key](ids), expected):
                    raise SystemExit(f"{key} differs from F.embedding on the device table at {n} tokens")
            for key, _, _ in PATHS:
                if key in measured:
                    s = spread(time_s(lambda: calls[key](ids), iters, cuda))
                    row[f"{key}_s"], row[f"{key}_us_per_token"] = s, s["median"] * 1e6 / n
                else:
                    row[f"{key}_s"] = row[f"{key}_us_per_token"] = None
        row["host_minus_device_us"] = (row["host_s"]["median"] - row["device_s"]["median"]) * 1e6
        rows.append(row)
        print(f"{n:>5} tokens: " + ", ".join(
            f"{k} {row[f'{k}_s']['median'] * 1e6:9.1f} us" for k in measured), flush=True)
    return {"cuda": cuda, "device": device_name(cuda), "vocab": vocab, "hidden": hidden,
            "graph": None if graph is None else ("cuda_graphed" if cuda else "stand-in (no CUDA)"),
            "dtype": "bfloat16", "table_bytes": vocab * hidden * 2, "iters": iters,
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "uva_view": None if view is None else ("cuda_view_of_pinned" if cuda else "stand-in (no CUDA)"),
            "paths": [{"key": k, "label": label, "what": what, "status": status[k]} for k, label, what in PATHS],
            "rows": rows}


def graph_failure(graph, fn, reference, ids, vocab: int, replays: dict) -> str | None:
    """Capture ``fn`` for this many tokens, replay it with other ids, then with ``ids``:
    None when both replays match ``reference`` bit for bit, else the status to record (a
    capture that fails, or a replay that reads the wrong rows, is a finding, not a crash)."""
    import torch

    try:
        replay = graph(fn, torch.zeros_like(ids))
        other = (ids * 7 + 1) % vocab
        if not torch.equal(replay(other), reference(other)) or not torch.equal(replay(ids), reference(ids)):
            return f"FAILED: a replay differs from F.embedding on the device table at {ids.numel()} tokens"
    except (RuntimeError, ValueError) as err:
        return f"FAILED: capture or replay raised {type(err).__name__}: {str(err).splitlines()[0][:300]}"
    replays[ids.numel()] = replay
    return None


def markdown(r: dict) -> str:
    cpu_note = ("" if r["cuda"] else
                " No CUDA: the \"device\" is the CPU, so the device and host rows both read host "
                "memory and the difference is the host gather's own overhead (staging buffer, one "
                f"extra copy, Python), not a link. {r['torch_threads']} torch thread.")
    paths = [p for p in r["paths"] if p["status"] == "measured"]
    head = ["tokens/step", "bytes moved"]
    head += [f"{p['label']} us (min-max)" for p in paths]
    head += [f"{p['label']} us/token" for p in paths]
    head += ["host - device us"]
    rows = []
    for row in r["rows"]:
        def cell(s):
            return f"{s['median'] * 1e6:.1f} ({s['min'] * 1e6:.1f}-{s['max'] * 1e6:.1f})"
        line = [row["tokens"], row["bytes_moved"]]
        line += [cell(row[f"{p['key']}_s"]) for p in paths]
        line += [fmt(row[f"{p['key']}_us_per_token"], 3) for p in paths]
        line += [fmt(row["host_minus_device_us"], 1)]
        rows.append(line)
    legend = md_table(["path", "what it is", "here"],
                      [[p["label"], p["what"], p["status"]] for p in r["paths"]])
    exact = ", ".join(p["label"] for p in paths[1:])
    if r.get("uva_view") == "stand-in (no CUDA)":
        cpu_note += " The UVA rows read through a stand-in view (the host table itself): they run the code, they cross no link."
    return (
        f"# Embedding gather cost per token: {r['device']}\n\n"
        f"Date {r['date']}, torch {r['torch']}; table {r['vocab']} x {r['hidden']} bf16 "
        f"({r['table_bytes'] / 1e9:.3f} GB); {r['iters']} timed calls per point, median and "
        f"(min-max) of wall time with the device synchronised around each call; whole run "
        f"{r['wall_s']:.0f} s; {r['load_note']}. Measured, not estimated.{cpu_note}\n\n"
        + legend + "\n"
        + md_table(head, rows)
        + f"\n{exact}: bit-identical to `F.embedding` on the device table at every size "
          "(checked before timing).\n"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=None,
                    help="table rows (default 248320 on CUDA, 65536 on the CPU)")
    ap.add_argument("--hidden", type=int, default=5120)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--smoke", action="store_true", help="small table, few iterations (seconds)")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = ap.parse_args(argv)
    import torch

    cuda = torch.cuda.is_available()
    vocab = args.vocab or (248320 if cuda else 65536)
    hidden, iters = args.hidden, args.iters
    if args.smoke:
        vocab, hidden, iters = min(vocab, 4096), min(hidden, 512), 3
    if vocab < 1 or hidden < 1 or iters < 1:
        print("error: --vocab, --hidden and --iters must be positive", file=sys.stderr)
        return 2
    tokens = tuple(t for t in TOKENS if not args.smoke or t <= 256)
    load_before, started = load_1min(), time.perf_counter()
    result = run(vocab, hidden, iters, tokens)
    result.update(benchmark="gather", date=today(), smoke=args.smoke,
                  wall_s=time.perf_counter() - started)
    result["load_note"] = shared_note(load_before, load_1min())
    stem = result_stem("gather", result["cuda"], result["device"]) + ("-smoke" if args.smoke else "")
    paths = write_results(args.out, stem, result, markdown(result))
    print(f"wrote {paths[0]} and {paths[1]}")
    return 0
