"""scripts/mutations.py stays runnable: every mutation names a file that exists, a function
in it (or none: module level, and C and shell files), a text that occurs exactly once in
that function, and tests that exist. A mutation whose text was edited away, or whose
function moved to another file, would print an error instead of breaking its line, and the
claim that each key line has a test that catches it would go unchecked."""

import ast
import runpy

import pytest

from helpers import REPO

TOOL = runpy.run_path(str(REPO / "scripts" / "mutations.py"), run_name="not_main")
MUTATIONS = TOOL["MUTATIONS"]


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_each_mutation_finds_its_file_function_and_text_once(name):
    file, function, old, new, _ = MUTATIONS[name]
    assert old != new, f"{name}: the mutation changes nothing"
    assert function is None or file.endswith(".py"), f"{name}: only a Python file is keyed by function"
    TOOL["locate"](name)  # raises LookupError naming what is missing
    path, text, broken = TOOL["mutated"](name)
    assert broken != text
    if path.suffix == ".py":
        ast.parse(broken)  # a mutation breaks behaviour, not the file's syntax


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_each_mutation_names_tests_that_exist(name):
    tests = MUTATIONS[name][4]
    assert tests, f"{name}: names no test that catches it"
    for node in tests:
        path, _, function = node.partition("::")
        source = REPO / path
        assert source.is_file(), f"{name}: {path} does not exist"
        function = function.split("[", 1)[0]  # one parameter of a parametrized test
        assert not function or f"def {function}(" in source.read_text(), f"{name}: {node} does not exist"


def test_a_text_found_twice_in_its_function_or_a_function_gone_is_refused(tmp_path, monkeypatch):
    """The two ways an entry goes stale are errors that say what to update, not a silent miss."""
    module = tmp_path / "m.py"
    module.write_text("def f(x):\n    y = x + 1\n    return x + 1\n\n\ndef g(x):\n    return x + 1\n")
    monkeypatch.setitem(TOOL["locate"].__globals__, "ROOT", tmp_path)
    table = TOOL["MUTATIONS"]
    monkeypatch.setitem(table, "t-once", ("m.py", "g", "x + 1", "x", ["tests"]))
    monkeypatch.setitem(table, "t-twice", ("m.py", "f", "x + 1", "x", ["tests"]))
    monkeypatch.setitem(table, "t-gone", ("m.py", "h", "x + 1", "x", ["tests"]))
    _, text, broken = TOOL["mutated"]("t-once")
    assert broken == text[:text.index("def g")] + "def g(x):\n    return x\n"
    with pytest.raises(LookupError, match="occurs 2 times in m.py's f"):
        TOOL["locate"]("t-twice")
    with pytest.raises(LookupError, match="has no function h"):
        TOOL["locate"]("t-gone")


def test_no_marker_is_left_in_the_code():
    """Mutations are keyed in scripts/mutations.py alone; a ``# mutation:`` comment in the
    code would be a second key that nothing reads."""
    left = []
    for folder in ("selective_offload", "benchmarks", "scripts"):
        for path in (REPO / folder).rglob("*"):
            if path.suffix in (".py", ".sh", ".c", ".h") and path.is_file() and path.name != "mutations.py":
                left += [f"{path.relative_to(REPO)}:{i + 1}" for i, line in enumerate(path.read_text().split("\n"))
                         if line.lstrip().startswith(("# mutation:", "// mutation:"))]
    assert left == []
