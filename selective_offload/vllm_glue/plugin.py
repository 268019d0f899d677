"""The ``vllm.general_plugins`` entry point: applies a plan in every vLLM process.

vLLM calls :func:`register` in each process it starts (the process that creates the
engine, the engine core, its workers), possibly more than once. With
``SELECTIVE_OFFLOAD_PLAN`` unset it does nothing. With it set it validates the options
exactly as :func:`selective_offload.enable` does (:meth:`RunOptions.from_env`), loads the
plan and installs the hooks (idempotent). A bad variable, an unwritable report path, a
bad plan, an unsupported vLLM, a probe profile that cannot be read (``auto``) or CPU kernels
that cannot be built or loaded (a plan that computes on the host) raises here, in the first
process that loads plugins, so vLLM stops with the reason before any engine process exists;
the next engine start in the same process tries again.

When no report path is named, the first process picks one in a temporary directory and
puts it in the environment, so the processes it spawns write where it reads. With
``SELECTIVE_OFFLOAD_PLAN=auto`` there is no plan to load: the worker makes it
(:mod:`.auto_plan`).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from ..errors import UserError

if TYPE_CHECKING:
    from ..plan_format import Plan


def register() -> None:
    """Install the plan the environment names; raise, in one line, what stops it. vLLM marks
    its plugins loaded before it calls them, so a refusal here would leave every later
    engine of this process without the plan: the mark is cleared first, and the next
    engine start calls this again (after the user fixed what was refused)."""
    from . import patches

    try:
        _register()
    except BaseException as exc:
        _load_again_at_next_start()
        patches.record_refusal(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        raise


def _register() -> None:
    from ..options import AUTO_PLAN, ENV_REPORT, RunOptions
    from . import patches

    options = RunOptions.from_env()
    if options is None:
        return
    current = patches.session()
    if current is not None and current.settings.options == options:
        return  # enable() installed these options in this process, and checked them there
    from ..plan_format import Plan
    from . import compat

    plan = None if options.plan_path == AUTO_PLAN else Plan.load(options.plan_path)
    targets = compat.resolve_targets()
    check_this_host(plan)
    options = options.with_default_report()
    os.environ[ENV_REPORT] = options.report_path
    patches.apply(patches.Settings(plan, options), targets)


def check_this_host(plan: Plan | None) -> None:
    """What an engine's worker will read of this machine for ``plan`` (``None``: ``auto``),
    read now, in the process that starts the engine, before any engine process exists, so a
    problem is one line here and not a worker's traceback: under ``auto`` the probe profile
    (``SELECTIVE_OFFLOAD_PROFILE``), which the worker plans from; for a plan that computes on
    the host CPU, and under ``auto`` when ``SELECTIVE_OFFLOAD_KERNEL_CACHE`` names a cache, the
    CPU kernels, built or loaded from their cache (``cpu_kernels.unavailable_reason``).
    Raises :class:`UserError`."""
    from ..options import ENV_KERNEL_CACHE

    if plan is None:
        from ..probe import load_profile

        load_profile()
    fmt = plan.host_compute_format if plan is not None else (
        "bf16" if os.environ.get(ENV_KERNEL_CACHE, "").strip() else None)
    if fmt is not None:
        from ..cpu_kernels import unavailable_reason

        reason = unavailable_reason(fmt, again=True)  # an earlier start's failure may be fixed by now
        if reason is not None:
            raise UserError(reason if plan is None else f"the plan computes on the host CPU ({fmt}), and {reason}")


def _load_again_at_next_start() -> None:
    """vLLM's ``load_general_plugins`` sets ``vllm.plugins.plugins_loaded`` before it calls
    the plugins: cleared, the next engine start in this process loads them again."""
    try:
        import vllm.plugins as plugins
    except ImportError:  # pragma: no cover - no vLLM: nothing to load again
        return
    if getattr(plugins, "plugins_loaded", None) is True:
        plugins.plugins_loaded = False
