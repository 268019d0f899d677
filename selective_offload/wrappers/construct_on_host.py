"""Build cold modules in host memory, so their weights never touch the device.

vLLM builds the model under ``with torch.device(target):``, so every parameter is
allocated on the GPU inside its module's ``__init__``; a module registration hook only
sees the module after that, and moving it then needs the device memory it was meant to
save (a 31 GB checkpoint OOMs a 24 GiB card at construction). The only place to decide is
the allocation itself.

:class:`ConstructOnHost` is a ``TorchFunctionMode`` pushed inside vLLM's device context.
On each tensor factory call (``torch.empty``, ``torch.zeros``, ...) it looks up the Python
stack for the innermost ``__init__`` that has a ``prefix`` argument - the convention every
vLLM layer follows (``prefix="model.embed_tokens"``, ``"visual.blocks.0.attn.qkv"``) - and
when a dot-separated segment of that prefix is one of the cold segments, it allocates on
the host (pinned where the platform pins) instead of the device. Helpers that allocate
inside a layer (``create_weights``) have no ``prefix`` of their own, so the walk reaches
the layer's ``__init__``. Which prefixes are cold is :mod:`selective_offload.names`' rule
(whole segments; ``lm_head`` never). The mode costs a short stack walk per factory call
during construction only.

The mode also keeps a ledger of what it routed, so the placement report can prove that a
cold parameter was *built* on the host rather than moved there after loading:
:meth:`ConstructOnHost.routed_storages` gives the storage addresses it allocated that
became parameters or buffers of the built model.
"""

from __future__ import annotations

import sys
from typing import Iterable

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors

from ..names import cold_segment

_MAX_FRAMES = 64


def _constructing(class_segments: dict[type, str], never: tuple[type, ...]) -> tuple[str, str] | None:
    """``("prefix", p)`` for the innermost ``__init__`` on the stack with a ``prefix``, or
    ``("segment", s)`` when a class in ``class_segments`` is built without one first."""
    frame = sys._getframe(2)
    for _ in range(_MAX_FRAMES):
        if frame is None:
            return None
        if frame.f_code.co_name == "__init__":
            local = frame.f_locals
            prefix = local.get("prefix")
            if isinstance(prefix, str) and prefix:
                return ("prefix", prefix)
            owner = local.get("self")
            if never and isinstance(owner, never):
                return None
            for cls, segment in class_segments.items():
                if isinstance(owner, cls):
                    return ("segment", segment)
        frame = frame.f_back
    return None


class ConstructOnHost(TorchFunctionMode):
    """Route the allocations of modules whose ``prefix`` has a cold segment to the host.

    ``routed`` maps each cold segment (``embed_tokens``, ``visual``) to the bytes allocated
    for it on the host, so the caller can check the routing happened; the tensors
    themselves are held until :meth:`routed_storages` (so no address is reused meanwhile).

    Some models build a module without passing it a prefix (vLLM's Llama builds its
    ``embed_tokens`` so); ``class_segments`` names classes whose instances stand for a
    segment when no prefix is found first (``{VocabParallelEmbedding: "embed_tokens"}``),
    and ``never`` classes that are never routed (``ParallelLMHead``, a subclass of it).
    """

    def __init__(self, segments: Iterable[str], pin_memory: bool = False, *,
                 class_segments: dict[type, str] | None = None, never: tuple[type, ...] = ()):
        super().__init__()
        self.segments = frozenset(segments)
        self.pin_memory = pin_memory
        self.class_segments = {c: s for c, s in (class_segments or {}).items() if s in self.segments}
        self.never = never
        self.routed: dict[str, int] = {}
        self._routed_tensors: list[torch.Tensor] = []
        self._constructors = _device_constructors()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in self._constructors and self.segments:
            found = _constructing(self.class_segments, self.never)
            if found is None:
                cold = None
            elif found[0] == "segment":
                cold = found[1]
            else:
                cold = cold_segment(found[1], self.segments)
            if cold is not None:
                kwargs["device"] = torch.device("cpu")
                if self.pin_memory and "pin_memory" in _PINNABLE.get(func, ()):
                    kwargs["pin_memory"] = True
                out = func(*args, **kwargs)
                if isinstance(out, torch.Tensor):
                    self.routed[cold] = self.routed.get(cold, 0) + out.numel() * out.element_size()
                    self._routed_tensors.append(out)
                return out
        return func(*args, **kwargs)

    def routed_storages(self, model: nn.Module) -> set[int]:
        """Storage addresses this mode allocated that hold ``model``'s parameters or buffers
        now; releases the ledger's references (temporaries it routed can then be freed)."""
        mine = {t.untyped_storage().data_ptr() for t in self._routed_tensors}
        self._routed_tensors.clear()
        held = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())
                if t.device.type == "cpu"}
        return mine & held


#: Factories that take ``pin_memory=``; others are pinned after construction.
_PINNABLE = {
    torch.empty: ("pin_memory",),
    torch.zeros: ("pin_memory",),
    torch.ones: ("pin_memory",),
    torch.full: ("pin_memory",),
    torch.empty_strided: ("pin_memory",),
}
