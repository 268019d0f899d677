"""``selective-offload demo``: a tiny model through vLLM with a plan applied, end to end.

Builds (once, from a fixed seed) a 4-layer random Qwen3 with hidden size 256, plans it for
a device budget just short of its size (so the embedding must go to the host), starts a
vLLM engine with the plan enabled - the engine core and worker are spawned processes, so
this exercises the plugin path - and prints the plan, the placement report and the
generated token ids; then does the same with plain vLLM and says whether the tokens are
identical. Nothing is downloaded.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

DEMO_PROMPTS = [[1, 2, 3, 4], [5, 6, 7], [900, 17, 256, 3, 3, 80]]
# An explicit KV cache size: vLLM's CPU build otherwise sizes it as a share of the node's
# memory minus the process's RSS, which grows with each engine one process starts.
ENGINE_ARGS = dict(skip_tokenizer_init=True, kv_cache_memory_bytes=64 << 20, max_model_len=256,
                   enforce_eager=True, dtype="float32", seed=0)


def save_tiny_qwen3(directory: Path, seed: int = 0, **overrides) -> Path:
    """A random 4-layer Qwen3 (hidden 256, vocab 1024, untied unless ``overrides`` say
    otherwise), saved with save_pretrained in bf16. The tests build theirs with this too."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                  max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(seed)
    Qwen3ForCausalLM(Qwen3Config(**{**config, **overrides})).to(torch.bfloat16).save_pretrained(directory)
    return directory


def build_tiny_model(directory: Path) -> Path:
    """The demo's tiny Qwen3 (seed 0), built once and reused."""
    if (directory / "model.safetensors").is_file():
        return directory
    return save_tiny_qwen3(directory)


@contextmanager
def progress(what: str, every_s: float = 10.0):
    """Print a line every ``every_s`` seconds while ``what`` runs."""
    done = threading.Event()
    started = time.monotonic()

    def tick() -> None:
        while not done.wait(every_s):
            print(f"  ... {what}: {time.monotonic() - started:.0f} s", flush=True)

    thread = threading.Thread(target=tick, daemon=True)
    print(f"{what} (vLLM start-up takes 30-60 s on 2 CPU cores)", flush=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        print(f"{what}: done in {time.monotonic() - started:.0f} s", flush=True)


def generate(model: Path, label: str) -> list[list[int]]:
    import gc

    from vllm import LLM, SamplingParams

    with progress(f"starting the {label} vLLM engine"):
        llm = LLM(model=str(model), **ENGINE_ARGS)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in DEMO_PROMPTS], params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    del llm
    gc.collect()
    return tokens


def run(workdir: Path, compare: bool = True) -> int:
    from .. import api
    from ..checkpoint import load_checkpoint
    from ..cli import render_plan
    from ..planner import PlanInputs, make_plan

    model = build_tiny_model(workdir / "tiny-qwen3")
    checkpoint = load_checkpoint(model)
    # Just short of the model: the largest cold module (the embedding) has to go.
    inputs = PlanInputs(device_memory_bytes=checkpoint.total_bytes - 1, kv_cache_bytes=0, reserve_bytes=0)
    plan = make_plan(checkpoint, inputs)
    print(f"== plan for {model} (a device budget 1 byte short of the model)")
    print(render_plan(plan, checkpoint))
    print()
    report_path = workdir / "report.json"
    api.enable(plan, strict=True, report_path=report_path)
    try:
        selective = generate(model, "selective-offload")
    finally:
        api.disable()
    print("\n== placement report (from the engine's worker process)")
    from ..report import PlacementReport

    print(PlacementReport.load(report_path).render())
    print("\n== generated token ids (greedy, 16 each)")
    for prompt, tokens in zip(DEMO_PROMPTS, selective):
        print(f"  {prompt} -> {tokens}")
    if not compare:
        return 0
    plain = generate(model, "plain")
    same = plain == selective
    print(f"\ntokens identical to plain vLLM: {'yes' if same else 'NO'}")
    return 0 if same else 1


def main(workdir: str | os.PathLike | None = None, compare: bool = True) -> int:
    directory = Path(workdir or Path.home() / ".cache" / "selective-offload" / "demo")
    directory.mkdir(parents=True, exist_ok=True)
    return run(directory, compare)


if __name__ == "__main__":
    sys.exit(main())
