"""The ``vllm.general_plugins`` entry point: applies a plan in every vLLM process.

vLLM calls :func:`register` in each process it starts (API server, engine core, workers),
possibly more than once. With ``SELECTIVE_OFFLOAD_PLAN`` unset it does nothing; with it
set it loads the plan and installs the hooks (idempotent). A bad plan or an unsupported
vLLM raises here, so the engine fails at start with the reason, before any weight loads.
"""

from __future__ import annotations

import os


def register() -> None:
    from ..api import ENV_EMBEDDING, ENV_PLAN, ENV_REPORT, ENV_STRICT

    plan_path = os.environ.get(ENV_PLAN)
    if not plan_path:
        return
    from ..planner import Plan
    from . import compat, patches

    plan = Plan.load(plan_path)
    targets = compat.resolve_targets()
    patches.apply(
        patches.Settings(
            plan=plan,
            plan_path=plan_path,
            strict=os.environ.get(ENV_STRICT, "0") == "1",
            report_path=os.environ.get(ENV_REPORT) or None,
            embedding_mode=os.environ.get(ENV_EMBEDDING, "auto"),
        ),
        targets,
    )
