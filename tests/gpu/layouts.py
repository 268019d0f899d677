"""What the layout and arena checks share: tensors laid out as vLLM leaves them after
post-processing, a UVA view and a device copy that keep a tensor's strides, and registrars
that count what the ledger asks of the driver.

Why a module of its own: ``test_layouts_through_arenas.py`` and ``test_fused_moe_uva_graph.py``
run on a GPU machine with torch and no vLLM; the CPU proxy
(``tests/unit/wrappers/test_gpu_checks_cpu_proxy.py``) runs the same builders here with a
registrar standing in for the driver, so a GPU run starts from code already checked.
"""

from __future__ import annotations

import torch
from torch import nn

FP8 = getattr(torch, "float8_e4m3fn", None)


def layout(t: torch.Tensor) -> tuple:
    """What vLLM's kernels depend on: dtype, shape, strides and the storage span."""
    return t.dtype, tuple(t.shape), tuple(t.stride()), span_bytes(t)


def span_bytes(t: torch.Tensor) -> int:
    """Bytes from the tensor's first element to one past its last, through its strides."""
    if t.numel() == 0:
        return 0
    return (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * t.element_size()


def host_span(t: torch.Tensor) -> torch.Tensor:
    """The bytes ``t`` covers in its storage, as a contiguous uint8 host tensor (same memory)."""
    flat = torch.empty(0, dtype=torch.uint8)
    flat.set_(t.untyped_storage(), t.storage_offset() * t.element_size(), (span_bytes(t),), (1,))
    return flat


def strided_view(t: torch.Tensor, view_bytes) -> torch.Tensor:
    """``t`` again, over ``view_bytes(host_span(t))`` (the same bytes, seen elsewhere), with
    its own sizes and strides put back on."""
    return view_bytes(host_span(t)).view(t.dtype).as_strided(t.shape, t.stride())


def strided_uva_view(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A device view of page-locked host ``t`` with its own sizes and strides: a torch-only
    stand-in for vLLM's ``get_accelerator_view_from_cpu_tensor`` (whose CUDA op,
    ``get_cuda_view_from_cpu_tensor``, is ``from_blob(device_ptr, sizes, strides)``). The
    project's ``cuda_view_of_pinned`` views the bytes the tensor spans; the strides go on after."""
    from selective_offload.wrappers import cuda_view_of_pinned

    return strided_view(t, lambda flat: cuda_view_of_pinned(flat, device))


def onload_keeping_strides(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A device copy with the host tensor's strides, as vLLM's prefetch offloader makes its
    copies (``empty_strided(size, stride)``) and the on-demand onload is to."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device).copy_(t, non_blocking=True)


def fp8_t_weight(n: int, k: int, seed: int) -> torch.Tensor:
    """An FP8 linear weight as vLLM keeps it for CUTLASS: the (N, K) checkpoint tensor's
    ``.t()``, (K, N) with strides (1, K) (``Fp8LinearMethod.process_weights_after_loading``)."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=gen) * 0.5).to(FP8).t()


#: Bytes of the small tensors a quant method's post-processing leaves one after another on
#: the heap (per-tensor and per-channel scales, zero points, norms): 4 to 512 bytes.
SCALE_BYTES = (4, 4, 16, 64, 128, 256, 512, 8)


def heap_scales(count: int, seed: int) -> list[torch.Tensor]:
    """``count`` small float32 tensors allocated one after another from the heap (so many
    share a page), each filled with values of its own."""
    out = []
    for i in range(count):
        n = SCALE_BYTES[i % len(SCALE_BYTES)] // 4
        t = torch.empty(n, dtype=torch.float32) if n > 1 else torch.empty((), dtype=torch.float32)
        t.copy_(torch.arange(n, dtype=torch.float32).reshape(t.shape) + seed + 1000 * i)
        out.append(t)
    return out


class HotLayerLike(nn.Module):
    """A decoder layer's attention as vLLM leaves it for per-tensor FP8 on CUTLASS
    (Qwen3-30B-A3B-FP8's shapes at full size): ``.t()`` FP8 weights, their float32 scalar
    scales, bf16 norms (contiguous), and a bf16 router gate."""

    def __init__(self, hidden: int, q_size: int, kv_size: int, experts: int, head_dim: int, seed: int) -> None:
        super().__init__()
        shapes = {"qkv_proj": (q_size + 2 * kv_size, hidden), "o_proj": (hidden, q_size)}
        for i, (name, (n, k)) in enumerate(shapes.items()):
            mod = nn.Module()
            mod.weight = nn.Parameter(fp8_t_weight(n, k, seed + i), requires_grad=False)
            mod.weight_scale = nn.Parameter(torch.full((), 0.01 * (i + 1)), requires_grad=False)
            mod.input_scale = nn.Parameter(torch.full((), 0.02 * (i + 1)), requires_grad=False)
            setattr(self, name, mod)
        gen = torch.Generator().manual_seed(seed)
        for name, n in (("input_layernorm", hidden), ("post_attention_layernorm", hidden),
                        ("q_norm", head_dim), ("k_norm", head_dim)):
            self.register_parameter(name, nn.Parameter(torch.randn(n, generator=gen).to(torch.bfloat16),
                                                       requires_grad=False))
        self.gate = nn.Parameter(torch.randn(experts, hidden, generator=gen).to(torch.bfloat16), requires_grad=False)


def hot_layer(cfg: dict, seed: int = 0) -> HotLayerLike:
    return HotLayerLike(cfg["moe_hidden"], cfg["hot_q"], cfg["hot_kv"], cfg["moe_experts"], cfg["head_dim"], seed)


class RoutedExpertsLike(nn.Module):
    """vLLM's unquantized routed experts for Triton, as post-processing leaves them:
    ``w13_weight`` (E, 2I, H) and ``w2_weight`` (E, H, I), contiguous."""

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        super().__init__()
        self.w13_weight = nn.Parameter(w13, requires_grad=False)
        self.w2_weight = nn.Parameter(w2, requires_grad=False)


def attach_views(module: nn.Module, device: torch.device, registrar, view_bytes) -> tuple[bool, dict, object]:
    """The glue's ``experts.attach`` on ``module`` (vLLM's routed experts, here a stand-in):
    page-locked through a ledger over ``registrar``, each parameter made a marked view over
    ``view_bytes`` of its host bytes. The view factory records, for each host tensor it is
    handed, its layout and whether it reads as pinned (``ledger.pinned``: the driver's
    ``is_pinned()``, or the stand-in registrar's). Returns (ok, figures, ledger)."""
    from selective_offload.vllm_glue.experts import UVA_MARKER, ExpertsLoad, attach
    from selective_offload.wrappers.page_locked import PageLockedLedger, PinPolicy

    model = nn.Module()
    model.experts = module
    xl = ExpertsLoad(groups={}, cold_segments=(), modules={"experts": "model.layers.0.mlp.experts"})
    ledger = PageLockedLedger(PinPolicy.decide(cuda=True), registrar)
    handed: list[dict] = []
    made: set[int] = set()

    def view(host: torch.Tensor) -> torch.Tensor:
        handed.append({"layout": [str(x) for x in layout(host)], "is_pinned": ledger.pinned(host)})
        out = strided_view(host, view_bytes)
        made.add(out.data_ptr())
        return out

    before = {n: layout(p.data)[:3] for n, p in module.named_parameters()}
    cuda = device.type == "cuda" and torch.cuda.is_available()
    grew = torch.cuda.memory_allocated(device) if cuda else 0
    attach(model, xl, device, ledger, view)
    grew = (torch.cuda.memory_allocated(device) - grew) if cuda else 0
    params = dict(module.named_parameters())
    figures = {"registrations": len(getattr(registrar, "registered", ())), "refused_712": registrar.refused,
               "locked_bytes": ledger.locked_bytes, "handed_to_view": handed, "device_growth_bytes": grew}
    ok = (len(handed) == len(params) and all(h["is_pinned"] for h in handed) and grew == 0
          and all(p.data_ptr() in made and getattr(p, UVA_MARKER, False) and layout(p.data)[:3] == before[n]
                  for n, p in params.items()))
    return ok, figures, ledger


class CountingRegistrar:
    """Passes every call to the driver's registrar and counts them (registrations, refusals)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.registered: list[tuple[int, int]] = []
        self.refused = 0
        self.unregistered: list[int] = []

    def register(self, ptr: int, nbytes: int) -> None:
        from selective_offload.wrappers.page_locked import AlreadyRegistered

        try:
            self.inner.register(ptr, nbytes)
        except AlreadyRegistered:  # CUDA error 712: a page of it is registered already
            self.refused += 1
            raise
        self.registered.append((ptr, nbytes))

    def unregister(self, ptr: int) -> None:
        self.unregistered.append(ptr)
        self.inner.unregister(ptr)


class PageRegistrar:
    """Stands in for the driver where there is no CUDA: registers whole pages, refuses a
    registration over a page already registered (CUDA error 712, ``AlreadyRegistered``),
    and answers ``is_pinned`` for an address inside a registered range (as
    ``cudaPointerGetAttributes`` does), which the ledger asks through ``pinned()``."""

    def __init__(self) -> None:
        from selective_offload.wrappers.page_locked import PAGE

        self.page = PAGE
        self.ranges: dict[int, int] = {}
        self.registered = self.ranges
        self.pages: set[int] = set()
        self.refused = 0

    def register(self, ptr: int, nbytes: int) -> None:
        from selective_offload.wrappers.page_locked import AlreadyRegistered

        pages = set(range(ptr // self.page, (ptr + nbytes - 1) // self.page + 1))
        if pages & self.pages:
            self.refused += 1
            raise AlreadyRegistered(ptr)
        self.pages |= pages
        self.ranges[ptr] = nbytes

    def unregister(self, ptr: int) -> None:
        nbytes = self.ranges.pop(ptr)
        self.pages -= set(range(ptr // self.page, (ptr + nbytes - 1) // self.page + 1))

    def is_pinned(self, t: torch.Tensor) -> bool:
        lo, hi = t.data_ptr(), t.data_ptr() + max(span_bytes(t), 1)
        return any(p <= lo and hi <= p + n for p, n in self.ranges.items())
