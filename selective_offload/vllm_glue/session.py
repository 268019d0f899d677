"""The glue's state: one :class:`Session` between ``apply()`` and ``remove()``.

Everything the hooks remember lives here, so there is one place to look and one thing to
drop: the settings (the plan and the options), what the current load is doing, the last
main model and its drafter (held weakly: they belong to vLLM), the wrappers attached to
cold groups (their small counters kept, so they can be reported after the model is
gone), and the last report.
"""

from __future__ import annotations

import hashlib
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..log import logger
from ..names import ModelNames, cold_segment
from ..options import AUTO_PLAN, RunOptions
from ..plan_format import Plan
from ..report import LandingReport, rank_path, remove_reports
from ..wrappers.page_locked import PageLockedLedger
from .compat import Targets
from .host_resident import HostResident

#: The key under vLLM's ``additional_config`` that carries the plan's identity, so vLLM's
#: compile caches (which hash ``additional_config``) never serve a graph built for
#: another plan, or for none.
COMPILE_KEY = "selective_offload"


@dataclass(frozen=True)
class Settings:
    #: ``None`` until the worker plans (``SELECTIVE_OFFLOAD_PLAN=auto``).
    plan: Plan | None
    options: RunOptions
    #: The model the plan was checked against in this process before any engine started
    #: (``enable(plan, model=...)``): the engine's start does not check it a second time.
    checked_model: str | None = None

    def checked_against(self, model: str) -> bool:
        """Whether the plan was checked against ``model`` already (the same directory or hub id)."""
        return self.checked_model is not None and same_model(self.checked_model, model)

    @property
    def auto(self) -> bool:
        """``SELECTIVE_OFFLOAD_PLAN=auto``: every main model is planned when it loads (the
        plan of the last one never speaks for the next)."""
        return self.options.plan_path == AUTO_PLAN

    @property
    def cold_on_host_segments(self) -> frozenset[str]:
        if self.plan is None:
            return frozenset()
        segments = self.plan.inputs.cold_segments
        return frozenset(cold_segment(g, segments) for g in self.plan.cold_on_host_groups) - {None}

    @property
    def identity(self) -> str:
        """What makes a compiled graph belong to this plan: the plan and the lookup mode."""
        digest = hashlib.sha256(self.plan.to_json().encode() + self.options.embedding_mode.encode())
        return digest.hexdigest()[:16]


def same_model(a: str, b: str) -> bool:
    """Two names of one model: the same hub id, or paths to one directory."""
    if a == b:
        return True
    try:
        return Path(a).resolve() == Path(b).resolve()
    except (OSError, RuntimeError):
        return False


@dataclass
class Load:
    """What one main-model load did, for the report."""

    settings: Settings
    device: torch.device
    constructed: bool = False
    #: Names of the cold parameters built on the host (see construct_on_host).
    routed_names: frozenset[str] = frozenset()
    #: The exact-layer prefetch offloader (hot layers), when the plan has any; the host
    #: memory verdict waits for its ``post_init``, which pins the hot layers' final storage.
    hot_offloader: Any = None
    post_init_done: bool = False
    #: The largest device transient one host module's post-processing took (bytes).
    post_process_transient: int = 0
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    drafter_expected: bool = False
    loaded_bytes: dict[str, int] = field(default_factory=dict)
    dtype: str = ""
    pipeline_ranks: int = 1
    #: vLLM's ``max_num_batched_tokens`` for this engine (the pre-flight prices its fused-MoE
    #: workspace at it); ``None``: as the plan priced it.
    batched_tokens: int | None = None
    #: How host weights are held on this machine, and what this load page-locked.
    page_locked: PageLockedLedger | None = None
    #: The plan's routed experts served uva (``experts.ExpertsLoad``), when it has any.
    experts: Any = None
    #: The plan's groups as the model vLLM builds names them (``model_names.names_for``).
    names: ModelNames = field(default_factory=ModelNames)
    #: The device's free memory before construction (``preflight.device_free_bytes``).
    device_free: int | None = None
    #: The host's available memory before construction (``preflight.host_available_bytes``).
    host_available: int | None = None

    @property
    def cold_segments(self) -> frozenset[str]:
        """The cold set's segments as the model spells them: what routing and wrapping match."""
        return self.names.segments(self.settings.cold_on_host_segments)


@dataclass
class Attached:
    """A wrapper the glue attached to a cold group. The wrapper belongs to the model and is
    held weakly; its counters (a small ledger, and a tower's last-call events) are kept, so
    they can still be reported after the model is gone."""

    wrapper: "weakref.ref[Any]"
    mechanism: str
    ledger: Any = None
    events: list | None = None
    host_bytes: int = 0
    #: Counters read from the wrapper as they are now (host-computed experts).
    live: Any = None

    def counters(self) -> dict[str, Any]:
        if self.live is not None:
            return self.live()
        if self.ledger is None:
            return {}
        wrapper = self.wrapper()
        if wrapper is not None and hasattr(wrapper, "stats") and not callable(wrapper.stats):
            self.host_bytes = wrapper.stats.host_bytes  # a tower: host bytes as they are now
        out = vars(self.ledger.snapshot(self.host_bytes)).copy()
        if self.events is not None:
            out["last_call_events"] = [list(e) for e in self.events]
        return out


@dataclass
class Main:
    """The last main model loaded in this process, for the drafter's turn and live counters."""

    model: "weakref.ref[nn.Module]"
    load: Load
    cold_params: set[int]
    hot_params: set[int]


@dataclass
class Session:
    """Everything the glue holds between ``apply()`` and ``remove()``."""

    settings: Settings
    targets: Targets
    #: (owner, attribute) -> the original object, restored by ``remove()``.
    originals: dict[tuple[Any, str], Any] = field(default_factory=dict)
    #: The main-model load in progress, and whether a drafter's load is.
    active: Load | None = None
    drafting: bool = False
    #: The drafter modules built on the host to be shared (see loading), as module objects,
    #: and the drafter's parameter sizes as loaded (before the CPU build repacks weights).
    drafter_routed: HostResident = field(default_factory=HostResident)
    drafter_routed_modules: list[str] = field(default_factory=list)
    drafter_loaded_bytes: dict[str, int] = field(default_factory=dict)
    #: BaseModelLoader.load_model calls seen (a loader that overrides it is caught by this).
    loads: int = 0
    main: Main | None = None
    attached: dict[str, Attached] = field(default_factory=dict)
    report: LandingReport | None = None
    #: The routing counters of the last main model (``routing.RoutingCounters``), when counted.
    routing: Any = None

    def reset(self, settings: Settings) -> None:
        """A new plan for the engines started from now on: nothing of the last one carries over."""
        self.settings, self.report, self.main, self.active, self.drafting = settings, None, None, None, False
        self.routing = None
        self.attached.clear()
        self.drafter_routed, self.drafter_routed_modules, self.drafter_loaded_bytes = HostResident(), [], {}

    def transfers(self) -> dict[str, dict[str, Any]]:
        """Each attached wrapper's counters, now."""
        return {group: c for group, a in self.attached.items() if (c := a.counters())}

    def live_report(self) -> LandingReport | None:
        """The report of the model loaded in this process, with the counters as they are now."""
        if self.report is None:
            return None
        self.report.transfers = self.transfers()
        self.report.transfers_as_of = "now"
        if self.routing is not None:
            self.report.routing = self.routing.as_report()
        if self.settings.options.report_path:
            save_report(self.report, self.settings.options.report_path)  # the file keeps the latest counters
        return self.report


def rank() -> int:
    """This process's rank among vLLM's workers (0 without a distributed group)."""
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    """How many worker ranks there are (1 without a distributed group): each writes a report."""
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def save_report(report: LandingReport, path: str) -> None:
    report.world_size = world_size()
    try:
        report.save(rank_path(path, rank()))
    except (OSError, ValueError) as exc:  # the reason must still reach the user, through the log and a raise
        logger.error("selective-offload: cannot write the report %s: %s", path, exc)


def clear_reports(path: str | None) -> None:
    """Remove a previous engine's reports, so they cannot speak for the next one."""
    if path:
        remove_reports(path)
