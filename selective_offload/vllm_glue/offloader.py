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
resident, and the plan's global layer indices are mapped to this rank's local ones. When
the frame cannot be read (another caller), the stack must have the plan's layer count.

``wrap_modules`` may be called again (a speculative drafter's layers, another stack):
those layers stay resident; the plan counts MTP layers as resident.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import Iterable, Iterator

from torch import nn

from ..errors import PlanError
from ..names import WRAPPER_SEGMENTS

logger = logging.getLogger("selective_offload")


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


def make_exact_prefetch_offloader(prefetch_base: type, layer_indices: list[int], prefetch_step: int,
                                  stack_prefix: str, num_layers: int | None):
    """Build the offloader; ``prefetch_base`` is vLLM's ``PrefetchOffloader`` (needs CUDA).

    ``stack_prefix`` is the plan's layer stack (``model.layers``) and ``num_layers`` its
    length; ``layer_indices`` are global indices into it.
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
            self._wrapped = (call and call.prefix) or prefix or stack_prefix
            start, end = (call.start, call.end) if call else (0, num_layers or 0)
            self.local_indices = local_indices(self.layer_indices, start, end) if call else self.layer_indices
            every: list[nn.Module] = []
            super().wrap_modules(select_layers(modules_generator, self.local_indices, every), prefix)
            if call is None and num_layers is not None and len(every) != num_layers:
                raise PlanError(f"the plan's stack {stack_prefix} has {num_layers} layers but the one vLLM "
                                 f"built has {len(every)}; make the plan again for this model")
            self.offloaded_modules = [every[i] for i in self.local_indices]
            return every

        @staticmethod
        def _is_plan_stack(call: StackCall | None) -> bool:
            if call is None or call.prefix is None:
                return True  # judged by the layer count once built
            return stack_name(call.prefix) == stack_name(stack_prefix)

    return ExactLayerPrefetchOffloader()
