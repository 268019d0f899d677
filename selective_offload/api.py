"""``enable(plan)`` before ``LLM(...)``; the same through ``vllm serve`` by environment.

vLLM builds the model in spawned processes (the engine core, its workers) that a
monkeypatch in the calling process never reaches. So :func:`enable` writes the plan to a
file and names it in ``SELECTIVE_OFFLOAD_PLAN``; every vLLM process loads the
``vllm.general_plugins`` entry point (:mod:`selective_offload.vllm_glue.plugin`), which
reads that variable and installs the hooks. :func:`enable` also installs them in the
calling process, for engines run in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``).
Without the variable the plugin does nothing: importing this package changes nothing.

For ``vllm serve``::

    selective-offload plan MODEL --device-memory 24GiB -o plan.json
    SELECTIVE_OFFLOAD_PLAN=plan.json vllm serve MODEL
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from .checkpoint import load_checkpoint
from .errors import PlanError, UserError
from .planner import Plan, PlanInputs, make_plan
from .report import PlacementReport
from .sizes import parse_size

ENV_PLAN = "SELECTIVE_OFFLOAD_PLAN"
ENV_REPORT = "SELECTIVE_OFFLOAD_REPORT"
ENV_STRICT = "SELECTIVE_OFFLOAD_STRICT"
ENV_EMBEDDING = "SELECTIVE_OFFLOAD_EMBEDDING"
_ENV = (ENV_PLAN, ENV_REPORT, ENV_STRICT, ENV_EMBEDDING)
#: The report file of the last enable(), still readable after disable().
_last_report_path: Path | None = None


def resolve_plan(plan: "Plan | str | os.PathLike", device_memory: str | int | None = None,
                 **inputs: Any) -> Plan:
    """A :class:`Plan` from a plan object, a plan JSON file, or a model to plan now."""
    if isinstance(plan, Plan):
        return plan
    path = Path(plan)
    if path.is_file() and path.suffix == ".json":
        try:
            return Plan.load(path)
        except PlanError:
            if device_memory is None:
                raise
    if not path.exists():
        raise PlanError(f"{path}: no such plan file or model directory; make a plan with "
                        "`selective-offload plan MODEL --device-memory ... -o plan.json`")
    if device_memory is None:
        raise PlanError(f"{path} is a model, not a plan: pass device_memory= (like '24GiB') to plan it now")
    return make_plan(load_checkpoint(path),
                     PlanInputs(device_memory_bytes=parse_size(device_memory, "device_memory"), **inputs))


def enable(plan: "Plan | str | os.PathLike", *, device_memory: str | int | None = None,
           strict: bool = False, report_path: str | os.PathLike | None = None,
           embedding_mode: str = "auto", **plan_inputs: Any) -> dict[str, Any]:
    """Apply ``plan`` to every vLLM engine this process starts from now on.

    ``plan`` is a :class:`Plan`, a plan JSON file, or a model directory (then planned
    here for ``device_memory`` and ``plan_inputs``). ``strict`` makes an unrealised plan
    an error instead of a loud warning. The placement report is written to
    ``report_path`` (default: a file in the temporary directory) and returned by
    :func:`placement_report`. Returns the engine arguments the plan supplies (``model``,
    when the plan was made from a local directory), to pass on: ``LLM(**enable(plan))``.

    Raises :class:`UserError` (one line saying what to do) for an unreadable plan or an
    unsupported vLLM, before anything is patched.
    """
    from .vllm_glue import compat, patches

    if embedding_mode not in patches.EMBEDDING_MODES:
        raise UserError(f"embedding_mode {embedding_mode!r}: use one of {', '.join(patches.EMBEDDING_MODES)}")
    resolved = resolve_plan(plan, device_memory, **plan_inputs)
    targets = compat.resolve_targets()  # raises before anything is changed
    workdir = Path(tempfile.mkdtemp(prefix="selective-offload-"))
    plan_path = workdir / "plan.json"
    resolved.save(plan_path)
    global _last_report_path
    report = Path(report_path) if report_path else workdir / "report.json"
    report.unlink(missing_ok=True)
    _last_report_path = report
    os.environ.update({ENV_PLAN: str(plan_path), ENV_REPORT: str(report),
                       ENV_STRICT: "1" if strict else "0", ENV_EMBEDDING: embedding_mode})
    patches.apply(patches.Settings(resolved, str(plan_path), strict, str(report), embedding_mode), targets)
    source = Path(str(resolved.model.get("source", "")))
    return {"model": str(source)} if source.is_dir() else {}


def disable() -> None:
    """Undo :func:`enable` for engines started after this call."""
    for name in _ENV:
        os.environ.pop(name, None)
    try:
        from .vllm_glue import patches
    except ImportError:  # pragma: no cover - vLLM absent: nothing was patched
        return
    patches.remove()


def placement_report() -> PlacementReport:
    """The placement report of the last engine started under :func:`enable`."""
    path = os.environ.get(ENV_REPORT) or _last_report_path
    if not path:
        raise UserError("no plan was enabled: call selective_offload.enable(plan) before LLM(...)")
    if not Path(path).is_file():
        raise UserError(f"{path}: no placement report yet; it is written when the engine has loaded the model")
    return PlacementReport.load(path)
