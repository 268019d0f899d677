"""Where every byte landed, against the plan: the proof that the offload happened.

Silent non-offload is the failure this project exists to end (asking vLLM for
``cpu_offload_params={embed_tokens, visual, mtp}`` moved 0.5 GiB of a 4.31 GB cold set and
said nothing), so after the model is loaded each of its parameters is matched to a plan
group (by :func:`names.group_key`, which survives vLLM's renames, of the group's name in
the model: :class:`names.ModelNames`) and its actual placement is read from the tensor itself and from the wrappers that own it.

Bytes are compared like with like. The plan counts checkpoint bytes; vLLM may hold a
group in a wider dtype (a bf16 checkpoint in a float32 engine) or padded, so the verdict
compares the bytes that landed elsewhere with the bytes *as loaded* of the groups the
plan puts on the host. More than :data:`TOLERANCE` of those misplaced is a problem.

Where a cold group's host bytes came from matters as much as where they are: bytes
allocated on the device while the model was built and moved to the host only after
loading need the device memory the plan meant to save, which is what runs a 24 GiB card
out of memory at construction. So the report splits each cold group's host bytes into
*routed* (allocated on the host at construction) and *moved* (moved after loading);
moved bytes above the tolerance are a problem too. Routed experts served ``uva`` are
judged the same way: where they are, and whether they were built on the host.

This module is the record (what landed, built from the loaded model; its JSON; the rank
files merged); :mod:`.report_text` renders it. A report that is not ``ok`` is logged as a
loud warning by the vLLM glue, or raised in strict mode. A worker that fails with a user error writes a report whose ``error`` says
why, so the calling process can raise that line instead of vLLM's generic failure.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import torch
from torch import nn

from . import jsonio, report_files
from .errors import PlanError, UserError
from .names import ModelNames, parameter_group_keys
from .outputs import ours, write_files
from .plan_format import COLD_SERVINGS, HOST_SERVINGS, GroupPlan, Plan, Serving, cold_serving
from .report_text import render_report
from .sizes import GB, fmt_bytes

REPORT_FORMAT = "selective-offload/report-v3"
#: Misplaced (or unrouted) bytes above this fraction of the bytes, as loaded, of the
#: groups the plan puts on the host make a report not ok.
TOLERANCE = 0.01
#: Page-locked host memory above this multiple of the host bytes (as loaded) is a warning
#: (a note in the report)...
PAGE_LOCKED_WARN = 1.05
#: ...and above this one a problem (an error in strict mode): RAM the operating system can
#: neither use nor swap, on machines whose RAM is the limit. torch's power-of-two rounding
#: of pinned blocks alone can reach 2x.
PAGE_LOCKED_LIMIT = 1.25
#: Where a parameter can be found, besides a serving of the plan's: host memory that no
#: wrapper of this plan owns.
STRAY_HOST = "host"
#: The host servings the verdict judges: the stem of the report's planned, loaded and landed
#: fields, the word its problems (and misplaced, unrouted fields) use, and the servings (a
#: cold group's gather and on-demand are one: the cold set).
JUDGED: tuple[tuple[str, str, frozenset[Serving]], ...] = (
    ("cold_on_host", "cold", COLD_SERVINGS),
    ("prefetch", "prefetch", frozenset({Serving.PREFETCH})),
    ("uva", "uva", frozenset({Serving.UVA})),
    ("host_compute", "compute", frozenset({Serving.COMPUTE})),
)


@dataclass
class GroupLanding:
    group: str
    #: How the plan serves the group (:class:`~.plan_format.Serving`, as the plan file says it).
    planned: str
    #: Where most of its bytes were found: the serving of the wrapper that owns them
    #: (``resident``: the device), or ``host`` (host memory no wrapper of the plan owns).
    actual: str
    #: Checkpoint bytes, as planned.
    planned_bytes: int
    #: Bytes as vLLM holds them, by where they are.
    device_bytes: int = 0
    host_bytes: int = 0
    #: Of ``host_bytes`` of a cold group or of routed experts served uva or compute: allocated on the host while the
    #: model was built, or moved there after loading (a transient of that size on the device).
    routed_bytes: int = 0
    moved_bytes: int = 0
    num_params: int = 0
    #: How the plan's mechanism serves the group (``host gather``, ``on demand (...)``).
    mechanism: str = ""

    @property
    def loaded_bytes(self) -> int:
        return self.device_bytes + self.host_bytes


@dataclass
class LandingReport:
    """Planned against actual placement for every group, with the verdict."""

    model_fingerprint: str
    compute_device: str
    #: True when the compute device is the CPU: host and device memory are then the same
    #: memory, and a placement says which wrapper owns the bytes, not which chip holds them.
    host_is_device: bool
    groups: list[GroupLanding] = field(default_factory=list)
    #: Checkpoint bytes the plan puts on the host, by serving (the cold set: gather and on-demand).
    planned_cold_on_host_bytes: int = 0
    planned_prefetch_bytes: int = 0
    planned_uva_bytes: int = 0
    planned_host_compute_bytes: int = 0
    #: The same groups' bytes as vLLM loaded them (the verdict's yardstick).
    loaded_cold_on_host_bytes: int = 0
    loaded_prefetch_bytes: int = 0
    loaded_uva_bytes: int = 0
    loaded_host_compute_bytes: int = 0
    #: Bytes, as loaded, found in each host serving.
    landed_cold_on_host_bytes: int = 0
    landed_prefetch_bytes: int = 0
    landed_uva_bytes: int = 0
    landed_host_compute_bytes: int = 0
    misplaced_cold_bytes: int = 0
    misplaced_prefetch_bytes: int = 0
    misplaced_uva_bytes: int = 0
    misplaced_compute_bytes: int = 0
    #: Bytes of the cold set (and of experts served uva or compute) moved to the host after
    #: loading instead of built there.
    unrouted_cold_bytes: int = 0
    unrouted_uva_bytes: int = 0
    unrouted_compute_bytes: int = 0
    est_link_bytes_per_step: int = 0
    #: Parameters of the model that no plan group claims (name -> bytes); a name that is
    #: another name of a claimed parameter (a tied LM head) is not listed.
    unplanned: dict[str, int] = field(default_factory=dict)
    #: Counters of each wrapper (group -> counters), as of ``transfers_as_of``.
    transfers: dict[str, dict[str, Any]] = field(default_factory=dict)
    transfers_as_of: str = "load"
    #: The worker's routing counts (``vllm_glue.routing``; a routing profile's fields), as of
    #: ``transfers_as_of``; empty when not counted.
    routing: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: A user error that stopped the load (the plan could not be applied at all).
    error: str | None = None
    #: Other worker ranks' verdicts (``rank1`` -> summary), merged by :meth:`load`.
    ranks: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: Groups this pipeline-parallel rank does not hold (another rank does, or none: the
    #: merge in :meth:`load` decides).
    on_other_ranks: list[str] = field(default_factory=list)
    #: Page-locked host memory against the host bytes: see :func:`judge_host_memory`.
    host_memory: dict[str, Any] = field(default_factory=dict)
    format: str = REPORT_FORMAT
    #: How many worker ranks the engine ran (each writes a file): what :meth:`load` checks
    #: the rank files against. ``None`` in a report of an older release.
    world_size: int | None = None

    @property
    def ok(self) -> bool:
        return not self.problems and self.error is None

    def landing(self, group: str) -> GroupLanding:
        return next(g for g in self.groups if g.group == group)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}

    def save(self, path: str | os.PathLike) -> None:
        """Write atomically, by the rule every output follows (:mod:`.outputs`): a reader
        never sees half a report, and only a report this project wrote (or nothing) is
        replaced: not a file of the user's, and not ``/dev/full`` (renaming over it as root
        would replace the device). A refusal is an ``OSError``, as a failed write is."""
        path = Path(path)
        try:
            write_files([("", path, (jsonio.dumps(self.to_dict()) + "\n").encode(), "report")])
        except UserError as exc:
            raise OSError(str(exc)) from None

    @classmethod
    def load_one(cls, path: str | os.PathLike) -> "LandingReport":
        """One report file, as written, every field checked (``PlanError`` in one line)."""
        try:
            data = jsonio.read(path)
        except OSError as exc:
            raise PlanError(f"{str(path)[:300]}: cannot read the landing report: {exc.strerror or exc}; "
                            f"{report_files.FIX}") from None
        except ValueError as exc:
            raise PlanError(f"{str(path)[:300]}: not a landing report of this selective-offload ({exc}); "
                            f"{report_files.FIX}") from None
        fields = report_files.read_fields(data, str(path), REPORT_FORMAT)
        fields["groups"] = [GroupLanding(**g) for g in fields["groups"]]
        return cls(**fields)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "LandingReport":
        """The report at ``path``, with every other worker rank's verdict merged in: a
        problem or error on any rank is the report's (each rank holds its own shard of a
        tensor-parallel model, so each judges its own bytes). A rank with no file, a file
        beyond the world size, or two files for one rank is a problem too."""
        report = cls.load_one(path)
        missing = set(report.on_other_ranks)
        others = [(k, p, cls.load_one(p)) for k, p in report_files.rank_files(path)]
        report.problems += report_files.rank_problems(Path(path), [(k, p, w.world_size) for k, p, w in others],
                                                      report.world_size)
        for _, other, worker in others:
            label = other.name.rsplit(".", 1)[-1]
            report.ranks[label] = {"ok": worker.ok, "landed_cold_on_host_bytes": worker.landed_cold_on_host_bytes,
                                   "landed_prefetch_bytes": worker.landed_prefetch_bytes,
                                   "landed_uva_bytes": worker.landed_uva_bytes,
                                   "landed_host_compute_bytes": worker.landed_host_compute_bytes,
                                   "problems": worker.problems, "error": worker.error}
            report.problems += [f"{label}: {p}" for p in worker.problems]
            if report.error is None and worker.error is not None:
                report.error = f"{label}: {worker.error}"
            held = {g.group: g for g in worker.groups if g.num_params}
            report.groups = [held.get(g.group, g) if g.group in missing else g for g in report.groups]
            missing -= set(held)
        if report.on_other_ranks:  # a pipeline-parallel model: a group no rank holds is missing
            report.problems += [f"group {name} is on no pipeline rank" for name in sorted(missing)]
            report.on_other_ranks = sorted(missing)
        return report

    @classmethod
    def failed(cls, error: str, plan: Plan | None, compute_device: str) -> "LandingReport":
        """The report of a load that a user error stopped."""
        return cls(model_fingerprint=plan.model.fingerprint if plan else "", compute_device=compute_device,
                   host_is_device=compute_device == "cpu", error=error)

    def render(self, path: str | os.PathLike | None = None) -> str:
        """The report as text, its verdict on the first line; ``path``: the file it was read
        from (:mod:`.report_text`)."""
        return render_report(self, path)


def rank_path(path: str | os.PathLike, worker_rank: int) -> Path:
    """Rank 0 writes the report file itself; rank k writes ``<file>.rank<k>`` beside it."""
    return Path(path) if worker_rank == 0 else Path(f"{path}.rank{worker_rank}")


def report_paths(path: str | os.PathLike) -> list[Path]:
    """The report file and every other rank's file beside it."""
    return [Path(path), *(p for _, p in report_files.rank_files(path))]


def remove_reports(path: str | os.PathLike) -> None:
    """Remove a previous engine's report files, so they cannot speak for the next one;
    only reports this project wrote (a report path naming a device, or a file of the
    user's, is never unlinked)."""
    for p in report_paths(path):
        if p.is_file() and p.stat().st_size and ours(p, "report"):
            p.unlink(missing_ok=True)


@dataclass
class _Matching:
    """Parameters matched to plan groups: bytes by group and by where they are."""

    landings: dict[str, GroupLanding]
    by_place: dict[str, dict[str, int]]
    unplanned: dict[str, int] = field(default_factory=dict)

    def record(self, group: str, where: str, nbytes: int, *, routed: bool | None = None) -> None:
        landing = self.landings[group]
        landing.num_params += 1
        if where == Serving.RESIDENT:
            landing.device_bytes += nbytes
        else:
            landing.host_bytes += nbytes
            if routed is True:
                landing.routed_bytes += nbytes
            elif routed is False:
                landing.moved_bytes += nbytes
        self.by_place[group][where] = self.by_place[group].get(where, 0) + nbytes


def _match_parameters(model: nn.Module, plan: Plan, *, host_is_device: bool, cold: set[int],
                      prefetch: set[int], routed: set[str] | None, size,
                      uva: set[int] = frozenset(), routed_uva: set[int] | None = None,
                      compute: set[int] = frozenset(),
                      names: ModelNames = ModelNames()) -> _Matching:
    segments = names.segments(plan.inputs.cold_segments)
    by_key: dict[tuple, GroupPlan] = {}
    for g in plan.groups:
        by_key.setdefault(names.key(g.group, plan.inputs.cold_segments), g)
    m = _Matching({g.group: GroupLanding(g.group, g.serving, Serving.NONE, g.bytes) for g in plan.groups},
                  {g.group: {} for g in plan.groups})
    # Tied weights are listed under every name, so a re-tied lm_head finds its group too.
    claimed: set[int] = set()
    unclaimed: list[tuple[str, torch.Tensor, int]] = []
    for name, param in model.named_parameters(remove_duplicate=False):
        nbytes = size(param, name)
        keys = parameter_group_keys(name, segments)
        planned = next((by_key[k] for k in keys if k in by_key), None)
        if planned is None:
            unclaimed.append((name, param, nbytes))
            continue
        claimed.add(id(param))
        if id(param) in prefetch:
            m.record(planned.group, Serving.PREFETCH, nbytes)
        elif id(param) in uva:
            m.record(planned.group, Serving.UVA, nbytes,
                     routed=None if routed_uva is None else id(param) in routed_uva)
        elif id(param) in compute:
            m.record(planned.group, Serving.COMPUTE, nbytes,
                     routed=None if routed_uva is None else id(param) in routed_uva)
        elif id(param) in cold:
            m.record(planned.group, cold_serving(planned.group, planned.kind), nbytes,
                     routed=None if routed is None else name in routed)
        elif param.device.type == "cpu" and not host_is_device:
            m.record(planned.group, STRAY_HOST, nbytes)
        else:
            m.record(planned.group, Serving.RESIDENT, nbytes)
    # Another name of a claimed parameter (a tied head) is counted under its group already.
    m.unplanned = {name: nbytes for name, param, nbytes in unclaimed if id(param) not in claimed}
    return m


def _honesty(m: _Matching, loaded_bytes: int) -> list[str]:
    """What a plan that was edited or made for less than this model would hide: groups the
    plan leaves out (absent) that the engine loaded anyway, and parameters in no group
    (placed by no one, counted nowhere) above the tolerance."""
    problems = [f"group {g.group} is planned absent (not loaded), but the engine loaded {fmt_bytes(g.loaded_bytes)} "
                "of it" for g in m.landings.values() if g.planned == Serving.NONE and g.num_params]
    uncovered = sum(m.unplanned.values())
    if uncovered > TOLERANCE * max(loaded_bytes, 1):
        names = sorted(m.unplanned, key=m.unplanned.get, reverse=True)
        problems.append(f"{fmt_bytes(uncovered)} of the loaded model are in no plan group ({', '.join(names[:4])}"
                        f"{' ...' if len(names) > 4 else ''}): the plan does not cover this model")
    return problems


def _count_drafter(m: _Matching, model: nn.Module, drafter: nn.Module, plan: Plan, cold: set[int],
                   size: Callable[[torch.Tensor, str], int], notes: list[str]) -> None:
    """An MTP head is built by vLLM's speculative drafter under names of its own: its
    parameters (less those it shares with the main model, such as the embedding) count
    for the plan's MTP group."""
    mtp = next((g for g in plan.groups if g.mtp), None)
    mtp_group = None if mtp is None else mtp.group
    shared = {id(p) for p in model.parameters()}
    own = [(n, p) for n, p in drafter.named_parameters() if id(p) not in shared]
    if mtp_group is None:
        m.unplanned.update({f"drafter.{n}": size(p, n) for n, p in own})
        return
    for name, param in own:
        m.record(mtp_group, cold_serving(mtp.group, mtp.kind) if id(param) in cold else Serving.RESIDENT,
                 size(param, name))
    if m.landings[mtp_group].planned == Serving.NONE:
        notes.append(f"the speculative drafter loaded {mtp_group}, which the plan left out "
                     "(plan with --speculative mtp to count it)")


def _missing_groups(m: _Matching, plan: Plan, drafter_loaded: bool, drafter_expected: bool,
                    notes: list[str], elsewhere: list[str] | None) -> list[str]:
    """Planned groups the model lacks: a problem, or, on one rank of a pipeline-parallel
    model (``elsewhere`` is a list), left to the merge of every rank's report."""
    problems = []
    for g in plan.groups:
        landing = m.landings[g.group]
        if landing.num_params:
            continue
        if g.mtp and not drafter_loaded:
            if g.serving != Serving.NONE:
                notes.append(f"{g.group} is loaded by the speculative drafter"
                             + ("" if drafter_expected else ", and this engine runs without one"))
        elif g.serving != Serving.NONE and g.bytes and elsewhere is not None:
            elsewhere.append(g.group)
        elif g.serving != Serving.NONE and g.bytes:
            problems.append(f"group {g.group} ({g.bytes / GB:.3f} GB, planned {g.location}, served {g.serving}) "
                            "is not in the loaded model")
    return problems


def _verdict(m: _Matching, report: LandingReport, check_routing: bool, check_uva_routing: bool = False) -> list[str]:
    """Misplaced, unrouted and stray host bytes against the tolerance."""
    problems: list[str] = []
    for stem, label, servings in JUDGED:
        loaded = landed = misplaced = 0
        wrong: list[str] = []
        for landing in m.landings.values():
            places = m.by_place[landing.group]
            here = sum(places.get(serving, 0) for serving in servings)
            landed += here
            if landing.planned in servings:
                loaded += landing.loaded_bytes
                off = landing.loaded_bytes - here
            else:
                off = here
            if off:
                misplaced += off
                wrong.append(landing.group)
        setattr(report, f"loaded_{stem}_bytes", loaded)
        setattr(report, f"landed_{stem}_bytes", landed)
        setattr(report, f"misplaced_{label}_bytes", misplaced)
        if misplaced > TOLERANCE * loaded:
            problems.append(
                f"{fmt_bytes(misplaced)} of {label} bytes (as loaded) did not land where planned, more than "
                f"{TOLERANCE:.0%} of the {fmt_bytes(loaded)} the plan puts on the host: "
                f"{', '.join(wrong[:6])}{' ...' if len(wrong) > 6 else ''}")
    for stem, label, servings, checked in (("cold_on_host", "cold", COLD_SERVINGS, check_routing),
                                           ("uva", "uva", {Serving.UVA}, check_uva_routing),
                                           ("host_compute", "compute", {Serving.COMPUTE}, check_uva_routing)):
        moved = [g for g in m.landings.values() if g.planned in servings and g.moved_bytes]
        unrouted = sum(g.moved_bytes for g in moved)
        setattr(report, f"unrouted_{label}_bytes", unrouted)
        if checked and unrouted > TOLERANCE * getattr(report, f"loaded_{stem}_bytes"):
            problems.append(
                f"{fmt_bytes(unrouted)} of {label} bytes were allocated on the device while the model was "
                f"built and moved to the host only after loading ({', '.join(g.group for g in moved[:6])}): "
                "the device needs them at construction, which is what the plan was to avoid")
    stray = sum(places.get(STRAY_HOST, 0) for places in m.by_place.values())
    if stray > TOLERANCE * max(report.loaded_cold_on_host_bytes + report.loaded_prefetch_bytes
                               + report.loaded_uva_bytes + report.loaded_host_compute_bytes, 1):
        problems.append(f"{fmt_bytes(stray)} are in host memory without the plan "
                        "(is vLLM's own cpu_offload_gb set as well?)")
    return problems


def build_report(
    model: nn.Module,
    plan: Plan,
    *,
    compute_device: torch.device,
    cold_on_host_params: set[int],
    prefetch_params: set[int],
    routed_names: set[str] | frozenset[str] | None = None,
    notes: Iterable[str] = (),
    drafter: nn.Module | None = None,
    drafter_expected: bool = False,
    loaded_bytes: Mapping[str, int] | None = None,
    drafter_loaded_bytes: Mapping[str, int] | None = None,
    mechanisms: Mapping[str, str] | None = None,
    pipeline_part: bool = False,
    uva_params: set[int] = frozenset(),
    routed_uva_params: set[int] | None = None,
    names: ModelNames | None = None,
    host_compute_params: set[int] = frozenset(),
) -> LandingReport:
    """Match ``model``'s parameters to ``plan``'s groups and compare placements.

    ``cold_on_host_params`` / ``prefetch_params`` are the ``id()`` of parameters that the
    cold-set wrappers and the hot-layer offloader own in host memory. ``routed_names``
    holds the names of the parameters that construction-time routing allocated on the host
    (``None``: routing is not checked): names, not storage addresses, because vLLM's
    post-processing may give a parameter new storage without it leaving the host. With ``drafter_expected`` and no ``drafter`` yet,
    a missing MTP group is awaited, not a problem. ``loaded_bytes`` (name -> bytes) gives
    sizes as loaded, for parameters that post-processing replaced by an empty one (a
    weight repacked into another object); ``drafter_loaded_bytes`` the same for the
    drafter's names. ``mechanisms`` describes each group's wrapper. ``pipeline_part``:
    this model is one pipeline-parallel rank's part, so groups it lacks may be on another.
    ``uva_params`` are the ``id()`` of routed-expert parameters held in host memory
    and read through UVA views, and ``routed_uva_params`` those of them built on the host
    (``None``: not checked); ``host_compute_params`` those computed on the host CPU (built on
    the host too, checked against ``routed_uva_params``). ``names`` says how the model names the plan's groups (vLLM's
    gpt-oss calls ``model.embed_tokens`` ``model.embedding``); the report keeps the plan's names.
    """
    loaded_bytes = loaded_bytes or {}

    def size(param: torch.Tensor, name: str = "", sizes: Mapping[str, int] = loaded_bytes) -> int:
        return max(param.numel() * param.element_size(), sizes.get(name, 0))

    def drafter_size(param: torch.Tensor, name: str = "") -> int:
        return size(param, name, drafter_loaded_bytes or {})

    host_is_device = compute_device.type == "cpu"
    m = _match_parameters(model, plan, host_is_device=host_is_device, cold=cold_on_host_params,
                          prefetch=prefetch_params, routed=routed_names, size=size,
                          uva=uva_params, routed_uva=routed_uva_params, compute=host_compute_params,
                          names=names or ModelNames())
    notes = list(notes)
    loaded = sum(g.loaded_bytes for g in m.landings.values()) + sum(m.unplanned.values())
    honesty = _honesty(m, loaded)  # the main model's own parameters, before the drafter's are counted
    if drafter is not None:
        _count_drafter(m, model, drafter, plan, cold_on_host_params, drafter_size, notes)
    for landing in m.landings.values():
        places = m.by_place[landing.group]
        if places:
            landing.actual = max(places, key=places.get)
        landing.mechanism = (mechanisms or {}).get(landing.group, "")
    report = LandingReport(
        model_fingerprint=plan.model.fingerprint, compute_device=str(compute_device),
        host_is_device=host_is_device, groups=list(m.landings.values()),
        planned_cold_on_host_bytes=plan.cold_on_host_bytes, planned_prefetch_bytes=plan.prefetch_bytes,
        planned_uva_bytes=plan.uva_bytes,
        planned_host_compute_bytes=sum(g.bytes for g in plan.groups if g.serving == Serving.COMPUTE),
        est_link_bytes_per_step=sum(g.est_link_bytes_per_step for g in plan.groups
                                    if m.landings[g.group].actual in HOST_SERVINGS),
        unplanned=m.unplanned, notes=notes,
    )
    report.problems = (honesty + _missing_groups(m, plan, drafter is not None, drafter_expected, notes,
                                                 report.on_other_ranks if pipeline_part else None)
                       + _verdict(m, report, routed_names is not None, routed_uva_params is not None))
    return report


def judge_host_memory(report: LandingReport, *, policy: str, reason: str, locked_by_how: Mapping[str, int],
                      locked_by_purpose: Mapping[str, int], torch_pinned_bytes: int | None,
                      resident_set_bytes: int | None) -> None:
    """Put page-locked host memory next to the host bytes, and judge the ratio.

    Page-locked bytes are what this project registered (exact sizes) plus what torch's
    caching host allocator holds (its own count, rounded blocks and cached ones included:
    vLLM's prefetch offloader and post-processing pin through it too), or, where torch
    gives no count, the buffers this project pinned through it at the size asked for.
    """
    host = (report.landed_cold_on_host_bytes + report.landed_prefetch_bytes + report.landed_uva_bytes
            + report.landed_host_compute_bytes)
    registered = sum(n for how, n in locked_by_how.items() if how.startswith("registered"))
    through_torch = torch_pinned_bytes if torch_pinned_bytes is not None else locked_by_how.get("caching allocator", 0)
    page_locked = registered + through_torch
    ratio = page_locked / host if host and policy == "register" else None
    report.host_memory = {
        "policy": policy, "reason": reason, "page_locked_bytes": page_locked, "registered_bytes": registered,
        "torch_pinned_bytes": torch_pinned_bytes, "by_purpose": dict(locked_by_purpose),
        "host_bytes": host, "page_locked_to_host_ratio": ratio, "resident_set_bytes": resident_set_bytes,
    }
    if policy == "unified" and host:
        report.notes.append(f"{reason}: the {fmt_bytes(host)} the plan puts on the host save no device memory here")
    elif policy == "pageable" and host and not report.host_is_device:
        report.notes.append(f"host weights are not page-locked: {reason}")
    if ratio is None:
        return
    if ratio > PAGE_LOCKED_LIMIT:
        report.problems.append(f"{fmt_bytes(page_locked)} of host memory is page-locked, {ratio:.2f}x the "
                               f"{fmt_bytes(host)} on the host (limit {PAGE_LOCKED_LIMIT}x): RAM the system can "
                               "neither use nor swap")
    elif ratio > PAGE_LOCKED_WARN:
        report.notes.append(f"warning: page-locked host memory is {ratio:.3f}x the host bytes "
                            f"(more than {PAGE_LOCKED_WARN}x)")
