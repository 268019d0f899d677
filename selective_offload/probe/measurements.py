"""The probe's measurements: this machine's link, memory and compute rates, timed with torch.

The planner prices a plan in bytes / bandwidth, so its two bandwidths (the host-to-device
link and the device memory) and the device's memory size decide the estimate. This module
measures them with torch alone (no vLLM: a GPU machine may not have it) and returns a
:class:`~.profile.Profile` (:func:`measure`); :mod:`.command` is the ``probe`` command
around it. Its read kernel, :func:`gemv_read_s`, is also the one the benchmarks time, so a
benchmark and the probe measure a read the same way.

What is measured, each as the median of ``repeats`` timed copies per size after warm-up
copies, the device synchronised before and after each copy:

- **link** (``link_gbps_pinned``, ``link_gbps_pageable``): host-to-device copies from
  page-locked (torch's pinned allocator) and from pageable host memory. Bytes counted: the
  size of the copy, once (the bytes that cross the link).
- **VRAM** (``vram_gbps``): a device-to-device copy. Bytes counted: **read + write**, 2 x
  the size of the copy, which is what a datasheet's memory bandwidth and a read-only
  stream (a decode step reading its weights) are comparable with.
- **device memory** (``device_memory_total_bytes``, ``device_memory_free_bytes``):
  ``torch.cuda.mem_get_info`` before the probe allocates anything of its own.
- **host memcpy** (``host_memcpy_gbps``): a host-to-host copy, read + write counted as for
  VRAM. Without a GPU this is all there is: the CPU is the device, there is no link, and
  ``no_link_reason`` says so.
- **UVA reads** (``uva_read_gbps``): a kernel (a bf16 matrix-vector product, the decode
  reads' shape: :func:`gemv_read_s`) reading page-locked host memory in place through a UVA
  device view, the way vLLM's ``cpu_offload_gb``, the UVA embedding and
  experts read in place are read: the SMs issue the reads over the link, which reaches less
  than the copy engine does, and less as the buffer grows (``estimate.traffic.DEFAULT_UVA_READ_FACTOR`` cites the
  published figures). So its sizes go past the copies' (up to 4 GiB in a
  full probe). Bytes counted: the buffer, once.
- **decode reads** (``decode_read_gbps``): a matrix-vector product over a bf16 weight as
  large as the largest copy, the shape of a batch-1 decode step's weight reads; bytes
  counted: the weight, once. Decode kernels read VRAM slower than a copy or a saturating
  read kernel (``estimate.traffic.DEFAULT_DECODE_READ_FACTOR`` cites the published runs), so
  planning prices VRAM reads at this when measured, else at the copy's rate x
  ``estimate.traffic.DEFAULT_DECODE_READ_FACTOR``.
- **matmul** (``matmul_tflops``, ``matmul_dtype``): a square matrix product large enough to
  be compute-bound (bf16 on a GPU, float32 on the CPU), ``2 n^3`` FLOPs over its median
  time: the rate at which a decode step's FLOPs can run at best, so a layer costs at least
  its FLOPs over it.

Every rate is the one of the **largest** size (small copies understate a link); the
per-size medians are kept in the profile (``*_samples_s``: bytes -> median seconds) so a
reader can see whether the rate had levelled off. Rates are decimal GB/s (10^9 bytes per
second), as links and memories are quoted.
"""

from __future__ import annotations

import datetime as dt
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from ..errors import UserError
from ..sizes import GB, GiB
from .formats import MiB, fmt_size
from .profile import Profile

#: Copy sizes of a full probe: the rate reported is the largest one's.
FULL_SIZES: tuple[int, ...] = (64 * MiB, 256 * MiB, 1 * GiB)
FULL_REPEATS = 5
FULL_WARMUP = 2
#: A quick probe (tests, CI): well under a second on a 2-core CPU; rates are understated
#: (the small copies stay partly in cache on a CPU and do not reach a link's top rate).
QUICK_SIZES: tuple[int, ...] = (4 * MiB, 16 * MiB, 64 * MiB)
QUICK_REPEATS = 3
QUICK_WARMUP = 1

#: UVA read sizes beyond the copies' (a real offload is GBs: kernels' host reads slow down
#: as the buffer grows); a size that cannot be page-locked here is skipped.
FULL_UVA_EXTRA_SIZES: tuple[int, ...] = (4 * GiB,)
#: Matrix side of the matmul rate (n x n by n x n); the quick probe's is small.
FULL_MATMUL_N = 8192
QUICK_MATMUL_N = 256


def machine_name() -> str:
    """The CPU model (``/proc/cpuinfo``) and architecture, as the benchmarks name machines."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({platform.machine()})"
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _check_sizes(sizes: Sequence[int] | None, quick: bool) -> tuple[int, ...]:
    if sizes is None:
        return QUICK_SIZES if quick else FULL_SIZES
    try:
        out = tuple(sorted({int(s) for s in sizes}))
    except (TypeError, ValueError):
        raise UserError(f"probe: copy sizes {sizes!r} must be whole numbers of bytes") from None
    if not out or out[0] <= 0 or any(isinstance(s, bool) for s in sizes):
        raise UserError(f"probe: copy sizes {list(sizes)!r} must be one or more positive numbers of bytes")
    return out


def _resolve_device(device: Any):
    """``None``: the current CUDA device when there is one, else the CPU."""
    import torch

    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        dev = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    except (RuntimeError, TypeError, ValueError):
        raise UserError(f"--device: cannot read {device!r} as a device; give cuda, cuda:N or cpu") from None
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise UserError(f"--device: {device!r} is a {dev.type} device; the probe measures cuda devices "
                        "(cuda, cuda:N) or the cpu")
    if not torch.cuda.is_available():
        raise UserError(f"--device: {device!r} asked for, but this torch ({torch.__version__}) sees no CUDA "
                        "device; leave --device out to measure the CPU")
    index = torch.cuda.current_device() if dev.index is None else dev.index
    if not 0 <= index < torch.cuda.device_count():
        raise UserError(f"--device: {device!r}: there are {torch.cuda.device_count()} CUDA device(s) here "
                        f"(cuda:0..cuda:{torch.cuda.device_count() - 1})")
    return torch.device("cuda", index)


def _median_copy_s(dst, src, *, repeats: int, warmup: int, cuda, non_blocking: bool) -> float:
    """Median wall seconds of ``dst.copy_(src)``, the device synchronised around each copy."""
    return _median_s(lambda: dst.copy_(src, non_blocking=non_blocking), repeats=repeats, warmup=warmup, cuda=cuda)


def _series(what: str, where: str, sizes: Sequence[int], make: Callable[[int], tuple],
            repeats: int, warmup: int, cuda, non_blocking: bool = False) -> dict[int, float]:
    """Median seconds per copy size; buffers are made per size and freed before the next."""
    out = {}
    for size in sizes:
        try:
            dst, src = make(size)
            out[size] = _median_copy_s(dst, src, repeats=repeats, warmup=warmup, cuda=cuda,
                                       non_blocking=non_blocking)
        except (RuntimeError, AssertionError, MemoryError) as exc:
            raise UserError(f"probe: could not measure the {what} on {where} with {fmt_size(size)} copies "
                            f"({_one_line(exc)}); free memory, or try --quick") from None
        finally:
            dst = src = None  # drop the buffers before the next size is made
    return out


def _median_s(fn: Callable[[], Any], *, repeats: int, warmup: int, cuda) -> float:
    """Median wall seconds of ``fn()``, the device synchronised around each call."""
    import torch

    def sync():
        if cuda is not None:
            torch.cuda.synchronize(cuda)

    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


#: Columns of the bf16 matrix the read measurements multiply (a hidden size of 8B-class models).
READ_COLS = 4096


def gemv_read_s(weight, *, repeats: int, warmup: int, cuda, cols: int = READ_COLS) -> float:
    """Median seconds of one bf16 matrix-vector product over the bytes of ``weight`` (a
    contiguous tensor of whole ``cols``-wide bf16 rows: device memory, or a UVA device view
    of host memory), the device synchronised around each: a batch-1 decode step's read of a
    weight, each byte once. The one measurement behind the probe's UVA and decode read rates
    and ``benchmarks/uva_read/``."""
    import torch

    flat = weight.reshape(-1).view(torch.uint8)
    rows = flat.numel() // (2 * cols)
    if rows < 1:
        raise ValueError(f"a read of {flat.numel()} bytes is less than one {cols}-wide bf16 row")
    matrix = flat[: rows * cols * 2].view(torch.bfloat16).view(rows, cols)
    x = torch.ones(cols, dtype=torch.bfloat16, device=matrix.device)
    return _median_s(lambda: torch.mv(matrix, x), repeats=repeats, warmup=warmup, cuda=cuda)


def uva_read_series(sizes: Sequence[int], *, repeats: int, warmup: int, cuda,
                    view: Callable[[Any], Any], pin: bool, required: int = 0) -> dict[int, float]:
    """Median seconds of one read kernel (:func:`gemv_read_s`) over ``size`` bytes of host
    memory through ``view(host)``: on CUDA a UVA device view of page-locked memory
    (:func:`~selective_offload.wrappers.host_embedding.cuda_view_of_pinned`), so every byte
    crosses the link inside the kernel, as vLLM's ``cpu_offload_gb`` reads its weights.
    Sizes past ``required`` that cannot be page-locked here are left out (a smaller machine);
    a failure at one of the first ``required`` sizes is a one-line :class:`UserError`."""
    import torch

    out = {}
    for n, size in enumerate(sizes):
        host = dev_view = None
        try:
            host = torch.empty(size, dtype=torch.uint8, pin_memory=pin).fill_(0x3C)  # bf16 0x3C3C: 0.0115
            dev_view = view(host)
            out[size] = gemv_read_s(dev_view, repeats=repeats, warmup=warmup, cuda=cuda)
        except (RuntimeError, AssertionError, MemoryError, ValueError) as exc:
            if n < required:
                raise UserError(f"probe: could not measure UVA reads of {fmt_size(size)} "
                                f"({_one_line(exc)}); free memory, or try --quick") from None
        finally:
            host = dev_view = None  # unpin before the next size
    return out


def decode_read_gbps(device, nbytes: int, *, repeats: int, warmup: int, cuda, cols: int = 8192) -> float:
    """GB/s at which :func:`gemv_read_s` reads a bf16 weight of about ``nbytes`` (``cols``
    wide) on ``device``: a batch-1 decode step's access pattern, each weight byte read once."""
    import torch

    rows = max(1, nbytes // (2 * cols))
    try:
        weight = torch.ones(rows, cols, dtype=torch.bfloat16, device=device)
        secs = gemv_read_s(weight, repeats=repeats, warmup=warmup, cuda=cuda, cols=cols)
    except (RuntimeError, AssertionError, MemoryError) as exc:
        raise UserError(f"probe: could not measure decode reads on {device} ({_one_line(exc)}); "
                        "free memory, or try --quick") from None
    return rows * cols * 2 / secs / GB


def matmul_tflops(device, n: int, dtype, *, repeats: int, warmup: int, cuda) -> float:
    """TFLOP/s of an ``n x n`` by ``n x n`` matmul in ``dtype`` on ``device`` (``2 n^3`` FLOPs)."""
    import torch

    try:
        a = torch.ones(n, n, dtype=dtype, device=device)
        b = torch.ones(n, n, dtype=dtype, device=device)
        secs = _median_s(lambda: torch.mm(a, b), repeats=repeats, warmup=warmup, cuda=cuda)
    except (RuntimeError, AssertionError, MemoryError) as exc:
        raise UserError(f"probe: could not measure the matmul rate on {device} ({_one_line(exc)}); "
                        "free memory, or try --quick") from None
    return 2 * n ** 3 / secs / 1e12


def _rate(samples: Mapping[int, float], counted: int) -> float | None:
    if not samples:
        return None
    size = max(samples)
    return counted * size / samples[size] / GB


def measure(*, device: Any = None, sizes: Sequence[int] | None = None, repeats: int | None = None,
            quick: bool = False) -> Profile:
    """Measure this machine with torch (see the module's docstring for what and how).

    ``device``: ``None`` (the current CUDA device, else the CPU), ``"cuda"``, ``"cuda:N"``,
    an index, or ``"cpu"`` (host memcpy only). ``sizes``: copy sizes in bytes (default
    64 MiB, 256 MiB, 1 GiB; ``quick``: 4, 16, 64 MiB); ``repeats``: timed copies per size
    (default 5; ``quick``: 3). A measurement that fails is a one-line :class:`UserError`."""
    import torch

    sizes = _check_sizes(sizes, quick)
    if repeats is None:
        repeats = QUICK_REPEATS if quick else FULL_REPEATS
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise UserError(f"probe: repeats {repeats!r} must be a whole number, 1 or more")
    warmup = QUICK_WARMUP if quick else FULL_WARMUP
    dev = _resolve_device(device)
    date = dt.datetime.now(dt.timezone.utc).replace(microsecond=0).isoformat()
    u8 = torch.uint8

    def host_pair(size):
        return torch.empty(size, dtype=u8).fill_(0), torch.empty(size, dtype=u8).fill_(1)

    host = _series("host memcpy", "the host", sizes, host_pair, repeats, warmup, cuda=None)
    common = dict(machine=machine_name(), date=date, torch_version=str(torch.__version__),
                  host_memcpy_gbps=_rate(host, 2), host_memcpy_samples_s=host,
                  repeats=repeats, quick=quick)
    from .host_compute import measure_host_compute

    cpu = measure_host_compute(device=dev if dev.type == "cuda" else None, quick=quick, repeats=repeats)
    common.update(cpu_kernel_gbps=cpu["cpu_kernel_gbps"], cpu_threads=cpu["cpu_threads"],
                  host_read_gbps=cpu["host_read_gbps"])
    matmul_n = QUICK_MATMUL_N if quick else FULL_MATMUL_N
    if dev.type == "cpu":
        common.update(matmul_tflops=matmul_tflops(dev, matmul_n, torch.float32, repeats=repeats, warmup=warmup,
                                                  cuda=None), matmul_dtype="float32")
        why = ("no GPU here: the CPU is the device, host and device memory are one, so there is no "
               "host-to-device link to measure" if not torch.cuda.is_available() else
               "--device cpu: the CPU is the device, host and device memory are one, so there is no "
               "host-to-device link to measure")
        return Profile(device=None, integrated=False, link_gbps_pinned=None, link_gbps_pageable=None,
                       vram_gbps=None, device_memory_total_bytes=None, device_memory_free_bytes=None,
                       no_link_reason=why, **common)

    name = f"{dev} ({torch.cuda.get_device_name(dev)})"
    try:
        with torch.cuda.device(dev):
            free, total = torch.cuda.mem_get_info(dev)
            props = torch.cuda.get_device_properties(dev)
    except (RuntimeError, AssertionError) as exc:
        raise UserError(f"probe: could not query {dev}: {_one_line(exc)}") from None
    fits = [s for s in sizes if 2 * s + 256 * MiB <= free]
    if not fits:
        raise UserError(f"probe: {name} has {free / GB:.2f} GB free, too little for two "
                        f"{fmt_size(sizes[0])} buffers; free device memory, or give smaller sizes")

    def device_buffer(size):
        return torch.empty(size, dtype=u8, device=dev)

    def pinned_pair(size):
        return device_buffer(size), torch.empty(size, dtype=u8, pin_memory=True).fill_(1)

    def pageable_pair(size):
        return device_buffer(size), torch.empty(size, dtype=u8).fill_(1)

    def d2d_pair(size):
        return device_buffer(size).fill_(0), device_buffer(size).fill_(1)

    with torch.cuda.device(dev):
        pinned = _series("pinned host-to-device copy", name, fits, pinned_pair, repeats, warmup, dev,
                         non_blocking=True)
        pageable = _series("pageable host-to-device copy", name, fits, pageable_pair, repeats, warmup, dev)
        d2d = _series("device-to-device copy", name, fits, d2d_pair, repeats, warmup, dev)
        torch.cuda.empty_cache()
        from ..wrappers.host_embedding import cuda_view_of_pinned

        uva_sizes = tuple(fits) + (() if quick or sizes != FULL_SIZES else FULL_UVA_EXTRA_SIZES)
        uva = uva_read_series(uva_sizes, repeats=repeats, warmup=warmup, cuda=dev,
                              view=lambda host: cuda_view_of_pinned(host, dev), pin=True, required=len(fits))
        matmul = matmul_tflops(dev, matmul_n, torch.bfloat16, repeats=repeats, warmup=warmup, cuda=dev)
        decode = decode_read_gbps(dev, max(fits), repeats=repeats, warmup=warmup, cuda=dev)
        torch.cuda.empty_cache()
    return Profile(
        device=torch.cuda.get_device_name(dev), integrated=bool(getattr(props, "is_integrated", False)),
        link_gbps_pinned=_rate(pinned, 1), link_gbps_pageable=_rate(pageable, 1), vram_gbps=_rate(d2d, 2),
        device_memory_total_bytes=int(total), device_memory_free_bytes=int(free), no_link_reason=None,
        h2d_pinned_samples_s=pinned, h2d_pageable_samples_s=pageable, d2d_samples_s=d2d,
        uva_read_gbps=_rate(uva, 1), uva_read_samples_s=uva, decode_read_gbps=decode, matmul_tflops=matmul,
        matmul_dtype="bfloat16", compute_capability="{}.{}".format(*torch.cuda.get_device_capability(dev)),
        handoff_s=cpu["handoff_s"], **common,
    )
