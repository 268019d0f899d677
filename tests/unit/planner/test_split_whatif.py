"""benchmarks/split_whatif.py: what the reference plans would reach with each layer's
host-compute work split between the GPU and the CPU at once (est, not built). The figures
come from the step model's split rule (estimate.device_share_time) on the planner's own
plans, so they are recomputed here and must match the newest results file, which
docs/design/step-model.md quotes."""

from __future__ import annotations

import json
import sys

from helpers import REPO


def test_the_split_whatif_results_and_the_docs_are_what_the_step_model_says(tmp_path):
    sys.path.insert(0, str(REPO / "benchmarks"))
    import split_whatif

    newest = sorted((REPO / "benchmarks" / "results").glob("split-whatif-est-*.json"))[-1]
    recorded = json.loads(newest.read_text())["rows"]
    rows = split_whatif.whatif_rows(tmp_path)
    assert rows == recorded
    for r in rows:
        s = r["split"]
        # the VRAM the plan used is what the shares hold: a share in (0, 1), and the split
        # never prices slower than the layer-at-a-time plan it rearranges
        assert 0.0 < s["device_share"] < 1.0 and s["est_tok_s"] >= r["plan"]["est_tok_s"], r
        assert s["est_cpu_ms"] > 0
    table = newest.with_suffix(".md").read_text()
    page = (REPO / "docs" / "design" / "step-model.md").read_text()
    missing = [line for line in table.splitlines() if line.startswith("| ") and line not in page]
    assert not missing, missing
    # the MoE page quotes the what-if figures of the three MoE plans with targets of their own
    moe = (REPO / "docs" / "usage" / "moe.md").read_text()
    assert all(f"{r['split']['est_tok_s']:.2f}" in moe for r in rows[:3])
    assert "GPTQ" in rows[3]["case"] and f"{rows[3]['plan']['est_tok_s']:.2f} tok/s" in moe
