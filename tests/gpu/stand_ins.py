"""Torch stand-ins for the modules the GPU mechanism tests build: no vLLM is imported here.

Why a module of its own: the tests check what the glue does to vLLM's modules (routing
them to the host at construction, moving shared tensors back, onloading a tower on
demand) on a machine whose image has torch and no vLLM. These classes make the same
allocation calls, with the same sizes, and take a ``prefix`` as every vLLM layer does;
the bytes and where they land are the point, not what the modules compute.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# ---------------------------------------------------------------- a drafter (construction)


class EmbeddingLike(nn.Module):
    """Like vLLM's ``VocabParallelEmbedding``: an uninitialised (vocab, hidden) weight."""

    def __init__(self, vocab: int, hidden: int, prefix: str = "") -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab, hidden, dtype=torch.bfloat16),
                                   requires_grad=False)


class LMHeadLike(EmbeddingLike):
    """Like vLLM's ``ParallelLMHead``, a subclass of the embedding class."""


class LayerLike(nn.Module):
    """A plain layer built with a hot prefix: never routed."""

    def __init__(self, rows: int, cols: int, prefix: str = "") -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, cols, dtype=torch.bfloat16),
                                   requires_grad=False)


class DrafterLike(nn.Module):
    """An EAGLE-style drafter: its own embedding and LM head (vLLM replaces both by the
    target's after loading) and its own layer (an EAGLE ``fc``: 2 x hidden -> hidden)."""

    def __init__(self, vocab: int, hidden: int, prefix: str = "") -> None:
        super().__init__()
        self.embed_tokens = EmbeddingLike(vocab, hidden, prefix="model.embed_tokens")
        self.fc = LayerLike(hidden, 2 * hidden, prefix="model.fc")
        # "lm_head" is never cold by prefix; the drafter's is routed by class (force).
        self.lm_head = LMHeadLike(vocab, hidden, prefix="lm_head")


# ---------------------------------------------------------------- a cold module among shared caches

# Module-global caches, as vLLM's rotary-embedding cache (``_ROPE_DICT``) and FlashInfer's
# ViT workspace are: whoever asks first builds the entry, everyone after shares it.
ROPE_CACHE: dict = {}
WORKSPACE: list = []
GLOBAL_TABLES: dict = {}


class RotaryLike(nn.Module):
    def __init__(self, max_positions: int, rotary_dim: int) -> None:
        super().__init__()
        self.register_buffer("cos_sin_cache", torch.ones(max_positions, rotary_dim),
                             persistent=False)


def get_rope(max_positions: int, rotary_dim: int) -> RotaryLike:
    key = (max_positions, rotary_dim)
    if key not in ROPE_CACHE:
        ROPE_CACHE[key] = RotaryLike(max_positions, rotary_dim)
    return ROPE_CACHE[key]


class VisionBlockLike(nn.Module):
    """A cold module: its own weight (routed to the host), a workspace allocated with an
    explicit device (left alone), a rotary module from the process-wide cache (built here
    first, so routed, then shared with the language model), and a table that only a
    module-global cache holds (not a parameter, buffer or attribute of any module)."""

    def __init__(self, cfg: dict, workspace_device: torch.device, prefix: str = "") -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg["cold_rows"], cfg["cold_cols"],
                                               dtype=torch.bfloat16), requires_grad=False)
        if not WORKSPACE:
            WORKSPACE.append(torch.zeros(cfg["workspace_bytes"], dtype=torch.uint8,
                                          device=workspace_device))
        self.rotary = get_rope(cfg["rope_positions"], cfg["rope_dim"])
        GLOBAL_TABLES["table"] = torch.arange(cfg["table_elems"], dtype=torch.float32)


class LanguageLayerLike(nn.Module):
    def __init__(self, cfg: dict, prefix: str = "") -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg["hot_rows"], cfg["hot_cols"],
                                               dtype=torch.bfloat16), requires_grad=False)
        self.rotary = get_rope(cfg["rope_positions"], cfg["rope_dim"])  # cached: shared


class SharedModel(nn.Module):
    def __init__(self, cfg: dict, workspace_device: torch.device) -> None:
        super().__init__()
        self.visual = VisionBlockLike(cfg, workspace_device, prefix="visual.blocks.0")
        self.layer = LanguageLayerLike(cfg, prefix="model.layers.0")


# ---------------------------------------------------------------- a vision tower, and vLLM's layer stack


class Block(nn.Module):
    """A ViT-like block: attention projections and an MLP (the bytes are what matters)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.norm2 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class Tower(nn.Module):
    def __init__(self, hidden: int, depth: int) -> None:
        super().__init__()
        self.patch_embed = nn.Linear(hidden, hidden)
        self.blocks = nn.ModuleList(Block(hidden) for _ in range(depth))
        self.norm = nn.LayerNorm(hidden)

    def forward(self, x):
        x = self.patch_embed(x)
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


def make_layers(num_hidden_layers: int, prefix: str, offloader, build) -> list:
    """The shape of vLLM's make_layers (the glue's offloader reads these locals)."""
    start_layer, end_layer = 0, num_hidden_layers
    return offloader.wrap_modules(build(i) for i in range(start_layer, end_layer))
