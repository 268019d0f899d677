"""``selective-offload report [PATH]``: read a server's landing report with one command.

After ``vllm serve`` with ``SELECTIVE_OFFLOAD_PLAN``, every worker rank wrote its report
(``report.json``, ``report.json.rank1``, ...); this command merges them as
:meth:`LandingReport.load` does and prints the same table the engine logs. The exit
status is the verdict, so a script (or a health check) can act on it without parsing.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .errors import UserError
from .options import ENV_REPORT, default_report_path, last_report_record
from .report import LandingReport

#: Exit status when the placement does not match the plan (or the plan was not applied).
EXIT_MISMATCH = 1


def add_report_command(sub) -> None:
    """The ``report`` subcommand on the CLI's subparsers."""
    r = sub.add_parser(
        "report", help="show a saved landing report (exit 0: matches the plan, 1: does not)",
        description="Print the landing report a vLLM engine wrote under a plan, every worker rank's file "
                    "(report.json.rankN) merged in. Exit status: 0 when the placement matches the plan, "
                    f"{EXIT_MISMATCH} when it does not (or the plan was not applied), 2 for bad input.")
    r.add_argument("path", nargs="?", metavar="PATH", default=None,
                   help=f"the report file (default: ${ENV_REPORT} when set, else the path the last engine "
                        f"set up with a plan recorded in {last_report_record()})")
    r.add_argument("--json", action="store_true", help="print the merged report as JSON (with \"ok\" and \"path\")")
    r.set_defaults(func=cmd_report)


def cmd_report(args: argparse.Namespace) -> int:
    path = Path(args.path) if args.path else default_report_path()
    try:
        exists = path.exists()
    except OSError as exc:  # a name too long, a loop of links
        raise UserError(f"{str(path)[:200]}: cannot be read ({exc.strerror or exc}); name the report file") from None
    if not args.path and not exists:
        raise UserError(f"{path}: no landing report there yet (the last path recorded): the engine set up "
                        "with the plan has not loaded a model, or wrote elsewhere; name the report file")
    report = LandingReport.load(path)
    if args.json:
        json.dump({**report.to_dict(), "path": str(path)}, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        print(report.render(path))
    return 0 if report.ok else EXIT_MISMATCH
