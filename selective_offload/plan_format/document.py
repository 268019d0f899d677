"""The :class:`Plan`: what ``selective-offload plan -o plan.json`` writes and what
``selective_offload.enable()`` applies.

``Plan`` is :class:`~.contents.PlanContents` (the fields and everything derived from the
groups) with the plan's checks (:mod:`.checks`) and its JSON I/O (:mod:`.io`) as methods,
so callers keep one object: ``plan.validate()``, ``Plan.load(path)``, ``plan.save(path)``.
The methods only delegate; each body lives in the module of its job. Being the top of the
package, this is the one module that imports both, and neither imports it.
"""

from __future__ import annotations

import os
from typing import Any

from . import checks, io
from .contents import PlanContents


class Plan(PlanContents):
    """A placement of every group of a model, checked to agree with itself (a frozen
    dataclass: its fields are :class:`~.contents.PlanContents`'s)."""

    # ---- consistency (see :mod:`.checks`)
    def validate(self, where: str = "plan") -> None:
        """Raise :class:`PlanError` (one line) when the plan contradicts itself: every
        derived quantity (role, MTP flag, coverage, hot layers, prefetch buffers, tower
        transient, strategy) is recomputed, and a stated value that disagrees is an error."""
        checks.validate(self, where)

    def check_groups(self, where: str = "plan") -> None:
        """Each group consistent in itself, unique, of the role its name and the inputs
        give it, inside the model; together they hold every tensor of the model."""
        checks.check_groups(self, where)

    def check_derived(self, where: str = "plan") -> None:
        """Stated quantities the groups bound: the prefetch buffers and the tower transient."""
        checks.check_derived(self, where)

    def check_vllm_baselines(self, where: str = "plan") -> None:
        """The cpu_offload_gb baseline's device bytes and verdict follow from its offloaded bytes and
        the groups (what it offloads needs the checkpoint's tensor order: bounded here)."""
        checks.check_vllm_baselines(self, where)

    def check_strategy(self, where: str = "plan") -> None:
        """The strategy names what the placement does, and a feasible placement fits."""
        checks.check_strategy(self, where)

    def require_feasible(self, what: str = "the plan", fix: str | None = None) -> None:
        """Refuse to apply an infeasible plan (enable(), and plans made at engine start)."""
        checks.require_feasible(self, what, fix)

    # ---- serialisation (see :mod:`.io`)
    def to_dict(self, *, derived: bool = True) -> dict[str, Any]:
        """The plan as its JSON object; ``derived=False`` leaves out what is computed from
        the fields (totals, estimates), so a plan of unchecked values can be written out to
        be checked."""
        return io.plan_to_dict(self, derived=derived)

    def to_json(self) -> str:
        """The plan as strict JSON (no NaN or Infinity: every number a plan holds is bounded)."""
        return io.plan_to_json(self)

    def save(self, path: str | os.PathLike) -> None:
        io.save_plan(self, path)

    @classmethod
    def checked(cls, plan: "Plan", where: str = "the Plan object") -> "Plan":
        """``plan`` validated as a plan file is: written out and read back through the same
        typed reader, so a Plan built or edited in Python gets no fewer checks than a file,
        and its errors name it, not a copy."""
        return io.checked_plan(cls, plan, where)

    @classmethod
    def from_dict(cls, data: Any, where: str = "plan") -> "Plan":
        return io.plan_from_dict(cls, data, where)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Plan":
        return io.load_plan(cls, path)
