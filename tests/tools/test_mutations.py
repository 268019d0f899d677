"""scripts/mutations.py stays runnable: every mutation's marker stands once in the tree, with
its text once in the lines after it, and every marker names a known mutation. A mutation
whose text was edited away would print an error instead of breaking its line, and the claim
that each key line has a test that catches it would go unchecked (this happened once, to
``no-routing``, when mutations were still keyed by exact file text)."""

import runpy
from pathlib import Path

import pytest
from helpers import REPO

ROOT = REPO
TOOL = runpy.run_path(str(ROOT / "scripts" / "mutations.py"), run_name="not_main")
MUTATIONS = TOOL["MUTATIONS"]
FOUND = TOOL["markers"]()


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_each_mutation_finds_its_marker_and_text_once(name):
    old, new, _ = MUTATIONS[name]
    assert old != new, f"{name}: the mutation changes nothing"
    TOOL["locate"](name, FOUND)  # raises LookupError naming what is missing
    path, text, broken = TOOL["mutated"](name)
    assert broken != text


def test_every_marker_names_a_known_mutation():
    assert sorted(set(FOUND) - set(MUTATIONS)) == []


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_each_mutation_names_tests_that_exist(name):
    tests = MUTATIONS[name][2]
    assert tests, f"{name}: names no test that catches it"
    for node in tests:
        path, _, function = node.partition("::")
        source = REPO / path
        assert source.is_file(), f"{name}: {path} does not exist"
        function = function.split("[", 1)[0]  # one parameter of a parametrized test
        assert not function or f"def {function}(" in source.read_text(), f"{name}: {node} does not exist"
