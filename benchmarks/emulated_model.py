"""The emulated model of the decode emulation: a model's bytes as device and pinned host
buffers, placed as a plan places them, and one decode step over them.

Why a module of its own: ``decode_emulation.py`` times placements, ``emulation_sections.py``
measures them section by section, and both need the same model: :class:`Shape` (the byte
counts of the plan's groups at a scale), :func:`build` (bulk, selective or resident
placements of those bytes: device matrices, a pinned arena, UVA views, a host-gathered
embedding), the :class:`Prefetcher` of hot layers, and the :class:`Runner` whose
``forward`` reads every resident byte once per step. Nothing here times or reports.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from _common import fill_random

REF_HIDDEN = 5120
ALIGN = 512  # byte alignment of slices of the pinned arena


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass
class Shape:
    """Byte counts of the emulated model at a scale, from the plan's groups."""

    scale: float
    hidden: int
    layer_bytes: dict[int, int]
    embed_rows: int
    lm_head_rows: int
    other_bytes: int  # norms and other small always-read modules
    tower_bytes: int  # vision tower: loaded, not read by a text step
    mtp_bytes: int = 0  # MTP head (loaded only for MTP speculative decoding): read per draft
    mtp_placement: str | None = None

    @classmethod
    def from_plan(cls, plan, scale: float) -> "Shape":
        hidden = max(64, int(round(REF_HIDDEN * math.sqrt(scale) / 64)) * 64)
        layer_bytes, embed, lm_head, other, tower, mtp, mtp_placement = {}, 0, 0, 0, 0, 0, None
        for g in plan.groups:
            if g.placement == "absent":
                continue
            if getattr(g, "mtp", False) or {"mtp", "mtp_layers"} & set(g.group.split(".")):
                mtp += g.bytes
                mtp_placement = str(getattr(g.placement, "value", g.placement))
            elif g.kind == "layer":
                layer_bytes[g.layer_index] = g.bytes
            elif g.group.split(".")[-1] == "embed_tokens":
                embed = g.bytes
            elif "lm_head" in g.group.split("."):
                lm_head = g.bytes
            elif g.kind == "cold":
                tower += g.bytes
            else:
                other += g.bytes

        def rows(nbytes: int) -> int:
            return max(1, int(nbytes * scale) // (2 * hidden))

        return cls(scale, hidden, {i: rows(b) * 2 * hidden for i, b in layer_bytes.items()},
                   rows(embed), rows(lm_head), rows(other) * 2 * hidden, int(tower * scale),
                   rows(mtp) * 2 * hidden if mtp else 0, mtp_placement)

    def row_bytes(self) -> int:
        return 2 * self.hidden

    def loaded_bytes(self) -> int:
        return (sum(self.layer_bytes.values()) + (self.embed_rows + self.lm_head_rows) * self.row_bytes()
                + self.other_bytes + self.tower_bytes + self.mtp_bytes)


@dataclass
class Layer:
    index: int
    device: object = None  # bf16 [rows, hidden] on the device
    host_view: object = None  # bf16 [rows, hidden] read in place (UVA view, or host on CPU)
    hot: int | None = None  # position in the prefetch order


@dataclass
class Emulated:
    name: str
    layers: list[Layer]
    lm_head: object
    other: object
    embed: object  # device table, or host table (with gather)
    gather: object = None
    unread: list = field(default_factory=list)
    hot_hosts: list = field(default_factory=list)
    link_bytes: int = 0
    device_read_bytes: int = 0
    overlap: bool = False
    row_bytes: int = 0
    mtp: object = None  # the MTP head's bytes as one device matrix (drafts read it)


class Prefetcher:
    """Hot layers into ``slots`` static device buffers on a side stream, in step order,
    wrapping round so the next step's first hot layers load during this step's tail."""

    def __init__(self, hosts: list, slots: int, hidden: int, cuda: bool, device) -> None:
        import torch

        self.hosts, self.hidden, self.cuda = hosts, hidden, cuda
        self.n_slots = max(1, min(slots, len(hosts)))
        biggest = max(h.numel() for h in hosts)
        self.slots = [torch.empty(biggest, dtype=torch.uint8, device=device) for _ in range(self.n_slots)]
        if cuda:
            self.stream = torch.cuda.Stream()
            self.copied = [torch.cuda.Event() for _ in hosts]
            self.consumed = [torch.cuda.Event() for _ in range(self.n_slots)]
        for k in range(self.n_slots):
            self.issue(k)

    def issue(self, k: int) -> None:
        import torch

        slot, host = self.slots[k % self.n_slots], self.hosts[k]
        if not self.cuda:
            slot[: host.numel()].copy_(host)
            return
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(self.consumed[k % self.n_slots])
            slot[: host.numel()].copy_(host, non_blocking=True)
            self.copied[k].record(self.stream)

    def get(self, k: int):
        import torch

        if self.cuda:
            torch.cuda.current_stream().wait_event(self.copied[k])
        return self.slots[k % self.n_slots][: self.hosts[k].numel()].view(torch.bfloat16).view(-1, self.hidden)

    def release(self, k: int) -> None:
        import torch

        if self.cuda:
            self.consumed[k % self.n_slots].record(torch.cuda.current_stream())
        self.issue((k + self.n_slots) % len(self.hosts))


def _device_matrix(nbytes: int, hidden: int, device):
    import torch

    t = torch.empty(nbytes, dtype=torch.uint8, device=device)
    if t.is_cuda:
        t.random_(0x30, 0x40)
    else:
        fill_random(t)
    return t.view(torch.bfloat16).view(-1, hidden)


class Arena:
    """One pinned host buffer, handed out in aligned slices (one allocation, not hundreds)."""

    def __init__(self, sizes: list[int], cuda: bool) -> None:
        import torch

        total = sum(_align(s) for s in sizes)
        self.buffer = torch.empty(max(total, 1), dtype=torch.uint8, pin_memory=cuda)
        fill_random(self.buffer, seed=1)
        self.offset = 0

    def take(self, nbytes: int):
        t = self.buffer[self.offset: self.offset + nbytes]
        self.offset += _align(nbytes)
        return t


def build(name: str, plan, shape: Shape, cuda: bool, device) -> Emulated:
    import torch

    from selective_offload.wrappers import HostGather, cuda_view_of_pinned

    h, rb = shape.hidden, shape.row_bytes()
    placement = {g.layer_index: g.placement for g in plan.groups if g.kind == "layer"}
    order = sorted(shape.layer_bytes)
    host_parts: dict[int, int] = {}
    hot_order: list[int] = []
    if name == "bulk":
        left = int(plan.bulk.offloaded_bytes * shape.scale) // rb * rb
        for i in order:
            take = min(left, shape.layer_bytes[i])
            host_parts[i], left = take, left - take
    elif name == "selective":
        hot_order = [i for i in order if placement[i] == "host-hot"]
    embed_on_host = name == "selective" and plan.placement_of("model.embed_tokens") == "host-cold"
    sizes = [host_parts.get(i, 0) for i in order if host_parts.get(i, 0)]
    sizes += [shape.layer_bytes[i] for i in hot_order]
    sizes += [shape.embed_rows * rb] if embed_on_host else []
    arena = Arena(sizes, cuda)

    layers, link, dev_read = [], 0, 0
    for i in order:
        layer, nbytes = Layer(i), shape.layer_bytes[i]
        if i in hot_order:
            layer.hot = hot_order.index(i)
            link += nbytes
            dev_read += nbytes
        else:
            on_host = host_parts.get(i, 0)
            if on_host:
                host = arena.take(on_host)
                view = cuda_view_of_pinned(host, device) if cuda else host
                layer.host_view = view.view(torch.bfloat16).view(-1, h)
                link += on_host
            if nbytes - on_host:
                layer.device = _device_matrix(nbytes - on_host, h, device)
                dev_read += nbytes - on_host
        layers.append(layer)
    emu = Emulated(name, layers, _device_matrix(shape.lm_head_rows * rb, h, device),
                   _device_matrix(shape.other_bytes, h, device), None)
    dev_read += shape.lm_head_rows * rb + shape.other_bytes
    emu.hot_hosts = [arena.take(shape.layer_bytes[i]) for i in hot_order]
    if embed_on_host:
        emu.embed = arena.take(shape.embed_rows * rb).view(torch.bfloat16).view(-1, h)
        emu.gather = HostGather(device, mode="host")
        link += rb
    else:
        emu.embed = _device_matrix(shape.embed_rows * rb, h, device)
        dev_read += rb
    if name != "selective" and shape.tower_bytes:
        # vLLM cannot offload the tower in these configurations: it occupies device memory.
        emu.unread.append(torch.empty(shape.tower_bytes, dtype=torch.uint8, device=device))
    if shape.mtp_bytes:
        # Speculative decoding's drafter: on the device in every configuration (the plan
        # made with speculative="mtp" keeps it there; vLLM's bulk offload is used up by
        # the target's layers before the drafter loads).
        emu.mtp = _device_matrix(shape.mtp_bytes, h, device)
    emu.arena = arena
    emu.link_bytes, emu.device_read_bytes, emu.overlap = link, dev_read, bool(hot_order)
    emu.row_bytes = rb
    return emu


class Runner:
    """An emulated model at work: its prefetcher (one, reused by every section, so the
    static slots are allocated once) and its current tokens. ``forward`` is one pass over
    the weights for ``n`` tokens; ``draft`` one MTP pass for one token."""

    def __init__(self, emu: Emulated, prefetch_step: int, cuda: bool, device) -> None:
        import torch

        self.emu, self.cuda, self.device = emu, cuda, device
        self.prefetch = (Prefetcher(emu.hot_hosts, prefetch_step, emu.lm_head.shape[1], cuda, device)
                         if emu.hot_hosts else None)
        self.vocab = min(emu.embed.shape[0], emu.lm_head.shape[0])
        self.tokens = torch.zeros(1, dtype=torch.long, device=device)
        self.hidden = torch.zeros(1, emu.lm_head.shape[1], dtype=torch.bfloat16, device=device)

    #: One token through ``torch.mv`` (the batch-1 section, as it always was) rather than a
    #: matrix product; the sweep and the verification section use a matrix product for
    #: every token count, 1 included, so their rows compare like with like (on this
    #: project's CPU a bf16 ``torch.mv`` is ~2x slower than the same bytes through ``x @ W.T``).
    matvec = True

    def lin(self, w, x):
        """``x @ w.T``, reading ``w`` once."""
        import torch

        return torch.mv(w, x[0]).unsqueeze(0) if self.matvec and x.shape[0] == 1 else x @ w.T

    @staticmethod
    def mix(x, y):
        import torch

        return (x * torch.rsqrt(1 + y.float().square().mean(-1, keepdim=True))).to(torch.bfloat16)

    def embed(self, tokens):
        import torch

        emu = self.emu
        if emu.gather is not None:
            return emu.gather(emu.embed, tokens)
        return torch.nn.functional.embedding(tokens, emu.embed)

    def logits_argmax(self, x):
        import torch

        return torch.argmax(self.lin(self.emu.lm_head, x)[:, : self.vocab], dim=-1)

    def forward(self, tokens):
        """One pass over every weight for ``tokens`` ([n]); the next token of each."""
        emu, lin, mix = self.emu, self.lin, self.mix
        x = self.embed(tokens)
        x = mix(x, lin(emu.other, x))
        for layer in emu.layers:
            if layer.hot is not None:
                w = self.prefetch.get(layer.hot)
                x = mix(x, lin(w, x))
                self.prefetch.release(layer.hot)
                continue
            if layer.host_view is not None:
                x = mix(x, lin(layer.host_view, x))
            if layer.device is not None:
                x = mix(x, lin(layer.device, x))
        self.hidden = x[-1:]
        return self.logits_argmax(x)

    def decode_step(self, batch: int) -> None:
        """``batch`` sequences, one token each."""
        import torch

        if self.tokens.numel() != batch:
            self.tokens = (torch.arange(batch, device=self.device) * 7919) % self.vocab
        self.tokens = self.forward(self.tokens)

    def draft(self, token):
        """One MTP draft pass: the token's embedding row and the target's last hidden state
        through the head's bytes, then the (shared) LM head."""
        x = self.embed(token) + self.hidden
        x = self.mix(x, self.lin(self.emu.mtp, x))
        self.hidden = x
        return self.logits_argmax(x)

    def drafts(self, k: int) -> list:
        token = self.tokens[-1:]
        out = [token]
        for _ in range(k):
            token = self.draft(token)
            out.append(token)
        return out

    def spec_step(self, k: int) -> None:
        """``k`` drafts, then ``k + 1`` tokens verified in one pass (the last accepted token
        and the drafts); the next step starts from the last position's token."""
        import torch

        if k == 0:
            self.decode_step(1)
            return
        self.tokens = self.forward(torch.cat(self.drafts(k)))[-1:]
