"""The facts every reader of tensors shares: a dtype's bits, a tensor's bytes, a tensor's entry.

Both the checkpoint readers (:mod:`.checkpoint`) and the quantization layouts
(:mod:`.quantization`) need them; they live here so that the imports run one way
(checkpoint -> quantization -> tensors) and neither has to import the other lazily.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

from .errors import CheckpointError

#: Bits per element of every safetensors dtype. Sub-byte types (F4, F6) are packed.
DTYPE_BITS: dict[str, int] = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E4M3": 8, "F8_E5M2": 8, "F8_E8M0": 8,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32,
    "I64": 64, "U64": 64, "F64": 64,
    "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}


def tensor_nbytes(dtype: str, shape: Iterable[int], where: str = "") -> int:
    """Bytes that ``shape`` elements of ``dtype`` occupy on disk (packed for sub-byte types)."""
    if dtype not in DTYPE_BITS:
        raise CheckpointError(
            f"{where}unknown dtype {dtype!r}; known safetensors dtypes are "
            f"{', '.join(sorted(DTYPE_BITS))}"
        )
    numel = math.prod(int(d) for d in shape)
    return (numel * DTYPE_BITS[dtype] + 7) // 8


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    #: The shard file the tensor lives in, or ``None`` for a manifest entry.
    shard: str | None = None
