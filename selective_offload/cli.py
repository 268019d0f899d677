"""The ``selective-offload`` command: plan a checkpoint, write manifests, read reports.

Bad input (a missing path, a corrupt header, a size it cannot read) prints one line,
``selective-offload: error: ...``, and exits with status 2; no traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Sequence

from . import __version__
from .checkpoint import load_checkpoint, write_manifest
from .errors import UserError
from .names import DEFAULT_COLD_SEGMENTS
from .estimate import (
    ASSUMED_CPU_TFLOPS,
    DEFAULT_ACCEPT_RATE,
    DEFAULT_DECODE_READ_FACTOR,
    DEFAULT_UVA_READ_FACTOR,
    KV_DTYPE_BYTES,
    REFERENCE_CPU_GBPS,
)
from .plan import REFERENCE_LINK_GBPS, REFERENCE_VRAM_GBPS, PlanInputs, Strategy
from .plan.inputs import MAX_CPU_THREADS, MAX_RANKS, moe_setting, parse_card
from .planner.host_compute import model_cpu_format
from .plan.io import writable_json
from .probe import (
    add_probe_arguments,
    default_profile_path,
    load_profile,
    plan_bandwidths,
    reference_note,
    plan_defaults,
    run_probe,
)
from .outputs import check_output_file, write_files
from .picture import add_picture_arguments, check_picture_arguments, drawn_pictures, picture_outputs
from .planner import make_plan
from .progress import progress
from .render import Shown, render_plan
from .report_cmd import add_report_command
from .sizes import fmt_bytes, parse_bandwidth_gbps, parse_size

#: Exit status of `plan` when nothing fits (the plan is still printed and written).
EXIT_INFEASIBLE = 3
#: Exit status for bad input.
EXIT_USAGE = 2

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


def _parse_cold(text: str) -> tuple[str, ...]:
    segs = tuple(s.strip() for s in text.split(",") if s.strip())
    if not segs or any("." in s for s in segs):
        raise UserError(
            f"--cold-segments: {text!r} must be a comma-separated list of single name "
            "segments, like embed_tokens,visual"
        )
    return segs


def _add_plan_arguments(p: argparse.ArgumentParser) -> None:
    """The plan's options in the groups a user looks for them in, one or two lines each
    (the README and the module docstrings say the why)."""
    card = p.add_argument_group("card and budget")
    card.add_argument("--device-memory", default=None, metavar="SIZE",
                      help="the GPU's memory, e.g. 24GiB (B, kB..TB, KiB..TiB); default: the probe's")
    card.add_argument("--kv-cache", default="1GiB", metavar="SIZE",
                      help="device memory kept for the KV cache (default: 1GiB)")
    card.add_argument("--reserve", default="2GiB", metavar="SIZE",
                      help="device memory kept for the CUDA context, activations, graphs (default: 2GiB)")
    card.add_argument("--host-memory", default=None, metavar="SIZE",
                      help="host RAM the host bytes must fit in (default: this machine's; 'none': no check)")
    card.add_argument("--compute-capability", default=None, metavar="MAJOR.MINOR",
                      help="the card's, like 8.9: picks vLLM's MoE kernel (default: the probe's, else 8.9)")
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


def _add_output_arguments(p: argparse.ArgumentParser) -> None:
    out = p.add_argument_group("output")
    out.add_argument("-o", "--output", metavar="FILE", help="also write the plan as JSON to FILE (for vllm serve)")
    out.add_argument("--json", action="store_true", help="print the plan as JSON instead of text")
    out.add_argument("-v", "--verbose", action="store_true", help="also print every group and the planner's notes")
    out.add_argument("--explain", action="store_true", help="also print what the estimate leaves out")
    add_picture_arguments(out)


def machine_ram_bytes() -> int | None:
    """This machine's physical memory, where the platform says."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _host_memory(text: str | None) -> int | None:
    if text is None:
        return machine_ram_bytes()
    if text.strip().lower() == "none":
        return None
    value = parse_size(text, "--host-memory")
    if value == 0:
        raise UserError("--host-memory: must be more than 0, like 64GiB (or 'none' to not check)")
    return value


def _parse_speculative(text: str | None) -> tuple[str | None, int | None]:
    """``mtp`` or ``mtp:K``."""
    if text is None:
        return None, None
    method, _, k = text.strip().partition(":")
    if method != "mtp" or (k and not k.isdigit()):
        raise UserError(f"--speculative: {text!r} is not understood; write mtp or mtp:K (K draft tokens, like mtp:2)")
    return "mtp", int(k) if k else None


def inputs_from_args(args: argparse.Namespace, profile=None) -> PlanInputs:
    """The plan's inputs: the flags, and this machine's probe ``profile`` where they are silent."""
    bulk = None
    if args.bulk_gb is not None:
        try:
            bulk = float(args.bulk_gb)
        except ValueError:
            raise UserError(f"--cpu-offload-gb: {args.bulk_gb!r} is not a number of GiB, like 10") from None
        if not bulk >= 0 or bulk == float("inf"):
            raise UserError(f"--cpu-offload-gb: {args.bulk_gb!r} must be a finite number of GiB, 0 or more")
    if args.prefetch_step < 1:
        raise UserError(f"--prefetch-step: {args.prefetch_step} must be 1 or more")
    speculative, spec_tokens = _parse_speculative(args.speculative)
    measured = plan_defaults(profile)
    link, vram, _ = plan_bandwidths(profile)
    if args.device_memory is None and measured["device_memory_bytes"] is None:
        raise UserError("--device-memory is needed (like 24GiB): no `selective-offload probe` profile of a GPU "
                        f"on this machine ({default_profile_path()}) says it")
    uva = parse_bandwidth_gbps(args.uva_gbps, "--uva-gbps") if args.uva_gbps is not None else (
        # mutation: probe-uva-with-another-link
        measured["uva_gbps"] if args.link_gbps is None else None)  # the probe's UVA rate goes with its link
    decode = (parse_bandwidth_gbps(args.decode_read_gbps, "--decode-read-gbps") if args.decode_read_gbps is not None
              # mutation: probe-decode-with-another-vram
              else measured["decode_read_gbps"] if args.vram_gbps is None else None)  # and its decode rate with its VRAM
    compute = None
    if args.compute_tflops is not None:
        try:
            compute = float(args.compute_tflops)
        except ValueError:
            compute = float("nan")
        if not (compute > 0 and compute != float("inf")):
            raise UserError(f"--compute-tflops: {args.compute_tflops!r} must be a positive number of TFLOP/s, "
                            "like 200")
    cpu_tflops = _positive(args.cpu_tflops, "--cpu-tflops", "TFLOP/s", "0.5") if args.cpu_tflops is not None else None
    cpu = (parse_bandwidth_gbps(args.cpu_gbps, "--cpu-gbps") if args.cpu_gbps is not None else None)
    threads = args.cpu_threads if args.cpu_threads is not None else measured["cpu_threads"]
    if args.cpu_threads is not None and not 1 <= args.cpu_threads <= MAX_CPU_THREADS:
        raise UserError(f"--cpu-threads: {args.cpu_threads} must be a whole number from 1 to {MAX_CPU_THREADS}")
    if not 1 <= args.ranks <= MAX_RANKS:
        raise UserError(f"--ranks: {args.ranks} must be a whole number from 1 to {MAX_RANKS}")
    if threads is not None and threads < args.ranks:
        raise UserError(f"--cpu-threads {threads} cannot be split between --ranks {args.ranks}; give at least "
                        "one thread per rank")
    card = measured.get("compute_capability")
    if args.compute_capability is not None:
        try:
            card = parse_card(args.compute_capability)
        except ValueError as exc:
            raise UserError(f"--compute-capability: {exc}") from None
    backend = str(args.moe_backend).lower().replace("-", "_")
    if backend not in ("auto", "triton", "marlin"):
        raise UserError(f"--moe-backend: {args.moe_backend!r} is not a backend the plan knows the kernel of; use "
                        "auto (vLLM's choice), triton or marlin")
    inputs = PlanInputs(
        device_memory_bytes=(parse_size(args.device_memory, "--device-memory") if args.device_memory is not None
                             else measured["device_memory_bytes"]),
        kv_cache_bytes=parse_size(args.kv_cache, "--kv-cache"),
        reserve_bytes=parse_size(args.reserve, "--reserve"),
        link_gbps=parse_bandwidth_gbps(args.link_gbps, "--link-gbps") if args.link_gbps is not None else link,
        vram_gbps=parse_bandwidth_gbps(args.vram_gbps, "--vram-gbps") if args.vram_gbps is not None else vram,
        speculative=speculative,
        spec_tokens=spec_tokens,
        accept_rate=args.accept_rate,
        batch=args.batch,
        max_model_len=args.max_model_len,
        max_seqs=args.max_seqs,
        kv_cache_dtype=args.kv_cache_dtype,
        context_tokens=args.context,
        cold_segments=_parse_cold(args.cold_segments),
        prefetch_step=args.prefetch_step,
        bulk_cpu_offload_gb=bulk,
        all_cold=args.all_cold,
        host_memory_bytes=_host_memory(args.host_memory),
        uva_gbps=uva,
        compute_tflops=compute if compute is not None else measured["compute_tflops"],
        decode_read_gbps=decode,
        compute_capability=card,
        moe_setting=moe_setting(backend, deep_gemm=not args.no_deep_gemm),
        cpu_gbps=cpu, cpu_gbps_source="flag" if cpu is not None else "assumed", cpu_threads=threads,
        cpu_tflops=cpu_tflops, handoff_s=measured["handoff_s"], ranks=args.ranks,
        host_compute=not args.no_host_compute,
    )
    if inputs.device_memory_bytes == 0:
        raise UserError("--device-memory: must be more than 0, like 24GiB")
    return inputs


def _positive(text: str, flag: str, unit: str, like: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (value > 0 and value != float("inf")):
        raise UserError(f"{flag}: {text!r} must be a positive number of {unit}, like {like}")
    return value


def with_measured_cpu_rate(inputs: PlanInputs, checkpoint, profile) -> PlanInputs:
    """The probe's host kernel rate for the model's format, where no --cpu-gbps gave one
    (the format is known only once the model is read)."""
    if inputs.cpu_gbps is not None:
        return inputs
    rates = plan_defaults(profile)["cpu_kernel_gbps"] or {}
    # mutation: probe-cpu-rate-ignored
    fmt = model_cpu_format(checkpoint)
    if fmt in rates:
        return replace(inputs, cpu_gbps=rates[fmt], cpu_gbps_source="measured")
    return inputs


def check_output(path: str | None, flag: str = "-o") -> None:
    """Refuse, before any work, an output file that cannot be written where it is named."""
    if path is not None:
        check_output_file(path, flag)


def cmd_plan(args: argparse.Namespace) -> int:
    check_picture_arguments(args)
    check_output(args.output)
    named = [path for path in (args.output, *(p for _, p in picture_outputs(args))) if path]
    if len({Path(p).absolute() for p in named}) < len(named):
        raise UserError(f"-o, --png and --svg name the same file ({', '.join(named)}); name a file for each")
    profile = load_profile()
    inputs = inputs_from_args(args, profile)
    started = time.perf_counter()
    checkpoint = read_model(args.model)
    read_s = time.perf_counter() - started
    inputs = with_measured_cpu_rate(inputs, checkpoint, profile)
    plan = make_plan(checkpoint, inputs)
    provenance = _inputs_provenance(args, profile)
    if provenance:
        plan = replace(plan, notes=plan.notes + (provenance,))
    # Every output is made before any is written: a model beyond the plan format is refused
    # here, and a picture that cannot be written leaves the plan file unwritten too.
    text = writable_json(plan, where=args.model)
    outputs = [("-o", args.output, text.encode())] if args.output else []
    outputs += drawn_pictures(plan, args)
    write_files(outputs)
    pictures = [path for flag, path, _ in outputs if flag != "-o"]
    if args.json:
        sys.stdout.write(text)
    else:
        written = ((f"plan {args.output}",) if args.output else ()) + (
            (f"picture: {', '.join(pictures)}",) if pictures else ())
        shown = Shown(label=args.model, host_ram_from=None if inputs.host_memory_bytes is None else (
                          "this machine's" if args.host_memory is None else "--host-memory"),
                      rates_from=_rates_from(args, profile), next_commands=next_commands(args, plan, checkpoint),
                      written=written)
        print(render_plan(plan, checkpoint, verbose=args.verbose, explain=args.explain, shown=shown))
        for note in machine_notes(plan):
            print(f"note: {note}")
        if inputs.max_model_len and inputs.max_seqs:
            print("\n" + "\n".join(kv_tradeoff(checkpoint, inputs)))
        if args.verbose:
            print(f"\nread {len(checkpoint.tensors)} tensor headers in {read_s * 1e3:.1f} ms")
    return EXIT_INFEASIBLE if plan.strategy == Strategy.INFEASIBLE else 0


def _rates_from(args: argparse.Namespace, profile) -> dict[str, str]:
    """Where the link and VRAM rates came from: a flag, this machine's probe, or the reference laptop."""
    measured = plan_defaults(profile)
    return {name: "given" if getattr(args, flag) is not None else "probed" if measured[key] is not None
            else "reference"
            for name, flag, key in (("link", "link_gbps", "link_gbps"), ("vram", "vram_gbps", "vram_gbps"))}


#: Where ``next:`` saves the plan when the user gave no ``-o``.
NEXT_PLAN_FILE = "plan.json"
#: Flags that change only what ``plan`` prints: left out of the command ``next:`` repeats.
_PRINT_ONLY_FLAGS = ("-v", "--verbose", "--explain")


def next_commands(args: argparse.Namespace, plan, checkpoint) -> tuple[str, ...]:
    """The exact commands to save and apply the plan: this ``plan`` command as typed with
    ``-o plan.json`` (when it wrote no plan file), then ``vllm serve`` of the checkpoint with
    the plan named in ``SELECTIVE_OFFLOAD_PLAN`` and the server settings the plan assumed."""
    typed = [a for a in getattr(args, "argv", None) or [args.model] if a not in _PRINT_ONLY_FLAGS]
    commands = []
    target = args.output
    if target is None:
        target = NEXT_PLAN_FILE
        # mutation: next-line-without-output
        commands.append(shlex.join(["selective-offload", "plan", *typed, "-o", target]))
    env = [f"SELECTIVE_OFFLOAD_PLAN={shlex.quote(str(target))}"] + (["VLLM_USE_DEEP_GEMM=0"] if args.no_deep_gemm
                                                                     else [])
    serve, comment = _served_model(args.model, checkpoint.kind)
    flags = []
    if args.max_model_len:
        flags += ["--max-model-len", str(args.max_model_len)]
    if str(args.moe_backend).lower() != "auto":
        flags += ["--moe-backend", str(args.moe_backend)]
    if plan.spec_tokens:
        flags += ["--speculative-config", json.dumps({"method": "mtp", "num_speculative_tokens": plan.spec_tokens})]
    commands.append(" ".join(env + ["vllm", "serve", *map(shlex.quote, serve), *map(shlex.quote, flags)]))
    return tuple(commands) + ((comment,) if comment else ())


def _served_model(model: str, kind: str) -> tuple[list[str], str]:
    """What ``vllm serve`` is given for the checkpoint planned: its directory, or its hub id
    (and revision); a manifest or a config alone names no weights, so a placeholder says so."""
    if kind == "hub":
        name, _, revision = model.partition("@")
        return ([name, "--revision", revision] if revision else [name]), ""
    path = Path(model)
    if kind == "safetensors":
        return [str(path.parent if path.is_file() else path)], ""
    return ["CHECKPOINT"], "# CHECKPOINT: the weights this " + ("manifest lists" if kind == "manifest" else "config describes")


def _inputs_provenance(args: argparse.Namespace, profile) -> str | None:
    """Where the bandwidths and device memory came from, when not from the flags."""
    if all(getattr(args, f) is not None for f in ("link_gbps", "vram_gbps", "device_memory")):
        return None
    _, _, source = plan_bandwidths(profile)
    if profile is not None and profile.no_link_reason is None:
        return f"inputs not given as flags come from this machine's profile: {source}"
    # no profile of a GPU: only the rates the flags left out are the reference laptop's
    # mutation: reference-note-names-both
    return reference_note(link=args.link_gbps is None, vram=args.vram_gbps is None)


def kv_tradeoff(checkpoint, inputs: PlanInputs) -> list[str]:
    """KV bytes against host bytes against est tok/s, for a few numbers of sequences of
    ``max_model_len`` tokens decoding together (est)."""
    lines = [f"KV cache trade-off at max_model_len {inputs.max_model_len} (est; N sequences decoding together):",
             f"{'N':>4} {'KV cache':>10} {'host bytes':>11} {'strategy':<12} {'est_tok/s':>9} {'per seq':>8}"]
    for n in sorted({1, 2, 4, 8, 16, inputs.max_seqs}):
        try:
            plan = make_plan(checkpoint, replace(inputs, max_seqs=n, batch=n), with_bulk=False)
        except UserError as exc:
            lines.append(f"{n:>4} {str(exc)[:60]}")
            continue
        lines.append(f"{n:>4} {fmt_bytes(plan.inputs.kv_cache_bytes):>10} {fmt_bytes(plan.host_bytes):>11} "
                     f"{plan.strategy:<12} {plan.est.est_tok_s:>9.2f} {plan.est.est_tok_s_per_seq:>8.2f}")
    return lines


def machine_notes(plan) -> list[str]:
    """What this machine changes about the plan: an integrated GPU shares one memory with
    the host, so the bytes a plan puts on the host free no device memory here."""
    import torch

    host = plan.host_bytes
    if not host or not torch.cuda.is_available():
        return []
    props = torch.cuda.get_device_properties(0)
    if getattr(props, "is_integrated", False):
        return [f"this machine's GPU ({props.name}) is integrated, one memory with the host: the "
                f"{fmt_bytes(host)} this plan puts on the host would free no device memory here"]
    return []


def cmd_manifest(args: argparse.Namespace) -> int:
    check_output(args.output)
    checkpoint = read_model(args.model)
    try:
        write_manifest(checkpoint, args.output)
    except OSError as exc:
        raise UserError(f"-o {args.output}: cannot write the manifest: {exc.strerror or exc}") from None
    print(f"wrote {args.output}: {len(checkpoint.tensors)} tensors, "
          f"{fmt_bytes(checkpoint.total_bytes)} ({checkpoint.kind})")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from .vllm_glue import demo  # imports vLLM: only for this command

    return demo.main(args.workdir, compare=not args.no_compare)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="selective-offload",
        description="Plan which weights of a checkpoint live in host memory: the bytes a decode "
                    "step does not read (embedding, vision/audio towers, MTP head) first, then "
                    "exact decoder layers, or a MoE layer's routed experts read in place (top-k of E "
                    "per token); priced next to vLLM's own cpu_offload_gb.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    model_help = ("a checkpoint directory of *.safetensors shards (only headers are read), a single "
                  ".safetensors shard, a manifest .json, a config.json (sizes estimated), a Hugging Face hub "
                  "id ORG/NAME[@REVISION] (the local cache, else only the shard headers over HTTP; HF_ENDPOINT, "
                  f"HF_TOKEN, HF_HUB_OFFLINE honoured), or the name of a bundled manifest: {', '.join(BUNDLED)}")
    p = sub.add_parser("plan", help="make a placement plan", usage="%(prog)s MODEL --device-memory SIZE [options]",
                       description=(
        "Make a placement plan and print its verdict, the device and host totals, the estimate "
        "and the commands that save and apply it (--verbose: every group; --json: the plan). The JSON "
        "file written with -o is what vllm serve and selective_offload.enable() take. Exit status: 0 when "
        f"the plan fits, {EXIT_INFEASIBLE} when it is infeasible (still printed), "
        f"{EXIT_USAGE} for bad input."))
    p.add_argument("model", metavar="MODEL", help=PLAN_MODEL_HELP)
    _add_plan_arguments(p)
    _add_output_arguments(p)
    p.set_defaults(func=cmd_plan)

    m = sub.add_parser("manifest", help="write a manifest (tensor names, shapes, dtypes) of a model",
                       description="Write a manifest that plans without the weights: from shard "
                                   "headers, or from a config.json alone (an estimate).")
    m.add_argument("model", metavar="MODEL", help=model_help)
    m.add_argument("-o", "--output", required=True, metavar="FILE", help="where to write the manifest JSON")
    m.set_defaults(func=cmd_manifest)

    pr = sub.add_parser("probe", help="measure this machine's link, VRAM and device memory for `plan`",
                        description="Measure host-to-device bandwidth (pinned and pageable), device memory "
                                    "bandwidth and device memory with torch, print them and write a profile that "
                                    "`plan` uses by default (flags still override). Without a GPU it measures host "
                                    "memcpy and says there is no link.")
    add_probe_arguments(pr)
    pr.set_defaults(func=run_probe)

    d = sub.add_parser("demo", help="run a tiny model through vLLM with a plan applied",
                       description="Build a tiny random Qwen3 (once), plan it so its embedding must go to "
                                   "the host, run it through vLLM with the plan enabled, print the plan, the "
                                   "placement report and the tokens, and compare them with plain vLLM.")
    d.add_argument("--workdir", metavar="DIR", default=None,
                   help="where the tiny model and the report go (default: ~/.cache/selective-offload/demo)")
    d.add_argument("--no-compare", action="store_true", help="skip the plain-vLLM run")
    d.set_defaults(func=cmd_demo)
    add_report_command(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.argv = argv[1:]  # after the command's name: what `next:` repeats
    try:
        return args.func(args)
    except UserError as exc:
        print(f"selective-offload: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:  # `selective-offload plan ... | head`
        return 0


if __name__ == "__main__":
    sys.exit(main())
