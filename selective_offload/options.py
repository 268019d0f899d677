"""How a plan is applied: strictness, the report file, the embedding's lookup mode.

The same options reach vLLM two ways: as arguments of ``enable()`` in the calling
process, and as environment variables in every process vLLM spawns (read by the
``vllm.general_plugins`` entry point). Both go through :meth:`RunOptions.validate`, so a
value refused by one is refused by the other, and both refuse before any model is built.

=============================  ==================================================
variable                       accepted values
=============================  ==================================================
``SELECTIVE_OFFLOAD_PLAN``     path of a plan JSON, or ``auto`` (plan at engine start
                               from the real card); unset: the plugin does nothing
``SELECTIVE_OFFLOAD_STRICT``   ``1 true yes on`` / ``0 false no off`` (any case);
                               unset or empty: off
``SELECTIVE_OFFLOAD_REPORT``   path of the report JSON; its directory must exist
                               and be writable; unset: a temporary file
``SELECTIVE_OFFLOAD_EMBEDDING`` ``auto`` (default), ``host`` or ``uva``
``SELECTIVE_OFFLOAD_DEVICE_    with ``SELECTIVE_OFFLOAD_PLAN=auto``: the device memory
MEMORY``                       to plan for (``24GiB``), in place of the card's
``SELECTIVE_OFFLOAD_LAST_REPORT`` where the report path of the last engine set-up is
                               recorded (default ``~/.cache/selective-offload/last-report``)
``SELECTIVE_OFFLOAD_KERNEL_    the folder the host-compute CPU kernels are compiled
CACHE``                        into (default ``$XDG_CACHE_HOME`` or ``~/.cache``,
                               then ``selective-offload/kernels``)
=============================  ==================================================

A report path is tried for real before any model is built: a trial file is created and
written beside it and removed, so a directory that refuses files (``/proc``, a read-only
mount), a name too long for the file system, and a target that is not a regular file
(``/dev/full``, a directory, a pipe) are refused in one line while they can still be
fixed. The report is later written to a temporary file and renamed over the target, which
replaces nothing but a regular file.

The report path is recorded because the default one is a new temporary directory per
run: ``selective-offload report`` without a path reads the record, so a user who ran
``vllm serve`` with a plan reads its report without knowing where it went.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from . import jsonio
from .errors import UserError

ENV_PLAN = "SELECTIVE_OFFLOAD_PLAN"
ENV_REPORT = "SELECTIVE_OFFLOAD_REPORT"
ENV_STRICT = "SELECTIVE_OFFLOAD_STRICT"
ENV_EMBEDDING = "SELECTIVE_OFFLOAD_EMBEDDING"
ENV_LAST_REPORT = "SELECTIVE_OFFLOAD_LAST_REPORT"
ENV_DEVICE_MEMORY = "SELECTIVE_OFFLOAD_DEVICE_MEMORY"
ENV_KERNEL_CACHE = "SELECTIVE_OFFLOAD_KERNEL_CACHE"
#: A last-report record holds one path: more than this is not one.
MAX_RECORD_BYTES = 16384
ENV_VARS = (ENV_PLAN, ENV_REPORT, ENV_STRICT, ENV_EMBEDDING)
#: ``SELECTIVE_OFFLOAD_PLAN=auto``: plan inside the worker, from the real card.
AUTO_PLAN = "auto"

#: ``host``: gather rows on the host and send them; ``uva``: read rows through a device
#: view of pinned memory (CUDA-graph safe); ``auto``: UVA when CUDA graphs are captured.
EMBEDDING_MODES = ("auto", "host", "uva")
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


def parse_flag(name: str, value: str | None, default: bool = False) -> bool:
    """A boolean environment variable as the ecosystem writes them; anything else is an error."""
    if value is None or not value.strip():
        return default
    text = value.strip().lower()
    # mutation: strict-env-only-1
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise UserError(f"{name}={value!r} is not a yes/no value; use one of 1, true, yes, on or 0, false, no, off")


#: What the report writer adds to a report's file name: another rank's suffix
#: (``.rank<k>``, k < 10**6) on the target; its temporary files have short names of their own.
RANK_SUFFIX_ROOM = len(".rank999999")


def temporary_name(path: Path) -> Path:
    """The temporary file a report is written to before it is renamed over ``path``:
    beside it (a rename is atomic within one file system), and short whatever the target's
    name, so it always fits where the target fits."""
    return path.with_name(f".so-{os.getpid()}-{abs(hash(path.name)) % 10**8}.tmp")


def check_report_path(path: str | os.PathLike, what: str = ENV_REPORT) -> Path:
    """Refuse, before any model is built, a report path that cannot be written: tried for
    real with a trial file beside it."""
    path = Path(path)
    try:
        return _check_report_path(path, what)
    except OSError as exc:  # a name too long for is_dir() itself, a loop of links
        raise UserError(f"{what}={str(path)[:200]}: cannot be used ({exc.strerror or exc}); name a file with a "
                        "shorter path in a writable directory") from None


def _check_report_path(path: Path, what: str) -> Path:
    if path.is_dir():
        raise UserError(f"{what}={path}: is a directory; name a file in it, like {path / 'report.json'}")
    # mutation: report-path-non-regular
    if path.exists() and not path.is_file():
        raise UserError(f"{what}={path}: is not a regular file (a device, a pipe or a socket), and the report "
                        "replaces its file; name a regular file")
    parent = path.parent
    if not parent.is_dir():
        raise UserError(f"{what}={path}: the directory {parent} does not exist; create it or name another file")
    try:
        name_max = os.pathconf(parent, "PC_NAME_MAX")
    except (OSError, ValueError):
        name_max = 255
    # mutation: report-path-name-length
    if len(path.name.encode()) + RANK_SUFFIX_ROOM > name_max:
        raise UserError(f"{what}={str(path)[:80]}...: the file name is {len(path.name.encode())} bytes, and with "
                        f"the {RANK_SUFFIX_ROOM} bytes other workers' reports add it would not fit this file "
                        f"system's {name_max}; name a shorter file")
    if not os.access(parent, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise UserError(f"{what}={path}: cannot be written (permission denied); name a file in a writable directory")
    trial = temporary_name(path)
    try:
        # mutation: report-path-no-trial
        with open(trial, "w") as f:
            f.write("{}\n")
    except OSError as exc:
        raise UserError(f"{what}={path}: a trial file beside it could not be written ({exc.strerror or exc}); "
                        "name a file in a writable directory on a normal file system") from None
    finally:
        try:
            trial.unlink()
        except OSError:
            pass
    return path


def device_memory_from_env(environ: Mapping[str, str] = os.environ) -> int | None:
    """``SELECTIVE_OFFLOAD_DEVICE_MEMORY`` in bytes (``None`` when unset); a bad value is
    refused naming the variable, in whichever process reads it first."""
    from .sizes import parse_size

    text = environ.get(ENV_DEVICE_MEMORY, "").strip()
    if not text:
        return None
    # mutation: device-memory-env-uncut
    if len(text) > 40:  # no size is this long; the message must not repeat thousands of characters
        raise UserError(f"{ENV_DEVICE_MEMORY}: {text[:20]!r}... ({len(text)} characters) is not a size; write one "
                        "like 24GiB (or unset it to plan for the card's memory)")
    value = parse_size(text, ENV_DEVICE_MEMORY)
    if value <= 0:
        raise UserError(f"{ENV_DEVICE_MEMORY}={text!r}: must be more than 0, like 24GiB (or unset it to plan "
                        "for the card's memory)")
    return value


@dataclass(frozen=True)
class RunOptions:
    """The options of one ``enable()`` (or one plugin load)."""

    plan_path: str
    strict: bool = False
    report_path: str | None = None
    embedding_mode: str = "auto"

    def validate(self) -> "RunOptions":
        if not isinstance(self.strict, bool):
            raise UserError(f"strict={self.strict!r}: must be True or False")
        if self.embedding_mode not in EMBEDDING_MODES:
            raise UserError(f"{ENV_EMBEDDING}={self.embedding_mode!r} (embedding_mode): use one of "
                            f"{', '.join(EMBEDDING_MODES)}")
        if self.report_path is not None:
            check_report_path(self.report_path)
        return self

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "RunOptions | None":
        """The options the environment gives, validated; ``None`` when no plan is named."""
        plan = environ.get(ENV_PLAN, "").strip()
        if not plan:
            return None
        options = cls(
            plan_path=plan,
            strict=parse_flag(ENV_STRICT, environ.get(ENV_STRICT)),
            report_path=environ.get(ENV_REPORT, "").strip() or None,
            embedding_mode=environ.get(ENV_EMBEDDING, "").strip() or "auto",
        ).validate()
        # mutation: device-memory-env-late
        if plan == AUTO_PLAN:
            device_memory_from_env(environ)
        return options

    def with_default_report(self) -> "RunOptions":
        """These options with a report file in a new temporary directory when none is named;
        the path (named or not) is recorded for ``selective-offload report``."""
        if self.report_path:
            remember_report_path(self.report_path)
            return self
        directory = tempfile.mkdtemp(prefix="selective-offload-report-")
        options = RunOptions(self.plan_path, self.strict, str(Path(directory) / "report.json"), self.embedding_mode)
        # mutation: last-report-not-recorded
        remember_report_path(options.report_path)
        return options

    def to_env(self) -> dict[str, str]:
        env = {ENV_PLAN: self.plan_path, ENV_STRICT: "1" if self.strict else "0",
               ENV_EMBEDDING: self.embedding_mode}
        if self.report_path:
            env[ENV_REPORT] = self.report_path
        return env


def last_report_record() -> Path:
    """``$SELECTIVE_OFFLOAD_LAST_REPORT`` when set (and not empty), else
    ``~/.cache/selective-offload/last-report``: a text file holding one report path."""
    env = os.environ.get(ENV_LAST_REPORT, "").strip()
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "selective-offload" / "last-report"


def remember_report_path(path: str | os.PathLike) -> None:
    """Record ``path`` as the last report path. Best effort: a home directory that cannot
    be written must not stop an engine from starting (the report itself is still written,
    and its path is in the environment and the log)."""
    record = last_report_record()
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        tmp = record.with_name(f".{record.name}.{os.getpid()}.tmp")
        tmp.write_text(str(Path(path).absolute()) + "\n")
        os.replace(tmp, record)
    except OSError:
        pass


def default_report_path(environ: Mapping[str, str] = os.environ) -> Path:
    """The report a user most likely means: ``SELECTIVE_OFFLOAD_REPORT`` when this shell
    names one, else the last recorded report path."""
    named = environ.get(ENV_REPORT, "").strip()
    if named:
        return Path(named)
    record = last_report_record()
    fix = f"name the report file, like `selective-offload report /path/report.json`, or remove {str(record)[:200]}"
    try:
        text = jsonio.read_text(record, max_bytes=MAX_RECORD_BYTES).strip()
    except FileNotFoundError:
        text = ""
    except OSError as exc:
        raise UserError(f"{str(record)[:200]}: cannot read the last-report record: {exc.strerror or exc}; {fix}") from None
    except ValueError as exc:
        raise UserError(f"{str(record)[:200]}: not a last-report record (one path): {exc}; {fix}") from None
    if len(text.splitlines()) > 1:
        raise UserError(f"{str(record)[:200]}: not a last-report record: more than one line; {fix}")
    if not text:
        raise UserError(f"no report path given and none recorded in {record}: name the report file "
                        f"(the {ENV_REPORT} the server ran with), like `selective-offload report /path/report.json`")
    return Path(text)
