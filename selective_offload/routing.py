"""A routing profile: how often each routed expert of each MoE layer was picked, measured.

The worker counts the router's picks on the device (``vllm_glue.routing``) and the landing
report carries the counts; ``selective-offload report --routing FILE`` saves them as a
profile, which ``plan --routing FILE`` reads to put each layer's busiest experts in its
device share and to price the share's hit rate (the share of the layer's picks its experts
take) from the counts instead of from uniform routing.

A profile is a file a user hands back, so it is read as every input is
(:class:`~selective_offload.jsonio.FieldReader`: one line naming the field and the fix), and
checked against the model it is applied to (:meth:`RoutingProfile.check_layers`: every MoE
layer of the model, each with its expert count). Its ``source`` says what was measured: the
model as the engine named it, vLLM's version, how many tokens were routed after warm-up, and
a free description of the workload (the prompts).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from . import jsonio
from .errors import PlanError, UserError
from .jsonio import FieldReader

ROUTING_FORMAT = "selective-offload/routing-v1"
FIX = ("record one with `selective-offload report --routing FILE` after serving the model with "
       "SELECTIVE_OFFLOAD_ROUTING=1 (or enable(..., routing=True))")
#: A profile larger than this is not one (a layer of 1,024 experts is a few kB).
MAX_PROFILE_BYTES = 16_000_000


@dataclass(frozen=True)
class RoutingProfile:
    """Picks per expert of each MoE layer (decoder layer index -> one count per expert), and
    where they were measured."""

    layers: Mapping[int, tuple[int, ...]]
    #: The model as the engine named it (a directory or a hub id).
    model: str = ""
    vllm_version: str = ""
    #: Tokens routed through the counted steps (the picks of a layer over its experts per token).
    tokens: int = 0
    #: What was served while counting (the prompts), as the user described it; "" if not.
    workload: str = ""
    #: The experts each token picks, per layer (vLLM's top_k), where known.
    experts_per_token: Mapping[int, int] = field(default_factory=dict)
    #: Where it was read from, for messages (``--routing FILE``).
    where: str = field(default="the routing profile", compare=False, repr=False)

    # ------------------------------------------------------------------ figures

    def picks(self, layer: int) -> int:
        return sum(self.layers[layer])

    def busiest(self, layer: int, n: int) -> tuple[int, ...]:
        """The ``n`` experts of ``layer`` picked most, busiest first (ties: the lower id first)."""
        counts = self.layers[layer]
        return tuple(sorted(range(len(counts)), key=lambda e: (-counts[e], e))[:n])

    def hit_rate(self, layer: int, experts: tuple[int, ...] | list[int]) -> float:
        """The share of ``layer``'s picks that land on ``experts`` (uniform when nothing was counted)."""
        counts = self.layers[layer]
        total = sum(counts)
        if not total:
            return len(set(experts)) / len(counts)
        return sum(counts[e] for e in set(experts)) / total

    def source_text(self) -> str:
        """One line: what was measured, for the plan's notes and the report."""
        what = f" ({self.workload})" if self.workload else ""
        return (f"{self.tokens} tokens routed{what} on {self.model or 'an unnamed model'}, "
                f"vLLM {self.vllm_version or 'unknown'}")

    def summary(self, device_experts: Mapping[int, int] | None = None) -> list[str]:
        """One line per layer: its picks, and the share of them its busiest ``N`` experts take
        (``N``: the layer's device share in ``device_experts``, else an eighth of its experts)
        against the ``N/E`` uniform routing gives."""
        lines = []
        for layer in sorted(self.layers):
            counts = self.layers[layer]
            n = (device_experts or {}).get(layer) or max(1, len(counts) // 8)
            busiest = self.busiest(layer, n)
            share = self.hit_rate(layer, busiest)
            lines.append(f"layer {layer}: {self.picks(layer)} picks of {len(counts)} experts; the busiest {n} "
                         f"({', '.join(map(str, busiest[:8]))}{', ...' if n > 8 else ''}) take {share:.1%} "
                         f"(uniform: {n / len(counts):.1%})")
        return lines

    # ------------------------------------------------------------------ checks

    def check_layers(self, experts_by_layer: Mapping[int, int], where: str | None = None,
                     required: frozenset[int] | None = None) -> None:
        """Refuse (``PlanError``, one line) a profile that is not of this model: a layer it
        has no MoE layer for, another expert count, or a MoE layer of ``required`` (default:
        all of ``experts_by_layer``) it has no counts for."""
        where = where or self.where
        for layer, counts in sorted(self.layers.items()):
            if layer not in experts_by_layer:
                raise PlanError(f"{where}: layer {layer} is no MoE layer of this model (its MoE layers: "
                                f"{_layers_text(experts_by_layer)}); {FIX} for this model")
            if len(counts) != experts_by_layer[layer]:
                raise PlanError(f"{where}: layer {layer} counts {len(counts)} experts, and this model's layer "
                                f"{layer} has {experts_by_layer[layer]}; {FIX} for this model")
        missing = sorted(set(experts_by_layer if required is None else required) - set(self.layers))
        if missing:
            raise PlanError(f"{where}: no counts for MoE layer {missing[0]} of this model "
                            f"({len(missing)} layer(s) missing); {FIX} for this model")

    # ------------------------------------------------------------------ JSON

    def to_dict(self) -> dict[str, Any]:
        return {"format": ROUTING_FORMAT,
                "source": {"model": self.model, "vllm_version": self.vllm_version, "tokens": self.tokens,
                           "workload": self.workload},
                "experts_per_token": {str(k): v for k, v in sorted(self.experts_per_token.items())},
                "layers": {str(k): list(v) for k, v in sorted(self.layers.items())}}

    @classmethod
    def from_dict(cls, data: Any, where: str, error: type[Exception] = UserError) -> "RoutingProfile":
        """Read field by field; a bad field is one line (``error``) naming it and the fix."""
        r = FieldReader(data, where, error=error, fix=FIX)
        found = r.raw("format", None)
        if found != ROUTING_FORMAT:
            r.fail(f"not a routing profile (format {cut_json(found)}, not {ROUTING_FORMAT!r})")
        s = r.child("source")
        layers_raw = r.object("layers", what="an object of layer index -> a list of counts, one per expert")
        lr = r.within(layers_raw, "layers")
        layers = {}
        for key in layers_raw:
            index = _layer_index(lr, key)
            counts = lr.int_list(key)
            if not counts:
                lr.bad(key, [], "a list of counts, one per expert")
            layers[index] = counts
        if not layers:
            r.bad("layers", layers_raw, "at least one layer's counts")
        k_raw = r.object("experts_per_token", default={})
        kr = r.within(k_raw, "experts_per_token")
        ks = {_layer_index(kr, key): kr.int(key, minimum=1) for key in k_raw}
        return cls(layers=layers, model=s.str("model", default=""), vllm_version=s.str("vllm_version", default=""),
                   tokens=s.int("tokens", default=0), workload=s.str("workload", default=""), experts_per_token=ks,
                   where=where)

    def save(self, path: str | os.PathLike, flag: str = "--routing") -> None:
        """Written whole by the rule every output follows (only over a routing profile this
        project wrote)."""
        from .outputs import write_files

        write_files([(flag, path, (jsonio.dumps(self.to_dict()) + "\n").encode(), "routing")])


def _layer_index(r: FieldReader, key: str) -> int:
    if not (key.isascii() and key.isdigit() and len(key) <= 6):
        r.fail(f"{jsonio.json_text(key)[:40]} is not a layer index (a decoder layer's number, like \"0\")")
    return int(key)


def cut_json(value: Any) -> str:
    from .errors import cut

    return cut(jsonio.json_text(value), 60)


def _layers_text(experts_by_layer: Mapping[int, int]) -> str:
    layers = sorted(experts_by_layer)
    if not layers:
        return "none"
    return f"{layers[0]} to {layers[-1]}" if layers == list(range(layers[0], layers[-1] + 1)) else ", ".join(
        map(str, layers[:8]))


def load_routing(path: str | os.PathLike, flag: str = "--routing") -> RoutingProfile:
    """The profile at ``path``, read through the one bounded reader; one line otherwise."""
    where = f"{flag}{'' if flag.endswith('=') else ' '}{str(path)[:200]}"  # --routing FILE, or routing=FILE
    try:
        data = jsonio.read(path, max_bytes=MAX_PROFILE_BYTES)
    except OSError as exc:
        raise UserError(f"{where}: cannot be read ({exc.strerror or exc}); name a routing profile file") from None
    except ValueError as exc:
        raise UserError(f"{where}: not a routing profile ({exc}); {FIX}") from None
    return RoutingProfile.from_dict(data, where)


def from_report(routing: Mapping[str, Any], where: str) -> RoutingProfile:
    """The profile a landing report's ``routing`` object holds (the worker's counts)."""
    return RoutingProfile.from_dict({**routing, "format": ROUTING_FORMAT}, where, PlanError)
