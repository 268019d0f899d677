"""What the decode emulation predicts a step costs, from bytes and bandwidths, and the
break-even arithmetic of speculative decoding.

Why a module of its own: the estimate (link bytes over the link rate plus device bytes over
the device rate, the planner's formula) is what each measured step is put beside; keeping
it apart from the timing (``emulation_sections.py``) keeps "est" and "measured" from being
computed in the same breath. Pure arithmetic over an :class:`emulated_model.Emulated`.
"""

from __future__ import annotations

from emulated_model import Emulated


def predict(emu: Emulated, bw: dict, tokens: int = 1) -> dict:
    """est_ step time from bytes: link bytes / link rate + device bytes / device rate. A
    step of ``tokens`` tokens reads the same weights and ``tokens`` embedding rows."""
    link_rate = bw["link_gbps"]
    if emu.name == "bulk":
        # Bulk reads its host bytes in place: through a UVA view on CUDA, and on the CPU a
        # plain read of host memory, which is the device read there.
        link_rate = bw.get("uva_read_gbps") or bw["device_read_gbps"]
    rows = (tokens - 1) * emu.row_bytes
    link_bytes = emu.link_bytes + (rows if emu.gather is not None else 0)
    device_bytes = emu.device_read_bytes + (0 if emu.gather is not None else rows)
    link_s = link_bytes / (link_rate * 1e9)
    vram_s = device_bytes / (bw["device_read_gbps"] * 1e9)
    out = {"link_bytes_per_step": link_bytes, "device_read_bytes_per_step": device_bytes,
           "est_link_s": link_s, "est_device_s": vram_s, "est_step_s": link_s + vram_s,
           "link_rate_used_gbps": link_rate}
    if emu.overlap:
        out["est_step_s_overlapped"] = max(link_s, vram_s)
    return out


def draft_bytes(emu: Emulated) -> tuple[int, int]:
    """(device bytes, link bytes) one draft pass reads: the head, the LM head, one row."""
    dev = emu.mtp.numel() * 2 + emu.lm_head.numel() * 2
    return (dev, emu.row_bytes) if emu.gather is not None else (dev + emu.row_bytes, 0)


def expected_tokens(k: int, accept: float) -> float:
    """Tokens a verification step yields with ``k`` drafts, each accepted with probability
    ``accept`` independently (the accepted prefix plus the target's own token)."""
    if accept >= 1.0:
        return float(k + 1)
    return (1.0 - accept ** (k + 1)) / (1.0 - accept)


def break_even_accept(k: int, tokens: float) -> float | None:
    """The acceptance rate at which ``expected_tokens(k, .) == tokens``; None when even
    every draft accepted (k + 1 tokens) is not enough."""
    if tokens <= 1.0:
        return 0.0
    if tokens > k + 1:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens(k, mid) < tokens else (lo, mid)
    return (lo + hi) / 2
