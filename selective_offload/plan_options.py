"""One reading of ``plan``'s options, for the command and for :func:`selective_offload.plan`.

Both take the same options with the same defaults (:func:`add_plan_arguments` holds them) and the
same checks, so a value the command refuses is refused from Python in the same words, with
the option spelled as the caller wrote it (``--kv-cache`` or ``kv_cache=``).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, NamedTuple

from .checkpoint import Checkpoint, load_checkpoint
from .errors import PlanError, UserError, cut
from .acceptance import DEFAULT_ACCEPT_RATE
from .estimate.traffic import (ASSUMED_CPU_TFLOPS, DEFAULT_DECODE_READ_FACTOR, DEFAULT_UVA_READ_FACTOR,
                               REFERENCE_CPU_GBPS)
from .kv_model import KV_DTYPE_BYTES
from .names import DEFAULT_COLD_SEGMENTS
from .plan_format import REFERENCE_LINK_GBPS, REFERENCE_VRAM_GBPS, Plan, PlanInputs
from .plan_format.inputs import MAX_BATCH, MAX_CPU_THREADS, MAX_RANKS, MAX_TOKENS, InputError, moe_setting, parse_card
from .plan_format.vocabulary import HOST_HEADROOM_BYTES
from .planner import make_plan
from .planner.cards import card_memory
from .planner.host_compute import model_cpu_format
from .probe import default_profile_path, plan_bandwidths, plan_defaults, reference_note
from .progress import progress
from .sizes import parse_bandwidth_gbps, parse_size


#: The KV cache kept when neither ``--kv-cache`` nor ``--max-model-len``/``--max-seqs`` says.
DEFAULT_KV_CACHE = "1GiB"


def cli_flag(name: str) -> str:
    """``kv-cache`` as the command spells it."""
    return f"--{name}"


def keyword(name: str) -> str:
    """``kv-cache`` as :func:`selective_offload.plan` spells it."""
    return f"{name.replace('-', '_')}="


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    """The plan's options in the groups a user looks for them in, one or two lines each
    (the README and the module docstrings say the why)."""
    card = p.add_argument_group("card and budget")
    card.add_argument("--device-memory", default=None, metavar="SIZE",
                      help="the card's size, e.g. 24GiB: planned for what such a card keeps free (default: "
                           "the probe's)")
    card.add_argument("--kv-cache", default=None, metavar="SIZE",
                      help=f"device memory kept for the KV cache (default: {DEFAULT_KV_CACHE}; --max-model-len with "
                           "--max-seqs sizes it instead)")
    card.add_argument("--reserve", default="2GiB", metavar="SIZE",
                      help="device memory kept for activations, CUDA graphs, slack (default: 2GiB)")
    card.add_argument("--host-memory", default=None, metavar="SIZE",
                      help=f"host RAM, less {HOST_HEADROOM_BYTES >> 30} GiB kept for the system and vLLM (default: "
                           "this machine's; 'none': no check)")
    card.add_argument("--compute-capability", default=None, metavar="MAJOR.MINOR",
                      help="the card's, like 8.9: vLLM's MoE kernel and its padded expert sizes (default: the "
                           "probe's, else 8.9)")
    card.add_argument("--cold-segments", default=",".join(DEFAULT_COLD_SEGMENTS), metavar="LIST",
                      help="comma-separated name segments a decode step does not read (default: the embedding, "
                           "towers, projectors, MTP)")
    card.add_argument("--all-cold", action="store_true",
                      help="put every cold module on the host even when fewer would fit (frees KV room)")
    rates = p.add_argument_group("machine rates (default: `selective-offload probe`'s, else the reference's)")
    rates.add_argument("--link-gbps", default=None, metavar="GB/S",
                       help=f"pinned host-to-device copy rate, decimal GB/s (reference: {REFERENCE_LINK_GBPS})")
    rates.add_argument("--vram-gbps", default=None, metavar="GB/S",
                       help=f"device memory bandwidth, decimal GB/s (reference: {REFERENCE_VRAM_GBPS})")
    rates.add_argument("--uva-gbps", default=None, metavar="GB/S",
                       help=f"kernels' in-place reads of host memory (default: {DEFAULT_UVA_READ_FACTOR} x the link)")
    rates.add_argument("--decode-read-gbps", default=None, metavar="GB/S",
                       help=f"decode kernels' VRAM read rate (default: {DEFAULT_DECODE_READ_FACTOR} x --vram-gbps)")
    rates.add_argument("--compute-tflops", default=None, metavar="TFLOP/S",
                       help="the GPU's matmul rate, to price FLOPs (default: the probe's; else not priced)")
    rates.add_argument("--cpu-gbps", default=None, metavar="GB/S",
                       help=f"host-compute: the CPU kernel's weight read rate (default: {REFERENCE_CPU_GBPS:g}, the "
                            "reference host's)")
    rates.add_argument("--cpu-threads", type=int, default=None, metavar="N",
                       help="host-compute: threads of the CPU pool (default: physical cores of one NUMA node)")
    rates.add_argument("--cpu-tflops", default=None, metavar="TFLOP/S",
                       help=f"host-compute: the CPU's matmul rate, for the crossover (default: {ASSUMED_CPU_TFLOPS:g})")
    rates.add_argument("--ranks", type=int, default=1, metavar="N",
                       help="TP/EP ranks sharing this host's CPU and memory bandwidth (default: 1)")
    rates.add_argument("--no-host-compute", action="store_true",
                       help="compute nothing on the host CPU (host experts read through UVA, MLPs stay whole)")
    rates.add_argument("--no-device-share", action="store_true",
                       help="no device share: each layer's host-compute experts or MLP wholly on the host")
    rates.add_argument("--no-head-share", action="store_true",
                       help="keep the LM head whole on the device (no vocabulary rows computed on the host CPU)")
    work = p.add_argument_group("workload")
    work.add_argument("--speculative", default=None, metavar="mtp[:K]",
                      help="plan for MTP speculative decoding with K drafts (default K: the model's MTP layers)")
    work.add_argument("--accept-rate", type=float, default=None, metavar="A",
                      help=f"the drafts' acceptance rate (default: the family's published rate, else "
                           f"{DEFAULT_ACCEPT_RATE})")
    work.add_argument("--batch", type=int, default=1, metavar="N",
                      help="concurrent decode sequences sharing a pass over the weights (default: 1)")
    work.add_argument("--max-model-len", type=int, default=None, metavar="L",
                      help="with --max-seqs: size the KV cache for N sequences of L tokens (replaces --kv-cache)")
    work.add_argument("--max-seqs", type=int, default=None, metavar="N", help="see --max-model-len")
    work.add_argument("--kv-cache-dtype", default="auto", choices=sorted(KV_DTYPE_BYTES), metavar="DTYPE",
                      help="KV cache dtype for --max-model-len: auto (the model's 16-bit dtype), fp8, bf16, ...")
    work.add_argument("--context", type=int, default=None, metavar="T",
                      help="average context per sequence, to price KV reads (default: half of --max-model-len)")
    vllm = p.add_argument_group("vLLM: the server's settings and its own offload, priced beside the plan")
    vllm.add_argument("--cpu-offload-gb", "--bulk-gb", dest="bulk_gb", default=None, metavar="GiB",
                      help="price vLLM's cpu_offload_gb at this (default: the least that covers the deficit)")
    vllm.add_argument("--moe-backend", default="auto", metavar="{auto,triton,marlin}",
                      help="the server's --moe-backend: with the card, decides the experts' kernel (default: auto)")
    vllm.add_argument("--no-deep-gemm", action="store_true",
                      help="plan for a server started with VLLM_USE_DEEP_GEMM=0")
    vllm.add_argument("--prefetch-step", type=int, default=1, metavar="N",
                      help="device slots per offloaded layer in vLLM's prefetch offloader (default: 1)")


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


def _given(spell: Callable[[str], str], name: str, value: Any) -> str:
    """An option with its value as the caller wrote it: ``--batch 8`` or ``batch=8``."""
    option = spell(name)
    return f"{option}{'' if option.endswith('=') else ' '}{value}"


def checked_together(args: argparse.Namespace, spell: Callable[[str], str]) -> list[str]:
    """The workload options read together: a contradiction among them is one line naming
    the options as the caller wrote them; what one option makes of another it overrides is
    returned as a note (one line each). A value out of its own range is left to
    :func:`validated`, which names it alone."""
    def in_range(value: Any, least: int, most: int) -> bool:
        return value is None or (isinstance(value, int) and not isinstance(value, bool) and least <= value <= most)

    mml, seqs, context, batch = args.max_model_len, args.max_seqs, args.context, args.batch
    if not (in_range(mml, 1, MAX_TOKENS) and in_range(seqs, 1, MAX_BATCH) and in_range(context, 0, MAX_TOKENS)
            and in_range(batch, 1, MAX_BATCH)):
        return []  # validated() names the value out of range, alone
    if (mml is None) != (seqs is None):
        given, missing = ("max-model-len", "max-seqs") if seqs is None else ("max-seqs", "max-model-len")
        raise UserError(f"{_given(spell, given, mml if seqs is None else seqs)} sizes the KV cache only with "
                        f"{spell(missing)}: give both (N sequences of L tokens), or neither and {spell('kv-cache')}")
    if context is not None and mml is not None and context > mml:
        raise UserError(f"{_given(spell, 'context', context)} is beyond {_given(spell, 'max-model-len', mml)}: no "
                        f"sequence holds more tokens than that; lower {spell('context')} or raise "
                        f"{spell('max-model-len')}")
    if seqs is not None and batch > seqs:
        raise UserError(f"{_given(spell, 'batch', batch)} is above {_given(spell, 'max-seqs', seqs)}: the server "
                        f"decodes at most that many sequences together; lower {spell('batch')} or raise "
                        f"{spell('max-seqs')}")
    notes = []
    if mml is not None and args.kv_cache is not None:
        notes.append(f"{_given(spell, 'kv-cache', args.kv_cache)} is not used: {spell('max-model-len')} with "
                     f"{spell('max-seqs')} sizes the KV cache ({seqs} sequence(s) of {mml} tokens)")
    return notes


def _parse_cold(text: str, spell) -> tuple[str, ...]:
    segs = tuple(s.strip() for s in text.split(",") if s.strip())
    if not segs or any("." in s for s in segs):
        raise UserError(
            f"{spell('cold-segments')}: {text!r} must be a comma-separated list of single name "
            "segments, like embed_tokens,visual"
        )
    return segs


def machine_ram_bytes() -> int | None:
    """This machine's physical memory, where the platform says."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _host_memory(text: str | None, spell) -> int | None:
    if text is None:
        return machine_ram_bytes()
    if text.strip().lower() == "none":
        return None
    value = parse_size(text, spell('host-memory'))
    if value == 0:
        raise UserError(f"{spell('host-memory')}: must be more than 0, like 64GiB (or 'none' to not check)")
    return value


def _parse_speculative(text: str | None, spell) -> tuple[str | None, int | None]:
    """``mtp`` or ``mtp:K``."""
    if text is None:
        return None, None
    method, _, k = text.strip().partition(":")
    if method != "mtp" or (k and not k.isdigit()):
        raise UserError(f"{spell('speculative')}: {text!r} is not understood; write mtp or mtp:K "
                        "(K draft tokens, like mtp:2)")
    return "mtp", int(k) if k else None


def inputs_from_args(args: argparse.Namespace, profile=None, spell: Callable[[str], str] = cli_flag) -> PlanInputs:
    """The plan's inputs: the options in ``args`` (named as ``plan``'s argparse names them),
    and this machine's probe ``profile`` where they are silent. Errors name an option as
    ``spell`` writes it: a flag for the command, a keyword for :func:`plan`."""
    bulk = None
    if args.bulk_gb is not None:
        try:
            bulk = float(args.bulk_gb)
        except ValueError:
            raise UserError(f"{spell('cpu-offload-gb')}: {args.bulk_gb!r} is not a number of GiB, like 10") from None
        if not bulk >= 0 or bulk == float("inf"):
            raise UserError(f"{spell('cpu-offload-gb')}: {args.bulk_gb!r} must be a finite number of GiB, 0 or more")
    if args.prefetch_step < 1:
        raise UserError(f"{spell('prefetch-step')}: {args.prefetch_step} must be 1 or more")
    speculative, spec_tokens = _parse_speculative(args.speculative, spell)
    measured = plan_defaults(profile)
    link, vram, _ = plan_bandwidths(profile)
    if args.device_memory is None and measured["device_memory_bytes"] is None:
        raise UserError(f"{spell('device-memory')} is needed (like 24GiB): no `selective-offload probe` profile of a GPU "
                        f"on this machine ({default_profile_path()}) says it")
    uva = parse_bandwidth_gbps(args.uva_gbps, spell('uva-gbps')) if args.uva_gbps is not None else (
        # mutation: probe-uva-with-another-link
        measured["uva_gbps"] if args.link_gbps is None else None)  # the probe's UVA rate goes with its link
    decode = (parse_bandwidth_gbps(args.decode_read_gbps, spell('decode-read-gbps')) if args.decode_read_gbps is not None
              # mutation: probe-decode-with-another-vram
              else measured["decode_read_gbps"] if args.vram_gbps is None else None)  # and its decode rate with its VRAM
    compute = (_positive(args.compute_tflops, spell('compute-tflops'), "TFLOP/s", "200")
               if args.compute_tflops is not None else None)
    cpu_tflops = _positive(args.cpu_tflops, spell('cpu-tflops'), "TFLOP/s", "0.5") if args.cpu_tflops is not None else None
    cpu = (parse_bandwidth_gbps(args.cpu_gbps, spell('cpu-gbps')) if args.cpu_gbps is not None else None)
    threads = args.cpu_threads if args.cpu_threads is not None else measured["cpu_threads"]
    if args.cpu_threads is not None and not 1 <= args.cpu_threads <= MAX_CPU_THREADS:
        raise UserError(f"{spell('cpu-threads')}: {args.cpu_threads} must be a whole number from 1 to {MAX_CPU_THREADS}")
    if not 1 <= args.ranks <= MAX_RANKS:
        raise UserError(f"{spell('ranks')}: {args.ranks} must be a whole number from 1 to {MAX_RANKS}")
    if threads is not None and threads < args.ranks:
        raise UserError(f"{spell('cpu-threads')} {threads} cannot be split between {spell('ranks')} {args.ranks}; give at least "
                        "one thread per rank")
    card = measured.get("compute_capability")
    if args.compute_capability is not None:
        try:
            card = parse_card(args.compute_capability)
        except ValueError as exc:
            raise UserError(f"{spell('compute-capability')}: {exc}") from None
    backend = str(args.moe_backend).lower().replace("-", "_")
    if backend not in ("auto", "triton", "marlin"):
        raise UserError(f"{spell('moe-backend')}: {args.moe_backend!r} is not a backend the plan knows the kernel of; use "
                        "auto (vLLM's choice), triton or marlin")
    inputs = PlanInputs(
        device_memory_bytes=(parse_size(args.device_memory, spell('device-memory')) if args.device_memory is not None
                             else measured["device_memory_bytes"]),
        kv_cache_bytes=parse_size(DEFAULT_KV_CACHE if args.kv_cache is None else args.kv_cache, spell('kv-cache')),
        reserve_bytes=parse_size(args.reserve, spell('reserve')),
        link_gbps=parse_bandwidth_gbps(args.link_gbps, spell('link-gbps')) if args.link_gbps is not None else link,
        vram_gbps=parse_bandwidth_gbps(args.vram_gbps, spell('vram-gbps')) if args.vram_gbps is not None else vram,
        speculative=speculative,
        spec_tokens=spec_tokens,
        accept_rate=args.accept_rate,
        batch=args.batch,
        max_model_len=args.max_model_len,
        max_seqs=args.max_seqs,
        kv_cache_dtype=args.kv_cache_dtype,
        context_tokens=args.context,
        cold_segments=_parse_cold(args.cold_segments, spell),
        prefetch_step=args.prefetch_step,
        bulk_cpu_offload_gb=bulk,
        all_cold=args.all_cold,
        host_memory_bytes=_host_memory(args.host_memory, spell),
        uva_gbps=uva,
        compute_tflops=compute if compute is not None else measured["compute_tflops"],
        decode_read_gbps=decode,
        compute_capability=card,
        moe_setting=moe_setting(backend, deep_gemm=not args.no_deep_gemm),
        cpu_gbps=cpu, cpu_gbps_source="flag" if cpu is not None else "assumed", cpu_threads=threads,
        cpu_tflops=cpu_tflops, handoff_s=measured["handoff_s"], ranks=args.ranks,
        host_compute=not args.no_host_compute, device_share=not args.no_device_share,
        head_share=not args.no_head_share,
    )
    # mutation: flags-together-unchecked
    checked_together(args, spell)
    validated(inputs, spell)
    if inputs.device_memory_bytes == 0:
        raise UserError(f"{spell('device-memory')}: must be more than 0, like 24GiB")
    inputs = with_card_memory(inputs, profile)
    validated(inputs, spell)
    return inputs


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
        # mutation: input-error-unnamed
        raise UserError(f"{spell(option)}: {respelled(exc, spell)}") from None
    except PlanError as exc:
        raise respelled(exc, spell) from None
    return inputs


def _option_names() -> frozenset[str]:
    return frozenset(a.option_strings[0][2:] for a in options_parser()._actions if a.option_strings)


def respelled(exc: UserError, spell: Callable[[str], str]) -> UserError:
    """``exc`` with each of plan's flags it names (``--kv-cache``) spelled as the caller
    writes options (``kv_cache=`` from :func:`selective_offload.plan`); its type kept."""
    # mutation: python-errors-spelled-as-flags
    if spell is cli_flag:
        return exc
    names = _option_names()
    text = re.sub(r"--([a-z][a-z0-9-]*)", lambda m: spell(m.group(1)) if m.group(1) in names else m.group(0), str(exc))
    return type(exc)(text) if not isinstance(exc, InputError) else UserError(text)


def _positive(text: str, flag: str, unit: str, like: str) -> float:
    try:
        value = float(text)
    except (TypeError, ValueError):  # a keyword of plan() may hold any object
        value = float("nan")
    if not (value > 0 and value != float("inf")):
        raise UserError(f"{flag}: {text!r} must be a positive number of {unit}, like {like}")
    return value


def with_measured_cpu_rate(inputs: PlanInputs, checkpoint, profile) -> PlanInputs:
    """The probe's host kernel rate for the model's format, and the host's read rate it
    measured beside it, where no ``cpu_gbps`` was given (the format is known only once the
    model is read)."""
    if inputs.cpu_gbps is not None:
        return inputs
    rates = plan_defaults(profile)["cpu_kernel_gbps"] or {}
    # mutation: probe-cpu-rate-ignored
    fmt = model_cpu_format(checkpoint)
    if fmt in rates:
        # the host's read rate the probe measured beside it decides whether the kernel is
        # claimed on this host (cpu_kernels.claimed.verdict)
        # mutation: probe-read-rate-dropped
        read = profile.host_read_gbps
        return replace(inputs, cpu_gbps=rates[fmt], cpu_gbps_source="measured", cpu_read_gbps=read)
    return inputs


def options_parser() -> argparse.ArgumentParser:
    """A parser of ``plan``'s options alone: the one place their names and defaults live."""
    parser = argparse.ArgumentParser(add_help=False)
    add_plan_arguments(parser)
    return parser


def options_from_keywords(values: dict[str, Any]) -> argparse.Namespace:
    """``plan``'s options as :func:`selective_offload.plan` takes them: each flag's name with
    ``_`` for ``-`` (``kv_cache="2GiB"``, ``no_host_compute=True``); what is not given takes the
    command's default. A name the command does not have is refused, naming the ones it has."""
    parser = options_parser()
    args = parser.parse_args([])
    by_keyword = {action.option_strings[0].lstrip("-").replace("-", "_"): action
                  for action in parser._actions if action.option_strings}
    unknown = sorted(set(values) - set(by_keyword))
    if unknown:
        raise UserError(f"plan(): {', '.join(k + '=' for k in unknown)} is not an option of selective-offload plan; "
                        f"the options are {', '.join(sorted(by_keyword))}")
    for name, value in values.items():
        action = by_keyword[name]
        if value is None:
            continue
        if action.nargs == 0:  # a switch: True or False, nothing else
            if not isinstance(value, bool):
                raise UserError(f"{name}=: {value!r} must be True or False")
        elif action.type is not None:
            # mutation: keyword-type-unchecked
            value = _typed(name, value, action.type)
        if action.choices is not None and value not in action.choices:
            raise UserError(f"{name}=: {value!r} is not one of {', '.join(map(str, action.choices))}")
        setattr(args, action.dest, value)
    return args


def _typed(name: str, value: Any, kind: type) -> Any:
    """A keyword's value as its option's type: a whole number for an ``int`` option (a
    string of one, not a bool or 2.5), a number for a ``float`` one."""
    wanted = "a whole number" if kind is int else "a number"
    if isinstance(value, str):
        try:
            return kind(value)
        except ValueError:
            raise UserError(f"{name}=: {cut(repr(value), 83)} is not {wanted}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise UserError(f"{name}=: {cut(repr(value), 83)} is not {wanted}")
    return kind(value)


def _inputs_provenance(args: argparse.Namespace, profile) -> str | None:
    """Where the bandwidths and device memory came from, when not from the options."""
    if all(getattr(args, f) is not None for f in ("link_gbps", "vram_gbps", "device_memory")):
        return None
    _, _, source = plan_bandwidths(profile)
    if profile is not None and profile.no_link_reason is None:
        return f"inputs not given as options come from this machine's profile: {source}"
    # no profile of a GPU: only the rates the flags left out are the reference laptop's
    # mutation: reference-note-names-both
    return reference_note(link=args.link_gbps is None, vram=args.vram_gbps is None)


class Planned(NamedTuple):
    """What :func:`plan_model` made: the plan, the checkpoint, the inputs it was planned for
    (before the planner chose what they leave open) and the seconds the read took."""

    plan: Plan
    checkpoint: Checkpoint
    inputs: PlanInputs
    read_s: float


def plan_model(model: str, args: argparse.Namespace, profile, spell: Callable[[str], str] = cli_flag) -> Planned:
    """Read ``model`` and plan it for the options in ``args``: the work of ``plan`` and of
    :func:`selective_offload.plan`."""
    inputs = inputs_from_args(args, profile, spell)
    started = time.perf_counter()
    checkpoint = read_model(model)
    read_s = time.perf_counter() - started
    inputs = with_measured_cpu_rate(inputs, checkpoint, profile)
    try:
        plan = make_plan(checkpoint, inputs)
    except PlanError as exc:  # what only the model shows (its KV layout), said in the caller's words
        raise respelled(exc, spell) from None
    provenance = _inputs_provenance(args, profile)
    # mutation: python-plan-provenance-dropped
    if provenance:
        plan = replace(plan, notes=plan.notes + (provenance,))
    noted = checked_together(args, spell)
    if noted:
        plan = replace(plan, notes=plan.notes + tuple(noted))
    return Planned(plan, checkpoint, inputs, read_s)
