"""What one decode step costs, estimated from bytes and bandwidths: the traffic model.

A decode step of a memory-bound model reads every resident weight once from VRAM, every
offloaded weight once over the link, and each sequence's KV cache. Four levers change
what that costs per generated token; each is priced here, and every figure is an
estimate (``est_``) that ignores compute (see :data:`~selective_offload.plan.EST_IGNORES`).

- **Overlap, as each mechanism moves bytes.** vLLM's prefetch offloader copies the next
  offloaded layer while the layers before it compute, so an offloaded layer costs about
  ``max(its copy, the compute it hides behind)``, not the sum (:func:`pipelined_step_s`).
  Bulk ``cpu_offload_gb`` reads its bytes through UVA inside the kernels: in line, no
  overlap (:func:`inline_step_s`).
- **Batch.** ``N`` concurrent sequences share one pass over the weights (and one trip of
  every offloaded byte over the link); each adds its own embedding rows and KV reads.
- **Speculative decoding.** An MTP head drafts ``K`` tokens (``K`` passes over the head and
  the LM head it shares), then one target pass verifies ``K + 1`` tokens per sequence.
  With a per-token acceptance rate ``a``, a step yields on average
  ``E(K, a) = (1 - a**(K + 1)) / (1 - a)`` tokens per sequence (the accepted prefix plus
  the target's own next token; :func:`expected_tokens_per_step`). Speculation pays when
  ``E(K, a) / (step + draft) > 1 / step_without``; the head's bytes also displace decoder
  layers to the host, which the placement prices.
- **KV cache.** Bytes per token from the model's attention layers (KV heads x head dim,
  MLA's latent, sliding windows capped at their window) plus the fixed state of
  linear-attention layers (:class:`KvModel`); a step reads each sequence's context.

Default acceptance rate: :data:`DEFAULT_ACCEPT_RATE`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

#: DeepSeek-V3's technical report (arXiv:2412.19437, section 5.4.3) measures 85-90%
#: acceptance of its MTP head's second-token prediction; the low end is the default. No
#: published figure was found for Qwen's MTP heads: pass ``--accept-rate`` from vLLM's own
#: spec-decode metrics (accepted / draft tokens) for the model you run.
DEFAULT_ACCEPT_RATE = 0.85

#: Bytes per element of vLLM's KV cache dtypes (``auto`` is the model's dtype: 2 for bf16).
KV_DTYPE_BYTES = {"auto": 2, "bfloat16": 2, "float16": 2, "bf16": 2, "fp16": 2, "fp8": 1, "fp8_e4m3": 1,
                  "fp8_e5m2": 1, "float32": 4}


def expected_tokens_per_step(k: int, accept_rate: float) -> float:
    """Tokens a sequence gains per step with ``k`` draft tokens at acceptance ``accept_rate``."""
    if k <= 0:
        return 1.0
    if accept_rate >= 1.0:
        return float(k + 1)
    return (1.0 - accept_rate ** (k + 1)) / (1.0 - accept_rate)


@dataclass(frozen=True)
class LayerCost:
    """One decoder layer in a step: the time its compute takes (its weights and KV read
    from VRAM, est) and, when it is offloaded, the time its copy over the link takes."""

    compute_s: float
    copy_s: float = 0.0


def pipelined_step_s(layers: list[LayerCost], other_s: float) -> tuple[float, float]:
    """Step time with the prefetch offloader, and how much link time it hides.

    Each offloaded layer's copy starts when the previous offloaded layer starts computing
    (one slot ahead) and overlaps everything computed from there up to it: the layers in
    between and, cyclically across steps, the tail of one step (``other_s``: LM head,
    sampling) and the head of the next. So the step is the sum, over those segments, of
    ``max(copy, compute of the segment)``.
    """
    offloaded = [i for i, layer in enumerate(layers) if layer.copy_s > 0]
    compute = sum(layer.compute_s for layer in layers) + other_s
    if not offloaded:
        return compute, 0.0
    step = 0.0
    for n, j in enumerate(offloaded):
        prev = offloaded[n - 1]
        if n == 0:  # wraps around: from the last offloaded layer through the step's end
            segment = sum(l.compute_s for l in layers[prev:]) + other_s + sum(l.compute_s for l in layers[:j])
        else:
            segment = sum(l.compute_s for l in layers[prev:j])
        step += max(layers[j].copy_s, segment)
    link = sum(layers[j].copy_s for j in offloaded)
    return step, compute + link - step


def inline_step_s(device_read_s: float, uva_read_s: float) -> float:
    """Bulk ``cpu_offload_gb``: kernels read offloaded weights through UVA, in line."""
    return device_read_s + uva_read_s


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
        if not isinstance(types, list) or len(types) != layers:
            types = _layer_types(c, layers)
        if c.get("kv_lora_rank"):  # MLA (DeepSeek): one latent plus the rope key per token
            per_token = (int(c["kv_lora_rank"]) + int(c.get("qk_rope_head_dim") or 0)) * kv_dtype_bytes
            desc = f"MLA latent {c['kv_lora_rank']}+{c.get('qk_rope_head_dim') or 0}"
        elif kv_heads and head_dim:
            per_token = 2 * int(kv_heads) * int(head_dim) * kv_dtype_bytes
            desc = f"{kv_heads} KV heads x {head_dim}"
        else:
            return None
        full = sum(1 for t in types if t in ("full_attention", "attention"))
        window = c.get("sliding_window")
        sliding = sum(1 for t in types if t in ("sliding_attention", "chunked_attention"))
        linear = sum(1 for t in types if t in ("linear_attention", "mamba"))
        fixed = linear * _linear_state_bytes(c)
        desc += (f"; {full} full-attention layers" + (f", {sliding} sliding ({window})" if sliding else "")
                 + (f", {linear} linear-attention (fixed state)" if linear else ""))
        return cls(full * per_token, ((int(window), sliding * per_token),) if sliding and window else (),
                   fixed, desc)


def _layer_types(c: Mapping[str, Any], layers: int) -> list[str]:
    """Layer kinds when the config does not list them: every ``full_attention_interval``-th
    layer full (hybrid linear-attention stacks), else all full attention."""
    interval = c.get("full_attention_interval")
    if isinstance(interval, int) and interval > 0:
        return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
    return ["full_attention"] * layers


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


@dataclass(frozen=True)
class Traffic:
    """The bytes one decode pass moves, by where they are read from (a placement's view)."""

    #: Decoder layers in stack order: (bytes read per pass, whether it is offloaded and
    #: prefetched over the link).
    layers: tuple[tuple[int, bool], ...] = ()
    #: Other resident bytes read every pass (the LM head, a tied embedding, norms).
    other_device_bytes: int = 0
    #: Bytes of one embedding row, gathered on the host (per token) or read on the device.
    row_bytes_host: int = 0
    row_bytes_device: int = 0
    #: Bulk cpu_offload_gb: bytes the kernels read through UVA, in line, every pass.
    uva_bytes: int = 0
    #: Speculative decoding: bytes each draft pass reads (the MTP head and the LM head).
    draft_bytes: int = 0


@dataclass(frozen=True)
class StepSettings:
    link_gbps: float
    vram_gbps: float
    batch: int = 1
    spec_tokens: int = 0
    accept_rate: float = DEFAULT_ACCEPT_RATE
    #: Average context of a sequence in the step (KV read per sequence); 0: not priced.
    context_tokens: int = 0


def step_cost(traffic: Traffic, settings: StepSettings, kv: KvModel | None, *, pipelined: bool) -> dict[str, float]:
    """The est_ figures of one step: link, VRAM, hidden link time, draft time, step time,
    tokens per step and tok/s (total and per sequence). ``pipelined``: the prefetch
    offloader's overlap (selective); otherwise every byte is paid in line (bulk)."""
    gb_link, gb_vram = settings.link_gbps * 1e9, settings.vram_gbps * 1e9
    n, k = max(1, settings.batch), max(0, settings.spec_tokens)
    tokens_per_pass = n * (k + 1)
    kv_s = (n * kv.bytes_per_seq(settings.context_tokens) / gb_vram) if kv is not None and settings.context_tokens else 0.0
    rows_link_s = traffic.row_bytes_host * (tokens_per_pass + k * n) / gb_link
    copies_s = sum(b for b, host in traffic.layers if host) / gb_link
    layer_read_s = sum(b for b, _ in traffic.layers) / gb_vram
    other_s = (traffic.other_device_bytes + traffic.row_bytes_device * tokens_per_pass) / gb_vram
    draft_s = k * traffic.draft_bytes / gb_vram
    link_s = copies_s + rows_link_s + traffic.uva_bytes / gb_link
    vram_s = layer_read_s + other_s + kv_s
    if pipelined:
        per_layer_kv = kv_s / len(traffic.layers) if traffic.layers else 0.0
        costs = [LayerCost(b / gb_vram + per_layer_kv, (b / gb_link) if host else 0.0) for b, host in traffic.layers]
        core, hidden = pipelined_step_s(costs, other_s + (0.0 if traffic.layers else kv_s))
        step = core + rows_link_s + traffic.uva_bytes / gb_link + draft_s
    else:
        hidden = 0.0
        step = inline_step_s(vram_s, link_s) + draft_s
    tokens = n * expected_tokens_per_step(k, settings.accept_rate)
    tok_s = tokens / step if step > 0 else float("inf")
    return {"est_link_s_per_step": link_s, "est_vram_s_per_step": vram_s, "est_step_s": step, "est_tok_s": tok_s,
            "est_tokens_per_step": tokens, "est_tok_s_per_seq": tok_s / n, "est_hidden_link_s_per_step": hidden,
            "est_draft_s_per_step": draft_s}
