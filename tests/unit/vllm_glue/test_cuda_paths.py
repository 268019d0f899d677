"""CPU proxies for the CUDA paths of vLLM's loading that the CPU build never takes.

No CUDA device exists here, so each test drives vLLM's own code where it can
(``process_weights_after_loading`` on vLLM's layer classes, with a CUDA target device
recorded rather than used) and stands in only for what needs the device:

- vLLM's ``device_loading_context`` is replaced by a recorder (``RoundTrip``) that notes
  every module vLLM would move to the device and gives its parameters back as vLLM does,
  in new torch-pinned storage (counted by ``TorchPinned``);
- torch's caching host allocator is ``TorchPinned``: a ledger of blocks rounded up to a
  power of two, a freed block staying locked in its cache until emptied (freeing is read
  from the storage itself, ``StorageWeakRef``);
- ``cudaHostRegister`` is ``PageRegistrar`` (by whole pages, error 712 on a page
  registered twice), and ``is_pinned()`` is what those two say;
- vLLM's ``PrefetchOffloader`` (its ``__init__`` makes a CUDA stream) is
  ``FakePrefetchOffloader``, the same life cycle in a few lines: pin each parameter at
  ``wrap_modules``, re-pin in ``post_init`` what is not pinned, point the parameter at a
  device buffer.
"""

from __future__ import annotations

import contextlib
import gc
import weakref
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from builders import MB, Inner, Model, checkpoint_of, cold_ids, plan_for, toy
from builders import inputs as plan_inputs
from selective_offload.errors import PlanError
from selective_offload.options import RunOptions
from selective_offload.plan_format import COLD_SERVINGS, Serving
from selective_offload.planner import make_plan
from selective_offload.report import build_report
from selective_offload.vllm_glue import offloader as offloader_module
from selective_offload.vllm_glue.embedding import install_host_embedding
from selective_offload.vllm_glue.loading import (
    _construct_drafter,
    _keep_post_processing_on_host,
    finish,
    judge_after_post_init,
    refuse_what_the_plan_cannot_survive,
    whole_tower_over_budget,
)
from selective_offload.vllm_glue.session import Load, Session, Settings
from selective_offload.wrappers.construct_on_host import ConstructOnHost
from selective_offload.wrappers.page_locked import PAGE, AlreadyRegistered, PageLockedLedger, PinPolicy
from selective_offload.wrappers.residency import OffloadError

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

CUDA = torch.device("cuda", 0)  # recorded as the target, never used


class TorchPinned:
    """torch's caching host allocator, as a ledger."""

    def __init__(self) -> None:
        self.live: list[tuple[StorageWeakRef, int, int]] = []
        self.cached = 0

    def pin_copy(self, t: torch.Tensor) -> torch.Tensor:
        out = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device="cpu").copy_(t)
        nbytes = out.untyped_storage().nbytes()
        self.live.append((StorageWeakRef(out.untyped_storage()), out.untyped_storage().data_ptr(),
                          1 << max(nbytes - 1, 0).bit_length()))
        return out

    def _collect(self) -> None:
        for ref, ptr, size in [x for x in self.live if x[0].expired()]:
            self.live.remove((ref, ptr, size))
            self.cached += size

    def is_pinned(self, t: torch.Tensor) -> bool:
        self._collect()
        return any(ptr == t.untyped_storage().data_ptr() for _, ptr, _ in self.live)

    def held(self) -> int:
        """Live and cached blocks: what torch's host_memory_stats counts as allocated."""
        self._collect()
        return sum(size for _, _, size in self.live) + self.cached

    def empty(self) -> None:
        self._collect()
        self.cached = 0


class PageRegistrar:
    def __init__(self, pinned: TorchPinned) -> None:
        self.registered: dict[int, int] = {}
        self.pinned = pinned

    def register(self, ptr: int, nbytes: int) -> None:
        pages = set(range(ptr // PAGE, (ptr + nbytes - 1) // PAGE + 1))
        if any(pages & set(range(p // PAGE, (p + n - 1) // PAGE + 1)) for p, n in self.registered.items()):
            raise AlreadyRegistered(ptr)
        self.registered[ptr] = nbytes

    def unregister(self, ptr: int) -> None:
        self.registered.pop(ptr)

    def is_pinned(self, t: torch.Tensor) -> bool:
        ptr = t.data_ptr()
        return self.pinned.is_pinned(t) or any(p <= ptr < p + n for p, n in self.registered.items())


class RoundTrip:
    """Stands in for vLLM's ``device_loading_context``: records each module it is entered
    for, and gives host parameters back as vLLM does (a new torch-pinned copy)."""

    def __init__(self, pinned: TorchPinned) -> None:
        self.entered: list[nn.Module] = []
        self.pinned = pinned

    @contextlib.contextmanager
    def __call__(self, module: nn.Module, target_device: torch.device):
        assert target_device == CUDA
        self.entered.append(module)
        host = [n for n, p in module.named_parameters() if p.device.type == "cpu"]
        yield module
        params = dict(module.named_parameters())
        for n in host:
            params[n].data = self.pinned.pin_copy(params[n].data)


@pytest.fixture
def vllm_post_processing(monkeypatch):
    """vLLM's process_weights_after_loading, with its device round trip recorded."""
    import vllm.model_executor.layers.linear as linear
    import vllm.model_executor.layers.vocab_parallel_embedding as vpe
    import vllm.model_executor.model_loader.utils as utils
    import vllm.model_executor.parameter as parameter

    for module in (linear, vpe, parameter):
        monkeypatch.setattr(module, "get_tensor_model_parallel_rank", lambda: 0)
        monkeypatch.setattr(module, "get_tensor_model_parallel_world_size", lambda: 1)
    pinned = TorchPinned()
    trip = RoundTrip(pinned)
    monkeypatch.setattr(utils, "device_loading_context", trip)
    config = SimpleNamespace(word_embeddings_untied_by_checkpoint=False, quantization=None, dtype=torch.float32)

    def run(model: nn.Module) -> None:
        utils.process_weights_after_loading(model, config, CUDA)

    return SimpleNamespace(run=run, trip=trip, pinned=pinned, linear=linear, vpe=vpe)


# --------------------------------------------------------------------------- 1. drafter

def test_a_drafters_host_embedding_and_head_take_no_device_round_trip(vllm_post_processing):
    """vLLM post-processes a drafter on the CUDA target: its host-built embedding and LM
    head (vLLM replaces them by the target's) must not cross to the device and back into
    rounded torch-pinned storage. Same parameter objects, same storage, nothing pinned."""
    vpe = vllm_post_processing.vpe

    class Drafter(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = nn.Module()
            self.model.embed_tokens = vpe.VocabParallelEmbedding(64, 8)
            self.lm_head = vpe.ParallelLMHead(64, 8)

    s = Session(Settings(None, None), SimpleNamespace(ParallelLMHead=vpe.ParallelLMHead,
                                                      VocabParallelEmbedding=vpe.VocabParallelEmbedding))
    with torch.device("meta"):  # vLLM's device context (the CUDA device cannot exist here)
        drafter = _construct_drafter(s, Drafter, (), {})
    assert s.drafter_routed_modules == ["lm_head", "model.embed_tokens"]
    before = {n: (p, p.untyped_storage().data_ptr()) for n, p in drafter.named_parameters()}
    assert all(p.device.type == "cpu" for p, _ in before.values())
    vllm_post_processing.run(drafter)
    assert vllm_post_processing.trip.entered == []
    assert {n: (p, p.untyped_storage().data_ptr()) for n, p in drafter.named_parameters()} == before
    assert vllm_post_processing.pinned.held() == 0
    assert [n for n, _ in s.drafter_routed.params(drafter)] == ["model.embed_tokens.weight", "lm_head.weight"]


def test_a_method_that_needs_the_device_round_trips_one_module_back_to_exact_host_memory(
        vllm_post_processing, monkeypatch):
    """A quant method that must post-process on the device (a repack with device kernels)
    still avoids vLLM's context: its module alone goes to the device and comes back to
    pageable host memory of exactly its size (to be page-locked in place), and the
    transient is recorded."""
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    from selective_offload.vllm_glue import host_resident

    seen = []

    class Repacking(QuantizeMethodBase):
        def create_weights(self, *args, **kwargs):
            raise NotImplementedError

        def apply(self, *args, **kwargs):
            raise NotImplementedError

        def process_weights_after_loading(self, layer):
            seen.append({n: p.device for n, p in layer.named_parameters()})
            layer.weight.data = layer.weight.data * 2  # a new tensor, as a repack makes

    moved = []

    def to_device(t, device):  # the copy the device would get (no CUDA device here)
        moved.append((device, t.numel() * t.element_size()))
        out = t.clone()
        out.__dict__["fake_device"] = device
        return out

    monkeypatch.setattr(host_resident, "to_device", to_device)
    layer = nn.Linear(16, 8, bias=False)
    layer.quant_method = Repacking()
    weight = layer.weight
    expected = weight.detach() * 2
    transients = []
    notes = host_resident.keep_on_host([("visual.proj", layer)], CUDA, transients.append)
    assert notes and "one module at a time" in notes[0]
    model = nn.Module()
    model.visual = layer
    vllm_post_processing.run(model)
    assert vllm_post_processing.trip.entered == []  # not vLLM's context
    assert moved == [(CUDA, 16 * 8 * 4)] and transients == [16 * 8 * 4] and len(seen) == 1
    assert layer.weight is weight and layer.weight.device.type == "cpu"
    assert torch.equal(layer.weight.detach(), expected)
    assert layer.weight.untyped_storage().nbytes() == 16 * 8 * 4  # exact size
    assert vllm_post_processing.pinned.held() == 0


# --------------------------------------------------------------------------- 3. report

def test_a_cold_module_post_processed_through_a_round_trip_is_still_built_on_the_host():
    """Post-processing may give a cold parameter new host storage (a quantized method's
    round trip): it was built on the host, and the report must still say so."""
    class Visual(nn.Sequential):
        def __init__(self, n, prefix=""):
            super().__init__(nn.Linear(n, n), nn.Linear(n, n))

    class Model(nn.Module):
        def __init__(self, n=16, layers=4):
            super().__init__()
            self.model = Inner(n, layers)
            self.visual = Visual(n, prefix="visual")
            self.lm_head = nn.Linear(n, 64, bias=False)

    mode = ConstructOnHost({"visual"})
    with torch.device("meta"), mode:
        model = Model()
    model.model.to_empty(device="cpu")
    model.lm_head.to_empty(device="cpu")
    result = mode.finish(model, lambda name: name.split(".")[0] == "visual")
    assert all(p.device.type == "cpu" for p in model.visual.parameters())
    for p in model.visual.parameters():  # the round trip's way back: new storage
        p.data = p.data.clone()
    plan = plan_for(checkpoint_of())
    cold = {id(p) for p in model.visual.parameters()} | {id(p) for p in model.model.embed_tokens.parameters()}
    report = build_report(model, plan, compute_device=CUDA, cold_on_host_params=cold, prefetch_params=set(),
                          routed_names=result.names | {"model.embed_tokens.weight"})
    visual = report.landing("model.visual")
    assert visual.routed_bytes == visual.host_bytes > 0 and visual.moved_bytes == 0
    assert report.unrouted_cold_bytes == 0


# --------------------------------------------------------------------------- 2. hot layers

class FakeParamOffloader:
    """vLLM 0.33's _CpuParamOffloader: pins at construction, re-pins in post_init."""

    def __init__(self, module, name, pinned: TorchPinned, registrar: PageRegistrar):
        self._module, self._param_name, self.pinned, self.registrar = module, name, pinned, registrar
        self._cpu_storage = pinned.pin_copy(self._param.data)
        self._param.data = self._cpu_storage

    @property
    def _param(self):
        obj = self._module
        for attr in self._param_name.split("."):
            obj = getattr(obj, attr)
        return obj

    def sync_cpu_storage(self):
        param = self._param
        if param.data.device.type == "cpu":
            if not self.registrar.is_pinned(param.data):
                self._cpu_storage = self.pinned.pin_copy(param.data)
            else:
                self._cpu_storage = param.data

    def assign_static_buffer(self):
        self.sync_cpu_storage()
        self._param.data = torch.empty_like(self._cpu_storage)  # the device buffer


class FakeModuleOffloader:
    def __init__(self, module, pinned, registrar):
        self.module = module
        self._param_offloaders = {n: FakeParamOffloader(module, n, pinned, registrar)
                                  for n, _ in module.named_parameters()}


def fake_prefetch_base(pinned, registrar):
    class FakePrefetchOffloader:
        def __init__(self, **kwargs):
            self.module_offloaders = []

        def wrap_modules(self, modules_generator, prefix=""):
            out = []
            for module in modules_generator:
                out.append(module)
                self.module_offloaders.append(FakeModuleOffloader(module, pinned, registrar))
            return out

        def post_init(self):
            for mo in self.module_offloaders:
                for po in mo._param_offloaders.values():
                    po.sync_cpu_storage()
            for mo in self.module_offloaders:
                for po in mo._param_offloaders.values():
                    po.assign_static_buffer()

    return FakePrefetchOffloader


def make_layers(num_hidden_layers, prefix, offloader, build, start_layer=0, end_layer=None):
    """The shape of vLLM's make_layers: this rank's layers, as a generator."""
    end_layer = num_hidden_layers if end_layer is None else end_layer
    return offloader.wrap_modules(build(i) for i in range(start_layer, end_layer))


def test_hot_layers_are_page_locked_once_at_their_size_after_post_init(vllm_post_processing, monkeypatch):
    """Ledger of page-locked bytes through a hot layer's life (vLLM's pinning at
    wrap_modules, its post-processing, post_init): torch's pinned blocks are gone after
    each layer is built; post_init leaves the layers registered once (one arena each, at
    their size plus alignment) and nothing in torch's cache, and the glue's verdict runs
    after that, on the final figures. vLLM's post-processing takes no layer to the device."""
    pinned = vllm_post_processing.pinned
    registrar = PageRegistrar(pinned)
    ledger = PageLockedLedger(PinPolicy.decide(cuda=True), registrar)
    monkeypatch.setattr(offloader_module, "release_cached_pinned", pinned.empty)
    at_verdict = []
    offloader = offloader_module.make_exact_prefetch_offloader(
        fake_prefetch_base(pinned, registrar), [1, 3], 1, "model.layers", 4, page_locked=ledger,
        on_post_init=lambda: at_verdict.append((pinned.held(), ledger.locked_bytes)))
    linear = vllm_post_processing.linear

    def build(i):
        layer = nn.Module()
        layer.qkv = linear.ReplicatedLinear(128, 384, bias=True, prefix=f"model.layers.{i}.qkv")
        layer.out = linear.ReplicatedLinear(128, 128, bias=True, prefix=f"model.layers.{i}.out")
        for m in (layer.qkv, layer.out):
            m._cpu_skip_gemm_dispatch = True  # the CPU build would repack into oneDNN otherwise
        return layer

    model = nn.Module()
    model.layers = nn.ModuleList(make_layers(4, "model.layers", offloader, build))
    assert [id(m) for m in offloader.offloaded_modules] == [id(model.layers[1]), id(model.layers[3])]
    assert pinned.held() == 0  # each layer's rounded pinned block released as it was built
    for i in (0, 2):  # resident layers live on the device (here: no storage at all)
        model.layers[i].to("meta")
    host_bytes = sum(p.numel() * p.element_size() for m in offloader.offloaded_modules for p in m.parameters())

    load = SimpleNamespace(device=CUDA, hot_offloader=offloader, notes=[], post_process_transient=0,
                           settings=SimpleNamespace(cold_on_host_segments=frozenset()), cold_segments=frozenset())
    _keep_post_processing_on_host(model, load)
    vllm_post_processing.run(model)
    assert not [m for m in vllm_post_processing.trip.entered
                if any(m is sub for layer in offloader.offloaded_modules for sub in layer.modules())]
    # vLLM's deferred attention layers take its round trip whatever the flag says: a copy
    # torch pinned, which post_init must not keep.
    qkv = model.layers[3].qkv
    qkv.bias.data = pinned.pin_copy(qkv.bias.data)
    assert pinned.held() > 0

    offloader.post_init()
    assert len(registrar.registered) == 2  # one registration per layer
    locked = sum(registrar.registered.values())
    assert at_verdict == [(0, locked)]
    assert host_bytes <= locked <= 1.05 * host_bytes
    for layer in offloader.offloaded_modules:
        for po in (po for mo in offloader.module_offloaders if mo.module is layer
                   for po in mo._param_offloaders.values()):
            assert registrar.is_pinned(po._cpu_storage) and not pinned.is_pinned(po._cpu_storage)


# --------------------------------------------------------------------------- 4. edge cases

def test_the_host_gather_under_cuda_graphs_is_refused_before_load():
    """A host gather is host work a CUDA graph cannot capture: with graphs captured and
    SELECTIVE_OFFLOAD_EMBEDDING=host, the load is refused up front, not during capture."""
    plan = SimpleNamespace(groups=[SimpleNamespace(group="model.embed_tokens", serving=Serving.GATHER)])

    def session(mode):
        return SimpleNamespace(settings=SimpleNamespace(plan=plan, options=RunOptions("p", embedding_mode=mode)))

    def config(graphs: bool):
        return SimpleNamespace(compilation_config=SimpleNamespace(cudagraph_mode="FULL" if graphs else "NONE"),
                               model_config=SimpleNamespace(enforce_eager=not graphs), lora_config=None)

    with pytest.raises(PlanError, match="a CUDA graph cannot capture"):
        refuse_what_the_plan_cannot_survive(session("host"), config(True), CUDA)
    refuse_what_the_plan_cannot_survive(session("host"), config(False), CUDA)
    refuse_what_the_plan_cannot_survive(session("host"), config(True), torch.device("cpu"))
    refuse_what_the_plan_cannot_survive(session("uva"), config(True), CUDA)


def test_a_uva_view_is_refused_when_registration_does_not_pin(vllm_post_processing):
    """vLLM's view op makes a private full copy of a table that is not pinned: after
    registration, is_pinned() must be true, or the view is refused with one line."""
    class NotPinning(PageRegistrar):
        def is_pinned(self, t):
            return False

    views = []
    layer = vllm_post_processing.vpe.VocabParallelEmbedding(64, 8)
    ledger = PageLockedLedger(PinPolicy.decide(cuda=True), NotPinning(TorchPinned()))
    with pytest.raises(OffloadError, match="UVA view would copy it"):
        install_host_embedding(layer, CUDA, "uva", views.append, ledger, "model.embed_tokens")
    assert views == []
    layer = vllm_post_processing.vpe.VocabParallelEmbedding(64, 8)
    ledger = PageLockedLedger(PinPolicy.decide(cuda=True), PageRegistrar(TorchPinned()))
    install_host_embedding(layer, CUDA, "uva", lambda t: views.append(t) or t, ledger, "model.embed_tokens")
    assert len(views) == 1 and ledger.locked_bytes == 64 * 8 * 4


def test_a_uva_table_stays_registered_and_nothing_is_unregistered_at_exit():
    """A captured CUDA graph may hold a UVA table's device address after the module is
    collected: that memory stays registered. Other memory is unregistered when its owner
    is collected, but not by an exit handler (the driver frees it with the process)."""
    registrar = PageRegistrar(TorchPinned())
    ledger = PageLockedLedger(PinPolicy.decide(cuda=True), registrar)
    uva_owner, owner = nn.Linear(2, 2), nn.Linear(2, 2)
    table, other = torch.empty(1 << 16), torch.empty(1 << 16)
    ledger.lock(table, "embedding")
    ledger.lock(other, "tower")
    ledger.release_with(uva_owner, [table], keep_registered=True)
    ledger.release_with(owner, [other])
    assert all(not f.atexit for f in weakref.finalize._registry if f.peek() and f.peek()[0] is owner)
    del uva_owner, owner
    gc.collect()
    assert list(registrar.registered) == [table.data_ptr()]


def test_a_tower_whose_blocks_vllm_compiles_is_budgeted_whole():
    """Qwen3-VL's vision blocks are @support_torch_compile classes (calls skip module
    hooks even uncompiled), so the tower is onloaded whole: the plan budgets all of it,
    not two blocks; and the glue reports a plan that budgeted less than a tower it had to
    onload whole."""
    blocks = make_plan(toy(), plan_inputs(530))
    assert blocks.est_transient_device_bytes == 2 * 9 * MB + 4 * MB
    whole = make_plan(toy(model_type="qwen3_vl"), plan_inputs(530))
    assert {g.group: g.serving for g in whole.groups}["model.visual"] in COLD_SERVINGS
    assert whole.est_transient_device_bytes == 40 * MB
    assert whole_tower_over_budget(whole, "model.visual", "on demand, whole: its blocks ...") == []
    [problem] = whole_tower_over_budget(blocks, "model.visual", "on demand, whole: its blocks ...")
    assert problem.startswith("model.visual onloads whole (40000000 B while it runs) but the plan budgets 22000000")
    assert whole_tower_over_budget(blocks, "model.visual", "on demand, block by block (blocks)") == []


def test_page_locked_memory_is_judged_after_the_prefetch_offloaders_post_init():
    """With hot layers, vLLM's prefetch offloader settles their host storage in post_init,
    after the load: the page-locked verdict waits for it (the report at load says so), and
    is made, and raised on in strict mode, when post_init has run."""
    plan = plan_for(checkpoint_of())
    with torch.device("meta"):  # the device (no CUDA here: meta stands in)
        model = Model()
    model.model.embed_tokens.to_empty(device="cpu")  # the cold set, in host memory
    model.visual.to_empty(device="cpu")
    cold = cold_ids(model)
    names = {n for n, p in model.named_parameters() if id(p) in cold}
    host = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) in cold)
    settings = Settings(plan, RunOptions("p", strict=True))
    s = Session(settings, None)
    ledger = PageLockedLedger(PinPolicy.decide(cuda=True), PageRegistrar(TorchPinned()))
    locked = torch.empty(host)  # 4x the host bytes page-locked: over the limit
    ledger.lock(locked, "hot layers")
    load = Load(settings, CUDA, routed_names=frozenset(names), page_locked=ledger, hot_offloader=object())
    finish(s, model, load, cold, set())
    assert s.report.ok and s.report.host_memory == {}
    assert "page-locked host memory is judged after the prefetch offloader's post_init" in s.report.notes
    with pytest.raises(PlanError, match="page-locked"):
        judge_after_post_init(s, load)
    assert s.report.host_memory["page_locked_to_host_ratio"] == pytest.approx(4.0)
