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

from selective_offload.wrappers.page_locked import PageLockedLedger, PinPath, PinPolicy, resident_set_bytes


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


def test_an_on_demand_tower_locks_its_host_weights_in_place():
    """The tower's weights are already in host memory (built there): they are page-locked
    where they are, exactly their size, and nothing is copied to pin them."""
    from selective_offload.wrappers import offload_on_demand

    registrar = RecordingRegistrar()
    ledger = PageLockedLedger(PinPolicy.decide(cuda=True), registrar)
    tower = nn.Sequential(nn.Linear(16, 16), nn.ModuleList([nn.Linear(16, 16) for _ in range(2)]))
    before = {n: p.untyped_storage().data_ptr() for n, p in tower.named_parameters()}
    offload_on_demand(tower, device="cpu", page_locked=ledger, name="model.visual")
    after = {n: p.untyped_storage().data_ptr() for n, p in tower.named_parameters()}
    assert after == before  # storage identity: no copy
    assert sorted(registrar.registered) == sorted(before.values())
    assert ledger.locked_bytes == sum(p.numel() * 4 for p in tower.parameters()) == 3 * (16 * 16 + 16) * 4
    assert ledger.by_purpose() == {"model.visual": ledger.locked_bytes}


def test_a_host_embedding_is_locked_in_place():
    from selective_offload.vllm_glue.embedding import install_host_embedding  # needs vLLM only for the import

    registrar = RecordingRegistrar()
    ledger = PageLockedLedger(PinPolicy.decide(cuda=True), registrar)
    layer = nn.Embedding(100, 8)
    layer.quant_method = type("M", (), {})()
    ptr = layer.weight.untyped_storage().data_ptr()
    install_host_embedding(layer, torch.device("cpu"), "host", None, ledger, "model.embed_tokens")
    assert layer.weight.untyped_storage().data_ptr() == ptr and registrar.registered == {ptr: 100 * 8 * 4}


def test_memory_registered_elsewhere_is_counted_and_never_unregistered():
    """The driver refuses a second registration (CUDA error 712); the ledger counts those
    bytes as registered elsewhere and leaves their unregistering to whoever registered them."""
    from selective_offload.wrappers.page_locked import AlreadyRegistered

    class Refusing(RecordingRegistrar):
        def register(self, ptr, nbytes):
            raise AlreadyRegistered(ptr)

    registrar = Refusing()
    ledger = PageLockedLedger(PinPolicy.decide(cuda=True), registrar)
    t = torch.empty(25)
    assert ledger.lock(t, "x") and ledger.by_how() == {"registered elsewhere": 100}
    ledger.unlock(t.untyped_storage().data_ptr())
    assert registrar.unregistered == [] and ledger.locked_bytes == 0
