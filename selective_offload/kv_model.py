"""What a sequence's KV cache costs: bytes per token of the model's attention layers (KV
heads x head dim, MLA's latent, sliding windows capped at their window) plus the fixed
state of linear-attention layers, read from its config (est). The step model
(:mod:`selective_offload.estimate`) prices a step's KV reads with it, and the planner sizes
the KV cache from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

#: Bytes per element of vLLM's KV cache dtypes (``auto`` is the model's dtype: 2 for bf16).
KV_DTYPE_BYTES = {"auto": 2, "bfloat16": 2, "float16": 2, "bf16": 2, "fp16": 2, "fp8": 1, "fp8_e4m3": 1,
                  "fp8_e5m2": 1, "float32": 4}


@dataclass(frozen=True)
class KvModel:
    """KV-cache bytes of one sequence, from the model's attention layers (est)."""

    #: Per token, summed over full-attention layers.
    full_bytes_per_token: int = 0
    #: (window, bytes per token summed over layers with that window).
    sliding: tuple[tuple[int, int], ...] = ()
    #: Per sequence, whatever its length: linear-attention (recurrent and conv) state.
    fixed_bytes_per_seq: int = 0
    description: str = ""

    def bytes_per_seq(self, context: int) -> int:
        return (self.full_bytes_per_token * context + sum(min(context, w) * b for w, b in self.sliding)
                + self.fixed_bytes_per_seq)

    def cache_bytes(self, max_model_len: int, max_seqs: int) -> int:
        """The cache for ``max_seqs`` sequences of ``max_model_len`` tokens."""
        return max_seqs * self.bytes_per_seq(max_model_len)

    def to_dict(self) -> dict[str, Any]:
        return {"full_bytes_per_token": self.full_bytes_per_token, "sliding": [list(s) for s in self.sliding],
                "fixed_bytes_per_seq": self.fixed_bytes_per_seq, "description": self.description}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "KvModel":
        return cls(int(data.get("full_bytes_per_token", 0)), tuple(tuple(map(int, s)) for s in data.get("sliding", ())),
                   int(data.get("fixed_bytes_per_seq", 0)), str(data.get("description", "")))

    @classmethod
    def from_config(cls, config: Mapping[str, Any], kv_dtype_bytes: int = 2) -> "KvModel | None":
        """The KV model of a ``config.json`` (its text part), or None when it says too little
        (or says it in values that are not numbers: a hand-edited ``"num_attention_heads": "4"``)."""
        try:
            kv = cls._from_config(config, kv_dtype_bytes)
        except (TypeError, ValueError, ArithmeticError, KeyError):
            return None
        if kv is not None and not all(0 <= n <= 2**53 for n in (kv.full_bytes_per_token, kv.fixed_bytes_per_seq)):
            return None
        return kv

    @classmethod
    def _from_config(cls, config: Mapping[str, Any], kv_dtype_bytes: int) -> "KvModel | None":
        text = config.get("text_config") if isinstance(config.get("text_config"), Mapping) else None
        c = {**config, **(text or {})}
        layers = c.get("num_hidden_layers")
        if not isinstance(layers, int) or layers <= 0:
            return None
        heads = c.get("num_attention_heads")
        kv_heads = c.get("num_key_value_heads") or heads
        head_dim = c.get("head_dim") or (c.get("hidden_size") // heads if heads and c.get("hidden_size") else None)
        types = c.get("layer_types")
        kinds = _listed_kinds(types) if isinstance(types, list) and len(types) == layers else _layer_kinds(c, layers)
        if c.get("kv_lora_rank"):  # MLA (DeepSeek): one latent plus the rope key per token
            per_token = (int(c["kv_lora_rank"]) + int(c.get("qk_rope_head_dim") or 0)) * kv_dtype_bytes
            desc = f"MLA latent {c['kv_lora_rank']}+{c.get('qk_rope_head_dim') or 0}"
        elif kv_heads and head_dim:
            per_token = 2 * int(kv_heads) * int(head_dim) * kv_dtype_bytes
            desc = f"{kv_heads} KV heads x {head_dim}"
        else:
            return None
        full, sliding, linear = kinds
        window = c.get("sliding_window")
        fixed = linear * _linear_state_bytes(c)
        desc += (f"; {full} full-attention layers" + (f", {sliding} sliding ({window})" if sliding else "")
                 + (f", {linear} linear-attention (fixed state)" if linear else ""))
        return cls(full * per_token, ((int(window), sliding * per_token),) if sliding and window else (),
                   fixed, desc)


def _listed_kinds(types: list) -> tuple[int, int, int]:
    """How many of the listed layers are full attention, sliding and linear."""
    return (sum(1 for t in types if t in ("full_attention", "attention")),
            sum(1 for t in types if t in ("sliding_attention", "chunked_attention")),
            sum(1 for t in types if t in ("linear_attention", "mamba")))


def _layer_kinds(c: Mapping[str, Any], layers: int) -> tuple[int, int, int]:
    """Layer kinds (full, sliding, linear) when the config does not list them: every
    ``full_attention_interval``-th layer full (hybrid linear-attention stacks), else all
    full attention. Counted, not listed: a config may declare 2**53 layers."""
    interval = c.get("full_attention_interval")
    if isinstance(interval, int) and interval > 0:
        full = layers // interval
        return full, 0, layers - full
    return layers, 0, 0


def _linear_state_bytes(c: Mapping[str, Any]) -> int:
    """A gated-delta-net layer's state per sequence (Qwen3-Next, Qwen3.5): the recurrent
    state (value heads x key dim x value dim, float32) and the convolution's last
    ``kernel - 1`` inputs (in the model's dtype). Other linear attentions: 0 (noted)."""
    v_heads, k_heads = c.get("linear_num_value_heads"), c.get("linear_num_key_heads")
    k_dim, v_dim, kernel = c.get("linear_key_head_dim"), c.get("linear_value_head_dim"), c.get("linear_conv_kernel_dim")
    if not all(isinstance(x, int) for x in (v_heads, k_heads, k_dim, v_dim, kernel)):
        return 0
    recurrent = v_heads * k_dim * v_dim * 4
    conv = (kernel - 1) * (2 * k_heads * k_dim + v_heads * v_dim) * 2
    return recurrent + conv
