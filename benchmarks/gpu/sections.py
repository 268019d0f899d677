"""What the GPU run runs: its sections, in order, with their arguments and time limits.

Why a module of its own: the driver (``benchmarks.gpu``) runs these, and the sections table
of docs/benchmarks.md (``benchmarks.tables``) lists them; both import this data and neither
imports the other's code for it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Section:
    name: str
    target: str  # "-m module": what runs, from the checkout's root
    full: str  # arguments of the full run; {out}: the results directory, {name}: <cuda|cpu>-<machine>
    small: str  # arguments with --small
    limit_s: int  # time limit of the full run: a section past it is ended and recorded, the rest still run
    small_limit_s: int  # time limit with --small
    est_s: str  # est seconds of the full run on an H100/H200-class machine (not yet measured there)


#: The sections, in order: one line each. est_s is each section's own arithmetic (host
#: memory pinned and filled, the timed loops), not yet measured on a GPU; each limit leaves
#: headroom above it, so one stuck section cannot hold up the others.
SECTIONS: tuple[Section, ...] = tuple(Section(*row) for row in (
    # name           what runs                       full-size arguments                   --small arguments                                limits (full, small)  est_s
    ("probe",        "-m selective_offload.cli",     "probe -o {out}/probe-{name}.json",   "probe --quick -o {out}/probe-{name}-quick.json", 30, 60,   "10-25"),
    ("preflight",    "-m benchmarks.preflight",      "--out {out}",                        "--small --out {out}",                          15, 60,   "4-10"),
    ("mechanism",    "-m benchmarks.mechanism",      "--out {out}",                        "--small --out {out}",                          270, 90,  "100-270"),
    ("gather",       "-m benchmarks.gather",         "--out {out}",                        "--smoke --out {out}",                          35, 60,   "15-35"),
    ("uva-read",     "-m benchmarks.uva_read",       "--out {out}",                        "--smoke --out {out}",                          35, 60,   "15-35"),
    ("host-compute", "-m benchmarks.host_compute",   "--max-seconds 15 --out {out}",       "--small --out {out}",                          50, 60,   "23-43"),
    ("routing",      "-m benchmarks.routing",        "--out {out}",                        "--small --out {out}",                          20, 30,   "3-10"),
))
