"""The layout invariant: every copy the mechanism makes keeps dtype, shape, strides and span.

One property, tested over every layout in ``builders.LAYOUT_CASES`` (what vLLM 0.33's
post-processing leaves for each linear and MoE method the project accepts, plus slices,
expanded and overlapping tensors): a page-locked arena, an on-demand onload and every host
or device copy hand back a tensor of the same dtype, shape and strides, with the same
values, in storage holding exactly its span. ``cudaHostRegister`` is the recording
``helpers.PageRegistrar``; the "device" of a copy or an onload is the CPU (a proxy: what is
checked is the layout, which a CUDA copy made by the same code keeps the same way).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from builders import LAYOUT_CASES
from helpers import PageRegistrar
from selective_offload.vllm_glue.host_resident import to_device, to_host_exact
from selective_offload.wrappers import offload_on_demand
from selective_offload.wrappers.layout import device_copy_like, host_copy_like, layout_of, span
from selective_offload.wrappers.page_locked import ARENA_ALIGN, PAGE, PageLockedLedger, PinPolicy

CASES = pytest.mark.parametrize("case", LAYOUT_CASES, ids=[c.name for c in LAYOUT_CASES])


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.double(), b.double())  # fp8 has no torch.equal on the CPU


def ledger() -> PageLockedLedger:
    return PageLockedLedger(PinPolicy.decide(cuda=True), PageRegistrar())


@CASES
def test_every_host_and_device_copy_keeps_the_layout(case):
    """to_host_exact (post-processing's way back), to_device (its way there), the wrappers'
    host and device copies: same layout and values, storage of exactly the span."""
    t = case.tensor()
    for copy in (host_copy_like, to_host_exact, lambda x: to_device(x, torch.device("cpu")),
                 lambda x: device_copy_like(x, "cpu")):
        c = copy(t)
        assert layout_of(c) == layout_of(t) and same_values(c, t)
        assert c.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
        assert c.untyped_storage().nbytes() == layout_of(t).span_nbytes


@CASES
def test_an_arena_keeps_the_layout_of_each_tensor(case):
    """lock_together puts the tensor's whole span in the arena and views it with its own
    strides: a column-major FP8 weight stays column-major, DeepGEMM's padded scales keep
    their padding, an expanded scale stays expanded; its address keeps its alignment."""
    t = case.tensor()
    before, values, align = layout_of(t), t.clone(), t.data_ptr() % ARENA_ALIGN
    param = nn.Parameter(t, requires_grad=False)
    book = ledger()
    assert book.lock_together([param], "layer")
    assert layout_of(param.data) == before and same_values(param.data, values)
    assert param.data_ptr() % ARENA_ALIGN == align
    [(ptr, nbytes)] = book.registrar.registered.items()
    assert ptr % PAGE == 0 and nbytes == -(-(align + before.span_nbytes) // PAGE) * PAGE
    assert book.pinned(param.data)


def test_one_arena_holds_every_layout_with_one_registration():
    """All the layouts as one module's tensors: one registration covers every span, and
    each tensor keeps its layout and values."""
    tensors = [c.tensor() for c in LAYOUT_CASES]
    params = [nn.Parameter(t, requires_grad=False) for t in tensors]
    book = ledger()
    book.lock_together(params, "layer")
    assert len({p.untyped_storage().data_ptr() for p in params}) == 1
    [(ptr, nbytes)] = book.registrar.registered.items()
    for p, t in zip(params, tensors):
        assert layout_of(p.data) == layout_of(t) and same_values(p.data, t)
        assert ptr <= p.data_ptr() and p.data_ptr() + layout_of(t).span_nbytes <= ptr + nbytes
    spans = sum(layout_of(t).span_nbytes for t in tensors)
    assert spans <= nbytes < spans + len(tensors) * 2 * ARENA_ALIGN + PAGE


def test_tensors_that_shared_a_storage_share_the_arena_at_the_same_offsets():
    """A view and its base (vLLM keeps a ``.t()`` view and a slice of one weight, the
    kernel both) stay one storage: a write through one is seen through the other."""
    base = torch.arange(64.0).view(8, 8)
    tensors = [base, base[2:5], base.t(), torch.ones(3)]
    offsets = [t.data_ptr() - base.data_ptr() for t in tensors[:3]]
    params = [nn.Parameter(t, requires_grad=False) for t in tensors]
    ledger().lock_together(params, "layer")
    assert [p.data_ptr() - params[0].data_ptr() for p in params[:3]] == offsets
    assert all(layout_of(p.data) == layout_of(t) for p, t in zip(params, tensors))
    params[0].data[3, 0] = -1.0
    assert params[1].data[1, 0] == -1.0 and params[2].data[0, 3] == -1.0


class Holder(nn.Module):
    """A module whose buffers are the catalogue's layouts; its forward records what it sees."""

    def __init__(self, tensors):
        super().__init__()
        for i, t in enumerate(tensors):
            self.register_buffer(f"t{i}", t)
        self.seen: list[torch.Tensor] = []

    def forward(self):
        self.seen = [b.data for _, b in self.named_buffers()]  # what it reads now
        return len(self.seen)


def test_an_on_demand_onload_keeps_every_layout():
    """A tower's tensors go through the arena, then onto the device for one forward: what
    the forward reads has the layout and values vLLM gave them, in new storage."""
    tensors = [c.tensor() for c in LAYOUT_CASES]
    values = [t.clone() for t in tensors]
    holder = Holder(tensors)
    offload_on_demand(holder, device="cpu", blocks=None, page_locked=ledger(), name="tower")
    hosts = [b.data for _, b in holder.named_buffers()]
    holder()
    for seen, host, t, v in zip(holder.seen, hosts, tensors, values):
        assert layout_of(seen) == layout_of(t) and same_values(seen, v)
        assert seen.untyped_storage().data_ptr() != host.untyped_storage().data_ptr()  # onloaded
        assert layout_of(host) == layout_of(t)  # and the arena between calls


def test_the_span_of_each_kind_of_layout():
    """The span: every byte from the lowest to one past the highest reached."""
    base = torch.empty(10, 12)
    assert span(base[3:7, 2:9]) == (38 * 4, (38 + 3 * 12 + 6 + 1) * 4)
    assert span(torch.empty(4, 1).expand(4, 8)) == (0, 16)
    assert span(torch.empty(0, 5)) == (0, 0)
    assert span(torch.empty(())) == (0, 4)
