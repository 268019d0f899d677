"""``plan``'s options, one dataclass for the command and for :func:`selective_offload.plan`.

:class:`PlanOptions` is the source, as vLLM's ``EngineArgs`` is its server's: each field
with its default, the parser of its kind of value (a size, a rate, a count, ...) and its
docstring, from which the command's flags and their help are made and whose names
:func:`selective_offload.plan` takes as keywords. So a value the command refuses is refused
from Python by the same parser in the same words, with the option spelled as the caller
wrote it (``--kv-cache`` or ``kv_cache=``).
"""

from __future__ import annotations

import argparse
import ast
import difflib
import functools
import inspect
import os
import re
import sys
import textwrap
import time
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Callable, NamedTuple

from .acceptance import DEFAULT_ACCEPT_RATE
from .checkpoint import Checkpoint, load_checkpoint
from .errors import PlanError, UserError, cut
from .estimate.traffic import (
    ASSUMED_CPU_TFLOPS,
    DEFAULT_DECODE_READ_FACTOR,
    DEFAULT_UVA_READ_FACTOR,
    REFERENCE_CPU_GBPS,
)
from .kv_model import KV_DTYPE_BYTES
from .names import DEFAULT_COLD_SEGMENTS
from .plan_format import REFERENCE_LINK_GBPS, REFERENCE_VRAM_GBPS, Plan, PlanInputs
from .plan_format.inputs import MAX_BATCH, MAX_CPU_THREADS, MAX_RANKS, MAX_TOKENS, InputError, moe_setting, parse_card
from .plan_format.vocabulary import HOST_HEADROOM_BYTES
from .planner import make_plan
from .planner.cards import card_memory
from .planner.host_compute import model_cpu_format
from .planner.shares import by_routing
from .probe import default_profile_path, plan_bandwidths, plan_defaults, reference_note
from .progress import progress
from .routing import load_routing
from .sizes import parse_bandwidth_gbps, read_size

#: The KV cache kept when neither ``--kv-cache`` nor ``--max-model-len``/``--max-seqs`` says.
DEFAULT_KV_CACHE = "1GiB"


def cli_flag(name: str) -> str:
    """``kv_cache`` (or ``kv-cache``) as the command spells it."""
    return f"--{name.replace('_', '-')}"


def keyword(name: str) -> str:
    """``kv-cache`` (or ``kv_cache``) as :func:`selective_offload.plan` spells it."""
    return f"{name.replace('-', '_')}="


def _given(spell: Callable[[str], str], name: str, value: Any) -> str:
    """An option with its value as the caller wrote it: ``--batch 8`` or ``batch=8``."""
    option = spell(name)
    return f"{option}{'' if option.endswith('=') else ' '}{value}"


# One parser per kind of value: each takes a value as given (a flag's text, a keyword's
# object) and the option as the caller spells it, and returns the value or raises one line.

def read_gpu_tflops(value: Any, option: str) -> float:
    """A positive, finite number of TFLOP/s (a GPU's)."""
    return _positive(value, option, "TFLOP/s", "200")


def read_cpu_tflops(value: Any, option: str) -> float:
    """A positive, finite number of TFLOP/s (a CPU's)."""
    return _positive(value, option, "TFLOP/s", "0.5")


def _typed(value: Any, option: str, kind: type) -> Any:
    """A value as its option's type: a whole number for an ``int`` option (a string of one,
    not a bool or 2.5), a number for a ``float`` one."""
    wanted = "a whole number" if kind is int else "a number"
    if isinstance(value, str):
        try:
            return kind(value)
        except ValueError:
            raise UserError(f"{option}: {cut(repr(value), 83)} is not {wanted}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise UserError(f"{option}: {cut(repr(value), 83)} is not {wanted}")
    return kind(value)


def read_count(value: Any, option: str) -> int:
    """A whole number (its range is checked with the inputs it sets)."""
    return _typed(value, option, int)


def read_number(value: Any, option: str) -> float:
    return _typed(value, option, float)


def read_switch(value: Any, option: str) -> bool:
    if not isinstance(value, bool):
        raise UserError(f"{option}: {cut(repr(value), 83)} must be True or False")
    return value


def read_kv_dtype(value: Any, option: str) -> str:
    if value not in KV_DTYPE_BYTES:
        raise UserError(f"{option}: {cut(repr(value), 83)} is not one of {', '.join(sorted(KV_DTYPE_BYTES))}")
    return value


def read_host_memory(value: Any, option: str) -> int | None:
    """A size, or ``none`` (no check: ``None``)."""
    if isinstance(value, str) and value.strip().lower() == "none":
        return None
    nbytes = read_size(value, option)
    if nbytes == 0:
        raise UserError(f"{option}: must be more than 0, like 64GiB (or 'none' to not check)")
    return nbytes


def read_cold(value: Any, option: str) -> tuple[str, ...]:
    text = str(value)
    segs = tuple(s.strip() for s in text.split(",") if s.strip())
    if not segs or any("." in s for s in segs):
        raise UserError(f"{option}: {cut(repr(text), 83)} must be a comma-separated list of single name "
                        "segments, like embed_tokens,visual")
    return segs


def read_speculative(value: Any, option: str) -> tuple[str, int | None]:
    """``mtp`` or ``mtp:K``: the method and its draft tokens (``None``: the model's MTP layers)."""
    text = str(value)
    method, _, k = text.strip().partition(":")
    if method != "mtp" or (k and not k.isdigit()):
        raise UserError(f"{option}: {cut(repr(text), 83)} is not understood; write mtp or mtp:K "
                        "(K draft tokens, like mtp:2)")
    return "mtp", int(k) if k else None


def read_card(value: Any, option: str) -> str:
    try:
        return parse_card(value)
    except ValueError as exc:
        raise UserError(f"{option}: {exc}") from None


def read_moe_backend(value: Any, option: str) -> str:
    backend = str(value).lower().replace("-", "_")
    if backend not in ("auto", "triton", "marlin"):
        raise UserError(f"{option}: {cut(repr(value), 83)} is not a backend the plan knows the kernel of; use "
                        "auto (vLLM's choice), triton or marlin")
    return backend


def read_cpu_offload_gb(value: Any, option: str) -> float:
    try:
        gb = float(value)
    except (TypeError, ValueError):
        raise UserError(f"{option}: {cut(repr(value), 83)} is not a number of GiB, like 10") from None
    if not gb >= 0 or gb == float("inf"):
        raise UserError(f"{option}: {cut(repr(value), 83)} must be a finite number of GiB, 0 or more")
    return gb


def read_routing(value: Any, option: str) -> str:
    """A routing profile's path (``selective-offload report --routing`` writes one)."""
    if not isinstance(value, (str, os.PathLike)) or not str(value).strip():
        raise UserError(f"{option}={value!r}: name a routing profile file (`selective-offload report --routing FILE` "
                        "writes one)")
    return str(value)


def _positive(value: Any, option: str, unit: str, like: str) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):  # a keyword of plan() may hold any object
        number = float("nan")
    if not (number > 0 and number != float("inf")):
        raise UserError(f"{option}: {cut(repr(value), 83)} must be a positive number of {unit}, like {like}")
    return number


#: argparse's part of each kind: a whole number or a number is typed by argparse on the
#: command line (its own one-line error), a switch is a flag without a value.
_ARGPARSE = {read_count: {"type": int}, read_number: {"type": float}, read_switch: {"action": "store_true"},
             read_kv_dtype: {"choices": sorted(KV_DTYPE_BYTES)}}

CARD, RATES, WORK, VLLM = "card", "rates", "work", "vllm"
#: The groups ``plan --help`` shows the options in, in order.
GROUPS = {CARD: "card and budget",
          RATES: "machine rates (default: `selective-offload probe`'s, else the reference's)",
          WORK: "workload",
          VLLM: "vLLM: the server's settings and its own offload, priced beside the plan"}


def option(default: Any, read: Callable[[Any, str], Any], group: str, metavar: str | None = None) -> Any:
    """A :class:`PlanOptions` field: its default, the parser of its kind of value, the group
    and metavar of its flag (its help is the docstring under it)."""
    return field(default=default, metadata={"read": read, "group": group, "metavar": metavar})


@dataclass(frozen=True)
class PlanOptions:
    """``plan``'s options: the one source of the command's flags (``--kv-cache``, help from
    the docstring under each field) and of :func:`selective_offload.plan`'s keywords
    (``kv_cache=``). A field holds the value as given (text or a Python object) or ``None``
    where the probe's profile, the machine or the planner decides; :meth:`inputs` reads
    them, each by the parser of its kind, into :class:`PlanInputs`."""

    device_memory: str | int | None = option(None, read_size, CARD, "SIZE")
    """the card's size, e.g. 24GiB: planned for what such a card keeps free (default: the probe's)"""
    kv_cache: str | int | None = option(None, read_size, CARD, "SIZE")
    """device memory kept for the KV cache (default: {DEFAULT_KV_CACHE}; --max-model-len with --max-seqs sizes
    it instead)"""
    reserve: str | int = option("2GiB", read_size, CARD, "SIZE")
    """device memory kept for activations, CUDA graphs, slack (default: 2GiB)"""
    host_memory: str | int | None = option(None, read_host_memory, CARD, "SIZE")
    """host RAM, less {HOST_HEADROOM_GIB} GiB kept for the system and vLLM (default: this machine's; 'none': no
    check)"""
    compute_capability: str | None = option(None, read_card, CARD, "MAJOR.MINOR")
    """the card's, like 8.9: vLLM's MoE kernel and its padded expert sizes (default: the probe's, else 8.9)"""
    cold_segments: str = option(",".join(DEFAULT_COLD_SEGMENTS), read_cold, CARD, "LIST")
    """comma-separated name segments a decode step does not read (default: the embedding, towers, projectors,
    MTP)"""
    all_cold: bool = option(False, read_switch, CARD)
    """put every cold module on the host even when fewer would fit (frees KV room)"""
    link_gbps: str | float | None = option(None, parse_bandwidth_gbps, RATES, "GB/S")
    """pinned host-to-device copy rate, decimal GB/s (reference: {REFERENCE_LINK_GBPS})"""
    vram_gbps: str | float | None = option(None, parse_bandwidth_gbps, RATES, "GB/S")
    """device memory bandwidth, decimal GB/s (reference: {REFERENCE_VRAM_GBPS})"""
    uva_gbps: str | float | None = option(None, parse_bandwidth_gbps, RATES, "GB/S")
    """kernels' in-place reads of host memory (default: {DEFAULT_UVA_READ_FACTOR} x the link)"""
    decode_read_gbps: str | float | None = option(None, parse_bandwidth_gbps, RATES, "GB/S")
    """decode kernels' VRAM read rate (default: {DEFAULT_DECODE_READ_FACTOR} x --vram-gbps)"""
    compute_tflops: str | float | None = option(None, read_gpu_tflops, RATES, "TFLOP/S")
    """the GPU's matmul rate, to price FLOPs (default: the probe's; else not priced)"""
    cpu_gbps: str | float | None = option(None, parse_bandwidth_gbps, RATES, "GB/S")
    """host-compute: the CPU kernel's weight read rate (default: {REFERENCE_CPU_GBPS:g}, the reference host's)"""
    cpu_threads: int | None = option(None, read_count, RATES, "N")
    """host-compute: threads of the CPU pool (default: physical cores of one NUMA node)"""
    cpu_tflops: str | float | None = option(None, read_cpu_tflops, RATES, "TFLOP/S")
    """host-compute: the CPU's matmul rate, for the crossover (default: {ASSUMED_CPU_TFLOPS:g})"""
    ranks: int = option(1, read_count, RATES, "N")
    """TP/EP ranks sharing this host's CPU and memory bandwidth (default: 1)"""
    no_host_compute: bool = option(False, read_switch, RATES)
    """compute nothing on the host CPU (host experts read through UVA, MLPs stay whole)"""
    no_device_share: bool = option(False, read_switch, RATES)
    """no device share: each layer's host-compute experts or MLP wholly on the host"""
    no_head_share: bool = option(False, read_switch, RATES)
    """keep the LM head whole on the device (no vocabulary rows computed on the host CPU)"""
    speculative: str | None = option(None, read_speculative, WORK, "mtp[:K]")
    """plan for MTP speculative decoding with K drafts (default K: the model's MTP layers)"""
    accept_rate: float | None = option(None, read_number, WORK, "A")
    """the drafts' acceptance rate (default: the family's published rate, else {DEFAULT_ACCEPT_RATE})"""
    batch: int = option(1, read_count, WORK, "N")
    """concurrent decode sequences sharing a pass over the weights (default: 1)"""
    max_model_len: int | None = option(None, read_count, WORK, "L")
    """with --max-seqs: size the KV cache for N sequences of L tokens (replaces --kv-cache)"""
    max_seqs: int | None = option(None, read_count, WORK, "N")
    """see --max-model-len"""
    kv_cache_dtype: str = option("auto", read_kv_dtype, WORK, "DTYPE")
    """KV cache dtype for --max-model-len: auto (the model's 16-bit dtype), fp8, bf16, ..."""
    context: int | None = option(None, read_count, WORK, "T")
    """average context per sequence, to price KV reads (default: half of --max-model-len)"""
    routing: str | None = option(None, read_routing, WORK, "FILE")
    """a routing profile (`report --routing`): device shares hold the busiest experts"""
    cpu_offload_gb: str | float | None = option(None, read_cpu_offload_gb, VLLM, "GiB")
    """price vLLM's cpu_offload_gb at this (default: the least that covers the deficit)"""
    moe_backend: str = option("auto", read_moe_backend, VLLM, "{auto,triton,marlin}")
    """the server's --moe-backend: with the card, decides the experts' kernel (default: auto)"""
    no_deep_gemm: bool = option(False, read_switch, VLLM)
    """plan for a server started with VLLM_USE_DEEP_GEMM=0"""
    prefetch_step: int = option(1, read_count, VLLM, "N")
    """device slots per offloaded layer in vLLM's prefetch offloader (default: 1)"""
    max_num_batched_tokens: int | None = option(None, read_count, VLLM, "T")
    """the server's --max-num-batched-tokens, the step its workspace is sized for (default: 2048)"""

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """The fields as ``plan``'s flags, in :data:`GROUPS`, each with its docstring as help."""
        docs = option_docs()
        groups = {key: parser.add_argument_group(title) for key, title in GROUPS.items()}
        for f in fields(cls):
            read = f.metadata["read"]
            extra = dict(_ARGPARSE.get(read, {}))
            if read is not read_switch:
                extra["metavar"] = f.metadata["metavar"]
            help_text = docs[f.name]
            groups[f.metadata["group"]].add_argument(cli_flag(f.name), dest=f.name, default=f.default,
                                                     help=help_text, **extra)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "PlanOptions":
        """The options of a parsed ``plan`` command line."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})

    @classmethod
    def from_keywords(cls, values: dict[str, Any]) -> "PlanOptions":
        """The options as :func:`selective_offload.plan` takes them (``kv_cache="2GiB"``,
        ``no_host_compute=True``), each read by its kind's parser now; what is not given (or
        ``None``) takes the command's default. An unknown name is refused naming the nearest."""
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(values) - set(known))
        if unknown:
            near = difflib.get_close_matches(unknown[0], known, n=1)
            raise UnknownOption(f"plan(): {', '.join(k + '=' for k in unknown)} is not an option of selective-offload "
                                f"plan; {f'did you mean {near[0]}=? ' if near else ''}the options are "
                                f"{', '.join(sorted(known))}")
        given = {name: value for name, value in values.items() if value is not None}
        for name, value in given.items():
            if name not in _ARGPARSE_TYPED:
                continue
            read = known[name].metadata["read"]
            given[name] = read(value, keyword(name))
        return cls(**given)

    def read(self, name: str, spell: Callable[[str], str]) -> Any:
        """Field ``name`` read by its kind's parser (``None`` stays ``None``), errors naming it
        as ``spell`` writes it."""
        value = getattr(self, name)
        if value is None:
            return None
        return PlanOptions.__dataclass_fields__[name].metadata["read"](value, spell(name))

    def checked_together(self, spell: Callable[[str], str]) -> list[str]:
        """The workload options read together: a contradiction among them is one line naming
        the options as the caller wrote them; what one option makes of another it overrides is
        returned as a note (one line each). A value out of its own range is left to
        :func:`validated`, which names it alone."""
        def in_range(value: Any, least: int, most: int) -> bool:
            return value is None or (isinstance(value, int) and not isinstance(value, bool) and least <= value <= most)

        mml, seqs, context, batch = self.max_model_len, self.max_seqs, self.context, self.batch
        if not (in_range(mml, 1, MAX_TOKENS) and in_range(seqs, 1, MAX_BATCH) and in_range(context, 0, MAX_TOKENS)
                and in_range(batch, 1, MAX_BATCH)):
            return []  # validated() names the value out of range, alone
        if (mml is None) != (seqs is None):
            given, missing = ("max-model-len", "max-seqs") if seqs is None else ("max-seqs", "max-model-len")
            raise UserError(f"{_given(spell, given, mml if seqs is None else seqs)} sizes the KV cache only with "
                            f"{spell(missing)}: give both (N sequences of L tokens), or neither and "
                            f"{spell('kv-cache')}")
        if context is not None and mml is not None and context > mml:
            raise UserError(f"{_given(spell, 'context', context)} is beyond {_given(spell, 'max-model-len', mml)}: "
                            f"no sequence holds more tokens than that; lower {spell('context')} or raise "
                            f"{spell('max-model-len')}")
        if seqs is not None and batch > seqs:
            raise UserError(f"{_given(spell, 'batch', batch)} is above {_given(spell, 'max-seqs', seqs)}: the "
                            f"server decodes at most that many sequences together; lower {spell('batch')} or raise "
                            f"{spell('max-seqs')}")
        notes = []
        if mml is not None and self.kv_cache is not None:
            notes.append(f"{_given(spell, 'kv-cache', self.kv_cache)} is not used: {spell('max-model-len')} with "
                         f"{spell('max-seqs')} sizes the KV cache ({seqs} sequence(s) of {mml} tokens)")
        return notes

    def inputs(self, profile=None, spell: Callable[[str], str] = cli_flag) -> PlanInputs:
        """The plan's inputs: these options, and this machine's probe ``profile`` where they
        are silent. Errors name an option as ``spell`` writes it: a flag for the command, a
        keyword for :func:`selective_offload.plan`."""
        def read(name: str) -> Any:
            return self.read(name, spell)

        offload_gb = read("cpu_offload_gb")
        prefetch_step = read("prefetch_step")
        if prefetch_step < 1:
            raise UserError(f"{spell('prefetch-step')}: {prefetch_step} must be 1 or more")
        speculative, spec_tokens = read("speculative") or (None, None)
        measured = plan_defaults(profile)
        link, vram, _ = plan_bandwidths(profile)
        if self.device_memory is None and measured["device_memory_bytes"] is None:
            raise UserError(f"{spell('device-memory')} is needed (like 24GiB): no `selective-offload probe` profile of "
                            f"a GPU on this machine ({default_profile_path()}) says it")
        uva = read("uva_gbps") if self.uva_gbps is not None else (
            measured["uva_gbps"] if self.link_gbps is None else None)  # the probe's UVA rate goes with its link
        decode = (read("decode_read_gbps") if self.decode_read_gbps is not None
                  else measured["decode_read_gbps"] if self.vram_gbps is None else None)  # and its decode rate with its VRAM
        compute = read("compute_tflops")
        cpu = read("cpu_gbps")
        threads, ranks = read("cpu_threads"), read("ranks")
        if threads is not None and not 1 <= threads <= MAX_CPU_THREADS:
            raise UserError(f"{spell('cpu-threads')}: {threads} must be a whole number from 1 to {MAX_CPU_THREADS}")
        if threads is None:
            threads = measured["cpu_threads"]
        if not 1 <= ranks <= MAX_RANKS:
            raise UserError(f"{spell('ranks')}: {ranks} must be a whole number from 1 to {MAX_RANKS}")
        if threads is not None and threads < ranks:
            raise UserError(f"{spell('cpu-threads')} {threads} cannot be split between {spell('ranks')} {ranks}; give "
                            "at least one thread per rank")
        card = read("compute_capability") or measured.get("compute_capability")
        device_memory = read("device_memory")
        inputs = PlanInputs(
            device_memory_bytes=device_memory if device_memory is not None else measured["device_memory_bytes"],
            kv_cache_bytes=read_size(DEFAULT_KV_CACHE, spell('kv-cache')) if self.kv_cache is None
            else read("kv_cache"),
            reserve_bytes=read("reserve"),
            link_gbps=read("link_gbps") if self.link_gbps is not None else link,
            vram_gbps=read("vram_gbps") if self.vram_gbps is not None else vram,
            speculative=speculative,
            spec_tokens=spec_tokens,
            accept_rate=read("accept_rate"),
            batch=read("batch"),
            max_model_len=read("max_model_len"),
            max_seqs=read("max_seqs"),
            max_num_batched_tokens=read("max_num_batched_tokens"),
            kv_cache_dtype=read("kv_cache_dtype"),
            context_tokens=read("context"),
            cold_segments=read("cold_segments"),
            prefetch_step=prefetch_step,
            vllm_cpu_offload_gb=offload_gb,
            all_cold=read("all_cold"),
            host_memory_bytes=machine_ram_bytes() if self.host_memory is None else read("host_memory"),
            uva_gbps=uva,
            compute_tflops=compute if compute is not None else measured["compute_tflops"],
            decode_read_gbps=decode,
            compute_capability=card,
            moe_setting=moe_setting(read("moe_backend"), deep_gemm=not read("no_deep_gemm")),
            cpu_gbps=cpu, cpu_gbps_source="flag" if cpu is not None else "assumed", cpu_threads=threads,
            cpu_tflops=read("cpu_tflops"), handoff_s=measured["handoff_s"], ranks=ranks,
            host_compute=not read("no_host_compute"), device_share=not read("no_device_share"),
            head_share=not read("no_head_share"),
        )
        self.checked_together(spell)
        validated(inputs, spell)
        if inputs.device_memory_bytes == 0:
            raise UserError(f"{spell('device-memory')}: must be more than 0, like 24GiB")
        inputs = with_card_memory(inputs, profile)
        validated(inputs, spell)
        return inputs

    def provenance(self, profile) -> str | None:
        """Where the bandwidths and device memory came from, when not from the options."""
        if all(v is not None for v in (self.link_gbps, self.vram_gbps, self.device_memory)):
            return None
        _, _, source = plan_bandwidths(profile)
        if profile is not None and profile.no_link_reason is None:
            return f"inputs not given as options come from this machine's profile: {source}"
        # no profile of a GPU: only the rates the options left out are the reference laptop's
        return reference_note(link=self.link_gbps is None, vram=self.vram_gbps is None)

    def rates_from(self, profile) -> dict[str, str]:
        """Where the link and VRAM rates came from: an option, this machine's probe, or the reference laptop."""
        measured = plan_defaults(profile)
        return {name: "given" if getattr(self, name + "_gbps") is not None
                else "probed" if measured[name + "_gbps"] is not None else "reference" for name in ("link", "vram")}


#: The options whose keyword is read (typed) when :func:`selective_offload.plan` is called:
#: the ones the command's parser types (numbers, switches, a choice); the rest are read with
#: the inputs, in the same words from either.
_ARGPARSE_TYPED = frozenset(f.name for f in fields(PlanOptions) if f.metadata["read"] in _ARGPARSE)


class UnknownOption(UserError, TypeError):
    """A keyword :func:`selective_offload.plan` does not take (a ``TypeError``, as Python's own
    for an unexpected keyword, and a :class:`UserError`: one line naming the nearest option)."""


#: What a field's docstring may name in braces, filled in when ``--help`` is built.
_HELP_VALUES = {"DEFAULT_KV_CACHE": DEFAULT_KV_CACHE, "HOST_HEADROOM_GIB": HOST_HEADROOM_BYTES >> 30,
                "REFERENCE_LINK_GBPS": REFERENCE_LINK_GBPS, "REFERENCE_VRAM_GBPS": REFERENCE_VRAM_GBPS,
                "DEFAULT_UVA_READ_FACTOR": DEFAULT_UVA_READ_FACTOR,
                "DEFAULT_DECODE_READ_FACTOR": DEFAULT_DECODE_READ_FACTOR, "REFERENCE_CPU_GBPS": REFERENCE_CPU_GBPS,
                "ASSUMED_CPU_TFLOPS": ASSUMED_CPU_TFLOPS, "DEFAULT_ACCEPT_RATE": DEFAULT_ACCEPT_RATE}


@functools.lru_cache(maxsize=1)
def option_docs() -> dict[str, str]:
    """Each :class:`PlanOptions` field's docstring (the string under it, as vLLM's
    ``get_attr_docs`` reads ``EngineArgs``), one line, its ``{NAME}`` values filled in."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(PlanOptions)))
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.split()).format_map(_HELP_VALUES)
    missing = [f.name for f in fields(PlanOptions) if f.name not in docs]
    assert not missing, f"PlanOptions fields without a docstring: {missing}"
    return docs


def machine_ram_bytes() -> int | None:
    """This machine's physical memory, where the platform says."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


DATA_DIR = Path(__file__).resolve().parent / "data"
#: Bundled manifests, usable by name in place of a path.
BUNDLED = {"qwen3.8-27b-fp8": DATA_DIR / "qwen3.8-27b-fp8.manifest.json"}


#: ``plan``'s MODEL in two lines (``manifest --help`` says more about each kind).
PLAN_MODEL_HELP = (f"a checkpoint dir or shard, a manifest or config.json, a hub id ORG/NAME[@REV], or "
                   f"a bundled name ({', '.join(BUNDLED)})")


def resolve_model(path: str) -> Path:
    """A path, or the name of a bundled manifest (when no such path exists)."""
    if not Path(path).exists() and path in BUNDLED:
        return BUNDLED[path]
    return Path(path)


#: A read of MODEL that outlasts this many seconds says what it is doing (on stderr).
PROGRESS_AFTER_S = 2.0


def read_model(model: str):
    """:func:`load_checkpoint` of ``model``, saying what it is doing when it takes long: a
    large config built on the meta device, or many shard headers fetched from the hub."""
    path = resolve_model(model)
    if path.name == "config.json" or path.suffix == ".json" and "config" in path.name:
        what = f"building the model of {model} on the meta device to list its tensors"
    elif not path.exists():
        what = f"reading {model}"
    else:
        what = f"reading the shard headers of {model}"
    with progress(what, after_s=PROGRESS_AFTER_S, stream=sys.stderr):
        return load_checkpoint(path)


def with_card_memory(inputs: PlanInputs, profile) -> PlanInputs:
    """``inputs`` with the device memory the plan fits in (:func:`planner.cards.card_memory`,
    the one rule): the probe's measurement of this machine's card where it has one."""
    gpu = profile is not None and getattr(profile, "device", None) is not None
    total = profile.device_memory_total_bytes if gpu else None
    free = profile.device_memory_free_bytes if gpu else None
    usable, source = card_memory(inputs.device_memory_bytes, total, free)
    return replace(inputs, usable_device_bytes=usable, usable_from=source)


#: The PlanInputs fields an option sets under another name (an error names the option).
FIELD_OPTIONS = {"batch": "batch", "spec_tokens": "speculative", "accept_rate": "accept-rate",
                 "max_model_len": "max-model-len", "max_seqs": "max-seqs", "context_tokens": "context",
                 "prefetch_step": "prefetch-step", "cold_segments": "cold-segments"}


def validated(inputs: PlanInputs, spell: Callable[[str], str]) -> PlanInputs:
    """``inputs`` checked by their own rules (:meth:`PlanInputs.validate`, the one place the
    bounds live), an error naming the option that set the field as ``spell`` writes it."""
    try:
        inputs.validate()
    except InputError as exc:
        option = FIELD_OPTIONS.get(exc.field)
        if option is None:
            raise respelled(exc, spell) from None
        raise UserError(f"{spell(option)}: {respelled(exc, spell)}") from None
    except PlanError as exc:
        raise respelled(exc, spell) from None
    return inputs


def respelled(exc: UserError, spell: Callable[[str], str]) -> UserError:
    """``exc`` with each of plan's flags it names (``--kv-cache``) spelled as the caller
    writes options (``kv_cache=`` from :func:`selective_offload.plan`); its type kept."""
    if spell is cli_flag:
        return exc
    names = frozenset(cli_flag(f.name)[2:] for f in fields(PlanOptions))
    text = re.sub(r"--([a-z][a-z0-9-]*)", lambda m: spell(m.group(1)) if m.group(1) in names else m.group(0), str(exc))
    return type(exc)(text) if not isinstance(exc, InputError) else UserError(text)


def with_measured_cpu_rate(inputs: PlanInputs, checkpoint, profile) -> PlanInputs:
    """The probe's host kernel rate for the model's format, and the host's read rate it
    measured beside it, where no ``cpu_gbps`` was given (the format is known only once the
    model is read)."""
    if inputs.cpu_gbps is not None:
        return inputs
    rates = plan_defaults(profile)["cpu_kernel_gbps"] or {}
    fmt = model_cpu_format(checkpoint)
    if fmt in rates:
        # the host's read rate the probe measured beside it decides whether the kernel is
        # claimed on this host (cpu_kernels.claimed.verdict)
        read = profile.host_read_gbps
        return replace(inputs, cpu_gbps=rates[fmt], cpu_gbps_source="measured", cpu_read_gbps=read)
    return inputs


class Planned(NamedTuple):
    """What :func:`plan_model` made: the plan, the checkpoint, the inputs it was planned for
    (before the planner chose what they leave open) and the seconds the read took."""

    plan: Plan
    checkpoint: Checkpoint
    inputs: PlanInputs
    read_s: float


def plan_model(model: str, options: PlanOptions, profile, spell: Callable[[str], str] = cli_flag) -> Planned:
    """Read ``model`` and plan it for ``options``: the work of ``plan`` and of
    :func:`selective_offload.plan`."""
    inputs = options.inputs(profile, spell)
    started = time.perf_counter()
    checkpoint = read_model(model)
    read_s = time.perf_counter() - started
    inputs = with_measured_cpu_rate(inputs, checkpoint, profile)
    routing_path = options.read("routing", spell)
    routing = load_routing(routing_path, spell("routing")) if routing_path else None
    try:
        plan = make_plan(checkpoint, inputs)
    except PlanError as exc:  # what only the model shows (its KV layout), said in the caller's words
        raise respelled(exc, spell) from None
    plan = by_routing(plan, routing)  # a profile of another model refused, naming it
    provenance = options.provenance(profile)
    if provenance:
        plan = replace(plan, notes=plan.notes + (provenance,))
    noted = options.checked_together(spell)
    if noted:
        plan = replace(plan, notes=plan.notes + tuple(noted))
    return Planned(plan, checkpoint, inputs, read_s)
