"""Tensor parallel on the CPU build: two ranks, one CPU core each.

Each rank holds half of the vocabulary's rows. The host embedding must serve that rank's
shard through vLLM's own masking (on CUDA vLLM would take its fused lookup, which skips
the host gather: the glue turns it off; tests/unit/vllm_glue/test_glue_units.py drives that branch).
Every rank judges its own bytes and writes its own report file; the report read by the
caller merges them.
"""

from __future__ import annotations

import pytest

import selective_offload
from helpers import generate_tokens, generate_with_plan, save_tiny_qwen3, tight_plan

pytestmark = pytest.mark.vllm


def test_two_ranks_with_the_embedding_on_the_host(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    model = save_tiny_qwen3(tmp_path / "m", seed=9)
    selective_offload.disable()
    plain = generate_tokens(model, tensor_parallel_size=2)
    tokens, report = generate_with_plan(tight_plan(model), model, tensor_parallel_size=2)
    assert tokens == plain
    assert report.ok, report.problems
    shard = 1024 // 2 * 256 * 4  # half the vocabulary's rows, float32 in the engine
    embed = report.landing("model.embed_tokens")
    assert (embed.actual, embed.host_bytes, embed.routed_bytes, embed.device_bytes) == ("host-cold", shard, shard, 0)
    assert report.ranks == {"rank1": {"ok": True, "landed_host_cold_bytes": shard, "landed_host_hot_bytes": 0,
                                      "landed_host_uva_bytes": 0, "problems": [], "error": None}}
