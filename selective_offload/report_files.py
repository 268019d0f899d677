"""Report files read as any input is: typed field by field, and the set of rank files checked.

A report file is written by the engine, but read back by whoever names it (a copy, an edit,
another release's file, a stale rank file beside a new one), so it is held to the rules a
plan is: :func:`read_fields` reads every field through :class:`jsonio.FieldReader` and
fails in one line (a ``PlanError``: the CLI's exit 2, never the "does not match" verdict
that a wrong type would otherwise reach as a crash in the table). :func:`rank_problems`
says what the rank files beside a report cannot vouch for: each rank records the world
size it ran in, so a rank with no file, a file beyond the world, or two files for one
rank is a named problem, not a silent "placement matches the plan".
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Iterable

from . import jsonio
from .errors import PlanError
from .jsonio import FieldReader

FIX = "name a report file the engine wrote (or run the engine again to write a new one)"
#: The byte counts of a report and of each group, every one an integer >= 0.
REPORT_INTS = ("planned_cold_on_host_bytes", "planned_prefetch_bytes", "planned_uva_bytes",
               "planned_host_compute_bytes",
               "loaded_cold_on_host_bytes", "loaded_prefetch_bytes", "loaded_uva_bytes", "loaded_host_compute_bytes",
               "landed_cold_on_host_bytes", "landed_prefetch_bytes", "landed_uva_bytes", "landed_host_compute_bytes",
               "misplaced_cold_bytes", "misplaced_prefetch_bytes", "misplaced_uva_bytes", "misplaced_compute_bytes",
               "unrouted_cold_bytes", "unrouted_uva_bytes", "unrouted_compute_bytes", "est_link_bytes_per_step")
GROUP_INTS = ("device_bytes", "host_bytes", "routed_bytes", "moved_bytes", "num_params")
RANK_SUMMARY_INTS = ("landed_cold_on_host_bytes", "landed_prefetch_bytes", "landed_uva_bytes",
                     "landed_host_compute_bytes")
#: A rank file is ``<report>.rank<digits>``; more digits than this is no rank of any machine.
MAX_RANK_DIGITS = 9
#: Ranks named one by one in a problem before the rest are counted.
NAMED_RANKS = 8


def _int_map(r: FieldReader, key: str) -> dict[str, int]:
    """An object of integers >= 0 (parameter name -> bytes)."""
    value = r.raw(key, {})
    if not isinstance(value, dict):
        r.bad(key, value, "an object of byte counts")
    sub = FieldReader(value, r.where, key, error=r.error, fix=r.fix)
    return {name: sub.int(name) for name in value}


def _objects(r: FieldReader, key: str) -> dict[str, dict[str, Any]]:
    """An object whose every value is an object (group -> counters)."""
    value = r.raw(key, {})
    if not isinstance(value, dict) or not all(isinstance(v, dict) for v in value.values()):
        r.bad(key, value, "an object of objects")
    return value


def _host_memory(r: FieldReader) -> dict[str, Any]:
    value = r.raw("host_memory", {})
    if value == {}:
        return {}
    h = r.child("host_memory")
    return {"policy": h.str("policy"), "reason": h.str("reason", default=""),
            "page_locked_bytes": h.int("page_locked_bytes"), "registered_bytes": h.int("registered_bytes", default=0),
            "torch_pinned_bytes": h.int("torch_pinned_bytes", optional=True), "by_purpose": _int_map(h, "by_purpose"),
            "host_bytes": h.int("host_bytes", default=0),
            "page_locked_to_host_ratio": h.number("page_locked_to_host_ratio", positive=False, optional=True),
            "resident_set_bytes": h.int("resident_set_bytes", optional=True)}


def _optional_str(r: FieldReader, key: str) -> str | None:
    value = r.raw(key, None)
    if value is not None and not isinstance(value, str):
        r.bad(key, value, "a string or null")
    return value


def _rank_summary(r: FieldReader) -> dict[str, Any]:
    return {"ok": r.bool("ok"), **{k: r.int(k, default=0) for k in RANK_SUMMARY_INTS},
            "problems": list(r.str_list("problems", default=[])), "error": _optional_str(r, "error")}


def _group(r: FieldReader) -> dict[str, Any]:
    return {"group": r.str("group", nonempty=True), "planned": r.str("planned"), "actual": r.str("actual"),
            "planned_bytes": r.int("planned_bytes"), **{k: r.int(k, default=0) for k in GROUP_INTS},
            "mechanism": r.str("mechanism", default="")}


def read_fields(data: Any, where: str, report_format: str) -> dict[str, Any]:
    """The keyword arguments of a ``LandingReport`` (groups as dicts of ``GroupLanding``'s),
    every field checked for its type and range; ``PlanError`` in one line otherwise."""
    where = where[:300]
    r = FieldReader(data, where, error=PlanError, fix=FIX)
    found = r.raw("format", None)
    if found != report_format:
        raise PlanError(f"{where}: not a landing report of this selective-offload (format "
                        f"{jsonio.json_type(found) if not isinstance(found, str) else repr(found[:60])}, "
                        f"not {report_format!r}); {FIX}")
    r.raw("ok", None)  # derived: recomputed from the problems and the error
    groups = r.raw("groups", [])
    if not isinstance(groups, list):
        r.bad("groups", groups, "a list of groups")
    ranks = _objects(r, "ranks")
    fields = {
        "model_fingerprint": r.str("model_fingerprint"), "compute_device": r.str("compute_device"),
        "host_is_device": r.bool("host_is_device"),
        "groups": [_group(FieldReader(g, where, f"groups[{i}]", error=PlanError, fix=FIX))
                   for i, g in enumerate(groups)],
        **{k: r.int(k, default=0) for k in REPORT_INTS},
        "unplanned": _int_map(r, "unplanned"), "transfers": _objects(r, "transfers"),
        "transfers_as_of": r.str("transfers_as_of", default="load"),
        "routing": dict(r.object("routing", default={})),
        "problems": list(r.str_list("problems", default=[])), "notes": list(r.str_list("notes", default=[])),
        "error": _optional_str(r, "error"),
        "ranks": {k: _rank_summary(FieldReader(v, where, f"ranks.{k}", error=PlanError, fix=FIX))
                  for k, v in ranks.items()},
        "on_other_ranks": list(r.str_list("on_other_ranks", default=[])),
        "host_memory": _host_memory(r), "format": report_format,
        # Reports written before the world size was recorded read as "unknown".
        "world_size": r.int("world_size", minimum=1, optional=True),
    }
    fields["notes"] += r.unknown()
    return fields


# --------------------------------------------------------------------------- rank files

_RANK_NAME = re.compile(r"\.rank([0-9]+)\Z")


def rank_files(path: str | os.PathLike) -> list[tuple[int | None, Path]]:
    """Every ``<report>.rank<digits>`` beside the report, as (rank, path), in rank order;
    the rank is ``None`` where the digits are too many to be one."""
    base = Path(path)
    found: list[tuple[int | None, Path]] = []
    try:
        names = os.listdir(base.parent if str(base.parent) else ".")
    except OSError:
        return []
    for name in names:
        match = _RANK_NAME.fullmatch(name[len(base.name):]) if name.startswith(base.name) else None
        if match:
            digits = match.group(1)
            found.append((int(digits) if len(digits) <= MAX_RANK_DIGITS else None, base.parent / name))
    return sorted(found, key=lambda f: (f[0] is None, f[0] or 0, f[1].name))


def _listed(ranks: Iterable[int], count: int) -> str:
    ranks = list(ranks)
    return ", ".join(map(str, ranks)) + (f" and {count - len(ranks)} more" if count > len(ranks) else "")


def _files(base: Path, ranks: list[int], count: int) -> str:
    """The rank files of ``ranks`` by name, and is/are for the sentence."""
    names = ", ".join(f"{base.name}.rank{k}" for k in ranks)
    return names + (f" and {count - len(ranks)} more are" if count > len(ranks) else " is" if count == 1 else " are")


def _missing(world: int, present: set[int]) -> tuple[list[int], int]:
    """The first ranks in 1..world-1 with no file, and how many there are (without walking
    a world of 2**53 ranks that a hostile file may state)."""
    named, k = [], 1
    while k < world and len(named) < NAMED_RANKS:
        if k not in present:
            named.append(k)
        k += 1
    return named, (world - 1) - len({p for p in present if 1 <= p < world})


def rank_problems(base: Path, world_sizes: list[tuple[int | None, Path, int | None]],
                  base_world: int | None) -> list[str]:
    """What the set of rank files cannot vouch for. ``world_sizes`` holds each rank file's
    (rank, path, recorded world size); ``base_world`` is rank 0's (``None``: not recorded,
    a report of an older release)."""
    problems: list[str] = []
    by_rank: dict[int, list[str]] = {0: [base.name]}
    for k, p, _ in world_sizes:
        if k is None:
            problems.append(f"{p.name[:120]} is no rank file a worker writes (a rank of that many digits); remove it")
            continue
        by_rank.setdefault(k, []).append(p.name)
        if p.name != f"{base.name}.rank{k}":
            problems.append(f"{p.name} is not a name a worker writes (rank {k} writes "
                            + (f"{base.name} itself" if k == 0 else f"{base.name}.rank{k}") + "): a copy or a "
                            "stale file, which cannot speak for the rank; remove it")
    for k, names in sorted(by_rank.items()):
        if len(names) > 1:
            problems.append(f"rank {k} has {len(names)} report files ({', '.join(names)}): which one is this "
                            "engine's is unknown; remove the stale one")
    stated = {base.name: base_world, **{p.name: w for _, p, w in world_sizes}}
    sizes = {w for w in stated.values() if w is not None}
    if len(sizes) > 1:
        problems.append("the rank files disagree on the world size ("
                        + ", ".join(f"{name}: {w}" for name, w in stated.items() if w is not None)
                        + "): they are not from one engine")
    present = {k for k in by_rank if k}
    world = max(sizes) if sizes else None
    if world is not None:
        named, count = _missing(world, present)
        if count:
            problems.append(f"{'rank' if count == 1 else 'ranks'} {_listed(named, count)} of the world of {world} "
                            f"wrote no report ({_files(base, named, count)} missing): "
                            f"{'its' if count == 1 else 'their'} placement is unknown")
        beyond = sorted(k for k in present if k >= world)
        if beyond:
            problems.append(f"{'rank' if len(beyond) == 1 else 'ranks'} {_listed(beyond[:NAMED_RANKS], len(beyond))} "
                            f"beyond the world of {world} ({_files(base, beyond[:NAMED_RANKS], len(beyond))} "
                            "a previous engine's); remove them")
    elif present:  # an older release's reports: the highest rank says the world was at least that large
        named, count = _missing(max(present) + 1, present)
        if count:
            problems.append(f"{'rank' if count == 1 else 'ranks'} {_listed(named, count)} wrote no report "
                            f"({_files(base, named, count)} missing, rank {max(present)}'s is there): "
                            f"{'its' if count == 1 else 'their'} placement is unknown")
    return problems
