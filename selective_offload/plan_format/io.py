"""Plans in and out of JSON: reading with bounds, the format's versions, writing, files.

Users edit plans by hand, and plans travel between machines and releases, so reading one
is a validation, not a deserialisation: every field goes through
:class:`~selective_offload.jsonio.FieldReader` (types, ranges, enums; one
:class:`PlanError` line naming the file, the field and the fix), what can be derived is
recomputed rather than read (estimates, each group's link and VRAM reads), and the plan
read is put through :mod:`.checks` before it is returned. Fields this version does not know
are ignored with a note; a newer format version is refused with "upgrade or re-plan", an
older one with "plan again" (no release has shipped an older format, so none is translated).

The format (``"format": "selective-offload/plan-v5"``) is documented in docs/reference/plan-format.md. It
gives each group a ``role`` (``hot``, ``cold``, ``absent``), a ``location`` (``device``,
``host``, ``absent``) apart from its ``serving`` (``resident``, ``gather``, ``on-demand``,
``prefetch``, ``uva``, ``none``; gather vs on-demand follows from the group and is
checked), names the kind of a whole embedding, tower, projector or MTP head
``component``, and keys vLLM's baselines by its settings (``vllm_cpu_offload_gb``,
``vllm_cpu_offload_params``). Routed experts of a MoE layer are a group of their own (kind
``experts``, with ``num_experts`` and ``experts_per_token``). A plan with routed experts
served ``compute`` (host-compute)
holds ``host_compute``: the CPU kernel's format, stored, and the crossover, threads and rates
it was priced at, derived from the inputs and the groups and checked when read (a plan
without it reads as ``host_compute`` None). A plan may also hold groups of kind ``mlp``
(``model.layers.N.mlp``: the MLP of a dense layer, always served ``compute``, its layer
group holding the rest); a plan without them keeps every dense layer whole. A plan names
the estimate model its ``est`` figures come from (``est_model``,
:data:`~.parts.EST_MODEL`); the figures are made anew when it is read. Writing is the mirror
of reading, kept beside it so a new field is added to both in one place. The functions
that make a ``Plan`` take its class as an argument, so this module never imports
:mod:`.document`, whose methods call it.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import MISSING, fields, replace
from enum import Enum
from pathlib import Path
from typing import Any, Mapping, TypeVar

from .. import jsonio
from ..acceptance import DEFAULT_ACCEPT_RATE
from ..errors import PlanError, UserError
from ..jsonio import FieldReader
from ..kv_model import KvModel
from ..outputs import write_files
from .checks import check_derived, check_groups, check_host_compute, check_strategy, check_totals, check_vllm_baselines
from .contents import TOTALS, PlanContents
from .inputs import PlanInputs
from .parts import EST_MODEL, Alternative, Estimate, GroupPlan, HostCompute, PlannedModel, VllmBaseline, cold_serving
from .vocabulary import (
    COLD_SERVINGS,
    FORMAT_PREFIX,
    FORMAT_VERSION,
    LAYER_INDEX_KINDS,
    MAX_PLAN_INT,
    MAX_PLAN_NUMBER,
    PLAN_FORMAT,
    REPLAN,
    SERVING_LOCATION,
    GroupKind,
    Location,
    Role,
    Serving,
    Strategy,
)

P = TypeVar("P", bound=PlanContents)

#: A format version of more digits than this is refused before it is converted.
MAX_VERSION_DIGITS = 6


def plan_reader(data: Any, where: str, path: str = "") -> FieldReader:
    """The typed reader of one JSON object of a plan: its errors are :class:`PlanError`
    and say how to re-plan; integers and numbers are bounded as a plan's are."""
    return FieldReader(data, where, path, error=PlanError, fix=REPLAN, max_int=MAX_PLAN_INT,
                       max_number=MAX_PLAN_NUMBER)


def _int_list(value: Any, limit: int = MAX_PLAN_INT) -> bool:
    return isinstance(value, list) and all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i <= limit for i in value)


# --------------------------------------------------------------------------- reading


def format_version(data: Any, where: str) -> int:
    """The plan format version of ``data``, refusing what is not a plan or is too new."""
    fmt = data.get("format") if isinstance(data, Mapping) else None
    m = re.fullmatch(re.escape(FORMAT_PREFIX) + r"([0-9]+)", fmt) if isinstance(fmt, str) else None
    if m is None:
        raise PlanError(
            f"{where}: not a selective-offload plan (its \"format\" is {json.dumps(fmt)[:80]}, expected "
            f"\"{PLAN_FORMAT}\"); make one with `selective-offload plan MODEL --device-memory SIZE -o plan.json`"
        )
    digits = m.group(1)
    if len(digits) > MAX_VERSION_DIGITS:  # int() of thousands of digits raises, and no format is that new
        raise PlanError(f"{where}: plan format version {digits[:12]}... ({len(digits)} digits) is not one this "
                        f"selective-offload reads (v{FORMAT_VERSION}); {REPLAN}")
    version = int(digits)
    if version > FORMAT_VERSION:
        raise PlanError(
            f"{where}: plan format v{version} is newer than this selective-offload (reads "
            f"v{FORMAT_VERSION}): upgrade selective-offload or re-plan with this one"
        )
    if version < FORMAT_VERSION:
        raise PlanError(f"{where}: plan format v{version} is older than this selective-offload reads "
                        f"(v{FORMAT_VERSION}); {REPLAN}")
    return version


def _card(r: FieldReader) -> str | None:
    """The optional ``compute_capability`` (plans made before it have none)."""
    value = r.raw("compute_capability", None)
    if value is not None and not isinstance(value, str):
        r.bad("compute_capability", value, "null or a string like \"8.9\"")
    return value


def read_inputs(r: FieldReader) -> tuple[PlanInputs, list[str]]:
    speculative = r.raw("speculative", None)
    if speculative not in (None, "mtp"):
        r.bad("speculative", speculative, "null or \"mtp\"")
    inputs = PlanInputs(
        device_memory_bytes=r.int("device_memory_bytes", minimum=1),
        kv_cache_bytes=r.int("kv_cache_bytes"),
        reserve_bytes=r.int("reserve_bytes"),
        link_gbps=r.number("link_gbps", positive=True),
        vram_gbps=r.number("vram_gbps", positive=True),
        speculative=speculative,
        cold_segments=r.str_list("cold_segments"),
        prefetch_step=r.int("prefetch_step", minimum=1),
        vllm_cpu_offload_gb=r.number("vllm_cpu_offload_gb", positive=False, default=None),
        all_cold=r.bool("all_cold", default=False),
        host_memory_bytes=r.int("host_memory_bytes", minimum=1, default=None),
        host_headroom_bytes=r.int("host_headroom_bytes", default=0),
        batch=r.int("batch", minimum=1, default=1),
        spec_tokens=r.int("spec_tokens", minimum=1, default=None),
        accept_rate=r.number("accept_rate", positive=False, default=DEFAULT_ACCEPT_RATE),
        max_model_len=r.int("max_model_len", minimum=1, default=None),
        max_seqs=r.int("max_seqs", minimum=1, default=None),
        kv_cache_dtype=r.str("kv_cache_dtype", default="auto"),
        context_tokens=r.int("context_tokens", default=None),
        uva_gbps=r.number("uva_gbps", positive=True, default=None),
        compute_tflops=r.number("compute_tflops", positive=True, default=None),
        decode_read_gbps=r.number("decode_read_gbps", positive=True, default=None),
        compute_capability=_card(r),
        moe_setting=r.str("moe_setting", default="auto"),
        cpu_gbps=r.number("cpu_gbps", positive=True, default=None),
        cpu_gbps_source=r.str("cpu_gbps_source", default="assumed"),
        cpu_read_gbps=r.number("cpu_read_gbps", positive=True, default=None),
        cpu_threads=r.int("cpu_threads", minimum=1, default=None),
        cpu_tflops=r.number("cpu_tflops", positive=True, default=None),
        handoff_s=r.number("handoff_s", positive=False, default=None),
        ranks=r.int("ranks", minimum=1, default=1),
        host_compute=r.bool("host_compute", default=True),
        device_share=r.bool("device_share", default=True),
        head_share=r.bool("head_share", default=True),
        usable_device_bytes=r.int("usable_device_bytes", minimum=1, default=None),
        usable_from=r.str("usable_from", default=None, nullable=True),
        max_num_batched_tokens=r.int("max_num_batched_tokens", minimum=1, default=None),
    )
    try:
        inputs.validate()
    except PlanError as exc:
        raise PlanError(f"{r.where}: inputs: {exc}") from None
    return inputs, r.unknown()


def read_group(r: FieldReader) -> tuple[GroupPlan, list[str]]:
    name = r.str("group", nonempty=True)
    # A hostile name is never echoed whole in the messages that follow.
    r.context = f"group {name if len(name) <= 120 else name[:117] + '...'}"
    kind = r.choice("kind", GroupKind)
    layer_index = r.int("layer_index", default=None)
    if (kind in LAYER_INDEX_KINDS) != (layer_index is not None):
        r.fail(f"kind is {kind} but layer_index is {json.dumps(layer_index)}; a group of kind "
               f"{' or '.join(sorted(LAYER_INDEX_KINDS))}, and only such a group, has a layer_index")
    r.seen.update({"est_link_bytes_per_step", "est_vram_bytes_per_step"})  # derived
    read = r.int("est_read_bytes_per_step")
    dtype_bytes = r.raw("dtype_bytes", {})
    if not isinstance(dtype_bytes, Mapping) or not all(
            isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 0
            for k, v in dtype_bytes.items()):
        r.bad("dtype_bytes", dtype_bytes, "an object of dtype -> bytes (integers >= 0)")
    dims = r.raw("kernel_dims", [])
    if not (isinstance(dims, list) and len(dims) in (0, 2) and _int_list(dims) and all(d > 0 for d in dims)):
        r.bad("kernel_dims", dims, "[H, I]: two sizes > 0 (or leave it out)")
    digest = r.raw("shapes_digest", None)
    if digest is not None and not isinstance(digest, str):
        r.bad("shapes_digest", digest, "a string or null")
    role, serving = r.choice("role", Role), read_serving(r)
    if serving in COLD_SERVINGS and serving != cold_serving(name, kind):
        r.fail(f"serving is {serving}, but a {role} {kind} group on the host is served {cold_serving(name, kind)} "
               "(an embedding or table: gather; a tower, projector or other component: on-demand)")
    group = GroupPlan(
        group=name, kind=kind, role=role, serving=serving,
        reason=r.str("reason", default=""), bytes=r.int("bytes"), layer_index=layer_index,
        est_read_bytes_per_step=read, mtp=r.bool("mtp", default=False),
        num_tensors=r.int("num_tensors", default=0), dtype_bytes=dict(dtype_bytes), shapes_digest=digest,
        num_experts=r.int("num_experts", default=0), experts_per_token=r.int("experts_per_token", default=0),
        device_experts=r.int("device_experts", default=0),
        device_expert_ids=r.int_list("device_expert_ids", default=[]),
        est_device_hit_rate=r.number("est_device_hit_rate", optional=True, minimum=0.0, maximum=1.0),
        device_channels=r.int("device_channels", default=0), intermediate=r.int("intermediate", default=0),
        kernel_dims=tuple(dims), post_processing_bytes=r.int("post_processing_bytes", default=0),
    )
    return group, r.unknown()


def read_serving(r: FieldReader) -> Serving:
    """A group's serving, and its location, which must be where that serving keeps it."""
    serving, location = r.choice("serving", Serving), r.choice("location", Location)
    if SERVING_LOCATION[serving] != location:
        r.fail(f"location is {location}, but a group served {serving} lives in "
               f"{SERVING_LOCATION[serving]} (device: resident; host: gather, on-demand, prefetch, uva; "
               "absent: none)")
    return serving


def read_estimate(r: FieldReader) -> Estimate:
    values = {}
    for f in fields(Estimate):
        value = r.raw(f.name, f.default if f.default is not MISSING else ...)
        if (isinstance(value, bool) or not isinstance(value, (int, float))
                or not jsonio.finite_number(value, MAX_PLAN_NUMBER) or value < 0):
            r.bad(f.name, value, f"a finite number >= 0 and at most {MAX_PLAN_NUMBER:g}")
        values[f.name] = float(value)
    return Estimate(**values)


def read_vllm_baseline(r: FieldReader) -> VllmBaseline:
    touched = r.raw("layers_touched")
    if not _int_list(touched):
        r.bad("layers_touched", touched, "a list of layer indices")
    return VllmBaseline(cpu_offload_gb=r.number("cpu_offload_gb", positive=False),
                        offloaded_bytes=r.int("offloaded_bytes"),
                        offloaded_tensors=r.int("offloaded_tensors"), layers_touched=tuple(touched),
                        device_bytes=r.int("device_bytes", minimum=None), fits=r.bool("fits"),
                        est=read_estimate(r.child("est")),
                        cpu_offload_params=r.str_list("cpu_offload_params", default=[]))


def read_model(r: FieldReader) -> tuple[PlannedModel, list[str]]:
    kv = r.raw("kv", None)
    if kv is not None:
        kr = r.child("kv")
        sliding = kr.raw("sliding", [])
        if not isinstance(sliding, list) or not all(_int_list(w) and len(w) == 2 for w in sliding):
            kr.bad("sliding", sliding, "a list of [window, bytes per token] pairs")
        kv = KvModel(kr.int("full_bytes_per_token", default=0), tuple(tuple(w) for w in sliding),
                     kr.int("fixed_bytes_per_seq", default=0), kr.str("description", default=""))
    model = PlannedModel(source=r.str("source"), kind=r.str("kind", default="safetensors"),
                         architectures=r.str_list("architectures", default=[]),
                         fingerprint=r.str("fingerprint", nonempty=True), num_tensors=r.int("num_tensors"),
                         total_bytes=r.int("total_bytes"), tie_word_embeddings=r.bool("tie_word_embeddings"),
                         num_hidden_layers=r.int("num_hidden_layers", default=None),
                         num_mtp_layers=r.int("num_mtp_layers", default=0),
                         kv=kv)
    return model, r.unknown()


def read_alternative(r: FieldReader) -> Alternative:
    hot = r.raw("hot_layer_indices")
    if not _int_list(hot):
        r.bad("hot_layer_indices", hot, "a list of layer indices")
    return Alternative(label=r.str("label"), strategy=r.choice("strategy", Strategy),
                       cold_on_host_bytes=r.int("cold_on_host_bytes"), prefetch_bytes=r.int("prefetch_bytes"),
                       hot_layer_indices=tuple(hot), est=read_estimate(r.child("est")),
                       uva_bytes=r.int("uva_bytes", default=0),
                       host_compute_bytes=r.int("host_compute_bytes", default=0))


#: The fields of a plan's ``host_compute`` object that reading recomputes and compares.
HOST_COMPUTE_FIELDS = tuple(f.name for f in fields(HostCompute))


#: How each stated field of ``host_compute`` is read: its type and range, as the reader
#: checks every other field of a plan (a crossover written as the string "308" is refused
#: naming the field, not compared with the 308 it derives).
HOST_COMPUTE_READERS = {
    "crossover_tokens": lambda r, n: r.int(n),
    "head_crossover_tokens": lambda r, n: r.int(n, nullable=True),
    "threads": lambda r, n: r.int(n, minimum=1, nullable=True),
    "ranks": lambda r, n: r.int(n, minimum=1),
    "cpu_gbps": lambda r, n: r.number(n, positive=True),
    "cpu_tflops": lambda r, n: r.number(n, positive=True),
    "handoff_s": lambda r, n: r.number(n),
    "cpu_gbps_source": lambda r, n: r.str(n, nonempty=True),
    "cpu_tflops_source": lambda r, n: r.str(n, nonempty=True),
    "handoff_source": lambda r, n: r.str(n, nonempty=True),
    "overlap": lambda r, n: r.str(n, nonempty=True),
}


def read_host_compute(r: FieldReader) -> tuple[str, dict[str, Any]]:
    """A plan's ``host_compute`` object: the CPU kernel's format, and what else it states,
    each field read by its type (every other field is derived from the inputs and the groups,
    and checked against them)."""
    fmt = r.str("format", nonempty=True)
    stated: dict[str, Any] = {}
    for name in HOST_COMPUTE_FIELDS:
        if name == "format" or name not in r.data:
            continue
        stated[name] = HOST_COMPUTE_READERS[name](r, name)
    r.unknown()
    return fmt, stated


def plan_from_dict(cls: type[P], data: Any, where: str = "plan") -> P:
    """The plan (of class ``cls``) that the JSON object ``data`` holds, read field by field
    and checked: groups, derived bounds, vLLM's baselines, stated totals, strategy."""
    format_version(data, where)
    top = plan_reader(data, where, "")
    top.seen.add("format")
    model, notes = read_model(top.child("model"))
    inputs, more = read_inputs(top.child("inputs"))
    notes += more
    groups_raw = top.raw("groups")
    if not isinstance(groups_raw, list) or not groups_raw:
        top.bad("groups", groups_raw, "a non-empty list of groups")
    groups = []
    for i, raw in enumerate(groups_raw):
        group, more = read_group(plan_reader(raw, where, f"groups[{i}]"))
        groups.append(group)
        notes += more
    hot = top.raw("hot_layer_indices")
    if not _int_list(hot):
        top.bad("hot_layer_indices", hot, "a list of layer indices")
    gb_key, segments_key = "vllm_cpu_offload_gb", "vllm_cpu_offload_params"
    gb_raw = top.raw(gb_key, None)
    alternative_raw = top.raw("alternative", None)
    segments_raw = top.raw(segments_key, None)
    host_raw = top.raw("host_compute", None)
    fmt, stated_host = (None, {}) if host_raw is None else read_host_compute(top.child("host_compute"))
    plan = cls(
        model=model, inputs=inputs, strategy=top.choice("strategy", Strategy), groups=tuple(groups),
        hot_layer_indices=tuple(hot), est_transient_device_bytes=top.int("est_transient_device_bytes"),
        vllm_cpu_offload_gb=None if gb_raw is None else read_vllm_baseline(top.child(gb_key)),
        notes=top.str_list("notes", default=[]),
        stored_prefetch_buffer_bytes=top.int("prefetch_buffer_bytes", default=None),
        est_vllm_workspace_bytes=top.int("est_vllm_workspace_bytes", default=0),
        est_load_transient_device_bytes=top.int("est_load_transient_device_bytes", default=0),
        alternative=None if alternative_raw is None else read_alternative(top.child("alternative")),
        vllm_cpu_offload_params=None if segments_raw is None else read_vllm_baseline(top.child(segments_key)),
        host_compute_format=fmt,
    )
    # derived: recomputed from the groups; the estimate model named says how they were made,
    # and they are made anew here
    top.str("est_model", default=EST_MODEL)
    top.seen.add("est")
    check_groups(plan, where)
    check_host_compute(plan, stated_host, where)
    check_derived(plan, where)
    check_vllm_baselines(plan, where)
    totals = stored_totals(top)
    ledger = totals.pop("ledger", None)
    check_totals(plan, totals, where)
    check_ledger(plan, ledger, where)
    check_strategy(plan, where)
    notes += top.unknown()
    return with_load_notes(plan, notes)


def stored_totals(top: FieldReader) -> dict[str, int]:
    """The totals a plan file states, to check against the groups."""
    if "totals" not in top.data:
        return {}
    r = top.child("totals")
    out: dict[str, Any] = {n: r.int(n, minimum=None) for n in TOTALS if n in r.data}
    if "ledger" in r.data:
        out["ledger"] = r.raw("ledger")
    return out


def check_ledger(plan: PlanContents, stated: Any, where: str) -> None:
    """A plan file's ``totals.ledger`` (derived, written for readers and the worker's
    pre-flight) is the one its groups and inputs give: every line, by name, where and bytes."""
    if stated is None:
        return
    derived = ledger_to_list(plan)
    if stated != derived:
        wrong = next((d for d in derived if d not in (stated if isinstance(stated, list) else [])), None)
        what = (f"its line {wrong['name']!r} is {wrong['bytes']} bytes of {wrong['where']} memory"
                if wrong else "it holds lines the plan does not make")
        raise PlanError(f"{where}: totals.ledger disagrees with the groups ({what}); delete the \"totals\" object to "
                        f"accept the groups as they are, or {REPLAN}")


def ledger_to_list(plan: PlanContents) -> list[dict[str, Any]]:
    return [{"name": line.name, "where": line.where, "bytes": line.bytes} for line in plan.ledger()]


def with_load_notes(plan: P, notes: list[str]) -> P:
    return replace(plan, load_notes=tuple(notes)) if notes else plan


def checked_plan(cls: type[P], plan: PlanContents, where: str = "the Plan object") -> P:
    """``plan`` validated as a plan file is: written out and read back through the same
    typed reader (types, enums, bounds, derived quantities), so a Plan built or edited
    in Python gets no fewer checks than a file, and its errors name it, not a copy."""
    try:
        data = jsonio.parse(json.dumps(plan_to_dict(plan, derived=False), allow_nan=False, default=_not_json))
    except (TypeError, ValueError, AttributeError, ArithmeticError, KeyError) as exc:
        raise PlanError(f"{where}: is not a well-formed plan ({str(exc).splitlines()[0][:120]}); build it "
                        "with make_plan() or Plan.load(), or " + REPLAN) from None
    read = plan_from_dict(cls, data, where=where)
    return with_load_notes(read, list(plan.load_notes) + list(read.load_notes))


def load_plan(cls: type[P], path: str | os.PathLike) -> P:
    path = Path(path)
    try:
        data = jsonio.read(path)
    except OSError as exc:
        raise PlanError(f"{path}: cannot read the plan: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise PlanError(f"{path}: the plan is not valid JSON ({exc}); {REPLAN}") from None
    return plan_from_dict(cls, data, where=str(path))


def plan_from_text(cls: type[P], text: str | bytes, where: str) -> P:
    """The plan a file's text holds, read as :func:`load_plan` reads a file (the same size
    bound, parser and typed reader)."""
    raw = text.encode() if isinstance(text, str) else text
    if len(raw) > jsonio.MAX_FILE_BYTES:
        raise PlanError(f"{where}: the plan is not valid JSON (larger than {jsonio.MAX_FILE_BYTES} bytes); {REPLAN}")
    try:
        data = jsonio.parse(raw)
    except ValueError as exc:
        raise PlanError(f"{where}: the plan is not valid JSON ({exc}); {REPLAN}") from None
    return plan_from_dict(cls, data, where=where)


def _not_json(value: Any) -> Any:
    if isinstance(value, Enum):
        return value.value
    raise TypeError(f"{type(value).__name__} {value!r} is not a plan value")


# --------------------------------------------------------------------------- writing


def inputs_to_dict(inputs: PlanInputs) -> dict[str, Any]:
    return {f.name: (list(v) if isinstance(v := getattr(inputs, f.name), tuple) else v) for f in fields(inputs)}


def group_to_dict(group: GroupPlan) -> dict[str, Any]:
    out = {f.name: getattr(group, f.name) for f in fields(group)}
    # an unchecked value of a Plan built in Python is written as it is, for the reader to refuse
    out["location"] = group.location if group.serving in Serving.values() else None
    out["dtype_bytes"] = dict(group.dtype_bytes)
    out["device_expert_ids"] = list(group.device_expert_ids)
    for name in ("device_experts", "device_expert_ids", "device_channels", "intermediate", "post_processing_bytes"):  # only when not 0
        if not out[name]:
            del out[name]
    if group.est_device_hit_rate is None:  # only where a routing profile priced it
        del out["est_device_hit_rate"]
    if group.kernel_dims:  # only a host-compute group
        out["kernel_dims"] = list(group.kernel_dims)
    else:
        del out["kernel_dims"]
    out["est_link_bytes_per_step"] = group.est_link_bytes_per_step
    out["est_vram_bytes_per_step"] = group.est_vram_bytes_per_step
    return out


def vllm_baseline_to_dict(baseline: VllmBaseline) -> dict[str, Any]:
    return {**{f.name: getattr(baseline, f.name) for f in fields(baseline)},
            "layers_touched": list(baseline.layers_touched), "est": baseline.est.__dict__.copy(),
            "cpu_offload_params": list(baseline.cpu_offload_params)}


def model_to_dict(model: PlannedModel) -> dict[str, Any]:
    return {**{f.name: getattr(model, f.name) for f in fields(model)}, "architectures": list(model.architectures),
            "kv": None if model.kv is None else model.kv.to_dict()}


def alternative_to_dict(alternative: Alternative) -> dict[str, Any]:
    return {**{f.name: getattr(alternative, f.name) for f in fields(alternative)},
            "hot_layer_indices": list(alternative.hot_layer_indices), "est": alternative.est.__dict__.copy()}


def _host_compute_to_dict(plan: PlanContents, derived: bool) -> dict[str, Any] | None:
    """The ``host_compute`` object: the format, and (``derived``) what follows from it."""
    if plan.host_compute_format is None:
        return None
    record = plan.host_compute if derived else None
    if record is None:
        return {"format": plan.host_compute_format}
    return {f.name: getattr(record, f.name) for f in fields(record)}


def plan_to_dict(plan: PlanContents, *, derived: bool = True) -> dict[str, Any]:
    """The plan as its JSON object; ``derived=False`` leaves out what is computed from
    the fields (totals, estimates), so a plan of unchecked values can be written out to
    be checked."""
    return {
        "format": PLAN_FORMAT,
        "model": model_to_dict(plan.model),
        "inputs": inputs_to_dict(plan.inputs),
        "strategy": plan.strategy,
        "hot_layer_indices": list(plan.hot_layer_indices),
        "est_transient_device_bytes": plan.est_transient_device_bytes,
        "prefetch_buffer_bytes": plan.prefetch_buffer_bytes if derived else plan.stored_prefetch_buffer_bytes,
        **({"est_vllm_workspace_bytes": plan.est_vllm_workspace_bytes} if plan.est_vllm_workspace_bytes else {}),
        **({"est_load_transient_device_bytes": plan.est_load_transient_device_bytes}
           if plan.est_load_transient_device_bytes else {}),
        **({"totals": {**plan.totals(), "ledger": ledger_to_list(plan)}, "est": plan.est.__dict__.copy()}
           if derived else {}),
        **{name: None if (b := getattr(plan, name)) is None else vllm_baseline_to_dict(b)
           for name in ("vllm_cpu_offload_gb", "vllm_cpu_offload_params")},
        "alternative": None if plan.alternative is None else alternative_to_dict(plan.alternative),
        "host_compute": _host_compute_to_dict(plan, derived),
        "est_model": EST_MODEL,
        "notes": list(plan.notes),
        "groups": [group_to_dict(g) for g in plan.groups],
    }


def plan_to_json(plan: PlanContents) -> str:
    """The plan as strict JSON (no NaN or Infinity: every number a plan holds is bounded)."""
    return jsonio.dumps(plan_to_dict(plan)) + "\n"


def writable_json(plan: PlanContents, where: str) -> str:
    """The plan's JSON, once it is known to read back: read through :func:`plan_from_text`,
    the reader's own bounds (integers to :data:`MAX_PLAN_INT`, numbers to
    :data:`MAX_PLAN_NUMBER`, the file size, the checks), so no file written is one the
    reader refuses. A model beyond them (10**9 experts, sizes past 2**53 bytes) is refused
    here, in one line naming ``where`` (the model) and the field, before anything is written."""
    text = plan_to_json(plan)
    try:
        plan_from_text(type(plan), text, where="")
    except PlanError as exc:
        problem = str(exc).removeprefix(": ").removesuffix("; " + REPLAN)
        raise PlanError(f"{where}: the model is beyond what a plan file holds ({problem[:300]}), so no plan is "
                        "written: this selective-offload plans models whose sizes and counts fit the plan "
                        "format") from None
    return text


def save_plan(plan: PlanContents, path: str | os.PathLike) -> None:
    text = writable_json(plan, where=plan.model.source[:200])
    try:
        write_files([("the plan", path, text.encode(), "plan")])
    except UserError as exc:
        raise PlanError(str(exc)) from None
