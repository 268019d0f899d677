"""Where every byte landed, against the plan: the proof that the offload happened.

Silent non-offload is the failure this project exists to end (asking vLLM for
``cpu_offload_params={embed_tokens, visual, mtp}`` moved 0.5 GiB of a 4.31 GB cold set and
said nothing), so after the model is loaded each of its parameters is matched to a plan
group and its actual placement is read from the tensor itself and from the wrappers that
own it. A report whose misplaced bytes exceed 1% of the planned cold or hot host bytes is
not ``ok``: the vLLM glue logs it as a loud warning, or raises in strict mode.

Names: vLLM renames some checkpoint tensors (``q_proj``/``k_proj``/``v_proj`` fuse into
``qkv_proj``; multimodal models move ``model.visual`` to ``visual`` and
``model.language_model.layers`` to ``language_model.model.layers``), so groups are matched
by a key that survives those renames: the cold segment for cold modules, the layer index
for decoder layers, and the module path without ``model``/``language_model`` wrappers for
the rest. Bytes are vLLM's own (padded vocabularies, fused or converted tensors), so they
can differ slightly from the checkpoint's; placements are what is compared.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

import torch
from torch import nn

from .errors import PlanError
from .planner import LAYER_RE, NEVER_COLD_SEGMENTS, Plan
from .sizes import GB, fmt_bytes

REPORT_FORMAT = "selective-offload/report-v1"
#: Misplaced bytes above this fraction of the planned host bytes make a report not ok.
TOLERANCE = 0.01
_WRAPPER_SEGMENTS = frozenset({"model", "language_model", "text_model"})


def group_key(name: str, cold_segments: Iterable[str]) -> tuple:
    """A rename-proof key for the group a parameter or plan group name belongs to."""
    parts = name.split(".")
    cold = set(cold_segments) - set(NEVER_COLD_SEGMENTS)
    if not set(parts) & set(NEVER_COLD_SEGMENTS):
        for seg in parts:
            if seg in cold:
                return ("cold", seg)
    m = LAYER_RE.match(name + ".")
    if m is not None:
        return ("layer", int(m.group("index")))
    path = [p for p in parts if p not in _WRAPPER_SEGMENTS]
    return ("module", ".".join(path))


@dataclass
class GroupLanding:
    group: str
    planned: str
    actual: str
    planned_bytes: int
    device_bytes: int = 0
    host_bytes: int = 0
    num_params: int = 0


@dataclass
class PlacementReport:
    """Planned against actual placement for every group, with the verdict."""

    model_fingerprint: str
    compute_device: str
    #: True when the compute device is the CPU: host and device memory are then the same
    #: memory, and a placement says which wrapper owns the bytes, not which chip holds them.
    host_is_device: bool
    groups: list[GroupLanding]
    planned_host_cold_bytes: int
    landed_host_cold_bytes: int
    planned_host_hot_bytes: int
    landed_host_hot_bytes: int
    misplaced_cold_bytes: int
    misplaced_hot_bytes: int
    est_link_bytes_per_step: int
    #: Parameters of the model that no plan group claims (name -> bytes).
    unplanned: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    format: str = REPORT_FORMAT

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}

    def save(self, path: str | os.PathLike) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> "PlacementReport":
        data = json.loads(Path(path).read_text())
        data.pop("ok", None)
        data["groups"] = [GroupLanding(**g) for g in data["groups"]]
        return cls(**data)

    def render(self) -> str:
        lines = [f"selective-offload placement report (compute device {self.compute_device}"
                 + ("; host memory is device memory here" if self.host_is_device else "") + ")"]
        head = f"{'group':<32} {'planned':<10} {'actual':<10} {'device':>11} {'host':>11}"
        lines += [head, "-" * len(head)]
        for g in self.groups:
            if g.planned == "device" and g.actual == "device":
                continue  # resident as planned; counted in the totals below
            lines.append(f"{g.group:<32} {g.planned:<10} {g.actual:<10} "
                         f"{fmt_bytes(g.device_bytes):>11} {fmt_bytes(g.host_bytes):>11}")
        resident = [g for g in self.groups if g.planned == "device" and g.actual == "device"]
        lines.append(f"{len(resident)} more groups resident on the device as planned "
                     f"({fmt_bytes(sum(g.device_bytes for g in resident))})")
        lines.append(f"cold on host: planned {fmt_bytes(self.planned_host_cold_bytes)}, "
                     f"landed {fmt_bytes(self.landed_host_cold_bytes)}; hot on host: planned "
                     f"{fmt_bytes(self.planned_host_hot_bytes)}, landed {fmt_bytes(self.landed_host_hot_bytes)}")
        for note in self.notes:
            lines.append(f"note: {note}")
        for problem in self.problems:
            lines.append(f"PLAN NOT REALISED: {problem}")
        lines.append("placement matches the plan" if self.ok else "placement does NOT match the plan")
        return "\n".join(lines)


def build_report(
    model: nn.Module,
    plan: Plan,
    *,
    compute_device: torch.device,
    host_cold_params: set[int],
    host_hot_params: set[int],
    notes: Iterable[str] = (),
    drafter: nn.Module | None = None,
    drafter_expected: bool = False,
    loaded_bytes: dict[str, int] | None = None,
) -> PlacementReport:
    """Match ``model``'s parameters to ``plan``'s groups and compare placements.

    ``host_cold_params`` / ``host_hot_params`` are the ``id()`` of parameters that the
    cold-set wrappers and the hot-layer offloader own in host memory. An MTP head is built
    by vLLM's speculative ``drafter``, under names of its own: the drafter's parameters
    (less those it shares with ``model``, such as the embedding) count for the plan's MTP
    group. With ``drafter_expected`` and no drafter yet, a missing MTP group is awaited,
    not a problem. ``loaded_bytes`` (name -> bytes) gives sizes as loaded, for parameters
    that post-processing replaced by an empty one (a weight repacked into another object).
    """
    loaded_bytes = loaded_bytes or {}

    def size(param: torch.Tensor, name: str = "") -> int:
        return max(param.numel() * param.element_size(), loaded_bytes.get(name, 0))

    segments = plan.inputs["cold_segments"]
    by_key = {}
    for p in plan.groups:
        by_key.setdefault(group_key(p.group, segments), p)
    landings = {p.group: GroupLanding(p.group, p.placement, "absent", p.bytes) for p in plan.groups}
    by_place: dict[str, dict[str, int]] = {p.group: {} for p in plan.groups}
    host_is_device = compute_device.type == "cpu"
    unplanned: dict[str, int] = {}

    def record(group: str, where: str, nbytes: int) -> None:
        landing = landings[group]
        landing.num_params += 1
        if where == "device":
            landing.device_bytes += nbytes
        else:
            landing.host_bytes += nbytes
        by_place[group][where] = by_place[group].get(where, 0) + nbytes

    # Tied weights are listed under every name, so a re-tied lm_head finds its group too.
    for name, param in model.named_parameters(remove_duplicate=False):
        nbytes = size(param, name)
        module_path = name.rsplit(".", 1)[0] if "." in name else name
        planned = by_key.get(group_key(module_path, segments))
        if planned is None:
            unplanned[name] = nbytes
            continue
        if id(param) in host_hot_params:
            where = "host-hot"
        elif id(param) in host_cold_params:
            where = "host-cold"
        elif param.device.type == "cpu" and not host_is_device:
            where = "host"  # in host memory, but not through this plan's wrappers
        else:
            where = "device"
        record(planned.group, where, nbytes)

    notes = list(notes)
    mtp_group = next((p.group for p in plan.groups if p.mtp), None)
    if drafter is not None:
        shared = {id(p) for p in model.parameters()}
        own = [(n, p) for n, p in drafter.named_parameters() if id(p) not in shared]
        if mtp_group is None:
            unplanned.update({f"drafter.{n}": size(p) for n, p in own})
        for _, param in own if mtp_group else ():
            record(mtp_group, "host-cold" if id(param) in host_cold_params else "device", size(param))
        if mtp_group and landings[mtp_group].planned == "absent":
            notes.append(f"the speculative drafter loaded {mtp_group}, which the plan left out "
                         "(plan with --speculative mtp to count it)")

    problems: list[str] = []
    misplaced = {"host-cold": 0, "host-hot": 0}
    landed = {"host-cold": 0, "host-hot": 0}
    wrong: dict[str, list[str]] = {"host-cold": [], "host-hot": []}
    stray_host = 0
    for g in landings.values():
        places = by_place[g.group]
        if places:
            g.actual = max(places, key=places.get)
        for kind in misplaced:
            landed[kind] += places.get(kind, 0)
            off = (sum(places.values()) - places.get(kind, 0)) if g.planned == kind else places.get(kind, 0)
            if off:
                misplaced[kind] += off
                wrong[kind].append(g.group)
        stray_host += places.get("host", 0)
        if g.group == mtp_group and g.num_params == 0 and drafter is None:
            if g.planned != "absent":
                notes.append(f"{g.group} is loaded by the speculative drafter"
                             + ("" if drafter_expected else ", and this engine runs without one"))
        elif g.planned != "absent" and g.num_params == 0 and g.planned_bytes:
            problems.append(f"group {g.group} ({g.planned_bytes / GB:.3f} GB, planned {g.planned}) "
                            "is not in the loaded model")
    for kind, planned_bytes, label in (
        ("host-cold", plan.host_cold_bytes, "cold"),
        ("host-hot", plan.host_hot_bytes, "hot"),
    ):
        if misplaced[kind] > TOLERANCE * planned_bytes:
            problems.append(
                f"{misplaced[kind] / GB:.3f} GB of {label} bytes did not land where planned "
                f"(more than {TOLERANCE:.0%} of the {planned_bytes / GB:.3f} GB planned): "
                f"{', '.join(wrong[kind][:6])}{' ...' if len(wrong[kind]) > 6 else ''}"
            )
    if stray_host > TOLERANCE * max(plan.host_cold_bytes + plan.host_hot_bytes, 1):
        problems.append(f"{stray_host / GB:.3f} GB are in host memory without the plan "
                        "(is vLLM's own cpu_offload_gb set as well?)")
    return PlacementReport(
        model_fingerprint=plan.model["fingerprint"],
        compute_device=str(compute_device),
        host_is_device=host_is_device,
        groups=list(landings.values()),
        planned_host_cold_bytes=plan.host_cold_bytes,
        landed_host_cold_bytes=landed["host-cold"],
        planned_host_hot_bytes=plan.host_hot_bytes,
        landed_host_hot_bytes=landed["host-hot"],
        misplaced_cold_bytes=misplaced["host-cold"],
        misplaced_hot_bytes=misplaced["host-hot"],
        est_link_bytes_per_step=sum(p.est_link_bytes_per_step for p in plan.groups
                                    if landings[p.group].actual.startswith("host")),
        unplanned=unplanned,
        problems=problems,
        notes=notes,
    )


def check_plan_matches(plan: Plan, group_names: Iterable[str], where: str) -> None:
    """Raise :class:`PlanError` when ``plan`` was made for a model with other group names."""
    actual = set(group_names)
    planned = {g.group for g in plan.groups}
    if actual == planned:
        return
    missing = sorted(planned - actual)
    extra = sorted(actual - planned)
    raise PlanError(
        f"the plan was made for another model ({plan.model['source']}, fingerprint "
        f"{plan.model['fingerprint']}) than {where}: "
        + (f"{len(missing)} planned group(s) are not in it (first: {missing[0]})" if missing else "")
        + ("; " if missing and extra else "")
        + (f"{len(extra)} of its group(s) are not in the plan (first: {extra[0]})" if extra else "")
        + "; make the plan again for this model"
    )
