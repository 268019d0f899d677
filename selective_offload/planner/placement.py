"""Step two of planning: where each group goes, cold bytes to the host first, hot ones last.

A decode step reads every resident weight once, so each hot byte kept on the host crosses
the link every step; cold groups (:mod:`.grouping` says which) cost nothing there. So the
cold set goes first (:func:`place_cold`), and only the rest of the deficit is closed from a
menu per decoder layer (:func:`place_hot`): resident, a MoE layer's routed experts read in
place through UVA or computed on the host CPU, a dense layer's MLP computed on the host CPU
(the rest resident or prefetched), or the whole layer through the prefetch offloader. What a placement costs
the device besides its resident bytes (prefetch buffers, a cold tower's transient) and the
host (its shortfall) is counted here too, as is the strategy it amounts to.

Placing never prices a step itself: :func:`place_hot` is handed the step model by
:mod:`.make`, which composes grouping, placement, the vLLM baselines and the notes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ..estimate.host import copied_bytes, copied_step_bytes
from ..estimate.traffic import expert_read_fraction
from ..names import EMBED_SEGMENTS, has_segment
from ..plan_format import (
    COLD_SERVINGS,
    HOST_SERVINGS,
    LAYER_KINDS,
    GroupKind,
    PlanInputs,
    Role,
    Serving,
    Strategy,
    cold_serving,
)
from .grouping import Group


def _spread(count: int, total: int) -> list[int]:
    """``count`` layer indices out of ``total``, evenly spaced and ending at the last one.

    Spacing them out leaves resident layers between two offloaded ones, whose compute the
    prefetch of the next offloaded layer can hide behind.
    """
    return sorted({(k + 1) * total // count - 1 for k in range(count)}) if count else []


@dataclass
class Placing:
    """The placement being built: group name -> placement, and what it costs the device."""

    groups: list[Group]
    budget: int
    where: dict[str, Serving] = field(default_factory=dict)
    #: The largest on-demand tower's device transient (see :func:`tower_transient_bytes`).
    transient: int = 0
    buffers: int = 0
    #: The CPU kernel format a host-compute group of each kind is computed in (its copy
    #: above the crossover is dequantized from it: :func:`copied_transient_bytes`).
    compute_formats: dict[GroupKind, str | None] = field(default_factory=dict)
    #: The sizes the CPU kernel computes a host-compute group of each kind with (``(H, I)``,
    #: :attr:`GroupPlan.kernel_dims`; ``()`` where the config does not say): what its copy
    #: above the crossover dequantizes an expert of.
    kernel_dims: dict[GroupKind, tuple[int, ...]] = field(default_factory=dict)
    #: A split LM head's (rows on the device, rows), by name: a step above its crossover
    #: copies only its host rows.
    head_rows: dict[str, tuple[int, int]] = field(default_factory=dict)
    #: Bytes vLLM's Marlin FP8 repack allocates for one routed-experts layer it post-processes
    #: on the device (:func:`.allocation.marlin_fp8_moe_repack_bytes`); 0 where none runs.
    repack: int = 0
    #: The engine's largest step (``max_num_batched_tokens``) and the tensor-parallel ranks
    #: the copied path's activations and shards are priced at (:func:`copied_transient_bytes`).
    tokens: int = 0
    ranks: int = 1

    def __post_init__(self) -> None:
        self.where = {g.name: Serving.NONE if g.role == Role.ABSENT else
                      cold_serving(g.name, g.kind) if g.vllm_host else Serving.RESIDENT for g in self.groups}

    def like(self, groups: list[Group]) -> "Placing":
        """A new placement of ``groups`` (every one resident, or where vLLM keeps it) on the same
        budget and terms as this one."""
        return Placing(groups, self.budget, compute_formats=self.compute_formats, kernel_dims=self.kernel_dims,
                       head_rows=dict(self.head_rows), repack=self.repack, tokens=self.tokens, ranks=self.ranks)

    def over_budget(self) -> int:
        """Device bytes (resident, tower transient, prefetch buffers) above the budget."""
        device = sum(g.nbytes for g in self.groups if self.where[g.name] == Serving.RESIDENT)
        return device + max(self.all_transient(), self.load_transient()) + self.buffers - self.budget

    def all_transient(self) -> int:
        """The device transient the plan states (``est_transient_device_bytes``): the larger
        of the tower's and the above-crossover copy's (they never run in the same layer)."""
        return max(self.transient, copied_transient_bytes(self))

    def load_transient(self) -> int:
        """The worker's load-time device peak beyond the weights (est_load_transient_device_bytes):
        the repack of one routed-experts layer post-processed on the device: served resident, or
        served uva or prefetch and onloaded for it whole as loaded (the glue's, and vLLM's
        ``device_loading_context``, one layer at a time); a layer computed on the host is not."""
        if not self.repack:
            return 0
        return max((self.repack + (g.nbytes - g.growth if self.where[g.name] != Serving.RESIDENT else 0)
                    for g in self.groups if g.kind == GroupKind.EXPERTS
                    and self.where[g.name] in (Serving.RESIDENT, Serving.UVA, Serving.PREFETCH)), default=0)


def copied_transient_bytes(p: Placing) -> int:
    """The most device memory a step above the crossover holds at once (est): one
    host-compute group's copy at a time (:func:`estimate.host.copied_step_bytes`)."""
    def copied(g: Group) -> int:
        on_device, rows = p.head_rows.get(g.name, (0, 1))
        dims = p.kernel_dims.get(g.kind, ()) if g.kind != GroupKind.MODULE else ()  # the head: its rows alone
        return copied_step_bytes(copied_bytes(g.served_bytes(Serving.COMPUTE), on_device, rows), g.num_experts,
                                 g.dtype_bytes, p.compute_formats.get(g.kind), dims, p.tokens,
                                 g.experts_per_token or 1, p.ranks if g.kind != GroupKind.MODULE else 1)

    return max((copied(g) for g in p.groups if p.where[g.name] == Serving.COMPUTE), default=0)


def place_cold(p: Placing, inputs: PlanInputs) -> None:
    """Cold modules to the host, largest first, until the deficit closes (or all of them)."""
    for g in sorted((g for g in p.groups if g.role == Role.COLD and not g.vllm_host), key=lambda g: -g.nbytes):
        if p.over_budget() <= 0 and not inputs.all_cold:
            break
        p.where[g.name] = cold_serving(g.name, g.kind)
        p.transient = max(p.transient, tower_transient_bytes(g))


def tower_transient_bytes(g: Group) -> int:
    """Device bytes a cold group on the host holds while it runs: the on-demand wrapper
    holds about two blocks and the non-block rest of a tower (the whole of a tower without
    blocks); an embedding is gathered row by row and holds nothing, and so is an n-gram
    table vLLM keeps on the host itself."""
    if g.vllm_host:
        return 0
    if g.largest_block_bytes:
        return 2 * g.largest_block_bytes + g.non_block_bytes
    return 0 if has_segment(g.name, EMBED_SEGMENTS) else g.nbytes


def prefetch_buffer_bytes(layers: list[Group], prefetch_step: int) -> int:
    """vLLM's prefetch offloader keeps ``prefetch_step`` static device slots per parameter
    *name*, each as large as that parameter's largest offloaded copy. In a uniform stack
    that is the largest layer; a hybrid stack (linear- and full-attention layers, as
    Qwen3.5's) needs slots for the union of both kinds' parameters."""
    largest: dict[str, int] = {}
    for g in layers:
        for name, nbytes in (g.param_bytes or {"": g.nbytes}).items():
            largest[name] = max(largest.get(name, 0), nbytes)
    return prefetch_step * sum(largest.values())


def _layer_units(groups: list[Group]) -> list[list[Group]]:
    """Decoder layers in stack order, each with its routed-experts group (if any): what the
    prefetch offloader copies as one."""
    by_index: dict[int, list[Group]] = {}
    for g in groups:
        if g.kind in LAYER_KINDS:
            by_index.setdefault(g.layer_index, []).append(g)
    return [sorted(by_index[i], key=lambda g: g.kind != GroupKind.LAYER) for i in sorted(by_index)
            if any(g.kind == GroupKind.LAYER for g in by_index[i])]


def _prefetch_fewest(p: Placing, units: list[list[Group]], inputs: PlanInputs) -> list[int]:
    """The fewest spread-out decoder layers of ``units`` that close the rest of the deficit
    (all of them when none do: the plan is then infeasible), net of the prefetch buffers
    they need. A layer goes whole: the offloader copies its routed experts with it. What of
    a layer is already on the host (a dense MLP computed there) stays: the rest is copied."""
    p.buffers = 0
    remaining = p.over_budget()
    if remaining <= 0 or not units:
        return []
    moved = [[g for g in unit if p.where[g.name] == Serving.RESIDENT] for unit in units]
    buffers = prefetch_buffer_bytes([g for unit in moved for g in unit], inputs.prefetch_step)
    chosen = next((c for c in (_spread(n, len(units)) for n in range(1, len(units) + 1))
                   if sum(g.nbytes for i in c for g in moved[i]) - buffers >= remaining),
                  list(range(len(units))))
    for i in chosen:
        for g in moved[i]:
            p.where[g.name] = Serving.PREFETCH
    # The candidates' buffers decided how many layers go (never fewer than needed); the
    # plan states what vLLM will allocate: slots for the chosen layers' parameters.
    p.buffers = prefetch_buffer_bytes([g for i in chosen for g in moved[i]], inputs.prefetch_step)
    return [units[i][0].layer_index for i in chosen]


def place_hot(p: Placing, inputs: PlanInputs, step_s: Callable[[Placing], float], tokens: int,
              uva: bool = True, moves: bool = True, compute: bool = False,
              mlp_compute: bool = False) -> list[int]:
    """Close the rest of the deficit (after the cold set) at the least est step time.

    The menu, per decoder layer: resident; a MoE layer's routed experts in host memory,
    read in place through UVA (a step pays, in line, the read fraction of their bytes over
    the link instead of from VRAM); the same experts in host memory computed there by the
    host CPU (host-compute: a step pays the read fraction of their bytes at the host
    kernel's rate, and a hand-off per layer, in line; above the crossover the step copies
    them instead); or the whole layer, experts included, through the prefetch offloader
    (every byte crosses the link each step, overlapped with the compute of the layers
    before it, plus device buffers of a layer's size).

    Why this search finds the cheapest combination the menu allows (under the step model):
    a UVA read (or a host-compute layer) costs the same per byte wherever it sits in the
    stack (it is paid in line, so order does not matter) and is cheapest per byte for the
    layers with the smallest read fraction, so for a given number ``n`` of host experts
    groups the best choice is the ``n`` with the smallest fraction (largest first among
    equals, to free the most); prefetching then takes the fewest spread-out layers of the
    rest, as for a dense model. Each ``n`` from 0 to every MoE layer is priced with the
    whole step model (``step_s``), once with the host experts served uva and once served
    compute (the CPU threads are one pool the host-compute layers share, so the menu does
    not mix the two: every host experts group is priced at the one rate), and the fastest
    placement that fits wins (the one with the smallest shortfall when none fits). Once
    experts alone close the deficit, more of them only add host time: the search stops.
    ``tokens``: the tokens one step serves (batch x tokens verified per sequence).
    ``uva``: whether the fused-MoE kernel vLLM picks on the plan's card reads UVA views
    (:mod:`.kernels`); without it the menu has no UVA entry (the glue would refuse one).
    ``moves``: whether the kernel's weights stay Parameters after post-processing; without
    it no MoE layer is prefetched either (its experts would stay on the device), and only
    layers without routed experts are candidates.
    ``compute``: whether the experts' format has a CPU kernel the committed benchmark
    claims (``cpu_kernels.claimed``); without it the menu has no host-compute entry.
    ``mlp_compute``: whether a dense layer's MLP (a group of its own in ``p.groups``: kind
    mlp, split by the caller) may be computed on the host. Then a dense layer's menu is also
    its MLP computed on the host with the rest resident, or with the rest prefetched: for
    each number ``m`` of computed MLPs (spread out; an MLP is read whole, so each costs the
    same per byte wherever it sits, and they share the one CPU pool with host-compute
    experts), the fewest spread-out layers are prefetched from the whole layers only, the
    rests of the computed ones only, or any of them, each priced with the whole step model.
    """
    units = _layer_units(p.groups)
    if p.over_budget() <= 0 or not units:
        return []
    servings = ([Serving.UVA] if uva else []) + ([Serving.COMPUTE] if compute else [])
    moe = [] if not servings else sorted((u for u in units if _kind_in(u, GroupKind.EXPERTS)),
                 key=lambda u: (expert_read_fraction(u[1].num_experts, u[1].experts_per_token, tokens),
                                -u[1].nbytes, u[0].layer_index))
    dense = [u for u in units if _kind_in(u, GroupKind.MLP)] if mlp_compute else []
    start = dict(p.where)
    best: tuple[tuple, dict[str, Serving], int, list[int]] | None = None
    for serving in servings or [Serving.UVA]:
        # The MLPs share the CPU pool with host-compute experts (one rate), not with uva ones
        # unless the experts have no compute entry at all.
        mlps = len(dense) if serving == Serving.COMPUTE or not compute else 0
        for n in range(len(moe) + 1):
            fit_at = None
            for m in range(mlps + 1):
                p.where = dict(start)
                for unit in moe[:n]:
                    p.where[unit[1].name] = serving
                computed = [dense[i] for i in _spread(m, len(dense))]
                for unit in computed:
                    p.where[unit[1].name] = Serving.COMPUTE
                on_host = {u[0].layer_index for u in moe[:n]}
                with_mlp = {u[0].layer_index for u in computed}
                candidates = [u for u in units if u[0].layer_index not in on_host
                              and (moves or not _kind_in(u, GroupKind.EXPERTS))]
                # Prefetch the fewest spread-out of: whole layers only, the rests of the layers
                # whose MLP is computed only, or any of them; each priced.
                variants = [candidates] if not with_mlp else [
                    [u for u in candidates if u[0].layer_index not in with_mlp],
                    [u for u in candidates if u[0].layer_index in with_mlp], candidates]
                base = dict(p.where)
                for chosen_from in variants:
                    p.where = dict(base)
                    hot = _prefetch_fewest(p, chosen_from, inputs)
                    over = p.over_budget()
                    key = (over > 0, max(over, 0), step_s(p) if over <= 0 else 0.0, n, m)
                    if best is None or key < best[0]:
                        best = (key, dict(p.where), p.buffers, hot)
                    if over <= 0 and not hot:
                        fit_at = m
                        break
                if fit_at is not None:
                    break  # more host MLPs only add host time
            if fit_at == 0:
                break  # more host experts only add host time
    _, p.where, p.buffers, hot = best
    return hot


def _kind_in(unit: list[Group], kind: GroupKind) -> bool:
    return any(g.kind == kind for g in unit)


def host_bytes(p: Placing) -> int:
    return sum(g.served_bytes(p.where[g.name]) for g in p.groups if p.where[g.name] in HOST_SERVINGS)


def host_shortfall(p: Placing, inputs: PlanInputs) -> int:
    available = inputs.host_available_bytes
    return 0 if available is None else max(0, host_bytes(p) - available)


def strategy_of(p: Placing, hot: list[int], inputs: PlanInputs) -> Strategy:
    if p.over_budget() > 0 or host_shortfall(p, inputs):
        return Strategy.INFEASIBLE
    if hot or any(w in (Serving.UVA, Serving.COMPUTE) for w in p.where.values()):  # hot bytes on the host
        return Strategy.HOT_OFFLOAD
    if any(w in COLD_SERVINGS for w in p.where.values()):
        return Strategy.COLD_OFFLOAD
    return Strategy.RESIDENT
