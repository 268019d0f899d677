"""What a plan holds, and everything that follows from its groups.

A plan states its groups; the totals, the deficit, the shortfalls, the step's traffic and
estimate, each group's expected role, the bounds on the prefetch buffers and the tower
transient, and the strategy all follow from them and the inputs, and are computed here,
never stored as the truth. :class:`PlanContents` is the record and these derivations;
:mod:`.checks` compares what a plan states against them, :mod:`.io` reads and writes
plans, and :class:`~selective_offload.plan_format.document.Plan` (the class everyone uses) adds
both as methods. The split keeps the derivations below the checks and the I/O, so neither
needs the class that calls it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..estimate.host import COPIED_PATH_TRAFFIC, copied_bytes, copied_step_bytes, share_native
from ..estimate.traffic import (
    EXPERTS_CPU,
    EXPERTS_DEVICE,
    EXPERTS_PREFETCHED,
    EXPERTS_UVA,
    ExpertsRead,
    Traffic,
    expert_read_fraction,
    flops_per_token,
)
from ..names import (
    EMBED_SEGMENTS,
    MTP_SEGMENTS,
    NEVER_COLD_SEGMENTS,
    VLLM_HOST_TABLES,
    cold_prefix,
    has_segment,
    host_table_prefix,
    layer_of,
)
from ..worker_buffers import Unit, staging_bytes, workspace_bytes
from .inputs import PlanInputs
from .parts import (
    Alternative,
    Estimate,
    GroupPlan,
    HostCompute,
    PlannedModel,
    VllmBaseline,
    read_flops,
)
from .vocabulary import (
    COLD_SERVINGS,
    HOST_COMPUTE_NOTE,
    KIND_ROLE,
    LAYER_KINDS,
    PREFETCH_KINDS,
    SERVED_UVA,
    GroupKind,
    Role,
    Serving,
    Strategy,
)

#: Totals derived from the groups, written under "totals" and checked when read.
TOTALS = ("device_bytes", "device_share_bytes", "cold_on_host_bytes", "prefetch_bytes", "uva_bytes",
          "host_compute_bytes", "absent_bytes", "cold_bytes",
          "weight_budget_bytes", "deficit_bytes", "shortfall_bytes", "host_shortfall_bytes",
          "host_compute_staging_bytes", "host_compute_workspace_bytes",
          "host_page_locked_bytes", "host_pageable_bytes")

#: Where a line of the ledger is allocated: device memory, page-locked or pageable host memory.
DEVICE, PAGE_LOCKED, PAGEABLE = "device", "page-locked", "pageable"
LEDGER_WHERE = (DEVICE, PAGE_LOCKED, PAGEABLE)
#: The ledger's lines (device, and page-locked host) of what vLLM 0.33's post-processing adds
#: to the weights it post-processes there, beyond what ``create_weights`` allocated
#: (:attr:`GroupPlan.post_processing_bytes`).
POST_PROCESSING_LINE = "vLLM post-processing"
#: The ledger's line of the worker's load-time peak beyond the weights
#: (:attr:`PlanContents.est_load_transient_device_bytes`), less the ``est transient`` line's
#: room, which it never coexists with.
LOAD_TRANSIENT_LINE = "est load-time transient"
#: The ledger's line of the resident weights as vLLM's ``create_weights`` allocates them.
RESIDENT_LINE = "resident weights"


@dataclass(frozen=True)
class LedgerLine:
    """One named allocation the plan makes: where (:data:`LEDGER_WHERE`) and its bytes
    (``est`` in the name where it is an estimate)."""

    name: str
    where: str
    bytes: int

#: Where the step model reads a placed experts group from.
_EXPERTS_READ = {Serving.RESIDENT: EXPERTS_DEVICE, Serving.PREFETCH: EXPERTS_PREFETCHED,
                 Serving.UVA: EXPERTS_UVA, Serving.COMPUTE: EXPERTS_CPU}


#: A model with fewer weight bytes than this gets no tok/s figures: its decode step is kernel
#: launches and Python between them, not bytes over a bandwidth, so the estimate (which prices
#: only bytes) would print rates and speed-ups the model never reaches. A checkpoint anyone
#: offloads is gigabytes; the demo's and the tests' random models are a few megabytes.
MIN_PRICED_MODEL_BYTES = 64 << 20


def priced(plan: "PlanContents") -> bool:
    """Whether the plan's model is large enough for its tok/s estimate to mean anything."""
    return plan.model.total_bytes >= MIN_PRICED_MODEL_BYTES


@dataclass(frozen=True)
class PlanContents:
    """A plan's fields and what derives from them (see the module docstring)."""

    model: PlannedModel
    inputs: PlanInputs
    strategy: Strategy
    groups: tuple[GroupPlan, ...]
    hot_layer_indices: tuple[int, ...]
    #: Device memory an on-demand tower holds while it runs (est: two blocks and the rest).
    est_transient_device_bytes: int
    #: vLLM's own ``cpu_offload_gb`` priced as a baseline (``None``: nothing to offload).
    vllm_cpu_offload_gb: VllmBaseline | None
    notes: tuple[str, ...] = ()
    #: Device bytes of vLLM's prefetch buffers (``prefetch_step`` slots of every parameter
    #: name the offloaded layers have, each as large as its largest); ``None``: derived as
    #: ``prefetch_step`` slots of the largest layer (plans before this field).
    stored_prefetch_buffer_bytes: int | None = None
    #: With speculative decoding asked for: the same input planned without it, to compare.
    alternative: Alternative | None = None
    #: MoE: vLLM's ``cpu_offload_gb`` with ``cpu_offload_params=experts`` (only routed experts).
    vllm_cpu_offload_params: VllmBaseline | None = None
    #: Host-compute: the CPU kernel's format the host-compute experts are computed in (a key
    #: of ``cpu_kernels.claimed.CLAIMED``); ``None`` exactly when no group is host-compute.
    host_compute_format: str | None = None
    #: Device bytes of vLLM's fused-MoE workspace (est: one per process, sized for the step
    #: of ``max_num_batched_tokens`` tokens the plan assumes; ``planner.allocation``); 0 for a
    #: model without routed experts, a kernel that takes none, and plans before this field.
    est_vllm_workspace_bytes: int = 0
    #: The worker's load-time device peak beyond the weights (est): vLLM 0.33's Marlin FP8
    #: repack of one routed-experts layer post-processed on the device (and, served ``uva``,
    #: that layer onloaded for it; ``planner.allocation.marlin_fp8_moe_repack_bytes``); 0
    #: where no repack runs on the device, and for plans before this field.
    est_load_transient_device_bytes: int = 0
    #: Notes from reading the plan (ignored unknown fields); not written back.
    load_notes: tuple[str, ...] = field(default=(), compare=False)

    # ---- derived from the groups (never stored as the truth)
    def _sum(self, *servings: Serving) -> int:
        """Bytes of the groups served one of ``servings``, as served (:attr:`GroupPlan.served_bytes`)."""
        return sum(g.served_bytes for g in self.groups if g.serving in servings)

    def post_processing_bytes(self, *servings: Serving) -> int:
        """What vLLM's post-processing adds to the groups served one of ``servings`` (never to
        a group computed on the host: :attr:`GroupPlan.served_bytes`)."""
        return sum(g.post_processing_bytes for g in self.groups if g.serving in servings and g.serving != Serving.COMPUTE)

    @property
    def device_bytes(self) -> int:
        return self._sum(Serving.RESIDENT)

    @property
    def device_share_bytes(self) -> int:
        """Device bytes of the host-compute groups' device shares (copies of host bytes)."""
        return sum(self.share_bytes(g) for g in self.groups)

    def share_bytes(self, g: GroupPlan) -> int:
        """Device bytes of one group's device share, as this plan's CPU format holds it."""
        return g.held_share_bytes(self.host_compute_format)

    @property
    def cold_on_host_bytes(self) -> int:
        return self._sum(*COLD_SERVINGS)

    @property
    def prefetch_bytes(self) -> int:
        return self._sum(Serving.PREFETCH)

    @property
    def uva_bytes(self) -> int:
        return self._sum(Serving.UVA)

    @property
    def host_compute_bytes(self) -> int:
        return self._sum(Serving.COMPUTE)

    @property
    def host_compute_declined(self) -> str | None:
        """Why this plan computes none of its host experts on the CPU (the planner's note,
        its cause alone), or None: it computes some, or the planner gave no such note."""
        if any(g.serving == Serving.COMPUTE for g in self.groups):
            return None
        for note in self.notes:
            if note.startswith(HOST_COMPUTE_NOTE) and SERVED_UVA in note:
                return note.removeprefix(HOST_COMPUTE_NOTE).split(f", {SERVED_UVA}", 1)[0]
        return None

    @property
    def absent_bytes(self) -> int:
        return self._sum(Serving.NONE)

    @property
    def host_weight_bytes(self) -> int:
        """Every weight byte the plan puts in host memory: cold, hot layers and routed experts."""
        return self.cold_on_host_bytes + self.prefetch_bytes + self.uva_bytes + self.host_compute_bytes

    @property
    def host_bytes(self) -> int:
        """Every byte the plan puts in host memory: its host weights and the worker's buffers
        (page-locked and pageable: :meth:`ledger`)."""
        return self.host_page_locked_bytes + self.host_pageable_bytes

    # ---- the worker's own buffers, and the ledger of every allocation
    def host_compute_units(self) -> list[Unit]:
        """Each host-compute group's largest host step (its crossover), as one rank's worker
        sizes its staging slot and workspace for it (:mod:`selective_offload.worker_buffers`);
        a group without ``kernel_dims`` is not priced."""
        record = self.host_compute
        if record is None:
            return []
        ranks = max(1, self.inputs.ranks)
        head_tokens = record.crossover_tokens if record.head_crossover_tokens is None else record.head_crossover_tokens
        units = []
        for g in self.groups:
            if g.serving != Serving.COMPUTE or len(g.kernel_dims) != 2:
                continue
            hidden, inner = g.kernel_dims
            if g.kind == GroupKind.MODULE:  # the split LM head: its host rows
                if head_tokens:
                    units.append(Unit.rows(head_tokens, hidden, inner - g.device_channels))
            elif record.crossover_tokens:  # tensor parallel: each rank computes its shard of I
                per_rank = -(-(inner - g.device_channels) // ranks)
                units.append(Unit.experts(record.crossover_tokens, g.experts_per_token or 1, g.num_experts or 1,
                                          hidden, per_rank))
        return units

    @property
    def host_compute_staging_bytes(self) -> int:
        """The workers' page-locked staging slots: one per rank, for the largest host step."""
        return max(1, self.inputs.ranks) * staging_bytes(self.host_compute_units())

    @property
    def host_compute_workspace_bytes(self) -> int:
        """The workers' kernel workspaces (pageable): one per rank, for the largest host step."""
        return max(1, self.inputs.ranks) * workspace_bytes(self.host_compute_units())

    @property
    def host_page_locked_bytes(self) -> int:
        return sum(line.bytes for line in self.ledger() if line.where == PAGE_LOCKED)

    @property
    def host_pageable_bytes(self) -> int:
        return sum(line.bytes for line in self.ledger() if line.where == PAGEABLE)

    @property
    def device_ledger_bytes(self) -> int:
        """The device bytes the plan holds to its weight budget: every device line of the
        :meth:`ledger`."""
        return sum(line.bytes for line in self.ledger() if line.where == DEVICE)

    def ledger(self) -> tuple[LedgerLine, ...]:
        """Every allocation the plan makes, by name: the weights where they are placed, vLLM's
        prefetch buffers and fused-MoE workspace, the worker's device shares, transients,
        staging slot and workspace.
        The device lines are what :attr:`shortfall_bytes` holds to the weight budget (the
        transient is the larger of a cold tower's and a step above the crossover's copy:
        they never run at once), the host lines
        (page-locked, then pageable) what :attr:`host_shortfall_bytes` holds to the host's
        memory. Host weights are page-locked where the card and vLLM's pin policy allow (on
        the CPU build nothing is)."""
        grown_device = self.post_processing_bytes(Serving.RESIDENT)
        grown_host = self.post_processing_bytes(*COLD_SERVINGS, Serving.PREFETCH, Serving.UVA)
        return (
            LedgerLine(RESIDENT_LINE, DEVICE, self.device_bytes - grown_device),
            LedgerLine(POST_PROCESSING_LINE, DEVICE, grown_device),
            LedgerLine("device shares", DEVICE, self.device_share_bytes),
            LedgerLine("prefetch buffers", DEVICE, self.prefetch_buffer_bytes),
            LedgerLine("est transient", DEVICE, self.est_transient_device_bytes),
            LedgerLine("est vLLM fused-MoE workspace", DEVICE, self.est_vllm_workspace_bytes),
            # the load-time peak and a step's transient never coexist: the part the other's room lacks
            LedgerLine(LOAD_TRANSIENT_LINE, DEVICE,
                       max(0, self.est_load_transient_device_bytes - self.est_transient_device_bytes)),
            LedgerLine("host weights", PAGE_LOCKED, self.host_weight_bytes - grown_host),
            LedgerLine(POST_PROCESSING_LINE, PAGE_LOCKED, grown_host),
            LedgerLine("host-compute staging", PAGE_LOCKED, self.host_compute_staging_bytes),
            LedgerLine("host-compute workspace", PAGEABLE, self.host_compute_workspace_bytes),
        )

    @property
    def host_compute(self) -> HostCompute | None:
        """What the runtime reads to serve the host-compute experts (the crossover, threads,
        rates), derived from the inputs and the groups; ``None`` when no group is host-compute."""
        experts = [e for e in self.traffic().experts if e.where == EXPERTS_CPU]
        if not experts or self.host_compute_format is None:
            return None
        return HostCompute.of(self.host_compute_format, self.inputs, experts)

    @property
    def baselines(self) -> tuple[VllmBaseline, ...]:
        """vLLM's own offloads priced on the same input: cpu_offload_gb, then with cpu_offload_params."""
        return tuple(b for b in (self.vllm_cpu_offload_gb, self.vllm_cpu_offload_params) if b is not None)

    @property
    def cold_bytes(self) -> int:
        return sum(g.bytes for g in self.groups if g.role == Role.COLD)

    @property
    def weight_budget_bytes(self) -> int:
        return self.inputs.weight_budget_bytes

    @property
    def deficit_bytes(self) -> int:
        """Bytes to load, and vLLM's fused-MoE workspace beside them, minus the weight budget
        (<= 0: everything fits on the device)."""
        loaded = sum(g.bytes for g in self.groups if g.serving != Serving.NONE)
        return loaded + self.est_vllm_workspace_bytes - self.weight_budget_bytes

    @property
    def prefetch_buffer_bytes(self) -> int:
        """vLLM's prefetch offloader keeps ``prefetch_step`` device slots of every offloaded
        parameter name; in a uniform stack that is the largest layer per slot."""
        if not self.hot_layer_indices:
            return 0
        if self.stored_prefetch_buffer_bytes is not None:
            return self.stored_prefetch_buffer_bytes
        hot = set(self.hot_layer_indices)
        per_layer: dict[int, int] = {}
        for g in self.groups:
            if g.kind in PREFETCH_KINDS and g.layer_index in hot:  # a layer's experts are copied with it
                per_layer[g.layer_index] = per_layer.get(g.layer_index, 0) + g.bytes
        return self.inputs.prefetch_step * max(per_layer.values(), default=0)

    @property
    def shortfall_bytes(self) -> int:
        """Device memory missing for this placement (0 when it fits): every device line of
        the :meth:`ledger` against the weight budget."""
        return max(0, self.device_ledger_bytes - self.weight_budget_bytes)

    @property
    def host_shortfall_bytes(self) -> int:
        """Host memory missing for the bytes placed on the host (0 when it fits, or unchecked)."""
        available = self.inputs.host_available_bytes
        if available is None:
            return 0
        return max(0, self.host_bytes - available)

    @property
    def est(self) -> Estimate:
        """This placement's decode step (est): prefetch overlap, batch, drafts and KV priced."""
        return Estimate.of(self.traffic(), self.inputs, self.model.kv, self.spec_tokens, pipelined=True)

    @property
    def spec_tokens(self) -> int:
        """Draft tokens per step: 0 without speculative decoding."""
        if self.inputs.speculative != "mtp":
            return 0
        return self.inputs.spec_tokens or max(1, self.model.num_mtp_layers)

    def traffic(self) -> Traffic:
        """The bytes a decode pass of this placement reads, by where from."""
        stack = sorted((g for g in self.groups if g.kind == GroupKind.LAYER), key=lambda g: g.layer_index)
        layers = tuple((g.est_read_bytes_per_step, g.serving == Serving.PREFETCH) for g in stack)
        position = {g.layer_index: i for i, g in enumerate(stack)}
        # Above the crossover the worker copies host-compute groups to the device and computes
        # them there with torch ops: a quantized format, dequantized first, moves many times
        # its bytes.
        copied = COPIED_PATH_TRAFFIC.get(self.host_compute_format or "", 1.0)
        native = share_native(self.host_compute_format, True)  # the experts' share held as stored
        experts = tuple(
            ExpertsRead(position[g.layer_index], g.served_bytes, g.num_experts, g.experts_per_token,
                        _EXPERTS_READ[g.serving],
                        flops_per_token(g.dtype_bytes) * expert_read_fraction(g.num_experts, g.experts_per_token, 1),
                        device_share=g.device_share, held_nbytes=g.held_bytes(native),
                        share_native=native, copied_traffic=copied, hit_rate=g.est_device_hit_rate)
            for g in self.groups if g.kind == GroupKind.EXPERTS and g.layer_index in position)
        # A dense layer's MLP, split out to be computed on the host, is one expert every token
        # takes (E = k = 1): read whole, its FLOPs times the step's tokens.
        experts += tuple(
            ExpertsRead(position[g.layer_index], g.served_bytes, 1, 1, _EXPERTS_READ[g.serving],
                        flops_per_token(g.dtype_bytes), device_share=g.device_share, held_nbytes=g.held_bytes(False),
                        copied_traffic=copied)
            for g in self.groups if g.kind == GroupKind.MLP and g.layer_index in position)
        # An LM head split by its vocabulary rows is one more such unit, outside the layer
        # stack (paid in line after the last layer); the device computes its first rows.
        experts += tuple(
            ExpertsRead(-1, g.served_bytes, 1, 1, EXPERTS_CPU, flops_per_token(g.dtype_bytes),
                        device_share=g.device_share, held_nbytes=g.held_bytes(False),
                        copied_traffic=COPIED_PATH_TRAFFIC["bf16"])
            for g in self.groups if g.kind == GroupKind.MODULE and g.serving == Serving.COMPUTE)
        other = row_host = row_device = draft = 0
        other_flops = draft_flops = 0.0
        head = sum(g.est_read_bytes_per_step for g in self.groups
                   if has_segment(g.group, NEVER_COLD_SEGMENTS) and g.serving == Serving.RESIDENT)
        for g in self.groups:
            if g.kind in LAYER_KINDS or g.serving == Serving.NONE:
                continue
            if g.mtp:
                draft += g.bytes
                draft_flops += flops_per_token(g.dtype_bytes)
            elif has_segment(g.group, EMBED_SEGMENTS) and g.role == Role.COLD:
                if g.serving in COLD_SERVINGS:
                    row_host += g.est_read_bytes_per_step
                else:
                    row_device += g.est_read_bytes_per_step
            elif g.serving == Serving.RESIDENT:
                other += g.est_read_bytes_per_step
                other_flops += read_flops(g.dtype_bytes, g.est_read_bytes_per_step, g.bytes)
        head_flops = sum(flops_per_token(g.dtype_bytes) for g in self.groups
                         if has_segment(g.group, NEVER_COLD_SEGMENTS) and g.serving == Serving.RESIDENT)
        speculating = bool(self.spec_tokens)
        return Traffic(layers, other, row_host, row_device, 0, (draft + head) if speculating else 0, experts,
                       tuple(flops_per_token(g.dtype_bytes) for g in stack), other_flops,
                       (draft_flops + head_flops) if speculating else 0.0)

    @property
    def cold_on_host_groups(self) -> list[str]:
        return [g.group for g in self.groups if g.serving in COLD_SERVINGS]

    def group_of(self, group: str) -> GroupPlan | None:
        """The group named ``group`` (``None``: the plan has none)."""
        return next((g for g in self.groups if g.group == group), None)

    def serving_of(self, group: str) -> Serving | None:
        found = self.group_of(group)
        return None if found is None else found.serving

    def totals(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in TOTALS}

    # ---- what the groups and the inputs imply, for the checks to compare against
    def _is_mtp_layer(self, group: str) -> bool:
        """A decoder layer past the model's last one, in a model that declares an MTP head
        (DeepSeek-V3 stores its MTP head so)."""
        layer, n = layer_of(group), self.model.num_hidden_layers
        return bool(self.model.num_mtp_layers and n is not None and layer is not None and layer[1] >= n)

    def _is_vllm_host_table(self, group: str) -> bool:
        """An n-gram / per-layer embedding table of a model whose vLLM class keeps such
        tables in host memory itself (:data:`names.VLLM_HOST_TABLES`)."""
        return (host_table_prefix(group) == group
                and any(a in VLLM_HOST_TABLES for a in self.model.architectures))

    def expected_role(self, g: GroupPlan) -> tuple[Role, bool, str] | None:
        """The role and MTP flag the group's kind, name and the inputs give it (the
        planner's rule), and why; ``None`` for a group of kind component whose name is not a
        cold module."""
        if g.kind == GroupKind.MODULE and self._is_vllm_host_table(g.group):
            return Role.COLD, False, "vLLM keeps this n-gram table in host memory itself and gathers rows"
        fixed = KIND_ROLE.get(g.kind)
        if fixed is not None:
            return fixed, False, f"a group of kind {g.kind} is read every step"
        prefix = cold_prefix(g.group, self.inputs.cold_segments)
        if prefix != g.group and not self._is_mtp_layer(g.group):
            return None
        if has_segment(g.group, MTP_SEGMENTS) if prefix == g.group else True:
            if self.inputs.speculative == "mtp":
                return Role.HOT, True, "MTP speculative decoding runs the MTP head every step"
            return (Role.ABSENT, True, "an MTP head is not loaded without MTP speculative decoding "
                    "(only an MTP head is ever absent: vLLM loads every other tensor)")
        if has_segment(g.group, EMBED_SEGMENTS) and self.model.tie_word_embeddings:
            return Role.HOT, False, "the embedding is tied to the LM head"
        return Role.COLD, False, "a decode step does not read it in full"

    def prefetch_buffer_range(self) -> tuple[int, int]:
        """The least and most the prefetch buffers can be for these hot layers: one slot per
        parameter name, each as large as its largest copy, is at least the largest layer
        and at most every layer (``prefetch_step`` slots of each), counting the hot layers
        only: the offloader makes slots for what it offloads. A layer's routed experts are
        copied with it, so they count in its bytes."""
        hot = set(self.hot_layer_indices)
        per_layer: dict[int, int] = {}
        for g in self.groups:
            if g.kind in PREFETCH_KINDS and g.layer_index in hot:
                per_layer[g.layer_index] = per_layer.get(g.layer_index, 0) + g.bytes
        layers = list(per_layer.values())
        if not self.hot_layer_indices or not layers:
            return 0, 0
        return self.inputs.prefetch_step * max(layers), self.inputs.prefetch_step * sum(layers)

    def tower_transient_limit(self) -> int:
        """The most an on-demand tower can hold on the device (two blocks and the rest of
        the largest tower on the host, at most twice its bytes)."""
        towers = [g.bytes for g in self.groups if g.serving in COLD_SERVINGS
                  and not has_segment(g.group, EMBED_SEGMENTS) and not self._is_vllm_host_table(g.group)]
        return 2 * max(towers, default=0)

    def copied_transient_bytes(self) -> int:
        """The most device memory a step above the crossover holds at once (est): one
        host-compute group copied (and an expert dequantized) at a time
        (:func:`~selective_offload.estimate.host.copied_step_bytes`; the head's rows are bf16)."""
        def copied(g: GroupPlan) -> int:
            if g.kind != GroupKind.MODULE:
                return copied_step_bytes(g.served_bytes, g.num_experts, g.dtype_bytes, self.host_compute_format,
                                         g.kernel_dims, self.inputs.batched_tokens, g.experts_per_token or 1,
                                         self.inputs.ranks)
            rows = (g.device_channels, g.intermediate) if g.intermediate else (0, 1)
            return copied_step_bytes(copied_bytes(g.served_bytes, *rows), g.num_experts, g.dtype_bytes, "bf16")

        return max((copied(g) for g in self.groups if g.serving == Serving.COMPUTE), default=0)

    def derived_strategy(self) -> Strategy:
        """What the placement does: the strategy a plan must state."""
        if self.shortfall_bytes or self.host_shortfall_bytes:
            return Strategy.INFEASIBLE
        if self.hot_layer_indices or any(g.serving in (Serving.UVA, Serving.COMPUTE)
                                         for g in self.groups):
            return Strategy.HOT_OFFLOAD  # hot bytes on the host: layers prefetched, or experts read in place
        if self.cold_on_host_groups:
            return Strategy.COLD_OFFLOAD
        return Strategy.RESIDENT
