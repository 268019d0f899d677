"""The compiled kernel seen from Python: checked arguments in, one ctypes call, f32 out.

:class:`MoEJob` is the form a CUDA graph needs: every pointer and size of one call in a C
struct, kept alive with its tensors, so ``cudaLaunchHostFunc(stream, job.function_pointer,
job.address)`` runs the host's experts with no Python on the way. :func:`moe` builds a
job per call and runs it at once.
"""

from __future__ import annotations

import ctypes
import math
import os
import statistics
import time

import torch

from . import build, cores, reference
from .weights import Activation, ExpertWeights

FMT_CODE = {"bf16": 0, "mxfp4": 1, "fp8-block": 2, "int4": 3}
#: int4's code by its scales' dtype (the C side reads bf16 or f16 scales as they are).
INT4_CODE = {torch.bfloat16: 3, torch.float16: 4}
#: Formats served by torch's own float32 ops instead of the C kernel (see :func:`moe`).
TORCH_FORMATS = frozenset({"f32"})
ACT_CODE = {"silu": 0, "swigluoai": 1, "gelu_tanh": 2}
DT_NONE, DT_BF16, DT_F32 = 0, 1, 2
STATUS = {1: "topk_ids holds an expert id >= the number of experts", 2: "the kernel's workspace could not be allocated",
          3: "the format or activation code is not one the kernel knows",
          4: "the kernel's threads could not be started (pthread_create failed: too many threads for the process's "
             "limits, or no memory for their stacks)"}
#: What to do about each status, for the one line a failed step raises.
FIX = {1: "the router picked experts this layer does not hold: plan the group served uva or on the device "
          "(selective-offload plan without --host-compute) and report the model",
       2: "the host ran out of memory: free host memory, or lower --max-num-seqs",
       3: f"the compiled kernel does not match this package: set {build.ENV_KERNEL_CACHE} to an empty folder of "
          "your own to build it again",
       4: "the process may start no more threads: raise its limit (ulimit -u) or lower --cpu-threads"}

#: Failed jobs already raised on (:func:`raise_if_failed`), by the library's count.
_RAISED = 0
#: The group each job serves, by the job's C address (what the library records of a failure).
_GROUPS: dict[int, str] = {}


class JobFailed(RuntimeError):
    """A host-compute job failed; its output was filled with NaN, never left stale."""


def raise_if_failed(where: str | None = None, *, at_start: bool = False) -> None:
    """Raise :class:`JobFailed`, in one line naming the group and what to do, when a job has
    failed since the last call (or the last failure :meth:`MoEJob.run` raised on), however
    it was run: directly, or through its host-function entry (:meth:`MoEJob.launch`; a CUDA
    host function, which cannot raise and is not waited for). vLLM's worker calls this at
    each step's host synchronisation, after the step's device work and before its sampled
    tokens leave the worker (``vllm_glue.host_compute.check_at_step_sync``). A failed job
    filled its output with NaN, so no step reads the previous step's sums. ``where``: the
    group to name when the failed job was made without one. ``at_start``: the failure came
    while vLLM profiled and warmed the model up, before any request (the line says the
    engine does not start)."""
    global _RAISED
    if _LIB is None:  # no kernel loaded: no job ever ran
        return
    count = int(_LIB.so_failures())
    if count > _RAISED:
        failed, _RAISED = count - _RAISED, count
        status = int(_LIB.so_last_failure())
        group = _GROUPS.get(int(_LIB.so_last_failed_job() or 0)) or where or "host-compute"
        outcome = ("while vLLM profiled and warmed up the model", "the engine does not start") if at_start else (
            "in this step", "its tokens are not returned")
        raise JobFailed(f"{group}: the host CPU's kernel failed {outcome[0]} ({STATUS.get(status, f'status {status}')}"
                        f"; {failed} job(s)), so its sums were NaN and {outcome[1]}; {FIX.get(status, 'report it')}")


def _seen_failures(lib: ctypes.CDLL) -> None:
    """A failure :meth:`MoEJob.run` raised on itself is not raised again."""
    global _RAISED
    if lib is _LIB:
        _RAISED = max(_RAISED, int(lib.so_failures()))


class _Job(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int64) for n in ("fmt", "act", "has_limit")] + [
        ("alpha", ctypes.c_float), ("limit", ctypes.c_float)] + [
        (n, ctypes.c_int64) for n in ("T", "K", "E", "H", "I", "block_n", "block_k", "x_dtype", "ids_i64",
                                      "bias_dtype", "threads")] + [
        (n, ctypes.c_void_p) for n in ("x", "topk_ids", "topk_weights", "host_mask", "w13", "w2", "w13_scale",
                                       "w2_scale", "w13_bias", "w2_bias", "w13_zeros", "w2_zeros", "out",
                                       "workspace")] + [
        (n, ctypes.c_int64) for n in ("workspace_bytes", "status", "runs", "tokens", "experts_read")]


_LIB: ctypes.CDLL | None = None
_ERROR: build.KernelUnavailable | None = None


def library(again: bool = False) -> ctypes.CDLL:
    """This machine's compiled kernel (built on first use); KernelUnavailable when it cannot be.
    A failure is remembered for the process; ``again``: try once more (an engine start after
    the user fixed what the last one refused)."""
    global _LIB, _ERROR
    if again and _LIB is None:
        _ERROR = None
    if _LIB is None and _ERROR is None:
        try:
            _LIB = build.load()
            if _LIB.so_moe_job_size() != ctypes.sizeof(_Job):
                raise build.KernelUnavailable(
                    f"host-compute CPU kernels: the compiled job struct is {_LIB.so_moe_job_size()} bytes, Python's "
                    f"{ctypes.sizeof(_Job)}; set {build.ENV_KERNEL_CACHE} to an empty folder of your own to build it "
                    f"again")
        except build.KernelUnavailable as e:
            _LIB, _ERROR = None, e
        else:
            set_pool_cpus(default_pool_cpus(_LIB), _LIB)
    if _ERROR is not None:
        raise _ERROR
    return _LIB


def omp_places(library_: ctypes.CDLL | None = None) -> list[int]:
    """The CPUs of the OpenMP places torch's runtime was given (``OMP_PLACES`` or
    ``GOMP_CPU_AFFINITY``, as vLLM's CPU worker binds its threads), in order; [] when none."""
    lib = library_ or library()
    buf = (ctypes.c_int32 * 1024)()
    return list(buf[:int(lib.so_omp_places(buf, 1024))])


def default_pool_cpus(library_: ctypes.CDLL | None = None) -> list[int]:
    """Where the kernels' pool pins its workers unless told otherwise: the cores of torch's
    OpenMP places where it has them (vLLM's CPU worker's binding: its engine thread is on
    the first, the kernel's caller), else one CPU per physical core of the NUMA node this
    process is bound to (:func:`.cores.cores_of_one_node`)."""
    return omp_places(library_) or cores.cores_of_one_node()


def set_pool_cpus(cpus: list[int] | None, library_: ctypes.CDLL | None = None) -> None:
    """Pin the kernels' pool to ``cpus`` from now on, workers already made included: a job of
    n threads runs on its calling thread (not pinned: it is the caller's) and workers 1 ..
    n-1, worker w on ``cpus[w % len(cpus)]``; so ``cpus[0]`` and the cores past the job's
    threads are left to the caller and the engine's other threads. ``None``:
    :func:`default_pool_cpus`; ``[]``: not pinned (workers inherit the binding of the thread
    that made them)."""
    lib = library_ or library()
    cpus = default_pool_cpus(lib) if cpus is None else [int(c) for c in cpus]
    bad = [c for c in cpus if not 0 <= c < 1024]
    if bad or len(cpus) > 1024:
        raise ValueError(f"host-compute kernel: cannot pin threads to CPUs {bad or cpus[1024:]}; give at most 1024 "
                         f"CPU ids of this machine (0-{(os.cpu_count() or 1) - 1})")
    lib.so_pool_set_cpus((ctypes.c_int32 * max(1, len(cpus)))(*cpus), len(cpus))


def pool_cpus(library_: ctypes.CDLL | None = None) -> list[int]:
    """The CPUs the kernels' pool pins its workers to ([]: not pinned)."""
    lib = library_ or library()
    buf = (ctypes.c_int32 * 1024)()
    return list(buf[:int(lib.so_pool_cpus(buf, 1024))])


def pool_threads(library_: ctypes.CDLL | None = None) -> list[int]:
    """The kernel thread ids of the pool's workers in this process (``/proc/self/task/TID``);
    [] before a job of more than one thread made them, and in a fork child until its own."""
    lib = library_ or library()
    buf = (ctypes.c_int32 * 1024)()
    return list(buf[:int(lib.so_pool_tids(buf, 1024))])


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _cpu(name: str, t: torch.Tensor) -> None:
    if t.device.type != "cpu":
        raise ValueError(f"host-compute kernel: {name} is on {t.device}; it computes on host (CPU) tensors only")
    if not t.is_contiguous():
        raise ValueError(f"host-compute kernel: {name} is not contiguous; pass a contiguous tensor")


def _biases(weights: ExpertWeights) -> tuple[torch.Tensor | None, torch.Tensor | None, int]:
    """Both biases in one dtype the kernel reads (bf16 or f32), converted once and kept."""
    b13, b2 = weights.w13_bias, weights.w2_bias
    if b13 is None and b2 is None:
        return None, None, DT_NONE
    if b13 is not None and b2 is not None and b13.dtype == b2.dtype:
        return b13, b2, DT_BF16 if b13.dtype == torch.bfloat16 else DT_F32
    if "biases" not in weights._cache:
        E, I, H = weights.num_experts, weights.intermediate, weights.hidden
        weights._cache["biases"] = (
            b13.float().contiguous() if b13 is not None else torch.zeros(E, 2 * I),
            b2.float().contiguous() if b2 is not None else torch.zeros(E, H))
    return *weights._cache["biases"], DT_F32


class _HostFunctionJob:
    """What a CUDA host function needs of a job (``wrappers.host_function``): the C struct's
    address and the C entry that runs it, named by ``ENTRY`` in the compiled library."""

    ENTRY: str
    lib: ctypes.CDLL
    job: ctypes.Structure

    @property
    def address(self) -> int:
        return ctypes.addressof(self.job)

    @property
    def function_pointer(self) -> int:
        return ctypes.cast(getattr(self.lib, self.ENTRY), ctypes.c_void_p).value

    def name(self, group: str) -> None:
        """The group a failure of this job is raised under (:func:`raise_if_failed`)."""
        _GROUPS[self.address] = group

    def launch(self) -> None:
        """Run the job as a CUDA host function does: through its C entry, with no check. A
        failure is counted, its output NaN, and raised at the next :func:`raise_if_failed`
        (each step's host synchronisation); the CPU build's host steps run so."""
        getattr(self.lib, self.ENTRY)(self.address)

    @property
    def runs(self) -> int:
        """Times the job ran, counted by the job itself (CUDA graph replays included)."""
        return int(self.job.runs)

    @property
    def tokens(self) -> int:
        """Tokens over those runs, counted by the job (its fixed T per run)."""
        return int(self.job.tokens)


class MoEJob(_HostFunctionJob):
    """One call's arguments, fixed: re-run it after writing new values into the same x,
    topk_ids and topk_weights tensors (what a CUDA graph replays). The tensors are kept
    alive by the job. Its sizes are fixed too, its buffers need not be its own: a job of T
    tokens reads and writes the first T rows of whatever it is given, so jobs of fewer
    tokens can be made over prefixes of the same buffers and share one ``workspace``
    (uint8, at least ``so_moe_workspace_bytes`` of its sizes), as long as they run one at a
    time. ``function_pointer`` is ``so_moe_job_run`` (a ``cudaHostFn_t``),
    ``address`` its argument; after a run ``status`` is 0, or see :meth:`check`."""

    ENTRY = "so_moe_job_run"

    def __init__(self, x, topk_ids, topk_weights, weights: ExpertWeights, activation: Activation, *,
                 out: torch.Tensor, threads: int | None = None, host_mask: torch.Tensor | None = None,
                 library_: ctypes.CDLL | None = None, workspace: torch.Tensor | None = None):
        self.lib = library_ or library()
        T, H, E = x.shape[0] if x.dim() == 2 else -1, weights.hidden, weights.num_experts
        if x.dim() != 2 or x.shape[1] != H or x.dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"host-compute kernel: x is {x.dtype} {list(x.shape)}; expected bf16 or float32 [T, {H}]")
        if topk_ids.dtype not in (torch.int32, torch.int64) or topk_ids.dim() != 2 or topk_ids.shape[0] != T:
            raise ValueError(f"host-compute kernel: topk_ids is {topk_ids.dtype} {list(topk_ids.shape)}; "
                             f"expected int32 or int64 [{T}, k]")
        K = topk_ids.shape[1]
        if topk_weights.dtype != torch.float32 or tuple(topk_weights.shape) != (T, K):
            raise ValueError(f"host-compute kernel: topk_weights is {topk_weights.dtype} {list(topk_weights.shape)}; "
                             f"expected float32 [{T}, {K}]")
        if out.dtype != torch.float32 or tuple(out.shape) != (T, H):
            raise ValueError(f"host-compute kernel: out is {out.dtype} {list(out.shape)}; expected float32 [{T}, {H}]")
        if host_mask is not None:
            if host_mask.dtype not in (torch.uint8, torch.bool) or tuple(host_mask.shape) != (E,):
                raise ValueError(f"host-compute kernel: host_mask is {host_mask.dtype} {list(host_mask.shape)}; "
                                 f"expected bool or uint8 [{E}]")
            host_mask = host_mask.view(torch.uint8) if host_mask.dtype == torch.bool else host_mask
        if weights.fmt not in FMT_CODE:
            raise ValueError(f"host-compute kernel: format {weights.fmt!r} has no C job"
                             + (" (float32 experts are computed by torch's ops, with no job a CUDA host function could "
                                "run: serve the model in bf16)" if weights.fmt in TORCH_FORMATS else ""))
        b13, b2, bias_dtype = _biases(weights)
        named = {**weights.tensors(), **dict(x=x, topk_ids=topk_ids, topk_weights=topk_weights, out=out,
                                             host_mask=host_mask, w13_bias=b13, w2_bias=b2)}
        for name, t in named.items():
            if t is not None:
                _cpu(name, t)
        self.threads = int(threads) if threads else torch.get_num_threads()
        nbytes = self.lib.so_moe_workspace_bytes(T, K, E, H, weights.intermediate)
        if workspace is not None:  # a workspace shared with other jobs (wrappers.host_buffers)
            _cpu("workspace", workspace)
            if workspace.dtype != torch.uint8 or workspace.numel() < nbytes:
                raise ValueError(f"host-compute kernel: the workspace holds {workspace.numel()} bytes; a job of "
                                 f"{T} tokens needs {nbytes}")
        self.workspace = workspace if workspace is not None else torch.empty(nbytes, dtype=torch.uint8)
        self.tensors = named  # kept alive as long as the job
        self.out = out
        lim = activation.limit
        self.job = _Job(
            fmt=INT4_CODE[weights.w13_scale.dtype] if weights.fmt == "int4" else FMT_CODE[weights.fmt],
            act=ACT_CODE[activation.kind], has_limit=int(lim is not None),
            alpha=activation.alpha, limit=float(lim) if lim is not None else 0.0, T=T, K=K, E=E, H=H,
            I=weights.intermediate, block_n=weights.block[0], block_k=weights.block[1],
            x_dtype=DT_BF16 if x.dtype == torch.bfloat16 else DT_F32, ids_i64=int(topk_ids.dtype == torch.int64),
            bias_dtype=bias_dtype, threads=self.threads, x=_ptr(x), topk_ids=_ptr(topk_ids),
            topk_weights=_ptr(topk_weights), host_mask=_ptr(host_mask), w13=_ptr(weights.w13), w2=_ptr(weights.w2),
            w13_scale=_ptr(weights.w13_scale), w2_scale=_ptr(weights.w2_scale), w13_bias=_ptr(b13),
            w2_bias=_ptr(b2), w13_zeros=_ptr(weights.w13_zeros), w2_zeros=_ptr(weights.w2_zeros), out=_ptr(out),
            workspace=_ptr(self.workspace), workspace_bytes=nbytes, status=0, runs=0, tokens=0, experts_read=0)

    @property
    def status(self) -> int:
        return int(self.job.status)

    @property
    def experts_read(self) -> int:
        """Distinct host experts the job's runs read (each once per run), counted by the job."""
        return int(self.job.experts_read)

    def check(self) -> None:
        if self.job.status:
            _seen_failures(self.lib)
            raise ValueError(f"host-compute kernel: {STATUS.get(self.status, f'status {self.status}')}")

    def run(self) -> torch.Tensor:
        self.lib.so_moe_job_run(self.address)
        self.check()
        return self.out


def moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, weights: ExpertWeights,
        activation: Activation, *, out: torch.Tensor | None = None, threads: int | None = None,
        host_mask: torch.Tensor | None = None, library_: ctypes.CDLL | None = None) -> torch.Tensor:
    """The host's picks of one MoE layer, float32 [T, H] (see the module docstring of
    selective_offload.cpu_kernels for the formula); CPU tensors only."""
    for name, t in (("x", x), ("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        if t.device.type != "cpu":
            raise ValueError(f"host-compute kernel: {name} is on {t.device}; it computes on host (CPU) tensors only")
    if x.dtype not in (torch.bfloat16, torch.float32):
        x = x.float()
    if topk_weights.dtype != torch.float32:
        topk_weights = topk_weights.float()
    if weights.fmt in TORCH_FORMATS:
        # Experts an engine holds in float32 (vLLM's CPU build runs a model in float32 when
        # asked): no compressed bytes to decode, so torch's float32 ops are the kernel,
        # exact to float32 where the C kernel's AVX512-BF16 path rounds the tokens.
        result = reference.moe_reference(x, topk_ids, topk_weights, weights, activation, host_mask=host_mask)
        return result if out is None else out.copy_(result)
    if out is None:
        out = torch.empty(x.shape[0], weights.hidden, dtype=torch.float32)
    job = MoEJob(x.contiguous(), topk_ids.contiguous(), topk_weights.contiguous(), weights, activation, out=out,
                 threads=threads, host_mask=host_mask, library_=library_)
    return job.run()


class _RowsJob(ctypes.Structure):
    _fields_ = [(n, ctypes.c_void_p) for n in ("w", "x", "out")] + [
        (n, ctypes.c_int64) for n in ("R", "C", "x_dtype", "T", "threads", "status")] + [
        ("workspace", ctypes.c_void_p)] + [(n, ctypes.c_int64) for n in ("workspace_bytes", "runs", "tokens")]


class RowsJob(_HostFunctionJob):
    """One call of the rows walk (:func:`rows`) as a C struct kept alive with its tensors:
    ``x`` [T, C] (bf16 or float32) dotted with every row of the bf16 ``weight`` [R, C] into
    ``out`` (float32 [T, R]). ``function_pointer(address)`` runs it with no Python, which is
    what a CUDA host function (``wrappers.host_function``) needs; :meth:`run` runs it here."""

    ENTRY = "so_rows_job_run"

    def __init__(self, x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, *, threads: int | None = None,
                 library_: ctypes.CDLL | None = None, workspace: torch.Tensor | None = None):
        for name, t in (("x", x), ("weight", weight), ("out", out)):
            _cpu(name, t)
        if weight.dtype != torch.bfloat16 or weight.dim() != 2:
            raise ValueError(f"host rows kernel: weight is {weight.dtype} {list(weight.shape)}; it reads bf16 [R, C]")
        if x.dim() != 2 or x.shape[1] != weight.shape[1] or x.dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"host rows kernel: x is {x.dtype} {list(x.shape)} and weight {list(weight.shape)}: they "
                             "do not multiply (x must be bf16 or float32 [T, C])")
        if out.dtype != torch.float32 or tuple(out.shape) != (x.shape[0], weight.shape[0]):
            raise ValueError(f"host rows kernel: out is {out.dtype} {list(out.shape)}; expected float32 "
                             f"[{x.shape[0]}, {weight.shape[0]}]")
        if not (x.is_contiguous() and weight.is_contiguous() and out.is_contiguous()):
            raise ValueError("host rows kernel: x, weight and out must be contiguous")
        self.lib = library_ or library()
        if self.lib.so_rows_job_size() != ctypes.sizeof(_RowsJob):
            raise build.KernelUnavailable(f"host rows kernel: the compiled job struct is {self.lib.so_rows_job_size()} "
                                          f"bytes, Python's {ctypes.sizeof(_RowsJob)}; set {build.ENV_KERNEL_CACHE} "
                                          f"to an empty folder of your own to build it again")
        if workspace is not None:
            _cpu("workspace", workspace)
        self.tensors = (x, weight, out, workspace)  # kept alive as long as the job
        self.out = out
        self.threads = int(threads) if threads else torch.get_num_threads()
        self.job = _RowsJob(w=_ptr(weight), x=_ptr(x), out=_ptr(out), R=weight.shape[0], C=weight.shape[1],
                            x_dtype=DT_F32 if x.dtype == torch.float32 else DT_BF16, T=x.shape[0],
                            threads=self.threads, status=0, workspace=_ptr(workspace),
                            workspace_bytes=0 if workspace is None else workspace.numel() * workspace.element_size(),
                            runs=0, tokens=0)

    def run(self) -> torch.Tensor:
        self.lib.so_rows_job_run(self.address)
        if self.job.status:
            _seen_failures(self.lib)
            raise RuntimeError(f"host rows kernel: {STATUS.get(int(self.job.status), f'status {self.job.status}')}")
        return self.out


def rows(x: torch.Tensor, weight: torch.Tensor, *, threads: int | None = None, out: torch.Tensor | None = None,
         library_: ctypes.CDLL | None = None) -> torch.Tensor:
    """``x @ weight.T`` on the host CPU, float32 [T, R], for a bf16 ``weight`` [R, C] (an LM
    head's host rows) by the C row walk (:class:`RowsJob`) with ``threads`` threads (torch's
    count when ``None``, as the experts' kernel); a float32 ``weight`` by torch's own float32
    op, exact. CPU tensors only."""
    for name, t in (("x", x), ("weight", weight)):
        if t.device.type != "cpu":
            raise ValueError(f"host rows kernel: {name} is on {t.device}; it computes on host (CPU) tensors only")
    if weight.dim() != 2 or x.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"host rows kernel: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not multiply")
    if weight.dtype == torch.float32:
        result = torch.nn.functional.linear(x.float(), weight)
        return result if out is None else out.copy_(result)
    if weight.dtype != torch.bfloat16:
        raise ValueError(f"host rows kernel: a {weight.dtype} weight; it reads bf16 (or float32, by torch)")
    x = (x if x.dtype in (torch.bfloat16, torch.float32) else x.float()).contiguous()
    if out is None:
        out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
    return RowsJob(x, weight.contiguous(), out, threads=threads, library_=library_).run()


def read_sum(lib: ctypes.CDLL, buf: torch.Tensor, threads: int) -> float:
    """The C read kernel's sum of ``buf`` with ``threads`` threads; RuntimeError, in one line,
    when it is NaN (its workers could not be started, or its work not allocated), so that no
    probe times a sum never done."""
    total = lib.so_read_sum(buf.data_ptr(), buf.numel() * buf.element_size(), threads)
    if math.isnan(total):
        raise RuntimeError(f"host read kernel: {STATUS[4]}; {FIX[4]}")
    return total


def read_gbps(threads: int, nbytes: int = 256 << 20, repeats: int = 7, library_: ctypes.CDLL | None = None) -> float:
    """This machine's read bandwidth with ``threads`` threads (GB/s, 1e9 bytes), the median
    of ``repeats`` sums of a buffer larger than the caches, by the C read kernel; RuntimeError
    when its threads cannot be started (:func:`read_sum`)."""
    lib = library_ or library()
    buf = torch.ones(nbytes // 4, dtype=torch.float32)
    read_sum(lib, buf, threads)  # warm: threads started, pages touched
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        read_sum(lib, buf, threads)
        times.append(time.perf_counter() - t0)
    return buf.numel() * 4 / statistics.median(times) / 1e9
