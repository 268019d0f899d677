"""JSON in and out with bounds: what every file a user hands us is parsed through.

Plans, manifests, configs, shard headers and reports are written by hand or by other
tools, so parsing one must fail in one line, never with a traceback: Python's parser
recurses once per nesting level (100,000 nested arrays exhaust the stack), refuses
integers of more than 4,300 digits with a ``ValueError`` that is not a
``JSONDecodeError``, and accepts ``NaN`` and ``Infinity``, which strict JSON readers
refuse. :func:`parse` bounds the size and the depth and refuses the non-standard
constants; :func:`dumps` writes strict JSON only (a non-finite number is a bug, raised).

What a parsed value means is checked field by field: :class:`FieldReader` is the one typed
reader of a JSON object's fields (integers and numbers in range, strings, booleans, enum
values, string lists), whose every failure is one line naming the file, the field and the
fix. The caller gives the error class and the default fix (a plan's reader raises
``PlanError`` and says how to re-plan), so each kind of file keeps its own voice.
"""

from __future__ import annotations

import json
import math
import os
import stat
from enum import Enum
from pathlib import Path
from typing import Any, Mapping

#: Nesting deeper than this is not a plan, manifest, config or header.
MAX_DEPTH = 64
#: A plan, manifest or config larger than this is not one (a safetensors header has its own
#: cap, checkpoint.MAX_HEADER_BYTES).
MAX_FILE_BYTES = 256_000_000
#: The largest integer a :class:`FieldReader` accepts unless told otherwise: 2**53, the
#: largest that JSON readers holding numbers as doubles keep exact.
MAX_INT = 2**53
#: The largest other number it accepts unless told otherwise (beyond it, float arithmetic
#: on the values overflows or loses every unit).
MAX_NUMBER = 1e18


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON (strict JSON has no NaN or Infinity)")


def _depth(value: Any) -> int:
    """How deep ``value`` nests (iteratively: a deep value must not exhaust the stack here)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            stack.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict) else item))
    return deepest


def _finite_float(text: str) -> float:
    value = float(text)
    # mutation: json-huge-float
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is too large (beyond a 64-bit float)")
    return value


def parse(text: str | bytes, *, max_depth: int = MAX_DEPTH) -> Any:
    """``json.loads`` with bounded depth, no NaN/Infinity and no huge integers; every
    failure is a ``ValueError`` whose message says what is wrong."""
    try:
        value = json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)
    # mutation: json-recursion-uncaught
    except RecursionError:
        raise ValueError(f"nested more than {max_depth} levels deep") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8 text ({exc.reason})") from None
    except ValueError as exc:  # JSONDecodeError, and int() past 4300 digits
        message = str(exc).splitlines()[0]
        if "integer string conversion" in message:  # int() past sys.get_int_max_str_digits()
            message = "a number has thousands of digits"
        raise ValueError(message) from None
    if _depth(value) > max_depth:
        raise ValueError(f"nested more than {max_depth} levels deep")
    return value


def read(path: str | Path, *, max_bytes: int = MAX_FILE_BYTES) -> Any:
    """Parse the JSON file at ``path``. Raises ``OSError`` (cannot read) or ``ValueError``
    (not bounded, valid JSON), for the caller to turn into its one-line error."""
    path = Path(path)
    # mutation: json-read-non-regular
    if path.exists() and not path.is_file():
        raise OSError("not a regular file")
    with path.open("rb") as f:
        raw = f.read(max_bytes + 1)
    if len(raw) > max_bytes:
        raise ValueError(f"larger than {max_bytes} bytes")
    return parse(raw)


def read_text(path: str | Path, *, max_bytes: int) -> str:
    """The text of a small file that must be one (a record holding a path): a regular file,
    opened without blocking (a FIFO would wait for a writer for ever), at most ``max_bytes``,
    UTF-8 without control characters but line ends. Raises ``OSError`` (cannot read, or not
    a regular file) or ``ValueError`` (not such text), for the caller's one line."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        # mutation: record-not-regular
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError("not a regular file")
        raw = b""
        while len(raw) <= max_bytes and (chunk := os.read(fd, max_bytes + 1 - len(raw))):
            raw += chunk
    finally:
        os.close(fd)
    # mutation: record-unbounded
    if len(raw) > max_bytes:
        raise ValueError(f"larger than {max_bytes} bytes")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8 text ({exc.reason})") from None
    if any(ord(c) < 32 and c not in "\r\n\t" or ord(c) == 127 for c in text):
        raise ValueError("holds control characters, so it is not text")
    return text


def dumps(data: Any, *, indent: int | None = 1) -> str:
    """Strict JSON (``allow_nan=False``): a NaN or Infinity raises ``ValueError``."""
    return json.dumps(data, indent=indent, allow_nan=False)


def json_type(value: Any) -> str:
    """What kind of JSON value ``value`` is, as a message says it (``an object``, ``null``)."""
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
            type(None): "null"}.get(type(value), "a number")


def finite_number(value: Any, limit: float = MAX_NUMBER) -> bool:
    """A number within ``limit``, and finite (a huge integer would overflow float arithmetic
    done with it); ``False`` for what is not a number, without raising."""
    try:
        return math.isfinite(value) and abs(value) <= limit
    except (TypeError, OverflowError):
        return False


class FieldReader:
    """Typed access to the fields of one JSON object of a file.

    ``where`` names the file, ``path`` the object inside it (``groups[3]``; empty at the
    top), ``context`` what the object is about (``group model.layers.3``), for messages.
    Every failure raises ``error`` with one line: the file, the field, what it is, what it
    must be, and ``fix`` (or a fix given for that failure). Each field read is recorded, so
    :meth:`unknown` can note the fields a file has that this release does not know.
    """

    def __init__(self, data: Any, where: str, path: str = "", context: str = "", *,
                 error: type[Exception], fix: str, max_int: int = MAX_INT, max_number: float = MAX_NUMBER) -> None:
        self.where, self.path, self.context = where, path, context
        self.error, self.fix, self.max_int, self.max_number = error, fix, max_int, max_number
        if not isinstance(data, Mapping):
            self.fail(f"must be an object, not {json_type(data)}")
        self.data = data
        self.seen: set[str] = set()

    def fail(self, problem: str, fix: str | None = None) -> None:
        at = f"{self.path} ({self.context})" if self.context else self.path
        raise self.error(f"{self.where}: {at}: {problem}; {self.fix if fix is None else fix}")

    def child(self, key: str) -> "FieldReader":
        """A reader of the object under ``key`` (same file, error, fix and bounds)."""
        return type(self)(self.raw(key), self.where, f"{self.path}.{key}" if self.path else key,
                          error=self.error, fix=self.fix, max_int=self.max_int, max_number=self.max_number)

    def raw(self, key: str, default: Any = ..., *, optional: bool = False) -> Any:
        self.seen.add(key)
        if key not in self.data:
            if default is not ... or optional:
                return None if default is ... else default
            raise self.error(f"{self.where}: {self._name(key)} is missing; {self.fix}")
        return self.data[key]

    def _name(self, key: str) -> str:
        name = f"{self.path}.{key}" if self.path else key
        return f"{name} of {self.context}" if self.context else name

    def bad(self, key: str, value: Any, wanted: str, fix: str | None = None) -> None:
        """Raise: field ``key`` holds ``value``, but must be ``wanted``."""
        raise self.error(f"{self.where}: {self._name(key)} is {json.dumps(value)[:60]}, "
                         f"but must be {wanted}; {self.fix if fix is None else fix}")

    def int(self, key: str, *, minimum: int | None = 0, default: Any = ..., optional: bool = False) -> int | None:
        value = self.raw(key, default, optional=optional)
        if value is None and (optional or default is None):
            return None
        if (isinstance(value, bool) or not isinstance(value, int) or (minimum is not None and value < minimum)
                # mutation: plan-int-unbounded
                or abs(value) > self.max_int):
            self.bad(key, value, "an integer" + (f" >= {minimum}" if minimum is not None else "")
                     + f" and at most {self.max_int}")
        return value

    def number(self, key: str, *, positive: bool, default: Any = ..., optional: bool = False) -> float | None:
        value = self.raw(key, default, optional=optional)
        if value is None and (optional or default is None):
            return None
        ok = (not isinstance(value, bool) and isinstance(value, (int, float)) and finite_number(value, self.max_number)
              and (value > 0 if positive else value >= 0))
        if not ok:
            self.bad(key, value, "a finite number " + ("> 0" if positive else ">= 0")
                     + f" and at most {self.max_number:g}")
        return float(value)

    def str(self, key: str, *, default: Any = ..., nonempty: bool = False) -> str:
        value = self.raw(key, default)
        if not isinstance(value, str) or (nonempty and not value):
            self.bad(key, value, "a non-empty string" if nonempty else "a string")
        return value

    def bool(self, key: str, *, default: Any = ...) -> bool:
        value = self.raw(key, default)
        if not isinstance(value, bool):
            self.bad(key, value, "true or false")
        return value

    def choice(self, key: str, enum: type[Enum], *, default: Any = ...) -> Any:
        """A member of ``enum`` (a string enum), by its value; a misspelling says the values."""
        value = self.raw(key, default)
        values = tuple(m.value for m in enum)
        if value not in values:
            self.bad(key, value, "one of " + ", ".join(values), fix="fix the spelling or " + self.fix)
        return enum(value)

    def str_list(self, key: str, *, default: Any = ...) -> tuple[str, ...]:
        value = self.raw(key, default)
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            self.bad(key, value, "a list of strings")
        return tuple(value)

    def unknown(self) -> list[str]:
        """Notes for fields this version does not know (tolerated)."""
        return [f"{self.where}: field {self._name(k)!r} is not known to this selective-offload "
                "and was ignored" for k in self.data if k not in self.seen]
