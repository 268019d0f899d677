"""Page-locked host memory: the path chosen for each policy case, and an exact ledger.

``cudaHostRegister`` needs a CUDA device; here a recording registrar stands in for it (it
receives the address and size the driver would), so what is tested is which storages are
registered, at which size, that nothing is copied, and that release unregisters.
"""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

from helpers import PageRegistrar
from selective_offload.wrappers import offload_on_demand
from selective_offload.wrappers.page_locked import (
    ARENA_ALIGN,
    PAGE,
    AlreadyRegistered,
    PageLockedLedger,
    PinPath,
    PinPolicy,
    resident_set_bytes,
)


class RecordingRegistrar:
    def __init__(self):
        self.registered: dict[int, int] = {}
        self.unregistered: list[int] = []

    def register(self, ptr, nbytes):
        assert ptr not in self.registered, "registered twice"
        self.registered[ptr] = nbytes

    def unregister(self, ptr):
        self.unregistered.append(ptr)


@pytest.mark.parametrize("case,expected", [
    (dict(cuda=False), PinPath.PAGEABLE),
    (dict(cuda=True), PinPath.REGISTER),
    (dict(cuda=True, pin_available=False), PinPath.PAGEABLE),           # WSL
    (dict(cuda=True, disabled_by_env=True), PinPath.PAGEABLE),          # VLLM_WEIGHT_OFFLOADING_DISABLE_PIN_MEMORY
    (dict(cuda=True, integrated=True), PinPath.UNIFIED),                # DGX Spark, Jetson
    (dict(cuda=True, integrated=True, disabled_by_env=True), PinPath.UNIFIED),
])
def test_the_path_for_each_policy_case(case, expected):
    policy = PinPolicy.decide(**case)
    assert policy.path == expected and policy.locks is (expected == PinPath.REGISTER) and policy.reason


def test_the_ledger_registers_exact_sizes_in_place_and_counts_them():
    registrar = RecordingRegistrar()
    ledger = PageLockedLedger(PinPolicy.decide(cuda=True), registrar)
    embedding = torch.empty(1000, 77, dtype=torch.bfloat16)  # 154,000 bytes: no power of two
    layer = torch.empty(3, 5, dtype=torch.float32)
    before = (embedding.untyped_storage().data_ptr(), layer.untyped_storage().data_ptr())
    assert ledger.lock(embedding, "model.embed_tokens") and ledger.lock(layer, "model.visual")
    assert ledger.lock(embedding, "model.embed_tokens")  # again: counted once
    assert (embedding.untyped_storage().data_ptr(), layer.untyped_storage().data_ptr()) == before  # no copy
    assert registrar.registered == {before[0]: 154_000, before[1]: 60}
    assert ledger.locked_bytes == 154_060
    assert ledger.by_purpose() == {"model.embed_tokens": 154_000, "model.visual": 60}
    assert ledger.by_how() == {"registered": 154_060}


def test_a_view_locks_its_whole_storage_once():
    registrar = RecordingRegistrar()
    ledger = PageLockedLedger(PinPolicy.decide(cuda=True), registrar)
    base = torch.empty(4, 10)
    ledger.lock(base[1:3], "rows")
    ledger.lock(base, "all")
    assert list(registrar.registered.values()) == [160] and ledger.locked_bytes == 160


def test_release_with_the_owning_module_unregisters():
    registrar = RecordingRegistrar()
    ledger = PageLockedLedger(PinPolicy.decide(cuda=True), registrar)
    module = nn.Linear(8, 8)
    for p in module.parameters():
        ledger.lock(p.data, "tower")
    ptrs = {p.untyped_storage().data_ptr() for p in module.parameters()}
    ledger.release_with(module, list(module.parameters()))
    assert ledger.locked_bytes == (64 + 8) * 4
    del module, p
    gc.collect()
    assert set(registrar.unregistered) == ptrs and ledger.locked_bytes == 0


@pytest.mark.parametrize("case", [dict(cuda=False), dict(cuda=True, disabled_by_env=True),
                                  dict(cuda=True, integrated=True)])
def test_nothing_is_locked_when_the_policy_says_no(case):
    registrar = RecordingRegistrar()
    ledger = PageLockedLedger(PinPolicy.decide(**case), registrar)
    assert ledger.lock(torch.empty(10), "x") is False
    assert registrar.registered == {} and ledger.locked_bytes == 0


def test_the_resident_set_is_read():
    rss = resident_set_bytes()
    assert rss is None or rss > 10_000_000  # a Python process with torch loaded


def test_an_on_demand_tower_locks_its_host_weights_in_one_arena():
    """The tower's host weights are packed into one page-aligned arena and page-locked with
    one registration (no page shared with another registration), at their size plus
    alignment padding only; values are kept and nothing else is pinned."""
    registrar = PageRegistrar()
    ledger = PageLockedLedger(PinPolicy.decide(cuda=True), registrar)
    tower = nn.Sequential(nn.Linear(16, 16), nn.ModuleList([nn.Linear(16, 16) for _ in range(2)]))
    values = {n: p.detach().clone() for n, p in tower.named_parameters()}
    offload_on_demand(tower, device="cpu", page_locked=ledger, name="model.visual")
    assert all(torch.equal(p, values[n]) for n, p in tower.named_parameters())
    assert len({p.untyped_storage().data_ptr() for p in tower.parameters()}) == 1
    [(ptr, nbytes)] = registrar.registered.items()
    exact = sum(p.numel() * 4 for p in tower.parameters())
    assert ptr % PAGE == 0 and exact <= nbytes < exact + 6 * ARENA_ALIGN + PAGE
    assert ledger.locked_bytes == nbytes and ledger.by_purpose() == {"model.visual": nbytes}


def test_a_host_embedding_is_locked_in_place():
    from selective_offload.vllm_glue.embedding import install_host_embedding  # needs vLLM only for the import

    registrar = RecordingRegistrar()
    ledger = PageLockedLedger(PinPolicy.decide(cuda=True), registrar)
    layer = nn.Embedding(100, 8)
    layer.quant_method = type("M", (), {})()
    ptr = layer.weight.untyped_storage().data_ptr()
    install_host_embedding(layer, torch.device("cpu"), "host", None, ledger, "model.embed_tokens")
    assert layer.weight.untyped_storage().data_ptr() == ptr and registrar.registered == {ptr: 100 * 8 * 4}


def test_a_refused_registration_is_not_counted_as_locked():
    """The driver refuses a registration over a page already registered (CUDA error 712:
    small tensors sharing a page). Those bytes are not locked: the ledger must not count
    them (nor ever unregister them)."""
    class Refusing(RecordingRegistrar):
        def register(self, ptr, nbytes):
            raise AlreadyRegistered(ptr)

    registrar = Refusing()
    ledger = PageLockedLedger(PinPolicy.decide(cuda=True), registrar)
    t = torch.empty(25)
    assert not ledger.lock(t, "x") and ledger.locked_bytes == 0 and ledger.refused_bytes == 100
    ledger.unlock(t.untyped_storage().data_ptr())
    assert registrar.unregistered == []


def test_small_tensors_of_two_modules_share_no_registered_page():
    """Two modules of small tensors (norm weights, biases), each packed into one arena
    with one registration: every byte is locked, no page is registered twice, and the
    values, shapes and dtypes are kept. Locked one tensor at a time instead, the second
    tensor on a shared page would be refused (error 712)."""
    registrar = PageRegistrar()
    ledger = PageLockedLedger(PinPolicy.decide(cuda=True), registrar)
    modules = [nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 3)) for _ in range(2)]
    for m in modules:
        before = {n: p.detach().clone() for n, p in m.named_parameters()}
        assert ledger.lock_together(list(m.parameters()), "tower")
        assert all(torch.equal(p, before[n]) and p.dtype == before[n].dtype for n, p in m.named_parameters())
        assert len({p.untyped_storage().data_ptr() for p in m.parameters()}) == 1  # one arena
        assert all(ledger.is_locked(p) for p in m.parameters())
    assert len(registrar.registered) == 2 and all(ptr % PAGE == 0 and n % PAGE == 0
                                                  for ptr, n in registrar.registered.items())
    assert ledger.locked_bytes == sum(registrar.registered.values()) and ledger.refused_bytes == 0
    loose = PageLockedLedger(PinPolicy.decide(cuda=True), PageRegistrar())
    small = [torch.empty(4) for _ in range(64)]  # heap neighbours: some share a page
    locked = [loose.lock(t, "loose") for t in small]
    assert not all(locked) and loose.refused_bytes > 0
