"""bitsandbytes (``quant_method: bitsandbytes``, or a config with ``load_in_4bit`` /
``load_in_8bit`` and no method): 4-bit nf4/fp4 with absmax blocks, optionally
double-quantized, and LLM.int8 with a row scale.

Parser and both layouts together, as bitsandbytes serializes a 4-bit weight with its
quant state beside it: the packed weight, ``.absmax``, ``.quant_map``, the nested
statistics under double quant, and a JSON quant state stored as a ``U8`` tensor.

Approximated: the quant-state JSON is rebuilt the way bitsandbytes writes it
(``QuantState.as_dict(packed=True)``), but its float ``nested_offset`` varies by a few
characters; the 4-bit block size is bitsandbytes' default 64 unless the config names one.
"""

from __future__ import annotations

import json
from typing import Any

from ..tensors import DTYPE_BITS
from .base import Builder, QuantScheme, cdiv
from .reader import ConfigReader

_BNB_STORAGE = {"uint8": "U8", "int8": "I8", "bfloat16": "BF16", "float16": "F16", "float32": "F32"}
_TORCH_DTYPE_NAMES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}


def parse_bnb(r: ConfigReader) -> tuple[QuantScheme, list[str]]:
    four = r.get_bool("load_in_4bit") or r.get_bool("_load_in_4bit")
    eight = r.get_bool("load_in_8bit") or r.get_bool("_load_in_8bit")
    exclude = r.names("llm_int8_skip_modules", "modules_to_not_convert")
    if four:
        quant_type = (r.get_str("bnb_4bit_quant_type", default="fp4") or "fp4").lower()
        if quant_type not in ("nf4", "fp4"):
            raise r.fail(f"bnb_4bit_quant_type {quant_type!r} is neither nf4 nor fp4")
        storage_name = (r.get_str("bnb_4bit_quant_storage", default="uint8") or "uint8").removeprefix("torch.")
        storage = _BNB_STORAGE.get(storage_name)
        if storage is None:
            raise r.fail(f"bnb_4bit_quant_storage {storage_name!r} is not a storage dtype bitsandbytes packs into")
        double = r.get_bool("bnb_4bit_use_double_quant")
        blocksize = r.get_int("bnb_4bit_blocksize", "blocksize", default=64)
        return QuantScheme(
            method="bitsandbytes-4bit",
            description=f"bitsandbytes {quant_type}, absmax per {blocksize} weights"
                        + (" (double-quantized)" if double else ""),
            layout="bnb4", bits=4, strategy="group", group_size=blocksize, quant_type=quant_type,
            double_quant=double, storage_dtype=storage, exclude=exclude,
        ), []
    if eight:
        return QuantScheme(
            method="bitsandbytes-8bit", description="bitsandbytes LLM.int8, I8 weights, F32 scale per row",
            layout="bnb8", bits=8, strategy="channel", exclude=exclude,
        ), []
    raise r.fail("sets neither load_in_4bit nor load_in_8bit")


def _bnb_quant_state(s: QuantScheme, out: int, inp: int, dtype: str) -> int:
    """Length of bitsandbytes' packed quant-state JSON (``QuantState.as_dict(packed=True)``)."""
    state: dict[str, Any] = {
        "quant_type": s.quant_type or "nf4",
        "blocksize": s.group_size or 64,
        "dtype": _TORCH_DTYPE_NAMES.get(dtype, "float16"),
        "shape": [out, inp],
    }
    if s.double_quant:
        # A float32 mean written by Python: typically 17-20 characters.
        state.update(nested_blocksize=256, nested_dtype="float32", nested_offset=0.012345678901234567)
    return len(json.dumps(state).encode())


def bnb4_tensors(b: Builder, s: QuantScheme, out: int, inp: int, dtype: str) -> None:
    numel = out * inp
    per_element = 2 * DTYPE_BITS[s.storage_dtype] // 8  # 4-bit values per stored element
    b.add("weight", s.storage_dtype, (cdiv(numel, per_element), 1))
    blocks = cdiv(numel, s.group_size or 64)
    if s.double_quant:
        b.add("weight.absmax", "U8", (blocks,))
    else:
        b.add("weight.absmax", "F32", (blocks,))
    b.add("weight.quant_map", "F32", (16,))
    if s.double_quant:
        b.add("weight.nested_absmax", "F32", (cdiv(blocks, 256),))
        b.add("weight.nested_quant_map", "F32", (256,))
    b.add(f"weight.quant_state.bitsandbytes__{s.quant_type or 'nf4'}", "U8",
          (_bnb_quant_state(s, out, inp, dtype),))


def bnb8_tensors(b: Builder, s: QuantScheme, out: int, inp: int, dtype: str) -> None:
    b.add("weight", "I8", (out, inp))
    b.add("SCB", "F32", (out,))
    b.scalar("weight_format", "U8")
