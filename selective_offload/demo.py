"""``selective-offload demo``: a tiny model through vLLM with a plan applied, end to end.

Builds (once, from a fixed seed) a 4-layer random Qwen3 with hidden size 256 and a small
word-level tokenizer made here, plans it for a device budget just short of its size (so
the embedding must go to the host), starts a vLLM engine with the plan enabled - the
engine core and worker are spawned processes, so this exercises the plugin path - and
prints the plan, the landing report and the generated text; then does the same with
plain vLLM and says whether the outputs are identical. Nothing is downloaded. The model's
weights are random, so the words it writes are random too.

An application of the public API (:func:`~selective_offload.api.enable`), above it; the
tiny model and the engine are :mod:`.vllm_glue.demo_engine`'s.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

DEMO_PROMPTS = ["baba bebe bibi bobo", "daka deke diki", "mono nunu sasa tete vivi"]
#: What the demo shows of other libraries' logs: errors only. vLLM's start-up warnings on
#: the CPU build (no Triton, no tcmalloc, eager mode) say nothing about the plan; the demo
#: prints its own progress, the plan and the report. Set before vLLM is imported; the
#: engine processes inherit them; a variable the user set wins.
QUIET_ENV = {
    "VLLM_LOGGING_LEVEL": "ERROR",
    "TORCH_CPP_LOG_LEVEL": "ERROR",
    "PYTHONWARNINGS": "ignore::FutureWarning",
    "TRANSFORMERS_VERBOSITY": "error",
}


def run(workdir: Path, compare: bool = True) -> int:
    from . import api
    from .checkpoint import load_checkpoint
    from .planner import PlanInputs, make_plan
    from .render import Shown, render_plan
    from .report import LandingReport
    from .vllm_glue.demo_engine import build_tiny_model, generate

    model = build_tiny_model(workdir / "tiny-qwen3")
    checkpoint = load_checkpoint(model)
    # Just short of the model: the largest cold module (the embedding) has to go.
    inputs = PlanInputs(device_memory_bytes=checkpoint.total_bytes - 1, kv_cache_bytes=0, reserve_bytes=0)
    plan = make_plan(checkpoint, inputs)
    print(f"== plan for {model} (a device budget 1 byte short of the model)")
    print(render_plan(plan, checkpoint, shown=Shown(label="the demo's tiny Qwen3")))
    print()
    report_path = workdir / "report.json"
    api.enable(plan, strict=True, report_path=report_path)
    try:
        selective = generate(model, "selective-offload", DEMO_PROMPTS)
    finally:
        api.disable()
    print("\n== landing report (from the engine's worker process)")
    print(LandingReport.load(report_path).render())
    print("\n== generated text (greedy, 12 words each; the model's weights are random)")
    for prompt, text in zip(DEMO_PROMPTS, selective):
        print(f"  {prompt!r} -> {text.strip()!r}")
    if not compare:
        return 0
    plain = generate(model, "plain", DEMO_PROMPTS)
    same = plain == selective
    print(f"\noutputs identical to plain vLLM: {'yes' if same else 'NO'}")
    return 0 if same else 1


def main(workdir: str | os.PathLike | None = None, compare: bool = True) -> int:
    for name, value in QUIET_ENV.items():
        os.environ.setdefault(name, value)
    warnings.filterwarnings("ignore", category=FutureWarning)
    directory = Path(workdir or Path.home() / ".cache" / "selective-offload" / "demo")
    directory.mkdir(parents=True, exist_ok=True)
    return run(directory, compare)


if __name__ == "__main__":
    sys.exit(main())
