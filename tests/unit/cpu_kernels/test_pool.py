"""The kernels' own thread pool (cpu_kernels/pool.h): the same sums at every thread count,
workers asleep (not spinning) between calls, each pinned to the core it is given, a forked
child computing with a pool of its own, and a worker that cannot be made failing the job
loudly rather than hanging it."""

from __future__ import annotations

import os
import resource
import signal
import time

import pytest
import torch
from makers import experts, routing

from selective_offload import cpu_kernels as ck
from selective_offload.cpu_kernels import cores, kernel, reference

SHAPES = {"bf16": (304, 176), "mxfp4": (224, 192), "fp8-block": (208, 96), "int4": (224, 160)}


@pytest.fixture
def default_pinning(lib):
    yield
    kernel.set_pool_cpus(None, lib)


def oracle(x, ids, tw, w, act, lib):
    int8 = w.fmt in ("mxfp4", "int4") and bool(lib.so_int8_mxfp4())
    return reference.moe_reference(x, ids, tw, w, act, int8_vectors=int8)


def close(got, want, lib, fmt):
    int8 = fmt in ("mxfp4", "int4") and bool(lib.so_int8_mxfp4())
    tol = 1e-2 if lib.so_bf16_activations() or int8 else 1e-4
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * float(want.abs().max().clamp(min=1e-6)))


def task_stat(tid: int) -> tuple[str, int]:
    """A thread's state letter and its CPU ticks (user + system) from /proc."""
    fields = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
    return fields[0], int(fields[11]) + int(fields[12])


@pytest.mark.parametrize("fmt", list(SHAPES))
def test_every_thread_count_gives_the_references_sums(lib, fmt):
    """1 thread (no pool), 2 and 3, and more threads than cores: the work is shared out
    dynamically and every output element still has one writer."""
    H, I = SHAPES[fmt]
    w = experts(fmt, 6, H, I, bias="bf16", seed=3, block=(64, 64))
    act = ck.Activation("swigluoai" if fmt == "mxfp4" else "silu")
    for T, K in ((1, 4), (9, 3)):
        ids, tw = routing(T, K, w.num_experts, T)
        x = torch.randn(T, H).bfloat16()
        want = oracle(x, ids, tw, w, act, lib)
        results = [ck.moe(x, ids, tw, w, act, threads=n, library_=lib) for n in (1, 2, 3, 2 * (os.cpu_count() or 1) + 1)]
        for got in results:
            close(got, want, lib, fmt)
        for got in results[1:]:  # the same sums whatever the threads (each element has one writer)
            torch.testing.assert_close(got, results[0], rtol=1e-5, atol=1e-6)
    assert len(kernel.pool_threads(lib)) >= 2 * (os.cpu_count() or 1)


def test_the_rows_walk_and_the_read_sum_are_the_same_at_every_thread_count(lib):
    w = torch.randn(300, 200).bfloat16()
    x = torch.randn(3, 200).bfloat16()
    want = x.float() @ w.float().T
    buf = torch.rand(100_003)
    for n in (1, 2, 5):
        got = ck.rows(x, w, threads=n, library_=lib)
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2 * float(want.abs().max()))
        assert abs(lib.so_read_sum(buf.data_ptr(), buf.numel() * 4, n) - float(buf.double().sum())) < 1e-2


def test_workers_sleep_between_calls(lib):
    """After a call the workers spin for a few microseconds at most, then sleep: a moment
    later each is asleep ('S') and burns no CPU while the caller is elsewhere."""
    H, I = SHAPES["bf16"]
    w = experts("bf16", 6, H, I, seed=1)
    ids, tw = routing(2, 3, w.num_experts, 1)
    x = torch.randn(2, H).bfloat16()
    for _ in range(5):
        ck.moe(x, ids, tw, w, ck.Activation("silu"), threads=3, library_=lib)
    tids = kernel.pool_threads(lib)
    assert len(tids) >= 2
    time.sleep(0.05)
    before = {t: task_stat(t) for t in tids}
    time.sleep(0.5)
    after = {t: task_stat(t) for t in tids}
    for t in tids:
        assert before[t][0] == "S" and after[t][0] == "S", f"worker {t} is {after[t][0]}, not asleep"
        assert after[t][1] - before[t][1] <= 1, f"worker {t} burnt {after[t][1] - before[t][1]} ticks while idle"


def test_the_default_pinning_is_the_node_this_process_is_bound_to(lib):
    """No OpenMP places here: the node's cores, one CPU per physical core, of the CPUs this
    process may use; the ones vLLM's CPU worker gives torch's runtime where it has them.
    The library is pinned so from the moment it is loaded."""
    assert kernel.pool_cpus(lib) == kernel.default_pool_cpus(lib)
    assert kernel.default_pool_cpus(lib) == (kernel.omp_places(lib) or cores.cores_of_one_node())
    assert set(kernel.default_pool_cpus(lib)) <= os.sched_getaffinity(0) | set(kernel.omp_places(lib))


def test_workers_are_pinned_to_the_cores_given(lib, default_pinning):
    cpus = sorted(os.sched_getaffinity(0))
    order = cpus[::-1]
    ck.rows(torch.randn(1, 64).bfloat16(), torch.randn(256, 64).bfloat16(), threads=3, library_=lib)
    kernel.set_pool_cpus(cpus, lib)  # the workers already made are moved
    tids = kernel.pool_threads(lib)
    for w, tid in enumerate(tids, start=1):
        assert os.sched_getaffinity(tid) == {cpus[w % len(cpus)]}
    kernel.set_pool_cpus(order, lib)
    ck.rows(torch.randn(1, 64).bfloat16(), torch.randn(256, 64).bfloat16(), threads=len(tids) + 2, library_=lib)
    assert kernel.pool_cpus(lib) == order
    for w, tid in enumerate(kernel.pool_threads(lib), start=1):  # old and new workers alike
        assert os.sched_getaffinity(tid) == {order[w % len(order)]}
    with pytest.raises(ValueError, match="cannot pin threads to CPUs"):
        kernel.set_pool_cpus([-1], lib)


def test_ranks_sharing_a_node_pin_their_pools_to_slices_of_its_cores(lib, default_pinning, monkeypatch):
    """Ranks whose CPU affinity sets are the same (unbound, or bound to one node together)
    pin their pools to disjoint slices of the node's cores; ranks bound apart (vLLM's
    ``--numa-bind``: each on its own node) keep their own cores whole. The affinity sets are
    given here as vLLM's world group would gather them (no world in this process)."""
    from selective_offload.vllm_glue import host_compute as glue

    cores_before = kernel.default_pool_cpus(lib)
    node = {frozenset(range(0, 6)): [0, 1, 2, 3, 4, 5], frozenset(range(6, 12)): [6, 7, 8, 9, 10, 11]}
    seen = []
    monkeypatch.setattr(kernel, "set_pool_cpus", lambda cpus, library_=None: seen.append(cpus))

    def pinned(affinities, rank):
        mine = frozenset(affinities[rank])
        monkeypatch.setattr(kernel, "default_pool_cpus", lambda library_=None: node[mine])
        monkeypatch.setattr(glue, "rank_affinities", lambda: (rank, tuple(frozenset(a) for a in affinities)))
        glue.pin_to_rank_cores(len(affinities))
        return seen.pop()

    apart = [set(range(0, 6)), set(range(6, 12))]
    assert [pinned(apart, r) for r in (0, 1)] == [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]]
    together = [set(range(0, 6))] * 3
    assert [pinned(together, r) for r in (0, 1, 2)] == [[0, 1], [2, 3], [4, 5]]
    two_nodes_four_ranks = [set(range(0, 6)), set(range(0, 6)), set(range(6, 12)), set(range(6, 12))]
    assert [pinned(two_nodes_four_ranks, r) for r in range(4)] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
    monkeypatch.setattr(glue, "rank_affinities", lambda: None)  # no vLLM world: the default pinning stays
    glue.pin_to_rank_cores(3)
    assert seen == [] and cores_before == kernel.pool_cpus(lib)


def in_child(fn, timeout_s: float = 60.0) -> int:
    """Run ``fn`` in a forked child; its exit status (0: fn returned True), or "hung" when
    it has not ended in ``timeout_s`` (it is killed)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = 0 if fn() else 3
        except BaseException:  # noqa: BLE001 - a child reports by its status only
            code = 2
        os._exit(code)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return "hung"


def test_a_forked_child_computes_with_a_pool_of_its_own(lib):
    H, I = SHAPES["int4"]
    w = experts("int4", 6, H, I, seed=2)
    ids, tw = routing(3, 2, w.num_experts, 2)
    x = torch.randn(3, H).bfloat16()
    act = ck.Activation("silu")
    want = ck.moe(x, ids, tw, w, act, threads=2, library_=lib)  # the parent's pool exists
    assert kernel.pool_threads(lib)

    def child():
        fresh = kernel.pool_threads(lib) == []  # the parent's workers are not the child's
        got = ck.moe(x, ids, tw, w, act, threads=2, library_=lib)
        return fresh and torch.equal(got, want) and len(kernel.pool_threads(lib)) >= 1

    assert in_child(child) == 0


def test_a_worker_that_cannot_be_made_fails_the_job_loudly(lib):
    """In a child whose address space has no room for a worker's stack (the limit just above
    what it maps), a job of many threads is failed (NaN, counted, its status named), not left
    waiting for a worker; so is a job of more threads than the pool holds."""
    H, I = SHAPES["bf16"]
    w = experts("bf16", 4, H, I, seed=4)
    ids, tw = routing(2, 2, w.num_experts, 4)
    x = torch.randn(2, H).bfloat16()
    out = torch.zeros(2, H)
    # More workers than the stacks of this process's threads, which a forked child's C
    # library keeps for reuse (the child needs new ones, and has no room for them).
    job = ck.MoEJob(x, ids, tw, w, ck.Activation("silu"), out=out, threads=64, library_=lib)

    def child():
        failures = lib.so_failures()
        size = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmSize:")) * 1024
        resource.setrlimit(resource.RLIMIT_AS, (size + (64 << 10), resource.RLIM_INFINITY))
        lib.so_moe_job_run(job.address)
        return job.status == 4 and bool(torch.isnan(out).all()) and lib.so_failures() == failures + 1

    assert in_child(child) == 0
    with pytest.raises(ValueError, match="threads could not be started"):
        ck.MoEJob(x, ids, tw, w, ck.Activation("silu"), out=out, threads=100_000, library_=lib).run()


def test_a_read_probe_whose_workers_cannot_be_made_raises(lib):
    """The bandwidth probe's read sum is NaN when its workers cannot be made; the probe
    raises that in one line (what failed, what to do) rather than timing a sum never done
    and reporting a bandwidth the planner would trust."""
    assert kernel.read_gbps(2, nbytes=1 << 20, repeats=1, library_=lib) > 0

    def child():
        size = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmSize:")) * 1024
        resource.setrlimit(resource.RLIMIT_AS, (size + (64 << 10), resource.RLIM_INFINITY))
        try:
            kernel.read_gbps(64, nbytes=4096, repeats=1, library_=lib)
        except RuntimeError as e:
            return "threads could not be started" in str(e) and "ulimit -u" in str(e) and "\n" not in str(e)
        return False

    assert in_child(child) == 0
