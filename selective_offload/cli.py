"""The ``selective-offload`` command: plan a checkpoint, write manifests, read reports.

Bad input (a missing path, a corrupt header, a size it cannot read) prints one line,
``selective-offload: error: ...``, and exits with status 2; no traceback.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Sequence

from . import __version__
from .checkpoint import manifest_text
from .errors import UserError
from .outputs import check_output_dir, resolve_outputs, write_outputs
from .picture import add_picture_arguments, check_picture_arguments, drawn_pictures
from .plan_format import PlanInputs, Strategy
from .plan_format.io import writable_json
from .plan_options import BUNDLED, PLAN_MODEL_HELP, PlanOptions, cli_flag, plan_model, read_model
from .planner.serving import serve_flags
from .planner.tradeoff import kv_tradeoff
from .probe import add_probe_arguments, load_profile, machine_notes, run_probe
from .render import Shown, render_plan
from .report_cmd import add_report_command
from .sizes import fmt_bytes

#: Exit status of `plan` when nothing fits (the plan is still printed and written).
EXIT_INFEASIBLE = 3
#: Exit status for bad input.
EXIT_USAGE = 2

def _add_output_arguments(p: argparse.ArgumentParser) -> None:
    out = p.add_argument_group("output")
    out.add_argument("-o", "--output", metavar="FILE", help="also write the plan as JSON to FILE, for vllm serve (never over a file "
                          "it did not write)")
    out.add_argument("--json", action="store_true", help="print the plan as JSON instead of text")
    out.add_argument("-v", "--verbose", action="store_true", help="also print every group and the planner's notes")
    out.add_argument("--explain", action="store_true", help="also print what the estimate leaves out, and a published figure to compare")
    add_picture_arguments(out)


def cmd_plan(args: argparse.Namespace) -> int:
    pictures = check_picture_arguments(args)
    # Every output resolved and tried before any work (outputs.py): two names for one file,
    # a file of the user's, a place inside the checkpoint planned, each one line here.
    outputs = resolve_outputs([("-o", args.output, "plan"), *pictures], model=args.model)
    profile = load_profile()
    options = PlanOptions.from_args(args)
    plan, checkpoint, inputs, read_s = plan_model(args.model, options, profile)
    # Every output is made before any is written: a model beyond the plan format is refused
    # here, and a picture that cannot be written leaves the plan file unwritten too.
    text = writable_json(plan, where=args.model)
    drawn = {flag: data for flag, _, data in drawn_pictures(plan, args)}
    write_outputs([(out, text.encode() if out.flag == "-o" else drawn[out.flag]) for out in outputs])
    pictures = [out.given for out in outputs if out.flag != "-o"]
    if args.json:
        sys.stdout.write(text)
    else:
        written = ((f"plan {args.output}",) if args.output else ()) + (
            (f"picture: {', '.join(pictures)}",) if pictures else ())
        shown = Shown(label=args.model, host_ram_from=None if inputs.host_memory_bytes is None else (
                          "this machine's" if args.host_memory is None else "--host-memory"),
                      rates_from=options.rates_from(profile), next_commands=next_commands(args, plan, checkpoint),
                      written=written)
        print(render_plan(plan, checkpoint, verbose=args.verbose, explain=args.explain, shown=shown))
        for note in machine_notes(plan.host_bytes) + options.checked_together(cli_flag):
            print(f"note: {note}")
        if inputs.max_model_len and inputs.max_seqs:
            print("\n" + "\n".join(tradeoff_lines(checkpoint, inputs)))
        if args.verbose:
            print(f"\nread {len(checkpoint.tensors)} tensor headers in {read_s * 1e3:.1f} ms")
    return EXIT_INFEASIBLE if plan.strategy == Strategy.INFEASIBLE else 0


#: Where ``next:`` saves the plan when the user gave no ``-o``.
NEXT_PLAN_FILE = "plan.json"
#: Flags that change only what ``plan`` prints: left out of the command ``next:`` repeats.
_PRINT_ONLY_FLAGS = ("-v", "--verbose", "--explain")


def next_commands(args: argparse.Namespace, plan, checkpoint) -> tuple[str, ...]:
    """The exact commands to save and apply the plan: this ``plan`` command as typed with
    ``-o plan.json`` (when it wrote no plan file), then ``vllm serve`` of the checkpoint with
    the plan named in ``SELECTIVE_OFFLOAD_PLAN`` and the server settings the plan assumed
    (``planner.serving``: its KV cache, its CUDA graph cap)."""
    typed = [a for a in getattr(args, "argv", None) or [args.model] if a not in _PRINT_ONLY_FLAGS]
    commands = []
    target = args.output
    whole = not plan.host_bytes and plan.strategy != Strategy.INFEASIBLE  # plain vLLM serves it: no plan
    if target is None and not whole:
        target = NEXT_PLAN_FILE
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
    flags += serve_flags(plan)
    commands.append(" ".join(([] if whole else env) + ["vllm", "serve", *map(shlex.quote, serve),
                                                      *map(shlex.quote, flags)]))
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


def tradeoff_lines(checkpoint, inputs: PlanInputs) -> list[str]:
    """:func:`planner.tradeoff.kv_tradeoff` as a table: KV bytes against host bytes against
    est tok/s, for a few numbers of sequences of ``max_model_len`` tokens decoding together."""
    lines = [f"KV cache trade-off at max_model_len {inputs.max_model_len} (est; N sequences decoding together):",
             f"{'N':>4} {'KV cache':>10} {'host bytes':>11} {'strategy':<12} {'est_tok/s':>9} {'per seq':>8}"]
    for n, plan in kv_tradeoff(checkpoint, inputs):
        if isinstance(plan, UserError):
            lines.append(f"{n:>4} {str(plan)[:60]}")
            continue
        lines.append(f"{n:>4} {fmt_bytes(plan.inputs.kv_cache_bytes):>10} {fmt_bytes(plan.host_bytes):>11} "
                     f"{plan.strategy:<12} {plan.est.est_tok_s:>9.2f} {plan.est.est_tok_s_per_seq:>8.2f}")
    return lines


def cmd_manifest(args: argparse.Namespace) -> int:
    outputs = resolve_outputs([("-o", args.output, "manifest")], model=args.model)  # before the model is read
    checkpoint = read_model(args.model)
    write_outputs([(outputs[0], manifest_text(checkpoint).encode())])
    print(f"wrote {args.output}: {len(checkpoint.tensors)} tensors, "
          f"{fmt_bytes(checkpoint.total_bytes)} ({checkpoint.kind})")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    if args.workdir is not None:
        check_output_dir(args.workdir, "--workdir")  # before vLLM is imported: a bad folder costs nothing
    from . import demo  # starts vLLM: only for this command

    return demo.main(args.workdir, compare=not args.no_compare)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="selective-offload",
        description="Plan how each weight of a checkpoint larger than the GPU is served: resident, "
                    "copied ahead, read in place from host memory (UVA), or computed on the host CPU "
                    "where it lives (a MoE layer's routed experts, a dense layer's MLP). The bytes a "
                    "decode step does not read (embedding, vision/audio towers, MTP head) go to the "
                    "host first. The plan is priced next to vLLM's own cpu_offload_gb, and the report an "
                    "engine writes under it proves where every byte landed.",
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
    PlanOptions.add_arguments(p)
    _add_output_arguments(p)
    p.set_defaults(func=cmd_plan)

    m = sub.add_parser("manifest", help="write a manifest (tensor names, shapes, dtypes) of a model",
                       description="Write a manifest that plans without the weights: from shard "
                                   "headers, or from a config.json alone (an estimate).")
    m.add_argument("model", metavar="MODEL", help=model_help)
    m.add_argument("-o", "--output", required=True, metavar="FILE",
                   help="where to write the manifest JSON (never over a file selective-offload did "
                                                                     "not write, nor inside MODEL)")
    m.set_defaults(func=cmd_manifest)

    pr = sub.add_parser("probe", help="measure this machine's link, VRAM, device memory and host CPU kernels for "
                                      "`plan`",
                        description="Measure host-to-device bandwidth (pinned and pageable), in-place (UVA) reads, "
                                    "device memory bandwidth, decode read and matmul rates and device memory with "
                                    "torch; the host-compute CPU kernels' weight read rate per format, the threads "
                                    "they ran with and the host's read bandwidth; and one layer's hand-off to the "
                                    "host and back. Print them and write a profile that `plan` uses by default "
                                    "(flags still override). Without a GPU it measures host memcpy and the CPU "
                                    "kernels, and says there is no link.")
    add_probe_arguments(pr)
    pr.set_defaults(func=run_probe)

    d = sub.add_parser("demo", help="run a tiny model through vLLM with a plan applied",
                       description="Build a tiny random Qwen3 (once), plan it so its embedding must go to "
                                   "the host, run it through vLLM with the plan enabled, print the plan, the "
                                   "landing report and the tokens, and compare them with plain vLLM.")
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
