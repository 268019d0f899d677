"""One engine of the end-to-end benchmark, measured in its own process, and the pooling of
a configuration's engines into one record.

Why a module of its own: ``python -m benchmarks.e2e --worker SPEC`` runs :func:`worker` in a fresh
process per engine (so memory figures and patches never leak between configurations); it
caps the device, starts ``vllm.LLM`` (the plan enabled, where it has one), times ``generate`` and
writes one JSON record. :func:`merge_rounds` pools the records of a configuration's
engines (rounds) on the parent's side. vLLM is imported only inside the worker.
"""

from __future__ import annotations

import time
from pathlib import Path

from benchmarks.common import engine_worker, proc_status_bytes, spread


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
    return engine_worker(spec_path, _measure)


def _measure(spec: dict, out: dict) -> None:
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
    from vllm import LLM

    t0 = time.perf_counter()
    llm = LLM(model=spec["model"], **spec["engine_args"])
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
        out["host_rss_bytes"] = proc_status_bytes("VmRSS")
        out["host_rss_peak_bytes"] = proc_status_bytes("VmHWM")
    if spec.get("plan_path"):
        import selective_offload

        report = selective_offload.landing_report()
        out["report"] = {"ok": report.ok, "landed_cold_on_host_bytes": report.landed_cold_on_host_bytes,
                         "landed_prefetch_bytes": report.landed_prefetch_bytes, "problems": report.problems}


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
