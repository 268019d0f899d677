"""Under vLLM's masked tensor-parallel lookup (ids outside this rank's shard become local
id 0, their rows zeroed in place afterwards), the host gather on a pinned host shard (rank
1 of 4) returns exactly what the same lookup on a device shard does, on the device and
writable in place, for 1 to 4096 tokens. The fixture also times both lookups (the results'
"Masked TP lookup" table)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from benchmarks.common import median_us
from mechanism import TOKENS_PER_STEP, bitwise_equal, nbytes, needs_cuda, records, sync
from selective_offload.wrappers import HostGather

SHARD_PINNED = "host shard is pinned"


def masked_lookup(ids: torch.Tensor, start: int, end: int, lookup) -> torch.Tensor:
    """vLLM's masked tensor-parallel lookup (``VocabParallelEmbedding.forward`` with
    ``use_fused_embedding`` off): ids outside this rank's shard [start, end) become local
    id 0, and their rows are zeroed in place after the lookup. No added vocabulary."""
    org_vocab_mask = (ids >= start) & (ids < end)
    valid_offset = start * org_vocab_mask
    masked = org_vocab_mask * (ids - valid_offset)
    out = lookup(masked.long())
    out.masked_fill_(~org_vocab_mask.unsqueeze(-1), 0)
    return out


@pytest.fixture(scope="module")
def tp_lookup(cfg, cuda, device, results):
    """The host gather under vLLM's masked TP lookup, against the same on a device shard."""
    vocab, hidden, tp, rank = cfg["vocab"], cfg["hidden"], cfg["tp_size"], 1
    rows = vocab // tp
    start, end = rank * rows, (rank + 1) * rows
    gen = torch.Generator(device=device).manual_seed(1)
    device_shard = torch.randn(rows, hidden, device=device, dtype=torch.bfloat16, generator=gen)
    host_shard = torch.empty(rows, hidden, dtype=torch.bfloat16, pin_memory=cuda)
    host_shard.copy_(device_shard)
    gather = HostGather(device)
    result = {"vocab": vocab, "hidden": hidden, "tp_size": tp, "rank": rank,
              "shard_rows": [start, end], "shard_bytes": nbytes(host_shard),
              "host_shard_pinned": host_shard.is_pinned() if cuda else None}
    seen = SimpleNamespace(tp=tp, rank=rank, host_shard_pinned=result["host_shard_pinned"], lookups=[])
    ids_gen = torch.Generator().manual_seed(2)
    rows_out = []
    with torch.inference_mode():  # as vLLM runs the model
        for tokens in TOKENS_PER_STEP:
            ids = torch.randint(0, vocab, (tokens,), generator=ids_gen)
            # The shard's edges, both sides: start and end - 1 are its own, end is not.
            for i, v in enumerate((start, end, end - 1, start - 1)[:tokens]):
                ids[i] = v
            ids = ids.to(device)
            in_shard = int(((ids >= start) & (ids < end)).sum())
            expected = masked_lookup(ids, start, end, lambda i: F.embedding(i, device_shard))
            raw = {}

            def host_lookup(i):
                raw["out"] = gather(host_shard, i)
                raw["ptr"] = raw["out"].data_ptr()
                return raw["out"]

            got = masked_lookup(ids, start, end, host_lookup)
            sync(cuda)
            zero_rows = int((got == 0).all(dim=-1).sum())
            seen.lookups.append(SimpleNamespace(
                tokens=tokens, in_shard=in_shard, equal=bitwise_equal(got, expected), device=got.device,
                in_place=(got.device == device and got is raw["out"] and got.data_ptr() == raw["ptr"]
                          and zero_rows >= tokens - in_shard)))
            row = {
                "tokens": tokens, "ids_in_shard": in_shard,
                "masked_device_lookup_us": median_us(
                    lambda: masked_lookup(ids, start, end, lambda i: F.embedding(i, device_shard)),
                    cfg["iters"], cuda),
                "masked_host_lookup_us": median_us(
                    lambda: masked_lookup(ids, start, end, lambda i: gather(host_shard, i)),
                    cfg["iters"], cuda),
            }
            rows_out.append(row)
            print(row)
    result["lookup"] = rows_out
    results["tp_lookup"] = result
    return seen


@records(SHARD_PINNED)
@needs_cuda("pinned host memory is CUDA's")
def test_the_host_shard_is_pinned(tp_lookup, checks):
    checks.check(SHARD_PINNED, tp_lookup.host_shard_pinned)


def test_the_masked_host_lookup_equals_the_masked_device_lookup(tp_lookup, checks):
    t = tp_lookup
    for x in t.lookups:
        checks.check(f"masked host lookup == masked device lookup ({x.tokens} tokens, "
                     f"TP rank {t.rank} of {t.tp})", x.equal, f"{x.in_shard} of {x.tokens} ids in the shard")


def test_the_host_lookup_output_is_on_the_device_and_masked_in_place(tp_lookup, checks):
    for x in tp_lookup.lookups:
        checks.check(f"host lookup output is on the device and masked in place ({x.tokens} tokens)",
                     x.in_place, f"on {x.device}, {x.tokens - x.in_shard} rows zeroed in place")
