"""The resident set of a process tree, sampled while it runs: the host-memory benchmark's
measurement.

Why a module of its own: an engine is several processes (the worker, vLLM's engine core,
on the CPU build the process holding the model), so its host memory is the sum of their
resident sets at each moment, sampled with psutil; :func:`sample_tree` does that until the
root exits, names each process by its command line, and leaves out short-lived helpers.
``benchmarks.host_memory`` starts the engines and reads peaks from the samples.
"""

from __future__ import annotations

import statistics
import time

from benchmarks.common import proc_status_bytes

#: A process seen in fewer samples than this is a helper (vLLM runs ``lscpu`` through a
#: shell) or a fork about to exec, whose resident set is its parent's pages counted again:
#: left out of the sums, listed apart.
TRANSIENT_SAMPLES = 5


def _cmd(p) -> str:
    import psutil

    try:
        return " ".join(p.cmdline())[:120]
    except psutil.Error:
        return ""


def _roles(per_pid: dict, root_pid: int) -> None:
    """Name each process of the tree from its last command line: vLLM titles its engine
    core ``VLLM::EngineCore`` and, on the CPU build, the process that holds the model
    ``VLLM::Worker``."""
    for pid, rec in per_pid.items():
        cmd = rec["cmd"].strip()
        if pid == root_pid:
            rec["name"] = "worker (LLM)"
        elif "VLLM::Worker" in cmd:
            rec["name"] = "model worker (VLLM::Worker)"
        elif "EngineCore" in cmd:
            rec["name"] = "engine core"
        elif "resource_tracker" in cmd:
            rec["name"] = "resource tracker"
        else:
            rec["name"] = cmd.split(" -c ")[0].rsplit("/", 1)[-1][:40] or "?"


def sample_tree(proc, interval_s: float, timeout_s: float) -> dict:
    """RSS of ``proc`` and each descendant every ``interval_s`` until it exits. Returns
    the summed samples (wall time, bytes) over the processes that lived through
    ``TRANSIENT_SAMPLES`` samples or more, and each process's peak RSS and last VmHWM."""
    import psutil

    root = psutil.Process(proc.pid)
    raw: list[tuple[float, dict[int, int]]] = []
    per_pid: dict[int, dict] = {}
    deadline = time.monotonic() + timeout_s
    costs = []
    while proc.poll() is None:
        if time.monotonic() > deadline:
            proc.kill()
            raise TimeoutError(f"the engine did not finish in {timeout_s:.0f} s")
        t0 = time.perf_counter()
        try:
            procs = [root] + root.children(recursive=True)
        except psutil.NoSuchProcess:
            break
        sample: dict[int, int] = {}
        for p in procs:
            try:
                rss = p.memory_info().rss
            except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
                continue
            sample[p.pid] = rss
            rec = per_pid.setdefault(p.pid, {"name": None, "cmd": "", "peak_rss_bytes": 0,
                                             "hwm_bytes": None, "samples": 0})
            rec["cmd"] = _cmd(p) or rec["cmd"]  # vLLM retitles its processes once started
            rec["peak_rss_bytes"] = max(rec["peak_rss_bytes"], rss)
            rec["samples"] += 1
            hwm = proc_status_bytes("VmHWM", p.pid)
            if hwm is not None:
                rec["hwm_bytes"] = hwm
        raw.append((time.time(), sample))
        costs.append(time.perf_counter() - t0)
        time.sleep(max(0.0, interval_s - costs[-1]))
    _roles(per_pid, root.pid)
    kept = {pid for pid, rec in per_pid.items() if rec["samples"] >= TRANSIENT_SAMPLES or pid == root.pid}
    for pid, rec in per_pid.items():
        rec["transient"] = pid not in kept
    samples = [(t, sum(b for pid, b in sample.items() if pid in kept)) for t, sample in raw]
    return {"samples": samples, "per_process": per_pid,
            "sample_cost_ms": statistics.median(costs) * 1e3 if costs else None}
