"""vLLM's prefetch offloader, offloading exactly the decoder layers the plan names.

vLLM's ``PrefetchOffloader`` chooses "the last ``num_in_group`` of every ``group_size``
layers"; the planner chooses exact indices. Rather than copy its machinery (static buffer
pool, copy stream, CUDA-graph-safe waits), this subclass builds it with
``group_size=1, num_in_group=1`` - "offload every layer you are given" - and gives it only
the planned layers, streaming them from ``make_layers``'s generator so each layer is
moved to the host as soon as it is built, exactly as the parent does (building all layers
first would put the whole stack on the device at once).

Which ``make_layers`` call is the plan's stack. ``make_layers`` hands ``wrap_modules`` a
generator of this pipeline rank's layers only (``start_layer`` to ``end_layer`` of the
stack, numbered from 0 here) and no name. Models build other stacks with it too, and
sometimes first: a Whisper-style encoder, an audio tower's encoder. So the offloader reads
``make_layers``'s own ``prefix``, ``start_layer`` and ``end_layer`` from its frame: a stack
whose name (without ``model``/``language_model`` wrappers) is not the plan's is left
resident, and the plan's global layer indices are mapped to this rank's local ones.

``wrap_modules`` may be called again (a speculative drafter's layers, another stack):
those layers stay resident; the plan counts MTP layers as resident. A call from outside
``make_layers`` (Ultravox builds its Whisper tower's layers so, before the language model)
is never taken as the plan's stack: its layers stay resident, and a plan whose stack was
never wrapped is reported.

Page-locked at exact size. The parent pins each hot parameter through torch's caching
host allocator when the layer is built (a block rounded up to a power of two); vLLM's
post-processing round trip would make a second pinned copy, and ``post_init`` drops the
first into torch's cache, which keeps it locked: about three times the hot bytes. Here
each built layer's host copy becomes an exact-size pageable tensor at once (the pinned
block goes back to torch's cache, released), the glue keeps post-processing off the
device (``host_resident.keep_on_host``), and ``post_init`` page-locks each layer's final
storage, packed into one arena with one registration (``cudaHostRegister``: ``is_pinned()``
is then true, so the parent keeps it rather than copying), releases torch's cached pinned
blocks, and only then lets the glue judge page-locked memory.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch
from torch import nn

from ..log import logger
from ..names import WRAPPER_SEGMENTS
from .host_resident import to_host_exact


def select_layers(modules: Iterable[nn.Module], indices: Iterable[int], sink: list) -> Iterator[nn.Module]:
    """Yield the modules at ``indices`` while collecting every module into ``sink``."""
    wanted = set(indices)
    for i, module in enumerate(modules):
        sink.append(module)
        if i in wanted:
            yield module


def local_indices(global_indices: Iterable[int], start: int, end: int) -> list[int]:
    """The plan's global layer indices that live on the rank holding ``[start, end)``,
    numbered from 0 as ``make_layers`` hands them over."""
    return sorted(i - start for i in set(global_indices) if start <= i < end)


def stack_name(prefix: str) -> str:
    """A layer stack's name without the wrappers vLLM adds or drops (``language_model``)."""
    return ".".join(p for p in prefix.split(".") if p and p not in WRAPPER_SEGMENTS)


@dataclass(frozen=True)
class StackCall:
    """What ``make_layers`` says about the stack it is building."""

    prefix: str | None
    start: int
    end: int


def caller_stack(depth: int = 2) -> StackCall | None:
    """Read ``make_layers``'s ``prefix``/``start_layer``/``end_layer`` from the calling frame."""
    frame = sys._getframe(depth)
    for _ in range(4):
        if frame is None:
            return None
        local = frame.f_locals
        if frame.f_code.co_name == "make_layers" and "start_layer" in local and "end_layer" in local:
            prefix = local.get("prefix")
            return StackCall(prefix if isinstance(prefix, str) else None,
                             int(local["start_layer"]), int(local["end_layer"]))
        frame = frame.f_back
    return None


def release_cached_pinned() -> None:
    """Give torch's cached pinned host blocks back to the system (freed blocks stay locked
    in its cache otherwise). ``torch.accelerator.empty_host_cache`` where torch has it,
    else the CUDA build's ``torch._C._host_emptyCache``."""
    empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
    if empty is None:
        empty = getattr(torch._C, "_host_emptyCache", None)
    if empty is not None and torch.cuda.is_available():
        empty()


def _param_offloaders(module_offloaders) -> list:
    return [po for mo in module_offloaders for po in getattr(mo, "_param_offloaders", {}).values()]


def exact_host_storage(param_offloaders) -> None:
    """Each parameter's host copy as an exact-size pageable tensor (the parent's pinned,
    rounded block is dropped); the parameter and the offloader's copy stay one tensor."""
    for po in param_offloaders:
        cpu = getattr(po, "_cpu_storage", None)
        if cpu is None or cpu.device.type != "cpu":
            continue
        exact = to_host_exact(cpu)
        po._cpu_storage = exact
        try:
            param = po._param
        except AttributeError:
            continue
        if param.data.device.type == "cpu":
            param.data = exact


def lock_final_storage(param_offloaders, page_locked, purpose: str = "hot layers") -> list[torch.Tensor]:
    """Page-lock one layer's host parameters as post-processing left them: packed into one
    arena, one registration (``PageLockedLedger.lock_together``: exact size, no page
    shared), which also drops any copy torch pinned on the way. The offloader's copies
    point at the arena. Returns the layer's host tensors."""
    params = []
    for po in param_offloaders:
        try:
            param = po._param
        except AttributeError:  # deleted by post-processing (k_scale / v_scale)
            continue
        if param.data.device.type == "cpu":
            params.append((po, param))
    if not params:
        return []
    if not all(page_locked.is_locked(p.data) for _, p in params):
        page_locked.lock_together([p for _, p in params], purpose)
    for po, p in params:
        po._cpu_storage = p.data
    return [p.data for _, p in params]


def make_exact_prefetch_offloader(prefetch_base: type, layer_indices: list[int], prefetch_step: int,
                                  stack_prefix: str, num_layers: int | None, page_locked=None,
                                  on_post_init=None):
    """Build the offloader; ``prefetch_base`` is vLLM's ``PrefetchOffloader`` (needs CUDA).

    ``stack_prefix`` is the plan's layer stack (``model.layers``); ``layer_indices`` are
    global indices into it (``num_layers``, the stack's length, is kept for the caller). ``page_locked`` (a
    :class:`~selective_offload.wrappers.page_locked.PageLockedLedger`) locks the hot
    layers at exact size; ``on_post_init`` runs after ``post_init`` (the glue's verdict).
    """

    class ExactLayerPrefetchOffloader(prefetch_base):
        def __init__(self) -> None:
            super().__init__(group_size=1, num_in_group=1, prefetch_step=prefetch_step,
                             offload_params=None, mode="cpu")
            self.layer_indices = sorted(set(layer_indices))
            self.offloaded_modules: list[nn.Module] = []
            self.local_indices: list[int] = []
            self._wrapped: str | None = None

        def wrap_modules(self, modules_generator, prefix: str = ""):
            call = caller_stack()
            if self._wrapped is not None or not self._is_plan_stack(call):
                logger.info("selective-offload: the layers of %s stay resident (hot layers come from %s)",
                            (call and call.prefix) or prefix or "another stack", self._wrapped or stack_prefix)
                return list(modules_generator)
            self._wrapped = call.prefix or prefix or stack_prefix
            self.local_indices = local_indices(self.layer_indices, call.start, call.end)
            every: list[nn.Module] = []
            super().wrap_modules(self._exact_as_built(select_layers(modules_generator, self.local_indices, every)),
                                 prefix)
            self.offloaded_modules = [every[i] for i in self.local_indices]
            return every

        def _exact_as_built(self, layers: Iterator[nn.Module]) -> Iterator[nn.Module]:
            """After the parent pins each layer (when the generator resumes), its host copy
            becomes exact-size pageable memory and torch's cached block is released: one
            layer's rounded block at a time, never the stack's."""
            if page_locked is None or not page_locked.policy.locks:
                yield from layers
                return
            for layer in layers:
                before = len(self.module_offloaders)
                yield layer
                exact_host_storage(_param_offloaders(self.module_offloaders[before:]))
                release_cached_pinned()

        def post_init(self):
            if page_locked is not None and page_locked.policy.locks:
                for mo in self.module_offloaders:
                    tensors = lock_final_storage(_param_offloaders([mo]), page_locked)
                    if tensors and getattr(mo, "module", None) is not None:
                        page_locked.release_with(mo.module, tensors)
            super().post_init()
            release_cached_pinned()
            if on_post_init is not None:
                on_post_init()

        @staticmethod
        def _is_plan_stack(call: StackCall | None) -> bool:
            if call is None:
                return False  # not make_layers: another stack (Ultravox's Whisper tower)
            if call.prefix is None:
                return True  # judged by the layer count once built
            return stack_name(call.prefix) == stack_name(stack_prefix)

    return ExactLayerPrefetchOffloader()
