"""A module (vision/audio tower, MTP head) that lives in host memory and visits the device.

Why on demand. A tower is read once per image or clip, in prefill; an MTP head only with
speculative decoding. Keeping them resident spends VRAM (0.92 GB of vision tower on
Qwen3.8-27B) on weights most steps never read. So parameters and buffers stay in
(pinned) host memory, are copied to the device when the module runs, and are dropped
after.

Why block by block. A tower is a stack of similar blocks; onloading it whole would need
its full size as transient device memory, the very memory we are trying to free. With a
block list, the non-block parameters (patch embedding, final norm, merger) are onloaded
for the whole call, and each block only around its own forward, while the next block's
copy runs on a side stream (prefetch). Transient device memory is then about two blocks
plus the non-block part, and the copies overlap compute. On a machine without CUDA there
is no stream: the same code copies synchronously, which keeps the hooks, the counters and
the event log testable on a CPU.

Why hooks and ``tensor.data`` swaps. Forward pre/post hooks onload and release without
touching the module's code; swapping ``.data`` keeps every Parameter object (and its
attributes, such as vLLM's ``weight_loader``) so loaders and ``state_dict`` see the host
tensors between calls. Releasing a block drops its device copy; the caching allocator is
told (``record_stream``) that the compute stream used it, so the memory is not handed to
the next prefetch while a kernel may still read it.

Limits. Host work per call means a module served this way runs eagerly, never inside a
captured CUDA graph (an MTP head under CUDA graphs needs UVA instead). Blocks must be
called through ``__call__`` (hooks do not fire for ``block.forward(...)``). Tensors held as
plain attributes, not as parameters or buffers, are left where they are.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch import nn

from .layout import device_copy_like
from .residency import (
    OffloadError,
    OffloadStats,
    TransferLedger,
    resolve_device,
    resolve_pin,
    tensor_bytes,
    to_host,
)

NON_BLOCK = "<non-block>"
_MARK = "_selective_offload_on_demand"


def find_block_list(module: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """The module's block stack: the ``nn.ModuleList`` of two or more children of one class
    holding the most parameter bytes (``blocks``, ``layers``, ``encoder.layers``...), or None."""
    best: tuple[int, str, nn.ModuleList] | None = None
    for name, child in module.named_modules():
        if not isinstance(child, nn.ModuleList) or len(child) < 2:
            continue
        if len({type(block) for block in child}) != 1:
            continue
        nbytes = sum(tensor_bytes(p) for p in child.parameters())
        if best is None or nbytes > best[0]:
            best = (nbytes, name, child)
    return None if best is None else (best[1], best[2])


@dataclass
class _Group:
    """Tensors onloaded and released together: one block, or the non-block remainder."""

    name: str
    tensors: list[torch.Tensor]
    hosts: list[torch.Tensor] = field(default_factory=list)
    device_copies: list[torch.Tensor] | None = None
    ready: torch.cuda.Event | None = None

    @property
    def nbytes(self) -> int:
        return sum(tensor_bytes(h) for h in self.hosts)


class OnDemandOffload:
    """Keeps ``module``'s parameters and buffers in host memory; onloads them per forward.

    Use :func:`offload_on_demand` to attach one and :meth:`detach` to remove it. ``events``
    records the last call's ``(action, group)`` pairs, action one of ``onload`` (copied
    when needed), ``prefetch`` (copied ahead on the side stream) and ``release``.
    """

    def __init__(
        self,
        module: nn.Module,
        device: torch.device | str | None = None,
        *,
        blocks: str | nn.ModuleList | None = "auto",
        prefetch: bool = True,
        pin: bool | None = None,
        page_locked=None,
        name: str = "",
    ) -> None:
        self.module = module
        self.device = resolve_device(device)
        self.prefetch = prefetch
        #: Page-locks host copies in place at their exact size (see ``page_locked``); its
        #: policy then decides whether to pin.
        self.page_locked = page_locked
        self.pin = page_locked.policy.locks if page_locked is not None else resolve_pin(pin, self.device)
        self.name = name or type(module).__name__
        self.block_list_name, self.block_list = self._resolve_blocks(blocks)
        self.events: list[tuple[str, str]] = []
        self._blocks_requested = blocks
        self._ledger = TransferLedger()
        self._original_device: dict[int, torch.device] = {}
        self._cuda = self.device.type == "cuda" and torch.cuda.is_available()
        self._side_stream = torch.cuda.Stream(self.device) if self._cuda else None
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._groups: list[_Group] = []
        self._blocks: list[_Group] = []
        self._non_block = _Group(NON_BLOCK, [])
        self.refresh()
        self._attach_hooks()
        setattr(module, _MARK, self)

    def _resolve_blocks(self, blocks) -> tuple[str | None, nn.ModuleList | None]:
        if blocks is None:
            return None, None
        if blocks == "auto":
            found = find_block_list(self.module)
            return found if found is not None else (None, None)
        if isinstance(blocks, str):
            found = self.module.get_submodule(blocks)
            name = blocks
        else:
            found = blocks
            name = next((n for n, m in self.module.named_modules() if m is blocks), None)
            if name is None:
                raise OffloadError(
                    "the blocks= ModuleList is not a submodule of the module being offloaded; "
                    "pass one of its own ModuleLists, its dotted name, 'auto' or None"
                )
        if not isinstance(found, nn.ModuleList):
            raise OffloadError(
                f"blocks={name!r} is a {type(found).__name__}, not an nn.ModuleList; pass the "
                "block stack's name (for example 'encoder.layers'), 'auto' or None"
            )
        return name, found

    # -- residency ---------------------------------------------------------------------

    def refresh(self) -> None:
        """(Re)collect the module's tensors and put any that are not on the host there.

        Called at construction and after ``load_state_dict``; call it after anything that
        replaces parameters (vLLM's ``process_weights_after_loading``).
        """
        self.release_all()
        # Where each tensor is used: a tensor used only inside block i is onloaded with
        # it; one used by two blocks or outside the block list (tied, shared) must stay
        # onloaded for the whole call, so it joins the non-block group.
        tensors: dict[int, torch.Tensor] = {}
        users: dict[int, set[int | None]] = {}
        named = [
            *self.module.named_parameters(remove_duplicate=False),
            *self.module.named_buffers(remove_duplicate=False),
        ]
        for name, t in named:
            tensors.setdefault(id(t), t)
            users.setdefault(id(t), set()).add(self._block_index(name))
        count = len(self.block_list) if self.block_list is not None else 0
        self._blocks = [
            _Group(
                f"{self.block_list_name}.{i}" if self.block_list_name else str(i),
                [t for key, t in tensors.items() if users[key] == {i}],
            )
            for i in range(count)
        ]
        in_blocks = {id(t) for g in self._blocks for t in g.tensors}
        self._non_block = _Group(
            NON_BLOCK, [t for key, t in tensors.items() if key not in in_blocks]
        )
        self._groups = [self._non_block, *self._blocks]
        for group in self._groups:
            for t in group.tensors:
                self._original_device.setdefault(id(t), t.device)
        if self.page_locked is not None and self.pin:
            # One arena, one registration for the module: small tensors never share a
            # registered page (page_locked.lock_together).
            self.page_locked.lock_together([t for g in self._groups for t in g.tensors], self.name)
        for group in self._groups:
            for t in group.tensors:
                t.data = to_host(t.data, self.pin, self.page_locked, self.name)
            group.hosts = [t.data for t in group.tensors]

    def _block_index(self, tensor_name: str) -> int | None:
        """Which block a dotted tensor name is in (None: outside the block list)."""
        if self.block_list is None:
            return None
        prefix = f"{self.block_list_name}." if self.block_list_name else ""
        if not tensor_name.startswith(prefix):
            return None
        return int(tensor_name[len(prefix):].split(".", 1)[0])

    def _onload(self, group: _Group, *, ahead: bool) -> None:
        if group.device_copies is not None:
            return
        side = ahead and self._side_stream is not None
        with torch.cuda.stream(self._side_stream) if side else contextlib.nullcontext():
            # Same dtype, shape, strides and span as the host tensor (wrappers.layout).
            copies = [device_copy_like(h, self.device, non_blocking=self._cuda) for h in group.hosts]
            if side:
                group.ready = torch.cuda.Event()
                group.ready.record()
        for t, c in zip(group.tensors, copies):
            t.data = c
        group.device_copies = copies
        self.events.append(("prefetch" if ahead else "onload", group.name))
        self._ledger.moved(group.nbytes)
        self._ledger.onloaded(group.nbytes)

    def _wait(self, group: _Group) -> None:
        if group.ready is None:
            return
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(group.ready)
        for c in group.device_copies or ():
            c.record_stream(stream)
        group.ready = None

    def _release(self, group: _Group) -> None:
        if group.device_copies is None:
            return
        for t, h in zip(group.tensors, group.hosts):
            t.data = h
        group.device_copies, group.ready = None, None
        self.events.append(("release", group.name))
        self._ledger.released(group.nbytes)

    def release_all(self) -> None:
        """Point every tensor back at its host copy (a no-op between calls)."""
        for group in [*self._blocks, self._non_block]:
            self._release(group)

    # -- hooks -------------------------------------------------------------------------

    def _attach_hooks(self) -> None:
        self._hooks.append(self.module.register_forward_pre_hook(self._before_module))
        self._hooks.append(
            self.module.register_forward_hook(self._after_module, always_call=True)
        )
        self._hooks.append(self.module.register_load_state_dict_post_hook(self._after_load))
        for i, block in enumerate(self.block_list or ()):
            self._hooks.append(block.register_forward_pre_hook(self._before_block(i)))
            self._hooks.append(
                block.register_forward_hook(self._after_block(i), always_call=True)
            )

    def _before_module(self, _module, _args) -> None:
        self._ledger.start_call()
        self.events.clear()
        self._onload(self._non_block, ahead=False)
        if self.prefetch and self._blocks:
            self._onload(self._blocks[0], ahead=True)

    def _after_module(self, _module, _args, _output) -> None:
        self.release_all()

    def _before_block(self, i: int):
        def hook(_block, _args) -> None:
            group = self._blocks[i]
            if group.device_copies is None:
                self._onload(group, ahead=False)
            self._wait(group)
            if self.prefetch and i + 1 < len(self._blocks):
                self._onload(self._blocks[i + 1], ahead=True)

        return hook

    def _after_block(self, i: int):
        def hook(_block, _args, _output) -> None:
            self._release(self._blocks[i])

        return hook

    def _after_load(self, _module, _incompatible_keys) -> None:
        # load_state_dict(assign=True) installs new tensors; bring them (back) to the host.
        self.refresh()

    # -- reporting and removal -----------------------------------------------------------

    @property
    def ledger(self) -> TransferLedger:
        """The live counters (a small object a caller may keep after the wrapper is gone)."""
        return self._ledger

    @property
    def stats(self) -> OffloadStats:
        host_bytes = sum(
            tensor_bytes(h) for g in self._groups for h in g.hosts if h.device.type == "cpu"
        )
        return self._ledger.snapshot(host_bytes)

    @property
    def transient_device_bytes(self) -> int:
        """Bytes onloaded right now (zero between calls)."""
        return self._ledger.transient_device_bytes

    def group_bytes(self) -> dict[str, int]:
        """Host bytes per onload group: the non-block part and each block."""
        return {g.name: g.nbytes for g in self._groups}

    def detach(self) -> None:
        """Remove the hooks and put every tensor back on the device it was on before."""
        self.release_all()
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        for group in self._groups:
            for t in group.tensors:
                original = self._original_device.get(id(t), t.device)
                if t.device != original:
                    if self.page_locked is not None:
                        self.page_locked.unlock(t.untyped_storage().data_ptr())
                    t.data = device_copy_like(t.data, original)
        self._groups, self._blocks = [], []
        if getattr(self.module, _MARK, None) is self:
            delattr(self.module, _MARK)


def offload_on_demand(
    module: nn.Module,
    device: torch.device | str | None = None,
    *,
    blocks: str | nn.ModuleList | None = "auto",
    prefetch: bool = True,
    pin: bool | None = None,
    page_locked=None,
    name: str = "",
) -> OnDemandOffload:
    """Keep ``module`` in host memory and onload it per forward (block by block if it has
    a block list: ``blocks="auto"`` finds it, ``None`` onloads the module whole).

    Offloading a module again with the same settings returns the existing handle; with
    other settings, or when one of its submodules is already offloaded, it raises.
    """
    device = resolve_device(device)
    existing = getattr(module, _MARK, None)
    if existing is not None:
        if (existing.device, existing._blocks_requested, existing.prefetch) == (
            device,
            blocks,
            prefetch,
        ) and existing.pin == resolve_pin(pin, device):
            return existing
        raise OffloadError(
            f"{type(module).__name__} is already offloaded on demand with other settings "
            f"(device={existing.device}); call .detach() on its handle first"
        )
    for sub_name, sub in module.named_modules():
        if sub_name and getattr(sub, _MARK, None) is not None:
            raise OffloadError(
                f"submodule {sub_name!r} of {type(module).__name__} is already offloaded on "
                "demand; detach it first or offload only one of the two"
            )
    return OnDemandOffload(module, device, blocks=blocks, prefetch=prefetch, pin=pin, page_locked=page_locked, name=name)
