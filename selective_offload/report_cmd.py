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
    r.add_argument("--routing", metavar="FILE", default=None,
                   help="print how concentrated each MoE layer's routing was (the share of its picks the busiest N "
                        "experts took, N: the plan's device share) and save the counts as a routing profile for "
                        "`plan --routing FILE` (the engine counts with SELECTIVE_OFFLOAD_ROUTING=1)")
    r.add_argument("--workload", metavar="TEXT", default="",
                   help="with --routing: what was served while counting (the prompts), recorded in the profile")
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
    if args.routing is not None:
        save_routing(report, path, args.routing, args.workload)
    elif args.json:
        json.dump({**report.to_dict(), "path": str(path)}, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        print(report.render(path))
    return 0 if report.ok else EXIT_MISMATCH


def save_routing(report: LandingReport, path: Path, target: str, workload: str) -> None:
    """Print the report's routing counts, layer by layer, and save them as a routing profile."""
    from dataclasses import replace

    from .routing import from_report

    if not report.routing:
        raise UserError(f"{str(path)[:200]}: this report holds no routing counts: serve the model with "
                        "SELECTIVE_OFFLOAD_ROUTING=1 (or enable(..., routing=True)) and read its report after "
                        "the workload")
    if "\n" in workload or "\r" in workload or len(workload) > 500:
        raise UserError("--workload: one line of at most 500 characters saying what was served (the prompts)")
    profile = replace(from_report(report.routing, f"{str(path)[:200]}: routing"), workload=workload.strip())
    if not profile.tokens:
        raise UserError(f"{str(path)[:200]}: no token was routed after warm-up as of this report ({report.transfers_as_of}); "
                        "serve the workload first, then read the report (from the process that ran the engine)")
    shares = report.routing.get("device_experts", {})
    device = {int(k): v for k, v in shares.items() if str(k).isdigit() and isinstance(v, int)} \
        if isinstance(shares, dict) else {}
    print(f"routing: {profile.source_text()}")
    for line in profile.summary(device):
        print(f"  {line}")
    profile.save(target)
    print(f"routing profile saved to {target} (plan --routing {target})")
