"""Check the offload mechanism on this machine, and time it: the GPU mechanism tests
(``tests/gpu/``) run in one prepared command, their checks and figures written to files.

What it asserts is what the tests there assert, one mechanism per file: a host-resident
embedding adds no device memory and gathers bit-exact (``test_embedding_memory_and_gather``),
also under vLLM's masked tensor-parallel lookup (``test_masked_tp_lookup``); a drafter's
shared modules are built on the host and freed when replaced (``test_drafter_shared_modules``);
a cold module's explicit-device, shared and globally held tensors land where they must
(``test_cold_module_allocations``); an on-demand tower matches the resident one within
its ledger (``test_on_demand_tower``); host memory page-locked the project's way is
exactly the planned bytes (``test_page_locked_host_memory``); the CUDA load paths of
issue 16 (``test_cuda_load_paths``); routed experts read through a marked UVA view
(``test_routed_experts_uva_view``); layouts kept through the arena (an FP8 ``.t()`` weight
through it into CUTLASS's scaled matmul, adjacent small heap tensors as one arena, a hot
layer's arena pinned: ``test_layouts_through_arenas``); a fused-MoE stand-in for vLLM's
``TritonExperts`` on marked UVA views under CUDA graph capture and replay against device
copies, decode and a 2048-token prefill timed (``test_fused_moe_uva_graph``). On a CPU-only machine the device asserts are listed as
skipped, with the reason; the rest run, the meta device standing in for the GPU where
placement is the point. The tests run through ``tests/gpu/runner.py``, so pytest need not
be installed (a GPU image may lack it); ``pytest tests/gpu`` runs the same tests.

What it measures (a table each, from the tests' fixtures, and the copy bandwidth here):
routed-expert reads, k of E experts through the UVA view against copying the whole layer
first and against device-resident reads, for steps of 1, 4 and 16 tokens
(``benchmarks.common.routed_expert_reads``: the read efficiency served uva plans price); device gather
vs host gather vs UVA gather for 1, 16, 256 and 4096 tokens per step; the masked TP
lookup, device shard vs host shard; construction figures (bytes routed, device growth,
release time); tower onload time against tower size; pinned (and pageable) host-to-device
bandwidth, beside the probe's UVA read rate (a kernel reading page-locked host memory in
place) and decode-shaped VRAM read rate; page-locked bytes over planned host bytes
(``ratio_rounding`` for torch's pinned blocks, ``ratio_exact`` for registration, per tensor
set and overall), the time to allocate and page-lock each way, and the process RSS around
it. Times are medians of per-call wall time with the device synchronised around each
call, so they include launch and sync overhead: measured, not estimated.

Results go to ``--out`` (default ``benchmarks/results/``) as JSON and Markdown named after
the device and the date. Without CUDA (or with ``--small``) sizes shrink so the run takes
seconds on two cores (1 torch thread). The full run on a GPU is an estimate, not a
measurement: 1.7 to 4.5 minutes on an H100/H200-class machine, under 8. Its cost is host
work, not the GPU: first-touching and pinning host memory (the 2.54 GB table copied to
the host and pinned twice, 5.1 GB of drafter copies written, about 1.3 GiB more pinned for
the TP shard and the cold weight; at 0.3 to 2 GB/s for first touch and pinning that is 10
to 60 s), building 2.4 G tower parameters on the CPU (each depth twice; 10 to 30 s), the
timed loops (30 calls per figure, about 10 s; the host gather of 4096 rows is the slowest
call, tens of ms), and the host-memory section (2.92 GB page-locked, filled, copied to the
device, read back and compared, 2 ways x 2 repetitions, 4.8 GB of it in torch's rounded
blocks: about 12 GB locked and 35 GB of host memory traffic, 20 to 60 s); the arena and
fused-MoE checks of issue 26 (1.2 GB of experts built on the device, copied to the host and
pinned, Triton compiling its kernel per block shape, four graphs captured and replayed
30 times each, the UVA prefill reading every expert over the link at tens of ms a replay:
est 10 to 30 s).

Usage: ``python -m benchmarks.mechanism [--small] [--out DIR]``. Exit status 1
when an assert failed (the results are still written), 0 otherwise.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
for path in (ROOT, ROOT / "tests" / "gpu"):
    sys.path.insert(0, str(path))

from runner import Session  # noqa: E402  (tests/gpu/runner.py)

from benchmarks.common import device_name, median_us, result_stem, today, write_results  # noqa: E402
from benchmarks.mechanism.report import markdown  # noqa: E402

BANDWIDTH = "bandwidth"
#: What runs, in order: the test modules of tests/gpu (one mechanism each), and the copy
#: bandwidth, which asserts nothing and is measured here.
STEPS = ("test_embedding_memory_and_gather", "test_masked_tp_lookup", "test_drafter_shared_modules",
         "test_cold_module_allocations", "test_on_demand_tower", BANDWIDTH, "test_page_locked_host_memory",
         "test_cuda_load_paths", "test_routed_experts_uva_view", "test_layouts_through_arenas",
         "test_fused_moe_uva_graph")
#: The results' sections, in the order the file gives them (None: its fixture failed).
SECTIONS = ("embedding", "tp_lookup", "drafter", "explicit_device", "tower", "bandwidth", "host_memory",
            "cuda_paths", "routed_experts", "layouts", "fused_moe")


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
        # The probe's own measurements of what the plan prices: kernels reading page-locked
        # host memory in place through a UVA view (vLLM's cpu_offload_gb, the UVA embedding,
        # experts read in place), against the copy; and a decode-shaped VRAM read.
        from selective_offload.probe import decode_read_gbps, uva_read_series
        from selective_offload.wrappers.host_embedding import cuda_view_of_pinned

        pinned = pageable = None
        uva = uva_read_series([nbytes], repeats=iters, warmup=2, cuda=device, pin=True, required=1,
                              view=lambda host: cuda_view_of_pinned(host, device))
        result["uva_read_gb_per_s"] = nbytes / uva[nbytes] / 1e9
        result["uva_over_pinned_copy"] = result["uva_read_gb_per_s"] / result["pinned_h2d_gb_per_s"]
        result["decode_read_gb_per_s"] = decode_read_gbps(device, nbytes, repeats=iters, warmup=2, cuda=device)
    else:
        src = torch.ones(nbytes, dtype=torch.uint8)
        us = median_us(lambda: dst.copy_(src), iters, cuda)
        result["host_to_host_copy_gb_per_s"] = nbytes / us / 1e3
        result["note"] = "no CUDA device: a host memory copy stands in for host-to-device"
    print(result)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="small sizes (automatic without CUDA)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)

    cuda = torch.cuda.is_available()
    small = args.small or not cuda
    if not cuda:
        # Multi-threaded CPU kernels stall for milliseconds when another process holds a
        # core (shared CI machines); one thread gives figures that mean something.
        torch.set_num_threads(1)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    name = device_name(cuda)
    date = today()
    session = Session(small)
    cfg, checks = session.run.config, session.run.checks
    started = time.perf_counter()
    results = {
        "device": name, "date": date, "torch": torch.__version__, "cuda": cuda, "small": small,
        "cpu_threads": torch.get_num_threads(),
        "config": {k: list(v) if isinstance(v, tuple) else v for k, v in cfg.items()},
    }
    for step in STEPS:
        if step == BANDWIDTH:
            session.run.results["bandwidth"] = bandwidth_section(cfg, cuda, device)
        else:
            session.run_module(step)
    session.close()
    results.update({key: session.run.results.get(key) for key in SECTIONS})
    results["cuda_paths"] = results["cuda_paths"] or {}  # its tests need CUDA: nothing measured without
    results["asserts"] = checks.rows
    results["wall_s"] = time.perf_counter() - started

    stem = result_stem("mechanism", cuda, name)
    write_results(args.out, stem, results, markdown(results))
    skipped = sum(r["status"].startswith("skipped") for r in checks.rows)
    print(f"wrote {args.out / stem}.{{json,md}} in {results['wall_s']:.1f} s; "
          f"{'FAILED asserts' if checks.failed else 'all run asserts passed'}, {skipped} skipped")
    return 1 if checks.failed else 0
