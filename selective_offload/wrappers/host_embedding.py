"""A token embedding whose weight lives in host memory and never on the device.

Why the embedding is cold. A decode step reads one row per token (10 KB for hidden 5120
in bf16) out of a 2.54 GB table (Qwen3.8-27B: 248320 x 5120). Keeping the table on the
device spends 2.54 GB of VRAM to save ~10 KB of PCIe traffic per token, so it is the
first thing to put in host memory. Its twin, the LM head, has the same shape and is read
in full every step: hot. With tied word embeddings the two are one tensor, so the
embedding is hot too, and :func:`refuse_if_tied` refuses to offload it.

Two ways to read the rows, both bit-exact with ``F.embedding`` on a device weight:

- ``mode="host"`` (host gather; the default, for eager execution). The token ids come to
  the host, the rows are gathered there into a reusable pinned staging buffer, and only
  those rows are copied to the device (asynchronously, from pinned memory). Fewest bytes
  over PCIe: exactly one row per token, in one contiguous copy. It needs the ids on the
  host, which costs a device-to-host sync when they start on the device, and it is host
  work, so it cannot be part of a captured CUDA graph.
- ``mode="uva"`` (zero-copy). The device reads the rows straight out of pinned host
  memory through a device view of it (unified virtual addressing). No host work per call,
  so it can run inside a CUDA graph: choose it when the model is captured. Each row is
  read over PCIe by the gather kernel itself.

How the UVA view is made. torch has no public call for "a CUDA tensor over this pinned
host memory". With unified addressing (every 64-bit CUDA platform), memory from
``cudaHostAlloc`` -- what ``pin_memory=True`` uses -- has the same address on host and
device, so :func:`cuda_view_of_pinned` hands torch that address through the
``__cuda_array_interface__`` protocol (the one CuPy and Numba use; torch parses its
``typestr`` with NumPy) and checks that torch made a view, not a copy. vLLM has a C++ op for
the same job (``torch.ops._C.get_cuda_view_from_cpu_tensor``); the vLLM glue may pass it
as ``view_factory`` instead.

Fitting vLLM's ``VocabParallelEmbedding``: its ``forward`` maps ids to shard-local indices
and masks the output; only the inner lookup (``quant_method.embedding(layer, ids)``) is
replaced, by a :class:`HostGather` call on ``layer.weight``, so the masking is untouched.
The Parameter object stays the same (:func:`move_module_weight_to_host`), so its
``weight_loader`` writes into host storage.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
from torch import nn

from .residency import (
    OffloadError,
    OffloadStats,
    TransferLedger,
    resolve_device,
    resolve_pin,
    tensor_bytes,
    to_host,
)

GatherMode = Literal["host", "uva"]
ViewFactory = Callable[[torch.Tensor], torch.Tensor]

_FLOAT8_DTYPES = tuple(
    getattr(torch, name)
    for name in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz")
    if hasattr(torch, name)
)


class TiedWeightError(OffloadError):
    """The embedding's weight is the LM head's weight: it is hot and must stay on the device."""


def refuse_if_tied(
    embedding: nn.Module | torch.Tensor,
    lm_head: nn.Module | torch.Tensor | None,
    *,
    embedding_name: str = "embed_tokens",
    lm_head_name: str = "lm_head",
) -> None:
    """Raise :class:`TiedWeightError` when the two weights are one tensor or share storage."""
    if lm_head is None:
        return
    a = embedding.weight if isinstance(embedding, nn.Module) else embedding
    b = lm_head.weight if isinstance(lm_head, nn.Module) else lm_head
    if a is b or (
        not a.is_meta
        and not b.is_meta
        and a.device == b.device
        and a.untyped_storage().nbytes() > 0
        and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    ):
        raise TiedWeightError(
            f"{embedding_name}.weight and {lm_head_name}.weight are the same tensor (tied word "
            f"embeddings): the embedding is the LM head's weight, which every decode step "
            f"reads in full, so it is hot and must stay on the device; do not offload "
            f"{embedding_name} for this model"
        )


def move_module_weight_to_host(
    module: nn.Module, attr: str = "weight", *, pin: bool | None = None
) -> torch.Tensor:
    """Put ``module.<attr>`` in host memory, keeping the Parameter object and its attributes.

    ``pin=None`` pins when CUDA is available. A device copy, if there was one, is dropped.
    Returns the parameter (the same object as before).
    """
    param = getattr(module, attr, None)
    if not isinstance(param, torch.Tensor):
        raise OffloadError(
            f"{type(module).__name__} has no tensor attribute {attr!r} to move to host memory; "
            "pass the name of its weight parameter as attr="
        )
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    param.data = to_host(param.data, resolve_pin(pin, device))
    return param


def _check_ids(ids: torch.Tensor) -> None:
    if ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(
            f"token ids must be int64 or int32 (as F.embedding requires), got {ids.dtype}"
        )


def _check_bounds(ids: torch.Tensor, num_rows: int) -> None:
    """Raise IndexError for an id outside ``[0, num_rows)``, as F.embedding does; one pass."""
    if ids.numel() == 0:
        return
    low, high = torch.stack(torch.aminmax(ids)).tolist()  # one device sync, not two
    bad = low if low < 0 else high if high >= num_rows else None
    if bad is not None:
        raise IndexError(
            f"index out of range in self: token id {bad} is outside the embedding's "
            f"{num_rows} rows (valid ids are 0..{num_rows - 1})"
        )


def _gatherable(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` as a dtype every gather kernel handles: fp8 as its raw bytes (bit-exact)."""
    return weight.view(torch.uint8) if weight.dtype in _FLOAT8_DTYPES else weight


def _host_weight(weight: torch.Tensor) -> torch.Tensor:
    data = weight.data if isinstance(weight, nn.Parameter) else weight
    if data.device.type != "cpu":
        raise OffloadError(
            f"the offloaded embedding weight is on {data.device}, not in host memory: "
            "something moved it back (module.to()/.cuda(), or a loader that replaced the "
            "tensor); call move_module_weight_to_host() on the module again"
        )
    if data.dim() != 2:
        raise OffloadError(
            f"an embedding weight must be 2-D (rows x hidden), got shape {tuple(data.shape)}"
        )
    return data


def _staging_rows(staging: torch.Tensor, n: int, like: torch.Tensor) -> torch.Tensor:
    row_bytes = like.shape[1] * like.element_size()
    if staging.dtype != torch.uint8 or staging.dim() != 1 or staging.device.type != "cpu":
        raise OffloadError("the staging buffer must be a 1-D uint8 host tensor")
    if staging.numel() < n * row_bytes:
        raise OffloadError(
            f"the staging buffer holds {staging.numel()} bytes, {n} rows need "
            f"{n * row_bytes}; pass a larger one (or use HostGather, which grows its own)"
        )
    return staging[: n * row_bytes].view(like.dtype).view(n, like.shape[1])


def host_gather(
    weight: torch.Tensor,
    ids: torch.Tensor,
    device: torch.device | str,
    staging: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows ``ids`` of the host ``weight``, gathered on the host and copied to ``device``.

    Returns ``F.embedding(ids, weight)`` on ``device``, bit for bit. ``staging`` is a 1-D
    uint8 host tensor large enough for the rows (pinned, for an asynchronous copy); when
    None a temporary is used. The copy out of ``staging`` may still be in flight when this
    returns: the caller must not overwrite ``staging`` before it completes
    (:class:`HostGather` waits on an event for that).
    """
    _check_ids(ids)
    host = _host_weight(weight)
    device = torch.device(device)
    ids_host = ids.to("cpu")
    _check_bounds(ids_host, host.shape[0])
    src = _gatherable(host)
    n = ids_host.numel()
    if staging is None:
        pin = device.type == "cuda" and torch.cuda.is_available()
        rows = torch.empty((n, src.shape[1]), dtype=src.dtype, pin_memory=pin)
    else:
        rows = _staging_rows(staging, n, src)
    torch.index_select(src, 0, ids_host.reshape(-1), out=rows)
    out = torch.empty(rows.shape, dtype=rows.dtype, device=device)
    out.copy_(rows, non_blocking=device.type == "cuda")
    return out.view(host.dtype).view(*ids.shape, src.shape[1])


class _ArrayInterface:
    """A pinned host buffer described with ``__cuda_array_interface__``; holding it keeps
    the host tensor (and so the memory the view reads) alive as long as the view."""

    def __init__(self, host: torch.Tensor) -> None:
        self.host = host
        self.__cuda_array_interface__ = {
            "shape": (tensor_bytes(host),),
            "typestr": "|u1",
            "data": (host.data_ptr(), False),
            "version": 2,
        }


def cuda_view_of_pinned(
    host: torch.Tensor, device: torch.device | str | None = None
) -> torch.Tensor:
    """A CUDA tensor that reads ``host``'s pinned memory in place (zero-copy, UVA).

    Pure torch: the view is built through ``__cuda_array_interface__`` (torch needs NumPy to
    read it). Raises :class:`OffloadError` if torch would have copied instead.
    """
    device = resolve_device(device if device is not None else "cuda")
    if device.type != "cuda" or not torch.cuda.is_available():
        raise OffloadError(
            "a UVA view needs a CUDA device; use mode='host' (host gather) on this machine"
        )
    if host.device.type != "cpu" or not host.is_pinned() or not host.is_contiguous():
        raise OffloadError(
            "a UVA view needs a contiguous pinned host tensor; move the weight with "
            "move_module_weight_to_host(module, pin=True) first"
        )
    try:
        flat = torch.as_tensor(_ArrayInterface(host), device=device)
    except (RuntimeError, TypeError, ValueError) as err:
        raise OffloadError(
            f"torch could not make a device view of pinned host memory ({err}); pass "
            "view_factory=torch.ops._C.get_cuda_view_from_cpu_tensor from vLLM, or use "
            "mode='host'"
        ) from err
    if flat.device != device or flat.data_ptr() != host.data_ptr():
        raise OffloadError(
            f"torch copied the pinned weight to {flat.device} instead of viewing it in place "
            f"(the memory was pinned for another device?); use mode='host' or pass vLLM's "
            "view_factory"
        )
    return flat.view(host.dtype).view(host.shape)


class HostGather:
    """The stateful part of an embedding lookup from host memory, one per embedding.

    Holds the pinned staging buffer (grown when a larger batch arrives, reused otherwise),
    the UVA view (rebuilt only when the host storage changes), and the counters. The weight
    is passed on every call rather than held, so a loader that replaces the tensor can
    never leave this object reading a stale one.
    """

    def __init__(
        self,
        device: torch.device | str | None = None,
        *,
        mode: GatherMode = "host",
        view_factory: ViewFactory | None = None,
        page_locked=None,
        pin: bool | None = None,
    ) -> None:
        self.device = resolve_device(device)
        if mode not in ("host", "uva"):
            raise OffloadError(f"unknown gather mode {mode!r}; use 'host' or 'uva'")
        if mode == "uva" and view_factory is None:
            if self.device.type != "cuda" or not torch.cuda.is_available():
                raise OffloadError(
                    f"mode='uva' needs a CUDA device (got {self.device}) or a view_factory "
                    "that makes a device view of host memory; use mode='host' here"
                )
            view_factory = lambda host: cuda_view_of_pinned(host, self.device)  # noqa: E731
        self.mode: GatherMode = mode
        self.view_factory = view_factory
        cuda = self.device.type == "cuda" and torch.cuda.is_available()
        self._pin = cuda if pin is None else (pin and cuda)
        #: Counts the staging buffer among this process's page-locked bytes.
        self.page_locked = page_locked
        self._staging: torch.Tensor | None = None
        self._copy_done: torch.cuda.Event | None = None
        self._view_key: tuple | None = None
        self._view: torch.Tensor | None = None
        self._ledger = TransferLedger()

    @property
    def ledger(self) -> TransferLedger:
        """The live counters (a small object a caller may keep after the wrapper is gone)."""
        return self._ledger

    @property
    def staging(self) -> torch.Tensor | None:
        """The host staging buffer (1-D uint8), or None before the first host gather."""
        return self._staging

    def __call__(self, weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        host = _host_weight(weight)
        _check_ids(ids)
        nbytes = ids.numel() * host.shape[1] * host.element_size()
        if self.mode == "uva":
            out = self._uva_gather(host, ids)
        else:
            if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise OffloadError(
                    "a host gather is host work and cannot be captured in a CUDA graph; "
                    "build this embedding with mode='uva' when the model is captured"
                )
            if self._copy_done is not None:
                # The previous call's copy may still be reading the staging buffer.
                self._copy_done.synchronize()
            out = host_gather(host, ids, self.device, self._staging_for(nbytes))
            if self.device.type == "cuda":
                self._copy_done = torch.cuda.Event()
                self._copy_done.record()
        self._ledger.start_call()
        self._ledger.moved(nbytes)
        return out

    def _staging_for(self, nbytes: int) -> torch.Tensor:
        if self._staging is None or self._staging.numel() < nbytes:
            old = 0 if self._staging is None else self._staging.numel()
            if self._staging is not None and self.page_locked is not None:
                self.page_locked.forget(self._staging)
            self._staging = torch.empty(
                max(nbytes, 2 * old), dtype=torch.uint8, pin_memory=self._pin
            )
            if self.page_locked is not None:
                self.page_locked.note_pinned(self._staging, "host gather staging buffer")
        return self._staging

    def _uva_gather(self, host: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        key = (host.data_ptr(), tuple(host.shape), host.dtype)
        if key != self._view_key:
            self._view, self._view_key = self.view_factory(host), key
        ids_dev = ids.to(self.device, non_blocking=True)
        capturing = self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if not capturing:
            # A graph cannot sync to check; outside one an out-of-range id must raise
            # here rather than trip a device-side assert.
            _check_bounds(ids_dev, host.shape[0])
        rows = torch.index_select(_gatherable(self._view), 0, ids_dev.reshape(-1))
        return rows.view(host.dtype).view(*ids.shape, host.shape[1])

    def stats(self, weight: torch.Tensor) -> OffloadStats:
        """Counters, with ``host_bytes`` taken from ``weight`` as it is placed now."""
        data = weight.data if isinstance(weight, nn.Parameter) else weight
        host_bytes = tensor_bytes(data) if data.device.type == "cpu" else 0
        return self._ledger.snapshot(host_bytes)


class HostEmbedding(nn.Module):
    """A drop-in for ``nn.Embedding`` (inference) whose weight stays in host memory.

    Owns the original Parameter object under the same name (``weight``), so state-dict
    keys and loaders are unchanged. ``load_state_dict`` copies into host storage; with
    ``assign=True`` the new tensor is moved back to the host afterwards. No gradient flows
    to the host weight.
    """

    def __init__(
        self,
        weight: nn.Parameter,
        device: torch.device | str | None = None,
        *,
        mode: GatherMode = "host",
        pin: bool | None = None,
        view_factory: ViewFactory | None = None,
        padding_idx: int | None = None,
    ) -> None:
        super().__init__()
        self.gather = HostGather(device, mode=mode, view_factory=view_factory)
        self._pin = resolve_pin(pin, self.gather.device)
        if mode == "uva" and view_factory is None and not self._pin:
            raise OffloadError("mode='uva' reads pinned memory; do not pass pin=False with it")
        if not isinstance(weight, nn.Parameter):
            weight = nn.Parameter(weight, requires_grad=False)
        self.weight = weight
        self.num_embeddings, self.embedding_dim = self.weight.shape
        self.padding_idx = padding_idx
        move_module_weight_to_host(self, "weight", pin=self._pin)
        self.register_load_state_dict_post_hook(_rehost_after_load)

    @classmethod
    def from_embedding(
        cls,
        embedding: nn.Module,
        device: torch.device | str | None = None,
        *,
        mode: GatherMode = "host",
        pin: bool | None = None,
        view_factory: ViewFactory | None = None,
        lm_head: nn.Module | None = None,
    ) -> HostEmbedding:
        """Replace ``embedding`` (an ``nn.Embedding``-like module); refuses a tied weight.

        Wrapping a :class:`HostEmbedding` again returns it unchanged when the device and
        mode agree, and raises otherwise.
        """
        refuse_if_tied(embedding, lm_head)
        if isinstance(embedding, HostEmbedding):
            if embedding.gather.device == resolve_device(device) and embedding.gather.mode == mode:
                return embedding
            raise OffloadError(
                f"this embedding is already host-resident for {embedding.gather.device} in "
                f"mode {embedding.gather.mode!r}; build a new one from the original module "
                "instead of re-wrapping"
            )
        if getattr(embedding, "max_norm", None) is not None:
            raise OffloadError(
                "an embedding with max_norm renormalises its weight in place on every "
                "lookup; it cannot be served from a read-only host copy"
            )
        return cls(
            embedding.weight,
            device,
            mode=mode,
            pin=pin,
            view_factory=view_factory,
            padding_idx=getattr(embedding, "padding_idx", None),
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.gather(self.weight, ids)

    @property
    def stats(self) -> OffloadStats:
        return self.gather.stats(self.weight)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, device={self.gather.device}, "
            f"mode={self.gather.mode}, weight on {self.weight.device}"
        )


def _rehost_after_load(module: HostEmbedding, _incompatible_keys) -> None:
    # load_state_dict(assign=True) installs the incoming tensor, wherever it lives.
    move_module_weight_to_host(module, "weight", pin=module._pin)
