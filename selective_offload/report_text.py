"""The landing report as text: its verdict on the first line, then each group that is
not resident as planned (planned against actual, in the plan's serving words), the host
bytes by serving, what each host-compute layer served, host memory, and every problem.

The record itself (what landed, its JSON, the rank files) is :mod:`.report`, whose
``LandingReport.render`` calls :func:`render_report`; this module reads the record's
fields and imports nothing of it. The engine logs this text, ``selective-offload report``
prints it.
"""

from __future__ import annotations

import os
from typing import Any

from .plan_format import COLD_SERVINGS, Serving
from .sizes import fmt_bytes

#: Servings whose bytes must be built on the host at construction (never on the device
#: first): the cold set and the routed experts read through UVA or computed there.
BUILT_ON_HOST = COLD_SERVINGS | {Serving.UVA, Serving.COMPUTE}
#: The host bytes by serving, as the report's fields name them (``planned_<stem>_bytes``).
HOST_LINES = (("gather and on-demand", "cold_on_host"), ("prefetch", "prefetch"), ("uva", "uva"),
              ("compute", "host_compute"))


def _host_compute_lines(r: Any) -> list[str]:
    """What each host-compute layer served, as of ``transfers_as_of`` and counted from where
    the counters say (``counted_since``: the end of vLLM's start-up in an engine): steps and
    token rows on the host CPU (a replayed CUDA graph's padding included: its jobs count the
    rows it was captured for) and its time per step, steps and tokens on the device path,
    and the expert bytes the CPU read."""
    lines = []
    for group, counters in r.transfers.items():
        served = counters.get("host_compute") if isinstance(counters, dict) else None
        if not isinstance(served, dict):
            continue
        per_step = served.get("host_s_per_step")

        def steps(n: Any) -> str:
            return f"{n} step{'' if n == 1 else 's'}"

        since = served.get("counted_since")
        lines.append(f"compute {group} (as of {r.transfers_as_of}"
                     + (f", counted from {since}" if since else "")
                     + f"): host CPU {steps(served.get('host_steps', 0))}, "
                     f"{served.get('host_tokens', 0)} token rows (padding included)"
                     + (f", {per_step * 1e3:.3f} ms per step" if isinstance(per_step, (int, float)) else "")
                     + f", {fmt_bytes(int(served.get('host_bytes', 0) or 0))} of {counters.get('read', 'experts')} "
                     f"read; device path "
                     f"{steps(served.get('device_steps', 0))}, {served.get('device_tokens', 0)} tokens (above "
                     f"{counters.get('crossover_tokens')} tokens per step)")
        share = counters.get("device_share")
        if isinstance(share, dict):
            lines[-1] += (f"; device share: {share.get('what')} on {share.get('device')} "
                          f"({fmt_bytes(int(share.get('bytes', 0) or 0))})"
                          + (f", {served['device_share_picks']} picks computed there"
                             if "device_share_picks" in served else ", computed there beside the CPU"))
    return lines


def verdict_line(r: Any) -> str:
    """The report's first line: whether the plan was applied and its placement realised."""
    if r.error:
        return f"PLAN NOT APPLIED: {r.error}"
    if r.ok:
        return "placement matches the plan"
    n = len(r.problems)
    return f"placement does NOT match the plan ({n} problem{'s' if n != 1 else ''} below)"


def render_report(r: Any, path: str | os.PathLike | None = None) -> str:
    """``r`` (a :class:`~.report.LandingReport`) as text, its verdict on the first line;
    ``path``: the file it was read from."""
    return "\n".join(_lines(r, path))


def _lines(r: Any, path: str | os.PathLike | None = None) -> list[str]:
    lines = [verdict_line(r),
             f"selective-offload landing report{f' {path}' if path else ''} (compute device {r.compute_device}"
             + ("; host memory is device memory here" if r.host_is_device else "") + ")"]
    if r.error:
        return lines
    head = f"{'group':<32} {'planned':<10} {'actual':<10} {'device':>11} {'host':>11}  how"
    lines += [head, "-" * len(head)]
    resident = [g for g in r.groups if g.planned == g.actual == Serving.RESIDENT]
    for g in r.groups:
        if g not in resident:
            how = g.mechanism + (f"; built on the host: {fmt_bytes(g.routed_bytes)}, moved after loading: "
                                 f"{fmt_bytes(g.moved_bytes)}" if g.planned in BUILT_ON_HOST else "")
            lines.append(f"{g.group:<32} {g.planned:<10} {g.actual:<10} "
                         f"{fmt_bytes(g.device_bytes):>11} "
                         f"{fmt_bytes(g.host_bytes):>11}  {how}")
    lines.append(f"{len(resident)} more groups resident on the device as planned "
                 f"({fmt_bytes(sum(g.device_bytes for g in resident))})")
    for label, stem in HOST_LINES:
        planned, loaded, landed = (getattr(r, f"{what}_{stem}_bytes") for what in ("planned", "loaded", "landed"))
        if planned or landed:
            lines.append(f"{label} on host: planned {fmt_bytes(planned)} of checkpoint bytes, "
                         f"{fmt_bytes(loaded)} as loaded; landed {fmt_bytes(landed)}")
    lines += _host_compute_lines(r)
    if r.host_memory:
        hm = r.host_memory
        ratio = hm.get("page_locked_to_host_ratio")
        lines.append(f"host memory ({hm['policy']}): page-locked {fmt_bytes(hm['page_locked_bytes'])}"
                     + (f", {ratio:.3f}x the host bytes" if ratio is not None else "")
                     + (f"; resident set {fmt_bytes(hm['resident_set_bytes'])}" if hm.get("resident_set_bytes") else ""))
    if r.unplanned:
        lines.append(f"in no plan group: {fmt_bytes(sum(r.unplanned.values()))} in {len(r.unplanned)} parameter(s) "
                     f"({', '.join(sorted(r.unplanned)[:4])}{' ...' if len(r.unplanned) > 4 else ''})")
    lines += [f"note: {note}" for note in r.notes]
    lines += [f"rank {label[4:]}: {'placement matches the plan' if v['ok'] else 'NOT realised'}"
              for label, v in r.ranks.items()]
    lines += [f"PLAN NOT REALISED: {problem}" for problem in r.problems]
    return lines
