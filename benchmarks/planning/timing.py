"""Planning-time cost: read the headers of a 64-shard, 30.9 GB checkpoint and plan it.

The checkpoint is header-only (each shard holds its true safetensors header and none of
its data), built from the bundled Qwen3.8-27B-FP8-shaped manifest, so what is timed is
exactly what `selective-offload plan` does on a real download: open each shard, read 8
bytes and the JSON header, validate offsets. Reports the median and spread of several
repetitions, the machine, and its 1-minute load before and after.

    .venv/bin/python -m benchmarks.planning timing [--repeats 7] [--out benchmarks/results]

With ``--out``, writes ``planning-cpu-<machine>.json`` and ``.md``, named as the other
benchmarks name theirs (planning is host work, so always ``cpu``). Files written before
2026-11-30 are named ``planning-<date>``; their JSON has the same keys (these add
``stem``, ``load_before``, ``load_after``, ``load_note`` and ``wall_s``).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

from benchmarks.common import load_1min, machine, result_stem, shared_note, today, write_results  # noqa: E402
from helpers import write_header_only  # noqa: E402
from selective_offload.checkpoint import load_checkpoint  # noqa: E402
from selective_offload.cli import BUNDLED  # noqa: E402
from selective_offload.planner import PlanInputs, make_plan  # noqa: E402
from selective_offload.sizes import GB, GiB  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--shards", type=int, default=64)
    ap.add_argument("--out", type=Path, default=None,
                    help="write planning-cpu-<machine>.json/.md here")
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.shards < 1:
        print("error: --repeats and --shards must be positive", file=sys.stderr)
        return 2
    load_before, started = load_1min(), time.perf_counter()

    reference = load_checkpoint(BUNDLED["qwen3.8-27b-fp8"])
    names = sorted(reference.tensors)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        per = -(-len(names) // args.shards)
        for i in range(args.shards):
            chunk = names[i * per:(i + 1) * per]
            write_header_only(root / f"model-{i + 1:05d}-of-{args.shards:05d}.safetensors",
                              {n: (reference.tensors[n].dtype, list(reference.tensors[n].shape)) for n in chunk})
        (root / "config.json").write_text(json.dumps(reference.config))
        on_disk = sum(p.stat().st_size for p in root.iterdir())

        read_s, plan_s = [], []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            ckpt = load_checkpoint(root)
            t1 = time.perf_counter()
            make_plan(ckpt, PlanInputs(device_memory_bytes=24 * GiB))
            t2 = time.perf_counter()
            read_s.append(t1 - t0)
            plan_s.append(t2 - t1)

    load_after = load_1min()
    result = {
        "benchmark": "planning",
        "date": today(),
        "machine": machine(),
        "python": platform.python_version(),
        "shards": args.shards,
        "tensors": len(ckpt.tensors),
        "declared_bytes": ckpt.total_bytes,
        "bytes_on_disk": on_disk,
        "repeats": args.repeats,
        "read_headers_ms_median": statistics.median(read_s) * 1e3,
        "read_headers_ms_min": min(read_s) * 1e3,
        "read_headers_ms_max": max(read_s) * 1e3,
        "plan_ms_median": statistics.median(plan_s) * 1e3,
        "plan_ms_min": min(plan_s) * 1e3,
        "plan_ms_max": max(plan_s) * 1e3,
        "load_before": load_before,
        "load_after": load_after,
        "load_note": shared_note(load_before, load_after),
        "wall_s": time.perf_counter() - started,
    }
    result["stem"] = result_stem("planning", False, result["machine"])
    md = (
        f"# Planning time ({result['date']}, {result['machine']})\n\n"
        f"{args.shards} header-only shards declaring {ckpt.total_bytes / GB:.2f} GB "
        f"({len(ckpt.tensors)} tensors; {on_disk / 1e3:.0f} kB on disk), {args.repeats} repetitions; "
        "the headers were just written, so they are read from the page cache; "
        f"{result['load_note']}.\n\n"
        "| step | median | min | max |\n|---|---|---|---|\n"
        f"| read headers | {result['read_headers_ms_median']:.1f} ms | {result['read_headers_ms_min']:.1f} ms "
        f"| {result['read_headers_ms_max']:.1f} ms |\n"
        f"| plan (24 GiB) | {result['plan_ms_median']:.1f} ms | {result['plan_ms_min']:.1f} ms "
        f"| {result['plan_ms_max']:.1f} ms |\n"
    )
    print(md)
    if args.out:
        paths = write_results(args.out, result["stem"], result, md)
        print(f"wrote {paths[0]} and {paths[1]}")
    return 0

