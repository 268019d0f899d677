"""What the first GPU run runs: its sections, in order, with their arguments and time limits.

Why a module of its own: the driver (``gpu_run.py``) runs these, and the budget table of docs/benchmarks.md
table (``tables.py``) lists them; both import this data and neither imports the other's
code for it, so there is no import circle between the driver and the tables.
"""

from __future__ import annotations

from dataclasses import dataclass


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
#: measured there. The limits add up to ten minutes (one batch slot on a shared GPU machine), less a
#: minute for the driver's own start and summary (a test checks), so a run always ends
#: with its summary written. host-compute's limit was taken from the others: each limit's
#: headroom above its est (5 s from probe, mechanism, gather and uva-read) and 20 s of the
#: decode emulation's timed steps (``--max-seconds`` 60 -> 40; its est lowered by as much).
#: host-compute's est: 8-28 s of setup (CUDA, the kernel compiled by the machine's cc, 1.9 GB
#: of experts and a dense MLP made and page-locked, the reference on the CPU for the checks)
#: and 15 s of timed loops (``--max-seconds``), each loop making at least 3 calls past it.
#: preflight's limit was taken from the decode emulation's timed steps (``--max-seconds``
#: 40 -> 25; its limit and est lowered by 15 s): its est is a Python start with torch (2-4 s),
#: the CUDA context (0.5-3 s) and eight plans from manifests (1-3 s).
SECTIONS: tuple[Section, ...] = tuple(Section(*row) for row in (
    # name               what runs                             full-size arguments                                   --small arguments                                limits (full, small)  est_s
    ("probe",            "-m selective_offload.cli",           "probe -o {out}/probe-{name}.json",                   "probe --quick -o {out}/probe-{name}-quick.json", 30, 60,   "10-25"),
    ("preflight",        "benchmarks/gpu_preflight.py",        "--out {out}",                                        "--small --out {out}",                          15, 60,   "4-10"),
    ("mechanism",        "benchmarks/gpu_mechanism_check.py",  "--out {out}",                                        "--small --out {out}",                          270, 90,  "100-270"),
    ("decode-emulation", "benchmarks/decode_emulation.py",     "--device-memory 24GiB --max-seconds 25 --out {out}", "--smoke --out {out}",                          105, 90,  "45-95"),
    ("gather",           "benchmarks/bench_gather.py",         "--out {out}",                                        "--smoke --out {out}",                          35, 60,   "15-35"),
    ("uva-read",         "benchmarks/bench_uva_read.py",       "--out {out}",                                        "--smoke --out {out}",                          35, 60,   "15-35"),
    ("host-compute",     "benchmarks/gpu_host_compute.py",     "--max-seconds 15 --out {out}",                       "--small --out {out}",                          50, 60,   "23-43"),
))
