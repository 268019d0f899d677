"""Typed reads from a ``quantization_config``, for every method's parser.

A config.json is user input: a ``group_size`` of ``"abc"``, ``true`` or ``-7`` must give one
line that names the file, the method and the key, and says what to do, whichever method
reads it. So the parsers never index the mapping themselves; they ask a
:class:`ConfigReader`, which reads through the project's one typed reader
(:class:`~selective_offload.jsonio.FieldReader`) and whose failures all end with the same
way out (:data:`ACTION`).

What it adds to that reader is what configs in the wild do: one value under several names
(``bits`` or ``w_bit``), ``null`` written for "not set", integers written as strings
(``"bits": "4"``), and an exclusion list written as one string.
"""

from __future__ import annotations

from typing import Any, Mapping

from ..errors import CheckpointError
from ..jsonio import FieldReader

#: The way out every size error offers: sizes from the checkpoint itself.
ACTION = "plan from the checkpoint's safetensors headers or a manifest instead"
#: What every config error says to do.
FIX = f"fix config.json or {ACTION}"


def where_prefix(where: str) -> str:
    """``where`` (the config's path) as a message prefix ending in ``": "``."""
    if not where:
        return ""
    return where if where.endswith(": ") else f"{where.rstrip(': ')}: "


class ConfigReader:
    """Typed reads from one object of a quantization_config (the top, or a part of it such
    as ``config_groups.group_0.weights``: :meth:`sub`); bad values raise one-line
    :class:`CheckpointError` naming the file, the method and the field's path.

    ``where`` is the message prefix (:func:`where_prefix`), kept for the parsers' notes.
    A key holding ``null`` counts as absent; of several keys the first that is set is read.
    """

    def __init__(self, cfg: Mapping[str, Any], where: str, method: str, path: str = ""):
        self.cfg, self.where, self.method = cfg, where, method
        self.fields = FieldReader(cfg, f"{where}quantization_config ({method})", path,
                                  error=CheckpointError, fix=FIX)

    def sub(self, data: Any, key: str) -> "ConfigReader":
        """A reader of ``data``, the object at ``key`` under this one (one that is not an
        object is refused here, naming its path)."""
        path = f"{self.fields.path}.{key}" if self.fields.path else key
        return ConfigReader(data, self.where, self.method, path)

    def fail(self, problem: str) -> CheckpointError:
        """The error for ``problem`` (the caller raises it)."""
        return self.fields.error_for(problem)

    def _key(self, keys: tuple[str, ...]) -> str | None:
        """The first of ``keys`` that is set (not absent, not null)."""
        for key in keys:
            if self.fields.raw(key, None) is not None:
                return key
        return None

    def get(self, *keys: str) -> Any:
        """The raw value of the first of ``keys`` that is set, else ``None``."""
        key = self._key(keys)
        return None if key is None else self.cfg[key]

    def get_int(self, *keys: str, default: int | None = None, minimum: int | None = 1,
                allow: tuple[int, ...] = ()) -> int | None:
        key = self._key(keys)
        return default if key is None else self.fields.int(key, minimum=minimum, allow=allow, text=True)

    def get_bool(self, *keys: str, default: bool = False) -> bool:
        key = self._key(keys)
        return default if key is None else self.fields.bool(key)

    def get_str(self, *keys: str, default: str | None = None) -> str | None:
        key = self._key(keys)
        return default if key is None else self.fields.str(key)

    def get_ints(self, key: str, *, length: int) -> tuple[int, ...] | None:
        """``length`` positive integers (a block shape), or ``None`` when not set."""
        return None if self._key((key,)) is None else self.fields.int_list(key, length=length, minimum=1)

    def names(self, *keys: str) -> tuple[str, ...]:
        """Every entry of every list named by ``keys`` (exclusion lists; one string is a
        list of one)."""
        entries: list[str] = []
        for key in keys:
            value = self.get(key)
            if isinstance(value, str):
                entries.append(value)
            elif value is not None:
                entries += self.fields.str_list(key, of="module names")
        return tuple(dict.fromkeys(entries))
