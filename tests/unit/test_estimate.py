"""The step-cost model's arithmetic, pinned on cases computed by hand."""

from __future__ import annotations

import pytest

from selective_offload.acceptance import expected_tokens_per_step
from selective_offload.checkpoint import Checkpoint, TensorInfo, tensor_nbytes
from selective_offload.estimate.host import (
    device_share_traffic,
    host_compute_bound_tokens,
    share_held_bytes,
    share_native,
)
from selective_offload.estimate.step import LayerCost, inline_step_s, pipelined_step_s, step_cost
from selective_offload.estimate.traffic import (
    DEFAULT_DECODE_READ_FACTOR,
    EXPERTS_CPU,
    EXPERTS_UVA,
    ExpertsRead,
    StepSettings,
    Traffic,
    expert_read_fraction,
)
from selective_offload.kv_model import KvModel
from selective_offload.planner import PlanInputs, break_even_accept_rate, group_tensors, prefetch_buffer_bytes

# ---- overlap

def test_one_offloaded_layer_hides_behind_the_rest_of_the_step():
    """Two layers, 1 ms of compute each; layer 0 is offloaded and its copy takes 3 ms. The
    copy starts once the last offloaded layer (itself, a step earlier) has run, so it
    overlaps the rest of the step (1 ms): max(3, 1) + layer 0's own 1 ms = 4 ms, and 1 ms
    of link time is hidden."""
    step, hidden = pipelined_step_s([LayerCost(1.0, 3.0), LayerCost(1.0)], 0.0)
    assert (step, hidden) == (4.0, 1.0)
    assert pipelined_step_s([LayerCost(1.0, 0.5), LayerCost(1.0)], 0.0) == (2.0, 0.5)  # copy fully hidden


def test_two_offloaded_layers_each_hide_behind_their_segment():
    """Layers [offloaded, resident, offloaded, resident], 1 ms compute each, 2 ms copies:
    each copy overlaps the resident layer after the previous offloaded one, so the step is
    2 x (max(2, 1) + 1) = 6 ms, against 8 ms with no overlap (vLLM's cpu_offload_gb). Two offloaded layers
    side by side hide nothing: the second's copy reuses the slot the first is reading."""
    layers = [LayerCost(1.0, 2.0), LayerCost(1.0), LayerCost(1.0, 2.0), LayerCost(1.0)]
    assert pipelined_step_s(layers, 0.0) == (6.0, 2.0)
    assert inline_step_s(4.0, 4.0) == 8.0
    assert pipelined_step_s([LayerCost(1.0, 2.0), LayerCost(1.0, 2.0)], 0.0) == (6.0, 0.0)
    # 1.5 ms copies: each hides behind the one resident layer before its own: 2 x (1.5 + 1)
    short = [LayerCost(1.0, 1.5), LayerCost(1.0), LayerCost(1.0, 1.5), LayerCost(1.0)]
    assert pipelined_step_s(short, 0.0) == (5.0, 2.0)


def test_the_tail_of_the_step_hides_the_first_copy():
    """LM head and sampling (other_s) run before the next step's first offloaded layer, so
    they hide 1.5 ms more of its 5 ms copy than the two layers after it alone (2 ms)."""
    layers = [LayerCost(1.0, 5.0), LayerCost(1.0), LayerCost(1.0)]
    assert pipelined_step_s(layers, 0.0) == (6.0, 2.0)
    assert pipelined_step_s(layers, 1.5) == (6.0, 3.5)



def test_a_copy_runs_behind_the_cpus_time_and_shares_host_memory_with_it():
    """Layer 0 computes 3 ms on the host CPU (2.5 ms of it the kernel's host reads), layer 1
    (1 ms) is offloaded with a 3.5 ms copy whose host reads take 1 ms at the kernel's rate.
    The copy runs behind layer 0 (the CPU's time included): max(3.5, 3, 1 + 2.5) + layer 1's
    own 1 ms = 4.5 ms. A copy reading 2 ms of host memory makes the shared reads bind:
    2 + 2.5 + 1 = 5.5 ms. Without host reads in its segment a copy's host share is not
    priced (a GPU-only step)."""
    cpu_layer = LayerCost(3.0, host_s=2.5)
    assert pipelined_step_s([cpu_layer, LayerCost(1.0, 3.5, copy_host_s=1.0)], 0.0) == (4.5, 3.0)
    step, hidden = pipelined_step_s([cpu_layer, LayerCost(1.0, 3.5, copy_host_s=2.0)], 0.0)
    assert (step, hidden) == (pytest.approx(5.5), pytest.approx(2.0))
    assert pipelined_step_s([LayerCost(3.0), LayerCost(1.0, 3.5, copy_host_s=9.0)], 0.0) == (4.5, 3.0)


def test_the_step_hides_a_copy_behind_a_layer_computed_on_the_host():
    """Two layers: layer 0's MLP (1 GB, one expert every token takes) on the host CPU at 10
    GB/s (100 ms + a 1 ms hand-off), layer 1 (0.5 GB) offloaded over a 10 GB/s link (50 ms).
    Read from VRAM at 1000 GB/s the layers' own reads are about 0.5 ms. The copy hides
    behind the CPU's time, and its 50 ms of host reads at 10 GB/s with the kernel's 100 ms
    bind: 150 ms, plus layer 1's own 0.5 ms, which no copy hides."""
    gb = 10 ** 9
    traffic = Traffic(layers=((gb // 1000, False), (gb // 2, True)),
                      experts=(ExpertsRead(0, gb, 1, 1, EXPERTS_CPU),))
    settings = StepSettings(10.0, 1000.0, decode_read_gbps=1000.0, cpu_gbps=10.0, cpu_tflops=1e6, handoff_s=1e-3)
    cost = step_cost(traffic, settings, None, pipelined=True)
    assert cost["est_cpu_s_per_step"] == pytest.approx(0.101)
    # the segment: the copy's host reads (0.05 s) then the kernel's (0.1 s) at the host's rate
    assert cost["est_step_s"] == pytest.approx(0.15 + 0.5e-3)
    # with nothing offloaded the CPU's time is the layer's, in line with the GPU's reads
    resident = Traffic(layers=((gb // 1000, False), (gb // 2, False)), experts=traffic.experts)
    assert step_cost(resident, settings, None, pipelined=True)["est_step_s"] == pytest.approx(0.101 + 0.501e-3)
    # a host four times as fast: the shared reads take 12.5 + 25 ms, layer 0 26 ms, and the
    # copy's own 50 ms over the link binds (then layer 1's 0.5 ms)
    fast = step_cost(traffic, StepSettings(10.0, 1000.0, decode_read_gbps=1000.0, cpu_gbps=40.0, cpu_tflops=1e6,
                                           handoff_s=1e-3), None, pipelined=True)
    assert fast["est_step_s"] == pytest.approx(0.05 + 0.5e-3)



def test_a_device_share_runs_beside_the_cpu_and_the_layer_waits_for_the_longer():
    """One resident layer (1 MB read at 1000 GB/s: 1 us) whose MLP (1 GB, one expert every
    token takes) is split: a quarter of its bytes on the device, read there at 1000 GB/s
    (0.25 ms), the rest by the CPU at 10 GB/s (75 ms + a 1 ms hand-off). The two run at once,
    so the step is the layer's own read and the longer of the two: 76 ms + 1 us, not their
    sum; the CPU's time shrinks with its share, and the share's reads are VRAM time."""
    gb = 10 ** 9

    def cost(share, vram=1000.0):
        at = StepSettings(10.0, vram, decode_read_gbps=vram, cpu_gbps=10.0, cpu_tflops=1e6, handoff_s=1e-3)
        traffic = Traffic(layers=((gb // 1000, False),), experts=(ExpertsRead(0, gb, 1, 1, EXPERTS_CPU,
                                                                            device_share=share),))
        return step_cost(traffic, at, None, pipelined=True)

    whole, split = cost(0.0), cost(0.25)
    assert whole["est_cpu_s_per_step"] == pytest.approx(0.101)
    assert split["est_cpu_s_per_step"] == pytest.approx(0.076)
    assert split["est_step_s"] == pytest.approx(0.076 + 1e-6)
    assert split["est_vram_s_per_step"] == pytest.approx(1e-6 + 0.25e-3)
    # a slow device: its share (0.25 GB at 2 GB/s, 125 ms) outlasts the CPU's 76 ms and binds
    slow = cost(0.25, vram=2.0)
    assert slow["est_step_s"] == pytest.approx(0.125 + 0.5e-3)
    # every byte on the device: the CPU reads nothing and only the hand-off is left beside it
    assert cost(1.0)["est_cpu_s_per_step"] == pytest.approx(1e-3)


# ---- speculative decoding

@pytest.mark.parametrize("k,a,expected", [(0, 0.9, 1.0), (1, 0.85, 1.85), (2, 0.5, 1.75), (3, 1.0, 4.0),
                                          (1, 0.0, 1.0)])
def test_expected_tokens_per_step(k, a, expected):
    assert expected_tokens_per_step(k, a) == pytest.approx(expected)


def test_speculation_breaks_even_where_the_tokens_pay_for_the_longer_step():
    """A step 20% longer with one draft token needs 1.2 tokens per step: E(1, a) = 1 + a,
    so a = 0.2. Two drafts and a step 1.5x longer: 1 + a + a^2 = 1.5 at a = (sqrt 3 - 1) / 2."""
    assert break_even_accept_rate(1.2, 1.0, 1) == pytest.approx(0.2, abs=1e-9)
    assert break_even_accept_rate(1.5, 1.0, 2) == pytest.approx((3 ** 0.5 - 1) / 2, abs=1e-9)
    assert break_even_accept_rate(2.5, 1.0, 1) is None  # even every draft accepted yields only 2


def test_draft_passes_and_tokens_in_the_step():
    """One offloaded 1 GB layer (1 s over a 1 GB/s link; its own reads, 0.01 s, come after
    its copy), an MTP head plus LM head of 2 GB read by decode kernels at 100 GB/s per
    draft: K=2 drafts add 0.04 s, and a step yields E(2, 0.5) = 1.75 tokens."""
    traffic = Traffic(layers=((10 ** 9, True),), draft_bytes=2 * 10 ** 9)
    cost = step_cost(traffic, StepSettings(1.0, 500.0, spec_tokens=2, accept_rate=0.5, decode_read_gbps=100.0), None,
                     pipelined=True)
    assert cost["est_draft_s_per_step"] == pytest.approx(0.04)
    assert cost["est_step_s"] == pytest.approx(1.0 + 0.01 + 0.04)
    assert cost["est_tokens_per_step"] == pytest.approx(1.75)
    assert cost["est_tok_s"] == pytest.approx(1.75 / 1.05)


# ---- batch

def test_a_batch_shares_the_link_traffic():
    """The same 1 s of link traffic serves 8 sequences: 8x the tokens per step; only the
    embedding rows (gathered on the host, per token) grow with the batch."""
    traffic = Traffic(layers=((10 ** 9, True), (10 ** 6, False)), row_bytes_host=10 ** 4)
    one = step_cost(traffic, StepSettings(1.0, 1000.0, batch=1), None, pipelined=True)
    eight = step_cost(traffic, StepSettings(1.0, 1000.0, batch=8), None, pipelined=True)
    # the rows are read in place through UVA: 0.86 of the 1 GB/s link
    assert eight["est_link_s_per_step"] - one["est_link_s_per_step"] == pytest.approx(7 * 10 ** 4 / 0.86e9)
    assert eight["est_tok_s"] / one["est_tok_s"] == pytest.approx(8, rel=1e-3)
    assert eight["est_tok_s_per_seq"] == pytest.approx(one["est_tok_s"], rel=1e-3)


def test_kv_reads_grow_with_batch_and_context():
    """2 layers x 1024 B per token of KV; 4 sequences at 1000 tokens read 8.192 MB: 8.192 ms
    when decode kernels read VRAM at 1 GB/s, on top of the weights; a datasheet 1 GB/s is
    read at the default fraction of it."""
    kv = KvModel(full_bytes_per_token=2 * 1024)
    traffic = Traffic(layers=((10 ** 6, False), (10 ** 6, False)))
    cost = step_cost(traffic, StepSettings(1.0, 9.0, batch=4, context_tokens=1000, decode_read_gbps=1.0), kv,
                     pipelined=False)
    assert cost["est_vram_s_per_step"] == pytest.approx((2e6 + 4 * 1000 * 2048) / 1e9)
    peak = step_cost(traffic, StepSettings(1.0, 1.0, batch=4, context_tokens=1000), kv, pipelined=False)
    assert peak["est_vram_s_per_step"] == pytest.approx((2e6 + 4 * 1000 * 2048) / (DEFAULT_DECODE_READ_FACTOR * 1e9))


# ---- KV bytes from configs

def test_kv_bytes_of_a_gqa_config():
    """2 layers, 2 KV heads x 64 dims, bf16: 2 (K and V) x 2 x 64 x 2 B = 512 B per layer
    per token; 2 sequences of 100 tokens: 204,800 B."""
    kv = KvModel.from_config({"num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
                              "head_dim": 64})
    assert kv.full_bytes_per_token == 1024
    assert kv.cache_bytes(100, 2) == 204_800


def test_kv_bytes_of_a_hybrid_linear_attention_config():
    """8 layers, every 4th full attention (Qwen3.5-style): 2 full layers of KV per token, and
    6 gated-delta-net layers with a fixed state per sequence: 16 value heads x 128 x 128
    float32 (1,048,576 B) plus 3 conv steps x (2 x 8 x 128 + 16 x 128) bf16 (24,576 B)."""
    config = {"num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
              "full_attention_interval": 4, "linear_num_value_heads": 16, "linear_num_key_heads": 8,
              "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4}
    kv = KvModel.from_config({"text_config": config})
    assert kv.full_bytes_per_token == 2 * (2 * 2 * 256 * 2)
    assert kv.fixed_bytes_per_seq == 6 * (16 * 128 * 128 * 4 + 3 * (2 * 8 * 128 + 16 * 128) * 2)
    assert kv.bytes_per_seq(1000) == 1000 * 4096 + kv.fixed_bytes_per_seq


def test_kv_bytes_with_sliding_windows_and_mla():
    sliding = KvModel.from_config({"num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 1,
                                   "head_dim": 128, "sliding_window": 1024,
                                   "layer_types": ["sliding_attention"] * 3 + ["full_attention"]})
    per_layer = 2 * 1 * 128 * 2
    assert sliding.bytes_per_seq(8192) == 8192 * per_layer + 3 * 1024 * per_layer
    mla = KvModel.from_config({"num_hidden_layers": 3, "num_attention_heads": 128, "kv_lora_rank": 512,
                               "qk_rope_head_dim": 64}, kv_dtype_bytes=1)
    assert mla.full_bytes_per_token == 3 * (512 + 64)


# ---- hybrid stacks need prefetch slots for the union of their parameters

def test_prefetch_buffers_of_a_hybrid_stack_cover_both_layer_kinds():
    spec = {}
    for i in range(4):
        kind = "self_attn.qkv" if i % 2 else "linear_attn.in_proj"
        spec[f"model.layers.{i}.{kind}.weight"] = ("BF16", [100, 100])
        spec[f"model.layers.{i}.mlp.up.weight"] = ("BF16", [100, 200])
    tensors = {n: TensorInfo(n, d, tuple(s), tensor_nbytes(d, s)) for n, (d, s) in spec.items()}
    layers = [g for g in group_tensors(Checkpoint("t", "manifest", tensors, {}), PlanInputs(device_memory_bytes=1))
              if g.kind == "layer"]
    largest_layer = max(g.nbytes for g in layers)
    assert prefetch_buffer_bytes(layers, 1) == 2 * 100 * 100 * 2 + 100 * 200 * 2 == largest_layer + 100 * 100 * 2
    assert prefetch_buffer_bytes(layers, 2) == 2 * prefetch_buffer_bytes(layers, 1)


def test_the_compute_bound_step_is_where_the_cpus_flops_overtake_its_bytes_whatever_the_ranks():
    # a dense MLP (one expert every token takes): 10 MB read whole, 1e7 FLOPs per token
    mlp = ExpertsRead(0, 10_000_000, 1, 1, EXPERTS_CPU, 1e7)
    settings = StepSettings(13.9, 472.0, cpu_gbps=50.0, cpu_tflops=0.1)
    # bytes: 10e6 / 50e9 = 0.2 ms; FLOPs: T x 1e7 / 1e11 = T x 0.1 ms -> bound from T = 2
    assert host_compute_bound_tokens([mlp], settings) == 2
    assert host_compute_bound_tokens([mlp], StepSettings(13.9, 472.0, cpu_gbps=50.0, cpu_tflops=0.1, ranks=4)) == 2
    assert host_compute_bound_tokens([mlp], StepSettings(13.9, 472.0, cpu_gbps=10.0, cpu_tflops=0.1)) == 10  # 1 ms of bytes
    assert host_compute_bound_tokens([mlp], StepSettings(13.9, 472.0, cpu_gbps=200.0, cpu_tflops=0.1)) == 1
    assert host_compute_bound_tokens([ExpertsRead(0, 10_000_000, 1, 1, EXPERTS_UVA, 1e7)], settings) is None


def test_a_share_is_held_at_least_as_wide_as_bf16():
    """Two bytes a parameter for packed 4-bit and 8-bit formats (dequantized to bf16), the
    stored bytes for bf16 and float32 (neither narrowed)."""
    assert share_held_bytes({"BF16": 1000}) == 1000
    assert share_held_bytes({"F32": 1000}) == 1000
    assert share_held_bytes({"F8_E4M3": 1000, "F32": 8}) == 2008
    assert share_held_bytes({"U8": 1000}) == 4000  # two 4-bit codes a byte
    assert share_held_bytes({"I32": 1000}) == 4000  # eight 4-bit values in four bytes


def test_an_mxfp4_expert_share_is_held_as_stored_and_reads_each_picked_expert_once():
    """Routed experts of MXFP4 (``NATIVE_SHARE_FORMATS``) keep their stored bytes on the device;
    a dense MLP's channels, and every other format, are held wide. The share kernel's traffic
    is the share's experts the step picks (uniform routing: each with the chance
    ``1 - (1 - k/E)^T``), each read once at its stored size, whatever the tokens; its FLOPs
    are the slots that land in the share."""
    assert share_native("mxfp4", True) and not share_native("mxfp4", False)
    assert not share_native("bf16", True) and not share_native("int4", True) and not share_native(None, True)
    stored = {"U8": 4000, "BF16": 64}
    assert share_held_bytes(stored, True) == 4064 and share_held_bytes(stored) > 4 * 4000 - 1
    E, k, m = 32, 4, 8  # 8 of 32 experts on the device, 1 MB each as stored
    e = ExpertsRead(0, E * 10 ** 6, E, k, EXPERTS_CPU, flops_per_token=8e6, device_share=m / E,
                    held_nbytes=E * 10 ** 6, share_native=True)
    for tokens in (1, 3, 64):
        traffic, flops = device_share_traffic(e, tokens)
        assert traffic == pytest.approx(m * expert_read_fraction(E, k, tokens) * 10 ** 6)
        assert flops == pytest.approx(tokens * k * (m / E) * 2e6)
    # held wide and gathered instead: each pick slot copies its expert and reads the copy
    wide = device_share_traffic(ExpertsRead(0, E * 10 ** 6, E, k, EXPERTS_CPU, flops_per_token=8e6,
                                            device_share=m / E, held_nbytes=E * 10 ** 6), 1)[0]
    assert wide > device_share_traffic(e, 1)[0] * k
