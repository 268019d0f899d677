"""jsonio.FieldReader, the one typed reader of every JSON input (plans, reports, probe
profiles, quantization configs): each read's accepted values, and each refusal as one line
naming the file, the field, what it is, what it must be, and the fix."""

from __future__ import annotations

import pytest

from selective_offload.jsonio import FieldReader, json_text


class Bad(Exception):
    pass


def reader(data, path="", **kw) -> FieldReader:
    return FieldReader(data, "f.json", path, error=Bad, fix="do X", **kw)


def refused(call) -> str:
    with pytest.raises(Bad) as info:
        call()
    message = str(info.value)
    assert "\n" not in message and message.startswith("f.json: ") and message.endswith("; do X"), message
    return message


def test_nullable_allows_null_but_not_absence():
    r = reader({"a": None, "b": None})
    assert r.number("a", nullable=True) is None and r.int("b", nullable=True) is None
    assert "is missing" in refused(lambda: r.number("c", nullable=True))
    message = refused(lambda: reader({"a": "x"}).number("a", nullable=True))
    assert message.endswith(", or null; do X"), message
    assert "a is null" in refused(lambda: reader({"a": None}).number("a"))


def test_optional_allows_absence():
    r = reader({})
    assert r.number("x", optional=True) is None and r.int("y", optional=True) is None
    assert r.str("z", default=None, nullable=True) is None


@pytest.mark.parametrize("value", [0, 2e6, -1, True, "5", 10**400])
def test_a_bounded_number_refuses_what_is_outside_its_bounds_saying_them(value):
    message = refused(lambda: reader({"rate": value}).number("rate", minimum=1e-3, maximum=1e6, unit="GB/s"))
    assert "rate is " in message and "must be a number of GB/s from 0.001 to 1e+06" in message


def test_a_bounded_number_keeps_what_is_inside():
    r = reader({"a": 1e-3, "b": 1e6, "c": 3})
    assert (r.number("a", minimum=1e-3, maximum=1e6), r.number("b", minimum=1e-3, maximum=1e6)) == (1e-3, 1e6)
    assert r.number("c", positive=True, maximum=3) == 3.0 and isinstance(r.number("c", positive=True), float)
    assert "> 0 and at most 1" in refused(lambda: reader({"s": 0}).number("s", positive=True, maximum=1.0))
    assert "> 0 and at most 1" in refused(lambda: reader({"s": 1.5}).number("s", positive=True, maximum=1.0))


def test_an_int_with_a_maximum_a_unit_and_an_allowed_sentinel():
    r = reader({"n": 4096, "g": -1, "h": -2})
    assert r.int("n", minimum=1, maximum=4096, unit="threads") == 4096
    assert r.int("g", minimum=1, allow=(-1,)) == -1
    message = refused(lambda: r.int("h", minimum=1, allow=(-1,)))
    assert "h is -2, but must be an integer >= 1" in message and "(or -1)" in message
    message = refused(lambda: reader({"n": 4097}).int("n", minimum=1, maximum=4096, unit="threads"))
    assert "must be a whole number of threads from 1 to 4096" in message


def test_an_int_written_as_text_counts_only_when_asked():
    assert reader({"b": "4"}).int("b", text=True) == 4
    assert reader({"b": "-1"}).int("b", minimum=1, allow=(-1,), text=True) == -1
    assert 'b is "4"' in refused(lambda: reader({"b": "4"}).int("b"))
    for text in ("four", "4.0", "9" * 5000):
        assert "b is " in refused(lambda: reader({"b": text}).int("b", text=True))


@pytest.mark.parametrize("value", ["", "  ", "a\nb", "a\rb", 7, None])
def test_a_one_line_string_is_not_blank_and_has_no_line_break(value):
    message = refused(lambda: reader({"name": value}).str("name", one_line=True))
    assert "but must be a one-line string" in message and "\n" not in message


def test_a_one_line_string_may_be_null_when_nullable():
    r = reader({"name": None, "other": "gpu 0"})
    assert r.str("name", one_line=True, nullable=True) is None
    assert r.str("other", one_line=True, nullable=True) == "gpu 0"


def test_an_int_list_of_a_given_length():
    assert reader({"b": [128, 64]}).int_list("b", length=2, minimum=1) == (128, 64)
    for value in ([128], [128, 0], [1, True], "128", [1.0, 2]):
        message = refused(lambda: reader({"b": value}).int_list("b", length=2, minimum=1))
        assert "must be a list of 2 integers from 1 to" in message


def test_a_str_list_says_what_its_strings_are():
    assert reader({"m": ["a", "b"]}).str_list("m", of="module names") == ("a", "b")
    assert "must be a list of module names" in refused(lambda: reader({"m": [1]}).str_list("m", of="module names"))


def test_an_object_and_a_reader_within_it_name_the_path():
    r = reader({"groups": {"g0": {"bits": "x"}}, "flat": 3})
    groups = r.within(r.object("groups"), "groups")
    message = refused(lambda: groups.within(groups.data["g0"], "g0").int("bits"))
    assert "groups.g0.bits is \"x\"" in message
    assert "flat is 3, but must be an object of things" in refused(lambda: r.object("flat", what="an object of things"))
    assert "groups.g0: must be an object, not a list" in refused(lambda: groups.within([1], "g0"))


def test_failures_at_the_top_name_the_file_alone():
    assert refused(lambda: reader([1])) == "f.json: must be an object, not a list; do X"
    assert str(reader({}).error_for("odd")) == "f.json: odd; do X"
    assert str(reader({}, path="a.b").error_for("odd")) == "f.json: a.b: odd; do X"


def test_a_hostile_name_or_value_is_cut_in_the_message():
    key = "k" * 5000
    message = refused(lambda: reader({key: "v" * 10**6}).int(key))
    assert len(message) < 300 and "..." in message


def test_json_text_spells_values_as_json():
    assert (json_text("a"), json_text(True), json_text(None), json_text(float("inf"))) == ('"a"', "true", "null", "inf")
