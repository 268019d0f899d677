"""Check the offload mechanism on this machine, and time it: one prepared script.

What it asserts (on CUDA; on a CPU-only machine the device asserts are listed as skipped):
- a host-resident embedding of the reference size (248320 x 5120 bf16, 2.54 GB) adds no
  device memory where a device-resident one adds its full size; its weight is pinned;
- host gather and UVA gather return exactly what ``F.embedding`` on the device weight does;
- an on-demand tower gives the resident tower's output, its transient device memory is
  about two blocks plus the non-block part (ledger and allocator agree), and offloading
  a device-built tower frees its device memory.

What it measures (a table each): device gather vs host gather vs UVA gather for 1, 16, 256
and 4096 tokens per step; tower onload time against tower size; pinned (and pageable)
host-to-device bandwidth. Times are medians of per-call wall time with the device
synchronised around each call, so they include launch and sync overhead: measured, not
estimated.

Results go to ``--out`` (default ``benchmarks/results/``) as JSON and Markdown named after
the device and the date. Without CUDA (or with ``--small``) sizes shrink so the script
finishes in seconds on two cores; on a GPU the full run takes a few minutes.

Usage: ``python benchmarks/gpu_mechanism_check.py [--small] [--out DIR]``. Exit status 1
when an assert failed (the results are still written), 0 otherwise.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import re
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from selective_offload.wrappers import (  # noqa: E402
    HostEmbedding,
    cuda_view_of_pinned,
    offload_on_demand,
)

TOKENS_PER_STEP = (1, 16, 256, 4096)
FULL = {"vocab": 248320, "hidden": 5120, "tower_hidden": 1280, "tower_depths": (4, 8, 16, 32),
        "tower_tokens": 1024, "bandwidth_bytes": 1 << 30, "iters": 30}
SMALL = {"vocab": 32768, "hidden": 1024, "tower_hidden": 256, "tower_depths": (2, 4, 8),
         "tower_tokens": 64, "bandwidth_bytes": 64 << 20, "iters": 10}
NO_CUDA = "skipped: no CUDA device"


class Checks:
    """Named asserts that are recorded, not raised, so every section still runs."""

    def __init__(self) -> None:
        self.rows: list[dict] = []

    def check(self, name: str, ok: bool, detail: str = "") -> None:
        self.rows.append({"name": name, "status": "passed" if ok else "FAILED", "detail": detail})
        print(f"[{'ok' if ok else 'FAIL'}] {name} {detail}")

    def skip(self, name: str, why: str = NO_CUDA) -> None:
        self.rows.append({"name": name, "status": why, "detail": ""})
        print(f"[skip] {name}: {why}")

    @property
    def failed(self) -> bool:
        return any(r["status"] == "FAILED" for r in self.rows)


def device_name(cuda: bool) -> str:
    if cuda:
        return torch.cuda.get_device_name()
    try:
        text = Path("/proc/cpuinfo").read_text()
        match = re.search(r"^model name\s*:\s*(.+)$", text, re.MULTILINE)
        if match:
            return match.group(1).strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def median_us(fn, iters: int, cuda: bool, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        sync(cuda)
        start = time.perf_counter()
        fn()
        sync(cuda)
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.shape, a.dtype) == (b.shape, b.dtype) and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    )


def embedding_section(cfg: dict, cuda: bool, device: torch.device, checks: Checks) -> dict:
    vocab, hidden, dtype = cfg["vocab"], cfg["hidden"], torch.bfloat16
    weight_bytes = vocab * hidden * 2
    print(f"embedding {vocab} x {hidden} bf16 = {weight_bytes / 1e9:.3f} GB")
    sync(cuda)
    before = torch.cuda.memory_allocated() if cuda else 0
    resident = nn.Embedding(vocab, hidden, dtype=dtype, device=device)
    sync(cuda)
    resident_delta = (torch.cuda.memory_allocated() - before) if cuda else None

    cpu_module = nn.Embedding(vocab, hidden, dtype=dtype, device="meta")
    cpu_module.weight = nn.Parameter(resident.weight.detach().to("cpu"), requires_grad=False)
    sync(cuda)
    before = torch.cuda.memory_allocated() if cuda else 0
    host = HostEmbedding.from_embedding(cpu_module, device)
    sync(cuda)
    host_delta = (torch.cuda.memory_allocated() - before) if cuda else None

    result = {"vocab": vocab, "hidden": hidden, "dtype": "bfloat16", "weight_bytes": weight_bytes,
              "device_resident_build_device_bytes": resident_delta,
              "host_resident_build_device_bytes": host_delta}
    if cuda:
        checks.check("device-resident embedding allocates its size on the device",
                     resident_delta >= weight_bytes, f"{resident_delta} >= {weight_bytes} bytes")
        checks.check("host-resident embedding allocates nothing on the device",
                     host_delta == 0, f"{host_delta} bytes")
        checks.check("device memory drops by the host bytes",
                     resident_delta - host_delta >= host.stats.host_bytes,
                     f"{resident_delta - host_delta} vs host_bytes {host.stats.host_bytes}")
        checks.check("host weight storage is pinned", host.weight.is_pinned())
        stats = torch.cuda.host_memory_stats()
        result["pinned_host_reserved_bytes"] = stats.get("reserved_bytes.current",
                                                         stats.get("reserved_bytes.all.current"))
    else:
        for name in ("device-resident embedding allocates its size on the device",
                     "host-resident embedding allocates nothing on the device",
                     "device memory drops by the host bytes", "host weight storage is pinned"):
            checks.skip(name)

    uva = view = None
    if cuda:
        try:
            uva = HostEmbedding.from_embedding(cpu_module, device, mode="uva")
            view = cuda_view_of_pinned(uva.weight.data, device)
        except Exception as err:  # noqa: BLE001 -- recorded as a failed check; timing goes on
            checks.check("UVA view of pinned memory can be built", False, repr(err))
            uva = view = None
        else:
            checks.check("UVA view of pinned memory can be built",
                         view.data_ptr() == uva.weight.data_ptr() and view.device == device,
                         f"device view at the host address, on {view.device}")
    else:
        checks.skip("UVA view of pinned memory can be built")

    gen = torch.Generator().manual_seed(0)
    rows = []
    for tokens in TOKENS_PER_STEP:
        ids = torch.randint(0, vocab, (tokens,), generator=gen).to(device)
        expected = F.embedding(ids, resident.weight.detach())
        checks.check(f"host gather == device F.embedding ({tokens} tokens)",
                     bitwise_equal(host(ids), expected))
        if uva is not None:
            checks.check(f"UVA gather == device F.embedding ({tokens} tokens)",
                         bitwise_equal(uva(ids), expected))
        elif not cuda:
            checks.skip(f"UVA gather == device F.embedding ({tokens} tokens)")
        def time_us(fn):
            return median_us(fn, cfg["iters"], cuda)

        with torch.no_grad():
            row = {
                "tokens": tokens,
                "row_bytes_moved": tokens * hidden * 2,
                "device_gather_us": time_us(lambda: F.embedding(ids, resident.weight)),
                "host_gather_us": time_us(lambda: host(ids)),
                "uva_gather_us": time_us(lambda: uva(ids)) if uva is not None else None,
                "uva_kernel_only_us": (
                    time_us(lambda: torch.index_select(view, 0, ids)) if view is not None else None
                ),
            }
        rows.append(row)
        print(row)
    result["gather"] = rows
    del resident
    return result


class Block(nn.Module):
    """A ViT-like block: attention projections and an MLP (the bytes are what matters)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.norm2 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class Tower(nn.Module):
    def __init__(self, hidden: int, depth: int) -> None:
        super().__init__()
        self.patch_embed = nn.Linear(hidden, hidden)
        self.blocks = nn.ModuleList(Block(hidden) for _ in range(depth))
        self.norm = nn.LayerNorm(hidden)

    def forward(self, x):
        x = self.patch_embed(x)
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


def tower_section(cfg: dict, cuda: bool, device: torch.device, checks: Checks) -> list[dict]:
    hidden, dtype, rows = cfg["tower_hidden"], torch.bfloat16, []
    for depth in cfg["tower_depths"]:
        torch.manual_seed(depth)
        resident = Tower(hidden, depth).to(device=device, dtype=dtype).eval()
        tower_bytes = sum(p.numel() * p.element_size() for p in resident.parameters())
        block_bytes = sum(p.numel() * p.element_size() for p in resident.blocks[0].parameters())
        rest_bytes = tower_bytes - depth * block_bytes
        x = torch.randn(1, cfg["tower_tokens"], hidden, device=device, dtype=dtype)
        with torch.no_grad():
            expected = resident(x)
            sync(cuda)
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated() if cuda else 0
            resident(x)
            sync(cuda)
            resident_activation_peak = (torch.cuda.max_memory_allocated() - base) if cuda else None
            resident_us = median_us(lambda: resident(x), cfg["iters"], cuda)

            offloaded = Tower(hidden, depth).to(device=device, dtype=dtype).eval()
            offloaded.load_state_dict(resident.state_dict())
            sync(cuda)
            before_offload = torch.cuda.memory_allocated() if cuda else 0
            handle = offload_on_demand(offloaded, device)
            sync(cuda)
            freed = (before_offload - torch.cuda.memory_allocated()) if cuda else None

            out = offloaded(x)
            checks.check(f"on-demand tower == resident tower (depth {depth})",
                         torch.equal(out, expected))
            ledger_peak = handle.stats.peak_transient_device_bytes
            checks.check(f"ledger peak transient == non-block + 2 blocks (depth {depth})",
                         ledger_peak == rest_bytes + 2 * block_bytes,
                         f"{ledger_peak} vs {rest_bytes + 2 * block_bytes} bytes")
            del out
            sync(cuda)
            if cuda:
                checks.check(f"offloading frees the tower's device memory (depth {depth})",
                             freed >= tower_bytes, f"{freed} >= {tower_bytes} bytes")
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                offloaded(x)
                sync(cuda)
                measured_peak = torch.cuda.max_memory_allocated() - base
                allowed = 1.05 * (ledger_peak + resident_activation_peak) + (2 << 20)
                checks.check(f"measured device peak within ledger + activations (depth {depth})",
                             measured_peak <= allowed, f"{measured_peak} <= {int(allowed)} bytes")
            else:
                measured_peak = None
                checks.skip(f"offloading frees the tower's device memory (depth {depth})")
                checks.skip(f"measured device peak within ledger + activations (depth {depth})")
            offloaded_us = median_us(lambda: offloaded(x), cfg["iters"], cuda)
        row = {
            "depth": depth,
            "tower_bytes": tower_bytes,
            "block_bytes": block_bytes,
            "resident_forward_us": resident_us,
            "on_demand_forward_us": offloaded_us,
            "onload_overhead_us": offloaded_us - resident_us,
            "bytes_moved_per_call": handle.stats.bytes_moved_last_call,
            # Bytes over the added time; None when prefetch hid the copies entirely.
            "effective_onload_gb_per_s": (
                handle.stats.bytes_moved_last_call / (offloaded_us - resident_us) / 1e3
                if offloaded_us > resident_us else None
            ),
            "peak_transient_device_bytes_ledger": ledger_peak,
            "peak_device_bytes_measured": measured_peak,
        }
        rows.append(row)
        print(row)
        handle.detach()
        del resident, offloaded
    return rows


def bandwidth_section(cfg: dict, cuda: bool, device: torch.device) -> dict:
    nbytes, iters = cfg["bandwidth_bytes"], max(cfg["iters"] // 3, 5)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    result = {"bytes_per_copy": nbytes}
    if cuda:
        pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        pageable = torch.empty(nbytes, dtype=torch.uint8)
        pinned.fill_(1)
        pageable.fill_(1)
        us = median_us(lambda: dst.copy_(pinned, non_blocking=True), iters, cuda)
        result["pinned_h2d_gb_per_s"] = nbytes / us / 1e3
        us = median_us(lambda: dst.copy_(pageable), iters, cuda)
        result["pageable_h2d_gb_per_s"] = nbytes / us / 1e3
    else:
        src = torch.ones(nbytes, dtype=torch.uint8)
        us = median_us(lambda: dst.copy_(src), iters, cuda)
        result["host_to_host_copy_gb_per_s"] = nbytes / us / 1e3
        result["note"] = "no CUDA device: a host memory copy stands in for host-to-device"
    print(result)
    return result


def _fmt(value, digits: int = 1) -> str:
    if value is None:
        return "n/a"
    return value if isinstance(value, str) else f"{value:.{digits}f}"


def _table(headers: list[str], rows: list[list]) -> list[str]:
    return [
        "| " + " | ".join(headers) + " |",
        "|" + "|".join("---" for _ in headers) + "|",
        *("| " + " | ".join(str(cell) for cell in row) + " |" for row in rows),
        "",
    ]


def markdown(results: dict) -> str:
    cuda, emb = results["cuda"], results["embedding"]
    setting = "CUDA" if cuda else "no CUDA: CPU figures, device asserts skipped"
    lines = [
        f"# Offload mechanism check: {results['device']}",
        "",
        f"Date {results['date']}, torch {results['torch']}, "
        f"{'small' if results['small'] else 'full'} sizes, {setting}; whole run "
        f"{results['wall_s']:.0f} s. Times are medians of per-call wall time with the device "
        "synchronised around each call (measured, not estimated)."
        + ("" if cuda else f" CPU run with {results['cpu_threads']} torch thread: the figures "
           "show that the code runs, not what a GPU does."),
        "",
        "## Asserts",
        "",
        *_table(["check", "status", "detail"],
                [[r["name"], r["status"], r["detail"]] for r in results["asserts"]]),
        f"## Embedding gather ({emb['vocab']} x {emb['hidden']} bf16)",
        "",
        *_table(
            ["tokens/step", "bytes moved", "device gather us", "host gather us",
             "UVA gather us", "UVA kernel only us"],
            [[r["tokens"], r["row_bytes_moved"], _fmt(r["device_gather_us"]),
              _fmt(r["host_gather_us"]), _fmt(r["uva_gather_us"]),
              _fmt(r["uva_kernel_only_us"])] for r in emb["gather"]],
        ),
        "## Tower onload vs size",
        "",
        *_table(
            ["blocks", "tower MB", "resident us", "on-demand us", "overhead us",
             "onload GB/s", "peak transient MB (ledger)", "peak device MB (measured)"],
            [[r["depth"], _fmt(r["tower_bytes"] / 1e6), _fmt(r["resident_forward_us"], 0),
              _fmt(r["on_demand_forward_us"], 0), _fmt(r["onload_overhead_us"], 0),
              _fmt(r["effective_onload_gb_per_s"], 2),
              _fmt(r["peak_transient_device_bytes_ledger"] / 1e6),
              _fmt(None if r["peak_device_bytes_measured"] is None
                   else r["peak_device_bytes_measured"] / 1e6)]
             for r in results["tower"]],
        ),
        "## Copy bandwidth",
        "",
        *_table(["measure", "value"],
                [[k, _fmt(v, 2) if isinstance(v, float) else v]
                 for k, v in results["bandwidth"].items()]),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="small sizes (automatic without CUDA)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args(argv)

    cuda = torch.cuda.is_available()
    small = args.small or not cuda
    cfg = SMALL if small else FULL
    if not cuda:
        # Multi-threaded CPU kernels stall for milliseconds when another process holds a
        # core (shared CI machines); one thread gives figures that mean something.
        torch.set_num_threads(1)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    name = device_name(cuda)
    date = dt.datetime.now(dt.timezone.utc).date().isoformat()
    checks = Checks()
    started = time.perf_counter()
    results = {
        "device": name, "date": date, "torch": torch.__version__, "cuda": cuda, "small": small,
        "cpu_threads": torch.get_num_threads(),
        "config": {k: list(v) if isinstance(v, tuple) else v for k, v in cfg.items()},
    }
    results["embedding"] = embedding_section(cfg, cuda, device, checks)
    results["tower"] = tower_section(cfg, cuda, device, checks)
    results["bandwidth"] = bandwidth_section(cfg, cuda, device)
    results["asserts"] = checks.rows
    results["wall_s"] = time.perf_counter() - started

    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")[:40]
    stem = f"mechanism-{'cuda' if cuda else 'cpu'}-{slug}-{date}"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out / f"{stem}.md").write_text(markdown(results))
    skipped = sum(r["status"].startswith("skipped") for r in checks.rows)
    print(f"wrote {args.out / stem}.{{json,md}} in {results['wall_s']:.1f} s; "
          f"{'FAILED asserts' if checks.failed else 'all run asserts passed'}, {skipped} skipped")
    return 1 if checks.failed else 0


if __name__ == "__main__":
    sys.exit(main())
