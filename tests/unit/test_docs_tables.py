"""The docs' tables the engine tests read from: docs/families.md's family table is
``helpers.FAMILY_TABLE`` rendered, and that table names what the engine tests run (each
family test_vllm_families parametrizes over with "yes" under the cold set and the
mechanism its plan serves the experts by, each other family's row in the engine test that
saves its tiny model); docs/usage/host-compute.md's numerics table is
``helpers.HOST_PATH_TOLERANCE`` rendered."""

from __future__ import annotations

from helpers import FAMILY_EXPERTS_SERVING, FAMILY_TABLE, HOST_PATH_TOLERANCE, MECHANISMS, REPO, TINY_MOE_FAMILIES


def render() -> str:
    lines = ["| family | " + " | ".join(MECHANISMS) + " | engine test |", "|---" * (len(MECHANISMS) + 2) + "|"]
    for name, test, cells in FAMILY_TABLE.values():
        lines.append(f"| {name} | " + " | ".join(cells[m] for m in MECHANISMS) + f" | {test or '-'} |")
    return "\n".join(lines) + "\n"


def test_the_docs_table_is_the_tests_table():
    assert render() in (REPO / "docs" / "families.md").read_text(), "rerun render() into docs/families.md"


def test_every_family_the_engine_tests_run_has_its_row():
    for family in TINY_MOE_FAMILIES:
        _, test, cells = FAMILY_TABLE[family]
        ran = {"cold set", FAMILY_EXPERTS_SERVING.get(family, "compute")}
        assert test == "test_vllm_families.py" and {m for m in MECHANISMS if cells[m] == "yes"} == ran, family
    for family, (_, test, cells) in FAMILY_TABLE.items():
        if family not in TINY_MOE_FAMILIES and test is not None:
            text = (REPO / "tests" / "engine" / test).read_text()
            assert f"save_tiny_{family}(" in text or f'"{family}": (' in text, family
        assert set(cells) == set(MECHANISMS) and (test is None) == all(c.startswith("not run") for c in cells.values())


def render_tolerances() -> str:
    lines = ["| host path | log-probability bound | why |", "|---|---|---|"]
    for path, t in HOST_PATH_TOLERANCE.items():
        bound = "the same tokens" if not t.logprob else f"{t.logprob:g}"
        if t.of_plain_rounding:
            bound += f", or {t.of_plain_rounding:g} x plain vLLM's bf16-vs-float32 distance if larger"
        lines.append(f"| {path} | {bound} | {t.reason} |")
    return "\n".join(lines) + "\n"


def test_the_numerics_table_is_the_tests_tolerances():
    text = (REPO / "docs" / "usage" / "host-compute.md").read_text()
    assert render_tolerances() in text, "rerun render_tolerances() into docs/usage/host-compute.md"
