"""Layouts kept through the arena, on the card (issue 26): an FP8 weight kept as vLLM keeps it
for CUTLASS (the (N, K) checkpoint tensor's ``.t()``, strides (1, K)) goes through
``PageLockedLedger.lock_together``, then a UVA view and a device copy that keep its strides,
and ``torch._scaled_mm`` (CUTLASS's scaled matmul, which needs its second operand
column-major) on each is bit-equal to the product on the untouched weight; adjacent small
heap tensors (scales as a quant method's post-processing leaves them, many sharing a page)
lock as one arena with one registration, read as pinned, and read on the device through
their views as their values; the per-parameter ``lock()`` on the same layout is recorded
with the refusals (CUDA error 712) the driver gives, each counted and none reported locked;
a hot layer's arena (FP8 ``.t()`` weights, scalar scales, norms) is one registration and
every parameter reads as pinned with its layout kept. All need CUDA (``cudaHostRegister``);
the FP8 matmul needs compute capability 8.9 or newer."""

from __future__ import annotations

import gc
import json
from types import SimpleNamespace

import pytest
import torch
from layouts import (
    FP8,
    CountingRegistrar,
    fp8_t_weight,
    heap_scales,
    hot_layer,
    layout,
    onload_keeping_strides,
    strided_uva_view,
)
from torch import nn

from mechanism import bitwise_equal, needs_cuda, records
from selective_offload.wrappers.page_locked import PAGE, CudaRegistrar, PageLockedLedger, PinPolicy

FP8_LAYOUT = "an FP8 .t() weight keeps dtype, shape, strides and span through the arena, its UVA view and device copy"
FP8_MM = "CUTLASS's scaled matmul on the arena's UVA view and device copy is bit-equal to the untouched weight's"
SCALES_PINNED = "adjacent small heap tensors locked as one arena: one registration, each is_pinned()"
SCALES_READ = "adjacent small heap tensors read on the device through their views equal their values"
PER_PARAM = "per-parameter lock() on the same heap layout: each refusal (error 712) counted, none reported locked"
HOT_PINNED = "a hot layer's arena: one registration, every parameter is_pinned() with its layout kept"


def _ledger() -> tuple[PageLockedLedger, CountingRegistrar]:
    registrar = CountingRegistrar(CudaRegistrar())
    return PageLockedLedger(PinPolicy.decide(cuda=True), registrar), registrar


def _release(ledger: PageLockedLedger, tensors) -> None:
    torch.cuda.synchronize()
    for ptr in {t.untyped_storage().data_ptr() for t in tensors}:
        ledger.unlock(ptr)


def _scaled_mm(a, b, scale_a, scale_b):
    got = torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16)
    return got[0] if isinstance(got, tuple) else got  # torch < 2.4 also returned the amax


def fp8_through_arena(cfg: dict, device: torch.device, seen: SimpleNamespace, out: dict) -> None:
    """1. The FP8 ``.t()`` weight through the arena, its view and copy, then CUTLASS."""
    n, k, m = cfg["fp8_n"], cfg["fp8_k"], cfg["fp8_m"]
    cc = torch.cuda.get_device_capability(device)
    if FP8 is None or cc < (8, 9):
        seen.fp8_skip = (f"FP8 scaled matmul needs compute capability 8.9 or newer: this card is "
                         f"{cc[0]}.{cc[1]}" if FP8 is not None else "FP8 scaled matmul: this torch has no float8_e4m3fn")
        return
    param = nn.Parameter(fp8_t_weight(n, k, seed=3), requires_grad=False)
    untouched = fp8_t_weight(n, k, seed=3)  # the same weight, never near the arena
    before = layout(param.data)
    ledger, registrar = _ledger()
    locked = ledger.lock_together([param], "model.layers.0.self_attn.qkv_proj")
    host = param.data
    uva, copy = strided_uva_view(host, device), onload_keeping_strides(host, device)
    resident = untouched.t().contiguous().to(device).t()  # vLLM's device weight: (K, N), strides (1, K)
    layouts = {"before": before, "after_arena": layout(host), "uva_view": layout(uva), "device_copy": layout(copy),
               "resident": layout(resident)}
    out["fp8"] = {"n": n, "k": k, "m": m, "compute_capability": f"{cc[0]}.{cc[1]}", "locked": locked,
                  "registrations": len(registrar.registered), "is_pinned": host.is_pinned(),
                  "layouts": {key: [str(v[0]), *v[1:]] for key, v in layouts.items()}}
    kept = len({v for key, v in layouts.items() if key != "resident"}) == 1 and layouts["before"][2] == (1, k)
    seen.fp8_layout = (kept and locked and host.is_pinned() and bitwise_equal(host, untouched),
                       json.dumps(out["fp8"]))
    gen = torch.Generator(device=device).manual_seed(5)
    a = (torch.randn(m, k, device=device, generator=gen) * 0.5).to(FP8)
    sa, sb = torch.tensor(0.5, device=device), torch.tensor(0.25, device=device)
    products = {name: _scaled_mm(a, b, sa, sb) for name, b in (("resident", resident), ("uva_view", uva),
                                                                ("device_copy", copy))}
    try:  # the control: the layout the arena used to give (row-major), which CUTLASS refuses
        _scaled_mm(a, copy.contiguous(), sa, sb)
        out["fp8"]["row_major_operand"] = "accepted by this torch"
    except RuntimeError as err:
        out["fp8"]["row_major_operand"] = f"refused: {str(err).splitlines()[0][:160]}"
    equal = {name: bitwise_equal(p, products["resident"]) for name, p in products.items()}
    out["fp8"]["products_bit_equal"] = equal
    seen.fp8_mm = (all(equal.values()), json.dumps({"bit_equal": equal, "row_major": out["fp8"]["row_major_operand"]}))
    del uva, copy, resident, products
    _release(ledger, [host])


def heap_tensors_through_arena(cfg: dict, device: torch.device, seen: SimpleNamespace, out: dict) -> None:
    """2. Adjacent small heap tensors: one arena, pinned, read through views; then lock()."""
    count = cfg["heap_scales"]
    scales = heap_scales(count, seed=1)
    pages = [(t.data_ptr() // PAGE, (t.data_ptr() + t.numel() * t.element_size() - 1) // PAGE) for t in scales]
    sharing = sum(1 for i in range(1, count) if pages[i][0] <= pages[i - 1][1])
    module = nn.Module()
    for i, t in enumerate(scales):
        module.register_parameter(f"scale{i}", nn.Parameter(t, requires_grad=False))
    values = [t.clone() for t in scales]
    ledger, registrar = _ledger()
    params = list(module.parameters())
    locked = ledger.lock_together(params, "model.layers.0.mlp.experts (scales)")
    pinned = [p.data.is_pinned() for p in params]
    kept = all(layout(p.data)[:3] == layout(v)[:3] for p, v in zip(params, values))
    out["heap_scales"] = {"tensors": count, "bytes": sum(v.numel() * 4 for v in values),
                          "neighbours_sharing_a_page": sharing, "arena_registrations": len(registrar.registered),
                          "arena_is_pinned": sum(pinned), "layouts_kept": kept}
    seen.scales_pinned = (locked and len(registrar.registered) == 1 and all(pinned) and kept,
                          json.dumps(out["heap_scales"]))
    views = [strided_uva_view(p.data, device) for p in params]
    read = torch.cat([v.reshape(-1).float() * 1 for v in views]).cpu()  # a device kernel reads each view
    seen.scales_read = (torch.equal(read, torch.cat([v.reshape(-1) for v in values])), f"{read.numel()} values")
    del views
    _release(ledger, [p.data for p in params])

    fresh = heap_scales(count, seed=2)  # the same layout, locked one parameter at a time
    ledger, registrar = _ledger()
    got = [ledger.lock(t, f"scale{i}") for i, t in enumerate(fresh)]
    refused = [t for t, ok in zip(fresh, got) if not ok]
    honest = all(t.is_pinned() for t, ok in zip(fresh, got) if ok)
    out["per_parameter_lock"] = {"tensors": count, "refused_712": len(refused), "registered": len(registrar.registered),
                                 "refused_bytes": ledger.refused_bytes, "by_how": ledger.by_how()}
    seen.per_param = (honest and registrar.refused == len(refused)
                      and ledger.refused_bytes == sum(t.untyped_storage().nbytes() for t in refused),
                      json.dumps(out["per_parameter_lock"]))
    _release(ledger, [t for t, ok in zip(fresh, got) if ok])


def hot_layer_arena(cfg: dict, seen: SimpleNamespace, out: dict) -> None:
    """4. A hot layer's arena: one registration, each parameter pinned, layouts kept."""
    layer = hot_layer(cfg, seed=7)
    named = dict(layer.named_parameters())
    before = {n: layout(p.data) for n, p in named.items()}
    values = {n: p.data.clone() for n, p in named.items()}
    ledger, registrar = _ledger()
    locked = ledger.lock_together(list(named.values()), "model.layers.0 (hot)")
    pinned = {n: p.data.is_pinned() and ledger.pinned(p.data) for n, p in named.items()}
    changed = [n for n, p in named.items() if layout(p.data) != before[n] or not bitwise_equal(p.data, values[n])]
    out["hot_layer"] = {"parameters": len(named), "registrations": len(registrar.registered),
                        "locked_bytes": ledger.locked_bytes, "not_pinned": [n for n, ok in pinned.items() if not ok],
                        "layout_or_values_changed": changed}
    seen.hot = (locked and len(registrar.registered) == 1 and all(pinned.values()) and not changed,
                json.dumps(out["hot_layer"]))
    _release(ledger, [p.data for p in named.values()])


@pytest.fixture(scope="module")
def arenas(cfg, device, results):
    """The three parts in order, each recorded (``results["layouts"]``) even when another failed."""
    out: dict = {}
    results["layouts"] = out
    seen = SimpleNamespace(fp8_skip=None, fp8_layout=None, fp8_mm=None, scales_pinned=None, scales_read=None,
                           per_param=None, hot=None, errors={})
    for name, part in (("fp8", lambda: fp8_through_arena(cfg, device, seen, out)),
                       ("heap", lambda: heap_tensors_through_arena(cfg, device, seen, out)),
                       ("hot", lambda: hot_layer_arena(cfg, seen, out))):
        try:
            part()
        except Exception as err:  # noqa: BLE001 -- a failed check; the other parts run
            seen.errors[name] = f"{type(err).__name__}: {err}"[:600]
            out[f"{name}_error"] = seen.errors[name]
        gc.collect()
    return seen


def _made(arenas, attr: str, part: str):
    return getattr(arenas, attr) or (False, arenas.errors.get(part, "not reached"))


@records(FP8_LAYOUT)
@needs_cuda("cudaHostRegister and a UVA view are CUDA's")
def test_an_fp8_t_weight_keeps_its_layout_through_the_arena_view_and_copy(arenas, checks):
    if arenas.fp8_skip:
        pytest.skip(arenas.fp8_skip)
    checks.check(FP8_LAYOUT, *_made(arenas, "fp8_layout", "fp8"))


@records(FP8_MM)
@needs_cuda("CUTLASS's scaled matmul runs on a CUDA device")
def test_cutlass_scaled_mm_on_the_arena_weight_is_bit_equal_to_the_untouched_weight(arenas, checks):
    if arenas.fp8_skip:
        pytest.skip(arenas.fp8_skip)
    checks.check(FP8_MM, *_made(arenas, "fp8_mm", "fp8"))


@records(SCALES_PINNED)
@needs_cuda("cudaHostRegister is CUDA's")
def test_adjacent_small_heap_tensors_lock_as_one_arena_and_read_as_pinned(arenas, checks):
    checks.check(SCALES_PINNED, *_made(arenas, "scales_pinned", "heap"))


@records(SCALES_READ)
@needs_cuda("a UVA view maps pinned host memory into the device's address space")
def test_adjacent_small_heap_tensors_read_through_their_views_equal_their_values(arenas, checks):
    checks.check(SCALES_READ, *_made(arenas, "scales_read", "heap"))


@records(PER_PARAM)
@needs_cuda("the driver's refusal (CUDA error 712) is CUDA's")
def test_per_parameter_lock_counts_each_refusal_and_reports_none_locked(arenas, checks):
    checks.check(PER_PARAM, *_made(arenas, "per_param", "heap"))


@records(HOT_PINNED)
@needs_cuda("cudaHostRegister is CUDA's")
def test_a_hot_layers_arena_is_one_registration_and_every_parameter_reads_as_pinned(arenas, checks):
    checks.check(HOT_PINNED, *_made(arenas, "hot", "hot"))
