"""JSON in and out with bounds: what every file a user hands us is parsed through.

Plans, manifests, configs, shard headers and reports are written by hand or by other
tools, so parsing one must fail in one line, never with a traceback: Python's parser
recurses once per nesting level (100,000 nested arrays exhaust the stack), refuses
integers of more than 4,300 digits with a ``ValueError`` that is not a
``JSONDecodeError``, and accepts ``NaN`` and ``Infinity``, which strict JSON readers
refuse. :func:`parse` bounds the size and the depth and refuses the non-standard
constants; :func:`dumps` writes strict JSON only (a non-finite number is a bug, raised).

What a parsed value means is checked field by field: :class:`FieldReader` is the one typed
reader of a JSON object's fields (integers and numbers in range with their unit, one-line
strings, booleans, enum values, string and integer lists, objects, each optionally null),
whose every failure is one line naming the file, the field and the fix. Plans, reports,
probe profiles and quantization configs all read through it. The caller gives the error
class and the default fix (a plan's reader raises ``PlanError`` and says how to re-plan; a
profile's ``UserError`` says to probe again), so each kind of file keeps its own voice.
"""

from __future__ import annotations

import json
import math
import os
import stat
from enum import Enum
from pathlib import Path
from typing import Any, Mapping

from .errors import cut

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
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is too large (beyond a 64-bit float)")
    return value


def parse(text: str | bytes, *, max_depth: int = MAX_DEPTH) -> Any:
    """``json.loads`` with bounded depth, no NaN/Infinity and no huge integers; every
    failure is a ``ValueError`` whose message says what is wrong."""
    try:
        value = json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)
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
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError("not a regular file")
        raw = b""
        while len(raw) <= max_bytes and (chunk := os.read(fd, max_bytes + 1 - len(raw))):
            raw += chunk
    finally:
        os.close(fd)
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


def json_text(value: Any) -> str:
    """``value`` as JSON for a message (a non-finite float as Python spells it; a value JSON
    cannot hold, such as a tuple key, as Python does)."""
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def finite_number(value: Any, limit: float = MAX_NUMBER) -> bool:
    """A number within ``limit``, and finite (a huge integer would overflow float arithmetic
    done with it); ``False`` for what is not a number, without raising."""
    try:
        return math.isfinite(value) and abs(value) <= limit
    except (TypeError, OverflowError):
        return False


class FieldReader:
    """Typed access to the fields of one JSON object of a file.

    ``where`` names the file (or, for an object embedded in one, the file and what the
    object is: ``config.json: quantization_config (gptq)``), ``path`` the object inside it
    (``groups[3]``; empty at the top), ``context`` what the object is about (``group
    model.layers.3``), for messages. Every failure raises ``error`` with one line: the
    file, the field, what it is, what it must be, and ``fix`` (or a fix given for that
    failure). Each field read is recorded, so :meth:`unknown` can note the fields a file
    has that this release does not know.

    A field may be absent (``default``, or ``optional``: ``None``) and, separately, may
    hold ``null`` (``nullable``: ``None``): a profile requires ``vram_gbps`` but lets it be
    null on a machine without a GPU. Numbers take bounds and a unit for the message
    (``a number of GB/s from 0.001 to 1e+06``), so each reader says its own limits in the
    same words.
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
        raise self.error_for(problem, fix)

    def error_for(self, problem: str, fix: str | None = None) -> Exception:
        """The error :meth:`fail` raises, for a caller that raises it itself."""
        at = f"{self.path} ({self.context})" if self.context else self.path
        return self.error(f"{self.where}: {at + ': ' if at else ''}{problem}; {self.fix if fix is None else fix}")

    def child(self, key: str) -> "FieldReader":
        """A reader of the object under ``key`` (same file, error, fix and bounds)."""
        return self.within(self.raw(key), key)

    def within(self, data: Any, key: str) -> "FieldReader":
        """A reader of ``data``, the object at ``key`` under this one (``key`` may index:
        ``config_groups.group_0``), with the same file, error, fix and bounds."""
        return FieldReader(data, self.where, f"{self.path}.{key}" if self.path else key,
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
        """Raise: field ``key`` holds ``value``, but must be ``wanted``. The name and the value
        are cut (a hostile key or value of megabytes is never echoed whole)."""
        raise self.error(f"{self.where}: {cut(self._name(key), 80)} is "
                         f"{cut(json_text(value), 60)}, but must be {wanted}; {self.fix if fix is None else fix}")

    def _value(self, key: str, default: Any, optional: bool, nullable: bool) -> Any:
        """The raw value, or ``...`` when it is absent-and-allowed or an allowed null."""
        value = self.raw(key, default, optional=optional)
        if value is None and (optional or nullable or default is None):
            return ...
        return value

    def int(self, key: str, *, minimum: int | None = 0, maximum: int | None = None, allow: tuple[int, ...] = (),
            unit: str = "", text: bool = False, nullable: bool = False, default: Any = ...,
            optional: bool = False) -> int | None:
        """An integer from ``minimum`` to ``maximum`` (default: the reader's ``max_int``), or
        one of ``allow`` (a sentinel such as -1). ``text``: a decimal integer written as a
        string (``"128"``) counts too, as some tools write configs."""
        value = self._value(key, default, optional, nullable)
        if value is ...:
            return None
        top = self.max_int if maximum is None else maximum
        number = value
        if text and isinstance(value, str) and len(value) <= 20:
            try:
                number = int(value)
            except ValueError:
                pass
        if number in allow and not isinstance(number, bool) and isinstance(number, int):
            return number
        if (isinstance(number, bool) or not isinstance(number, int) or (minimum is not None and number < minimum)
                or abs(number) > top):
            what = f"a whole number of {unit}" if unit else "an integer"
            too_large = isinstance(number, int) and not isinstance(number, bool) and abs(number) > top
            if maximum is not None and minimum is not None:
                what += f" from {minimum} to {top}"
            else:  # the reader's own bound is named only to the value that passed it
                what += (f" >= {minimum}" if minimum is not None else "") + (f" and at most {top}" if too_large else "")
            what += (f" (or {', '.join(map(repr, allow))})" if allow else "") + (", or null" if nullable else "")
            self.bad(key, value, what)
        return number

    def number(self, key: str, *, positive: bool = False, minimum: float | None = None,
               maximum: float | None = None, unit: str = "", nullable: bool = False, default: Any = ...,
               optional: bool = False) -> float | None:
        """A finite number: ``> 0`` (``positive``) or ``>= 0``, or from ``minimum``; at most
        ``maximum`` (default: the reader's ``max_number``)."""
        value = self._value(key, default, optional, nullable)
        if value is ...:
            return None
        top = self.max_number if maximum is None else maximum
        low = (0 if minimum is None else minimum)
        ok = (not isinstance(value, bool) and isinstance(value, (int, float)) and finite_number(value, top)
              and (value > low if positive else value >= low))
        if not ok:
            what = f"a number of {unit}" if unit else "a finite number"
            if minimum is not None and maximum is not None and not positive:
                what += f" from {minimum:g} to {top:g}"
            else:
                what += (" > " if positive else " >= ") + f"{low:g} and at most {top:g}"
            self.bad(key, value, what + (", or null" if nullable else ""))
        return float(value)

    def str(self, key: str, *, default: Any = ..., nonempty: bool = False, one_line: bool = False,
            nullable: bool = False) -> str | None:
        """A string; ``nonempty``: not ``""``; ``one_line``: not blank, no line break (a name
        printed on a line of its own)."""
        value = self._value(key, default, False, nullable) if nullable else self.raw(key, default)
        if value is ...:
            return None
        if (not isinstance(value, str) or (nonempty and not value)
                or (one_line and (not value.strip() or "\n" in value or "\r" in value))):
            what = "a one-line string" if one_line else "a non-empty string" if nonempty else "a string"
            self.bad(key, value, what + (", or null" if nullable else ""))
        return value

    def bool(self, key: str, *, default: Any = ..., nullable: bool = False) -> bool | None:
        value = self._value(key, default, False, nullable) if nullable else self.raw(key, default)
        if value is ...:
            return None
        if not isinstance(value, bool):
            self.bad(key, value, "true or false" + (", or null" if nullable else ""))
        return value

    def choice(self, key: str, enum: type[Enum], *, default: Any = ...) -> Any:
        """A member of ``enum`` (a string enum), by its value; a misspelling says the values."""
        value = self.raw(key, default)
        values = tuple(m.value for m in enum)
        if value not in values:
            self.bad(key, value, "one of " + ", ".join(values), fix="fix the spelling or " + self.fix)
        return enum(value)

    def str_list(self, key: str, *, default: Any = ..., of: str = "strings") -> tuple[str, ...]:
        """A list of strings (``of`` says what they are: ``module names``)."""
        value = self.raw(key, default)
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            self.bad(key, value, f"a list of {of}")
        return tuple(value)

    def int_list(self, key: str, *, length: int | None = None, minimum: int = 0,
                 default: Any = ...) -> tuple[int, ...]:
        """A list of integers from ``minimum`` to the reader's ``max_int``, of ``length``
        entries when given (a block shape: two positive integers)."""
        value = self.raw(key, default)
        if (not isinstance(value, (list, tuple)) or (length is not None and len(value) != length)
                or not all(not isinstance(v, bool) and isinstance(v, int) and minimum <= v <= self.max_int
                           for v in value)):
            self.bad(key, value, f"a list of {'' if length is None else f'{length} '}integers from {minimum} "
                     f"to {self.max_int}")
        return tuple(value)

    def object(self, key: str, *, default: Any = ..., what: str = "an object") -> Mapping:
        """The object under ``key`` as it is (its entries are the caller's to read: keys that
        are data, such as copy sizes, not field names); ``what`` says what it must hold."""
        value = self.raw(key, default)
        if not isinstance(value, Mapping):
            self.bad(key, value, what)
        return value

    def unknown(self) -> list[str]:
        """Notes for fields this version does not know (tolerated)."""
        return [f"{self.where}: field {self._name(k)!r} is not known to this selective-offload "
                "and was ignored" for k in self.data if k not in self.seen]
