"""The plan's checkpoint names as the model vLLM builds names them, from the model class.

Plans speak checkpoint names (``plan`` reads them from the safetensors headers); vLLM's
model classes may name modules otherwise: gpt-oss builds the checkpoint's
``model.embed_tokens`` as ``model.embedding`` and ``self_attn`` as ``attn``. Each class says
how in its ``hf_to_vllm_mapper`` (a ``WeightsMapper`` its ``load_weights`` applies to every
checkpoint tensor name), read here from the class before the model is built, so that
routing at construction, the host embedding, the experts and the report all use one
translation (:class:`names.ModelNames`). vLLM's rename-only variant of the mapper is used
(``get_rename_mapper``: what "consumers that name modules rather than load them need", in
its words): stacked parameters (q/k/v into ``qkv_proj``, the ``packed_modules_mapping``)
rename leaves inside a module, never a plan group, and a weight vLLM skips still names its
module. A rename a class makes in ``load_weights`` outside its mapper shows after
construction: a plan group whose name in the model names no module there is refused
(:func:`refuse_unnamed`), before any weight loads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from torch import nn

from ..checkpoint import load_checkpoint
from ..errors import PlanError
from ..names import ModelNames, NameMap, layer_of, model_names, unnamed_groups
from ..plan_format import LAYER_KINDS, Plan, Serving

#: Tensor names tried for each group when the checkpoint is not a local directory (its
#: headers cannot be read here): the leaves most modules have.
PROBE_LEAVES = ("weight", "bias")


def class_mapping(model_cls: type) -> tuple[NameMap | None, str]:
    """The model class's own tensor-name mapping, and where it came from."""
    mapper = getattr(model_cls, "hf_to_vllm_mapper", None)
    source = f"vLLM's {model_cls.__name__}"
    if mapper is None or not callable(getattr(mapper, "map_name", None)):
        return None, source
    renames = mapper.get_rename_mapper() if callable(getattr(mapper, "get_rename_mapper", None)) else mapper
    return renames.map_name, f"{source} (its hf_to_vllm_mapper)"


def names_for(plan: Plan, model_config) -> tuple[ModelNames, list[str]]:
    """The plan's groups as the model vLLM is about to build names them, and notes."""
    from vllm.model_executor.model_loader.utils import get_model_architecture

    model_cls, _ = get_model_architecture(model_config)
    mapping, source = class_mapping(model_cls)
    groups = [g.group for g in plan.groups]
    notes = []
    model_dir = Path(str(model_config.model))
    if mapping is None:
        tensors: list[str] = []
    elif model_dir.is_dir():
        tensors = list(load_checkpoint(model_dir).tensors)
    else:
        tensors = [f"{g}.{leaf}" for g in groups for leaf in PROBE_LEAVES]
        notes.append(f"{model_dir} is not a local directory: {source} was applied to the plan's group names with "
                     f"the leaves {', '.join(PROBE_LEAVES)}, not to the checkpoint's tensor names")
    names = model_names(groups, tensors, mapping, plan.inputs.cold_segments, source)
    line = names.describe()
    return names, notes + ([line] if line else [])


def first_names(model: nn.Module) -> Callable[[str], str]:
    """A module name of ``model`` with any decoder layer on its path read by the layer's
    first name: vLLM's Gemma 4 registers its decoder layers again, for its YOCO split, under
    ``model.self_decoder.decoder_layers.N``, the same modules as ``model.layers.N``, not
    copies sharing their parameters. The name kept is the one in the layer stack
    (``...layers.N``), not the first registered, whose index may be another. Only whole
    decoder layers are read so: a smaller module held in two places (a cached rotary
    table) stays shared."""
    names: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        names.setdefault(id(module), []).append(name)
    aliases: dict[str, str] = {}
    for held in names.values():
        # the name in the layer stack (``...layers.N``), whichever vLLM registered first
        layer = next((n for n in held if (at := layer_of(n)) is not None and n == f"{at[0]}.{at[1]}"), None)
        if layer is not None:
            aliases.update((n, layer) for n in held if n != layer)

    def name_of(name: str) -> str:
        parts = name.split(".")
        for n in range(len(parts), 0, -1):
            head = ".".join(parts[:n])
            if head in aliases:
                return ".".join([aliases[head], *parts[n:]])
        return name

    return name_of


def refuse_unnamed(model: nn.Module, names: ModelNames, plan: Plan) -> None:
    """Refuse, with one line, a plan group outside the decoder layers whose name in the
    model names no module of the model just built (layers and routed experts are found by
    their index; MTP heads by the drafter; groups planned absent are not loaded)."""
    wanted = [g.group for g in plan.groups if g.kind not in LAYER_KINDS and not g.mtp and g.bytes
              and g.serving != Serving.NONE]
    modules = [n for n, _ in model.named_modules(remove_duplicate=False)]
    modules += [n.rsplit(".", 1)[0] for n, _ in model.named_parameters(remove_duplicate=False) if "." in n]
    missing = unnamed_groups(names, wanted, modules, plan.inputs.cold_segments)
    if missing:
        g = missing[0]
        raise PlanError(f"{names.source or 'vLLM'} builds no module for the plan's {g} (looked for "
                        f"{names.model_name(g)}): this model class renames it in a way its hf_to_vllm_mapper does "
                        "not say, so selective-offload cannot map its names; run it without a plan")
