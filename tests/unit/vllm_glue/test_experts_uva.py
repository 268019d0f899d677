"""Routed experts in host memory read through UVA views, on vLLM's own MoE classes.

vLLM's real ``FusedMoEFactory`` builds a real ``MoERunner`` / ``RoutedExperts`` here (no
engine). Where CUDA would be needed, a stand-in says so: PyTorch's meta device stands for
the GPU the model is built under (anything that comes out on the CPU was routed), a
recording registrar for ``cudaHostRegister``, a recording function for vLLM's
``get_accelerator_view_from_cpu_tensor`` (its device views need a GPU), and a recording
copy for the one-layer device transient of quantized post-processing.
"""

from __future__ import annotations

import gc

import pytest
import torch

from helpers import PageRegistrar
from selective_offload.errors import PlanError
from selective_offload.names import group_key
from selective_offload.planner import kernels
from selective_offload.vllm_glue import experts
from selective_offload.wrappers.construct_on_host import ConstructOnHost
from selective_offload.wrappers.page_locked import PageLockedLedger, PinPath, PinPolicy

GROUP = "model.layers.0.mlp.experts"
E, HIDDEN, INTER = 8, 128, 64
#: w13 (E x 2*INTER x HIDDEN) and w2 (E x HIDDEN x INTER), float32.
EXPERT_BYTES = E * (2 * INTER * HIDDEN + HIDDEN * INTER) * 4


def experts_load(*groups: str) -> experts.ExpertsLoad:
    return experts.ExpertsLoad({group_key(g, ()): g for g in groups}, ())


def build_runners(xl: experts.ExpertsLoad | None, layers: int = 2, device: str = "meta"):
    """vLLM's MoE runners for ``layers`` decoder layers, built under ``device`` (meta: the
    stand-in for the GPU) with the glue's construction routing for ``xl``."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.fused_moe.layer import FusedMoEFactory
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    mode = ConstructOnHost((), **experts.routing_kwargs(xl, RoutedExperts))
    with set_current_vllm_config(VllmConfig()), torch.device(device), mode:
        runners = [FusedMoEFactory(num_experts=E, top_k=2, hidden_size=HIDDEN, intermediate_size=INTER,
                                   tp_size=1, dp_size=1, pcp_size=1, params_dtype=torch.float32,
                                   prefix=f"model.layers.{i}.mlp.experts") for i in range(layers)]
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList(torch.nn.Module() for _ in range(layers))
    for layer, runner in zip(model.layers, runners):
        layer.mlp = torch.nn.Module()
        layer.mlp.experts = runner
    return model, mode


def find(model, xl):
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    experts.find_modules(model, xl, RoutedExperts)


def test_the_planned_experts_are_built_on_the_host_and_no_others():
    """Routing by the FusedMoE prefix, which vLLM hands RoutedExperts as ``layer_name``:
    layer 0's experts (planned served uva) are allocated on the host, layer 1's under the
    device, and the ledger holds exactly layer 0's expert storages."""
    xl = experts_load(GROUP)
    model, mode = build_runners(xl)
    got = {n: p.device.type for n, p in model.named_parameters()}
    assert got == {"layers.0.mlp.experts.routed_experts.w13_weight": "cpu",
                   "layers.0.mlp.experts.routed_experts.w2_weight": "cpu",
                   "layers.1.mlp.experts.routed_experts.w13_weight": "meta",
                   "layers.1.mlp.experts.routed_experts.w2_weight": "meta"}
    assert mode.routed == {GROUP: EXPERT_BYTES}
    find(model, xl)
    assert xl.modules == {"layers.0.mlp.experts.routed_experts": GROUP}
    result = mode.finish(model, xl.is_expert_module)
    assert result.storages == {p.untyped_storage().data_ptr() for p in model.layers[0].parameters()}


@pytest.mark.parametrize("alias_first", [False, True], ids=["stack-first", "alias-first"])
def test_a_decoder_layer_listed_twice_keeps_its_experts_on_the_host(alias_first):
    """vLLM's Gemma 4 lists its decoder layers again under ``self_decoder.decoder_layers``
    (the same modules): the experts are one layer's, not a copy shared with the rest of the
    model, so they stay where they were built and none is taken as shared. The layer's
    name is the stack's (``layers.N``) whichever list vLLM registers first."""
    xl = experts_load(GROUP)
    model, mode = build_runners(xl)
    model.self_decoder = torch.nn.Module()
    model.self_decoder.decoder_layers = model.layers[:2]
    if alias_first:
        model._modules = {"self_decoder": model._modules.pop("self_decoder"), **model._modules}
    find(model, xl)
    assert xl.modules == {"layers.0.mlp.experts.routed_experts": GROUP} and xl.shared == frozenset()
    result = mode.finish(model, experts.expert_names(model, xl))
    assert result.storages == {p.untyped_storage().data_ptr() for p in model.layers[0].parameters()}
    assert result.moved_back_bytes == 0


def test_renamed_wrappers_still_match_the_plan_group():
    """vLLM names Qwen3-VL-MoE's experts ``language_model.model.layers.0.mlp.experts``;
    the checkpoint (and so the plan) ``model.language_model.layers.0.mlp.experts``."""
    xl = experts_load("model.language_model.layers.0.mlp.experts")
    assert xl.group_of("language_model.model.layers.0.mlp.experts") == "model.language_model.layers.0.mlp.experts"
    assert xl.group_of("language_model.model.layers.1.mlp.experts") is None
    assert xl.group_of("language_model.model.layers.0.mlp") is None


def test_unquantized_post_processing_runs_in_place_and_stays_built_on_the_host():
    """vLLM's own process_weights_after_loading loop on the CPU build: the unquantized
    method repacks w13/w2 into new parameters (replace_parameter). With the glue's take-over
    it runs without device_loading_context, the new parameters are on the host, and they
    still count as built there (the layer never was on the device)."""
    from types import SimpleNamespace

    from vllm.model_executor.model_loader import utils as loader_utils

    xl = experts_load(GROUP)
    model, mode = build_runners(xl, layers=1, device="cpu")
    find(model, xl)
    result = mode.finish(model, xl.is_expert_module)
    experts.after_construction(model, xl, result.storages, torch.device("cpu"))
    routed_experts = model.layers[0].mlp.experts.routed_experts
    assert routed_experts.quant_method.requires_device_loading is False
    entered = []
    original = loader_utils.device_loading_context
    loader_utils.device_loading_context = lambda module, device: (entered.append(module), original(module, device))[1]
    try:
        with torch.no_grad():
            for p in routed_experts.parameters():
                p.normal_()
        config = SimpleNamespace(dtype=torch.float32, quantization=None, word_embeddings_untied_by_checkpoint=False)
        loader_utils.process_weights_after_loading(model, config, torch.device("cpu"))
    finally:
        loader_utils.device_loading_context = original
    assert routed_experts not in entered
    params = list(routed_experts.parameters())
    assert params and all(p.device.type == "cpu" for p in params)
    assert {id(p) for p in params} <= xl.routed
    assert xl.post_processing[GROUP] == "post-processed in place on the host" and xl.transient_bytes == 0


def test_block_fp8_on_triton_post_processes_on_the_host_even_on_cuda():
    """vLLM 0.33's block-FP8 post-processing for Triton needs no device (the table's
    ``HOST_POST_PROCESSING``, checked against 0.33's own method in the contract tier): the
    glue runs it in place on the host, with no device round trip, on a CUDA device too.
    The method is a stand-in named as vLLM's (building Fp8MoEMethod needs CUDA here)."""
    xl = experts_load(GROUP)
    model, mode = build_runners(xl, layers=1, device="cpu")
    find(model, xl)
    result = mode.finish(model, xl.is_expert_module)
    layer = model.layers[0].mlp.experts.routed_experts
    ran = []
    standin = type("Fp8MoEMethod", (torch.nn.Module,), {
        "block_quant": True, "requires_device_loading": True,
        "process_weights_after_loading": lambda self, layer: ran.append(layer)})()
    standin.experts_cls = type("TritonExperts", (), {})
    layer.quant_method = standin
    experts.after_construction(model, xl, result.storages, torch.device("cuda"))
    standin.process_weights_after_loading(layer)
    assert ran == [layer] and standin.requires_device_loading is False
    assert xl.post_processing[GROUP] == "post-processed in place on the host" and xl.transient_bytes == 0
    assert all(p.device.type == "cpu" for p in layer.parameters())
    assert not kernels.post_processes_on_host("fp8-tensor", "TritonExperts")  # requantizes through a compiled op


def test_device_post_processing_is_one_layer_at_a_time_and_returns_at_exact_size():
    """A method that needs the device (quantized on CUDA): the layer alone goes to the
    device (a recording copy stands for it), the transient is that layer's bytes, vLLM's
    own round trip is off, and every parameter ends in host memory built on the host."""
    from vllm.model_executor.utils import replace_parameter

    xl = experts_load(GROUP)
    model, mode = build_runners(xl, layers=1, device="cpu")
    find(model, xl)
    result = mode.finish(model, xl.is_expert_module)
    layer = model.layers[0].mlp.experts.routed_experts
    xl.routed |= {id(p) for p in layer.parameters() if p.untyped_storage().data_ptr() in result.storages}
    onloaded = []

    def onload(t, device):
        onloaded.append((device, t.numel() * t.element_size()))
        return t.clone()

    class Requantize:  # stands for a method whose post-processing replaces parameters
        requires_device_loading = True

        def process_weights_after_loading(self, layer):
            replace_parameter(layer, "w2_weight", layer.w2_weight.data.transpose(1, 2).contiguous().transpose(1, 2))

    method = Requantize()
    experts.take_over_post_processing(layer, method, GROUP, xl, torch.device("cuda"), onload=onload)
    assert method.requires_device_loading is False
    method.process_weights_after_loading(layer)
    assert [d.type for d, _ in onloaded] == ["cuda", "cuda"] and sum(n for _, n in onloaded) == EXPERT_BYTES
    assert xl.transient_bytes == EXPERT_BYTES and "one layer at a time" in xl.post_processing[GROUP]
    assert {id(p) for p in layer.parameters()} <= xl.routed


def test_the_way_back_to_the_host_keeps_the_layout_at_exact_size():
    from selective_offload.vllm_glue.host_resident import to_host_exact

    base = torch.arange(64.0).view(8, 8)
    view = base[:, :4].t()  # strided, a slice of a larger storage
    copy = to_host_exact(view)
    assert copy.stride() == view.stride() and torch.equal(copy, view)
    assert copy.untyped_storage().nbytes() < base.untyped_storage().nbytes()


def uva_ledger(registrar=None) -> PageLockedLedger:
    return PageLockedLedger(PinPolicy(PinPath.REGISTER, "test"), registrar=registrar or PageRegistrar())


def test_attach_locks_each_experts_module_in_one_arena_then_swaps_in_marked_uva_views():
    """On CUDA: an experts module's parameters are packed into one page-aligned arena with
    one registration (layouts and values kept), then each ``.data`` becomes the device view
    vLLM's helper returns for that arena memory (a recorder stands for the helper), marked
    as vLLM marks its own. The parameter objects stay the same, so whatever holds them
    (the kernel's quant config) sees the views."""
    from selective_offload.wrappers.layout import layout_of
    from selective_offload.wrappers.page_locked import PAGE

    xl = experts_load(GROUP)
    model, mode = build_runners(xl, layers=1, device="cpu")
    find(model, xl)
    layer = model.layers[0].mlp.experts.routed_experts
    with torch.no_grad():  # values, not the allocator's leftovers (a NaN among them never equals itself)
        for p in layer.parameters():
            p.normal_()
    before = {n: (p, layout_of(p.data), p.detach().clone()) for n, p in layer.named_parameters()}
    ledger = uva_ledger()
    asked = []

    def accelerator_view(t):
        asked.append((t.data_ptr(), ledger.pinned(t)))
        return t.view_as(t)  # stands for the device view of the same memory

    params = experts.attach(model, xl, torch.device("cuda"), ledger, accelerator_view)
    [(ptr, nbytes)] = ledger.registrar.registered.items()
    assert ptr % PAGE == 0 and EXPERT_BYTES <= nbytes < EXPERT_BYTES + PAGE + 2 * 64
    assert sorted(asked) == sorted((p.data_ptr(), True) for p in layer.parameters())
    for name, p in layer.named_parameters():
        obj, layout, values = before[name]
        assert p is obj and getattr(p, experts.UVA_MARKER) is True and experts.is_live_view(p)
        assert layout_of(p.data) == layout and torch.equal(p.data, values)
    assert params == {id(p) for p, _, _ in before.values()}
    assert xl.mechanisms[GROUP].startswith("uva (")


def test_expert_views_stay_registered_after_their_module_is_collected():
    """A captured CUDA graph may still read a view's address after the model is released:
    the arena stays registered (and held) until the process ends."""
    import weakref

    model, xl = block_fp8_model(layers=1)
    ledger = uva_ledger()
    experts.attach(model, xl, torch.device("cuda"), ledger, lambda t: t.view_as(t))
    locked, gone = ledger.locked_bytes, weakref.ref(model.layers[0].mlp.experts)
    del model
    gc.collect()
    assert gone() is None  # the module was collected: only keep_registered holds the arena
    assert ledger.registrar.unregistered == [] and ledger.locked_bytes == locked > 0


def test_memory_the_driver_does_not_report_pinned_is_refused_before_any_view():
    """After registration ``is_pinned()`` must be true (vLLM's view helper would otherwise
    make a private device copy, or read unregistered memory): refused in one line."""
    class NotPinning(PageRegistrar):
        def is_pinned(self, t):
            return False

    xl = experts_load(GROUP)
    model, _ = build_runners(xl, layers=1, device="cpu")
    find(model, xl)
    views = []
    with pytest.raises(PlanError) as err:
        experts.attach(model, xl, torch.device("cuda"), uva_ledger(NotPinning()), views.append)
    assert views == [] and "\n" not in str(err.value) and "is_pinned() is false" in str(err.value)


def test_a_marker_left_by_a_reload_is_checked_against_the_storage():
    """vLLM 0.33's ``replace_parameter`` keeps the Parameter object and rebinds ``.data``
    when the new tensor differs (model_executor/utils.py:82): the UVA marker survives on
    memory that is no view. attach re-checks the marker against the recorded view and
    redoes that parameter (locked, viewed); a reload that wrote into the view in place
    leaves it as it is."""
    xl = experts_load(GROUP)
    model, _ = build_runners(xl, layers=1, device="cpu")
    find(model, xl)
    layer = model.layers[0].mlp.experts.routed_experts
    ledger = uva_ledger()
    viewed = []

    def accelerator_view(t):
        viewed.append(t.data_ptr())
        return t.view_as(t)

    experts.attach(model, xl, torch.device("cuda"), ledger, accelerator_view)
    with torch.no_grad():
        layer.w2_weight.copy_(torch.ones_like(layer.w2_weight))  # in place: still the view
    layer.w13_weight.data = torch.randn(layer.w13_weight.shape)  # rebound: a stale marker
    assert getattr(layer.w13_weight, experts.UVA_MARKER) and not experts.is_live_view(layer.w13_weight)
    viewed.clear()
    experts.attach(model, xl, torch.device("cuda"), ledger, accelerator_view)
    assert viewed == [layer.w13_weight.data_ptr()] and len(ledger.registrar.registered) == 2
    assert experts.is_live_view(layer.w13_weight) and ledger.pinned(layer.w13_weight.data)


def test_on_the_cpu_build_there_is_no_view_but_the_placement_is_recorded():
    xl = experts_load(GROUP)
    model, _ = build_runners(xl, layers=1, device="cpu")
    find(model, xl)
    calls = []
    params = experts.attach(model, xl, torch.device("cpu"), None, lambda t: calls.append(t))
    layer = model.layers[0].mlp.experts.routed_experts
    assert calls == [] and params == {id(p) for p in layer.parameters()}
    assert not any(getattr(p, experts.UVA_MARKER, False) for p in layer.parameters())
    assert xl.mechanisms[GROUP].startswith("uva (host memory is the device's memory here")


def test_a_kernel_that_does_not_read_uva_views_is_refused_before_loading():
    """vLLM's real unquantized method (its kernel chosen at construction: the CPU build's)
    on a CUDA device is refused with one line naming the kernel and, for the card, the
    setting the kernel table says gets a UVA kernel; Triton's and Marlin's kernels are
    accepted; on the CPU build nothing needs a view."""
    xl = experts_load(GROUP)
    model, _ = build_runners(xl, layers=1, device="cpu")
    method = model.layers[0].mlp.experts.routed_experts.quant_method
    with pytest.raises(PlanError) as err:
        experts.check_kernel(GROUP, method, torch.device("cuda"), card="12.0")
    line = str(err.value)
    assert "\n" not in line and line.startswith(GROUP) and method.experts_cls.__name__ in line
    assert "start vLLM with --moe-backend triton" in line and "SM 12.0" in line
    with pytest.raises(PlanError, match="compute capability is not known here"):
        experts.check_kernel(GROUP, method, torch.device("cuda"))  # no CUDA here: no card to advise for
    experts.check_kernel(GROUP, method, torch.device("cpu"))

    for name in ("TritonExperts", "MarlinExperts"):  # the names the table accepts (vLLM's classes need CUDA)
        method.experts_cls = type(name, (), {})
        experts.check_kernel(GROUP, method, torch.device("cuda"), card="9.0")


def test_the_refusal_names_the_setting_the_table_gives_for_the_method_and_card():
    """An FP8 block method on SM 12.0 (DeepGEMM, by the table) is told VLLM_USE_DEEP_GEMM=0,
    one on SM 10.0 (FlashInfer TRTLLM) --moe-backend triton; gpt-oss MXFP4 on SM 9.0
    (OpenAI's triton_kernels) --moe-backend marlin, never triton (which is triton_kernels)."""
    class Fp8MoEMethod:
        block_quant = True

    class GptOssMxfp4MoEMethod:
        pass

    for method, kernel, card, want in ((Fp8MoEMethod(), "TritonOrDeepGemmExperts", "12.0", "VLLM_USE_DEEP_GEMM=0"),
                                       (Fp8MoEMethod(), "TrtLlmFp8ExpertsMonolithic", "10.0", "--moe-backend triton"),
                                       (GptOssMxfp4MoEMethod(), "OAITritonMxfp4ExpertsMonolithic", "9.0",
                                        "--moe-backend marlin")):
        method.experts_cls = type(kernel, (), {})
        with pytest.raises(PlanError) as err:
            experts.check_kernel(GROUP, method, torch.device("cuda"), card=card)
        assert f"start vLLM with {want} " in str(err.value), str(err.value)


def test_uva_reads_need_page_locked_memory():
    xl = experts_load(GROUP)
    pageable = PinPolicy.decide(cuda=True, disabled_by_env=True)
    with pytest.raises(PlanError, match="needs page-locked host memory.*VLLM_WEIGHT_OFFLOADING_DISABLE_PIN_MEMORY"):
        experts.refuse_before_load(xl, torch.device("cuda"), pageable)
    experts.refuse_before_load(xl, torch.device("cuda"), PinPolicy.decide(cuda=True))
    experts.refuse_before_load(xl, torch.device("cpu"), PinPolicy.decide(cuda=False))


def test_what_vllms_moe_runner_holds_beside_the_experts_stays_with_the_layer():
    """vLLM's runner at ``mlp.experts`` also holds the router gate (the same parameter as
    ``mlp.gate``): listed again under ``experts.``, it is still the layer's, not a routed
    expert, so the report does not count it as an expert byte on the device."""
    assert group_key("model.layers.0.mlp.experts.routed_experts", ()) == ("experts", 0)
    assert group_key("model.layers.0.mlp.experts.gate", ()) == ("layer", 0)
    assert group_key("model.layers.0.mlp.experts._shared_experts._layer.down_proj", ()) == ("layer", 0)
    assert group_key("model.layers.0.mlp.experts.17.down_proj", ()) == ("experts", 0)


def test_a_parameter_shared_with_the_router_is_never_moved_or_viewed():
    """vLLM hands RoutedExperts the router's score-correction bias (the same Parameter as
    the gate's); the glue leaves it where the gate has it."""
    xl = experts_load(GROUP)
    model, _ = build_runners(xl, layers=1, device="cpu")
    bias = torch.nn.Parameter(torch.zeros(E), requires_grad=False)
    model.layers[0].mlp.gate = torch.nn.Module()
    model.layers[0].mlp.gate.e_score_correction_bias = bias
    layer = model.layers[0].mlp.experts.routed_experts
    layer.e_score_correction_bias = bias
    find(model, xl)
    assert xl.shared == {"e_score_correction_bias"}
    ledger = uva_ledger()
    params = experts.attach(model, xl, torch.device("cuda"), ledger, lambda t: t.view_as(t))
    assert id(bias) not in params and not getattr(bias, experts.UVA_MARKER, False) and not ledger.is_locked(bias)
    assert params == {id(layer.w13_weight), id(layer.w2_weight)}


class BlockFp8Experts(torch.nn.Module):
    """A block-FP8 routed experts module of Qwen3-30B-A3B-FP8's shape, every dimension
    scaled down 8 times (128 experts, hidden 2048, intermediate 768, 128x128 blocks: here
    16, 256, 96), its parameters created in the order vLLM 0.33's Fp8MoEMethod creates
    them (quantization/fp8.py create_weights: the weights, then their block scales)."""

    def __init__(self, e=16, h=256, i=96, block=128):
        super().__init__()
        fp8, blocks = torch.float8_e4m3fn, lambda n: -(-n // block)

        def param(*shape, dtype=torch.float32):
            return torch.nn.Parameter(torch.rand(shape).to(dtype), requires_grad=False)

        self.w13_weight = param(e, 2 * i, h, dtype=fp8)
        self.w2_weight = param(e, h, i, dtype=fp8)
        self.w13_weight_scale_inv = param(e, blocks(2 * i), blocks(h))
        self.w2_weight_scale_inv = param(e, blocks(h), blocks(i))


def block_fp8_model(layers: int):
    """``layers`` decoder layers of :class:`BlockFp8Experts`, each a uva-served group."""
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList(torch.nn.Module() for _ in range(layers))
    for layer in model.layers:
        layer.mlp = torch.nn.Module()
        layer.mlp.experts = BlockFp8Experts()
    groups = [f"model.layers.{i}.mlp.experts" for i in range(layers)]
    xl = experts_load(*groups)
    xl.modules = {f"layers.{i}.mlp.experts": g for i, g in enumerate(groups)}
    return model, xl


def shared_page_pairs(tensors) -> int:
    from selective_offload.wrappers.layout import span
    from selective_offload.wrappers.page_locked import PAGE

    pages = []
    for t in tensors:
        lo, hi = span(t)
        start = t.untyped_storage().data_ptr() + lo
        pages.append(set(range(start // PAGE, (start + hi - lo - 1) // PAGE + 1)))
    return sum(bool(a & b) for k, a in enumerate(pages) for b in pages[k + 1:])


def test_block_scales_reallocated_on_the_heap_are_refused_one_by_one_and_locked_in_arenas():
    """Finding 2 on a CPU proxy (``helpers.PageRegistrar`` refuses a page registered twice,
    as CUDA does with error 712). Post-processed on the device one layer at a time, each
    parameter comes back to the host one after another (the glue's way back, to_host_exact):
    the small block scales land on the heap and share pages with their neighbours.
    Registered one parameter at a time, some are refused and stay unlocked; attach's arenas lock every
    one, one registration per module, no refusal."""
    layers = 4
    model, xl = block_fp8_model(layers)
    # The way back from the device, in vLLM's parameter order, onto a stand-in for the heap:
    # one after another, 16-byte aligned, each its own storage, as malloc packs small blocks
    # (the real heap's placement varies from run to run; this one does not).
    params = list(model.parameters())
    heap = bytearray(sum(-(-p.numel() * p.element_size() // 16) * 16 for p in params) + 16)
    base = (-torch.frombuffer(heap, dtype=torch.uint8).data_ptr()) % 16
    at = base
    for p in params:
        nbytes = p.numel() * p.element_size()
        block = torch.frombuffer(memoryview(heap)[at:at + nbytes], dtype=torch.uint8)
        block.copy_(p.data.contiguous().view(-1).view(torch.uint8))
        p.data = block.view(p.dtype).view(p.shape)
        at += -(-nbytes // 16) * 16
    # The premise of the finding: small scales share pages with their neighbours.
    assert shared_page_pairs(params) > 0

    one_by_one = uva_ledger()
    locked = [one_by_one.lock(p.data, "experts") for p in model.parameters()]
    assert not all(locked) and one_by_one.refused_bytes > 0 and one_by_one.registrar.refused
    assert not all(one_by_one.pinned(p.data) for p in model.parameters())

    ledger = uva_ledger()
    params = experts.attach(model, xl, torch.device("cuda"), ledger, lambda t: t.view_as(t))
    assert params == {id(p) for p in model.parameters()}
    assert ledger.refused_bytes == 0 and ledger.registrar.refused == [] and len(ledger.registrar.registered) == layers
    assert all(ledger.pinned(p.data) and experts.is_live_view(p) for p in model.parameters())


def _checkpoint(seed: int) -> dict[str, torch.Tensor]:
    """One layer's experts as a checkpoint stores them: each expert's gate, up and down."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for e in range(E):
        for name, shape in (("gate_proj", (INTER, HIDDEN)), ("up_proj", (INTER, HIDDEN)), ("down_proj", (HIDDEN, INTER))):
            out[f"layers.0.mlp.experts.{e}.{name}.weight"] = torch.randn(*shape, generator=g)
    return out


def _load_weights(model, weights) -> set[str]:
    """The model's ``load_weights`` as vLLM's MoE models write it (Qwen3-MoE's): each
    expert's tensors through the parameter's own ``weight_loader`` (which the layerwise
    reload wraps), by vLLM's expert mapping."""
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    mapping = RoutedExperts.make_expert_params_mapping(model, "gate_proj", "down_proj", "up_proj", num_experts=E)
    params = dict(model.named_parameters())
    loaded = set()
    for name, tensor in weights:
        for param_name, weight_name, expert_id, shard_id in mapping:
            if weight_name in name:
                param = params[name.replace(weight_name, param_name)]
                param.weight_loader(param, tensor, name, shard_id=shard_id, expert_id=expert_id)
                loaded.add(name)
                break
    return loaded


def _expected(ckpt) -> tuple[torch.Tensor, torch.Tensor]:
    w13 = torch.stack([torch.cat([ckpt[f"layers.0.mlp.experts.{e}.gate_proj.weight"],
                                  ckpt[f"layers.0.mlp.experts.{e}.up_proj.weight"]]) for e in range(E)])
    w2 = torch.stack([ckpt[f"layers.0.mlp.experts.{e}.down_proj.weight"] for e in range(E)])
    return w13, w2


def test_vllms_reload_writes_the_new_bytes_where_the_uva_views_read():
    """vLLM's own in-place reload (``reload_weights``: each layer rebuilt from the metadata
    recorded at construction, loaded through its weight loaders, post-processed by the
    quant method the glue took over, then copied into the tensors it restores): the
    parameters stay the glue's live views, at their addresses, and read the new bytes."""
    from vllm.model_executor.model_loader.reload.layerwise import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
        record_metadata_for_reloading,
    )

    xl = experts_load(GROUP)
    model, _ = build_runners(xl, layers=1, device="cpu")
    record_metadata_for_reloading(model)  # as vLLM's initialize_model does
    model.load_weights = lambda weights: _load_weights(model, weights)
    find(model, xl)
    layer = model.layers[0].mlp.experts.routed_experts
    experts.take_over_post_processing(layer, layer.quant_method, GROUP, xl, None)
    model.load_weights(_checkpoint(1).items())
    layer.quant_method.process_weights_after_loading(layer)
    ledger = uva_ledger()
    experts.attach(model, xl, torch.device("cuda"), ledger, lambda t: t.view_as(t))
    views = {n: (p, p.data_ptr()) for n, p in layer.named_parameters()}
    assert all(experts.is_live_view(p) for p, _ in views.values())

    ckpt = _checkpoint(2)
    initialize_layerwise_reload(model)
    model.load_weights(ckpt.items())
    finalize_layerwise_reload(model, None)
    w13, w2 = _expected(ckpt)
    for name, want in (("w13_weight", w13), ("w2_weight", w2)):
        param, ptr = views[name]
        assert getattr(layer, name) is param and param.data_ptr() == ptr and experts.is_live_view(param)
        torch.testing.assert_close(param.data, want)  # the view reads the reloaded bytes
    assert len(ledger.registrar.registered) == 1  # nothing locked again


def _repacking_method(layer):
    """Stands for a quant method whose post-processing gives a weight new tensors (a
    repack): it rebinds the Parameter's ``.data`` as vLLM 0.33's ``replace_parameter``
    does when the new tensor's stride or device differs (the installed 0.32 registers a
    new Parameter instead), here with twice the loaded values, on the host."""
    def process_weights_after_loading(layer):
        w = layer.w13_weight
        w.data = w.data.to("cpu") * 2

    layer.quant_method.process_weights_after_loading = process_weights_after_loading


def _loaded_and_viewed():
    xl = experts_load(GROUP)
    model, _ = build_runners(xl, layers=1, device="cpu")
    model.load_weights = lambda weights: _load_weights(model, weights)
    find(model, xl)
    layer = model.layers[0].mlp.experts.routed_experts
    _repacking_method(layer)
    experts.take_over_post_processing(layer, layer.quant_method, GROUP, xl, None)
    model.load_weights(_checkpoint(1).items())
    layer.quant_method.process_weights_after_loading(layer)
    ledger = uva_ledger()
    experts.attach(model, xl, torch.device("cuda"), ledger, lambda t: t.view_as(t))
    return model, layer, ledger


def test_a_reload_whose_post_processing_replaces_a_viewed_weight_is_viewed_again_at_its_address():
    """A reload that loads into the views and runs the post-processing again (a caller's
    ``load_weights`` then ``process_weights_after_loading``): the repacked tensor replaces
    the view's data; the glue copies it into the page-locked storage the view read and
    views it again at the same address (a captured graph's), with nothing locked again."""
    model, layer, ledger = _loaded_and_viewed()
    param, ptr = layer.w13_weight, layer.w13_weight.data_ptr()
    ckpt = _checkpoint(2)
    model.load_weights(ckpt.items())
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.w13_weight is param and param.data_ptr() == ptr and experts.is_live_view(param)
    torch.testing.assert_close(param.data, 2 * _expected(ckpt)[0])
    assert len(ledger.registrar.registered) == 1


def test_a_reload_that_changes_a_viewed_weights_shape_is_refused_in_one_line():
    """A repack of another shape cannot be read at the view's address: one line, and the
    page-locked storage the view reads is left as it was."""
    _, layer, _ = _loaded_and_viewed()
    param = layer.w13_weight
    before = param.data.clone()
    param.data = torch.zeros(E, 2 * INTER * HIDDEN)  # the reload's repack, flattened per expert
    with pytest.raises(PlanError) as err:
        experts.view_again(param, f"{GROUP}: w13_weight", lambda t: t.view_as(t))
    line = str(err.value)
    assert "\n" not in line and line.startswith(f"{GROUP}: w13_weight") and "restart the engine" in line
    torch.testing.assert_close(getattr(param, experts.VIEW_RECORD)[2], before)


def test_vllms_reload_refills_a_computed_layers_device_share_with_the_new_bytes():
    """A layer served ``compute`` with a device share (its first experts also on the device)
    across vLLM's own in-place reload: the quant method the glue installed runs on the layer
    vLLM rebuilt and loaded, before vLLM copies the new values into the host experts'
    tensors, so the share is refilled from the layer's tensors as they are then, in the
    tensors a captured graph holds; the host experts read the new bytes too."""
    from vllm.model_executor.model_loader.reload.layerwise import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
        record_metadata_for_reloading,
    )

    from selective_offload.cpu_kernels import Activation
    from selective_offload.cpu_kernels.reference import held_share
    from selective_offload.vllm_glue import host_compute
    from selective_offload.wrappers.host_compute import HostExperts

    xl = experts_load(GROUP)
    model, _ = build_runners(xl, layers=1, device="cpu")
    record_metadata_for_reloading(model)
    model.load_weights = lambda weights: _load_weights(model, weights)
    layer = model.layers[0].mlp.experts.routed_experts
    model.load_weights(_checkpoint(1).items())
    weights = host_compute.weights_of(layer, "f32")
    share = held_share(weights, 3, torch.device("cpu"))
    hosted = HostExperts(GROUP, weights, Activation("silu"), crossover_tokens=2, threads=1, device=torch.device("cpu"),
                         device_share=share)
    layer._replace_quant_method(host_compute.method_class()(layer.quant_method, hosted))
    held = {n: t.data_ptr() for n, t in share.tensors().items()}

    ckpt = _checkpoint(2)
    initialize_layerwise_reload(model)
    model.load_weights(ckpt.items())
    finalize_layerwise_reload(model, None)
    w13, w2 = _expected(ckpt)
    torch.testing.assert_close(hosted.weights.w13, w13)  # vLLM copied into the host experts' tensors
    for name, want in (("w13", w13[:3]), ("w2", w2[:3])):
        got = share.tensors()[name]
        assert got.data_ptr() == held[name]
        torch.testing.assert_close(got, want)


def test_vllms_reload_rebuilds_a_computed_layer_in_host_memory(tmp_path):
    """vLLM records at construction the device its layer-by-layer reload rebuilds each layer
    on (the default device: CUDA on a GPU; meta stands in for it here). A layer the glue
    serves ``compute`` is rebuilt in host memory instead, so its whole as-loaded experts
    never land on the device, which the plan does not count; vLLM's own reload then runs
    through and the host experts read the new bytes."""
    from vllm.model_executor.model_loader.reload.layerwise import (
        finalize_layerwise_reload,
        get_layerwise_info,
        initialize_layerwise_reload,
        record_metadata_for_reloading,
    )

    from helpers import compute_experts_plan, save_tiny_qwen3_moe
    from selective_offload.vllm_glue import host_compute

    xl = experts_load(GROUP)
    model, _ = build_runners(xl, layers=1, device="cpu")
    with torch.device("meta"):
        record_metadata_for_reloading(model)
    model.load_weights = lambda weights: _load_weights(model, weights)
    layer = model.layers[0].mlp.experts.routed_experts
    model.load_weights(_checkpoint(1).items())
    plan = compute_experts_plan(save_tiny_qwen3_moe(tmp_path / "moe"))  # the same experts' shapes
    hosted = host_compute.install(GROUP, layer, layer.quant_method, plan, torch.device("cpu"))
    assert get_layerwise_info(layer).restore_device == torch.device("cpu")

    ckpt = _checkpoint(2)
    initialize_layerwise_reload(model)
    model.load_weights(ckpt.items())
    finalize_layerwise_reload(model, None)
    w13, w2 = _expected(ckpt)
    torch.testing.assert_close(hosted.weights.w13, w13)
    torch.testing.assert_close(hosted.weights.w2, w2)
