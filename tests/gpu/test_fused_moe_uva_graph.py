"""A fused-MoE layer on marked UVA views, captured in a CUDA graph and replayed, against the
same layer on device copies (issue 26), at Qwen3-30B-A3B's per-layer shape (128 experts,
hidden 2048, moe_intermediate 768, top-8, bf16; tiny under --small).

The routed experts go the glue's way: host memory of their exact size handed to
``vllm_glue.experts.attach``, which page-locks them and makes each parameter a marked UVA
view (the view factory records that every host tensor it is given reads as pinned: the
``is_pinned()`` after registration, for the experts' arena). vLLM's Triton fused-MoE kernel
cannot be carried to a machine without vLLM; ``grouped_moe.grouped_experts`` stands in for
``TritonExperts`` (each routed expert's weights read once per group of its tokens, as vLLM
does for host-resident weights). A decode step (1 token) and a 2048-token prefill are each
captured with one routing and replayed with another; the UVA replay must equal the
device-copy replay bit for bit (the same kernel on the same bytes), and both the float32
per-expert reference within bf16 tolerance. Each replay is timed, UVA against device, and
the ratio recorded (``results["fused_moe"]``). Needs CUDA and Triton."""

from __future__ import annotations

import gc
import json
from types import SimpleNamespace

import pytest
import torch
from layouts import CountingRegistrar, RoutedExpertsLike, attach_views

from benchmarks.common import median_us
from mechanism import bitwise_equal, needs_cuda, records
from selective_offload.wrappers import cuda_view_of_pinned
from selective_offload.wrappers.page_locked import CudaRegistrar

EXPERTS_PINNED = ("routed experts through attach(): each host tensor registered is_pinned(), each parameter a marked "
                  "UVA view with its layout, no device memory added")
REPLAY_EQUAL = "fused-MoE stand-in replayed from a CUDA graph on UVA views equals the device-copy replay bit for bit"
REFERENCE = "the fused-MoE stand-in equals the float32 per-expert reference within bf16 tolerance"
PHASES = ("decode", "prefill")
#: Relative to the reference's largest magnitude: bf16 rounds each of the layer's three
#: stages (gate-up, activation, down) to 8 bits; a wrong layout is off by the whole value.
TOLERANCE = 0.05


def build_experts(cfg: dict, device: torch.device):
    """Device copies, then host memory of their exact size with the same bytes (pageable, as
    routing builds it), in a module as vLLM's routed experts."""
    e, h, i = cfg["moe_experts"], cfg["moe_hidden"], cfg["moe_inter"]
    gen = torch.Generator(device=device).manual_seed(11)
    w13 = (torch.randn(e, 2 * i, h, device=device, generator=gen) * 0.02).to(torch.bfloat16)
    w2 = (torch.randn(e, h, i, device=device, generator=gen) * 0.02).to(torch.bfloat16)
    hosts = [torch.empty(w.shape, dtype=w.dtype) for w in (w13, w2)]
    for host, w in zip(hosts, (w13, w2)):
        host.copy_(w)
    return (w13, w2), RoutedExpertsLike(*hosts)


def capture_and_replay(weights, cfg: dict, tokens: int, device: torch.device):
    """Capture the layer with one routing, replay it with another: (output, replay us)."""
    import grouped_moe

    e, h, k = cfg["moe_experts"], cfg["moe_hidden"], cfg["moe_top_k"]
    gen = torch.Generator(device=device).manual_seed(tokens)
    x = torch.randn(tokens, h, device=device, generator=gen).to(torch.bfloat16)
    topk_w, topk_ids = grouped_moe.routing(tokens, e, k, device, seed=tokens)
    blocks = grouped_moe.blocks_for(tokens)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture, as torch asks
        for _ in range(2):
            grouped_moe.grouped_experts(x, *weights, topk_w, topk_ids, blocks)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = grouped_moe.grouped_experts(x, *weights, topk_w, topk_ids, blocks)
    new_w, new_ids = grouped_moe.routing(tokens, e, k, device, seed=tokens + 1)
    x.copy_(torch.randn(tokens, h, device=device, generator=gen).to(torch.bfloat16))
    topk_w.copy_(new_w)
    topk_ids.copy_(new_ids)
    graph.replay()
    torch.cuda.synchronize()
    got = y.clone()
    us = median_us(graph.replay, cfg["iters"], True)
    del graph
    return got, us, (x.clone(), topk_w.clone(), topk_ids.clone())


@pytest.fixture(scope="module")
def fused_moe(cfg, device, results):
    """The experts attached as UVA views, both phases on both weights, timed and compared."""
    out: dict = {"shape": {k: cfg[k] for k in ("moe_experts", "moe_hidden", "moe_inter", "moe_top_k")},
                 "rows": []}
    results["fused_moe"] = out
    seen = SimpleNamespace(pinned=None, equal={}, reference={}, error=None)
    try:
        import grouped_moe  # noqa: F401  (needs Triton)
    except ImportError as err:
        seen.error = f"Triton is not importable here: {err}"
        out["error"] = seen.error
        return seen
    try:
        resident, module = build_experts(cfg, device)
        ok, out["attach"], ledger = attach_views(module, device, CountingRegistrar(CudaRegistrar()),
                                                 lambda flat: cuda_view_of_pinned(flat, device))
        seen.pinned = (ok, json.dumps(out["attach"]))
        uva = (module.w13_weight, module.w2_weight)
        expert_bytes = sum(w[0].numel() * w.element_size() for w in resident)
        out["expert_bytes"] = expert_bytes
        for phase, tokens in zip(PHASES, (1, cfg["moe_prefill"])):
            row = {"phase": phase, "tokens": tokens}
            try:
                y_uva, row["uva_replay_us"], inputs = capture_and_replay(uva, cfg, tokens, device)
                y_dev, row["device_replay_us"], _ = capture_and_replay(resident, cfg, tokens, device)
                import grouped_moe

                ref = grouped_moe.reference_experts(inputs[0], *resident, inputs[1], inputs[2])
                scale = float(ref.abs().max())
                err = float((y_uva.float() - ref).abs().max())
                row.update(uva_over_device=row["uva_replay_us"] / row["device_replay_us"],
                           distinct_experts=int(inputs[2].unique().numel()),
                           bit_equal=bitwise_equal(y_uva, y_dev), max_abs_err=err, ref_max_abs=scale)
                seen.equal[phase] = (row["bit_equal"], f"{phase}: {tokens} token(s)")
                seen.reference[phase] = (err <= TOLERANCE * scale, f"{phase}: max abs error {err:.3g} of {scale:.3g}")
            except Exception as err:  # noqa: BLE001 -- recorded; the other phase runs
                row["error"] = f"{type(err).__name__}: {err}"[:600]
                seen.equal[phase] = seen.reference[phase] = (False, row["error"])
            out["rows"].append(row)
            print({"fused_moe": row})
            gc.collect()
        del uva, resident, module
        gc.collect()
        torch.cuda.synchronize()
        out["locked_bytes_after_release"] = ledger.locked_bytes
    except Exception as err:  # noqa: BLE001
        seen.error = f"{type(err).__name__}: {err}"[:600]
        out["error"] = seen.error
    return seen


def _made(seen, value):
    return value or (False, seen.error or "not reached")


@records(EXPERTS_PINNED)
@needs_cuda("cudaHostRegister and a UVA view are CUDA's")
def test_routed_experts_attached_are_pinned_marked_uva_views_with_their_layout(fused_moe, checks):
    checks.check(EXPERTS_PINNED, *_made(fused_moe, fused_moe.pinned))


@records(*(f"{REPLAY_EQUAL} ({p})" for p in PHASES))
@needs_cuda("CUDA graphs and UVA views are CUDA's")
def test_the_graph_replay_on_uva_views_equals_the_device_copy_replay(fused_moe, checks):
    for phase in PHASES:
        checks.check(f"{REPLAY_EQUAL} ({phase})", *_made(fused_moe, fused_moe.equal.get(phase)))


@records(*(f"{REFERENCE} ({p})" for p in PHASES))
@needs_cuda("the Triton kernel runs on a CUDA device here (the CPU proxy runs it interpreted)")
def test_the_stand_in_equals_the_float32_reference(fused_moe, checks):
    for phase in PHASES:
        checks.check(f"{REFERENCE} ({phase})", *_made(fused_moe, fused_moe.reference.get(phase)))
