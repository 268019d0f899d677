"""CPU proxies of the GPU run's layout, arena and fused-MoE checks (tests/gpu), so the GPU
run compares against code already known right here.

- The fused-MoE stand-in (``tests/gpu/grouped_moe.py``, standing in for vLLM's
  ``TritonExperts``) runs its own Triton kernel under Triton's interpreter
  (``TRITON_INTERPRET=1``, in a subprocess: Triton reads it at import) and equals a
  per-token float32 reference, for weights in vLLM's layout and through a strided view of
  them; the same bytes in another layout give another answer, so a wrong layout is caught.
- Its routing (``align``, vLLM's ``moe_align_block_size`` in fixed-shape ops) groups every
  slot once, under its own expert, each run padded to the block.
- The arena checks' host half, with ``PageRegistrar`` standing in for the driver (whole
  pages, error 712 on a page registered twice, ``is_pinned`` by address): the small heap
  tensors share pages, so one ``lock()`` each is refused and counted, while one arena is one
  registration that reads as pinned; the hot layer's FP8 ``.t()`` weights keep their layout
  through ``lock_together``; the experts through ``experts.attach`` are handed to the view
  factory pinned and come back marked views with their layout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from helpers import REPO

GPU = REPO / "tests" / "gpu"
sys.path.insert(0, str(GPU))

from layouts import (  # noqa: E402
    PageRegistrar,
    RoutedExpertsLike,
    attach_views,
    fp8_t_weight,
    heap_scales,
    host_span,
    hot_layer,
    layout,
    strided_view,
)

from selective_offload.wrappers.page_locked import PageLockedLedger, PinPolicy  # noqa: E402

TINY = {"moe_experts": 8, "moe_hidden": 64, "moe_inter": 32, "hot_q": 128, "hot_kv": 32, "head_dim": 16}

INTERPRETED = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import torch
import torch.nn.functional as F
import grouped_moe as g

def per_token(x, w13, w2, w, ids):
    inter = w13.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = w13[e].double() @ x[t].double()
            out[t] += float(w[t, j]) * (w2[e].double() @ (F.silu(h[:inter]) * h[inter:]))
    return out

rows = []
for tokens, experts, hidden, inter, top_k in ((3, 8, 32, 24, 2), (24, 3, 40, 16, 2)):
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.1
    w2_t = torch.randn(experts, inter, hidden, generator=gen) * 0.1   # stored (E, I, H) ...
    w2 = w2_t.transpose(1, 2)                                           # ... read as (E, H, I): strided
    w, ids = g.routing(tokens, experts, top_k, "cpu", seed=tokens)
    ref = per_token(x, w13, w2, w, ids)
    got = g.grouped_experts(x, w13, w2, w, ids, blocks=(16, 16, 16)).double()
    dense = g.grouped_experts(x, w13, w2.contiguous(), w, ids, blocks=(16, 16, 16)).double()
    wrong = g.grouped_experts(x, w13, w2_t.reshape(w2.shape), w, ids, blocks=(16, 16, 16)).double()
    eager = g.reference_experts(x, w13, w2, w, ids).double()
    counts = torch.bincount(ids.reshape(-1).long(), minlength=experts)
    rows.append({"tokens": tokens, "scale": float(ref.abs().max()), "err": float((got - ref).abs().max()),
                 "dense_equal": bool(torch.equal(got, dense)), "wrong_err": float((wrong - ref).abs().max()),
                 "eager_err": float((eager - ref).abs().max()), "max_count": int(counts.max()),
                 "empty_experts": int((counts == 0).sum())})
print(json.dumps(rows))
"""


@pytest.fixture(scope="module")
def interpreted():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", INTERPRETED, str(GPU)], capture_output=True, text=True,
                          timeout=300, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_fused_moe_stand_in_equals_a_per_token_reference(interpreted):
    for row in interpreted:
        assert row["err"] <= 1e-5 * max(row["scale"], 1.0), row
        assert row["eager_err"] <= 1e-5 * max(row["scale"], 1.0), row  # the GPU check's own reference
    # Both cases the kernel must get right: an expert with more tokens than a block, and
    # experts no token routes to.
    assert any(r["max_count"] > 16 for r in interpreted) and any(r["empty_experts"] for r in interpreted)


def test_the_stand_in_reads_weights_through_their_strides_and_a_wrong_layout_is_caught(interpreted):
    for row in interpreted:
        assert row["dense_equal"], row  # a strided view and its contiguous copy: the same result
        assert row["wrong_err"] > 0.1 * row["scale"], row  # the same bytes laid out otherwise: caught


def test_routing_groups_every_slot_once_under_its_own_expert():
    g = pytest.importorskip("grouped_moe")
    weights, ids = g.routing(24, 3, 2, "cpu", seed=1)
    sorted_ids, expert_ids, padded = g.align(ids, 3, 16)
    flat = ids.reshape(-1)
    total = int(padded)
    assert total % 16 == 0 and total == sum(-(-int((flat == e).sum()) // 16) * 16 for e in range(3))
    used = sorted_ids[:total]
    real = used[used < flat.numel()]
    assert sorted(real.tolist()) == list(range(flat.numel()))  # every slot once
    for b in range(total // 16):
        block = sorted_ids[b * 16:(b + 1) * 16]
        block = block[block < flat.numel()].long()
        assert (flat[block] == expert_ids[b]).all()
    assert (sorted_ids[total:] == flat.numel()).all()


def test_a_strided_view_is_the_same_bytes_with_the_same_layout():
    w = fp8_t_weight(64, 32, seed=0)
    assert w.stride() == (1, 32)
    span = host_span(w)
    assert span.data_ptr() == w.data_ptr() and span.numel() == 64 * 32 and span.is_contiguous()
    again = strided_view(w, lambda flat: flat.clone())  # other memory, as a device view is
    assert layout(again)[:3] == layout(w)[:3] and torch.equal(again.view(torch.uint8), w.view(torch.uint8))


def heap_scales_sharing_pages(count: int, seed: int) -> list[torch.Tensor]:
    """:func:`heap_scales` whose tensors share pages, the premise of the test below. In a
    fresh process consecutive small allocations lie side by side; late in a long one the
    heap may hand them scattered holes, one to a page. Then allocate again, the earlier
    ones kept (they fill the holes), a few times: the tensors are still the heap's own."""
    held = []
    for attempt in range(8):
        scales = heap_scales(count, seed=seed + 100 * attempt)
        pages = [p for t in scales for p in range(t.data_ptr() // 4096, (t.data_ptr() + t.untyped_storage().nbytes() - 1) // 4096 + 1)]
        if len(pages) != len(set(pages)):
            return scales
        held.append(scales)
    pytest.skip(f"the heap gave {count} small tensors a page each, 8 times over: nothing shares a page to refuse")


def test_small_heap_tensors_share_pages_so_lock_per_tensor_is_refused_and_counted():
    registrar = PageRegistrar()
    ledger = PageLockedLedger(PinPolicy.decide(cuda=True), registrar)
    scales = heap_scales_sharing_pages(64, seed=2)
    got = [ledger.lock(t, f"scale{i}") for i, t in enumerate(scales)]
    refused = [t for t, ok in zip(scales, got) if not ok]
    assert refused and registrar.refused == len(refused)  # the premise, on this heap
    assert ledger.refused_bytes == sum(t.untyped_storage().nbytes() for t in refused)
    assert all(ledger.pinned(t) for t, ok in zip(scales, got) if ok)


def test_small_heap_tensors_lock_as_one_arena_that_reads_as_pinned():
    registrar = PageRegistrar()
    ledger = PageLockedLedger(PinPolicy.decide(cuda=True), registrar)
    params = [nn.Parameter(t, requires_grad=False) for t in heap_scales(64, seed=3)]
    values = [p.data.clone() for p in params]
    assert ledger.lock_together(params, "scales")
    assert len(registrar.ranges) == 1 and registrar.refused == 0
    assert all(ledger.pinned(p.data) and torch.equal(p.data, v) and layout(p.data)[:3] == layout(v)[:3]
               for p, v in zip(params, values))


def test_a_hot_layers_arena_keeps_every_layout_and_reads_as_pinned():
    """The GPU check's host half: FP8 ``.t()`` weights keep strides (1, K) through the arena
    (the intended ``lock_together``; the contiguous copy it replaces fails here)."""
    layer = hot_layer(TINY, seed=4)
    named = dict(layer.named_parameters())
    before = {n: layout(p.data) for n, p in named.items()}
    values = {n: p.data.clone() for n, p in named.items()}
    registrar = PageRegistrar()
    ledger = PageLockedLedger(PinPolicy.decide(cuda=True), registrar)
    assert before["qkv_proj.weight"][2] == (1, TINY["moe_hidden"])
    assert ledger.lock_together(list(named.values()), "model.layers.0")
    assert len(registrar.ranges) == 1
    for n, p in named.items():
        assert layout(p.data) == before[n], n
        assert ledger.pinned(p.data) and torch.equal(p.data.flatten().view(torch.uint8), values[n].flatten().view(torch.uint8)), n


def test_experts_through_attach_are_handed_to_the_view_pinned_and_come_back_marked():
    e, h, i = TINY["moe_experts"], TINY["moe_hidden"], TINY["moe_inter"]
    module = RoutedExpertsLike(torch.randn(e, 2 * i, h).to(torch.bfloat16), torch.randn(e, h, i).to(torch.bfloat16))
    values = [p.data.clone() for p in module.parameters()]
    registrar = PageRegistrar()
    # The device is CUDA's as the GPU run's is (attach makes views for it); the "view" here is
    # a copy of the host bytes, so the values read back are the registered memory's.
    ok, figures, ledger = attach_views(module, torch.device("cuda"), registrar, lambda flat: flat.clone())
    assert figures["device_growth_bytes"] == 0 and figures["refused_712"] == 0
    assert ok, figures
    assert all(torch.equal(p.data, v) for p, v in zip(module.parameters(), values))
