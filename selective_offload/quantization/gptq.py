"""GPTQ (``quant_method: gptq``, ``gptq_marlin``): int weights packed into int32 along the
input dimension, zero points packed along the output, F16 scales per input group, and the
activation-order index ``g_idx``.

Parser and layout together: ``bits``, ``group_size`` and ``lm_head`` decide the tensors.
Approximated: ``g_idx`` is always stored (AutoGPTQ and GPTQModel save it with or without
``desc_act``); GPTQModel's per-module ``dynamic`` overrides are not modelled (a note says so).
"""

from __future__ import annotations

from .base import Builder, QuantScheme, cdiv, group_count
from .reader import ConfigReader


def parse_gptq(r: ConfigReader) -> tuple[QuantScheme, list[str]]:
    notes: list[str] = []
    bits = r.get_int("bits")
    if bits is None:
        bits = 4
        notes.append(f"{r.where}quantization_config (gptq) names no bits; assumed 4")
    if bits > 8:
        raise r.fail(f"bits {bits} is more than GPTQ packs (at most 8)")
    group = r.get_int("group_size", allow=(-1,))
    if group is None:
        group = 128
        notes.append(f"{r.where}quantization_config (gptq) names no group_size; assumed 128")
    desc_act = r.get_bool("desc_act")
    if r.cfg.get("dynamic"):
        notes.append(f"{r.where}quantization_config (gptq): per-module 'dynamic' overrides are not "
                     "modelled; every quantized module is counted with the top-level bits and group size")
    g = f"group {group}" if group > 0 else "per channel"
    return QuantScheme(
        method="gptq",
        description=f"GPTQ int{bits}, {g}, F16 scales, packed zeros" + (", act-order" if desc_act else ""),
        layout="gptq", bits=bits, strategy="group" if group > 0 else "channel",
        group_size=group if group > 0 else None, symmetric=r.get_bool("sym", default=True), g_idx=True,
        quantize_lm_head=r.get_bool("lm_head"),
        exclude=r.names("modules_to_not_convert"),
    ), notes


def gptq_tensors(b: Builder, s: QuantScheme, out: int, inp: int, dtype: str) -> None:
    groups = group_count(s, inp)
    b.add("qweight", "I32", (cdiv(inp * s.bits, 32), out))
    b.add("qzeros", "I32", (groups, cdiv(out * s.bits, 32)))
    b.add("scales", "F16", (groups, out))
    b.add("g_idx", "I32", (inp,))
