"""The demo's tiny model and engine (:mod:`selective_offload.demo` is the demo): a random
Qwen3 with a word tokenizer made here (the engine tests build theirs with it too), and a
vLLM engine started on it to generate greedily, with the engine arguments the engine tests
start theirs with. The tokenizer needs the ``tokenizers`` library, which vLLM brings."""

from __future__ import annotations

from pathlib import Path

from ..progress import progress as _progress

# An explicit KV cache size: vLLM's CPU build otherwise sizes it as a share of the node's
# memory minus the process's RSS, which grows with each engine one process starts.
ENGINE_ARGS = dict(skip_tokenizer_init=True, kv_cache_memory_bytes=64 << 20, max_model_len=256,
                   enforce_eager=True, dtype="float32", seed=0)


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


def generate(model: Path, label: str, prompts: list[str]) -> list[str]:
    """Greedy, 12 tokens per prompt, from a fresh engine on ``model`` (freed before it returns)."""
    import gc

    from vllm import LLM, SamplingParams

    with progress(f"starting the {label} vLLM engine"):
        llm = LLM(model=str(model), **{**ENGINE_ARGS, "skip_tokenizer_init": False, "use_tqdm_on_load": False})
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    texts = [o.outputs[0].text for o in outputs]
    del llm
    gc.collect()
    return texts
