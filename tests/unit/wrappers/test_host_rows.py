"""HostRows: the LM head split by rows, the host's rows computed by torch's CPU linear at or
below the crossover and copied to the device above it. Here the "device" is the CPU (no
CUDA): the host part is still read from the host tensor and the device part from its own
copy of the first rows, as on a GPU; the CUDA ordering itself is checked on a GPU only."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from selective_offload.wrappers.host_rows import HostRows

V, H, DEVICE_ROWS = 48, 32, 20
GROUP = "lm_head"
CPU = torch.device("cpu")


def weight(dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(V, H, generator=g) * 0.1).to(dtype)


def hidden(tokens: int, dtype=torch.float32, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, H, generator=g).to(dtype)


def head(w: torch.Tensor, crossover: int = 4, **kw) -> HostRows:
    return HostRows(GROUP, w, kw.pop("device_rows", DEVICE_ROWS), crossover_tokens=crossover, device=CPU, **kw)


#: bf16: one rounding of each logit (a relative 2**-7) apart from the full linear, should the
#: split sum in another order; float32: the same sums to float32 accuracy.
TOLERANCE = {torch.bfloat16: dict(rtol=2 ** -7, atol=1e-3), torch.float32: dict(rtol=1e-6, atol=1e-6)}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 3, 4, 7])
def test_the_split_gives_the_full_linear_on_both_paths(dtype, tokens):
    """Device rows first, host rows after, in x's dtype on x's device, whichever path."""
    w = weight(dtype)
    rows = head(w, crossover=4)
    x = hidden(tokens, dtype)
    out = rows(x)
    assert out.shape == (tokens, V) and out.dtype == dtype and out.device == x.device
    torch.testing.assert_close(out, F.linear(x, w), **TOLERANCE[dtype])
    on_host = tokens <= 4
    assert (rows.counts.host.steps, rows.counts.device.steps) == ((1, 0) if on_host else (0, 1))


def test_the_crossover_is_inclusive_and_each_path_is_counted():
    w = weight(torch.bfloat16)
    rows = head(w, crossover=3)
    for tokens in (1, 3, 4, 3, 9):
        rows(hidden(tokens, torch.bfloat16, seed=tokens))
    c = rows.counts
    assert (c.host.steps, c.host.tokens, c.device.steps, c.device.tokens) == (3, 7, 2, 13)
    assert rows.host_rows == V - DEVICE_ROWS
    assert c.host_bytes == 3 * (V - DEVICE_ROWS) * H * 2  # the host rows, read once a host step
    assert c.host.per_step_s() > 0
    assert rows.as_dict()["host_bytes"] == c.host_bytes and rows.as_dict()["device_steps"] == 2


def test_a_crossover_of_zero_sends_every_step_to_the_device():
    rows = head(weight(), crossover=0)
    x = hidden(1)
    torch.testing.assert_close(rows(x), F.linear(x, weight()), **TOLERANCE[torch.float32])
    assert (rows.counts.host.steps, rows.counts.device.steps, rows.counts.host_bytes) == (0, 1, 0)


@pytest.mark.parametrize("tokens", [2, 9])
def test_the_host_rows_are_read_from_the_host_tensor_and_the_first_from_the_device_copy(tokens):
    """A change to the host tensor's rows ``device_rows:`` shows in the last columns only, on
    either path (the host reads them in place; the device path copies them each step); a
    change to its first rows shows nowhere (the device holds its own copy); a change to the
    device copy shows in the first columns only."""
    w = weight()
    rows = head(w, crossover=4)
    x = hidden(tokens)
    before = rows(x)

    w[DEVICE_ROWS:] *= -2.0
    w[:DEVICE_ROWS] += 1.0
    after_host = rows(x)
    assert torch.equal(after_host[:, :DEVICE_ROWS], before[:, :DEVICE_ROWS])
    torch.testing.assert_close(after_host[:, DEVICE_ROWS:], -2.0 * before[:, DEVICE_ROWS:])

    rows.device_weight.mul_(3.0)
    after_device = rows(x)
    torch.testing.assert_close(after_device[:, :DEVICE_ROWS], 3.0 * before[:, :DEVICE_ROWS])
    assert torch.equal(after_device[:, DEVICE_ROWS:], after_host[:, DEVICE_ROWS:])


def test_a_given_device_weight_is_used_as_it_is():
    w = weight()
    given = torch.zeros(DEVICE_ROWS, H)
    rows = head(w, device_weight=given)
    out = rows(hidden(2))
    assert rows.device_weight is given and torch.equal(out[:, :DEVICE_ROWS], torch.zeros(2, DEVICE_ROWS))


def test_a_float32_input_to_a_bf16_head_comes_back_float32():
    w = weight(torch.bfloat16)
    x = hidden(2)
    out = head(w)(x)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, F.linear(x.to(torch.bfloat16), w).float(), **TOLERANCE[torch.bfloat16])


@pytest.mark.parametrize("build, says", [
    (lambda w: head(w, device_rows=0), "between 1 and"),
    (lambda w: head(w, device_rows=V), "between 1 and"),
    (lambda w: head(w, crossover=-1), "crossover"),
    (lambda w: head(w[0]), "2-D"),
    (lambda w: head(w.half()), "only bf16 and float32"),
    (lambda w: head(w, device_weight=torch.zeros(DEVICE_ROWS + 1, H)), "device weight"),
    (lambda w: head(w, device_weight=torch.zeros(DEVICE_ROWS, H + 1)), "device weight"),
    (lambda w: head(w, device_weight=torch.zeros(DEVICE_ROWS, H, dtype=torch.bfloat16)), "device weight"),
])
def test_each_bad_argument_is_refused_naming_the_group(build, says):
    with pytest.raises(ValueError, match=f"^{GROUP}: .*{says}"):
        build(weight())


def test_a_call_inside_a_cuda_graph_capture_is_refused(monkeypatch):
    """Fake: no CUDA here, so the head is told its device is CUDA and that a capture is under
    way; what is checked is that it refuses before doing anything."""
    rows = head(weight())
    rows.device = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match=f"^{GROUP}: .*CUDA graph"):
        rows(hidden(1))
    assert rows.counts.host.steps == rows.counts.device.steps == 0
