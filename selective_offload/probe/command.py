"""The ``selective-offload probe`` command: its options, and a run that measures, writes and prints.

The entry point only: :mod:`.measurements` does the measuring, :mod:`.profile` the file and
the lines printed. The CLI (``selective_offload.cli``) adds these options to its ``probe``
subcommand and calls :func:`run_probe`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from ..outputs import check_output_file
from ..progress import progress
from .measurements import measure
from .profile import PROFILE_ENV, default_profile_path

#: A probe that outlasts this many seconds says what it measures, and every ten seconds how
#: long it has run (a full probe takes about a minute; ``--quick`` stays silent).
PROGRESS_AFTER_S = 3.0


def add_probe_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``probe`` subcommand's options; ``run_probe`` takes the parsed namespace."""
    parser.add_argument("-o", "--output", metavar="PATH", default=None,
                        help=f"where to write the profile (default: ${PROFILE_ENV} when set, else "
                             "~/.cache/selective-offload/profile.json)")
    parser.add_argument("--quick", action="store_true",
                        help="small copies (4-64 MiB): well under a second, for tests and CI; the rates are understated")
    parser.add_argument("--device", default=None, metavar="DEVICE",
                        help="cuda, cuda:N or cpu (default: the current CUDA device when there is one, else the CPU)")


def run_probe(args: argparse.Namespace) -> int:
    """Measure, print what was measured and where the profile went, write it; 0 on success.
    Failures are one-line :class:`UserError` s (the CLI prints them and exits 2)."""
    given = getattr(args, "output", None)
    output = Path(given).expanduser() if given else default_profile_path()
    flag = "--output" if given else (PROFILE_ENV if os.environ.get(PROFILE_ENV, "").strip() else "")
    try:  # the folder is made, as Profile.save makes it, so the trial below can be written
        output.parent.mkdir(parents=True, exist_ok=True)
    except OSError:
        pass  # refused in one line by the trial, which names the path
    # Tried for real before measuring (a full probe takes a minute), as plan's outputs are;
    # a file there that is not a profile this project wrote (what SELECTIVE_OFFLOAD_PROFILE
    # may name) is refused, not replaced.
    check_output_file(output, f"{flag}=" if flag == PROFILE_ENV else flag, "profile")
    started = time.perf_counter()
    with progress("selective-offload probe: measuring this machine", after_s=PROGRESS_AFTER_S, stream=sys.stderr,
                  note="copies, device reads, and the host CPU kernels on each format's layer"):
        profile = measure(device=getattr(args, "device", None), quick=bool(getattr(args, "quick", False)))
    took = time.perf_counter() - started
    path = profile.save(output, f"{flag}=" if flag == PROFILE_ENV else flag)
    print(profile.render())
    print(f"\nmeasured in {took:.2f} s; profile written to {path}")
    return 0
