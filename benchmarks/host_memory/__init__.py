"""Host memory of a vLLM engine with a cold plan against plain vLLM: the peak resident set
of the whole engine (every process vLLM starts) during loading and a short generate.

Why: the plan puts the embedding in host memory. On a GPU that saves device memory; it
must not cost host memory beyond the embedding itself, such as a second copy made while
moving it, a pinned copy beside a pageable one, or staging buffers that grow with the
table. On the CPU build host memory is the device, so an engine with the plan and one
without hold the same weights in the same RAM: any difference in their resident sets is
what the mechanism adds.

How: each engine runs in its own subprocess (this script with ``--worker``), which starts
``vllm.LLM`` with vLLM's default engine process (the engine core, which holds the model,
is a child of the worker). While it runs, this process samples the resident set (psutil
``memory_info().rss``) of the worker and all its descendants every ``--interval-ms``
(default 20 ms) and sums it; the peak of that sum is the figure. The kernel's own per-
process high-water marks (``VmHWM``) are read at each sample too: their sum is an upper
bound (the processes' peaks need not coincide). Plain vLLM and the plan alternate in
order, ``--repeats`` times (default 3). The model is a random Qwen3 with a large
vocabulary built here with ``save_pretrained`` (no download): vocab 131072 x hidden 1024,
2 layers, untied, bf16 (a 268 MB embedding), so a duplicate copy of the embedding would
stand far above the run-to-run noise. The plan is the planner's for a budget 1000 bytes
short of the model (the embedding, the only cold module, goes to the host).

    python -m benchmarks.host_memory              # 3 x 2 engines, 3 to 4 minutes on 2 cores
    python -m benchmarks.host_memory --smoke      # tiny model, 1 x 2 engines

Writes ``host-memory-<cpu|cuda>-<machine>.json`` and ``.md`` under ``--out``.

The pieces: ``rss_sampling.py`` (the process tree's resident set, sampled) and
``report.py`` (the Markdown); this script builds the model and the plan,
starts the engines and compares them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import (  # noqa: E402
    RESULTS_DIR,
    BenchError,
    engine_worker,
    load_1min,
    machine,
    module_env,
    result_stem,
    shared_note,
    spread,
    today,
    vllm_version,
    worker_files,
    worker_or_run,
    worker_result,
    write_results,
)
from benchmarks.host_memory.report import markdown  # noqa: E402
from benchmarks.host_memory.rss_sampling import TRANSIENT_SAMPLES, sample_tree  # noqa: E402

CONFIGS = ("plain", "selective")
FULL_MODEL = dict(vocab_size=131072, hidden_size=1024, intermediate_size=3072, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=128)
SMOKE_MODEL = dict(vocab_size=4096, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                   num_attention_heads=2, num_key_value_heads=1, head_dim=64)
METHOD = (
    "Each engine runs in its own subprocess (this script with --worker: vllm.LLM with vLLM's default "
    "engine process, so the engine core, and on the CPU build the process it starts to hold and run the "
    "model, are descendants of the worker). While it "
    "loads the model and generates, the benchmark samples the resident set (psutil memory_info().rss) "
    "of the worker and every descendant every {interval} ms and sums it; the figure is the peak of "
    "that sum. Processes seen in fewer than " + str(TRANSIENT_SAMPLES) + " samples (a shell vLLM runs for "
    "lscpu, a fork caught before its exec, whose RSS is its parent's pages counted again) are left out "
    "of the sums and listed apart. Summed RSS counts pages shared between processes (libraries, torch) "
    "once per process: "
    "the same for both configurations, so their difference is meaningful, their absolute values "
    "overstate unique memory. A sample can miss a spike shorter than the interval; the sum of the "
    "kernel's per-process high-water marks (VmHWM) of the same processes is given beside it as an upper "
    "bound. Plain vLLM "
    "and the plan ({plan}) are started in alternating order, {repeats} time(s) each, on the same "
    "model and engine arguments; prompts are random token ids (no tokenizer)."
)
SHOWS = (
    "What it shows: host RAM the plan's mechanism adds to an engine (a second copy of the embedding, "
    "staging buffers, wrappers, the report), at load and during a short generate, with the noise "
    "between identical engines beside it. What it does not show: page-locked memory. The CPU build "
    "has none (no CUDA: the pin policy is pageable), so the rounding of torch's pinned blocks and the "
    "exact registration the project does on CUDA are not exercised here "
    "(benchmarks/mechanism/ measures those); nor does it show device memory saved, "
    "which needs a GPU."
)


# --------------------------------------------------------------------------- worker


def worker(spec_path: Path) -> int:
    """One engine: load, a short generate, timestamps for the sampler, then exit."""
    return engine_worker(spec_path, _measure, t_worker_start=time.time())


def _measure(spec: dict, out: dict) -> None:
    from vllm import LLM, SamplingParams

    out["t_load_start"] = time.time()
    llm = LLM(model=spec["model"], **spec["engine_args"])
    out["t_loaded"] = time.time()
    params = SamplingParams(max_tokens=spec["max_tokens"], temperature=0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in spec["prompts"]], params, use_tqdm=False)
    out["t_generated"] = time.time()
    out["generated_tokens"] = sum(len(o.outputs[0].token_ids) for o in outputs)
    out["first_tokens"] = [list(o.outputs[0].token_ids[:8]) for o in outputs]
    try:
        out["engine_dtype"] = str(llm.llm_engine.model_config.dtype).replace("torch.", "")
    except AttributeError:
        out["engine_dtype"] = None
    if spec.get("plan_path"):
        import selective_offload

        report = selective_offload.landing_report()
        out["report"] = {"ok": report.ok, "problems": report.problems,
                         "landed_cold_on_host_bytes": report.landed_cold_on_host_bytes,
                         "host_memory": report.host_memory}


# --------------------------------------------------------------------------- an engine, sampled


def run_engine(spec: dict, workdir: Path, interval_s: float, timeout_s: float, env: dict) -> dict:
    name = spec["name"]
    spec_path, log_path = worker_files(spec, workdir)
    print(f"[{name}] starting an engine ...", flush=True)
    t0 = time.time()
    with log_path.open("w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "benchmarks.host_memory", "--worker", str(spec_path)], env=module_env(env),
                                stdout=log, stderr=subprocess.STDOUT)
        try:
            sampled = sample_tree(proc, interval_s, timeout_s)
        except TimeoutError as err:
            proc.wait()
            return {"name": name, "status": "failed", "error": f"{err} (log: {log_path})"}
    result = worker_result(spec, log_path)
    result["name"] = name
    if result["status"] != "measured":
        print(f"[{name}] failed: {result.get('error')}", flush=True)
        return result
    samples = sampled["samples"]

    def peak(until: float | None = None, since: float | None = None) -> int | None:
        vals = [b for t, b in samples if (until is None or t <= until) and (since is None or t >= since)]
        return max(vals) if vals else None

    loaded = [b for t, b in samples if t <= result["t_loaded"]]
    result.update({
        "peak_rss_bytes": peak(),
        "peak_rss_load_bytes": peak(until=result["t_loaded"]),
        "peak_rss_generate_bytes": peak(since=result["t_loaded"], until=result["t_generated"]),
        "rss_loaded_bytes": loaded[-1] if loaded else None,
        # The kernel's counters are approximate (per-CPU batches): VmHWM can read a few hundred
        # KB under a sampled RSS, so each process counts the larger of the two.
        "hwm_sum_bytes": sum(max(p["hwm_bytes"] or 0, p["peak_rss_bytes"])
                             for p in sampled["per_process"].values() if not p["transient"]),
        "processes": [{"pid": pid, **rec} for pid, rec in sampled["per_process"].items()],
        "samples": len(samples),
        "sample_interval_ms": ((samples[-1][0] - samples[0][0]) / (len(samples) - 1) * 1e3
                               if len(samples) > 1 else None),
        "sample_cost_ms": sampled["sample_cost_ms"],
        "load_s": result["t_loaded"] - result["t_load_start"],
        "wall_s": time.time() - t0,
    })
    print(f"[{name}] peak {result['peak_rss_bytes'] / 1e6:.0f} MB (load {result['peak_rss_load_bytes'] / 1e6:.0f}, "
          f"generate {result['peak_rss_generate_bytes'] / 1e6:.0f}), {len(samples)} samples, "
          f"{result['wall_s']:.0f} s", flush=True)
    return result


# --------------------------------------------------------------------------- model


def build_model(directory: Path, model_cfg: dict, seed: int = 0) -> Path:
    """A random Qwen3 (untied, bf16) saved with save_pretrained; reused when it is there."""
    marker = directory / "bench-model.json"
    if marker.is_file() and json.loads(marker.read_text()) == model_cfg and (directory / "config.json").is_file():
        return directory
    from transformers.utils import logging as hf_logging

    from selective_offload.vllm_glue.demo_engine import save_tiny_qwen3

    hf_logging.disable_progress_bar()
    print(f"building a random Qwen3 {model_cfg} in {directory}", flush=True)
    save_tiny_qwen3(directory, seed, **model_cfg, max_position_embeddings=512)
    marker.write_text(json.dumps(model_cfg))
    return directory


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3, help="engines per configuration, in alternating order")
    ap.add_argument("--dtype", default="bfloat16", help="engine dtype (default bfloat16)")
    ap.add_argument("--max-tokens", type=int, default=16, help="tokens generated per prompt")
    ap.add_argument("--prompts", type=int, default=4, help="prompts in the generate")
    ap.add_argument("--interval-ms", type=float, default=20.0, help="RSS sampling interval")
    ap.add_argument("--cpu-threads", type=int, default=1,
                    help="OMP_NUM_THREADS for each engine on the CPU build (default 1, as the e2e suite)")
    ap.add_argument("--smoke", action="store_true", help="a tiny model, 1 repetition, 4 tokens")
    ap.add_argument("--workdir", type=Path, help="where the model, plan and worker logs go (default: a new temp dir)")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR)
    ap.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    return worker_or_run(ap.parse_args(argv), worker, run)


def run(args) -> int:
    repeats, max_tokens = (1, 4) if args.smoke else (args.repeats, args.max_tokens)
    if min(repeats, max_tokens, args.prompts, args.cpu_threads) < 1 or args.interval_ms <= 0:
        raise BenchError("--repeats, --max-tokens, --prompts, --cpu-threads and --interval-ms must be positive")
    try:
        import psutil  # noqa: F401
    except ImportError:
        raise BenchError("psutil is needed to sample the engine's processes (pip install psutil)") from None

    import torch

    from selective_offload.checkpoint import load_checkpoint
    from selective_offload.planner import PlanInputs, make_plan

    started, load_before = time.perf_counter(), load_1min()
    cuda = torch.cuda.is_available()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench-host-memory-"))
    workdir.mkdir(parents=True, exist_ok=True)
    model_cfg = SMOKE_MODEL if args.smoke else FULL_MODEL
    model = build_model(workdir / ("model-smoke" if args.smoke else "model"), model_cfg)
    ckpt = load_checkpoint(model)
    plan = make_plan(ckpt, PlanInputs(device_memory_bytes=ckpt.total_bytes - 1000, kv_cache_bytes=0,
                                      reserve_bytes=0))
    if plan.strategy != "cold_offload" or plan.hot_layer_indices:
        raise BenchError(f"expected a cold-only plan for the built model, got {plan.strategy} "
                         f"(hot layers {plan.hot_layer_indices})")
    plan_path = workdir / "cold.plan.json"
    plan.save(plan_path)
    embedding_ckpt_bytes = plan.cold_on_host_bytes

    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, model_cfg["vocab_size"] - 10, (args.prompts, 16), generator=gen).tolist()
    engine_args = dict(skip_tokenizer_init=True, max_model_len=128, max_num_seqs=8, max_num_batched_tokens=128,
                       enforce_eager=not cuda, seed=0, dtype=args.dtype, enable_prefix_caching=False,
                       kv_cache_memory_bytes=64 << 20)
    if cuda:
        engine_args["gpu_memory_utilization"] = 0.5
    env = {k: v for k, v in os.environ.items() if not k.startswith("SELECTIVE_OFFLOAD_")}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # vLLM's default: the engine core in its own process
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if not cuda:
        env["OMP_NUM_THREADS"] = str(args.cpu_threads)
    timeout_s = 600 if args.smoke else 1200
    specs = {
        "plain": {"config": "plain", "model": str(model), "engine_args": engine_args, "prompts": prompts,
                  "max_tokens": max_tokens},
        "selective": {"config": "selective", "model": str(model), "engine_args": engine_args, "prompts": prompts,
                      "max_tokens": max_tokens, "plan_path": str(plan_path),
                      "report_path": str(workdir / "selective.report.json")},
    }
    runs: dict[str, list[dict]] = {c: [] for c in CONFIGS}
    order: list[list[str]] = []
    for r in range(repeats):
        names = list(CONFIGS) if r % 2 == 0 else list(reversed(CONFIGS))
        order.append(names)
        for name in names:
            spec = {**specs[name], "name": f"{name}.r{r + 1}"}
            runs[name].append(run_engine(spec, workdir, args.interval_ms / 1e3, timeout_s, env))

    configs = []
    for name in CONFIGS:
        ok = [x for x in runs[name] if x["status"] == "measured"]
        rec = {"name": name, "status": "measured" if len(ok) == len(runs[name]) else "failed",
               "errors": [x.get("error") for x in runs[name] if x["status"] != "measured"],
               "runs": runs[name]}
        for key in ("peak_rss_bytes", "peak_rss_load_bytes", "peak_rss_generate_bytes", "rss_loaded_bytes",
                    "hwm_sum_bytes", "load_s"):
            rec[key] = spread(x.get(key) for x in ok)
        configs.append(rec)
    by = {c["name"]: c for c in configs}
    measured = all(c["status"] == "measured" for c in configs)
    engine_dtype = next((x.get("engine_dtype") for c in configs for x in c["runs"] if x.get("engine_dtype")), None)
    elem = {"bfloat16": 2, "float16": 2, "float32": 4}.get(engine_dtype or "", 2)
    embedding_engine_bytes = embedding_ckpt_bytes // 2 * elem  # the checkpoint is bf16
    comparison = {}
    if measured:
        for key in ("peak_rss_bytes", "peak_rss_load_bytes", "peak_rss_generate_bytes", "rss_loaded_bytes",
                    "hwm_sum_bytes"):
            sel, plain = by["selective"][key]["median"], by["plain"][key]["median"]
            comparison[key] = {"ratio": sel / plain, "difference_bytes": sel - plain,
                               "difference_over_embedding": (sel - plain) / embedding_engine_bytes}
        pairs = [s["peak_rss_bytes"] / p["peak_rss_bytes"]
                 for s, p in zip(by["selective"]["runs"], by["plain"]["runs"])]
        comparison["paired_peak_ratio"] = spread(pairs)
        plain_peaks = [x["peak_rss_bytes"] for x in by["plain"]["runs"]]
        sel_peaks = [x["peak_rss_bytes"] for x in by["selective"]["runs"]]
        comparison["noise_bytes"] = {"plain_max_minus_min": max(plain_peaks) - min(plain_peaks),
                                     "selective_max_minus_min": max(sel_peaks) - min(sel_peaks)}
        comparison["by_process"] = by_process(by)
        tokens = {json.dumps(x["first_tokens"]) for c in configs for x in c["runs"]}
        comparison["same_tokens"] = len(tokens) == 1
    reports = [x.get("report") for x in by["selective"]["runs"] if x.get("report")]
    result = {
        "benchmark": "host-memory", "date": today(), "machine": machine(), "cuda": cuda,
        "device": torch.cuda.get_device_name() if cuda else None,
        "vllm": vllm_version(), "torch": torch.__version__, "smoke": args.smoke,
        "model": {"path": str(model), "config": model_cfg, "checkpoint_bytes": ckpt.total_bytes,
                  "checkpoint_dtype": "bfloat16", "embedding_checkpoint_bytes": embedding_ckpt_bytes,
                  "embedding_engine_bytes": embedding_engine_bytes, "engine_dtype": engine_dtype,
                  "tied": False},
        "plan": {"strategy": plan.strategy, "cold_on_host_bytes": plan.cold_on_host_bytes,
                 "cold_on_host_groups": plan.cold_on_host_groups},
        "engine_args": engine_args, "repeats": repeats, "order": order, "max_tokens": max_tokens,
        "prompts": args.prompts, "interval_ms": args.interval_ms,
        "cpu_threads": None if cuda else args.cpu_threads,
        "method": METHOD.format(interval=f"{args.interval_ms:g}", plan=f"{plan.strategy}, "
                                f"{embedding_ckpt_bytes / 1e6:.0f} MB of embedding on the host", repeats=repeats),
        "shows": SHOWS, "configs": configs, "comparison": comparison,
        "report": reports[-1] if reports else None,
        "wall_s": time.perf_counter() - started,
    }
    result["load_note"] = shared_note(load_before, load_1min())
    stem = result_stem("host-memory", cuda, result["machine"]) + ("-smoke" if args.smoke else "")
    paths = write_results(args.out, stem, result, markdown(result))
    print(markdown(result))
    print(f"wrote {paths[0]} and {paths[1]} (worker logs in {workdir})")
    if not measured:
        print(f"error: failed: {', '.join(c['name'] for c in configs if c['status'] != 'measured')}", file=sys.stderr)
        return 1
    return 0


def by_process(by: dict) -> list[dict]:
    """Median peak per process role (summed over processes of one role in an engine), plain
    against selective: where a difference lives (the process holding the model, or not)."""
    def roles(rec: dict) -> list[dict]:
        out = []
        for x in rec["runs"]:
            peaks: dict[str, int] = {}
            for p in x["processes"]:
                if not p["transient"]:
                    peaks[p["name"]] = peaks.get(p["name"], 0) + p["peak_rss_bytes"]
            out.append(peaks)
        return out

    plain, sel = roles(by["plain"]), roles(by["selective"])
    names = [n for n in dict.fromkeys(n for peaks in plain + sel for n in peaks)
             if all(n in peaks for peaks in plain + sel)]  # transient helpers (lscpu) left out
    rows = []
    for n in names:
        a = statistics.median(p[n] for p in plain)
        b = statistics.median(p[n] for p in sel)
        rows.append({"process": n, "plain_peak_bytes": a, "selective_peak_bytes": b, "difference_bytes": b - a})
    return rows
