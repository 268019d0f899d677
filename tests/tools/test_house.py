"""The package's shape, kept by a test: no import circles, and vLLM imported only by the glue.
Read from the source with ``ast``, imports inside functions included: moving one side of a
circle into a function hides it, it does not end it. (One reason to change per file is the
third rule, CONTRIBUTING.md's; no count of lines measures it, so no test holds it.)"""

from __future__ import annotations

import ast
from pathlib import Path

from helpers import REPO
from selective_offload.log import LOGGER_NAME

PACKAGE = REPO / "selective_offload"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Modules of the package that PATH imports anywhere, resolved to module names."""
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return {m for m in found if m.startswith("selective_offload")}


def graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    edges = {}
    for name, path in modules.items():
        targets = set()
        for m in imports_of(path):
            while m and m not in modules:
                m = m.rpartition(".")[0]
            if m and m != name and not name.startswith(m + "."):  # a package's own __init__ is not a cycle
                targets.add(m)
        edges[name] = targets
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    found, state, stack = [], {}, []

    def visit(n: str) -> None:
        state[n] = 1
        stack.append(n)
        for m in sorted(edges.get(n, ())):
            if state.get(m) == 1:
                found.append(stack[stack.index(m):] + [m])
            elif m not in state:
                visit(m)
        stack.pop()
        state[n] = 2

    for n in sorted(edges):
        if n not in state:
            visit(n)
    return found


def test_the_package_has_no_import_circle():
    assert cycles(graph()) == []


def benchmark_graph() -> dict[str, set[str]]:
    """The benchmark modules (the package ``benchmarks``) and what each imports of it."""
    root = REPO / "benchmarks"
    modules = {".".join(("benchmarks", *p.relative_to(root).with_suffix("").parts)).removesuffix(".__init__"): p
               for p in root.rglob("*.py")}
    edges = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                found.add(node.module)
                found.update(f"{node.module}.{a.name}" for a in node.names)
        edges[name] = {m for m in found if m in modules and m != name and not name.startswith(m + ".")}
    return edges


def test_the_benchmarks_have_no_import_circle():
    assert cycles(benchmark_graph()) == []


def test_the_circle_finder_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]


def test_only_the_glue_imports_vllm():
    outside = []
    for path in PACKAGE.rglob("*.py"):
        if "vllm_glue" in path.relative_to(PACKAGE).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            outside += [f"{path.relative_to(REPO)}: {n}" for n in names if n.split(".")[0] == "vllm"]
    assert outside == []


def logger_names(path: Path) -> list[str]:
    """The first argument of every ``getLogger``/``init_logger`` call in ``path``, as written."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
                "getLogger", "init_logger"):
            found.append(ast.unparse(node.args[0]) if node.args else "<root>")
    return found


def test_the_package_logs_through_one_logger_under_vllms_name():
    """vLLM formats and routes the lines of loggers under ``vllm``; one name means one switch."""
    assert LOGGER_NAME.startswith("vllm.")
    calls = {str(p.relative_to(REPO)): logger_names(p) for p in PACKAGE.rglob("*.py") if logger_names(p)}
    assert calls == {"selective_offload/log.py": ["LOGGER_NAME"]}, calls
