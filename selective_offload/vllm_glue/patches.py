"""Install and remove the glue's hooks into vLLM; the one place that changes vLLM.

The hooks, and where each is explained:

=====================================================  ===================================
hooked                                                 module
=====================================================  ===================================
``MPClient.__init__`` (process that starts the engine)  :mod:`.caller`
``BaseModelLoader.load_model`` (worker)                 :mod:`.loading`
``base_loader.initialize_model`` (worker)               :mod:`.loading`
``base_loader.process_weights_after_loading``           :mod:`.loading`
``Worker.sample_tokens`` (each step's host sync)         :mod:`.host_compute` (failed jobs)
``compile_or_warm_up_model`` of ``Worker`` and of every  :mod:`.host_compute` (failed jobs,
worker class that overrides it, now or later (the CPU    counts from here on), :mod:`.routing`
build's ``CPUWorker``)                                   (counters zeroed)
``Worker.shutdown``                                      :mod:`.routing` (the report written)
``load_model`` of every loader class that overrides     :mod:`.loading` (reported as not
it, now or later (``BaseModelLoader.__init_subclass__``)  applied)
=====================================================  ===================================

:func:`apply` resolves nothing itself (:mod:`.compat` has resolved every target before),
installs all hooks at once and keeps the originals in the :class:`~.session.Session`;
:func:`remove` restores them. Both are idempotent. A second :func:`apply` swaps the
settings and forgets the last engine's state.
"""

from __future__ import annotations

from typing import Any, Callable

from . import caller, host_compute, loading, routing
from .compat import Targets
from .session import Session, Settings

__all__ = ["Settings", "Session", "apply", "remove", "is_applied", "session", "record_refusal", "refusal"]

_session: Session | None = None
#: Why the last start of an engine in this process was refused before any engine process
#: existed (the plugin's one line), for landing_report(); cleared by apply().
_refusal: str | None = None


def record_refusal(reason: str) -> None:
    global _refusal
    _refusal = reason


def refusal() -> str | None:
    return _refusal


def session() -> Session | None:
    return _session


def _hooks(targets: Targets) -> list[tuple[Any, str, Callable]]:
    hooks = [
        (targets.MPClient, "__init__", caller.make_engine_start(session)),
        (targets.BaseModelLoader, "load_model", loading.make_load_model(session)),
        (targets.base_loader, "initialize_model", loading.make_initialize_model(session)),
        (targets.base_loader, "process_weights_after_loading", loading.make_post_process(session)),
        (targets.Worker, "sample_tokens", host_compute.check_at_step_sync),
        (targets.Worker, "shutdown", routing.save_at_shutdown(session)),
        (targets.Worker, "compile_or_warm_up_model", _after_warm_up),
    ]
    return hooks + [(cls, attr, make) for base, attr, make in _subclass_hooks(targets)
                    for cls in _overriding(base, attr)]


def _after_warm_up(original: Callable) -> Callable:
    """``compile_or_warm_up_model``, the end of start-up, wrapped once for both modules that
    act there: the routing counters zeroed, then failed jobs raised and the host-compute
    counts started again (:func:`.host_compute.make_start_check`)."""
    zeroed = routing.zero_after_warm_up(lambda: _session.routing if _session is not None else None)(original)
    return host_compute.make_start_check(session)(zeroed)


def _subclass_hooks(targets: Targets) -> list[tuple[type, str, Callable]]:
    """Methods hooked in every class below a base that overrides them, now or later:
    loaders' ``load_model`` (guarded: reported as not applied), workers'
    ``compile_or_warm_up_model`` (the CPU build's ``CPUWorker`` overrides it without
    calling ``Worker``'s, and is imported after the plugin applies the hooks)."""
    return [(targets.BaseModelLoader, "load_model", loading.make_override_guard(session)),
            (targets.Worker, "compile_or_warm_up_model", _after_warm_up)]


def _overriding(base: type, attr: str) -> list[type]:
    """Classes (at any depth below ``base``) that define their own ``attr``."""
    found, todo = [], list(base.__subclasses__())
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        if attr in vars(cls):
            found.append(cls)
    return found


def _guard_later_subclasses(s: Session) -> None:
    """Classes defined after apply() (a plugin's ``register_model_loader``, the worker class
    vLLM imports by name) get the hooks of :func:`_subclass_hooks` too."""
    for base, attr, make in _subclass_hooks(s.targets):
        s.originals[(base, "__init_subclass__")] = vars(base).get("__init_subclass__", _ABSENT)

        def __init_subclass__(cls, _base=base, _attr=attr, _make=make, **kwargs):
            super(_base, cls).__init_subclass__(**kwargs)
            current = _session
            if current is not None and _attr in vars(cls):
                original = getattr(cls, _attr)
                current.originals[(cls, _attr)] = original
                setattr(cls, _attr, _make(original))

        base.__init_subclass__ = classmethod(__init_subclass__)


#: Stands for "the class had no attribute of its own" among the originals.
_ABSENT = object()


def apply(settings: Settings, targets: Targets) -> Session:
    """Install the hooks (or swap the settings when they are installed already)."""
    global _session, _refusal
    _refusal = None
    if _session is not None:
        _session.reset(settings)
        return _session
    new = Session(settings, targets)
    for owner, attr, make in _hooks(targets):
        original = getattr(owner, attr)
        new.originals[(owner, attr)] = original
        setattr(owner, attr, make(original))
    _guard_later_subclasses(new)
    _session = new
    return new


def remove() -> None:
    """Restore every hooked object and drop the session (idempotent)."""
    global _session, _refusal
    _refusal = None
    if _session is None:
        return
    for (owner, attr), original in reversed(list(_session.originals.items())):
        if original is _ABSENT:
            delattr(owner, attr)
        else:
            setattr(owner, attr, original)
    _session = None


def is_applied() -> bool:
    return _session is not None
