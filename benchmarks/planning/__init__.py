"""The planning suite: what planning costs and what the plans say, no device needed.

    python -m benchmarks.planning timing [--repeats 7] [--out DIR]   # read headers and plan a 64-shard checkpoint
    python -m benchmarks.planning moe-plans [--out DIR | --manifests DIR]  # the MoE reference plans (est)
    python -m benchmarks.planning published [--check]                 # the step model against published figures

``timing`` measures (``planning-cpu-<machine>``); ``moe-plans`` and ``published`` are
arithmetic on stated rates (``moe-plans-est``, ``published``), regenerated, never edited.
"""

from __future__ import annotations

import sys

from benchmarks.planning import moe_plans, published, timing

PARTS = {"timing": timing.main, "moe-plans": moe_plans.main, "published": published.main}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in PARTS:
        print(f"usage: python -m benchmarks.planning {{{','.join(PARTS)}}} [options]  "
              "(each part's --help says more)", file=sys.stderr)
        return 2
    return PARTS[argv[0]](argv[1:])
