"""Which cores the host-compute kernels' threads run on: one logical CPU per physical core
of the NUMA node this process is bound to (the node vLLM binds a worker to, not node 0 by
rule), read from ``/sys``. The probe counts them (its thread count), the glue splits them
between ranks and leaves one for vLLM's engine thread on CUDA, and the kernels' pool pins
its workers to them (:func:`.kernel.set_pool_cpus`)."""

from __future__ import annotations

import os
from pathlib import Path


def cpulist(text: str) -> set[int]:
    """A Linux cpulist (``0-3,8,10-11``) as a set."""
    out: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def allowed_cpus() -> set[int]:
    """The CPUs this process may run on (its main thread's binding)."""
    return os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))


def cores_of_one_node(sys_root: str = "/sys", allowed: set[int] | None = None) -> list[int]:
    """One logical CPU (the lowest) per physical core of the NUMA node this process runs on,
    ascending: the node is the one holding most of the CPUs this process may run on
    (``allowed``, by default ``os.sched_getaffinity``); falls back to the CPUs this process
    may use when ``/sys`` names no node."""
    if allowed is None:
        allowed = allowed_cpus()
    root = Path(sys_root)
    nodes = []
    for path in sorted(root.glob("devices/system/node/node[0-9]*/cpulist"),
                       key=lambda p: int(p.parent.name.removeprefix("node"))):
        try:
            nodes.append(cpulist(path.read_text()))
        except (OSError, ValueError):
            continue
    node = max(nodes, key=lambda cpus: len(cpus & allowed), default=set(allowed))
    if not node & allowed:
        node = set(allowed)
    cores: dict[tuple[int, int], int] = {}
    for cpu in sorted(node & allowed):
        topo = root / f"devices/system/cpu/cpu{cpu}/topology"
        try:
            core = (int((topo / "physical_package_id").read_text()), int((topo / "core_id").read_text()))
        except (OSError, ValueError):
            core = (0, -1 - cpu)
        cores.setdefault(core, cpu)
    return sorted(cores.values()) or sorted(allowed)[:1] or [0]


def rank_cores(node_cores: list[int], affinities: list[set[int]], rank: int) -> list[int]:
    """The cores a rank's kernel pool is pinned to, of ``node_cores`` (its node's, as
    :func:`cores_of_one_node` reads them from its own binding), given the CPU affinity sets
    of the ranks on this host (``affinities``; ``rank``: this one's index there). The ranks
    whose sets overlap this one's (ranks left unbound, or bound to one node together) split
    the cores in equal slices, in rank order; a rank whose set no other rank's touches
    (vLLM's ``--numa-bind`` putting each rank on its own node, or its own CPUs) keeps them
    whole."""
    sharing = sharing_ranks(affinities, rank)
    if len(sharing) <= 1:
        return list(node_cores)
    at = sharing.index(rank)
    per = max(1, len(node_cores) // len(sharing))
    return node_cores[at * per:(at + 1) * per] or node_cores[-per:]


def sharing_ranks(affinities: list[set[int]], rank: int) -> list[int]:
    """The ranks (indices of ``affinities``, this one's ``rank`` among them) whose CPU
    affinity sets overlap this rank's: those its node's cores are split between."""
    mine = affinities[rank]
    return [i for i, cpus in enumerate(affinities) if i == rank or cpus & mine]
