"""JSON in and out with bounds: what every file a user hands us is parsed through.

Plans, manifests, configs, shard headers and reports are written by hand or by other
tools, so parsing one must fail in one line, never with a traceback: Python's parser
recurses once per nesting level (100,000 nested arrays exhaust the stack), refuses
integers of more than 4,300 digits with a ``ValueError`` that is not a
``JSONDecodeError``, and accepts ``NaN`` and ``Infinity``, which strict JSON readers
refuse. :func:`parse` bounds the size and the depth and refuses the non-standard
constants; :func:`dumps` writes strict JSON only (a non-finite number is a bug, raised).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

#: Nesting deeper than this is not a plan, manifest, config or header.
MAX_DEPTH = 64
#: A plan, manifest or config larger than this is not one (a safetensors header has its own
#: cap, checkpoint.MAX_HEADER_BYTES).
MAX_FILE_BYTES = 256_000_000


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
    if path.exists() and not path.is_file():
        raise OSError("not a regular file")
    with path.open("rb") as f:
        raw = f.read(max_bytes + 1)
    if len(raw) > max_bytes:
        raise ValueError(f"larger than {max_bytes} bytes")
    return parse(raw)


def dumps(data: Any, *, indent: int | None = 1) -> str:
    """Strict JSON (``allow_nan=False``): a NaN or Infinity raises ``ValueError``."""
    return json.dumps(data, indent=indent, allow_nan=False)
