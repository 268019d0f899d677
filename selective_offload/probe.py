"""``selective-offload probe``: measure this machine's link and memory, once, for planning.

The planner prices a plan in bytes / bandwidth, so its two bandwidths (the host-to-device
link and the device memory) and the device's memory size decide the estimate. This module
measures them with torch alone (no vLLM: a GPU machine may not have it) and keeps them in a
small JSON profile, ``~/.cache/selective-offload/profile.json`` by default
(``$SELECTIVE_OFFLOAD_PROFILE`` moves it), that planning can take its defaults from.

What is measured, each as the median of ``repeats`` timed copies per size after warm-up
copies, the device synchronised before and after each copy:

- **link** (``link_gbps_pinned``, ``link_gbps_pageable``): host-to-device copies from
  page-locked (torch's pinned allocator) and from pageable host memory. Bytes counted: the
  size of the copy, once (the bytes that cross the link).
- **VRAM** (``vram_gbps``): a device-to-device copy. Bytes counted: **read + write**, 2 x
  the size of the copy, which is what a datasheet's memory bandwidth and a read-only
  stream (a decode step reading its weights) are comparable with.
- **device memory** (``device_memory_total_bytes``, ``device_memory_free_bytes``):
  ``torch.cuda.mem_get_info`` before the probe allocates anything of its own.
- **host memcpy** (``host_memcpy_gbps``): a host-to-host copy, read + write counted as for
  VRAM. Without a GPU this is all there is: the CPU is the device, there is no link, and
  ``no_link_reason`` says so.
- **UVA reads** (``uva_read_gbps``): a kernel (a bf16 matrix-vector product, the decode
  reads' shape: :func:`gemv_read_s`) reading page-locked host memory in place through a UVA
  device view, the way vLLM's ``cpu_offload_gb``, the UVA embedding and
  experts read in place are read: the SMs issue the reads over the link, which reaches less
  than the copy engine does, and less as the buffer grows (nvbandwidth issue #42: an A100's
  in-kernel host reads fell from 25.1 to 16.5 GB/s between 1 and 20 GiB). So its sizes go
  past the copies' (up to 4 GiB in a full probe). Bytes counted: the buffer, once.
- **decode reads** (``decode_read_gbps``): a matrix-vector product over a bf16 weight as
  large as the largest copy, the shape of a batch-1 decode step's weight reads; bytes
  counted: the weight, once. Decode kernels read VRAM slower than a copy or a saturating
  read kernel (published vLLM runs read at 0.6-0.78 of a datasheet or saturating rate), so
  planning prices VRAM reads at this when measured, else at the copy's rate x
  ``estimate.DEFAULT_DECODE_READ_FACTOR``.
- **matmul** (``matmul_tflops``, ``matmul_dtype``): a square matrix product large enough to
  be compute-bound (bf16 on a GPU, float32 on the CPU), ``2 n^3`` FLOPs over its median
  time: the rate at which a decode step's FLOPs can run at best, so a layer costs at least
  its FLOPs over it.

Every rate is the one of the **largest** size (small copies understate a link); the
per-size medians are kept in the profile (``*_samples_s``: bytes -> median seconds) so a
reader can see whether the rate had levelled off. Rates are decimal GB/s (10^9 bytes per
second), as links and memories are quoted.

Reading a profile is a validation: a file that is not JSON, has another format, lacks a
field or holds a value that cannot be (a negative bandwidth, more free memory than total)
is one :class:`UserError` line naming the file.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from . import jsonio
from .errors import UserError
from .sizes import GB, MAX_BYTES, MAX_GBPS, MIN_GBPS, GiB, size_arg

PROFILE_FORMAT = "selective-offload/profile-v1"
#: The environment variable that names the profile file.
PROFILE_ENV = "SELECTIVE_OFFLOAD_PROFILE"

MiB = 1 << 20
#: Copy sizes of a full probe: the rate reported is the largest one's.
FULL_SIZES: tuple[int, ...] = (64 * MiB, 256 * MiB, 1 * GiB)
FULL_REPEATS = 5
FULL_WARMUP = 2
#: A quick probe (tests, CI): well under a second on a 2-core CPU; rates are understated
#: (the small copies stay partly in cache on a CPU and do not reach a link's top rate).
QUICK_SIZES: tuple[int, ...] = (4 * MiB, 16 * MiB, 64 * MiB)
QUICK_REPEATS = 3
QUICK_WARMUP = 1

#: What the VRAM and host-memcpy rates count: the bytes read plus the bytes written.
COPY_BYTES_COUNTED = "read+write"
#: The measurements whose per-size medians a profile keeps.
SAMPLE_KINDS = ("h2d_pinned", "h2d_pageable", "d2d", "host_memcpy", "uva_read")
#: UVA read sizes beyond the copies' (a real offload is GBs: kernels' host reads slow down
#: as the buffer grows); a size that cannot be page-locked here is skipped.
FULL_UVA_EXTRA_SIZES: tuple[int, ...] = (4 * GiB,)
#: Matrix side of the matmul rate (n x n by n x n); the quick probe's is small.
FULL_MATMUL_N = 8192
QUICK_MATMUL_N = 256

REPROBE = "run `selective-offload probe` again, or delete the file"


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
    #: Timed copies per size (the samples are their medians); ``None``: not recorded.
    repeats: int | None = None
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

    def save(self, path: str | os.PathLike) -> Path:
        """Write the profile as JSON (the folder is made; the file replaced in one step)."""
        path = Path(path).expanduser()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_text(self.to_json())
            os.replace(tmp, path)
        except OSError as exc:
            raise UserError(f"{path}: cannot write the profile: {exc.strerror or exc}; "
                            "give another path with --output") from None
        return path

    @classmethod
    def from_dict(cls, data: Any, where: str = "profile") -> "Profile":
        return _read_profile(data, where)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Profile":
        path = Path(path).expanduser()
        try:
            text = path.read_text()
        except OSError as exc:
            raise UserError(f"{path}: cannot read the profile: {exc.strerror or exc}") from None
        except UnicodeDecodeError:
            raise UserError(f"{path}: the profile is not text (not UTF-8 JSON); {REPROBE}") from None
        try:
            data = jsonio.parse(text)
        except ValueError as exc:  # bounded depth, no NaN/Infinity or numbers of thousands of digits
            raise UserError(f"{path}: the profile is not valid JSON ({exc}); {REPROBE}") from None
        return cls.from_dict(data, where=str(path))

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
            lines.append(f"  device         {self.device} ({kind})")
        largest = _largest(self.h2d_pinned_samples_s) or _largest(self.host_memcpy_samples_s)
        of = f" ({_fmt_size(largest)} copies, median of {self.repeats or '?'})" if largest else ""
        if self.has_link:
            lines.append(f"  link (H2D)     {_fmt_rate(self.link_gbps_pinned)} GB/s pinned, "
                         f"{_fmt_rate(self.link_gbps_pageable)} GB/s pageable{of}")
        else:
            lines.append(f"  link (H2D)     none: {self.no_link_reason}")
        if self.uva_read_gbps is not None:
            of_uva = _largest(self.uva_read_samples_s)
            ratio = (f", {self.uva_read_gbps / self.link_gbps_pinned:.2f}x the pinned copy"
                     if self.link_gbps_pinned else "")
            lines.append(f"  UVA reads      {_fmt_rate(self.uva_read_gbps)} GB/s (a kernel reading "
                         f"{_fmt_size(of_uva)} of page-locked host memory in place{ratio})")
        if self.vram_gbps is not None:
            lines.append(f"  VRAM           {_fmt_rate(self.vram_gbps)} GB/s "
                         "(device-to-device copy, bytes read + written)")
        if self.decode_read_gbps is not None:
            lines.append(f"  decode reads   {_fmt_rate(self.decode_read_gbps)} GB/s (a bf16 matrix-vector product "
                         "reading its weight once: the rate planning prices VRAM reads at)")
        if self.matmul_tflops is not None:
            lines.append(f"  matmul         {self.matmul_tflops:.3g} TFLOP/s ({self.matmul_dtype}, compute-bound size)")
        if self.device_memory_total_bytes is not None:
            free = ("" if self.device_memory_free_bytes is None
                    else f", {self.device_memory_free_bytes / GB:.2f} GB free at probe")
            lines.append(f"  device memory  {self.device_memory_total_bytes / GB:.2f} GB "
                         f"({_gib(self.device_memory_total_bytes)}) total{free}")
        if self.host_memcpy_gbps is not None:
            lines.append(f"  host memcpy    {_fmt_rate(self.host_memcpy_gbps)} GB/s "
                         f"(host-to-host copy, bytes read + written){of if not self.has_link else ''}")
        for kind, counted in (("h2d_pinned", 1), ("h2d_pageable", 1), ("uva_read", 1), ("d2d", 2),
                              ("host_memcpy", 2)):
            samples = self.samples(kind)
            if samples:
                rates = ", ".join(f"{_fmt_size(n)} {_fmt_rate(counted * n / s / GB)}"
                                  for n, s in sorted(samples.items()))
                lines.append(f"    {kind:<14}{rates} GB/s")
        defaults = plan_defaults(self)
        if any(v is not None for v in defaults.values()):
            args = []
            if defaults["link_gbps"] is not None:
                args.append(f"--link-gbps {_fmt_rate(defaults['link_gbps'])}")
            if defaults["uva_gbps"] is not None:
                args.append(f"--uva-gbps {_fmt_rate(defaults['uva_gbps'])}")
            if defaults["vram_gbps"] is not None:
                args.append(f"--vram-gbps {_fmt_rate(defaults['vram_gbps'])}")
            if defaults["decode_read_gbps"] is not None:
                args.append(f"--decode-read-gbps {_fmt_rate(defaults['decode_read_gbps'])}")
            if defaults["compute_tflops"] is not None:
                args.append(f"--compute-tflops {defaults['compute_tflops']:.3g}")
            if defaults["device_memory_bytes"] is not None:
                args.append(f"--device-memory {size_arg(defaults['device_memory_bytes'])}")
            lines.append(f"  for planning   {' '.join(args)}")
        else:
            lines.append("  for planning   nothing: without a GPU there is no link or VRAM to measure; "
                         "give --device-memory, --link-gbps and --vram-gbps of the target GPU")
        return "\n".join(lines)


def _largest(samples: Mapping[int, float]) -> int | None:
    return max(samples) if samples else None


def _fmt_rate(gbps: float | None) -> str:
    if gbps is None:
        return "n/a"
    return f"{gbps:.0f}" if gbps >= 1000 else f"{gbps:.3g}" if gbps < 10 else f"{gbps:.1f}"


def _fmt_size(nbytes: int) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def _gib(nbytes: int) -> str:
    return f"{nbytes / GiB:.2f} GiB"


# --------------------------------------------------------------------------- reading


_REQUIRED = ("format", "machine", "date", "torch_version", "device", "integrated", "link_gbps_pinned",
             "link_gbps_pageable", "vram_gbps", "device_memory_total_bytes", "device_memory_free_bytes",
             "host_memcpy_gbps", "no_link_reason")


def _read_profile(data: Any, where: str) -> Profile:
    def bad(name: str, value: Any, want: str) -> UserError:
        shown = json.dumps(value) if not isinstance(value, float) or math.isfinite(value) else repr(value)
        if len(shown) > 60:
            shown = shown[:57] + "..."
        return UserError(f"{where}: {name} is {shown}, but must be {want}; {REPROBE}")

    if not isinstance(data, dict):
        raise UserError(f"{where}: a profile is a JSON object, not {type(data).__name__}; {REPROBE}")
    fmt = data.get("format")
    if fmt != PROFILE_FORMAT:
        if isinstance(fmt, str) and fmt.startswith("selective-offload/profile-v"):
            raise UserError(f"{where}: format {fmt!r} is not {PROFILE_FORMAT!r}, the one this release reads; "
                            f"upgrade selective-offload, or {REPROBE}")
        raise UserError(f"{where}: not a selective-offload profile (format is {json.dumps(fmt)}, "
                        f"not {PROFILE_FORMAT!r}); {REPROBE}")
    missing = [name for name in _REQUIRED if name not in data]
    if missing:
        raise UserError(f"{where}: the profile lacks {', '.join(missing)}; {REPROBE}")

    def text(name: str, optional: bool = False) -> str | None:
        value = data[name]
        if value is None and optional:
            return None
        if not isinstance(value, str) or not value.strip() or "\n" in value:
            raise bad(name, value, "a one-line string" + (" or null" if optional else ""))
        return value

    def rate(name: str) -> float | None:
        value = data[name]
        if value is None:
            return None
        # mutation: profile-rate-unbounded
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not MIN_GBPS <= value <= MAX_GBPS:
            raise bad(name, value, f"a number of GB/s from {MIN_GBPS:g} to {MAX_GBPS:g}, or null")
        return float(value)

    def nbytes(name: str) -> int | None:
        value = data[name]
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_BYTES:
            raise bad(name, value, f"a whole number of bytes from 0 to {MAX_BYTES}, or null")
        return value

    def samples(name: str) -> dict[int, float]:
        raw = data.get(name, {})
        if not isinstance(raw, dict):
            raise bad(name, raw, "an object of copy size in bytes -> median seconds")
        out = {}
        for key, secs in raw.items():
            try:
                size = int(key)
            except ValueError:
                raise bad(name, raw, "an object of copy size in bytes -> median seconds") from None
            if (not 0 < size <= MAX_BYTES or isinstance(secs, bool) or not isinstance(secs, (int, float))
                    or not 0 < secs <= 1e9):
                raise bad(f"{name}[{key}]", secs, "a positive number of seconds for a positive size")
            out[size] = float(secs)
        return out

    date = text("date")
    try:
        dt.datetime.fromisoformat(date.replace("Z", "+00:00"))
    except ValueError:
        raise bad("date", date, "an ISO date, like 2026-12-01T10:00:00+00:00") from None
    integrated = data["integrated"]
    if not isinstance(integrated, bool):
        raise bad("integrated", integrated, "true or false")
    repeats = data.get("repeats")
    if repeats is not None and (isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1):
        raise bad("repeats", repeats, "a whole number, 1 or more, or null")
    quick = data.get("quick", False)
    if not isinstance(quick, bool):
        raise bad("quick", quick, "true or false")
    counted = data.get("copy_bytes_counted", COPY_BYTES_COUNTED)
    if counted != COPY_BYTES_COUNTED:
        raise bad("copy_bytes_counted", counted, f"{COPY_BYTES_COUNTED!r}")
    profile = Profile(
        machine=text("machine"), date=date, torch_version=text("torch_version"),
        device=text("device", optional=True), integrated=integrated,
        link_gbps_pinned=rate("link_gbps_pinned"), link_gbps_pageable=rate("link_gbps_pageable"),
        vram_gbps=rate("vram_gbps"), device_memory_total_bytes=nbytes("device_memory_total_bytes"),
        device_memory_free_bytes=nbytes("device_memory_free_bytes"), host_memcpy_gbps=rate("host_memcpy_gbps"),
        no_link_reason=text("no_link_reason", optional=True),
        **{f"{k}_samples_s": samples(f"{k}_samples_s") for k in SAMPLE_KINDS},
        uva_read_gbps=rate("uva_read_gbps") if "uva_read_gbps" in data else None,
        decode_read_gbps=rate("decode_read_gbps") if "decode_read_gbps" in data else None,
        matmul_tflops=rate("matmul_tflops") if "matmul_tflops" in data else None,
        matmul_dtype=(text("matmul_dtype", optional=True) if "matmul_dtype" in data else None),
        repeats=repeats, quick=quick,
    )
    _check_consistent(profile, bad)
    return profile


def _check_consistent(p: Profile, bad: Callable[[str, Any, str], UserError]) -> None:
    """Values that each parse but cannot be together."""
    if p.has_link and p.link_gbps_pinned is None:
        raise bad("link_gbps_pinned", None, "a number when no_link_reason is null (there is a link)")
    if not p.has_link and (p.link_gbps_pinned is not None or p.link_gbps_pageable is not None):
        raise bad("no_link_reason", p.no_link_reason, "null when link rates are given")
    if p.device is None:
        for name in ("vram_gbps", "device_memory_total_bytes", "device_memory_free_bytes"):
            if getattr(p, name) is not None:
                raise bad(name, getattr(p, name), "null when device is null (no GPU)")
        if p.integrated:
            raise bad("integrated", True, "false when device is null (no GPU)")
        if p.has_link:
            raise bad("no_link_reason", None, "a reason when device is null (no GPU, no link)")
    if p.uva_read_gbps is not None and not p.has_link:
        raise bad("uva_read_gbps", p.uva_read_gbps, "null when there is no link (no GPU)")
    if p.decode_read_gbps is not None and p.device is None:
        raise bad("decode_read_gbps", p.decode_read_gbps, "null when device is null (no GPU)")
    if (p.matmul_tflops is None) != (p.matmul_dtype is None):
        raise bad("matmul_dtype", p.matmul_dtype, "given exactly when matmul_tflops is")
    if p.device_memory_total_bytes == 0:
        raise bad("device_memory_total_bytes", 0, "more than 0 bytes or null")
    total, free = p.device_memory_total_bytes, p.device_memory_free_bytes
    if free is not None and (total is None or free > total):
        raise bad("device_memory_free_bytes", free,
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
    path = Path(path).expanduser() if path is not None else default_profile_path()
    if not path.exists() and not path.is_symlink():
        return None
    return Profile.load(path)


def plan_defaults(profile: Profile | None) -> dict[str, float | int | None]:
    """The :class:`~selective_offload.plan.PlanInputs` values a profile supplies: ``link_gbps``
    (the pinned host-to-device rate), ``uva_gbps`` (kernels reading host memory in place),
    ``vram_gbps`` (the copy's), ``decode_read_gbps`` (a matrix-vector product's: the rate
    planning prices VRAM at, when measured), ``compute_tflops`` (the GPU's matmul rate) and
    ``device_memory_bytes`` (the device's total memory); ``None`` for what it cannot (no
    link, no GPU, no profile)."""
    if profile is None:
        return {"link_gbps": None, "uva_gbps": None, "vram_gbps": None, "decode_read_gbps": None,
                "compute_tflops": None, "device_memory_bytes": None}
    on_gpu = profile.device is not None
    return {
        "link_gbps": profile.link_gbps_pinned if profile.has_link else None,
        # mutation: probe-uva-not-supplied
        "uva_gbps": profile.uva_read_gbps if profile.has_link else None,
        "vram_gbps": profile.vram_gbps if on_gpu else None,
        # mutation: probe-decode-not-supplied
        "decode_read_gbps": profile.decode_read_gbps if on_gpu else None,
        "compute_tflops": profile.matmul_tflops if on_gpu else None,
        "device_memory_bytes": (profile.device_memory_total_bytes
                                if profile.device is not None and profile.device_memory_total_bytes else None),
    }


def plan_bandwidths(profile: Profile | None) -> tuple[float, float, str]:
    """The link and VRAM bandwidths a plan uses when no flag gives them: the profile's where
    it measured them, else the reference laptop's; and one line saying which."""
    from .plan import REFERENCE_LINK_GBPS, REFERENCE_VRAM_GBPS

    measured = plan_defaults(profile)
    link = measured["link_gbps"] or REFERENCE_LINK_GBPS
    vram = measured["vram_gbps"] or REFERENCE_VRAM_GBPS
    if profile is not None and profile.no_link_reason is None:
        return link, vram, describe(profile)
    return link, vram, reference_note()


def reference_note(*, link: bool = True, vram: bool = True) -> str | None:
    """The line saying which rates are the reference laptop's (no probe of a GPU here): the
    link's, the VRAM's, or both (``None`` when neither is)."""
    from .plan import REFERENCE_LINK_GBPS, REFERENCE_VRAM_GBPS

    named = ([f"link {REFERENCE_LINK_GBPS} GB/s"] if link else []) + ([f"VRAM {REFERENCE_VRAM_GBPS} GB/s"] if vram else [])
    if not named:
        return None
    return (f"{' and '.join(named)} {'are' if len(named) > 1 else 'is'} the reference laptop's (no "
            "`selective-offload probe` profile of a GPU here): measure yours with `selective-offload probe`")


def describe(profile: Profile) -> str:
    """One line saying what a profile supplies and where it came from, for a plan's notes."""
    parts = []
    defaults = plan_defaults(profile)
    if defaults["link_gbps"] is not None:
        parts.append(f"link {_fmt_rate(defaults['link_gbps'])} GB/s pinned")
    elif profile.no_link_reason:
        parts.append("no link")
    if defaults["uva_gbps"] is not None:
        parts.append(f"UVA reads {_fmt_rate(defaults['uva_gbps'])} GB/s")
    if defaults["vram_gbps"] is not None:
        parts.append(f"VRAM {_fmt_rate(defaults['vram_gbps'])} GB/s")
    if defaults["decode_read_gbps"] is not None:
        parts.append(f"decode reads {_fmt_rate(defaults['decode_read_gbps'])} GB/s")
    if defaults["compute_tflops"] is not None:
        parts.append(f"matmul {defaults['compute_tflops']:.3g} TFLOP/s")
    if defaults["device_memory_bytes"] is not None:
        parts.append(f"device memory {_gib(defaults['device_memory_bytes'])}")
    if profile.device is None and profile.host_memcpy_gbps is not None:
        parts.append(f"host memcpy {_fmt_rate(profile.host_memcpy_gbps)} GB/s")
    what = profile.device or f"{profile.machine}, no GPU"
    if profile.integrated:
        what += ", integrated"
    quick = " (quick probe: rates understated)" if profile.quick else ""
    return f"{', '.join(parts)} measured by `selective-offload probe` on {profile.day}, {what}{quick}"


# --------------------------------------------------------------------------- measuring


def machine_name() -> str:
    """The CPU model (``/proc/cpuinfo``) and architecture, as the benchmarks name machines."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({platform.machine()})"
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _check_sizes(sizes: Sequence[int] | None, quick: bool) -> tuple[int, ...]:
    if sizes is None:
        return QUICK_SIZES if quick else FULL_SIZES
    try:
        out = tuple(sorted({int(s) for s in sizes}))
    except (TypeError, ValueError):
        raise UserError(f"probe: copy sizes {sizes!r} must be whole numbers of bytes") from None
    if not out or out[0] <= 0 or any(isinstance(s, bool) for s in sizes):
        raise UserError(f"probe: copy sizes {list(sizes)!r} must be one or more positive numbers of bytes")
    return out


def _resolve_device(device: Any):
    """``None``: the current CUDA device when there is one, else the CPU."""
    import torch

    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        dev = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    except (RuntimeError, TypeError, ValueError):
        raise UserError(f"--device: cannot read {device!r} as a device; give cuda, cuda:N or cpu") from None
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise UserError(f"--device: {device!r} is a {dev.type} device; the probe measures cuda devices "
                        "(cuda, cuda:N) or the cpu")
    if not torch.cuda.is_available():
        raise UserError(f"--device: {device!r} asked for, but this torch ({torch.__version__}) sees no CUDA "
                        "device; leave --device out to measure the CPU")
    index = torch.cuda.current_device() if dev.index is None else dev.index
    if not 0 <= index < torch.cuda.device_count():
        raise UserError(f"--device: {device!r}: there are {torch.cuda.device_count()} CUDA device(s) here "
                        f"(cuda:0..cuda:{torch.cuda.device_count() - 1})")
    return torch.device("cuda", index)


def _median_copy_s(dst, src, *, repeats: int, warmup: int, cuda, non_blocking: bool) -> float:
    """Median wall seconds of ``dst.copy_(src)``, the device synchronised around each copy."""
    return _median_s(lambda: dst.copy_(src, non_blocking=non_blocking), repeats=repeats, warmup=warmup, cuda=cuda)


def _series(what: str, where: str, sizes: Sequence[int], make: Callable[[int], tuple],
            repeats: int, warmup: int, cuda, non_blocking: bool = False) -> dict[int, float]:
    """Median seconds per copy size; buffers are made per size and freed before the next."""
    out = {}
    for size in sizes:
        try:
            dst, src = make(size)
            out[size] = _median_copy_s(dst, src, repeats=repeats, warmup=warmup, cuda=cuda,
                                       non_blocking=non_blocking)
        except (RuntimeError, AssertionError, MemoryError) as exc:
            raise UserError(f"probe: could not measure the {what} on {where} with {_fmt_size(size)} copies "
                            f"({_one_line(exc)}); free memory, or try --quick") from None
        finally:
            dst = src = None  # drop the buffers before the next size is made
    return out


def _median_s(fn: Callable[[], Any], *, repeats: int, warmup: int, cuda) -> float:
    """Median wall seconds of ``fn()``, the device synchronised around each call."""
    import torch

    def sync():
        if cuda is not None:
            torch.cuda.synchronize(cuda)

    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


#: Columns of the bf16 matrix the read measurements multiply (a hidden size of 8B-class models).
READ_COLS = 4096


def gemv_read_s(weight, *, repeats: int, warmup: int, cuda, cols: int = READ_COLS) -> float:
    """Median seconds of one bf16 matrix-vector product over the bytes of ``weight`` (a
    contiguous tensor of whole ``cols``-wide bf16 rows: device memory, or a UVA device view
    of host memory), the device synchronised around each: a batch-1 decode step's read of a
    weight, each byte once. The one measurement behind the probe's UVA and decode read rates
    and ``benchmarks/bench_uva_read.py``."""
    import torch

    flat = weight.reshape(-1).view(torch.uint8)
    rows = flat.numel() // (2 * cols)
    if rows < 1:
        raise ValueError(f"a read of {flat.numel()} bytes is less than one {cols}-wide bf16 row")
    matrix = flat[: rows * cols * 2].view(torch.bfloat16).view(rows, cols)
    x = torch.ones(cols, dtype=torch.bfloat16, device=matrix.device)
    return _median_s(lambda: torch.mv(matrix, x), repeats=repeats, warmup=warmup, cuda=cuda)


def uva_read_series(sizes: Sequence[int], *, repeats: int, warmup: int, cuda,
                    view: Callable[[Any], Any], pin: bool, required: int = 0) -> dict[int, float]:
    """Median seconds of one read kernel (:func:`gemv_read_s`) over ``size`` bytes of host
    memory through ``view(host)``: on CUDA a UVA device view of page-locked memory
    (:func:`~selective_offload.wrappers.host_embedding.cuda_view_of_pinned`), so every byte
    crosses the link inside the kernel, as vLLM's ``cpu_offload_gb`` reads its weights.
    Sizes past ``required`` that cannot be page-locked here are left out (a smaller machine);
    a failure at one of the first ``required`` sizes is a one-line :class:`UserError`."""
    import torch

    out = {}
    for n, size in enumerate(sizes):
        host = dev_view = None
        try:
            host = torch.empty(size, dtype=torch.uint8, pin_memory=pin).fill_(0x3C)  # bf16 0x3C3C: 0.0115
            dev_view = view(host)
            # mutation: probe-uva-own-kernel
            out[size] = gemv_read_s(dev_view, repeats=repeats, warmup=warmup, cuda=cuda)
        except (RuntimeError, AssertionError, MemoryError, ValueError) as exc:
            if n < required:
                raise UserError(f"probe: could not measure UVA reads of {_fmt_size(size)} "
                                f"({_one_line(exc)}); free memory, or try --quick") from None
        finally:
            host = dev_view = None  # unpin before the next size
    return out


def decode_read_gbps(device, nbytes: int, *, repeats: int, warmup: int, cuda, cols: int = 8192) -> float:
    """GB/s at which :func:`gemv_read_s` reads a bf16 weight of about ``nbytes`` (``cols``
    wide) on ``device``: a batch-1 decode step's access pattern, each weight byte read once."""
    import torch

    rows = max(1, nbytes // (2 * cols))
    try:
        weight = torch.ones(rows, cols, dtype=torch.bfloat16, device=device)
        secs = gemv_read_s(weight, repeats=repeats, warmup=warmup, cuda=cuda, cols=cols)
    except (RuntimeError, AssertionError, MemoryError) as exc:
        raise UserError(f"probe: could not measure decode reads on {device} ({_one_line(exc)}); "
                        "free memory, or try --quick") from None
    return rows * cols * 2 / secs / GB


def matmul_tflops(device, n: int, dtype, *, repeats: int, warmup: int, cuda) -> float:
    """TFLOP/s of an ``n x n`` by ``n x n`` matmul in ``dtype`` on ``device`` (``2 n^3`` FLOPs)."""
    import torch

    try:
        a = torch.ones(n, n, dtype=dtype, device=device)
        b = torch.ones(n, n, dtype=dtype, device=device)
        secs = _median_s(lambda: torch.mm(a, b), repeats=repeats, warmup=warmup, cuda=cuda)
    except (RuntimeError, AssertionError, MemoryError) as exc:
        raise UserError(f"probe: could not measure the matmul rate on {device} ({_one_line(exc)}); "
                        "free memory, or try --quick") from None
    return 2 * n ** 3 / secs / 1e12


def _rate(samples: Mapping[int, float], counted: int) -> float | None:
    if not samples:
        return None
    size = max(samples)
    return counted * size / samples[size] / GB


def measure(*, device: Any = None, sizes: Sequence[int] | None = None, repeats: int | None = None,
            quick: bool = False) -> Profile:
    """Measure this machine with torch (see the module's docstring for what and how).

    ``device``: ``None`` (the current CUDA device, else the CPU), ``"cuda"``, ``"cuda:N"``,
    an index, or ``"cpu"`` (host memcpy only). ``sizes``: copy sizes in bytes (default
    64 MiB, 256 MiB, 1 GiB; ``quick``: 4, 16, 64 MiB); ``repeats``: timed copies per size
    (default 5; ``quick``: 3). A measurement that fails is a one-line :class:`UserError`."""
    import torch

    sizes = _check_sizes(sizes, quick)
    if repeats is None:
        repeats = QUICK_REPEATS if quick else FULL_REPEATS
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise UserError(f"probe: repeats {repeats!r} must be a whole number, 1 or more")
    warmup = QUICK_WARMUP if quick else FULL_WARMUP
    dev = _resolve_device(device)
    date = dt.datetime.now(dt.timezone.utc).replace(microsecond=0).isoformat()
    u8 = torch.uint8

    def host_pair(size):
        return torch.empty(size, dtype=u8).fill_(0), torch.empty(size, dtype=u8).fill_(1)

    host = _series("host memcpy", "the host", sizes, host_pair, repeats, warmup, cuda=None)
    common = dict(machine=machine_name(), date=date, torch_version=str(torch.__version__),
                  host_memcpy_gbps=_rate(host, 2), host_memcpy_samples_s=host,
                  repeats=repeats, quick=quick)
    matmul_n = QUICK_MATMUL_N if quick else FULL_MATMUL_N
    if dev.type == "cpu":
        common.update(matmul_tflops=matmul_tflops(dev, matmul_n, torch.float32, repeats=repeats, warmup=warmup,
                                                  cuda=None), matmul_dtype="float32")
        why = ("no GPU here: the CPU is the device, host and device memory are one, so there is no "
               "host-to-device link to measure" if not torch.cuda.is_available() else
               "--device cpu: the CPU is the device, host and device memory are one, so there is no "
               "host-to-device link to measure")
        return Profile(device=None, integrated=False, link_gbps_pinned=None, link_gbps_pageable=None,
                       vram_gbps=None, device_memory_total_bytes=None, device_memory_free_bytes=None,
                       no_link_reason=why, **common)

    name = f"{dev} ({torch.cuda.get_device_name(dev)})"
    try:
        with torch.cuda.device(dev):
            free, total = torch.cuda.mem_get_info(dev)
            props = torch.cuda.get_device_properties(dev)
    except (RuntimeError, AssertionError) as exc:
        raise UserError(f"probe: could not query {dev}: {_one_line(exc)}") from None
    fits = [s for s in sizes if 2 * s + 256 * MiB <= free]
    if not fits:
        raise UserError(f"probe: {name} has {free / GB:.2f} GB free, too little for two "
                        f"{_fmt_size(sizes[0])} buffers; free device memory, or give smaller sizes")

    def device_buffer(size):
        return torch.empty(size, dtype=u8, device=dev)

    def pinned_pair(size):
        return device_buffer(size), torch.empty(size, dtype=u8, pin_memory=True).fill_(1)

    def pageable_pair(size):
        return device_buffer(size), torch.empty(size, dtype=u8).fill_(1)

    def d2d_pair(size):
        return device_buffer(size).fill_(0), device_buffer(size).fill_(1)

    with torch.cuda.device(dev):
        pinned = _series("pinned host-to-device copy", name, fits, pinned_pair, repeats, warmup, dev,
                         non_blocking=True)
        pageable = _series("pageable host-to-device copy", name, fits, pageable_pair, repeats, warmup, dev)
        d2d = _series("device-to-device copy", name, fits, d2d_pair, repeats, warmup, dev)
        torch.cuda.empty_cache()
        from .wrappers.host_embedding import cuda_view_of_pinned

        uva_sizes = tuple(fits) + (() if quick or sizes != FULL_SIZES else FULL_UVA_EXTRA_SIZES)
        uva = uva_read_series(uva_sizes, repeats=repeats, warmup=warmup, cuda=dev,
                              view=lambda host: cuda_view_of_pinned(host, dev), pin=True, required=len(fits))
        matmul = matmul_tflops(dev, matmul_n, torch.bfloat16, repeats=repeats, warmup=warmup, cuda=dev)
        decode = decode_read_gbps(dev, max(fits), repeats=repeats, warmup=warmup, cuda=dev)
        torch.cuda.empty_cache()
    return Profile(
        device=torch.cuda.get_device_name(dev), integrated=bool(getattr(props, "is_integrated", False)),
        link_gbps_pinned=_rate(pinned, 1), link_gbps_pageable=_rate(pageable, 1), vram_gbps=_rate(d2d, 2),
        device_memory_total_bytes=int(total), device_memory_free_bytes=int(free), no_link_reason=None,
        h2d_pinned_samples_s=pinned, h2d_pageable_samples_s=pageable, d2d_samples_s=d2d,
        uva_read_gbps=_rate(uva, 1), uva_read_samples_s=uva, decode_read_gbps=decode, matmul_tflops=matmul,
        matmul_dtype="bfloat16", **common,
    )


# --------------------------------------------------------------------------- the command


def add_probe_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``probe`` subcommand's options; ``run_probe`` takes the parsed namespace."""
    parser.add_argument("-o", "--output", metavar="PATH", default=None,
                        help=f"where to write the profile (default: ${PROFILE_ENV} when set, else "
                             "~/.cache/selective-offload/profile.json)")
    parser.add_argument("--quick", action="store_true",
                        help="small copies (4-64 MiB): well under a second, for tests and CI; the rates are understated")
    parser.add_argument("--device", default=None, metavar="DEVICE",
                        help="cuda, cuda:N or cpu (default: the current CUDA device when there is one, else the CPU)")


def run_probe(args: argparse.Namespace) -> int:
    """Measure, print what was measured and where the profile went, write it; 0 on success.
    Failures are one-line :class:`UserError` s (the CLI prints them and exits 2)."""
    output = Path(args.output).expanduser() if getattr(args, "output", None) else default_profile_path()
    started = time.perf_counter()
    profile = measure(device=getattr(args, "device", None), quick=bool(getattr(args, "quick", False)))
    took = time.perf_counter() - started
    path = profile.save(output)
    print(profile.render())
    print(f"\nmeasured in {took:.2f} s; profile written to {path}")
    return 0


__all__ = [
    "PROFILE_FORMAT", "PROFILE_ENV", "Profile", "measure", "default_profile_path", "load_profile",
    "plan_defaults", "describe", "add_probe_arguments", "run_probe",
]

# The field names of a profile, in file order (for readers and the tests).
PROFILE_FIELDS = tuple(f.name for f in fields(Profile))
