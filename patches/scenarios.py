"""The integration scenarios, run either through the runtime extension or through a
patched vLLM with the extension switched off; prints a JSON summary to compare.

    python patches/scenarios.py extension OUT.json
    PYTHONPATH=/tmp/patched python patches/scenarios.py patched OUT.json

Each scenario builds a tiny random model (no download), plans it with every cold module
on the host (--all-cold), generates greedy tokens in an in-process engine, and records
where each planned cold group landed (the landing report's view) and the tokens:

- qwen3: a text model, its embedding on the host;
- idefics3: a vision-language model with image prompts, embedding and tower on the host;
- mimo_mtp: MiMo with MTP speculative decoding, its embedding on the host. Through the
  patch the run also records which of the drafter's modules the loader built as
  placeholders (meta device, not loaded) because the proposer replaces them with the
  target's, and whether the drafter ended up with the target's embedding and LM head.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from helpers import (  # noqa: E402
    ENGINE_ARGS,
    PROMPTS,
    all_cold_plan,
    generate_with_plan,
    save_tiny_idefics3,
    save_tiny_mimo_mtp,
    save_tiny_qwen3,
)

IMAGE_ARGS = dict(skip_tokenizer_init=False, limit_mm_per_prompt={"image": 1})
MTP_ARGS = dict(speculative_config={"method": "mtp", "num_speculative_tokens": 1})


def image_prompts():
    import numpy as np
    from PIL import Image

    def image(seed):
        return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (64, 64, 3), dtype=np.uint8))

    return [{"prompt": "<image> baba bebe bibi", "multi_modal_data": {"image": image(1)}},
            {"prompt": "mono nunu sasa tete"}]


def summarise(report) -> dict:
    from selective_offload.plan_format.vocabulary import COLD_SERVINGS

    return {g.group: [g.actual, g.host_bytes, g.device_bytes] for g in report.groups if g.planned in COLD_SERVINGS}


def plan_for(model: Path, engine_args):
    return all_cold_plan(model, speculative="mtp" if "speculative_config" in engine_args else None)


def run_extension(model: Path, prompts, engine_args) -> dict:
    tokens, report = generate_with_plan(plan_for(model, engine_args), model, prompts, **engine_args)
    return {"tokens": tokens, "cold": summarise(report), "ok": report.ok}


@contextlib.contextmanager
def drafter_placeholders():
    """Yields the names of the drafter modules TargetSharing.prepare puts on the meta
    device (the patch's own record of what it did not build or load)."""
    from vllm.model_executor.offloader.host_modules import TargetSharing

    names: list[str] = []
    prepare = TargetSharing.prepare

    def recording(self, model, router, device):
        replaced = prepare(self, model, router, device)
        ids = {id(m): n for n, m in model.named_modules()}
        names.extend(sorted(ids[id(m)] for m in replaced))
        return replaced

    TargetSharing.prepare = recording
    try:
        yield names
    finally:
        TargetSharing.prepare = prepare


def run_patched(model: Path, prompts, engine_args) -> dict:
    import gc

    import torch
    from vllm import LLM, SamplingParams

    from selective_offload.names import cold_segment
    from selective_offload.report import build_report

    plan = plan_for(model, engine_args)
    segments = sorted({cold_segment(g, plan.inputs.cold_segments) for g in plan.cold_on_host_groups})
    with drafter_placeholders() as placeholders:
        llm = LLM(model=str(model), offload_host_modules=set(segments), **{**ENGINE_ARGS, **engine_args})
    try:
        requests = [p if isinstance(p, dict) else {"prompt_token_ids": p} for p in prompts]
        params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
        tokens = [list(o.outputs[0].token_ids) for o in llm.generate(requests, params, use_tqdm=False)]
        engine = llm.llm_engine.engine_core.engine_core
        runner = engine.model_executor.driver_worker.worker.model_runner
        net = runner.model
        drafter = getattr(getattr(runner, "drafter", None), "model", None)
        host = {id(p) for p in net.parameters() if getattr(p, "_vllm_host_module", False)}
        report = build_report(net, plan, compute_device=torch.device("cpu"), cold_on_host_params=host,
                              prefetch_params=set(), drafter=drafter,
                              drafter_expected=drafter is not None)
        result = {"tokens": tokens, "cold": summarise(report), "ok": report.ok}
        if drafter is not None:
            result["drafter_placeholders"] = placeholders
            result["drafter_shares"] = (drafter.model.embed_tokens is net.model.embed_tokens
                                        and drafter.lm_head is net.lm_head)
            result["drafter_meta"] = sorted(n for n, p in drafter.named_parameters() if p.is_meta)
    finally:
        del llm
        gc.collect()
    return result


def main() -> int:
    mode, out = sys.argv[1], Path(sys.argv[2])
    import vllm

    if mode == "patched" and "OffloadConfig" not in open(Path(vllm.__file__).parent / "config/offload.py").read():
        raise SystemExit("this vLLM has no offload config")
    run = run_extension if mode == "extension" else run_patched
    results = {"vllm": vllm.__file__}
    with tempfile.TemporaryDirectory() as tmp:
        qwen = save_tiny_qwen3(Path(tmp) / "qwen3", seed=7)
        idefics = save_tiny_idefics3(Path(tmp) / "idefics3", seed=8)
        results["qwen3"] = run(qwen, PROMPTS, {})
        results["idefics3"] = run(idefics, image_prompts(), IMAGE_ARGS)
        mimo = save_tiny_mimo_mtp(Path(tmp) / "mimo", seed=4)
        results["mimo_mtp"] = run(mimo, PROMPTS, MTP_ARGS)
    out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
