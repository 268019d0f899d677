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
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
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
