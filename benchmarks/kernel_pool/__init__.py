"""The host-compute kernels' own thread pool against the OpenMP runtime torch loaded, side
by side in one process: per-layer kernel time, and the CPU the threads burn between calls.

The same kernel source is built twice: as shipped (its jobs on ``pool.h``'s pool: workers
pinned to the cores of this process's node, spinning at most the pool's window and then
asleep on a futex) and with ``-DSO_OPENMP`` (the same jobs in ``#pragma omp parallel`` on
torch's libgomp, whose idle threads spin as its wait policy, fixed when torch loaded it,
says). For each format's real-shaped layer (``cpu_kernels.timing.LAYERS``) and thread
count, each build runs, in alternating order each round:

- back to back: ``--iters`` calls for one token with new random expert ids each (the
  weights come from memory), timed one by one;
- with a gap: the same calls, each after a 1 ms sleep (a layer's turn on the device between
  two host layers), timed one by one, and the process's CPU time during each sleep (what
  the threads burn while the caller waits: libgomp's spin, or the pool's window).

Each round runs each build in a process of its own (libgomp's threads spin on after its
calls, and would otherwise run beside the pool's and count in its CPU time). A row's figure
is the median over the rounds of each round's median call (the spread: the rounds' lowest
and highest), never a best round.

    .venv/bin/python -m benchmarks.kernel_pool [--threads 1,2] [--iters 31] [--rounds 5] [--smoke] [--out DIR]

Writes ``kernel-pool-cpu-<machine>.json`` and ``.md`` into ``benchmarks/results/`` (or
``--out``); ``--smoke`` (tiny layers, a few calls, ``-smoke`` in the name) is what the test
suite runs. Run it under ``nice`` on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import (
    RESULTS_DIR,
    fmt,
    load_1min,
    machine,
    md_table,
    module_env,
    result_stem,
    shared_note,
    today,
    write_results,
)
from benchmarks.cpu_kernels import KERNEL_FORMATS, kernel_selection
from selective_offload import cpu_kernels as ck
from selective_offload.cpu_kernels import build, kernel, timing

#: The formats the compiled kernel is for.
#: The sleep between two calls in the gapped runs (seconds).
GAP_S = 0.001
#: The pause before each block: longer than any runtime spins (libgomp: a few ms).
SETTLE_S = 0.3


def block(job, ids, picks, gap: bool) -> tuple[list[float], list[float]]:
    """Each call's seconds, and (``gap``) the process CPU seconds burnt in the sleep before it."""
    call_s, burnt_s = [], []
    for p in picks:
        ids.copy_(p)
        if gap:
            c0 = time.process_time()
            time.sleep(GAP_S)
            burnt_s.append(time.process_time() - c0)
        t0 = time.perf_counter()
        job.run()
        call_s.append(time.perf_counter() - t0)
    return call_s, burnt_s


def child(name: str, formats, threads_list, iters, seed, smoke) -> dict:
    """One build's round, in a process of its own (so one build's idle threads never run beside
    the other's calls, nor count in its CPU time): each (format, threads) block's median call
    back to back and after a gap, and the cores burnt in the gaps."""
    lib = build.load(("-DSO_OPENMP",), quiet=True) if name == "openmp" else ck.library()
    med = statistics.median
    out = {"pool_cpus": kernel.pool_cpus(lib), "spin_ns": int(lib.so_pool_spin_ns()), "blocks": []}
    layers = {f: timing.layer_of(f, small=smoke) for f in formats}  # made first: torch's threads idle after
    for f in formats:
        base, w, act = layers[f]
        E, k, H = base["E"], base["k"], base["H"]
        g = torch.Generator().manual_seed(seed)
        picks = [torch.randperm(E, generator=g)[:k].view(1, k).int() for _ in range(iters + timing.WARM_ROUNDS)]
        x, tw = torch.randn(1, H, generator=g).bfloat16(), torch.rand(1, k, generator=g)
        for t in threads_list:
            ids = torch.zeros(1, k, dtype=torch.int32)
            job = ck.MoEJob(x, ids, tw, w, act, out=torch.empty(1, H), threads=t, library_=lib)
            time.sleep(SETTLE_S)  # the last block's (or torch's) idle threads asleep by now
            block(job, ids, picks[:timing.WARM_ROUNDS], False)  # warm: threads made, code touched
            back, _ = block(job, ids, picks[timing.WARM_ROUNDS:], False)
            gapped, burnt = block(job, ids, picks[timing.WARM_ROUNDS:], True)
            out["blocks"].append(dict(base, threads=t, build=name, bytes_per_call=k * w.expert_bytes, back_s=med(back),
                                      gap_s=med(gapped), burnt_cores=sum(burnt) / (GAP_S * len(burnt))))
    return out


def run(formats, threads_list, iters, rounds, smoke) -> tuple[list[dict], dict]:
    """``rounds`` rounds, each a process per build, the builds' order alternating."""
    med = statistics.median
    seen: dict[tuple, list[dict]] = {}
    info: dict = {}
    builds = ("openmp", "pool")
    for r in range(rounds):
        for name in builds if r % 2 == 0 else tuple(reversed(builds)):
            cmd = [sys.executable, "-m", "benchmarks.kernel_pool", "--child", name, "--seed", str(r), "--iters",
                   str(iters), "--threads", ",".join(map(str, threads_list)), "--formats", ",".join(formats)]
            proc = subprocess.run(cmd + (["--smoke"] if smoke else []), capture_output=True, text=True,
                                  env=module_env(dict(os.environ)), timeout=1800)
            if proc.returncode:
                raise RuntimeError(f"the {name} round failed: {proc.stderr.strip()[-400:]}")
            got = json.loads(proc.stdout.strip().splitlines()[-1])
            if name == "pool":
                info = {k: got[k] for k in ("pool_cpus", "spin_ns")}
            for b in got["blocks"]:
                seen.setdefault((b["format"], b["threads"], name), []).append(b)
                print(f"round {r} {b['format']} threads={b['threads']} {name}: back to back {b['back_s'] * 1e3:.3f} "
                      f"ms, after a gap {b['gap_s'] * 1e3:.3f} ms, {b['burnt_cores']:.2f} cores burnt in the gap",
                      file=sys.stderr, flush=True)
    rows = []
    for (f, t, name), reps in sorted(seen.items(), key=lambda kv: (formats.index(kv[0][0]), kv[0][1], kv[0][2])):
        def spread(key):
            vals = [rep[key] for rep in reps]
            return {"median": med(vals), "min": min(vals), "max": max(vals), "rounds": vals}
        row = {k: reps[0][k] for k in ("format", "model", "E", "k", "H", "I", "activation", "bytes_per_call")}
        row.update(threads=t, build=name, rounds=len(reps), back_s=spread("back_s"), gap_s=spread("gap_s"),
                   burnt_cores=spread("burnt_cores"))
        rows.append(row)
    return rows, info


def ms(s: dict) -> str:
    return f"{fmt(s['median'] * 1e3, 3)} ({fmt(s['min'] * 1e3, 3)}-{fmt(s['max'] * 1e3, 3)})"


def markdown(result) -> str:
    head = ["format", "layer", "threads", "build", "call ms, back to back", "call ms, after a 1 ms gap",
            "cores burnt in the gap", "pool / OpenMP time (back to back, gap)"]
    by = {(r["format"], r["threads"], r["build"]): r for r in result["rows"]}
    body = []
    for r in result["rows"]:
        layer = f"{r['model']} E={r['E']} k={r['k']} H={r['H']} I={r['I']}"
        other = by.get((r["format"], r["threads"], "openmp"))
        ratio = ""
        if r["build"] == "pool" and other:
            ratio = (f"{fmt(r['back_s']['median'] / other['back_s']['median'])}, "
                     f"{fmt(r['gap_s']['median'] / other['gap_s']['median'])}")
        b = r["burnt_cores"]
        body.append([r["format"], layer, r["threads"], r["build"], ms(r["back_s"]), ms(r["gap_s"]),
                     f"{fmt(b['median'])} ({fmt(b['min'])}-{fmt(b['max'])})", ratio])
    return (f"# Host-compute kernels: their own pool against OpenMP ({result['date']}, {result['machine']})\n\n"
            f"One token's call of each layer with new random expert ids, {result['iters']} calls per build a round, "
            f"{result['rounds']} rounds, each build in a process of its own, their order alternating; figures are "
            f"the median over rounds of each round's median (the rounds' lowest-highest in brackets). "
            f"`pool`: the kernels as shipped (workers "
            f"pinned to CPUs {result['pool_cpus']}, spinning {result['spin_ns'] / 1e3:g} us before they sleep); "
            f"`openmp`: the same source built with -DSO_OPENMP, its jobs on torch's libgomp. "
            f"Cores burnt in the gap: the process's CPU time during the {GAP_S * 1e3:g} ms sleep before each call "
            f"over the sleep's length (0: every thread asleep; 1: one core spinning throughout). "
            f"{result['load_note']}.\n\n" + md_table(head, body))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", default=f"1,{os.cpu_count() or 1}", help="comma-separated thread counts")
    ap.add_argument("--iters", type=int, default=31, help="calls per build, mode and round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--formats", default=",".join(KERNEL_FORMATS))
    ap.add_argument("--smoke", action="store_true", help="tiny layers, a few calls (seconds)")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR)
    ap.add_argument("--child", choices=("openmp", "pool"), help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    selection = kernel_selection(args.threads, args.formats, iters=args.iters, rounds=args.rounds)
    if selection is None:
        return 2
    threads, formats = selection
    try:
        for opts in ((), ("-DSO_OPENMP",)):
            build.load(opts, quiet=True)  # built once here, not in each round's process
    except ck.KernelUnavailable as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    iters, rounds = (3, 2) if args.smoke else (args.iters, args.rounds)
    if args.child:
        print(json.dumps(child(args.child, formats, threads, iters, args.seed, args.smoke)))
        return 0
    load_before, started = load_1min(), time.perf_counter()
    rows, info = run(formats, threads, iters, rounds, args.smoke)
    load_after = load_1min()
    result = dict(benchmark="kernel-pool", date=today(), machine=machine(), smoke=args.smoke, iters=iters,
                  rounds=rounds, threads=threads, gap_s=GAP_S, **info, rows=rows, load_before=load_before,
                  load_after=load_after, load_note=shared_note(load_before, load_after).capitalize(),
                  wall_s=time.perf_counter() - started)
    stem = result_stem("kernel-pool", False, result["machine"]) + ("-smoke" if args.smoke else "")
    result["stem"] = stem
    md = markdown(result)
    print(md)
    paths = write_results(args.out, stem, result, md)
    print(f"wrote {paths[0]} and {paths[1]}")
    return 0
