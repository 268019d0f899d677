"""The probe profile under hostile input: ``$SELECTIVE_OFFLOAD_PROFILE`` names a file that
``plan`` and ``SELECTIVE_OFFLOAD_PLAN=auto`` read on every run, so whatever is there (a FIFO,
a 1 GiB file, random bytes, deep nesting, numbers of thousands of digits, fields of other
types) must be one line naming the variable and what to do, in bounded time and memory,
never a hang or a traceback.

The named tests are the issue's cases as a user meets them (the CLI's exit 2); the property
tests search many generated files for any other exception, a second line, or a long one."""

from __future__ import annotations

import json
import os
import threading
import time
import tracemalloc

import pytest
from hypothesis import given
from hypothesis import strategies as st

from helpers import write_header_only
from selective_offload.cli import EXIT_USAGE, main
from selective_offload.errors import UserError
from selective_offload.probe import PROFILE_ENV, Profile, command, load_profile
from selective_offload.probe.profile import MAX_PROFILE_BYTES, PROFILE_FIELDS

#: A message longer than this is not one line a person reads.
MAX_MESSAGE = 600

GOOD = {"format": "selective-offload/profile-v1", "machine": "m", "date": "2026-12-01T10:00:00",
        "torch_version": "2", "device": None, "integrated": False, "link_gbps_pinned": None,
        "link_gbps_pageable": None, "vram_gbps": None, "device_memory_total_bytes": None,
        "device_memory_free_bytes": None, "host_memcpy_gbps": 5.0, "no_link_reason": "no GPU"}


def plan_refuses(capsys, tmp_path, match) -> str:
    """`selective-offload plan MODEL` with the profile variable set: exit 2, one line."""
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    write_header_only(model / "model.safetensors", {"model.layers.0.w": ("BF16", [4, 4])})
    code = main(["plan", str(model), "--device-memory", "24GiB"])
    _, err = capsys.readouterr()
    assert code == EXIT_USAGE, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert match in err and PROFILE_ENV in err, err
    return err


def within(seconds: float, call):
    """``call()``'s result or exception, failing the test if it takes longer than ``seconds``."""
    box: dict = {}

    def run():
        try:
            box["value"] = call()
        except BaseException as exc:  # noqa: BLE001 - handed to the test below
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    return thread, box


def test_a_fifo_profile_is_refused_without_opening_it(capsys, tmp_path, monkeypatch):
    """A FIFO hung `plan` (opening one for reading waits for a writer): it is not a regular
    file, so it is refused before it is opened."""
    fifo = tmp_path / "profile.json"
    os.mkfifo(fifo)
    monkeypatch.setenv(PROFILE_ENV, str(fifo))
    thread, box = within(10, load_profile)
    if thread.is_alive():  # unblock the reader so the test process can end, then fail
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(5)
        pytest.fail("reading a FIFO profile hung")
    assert isinstance(box.get("error"), UserError), box
    assert "not a regular file" in str(box["error"])
    plan_refuses(capsys, tmp_path, "not a regular file")


def test_a_one_gib_profile_is_refused_reading_no_more_than_the_bound(capsys, tmp_path, monkeypatch):
    """A 1 GiB profile was read whole (2.3 GB peak): the reader stops past the bound."""
    huge = tmp_path / "profile.json"
    with huge.open("wb") as f:  # sparse: no disk used, but a reader of the whole file reads 1 GiB
        f.truncate(2**30)
    monkeypatch.setenv(PROFILE_ENV, str(huge))
    tracemalloc.start()
    try:
        started = time.perf_counter()
        with pytest.raises(UserError, match=f"larger than {MAX_PROFILE_BYTES} bytes"):
            load_profile()
        elapsed = time.perf_counter() - started
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 * MAX_PROFILE_BYTES, peak
    assert elapsed < 5, elapsed
    err = plan_refuses(capsys, tmp_path, "larger than")
    assert "unset it" in err


def test_a_directory_or_unreadable_profile_names_the_variable(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv(PROFILE_ENV, str(tmp_path))
    plan_refuses(capsys, tmp_path, "not a regular file")


def test_a_profile_named_as_an_argument_is_not_blamed_on_the_variable(tmp_path, monkeypatch):
    monkeypatch.delenv(PROFILE_ENV, raising=False)
    bad = tmp_path / "p.json"
    bad.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(UserError) as info:
        load_profile(bad)
    assert PROFILE_ENV not in str(info.value) and str(bad) in str(info.value)


@pytest.mark.parametrize("case,says", [("into /proc", "cannot be written"), ("onto a directory", "is a directory")])
def test_a_probe_output_that_cannot_be_written_is_refused_before_measuring(capsys, tmp_path, monkeypatch, case, says):
    """`probe -o PATH` measured first (a minute on a GPU) and only then found it could not
    write the profile; the path is tried first, as plan's outputs are."""
    measured: list = []
    monkeypatch.setattr(command, "measure", lambda **kw: measured.append(kw) or pytest.fail("measured first"))
    target = "/proc/profile.json" if case == "into /proc" else str(tmp_path)
    code = main(["probe", "--quick", "-o", target])
    out, err = capsys.readouterr()
    assert code == EXIT_USAGE and not out, (code, out, err)
    assert err.count("\n") == 1 and err.startswith("selective-offload: error: --output ") and says in err, err
    assert target in err and measured == []


# --------------------------------------------------------------------------- property tests


def assert_one_line_or_a_profile(path) -> None:
    """The contract: a Profile, or a UserError of one bounded line; nothing else, quickly."""
    started = time.perf_counter()
    try:
        Profile.load(path, PROFILE_ENV)
    except UserError as exc:
        message = str(exc)
        assert "\n" not in message and "\r" not in message, message[:300]
        assert len(message) <= MAX_MESSAGE, message[:300]
        assert PROFILE_ENV in message, message[:300]
    assert time.perf_counter() - started < 5


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
                    | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                    max_leaves=12)


@given(st.binary(max_size=2000))
def test_random_bytes_are_one_line(tmp_path_factory, raw):
    path = tmp_path_factory.mktemp("p") / "profile.json"
    path.write_bytes(raw)
    assert_one_line_or_a_profile(path)


@given(st.integers(min_value=60, max_value=5000), st.sampled_from(["[", "{\"a\":"]))
def test_deep_nesting_is_one_line(tmp_path_factory, depth, opener):
    closer = "]" if opener == "[" else "}"
    path = tmp_path_factory.mktemp("p") / "profile.json"
    path.write_text(json.dumps({**GOOD, "x": None})[:-1] + ", \"deep\": " + opener * depth + "1" + closer * depth + "}")
    assert_one_line_or_a_profile(path)


@given(st.sampled_from(PROFILE_FIELDS), st.integers(min_value=1, max_value=20_000))
def test_numbers_of_many_digits_in_any_field_are_one_line(tmp_path_factory, name, digits):
    path = tmp_path_factory.mktemp("p") / "profile.json"
    text = json.dumps({**GOOD, name: 0}).replace(f"\"{name}\": 0", f"\"{name}\": {'9' * digits}", 1)
    path.write_text(text)
    assert_one_line_or_a_profile(path)


@given(st.sampled_from(PROFILE_FIELDS), JSON)
def test_any_value_in_any_field_is_one_line(tmp_path_factory, name, value):
    path = tmp_path_factory.mktemp("p") / "profile.json"
    path.write_text(json.dumps({**GOOD, name: value}))
    assert_one_line_or_a_profile(path)


#: Copy sizes as a profile's keys: any text, and integers that int() reads although padded
#: to thousands of characters (zeros, spaces, underscores), whose messages must still be short.
SIZE_KEYS = st.text(max_size=50) | st.builds(lambda pad, n: pad + str(n),
                                             st.sampled_from(["", "0" * 3000, " " * 3000, "1_" * 1500]),
                                             st.integers(min_value=-(10**30), max_value=10**30))


@given(st.sampled_from([f for f in PROFILE_FIELDS if f.endswith("_samples_s")]),
       st.dictionaries(SIZE_KEYS, JSON, max_size=3))
def test_any_samples_object_is_one_line(tmp_path_factory, name, samples):
    path = tmp_path_factory.mktemp("p") / "profile.json"
    path.write_text(json.dumps({**GOOD, name: samples}))
    assert_one_line_or_a_profile(path)


@given(st.text(min_size=1, max_size=200), st.sampled_from(["utf-16", "latin-1", "cp1252"]))
def test_other_encodings_are_one_line(tmp_path_factory, text, encoding):
    path = tmp_path_factory.mktemp("p") / "profile.json"
    path.write_bytes(json.dumps({**GOOD, "machine": text}, ensure_ascii=False).encode(encoding, "replace"))
    assert_one_line_or_a_profile(path)
