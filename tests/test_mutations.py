"""scripts/mutations.py stays runnable: every mutation names a file that exists and a piece of
source text that occurs in it exactly once. A mutation whose text was edited away would
print an error instead of breaking its line, and the claim that each key line has a test
that catches it would go unchecked (this happened once, to ``no-routing``)."""

import runpy
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MUTATIONS = runpy.run_path(str(ROOT / "scripts" / "mutations.py"), run_name="not_main")["MUTATIONS"]


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_each_mutation_still_finds_its_line_once(name):
    path, old, new = MUTATIONS[name]
    source = ROOT / path
    assert source.is_file(), f"{name}: {path} does not exist"
    assert old != new, f"{name}: the mutation changes nothing"
    count = source.read_text().count(old)
    assert count == 1, f"{name}: its text occurs {count} times in {path}, not once; update the mutation"
