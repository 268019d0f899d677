"""vLLM's prefetch offloader, offloading exactly the decoder layers the plan names.

vLLM's ``PrefetchOffloader`` chooses "the last ``num_in_group`` of every ``group_size``
layers"; the planner chooses exact indices. Rather than copy its machinery (static buffer
pool, copy stream, CUDA-graph-safe waits), this subclass builds it with
``group_size=1, num_in_group=1`` - "offload every layer you are given" - and gives it only
the planned layers, streaming them from ``make_layers``'s generator so each layer is
moved to the host as soon as it is built, exactly as the parent does (building all layers
first would put the whole stack on the device at once).

``wrap_modules`` may be called again when a speculative drafter (an MTP head) builds its
own layers with ``make_layers``; the parent asserts it is called once. Here a second call
leaves the drafter's layers where they are and logs it: the plan counts MTP layers as
resident.
"""

from __future__ import annotations

import logging
from typing import Iterable, Iterator

from torch import nn

logger = logging.getLogger("selective_offload")


def select_layers(modules: Iterable[nn.Module], indices: Iterable[int], sink: list) -> Iterator[nn.Module]:
    """Yield the modules at ``indices`` while collecting every module into ``sink``."""
    wanted = set(indices)
    for i, module in enumerate(modules):
        sink.append(module)
        if i in wanted:
            yield module


def make_exact_prefetch_offloader(prefetch_base: type, layer_indices: list[int], prefetch_step: int):
    """Build the offloader; ``prefetch_base`` is vLLM's ``PrefetchOffloader`` (needs CUDA)."""

    class ExactLayerPrefetchOffloader(prefetch_base):
        def __init__(self) -> None:
            super().__init__(group_size=1, num_in_group=1, prefetch_step=prefetch_step,
                             offload_params=None, mode="cpu")
            self.layer_indices = sorted(set(layer_indices))
            self.offloaded_modules: list[nn.Module] = []
            self._wrapped_prefixes: list[str] = []

        def wrap_modules(self, modules_generator, prefix: str = ""):
            if self._wrapped_prefixes:
                logger.info("selective-offload: %s layers stay resident (hot layers were taken "
                            "from %s)", prefix or "second layer stack", self._wrapped_prefixes[0])
                return list(modules_generator)
            self._wrapped_prefixes.append(prefix)
            every: list[nn.Module] = []
            super().wrap_modules(select_layers(modules_generator, self.layer_indices, every), prefix)
            if self.layer_indices and self.layer_indices[-1] >= len(every):
                raise ValueError(
                    f"the plan offloads layer {self.layer_indices[-1]} but {prefix or 'the stack'} "
                    f"has {len(every)} layers; make the plan again for this model"
                )
            self.offloaded_modules = [every[i] for i in self.layer_indices]
            return every

    return ExactLayerPrefetchOffloader()
