"""The kernel's rate beside the host's read rate (cpu_kernels.timing): the rounds behind the
committed claim and behind a probe's claim on its own host, on this machine's real kernel."""

import statistics

import pytest
import torch

from selective_offload import cpu_kernels as ck
from selective_offload.cpu_kernels import timing


class Counting:
    """This machine's compiled kernel library, counting the read kernel's sums (every other
    call goes to the library itself)."""

    def __init__(self, lib):
        self.lib, self.sums = lib, []

    def so_read_sum(self, ptr, nbytes, threads):
        self.sums.append((nbytes, threads))
        return self.lib.so_read_sum(ptr, nbytes, threads)

    def __getattr__(self, name):
        return getattr(self.lib, name)


def test_rounds_alternate_new_picks_with_the_read_kernel_and_skip_the_warm_ones(lib):
    """Every round calls the kernel with another token's picks (new experts, so they come
    from memory) and then sums the read buffer with the same threads; the warm rounds run
    but are not counted, and things timed beside run in the same rounds."""
    base, weights, act = timing.layer_of("int4", small=True)
    counting, seen = Counting(lib), []
    read_buf = torch.ones(1 << 16)
    rounds = timing.side_by_side(weights, act, base["k"], 2, 7, read_buf, counting,
                                 beside={"ids": lambda x, ids, tw, job, nxt: seen.append(ids.clone())})
    assert len(counting.sums) == len(seen) == 7 + timing.WARM_ROUNDS
    assert counting.sums[0] == (read_buf.numel() * 4, 2)
    assert len(rounds.kernel_s) == len(rounds.read_s) == len(rounds.beside_s["ids"]) == 7
    assert len({tuple(s.flatten().tolist()) for s in seen}) > 1  # new experts, not one pick over and over
    assert all(s.shape == (1, base["k"]) and s.min() >= 0 and s.max() < base["E"] for s in seen)
    assert rounds.kernel_gbps(base["k"] * weights.expert_bytes) > 0 and rounds.read_gbps(read_buf.numel() * 4) > 0


def test_every_kernel_format_has_a_timed_layer_of_its_real_shape():
    """The committed benchmark and the probe time each kernel format on the same layer: a
    real model's shape, with int4's zero points (its slower path) and MXFP4's biases."""
    kernel_formats = {f for f in ck.FORMATS if f not in ck.TORCH_FORMATS}
    assert set(timing.LAYERS) == kernel_formats == set(timing.SMALL)
    base, w, act = timing.layer_of("int4", small=True)
    assert w.w13_zeros is not None and (base["E"], base["k"], base["H"], base["I"]) == timing.SMALL["int4"]
    base, w, act = timing.layer_of("mxfp4", small=True)
    assert w.w13_bias is not None and act.kind == "swigluoai"
    with pytest.raises(ValueError, match="no timed layer for format 'f32'"):
        timing.layer_weights("f32", 2, 64, 64, False)


def test_the_probe_takes_its_rates_from_the_benchmarks_rounds(monkeypatch):
    """The probe's kernel rate per format and its read rate come from ``side_by_side``'s
    rounds on each format's timed layer, the read rate from those same rounds (the ratio a
    plan is then claimed by is measured as the committed claim is)."""
    from selective_offload.probe import host_compute

    calls, made = [], []
    real = timing.side_by_side

    def spy(weights, act, k, threads, n, read_buf, lib, beside=None, seed=None):
        rounds = real(weights, act, k, threads, n, read_buf, lib, beside, seed)
        calls.append((weights.fmt, weights.num_experts, weights.hidden, k, n, read_buf.data_ptr()))
        made.append((weights.fmt, rounds, k * weights.expert_bytes, read_buf.numel() * 4))
        return rounds

    monkeypatch.setattr(timing, "side_by_side", spy)
    out = host_compute.measure_host_compute(quick=True, say=lambda line: None)
    assert sorted(c[0] for c in calls) == sorted(out["cpu_kernel_gbps"])
    for fmt, E, H, k, n, _ in calls:
        assert (E, k, H) == (timing.SMALL[fmt][0], timing.SMALL[fmt][1], timing.SMALL[fmt][2])
        assert n == host_compute.QUICK_CALLS
    assert len({c[5] for c in calls}) == 1  # one read buffer for every format
    for fmt, rounds, nbytes, _ in made:
        assert out["cpu_kernel_gbps"][fmt] == pytest.approx(rounds.kernel_gbps(nbytes))
    read_s = [s for _, rounds, _, _ in made for s in rounds.read_s]
    assert out["host_read_gbps"] == pytest.approx(made[0][3] / statistics.median(read_s) / 1e9, rel=1e-9)
