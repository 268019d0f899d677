"""Run the GPU mechanism tests without pytest's command line: what the GPU machine's image
may lack, and what writes their checks to a results file.

Why: ``benchmarks/mechanism/`` runs these tests in one prepared command on a
GPU machine that has torch and perhaps no pytest, and records every check (passed, FAILED,
or skipped and why) with the figures the fixtures measured. This runs the part of pytest
these tests use, and nothing more:

- fixtures by argument name: ``conftest.py``'s are session-scoped, a test module's own are
  module-scoped (the convention the tests keep); a generator fixture is torn down when its
  scope ends, and a fixture that raised raises again for each test that asks for it;
- ``pytest.mark.skipif`` marks and ``pytest.skip()``: the checks a skipped test
  ``records`` are listed with the reason's head as their status (``mechanism.skip_status``);
- the test functions of a module (``test_*``) in the order they are defined.

A test that fails on a named check has its row already (``mechanism.Checks.check``); one
that raises anything else gets a FAILED row named after it. Where pytest is installed its
own ``fixture``, ``mark.skipif`` and ``skip`` are what the tests use; where it is not, a
stand-in with those three names is installed as ``pytest`` before any test is imported.
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


class Skipped(Exception):
    """The stand-in's ``pytest.skip()``."""

    def __init__(self, msg: str = "") -> None:
        super().__init__(msg)
        self.msg = msg


def _stand_in_pytest() -> types.ModuleType:
    """``pytest.fixture``, ``pytest.mark.skipif`` and ``pytest.skip``, as far as these tests use them."""

    class Mark:
        def __init__(self, name: str, args: tuple, kwargs: dict) -> None:
            self.name, self.args, self.kwargs = name, args, kwargs

    class MarkGenerator:
        @staticmethod
        def skipif(condition: bool, *, reason: str = ""):
            def apply(test):
                test.pytestmark = [*getattr(test, "pytestmark", []), Mark("skipif", (condition,), {"reason": reason})]
                return test

            return apply

    def fixture(function=None, *, scope: str = "function"):
        return (lambda f: f) if function is None else function

    def skip(reason: str = "") -> None:
        raise Skipped(reason)

    skip.Exception = Skipped
    module = types.ModuleType("pytest")
    module.fixture, module.mark, module.skip = fixture, MarkGenerator(), skip
    return module


def ensure_pytest() -> types.ModuleType:
    """pytest, or the stand-in installed in its place."""
    try:
        import pytest
    except ImportError:
        sys.modules["pytest"] = _stand_in_pytest()
        import pytest
    return pytest


def _function(fixture):
    """The function under pytest's fixture wrapper (older pytest: ``__pytest_wrapped__``)."""
    wrapped = getattr(fixture, "__pytest_wrapped__", None)
    if wrapped is not None:
        return wrapped.obj
    return getattr(fixture, "__wrapped__", fixture)


def _import(path: Path, name: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


class _Failed:
    def __init__(self, error: BaseException) -> None:
        self.error = error


class Scope:
    """The fixture values of one scope, made on first use, torn down at :meth:`close`."""

    def __init__(self, module: types.ModuleType, parent: "Scope | None" = None) -> None:
        # The module's own functions (a fixture's name is its argument's); not what it imports.
        self.namespace = {n: v for n, v in vars(module).items()
                          if callable(v) and getattr(_function(v), "__module__", None) == module.__name__}
        self.parent = parent
        self.values: dict = {}
        self.teardowns: list = []

    def get(self, name: str):
        if name not in self.namespace:
            if self.parent is None:
                raise LookupError(f"no fixture named {name!r}")
            return self.parent.get(name)
        if name not in self.values:
            function = _function(self.namespace[name])
            try:
                value = function(**{arg: self.get(arg) for arg in inspect.signature(function).parameters})
                if inspect.isgenerator(value):
                    self.teardowns.append(value)
                    value = next(value)
            except Exception as err:  # noqa: BLE001 -- raised again for each test that asks for it
                value = _Failed(err)
            self.values[name] = value
        value = self.values[name]
        if isinstance(value, _Failed):
            raise value.error
        return value

    def close(self) -> None:
        for generator in reversed(self.teardowns):
            try:
                next(generator)
            except StopIteration:
                pass
        self.values.clear()
        self.teardowns.clear()


class Session:
    """The mechanism tests' run: ``run_module`` for each test module, then :meth:`close`."""

    def __init__(self, small: bool) -> None:
        self.pytest = ensure_pytest()
        for path in (ROOT, HERE):  # HERE first: its mechanism.py, not benchmarks/mechanism
            if str(path) not in sys.path:
                sys.path.insert(0, str(path))
        import mechanism

        self.mechanism = mechanism
        mechanism.RUN.small = small
        self.run = mechanism.RUN
        self.scope = Scope(_import(HERE / "conftest.py", "gpu_conftest"))

    def run_module(self, stem: str) -> list[tuple[str, str]]:
        """Each test of ``tests/gpu/<stem>.py``, in order: (name, passed / failed / skipped)."""
        module = _import(HERE / f"{stem}.py", stem)
        scope = Scope(module, self.scope)
        tests = [(n, f) for n, f in vars(module).items() if n.startswith("test_") and inspect.isfunction(f)]
        try:
            return [(name, self.run_test(stem, name, test, scope)) for name, test in tests]
        finally:
            scope.close()

    def run_test(self, stem: str, name: str, test, scope: Scope) -> str:
        checks, before = self.run.checks, len(self.run.checks.rows)
        reason = next((m.kwargs.get("reason", "") for m in getattr(test, "pytestmark", [])
                       if m.name == "skipif" and m.args and m.args[0]), None)
        outcome = "skipped"
        if reason is None:
            try:
                test(**{arg: scope.get(arg) for arg in inspect.signature(test).parameters})
                outcome = "passed"
            except self.pytest.skip.Exception as err:
                reason = getattr(err, "msg", None) or str(err)
            except Exception as err:  # noqa: BLE001 -- recorded; the other tests still run
                outcome = "failed"
                if not any(r["status"] == "FAILED" for r in checks.rows[before:]):
                    checks.rows.append({"name": f"{stem}::{name}", "status": "FAILED",
                                        "detail": f"{type(err).__name__}: {err}"[:600]})
        if outcome == "skipped":
            made = {r["name"] for r in checks.rows[before:]}
            for check in self.mechanism.recorded_names(test, self.run.config):
                if check not in made:
                    checks.skip(check, self.mechanism.skip_status(reason))
        print(f"== {stem}::{name}: {outcome}" + (f" ({reason})" if outcome == "skipped" else ""), flush=True)
        return outcome

    def close(self) -> None:
        self.scope.close()
