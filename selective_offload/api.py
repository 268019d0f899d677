"""``plan(model, device_memory=...)``, then ``enable(plan)`` before ``LLM(...)``; the same
through ``vllm serve`` by environment.

vLLM builds the model in spawned processes (the engine core, its workers) that a
monkeypatch in the calling process never reaches. So :func:`enable` writes the plan to a
file and names it in ``SELECTIVE_OFFLOAD_PLAN``; every vLLM process loads the
``vllm.general_plugins`` entry point (:mod:`selective_offload.vllm_glue.plugin`), which
reads that variable and installs the hooks. :func:`enable` also installs them in the
calling process: for engines run in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), to
check the model before an engine starts, and to raise a worker's reason for failing.
Without the variable the plugin does nothing: importing this package changes nothing.

:func:`enable` takes what :func:`plan` returns, a plan file, or ``"auto"`` (planned in the
worker from the real card); a model in the plan's place is refused, naming the call that
plans it.

For ``vllm serve``::

    selective-offload plan MODEL --device-memory 24GiB -o plan.json
    SELECTIVE_OFFLOAD_PLAN=plan.json vllm serve MODEL
"""

from __future__ import annotations

import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

from .checkpoint import INDEX_NAME, load_checkpoint, require_complete
from .errors import PlanError, UserError
from .model_match import check_plan_matches_model
from .options import AUTO_PLAN, ENV_PLAN, ENV_VARS, RunOptions, device_memory_from_env
from .plan_format import Plan
from .planner.serving import engine_settings
from .report import LandingReport, remove_reports

#: The report file of the last enable(), still readable after disable().
_last_report_path: Path | None = None

_PLAN_HINT = "a plan is the JSON that `selective-offload plan MODEL --device-memory SIZE -o plan.json` writes"


def _is_model_dir(path: Path) -> bool:
    try:
        return path.is_dir() and (any(path.glob("*.safetensors")) or (path / INDEX_NAME).is_file())
    except OSError:  # a name too long, no permission: not a model directory we can read
        return False


def plan(model: "str | os.PathLike", device_memory: "str | int | None" = None, **options: Any) -> Plan:
    """Plan ``model`` for a card of ``device_memory``, as ``selective-offload plan`` does.

    ``model`` is anything the command takes: a checkpoint directory or shard, a manifest, a
    ``config.json``, a hub id (``ORG/NAME[@REVISION]``) or a bundled name. ``options`` are the
    fields of :class:`~selective_offload.plan_options.PlanOptions`, the command's flags with
    ``_`` for ``-`` (``kv_cache="2GiB"``, ``cpu_gbps=40``, ``no_host_compute=True``), with the
    same defaults, including this machine's
    ``selective-offload probe`` profile where one exists. Without ``device_memory`` the
    profile's card is planned for. The plan may be infeasible; it says why
    (:meth:`Plan.require_feasible` raises it), and :func:`enable` refuses it.

    Raises :class:`UserError` (one line naming the option as written here) for a bad value,
    a ``TypeError`` (also a :class:`UserError`) naming the nearest option for an unknown one.
    """
    from .plan_options import PlanOptions, keyword, plan_model
    from .probe import load_profile

    chosen = PlanOptions.from_keywords({"device_memory": device_memory, **options})
    return plan_model(str(model), chosen, load_profile(), keyword).plan


def resolve_plan(plan: "Plan | str | os.PathLike") -> Plan:
    """A validated :class:`Plan` from a plan object or a plan JSON file; a model in its place
    is refused, naming the call that plans it."""
    if isinstance(plan, Plan):
        return Plan.checked(plan)
    if not isinstance(plan, (str, os.PathLike)):
        raise PlanError(f"enable() takes a Plan, a plan file or 'auto', not {type(plan).__name__}; {_PLAN_HINT}")
    path = Path(plan)
    if _hub_id(plan) or _is_model_dir(path):
        what = "a Hugging Face hub id" if _hub_id(plan) else "a model directory"
        raise PlanError(f"{plan}: is {what}, not a plan; enable(selective_offload.plan({str(plan)!r}, "
                        f"device_memory='24GiB')) plans it here, enable('auto', model={str(plan)!r}) in the worker "
                        "from the real card")
    try:
        exists, is_file = path.exists(), path.is_file()
    except OSError as exc:  # a name too long, a loop of links
        raise PlanError(f"{path}: cannot be read ({exc.strerror or exc}); {_PLAN_HINT}") from None
    if not exists:
        raise PlanError(f"{path}: no such plan file; {_PLAN_HINT}")
    if path.is_dir():
        raise PlanError(f"{path}: is a directory without *.safetensors shards, not a plan file; {_PLAN_HINT}")
    if not is_file:
        raise PlanError(f"{path}: is neither a regular file nor a directory (a device or a pipe), so not a plan; "
                        f"{_PLAN_HINT}")
    if path.suffix != ".json":
        raise PlanError(f"{path}: not a plan ({_PLAN_HINT})")
    return Plan.load(path)


def enable(plan: "Plan | str | os.PathLike", *, model: str | os.PathLike | None = None, strict: bool = False,
           report_path: str | os.PathLike | None = None, embedding_mode: str = "auto",
           routing: bool = False) -> dict[str, Any]:
    """Apply ``plan`` to every vLLM engine this process starts from now on.

    ``plan`` is a :class:`Plan` (from :func:`plan`), a plan JSON file, or ``"auto"``
    (planned in the engine's worker from the real card, for ``model`` or whatever model the
    engine loads); a model in the plan's place is refused, naming the call that plans it.
    The plan is checked against the checkpoint it will run on, here and now, when that is known:
    ``model`` (a directory, or a hub id read from the local cache or by its headers), or
    the directory the plan was made from; otherwise when the engine starts. ``strict`` makes
    an unrealised plan an error instead of a loud warning. The landing report is
    written to ``report_path`` (default: a file in the temporary directory) and returned
    by :func:`landing_report`. Returns the engine arguments the plan supplies, to pass
    on: ``LLM(**enable(plan))``: ``model``, and the settings that make vLLM match the plan
    (``planner.serving.engine_settings``: the KV cache it kept, a CUDA graph cap, the step its
    fused-MoE workspace was priced for). ``routing``: the worker counts each routed expert's
    picks after warm-up, for the report and ``selective-offload report --routing``
    (``SELECTIVE_OFFLOAD_ROUTING=1`` does the same for a server).

    Raises :class:`UserError` (one line saying what to do) for a bad option, an unreadable
    or inconsistent plan, a plan for another model, an infeasible plan or an unsupported
    vLLM, before anything is patched.
    """
    from .vllm_glue import compat
    from .vllm_glue.plugin import check_this_host

    # Options first, with a placeholder plan path: a bad option must not cost a plan read.
    RunOptions("", strict, str(report_path) if report_path else None, embedding_mode, routing).validate()
    if not isinstance(plan, Plan) and isinstance(plan, (str, os.PathLike)) and str(plan) == AUTO_PLAN:
        return _enable_auto(model, strict, report_path, embedding_mode, routing)
    resolved = resolve_plan(plan)
    resolved.require_feasible()
    supplied = engine_settings(resolved)
    if model is not None and _hub_id(model):  # checked against the hub's headers (or the cached snapshot)
        check_plan_matches_model(resolved, load_checkpoint(str(model)))
        targets = compat.resolve_targets()  # raises before anything is changed
        check_this_host(resolved)
        _install(resolved, _saved(resolved, strict, report_path, embedding_mode, routing), targets, checked=str(model))
        return {"model": str(model), **supplied}
    model_dir = Path(model) if model is not None else Path(resolved.model.source)
    if model is not None and not _is_model_dir(model_dir):
        raise PlanError(f"model={model_dir}: not a checkpoint directory (no *.safetensors shards)")
    if _is_model_dir(model_dir):
        checkpoint = load_checkpoint(model_dir)
        require_complete(checkpoint)
        check_plan_matches_model(resolved, checkpoint)
    elif resolved.model.kind == "safetensors":
        warnings.warn(f"selective-offload: the plan was made for {resolved.model.source}, which is not a checkpoint "
                      f"directory from {os.getcwd()}: it is checked against the model when the engine starts; "
                      "pass model= to check it now", UserWarning, stacklevel=2)
    targets = compat.resolve_targets()  # raises before anything is changed
    check_this_host(resolved)
    _install(resolved, _saved(resolved, strict, report_path, embedding_mode, routing), targets,
             checked=str(model_dir) if _is_model_dir(model_dir) else None)
    if _is_model_dir(model_dir):
        return {"model": str(model_dir), **supplied}
    return ({"model": resolved.model.source} if resolved.model.kind == "hub" else {}) | supplied


def _hub_id(text) -> bool:
    """A Hugging Face hub id (``ORG/NAME[@REVISION]``) that is not also a path here."""
    from .checkpoint.hub import parse_hub_id

    if isinstance(text, Plan) or parse_hub_id(str(text)) is None:
        return False
    try:
        return not Path(text).exists()
    except OSError:  # a name too long to be a path here
        return True


def _saved(plan: Plan, strict, report_path, embedding_mode, routing=False) -> RunOptions:
    """The plan written to a file of its own (the processes vLLM spawns read it), as options."""
    workdir = Path(tempfile.mkdtemp(prefix="selective-offload-"))
    plan.save(workdir / "plan.json")
    return RunOptions(str(workdir / "plan.json"), strict, str(report_path) if report_path else None, embedding_mode,
                      routing)


def _install(plan: Plan | None, options: RunOptions, targets, checked: str | None = None) -> None:
    """Name the options in the environment (for the processes vLLM spawns), clear the last
    engine's report, and install the hooks here; ``checked``: the model the plan was checked
    against here (the engine's start does not check it again)."""
    from .vllm_glue import patches

    options = options.with_default_report()
    global _last_report_path
    _last_report_path = Path(options.report_path)
    remove_reports(_last_report_path)
    os.environ.update(options.to_env())
    patches.apply(patches.Settings(plan, options, checked), targets)


def _enable_auto(model, strict, report_path, embedding_mode, routing=False) -> dict[str, Any]:
    """Plan inside the engine's worker, from the real card (see vllm_glue/auto_plan.py)."""
    from .vllm_glue import compat
    from .vllm_glue.plugin import check_this_host

    model_dir = Path(model) if model is not None else None
    if model_dir is not None and not _is_model_dir(model_dir):
        raise PlanError(f"{model_dir}: not a checkpoint directory (no *.safetensors shards) to plan at engine start")
    device_memory_from_env()  # the worker reads it: a bad value is refused here, before any engine starts
    targets = compat.resolve_targets()
    check_this_host(None)  # the profile it plans from, and a kernel cache it was told to use
    _install(None, RunOptions(AUTO_PLAN, strict, str(report_path) if report_path else None, embedding_mode,
                              routing), targets)
    return {"model": str(model_dir)} if model_dir is not None else {}


def disable() -> None:
    """Undo :func:`enable` for engines started after this call."""
    for name in ENV_VARS:
        os.environ.pop(name, None)
    try:
        from .vllm_glue import patches
    except ImportError:  # pragma: no cover - vLLM absent: nothing was patched
        return
    patches.remove()


def landing_report() -> LandingReport:
    """The landing report of the last engine started under :func:`enable`.

    For an engine in this process, the wrappers' transfer counters are as they are now;
    for a spawned engine, as they were when the model had loaded.
    """
    try:
        from .vllm_glue import patches
    except ImportError:  # pragma: no cover - vLLM absent
        patches = None
    live = patches.session() if patches is not None else None
    refused = patches.refusal() if patches is not None else None
    if refused is not None:  # the last engine start stopped before any engine process (the plugin's line)
        return LandingReport.failed(refused, None, "none: no engine started")
    if live is not None and live.report is not None:
        return live.live_report()
    path = os.environ.get("SELECTIVE_OFFLOAD_REPORT") or _last_report_path
    if os.environ.get(ENV_PLAN, "").strip() and not os.environ.get("SELECTIVE_OFFLOAD_REPORT"):
        # named in the environment, and no engine start has read it yet (that names the report)
        raise UserError(f"{ENV_PLAN}={os.environ[ENV_PLAN].strip()[:200]} is set, and no vLLM engine has started "
                        "in this process since: start one (LLM(...)) and ask again")
    if not path:
        raise UserError("no plan was enabled: call selective_offload.enable(plan) before LLM(...)")
    if not Path(path).is_file():
        raise UserError(f"{path}: no landing report: no vLLM engine has loaded a model since "
                        "selective_offload.enable(); it applies only to engines started after it, so call "
                        "enable() before LLM(...)")
    return LandingReport.load(path)
