"""What reading the token embedding from host memory costs per token, against reading it
from device memory, for 1 to 4096 tokens per step.

Why it matters: the planner calls the embedding cold because a decode step reads one row
per token (10 KB at hidden 5120 in bf16) out of a 2.54 GB table, so moving the table to
the host should cost next to nothing. This measures that "next to nothing": a device
gather (``F.embedding`` on a resident table) against the project's host gather
(:class:`selective_offload.wrappers.HostGather`: ids to the host, rows gathered into a
pinned staging buffer, one copy of those rows to the device), and on CUDA the zero-copy
UVA gather (the device reads the rows through a view of the pinned table). Batch 1 decode
is 1 token per step; prefill and large batches are the thousands.

Without CUDA the "device" is the CPU: both gathers read host memory, so the difference is
the host gather's own overhead (staging, an extra copy, Python), not a link.

    .venv/bin/python benchmarks/bench_gather.py [--vocab N] [--hidden N] [--iters N]
                                                [--smoke] [--out benchmarks/results]

Writes ``gather-<cpu|cuda>-<machine>-<date>.json`` and ``.md``. Planning time (header
reading and ``make_plan``) is a separate script: ``benchmarks/bench_planning.py``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import (  # noqa: E402
    RESULTS_DIR, device_name, fill_random, fmt, load_1min, md_table, result_stem, shared_note, spread,
    time_s, today, write_results,
)

TOKENS = (1, 4, 16, 64, 256, 1024, 4096)


def run(vocab: int, hidden: int, iters: int, tokens: tuple[int, ...]) -> dict:
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
    uva = HostGather(device, mode="uva") if cuda else None
    if uva is not None:
        cuda_view_of_pinned(host_table, device)  # fail early if UVA views cannot be made

    gen = torch.Generator().manual_seed(1)
    rows = []
    for n in tokens:
        ids = torch.randint(0, vocab, (n,), generator=gen).to(device)
        with torch.no_grad():
            expected = F.embedding(ids, device_table)
            if not torch.equal(host(host_table, ids), expected):
                raise SystemExit(f"host gather differs from F.embedding at {n} tokens")
            dev = spread(time_s(lambda: F.embedding(ids, device_table), iters, cuda))
            hst = spread(time_s(lambda: host(host_table, ids), iters, cuda))
            uv = spread(time_s(lambda: uva(host_table, ids), iters, cuda)) if uva else None
        row = {
            "tokens": n,
            "bytes_moved": n * hidden * 2,
            "device_gather_s": dev,
            "host_gather_s": hst,
            "uva_gather_s": uv,
            "device_gather_us_per_token": dev["median"] * 1e6 / n,
            "host_gather_us_per_token": hst["median"] * 1e6 / n,
            "uva_gather_us_per_token": uv["median"] * 1e6 / n if uv else None,
            "host_minus_device_us": (hst["median"] - dev["median"]) * 1e6,
        }
        rows.append(row)
        print(f"{n:>5} tokens: device {dev['median'] * 1e6:9.1f} us, host {hst['median'] * 1e6:9.1f} us"
              + (f", uva {uv['median'] * 1e6:9.1f} us" if uv else ""), flush=True)
    return {"cuda": cuda, "device": device_name(cuda), "vocab": vocab, "hidden": hidden,
            "dtype": "bfloat16", "table_bytes": vocab * hidden * 2, "iters": iters,
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__, "rows": rows}


def markdown(r: dict) -> str:
    cpu_note = ("" if r["cuda"] else
                " No CUDA: the \"device\" is the CPU, so both gathers read host memory and the "
                "difference is the host gather's own overhead (staging buffer, one extra copy, "
                f"Python), not a link. {r['torch_threads']} torch thread.")
    head = ["tokens/step", "bytes moved", "device gather us (min-max)", "host gather us (min-max)",
            "device us/token", "host us/token", "host - device us"]
    if r["cuda"]:
        head[4:4] = ["UVA gather us (min-max)"]
        head += ["UVA us/token"]
    rows = []
    for row in r["rows"]:
        def cell(s):
            return f"{s['median'] * 1e6:.1f} ({s['min'] * 1e6:.1f}-{s['max'] * 1e6:.1f})"
        line = [row["tokens"], row["bytes_moved"], cell(row["device_gather_s"]), cell(row["host_gather_s"]),
                fmt(row["device_gather_us_per_token"], 3), fmt(row["host_gather_us_per_token"], 3),
                fmt(row["host_minus_device_us"], 1)]
        if r["cuda"]:
            line[4:4] = [cell(row["uva_gather_s"])]
            line += [fmt(row["uva_gather_us_per_token"], 3)]
        rows.append(line)
    return (
        f"# Embedding gather cost per token: {r['device']}\n\n"
        f"Date {r['date']}, torch {r['torch']}; table {r['vocab']} x {r['hidden']} bf16 "
        f"({r['table_bytes'] / 1e9:.3f} GB); {r['iters']} timed calls per point, median and "
        f"(min-max) of wall time with the device synchronised around each call; whole run "
        f"{r['wall_s']:.0f} s; {r['load_note']}. Measured, not estimated.{cpu_note}\n\n"
        + md_table(head, rows)
        + "\nHost gather is bit-identical to `F.embedding` at every size (checked before timing).\n"
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


if __name__ == "__main__":
    sys.exit(main())
