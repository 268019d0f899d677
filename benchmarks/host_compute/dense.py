"""The host-compute section's dense layer: a Qwen3.8-27B-shaped decoder layer's attention on
the GPU and its MLP on the host CPU, against the same layer with its MLP's bytes copied
over the link (what the prefetch offloader moves for a hot layer).

Why: for a dense model the plan's choice per offloaded layer is "MLP computed on the host,
the rest on the GPU" or "the whole layer copied ahead". The first costs the layer's
attention on the GPU, one hand-off and the CPU's read of the MLP's bytes at host memory
bandwidth; the second costs the link time of every byte (hidden behind the other layers'
compute only while there is compute to hide behind). Only a GPU shows the real hand-off
inside a layer, so each part is timed alone and the layer as one sequence:

- ``attention_s``: the projections (bf16, device-resident) and one decode token's attention
  over a KV cache of ``context`` tokens (``scaled_dot_product_attention``, grouped heads),
  with the output gate and the residual, as Qwen3.8's attention computes them;
- ``mlp_host_s``: the MLP as the one expert every token takes, through
  :class:`~selective_offload.wrappers.host_compute.HostExperts` (the stream-ordered host
  function on CUDA, replayed from a captured graph);
- ``layer_host_s``: attention then the host MLP, captured as one graph on CUDA: the layer as
  a model's step runs it;
- ``mlp_copy_s``: the MLP's stored bytes (block FP8 codes and scales) copied from the same
  page-locked host memory into device buffers, one non-blocking copy per tensor: the link
  time the prefetch path pays for this MLP, before any compute.

The output of the layer (graph replay after new inputs are written) is checked against the
same attention run eagerly followed by the MLP's torch reference on the CPU. Without CUDA
(``--small``) the same code runs on the CPU: eager calls, a host-to-host copy as the copy's
stand-in, so every line but the graph capture is exercised.
"""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.host_compute.layers import TOL_BF16, Shape, _reason, activation, capture, check, timed


@dataclass(frozen=True)
class Attention:
    """One layer's attention at decode, from the model's config."""

    heads: int
    kv_heads: int
    head_dim: int
    context: int

    @property
    def q_rows(self) -> int:  # the query and its output gate, one head_dim each per head
        return 2 * self.heads * self.head_dim


#: Qwen3.8-27B: 24 query heads (q_proj also yields a gate of the same width: 12288 rows),
#: 4 KV heads, head_dim 256; a 4096-token context.
ATTENTION = Attention(heads=24, kv_heads=4, head_dim=256, context=4096)
SMALL_ATTENTION = Attention(heads=2, kv_heads=1, head_dim=32, context=64)


def make_attention(shape: Shape, att: Attention, device, seed: int = 11) -> dict:
    """Device-resident bf16 projections and a filled KV cache, of order-one outputs."""
    import torch

    g = torch.Generator().manual_seed(seed)
    H, hd = shape.hidden, att.head_dim

    def w(rows, cols):
        return (torch.randn(rows, cols, generator=g) * cols ** -0.5).to(torch.bfloat16).to(device)

    return {"q": w(att.q_rows, H), "k": w(att.kv_heads * hd, H), "v": w(att.kv_heads * hd, H),
            "o": w(H, att.heads * hd),
            "k_cache": torch.randn(1, att.kv_heads, att.context, hd, generator=g).to(torch.bfloat16).to(device),
            "v_cache": torch.randn(1, att.kv_heads, att.context, hd, generator=g).to(torch.bfloat16).to(device)}


def attention(x, p: dict, att: Attention):
    """x [1, H] bf16 -> x + attention(x): query, gate, grouped-head attention over the cache."""
    import torch
    import torch.nn.functional as F

    q, gate = (x @ p["q"].T).split(att.heads * att.head_dim, dim=-1)
    qh = q.view(1, att.heads, 1, att.head_dim)
    out = F.scaled_dot_product_attention(qh, p["k_cache"], p["v_cache"], enable_gqa=True)
    out = out.reshape(1, att.heads * att.head_dim) * torch.sigmoid(gate)
    return x + out @ p["o"].T


def dense_layer(ctx, shape: Shape, weights, att: Attention | None = None) -> dict:
    """The parts and the whole of one dense layer with its MLP on the host (module docstring)."""
    import torch

    from selective_offload import cpu_kernels
    from selective_offload.wrappers.host_compute import HostExperts

    if not ctx.kernel_ok:
        return {"status": ctx.kernel}
    att = att or (SMALL_ATTENTION if ctx.small else ATTENTION)
    act, dev = activation(shape), ctx.device
    p = make_attention(shape, att, dev)
    he = HostExperts(shape.name, weights, act, crossover_tokens=1, threads=ctx.threads, device=dev)
    ids = torch.zeros(1, 1, dtype=torch.int32, device=dev)
    one = torch.ones(1, 1, dtype=torch.float32, device=dev)
    gen = torch.Generator().manual_seed(5)
    inputs = [torch.randn(1, shape.hidden, generator=gen).to(torch.bfloat16).to(dev) for _ in range(4)]
    x = inputs[0].clone()

    def mlp(h):
        return h + he(h, ids, one).to(h.dtype)

    def layer():
        return mlp(attention(x, p, att))

    def prepare(j):
        x.copy_(inputs[j])

    result: dict = {"status": "measured", "shape": shape.name, "tokens": 1, "attention": vars(att) | {
        "bytes": sum(t.numel() * t.element_size() for k, t in p.items() if k in ("q", "k", "v", "o"))},
        "mlp_bytes": weights.nbytes, "graph": ctx.cuda}
    deadline = ctx.deadline(0.02)
    try:
        if ctx.cuda:
            att_graph, _ = capture(lambda: attention(x, p, att))
            mid = attention(x, p, att)
            mlp_graph, _ = capture(lambda: mlp(mid))
            layer_graph, out = capture(layer)
            runs = {"attention_s": lambda j: att_graph.replay(), "mlp_host_s": lambda j: mlp_graph.replay(),
                    "layer_host_s": lambda j: layer_graph.replay()}
        else:
            runs = {"attention_s": lambda j: attention(x, p, att), "mlp_host_s": lambda j: mlp(x),
                    "layer_host_s": lambda j: layer()}
        for name, run in runs.items():
            result[name] = timed(run, len(inputs), ctx.iters, ctx.cuda, deadline,
                                 prepare=prepare if name != "mlp_host_s" else None)
        # The layer's output after new inputs: the captured graph (or the eager call) against
        # attention run eagerly and the MLP's reference on the CPU.
        prepare(1)
        if ctx.cuda:
            layer_graph.replay()
            torch.cuda.synchronize()
        else:
            out = layer()
        mid = attention(inputs[1], p, att).cpu()
        want = mid.float() + cpu_kernels.reference.moe_reference(mid, ids.cpu(), one.cpu(), weights, act)
        ctx.checks.append({"shape": shape.name, **check("dense layer (attention + host MLP)", 1, out.cpu(), want,
                                                         TOL_BF16)})
        # The prefetch path's link time for this MLP: its stored bytes, host to device.
        src = list(weights.tensors().values())
        dst = [torch.empty_like(t, device=dev) for t in src]

        def copy(j):
            for d, s in zip(dst, src):
                d.copy_(s, non_blocking=True)

        result["mlp_copy_s"] = timed(copy, 1, ctx.iters, ctx.cuda, deadline)
        result["copy"] = "host to device" if ctx.cuda else "host to host (stand-in: no device here)"
        med = result["mlp_copy_s"]["median"]
        result["mlp_copy_gbps"] = weights.nbytes / med / 1e9 if med else None
        result["layer_prefetch_s"] = result["attention_s"]["median"] + med
        result["host_over_prefetch"] = result["layer_host_s"]["median"] / result["layer_prefetch_s"]
    except Exception as exc:
        result["status"] = _reason(exc)
    return result
