"""The host-resident embedding inside vLLM: a host row gather, or a UVA device view.

``VocabParallelEmbedding.forward`` stays vLLM's: it maps ids to this rank's shard and
masks the rows of other shards; only the inner lookup (``quant_method.embedding``) is
replaced. One of vLLM's paths skips that lookup: with tensor parallelism on CUDA,
``use_fused_embedding`` sends the ids and the weight to a fused CUDA kernel that masks
and gathers in one pass and allocates its output on the weight's device (the host, here).
Host-resident embeddings are switched to the masked path (the attribute is read at call
time), which hands the lookup shard-local ids.

``auto`` picks the UVA view when CUDA graphs are captured (a host gather is host work and
cannot be in a graph), and the host gather otherwise (fewest bytes over the link).
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any

import torch
from torch import nn

from ..options import RunOptions
from ..wrappers import HostGather
from ..wrappers.layout import host_copy_like
from ..wrappers.page_locked import PageLockedLedger
from ..wrappers.residency import OffloadError

#: The gathers behind the custom op, by handle (the op takes an int, not an object). Held
#: weakly: each embedding layer holds its own gather, so its staging buffer lives exactly
#: as long as the model.
_gathers: "weakref.WeakValueDictionary[int, HostGather]" = weakref.WeakValueDictionary()
_handles = itertools.count()


@torch.library.custom_op("selective_offload::host_gather", mutates_args=())
def _host_gather_op(ids: torch.Tensor, weight: torch.Tensor, handle: int) -> torch.Tensor:
    """Opaque to torch.compile: the gather's host work and staging buffer stay out of graphs."""
    return _gathers[handle](weight, ids)


@_host_gather_op.register_fake
def _(ids: torch.Tensor, weight: torch.Tensor, handle: int) -> torch.Tensor:
    return ids.new_empty((*ids.shape, weight.shape[-1]), dtype=weight.dtype)


def graphs_captured(vllm_config) -> bool:
    """Whether vLLM will capture CUDA graphs of the model (the mode in force, not the
    flag the user set: vLLM resolves ``enforce_eager`` into the compilation config)."""
    mode = getattr(getattr(vllm_config, "compilation_config", None), "cudagraph_mode", None)
    if mode is None:
        return not bool(getattr(vllm_config.model_config, "enforce_eager", False))
    return getattr(mode, "name", str(mode)).upper() != "NONE"


def embedding_mode(options: RunOptions, device: torch.device, vllm_config) -> str:
    if options.embedding_mode != "auto":
        return options.embedding_mode
    return "uva" if device.type == "cuda" and graphs_captured(vllm_config) else "host"


def install_host_embedding(layer: nn.Module, device: torch.device, mode: str, accelerator_view,
                           page_locked: PageLockedLedger | None = None, name: str = "embedding") -> tuple[Any, str]:
    """Make ``layer`` (a ``VocabParallelEmbedding``) read its rows from host memory.

    The table is page-locked in place at its exact size when ``page_locked``'s policy
    locks (never copied to be pinned). Returns the object whose counters the report shows
    (the gather, or the weight for a UVA view) and a one-line description of the mechanism.
    """
    weight = layer.weight
    if weight.device.type != "cpu":
        weight.data = host_copy_like(weight.data)
    locked = page_locked.lock(weight.data, name) if page_locked is not None else False
    fused = bool(getattr(layer, "use_fused_embedding", False))
    if hasattr(layer, "use_fused_embedding"):
        layer.use_fused_embedding = False  # read by forward at call time: the masked path
    suffix = "; vLLM's fused TP lookup turned off" if fused else ""
    if mode == "uva":
        # The weight itself becomes a device view of pinned host memory: vLLM's own lookup
        # (F.embedding) then reads the rows over the link, inside CUDA graphs too.
        host = weight.data if locked or weight.data.is_pinned() else weight.data.pin_memory()
        pinned = page_locked.pinned(host) if page_locked is not None else host.is_pinned()
        if not pinned:
            # vLLM's view op would silently make a private, full-size copy of the table.
            raise OffloadError(f"{name}: the driver does not report the table as page-locked after "
                               "registration, so a UVA view would copy it; use the host gather "
                               "(SELECTIVE_OFFLOAD_EMBEDDING=host with enforce_eager)")
        weight.data = accelerator_view(host)
        weight._selective_offload_uva = True
        return weight, "UVA view (the gather kernel reads rows over the link)" + suffix
    gather = HostGather(device, page_locked=page_locked,
                        pin=page_locked.policy.locks if page_locked is not None else None)
    handle = next(_handles)
    _gathers[handle] = gather
    layer._selective_offload_gather = gather  # the layer owns its gather and staging buffer

    def embedding(layer_: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return torch.ops.selective_offload.host_gather(ids, layer_.weight, handle)

    # An instance attribute shadows UnquantizedEmbeddingMethod.embedding: the vocab-parallel
    # masking in VocabParallelEmbedding.forward stays vLLM's.
    layer.quant_method.embedding = embedding
    return gather, "host gather (one row per token crosses the link)" + suffix
