"""The first GPU run in one command: every section that needs a GPU, each under its own
time limit, into one results directory, with a summary of the headline ratios.

Why one prepared command: a GPU is lent to some tasks only, for minutes, on a machine
image with its own Python and torch, no vLLM and no network. Whoever has one must be able
to measure everything in one call, and the figures must reach the README through files
(``benchmarks/tables.py``), never by hand.

The sections are :data:`SECTIONS`, run in order; a section that fails or runs past its
limit is recorded (status, exit code, the end of its output) and the rest still run. Each
is its own process: this interpreter, the working tree on ``PYTHONPATH`` (nothing is
installed), ``import vllm`` blocked (the GPU image has none; a blocked try is printed and
counted, so the summary shows that no section needed vLLM). The device memory cap applies
where placement depends on the card's size: the decode emulation caps itself to a 24 GiB
card (torch's per-process memory fraction, checked to bind); the probe, the mechanism
check and the gather benchmark measure rates and allocation deltas, which a cap does not
change.

Results go to ``--out`` (default ``$OUT`` when set, else ``benchmarks/out/gpu-run-<cuda|cpu>-
<machine>-<date>[-small]/``): each section's JSON and Markdown (a section that writes JSON
but no Markdown gets its console output as Markdown), the summary
``gpu-run-<cuda|cpu>-<machine>-<date>[-small].{json,md}`` and the whole console log
``<same stem>.log``. ``--pack`` (the default when ``$OUT`` is set and ``--out`` is not given)
leaves four files: the summary's JSON and Markdown, the log, and one ``.tar.gz`` of
everything, so the results fit what a device machine sends back (at most 8 files, 16 MiB
each, in a flat folder).

``--import PATH`` (a ``.tar.gz`` from ``--pack``, or a results directory) copies the JSON and
Markdown into ``benchmarks/results/`` and regenerates the README's tables.

Exit status: 0 when every section ran and exited 0, 1 otherwise (the summary is still
written), 2 for bad input or an interpreter without torch.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tarfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import RESULTS_DIR, fmt, md_table, slug, today  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Section:
    name: str
    target: str  # a script path under the tree, or "-m module"
    full: str  # arguments of the full run; {out}: the results directory, {name}: <cuda|cpu>-<machine>-<date>
    small: str  # arguments with --small
    limit_s: int  # time limit of the full run
    small_limit_s: int  # time limit with --small
    est_s: str  # est seconds of the full run on an H200 (not yet measured there)


#: The sections, in order: one line each. est_s is what each should take on an H200, from
#: its own docstring's arithmetic (host memory pinned and filled, the timed loops), not yet
#: measured there. The limits add up to what one command of the device tool may run, less a
#: minute for the driver's own start and summary (a test checks), so a run always ends
#: with its summary written.
SECTIONS: tuple[Section, ...] = tuple(Section(*row) for row in (
    # name               what runs                             full-size arguments                                   --small arguments                                limits (full, small)  est_s
    ("probe",            "-m selective_offload.cli",           "probe -o {out}/probe-{name}.json",                   "probe --quick -o {out}/probe-{name}-quick.json", 35, 60,   "10-25"),
    ("mechanism",        "benchmarks/gpu_mechanism_check.py",  "--out {out}",                                        "--small --out {out}",                          250, 90,  "90-240"),
    ("decode-emulation", "benchmarks/decode_emulation.py",     "--device-memory 24GiB --max-seconds 60 --out {out}", "--smoke --out {out}",                          150, 90,  "80-130"),
    ("gather",           "benchmarks/bench_gather.py",         "--out {out}",                                        "--smoke --out {out}",                          40, 60,   "15-35"),
    ("uva-read",         "benchmarks/bench_uva_read.py",       "--out {out}",                                        "--smoke --out {out}",                          40, 60,   "15-35"),
))

#: Printed to stderr by a section's process each time something tries to import vLLM.
BLOCKED = "gpu_run: blocked import of"

#: What each section's process runs: block vLLM (a meta path finder ahead of every other,
#: so an installed vLLM is not found either), then the script or module as ``__main__``.
CHILD = f"""
import runpy, sys

class NoVllm:
    def find_spec(self, name, path=None, target=None):
        if name == "vllm" or name.startswith("vllm."):
            print("{BLOCKED} " + name, file=sys.stderr, flush=True)
            raise ModuleNotFoundError("No module named " + repr(name) + " (gpu_run: the GPU image has no vLLM)",
                                      name=name)
        return None

# mutation: gpu-run-vllm-not-blocked
sys.meta_path.insert(0, NoVllm())
kind, target, *argv = sys.argv[1:]
sys.argv = [target, *argv]
if kind == "module":
    runpy.run_module(target, run_name="__main__", alter_sys=True)
else:
    runpy.run_path(target, run_name="__main__")
"""

#: What the interpreter and the card are, in a process of its own (this one never touches
#: CUDA, so the sections find the card as the machine gives it).
ENVIRONMENT = """
import importlib.util, json, platform, sys
sys.path.insert(0, "benchmarks")
out = {"python": platform.python_version(), "executable": sys.executable,
       "vllm_installed": importlib.util.find_spec("vllm") is not None}
try:
    import torch
    import _common
    cuda = bool(torch.cuda.is_available())
    out.update(torch=torch.__version__, cuda=cuda, cuda_version=torch.version.cuda,
               machine=_common.machine(), device=_common.device_name(cuda))
    if cuda:
        out.update(device_count=torch.cuda.device_count(),
                   device_memory_total_bytes=torch.cuda.get_device_properties(0).total_memory)
except Exception as exc:
    out["torch_error"] = type(exc).__name__ + ": " + str(exc).splitlines()[0]
print(json.dumps(out))
"""
NVIDIA_SMI = ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,pcie.link.gen.current,"
              "pcie.link.width.current,clocks.sm,clocks.max.sm", "--format=csv"]

#: What the device tool sends back from $OUT (see README "The first GPU run").
RETURN_LIMITS = {"files": 8, "file_bytes": 16 << 20}
SAFE_NAME = re.compile(r"^[A-Za-z0-9._-]+$")


class Log:
    """Everything the driver and its sections print: to the console and to one file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.file = path.open("a", encoding="utf-8")
        self.lock = threading.Lock()

    def __call__(self, text: str = "") -> None:
        with self.lock:
            print(text, flush=True)
            self.file.write(text + "\n")
            self.file.flush()

    def close(self) -> None:
        self.file.close()


# --------------------------------------------------------------------------- running


def environment(python: str) -> dict:
    try:
        proc = subprocess.run([python, "-c", ENVIRONMENT], capture_output=True, text=True, timeout=120, cwd=ROOT,
                              env=child_env())
        env = json.loads(proc.stdout.strip().splitlines()[-1])
    except (subprocess.TimeoutExpired, OSError, ValueError, IndexError) as exc:
        env = {"torch_error": f"could not run {python}: {type(exc).__name__}: {exc}"}
    try:
        smi = subprocess.run(NVIDIA_SMI, capture_output=True, text=True, timeout=20)
        if smi.returncode == 0:
            env["nvidia_smi"] = smi.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    return env


def child_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env["PYTHONUNBUFFERED"] = "1"
    return env


def command(section: Section, python: str, out: Path, name: str, small: bool) -> tuple[list[str], str]:
    """The section's process (the vLLM-blocking launcher) and the command a person would type."""
    args = (section.small if small else section.full).format(out=out, name=name)
    if section.target.startswith("-m "):
        kind, target = "module", section.target[3:].strip()
    else:
        kind, target = "path", str(ROOT / section.target)
    return [python, "-c", CHILD, kind, target, *shlex.split(args)], f"python3 {section.target} {args}"


def snapshot(out: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in out.iterdir() if p.is_file()}


def run_section(section: Section, cmd: list[str], shown: str, limit_s: float, out: Path, log: Log) -> dict:
    """Run one section's process under its limit, its output streamed to the log with the
    section's name in front; a section past its limit is ended (its process group)."""
    before = snapshot(out)
    row: dict = {"name": section.name, "command": shown, "limit_s": limit_s}
    tail: list[str] = []
    blocked: list[str] = []
    log(f"== {section.name}: {shown} (limit {limit_s:g} s)")
    started = time.perf_counter()
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                                cwd=ROOT, env=child_env(), start_new_session=True)
    except OSError as exc:
        row.update(status="could not start", error=str(exc), wall_s=0.0, files=[], vllm_imports_blocked=[])
        log(f"== {section.name}: could not start: {exc}")
        return row

    def pump() -> None:
        for line in proc.stdout:
            line = line.rstrip("\n")
            if line.startswith(BLOCKED):
                # mutation: gpu-run-blocked-not-counted
                blocked.append(line[len(BLOCKED):].strip())
            tail.append(line)
            del tail[:-40]
            log(f"[{section.name}] {line}")

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    timed_out = False
    try:
        # mutation: gpu-run-no-time-limit
        proc.wait(timeout=limit_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        stop(proc)
    reader.join(timeout=10)
    row["wall_s"] = round(time.perf_counter() - started, 2)
    row["exit_code"] = proc.returncode
    row["vllm_imports_blocked"] = blocked
    if timed_out:
        row["status"] = "timed out"
    else:
        row["status"] = "ok" if proc.returncode == 0 else "failed"
    if row["status"] != "ok":
        row["output_tail"] = tail[-20:]
    after = snapshot(out)
    row["files"] = sorted(n for n, m in after.items() if before.get(n) != m and n.endswith((".json", ".md")))
    log(f"== {section.name}: {row['status']}"
        + (f" (exit {proc.returncode})" if row["status"] == "failed" else "")
        + f" in {row['wall_s']:.1f} s; files: {', '.join(row['files']) or 'none'}")
    return row


def stop(proc: subprocess.Popen) -> None:
    """End a section's process group: SIGTERM, then SIGKILL after 5 s."""
    for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def console_markdown(section: Section, row: dict, out: Path, log_path: Path) -> None:
    """A section that wrote JSON and no Markdown (the probe writes its profile) gets its
    console output, from the log, as Markdown beside the JSON."""
    jsons = [n for n in row["files"] if n.endswith(".json")]
    if not jsons or any(n.endswith(".md") for n in row["files"]):
        return
    prefix = f"[{section.name}] "
    lines = [ln[len(prefix):] for ln in log_path.read_text(encoding="utf-8").splitlines() if ln.startswith(prefix)]
    md = out / (Path(jsons[0]).stem + ".md")
    md.write_text(f"# {section.name}: console output\n\n`{row['command']}`"
                  f" ({row['status']}, {row['wall_s']:.1f} s)\n\n```\n" + "\n".join(lines) + "\n```\n")
    row["files"] = sorted(row["files"] + [md.name])


# --------------------------------------------------------------------------- the ratios


@dataclass(frozen=True)
class Family:
    """A headline figure: which section measures it, what it proves, and how to read it
    from the section's JSON (a list of rows, or a string: the reason it was not measured)."""

    key: str
    section: str
    label: str
    proves: str
    read: Callable[[dict], "list[dict] | str"]


def _row(label: str, measured, est=None, note: str = "") -> dict:
    return {"label": label, "measured": measured, "est": est, "note": note}


def _med(s: dict | None) -> float | None:
    return None if not s else s.get("median")


def _ok(d: dict, name: str) -> dict | None:
    return next((c for c in d.get("configs", []) if c.get("config") == name and c.get("status") == "measured"), None)


def selective_over_bulk(d: dict) -> list[dict] | str:
    rows = []
    cap = d.get("cap", {})
    under = [c.get("under_cap") for c in d.get("configs", []) if c.get("capped")]
    note = ("cap " + {True: "binds", False: "DOES NOT bind", None: "not checked (no CUDA)"}[cap.get("binds")]
            + ("" if cap.get("binds") is None else
               "; capped placements under it: " + ("yes" if all(u is not False for u in under) else "NO")))
    if "speedup_selective_over_bulk" in d:
        rows.append(_row("batch 1 (matrix-vector)", d["speedup_selective_over_bulk"], d.get("est_speedup_selective_over_bulk"), note))
    sweep = d.get("batch_sweep") or {}
    points = {(c["config"], p["batch"]): p for c in sweep.get("configs", []) for p in c.get("rows", [])
              if p.get("status") == "measured"}
    for b, ratio in (sweep.get("speedup_selective_over_bulk") or {}).items():
        bulk, sel = points.get(("bulk", int(b))), points.get(("selective", int(b)))
        # mutation: gpu-run-sweep-est-inverted
        est = bulk["est_step_s"] / sel["est_step_s"] if bulk and sel else None
        rows.append(_row(f"batch {b} (matrix product), total tok/s", ratio, est))
    return rows or "bulk and selective were not both measured (see the decode-emulation results)"


def cold_only_over_bulk(d: dict) -> list[dict] | str:
    cold, bulk = _ok(d, "cold_only") or _ok(d, "cold-only"), _ok(d, "bulk")
    if cold and bulk:
        return [_row("batch 1", _med(bulk["step_s"]) / _med(cold["step_s"]), bulk["est_step_s"] / cold["est_step_s"])]
    return ("the decode emulation has no cold-only placement: on the reference 24 GiB card the cold set alone "
            "does not close the deficit (the plan needs hot layers too), so a cold-only plan does not fit")


def selective_mtp(d: dict) -> list[dict] | str:
    v = d.get("verification") or {}
    if v.get("skipped"):
        return f"skipped: {v['skipped']}"
    sel = next((c for c in v.get("configs", []) if c.get("config") == "selective" and c.get("status") == "measured"),
               None)
    if sel is None:
        return "the selective placement of the MTP plan was not measured"
    rows = []
    for p in sel["rows"]:
        if p.get("status") != "measured" or not p["k"]:
            continue
        accept = p.get("break_even_accept_rate_vs_plain_plan", "n/a")
        accept = "never (more than K + 1 tokens)" if accept is None else fmt(accept)
        rows.append(_row(f"K = {p['k']}: step / plain step on the same placement", p.get("break_even_tokens_per_step"),
                         p.get("est_break_even_tokens_per_step"),
                         f"acceptance needed to beat the plan without MTP: {accept}"))
    return rows or "no K >= 1 point was measured"


def est_over_measured(d: dict) -> list[dict] | str:
    # mutation: gpu-run-est-over-measured-inverted
    rows = [_row(c["config"] + ("" if c.get("capped") else " (no cap)"), c["est_step_s"] / _med(c["step_s"]))
            for c in d.get("configs", []) if c.get("status") == "measured"]
    return rows or "no placement was measured"


def uva_over_copy_emulation(d: dict) -> list[dict] | str:
    bw = d.get("bandwidth") or {}
    if not bw.get("uva_read_gbps"):
        return "no CUDA: a UVA view of pinned memory needs a GPU" if not d.get("cuda") else "no UVA read rate recorded"
    return [_row(f"{bw['probe_bytes'] / 2**30:g} GiB, bf16 GEMV through the view / pinned copy",
                 bw["uva_read_gbps"] / bw["link_gbps"], None,
                 f"UVA {bw['uva_read_gbps']:.2f} GB/s, copy {bw['link_gbps']:.2f} GB/s")]


def uva_over_copy_sizes(d: dict) -> list[dict] | str:
    if not d.get("cuda"):
        return d.get("uva") or "no CUDA"
    return [_row(f"{r['bytes'] / 2**30:.2f} GiB", r.get("uva_over_copy"), None,
                 r["error"] if "error" in r else
                 f"UVA GEMV {r['uva_gemv_gbps']:.2f}, copy {r['copy_gbps']:.2f} GB/s"
                 + ("" if r.get("uva_equals_device") else "; the view's result DIFFERS from the device copy's"))
            for r in d.get("rows", [])] or "no sizes measured"


def uva_over_copy_probe(d: dict) -> list[dict] | str:
    if d.get("no_link_reason"):
        return d["no_link_reason"]
    keys = sorted(k for k, v in d.items() if "uva" in k and k.endswith("gbps") and isinstance(v, (int, float)))
    if not keys:
        return "this probe does not measure a UVA read rate (no `*uva*_gbps` field in its profile)"
    return [_row(f"{k} / link_gbps_pinned", d[k] / d["link_gbps_pinned"], None,
                 f"{d[k]:.2f} / {d['link_gbps_pinned']:.2f} GB/s") for k in keys]


def pageable_over_pinned(d: dict) -> list[dict] | str:
    if d.get("no_link_reason"):
        return d["no_link_reason"]
    return [_row("host-to-device copy", d["link_gbps_pageable"] / d["link_gbps_pinned"], None,
                 f"pageable {d['link_gbps_pageable']:.2f}, pinned {d['link_gbps_pinned']:.2f} GB/s, "
                 f"VRAM {d['vram_gbps']:.0f} GB/s")]


def page_locked_over_planned(d: dict) -> list[dict] | str:
    hm = d.get("host_memory") or {}
    if not hm.get("overall"):
        return "no host-memory section in the mechanism results"
    o = hm["overall"]
    if not d.get("cuda"):
        return ("no CUDA: nothing is page-locked without a GPU (est for torch's pinned blocks: "
                f"{fmt(o.get('est_ratio_rounding'), 4)})")
    return [_row("exact registration (the project's host weights)", o.get("ratio_exact"), 1.0),
            _row("torch's pinned blocks (vLLM's own pins)", o.get("ratio_rounding"), o.get("est_ratio_rounding"),
                 "est: every tensor rounded up to a power of two")]


def _gather_ratio(d: dict, key: str) -> list[dict] | str:
    path = next((p for p in d.get("paths", []) if p["key"] == key), None)
    if path is None or path["status"] != "measured":
        return path["status"] if path else f"no {key} path in the gather results"
    rows = [r for r in d.get("rows", []) if r.get(f"{key}_s") and r.get("device_s")]
    picked = [r for r in rows if r["tokens"] in (1, max(x["tokens"] for x in rows))] if rows else []
    return [_row(f"{r['tokens']} token(s) per step", _med(r[f"{key}_s"]) / _med(r["device_s"]), None,
                 f"{_med(r[f'{key}_s']) * 1e6:.1f} us vs {_med(r['device_s']) * 1e6:.1f} us") for r in picked] \
        or "no rows"


def uva_embedding_over_device(d: dict) -> list[dict] | str:
    """The glue's UVA lookup called eagerly and replayed from a CUDA graph (where a failed
    capture or a wrong replay is the row's note)."""
    rows = []
    for key, how in (("uva_embedding", "eager"), ("uva_embedding_graph", "CUDA graph replay")):
        got = _gather_ratio(d, key)
        if isinstance(got, str):
            if key == "uva_embedding":
                return got  # no UVA view at all (no CUDA)
            rows.append(_row(how, None, None, got))
        else:
            rows += [{**r, "label": f"{how}, {r['label']}"} for r in got]
    return rows


FAMILIES: tuple[Family, ...] = (
    Family("selective_over_bulk", "decode-emulation", "selective / bulk, decode tok/s",
           "whether the plan decodes faster than vLLM's bulk `cpu_offload_gb` on the same 24 GiB card, and by how "
           "much as batches share each step's link bytes", selective_over_bulk),
    Family("cold_only_over_bulk", "decode-emulation", "cold-only / bulk, decode tok/s",
           "whether moving only the bytes a step does not read already beats bulk", cold_only_over_bulk),
    Family("selective_mtp", "decode-emulation", "selective+MTP: tokens a verify step must yield to break even",
           "what MTP speculative decoding costs per step on the selective placement (well below K + 1 tokens: "
           "verifying K + 1 tokens costs about one pass on a link-bound step)", selective_mtp),
    Family("est_over_measured", "decode-emulation", "est / measured step time, batch 1, per placement",
           "how far the planner's bytes-over-bandwidth estimate is from the step it prices", est_over_measured),
    Family("uva_over_copy_emulation", "decode-emulation", "UVA read rate / pinned copy rate",
           "what a kernel reading pinned host memory in place (bulk offload, the UVA embedding) gets of the link",
           uva_over_copy_emulation),
    Family("uva_over_copy_sizes", "uva-read", "UVA read rate / copy rate, by buffer size",
           "whether a kernel reading page-locked host memory in place keeps the copy engine's rate up to the size "
           "of a real offload (the largest size: the reference plan's bulk offload)", uva_over_copy_sizes),
    Family("uva_over_copy_probe", "probe", "UVA read rate / pinned copy rate (probe)",
           "the rate `plan` would price in-kernel host reads at, measured where plans are made", uva_over_copy_probe),
    Family("pageable_over_pinned", "probe", "pageable / pinned copy rate",
           "what page-locking host weights is worth: the copy rate pageable memory gets", pageable_over_pinned),
    Family("page_locked_over_planned", "mechanism", "page-locked / planned host bytes",
           "whether host weights lock exactly their bytes (no power-of-two rounding), and how much more torch's "
           "pinned blocks (vLLM's own pins) lock",
           page_locked_over_planned),
    Family("uva_embedding_over_device", "gather", "UVA embedding / device embedding, time per lookup",
           "that the glue's UVA embedding is graph-safe (a captured lookup replayed with new ids reads the right "
           "rows) and what it costs a step against a resident table", uva_embedding_over_device),
    Family("host_gather_over_device", "gather", "host gather / device embedding, time per lookup",
           "what the eager host gather costs a step against a resident table", lambda d: _gather_ratio(d, "host")),
)


def ratios(sections: list[dict], out: Path) -> list[dict]:
    """Each family's rows from its section's JSON, or one row saying why it is not measured."""
    by_name = {s["name"]: s for s in sections}
    result = []
    for fam in FAMILIES:
        entry = {"key": fam.key, "section": fam.section, "label": fam.label, "proves": fam.proves,
                 "rows": [], "source": None, "not_measured": None}
        sec = by_name.get(fam.section)
        jsons = [n for n in (sec or {}).get("files", []) if n.endswith(".json")]
        if sec is None:
            entry["not_measured"] = f"the {fam.section} section was not run"
        elif not jsons:
            entry["not_measured"] = f"the {fam.section} section {sec['status']} before writing results"
        else:
            entry["source"] = jsons[0]
            try:
                got = fam.read(json.loads((out / jsons[0]).read_text()))
            except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError) as exc:
                got = f"could not read {jsons[0]}: {type(exc).__name__}: {exc}"
            if isinstance(got, str):
                entry["not_measured"] = got
            else:
                entry["rows"] = got
        result.append(entry)
    return result


def placements_table(sections: list[dict], out: Path) -> list[list]:
    """est / measured for every decode-emulation point (batch 1, the sweep, verification)."""
    sec = next((s for s in sections if s["name"] == "decode-emulation"), None)
    jsons = [n for n in (sec or {}).get("files", []) if n.endswith(".json")]
    if not jsons:
        return []
    d = json.loads((out / jsons[0]).read_text())
    rows = []
    for c in d.get("configs", []):
        if c.get("status") == "measured":
            rows.append([c["config"], "batch 1 (GEMV)", c["est_step_s"] * 1e3, _med(c["step_s"]) * 1e3])
    for c in (d.get("batch_sweep") or {}).get("configs", []):
        for p in c.get("rows", []):
            if p.get("status") == "measured":
                rows.append([c["config"], f"batch {p['batch']}", p["est_step_s"] * 1e3, _med(p["step_s"]) * 1e3])
    for c in (d.get("verification") or {}).get("configs", []):
        for p in c.get("rows", []):
            if p.get("status") == "measured":
                rows.append([c["config"] + " (MTP plan)", f"K = {p['k']}", p["est_step_s"] * 1e3,
                             _med(p["step_s"]) * 1e3])
    return [[a, b, f"{e:.2f}", f"{m:.2f}", fmt(e / m, 3)] for a, b, e, m in rows]


# --------------------------------------------------------------------------- the summary


def _cell(value) -> str:
    if value is None:
        return ""
    return fmt(value, 3) if isinstance(value, float) else str(value)


def ratio_rows(families: list[dict], source_link: Callable[[str], str] = lambda s: f"`{s}`") -> list[list[str]]:
    """The headline table's rows: figure, measured, est, from."""
    rows = []
    for f in families:
        if f["not_measured"]:
            rows.append([f["label"], f"not measured: {f['not_measured']}", "", ""])
            continue
        for r in f["rows"]:
            label = f"{f['label']}: {r['label']}"
            measured = ("n/a" if r["measured"] is None else _cell(r["measured"])) + (
                f" ({r['note']})" if r.get("note") else "")
            rows.append([label, measured, _cell(r["est"]), source_link(f["source"])])
    return rows


def summary_markdown(s: dict, brief: bool = False) -> str:
    """The summary's Markdown; ``brief``: the sections and the headline ratios only (what
    the console ends with, so the end of a device run's output holds them)."""
    env = s["environment"]
    where = (f"{env.get('device')} ({env.get('machine')})" if env.get("cuda")
             else f"{env.get('machine')}, no CUDA: CPU figures show that the path runs, not what a GPU does")
    sections = md_table(
        ["section", "status", "s (limit)", "vLLM imports blocked", "files"],
        [[r["name"], r["status"] + (f" (exit {r.get('exit_code')})" if r["status"] == "failed" else ""),
          f"{r['wall_s']:.1f} ({r['limit_s']:g})", len(r.get("vllm_imports_blocked", [])),
          ", ".join(f"`{n}`" for n in r["files"]) or "none"] for r in s["sections"]])
    failures = "".join(
        f"\n{r['name']} ({r['status']}), last lines:\n\n```\n" + "\n".join(r.get("output_tail", [])) + "\n```\n"
        for r in s["sections"] if r["status"] != "ok")
    headline = md_table(["figure", "measured", "est", "from"], ratio_rows(s["ratios"]))
    if brief:
        return f"## {s['stem']}: sections\n\n{sections}\n## Headline ratios\n\n{headline}"
    lines = [
        f"# GPU run: {s['stem']}",
        "",
        f"Date {s['date']}, {where}; python {env.get('python')}, torch {env.get('torch')}"
        f" ({'CUDA ' + str(env.get('cuda_version')) if env.get('cuda') else 'no CUDA'}); {'small sizes (--small)' if s['small'] else 'full sizes'}; "
        f"whole run {s['wall_s']:.0f} s; code {s['commit']}. vLLM installed here: "
        f"{'yes' if env.get('vllm_installed') else 'no'} (every section ran with `import vllm` blocked).",
        "",
        "## Sections",
        "",
        sections + failures,
        "## Headline ratios",
        "",
        "Measured beside est (the figure the planner or the script predicted, where there is one); "
        "what each proves is listed below the table.",
        "",
        headline,
        "What each figure proves:",
        "",
        *[f"- **{f['label']}**: {f['proves']}." for f in s["ratios"]],
        "",
    ]
    if s["placements"]:
        lines += ["## est / measured step time, decode emulation", "",
                  md_table(["placement", "point", "est step ms", "measured step ms", "est / measured"],
                           s["placements"])]
    if env.get("nvidia_smi"):
        lines += ["## nvidia-smi", "", "```", env["nvidia_smi"], "```", ""]
    return "\n".join(lines)


def commit() -> str:
    try:
        proc = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                              cwd=ROOT)
        return proc.stdout.strip() or "unknown (no git here)"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown (no git here)"


def pack(out: Path, stem: str, log: Log) -> list[str]:
    """One .tar.gz of every file in ``out``; then only it, the summary and the log stay."""
    keep = {f"{stem}.json", f"{stem}.md", f"{stem}.log"}
    tar_path = out / f"{stem}.tar.gz"
    files = sorted(p for p in out.iterdir() if p.is_file() and p != tar_path)
    with tarfile.open(tar_path, "w:gz") as tar:
        for p in files:
            tar.add(p, arcname=p.name)
    for p in files:
        if p.name not in keep:
            # mutation: gpu-run-pack-keeps-all
            p.unlink()
    left = sorted(p.name for p in out.iterdir())
    log(f"packed {len(files)} files into {tar_path.name}; {out} holds {', '.join(left)}")
    return left


def check_returnable(out: Path) -> list[str]:
    """What the device tool would not send back (too many files, too large, odd names)."""
    files = [p for p in out.rglob("*") if p.is_file()]
    problems = [f"{len(files)} files, more than {RETURN_LIMITS['files']}"] if len(files) > RETURN_LIMITS["files"] else []
    problems += [f"{p.name}: {p.stat().st_size} bytes, over 16 MiB" for p in files
                 if p.stat().st_size > RETURN_LIMITS["file_bytes"]]
    problems += [f"{p.name}: a name with characters other than letters, digits, '.', '_', '-'" for p in files
                 if not SAFE_NAME.match(p.name)]
    return problems


# --------------------------------------------------------------------------- import


def import_results(path: Path, results: Path) -> list[str]:
    """Copy the JSON and Markdown of a packed run (or a results directory) into ``results``."""
    copied = []
    results.mkdir(parents=True, exist_ok=True)
    if path.is_dir():
        tars = sorted(path.glob("gpu-run-*.tar.gz"))
        if tars:
            return import_results(tars[-1], results)
        for p in sorted(path.iterdir()):
            if p.is_file() and p.suffix in (".json", ".md") and SAFE_NAME.match(p.name):
                (results / p.name).write_bytes(p.read_bytes())
                copied.append(p.name)
        return copied
    with tarfile.open(path, "r:*") as tar:
        for m in tar.getmembers():
            name = m.name
            if m.isfile() and "/" not in name and SAFE_NAME.match(name) and name.endswith((".json", ".md")):
                (results / name).write_bytes(tar.extractfile(m).read())
                copied.append(name)
    return copied


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="small sizes: the same path in well under a minute on a CPU")
    ap.add_argument("--out", type=Path, default=None,
                    help="results directory (default: $OUT when set, else benchmarks/out/gpu-run-<...>/)")
    ap.add_argument("--pack", action=argparse.BooleanOptionalAction, default=None,
                    help="leave only the summary, the log and one .tar.gz (default: on when $OUT is used)")
    ap.add_argument("--only", default=None, help="run these sections only, comma-separated: "
                    + ", ".join(s.name for s in SECTIONS))
    ap.add_argument("--import", dest="import_path", type=Path, default=None, metavar="PATH",
                    help="copy a packed run's (or a directory's) JSON and Markdown into benchmarks/results/ and "
                         "regenerate the README's tables; runs nothing")
    ap.add_argument("--results", type=Path, default=RESULTS_DIR, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.import_path is not None:
        if not args.import_path.exists():
            print(f"error: {args.import_path} does not exist", file=sys.stderr)
            return 2
        copied = import_results(args.import_path, args.results)
        print(f"copied {len(copied)} files into {args.results}: {', '.join(copied)}")
        import tables

        return tables.main(["--results", str(args.results)])

    chosen = list(SECTIONS)
    if args.only:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in names if n not in {s.name for s in SECTIONS}]
        if unknown or not names:
            print(f"error: --only {args.only!r}: unknown {', '.join(unknown) or 'empty list'}; the sections are "
                  + ", ".join(s.name for s in SECTIONS), file=sys.stderr)
            return 2
        chosen = [s for s in SECTIONS if s.name in names]

    python = sys.executable
    started = time.perf_counter()
    env = environment(python)
    if "torch_error" in env:
        print(f"error: {python} cannot import torch ({env['torch_error']}); run with PYTHON set to an interpreter "
              "that has torch", file=sys.stderr)
        return 2
    name = f"{'cuda' if env['cuda'] else 'cpu'}-{slug(env['device'])}-{today()}"
    only = [s.name for s in chosen] if args.only else None
    # A rerun of some sections is its own summary, never overwriting the full run's; the
    # README's table takes those sections from it (benchmarks/tables.py).
    stem = f"gpu-run-{name}" + ("-small" if args.small else "") + (f"-only-{'-'.join(only)}" if only else "")
    use_env_out = args.out is None and bool(os.environ.get("OUT"))
    out = (args.out or (Path(os.environ["OUT"]) if use_env_out else ROOT / "benchmarks" / "out" / stem)).resolve()
    do_pack = use_env_out if args.pack is None else args.pack
    out.mkdir(parents=True, exist_ok=True)
    log = Log(out / f"{stem}.log")
    log(f"gpu_run: {stem} -> {out}; {env.get('device')}, python {env.get('python')}, torch {env.get('torch')}, "
        f"CUDA {env.get('cuda_version') if env.get('cuda') else 'none'}; sections "
        + ", ".join(f"{s.name} ({s.small_limit_s if args.small else s.limit_s} s)" for s in chosen))

    rows = []
    for section in chosen:
        limit = section.small_limit_s if args.small else section.limit_s
        row = run_section(section, *command(section, python, out, name, args.small), limit, out, log)
        console_markdown(section, row, out, log.path)
        # mutation: gpu-run-stops-at-failure
        rows.append(row)

    summary = {
        "benchmark": "gpu-run", "stem": stem, "date": today(), "small": args.small, "only": only, "cuda": env["cuda"],
        "device": env["device"], "commit": commit(), "environment": env, "sections": rows,
        "ratios": ratios(rows, out), "placements": placements_table(rows, out),
        "wall_s": round(time.perf_counter() - started, 1),
    }
    (out / f"{stem}.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    (out / f"{stem}.md").write_text(summary_markdown(summary))
    log()
    log(summary_markdown(summary, brief=True))
    if do_pack:
        pack(out, stem, log)
        problems = check_returnable(out)
        if problems:
            log("WARNING: the device tool would not send all of this back: " + "; ".join(problems))
    ok = all(r["status"] == "ok" for r in rows)
    log(f"gpu_run: {'every section ok' if ok else 'NOT every section ok'} in {summary['wall_s']:.0f} s; "
        f"summary {out / stem}.md")
    log.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
