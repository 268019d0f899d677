"""The step model against published measurements of offloaded decoding.

``benchmarks/planning/published.json`` lists measurements others published (or the project's user
measured), each with its source and setup. For every point the model can express it holds
the ``selective-offload plan`` arguments that model it and which estimate the measurement
is compared with (vLLM's ``cpu_offload_gb`` row, or the selective plan); this script
runs exactly that plan, prints est/measured, and writes ``benchmarks/results/published.{json,md}``.
Points it cannot express (the CPU computing offloaded weights, throughput that includes
prefill, another mechanism, a setup the source leaves out) are listed with what is missing,
never forced into a number.

The verdict per point uses the issue's tolerances: within 10% for the mechanisms this
project and vLLM use (UVA reads in kernels, the prefetch offloader's copies) on dense
models, within 25% for resident MoE and compute-bound formats. A point that calibrates a
default (its ``role``) is marked so: agreeing with it shows the arithmetic, not the model.

    python -m benchmarks.planning published            # print and write the results
    python -m benchmarks.planning published --check    # exit 1 when the results file is stale
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

POINTS = Path(__file__).resolve().parent / "published.json"
RESULTS = ROOT / "benchmarks" / "results"
STEM = "published"
FORMAT = "selective-offload/published-v1"
ROLES = ("calibrates", "validates", "not expressed")
COMPARES = ("cpu_offload", "selective")
#: est/measured must lie within 1 +- this, by kind of point (the issue's "done when").
TOLERANCE = {"dense": 0.10, "moe": 0.25, "compute-bound format": 0.25}


class PublishedError(Exception):
    """published.json says something this script cannot use (one line)."""


def load_points(path: Path = POINTS) -> list[dict]:
    """The decode-rate points of ``path``, checked (one-line :class:`PublishedError`)."""
    return _load(path)["points"]


def load_calibrations(path: Path = POINTS) -> list[dict]:
    """Which point each default factor of the step model is calibrated on, and which validate it."""
    return _load(path).get("calibrations", [])


def load_acceptance(path: Path = POINTS) -> list[dict]:
    """The accepted-length series of ``path``, checked."""
    return _load(path).get("acceptance_lengths", [])


def _load(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise PublishedError(f"{path}: cannot read ({exc})") from None
    if data.get("format") != FORMAT:
        raise PublishedError(f"{path}: format is {data.get('format')!r}, not {FORMAT!r}")
    points, seen = data.get("points"), set()
    if not isinstance(points, list) or not points:
        raise PublishedError(f"{path}: 'points' must be a non-empty list")
    for p in points:
        where = f"{path}: point {p.get('id')!r}"
        for key in ("id", "what", "source", "setup", "role", "format_class", "mechanism", "verified"):
            if not isinstance(p.get(key), str) or not p[key].strip():
                raise PublishedError(f"{where}: '{key}' must be a non-empty string")
        if p["id"] in seen:
            raise PublishedError(f"{where}: the id is used twice")
        seen.add(p["id"])
        if ("measured_tok_s" in p) == ("measured_ms_per_token" in p):
            raise PublishedError(f"{where}: give exactly one of measured_tok_s, measured_ms_per_token")
        if p["role"] not in ROLES:
            raise PublishedError(f"{where}: role {p['role']!r} is not one of {', '.join(ROLES)}")
        if p["role"] == "not expressed":
            if not p.get("missing"):
                raise PublishedError(f"{where}: a point the model does not express says what is 'missing'")
        else:
            if not isinstance(p.get("plan_args"), list) or p.get("compare") not in COMPARES:
                raise PublishedError(f"{where}: an expressed point needs 'plan_args' (a list) and "
                                     f"'compare' ({' or '.join(COMPARES)})")
            if "measured_tok_s" not in p:
                raise PublishedError(f"{where}: an expressed point is measured in tok/s")
            high = p.get("measured_tok_s_high", p["measured_tok_s"])
            if not (isinstance(high, (int, float)) and high >= p["measured_tok_s"]):
                raise PublishedError(f"{where}: measured_tok_s_high must be at least measured_tok_s")
            if p["format_class"] not in TOLERANCE:
                raise PublishedError(f"{where}: format_class {p['format_class']!r} has no tolerance "
                                     f"({', '.join(TOLERANCE)})")
    for c in data.get("calibrations", []):
        where = f"{path}: calibration {c.get('id')!r}"
        roles = {p["id"]: p["role"] for p in points}
        if roles.get(c.get("calibrate_on")) != "calibrates" or any(roles.get(v) != "validates" for v in c.get("validate", [])):
            raise PublishedError(f"{where}: calibrate_on must name a point whose role is 'calibrates', and validate "
                                 "points whose role is 'validates'")
        if c.get("scales") not in ("est_link_s_per_step", "est_vram_s_per_step") or not isinstance(c.get("constant"), str):
            raise PublishedError(f"{where}: needs 'constant' (a name in estimate/traffic.py) and 'scales' "
                                 "(est_link_s_per_step or est_vram_s_per_step)")
    for s in data.get("acceptance_lengths", []):
        where = f"{path}: acceptance series {s.get('id')!r}"
        ks, lengths = s.get("draft_tokens"), s.get("measured_accepted_length")
        if not (isinstance(ks, list) and isinstance(lengths, list) and len(ks) == len(lengths) >= 2
                and s.get("calibrate_on") in ks and all(1 <= x <= k + 1 for k, x in zip(ks, lengths))):
            raise PublishedError(f"{where}: needs draft_tokens and measured_accepted_length of one length (2 or "
                                 "more, each length between 1 and K + 1) and calibrate_on among the K")
    return data


def estimate(point: dict) -> dict:
    """Run the plan the point's arguments describe; the estimate it is compared with."""
    from selective_offload.checkpoint import load_checkpoint
    from selective_offload.cli import build_parser
    from selective_offload.plan_options import PlanOptions, resolve_model
    from selective_offload.planner import make_plan

    args = build_parser().parse_args(["plan", *point["plan_args"]])
    checkpoint = load_checkpoint(resolve_model(args.model))
    inputs = PlanOptions.from_args(args).inputs(profile=None)

    def chosen(plan):
        if point["compare"] == "cpu_offload":
            if plan.vllm_cpu_offload_gb is None:
                raise PublishedError(f"point {point['id']!r}: the plan has no cpu_offload_gb row to compare with")
            return plan.vllm_cpu_offload_gb.est
        return plan.est

    plan = make_plan(checkpoint, inputs)
    est = chosen(plan)
    # the same plan with every byte at the copy rate (the model before per-mechanism rates)
    copy_rate = chosen(make_plan(checkpoint, replace(inputs, uva_gbps=inputs.link_gbps))).est_tok_s
    return {"est_tok_s": est.est_tok_s, "est_tok_s_at_copy_rate": copy_rate, "est_step_s": est.est_step_s,
            "est_link_s_per_step": est.est_link_s_per_step,
            "est_vram_s_per_step": est.est_vram_s_per_step,
            "est_compute_s_per_step": est.est_compute_s_per_step, "uva_read_gbps": plan.inputs.uva_read_gbps,
            "link_gbps": plan.inputs.link_gbps, "vram_gbps": plan.inputs.vram_gbps,
            "vram_read_gbps": plan.inputs.vram_read_gbps,
            "compute_tflops": plan.inputs.compute_tflops}


def calibration_rows(calibrations: list[dict], expressed: list[dict]) -> list[dict]:
    """Each default factor beside the point it is the arithmetic of and the points that
    validate it: the factor at which the calibration point's measured tok/s comes out (for
    each end of a measured range) is the default x the part of the step it scales / what the
    measured step leaves for that part; the validating points' est/measured are their rows'."""
    from selective_offload.estimate import traffic as est_module

    by_id = {r["id"]: r for r in expressed}
    rows = []
    for c in calibrations:
        cal = by_id[c["calibrate_on"]]
        default = getattr(est_module, c["constant"], None)
        if not isinstance(default, float):
            raise PublishedError(f"calibration {c['id']!r}: estimate/traffic.py has no factor {c['constant']!r}")
        part = cal[c["scales"]]
        implied = [default * part / (1 / m - (cal["est_step_s"] - part))
                   for m in (cal["measured_tok_s"], cal["measured_tok_s_high"])]
        rows.append({"id": c["id"], "what": c["what"], "constant": c["constant"], "default": default,
                     "calibrate_on": cal["id"], "implied": implied,
                     "validates": [{"id": v, "est_over_measured": [by_id[v]["est_over_measured_low"],
                                                                   by_id[v]["est_over_measured"]],
                                    "within": by_id[v]["within"]} for v in c["validate"]],
                     "no_validation": c.get("no_validation")})
    return rows


def acceptance_rows(series: list[dict]) -> list[dict]:
    """E(K, a) against measured accepted lengths: ``a`` from the calibration K (at K=1 the
    length is 1 + a), every other K validates the constant-rate model."""
    from selective_offload.acceptance import expected_tokens_per_step

    rows = []
    for s in series:
        measured = dict(zip(s["draft_tokens"], s["measured_accepted_length"]))
        k0 = s["calibrate_on"]
        lo, hi = 0.0, 1.0  # a such that E(k0, a) is the measured length
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if expected_tokens_per_step(k0, mid) < measured[k0] else (lo, mid)
        a = (lo + hi) / 2
        for k, length in measured.items():
            est = expected_tokens_per_step(k, a)
            rows.append({"id": s["id"], "what": s["what"], "source": s["source"], "url": s.get("url"),
                         "setup": s["setup"], "draft_tokens": k, "accept_rate": a, "measured_accepted_length": length,
                         "est_tokens_per_step": est, "est_over_measured": est / length,
                         "role": "calibrates" if k == k0 else "validates", "tolerance": TOLERANCE["dense"],
                         "within": abs(est / length - 1) <= TOLERANCE["dense"]})
    return rows


def run(points: list[dict], acceptance: list[dict] = (), calibrations: list[dict] = ()) -> dict:
    rows, missing = [], []
    for p in points:
        measured = p.get("measured_tok_s")
        base = {"id": p["id"], "what": p["what"], "source": p["source"], "url": p.get("url"),
                "verified": p["verified"], "setup": p["setup"], "mechanism": p["mechanism"],
                "format_class": p["format_class"], "role": p["role"]}
        if p["role"] == "not expressed":
            missing.append({**base, "measured_tok_s": measured,
                            "measured_ms_per_token": p.get("measured_ms_per_token"), "missing": p["missing"]})
            continue
        est = estimate(p)
        high = p.get("measured_tok_s_high", measured)
        # a range measured: est/measured against both ends, within only if both are
        ratio, ratio_low = est["est_tok_s"] / measured, est["est_tok_s"] / high
        tol = TOLERANCE[p["format_class"]]
        rows.append({**base, "plan_args": p["plan_args"], "compare": p["compare"], "measured_tok_s": measured,
                     "measured_tok_s_high": high, **est, "est_over_measured": ratio,
                     "est_over_measured_low": ratio_low, "tolerance": tol,
                     "within": abs(ratio - 1) <= tol and abs(ratio_low - 1) <= tol,
                     "calibrates": p.get("calibrates"), "known_outside": p.get("known_outside")})
    return {"format": "selective-offload/published-results-v1", "points_file": "benchmarks/planning/published.json",
            "expressed": rows, "not_expressed": missing, "acceptance": acceptance_rows(list(acceptance)),
            "calibrations": calibration_rows(list(calibrations), rows)}


def _short(url: str) -> str:
    """``owner/repo#N`` for a GitHub issue or pull request, else the address without its scheme."""
    parts = url.split("://", 1)[-1].rstrip("/").split("/")
    if parts[0] == "github.com" and len(parts) >= 5 and parts[3] in ("issues", "pull") and parts[4].isdigit():
        return f"{parts[1]}/{parts[2]}#{parts[4]}"
    return "/".join(parts)


def _cli(args: list[str]) -> str:
    return "`selective-offload plan " + " ".join(args) + "`"


def markdown(result: dict) -> str:
    """The table docs/design/step-model.md shows (regenerated, and checked by tests/unit/planner/test_estimates_match.py)."""
    lines = ["| point | mechanism | measured tok/s | est tok/s | est/measured | tolerance | role | est tok/s, UVA reads "
             "at the copy rate |", "|---|---|---|---|---|---|---|---|"]
    for r in result["expressed"]:
        verdict = "within" if r["within"] else "outside"
        measured, ratio = f"{r['measured_tok_s']:.2f}", f"{r['est_over_measured']:.3f}"
        if r["measured_tok_s_high"] != r["measured_tok_s"]:
            measured = f"{r['measured_tok_s']:.2f}-{r['measured_tok_s_high']:.2f}"
            ratio = f"{r['est_over_measured_low']:.3f}-{r['est_over_measured']:.3f}"
        lines.append(f"| {r['id']} | {r['mechanism']} ({r['format_class']}) | {measured} | "
                     f"{r['est_tok_s']:.2f} | {ratio} | +-{r['tolerance']:.0%} ({verdict}) | "
                     f"{r['role']} | {r['est_tok_s_at_copy_rate']:.2f} |")
    out = ["# The step model against published measurements (est/measured)", "",
           "Generated by `benchmarks/planning/published.py` from `benchmarks/planning/published.json`; every estimate is the "
           "plan the listed arguments make (`est_`).", "", *lines, ""]
    for r in result["expressed"]:
        out.append(f"- **{r['id']}**: {r['what']}. Source: {r['source']}"
                   + (f" ({r['url']})" if r["url"] else "") + f". Modelled by {_cli(r['plan_args'])}, "
                   f"compared with its {r['compare']} row."
                   + (f" Calibration: {r['calibrates']}." if r.get("calibrates") else "")
                   + (f" Known outside the tolerance: {r['known_outside']}." if r.get("known_outside") else ""))
    if result.get("calibrations"):
        out += ["", "Each default factor of the step model (`selective_offload/estimate/traffic.py`), the one point it is "
                "calibrated on (the factor at which that point's measurement comes out, each end of its range) and "
                "the points that validate it:", "",
                "| factor | default | calibrated on | factor the point gives | validated on (est/measured) |",
                "|---|---|---|---|---|"]
        for r in result["calibrations"]:
            checks = "; ".join(f"{v['id']} {v['est_over_measured'][0]:.3f}"
                               + (f"-{v['est_over_measured'][1]:.3f}" if v["est_over_measured"][1] != v["est_over_measured"][0]
                                  else "") + ("" if v["within"] else " (outside)") for v in r["validates"])
            out.append(f"| {r['constant']} | {r['default']:g} | {r['calibrate_on']} | "
                       + (f"{r['implied'][0]:.3f}-{r['implied'][1]:.3f}" if abs(r['implied'][0] - r['implied'][1]) > 5e-4
                          else f"{r['implied'][0]:.3f}") + f" | {checks or 'none: ' + r['no_validation']} |")
        out += ["", *(f"- **{r['constant']}**: {r['what']}." for r in result["calibrations"])]
    if result.get("acceptance"):
        out += ["", "Tokens per step with K draft tokens, E(K, a) = (1 - a^(K+1)) / (1 - a) against measured mean "
                "accepted lengths (bonus token included); a is calibrated on K=1:", "",
                "| series | K | a | measured length | est E(K, a) | est/measured | role |", "|---|---|---|---|---|---|---|"]
        for r in result["acceptance"]:
            out.append(f"| {r['id']} | {r['draft_tokens']} | {r['accept_rate']:.3f} | {r['measured_accepted_length']:.2f} | "
                       f"{r['est_tokens_per_step']:.2f} | {r['est_over_measured']:.3f} | {r['role']} |")
        sources = sorted({(r["source"], r["url"]) for r in result["acceptance"]})
        out += ["", *(f"Source: {src} ({url})." for src, url in sources)]
    out += ["", "Not expressed by the step model (listed, not forced):", "",
            "| point | measured | what is missing | source |", "|---|---|---|---|"]
    for r in result["not_expressed"]:
        measured = (f"{r['measured_tok_s']:g} tok/s" if r["measured_tok_s"] is not None
                    else f"{r['measured_ms_per_token']:g} ms/token")
        src = f"[{_short(r['url'])}]({r['url']})" if r["url"] else r["source"].split(",")[0]
        out.append(f"| {r['id']} | {measured} | {'; '.join(r['missing'])} | {src} |")
    return "\n".join(out) + "\n"


def write(result: dict, out: Path = RESULTS) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    j, m = out / f"{STEM}.json", out / f"{STEM}.md"
    j.write_text(json.dumps(result, indent=1) + "\n")
    m.write_text(markdown(result))
    return j, m


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--points", default=str(POINTS), help="the points file (default: benchmarks/planning/published.json)")
    parser.add_argument("--out", default=str(RESULTS), help="where to write published.{json,md}")
    parser.add_argument("--check", action="store_true", help="exit 1 when the results file differs from a fresh run")
    args = parser.parse_args(argv)
    try:
        path = Path(args.points)
        result = run(load_points(path), load_acceptance(path), load_calibrations(path))
    except PublishedError as exc:
        print(f"published.py: error: {exc}", file=sys.stderr)
        return 2
    for r in result["expressed"]:
        print(f"{r['id']:<28} measured {r['measured_tok_s']:7.2f}-{r['measured_tok_s_high']:.2f} tok/s  "
              f"est {r['est_tok_s']:7.2f}  est/measured {r['est_over_measured_low']:.3f}-{r['est_over_measured']:.3f}  "
              f"({r['role']}; {'within' if r['within'] else 'OUTSIDE'} +-{r['tolerance']:.0%})")
    for r in result["calibrations"]:
        print(f"{r['constant']:<28} default {r['default']:g}, {r['calibrate_on']} gives {r['implied'][0]:.3f}-"
              f"{r['implied'][1]:.3f}; validated on {', '.join(v['id'] for v in r['validates']) or 'nothing'}")
    for r in result["acceptance"]:
        print(f"{r['id']:<28} K={r['draft_tokens']} measured length {r['measured_accepted_length']:.2f}  "
              f"est {r['est_tokens_per_step']:.2f}  est/measured {r['est_over_measured']:.3f}  ({r['role']})")
    for r in result["not_expressed"]:
        print(f"{r['id']:<28} not expressed: {r['missing'][0]}")
    if args.check:
        stale = [p for p, text in ((Path(args.out) / f"{STEM}.json", json.dumps(result, indent=1) + "\n"),
                                   (Path(args.out) / f"{STEM}.md", markdown(result)))
                 if not p.exists() or p.read_text() != text]
        if stale:
            print(f"stale: {', '.join(map(str, stale))}; run benchmarks/planning/published.py", file=sys.stderr)
            return 1
        return 0
    for path in write(result, Path(args.out)):
        print(f"wrote {path}")
    return 0

