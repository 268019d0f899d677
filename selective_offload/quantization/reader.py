"""Typed reads from a ``quantization_config``, for every method's parser.

A config.json is user input: a ``group_size`` of ``"128"``, ``true`` or ``-7`` must give one
line that names the file, the method and the key, and says what to do, whichever method
reads it. So the parsers never index the mapping themselves; they ask a
:class:`ConfigReader`, whose failures all end with the same way out (:data:`ACTION`).
"""

from __future__ import annotations

from typing import Any, Mapping

from ..errors import CheckpointError, cut

#: The way out every size error offers: sizes from the checkpoint itself.
ACTION = "plan from the checkpoint's safetensors headers or a manifest instead"


def short(value: Any) -> str:
    """``value`` for an error message: its repr on one line, cut at 60 characters."""
    return cut(repr(value), 60)


def where_prefix(where: str) -> str:
    """``where`` (the config's path) as a message prefix ending in ``": "``."""
    if not where:
        return ""
    return where if where.endswith(": ") else f"{where.rstrip(': ')}: "


class ConfigReader:
    """Typed reads from a quantization_config mapping; bad values raise one-line errors."""

    def __init__(self, cfg: Mapping[str, Any], where: str, method: str):
        self.cfg, self.where, self.method = cfg, where, method

    def fail(self, problem: str) -> CheckpointError:
        return CheckpointError(
            f"{self.where}quantization_config ({self.method}): {problem}; fix config.json or {ACTION}"
        )

    def get(self, *keys: str, cfg: Mapping[str, Any] | None = None) -> Any:
        cfg = self.cfg if cfg is None else cfg
        for key in keys:
            if cfg.get(key) is not None:
                return cfg[key]
        return None

    def get_int(self, *keys: str, default: int | None = None, cfg: Mapping[str, Any] | None = None,
            minimum: int | None = 1, allow: tuple[int, ...] = ()) -> int | None:
        value = self.get(*keys, cfg=cfg)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise self.fail(f"{keys[0]} must be an integer, not {short(value)}")
        try:
            number = int(value)
        except ValueError:
            raise self.fail(f"{keys[0]} must be an integer, not {short(value)}") from None
        if minimum is not None and number < minimum and number not in allow:
            raise self.fail(f"{keys[0]} must be at least {minimum}, not {number}")
        return number

    def get_bool(self, *keys: str, default: bool = False, cfg: Mapping[str, Any] | None = None) -> bool:
        value = self.get(*keys, cfg=cfg)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.fail(f"{keys[0]} must be true or false, not {short(value)}")
        return value

    def get_str(self, *keys: str, default: str | None = None, cfg: Mapping[str, Any] | None = None) -> str | None:
        value = self.get(*keys, cfg=cfg)
        if value is None:
            return default
        if not isinstance(value, str):
            raise self.fail(f"{keys[0]} must be a string, not {short(value)}")
        return value

    def names(self, *keys: str, cfg: Mapping[str, Any] | None = None) -> tuple[str, ...]:
        """Every entry of every list named by ``keys`` (exclusion lists)."""
        cfg = self.cfg if cfg is None else cfg
        entries: list[str] = []
        for key in keys:
            value = cfg.get(key)
            if value is None:
                continue
            if isinstance(value, str):
                value = [value]
            if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
                raise self.fail(f"{key} must be a list of module names, not {short(value)}")
            entries += value
        return tuple(dict.fromkeys(entries))
