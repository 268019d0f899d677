"""End to end through vLLM: decode speed of one model on one device-memory budget, for each
way of making it fit, with the planner's estimate beside every measured figure.

Why: the project's claim is about `LLM.generate` on a real engine, not about a model of
it. One run starts a fresh in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), in
its own Python process so memory figures and patches never leak between them, for:

- ``resident``: plain vLLM, every weight on the device (when it fits the budget);
- ``cpu_offload``: plain vLLM with ``cpu_offload_gb`` at the smallest whole GiB that covers the
  deficit (the planner's ``plan.vllm_cpu_offload_gb``; vLLM counts GiB, ``int(gb * 1024**3)`` bytes);
- ``cold_only``: ``selective_offload.enable(plan)`` with a plan that puts only cold
  modules (embedding, towers, MTP) on the host;
- ``selective``: the planner's plan for the budget: the cold set plus the exact hot
  decoder layers through vLLM's prefetch offloader (needs CUDA).

What is measured, per configuration and batch size, over ``--repeats`` repetitions in the
same engine (median and min-max): decode tokens/s with prefill excluded, time to first
token, peak device memory, and the bytes in host memory. Decode tok/s is taken from the
engine's own per-request timestamps (``RequestOutput.metrics``: tokens after the first,
over the time from the first token to the last); as a cross-check, and the fallback where
a vLLM build fills no metrics, ``batch * (N - 1) / (t(max_tokens=N) - t(max_tokens=1))``
from wall times of two ``generate`` calls. Time to first token is the wall time of a
``max_tokens=1`` call (prefill and one sampled token). Prefix caching is off, so every
repetition prefills.

The device cap (a 24 GiB card emulated on a larger GPU): vLLM's
``gpu_memory_utilization = cap / total`` (vLLM's own accounting), plus
``torch.cuda.set_per_process_memory_fraction(cap / total)`` as a hard ceiling on the
caching allocator (``--no-hard-cap`` drops it). The worker checks that the ceiling binds
(an allocation just over it must fail) and that peak reserved memory stayed under it.
vLLM's KV cache is sized to the plan's ``--kv-cache`` (``kv_cache_memory_bytes``).

On the CPU build (vllm-cpu) host memory is the device: nothing can be capped or checked,
vLLM's UVA offloader leaves parameters already on the CPU untouched (``cpu_offload_gb`` is
a no-op there), the prefetch offloader needs CUDA (``selective`` with hot layers is
skipped), and ``resident`` runs even over the nominal budget as the reference. With no
``--model`` a tiny random Qwen3 is built (no download) and planned for a budget that needs
hot layers; what it measures is the mechanism's overhead (host gather, wrappers) with no
link cost: ``cold_only / resident`` should be close to 1.0.

    python -m benchmarks.e2e --model /path/to/model --device-memory 24GiB
    python -m benchmarks.e2e            # tiny model, on this machine
    python -m benchmarks.e2e --smoke    # 1 repetition, 8 tokens, batches 1 and 2

Writes ``e2e-<cpu|cuda>-<machine>.json``, ``.md`` and ``.png`` under ``--out``.

The pieces: ``plan.py`` (what each configuration runs, from the plans),
``engine.py`` (one engine, measured in its own process, and the pooling of rounds),
``report.py`` (the Markdown and the chart); this script checks the input, plans,
starts the engines in alternating rounds and writes the results.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import (  # noqa: E402
    RESULTS_DIR,
    BenchError,
    device_name,
    load_1min,
    module_env,
    result_stem,
    shared_note,
    today,
    vllm_version,
    worker_files,
    worker_or_run,
    worker_result,
    write_results,
)
from benchmarks.e2e.engine import merge_rounds, worker  # noqa: E402
from benchmarks.e2e.plan import decide, tiny_budget  # noqa: E402
from benchmarks.e2e.report import chart, markdown  # noqa: E402

CONFIGS = ("resident", "cpu_offload", "cold_only", "selective")
METHOD = ("decode tok/s = sum over requests of (generated tokens - 1) / (last token time - first "
          "token time), from vLLM's per-request engine timestamps (RequestOutput.metrics), prefill "
          "excluded; cross-check: batch*(N-1) / (wall(max_tokens=N) - wall(max_tokens=1)). TTFT = "
          "wall time of a max_tokens=1 generate (prefill + first token). Prefix caching off.")


# --------------------------------------------------------------------------- main


def _run_worker(spec: dict, workdir: Path, timeout_s: float, extra_env: dict) -> dict:
    name = spec["name"]
    spec_path, log_path = worker_files(spec, workdir)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SELECTIVE_OFFLOAD_")}
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    env.update(extra_env)
    print(f"[{name}] starting an engine ...", flush=True)
    t0 = time.perf_counter()
    with log_path.open("w") as log:
        try:
            subprocess.run([sys.executable, "-m", "benchmarks.e2e", "--worker", str(spec_path)], env=module_env(env),
                           stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired:
            return {"status": "failed", "error": f"timed out after {timeout_s:.0f} s (log: {log_path})"}
    result = worker_result(spec, log_path)
    print(f"[{name}] {result['status']} in {time.perf_counter() - t0:.0f} s"
          + (f": {result.get('error')}" if result["status"] != "measured" else ""), flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, help="a checkpoint directory (default: a tiny random Qwen3 built here)")
    ap.add_argument("--device-memory", help="the card's memory, like 24GiB (required with --model)")
    ap.add_argument("--kv-cache", default=None, help="KV cache the plan and vLLM reserve (default 1GiB; tiny: 0)")
    ap.add_argument("--reserve", default=None, help="activations and slack (default 2GiB; tiny: 0)")
    ap.add_argument("--cpu-offload-gb", type=float, default=None,
                    help="vLLM cpu_offload_gb for the cpu_offload row (default: the smallest whole GiB covering the deficit)")
    ap.add_argument("--link-gbps", type=float, help="host-to-device GB/s for the estimate (default: measured)")
    ap.add_argument("--vram-gbps", type=float, help="device read GB/s for the estimate (default: measured)")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3, help="timed repetitions per engine")
    ap.add_argument("--rounds", type=int, default=2,
                    help="fresh engines per configuration, started in alternating order")
    ap.add_argument("--dtype", default=None, help="engine dtype (default: auto on CUDA, float32 on the CPU)")
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (always on the CPU)")
    ap.add_argument("--cpu-threads", type=int, default=1,
                    help="OMP_NUM_THREADS for each engine on the CPU build (default 1: steady on a shared machine)")
    ap.add_argument("--no-hard-cap", action="store_true",
                    help="cap with gpu_memory_utilization only, not set_per_process_memory_fraction")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="subset to run")
    ap.add_argument("--smoke", action="store_true", help="1 repetition, 8 tokens, batches 1 and 2")
    ap.add_argument("--workdir", type=Path, help="where the tiny model and worker logs go")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR)
    ap.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    return worker_or_run(ap.parse_args(argv), worker, run)


def _settings(args) -> dict:
    """The run's sizes from the arguments, checked: bad input fails before anything is built."""
    if args.model is not None:
        if not args.model.is_dir():
            raise BenchError(f"{args.model}: no such model directory")
        if not (args.model / "config.json").is_file() or not any(args.model.glob("*.safetensors")):
            raise BenchError(f"{args.model}: not a checkpoint directory (needs config.json and *.safetensors)")
        if not args.device_memory:
            raise BenchError("--device-memory is required with --model (like --device-memory 24GiB)")
    try:
        batches = sorted({int(b) for b in args.batches.split(",") if b.strip()})
    except ValueError:
        raise BenchError(f"--batches {args.batches!r}: give sizes like 1,8") from None
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    if unknown := set(configs) - set(CONFIGS):
        raise BenchError(f"--configs: unknown {', '.join(sorted(unknown))}; choose from {', '.join(CONFIGS)}")
    repeats, max_tokens, rounds = (1, 8, 1) if args.smoke else (args.repeats, args.max_tokens, args.rounds)
    if args.smoke:
        batches = [1, 2]
    if (not batches or min(batches) < 1 or min(repeats, rounds, args.prompt_len, args.cpu_threads) < 1
            or max_tokens < 2):
        raise BenchError("--batches, --repeats, --rounds, --prompt-len and --cpu-threads must be positive "
                         "and --max-tokens at least 2")

    from selective_offload.errors import UserError
    from selective_offload.sizes import GiB, parse_size

    tiny = args.model is None
    try:  # sizes first: bad input fails before anything is built
        device_memory = parse_size(args.device_memory, "--device-memory") if args.device_memory else None
        kv = parse_size(args.kv_cache, "--kv-cache") if args.kv_cache else (0 if tiny else GiB)
        reserve = parse_size(args.reserve, "--reserve") if args.reserve else (0 if tiny else 2 * GiB)
    except UserError as err:
        raise BenchError(str(err)) from None
    return dict(batches=batches, configs=configs, repeats=repeats, max_tokens=max_tokens, rounds=rounds,
                tiny=tiny, device_memory=device_memory, kv=kv, reserve=reserve)


def _bandwidth(args, cuda: bool) -> dict:
    """The estimate's bandwidths: given, or measured here (a GEMV, the way decode reads)."""
    if args.link_gbps and args.vram_gbps:
        return {"link_gbps": args.link_gbps, "vram_gbps": args.vram_gbps, "decode_read_gbps": None,
                "source": "given"}
    from benchmarks.common import measure_link_gbps, measure_read_gbps

    probe = (256 << 20) if cuda else (64 << 20)
    read = args.vram_gbps or measure_read_gbps(probe, cuda)  # measured: a GEMV, the way decode reads
    return {"link_gbps": args.link_gbps or measure_link_gbps(probe, cuda), "vram_gbps": read,
            "decode_read_gbps": None if args.vram_gbps else read,
            "source": "measured here" + ("" if cuda else ": host memory copy and host GEMV read")}


def _engine_args(args, s: dict, cuda: bool) -> tuple[dict, str]:
    """vLLM's arguments for every engine, and a note on how the device is capped."""
    import torch

    engine_args = dict(skip_tokenizer_init=True, max_model_len=args.prompt_len + s["max_tokens"] + 8,
                       enforce_eager=args.enforce_eager or not cuda, seed=0, enable_prefix_caching=False,
                       disable_log_stats=False, dtype=args.dtype or ("auto" if cuda else "float32"))
    cap_note = "no CUDA: host memory is the device; the budget cannot be capped or checked here"
    if cuda and s["tiny"]:
        engine_args.update(gpu_memory_utilization=0.3, kv_cache_memory_bytes=64 << 20)
        cap_note = "tiny model on CUDA: its budget is nominal, no device cap is set (give --model to cap)"
    elif cuda:
        total = torch.cuda.get_device_properties(0).total_memory
        fraction = min(0.95, s["device_memory"] / total)
        engine_args.update(gpu_memory_utilization=fraction, kv_cache_memory_bytes=max(s["kv"], 64 << 20))
        cap_note = (f"gpu_memory_utilization={fraction:.4f} ({s['device_memory'] / 2**30:.4g} GiB of "
                    f"{total / 2**30:.4g} GiB)" + ("" if args.no_hard_cap else
                    " and set_per_process_memory_fraction to the same; checked per configuration"))
    else:
        engine_args["gpu_memory_utilization"] = 0.1  # sizes the KV cache from host memory here
    return engine_args, cap_note


def _records_and_specs(rows: list[dict], s: dict, args, model: Path, prompts: list, engine_args: dict,
                       cuda: bool, workdir: Path) -> tuple[list[dict], dict]:
    """Each configuration's record (est, status) and, for those that run, its worker's spec."""
    results, specs = [], {}
    for row in rows:
        name = row["name"]
        rec = {k: v for k, v in row.items() if k not in ("plan", "est")}
        est = row.get("est")
        rec["est_step_s"] = est.est_step_s if est else None
        if name not in s["configs"] and rec["status"] == "run":
            rec.update(status="skipped", reason="not in --configs")
        if rec["status"] == "run":
            spec = {"name": name, "model": str(model), "engine_args": dict(engine_args), "prompts": prompts,
                    "batches": s["batches"], "max_tokens": s["max_tokens"], "repeats": s["repeats"],
                    "cap_bytes": s["device_memory"] if cuda and not s["tiny"] else None,
                    "hard_cap": not args.no_hard_cap}
            if name == "cpu_offload":
                spec["engine_args"]["cpu_offload_gb"] = row["cpu_offload_gb"]
            if "plan" in row:
                spec["plan_path"] = str(workdir / f"{name}.plan.json")
                spec["report_path"] = str(workdir / f"{name}.report.json")
                row["plan"].save(spec["plan_path"])
            rec["engine_args"] = spec["engine_args"]
            specs[name] = spec
        results.append(rec)
    return results, specs


def _run_rounds(specs: dict, rounds: int, workdir: Path, timeout_s: float, extra_env: dict) -> dict[str, list[dict]]:
    """Every configuration gets a fresh engine per round, in alternating order, so a machine
    that drifts (another process starting, thermal state) biases no configuration."""
    runs: dict[str, list[dict]] = {name: [] for name in specs}
    for r in range(rounds):
        for name in (list(specs) if r % 2 == 0 else list(reversed(specs))):
            if runs[name] and runs[name][-1]["status"] != "measured":
                continue  # failed once: not again
            runs[name].append(_run_worker({**specs[name], "name": f"{name}.r{r + 1}"}, workdir,
                                          timeout_s, extra_env))
    return runs


def _pool(results: list[dict], runs: dict[str, list[dict]]) -> None:
    """Each record given its engines' pooled figures, its memory and host bytes, and est."""
    for rec in results:
        name = rec["name"]
        if name in runs:
            rec.update(merge_rounds(runs[name]))
            rec["name"] = name
            if rec["status"] == "measured":
                rec["memory_bytes"] = rec.get("peak_device_allocated_bytes", rec.get("host_rss_bytes"))
                if name == "resident":
                    rec["host_bytes"] = 0
                elif name == "cpu_offload":
                    rec["host_bytes"] = rec.get("placement", {}).get("vllm_uva_offloaded_bytes")
                else:
                    rep = rec.get("report", {})
                    rec["host_bytes"] = rep.get("landed_cold_on_host_bytes", 0) + rep.get("landed_prefetch_bytes", 0)
                for b, m in rec["batches"].items():
                    m["est_tok_s"] = int(b) / rec["est_step_s"] if rec["est_step_s"] else None
                    med = m["decode_tok_s"]["median"]
                    m["measured_over_est"] = med / m["est_tok_s"] if med and m["est_tok_s"] else None


def run(args) -> int:
    s = _settings(args)
    batches, tiny, kv, reserve = s["batches"], s["tiny"], s["kv"], s["reserve"]

    import torch

    from selective_offload.checkpoint import load_checkpoint
    from selective_offload.errors import UserError
    from selective_offload.planner import EST_MODEL, PlanInputs
    from selective_offload.vllm_glue.demo_engine import build_tiny_model

    started, load_before = time.perf_counter(), load_1min()
    cuda = torch.cuda.is_available()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench-e2e-"))
    workdir.mkdir(parents=True, exist_ok=True)
    model = build_tiny_model(workdir / "tiny-qwen3") if tiny else args.model.resolve()
    try:
        ckpt = load_checkpoint(model)
    except UserError as err:
        raise BenchError(str(err)) from None
    device_memory = s["device_memory"] = s["device_memory"] or tiny_budget(ckpt)

    bandwidth = _bandwidth(args, cuda)
    inputs = PlanInputs(device_memory_bytes=device_memory, kv_cache_bytes=kv, reserve_bytes=reserve,
                        link_gbps=bandwidth["link_gbps"], vram_gbps=bandwidth["vram_gbps"],
                        decode_read_gbps=bandwidth["decode_read_gbps"], vllm_cpu_offload_gb=args.cpu_offload_gb)
    try:
        plan, rows = decide(ckpt, inputs, cuda, capped=cuda and not tiny)
    except UserError as err:
        raise BenchError(str(err)) from None

    # Prompts: random ids, one per request of the largest batch, the same for every config.
    vocab = ckpt.config.get("vocab_size") or ckpt.config.get("text_config", {}).get("vocab_size") or 1000
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, max(11, vocab - 10), (max(batches), args.prompt_len), generator=gen).tolist()
    engine_args, cap_note = _engine_args(args, s, cuda)
    timeout_s = 600 if args.smoke else 3600
    # On the CPU build one OpenMP thread per engine: a tiny model's step is no faster with
    # two, and with two a core taken by another process stalls every OpenMP barrier.
    extra_env = {} if cuda else {"OMP_NUM_THREADS": str(args.cpu_threads)}

    results, specs = _records_and_specs(rows, s, args, model, prompts, engine_args, cuda, workdir)
    _pool(results, _run_rounds(specs, s["rounds"], workdir, timeout_s, extra_env))

    by_name = {r["name"]: r for r in results}
    overhead = ratios(by_name, next((n for n in ("selective", "cold_only")
                                     if by_name[n]["status"] == "measured"), None), batches)
    # On the CPU build cpu_offload is plain vLLM again: cpu_offload/resident is the engine-to-engine noise.
    noise = ratios(by_name, "cpu_offload", batches) if not cuda else {}
    result = {
        "benchmark": "e2e", "date": today(), "device": device_name(cuda), "cuda": cuda, "vllm": vllm_version(),
        "model": str(model), "tiny": tiny, "model_bytes": ckpt.total_bytes, "smoke": args.smoke,
        "device_memory_bytes": device_memory, "kv_cache_bytes": kv, "reserve_bytes": reserve,
        "bandwidth": bandwidth, "batches": batches, "repeats": s["repeats"], "rounds": s["rounds"],
        "max_tokens": s["max_tokens"],
        "prompt_len": args.prompt_len, "method": METHOD, "cpu_threads": None if cuda else args.cpu_threads, "cap": {"note": cap_note},
        "plan": {"strategy": plan.strategy, "hot_layer_indices": plan.hot_layer_indices,
                 "deficit_bytes": plan.deficit_bytes, "cold_on_host_bytes": plan.cold_on_host_bytes,
                 "prefetch_bytes": plan.prefetch_bytes,
                 "cpu_offload_gb": plan.vllm_cpu_offload_gb.cpu_offload_gb if plan.vllm_cpu_offload_gb else None},
        "configs": results, "overhead_ratio": overhead, "noise_floor_ratio": noise,
        "est_model": EST_MODEL,
        "wall_s": time.perf_counter() - started,
    }
    result["load_note"] = shared_note(load_before, load_1min())
    stem = result_stem("e2e", cuda, result["device"]) + ("-smoke" if args.smoke else "")
    paths = write_results(args.out, stem, result, markdown(result))
    try:
        chart(result, args.out / f"{stem}.png")
        png = f" and {args.out / stem}.png"
    except ImportError as err:  # a GPU image without matplotlib: the JSON and Markdown are the results
        png = f" (no chart: {err}; `pip install matplotlib` draws it)"
    print(markdown(result))
    print(f"wrote {paths[0]}, {paths[1]}{png} (worker logs in {workdir})")
    failed = [r["name"] for r in results if r["status"] == "failed"]
    caps = [r["name"] for r in results if r.get("under_cap") is False or r.get("cap_binds") is False]
    if failed or caps:
        print(f"error: failed: {', '.join(failed) or '-'}; cap not held: {', '.join(caps) or '-'}", file=sys.stderr)
        return 1
    return 0


def ratios(by_name: dict, name: str | None, batches: list[int]) -> dict:
    """Decode tok/s of ``name`` over resident's per batch, and the step time it adds."""
    if not name or by_name[name]["status"] != "measured" or by_name["resident"]["status"] != "measured":
        return {}
    out = {}
    for b in map(str, batches):
        a = by_name[name]["batches"][b]["decode_tok_s"]["median"]
        z = by_name["resident"]["batches"][b]["decode_tok_s"]["median"]
        if a and z:
            out[b] = {"ratio": a / z, "added_ms_per_step": (int(b) / a - int(b) / z) * 1e3,
                      "numerator": name, "denominator": "resident"}
    return out
