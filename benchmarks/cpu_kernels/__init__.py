"""Host-compute CPU kernels at batch 1: how close each format's kernel comes to the host's
read bandwidth.

For each format, one real-shaped MoE layer's routed experts (bf16, fp8-block and int4:
Qwen3-30B-A3B, E=128 k=8 H=2048 I=768, int4 in groups of 128 with zero points; mxfp4:
gpt-oss-20b, E=32 k=4 H=2880 I=2880, with biases and swigluoai) are computed for one token
with new random expert ids every call (so the weights come from memory, not from a cache). The figure is the weights' bytes read per
second (the k experts' weights, scales and biases over the call's time, median of many
calls), beside the read bandwidth of the C read kernel with the same threads, sampled in
the same rounds (one kernel call, one read of a buffer larger than the caches, alternating),
so both see the same machine: ``selective_offload.cpu_kernels.timing``'s rounds and layers,
which ``selective-offload probe`` runs on a user's host too. The ratio is what ``CLAIMED`` in
``selective_offload.cpu_kernels`` is judged by (a format is claimed when every thread count
measured reaches ``CLAIM_BAR`` in its best of ``--repeats`` whole measurements, taken in
turns over the rows: on a shared machine other work only slows a repeat down, and a slow
spell then lands on one repeat of several rows rather than every repeat of one; the row's
ratio shown is their median). torch's own bf16 path (``F.linear`` per picked expert) is
timed the same way beside the bf16 kernel, and on the AVX512-BF16 build the bf16 kernel
with the other software-prefetch choice (moe.c picks one by CPU vendor), and the same walk
over an LM head's host rows (``cpu_kernels.rows``: the rows gpt-oss's reference plan leaves
the host CPU, :data:`HEAD_ROWS`), which a plan splits only where bf16 is claimed.

    .venv/bin/python -m benchmarks.cpu_kernels [--threads 1,2] [--iters 41] [--repeats 3] [--smoke] [--out DIR]

Writes ``cpu-kernels-cpu-<machine>.json`` and ``.md`` into ``benchmarks/results/``
(or ``--out``); ``--smoke`` (tiny layers, a few calls, ``-smoke`` in the name) is what the
test suite runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.common import (  # noqa: E402,E501
    RESULTS_DIR,
    fmt,
    load_1min,
    machine,
    md_table,
    result_stem,
    shared_note,
    today,
    write_results,
)
from selective_offload import cpu_kernels as ck  # noqa: E402
from selective_offload.cpu_kernels import build, timing  # noqa: E402

#: The builds the benchmark can measure: the flags added to the native build's.
BUILDS = {"native": (), "avx2": ("-mno-avx512f",)}

#: An LM head's rows computed on the host, timed beside the bf16 rows: gpt-oss's last 27776
#: of 201088 vocabulary rows of 2880 (benchmarks/results/moe-plans-est.md), and
#: a small head for --smoke.
HEAD_ROWS, SMOKE_HEAD_ROWS = (27776, 2880), (512, 256)

#: The formats the compiled kernel is for (f32 experts are computed by torch, not timed here).
KERNEL_FORMATS = tuple(f for f in ck.FORMATS if f not in ck.TORCH_FORMATS)


def kernel_selection(threads_text: str, formats_text: str, **counts: int) -> tuple[list[int], list[str]] | None:
    """A kernel benchmark's ``--threads`` and ``--formats``, with its counts (each at least 1):
    the sorted thread counts and the formats, or None after one line on stderr."""
    try:
        threads = sorted({int(t) for t in threads_text.split(",")})
    except ValueError:
        print(f"error: --threads {threads_text!r}: write thread counts like 1,2", file=sys.stderr)
        return None
    formats = [f for f in formats_text.split(",") if f]
    if any(f not in KERNEL_FORMATS for f in formats) or not formats or min(threads) < 1 or min(counts.values()) < 1:
        flags = " and ".join(f"--{name}" for name in counts)
        print(f"error: formats must be some of {','.join(KERNEL_FORMATS)}; threads, {flags} at least 1", file=sys.stderr)
        return None
    return threads, formats


def torch_bf16_step(w: ck.ExpertWeights, act: ck.Activation):
    """torch's own path for the same picks: F.linear per picked expert, bf16."""
    I = w.intermediate

    def step(x, ids, tw):
        out = torch.zeros(x.shape[0], w.hidden, dtype=torch.float32)
        for j, e in enumerate(ids[0].tolist()):
            h = F.linear(x, w.w13[e])
            a = F.silu(h[:, :I]) * h[:, I:]
            out += tw[:, j:j + 1] * F.linear(a, w.w2[e]).float()
        return out
    return step


def measure(w, act, K, threads, iters, read_buf, lib, torch_step=None, other_prefetch=False,
            head=None) -> timing.Rounds:
    """The kernel and the read kernel in alternating rounds (``timing.side_by_side``, what the
    probe runs too), with torch's step and, with ``other_prefetch``, the same kernel with the
    other software-prefetch choice for bf16 rows timed in the same rounds; with ``head`` (its
    weight and a token), the rows walk over that head."""
    beside = {}
    if head is not None:
        hw, hx = head
        hout = torch.empty(1, hw.shape[0])
        beside["head"] = lambda x, ids, tw, job, _next: ck.rows(hx, hw, threads=threads, out=hout, library_=lib)
    if torch_step is not None:
        beside["torch"] = lambda x, ids, tw, job, _next: torch_step(x, ids, tw)
    if other_prefetch:
        chosen = lib.so_bf16_prefetch()

        def other(x, ids, tw, job, next_ids):
            ids.copy_(next_ids)  # other experts than the kernel's call read
            lib.so_set_bf16_prefetch(1 - chosen)
            try:
                job.run()
            finally:
                lib.so_set_bf16_prefetch(chosen)
        beside["other"] = other
    return timing.side_by_side(w, act, K, threads, iters, read_buf, lib, beside)


def run(formats, threads_list, iters, smoke, read_bytes, repeats=1, lib=None):
    """Every (format, threads) row measured ``repeats`` times, the repeats taken in turns
    over all rows (a slow spell of a shared machine then falls on several rows' one repeat,
    not on one row's every repeat)."""
    lib = lib or ck.library()
    read_buf = torch.ones(read_bytes // 4)
    rows_, cols = SMOKE_HEAD_ROWS if smoke else HEAD_ROWS
    head = (torch.randn(rows_, cols).bfloat16(), torch.randn(1, cols).bfloat16())
    layers = {}
    for f in formats:
        base, w, act = timing.layer_of(f, small=smoke)
        layers[f] = (base, w, act, torch_bf16_step(w, act) if f == "bf16" else None,
                     # The bf16 walk's software prefetch is chosen per CPU vendor: time the other choice beside it.
                     f == "bf16" and bool(lib.so_bf16_activations()))
    reps = {(f, t): [] for f in formats for t in threads_list}
    for _ in range(repeats):
        for f in formats:
            _, w, act, step, alternate = layers[f]
            for t in threads_list:
                reps[f, t].append(measure(w, act, layers[f][0]["k"], t, iters, read_buf, lib, step,
                                          other_prefetch=alternate, head=head if f == "bf16" else None))
    rows = []
    for f in formats:
        base, w, _, step, alternate = layers[f]
        nbytes = base["k"] * w.expert_bytes
        for t in threads_list:
            ms = reps[f, t]
            med = statistics.median
            ratios = [m.kernel_gbps(nbytes) / m.read_gbps(read_bytes) for m in ms]
            k_s = med(med(m.kernel_s) for m in ms)
            read_gbps = med(m.read_gbps(read_bytes) for m in ms)
            ks = [v for m in ms for v in m.kernel_s]
            rs = [v for m in ms for v in m.read_s]
            row = dict(base, threads=t, status="measured", bytes_per_call=nbytes, kernel_s=k_s,
                       kernel_gbps=nbytes / k_s / 1e9, read_gbps=read_gbps, ratio=med(ratios),
                       ratios=ratios, kernel_s_min=min(ks), kernel_s_max=max(ks), read_gbps_min=read_bytes / max(rs) / 1e9,
                       read_gbps_max=read_bytes / min(rs) / 1e9, calls=len(ks))
            if step is not None:
                t_s = med(med(m.beside_s["torch"]) for m in ms)
                row.update(torch_s=t_s, torch_gbps=nbytes / t_s / 1e9, torch_ratio=nbytes / t_s / 1e9 / read_gbps)
            if alternate:
                o_s = med(med(m.beside_s["other"]) for m in ms)
                row.update(other_prefetch_ratio=nbytes / o_s / 1e9 / read_gbps)
            if f == "bf16":
                h_s, h_bytes = med(med(m.beside_s["head"]) for m in ms), head[0].numel() * 2
                row.update(head_rows=list(head[0].shape), head_s=h_s, head_gbps=h_bytes / h_s / 1e9,
                           head_ratio=h_bytes / h_s / 1e9 / read_gbps)
            rows.append(row)
            print(f"{f} threads={t}: {row['kernel_gbps']:.1f} GB/s of {read_gbps:.1f} read "
                  f"(ratio {row['ratio']:.2f}; repeats {', '.join(f'{r:.2f}' for r in ratios)})", file=sys.stderr, flush=True)
    return rows


def claims(rows) -> dict:
    """format -> claimed: every thread count measured reached the bar in its best repeat
    (other work on a shared machine only slows a repeat down, so the best one is the
    kernel's own rate; the median is reported beside it)."""
    out = {}
    for f in KERNEL_FORMATS:
        ratios = [max(r["ratios"]) for r in rows if r["format"] == f and r["status"] == "measured"]
        out[f] = bool(ratios) and min(ratios) >= ck.CLAIM_BAR
    return out


def markdown(result) -> str:
    head = ["format", "layer", "threads", "MB/call", "kernel GB/s", "read GB/s", "ratio (repeats)", "torch bf16 F.linear ratio",
            "other bf16 prefetch ratio", "LM head rows ratio"]
    body = []
    for r in result["rows"]:
        layer = f"{r['model']} E={r['E']} k={r['k']} H={r['H']} I={r['I']} {r['activation']}"
        if r["status"] != "measured":
            body.append([r["format"], layer, r["threads"], "", "", "", r["status"], "", "", ""])
            continue
        body.append([r["format"], layer, r["threads"], fmt(r["bytes_per_call"] / 1e6, 1),
                     f"{fmt(r['kernel_gbps'], 1)}", f"{fmt(r['read_gbps'], 1)} ({fmt(r['read_gbps_min'], 0)}-"
                     f"{fmt(r['read_gbps_max'], 0)})", f"{fmt(r['ratio'])} ({', '.join(fmt(v) for v in r['ratios'])})",
                     fmt(r.get("torch_ratio")), fmt(r.get("other_prefetch_ratio")),
                     "" if "head_ratio" not in r else f"{fmt(r['head_ratio'])} ({r['head_rows'][0]}x{r['head_rows'][1]})"])
    claimed = ", ".join(f for f, c in result["claims"].items() if c) or "none"
    native = result.get("build", "native") == "native"
    verdict = (f"Claimed (every thread count's best repeat at >= {result['claim_bar']} of the read bandwidth; other work "
               f"only slows a repeat down): {claimed}." if native else
               f"At the claim bar (every thread count's best repeat at >= {result['claim_bar']} of the read bandwidth): "
               f"{claimed}; the {result['build']} build claims nothing (the native build's full result decides).")
    title = "" if native else f", {result['build']} build"
    return (f"# Host-compute CPU kernels at batch 1 ({result['date']}, {result['machine']}{title})\n\n"
            f"Weights read per second by the kernel (the k picked experts' bytes over the call's median time, "
            f"{result['iters']} calls with new random ids each) against the C read kernel's bandwidth with the same "
            f"threads, sampled alternately in the same rounds (median, min-max); each row measured {result['repeats']} "
            f"times, the repeats taken in turns over the rows, its ratio the median of theirs (each listed). "
            f"Kernel build: {result['simd']}. "
            f"{result['load_note']}.\n\n" + md_table(head, body) + f"\n{verdict}\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", default=f"1,{os.cpu_count() or 1}", help="comma-separated thread counts")
    ap.add_argument("--iters", type=int, default=41)
    ap.add_argument("--repeats", type=int, default=3, help="whole measurements per row; the row's ratio is their median")
    ap.add_argument("--formats", default=",".join(KERNEL_FORMATS))
    ap.add_argument("--smoke", action="store_true", help="tiny layers, a few calls (seconds)")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR)
    ap.add_argument("--build", choices=tuple(BUILDS), default="native",
                    help="native: the build this CPU compiles (the one engines use; its full result decides the "
                         "claims); avx2: the same kernel without AVX-512, as a CPU that has only AVX2 builds it "
                         "(its result is written as cpu-kernels-avx2-... and claims nothing)")
    args = ap.parse_args(argv)
    selection = kernel_selection(args.threads, args.formats, iters=args.iters, repeats=args.repeats)
    if selection is None:
        return 2
    threads, formats = selection
    try:
        lib = ck.library() if args.build == "native" else build.load(BUILDS[args.build], quiet=True)
    except ck.KernelUnavailable as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    iters = min(args.iters, 3) if args.smoke else args.iters
    load_before, started = load_1min(), time.perf_counter()
    repeats = 1 if args.smoke else args.repeats
    rows = run(formats, threads, iters, args.smoke, timing.SMALL_READ_BYTES if args.smoke else timing.READ_BYTES, repeats, lib)
    load_after = load_1min()
    simd = {0: "plain C", 256: "AVX2", 512: "AVX-512"}.get(lib.so_simd_level(), "?")
    if lib.so_bf16_activations():
        simd += (" with AVX512-BF16 (tokens and activations in bf16, f32 sums; bf16 rows "
                 + ("prefetched in software" if lib.so_bf16_prefetch() else "not prefetched in software (an AMD CPU)")
                 + ", the other choice timed beside it)")
    if lib.so_int8_mxfp4():
        simd += (", MXFP4 and int4 with " + ("AVX512-VNNI" if lib.so_int8_mxfp4() == 512 else "256-bit pair sums (AVX-VNNI where present)")
                 + " (tokens and activations in int8 per block of 32, int32 sums)")
    result = dict(benchmark="cpu-kernels", build=args.build, date=today(), machine=machine(), smoke=args.smoke,
                  iters=iters, repeats=repeats,
                  threads=threads, simd=simd, claim_bar=ck.CLAIM_BAR, rows=rows, claims=claims(rows),
                  load_before=load_before, load_after=load_after,
                  load_note=shared_note(load_before, load_after).capitalize(), wall_s=time.perf_counter() - started)
    name = "cpu-kernels" if args.build == "native" else f"cpu-kernels-{args.build}"
    stem = result_stem(name, False, result["machine"]) + ("-smoke" if args.smoke else "")
    result["stem"] = stem
    md = markdown(result)
    print(md)
    paths = write_results(args.out, stem, result, md)
    print(f"wrote {paths[0]} and {paths[1]}")
    return 0
