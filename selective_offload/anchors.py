"""Published llama.cpp decode rates of MoE models with their routed experts on the host CPU,
shown beside a plan of the same model on a card of the same size (never compared in a
test: another engine, another host, other formats).

Each anchor names the model by what a plan knows of it (its architecture, decoder layers and
routed experts per layer), the card size (GB as sold; ``None``: the figure is for the CPU
alone), the measured rate, the setup and its source as the source states them.
``benchmarks/planning/published.json`` holds the same figures under ``llama_cpp_anchors``
(tests/unit/planner/test_host_compute.py checks they agree).
"""

from __future__ import annotations

from dataclasses import dataclass

from .sizes import GiB


@dataclass(frozen=True)
class Anchor:
    model: str
    architecture: str
    num_hidden_layers: int
    num_experts: int
    card_gb: int | None
    tok_s: float
    setup: str
    source: str

    def line(self) -> str:
        card = f"{self.card_gb} GB card" if self.card_gb else "CPU only"
        return f"llama.cpp published: {self.tok_s:g} tok/s ({self.model}, {card}: {self.setup}; {self.source})"


LLAMA_CPP: tuple[Anchor, ...] = (
    Anchor("gpt-oss-120b", "GptOssForCausalLM", 36, 128, None, 25.6,
           "i9-14900K, every expert layer on the CPU",
           "gokawiil.com/article/74814 (a repost of a r/LocalLLaMA post: llama-server, --n-cpu-moe 36, 25.62 tok/s eval)"),
    Anchor("gpt-oss-120b", "GptOssForCausalLM", 36, 128, 24, 33.1,
           "RTX 3090 24 GB, --n-cpu-moe 25",
           "ai-maestro.online, 'Drastically improve prompt processing speed for --n-cpu-moe partially offloaded "
           "models' (informal llama-bench, gpt-oss-120b-F16.gguf, -ub 256, 33.14 tok/s)"),
    Anchor("gpt-oss-20b", "GptOssForCausalLM", 24, 32, 8, 36.4,
           "RTX 2080 8 GB + i9-10900X (quad-channel DDR4), MXFP4, --n-cpu-moe 12, llmfit bench --runs 3",
           "AlexsJones/llmfit PR #775"),
    Anchor("Qwen3-30B-A3B", "Qwen3MoeForCausalLM", 48, 128, 8, 36.7,
           "RTX 2080 8 GB + i9-10900X (quad-channel DDR4), Qwen3-30B-A3B-Instruct-2507 Q4_K_M (4-bit), "
           "-ngl 99 --n-cpu-moe 36, generation rate the server measured",
           "AlexsJones/llmfit PR #755"),
)


def anchors_for(architectures: tuple[str, ...], num_hidden_layers: int | None, num_experts: int,
                device_memory_bytes: int | None = None) -> list[Anchor]:
    """The anchors of this model (architecture, layers, experts); with ``device_memory_bytes``,
    only those measured on a card of that size (GB as sold: the nearest whole GiB)."""
    found = [a for a in LLAMA_CPP if a.architecture in architectures and a.num_hidden_layers == num_hidden_layers
             and a.num_experts == num_experts]
    if device_memory_bytes is None:
        return found
    return [a for a in found if a.card_gb is not None and a.card_gb == round(device_memory_bytes / GiB)]
