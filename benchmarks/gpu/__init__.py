"""The first GPU run in one command: every section that needs a GPU, each under its own
time limit, into one results directory, with a summary of the headline ratios.

Why one command: a GPU machine may have its own Python and torch, no vLLM and no network;
everything that needs the card is measured in one call, and the figures reach
docs/benchmarks.md through files (``python -m benchmarks.tables``), never by hand.

The sections are ``benchmarks.gpu.sections.SECTIONS``, run in order; a section that fails or runs past its
limit is recorded (status, exit code, the end of its output) and the rest still run. Each
is its own process: this interpreter, the working tree on ``PYTHONPATH`` (nothing is
installed), ``import vllm`` blocked (the GPU image has none; a blocked try is printed and
counted, so the summary shows that no section needed vLLM). No section caps the card's
memory: the probe, the mechanism check and the gather, UVA-read and host-compute
benchmarks measure rates and allocation deltas, which a cap does not change, and the
pre-flight reads the card's own free memory and plans for it. What a plan does on a capped
card is ``python -m benchmarks.e2e``'s to measure, through vLLM.

Results go to ``--out`` (default ``$OUT`` when set, else ``benchmarks/out/gpu-run-<cuda|cpu>-
<machine>-<date>[-small]/``): each section's JSON and Markdown (a section that writes JSON
but no Markdown gets its console output as Markdown), the summary
``gpu-run-<cuda|cpu>-<machine>[-small].{json,md}`` and the whole console log
``<same stem>.log``. ``--pack`` (the default when ``$OUT`` is set and ``--out`` is not given)
leaves four files: the summary's JSON and Markdown, the log, and one ``.tar.gz`` of
everything: a few files in one flat folder, easy to copy off the GPU machine.

``--import PATH`` (a ``.tar.gz`` from ``--pack``, or a results directory) copies the JSON and
Markdown into ``benchmarks/results/`` and regenerates the tables of docs/benchmarks.md.

Exit status: 0 when every section ran and exited 0, 1 otherwise (the summary is still
written), 2 for bad input or an interpreter without torch.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from benchmarks import tables  # noqa: E402  (--import regenerates the tables of docs/benchmarks.md; tables imports nothing of this driver)
from benchmarks.common import RESULTS_DIR, md_table, slug, today  # noqa: E402
from benchmarks.gpu.figures import ratio_rows, ratios  # noqa: E402
from benchmarks.gpu.pack import import_results  # noqa: E402
from benchmarks.gpu.pack import pack as pack_run
from benchmarks.gpu.sections import SECTIONS, Section  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


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
out = {"python": platform.python_version(), "executable": sys.executable,
       "vllm_installed": importlib.util.find_spec("vllm") is not None}
try:
    import torch
    from benchmarks import common as _common
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
                blocked.append(line[len(BLOCKED):].strip())
            tail.append(line)
            del tail[:-40]
            log(f"[{section.name}] {line}")

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    timed_out = False
    try:
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


# --------------------------------------------------------------------------- the summary


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
        f" ({'CUDA ' + str(env.get('cuda_version')) if env.get('cuda') else 'no CUDA'}); "
        f"{'small sizes (--small)' if s['small'] else 'full sizes'}; "
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
                         "regenerate the tables of docs/benchmarks.md; runs nothing")
    ap.add_argument("--results", type=Path, default=RESULTS_DIR, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.import_path is not None:
        if not args.import_path.exists():
            print(f"error: {args.import_path} does not exist", file=sys.stderr)
            return 2
        copied = import_results(args.import_path, args.results)
        print(f"copied {len(copied)} files into {args.results}: {', '.join(copied)}")
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
    name = f"{'cuda' if env['cuda'] else 'cpu'}-{slug(env['device'])}"
    only = [s.name for s in chosen] if args.only else None
    # A rerun of some sections is its own summary, never overwriting the full run's; the
    # page's table takes those sections from it (benchmarks/tables.py).
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
        rows.append(row)

    summary = {
        "benchmark": "gpu-run", "stem": stem, "date": today(), "small": args.small, "only": only, "cuda": env["cuda"],
        "device": env["device"], "commit": commit(), "environment": env, "sections": rows,
        "ratios": ratios(rows, out),
        "wall_s": round(time.perf_counter() - started, 1),
    }
    (out / f"{stem}.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    (out / f"{stem}.md").write_text(summary_markdown(summary))
    log()
    log(summary_markdown(summary, brief=True))
    if do_pack:
        pack_run(out, stem, log)
    ok = all(r["status"] == "ok" for r in rows)
    log(f"gpu_run: {'every section ok' if ok else 'NOT every section ok'} in {summary['wall_s']:.0f} s; "
        f"summary {out / stem}.md")
    log.close()
    return 0 if ok else 1
