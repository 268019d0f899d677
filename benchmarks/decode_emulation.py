"""A decode step of a Qwen3.8-27B-FP8-sized model in plain torch, under a 24 GiB cap:
vLLM-style bulk offload against the selective placement, measured against bytes/bandwidth.

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
step. Attention, KV cache and activations beyond one vector are left out.

Configurations (all from the plan for ``--device-memory``, default 24 GiB, scaled):

- ``bulk``: vLLM's ``cpu_offload_gb`` as the planner prices it (``plan.bulk``): the first
  bytes of the layer stack in model order live in pinned host memory and are read in
  place every step through a UVA device view (zero-copy, as vLLM's UVA offloader does);
  the embedding, LM head and vision tower stay on the device.
- ``selective``: the plan itself: the embedding in pinned host memory read by
  ``HostGather`` (one row per step crosses the link), the vision tower on the host (not
  read by a text step, so not allocated here), the LM head resident, and the plan's exact
  hot layers in pinned memory, prefetched on a side stream into ``prefetch_step`` static
  device slots (the next hot layer's copy overlaps the resident layers before it).
- ``resident``: everything on the device, no cap; run only when the device has room (a
  reference for the device-bandwidth term).

First it measures the link (pinned host-to-device copy), the UVA read rate and the
device read rate (the same matrix-vector product over resident memory); then it predicts
each configuration's step time from its bytes (``est_``: link bytes / link rate + device
bytes / device rate, the planner's formula; for ``selective`` also the fully overlapped
bound max(link, device)) and reports measured against predicted.

The cap: ``torch.cuda.set_per_process_memory_fraction(cap / total)``, checked to bind (an
allocation just over the cap must fail) and checked after each configuration (peak
allocated <= cap). Without CUDA the "device" is the CPU: streams are no-ops, prefetch is a
plain copy, the cap cannot be checked, and figures only show that the code runs.

``--scale`` multiplies every byte count (and shrinks hidden by its square root), so the
CPU path runs at 1% by default; on a GPU the default is the full size. ``--max-seconds``
bounds the timed steps (allocation and filling come on top, a few seconds per 10 GB).

    python benchmarks/decode_emulation.py [--scale 1.0] [--device-memory 24GiB]
        [--steps 20] [--max-seconds 240] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import gc
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import (  # noqa: E402
    RESULTS_DIR, device_name, fill_random, fmt, load_1min, md_table, measure_link_gbps,
    measure_read_gbps, result_stem, shared_note, spread, time_s, today, write_results,
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

    @classmethod
    def from_plan(cls, plan, scale: float) -> "Shape":
        hidden = max(64, int(round(REF_HIDDEN * math.sqrt(scale) / 64)) * 64)
        layer_bytes, embed, lm_head, other, tower = {}, 0, 0, 0, 0
        for g in plan.groups:
            if g.placement == "absent":
                continue
            if g.kind == "layer":
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
                   rows(embed), rows(lm_head), rows(other) * 2 * hidden, int(tower * scale))

    def row_bytes(self) -> int:
        return 2 * self.hidden


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
    emu.arena = arena
    emu.link_bytes, emu.device_read_bytes, emu.overlap = link, dev_read, bool(hot_order)
    return emu


def run_steps(emu: Emulated, prefetch_step: int, steps: int, deadline: float, cuda: bool, device) -> list[float]:
    import torch

    prefetch = (Prefetcher(emu.hot_hosts, prefetch_step, emu.lm_head.shape[1], cuda, device)
                if emu.hot_hosts else None)
    vocab = min(emu.embed.shape[0], emu.lm_head.shape[0])
    token = torch.zeros(1, dtype=torch.long, device=device)

    def mix(x, y):
        return (x * torch.rsqrt(1 + y.float().square().mean())).to(torch.bfloat16)

    def step():
        nonlocal token
        if emu.gather is not None:
            x = emu.gather(emu.embed, token)[0]
        else:
            x = torch.nn.functional.embedding(token, emu.embed)[0]
        x = mix(x, torch.mv(emu.other, x))
        for layer in emu.layers:
            if layer.hot is not None:
                w = prefetch.get(layer.hot)
                x = mix(x, torch.mv(w, x))
                prefetch.release(layer.hot)
                continue
            if layer.host_view is not None:
                x = mix(x, torch.mv(layer.host_view, x))
            if layer.device is not None:
                x = mix(x, torch.mv(layer.device, x))
        token = torch.argmax(torch.mv(emu.lm_head, x)[:vocab]).view(1)

    with torch.no_grad():
        return time_s(step, steps, cuda, warmup=2, deadline=deadline)


def predict(emu: Emulated, bw: dict) -> dict:
    link_rate = bw["link_gbps"]
    if emu.name == "bulk":
        # Bulk reads its host bytes in place: through a UVA view on CUDA, and on the CPU a
        # plain read of host memory, which is the device read there.
        link_rate = bw.get("uva_read_gbps") or bw["device_read_gbps"]
    link_s = emu.link_bytes / (link_rate * 1e9)
    vram_s = emu.device_read_bytes / (bw["device_read_gbps"] * 1e9)
    out = {"link_bytes_per_step": emu.link_bytes, "device_read_bytes_per_step": emu.device_read_bytes,
           "est_link_s": link_s, "est_device_s": vram_s, "est_step_s": link_s + vram_s,
           "link_rate_used_gbps": link_rate}
    if emu.overlap:
        out["est_step_s_overlapped"] = max(link_s, vram_s)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=float, default=None,
                    help="multiply every byte count (default 1.0 on CUDA, 0.01 on the CPU)")
    ap.add_argument("--device-memory", default="24GiB", help="the card to emulate (default 24GiB)")
    ap.add_argument("--steps", type=int, default=20, help="timed decode steps per configuration")
    ap.add_argument("--max-seconds", type=float, default=240.0, help="bound on the timed steps, all together")
    ap.add_argument("--smoke", action="store_true", help="scale 0.0005, 3 steps (seconds, for the tests)")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = ap.parse_args(argv)

    from selective_offload.errors import UserError
    from selective_offload.sizes import parse_size

    try:
        device_memory = parse_size(args.device_memory, "--device-memory")
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    import torch

    from selective_offload.checkpoint import load_checkpoint
    from selective_offload.cli import BUNDLED
    from selective_offload.planner import PlanInputs, make_plan

    cuda = torch.cuda.is_available()
    scale = 0.0005 if args.smoke else (args.scale if args.scale is not None else (1.0 if cuda else 0.01))
    steps = 3 if args.smoke else args.steps
    if not (0 < scale <= 1) or steps < 1 or args.max_seconds <= 0:
        print("error: --scale must be in (0, 1], --steps and --max-seconds positive", file=sys.stderr)
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

        host = fill_random(torch.empty(probe, dtype=torch.uint8, pin_memory=True))
        view = cuda_view_of_pinned(host, device).view(torch.bfloat16).view(-1, 4096)
        x = torch.ones(4096, dtype=torch.bfloat16, device=device)
        bw["uva_read_gbps"] = view.numel() * 2 / statistics.median(time_s(lambda: torch.mv(view, x), 5, True)) / 1e9
        del host, view
    else:
        bw["note"] = "no CUDA: link and device are both host memory here"
    print(f"bandwidths: {bw}", flush=True)
    ckpt = load_checkpoint(BUNDLED[MODEL])
    plan = make_plan(ckpt, PlanInputs(device_memory_bytes=device_memory, link_gbps=bw["link_gbps"],
                                      vram_gbps=bw["device_read_gbps"]))
    if plan.strategy == "infeasible" or plan.bulk is None:
        print(f"error: the plan for {args.device_memory} is {plan.strategy}; nothing to compare", file=sys.stderr)
        return 2
    shape = Shape.from_plan(plan, scale)

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

    loaded = sum(shape.layer_bytes.values()) + (shape.embed_rows + shape.lm_head_rows) * shape.row_bytes() \
        + shape.other_bytes + shape.tower_bytes
    names = ["bulk", "selective"]
    if not cuda or loaded < 0.85 * torch.cuda.mem_get_info(device)[0]:
        names.append("resident")
    deadline_total = time.perf_counter() + args.max_seconds
    configs = []
    for n, name in enumerate(names):
        row: dict = {"config": name}
        capped = name != "resident"
        if cuda:
            torch.cuda.set_per_process_memory_fraction(cap_info["fraction"] if capped else 1.0, device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        try:
            emu = build(name if name != "resident" else "resident", plan, shape, cuda, device)
        except torch.OutOfMemoryError as err:
            row.update(status="does not fit the cap", error=str(err).splitlines()[0])
            configs.append(row)
            continue
        row["build_s"] = time.perf_counter() - t0
        row.update(predict(emu, bw))
        share = (deadline_total - time.perf_counter()) / (len(names) - n)
        times = run_steps(emu, plan.inputs.prefetch_step, steps, time.perf_counter() + share, cuda, device)
        s = spread(times)
        row.update(status="measured", capped=capped, step_s=s, tok_s=1.0 / s["median"],
                   measured_over_est=s["median"] / row["est_step_s"])
        if "est_step_s_overlapped" in row:
            row["measured_over_est_overlapped"] = s["median"] / row["est_step_s_overlapped"]
        if cuda:
            peak = torch.cuda.max_memory_allocated(device)
            row["peak_device_bytes"] = peak
            row["under_cap"] = peak <= cap if capped else None
        row["host_pinned_bytes"] = emu.arena.buffer.numel()
        configs.append(row)
        print(f"{name}: step {s['median'] * 1e3:.2f} ms (est {row['est_step_s'] * 1e3:.2f} ms)", flush=True)
        del emu
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
            getattr(torch._C, "_host_emptyCache", lambda: None)()

    result = {
        "benchmark": "decode-emulation", "date": today(), "device": device_name(cuda), "cuda": cuda,
        "torch": torch.__version__, "torch_threads": torch.get_num_threads(), "smoke": args.smoke,
        "model": MODEL, "scale": scale, "hidden": shape.hidden, "device_memory_bytes": device_memory,
        "bandwidth": bw, "cap": cap_info,
        "plan": {"strategy": plan.strategy, "hot_layer_indices": plan.hot_layer_indices,
                 "host_cold_bytes": plan.host_cold_bytes, "host_hot_bytes": plan.host_hot_bytes,
                 "prefetch_buffer_bytes": plan.prefetch_buffer_bytes,
                 "est_step_s_full_scale": plan.est.est_step_s,
                 "bulk_cpu_offload_gb": plan.bulk.cpu_offload_gb,
                 "bulk_offloaded_bytes": plan.bulk.offloaded_bytes,
                 "bulk_est_step_s_full_scale": plan.bulk.est.est_step_s},
        "configs": configs,
        "wall_s": time.perf_counter() - started,
    }
    result["load_note"] = shared_note(load_before, load_1min())
    bulk = next((c for c in configs if c["config"] == "bulk" and c["status"] == "measured"), None)
    sel = next((c for c in configs if c["config"] == "selective" and c["status"] == "measured"), None)
    if bulk and sel:
        result["speedup_selective_over_bulk"] = bulk["step_s"]["median"] / sel["step_s"]["median"]
        result["est_speedup_selective_over_bulk"] = bulk["est_step_s"] / sel["est_step_s"]
    stem = result_stem("decode-emulation", cuda, result["device"]) + ("-smoke" if args.smoke else "")
    paths = write_results(args.out, stem, result, markdown(result))
    print(f"wrote {paths[0]} and {paths[1]}")
    failed = any(c.get("under_cap") is False for c in configs) or cap_info.get("binds") is False
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
    )


if __name__ == "__main__":
    sys.exit(main())
