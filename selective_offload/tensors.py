"""The facts every reader of tensors shares: a dtype's bits, a tensor's bytes, a tensor's entry.

Both the checkpoint readers (:mod:`.checkpoint`) and the quantization layouts
(:mod:`.quantization`) need them; they live here so that the imports run one way
(checkpoint -> quantization -> tensors) and neither has to import the other lazily.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Iterable

from .errors import CheckpointError
from .sizes import MAX_BYTES

#: Bits per element of every safetensors dtype. Sub-byte types (F4, F6) are packed.
DTYPE_BITS: dict[str, int] = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E4M3": 8, "F8_E5M2": 8, "F8_E8M0": 8,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32,
    "I64": 64, "U64": 64, "F64": 64,
    "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}


#: A dimension or offset larger than this is not a real tensor (2**53: see sizes.MAX_BYTES).
MAX_DIM = MAX_BYTES


def tensor_nbytes(dtype: str, shape: Iterable[int], where: str = "") -> int:
    """Bytes that ``shape`` elements of ``dtype`` occupy on disk (packed for sub-byte types)."""
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        shown = repr(dtype[:40]) if isinstance(dtype, str) else json.dumps(dtype)[:40]
        raise CheckpointError(
            f"{where}unknown dtype {shown}; known safetensors dtypes are "
            f"{', '.join(sorted(DTYPE_BITS))}"
        )
    numel = math.prod(int(d) for d in shape)
    return (numel * DTYPE_BITS[dtype] + 7) // 8


def check_shape(shape: Any, where: str) -> tuple[int, ...]:
    """A shape as safetensors reads one: a list of integers from 0 up (no floats, no
    booleans, no negative or absurd dimensions)."""
    if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= MAX_DIM for d in shape):
        raise CheckpointError(f"{where}shape {json.dumps(shape)[:60]} must be a list of whole numbers from 0 to "
                              f"{MAX_DIM}; the file is corrupt or hand-edited: fix or re-fetch it")
    if math.prod(shape) > MAX_DIM * 8:
        raise CheckpointError(f"{where}shape {shape} has more elements than any real tensor; the file is corrupt")
    return tuple(shape)


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    #: The shard file the tensor lives in, or ``None`` for a manifest entry.
    shard: str | None = None
