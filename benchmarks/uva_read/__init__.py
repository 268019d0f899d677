"""How fast a kernel reads page-locked host memory in place (UVA) against a copy of the
same bytes, for buffers up to the size of a real offload.

Why: vLLM's ``cpu_offload_gb``, the UVA embedding and experts read in place all read
host memory from inside kernels, while the prefetch offloader and tower onloads copy it
with the copy engine; a plan prices both at one link rate. Kernels reading host memory
have been reported below the copy engine's rate, and falling as buffers grow past several
GiB on some GPUs, so the ratio at a real offload's size decides whether that price holds.

For each size, host memory is allocated pageable and page-locked in place at its exact
size, the project's way (``PageLockedLedger``, ``cudaHostRegister``), filled with random
bf16 values, then timed (median of ``--iters`` calls, the device synchronised around each):

- ``copy``: ``dst.copy_(host, non_blocking=True)`` into a device buffer (the copy engine);
- ``uva_gemv``: a bf16 matrix-vector product over a UVA device view of the host memory
  (``cuda_view_of_pinned``), which is what a decode kernel reading offloaded weights does;
- ``device_gemv``: the same product over the device copy (the VRAM read rate, for scale).

Both products are ``selective_offload.probe.gemv_read_s``, the measurement
``selective-offload probe`` makes its UVA and decode read rates with: this script only
sweeps sizes past the probe's and sets the copy beside each.

The largest size is the reference plan's cpu_offload_gb on a 24 GiB card (``plan.vllm_cpu_offload_gb`` for
the bundled Qwen3.8-27B-FP8 manifest: the bytes vLLM's ``cpu_offload_gb`` reads every
step). Without CUDA there is no view to read through: the UVA rows are skipped with the
reason, and ``copy`` is a host memory copy.

    python -m benchmarks.uva_read [--sizes 256MiB,1GiB,cpu_offload_gb] [--iters 5] [--smoke]
                                        [--out benchmarks/results]

Writes ``uva-read-<cpu|cuda>-<machine>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from benchmarks.common import (  # noqa: E402
    RESULTS_DIR,
    BenchError,
    device_name,
    fill_random,
    fmt,
    load_1min,
    md_table,
    result_stem,
    shared_note,
    time_s,
    today,
    worker_or_run,
    write_results,
)
from selective_offload.probe import READ_COLS as HIDDEN  # noqa: E402  (columns of the bf16 matrix read)

NO_CUDA = "skipped: no CUDA device (a UVA view of page-locked host memory needs one)"


def cpu_offload_bytes() -> int:
    """The bytes vLLM's cpu_offload_gb reads per step for the reference plan on 24 GiB."""
    from selective_offload.checkpoint import load_checkpoint
    from selective_offload.cli import BUNDLED
    from selective_offload.planner import PlanInputs, make_plan

    plan = make_plan(load_checkpoint(BUNDLED["qwen3.8-27b-fp8"]), PlanInputs(device_memory_bytes=24 << 30))
    return plan.vllm_cpu_offload_gb.offloaded_bytes


def parse_sizes(text: str) -> list[int]:
    from selective_offload.errors import UserError
    from selective_offload.sizes import parse_size

    out = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        try:
            out.append(cpu_offload_bytes() if part == "cpu_offload_gb" else parse_size(part, "--sizes"))
        except UserError as err:
            raise BenchError(str(err)) from None
    if not out or min(out) < 2 * HIDDEN:
        raise BenchError(f"--sizes {text!r}: give one or more sizes of at least {2 * HIDDEN} bytes (or 'cpu_offload_gb')")
    return out


def measure(nbytes: int, iters: int, cuda: bool, view=None) -> dict:
    """One size; an error (page-locking refused, out of memory) is recorded in the row.
    ``view`` makes the device view of the host buffer (default on CUDA:
    ``cuda_view_of_pinned``; without CUDA the UVA figures are skipped unless a stand-in is
    passed, as the tests do to run their code)."""
    import torch

    row: dict = {"bytes": nbytes // (2 * HIDDEN) * 2 * HIDDEN}
    try:
        _measure(row, iters, cuda, view)
    except (RuntimeError, OSError, ValueError) as err:  # torch's OOM; OffloadError (page-locking refused)
        row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    finally:
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    return row


def _measure(row: dict, iters: int, cuda: bool, view_factory) -> None:
    import torch

    from selective_offload.probe import gemv_read_s
    from selective_offload.wrappers import cuda_view_of_pinned
    from selective_offload.wrappers.page_locked import PageLockedLedger, PinPolicy

    nbytes = row["bytes"]
    rows = nbytes // (2 * HIDDEN)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    t0 = time.perf_counter()
    host = torch.empty(nbytes, dtype=torch.uint8)
    ledger = PageLockedLedger(PinPolicy.decide(cuda=cuda))
    row["page_locked"] = ledger.lock(host, "uva read")
    try:
        fill_random(host)
        row["alloc_lock_fill_s"] = time.perf_counter() - t0
        dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
        x = torch.ones(HIDDEN, dtype=torch.bfloat16, device=device)
        secs = time_s(lambda: dst.copy_(host, non_blocking=cuda), iters, cuda, warmup=1)
        row["copy_gbps"] = nbytes / statistics.median(secs) / 1e9
        matrix = dst.view(torch.bfloat16).view(rows, HIDDEN)
        sync = device if cuda else None
        row["device_gemv_gbps"] = nbytes / gemv_read_s(dst, repeats=iters, warmup=2, cuda=sync) / 1e9
        if cuda and view_factory is None:
            view_factory = lambda t: cuda_view_of_pinned(t, device)  # noqa: E731
        if view_factory is not None:
            raw = view_factory(host)
            if raw.numel() * raw.element_size() != nbytes:
                raise ValueError(f"the view holds {raw.numel() * raw.element_size()} bytes, not the buffer's {nbytes}")
            row["uva_gemv_gbps"] = nbytes / gemv_read_s(raw, repeats=iters, warmup=2, cuda=sync) / 1e9
            row["uva_over_copy"] = row["uva_gemv_gbps"] / row["copy_gbps"]
            view = raw.view(torch.bfloat16).view(rows, HIDDEN)
            # The view reads the same bytes as the device copy (summation order may differ).
            row["uva_equals_device"] = bool(torch.allclose(torch.mv(view, x).float(), torch.mv(matrix, x).float(),
                                                           rtol=2e-2, atol=1e-3))
            del view
    finally:
        if ledger.is_locked(host):
            if cuda:
                torch.cuda.synchronize()
            ledger.unlock(host.untyped_storage().data_ptr())


def markdown(r: dict) -> str:
    note = "" if r["cuda"] else (" No CUDA: `copy` is a host memory copy, `device_gemv` reads host memory, and "
                                 f"the UVA columns are {NO_CUDA}.")
    rows = [[f"{x['bytes'] / 2**30:.3f}", fmt(x.get("copy_gbps")), fmt(x.get("uva_gemv_gbps")),
             fmt(x.get("uva_over_copy"), 3), fmt(x.get("device_gemv_gbps"), 1),
             {True: "yes", False: "NO", None: "n/a"}[x.get("uva_equals_device")], fmt(x.get("alloc_lock_fill_s")),
             x.get("error", "")]
            for x in r["rows"]]
    return (f"# UVA read rate against the copy rate: {r['device']}\n\n"
            f"Date {r['date']}, torch {r['torch']}; {r['iters']} timed calls per figure (median, the device "
            f"synchronised around each call); host memory "
            + ("page-locked in place at its exact size (`cudaHostRegister`)" if r["cuda"] else "pageable")
            + f"; the largest size is the reference plan's cpu_offload_gb on a 24 GiB card "
            f"({r['cpu_offload_bytes'] / 1e9:.2f} GB); whole run {r['wall_s']:.0f} s; {r['load_note']}. Measured, not "
            f"estimated.{note}\n\n"
            + md_table(["GiB", "copy GB/s (copy engine)", "UVA GEMV GB/s (in-kernel read)", "UVA / copy",
                        "device GEMV GB/s", "UVA result == device", "alloc+lock+fill s", "error"], rows))


def run(args) -> int:
    import torch

    cuda = torch.cuda.is_available()
    if not cuda:
        torch.set_num_threads(1)  # steadier figures on a shared machine
    sizes = parse_sizes(args.sizes or ("4MiB,16MiB" if args.smoke else "256MiB,1GiB,cpu_offload_gb" if cuda else "64MiB,256MiB"))
    iters = 3 if args.smoke else args.iters
    if iters < 1:
        raise BenchError("--iters must be 1 or more")
    load_before, started = load_1min(), time.perf_counter()
    rows = [measure(n, iters, cuda) for n in sizes]
    result = {"benchmark": "uva-read", "date": today(), "device": device_name(cuda), "cuda": cuda,
              "torch": torch.__version__, "iters": iters, "hidden": HIDDEN, "cpu_offload_bytes": cpu_offload_bytes(),
              "smoke": args.smoke, "rows": rows, "uva": "measured" if cuda else NO_CUDA,
              "wall_s": time.perf_counter() - started}
    result["load_note"] = shared_note(load_before, load_1min())
    stem = result_stem("uva-read", cuda, result["device"]) + ("-smoke" if args.smoke else "")
    paths = write_results(args.out, stem, result, markdown(result))
    print(f"wrote {paths[0]} and {paths[1]}")
    return 0 if all(r.get("uva_equals_device", True) and "error" not in r for r in rows) else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default=None,
                    help="buffer sizes, comma-separated; 'cpu_offload_gb': the reference plan's cpu_offload_gb (default on "
                         "CUDA 256MiB,1GiB,cpu_offload_gb; on the CPU 64MiB,256MiB)")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="4 and 16 MiB, 3 calls (seconds)")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR)
    return worker_or_run(ap.parse_args(argv), None, run)
