"""Hooks in the process that starts the engine (``LLM(...)``, ``vllm serve``'s API server).

Before any engine process exists: the plan is checked against the checkpoint vLLM was
asked to load (unless ``enable(plan, model=...)`` checked it against that model already:
one check before the engine starts, one in the worker), and the plan's identity is put into ``additional_config`` (which vLLM
hashes for its compile caches). If the engine then fails to start because of the plan,
the worker's one-line reason, read from the report file, is raised instead of vLLM's
generic "Engine core initialization failed", so it is the last line the user sees.
"""

from __future__ import annotations

from pathlib import Path

from ..checkpoint import load_checkpoint, require_complete
from ..errors import PlanError
from ..model_match import check_plan_matches_model
from ..plan_format import Plan
from ..report import LandingReport, report_paths
from .session import COMPILE_KEY, Settings, clear_reports, logger


def check_model(plan: Plan, model: str) -> list[str]:
    """Check ``plan`` against the checkpoint at ``model`` when it is a local directory."""
    if not Path(model).is_dir():
        return [f"{model} is not a local directory: the plan is checked against the loaded model only"]
    checkpoint = load_checkpoint(model)
    require_complete(checkpoint)
    return check_plan_matches_model(plan, checkpoint)


def stamp_compile_key(settings: Settings, vllm_config) -> str | None:
    """Put the plan's identity where vLLM's compile-cache hash sees it; a note if it cannot."""
    extra = getattr(vllm_config, "additional_config", None)
    if isinstance(extra, dict):
        extra[COMPILE_KEY] = settings.identity
        return None
    return ("vLLM's additional_config is not a dict here, so its compile cache key does not "
            "include the plan: clear the compile cache when changing plans")


def worker_error(report_path: str | None) -> str | None:
    """The user error a worker (any rank) wrote to the report files, if any."""
    if not report_path:
        return None
    for path in report_paths(report_path):
        if path.is_file():
            try:
                error = LandingReport.load_one(path).error
            except PlanError:
                continue
            if error:
                return error
    return None


def make_engine_start(get_session):
    """``MPClient.__init__``: runs before the engine processes start."""

    def wrap(original):
        def __init__(self, *args, **kwargs):
            s = get_session()
            if s is None:
                return original(self, *args, **kwargs)
            vllm_config = kwargs.get("vllm_config", args[1] if len(args) > 1 else None)
            model = getattr(getattr(vllm_config, "model_config", None), "model", None)
            # auto: the worker plans; a plan enable() checked against this model is not checked again
            if model is not None and not s.settings.auto and not s.settings.checked_against(str(model)):
                for note in check_model(s.settings.plan, str(model)):
                    logger.info("selective-offload: %s", note)
            if vllm_config is not None and not s.settings.auto:
                note = stamp_compile_key(s.settings, vllm_config)
                if note:
                    logger.warning("selective-offload: %s", note)
            report_path = s.settings.options.report_path
            clear_reports(report_path)
            try:
                return original(self, *args, **kwargs)
            except Exception:
                reason = worker_error(report_path)
                if reason is None:
                    raise
            raise PlanError(reason)

        return __init__

    return wrap
