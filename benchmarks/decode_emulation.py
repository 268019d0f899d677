"""A decode step of a Qwen3.8-27B-FP8-sized model in plain torch, under a 24 GiB cap:
vLLM-style bulk offload against the selective placement, measured against bytes/bandwidth;
then the same placements at larger batches, and speculative decoding's verification step.

Why: the claim that selective offload beats ``cpu_offload_gb`` is a claim about bytes over
the link per step. This checks it on a GPU where vLLM cannot be installed (or before it
is): random weights with the reference checkpoint's byte counts, the planner's own
placement decisions (``make_plan`` on the bundled manifest), and the project's mechanism
pieces (``HostGather`` for the embedding, ``cuda_view_of_pinned`` for UVA reads).

The step. Every resident byte is read once per step, as a bandwidth-bound decode step
does: each decoder layer is one uint8 buffer of the layer's byte count (0.38 GB of FP8
weights), read as a bf16 matrix [rows, hidden] by one matrix-vector product (so an FP8
layer is emulated by a bf16 matrix of the same bytes: twice the bytes per element, half
the elements; the bytes read are exact, the FLOPs are not). Then the LM head (bf16,
248320 x 5120) and an argmax give the next token, whose embedding row starts the next
step. Attention, KV cache and activations beyond one vector are left out. A step of
``n`` tokens is the same pass with ``n`` rows: one matrix product per weight (``x @ W.T``),
every weight byte still crossing once (when the GEMM's tile covers the ``n`` rows).

Configurations (all from the plan for ``--device-memory``, default 24 GiB, scaled):

- ``bulk``: vLLM's ``cpu_offload_gb`` as the planner prices it (``plan.bulk``): the first
  bytes of the layer stack in model order live in pinned host memory and are read in
  place every step through a UVA device view (zero-copy, as vLLM's UVA offloader does);
  the embedding, LM head and vision tower stay on the device.
- ``selective``: the plan itself: the embedding in pinned host memory read by
  ``HostGather`` (one row per token crosses the link), the vision tower on the host (not
  read by a text step, so not allocated here), the LM head resident, and the plan's exact
  hot layers in pinned memory, prefetched on a side stream into ``prefetch_step`` static
  device slots (the next hot layer's copy overlaps the resident layers before it).
- ``resident``: everything on the device, no cap; run only when the device has room (a
  reference for the device-bandwidth term).

Sections:

1. **Batch 1** (the table it always had): first it measures the link (pinned
   host-to-device copy), the UVA read rate and the device read rate (the same
   matrix-vector product over resident memory); then it predicts each configuration's step
   time from its bytes (``est_``: link bytes / link rate + device bytes / device rate, the
   planner's formula; for ``selective`` also the fully overlapped bound max(link, device))
   and reports measured against predicted.
2. **Batch sweep** (``--batches``, default 1,4,16,64): the same built placements, a step
   of ``b`` sequences x 1 token; per-sequence tok/s (1 / step) and total tok/s (b / step)
   against est (the bytes barely grow with ``b``: est total tok/s is b / est step, the
   planner's upper bound). Attention and KV reads, which grow with the batch, are not
   emulated.
3. **Speculative verification** (``--draft-k``, default 1,2,3): placements re-planned for
   MTP speculative decoding (``make_plan(..., speculative="mtp")``: the MTP head resident,
   more layers hot). A step drafts ``K`` tokens, each one pass over an MTP-sized matrix
   (the head's bytes: its decoder layer and ``fc``) plus the LM head, its embedding row
   read the way the configuration reads the embedding, then verifies ``K + 1`` tokens in
   one pass over the weights. ``K = 0`` is a plain step on this placement. Reported: time
   per step (drafts included), the drafts alone, and the tokens per step a verification
   must yield to break even: against the plain step on this placement, and against the
   batch-1 step of the plan made without MTP (what turning MTP on must beat); with the
   per-token acceptance rate that yields them if acceptances are independent,
   ``E(K, a) = (1 - a**(K + 1)) / (1 - a)``.
4. **Routed experts** (``--experts``, default on): one MoE layer's routed experts in
   pinned host memory (Qwen3-30B-A3B's and gpt-oss-120b's shapes, scaled), a step of T
   tokens (1, 4, 16) reading the distinct experts its tokens route to in place through a
   UVA view inside a kernel, against copying the whole layer to the device first (what a
   prefetch offloader moves) and against device-resident reads
   (``_common.routed_expert_reads``). On CUDA this measures the UVA read efficiency the
   planner's host-uva price assumes; on the CPU "UVA" is a plain read (no link).

The cap: ``torch.cuda.set_per_process_memory_fraction(cap / total)``, checked to bind (an
allocation just over the cap must fail) and checked after each configuration and section
(peak allocated <= cap). Without CUDA the "device" is the CPU: streams are no-ops, prefetch
is a plain copy, the cap cannot be checked, and figures only show that the code runs.

``--scale`` multiplies every byte count (and shrinks hidden by its square root), so the
CPU path runs at 1% by default; on a GPU the default is the full size (``--small``: 1%,
fewer steps, seconds anywhere). ``--max-seconds`` bounds the timed steps of all sections
together (allocation and filling come on top, a few seconds per 10 GB; six placements are
built at most).

    python benchmarks/decode_emulation.py [--scale 1.0] [--device-memory 24GiB]
        [--steps 20] [--batches 1,4,16,64] [--draft-k 1,2,3] [--sweep-steps 10]
        [--max-seconds 240] [--small] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import gc
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import (  # noqa: E402
    EXPERT_SHAPES, RESULTS_DIR, device_name, fill_random, fmt, load_1min, md_table, measure_link_gbps,
    measure_read_gbps, result_stem, routed_expert_reads, routed_expert_rows, shared_note, spread, time_s, today,
    write_results,
)

MODEL = "qwen3.8-27b-fp8"
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


def timed(fn, steps: int, cuda: bool, deadline: float, warmup: int = 2) -> list[float]:
    import torch

    with torch.no_grad():
        return time_s(fn, steps, cuda, warmup=warmup, deadline=deadline)


class Budget:
    """``--max-seconds`` shared by every timed point, in proportion to its planned steps."""

    def __init__(self, seconds: float, weight: float) -> None:
        self.end, self.left = time.perf_counter() + seconds, weight

    def deadline(self, weight: float) -> float:
        now = time.perf_counter()
        share = max(0.0, self.end - now) * weight / max(self.left, weight)
        self.left -= weight
        return now + share

    def skip(self, weight: float) -> None:
        self.left -= weight


def predict(emu: Emulated, bw: dict, tokens: int = 1) -> dict:
    """est_ step time from bytes: link bytes / link rate + device bytes / device rate. A
    step of ``tokens`` tokens reads the same weights and ``tokens`` embedding rows."""
    link_rate = bw["link_gbps"]
    if emu.name == "bulk":
        # Bulk reads its host bytes in place: through a UVA view on CUDA, and on the CPU a
        # plain read of host memory, which is the device read there.
        link_rate = bw.get("uva_read_gbps") or bw["device_read_gbps"]
    rows = (tokens - 1) * emu.row_bytes
    link_bytes = emu.link_bytes + (rows if emu.gather is not None else 0)
    device_bytes = emu.device_read_bytes + (0 if emu.gather is not None else rows)
    link_s = link_bytes / (link_rate * 1e9)
    vram_s = device_bytes / (bw["device_read_gbps"] * 1e9)
    out = {"link_bytes_per_step": link_bytes, "device_read_bytes_per_step": device_bytes,
           "est_link_s": link_s, "est_device_s": vram_s, "est_step_s": link_s + vram_s,
           "link_rate_used_gbps": link_rate}
    if emu.overlap:
        out["est_step_s_overlapped"] = max(link_s, vram_s)
    return out


def draft_bytes(emu: Emulated) -> tuple[int, int]:
    """(device bytes, link bytes) one draft pass reads: the head, the LM head, one row."""
    dev = emu.mtp.numel() * 2 + emu.lm_head.numel() * 2
    return (dev, emu.row_bytes) if emu.gather is not None else (dev + emu.row_bytes, 0)


def expected_tokens(k: int, accept: float) -> float:
    """Tokens a verification step yields with ``k`` drafts, each accepted with probability
    ``accept`` independently (the accepted prefix plus the target's own token)."""
    if accept >= 1.0:
        return float(k + 1)
    return (1.0 - accept ** (k + 1)) / (1.0 - accept)


def break_even_accept(k: int, tokens: float) -> float | None:
    """The acceptance rate at which ``expected_tokens(k, .) == tokens``; None when even
    every draft accepted (k + 1 tokens) is not enough."""
    if tokens <= 1.0:
        return 0.0
    if tokens > k + 1:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens(k, mid) < tokens else (lo, mid)
    return (lo + hi) / 2


@dataclass
class Ctx:
    cuda: bool
    device: object
    cap_info: dict
    bw: dict
    budget: Budget
    prefetch_step: int


def _cap_for(ctx: Ctx, capped: bool) -> None:
    import torch

    if ctx.cuda:
        torch.cuda.set_per_process_memory_fraction(ctx.cap_info["fraction"] if capped else 1.0, ctx.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(ctx.device)


def _peak(ctx: Ctx, row: dict, capped: bool, key: str = "peak_device_bytes") -> None:
    import torch

    if ctx.cuda:
        peak = torch.cuda.max_memory_allocated(ctx.device)
        row[key] = peak
        if capped:
            row["under_cap"] = peak <= ctx.cap_info["cap_bytes"] and row.get("under_cap", True)
        else:
            row["under_cap"] = None


def _free(ctx: Ctx) -> None:
    import torch

    gc.collect()
    if ctx.cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        getattr(torch._C, "_host_emptyCache", lambda: None)()


def measure_placement(ctx: Ctx, name: str, plan, shape: Shape, steps: int, batches: list[int],
                      sweep_steps: int) -> tuple[dict, dict | None]:
    """Section 1 (batch 1) and section 2 (the batch sweep) on one built placement."""
    import torch

    row: dict = {"config": name}
    sweep: dict = {"config": name, "rows": []}
    capped = name != "resident"
    _cap_for(ctx, capped)
    t0 = time.perf_counter()
    try:
        emu = build(name, plan, shape, ctx.cuda, ctx.device)
        runner = Runner(emu, ctx.prefetch_step, ctx.cuda, ctx.device)
    except torch.OutOfMemoryError as err:
        row.update(status="does not fit the cap", error=str(err).splitlines()[0])
        sweep.update(status=row["status"])
        ctx.budget.skip(steps + sweep_steps * len(batches))
        return row, sweep
    row["build_s"] = time.perf_counter() - t0
    row.update(predict(emu, ctx.bw))
    times = timed(lambda: runner.decode_step(1), steps, ctx.cuda, ctx.budget.deadline(steps))
    s = spread(times)
    row.update(status="measured", capped=capped, step_s=s, tok_s=1.0 / s["median"],
               measured_over_est=s["median"] / row["est_step_s"])
    if "est_step_s_overlapped" in row:
        row["measured_over_est_overlapped"] = s["median"] / row["est_step_s_overlapped"]
    _peak(ctx, row, capped)
    row["host_pinned_bytes"] = emu.arena.buffer.numel()
    print(f"{name}: step {s['median'] * 1e3:.2f} ms (est {row['est_step_s'] * 1e3:.2f} ms)", flush=True)

    sweep.update(status="measured", capped=capped)
    runner.matvec = False
    for n, b in enumerate(batches):
        point: dict = {"batch": b}
        try:
            times = timed(lambda: runner.decode_step(b), sweep_steps, ctx.cuda,
                          ctx.budget.deadline(sweep_steps), warmup=1)
        except torch.OutOfMemoryError as err:
            point.update(status="does not fit the cap", error=str(err).splitlines()[0])
            sweep["rows"].append(point)
            ctx.budget.skip(sweep_steps * (len(batches) - n - 1))
            break  # a larger batch needs more; the prefetcher's cycle is broken anyway
        s = spread(times)
        est = predict(emu, ctx.bw, tokens=b)
        point.update(status="measured", step_s=s, per_seq_tok_s=1.0 / s["median"],
                     total_tok_s=b / s["median"], est_step_s=est["est_step_s"],
                     est_total_tok_s=b / est["est_step_s"],
                     measured_over_est=s["median"] / est["est_step_s"])
        sweep["rows"].append(point)
        print(f"{name} batch {b}: step {s['median'] * 1e3:.2f} ms, {b / s['median']:.1f} tok/s in all",
              flush=True)
    _peak(ctx, sweep, capped)
    runner = emu = None  # noqa: F841 (frees the placement before the next is built)
    _free(ctx)
    return row, sweep


def measure_verification(ctx: Ctx, name: str, plan, shape: Shape, ks: list[int], steps: int,
                         plain_step_s: float | None) -> dict:
    """Section 3 on one placement of the MTP plan: K = 0 (a plain step), then each K."""
    import torch

    out: dict = {"config": name, "rows": []}
    capped = name != "resident"
    points = [0] + ks
    weight = steps * (len(points) + len(ks))
    _cap_for(ctx, capped)
    t0 = time.perf_counter()
    try:
        emu = build(name, plan, shape, ctx.cuda, ctx.device)
        runner = Runner(emu, ctx.prefetch_step, ctx.cuda, ctx.device)
    except torch.OutOfMemoryError as err:
        out.update(status="does not fit the cap", error=str(err).splitlines()[0])
        ctx.budget.skip(weight)
        return out
    runner.matvec = False
    out.update(status="measured", capped=capped, build_s=time.perf_counter() - t0,
               host_pinned_bytes=emu.arena.buffer.numel())
    base = predict(emu, ctx.bw)
    dev_b, link_b = draft_bytes(emu)
    out.update(link_bytes_per_step=base["link_bytes_per_step"],
               device_read_bytes_per_step=base["device_read_bytes_per_step"],
               draft_device_bytes=dev_b, draft_link_bytes=link_b)
    est_draft_one = dev_b / (ctx.bw["device_read_gbps"] * 1e9) + link_b / (ctx.bw["link_gbps"] * 1e9)
    k0 = None
    for k in points:
        point: dict = {"k": k, "tokens_verified": k + 1}
        try:
            s = spread(timed(lambda: runner.spec_step(k), steps, ctx.cuda, ctx.budget.deadline(steps), warmup=1))
            d = (spread(timed(lambda: runner.drafts(k), steps, ctx.cuda, ctx.budget.deadline(steps), warmup=1))
                 if k else None)
        except torch.OutOfMemoryError as err:
            point.update(status="does not fit the cap", error=str(err).splitlines()[0])
            out["rows"].append(point)
            break
        est = predict(emu, ctx.bw, tokens=k + 1)["est_step_s"] + k * est_draft_one
        point.update(status="measured", step_s=s, draft_s=d, est_step_s=est, est_draft_s=k * est_draft_one,
                     measured_over_est=s["median"] / est, max_tok_s=(k + 1) / s["median"])
        if k == 0:
            k0 = point
        # Acceptance rates only where there are drafts to accept (K >= 1).
        if k0 is not None:
            need = s["median"] / k0["step_s"]["median"]
            point.update(break_even_tokens_per_step=need, est_break_even_tokens_per_step=est / k0["est_step_s"])
            if k:
                point["break_even_accept_rate"] = break_even_accept(k, need)
        if plain_step_s:
            need = s["median"] / plain_step_s
            point["break_even_tokens_vs_plain_plan"] = need
            if k:
                point["break_even_accept_rate_vs_plain_plan"] = break_even_accept(k, need)
        out["rows"].append(point)
        print(f"{name} K={k}: step {s['median'] * 1e3:.2f} ms"
              + (f" (drafts {d['median'] * 1e3:.2f} ms)" if d else "")
              + (f", break even at {point['break_even_tokens_per_step']:.2f} tokens/step"
                 if "break_even_tokens_per_step" in point else ""), flush=True)
    _peak(ctx, out, capped)
    runner = emu = None  # noqa: F841 (frees the placement before the next is built)
    _free(ctx)
    return out


def _ints(text: str, flag: str, least: int) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{flag} takes whole numbers separated by commas, got {text!r}") from None
    if any(v < least for v in values):
        raise ValueError(f"{flag} values must be at least {least}, got {text!r}")
    return sorted(set(values))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=float, default=None,
                    help="multiply every byte count (default 1.0 on CUDA, 0.01 on the CPU)")
    ap.add_argument("--device-memory", default="24GiB", help="the card to emulate (default 24GiB)")
    ap.add_argument("--steps", type=int, default=20, help="timed decode steps per configuration at batch 1")
    ap.add_argument("--batches", default="1,4,16,64",
                    help="batch sizes of the batch sweep, comma-separated ('' skips it)")
    ap.add_argument("--draft-k", default="1,2,3",
                    help="draft tokens K of the verification section, comma-separated ('' skips it)")
    ap.add_argument("--sweep-steps", type=int, default=10,
                    help="timed steps per point of the batch sweep and the verification section")
    ap.add_argument("--max-seconds", type=float, default=240.0,
                    help="bound on the timed steps of all sections together")
    ap.add_argument("--small", action="store_true",
                    help="scale 0.01, 5 steps, 3 per sweep point (seconds, on a GPU or the CPU)")
    ap.add_argument("--smoke", action="store_true", help="scale 0.0005, 3 steps (seconds, for the tests)")
    ap.add_argument("--no-experts", dest="experts", action="store_false",
                    help="skip the routed-experts section")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = ap.parse_args(argv)

    from selective_offload.errors import UserError
    from selective_offload.sizes import parse_size

    try:
        device_memory = parse_size(args.device_memory, "--device-memory")
        batches = _ints(args.batches, "--batches", 1)
        ks = _ints(args.draft_k, "--draft-k", 1)
    except (UserError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    import torch

    from selective_offload.checkpoint import load_checkpoint
    from selective_offload.cli import BUNDLED
    from selective_offload.planner import PlanInputs, make_plan

    cuda = torch.cuda.is_available()
    quick = args.smoke or args.small
    scale = args.scale if args.scale is not None else (
        0.0005 if args.smoke else 0.01 if args.small else (1.0 if cuda else 0.01))
    steps = 3 if args.smoke else 5 if args.small else args.steps
    sweep_steps = 3 if quick else args.sweep_steps
    if not (0 < scale <= 1) or steps < 1 or sweep_steps < 1 or args.max_seconds <= 0:
        print("error: --scale must be in (0, 1], --steps, --sweep-steps and --max-seconds positive",
              file=sys.stderr)
        return 2
    if not cuda:
        torch.set_num_threads(1)  # steadier on a shared machine; the bandwidths use it too
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    started, load_before = time.perf_counter(), load_1min()

    # ---- bandwidths, then the plan made with them
    probe = max(1 << 20, int((1 << 30) * scale))
    bw = {"probe_bytes": probe, "link_gbps": measure_link_gbps(probe, cuda),
          "device_read_gbps": measure_read_gbps(probe, cuda)}
    if cuda:
        from selective_offload.wrappers import cuda_view_of_pinned

        from selective_offload.probe import gemv_read_s

        host = fill_random(torch.empty(probe, dtype=torch.uint8, pin_memory=True))
        view = cuda_view_of_pinned(host, device).view(torch.bfloat16).view(-1, 4096)
        bw["uva_read_gbps"] = view.numel() * 2 / gemv_read_s(view, repeats=5, warmup=2, cuda=device, cols=4096) / 1e9
        del host, view
    else:
        bw["note"] = "no CUDA: link and device are both host memory here"
    print(f"bandwidths: {bw}", flush=True)
    ckpt = load_checkpoint(BUNDLED[MODEL])
    plan = make_plan(ckpt, PlanInputs(device_memory_bytes=device_memory, link_gbps=bw["link_gbps"],
                                      vram_gbps=bw["device_read_gbps"], decode_read_gbps=bw["device_read_gbps"]))
    if plan.strategy == "infeasible" or plan.bulk is None:
        print(f"error: the plan for {args.device_memory} is {plan.strategy}; nothing to compare", file=sys.stderr)
        return 2
    shape = Shape.from_plan(plan, scale)

    # ---- the MTP plan of the verification section (or why there is none)
    verify: dict = {"draft_k": ks, "steps": sweep_steps, "configs": []}
    plan_mtp = shape_mtp = None
    if ks:
        try:
            plan_mtp = make_plan(ckpt, PlanInputs(device_memory_bytes=device_memory, link_gbps=bw["link_gbps"],
                                                  vram_gbps=bw["device_read_gbps"],
                                                  decode_read_gbps=bw["device_read_gbps"], speculative="mtp"))
        except (TypeError, ValueError, UserError) as err:
            verify["skipped"] = f"no plan for MTP speculative decoding: {str(err).splitlines()[0]}"
        if plan_mtp is not None:
            shape_mtp = Shape.from_plan(plan_mtp, scale)
            if plan_mtp.strategy == "infeasible":
                verify["skipped"] = f"the plan for MTP speculative decoding is infeasible at {args.device_memory}"
            elif not shape_mtp.mtp_bytes:
                verify["skipped"] = "the checkpoint has no MTP head to draft with"
            elif shape_mtp.mtp_placement != "device":
                verify["skipped"] = (f"the plan puts the MTP head at {shape_mtp.mtp_placement}; the emulation "
                                     "drafts from a head on the device only")
        if plan_mtp is not None and "skipped" not in verify:
            verify["plan"] = {
                "strategy": plan_mtp.strategy, "hot_layer_indices": list(plan_mtp.hot_layer_indices),
                "mtp_bytes_full_scale": sum(g.bytes for g in plan_mtp.groups
                                            if getattr(g, "mtp", False) and g.placement != "absent"),
                "mtp_placement": shape_mtp.mtp_placement,
                "host_hot_bytes": plan_mtp.host_hot_bytes,
                "bulk_cpu_offload_gb": plan_mtp.bulk.cpu_offload_gb if plan_mtp.bulk else None,
                "bulk_offloaded_bytes": plan_mtp.bulk.offloaded_bytes if plan_mtp.bulk else None,
            }
    else:
        verify["skipped"] = "--draft-k is empty"

    # ---- the cap
    cap = int(device_memory * scale)
    cap_info: dict = {"cap_bytes": cap}
    if cuda:
        total = torch.cuda.get_device_properties(device).total_memory
        cap_info["device_total_bytes"] = total
        cap_info["fraction"] = min(1.0, cap / total)
        torch.cuda.set_per_process_memory_fraction(cap_info["fraction"], device)
        try:
            torch.empty(cap + (64 << 20), dtype=torch.uint8, device=device)
            cap_info["binds"] = False
        except torch.OutOfMemoryError:
            cap_info["binds"] = True
        torch.cuda.empty_cache()
    else:
        cap_info["binds"] = None
        cap_info["note"] = "no CUDA: host memory is the device; the cap cannot be set or checked"

    def fits_resident(s: Shape) -> bool:
        return not cuda or s.loaded_bytes() < 0.85 * torch.cuda.mem_get_info(device)[0]

    names = ["bulk", "selective"] + (["resident"] if fits_resident(shape) else [])
    vnames = []
    if "skipped" not in verify:
        vnames = (["bulk"] if plan_mtp.bulk is not None else []) + ["selective"] \
            + (["resident"] if fits_resident(shape_mtp) else [])
    weight = len(names) * (steps + sweep_steps * len(batches)) + len(vnames) * sweep_steps * (1 + 2 * len(ks))
    ctx = Ctx(cuda, device, cap_info, bw, Budget(args.max_seconds, weight), plan.inputs.prefetch_step)

    configs, sweeps = [], []
    for name in names:
        row, sweep = measure_placement(ctx, name, plan, shape, steps, batches, sweep_steps)
        configs.append(row)
        if batches:
            sweeps.append(sweep)
    # The plain step the verification is compared with: the sweep's batch 1 (the same
    # matrix-product kernels), else the batch-1 section's.
    plain = {c["config"]: c["step_s"]["median"] for c in configs if c["status"] == "measured"}
    verify["plain_plan_reference"] = "batch-1 section (torch.mv)"
    for sw in sweeps:
        one = next((p for p in sw["rows"] if p["batch"] == 1 and p["status"] == "measured"), None)
        if one is not None:
            plain[sw["config"]] = one["step_s"]["median"]
            verify["plain_plan_reference"] = "batch sweep, batch 1"
    for name in vnames:
        verify["configs"].append(measure_verification(ctx, name, plan_mtp, shape_mtp, ks, sweep_steps,
                                                      plain.get(name)))

    experts_section = measure_routed_experts(cuda, device, scale, quick) if args.experts else {
        "skipped": "--no-experts"}

    result = {
        "routed_experts": experts_section,
        "benchmark": "decode-emulation", "date": today(), "device": device_name(cuda), "cuda": cuda,
        "torch": torch.__version__, "torch_threads": torch.get_num_threads(), "smoke": args.smoke,
        "small": args.small, "model": MODEL, "scale": scale, "hidden": shape.hidden,
        "device_memory_bytes": device_memory, "steps": steps,
        "bandwidth": bw, "cap": cap_info,
        "plan": {"strategy": plan.strategy, "hot_layer_indices": list(plan.hot_layer_indices),
                 "host_cold_bytes": plan.host_cold_bytes, "host_hot_bytes": plan.host_hot_bytes,
                 "prefetch_buffer_bytes": plan.prefetch_buffer_bytes,
                 "est_step_s_full_scale": plan.est.est_step_s,
                 "bulk_cpu_offload_gb": plan.bulk.cpu_offload_gb,
                 "bulk_offloaded_bytes": plan.bulk.offloaded_bytes,
                 "bulk_est_step_s_full_scale": plan.bulk.est.est_step_s},
        "configs": configs,
        "batch_sweep": {"batches": batches, "steps": sweep_steps, "configs": sweeps}
        if batches else {"batches": [], "skipped": "--batches is empty"},
        "verification": verify,
        "wall_s": time.perf_counter() - started,
    }
    result["load_note"] = shared_note(load_before, load_1min())
    bulk = next((c for c in configs if c["config"] == "bulk" and c["status"] == "measured"), None)
    sel = next((c for c in configs if c["config"] == "selective" and c["status"] == "measured"), None)
    if bulk and sel:
        result["speedup_selective_over_bulk"] = bulk["step_s"]["median"] / sel["step_s"]["median"]
        result["est_speedup_selective_over_bulk"] = bulk["est_step_s"] / sel["est_step_s"]
    if batches:
        by = {(s["config"], p["batch"]): p for s in sweeps for p in s["rows"] if p.get("status") == "measured"}
        result["batch_sweep"]["speedup_selective_over_bulk"] = {
            str(b): by[("bulk", b)]["step_s"]["median"] / by[("selective", b)]["step_s"]["median"]
            for b in batches if ("bulk", b) in by and ("selective", b) in by}
    suffix = "-smoke" if args.smoke else "-small" if args.small else ""
    stem = result_stem("decode-emulation", cuda, result["device"]) + suffix
    paths = write_results(args.out, stem, result, markdown(result))
    print(f"wrote {paths[0]} and {paths[1]}")
    sections = configs + sweeps + verify["configs"]
    failed = any(c.get("under_cap") is False for c in sections) or cap_info.get("binds") is False
    return 1 if failed else 0


def markdown(r: dict) -> str:
    bw, plan, cap = r["bandwidth"], r["plan"], r["cap"]
    rows = []
    for c in r["configs"]:
        if c["status"] != "measured":
            rows.append([c["config"], c["status"]] + [""] * 8)
            continue
        s = c["step_s"]
        est = f"{c['est_step_s'] * 1e3:.2f}"
        if "est_step_s_overlapped" in c:
            est += f" (overlapped {c['est_step_s_overlapped'] * 1e3:.2f})"
        rows.append([
            c["config"], "measured" + ("" if c["capped"] else " (no cap)"),
            f"{c['link_bytes_per_step'] / 1e6:.1f}", f"{c['device_read_bytes_per_step'] / 1e6:.1f}",
            f"{s['median'] * 1e3:.2f} ({s['min'] * 1e3:.2f}-{s['max'] * 1e3:.2f})", est,
            fmt(c["measured_over_est"]), fmt(c["tok_s"], 1),
            "n/a" if c.get("peak_device_bytes") is None else f"{c['peak_device_bytes'] / 1e9:.2f}",
            {True: "yes", False: "NO", None: "n/a"}[c.get("under_cap")],
        ])
    speed = ""
    if "speedup_selective_over_bulk" in r:
        speed = (f"\nSelective over bulk: **{r['speedup_selective_over_bulk']:.2f}x** measured, "
                 f"{r['est_speedup_selective_over_bulk']:.2f}x est.\n")
    where = ("" if r["cuda"] else
             " No CUDA: the \"device\" is the CPU (link = host memory copy, streams are no-ops, "
             "prefetch is a synchronous copy), so the figures show that the code runs and how "
             "the prediction tracks bytes, not what a GPU does.")
    return (
        f"# Decode-step emulation: {r['model']} under a {r['device_memory_bytes'] / 2**30:g} GiB cap, "
        f"{r['device']}\n\n"
        f"Date {r['date']}, torch {r['torch']}, scale {r['scale']:g} (hidden {r['hidden']}), "
        f"{r['torch_threads']} torch thread(s); whole run {r['wall_s']:.0f} s; {r['load_note']}.{where}\n\n"
        f"Bandwidths measured first: link {bw['link_gbps']:.2f} GB/s (pinned copy), device read "
        f"{bw['device_read_gbps']:.2f} GB/s (bf16 GEMV)"
        + (f", UVA read {bw['uva_read_gbps']:.2f} GB/s" if bw.get("uva_read_gbps") else "")
        + f". Cap {cap['cap_bytes'] / 1e9:.3f} GB: "
        + ("binds (an allocation just over it fails)" if cap["binds"] else
           "does NOT bind" if cap["binds"] is False else cap.get("note", "n/a"))
        + f".\n\nPlan (bundled manifest, full scale): {plan['strategy']}, hot layers "
        f"{plan['hot_layer_indices']}, est step {plan['est_step_s_full_scale'] * 1e3:.0f} ms; bulk "
        f"cpu_offload_gb={plan['bulk_cpu_offload_gb']:g} ({plan['bulk_offloaded_bytes'] / 1e9:.2f} GB), "
        f"est step {plan['bulk_est_step_s_full_scale'] * 1e3:.0f} ms (with the bandwidths above).\n\n"
        + md_table(["config", "status", "link MB/step", "device MB/step", "step ms median (min-max)",
                    "est step ms", "measured/est", "tok/s", "peak device GB", "under cap"], rows)
        + speed
        + "\nest = link bytes / link rate + device bytes / device rate (bulk's link rate is the UVA "
          "read rate on CUDA, the device read rate on the CPU); it ignores launch overhead (64+ small kernels per step dominate at "
          "small scales), the argmax and the host gather's device-to-host sync.\n"
        + markdown_sweep(r) + markdown_verification(r) + markdown_experts(r)
    )


def measure_routed_experts(cuda: bool, device, scale: float, quick: bool) -> dict:
    """Section 4: each reference MoE layer's routed experts, scaled like everything else."""
    out = {"shapes": {}}
    for name, shape in EXPERT_SHAPES.items():
        expert_bytes = max(1 << 16, int(shape["expert_bytes"] * scale))
        out["shapes"][name] = routed_expert_reads(shape["num_experts"], shape["experts_per_token"], expert_bytes,
                                                  cuda, tokens=(1, 4) if quick else (1, 4, 16),
                                                  iters=3 if quick else 10, device=device)
        print(f"routed experts {name}: {[(p['tokens'], p['uva_speedup_over_copy']) for p in out['shapes'][name]['rows']]}",
              flush=True)
    return out


def markdown_experts(r: dict) -> str:
    section = r.get("routed_experts") or {}
    if "skipped" in section:
        return f"\n## Routed experts\n\nSkipped: {section['skipped']}.\n"
    parts = ["\n## Routed experts: k of E read through a UVA view against a whole-layer copy\n\n"
             "Distinct experts the step's tokens route to (uniform random top-k), each read once in place by "
             "a GEMV through a device view of pinned host memory (uva), against copying the whole layer "
             "first (copy, what the prefetch offloader moves) and device-resident reads; est distinct = "
             "E x expert_read_fraction.\n"]
    for name, e in section.get("shapes", {}).items():
        parts.append(f"\n{name} ({e['num_experts']} experts top-{e['experts_per_token']}, "
                     f"{e['expert_bytes'] / 1e6:.2f} MB an expert at this scale; {e['uva']}):\n\n")
        parts.append(md_table(*routed_expert_rows(e)))
    return "".join(parts)


def _ms(s: dict | None) -> str:
    if not s:
        return ""
    return f"{s['median'] * 1e3:.2f} ({s['min'] * 1e3:.2f}-{s['max'] * 1e3:.2f})"


def _cap_cell(c: dict) -> list[str]:
    return ["n/a" if c.get("peak_device_bytes") is None else f"{c['peak_device_bytes'] / 1e9:.2f}",
            {True: "yes", False: "NO", None: "n/a"}[c.get("under_cap")]]


def markdown_sweep(r: dict) -> str:
    sweep = r.get("batch_sweep") or {}
    head = "\n## Batch sweep: the same placements, b sequences x 1 token per step\n\n"
    if sweep.get("skipped"):
        return head + f"Skipped: {sweep['skipped']}.\n"
    rows = []
    for c in sweep["configs"]:
        if c.get("status") != "measured":
            rows.append([c["config"], "", c.get("status", "")] + [""] * 8)
            continue
        for p in c["rows"]:
            if p["status"] != "measured":
                rows.append([c["config"], p["batch"], p["status"]] + [""] * 8)
                continue
            rows.append([c["config"] + ("" if c["capped"] else " (no cap)"), p["batch"], "measured",
                         _ms(p["step_s"]), f"{p['est_step_s'] * 1e3:.2f}", fmt(p["measured_over_est"]),
                         fmt(p["per_seq_tok_s"], 1), fmt(p["total_tok_s"], 1), fmt(p["est_total_tok_s"], 1)]
                        + _cap_cell(c))
    speed = sweep.get("speedup_selective_over_bulk") or {}
    line = ("\nSelective over bulk, total tok/s: "
            + ", ".join(f"batch {b}: **{v:.2f}x**" for b, v in speed.items()) + ".\n") if speed else ""
    return (head + f"{sweep['steps']} timed steps per point (after one warm-up), median (min-max); one "
            "matrix product per weight for every batch, 1 included (the batch-1 table above uses a "
            "matrix-vector product). "
            "est total tok/s = b / est step: the weights' bytes do not grow with the batch, so est is an "
            "upper bound that larger batches fall behind (compute, and here no attention or KV reads: a "
            "real batch reads each sequence's KV cache too). Peak device memory and the cap: over the "
            "configuration's batch-1 and sweep steps together.\n\n"
            + md_table(["config", "batch", "status", "step ms median (min-max)", "est step ms", "measured/est",
                        "tok/s per sequence", "tok/s total", "est tok/s total", "peak device GB", "under cap"],
                       rows)
            + line)


def markdown_verification(r: dict) -> str:
    v = r.get("verification") or {}
    head = "\n## Speculative decoding: K drafts, K + 1 tokens verified in one pass\n\n"
    if v.get("skipped"):
        return head + f"Skipped: {v['skipped']}.\n"
    plan = v["plan"]
    rows = []
    for c in v["configs"]:
        if c.get("status") != "measured":
            rows.append([c["config"], "", c.get("status", "")] + [""] * 9)
            continue
        for p in c["rows"]:
            if p["status"] != "measured":
                rows.append([c["config"], p["k"], p["status"]] + [""] * 9)
                continue
            def acceptance(key: str) -> str:
                if key not in p:
                    return "n/a" if p["k"] else ""  # K = 0: no drafts to accept
                return "never" if p[key] is None else fmt(p[key])
            rows.append([
                c["config"] + ("" if c["capped"] else " (no cap)"), p["k"], p["tokens_verified"],
                _ms(p["step_s"]), _ms(p["draft_s"]) or "none", f"{p['est_step_s'] * 1e3:.2f}",
                fmt(p.get("break_even_tokens_per_step")), fmt(p.get("est_break_even_tokens_per_step")),
                acceptance("break_even_accept_rate"),
                fmt(p.get("break_even_tokens_vs_plain_plan")),
                acceptance("break_even_accept_rate_vs_plain_plan"),
                fmt(p["max_tok_s"], 1),
            ])
    bulk = (f"bulk cpu_offload_gb={plan['bulk_cpu_offload_gb']:g}" if plan.get("bulk_cpu_offload_gb") is not None
            else "no bulk baseline")
    return (
        head
        + f"Placements re-planned with speculative=\"mtp\": the MTP head "
          f"({plan['mtp_bytes_full_scale'] / 1e9:.2f} GB at full scale) on the {plan['mtp_placement']}, hot layers "
          f"{plan['hot_layer_indices']}, {bulk}. A step: K draft passes (each: one embedding row, one pass over "
          "the head's bytes, the LM head, an argmax; the head's bytes as one matrix), then K + 1 tokens through "
          f"one pass over the weights. K = 0 is a plain step on this placement. {v['steps']} timed steps per "
          "point, median (min-max); drafts timed alone too.\n\n"
        + md_table(["config", "K", "tokens verified", "step ms (drafts + verify)", "drafts alone ms",
                    "est step ms", "break-even tokens/step", "est break-even", "break-even acceptance",
                    "break-even tokens/step vs plain plan", "acceptance vs plain plan",
                    "tok/s if all accepted"], rows)
        + "\nBreak-even tokens/step: step time / the K = 0 step on the same placement, the tokens a "
          "verification step must yield on average (accepted drafts + 1) to match plain decoding there; "
          "vs plain plan: / the batch-1 step of the plan made without MTP (what turning MTP on must beat, "
          f"the head's bytes displacing layers included; from the {v.get('plain_plan_reference')}). Acceptance: the per-draft acceptance rate that "
          "yields those tokens when acceptances are independent, E(K, a) = (1 - a^(K+1)) / (1 - a); "
          "never: more than K + 1 tokens would be needed. est = the bytes of the verify pass and of K "
          "drafts over their rates.\n"
        + "".join(f"\n{c['config']}: peak device {c['peak_device_bytes'] / 1e9:.2f} GB, under cap "
                  f"{ {True: 'yes', False: 'NO', None: 'n/a'}[c.get('under_cap')] }."
                  for c in v["configs"] if c.get("peak_device_bytes") is not None)
        + ("\n" if r["cuda"] else "")
    )


if __name__ == "__main__":
    sys.exit(main())
