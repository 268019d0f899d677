"""The probe's profile: what ``selective-offload probe`` measured on one machine, as a file.

:class:`Profile` is the schema (one frozen dataclass, each field's unit in its name) with
its serialisation, its reading, the lines it prints, and the values it supplies to
planning (:func:`plan_defaults`). It lives in ``~/.cache/selective-offload/profile.json``
by default (``$SELECTIVE_OFFLOAD_PROFILE`` moves it). :mod:`.measurements` makes one,
:mod:`.command` writes and prints one, :mod:`.planning` turns one into a plan's bandwidths
and the note naming where they came from. The rendering stays with the schema because
the lines it prints are the fields and the flags :func:`plan_defaults` supplies.

Rates are decimal GB/s (10^9 bytes per second), as links and memories are quoted; each
is the one of the largest size measured, and the per-size medians are kept
(``*_samples_s``: bytes -> median seconds) so a reader can see whether it had levelled off.

Reading a profile is a validation: a file that is not JSON, has another format, lacks a
field or holds a value that cannot be (a negative bandwidth, more free memory than total)
is one :class:`UserError` line naming the file.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import shlex
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Mapping

from .. import jsonio
from ..errors import UserError, cut
from ..sizes import GB, MAX_BYTES, MAX_GBPS, MIN_GBPS, size_arg
from .formats import fmt_gib, fmt_rate, fmt_size, largest_size

PROFILE_FORMAT = "selective-offload/profile-v1"
#: The environment variable that names the profile file.
PROFILE_ENV = "SELECTIVE_OFFLOAD_PROFILE"

#: What the VRAM and host-memcpy rates count: the bytes read plus the bytes written.
COPY_BYTES_COUNTED = "read+write"
#: The measurements whose per-size medians a profile keeps.
SAMPLE_KINDS = ("h2d_pinned", "h2d_pageable", "d2d", "host_memcpy", "uva_read")

REPROBE = "run `selective-offload probe` again, or delete the file"
#: A profile is a few kilobytes; a file larger than this is not one (and is not read past it).
MAX_PROFILE_BYTES = 1_000_000


# --------------------------------------------------------------------------- the profile


@dataclass(frozen=True)
class Profile:
    """What ``selective-offload probe`` measured on one machine. Bandwidths are decimal GB/s;
    a field is ``None`` where this machine has no such thing (no GPU: no link, no VRAM)."""

    machine: str
    date: str
    torch_version: str
    device: str | None
    integrated: bool
    link_gbps_pinned: float | None
    link_gbps_pageable: float | None
    vram_gbps: float | None
    device_memory_total_bytes: int | None
    device_memory_free_bytes: int | None
    host_memcpy_gbps: float | None
    no_link_reason: str | None
    #: Per measurement (``h2d_pinned``, ``h2d_pageable``, ``d2d``, ``host_memcpy``): copy
    #: size in bytes -> median seconds of one copy.
    h2d_pinned_samples_s: Mapping[int, float] = field(default_factory=dict, hash=False)
    h2d_pageable_samples_s: Mapping[int, float] = field(default_factory=dict, hash=False)
    d2d_samples_s: Mapping[int, float] = field(default_factory=dict, hash=False)
    host_memcpy_samples_s: Mapping[int, float] = field(default_factory=dict, hash=False)
    #: A kernel reading page-locked host memory through a UVA view: bytes / second of the
    #: largest buffer (GB/s); ``None``: not measured (no GPU, or a profile from before).
    uva_read_gbps: float | None = None
    uva_read_samples_s: Mapping[int, float] = field(default_factory=dict, hash=False)
    #: A matrix-vector product reading a bf16 weight from VRAM (GB/s, the weight counted
    #: once); ``None``: not measured.
    decode_read_gbps: float | None = None
    #: Dense matmul rate (TFLOP/s) in ``matmul_dtype``; ``None``: not measured.
    matmul_tflops: float | None = None
    matmul_dtype: str | None = None
    #: The GPU's compute capability as ``torch.cuda.get_device_capability`` spells it
    #: ("8.9"); ``None``: no GPU, or a profile from before it was recorded.
    compute_capability: str | None = None
    #: Timed copies per size (the samples are their medians); ``None``: not recorded.
    repeats: int | None = None
    #: Host-compute: the host CPU kernel's rate per format it supports (GB/s of expert
    #: weights read at batch 1, with ``cpu_threads`` threads); empty: not measured (no
    #: kernels here, or a profile from before).
    cpu_kernel_gbps: Mapping[str, float] = field(default_factory=dict, hash=False)
    #: Threads the kernel rates were measured with (physical cores of one NUMA node).
    cpu_threads: int | None = None
    #: The host's memory read rate with those threads (GB/s): what the kernels' rates are bounded by.
    host_read_gbps: float | None = None
    #: One layer's hand-off (seconds): hidden states and top-k to the host and the sum back,
    #: with the synchronisation between; ``None``: not measured (no GPU).
    handoff_s: float | None = None
    #: Made with ``--quick`` (small copies: the rates are understated).
    quick: bool = False
    #: What ``vram_gbps`` and ``host_memcpy_gbps`` count (link rates count each byte once).
    copy_bytes_counted: str = COPY_BYTES_COUNTED
    format: str = PROFILE_FORMAT

    # ---- derived
    @property
    def has_link(self) -> bool:
        return self.no_link_reason is None

    @property
    def day(self) -> str:
        """The date the probe ran (``YYYY-MM-DD``)."""
        return self.date[:10]

    def samples(self, kind: str) -> Mapping[int, float]:
        return getattr(self, f"{kind}_samples_s")

    # ---- serialisation
    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for kind in SAMPLE_KINDS:
            key = f"{kind}_samples_s"
            data[key] = {str(size): secs for size, secs in sorted(data[key].items())}
        data = {"format": data.pop("format"), **data}
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1) + "\n"

    def save(self, path: str | os.PathLike, flag: str = "--output") -> Path:
        """Write the profile as JSON (the folder is made) by the rule every output follows
        (:mod:`..outputs`): never over a file that is not a profile this project wrote, and
        replaced in one step. ``flag``: what named the path, for the messages."""
        from ..outputs import write_files

        path = Path(path).expanduser()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError:
            pass  # refused in one line by the output's checks, which name the path
        write_files([(flag, path, self.to_json().encode(), "profile")])
        return path

    @classmethod
    def from_dict(cls, data: Any, where: str = "profile") -> "Profile":
        return _read_profile(data, where)

    @classmethod
    def load(cls, path: str | os.PathLike, named_by: str | None = None) -> "Profile":
        """The profile in the file at ``path``, read through the project's one bounded JSON
        reader (:func:`jsonio.read`: a regular file only, so a FIFO is refused before it is
        opened; at most :data:`MAX_PROFILE_BYTES` read; bounded depth and numbers).
        ``named_by``: the environment variable that named the file, for the messages."""
        path = Path(path).expanduser()
        where = f"{named_by}={path}" if named_by else str(path)
        fix = f"point {named_by} at a profile `selective-offload probe` wrote, or unset it" if named_by else REPROBE
        try:
            data = jsonio.read(path, max_bytes=MAX_PROFILE_BYTES)
        except OSError as exc:  # missing, unreadable, or not a regular file (a FIFO, a directory)
            raise UserError(f"{where}: cannot read the profile: {exc.strerror or exc}; {fix}") from None
        except ValueError as exc:  # too large, not UTF-8, deep, NaN/Infinity, numbers of thousands of digits
            raise UserError(f"{where}: the profile is not valid JSON ({str(exc)[:120]}); {fix}") from None
        return cls.from_dict(data, where=where)

    # ---- for people
    def render(self) -> str:
        """The lines ``selective-offload probe`` prints."""
        lines = [f"selective-offload probe ({self.format}) on {self.date}"
                 + (": quick (small copies, rates understated)" if self.quick else "")]
        lines.append(f"  machine        {self.machine}; torch {self.torch_version}")
        if self.device is None:
            lines.append("  device         none (no GPU): the CPU is the device")
        else:
            kind = "integrated: one memory with the host" if self.integrated else "discrete"
            cc = f", compute capability {self.compute_capability}" if self.compute_capability else ""
            lines.append(f"  device         {self.device} ({kind}{cc})")
        largest = largest_size(self.h2d_pinned_samples_s) or largest_size(self.host_memcpy_samples_s)
        of = f" ({fmt_size(largest)} copies, median of {self.repeats or '?'})" if largest else ""
        if self.has_link:
            lines.append(f"  link (H2D)     {fmt_rate(self.link_gbps_pinned)} GB/s pinned, "
                         f"{fmt_rate(self.link_gbps_pageable)} GB/s pageable{of}")
        else:
            lines.append(f"  link (H2D)     none: {self.no_link_reason}")
        if self.uva_read_gbps is not None:
            of_uva = largest_size(self.uva_read_samples_s)
            ratio = (f", {self.uva_read_gbps / self.link_gbps_pinned:.2f}x the pinned copy"
                     if self.link_gbps_pinned else "")
            lines.append(f"  UVA reads      {fmt_rate(self.uva_read_gbps)} GB/s (a kernel reading "
                         f"{fmt_size(of_uva)} of page-locked host memory in place{ratio})")
        if self.vram_gbps is not None:
            lines.append(f"  VRAM           {fmt_rate(self.vram_gbps)} GB/s "
                         "(device-to-device copy, bytes read + written)")
        if self.decode_read_gbps is not None:
            lines.append(f"  decode reads   {fmt_rate(self.decode_read_gbps)} GB/s (a bf16 matrix-vector product "
                         "reading its weight once: the rate planning prices VRAM reads at)")
        if self.matmul_tflops is not None:
            lines.append(f"  matmul         {self.matmul_tflops:.3g} TFLOP/s ({self.matmul_dtype}, compute-bound size)")
        if self.device_memory_total_bytes is not None:
            free = ("" if self.device_memory_free_bytes is None
                    else f", {self.device_memory_free_bytes / GB:.2f} GB free at probe")
            lines.append(f"  device memory  {self.device_memory_total_bytes / GB:.2f} GB "
                         f"({fmt_gib(self.device_memory_total_bytes)}) total{free}")
        if self.cpu_kernel_gbps:
            rates = ", ".join(f"{fmt} {fmt_rate(gbps)}" for fmt, gbps in sorted(self.cpu_kernel_gbps.items()))
            threads = f" with {self.cpu_threads} threads" if self.cpu_threads else ""
            lines.append(f"  CPU kernels    {rates} GB/s of expert weights at batch 1{threads} (host-compute)")
            if self.quick:
                lines.append("    not for plans (quick: cache-sized layers and reads); a full probe measures them")
            elif self.host_read_gbps:
                from ..cpu_kernels.claimed import CLAIM_BAR, verdict

                kernels = sorted(self.cpu_kernel_gbps.items())
                fast = [f for f, gbps in kernels if verdict(f, gbps, self.host_read_gbps)[0]]
                lines.append("    of reads     " + ", ".join(f"{f} {gbps / self.host_read_gbps:.2f}" for f, gbps in kernels)
                             + f"; claimed fast on this host (at least {CLAIM_BAR:g}): {', '.join(fast) or 'none'}")
        if self.host_read_gbps is not None:
            lines.append(f"  host reads     {fmt_rate(self.host_read_gbps)} GB/s (the CPU reading its memory)")
        if self.handoff_s is not None:
            lines.append(f"  hand-off       {self.handoff_s * 1e6:.1f} us per layer (hidden states down, sum back)")
        if self.host_memcpy_gbps is not None:
            lines.append(f"  host memcpy    {fmt_rate(self.host_memcpy_gbps)} GB/s "
                         f"(host-to-host copy, bytes read + written){of if not self.has_link else ''}")
        for kind, counted in (("h2d_pinned", 1), ("h2d_pageable", 1), ("uva_read", 1), ("d2d", 2),
                              ("host_memcpy", 2)):
            samples = self.samples(kind)
            if samples:
                rates = ", ".join(f"{fmt_size(n)} {fmt_rate(counted * n / s / GB)}"
                                  for n, s in sorted(samples.items()))
                lines.append(f"    {kind:<14}{rates} GB/s")
        defaults = plan_defaults(self)
        if any(v is not None for v in defaults.values()):
            args = [f"{flag} {as_flag(defaults[key])}" for key, flag, as_flag, _, _ in SUPPLIED
                    if defaults[key] is not None]
            # A command that runs as printed (quoted for a POSIX shell, MODEL the one word to
            # replace); what is not a flag's value goes on the lines after it.
            command = shlex.join(["selective-offload", "plan", "MODEL", *(w for a in args for w in a.split(" "))])
            lines.append(f"  for planning   {command}")
            if defaults["cpu_kernel_gbps"]:
                lines.append("                 (--cpu-gbps: the CPU kernels' rate above for MODEL's format, which "
                             "plan takes from this profile)")
            if self.device is None:
                lines.append("                 no GPU, so no link or VRAM: give --device-memory, --link-gbps and "
                             "--vram-gbps of the target GPU")
        else:
            lines.append("  for planning   nothing: without a GPU there is no link or VRAM to measure; "
                         "give --device-memory, --link-gbps and --vram-gbps of the target GPU")
        return "\n".join(lines)


# --------------------------------------------------------------------------- reading


_REQUIRED = ("format", "machine", "date", "torch_version", "device", "integrated", "link_gbps_pinned",
             "link_gbps_pageable", "vram_gbps", "device_memory_total_bytes", "device_memory_free_bytes",
             "host_memcpy_gbps", "no_link_reason")
#: What a ``*_samples_s`` object must be.
_SAMPLES = "an object of copy size in bytes -> median seconds"


def _rate(r: jsonio.FieldReader, name: str, *, optional: bool = False) -> float | None:
    """A rate in GB/s, or null (no such thing on this machine); ``optional``: may be absent
    (a profile from before it was measured)."""
    return r.number(name, minimum=MIN_GBPS, maximum=MAX_GBPS, unit="GB/s", nullable=True, optional=optional)


def _read_profile(data: Any, where: str) -> Profile:
    """The profile in ``data`` (a parsed file), read through :class:`jsonio.FieldReader`:
    every failure one :class:`UserError` line naming ``where``, the field, and :data:`REPROBE`."""
    r = jsonio.FieldReader(data, where, error=UserError, fix=REPROBE)
    fmt = r.raw("format", optional=True)
    if fmt != PROFILE_FORMAT:
        if isinstance(fmt, str) and fmt.startswith("selective-offload/profile-v") and len(fmt) < 60:
            raise UserError(f"{where}: format {fmt!r} is not {PROFILE_FORMAT!r}, the one this release reads; "
                            f"upgrade selective-offload, or {REPROBE}")
        raise UserError(f"{where}: not a selective-offload profile (format is {cut(jsonio.json_text(fmt), 60)}, "
                        f"not {PROFILE_FORMAT!r}); {REPROBE}")
    missing = [name for name in _REQUIRED if name not in r.data]
    if missing:  # all of them at once, not the first
        raise UserError(f"{where}: the profile lacks {', '.join(missing)}; {REPROBE}")

    def nbytes(name: str) -> int | None:
        return r.int(name, minimum=0, maximum=MAX_BYTES, unit="bytes", nullable=True)

    def samples(name: str) -> dict[int, float]:
        raw = r.object(name, default={}, what=_SAMPLES)
        out, entries = {}, r.within(raw, name)
        for key in raw:
            try:
                size = int(key)
            except ValueError:
                size = 0
            if not 0 < size <= MAX_BYTES:
                r.bad(name, raw, _SAMPLES)
            out[size] = entries.number(key, positive=True, maximum=1e9, unit="seconds")
        return out

    date = r.str("date", one_line=True)
    try:
        dt.datetime.fromisoformat(date.replace("Z", "+00:00"))
    except ValueError:
        r.bad("date", date, "an ISO date, like 2026-12-01T10:00:00+00:00")
    counted = r.raw("copy_bytes_counted", COPY_BYTES_COUNTED)
    if counted != COPY_BYTES_COUNTED:
        r.bad("copy_bytes_counted", counted, f"{COPY_BYTES_COUNTED!r}")
    profile = Profile(
        machine=r.str("machine", one_line=True), date=date, torch_version=r.str("torch_version", one_line=True),
        device=r.str("device", one_line=True, nullable=True), integrated=r.bool("integrated"),
        link_gbps_pinned=_rate(r, "link_gbps_pinned"), link_gbps_pageable=_rate(r, "link_gbps_pageable"),
        vram_gbps=_rate(r, "vram_gbps"), device_memory_total_bytes=nbytes("device_memory_total_bytes"),
        device_memory_free_bytes=nbytes("device_memory_free_bytes"), host_memcpy_gbps=_rate(r, "host_memcpy_gbps"),
        no_link_reason=r.str("no_link_reason", one_line=True, nullable=True),
        **{f"{k}_samples_s": samples(f"{k}_samples_s") for k in SAMPLE_KINDS},
        uva_read_gbps=_rate(r, "uva_read_gbps", optional=True),
        decode_read_gbps=_rate(r, "decode_read_gbps", optional=True),
        matmul_tflops=r.number("matmul_tflops", minimum=MIN_GBPS, maximum=MAX_GBPS, unit="TFLOP/s",
                               nullable=True, optional=True),
        matmul_dtype=r.str("matmul_dtype", one_line=True, nullable=True, default=None),
        compute_capability=r.str("compute_capability", one_line=True, nullable=True, default=None),
        cpu_kernel_gbps=_kernel_rates(r),
        cpu_threads=r.int("cpu_threads", minimum=1, maximum=4096, unit="threads", nullable=True, optional=True),
        host_read_gbps=_rate(r, "host_read_gbps", optional=True),
        handoff_s=r.number("handoff_s", positive=True, maximum=1.0, unit="seconds", nullable=True, optional=True),
        repeats=r.int("repeats", minimum=1, nullable=True, optional=True), quick=r.bool("quick", default=False),
    )
    _check_consistent(profile, r.bad)
    return profile


#: The most formats a profile's ``cpu_kernel_gbps`` holds, and the longest name of one.
MAX_KERNEL_FORMATS, MAX_FORMAT_NAME = 16, 32


def _kernel_rates(r: jsonio.FieldReader) -> dict[str, float]:
    """The profile's ``cpu_kernel_gbps``: format name -> GB/s, bounded."""
    want = (f"an object of at most {MAX_KERNEL_FORMATS} format names (like \"bf16\") -> GB/s from "
            f"{MIN_GBPS:g} to {MAX_GBPS:g}")
    raw = r.object("cpu_kernel_gbps", default={}, what=want)
    if len(raw) > MAX_KERNEL_FORMATS or not all(isinstance(n, str) and 0 < len(n) <= MAX_FORMAT_NAME
                                                and n.isprintable() for n in raw):
        r.bad("cpu_kernel_gbps", raw, want)
    rates = r.within(raw, "cpu_kernel_gbps")
    return {name: rates.number(name, minimum=MIN_GBPS, maximum=MAX_GBPS, unit="GB/s") for name in raw}


def _check_consistent(p: Profile, bad: Callable[[str, Any, str], None]) -> None:
    """Values that each parse but cannot be together (``bad`` raises)."""
    if p.has_link and p.link_gbps_pinned is None:
        bad("link_gbps_pinned", None, "a number when no_link_reason is null (there is a link)")
    if not p.has_link and (p.link_gbps_pinned is not None or p.link_gbps_pageable is not None):
        bad("no_link_reason", p.no_link_reason, "null when link rates are given")
    if p.device is None:
        for name in ("vram_gbps", "device_memory_total_bytes", "device_memory_free_bytes"):
            if getattr(p, name) is not None:
                bad(name, getattr(p, name), "null when device is null (no GPU)")
        if p.integrated:
            bad("integrated", True, "false when device is null (no GPU)")
        if p.has_link:
            bad("no_link_reason", None, "a reason when device is null (no GPU, no link)")
    if p.uva_read_gbps is not None and not p.has_link:
        bad("uva_read_gbps", p.uva_read_gbps, "null when there is no link (no GPU)")
    if p.handoff_s is not None and not p.has_link:
        bad("handoff_s", p.handoff_s, "null when there is no link (no GPU to hand off to)")
    if p.decode_read_gbps is not None and p.device is None:
        bad("decode_read_gbps", p.decode_read_gbps, "null when device is null (no GPU)")
    if (p.matmul_tflops is None) != (p.matmul_dtype is None):
        bad("matmul_dtype", p.matmul_dtype, "given exactly when matmul_tflops is")
    if p.device_memory_total_bytes == 0:
        bad("device_memory_total_bytes", 0, "more than 0 bytes or null")
    total, free = p.device_memory_total_bytes, p.device_memory_free_bytes
    if free is not None and (total is None or free > total):
        bad("device_memory_free_bytes", free,
            f"at most device_memory_total_bytes ({total})" if total is not None
            else "null when device_memory_total_bytes is null")


# --------------------------------------------------------------------------- where it lives


def default_profile_path() -> Path:
    """``$SELECTIVE_OFFLOAD_PROFILE`` when set (and not empty), else
    ``~/.cache/selective-offload/profile.json``."""
    env = os.environ.get(PROFILE_ENV, "").strip()
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "selective-offload" / "profile.json"


def load_profile(path: str | os.PathLike | None = None) -> Profile | None:
    """The profile at ``path`` (default: :func:`default_profile_path`), or ``None`` when there
    is no such file; a file that exists but cannot be used is a one-line :class:`UserError`."""
    named_by = None
    if path is None:
        path, named_by = default_profile_path(), (PROFILE_ENV if os.environ.get(PROFILE_ENV, "").strip() else None)
    path = Path(path).expanduser()
    try:
        if not path.exists() and not path.is_symlink():
            return None
    except OSError as exc:  # a name too long, a loop of links
        raise UserError(f"{named_by or 'the profile'}={str(path)[:200]}: cannot be used ({exc.strerror or exc})"
                        + (f"; point {named_by} at a profile file, or unset it" if named_by else "")) from None
    return Profile.load(path, named_by)


# --------------------------------------------------------------------------- what planning takes

#: What :func:`plan_defaults` supplies, as ``plan``'s flag (the command ``probe`` prints)
#: and in a plan's note (:func:`.planning.describe`): key, flag, the value as the flag takes
#: it, the note's words (``None``: not in the note), the value as the note says it.
SUPPLIED: tuple[tuple[str, str, Callable[[Any], str], str | None, Callable[[Any], str]], ...] = (
    ("link_gbps", "--link-gbps", fmt_rate, "link {} GB/s pinned", fmt_rate),
    ("uva_gbps", "--uva-gbps", fmt_rate, "UVA reads {} GB/s", fmt_rate),
    ("vram_gbps", "--vram-gbps", fmt_rate, "VRAM {} GB/s", fmt_rate),
    ("decode_read_gbps", "--decode-read-gbps", fmt_rate, "decode reads {} GB/s", fmt_rate),
    ("compute_tflops", "--compute-tflops", "{:.3g}".format, "matmul {} TFLOP/s", "{:.3g}".format),
    ("device_memory_bytes", "--device-memory", size_arg, "device memory {}", fmt_gib),
    ("cpu_threads", "--cpu-threads", str, None, str),
)



def plan_defaults(profile: Profile | None) -> dict[str, float | int | None]:
    """The :class:`~selective_offload.plan_format.PlanInputs` values a profile supplies: ``link_gbps``
    (the pinned host-to-device rate), ``uva_gbps`` (kernels reading host memory in place),
    ``vram_gbps`` (the copy's), ``decode_read_gbps`` (a matrix-vector product's: the rate
    planning prices VRAM at, when measured), ``compute_tflops`` (the GPU's matmul rate) and
    ``device_memory_bytes`` (the device's total memory); ``None`` for what it cannot (no
    link, no GPU, no profile). For host-compute: ``cpu_kernel_gbps`` (the host kernel's rate
    per format, ``None`` when none was measured; the plan takes its model's format's),
    ``cpu_threads`` and ``handoff_s`` (the per-layer hand-off)."""
    if profile is None:
        return {"link_gbps": None, "uva_gbps": None, "vram_gbps": None, "decode_read_gbps": None,
                "compute_tflops": None, "device_memory_bytes": None, "compute_capability": None,
                "cpu_kernel_gbps": None, "cpu_threads": None, "handoff_s": None}
    on_gpu = profile.device is not None
    return {
        "link_gbps": profile.link_gbps_pinned if profile.has_link else None,
        "uva_gbps": profile.uva_read_gbps if profile.has_link else None,
        "vram_gbps": profile.vram_gbps if on_gpu else None,
        "decode_read_gbps": profile.decode_read_gbps if on_gpu else None,
        "compute_tflops": profile.matmul_tflops if on_gpu else None,
        "device_memory_bytes": (profile.device_memory_total_bytes
                                if profile.device is not None and profile.device_memory_total_bytes else None),
        "compute_capability": profile.compute_capability if on_gpu else None,
        # A quick probe's kernels and reads ran on cache-sized data: rates its host's memory
        # does not give, so they price nothing and claim no kernel fast or slow here.
        "cpu_kernel_gbps": (dict(profile.cpu_kernel_gbps) or None) if not profile.quick else None,
        "cpu_threads": profile.cpu_threads,
        "handoff_s": profile.handoff_s,
    }

# The field names of a profile, in file order (for readers and the tests).
PROFILE_FIELDS = tuple(f.name for f in fields(Profile))
