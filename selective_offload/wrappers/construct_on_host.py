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

Only what becomes the cold module's own parameters and buffers stays on the host:

- an allocation that names its device (``torch.zeros(n, device="cuda")``: a workspace a
  kernel needs on the device, such as FlashInfer's ViT workspace) is left alone;
- after construction, :meth:`ConstructOnHost.finish` moves back to the device whatever it
  routed that is not exclusively a parameter or buffer of a cold module: a submodule a
  module-global cache hands to a hot module too (vLLM's rotary-embedding cache), or a
  tensor something outside the model still holds.

Routed experts (a MoE layer's ``experts`` served ``uva``) are routed by their exact
module, not by a segment: ``modules`` maps a constructing module's prefix to the label of
its plan group (or ``None``), and ``named_by`` names classes whose ``__init__`` carries
that prefix under another argument (vLLM's ``RoutedExperts`` gets the FusedMoE prefix as
``layer_name``; the factory that builds it is a function, not an ``__init__``).

The mode keeps a ledger of what it routed, so the landing report can prove that a cold
parameter was *built* on the host rather than moved there after loading: ``finish``
returns the cold parameters and buffers it allocated, by name in the model (the identity
the report checks: vLLM's post-processing may give a parameter new storage) and by
storage address (valid until post-processing).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors

from ..names import cold_segment
from .layout import device_copy_like

_MAX_FRAMES = 64


def _constructing(class_segments: dict[type, str], never: tuple[type, ...],
                  force: tuple[tuple[type, str], ...] = (),
                  named_by: Mapping[type, str] | None = None) -> tuple[str, str] | None:
    """``("prefix", p)`` for the innermost ``__init__`` on the stack with a ``prefix`` (or,
    for a class in ``named_by``, the argument that carries it), or ``("segment", s)`` when
    a class in ``class_segments`` is built without one first, or an instance of a
    ``force`` class is being built (whatever its prefix)."""
    frame = sys._getframe(2)
    for _ in range(_MAX_FRAMES):
        if frame is None:
            return None
        if frame.f_code.co_name == "__init__":
            local = frame.f_locals
            for cls, segment in force:
                if isinstance(local.get("self"), cls):
                    return ("segment", segment)
            for cls, argument in (named_by or {}).items():
                if isinstance(local.get("self"), cls) and isinstance(local.get(argument), str):
                    return ("prefix", local[argument])
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
    ``force`` lists ``(class, label)`` pairs whose instances are routed whatever their
    prefix, checked in order (a speculative drafter's embedding and LM head, which vLLM
    replaces by the target's after loading). ``modules`` maps a prefix that has no cold
    segment to a label when that exact module is to be built on the host (a plan's
    ``uva``-served experts), and ``named_by`` names classes whose ``__init__`` carries its
    prefix under another argument (``{RoutedExperts: "layer_name"}``).
    """

    def __init__(self, segments: Iterable[str], pin_memory: bool = False, *,
                 class_segments: dict[type, str] | None = None, never: tuple[type, ...] = (),
                 force: tuple[tuple[type, str], ...] = (),
                 modules: Callable[[str], str | None] | None = None,
                 named_by: Mapping[type, str] | None = None):
        super().__init__()
        self.segments = frozenset(segments)
        self.pin_memory = pin_memory
        self.class_segments = {c: s for c, s in (class_segments or {}).items() if s in self.segments}
        self.never = never
        self.force = tuple(force)
        self.modules = modules
        self.named_by = dict(named_by or {})
        self.routed: dict[str, int] = {}
        self._routed_tensors: list[tuple[torch.Tensor, torch.device]] = []
        self._constructors = _device_constructors()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        explicit = kwargs.get("device") is not None
        if func in self._constructors and (self.segments or self.force or self.modules) and not explicit:
            found = _constructing(self.class_segments, self.never, self.force, self.named_by)
            if found is None:
                cold = None
            elif found[0] == "segment":
                cold = found[1]
            else:
                cold = cold_segment(found[1], self.segments)
                if cold is None and self.modules is not None:
                    cold = self.modules(found[1])
            if cold is not None:
                target = torch.get_default_device()  # where vLLM's device context would put it
                kwargs["device"] = torch.device("cpu")
                if self.pin_memory and "pin_memory" in _PINNABLE.get(func, ()):
                    kwargs["pin_memory"] = True
                out = func(*args, **kwargs)
                if isinstance(out, torch.Tensor):
                    self.routed[cold] = self.routed.get(cold, 0) + out.numel() * out.element_size()
                    self._routed_tensors.append((out, target))
                return out
        return func(*args, **kwargs)

    def finish(self, model: nn.Module, is_cold: Callable[[str], bool]) -> RoutingResult:
        """Keep on the host only what is exclusively a cold module's parameter or buffer.

        ``is_cold(name)`` says whether the module at ``name`` in ``model`` is cold. A
        tensor this mode routed that a non-cold module also holds (a cached submodule
        shared with the language model), or that something outside the model still
        references (a module-global cache), goes back to the device it was meant for.
        Releases the ledger's references, so routed temporaries can be freed.
        """
        cold_ptrs, hot_ptrs = set(), set()
        holders: list[tuple[dict, str, torch.Tensor]] = []
        cold_names: list[tuple[str, int]] = []
        for name, module in model.named_modules(remove_duplicate=False):
            cold = is_cold(name)
            owned = cold_ptrs if cold else hot_ptrs
            for table in (module._parameters, module._buffers):
                for key, t in table.items():
                    if t is not None:
                        owned.add(_ptr(t))
                        holders.append((table, key, t))
                        if cold:
                            cold_names.append((f"{name}.{key}" if name else key, _ptr(t)))
        targets = {_ptr(t): device for t, device in self._routed_tensors}
        keep = {p for p in targets if p in cold_ptrs and p not in hot_ptrs}
        moved_back = left = 0
        replaced: dict[int, torch.Tensor] = {}
        for table, key, t in holders:
            p = _ptr(t)
            if id(t) in replaced:
                table[key] = replaced[id(t)]
            elif p in targets and p not in keep:
                replaced[id(t)] = table[key] = _moved(t, targets[p])
                moved_back += t.numel() * t.element_size()
        for t, device in self._routed_tensors:
            p = _ptr(t)
            # Held by this ledger, the loop and the getrefcount argument only: a temporary.
            if p in targets and p not in cold_ptrs | hot_ptrs and sys.getrefcount(t) > 3:
                try:
                    t.data = device_copy_like(t.data, device)  # every holder sees it
                    moved_back += t.numel() * t.element_size()
                except RuntimeError:  # a device torch cannot swap storage to (meta)
                    left += t.numel() * t.element_size()
        self._routed_tensors.clear()
        return RoutingResult(storages=keep, moved_back_bytes=moved_back, left_on_host_bytes=left,
                             names=frozenset(n for n, p in cold_names if p in keep))


def _moved(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``, the same object when torch can swap its storage in place."""
    try:
        t.data = device_copy_like(t.data, device)
        return t
    except RuntimeError:  # meta and other devices set_data refuses: a new object
        moved = device_copy_like(t.detach(), device)
        return nn.Parameter(moved, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else moved


@dataclass(frozen=True)
class RoutingResult:
    """What construction-time routing left on the host, and what it gave back."""

    #: Storage addresses of the cold parameters and buffers built on the host.
    storages: set[int]
    #: Bytes routed to the host and then moved back to the device (shared or cached).
    moved_back_bytes: int
    #: Bytes held outside the model that could not be moved back (reported, not hidden).
    left_on_host_bytes: int = 0
    #: The same parameters and buffers by name in the model: the identity that survives
    #: post-processing (which may give a parameter new storage, or a new Parameter object).
    names: frozenset[str] = frozenset()


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


#: Factories that take ``pin_memory=``; others are pinned after construction.
_PINNABLE = {
    torch.empty: ("pin_memory",),
    torch.zeros: ("pin_memory",),
    torch.ones: ("pin_memory",),
    torch.full: ("pin_memory",),
    torch.empty_strided: ("pin_memory",),
}
