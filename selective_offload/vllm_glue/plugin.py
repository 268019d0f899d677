"""The ``vllm.general_plugins`` entry point: applies a plan in every vLLM process.

vLLM calls :func:`register` in each process it starts (the process that creates the
engine, the engine core, its workers), possibly more than once. With
``SELECTIVE_OFFLOAD_PLAN`` unset it does nothing. With it set it validates the options
exactly as :func:`selective_offload.enable` does (:meth:`RunOptions.from_env`), loads the
plan and installs the hooks (idempotent). A bad variable, an unwritable report path, a
bad plan or an unsupported vLLM raises here, in the first process that loads plugins, so
vLLM stops with the reason before any engine process exists.

When no report path is named, the first process picks one in a temporary directory and
puts it in the environment, so the processes it spawns write where it reads. With
``SELECTIVE_OFFLOAD_PLAN=auto`` there is no plan to load: the worker makes it
(:mod:`.auto_plan`).
"""

from __future__ import annotations

import os


def register() -> None:
    from ..options import AUTO_PLAN, ENV_REPORT, RunOptions

    options = RunOptions.from_env()
    if options is None:
        return
    from ..plan_format import Plan
    from . import compat, patches

    plan = None if options.plan_path == AUTO_PLAN else Plan.load(options.plan_path)
    targets = compat.resolve_targets()
    options = options.with_default_report()
    os.environ[ENV_REPORT] = options.report_path
    patches.apply(patches.Settings(plan, options), targets)
