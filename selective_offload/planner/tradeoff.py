"""The KV cache traded against host bytes: the same model planned for a few numbers of
sequences of ``max_model_len`` tokens decoding together (``plan --max-model-len --max-seqs``
prints the table)."""

from __future__ import annotations

from dataclasses import replace

from ..checkpoint import Checkpoint
from ..errors import UserError
from ..plan_format import Plan, PlanInputs
from .make import make_plan


def kv_tradeoff(checkpoint: Checkpoint, inputs: PlanInputs) -> list[tuple[int, Plan | UserError]]:
    """For N of 1, 2, 4, 8, 16 and ``inputs.max_seqs`` sequences decoding together, the plan
    made for them (its KV cache, host bytes and est tok/s), or why none could be made."""
    rows: list[tuple[int, Plan | UserError]] = []
    for n in sorted({1, 2, 4, 8, 16, inputs.max_seqs}):
        try:
            rows.append((n, make_plan(checkpoint, replace(inputs, max_seqs=n, batch=n), with_cpu_offload=False)))
        except UserError as exc:
            rows.append((n, exc))
    return rows
