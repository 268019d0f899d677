"""Write the bundled manifest shaped like Qwen3.8-27B-FP8 (its measured facts: docs/design/reference-measurements.md).

The real checkpoint is 30.89 GB: 64 decoder layers of about 0.38 GB (FP8 weights with
block scales), ``lm_head`` and ``model.embed_tokens`` of 248320 x 5120 BF16 (2.543 GB
each), a 0.922 GB vision tower and a 0.478 GB MTP head. The shapes below are chosen so the
byte totals of each group match those figures to within 0.5%; the exact per-tensor shapes
of the real model are not public to us and do not matter for a bandwidth plan.

Run: python scripts/make_reference_manifest.py  (rewrites selective_offload/data/...)
"""

from __future__ import annotations

import json
import math
from pathlib import Path

HIDDEN, VOCAB, LAYERS, INTER = 5120, 248320, 64, 17920
HEADS, KV_HEADS, HEAD_DIM = 24, 4, 256
V_HIDDEN, V_INTER, V_BLOCKS, PATCH = 1280, 3296, 27, 16 * 16 * 3 * 2
MTP_INTER = 17408

tensors: dict[str, dict] = {}


def add(name: str, shape: list[int], dtype: str = "BF16") -> None:
    tensors[name] = {"dtype": dtype, "shape": shape}


def fp8_linear(prefix: str, out_f: int, in_f: int) -> None:
    add(f"{prefix}.weight", [out_f, in_f], "F8_E4M3")
    add(f"{prefix}.weight_scale_inv", [math.ceil(out_f / 128), math.ceil(in_f / 128)], "F32")


def decoder_layer(prefix: str, inter: int = INTER) -> None:
    add(f"{prefix}.input_layernorm.weight", [HIDDEN])
    add(f"{prefix}.post_attention_layernorm.weight", [HIDDEN])
    # Gated attention: q_proj carries the query and its gate.
    fp8_linear(f"{prefix}.self_attn.q_proj", 2 * HEADS * HEAD_DIM, HIDDEN)
    fp8_linear(f"{prefix}.self_attn.k_proj", KV_HEADS * HEAD_DIM, HIDDEN)
    fp8_linear(f"{prefix}.self_attn.v_proj", KV_HEADS * HEAD_DIM, HIDDEN)
    fp8_linear(f"{prefix}.self_attn.o_proj", HIDDEN, HEADS * HEAD_DIM)
    add(f"{prefix}.self_attn.q_norm.weight", [HEAD_DIM])
    add(f"{prefix}.self_attn.k_norm.weight", [HEAD_DIM])
    add(f"{prefix}.self_attn.head_gate.weight", [104, HIDDEN])
    fp8_linear(f"{prefix}.mlp.gate_proj", inter, HIDDEN)
    fp8_linear(f"{prefix}.mlp.up_proj", inter, HIDDEN)
    fp8_linear(f"{prefix}.mlp.down_proj", HIDDEN, inter)


add("model.embed_tokens.weight", [VOCAB, HIDDEN])
for i in range(LAYERS):
    decoder_layer(f"model.layers.{i}")
add("model.norm.weight", [HIDDEN])
add("lm_head.weight", [VOCAB, HIDDEN])

# Vision tower, BF16 (towers are usually left unquantized).
add("model.visual.patch_embed.proj.weight", [V_HIDDEN, PATCH])
add("model.visual.pos_embed.weight", [2304, V_HIDDEN])
for b in range(V_BLOCKS):
    p = f"model.visual.blocks.{b}"
    add(f"{p}.norm1.weight", [V_HIDDEN]); add(f"{p}.norm1.bias", [V_HIDDEN])
    add(f"{p}.norm2.weight", [V_HIDDEN]); add(f"{p}.norm2.bias", [V_HIDDEN])
    add(f"{p}.attn.qkv.weight", [3 * V_HIDDEN, V_HIDDEN]); add(f"{p}.attn.qkv.bias", [3 * V_HIDDEN])
    add(f"{p}.attn.proj.weight", [V_HIDDEN, V_HIDDEN]); add(f"{p}.attn.proj.bias", [V_HIDDEN])
    add(f"{p}.mlp.linear_fc1.weight", [V_INTER, V_HIDDEN]); add(f"{p}.mlp.linear_fc1.bias", [V_INTER])
    add(f"{p}.mlp.linear_fc2.weight", [V_HIDDEN, V_INTER]); add(f"{p}.mlp.linear_fc2.bias", [V_HIDDEN])
add("model.visual.merger.norm.weight", [V_HIDDEN * 4])
add("model.visual.merger.linear_fc1.weight", [V_HIDDEN * 4, V_HIDDEN * 4])
add("model.visual.merger.linear_fc2.weight", [HIDDEN, V_HIDDEN * 4])

# MTP head: one FP8 decoder layer plus its BF16 fusion projection and norms.
add("mtp.fc.weight", [HIDDEN, 2 * HIDDEN])
add("mtp.pre_fc_norm_embedding.weight", [HIDDEN])
add("mtp.pre_fc_norm_hidden.weight", [HIDDEN])
add("mtp.norm.weight", [HIDDEN])
decoder_layer("mtp.layers.0", MTP_INTER)

config = {
    "architectures": ["Qwen3_8ForConditionalGeneration"],
    "model_type": "qwen3_8",
    "tie_word_embeddings": False,
    "text_config": {
        "hidden_size": HIDDEN, "num_hidden_layers": LAYERS, "vocab_size": VOCAB,
        "intermediate_size": INTER, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
        "mtp_num_hidden_layers": 1, "tie_word_embeddings": False,
    },
    "vision_config": {"hidden_size": V_HIDDEN, "depth": V_BLOCKS},
    "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]},
    "torch_dtype": "bfloat16",
}
manifest = {
    "format": "selective-offload/manifest-v1",
    "source": "bundled: Qwen3.8-27B-FP8 (shape-alike, byte totals from docs/design/reference-measurements.md)",
    "kind": "manifest",
    "config": config,
    "tensors": tensors,
}
out = Path(__file__).resolve().parent.parent / "selective_offload/data/qwen3.8-27b-fp8.manifest.json"
out.write_text(json.dumps(manifest, separators=(",", ":")) + "\n")
print(f"wrote {out} ({len(tensors)} tensors)")
