"""Errors a user can act on.

Every failure caused by the user's input (a path, a size, a header, a plan) is raised as
a :class:`UserError` whose message is one line: what is wrong, with which file or value,
and what to do. The CLI prints that line and exits with status 2; nothing else in the
project catches it, so a library caller sees the same message.
"""

from __future__ import annotations


class UserError(Exception):
    """Bad input: the message says what is wrong and what to do."""


class CheckpointError(UserError):
    """A checkpoint, shard header, manifest or config.json that cannot be used."""


class PlanError(UserError):
    """A plan that cannot be made, read, or applied to this model."""


def cut(text: str, limit: int = 80) -> str:
    """``text`` for a message: one line, at most ``limit`` characters (a hostile input's
    10 MB string or a path of thousands of characters is never echoed whole; what is cut
    ends in ``...``). The one place messages cut what they quote."""
    text = str(text).replace("\r", " ").replace("\n", " ")
    return text if len(text) <= limit else text[:max(0, limit - 3)] + "..."
