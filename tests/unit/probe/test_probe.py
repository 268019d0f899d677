"""`selective-offload probe`: measuring (quick, on the CPU here), the profile file, its
validation, where it lives, and what it supplies to planning."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time as time_

import pytest
import torch

from builders import gpu_profile
from selective_offload.cli import main
from selective_offload.errors import UserError
from selective_offload.plan_format import PlanInputs
from selective_offload.probe import (
    PROFILE_ENV,
    PROFILE_FORMAT,
    Profile,
    add_probe_arguments,
    command,
    default_profile_path,
    describe,
    load_profile,
    measure,
    plan_defaults,
    run_probe,
    uva_read_series,
)
from selective_offload.probe import measurements as probe
from selective_offload.sizes import GiB

MiB = 1 << 20


@pytest.fixture(scope="module")
def cpu_profile() -> Profile:
    return measure(device="cpu", quick=True)


def one_line_naming(exc: pytest.ExceptionInfo, path) -> str:
    msg = str(exc.value)
    assert "\n" not in msg, msg
    assert str(path) in msg, msg
    return msg


# --------------------------------------------------------------------------- measuring


def test_quick_cpu_measure_has_no_link_and_a_host_memcpy_rate(cpu_profile):
    p = cpu_profile
    assert p.format == PROFILE_FORMAT
    assert p.no_link_reason and "no host-to-device link" in p.no_link_reason and "\n" not in p.no_link_reason
    assert p.host_memcpy_gbps is not None and p.host_memcpy_gbps > 0
    for name in ("link_gbps_pinned", "link_gbps_pageable", "vram_gbps", "device_memory_total_bytes",
                 "device_memory_free_bytes", "device"):
        assert getattr(p, name) is None, name
    assert p.integrated is False and p.quick is True and p.repeats == 3
    assert p.torch_version == torch.__version__
    assert p.machine and p.date[:4].isdigit()
    # the per-size medians are kept, and the reported rate is the largest copy's (read + write)
    assert sorted(p.host_memcpy_samples_s) == [4 * MiB, 16 * MiB, 64 * MiB]
    assert all(s > 0 for s in p.host_memcpy_samples_s.values())
    assert p.host_memcpy_gbps == pytest.approx(2 * 64 * MiB / p.host_memcpy_samples_s[64 * MiB] / 1e9)
    assert not p.h2d_pinned_samples_s and not p.h2d_pageable_samples_s and not p.d2d_samples_s
    # no link, so no UVA reads; the CPU's matmul rate is measured (float32)
    assert p.uva_read_gbps is None and not p.uva_read_samples_s
    assert p.matmul_dtype == "float32" and p.matmul_tflops > 0


def test_uva_read_series_times_a_kernel_reading_a_view_of_host_memory():
    """The UVA read measurement's code path on the CPU: the host tensor itself stands in for
    the UVA device view (no CUDA device exists here), read by the same matrix-vector product; a size
    past the required ones that cannot be allocated is left out, a required one is one line."""
    seen = []

    def view(host):
        seen.append(host.numel() * host.element_size())
        return host

    out = uva_read_series([MiB, 4 * MiB], repeats=2, warmup=1, cuda=None, view=view, pin=False, required=2)
    assert sorted(out) == [MiB, 4 * MiB] and all(v > 0 for v in out.values()) and seen == [MiB, 4 * MiB]

    def fails_large(host):
        if host.numel() * host.element_size() > MiB:
            raise RuntimeError("cudaHostRegister failed: out of memory\nmore")
        return host

    assert list(uva_read_series([MiB, 4 * MiB], repeats=1, warmup=0, cuda=None, view=fails_large, pin=False,
                                required=1)) == [MiB]
    with pytest.raises(UserError, match="could not measure UVA reads of 4 MiB") as exc:
        uva_read_series([MiB, 4 * MiB], repeats=1, warmup=0, cuda=None, view=fails_large, pin=False, required=2)
    assert "\n" not in str(exc.value)


def test_decode_read_rate_is_the_weight_bytes_of_a_matrix_vector_product(monkeypatch):
    calls = []
    monkeypatch.setattr(probe, "_median_s", lambda fn, **kw: (calls.append(fn()), 0.25)[1])
    rate = probe.decode_read_gbps(torch.device("cpu"), 4 * MiB, repeats=1, warmup=0, cuda=None, cols=1024)
    assert calls[0].shape == (2048,) and rate == pytest.approx(4 * MiB / 0.25 / 1e9)


def test_matmul_rate_counts_two_n_cubed_flops(monkeypatch):
    monkeypatch.setattr(probe, "_median_s", lambda fn, **kw: (fn(), 0.5)[1])
    assert probe.matmul_tflops(torch.device("cpu"), 100, torch.float32, repeats=1, warmup=0, cuda=None) == \
        pytest.approx(2 * 100 ** 3 / 0.5 / 1e12)


def test_measure_default_device_here_is_the_cpu_when_torch_sees_no_gpu():
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device: the default measures it")
    p = measure(quick=True, sizes=[MiB], repeats=1)
    assert p.device is None and p.no_link_reason.startswith("no GPU here")
    assert list(p.host_memcpy_samples_s) == [MiB]


@pytest.mark.parametrize("kwargs, words", [
    (dict(sizes=[0]), "positive"),
    (dict(sizes=[]), "positive"),
    (dict(sizes=["lots"]), "whole numbers"),
    (dict(repeats=0), "repeats"),
    (dict(device="tpu"), "cannot read"),
    (dict(device="meta"), "cuda devices"),
])
def test_measure_rejects_bad_arguments_in_one_line(kwargs, words):
    with pytest.raises(UserError) as exc:
        measure(quick=True, **kwargs)
    assert words in str(exc.value) and "\n" not in str(exc.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_measure_cuda_without_a_gpu_is_one_line():
    with pytest.raises(UserError, match="sees no CUDA device") as exc:
        measure(device="cuda", quick=True)
    assert "\n" not in str(exc.value)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_quick_gpu_measure_has_link_vram_and_device_memory(tmp_path):
    p = measure(quick=True)
    assert p.no_link_reason is None and p.device == torch.cuda.get_device_name()
    assert p.link_gbps_pinned > 0 and p.link_gbps_pageable > 0 and p.vram_gbps > 0
    assert 0 < p.device_memory_free_bytes <= p.device_memory_total_bytes
    assert p.integrated == bool(getattr(torch.cuda.get_device_properties(0), "is_integrated", False))
    assert sorted(p.h2d_pinned_samples_s) == sorted(p.d2d_samples_s) == [4 * MiB, 16 * MiB, 64 * MiB]
    p.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json") == p
    assert p.uva_read_gbps > 0 and sorted(p.uva_read_samples_s) == [4 * MiB, 16 * MiB, 64 * MiB]
    assert p.matmul_dtype == "bfloat16" and p.matmul_tflops > 0 and p.decode_read_gbps > 0
    assert plan_defaults(p) == {"link_gbps": p.link_gbps_pinned, "uva_gbps": p.uva_read_gbps,
                                "vram_gbps": p.vram_gbps, "decode_read_gbps": p.decode_read_gbps,
                                "compute_tflops": p.matmul_tflops,
                                "device_memory_bytes": p.device_memory_total_bytes}


# --------------------------------------------------------------------------- the file


def test_save_load_round_trip(tmp_path, cpu_profile):
    for profile in (cpu_profile, gpu_profile(integrated=True, quick=True)):
        path = tmp_path / "deeper" / "profile.json"
        profile.save(path)
        data = json.loads(path.read_text())
        assert data["format"] == PROFILE_FORMAT and list(data)[0] == "format"
        assert all(isinstance(k, str) for k in data["host_memcpy_samples_s"])
        loaded = Profile.load(path)
        assert loaded == profile
        assert loaded.host_memcpy_samples_s == profile.host_memcpy_samples_s


def test_a_gpu_profile_file_written_by_hand_loads(tmp_path):
    data = gpu_profile().to_dict()
    for key in ("h2d_pinned_samples_s", "h2d_pageable_samples_s", "d2d_samples_s", "host_memcpy_samples_s",
                "repeats", "quick", "copy_bytes_counted"):
        del data[key]  # optional: a hand-written profile needs only the figures
    path = tmp_path / "hand.json"
    path.write_text(json.dumps(data))
    p = Profile.load(path)
    assert p.link_gbps_pinned == 52.3 and p.repeats is None and not p.d2d_samples_s


def _gpu_data():
    return gpu_profile().to_dict()


def _edit(**changes):
    def make():
        data = _gpu_data()
        for key, value in changes.items():
            if value is _DROP:
                del data[key]
            else:
                data[key] = value
        return json.dumps(data)
    return make


_DROP = object()

BAD_FILES = {
    "not JSON": (lambda: "{\"format\": ", "not valid JSON"),
    "not an object": (lambda: "[1, 2]", "must be an object, not a list"),
    "a plan, not a profile": (_edit(format="selective-offload/plan-v2"), "not a selective-offload profile"),
    "no format": (_edit(format=_DROP), "not a selective-offload profile"),
    "a newer profile": (_edit(format="selective-offload/profile-v9"), "upgrade selective-offload"),
    "missing fields": (_edit(vram_gbps=_DROP, date=_DROP), "lacks date, vram_gbps"),
    "negative link": (_edit(link_gbps_pinned=-3.0), "link_gbps_pinned is -3.0"),
    "zero vram": (_edit(vram_gbps=0), "vram_gbps is 0"),
    "a rate beyond any link or memory": (_edit(vram_gbps=1e7), "vram_gbps is 10000000.0, but must be a number of GB/s"),
    "string rate": (_edit(host_memcpy_gbps="fast"), "host_memcpy_gbps"),
    "bool rate": (_edit(vram_gbps=True), "vram_gbps is true"),
    "infinite rate": (lambda: _edit()().replace("3900.0", "Infinity"), "not valid JSON (Infinity is not JSON"),
    "fractional bytes": (_edit(device_memory_total_bytes=1.5e11), "device_memory_total_bytes"),
    "more free than total": (_edit(device_memory_free_bytes=10**12), "at most device_memory_total_bytes"),
    "integrated not bool": (_edit(integrated="no"), "true or false"),
    "bad date": (_edit(date="last tuesday"), "ISO date"),
    "multi-line machine": (_edit(machine="a\nb"), "one-line string"),
    "a link and a no-link reason": (_edit(no_link_reason="none here"), "null when link rates are given"),
    "no link rate, no reason": (_edit(link_gbps_pinned=None), "link_gbps_pinned"),
    "vram without a device": (_edit(device=None, link_gbps_pinned=None, link_gbps_pageable=None,
                                    no_link_reason="cpu"), "null when device is null"),
    "bad samples": (_edit(d2d_samples_s={"1024": -1}), "d2d_samples_s.1024 is -1"),
    "bad sample size": (_edit(d2d_samples_s={"big": 0.1}), "d2d_samples_s"),
    "zero repeats": (_edit(repeats=0), "repeats"),
    "negative UVA rate": (_edit(uva_read_gbps=-1.0), "uva_read_gbps is -1.0"),
    "UVA reads without a link": (_edit(uva_read_gbps=20.0, device=None, link_gbps_pinned=None, link_gbps_pageable=None,
                                       vram_gbps=None, device_memory_total_bytes=None,
                                       device_memory_free_bytes=None, no_link_reason="cpu"),
                                 "null when there is no link"),
    "a matmul rate without its dtype": (_edit(matmul_tflops=700.0), "given exactly when matmul_tflops is"),
    "zero matmul rate": (_edit(matmul_tflops=0, matmul_dtype="bfloat16"), "matmul_tflops is 0"),
    "decode reads without a device": (_edit(decode_read_gbps=100.0, device=None, link_gbps_pinned=None,
                                            link_gbps_pageable=None, vram_gbps=None, device_memory_total_bytes=None,
                                            device_memory_free_bytes=None, no_link_reason="cpu"),
                                      "null when device is null"),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_load_refuses_bad_profiles_in_one_line_naming_the_file(tmp_path, case):
    make, words = BAD_FILES[case]
    path = tmp_path / "profile.json"
    path.write_text(make())
    with pytest.raises(UserError) as exc:
        Profile.load(path)
    msg = one_line_naming(exc, path)
    assert words in msg, msg
    with pytest.raises(UserError):  # load_profile: the file exists, so it is read and refused
        load_profile(path)


def test_load_of_an_unreadable_path_is_one_line(tmp_path):
    with pytest.raises(UserError) as exc:
        Profile.load(tmp_path / "absent.json")
    assert "cannot read" in one_line_naming(exc, tmp_path / "absent.json")
    (tmp_path / "adir").mkdir()
    with pytest.raises(UserError) as exc:
        load_profile(tmp_path / "adir")
    one_line_naming(exc, tmp_path / "adir")
    (tmp_path / "binary.json").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(UserError) as exc:
        Profile.load(tmp_path / "binary.json")
    one_line_naming(exc, tmp_path / "binary.json")


def test_save_to_an_unwritable_place_is_one_line(tmp_path, cpu_profile):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(UserError) as exc:
        cpu_profile.save(blocker / "profile.json")
    assert "cannot be written" in one_line_naming(exc, blocker / "profile.json")


# --------------------------------------------------------------------------- where it lives


def test_default_path_and_load_profile_honour_the_environment(tmp_path, monkeypatch, cpu_profile):
    monkeypatch.delenv(PROFILE_ENV, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_profile_path() == tmp_path / "home" / ".cache" / "selective-offload" / "profile.json"
    assert load_profile() is None  # no file: nothing, no error
    assert load_profile(tmp_path / "nowhere.json") is None

    target = tmp_path / "elsewhere" / "p.json"
    monkeypatch.setenv(PROFILE_ENV, str(target))
    assert default_profile_path() == target
    assert load_profile() is None
    cpu_profile.save(target)
    assert load_profile() == cpu_profile
    target.write_text("garbage")
    with pytest.raises(UserError) as exc:
        load_profile()
    one_line_naming(exc, target)

    monkeypatch.setenv(PROFILE_ENV, "")  # empty: as unset
    assert default_profile_path() == tmp_path / "home" / ".cache" / "selective-offload" / "profile.json"


# --------------------------------------------------------------------------- for planning


def test_plan_defaults_of_a_cpu_profile_supply_only_the_host_kernels(cpu_profile):
    """A probe without a GPU supplies nothing of a GPU (the CPU's matmul rate is not a
    GPU's), and the host CPU kernels' rates and threads it measured (the host that computes
    host-compute experts is this one); a quick probe's kernel rates (cache-sized layers)
    supply nothing."""
    nothing = {"link_gbps": None, "uva_gbps": None, "vram_gbps": None, "decode_read_gbps": None,
               "compute_tflops": None, "device_memory_bytes": None, "compute_capability": None,
               "cpu_kernel_gbps": None, "cpu_threads": None, "handoff_s": None}
    assert cpu_profile.quick and cpu_profile.cpu_kernel_gbps
    assert plan_defaults(cpu_profile)["cpu_kernel_gbps"] is None
    assert "not for plans (quick" in cpu_profile.render()
    full = dataclasses.replace(cpu_profile, quick=False)
    assert "not for plans" not in full.render()
    supplied = plan_defaults(full)
    host = {k: supplied.pop(k) for k in ("cpu_kernel_gbps", "cpu_threads")}
    assert supplied == {k: v for k, v in nothing.items() if k not in host}
    assert host["cpu_kernel_gbps"] == full.cpu_kernel_gbps and host["cpu_threads"] == full.cpu_threads
    assert all(rate > 0 for rate in host["cpu_kernel_gbps"].values()) and host["cpu_threads"] >= 1
    assert plan_defaults(None) == nothing
    line = describe(cpu_profile)
    assert "\n" not in line and line.startswith("no link, host memcpy ")
    assert "measured by `selective-offload probe` on " + cpu_profile.date[:10] in line
    assert "no GPU" in line and "quick probe" in line


def test_a_quick_probe_with_a_cached_read_rate_does_not_switch_host_compute_off(tmp_path, monkeypatch, capsys):
    """The default profile of a quick probe, its host read rate cache-inflated far past its
    kernel's (the CPU kernel then fails the claim bar): the bundled reference plan still
    computes on the CPU, as with no profile; a full probe's same rates would switch it off,
    and the default view says so in its `cpu:` line."""
    reference = ["plan", "qwen3.8-27b-fp8", "--device-memory", "24GiB"]
    assert main([*reference, "--json"]) == 0
    without = json.loads(capsys.readouterr().out)
    assert without["host_compute"] is not None
    target = tmp_path / "profile.json"
    monkeypatch.setenv(PROFILE_ENV, str(target))
    cached = {"bf16": 20.0, "fp8-block": 20.0, "mxfp4": 20.0, "int4": 20.0}
    for quick in (True, False):
        # A laptop's link, where computing on the CPU pays at the assumed rate (as with no profile).
        gpu_profile(quick=quick, cpu_kernel_gbps=cached, cpu_threads=2, host_read_gbps=163.0,
                    link_gbps_pinned=13.9).save(target)
        assert main([*reference, "--json"]) == 0
        plan = json.loads(capsys.readouterr().out)
        assert (plan["host_compute"] is not None) is quick, quick
        assert main(reference) == 0
        cpu = [line for line in capsys.readouterr().out.splitlines() if line.startswith("cpu ")]
        assert len(cpu) == 1 and cpu[0].startswith("cpu    not used: " if not quick else "cpu    fp8-block at "), cpu


def test_plan_defaults_of_a_gpu_profile_supply_link_vram_and_device_memory():
    p = gpu_profile()
    assert plan_defaults(p) == {"link_gbps": 52.3, "uva_gbps": None, "vram_gbps": 3900.0, "decode_read_gbps": None,
                                "compute_tflops": None, "device_memory_bytes": 150_119_071_744,
                                "compute_capability": None,  # a profile from before the card was recorded
                                "cpu_kernel_gbps": None, "cpu_threads": None, "handoff_s": None}
    assert plan_defaults(gpu_profile(compute_capability="9.0"))["compute_capability"] == "9.0"
    assert describe(p) == ("link 52.3 GB/s pinned, VRAM 3900 GB/s, device memory 139.81 GiB measured by "
                           "`selective-offload probe` on 2026-12-01, NVIDIA H200")
    # a profile that measured UVA reads and the matmul rate supplies them too
    q = gpu_profile(uva_read_gbps=40.1, uva_read_samples_s={GiB: GiB / 40.1e9}, matmul_tflops=701.0,
                    matmul_dtype="bfloat16")
    assert plan_defaults(q)["uva_gbps"] == 40.1 and plan_defaults(q)["compute_tflops"] == 701.0
    assert describe(q).startswith("link 52.3 GB/s pinned, UVA reads 40.1 GB/s, VRAM 3900 GB/s, matmul 701 TFLOP/s")
    text = q.render()
    assert "UVA reads      40.1 GB/s (a kernel reading 1 GiB of page-locked host memory in place, 0.77x the " \
           "pinned copy)" in text
    assert "matmul         701 TFLOP/s (bfloat16, compute-bound size)" in text
    assert "--link-gbps 52.3 --uva-gbps 40.1 --vram-gbps 3900 --compute-tflops 701" in text
    # a measured decode read rate is what planning prices VRAM reads at, beside the copy's
    r = gpu_profile(decode_read_gbps=3100.0)
    assert plan_defaults(r)["decode_read_gbps"] == 3100.0 and plan_defaults(r)["vram_gbps"] == 3900.0
    assert "--vram-gbps 3900 --decode-read-gbps 3100" in r.render()
    assert "VRAM 3900 GB/s, decode reads 3100 GB/s" in describe(r)
    assert "decode reads   3100 GB/s (a bf16 matrix-vector product reading its weight once" in r.render()
    assert describe(gpu_profile(integrated=True)).endswith("NVIDIA H200, integrated")


def test_plan_defaults_feed_plan_inputs():
    supplied = {k: v for k, v in plan_defaults(gpu_profile()).items() if v is not None}
    inputs = PlanInputs(**supplied)
    inputs.validate()
    assert inputs.link_gbps == 52.3 and inputs.device_memory_bytes == 150_119_071_744
    measured = gpu_profile(uva_read_gbps=40.1, matmul_tflops=701.0, matmul_dtype="bfloat16")
    inputs = PlanInputs(**{k: v for k, v in plan_defaults(measured).items() if v is not None})
    inputs.validate()
    assert inputs.uva_read_gbps == 40.1 and inputs.compute_tflops == 701.0


def test_render_says_which_kernels_are_claimed_on_this_host():
    """With the host's read rate, the probe's summary gives each kernel's ratio to it and the
    formats a plan made from this profile claims there (``claimed.verdict``'s bar)."""
    text = gpu_profile(cpu_kernel_gbps={"bf16": 30.0, "int4": 10.0}, cpu_threads=8, host_read_gbps=40.0).render()
    assert "of reads     bf16 0.75, int4 0.25; claimed fast on this host (at least 0.6): bf16" in text
    text = gpu_profile(cpu_kernel_gbps={"int4": 10.0}, cpu_threads=8, host_read_gbps=40.0).render()
    assert "claimed fast on this host (at least 0.6): none" in text
    assert "of reads" not in gpu_profile(cpu_kernel_gbps={"int4": 10.0}, cpu_threads=8).render()


def test_render_of_a_gpu_profile():
    text = gpu_profile().render()
    assert "NVIDIA H200 (discrete)" in text
    assert "52.3 GB/s pinned, 19.8 GB/s pageable (1 GiB copies, median of 5)" in text
    assert "VRAM           3900 GB/s (device-to-device copy, bytes read + written)" in text
    assert "150.12 GB (139.81 GiB) total, 149.00 GB free at probe" in text
    assert "for planning   selective-offload plan MODEL --link-gbps 52.3 --vram-gbps 3900 --device-memory 150119071744" in text
    # per size: pinned 64 MiB at 0.0013 s is 51.6 GB/s; d2d counts read + write
    assert "h2d_pinned    64 MiB 51.6, 1 GiB 52.4 GB/s" in text
    assert "d2d           64 MiB 3728, 1 GiB 3897 GB/s" in text


# --------------------------------------------------------------------------- the command


def _args(argv):
    parser = argparse.ArgumentParser(prog="selective-offload probe")
    add_probe_arguments(parser)
    return parser.parse_args(argv)


def test_probe_arguments_and_their_defaults():
    args = _args([])
    assert args.output is None and args.quick is False and args.device is None
    args = _args(["--output", "x.json", "--quick", "--device", "cpu"])
    assert (args.output, args.quick, args.device) == ("x.json", True, "cpu")


def test_run_probe_end_to_end(tmp_path, capsys):
    out = tmp_path / "sub" / "profile.json"
    assert run_probe(_args(["--output", str(out), "--quick", "--device", "cpu"])) == 0
    printed = capsys.readouterr().out
    lines = printed.splitlines()
    assert lines[0].startswith("selective-offload probe (selective-offload/profile-v1) on ")
    assert lines[0].endswith(": quick (small copies, rates understated)")
    assert any(line.startswith("  device         none (no GPU)") for line in lines)
    assert any(line.startswith("  link (H2D)     none: ") for line in lines)
    memcpy = next(line for line in lines if line.startswith("  host memcpy    "))
    assert "GB/s (host-to-host copy, bytes read + written) (64 MiB copies, median of 3)" in memcpy
    assert any(line.startswith("    host_memcpy   4 MiB ") for line in lines)
    planning = [line for line in lines if line.startswith("  for planning   ")]
    assert len(planning) == 1 and "--cpu-threads" in planning[0]
    assert lines[lines.index(planning[0]) + 1].strip().startswith("no GPU, so no link or VRAM")  # quick: no --cpu-gbps
    assert lines[-1].startswith("measured in ") and lines[-1].endswith(f"; profile written to {out}")
    profile = Profile.load(out)
    assert profile.host_memcpy_gbps > 0 and profile.no_link_reason
    assert profile.render() in printed


def test_a_long_probe_says_what_it_measures_on_stderr(tmp_path, monkeypatch, capsys):
    """A probe that outlasts ``PROGRESS_AFTER_S`` says what it measures and when it is done,
    on stderr (stdout keeps the profile's summary alone); a quick one says nothing there."""

    assert run_probe(_args(["--output", str(tmp_path / "q.json"), "--quick", "--device", "cpu"])) == 0
    assert "measuring" not in capsys.readouterr().err
    real = command.measure

    def slow(**kw):
        time_.sleep(0.3)
        return real(**kw)

    monkeypatch.setattr(command, "measure", slow)
    monkeypatch.setattr(command, "PROGRESS_AFTER_S", 0.05)
    assert run_probe(_args(["--output", str(tmp_path / "p.json"), "--quick", "--device", "cpu"])) == 0
    out, err = capsys.readouterr()
    assert err.startswith("selective-offload probe: measuring this machine (copies, device reads, and the host CPU "
                          "kernels on each format's layer) ...\n"), err
    assert "selective-offload probe: measuring this machine: done in " in err and "measuring" not in out


def test_run_probe_writes_to_the_default_path(tmp_path, monkeypatch, capsys):
    target = tmp_path / "env.json"
    monkeypatch.setenv(PROFILE_ENV, str(target))
    assert run_probe(_args(["--quick", "--device", "cpu"])) == 0
    assert capsys.readouterr().out.rstrip().endswith(f"profile written to {target}")
    assert load_profile() is not None and math.isfinite(load_profile().host_memcpy_gbps)


def test_run_probe_failures_are_one_line(tmp_path):
    with pytest.raises(UserError) as exc:
        run_probe(_args(["--output", str(tmp_path / "p.json"), "--quick", "--device", "bogus:device"]))
    assert "\n" not in str(exc.value) and "--device" in str(exc.value)
    assert not (tmp_path / "p.json").exists()
