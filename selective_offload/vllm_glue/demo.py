"""``selective-offload demo``: a tiny model through vLLM with a plan applied, end to end.

Builds (once, from a fixed seed) a 4-layer random Qwen3 with hidden size 256 and a small
word-level tokenizer made here, plans it for a device budget just short of its size (so
the embedding must go to the host), starts a vLLM engine with the plan enabled - the
engine core and worker are spawned processes, so this exercises the plugin path - and
prints the plan, the placement report and the generated text; then does the same with
plain vLLM and says whether the outputs are identical. Nothing is downloaded. The model's
weights are random, so the words it writes are random too.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

from ..progress import progress as _progress

DEMO_PROMPTS = ["baba bebe bibi bobo", "daka deke diki", "mono nunu sasa tete vivi"]
# An explicit KV cache size: vLLM's CPU build otherwise sizes it as a share of the node's
# memory minus the process's RSS, which grows with each engine one process starts.
ENGINE_ARGS = dict(skip_tokenizer_init=True, kv_cache_memory_bytes=64 << 20, max_model_len=256,
                   enforce_eager=True, dtype="float32", seed=0)
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
_SYLLABLES = [c + v for c in "bdfghklmnprstvz" for v in "aeiou"]


def word_tokenizer(vocab_size: int, specials: list[str] | None = None):
    """A word-level tokenizer of ``vocab_size`` entries built here: the special tokens, a
    newline, then made-up words (``baba``, ``babe``, ...) split on whitespace."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = specials or ["<pad>", "<eos>", "<bos>", "<unk>"]
    words = [a + b for a in _SYLLABLES for b in _SYLLABLES]
    vocab = specials + ["\n"] + words[: vocab_size - len(specials) - 1]
    backend = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(vocab)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>",
                                   pad_token="<pad>", unk_token="<unk>")


def save_tiny_qwen3(directory: Path, seed: int = 0, *, tokenizer: bool = False, **overrides) -> Path:
    """A random 4-layer Qwen3 (hidden 256, vocab 1024, untied unless ``overrides`` say
    otherwise), saved with save_pretrained in bf16, with a word tokenizer when asked.
    The tests build theirs with this too."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                  max_position_embeddings=256, tie_word_embeddings=False)
    if tokenizer:
        config.update(bos_token_id=2, eos_token_id=1, pad_token_id=0)  # the word tokenizer's ids
    config.update(overrides)
    torch.manual_seed(seed)
    Qwen3ForCausalLM(Qwen3Config(**config)).to(torch.bfloat16).save_pretrained(directory)
    if tokenizer:
        word_tokenizer(config["vocab_size"]).save_pretrained(directory)
    return directory


def build_tiny_model(directory: Path) -> Path:
    """The demo's tiny Qwen3 (seed 0) with its tokenizer, built once and reused."""
    from transformers.utils import logging as hf_logging

    if (directory / "model.safetensors").is_file() and (directory / "tokenizer.json").is_file():
        return directory
    print(f"building a tiny random Qwen3 and its tokenizer in {directory} (once)", flush=True)
    hf_logging.disable_progress_bar()
    return save_tiny_qwen3(directory, tokenizer=True)


def progress(what: str, every_s: float = 10.0):
    """A line every ``every_s`` seconds while ``what`` runs (the CLI's long reads use the same)."""
    return _progress(what, every_s=every_s, note="vLLM start-up takes tens of seconds on 2 CPU cores")


def generate(model: Path, label: str) -> list[str]:
    import gc

    from vllm import LLM, SamplingParams

    with progress(f"starting the {label} vLLM engine"):
        llm = LLM(model=str(model), **{**ENGINE_ARGS, "skip_tokenizer_init": False, "use_tqdm_on_load": False})
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outputs = llm.generate(DEMO_PROMPTS, params, use_tqdm=False)
    texts = [o.outputs[0].text for o in outputs]
    del llm
    gc.collect()
    return texts


def run(workdir: Path, compare: bool = True) -> int:
    from .. import api
    from ..checkpoint import load_checkpoint
    from ..planner import PlanInputs, make_plan
    from ..render import Shown, render_plan
    from ..report import PlacementReport

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
        selective = generate(model, "selective-offload")
    finally:
        api.disable()
    print("\n== placement report (from the engine's worker process)")
    print(PlacementReport.load(report_path).render())
    print("\n== generated text (greedy, 12 words each; the model's weights are random)")
    for prompt, text in zip(DEMO_PROMPTS, selective):
        print(f"  {prompt!r} -> {text.strip()!r}")
    if not compare:
        return 0
    plain = generate(model, "plain")
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
