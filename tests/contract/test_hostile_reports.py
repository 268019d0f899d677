"""Report files and last-report records as a hostile user hands them, searched by hypothesis.

The contract of ``selective-offload report`` (through ``cli.main``, as the console script
calls it): bad input is exit 2 with one line on stderr naming the file, in text and in
``--json`` alike; exit 1 ("does not match") is only ever a verdict on a report that was
read, and a rank set that cannot vouch for every rank is a named problem in it. Never a
traceback (an exception out of ``main`` fails the test), never a hang.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import tempfile
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from selective_offload.cli import main
from selective_offload.jsonio import MAX_DEPTH, MAX_INT
from selective_offload.report import GroupLanding, LandingReport

REFUSED = 2


def a_report(world_size: int | None = 1) -> dict:
    groups = [GroupLanding("model.embed_tokens", "gather", "gather", 2048, host_bytes=2048,
                           routed_bytes=2048, num_params=1, mechanism="host gather"),
              GroupLanding("model.layers.0", "device", "device", 4096, device_bytes=4096, num_params=3)]
    report = LandingReport("fp", "cuda:0", False, groups, planned_cold_on_host_bytes=2048,
                             loaded_cold_on_host_bytes=2048, landed_cold_on_host_bytes=2048, world_size=world_size)
    report.host_memory = {"policy": "register", "reason": "r", "page_locked_bytes": 2048, "registered_bytes": 2048,
                          "torch_pinned_bytes": None, "by_purpose": {"cold": 2048}, "host_bytes": 2048,
                          "page_locked_to_host_ratio": 1.0, "resident_set_bytes": None}
    report.unplanned = {"x.bias": 4}
    report.ranks = {"rank1": {"ok": True, "landed_cold_on_host_bytes": 0, "landed_prefetch_bytes": 0,
                              "landed_uva_bytes": 0, "problems": [], "error": None}}
    return report.to_dict()


def cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(args))
    return rc, out.getvalue(), err.getvalue()


def assert_refused(path: Path) -> None:
    """Exit 2, one line naming the file, and the same in text and in --json."""
    for args in (["report", str(path)], ["report", str(path), "--json"]):
        rc, out, err = cli(*args)
        assert rc == REFUSED and out == "", (args, rc, out, err)
        lines = err.splitlines()
        assert len(lines) == 1 and lines[0].startswith("selective-offload: error: "), err
        assert str(path) in lines[0]


def assert_read_and_agreed(path: Path) -> int:
    """A report that was read: text and --json give one verdict, the exit status says it."""
    rc, out, err = cli("report", str(path))
    rc_json, out_json, _ = cli("report", str(path), "--json")
    assert rc in (0, 1) and err == "" and rc_json == rc
    assert json.loads(out_json)["ok"] is (rc == 0)
    first = out.splitlines()[0]
    assert first == "placement matches the plan" if rc == 0 else first.startswith(
        ("placement does NOT match the plan", "PLAN NOT APPLIED: "))
    return rc


json_leaves = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                        st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=8))
json_values = st.recursive(json_leaves, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                                  st.dictionaries(st.text(max_size=5), inner,
                                                                                  max_size=3)),
                           max_leaves=8)


def _is_int(v, minimum=0) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and minimum <= v <= MAX_INT


#: Where in a report a field is, and what it must hold.
FIELDS = {
    ("model_fingerprint",): lambda v: isinstance(v, str),
    ("compute_device",): lambda v: isinstance(v, str),
    ("host_is_device",): lambda v: isinstance(v, bool),
    ("planned_cold_on_host_bytes",): _is_int,
    ("landed_uva_bytes",): _is_int,
    ("est_link_bytes_per_step",): _is_int,
    ("world_size",): lambda v: v is None or _is_int(v, 1),
    ("error",): lambda v: v is None or isinstance(v, str),
    ("problems",): lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
    ("notes",): lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
    ("unplanned", "x.bias"): _is_int,
    ("groups",): lambda v: v == [],
    ("groups", 0): lambda v: False,  # any other value than a group object
    ("groups", 0, "group"): lambda v: isinstance(v, str) and v != "",
    ("groups", 1, "planned_bytes"): _is_int,
    ("groups", 0, "host_bytes"): _is_int,
    ("groups", 0, "mechanism"): lambda v: isinstance(v, str),
    ("host_memory", "policy"): lambda v: isinstance(v, str),
    ("host_memory", "page_locked_to_host_ratio"): lambda v: v is None or (
        isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 1e18),
    ("host_memory", "resident_set_bytes"): lambda v: v is None or _is_int(v),
    ("ranks", "rank1", "ok"): lambda v: isinstance(v, bool),
    ("ranks", "rank1", "problems"): lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
}


def put(data, where, value):
    for key in where[:-1]:
        data = data[key]
    data[where[-1]] = value


@st.composite
def wrong_fields(draw):
    where = draw(st.sampled_from(sorted(FIELDS, key=str)))
    value = draw(json_values.filter(lambda v: not FIELDS[where](v)))
    return where, value


@contextlib.contextmanager
def report_file(content: str | bytes):
    """``content`` written as a report file in a folder of its own (hypothesis runs a test
    many times in one function-scoped tmp_path)."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "report.json"
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        yield path


@given(wrong_fields())
def test_a_field_of_another_type_is_refused_in_one_line(case):
    where, value = case
    data = a_report()
    put(data, where, value)
    with report_file(json.dumps(data)) as path:
        assert_refused(path)


@given(json_values)
def test_any_json_that_is_not_a_report_is_refused(value):
    with report_file(json.dumps(value)) as path:
        assert_refused(path)


@given(st.dictionaries(st.sampled_from(sorted(a_report())), json_values, max_size=6))
def test_a_report_with_random_fields_is_refused_or_read_and_text_and_json_agree(fields):
    data = {**a_report(), **fields, "format": "selective-offload/report-v2"}
    with report_file(json.dumps(data)) as path:
        rc, _, _ = cli("report", str(path))
        if rc == REFUSED:
            assert_refused(path)
        else:
            assert_read_and_agreed(path)


@given(st.integers(1, 5000))
def test_nesting_is_read_within_the_bound_and_refused_beyond_it(depth):
    """Counters (``transfers``) may hold any object: nesting decides alone."""
    text = json.dumps({**a_report(), "transfers": {"g": {"c": "@"}}})
    with report_file(text.replace('"@"', "[" * depth + "]" * depth)) as path:
        if 3 + depth <= MAX_DEPTH:
            assert assert_read_and_agreed(path) == 0
        else:
            assert_refused(path)


@given(st.sampled_from(["planned_cold_on_host_bytes", "world_size", "groups.0.host_bytes"]),
       st.one_of(st.integers(17, 6000).map(lambda n: "9" * n), st.integers(17, 6000).map(lambda n: "-" + "9" * n),
                 st.integers(300, 6000).map(lambda n: f"1e{n}"), st.just("1.5"), st.just("NaN"),
                 st.just("Infinity")))
def test_huge_and_odd_numbers_are_refused(field, number):
    data = a_report()
    put(data, tuple(int(k) if k.isdigit() else k for k in field.split(".")), "@")
    with report_file(json.dumps(data).replace('"@"', number)) as path:
        assert_refused(path)


@given(st.binary(max_size=200), st.integers(0, 400))
def test_bytes_that_are_not_utf8_are_refused(noise, at):
    text = json.dumps(a_report()).encode()
    raw = text[:at] + b"\xff" + noise + text[at:]
    with report_file(raw) as path:
        assert_refused(path)


RANK_SUFFIXES = ["1", "2", "3", "4", "0", "00", "01", "001", "6", "1234567890123"]


@given(st.sets(st.sampled_from(RANK_SUFFIXES), max_size=5), st.one_of(st.none(), st.integers(1, 5)))
def test_a_rank_set_that_is_not_every_rank_once_is_a_named_problem(suffixes, world):
    """Each rank file a valid report of ``world`` ranks (``None``: an older release's, no
    world size): the placement matches only when the files are exactly ranks 1..world-1 by
    their own names; otherwise each missing, extra or misnamed file is named in a problem."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "report.json"
        for suffix in ["", *suffixes]:
            Path(f"{path}.rank{suffix}" if suffix else path).write_text(json.dumps({**a_report(world), "ranks": {}}))
        canonical = {s for s in suffixes if s.isdigit() and str(int(s)) == s and s != "0" and len(s) < 10}
        top = world if world is not None else max(map(int, canonical), default=0) + 1
        expected = {str(k) for k in range(1, top)}
        rc, out, err = cli("report", str(path))
        assert err == "" and rc == (0 if suffixes == expected else 1), out
        problems = "\n".join(line for line in out.splitlines() if line.startswith("PLAN NOT REALISED"))
        for suffix in suffixes ^ expected:
            assert f"report.json.rank{suffix}" in problems, (suffix, out)
        assert assert_read_and_agreed(path) == rc


@given(st.binary(max_size=300))
def test_any_bytes_in_the_last_report_record_are_one_line(raw):
    """The record names no report that exists here, so every content is refused: one line."""
    with tempfile.TemporaryDirectory() as d:
        record = Path(d) / "last-report"
        record.write_bytes(raw)
        saved = {k: os.environ.get(k) for k in ("SELECTIVE_OFFLOAD_LAST_REPORT", "SELECTIVE_OFFLOAD_REPORT")}
        os.environ["SELECTIVE_OFFLOAD_LAST_REPORT"], os.environ["SELECTIVE_OFFLOAD_REPORT"] = str(record), ""
        try:
            rc, out, err = cli("report")
        finally:
            for k, v in saved.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
        assert rc == REFUSED and out == "" and len(err.splitlines()) == 1, err
