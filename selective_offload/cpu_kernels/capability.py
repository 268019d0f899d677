"""What the host kernels compute, for each kind of layer: the one rule the planner reads
from a checkpoint's config before it serves a group ``compute``, and the worker checks on
the layer vLLM built before it installs the host path (``vllm_glue.host_compute`` and
``host_mlp``). Both describe the layer as a :class:`HostLayer` and ask :func:`refusal`, so
a plan never computes on the host what the worker would refuse.

What a layer computes (vLLM 0.33's names; the kernel's in :data:`.weights.KINDS`):

===============  ===================================  ==========================================
layer            computed on the host                 refused, with the reason
===============  ===================================  ==========================================
routed experts   gated silu, gelu_tanh (Gemma 4),     gelu (erf), situ, swiglustep,
                 swigluoai (gpt-oss; clamp and        swigluoai_uninterleave, ungated
                 alpha read from the layer); biases;  (``*_no_mul``, relu2); silu clamped at a
                 the router weight on the output, or  ``swiglu_limit``; the router weight on the
                 on the input at top-1 (Llama-4)      input at top-k > 1
dense MLP        gated silu / swish, gelu_pytorch_    gelu and geglu (erf), any other; biases;
                 tanh (Gemma 2, 3, 4); no biases      an MLP without gate and up projections
===============  ===================================  ==========================================

The router weight on the input (vLLM's ``apply_router_weight_on_input``, which it allows
at top-1 only) is applied by the worker as vLLM's own prepare step applies it: the tokens
scaled by their weight in their dtype, the experts' sum taken with weight 1.

From a config (:func:`experts_of_config`, :func:`mlp_of_config`): routed experts are
silu-gated unless their model sets otherwise in vLLM 0.33's model code
(:data:`EXPERT_ACTIVATION_OF_MODEL`; ``FusedMoE``'s default is silu); a dense MLP's
activation is the config's ``hidden_activation`` (Gemma) or ``hidden_act``.
No vLLM import: the worker reads its layer's attributes itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from .weights import Activation

EXPERTS, MLP = "experts", "mlp"

#: vLLM's activation names -> the kernel's, by layer kind (experts: ``MoEActivation``'s
#: values; MLPs: vLLM's act-and-mul registry names, which the configs use).
COMPUTED = {
    EXPERTS: {"silu": "silu", "swigluoai": "swigluoai", "gelu_tanh": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"},
    MLP: {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"},
}
#: Activations vLLM 0.33 builds that no host kernel computes, with what they are.
NOT_COMPUTED = {
    "gelu": "GELU with erf (the kernels compute its tanh approximation)",
    "geglu": "GELU with erf (the kernels compute its tanh approximation)",
    "situ": "SiTU", "swiglustep": "SwiGLU-step", "swigluoai_uninterleave": "SwiGLU-OAI on packed gate and up rows",
    "relu2": "squared ReLU, ungated",
}

#: Routed experts' activation where vLLM 0.33's model code sets it apart from ``FusedMoE``'s
#: silu, by config ``model_type`` (``gemma4.py``, ``gpt_oss.py``, ``moondream3.py``,
#: ``step3p5.py`` (some layers), ``nemotron_h.py`` (``mlp_hidden_act``, ungated)); a string
#: starting with ``config.`` names the config key vLLM reads it from.
EXPERT_ACTIVATION_OF_MODEL = {
    "gpt_oss": "swigluoai", "gemma4": "gelu_tanh", "gemma4_text": "gelu_tanh", "moondream3": "gelu",
    "step3p5": "swiglustep", "nemotron_h": "relu2_no_mul", "jamba": "config.hidden_act",
}
#: Models whose routed experts vLLM 0.33 builds with the router weight applied to the input
#: (``llama4.py``: always; ``laguna.py``: as its config says).
ROUTER_ON_INPUT_OF_MODEL = {"llama4": True, "llama4_text": True, "laguna": "config.moe_apply_router_weight_on_input"}
#: Config keys of per-layer clamps vLLM 0.33 puts on silu experts (``exaone_moe.py``,
#: ``bailing_moe_v3.py``): a positive value clamps that layer.
CLAMP_KEYS = ("swiglu_limits", "expert_swiglu_limit_list")


@dataclass(frozen=True)
class HostLayer:
    """One layer as the host would compute it: ``kind`` (:data:`EXPERTS` or :data:`MLP`),
    its ``activation`` by vLLM's name, the router weight applied to the input (experts) and
    the top-k it is routed with (None: unknown), a clamp on a silu gate (``swiglu_limit``),
    biases (MLP projections) and whether it has gate and up projections."""

    kind: str
    activation: str
    router_weight_on_input: bool = False
    experts_per_token: int | None = None
    clamp_limit: float | None = None
    bias: bool = False
    gated: bool = True


def refusal(layer: HostLayer) -> str | None:
    """None when the host kernels compute ``layer``, else why not (a phrase that follows
    "the CPU kernels do not compute this layer: ")."""
    act = str(layer.activation).lower()
    if not layer.gated:
        return "its MLP has no gate and up projections (the kernels compute gated MLPs)"
    if act not in COMPUTED[layer.kind]:
        what = f"{act.removesuffix('_no_mul')}, ungated" if act.endswith("_no_mul") else NOT_COMPUTED.get(act)
        said = f" ({what})" if what else ""
        return f"its activation is {act}{said}; they compute {', '.join(sorted(set(COMPUTED[layer.kind])))}"
    if layer.clamp_limit is not None and COMPUTED[layer.kind][act] != "swigluoai":
        return f"vLLM clamps its {act} gate and up at {layer.clamp_limit:g} (swiglu_limit), which the kernels do not"
    if layer.router_weight_on_input and layer.experts_per_token != 1:
        return (f"vLLM applies its router weight to the input, which is defined for one expert per token, and it "
                f"routes {layer.experts_per_token or 'an unknown number of'} experts per token")
    if layer.bias and layer.kind == MLP:
        return "its projections have biases, which the host MLP does not add"
    return None


def kernel_activation(layer: HostLayer, alpha: float | None = None, limit: float | None = None) -> Activation:
    """The kernel's :class:`.weights.Activation` for a layer :func:`refusal` accepts
    (swigluoai's ``alpha`` and ``limit`` as the layer holds them; None: gpt-oss's)."""
    kind = COMPUTED[layer.kind][str(layer.activation).lower()]
    if kind == "swigluoai":
        return Activation(kind, alpha=1.702 if alpha is None else float(alpha),
                          limit=7.0 if limit is None else float(limit))
    return Activation(kind)


def _model_types(config: Mapping[str, Any]) -> list[str]:
    text = config.get("text_config") if isinstance(config.get("text_config"), Mapping) else {}
    return [str(t) for t in (text.get("model_type"), config.get("model_type")) if t]


def _key(config: Mapping[str, Any], key: str) -> Any:
    """``key`` from the language model's config (``text_config``) first, then the top level."""
    text = config.get("text_config") if isinstance(config.get("text_config"), Mapping) else {}
    return text.get(key) if text.get(key) is not None else config.get(key)


def _of_model(table: Mapping[str, Any], config: Mapping[str, Any], default: Any) -> Any:
    for model_type in _model_types(config):
        if model_type in table:
            value = table[model_type]
            if isinstance(value, str) and value.startswith("config."):
                found = _key(config, value.removeprefix("config."))
                return default if found is None else found
            return value
    return default


def experts_of_config(config: Mapping[str, Any], experts_per_token: int | None) -> HostLayer:
    """A model's routed experts as vLLM 0.33 builds them, from its ``config.json``."""
    limits = [_key(config, k) for k in CLAMP_KEYS]
    clamps = [float(v) for lim in limits if isinstance(lim, list) for v in lim if isinstance(v, (int, float)) and v > 0]
    return HostLayer(EXPERTS, str(_of_model(EXPERT_ACTIVATION_OF_MODEL, config, "silu")),
                     router_weight_on_input=bool(_of_model(ROUTER_ON_INPUT_OF_MODEL, config, False)),
                     experts_per_token=experts_per_token, clamp_limit=min(clamps) if clamps else None)


def mlp_of_config(config: Mapping[str, Any], tensor_names: Iterable[str] = ()) -> HostLayer:
    """A model's dense MLPs, from its ``config.json`` (``hidden_activation``, else
    ``hidden_act``; unstated: silu, transformers' default for the Llama-style families;
    ``mlp_bias``) and, when given, its MLP tensors' names (gate and up projections, or
    Phi-3's fused ``gate_up_proj``: gated)."""
    act = _key(config, "hidden_activation") or _key(config, "hidden_act") or "silu"
    leaves = {n.split(".")[-2] for n in tensor_names if n.count(".") >= 1}
    gated = not leaves or "gate_up_proj" in leaves or {"gate_proj", "up_proj"} <= leaves
    return HostLayer(MLP, str(act), bias=bool(_key(config, "mlp_bias")), gated=gated)
