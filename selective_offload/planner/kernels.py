"""Which fused-MoE kernel vLLM 0.33 picks for a layer's routed experts, and whether it reads
host memory in place through UVA views: one table, used by the planner before a plan is made
and by the glue when vLLM has built the layer (no vLLM import here).

vLLM picks the kernel (the quant method's ``experts_cls``) when it builds the layer, from the
quantization method, the card's compute capability and the global ``moe_backend`` /
environment. Its oracles (``model_executor/layers/fused_moe/oracle/*.py``) decide; this table
is what they answer, written down from running them (``tests/contract/check_kernel_table.py``
runs vLLM 0.33's own quant methods and oracles with each row's capability and setting and
checks every row; the rows it cannot run are in :data:`NOT_RUN`, with the reason).

Shapes matter to the oracles (block kernels need 128-aligned dimensions): the rows hold for
the shapes the reference models have, Qwen3-30B-A3B's (hidden 2048, expert intermediate 768)
for every method but MXFP4, gpt-oss's (2880 / 2880, SwiGLU-OAI with biases) for MXFP4. TP=1,
no expert parallelism, no LoRA.

Which kernels read UVA views (:data:`UVA_KERNELS`), and why:

=============================  ====  ===========================================================
kernel (``experts_cls``)       uva   evidence (vLLM 0.33 sources)
=============================  ====  ===========================================================
``TritonExperts``              yes   vLLM reads host weights through it itself: ``TritonExperts.
                                     apply`` checks ``_weights_host_resident`` (the UVA marker)
``MarlinExperts``              yes   vLLM's own ``cpu_offload_gb`` hands it UVA views the way the
                                     glue does: ``offloader/uva.py:118-122`` makes each parameter
                                     a device view of pinned host memory at construction (its
                                     ``device`` stays the accelerator, ``uva.py:96-98``), Marlin's
                                     repack then runs on the device, and ``device_loading_context``
                                     re-offloads each replaced parameter to pinned host memory
                                     and a new view (``model_loader/utils.py:252-261``). PR
                                     #56118's "b_q_weight is not on GPU" is the kernel's
                                     device check failing for a raw host tensor (device ``cpu``);
                                     a UVA view is a CUDA tensor and passes it. The glue does the
                                     same: post-processing on the device one layer at a time,
                                     then host copies of exact size and views.
CPU build kernels              yes   no view: host memory is the compute device's memory
FlashInfer TRTLLM / CUTLASS,   no    weights shuffled for TMA-driven kernels; reading mapped host
DeepGEMM, OAI triton_kernels,        memory through them is not verified, and vLLM's own UVA
Humming, ``TritonWNA16``             offload is not known to feed them
=============================  ====  ===========================================================
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from ..plan_format.inputs import DEFAULT_CARD, MOE_SETTINGS

#: The cards the table covers, as ``torch.cuda.get_device_capability`` spells them ("major.minor").
CARDS = ("7.5", "8.0", "8.6", "8.7", "8.9", "9.0", "10.0", "12.0")
#: The cards before Ada (Turing 7.5; Ampere 8.0, 8.6 and 8.7): no FP8 arithmetic and none of
#: the SM 9.0-and-up kernels, so vLLM 0.33's oracles pick the same kernel on each of them for
#: every row (MXFP4 on Marlin, ``quantization/utils/marlin_utils_fp4.py:34-35``, at the same
#: padded sizes). The rows below are written once for them (the first cell); every one of
#: these columns is still run and checked card by card (tests/contract/check_kernel_table.py).
PRE_ADA = ("7.5", "8.0", "8.6", "8.7")
#: The settings a row can be made under: vLLM's default, and the switches the advice names.
#: (the plan's own vocabulary, :data:`selective_offload.plan_format.inputs.MOE_SETTINGS`).
SETTINGS = AUTO, DEEP_GEMM_OFF, TRITON, MARLIN = MOE_SETTINGS
#: A setting vLLM refuses for the method on that card (it raises when the layer is built).
REFUSED = "(vLLM refuses)"

#: Fused-MoE kernels that read expert weights through UVA views (see the table above).
UVA_KERNELS = frozenset({"TritonExperts", "MarlinExperts"})

#: Kernels whose post-processing leaves the expert weights as something other than
#: Parameters of the layer: for OAI triton_kernels (gpt-oss MXFP4 on SM 9.0, and under
#: ``--moe-backend triton``) vLLM assigns triton_kernels tensors as plain attributes and moves
#: the scales into the kernel's precision config (0.33 ``quantization/mxfp4.py:361-371``,
#: ``fused_moe/oracle/mxfp4.py:1444-1472``). Neither vLLM's prefetch offloader nor a UVA view
#: reaches them: they stay on the device, so no layer of theirs can be offloaded.
WRAPPED_KERNELS = frozenset({"OAITritonMxfp4ExpertsMonolithic", "OAITritonExperts", "UnfusedOAITritonExperts"})

#: (method, kernel) pairs whose post-processing needs no device: vLLM 0.33 runs it on host
#: tensors and leaves every byte and stride as loaded. Unquantized on Triton only makes the
#: weights contiguous; block FP8 on Triton has no format conversion
#: (``fused_moe/oracle/fp8.py:588-700`` has no Triton branch) and no requantization (that is
#: per-tensor FP8's, ``quantization/fp8.py:752-761``, through a compiled op). Checked by
#: running 0.33's own ``process_weights_after_loading`` on host tensors
#: (tests/contract/check_kernel_table.py). Any other pair post-processes on the device.
HOST_POST_PROCESSING = frozenset({("unquantized", "TritonExperts"), ("fp8-block", "TritonExperts")})


def post_processes_on_host(method: str | None, kernel: str | None) -> bool:
    """Whether vLLM's post-processing of ``method``'s experts for ``kernel`` runs on the host."""
    return (method, kernel) in HOST_POST_PROCESSING


#: Methods, with what vLLM builds for them (the class whose oracle call the rows follow).
METHODS = {
    "unquantized": "bf16/fp16, UnquantizedFusedMoEMethod (oracle/unquantized.py)",
    "fp8-tensor": "FP8 per-tensor, Fp8MoEMethod (quantization/fp8.py:523, oracle/fp8.py)",
    "fp8-block": "block FP8 128x128, Fp8MoEMethod (quantization/fp8.py:523, oracle/fp8.py)",
    "mxfp4": "gpt-oss MXFP4, GptOssMxfp4MoEMethod (quantization/mxfp4.py:158, oracle/mxfp4.py)",
    "nvfp4": "NVFP4 W4A4, ModelOptNvFp4FusedMoE (quantization/modelopt.py:874, oracle/nvfp4.py)",
    "wna16": "W4A16 group 128 (GPTQ, AWQ, compressed-tensors), CompressedTensorsWNA16MoEMethod "
             "(compressed_tensors_moe_wna16.py:102, oracle/int_wna16.py)",
    "int8": "INT8 W8A8 channel/token, CompressedTensorsW8A8Int8MoEMethod (compressed_tensors_moe_w8a8_int8.py:71, "
            "oracle/int8.py)",
}

_T, _M = "TritonExperts", "MarlinExperts"
#: (method, setting) -> the kernel on the pre-Ada cards (:data:`PRE_ADA`), then on 8.9, 9.0,
#: 10.0 and 12.0; :data:`KERNELS` has one cell per card of :data:`CARDS`.
_ROWS: dict[tuple[str, str], tuple[str, ...]] = {
    ("unquantized", AUTO): (_T, _T, _T, "TrtLlmBf16ExpertsMonolithic", "FlashInferExperts"),
    ("unquantized", DEEP_GEMM_OFF): (_T, _T, _T, "TrtLlmBf16ExpertsMonolithic", "FlashInferExperts"),
    ("unquantized", TRITON): (_T, _T, _T, _T, _T),
    # 'marlin' is quantization-only: an unquantized layer falls through to auto (oracle/unquantized.py:306-309)
    ("unquantized", MARLIN): (_T, _T, _T, "TrtLlmBf16ExpertsMonolithic", "FlashInferExperts"),
    ("fp8-tensor", AUTO): (_M, _T, _T, _T, _T),
    ("fp8-tensor", DEEP_GEMM_OFF): (_M, _T, _T, _T, _T),
    ("fp8-tensor", TRITON): (REFUSED, _T, _T, _T, _T),
    ("fp8-tensor", MARLIN): (_M, _M, _M, _M, _M),
    ("fp8-block", AUTO): (_M, _T, _T, "TrtLlmFp8ExpertsMonolithic", "TritonOrDeepGemmExperts"),
    ("fp8-block", DEEP_GEMM_OFF): (_M, _T, _T, "TrtLlmFp8ExpertsMonolithic", _T),
    ("fp8-block", TRITON): (REFUSED, _T, _T, _T, _T),
    ("fp8-block", MARLIN): (_M, _M, _M, _M, _M),
    ("mxfp4", AUTO): (_M, _M, "OAITritonMxfp4ExpertsMonolithic", "TrtLlmMxfp4ExpertsMonolithic", _M),
    ("mxfp4", DEEP_GEMM_OFF): (_M, _M, "OAITritonMxfp4ExpertsMonolithic", "TrtLlmMxfp4ExpertsMonolithic", _M),
    # 'triton' is OpenAI's triton_kernels for MXFP4 (SM 9.0 and up), not TritonExperts
    ("mxfp4", TRITON): (REFUSED, REFUSED, "OAITritonMxfp4ExpertsMonolithic", "OAITritonMxfp4ExpertsMonolithic",
                        "OAITritonMxfp4ExpertsMonolithic"),
    ("mxfp4", MARLIN): (_M, _M, _M, _M, _M),
    ("nvfp4", AUTO): (_M, _M, "HummingGroupedExperts", "TrtLlmNvFp4ExpertsMonolithic", "FlashInferExperts"),
    ("nvfp4", DEEP_GEMM_OFF): (_M, _M, "HummingGroupedExperts", "TrtLlmNvFp4ExpertsMonolithic", "FlashInferExperts"),
    ("nvfp4", TRITON): (REFUSED,) * 5,
    ("nvfp4", MARLIN): (_M, _M, _M, _M, _M),
    ("wna16", AUTO): (_M, _M, "HummingGroupedExperts", _M, _M),
    ("wna16", DEEP_GEMM_OFF): (_M, _M, "HummingGroupedExperts", _M, _M),
    ("wna16", TRITON): ("TritonWNA16Experts",) * 5,
    ("wna16", MARLIN): (_M, _M, _M, _M, _M),
    ("int8", AUTO): (_T, _T, _T, _T, _T),
    ("int8", DEEP_GEMM_OFF): (_T, _T, _T, _T, _T),
    ("int8", TRITON): (_T, _T, _T, _T, _T),
    ("int8", MARLIN): (REFUSED,) * 5,
}
#: (method, setting) -> the kernel per card, in :data:`CARDS` order.
KERNELS: dict[tuple[str, str], tuple[str, ...]] = {
    key: (row[0],) * len(PRE_ADA) + row[1:] for key, row in _ROWS.items()}

#: (method, kernel) -> the multiples vLLM 0.33 rounds the routed experts' hidden size and
#: intermediate size (per partition; TP=1 here) up to before it allocates them: the quant
#: method's ``maybe_roundup_sizes``, which ``RoutedExperts.__init__`` calls before
#: ``create_weights`` (``fused_moe/routed_experts.py:171-187``, ``:213``). A pair not listed keeps the
#: checkpoint's sizes: the base method rounds only for DeepEP all2all
#: (``fused_moe/fused_moe_method_base.py:70-100`` -> ``fused_moe/all2all_utils.py:148-187``),
#: which TP=1 without expert parallelism never uses, and Fp8MoEMethod, ModelOptNvFp4FusedMoE
#: and the compressed-tensors WNA16 and W8A8-int8 methods do not override it (their block FP8
#: TP padding, ``oracle/fp8.py:324-352``, returns early at one rank). Held to vLLM's own
#: round-up for every row, on gpt-oss's and Qwen3-30B-A3B's shapes, by
#: tests/contract/check_kernel_table.py.
ROUND_UP: dict[tuple[str, str], tuple[int, int]] = {
    # GptOssMxfp4MoEMethod.maybe_roundup_sizes (quantization/mxfp4.py:183-198) ->
    # mxfp4_round_up_hidden_size_and_intermediate_size: Marlin, not on XPU (oracle/mxfp4.py:865-870)
    ("mxfp4", _M): (256, 128),
    # FlashInfer TRT-LLM MXFP4 (TRTLLM_BACKENDS, oracle/mxfp4.py:871-873)
    ("mxfp4", "TrtLlmMxfp4ExpertsMonolithic"): (256, 128),
    # OAI triton_kernels (Mxfp4MoeBackend.TRITON) on CUDA: the last branch (oracle/mxfp4.py:915-916)
    ("mxfp4", "OAITritonMxfp4ExpertsMonolithic"): (1, 64),
    # UnquantizedFusedMoEMethod.maybe_roundup_sizes (unquantized_fused_moe_method.py:131-146) ->
    # FLASHINFER_TRTLLM (oracle/unquantized.py:385-392)
    ("unquantized", "TrtLlmBf16ExpertsMonolithic"): (1, 128),
}


#: Compute capabilities vLLM 0.33's kernel selection can see that the table has no column of
#: its own for (10.3 and 12.1 take their family's, :func:`_table_card`); the contract check
#: runs vLLM's own selection and round-up on them too.
OFF_TABLE_CARDS = ("10.3", "12.1")

#: Methods whose routed experts vLLM 0.33 rounds up by the kernel it picks on any CUDA card,
#: so that on a card the table has no column for the bytes it allocates are not known:
#: MXFP4, whose every backend rounds (``oracle/mxfp4.py:851-916``; on SM 7.5 to 8.x vLLM
#: picks Marlin, ``quantization/utils/marlin_utils_fp4.py:34-35``, as OAI triton_kernels needs
#: SM 9.0, ``fused_moe/experts/gpt_oss_triton_kernels_moe.py:41-53``: 2880 -> 3072 / 2944;
#: those cards are columns of the table, :data:`PRE_ADA`).
#: The others allocate the checkpoint's sizes on such a card: unquantized experts pad only
#: for FlashInfer TRT-LLM (``oracle/unquantized.py:385-392``), which runs on the SM 10.x family
#: alone (``fused_moe/experts/trtllm_bf16_moe.py:95-102``: the table's 10.0 column) and for
#: ROCm's AITER; FP8, NVFP4, WNA16 and INT8 do not round at TP=1 (:data:`ROUND_UP`).
PADS_BY_KERNEL = frozenset({"mxfp4"})


def sizes_known(method: str | None, card: str, setting: str = AUTO) -> bool:
    """Whether the sizes vLLM 0.33 allocates ``method``'s routed experts at on ``card`` are
    known: the table has the card's kernel, or the method pads for no kernel off the table."""
    return kernel_for(method, card, setting) is not None or method not in PADS_BY_KERNEL


def round_up(value: int, multiple: int) -> int:
    """``value`` rounded up to a multiple of ``multiple`` (vLLM's ``utils/math_utils.py:27``)."""
    return -(-value // multiple) * multiple


def allocated_sizes(method: str | None, kernel: str | None, hidden: int, intermediate: int) -> tuple[int, int]:
    """The hidden and intermediate sizes vLLM 0.33 allocates ``method``'s routed experts at
    for ``kernel`` (:data:`ROUND_UP`; the checkpoint's own where the pair pads nothing)."""
    h, i = ROUND_UP.get((method, kernel), (1, 1))
    return round_up(hidden, h), round_up(intermediate, i)


_HUMMING = ("Humming outranks Marlin on SM 9.0 only (quantization/utils/humming/priority.py:11, moved ahead by "
            "prioritize_humming, :26-48); whether it supports the layer needs the humming package (vllm.utils.humming"
            ":120 imports it), which is a CUDA wheel and does not import here. Written down from the source: the "
            "CUDA wheel requires humming-kernels (its METADATA), so Humming's class is what vLLM builds")
#: (method, setting, card) -> why the contract check cannot run that row here.
NOT_RUN: dict[tuple[str, str, str], str] = {
    (m, s, "9.0"): _HUMMING for m in ("wna16", "nvfp4") for s in (AUTO, DEEP_GEMM_OFF)}


@dataclass(frozen=True)
class Pick:
    """What vLLM builds for one experts layer: its kernel, and whether that reads UVA views."""

    method: str | None
    card: str
    setting: str
    kernel: str | None  # None: the method is not in the table

    @property
    def reads_uva(self) -> bool:
        return reads_uva(self.kernel)

    @property
    def moves(self) -> bool:
        """Whether the experts' weights stay Parameters that an offload can move."""
        return self.kernel not in WRAPPED_KERNELS


#: The ``plan`` flag that makes a plan for each setting.
PLAN_FLAGS = {AUTO: "--moe-backend auto", DEEP_GEMM_OFF: "--no-deep-gemm", TRITON: "--moe-backend triton",
              MARLIN: "--moe-backend marlin"}


def card_of(capability: tuple[int, int]) -> str:
    return f"{capability[0]}.{capability[1]}"


def reads_uva(kernel: str | None) -> bool:
    """Whether a fused-MoE kernel class (by name) reads expert weights through UVA views."""
    return kernel in UVA_KERNELS


def _table_card(card: str) -> str | None:
    """The table's column for ``card``: itself, or its family's (12.1 -> 12.0; 10.3 -> 10.0; 8.8 -> none)."""
    if card in CARDS:
        return card
    major = card.split(".")[0]
    family = {"10": "10.0", "12": "12.0"}.get(major)
    return family


def kernel_for(method: str | None, card: str, setting: str = AUTO) -> str | None:
    """The kernel vLLM 0.33 builds for ``method`` on ``card`` under ``setting``; ``None`` when
    the table does not know (an unknown method or card), :data:`REFUSED` where vLLM raises."""
    column = _table_card(card)
    if method is None or column is None or (method, setting) not in KERNELS:
        return None
    return KERNELS[(method, setting)][CARDS.index(column)]


def pick(method: str | None, card: str, setting: str = AUTO) -> Pick:
    return Pick(method, card, setting, kernel_for(method, card, setting))


def advice(method: str | None, card: str) -> str | None:
    """A setting under which vLLM builds a UVA-reading kernel for ``method`` on ``card`` (the
    cheapest first: the DeepGEMM switch touches only block FP8; a backend switch is global)."""
    for setting in (DEEP_GEMM_OFF, TRITON, MARLIN):
        if reads_uva(kernel_for(method, card, setting)):
            return setting
    return None


def quantization_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """A ``config.json``'s ``quantization_config``, at the top or in its ``text_config``
    (``{}``: unquantized)."""
    return config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config") or {}


def method_of_config(config: Mapping[str, Any]) -> str | None:
    """The table's method for a checkpoint's ``config.json`` (its ``quantization_config``),
    or ``None`` for a method the table does not cover (the planner then reads no experts
    through UVA)."""
    qc = quantization_config(config)
    if not qc:
        return "unquantized"
    method = str(qc.get("quant_method", "")).lower().replace("_", "-")
    if method == "fp8":
        return "fp8-block" if qc.get("weight_block_size") else "fp8-tensor"
    if method == "mxfp4":
        return "mxfp4"
    if method in ("modelopt", "modelopt-fp4", "nvfp4"):
        algo = str(qc.get("quant_algo") or (qc.get("quantization") or {}).get("quant_algo") or "").upper()
        return "nvfp4" if algo == "NVFP4" or method != "modelopt" else None
    if method in ("gptq", "gptq-marlin", "awq", "awq-marlin"):
        return "wna16" if qc.get("bits", qc.get("w_bit")) == 4 else None
    if method == "compressed-tensors":
        return _ct_method(qc)
    return None


def _ct_method(qc: Mapping[str, Any]) -> str | None:
    groups = [g for g in (qc.get("config_groups") or {}).values() if isinstance(g, Mapping)]
    if len(groups) != 1:
        return None
    weights, acts = groups[0].get("weights") or {}, groups[0].get("input_activations")
    if weights.get("type") == "int" and weights.get("num_bits") == 4 and not acts:
        return "wna16"
    if weights.get("type") == "int" and weights.get("num_bits") == 8 and acts and acts.get("dynamic"):
        return "int8"
    return None  # FP8 through compressed-tensors allows vLLM's CUTLASS kernels: not in the table


def method_of_vllm(method: Any) -> str | None:
    """The table's method for a vLLM quant method object (the glue's side)."""
    name = type(method).__name__
    if name == "UnquantizedFusedMoEMethod":
        return "unquantized"
    if name == "Fp8MoEMethod":
        return "fp8-block" if getattr(method, "block_quant", False) else "fp8-tensor"
    return {"GptOssMxfp4MoEMethod": "mxfp4", "ModelOptNvFp4FusedMoE": "nvfp4",
            "CompressedTensorsWNA16MoEMethod": "wna16", "GPTQMarlinMoEMethod": "wna16", "AWQMarlinMoEMethod": "wna16",
            "AutoGPTQMoEMethod": "wna16", "AutoAWQMoEMethod": "wna16",
            "CompressedTensorsW8A8Int8MoEMethod": "int8"}.get(name)


#: What a global backend switch costs the layers that stay on the device: not priced.
SWITCH_UNPRICED = ("unpriced: no published speed ratio between these fused-MoE kernels is at hand; vLLM's oracle "
                   "only orders them (it prefers Triton to FlashInfer on SM 9.0, oracle/unquantized.py:76-80, and "
                   "Marlin to triton_kernels for MXFP4 on SM 12.x, oracle/mxfp4.py:426-433)")


def switch_note(method: str, card: str, setting: str) -> str:
    """What ``setting`` costs the device-resident experts layers (it is global)."""
    before, after = kernel_for(method, card), kernel_for(method, card, setting)
    if before == after:
        return f"{setting} leaves the device-resident experts layers on {before}: no cost"
    scope = "block-FP8 MoE layers" if setting == DEEP_GEMM_OFF else "every MoE layer"
    return (f"{setting} is global: {scope}, the device-resident ones too, move from {before} to {after}; "
            f"what that costs them is {SWITCH_UNPRICED}")


def readme_block() -> str:
    """The README's kernel table, generated from :data:`KERNELS` (tests/tools checks the README holds it)."""
    lines = ["| method | " + " | ".join(f"SM {c}" for c in CARDS) + " |", "|---|" + "---|" * len(CARDS)]
    for method in METHODS:
        cells = []
        for card in CARDS:
            kernel = kernel_for(method, card)
            cell = f"{_short(kernel)} ({'uva' if reads_uva(kernel) else 'not uva'})"
            if not reads_uva(kernel) and (fix := advice(method, card)):
                cell += f"; `{fix}`: {_short(kernel_for(method, card, fix))}"
            cells.append(cell)
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _short(kernel: str | None) -> str:
    if kernel is None:
        return "unknown"
    return kernel.removesuffix("Monolithic").removesuffix("Experts") or kernel


def kernel_notes(kernel: Pick, assumed: bool) -> list[str]:
    """The plan's notes on the card it was made for and the experts' kernel."""
    card = (f"card: compute capability {kernel.card}" + (
        f" (assumed: none was given; {DEFAULT_CARD} is the reference laptop's class; give "
        "--compute-capability, as torch.cuda.get_device_capability spells it)" if assumed else ""))
    if kernel.kernel is None:
        what = ("the quantization method is not in the kernel table" if kernel.method is None
                else f"compute capability {kernel.card} is not in the kernel table")
        return [card, f"routed experts: {what}, so the fused-MoE kernel vLLM 0.33 picks is not known, and none are "
                      "planned to be read in place through UVA (prefetch copies or resident instead)"]
    under = f" under {kernel.setting}" if kernel.setting != AUTO else ""
    line = f"routed experts: vLLM 0.33 picks {kernel.kernel} for {kernel.method} on SM {kernel.card}{under}"
    if kernel.reads_uva:
        cost = f" (start vLLM with {kernel.setting}; {switch_note(kernel.method, kernel.card, kernel.setting)})" \
            if under else ""
        return [card, line + ", which reads them in place through UVA views" + cost]
    fix = advice(kernel.method, kernel.card)
    why = (line + ", which is not known to read UVA views, so none are planned served uva (the glue would refuse "
           "them): prefetch copies or resident instead")
    if not kernel.moves:
        why = (line + ", which is not known to read UVA views and whose weights become triton_kernels tensors, "
               "not Parameters (vLLM 0.33 "
               "quantization/mxfp4.py:361-371): neither a prefetch copy nor a UVA view moves them, so every layer "
               "with routed experts stays resident")
    if fix:
        why += (f"; with {fix} vLLM picks {kernel_for(kernel.method, kernel.card, fix)}, which does: make the plan "
                f"with `plan {PLAN_FLAGS[fix]}` and start vLLM so ({switch_note(kernel.method, kernel.card, fix)})")
    return [card, why]


#: The lines around the generated block in the README.
README_BEGIN = "<!-- kernel table: generated by selective_offload.planner.kernels.readme_block -->"
README_END = "<!-- end of kernel table -->"


def readme_with_block(text: str) -> str:
    """``text`` (the README) with its kernel table replaced by :func:`readme_block`'s."""
    start, end = text.index(README_BEGIN), text.index(README_END)
    return text[:start] + README_BEGIN + "\n" + readme_block() + text[end:]
