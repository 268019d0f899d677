"""What a person reads: the README short, every link and quoted path real, the generated
tables current, and every command the README shows one the CLI accepts.

Why: documentation drifts silently. A page that names a file the repository lacks, a link
whose anchor was renamed, a variable read by the code and listed nowhere, or a quick-start
command whose option was renamed is caught here instead of by a user.
"""

from __future__ import annotations

import ast
import re
import shlex
import subprocess
from pathlib import Path

import pytest

import selective_offload
from helpers import REPO
from selective_offload import cli, options
from selective_offload.plan_options import PlanOptions

README = REPO / "README.md"
#: The pages a person reads, and the folders whose paths they may quote.
PAGES = sorted([README, REPO / "CONTRIBUTING.md", REPO / "patches" / "README.md", *(REPO / "docs").rglob("*.md")])
TOP = ("selective_offload/", "benchmarks/", "scripts/", "tests/", "docs/", "patches/", ".ci/")
README_MAX_LINES = 220


def tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    return out.splitlines()


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    body = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
    return {slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", body, flags=re.MULTILINE)}


def test_the_readme_is_one_screenful_of_purpose():
    lines = README.read_text().splitlines()
    assert len(lines) < README_MAX_LINES, f"README.md is {len(lines)} lines; move detail to docs/"
    headings = [line for line in lines if line.startswith("## ")]
    assert headings[:2] == ["## Quick start", "## Use"], headings


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_link_and_anchor_resolves(page):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(target)
    assert not broken, f"{page.relative_to(REPO)}: {broken}"


@pytest.mark.parametrize("page", [p for p in PAGES if p.parent.name != "patches"],
                         ids=lambda p: str(p.relative_to(REPO)))
def test_every_quoted_path_exists(page):
    """A path in backticks that starts at a top-level folder names a file or folder the
    repository has (globs, placeholders and results patterns aside; the patch's page quotes
    vLLM's tree, not ours)."""
    missing = []
    for quoted in re.findall(r"`([^`\s]+)`", page.read_text()):
        path = quoted.split("::")[0].rstrip(".,:;")
        if not path.startswith(TOP) or re.search(r"[*<>{}$\[]|\.\.\.", quoted):
            continue
        if not (REPO / path).exists():
            missing.append(path)
    assert not missing, f"{page.relative_to(REPO)} quotes paths that do not exist: {sorted(set(missing))}"


def test_nothing_cites_a_file_the_repository_lacks():
    """The project's reference material lives outside the repository; no tracked file may
    point a reader there."""
    outside = re.compile(r"\b(SPEC|FIELD|STYLE)\.md\b|\.\./shared/")
    hits = []
    for name in tracked():
        path = REPO / name
        if path.suffix in {".png", ".gz"} or name == "tests/tools/test_docs.py":
            continue
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        hits += [f"{name}:{i}" for i, line in enumerate(text.splitlines(), 1) if outside.search(line)]
    assert not hits, hits


def test_the_environment_tables_are_generated_and_complete():
    for page in (README, REPO / "docs" / "reference" / "environment.md"):
        text = page.read_text()
        assert text.count(options.ENVIRONMENT_BEGIN) == 1, page
        assert options.with_environment_table(text) == text, f"{page.name}: regenerate the environment table"
    listed = {name for name, _ in options.ENVIRONMENT}
    read = set()
    for name in tracked():
        if name.startswith(("selective_offload/", "scripts/", "benchmarks/")) and name.endswith((".py", ".sh")):
            read |= set(re.findall(r"SELECTIVE_OFFLOAD_[A-Z_]*[A-Z]", (REPO / name).read_text()))
    assert read and read <= listed, f"read but not documented: {sorted(read - listed)}"


def readme_commands() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.DOTALL)
    commands = []
    for block in blocks:
        for line in block.splitlines():
            line = line.split("  #")[0].strip()
            if line and not line.startswith("#"):
                commands.append(line)
    return commands


def test_every_readme_command_is_one_the_project_accepts():
    """Scripts exist, and each `selective-offload` line parses with the CLI's own parser
    (environment assignments and `vllm serve` aside, which the engine tests run)."""
    commands = readme_commands()
    assert any(c.startswith("bash scripts/demo.sh") for c in commands)
    assert any(c.startswith("bash scripts/test.sh") for c in commands)
    parser = cli.build_parser()
    checked = 0
    for command in commands:
        words = shlex.split(command)
        while words and re.match(r"^[A-Z_]+=", words[0]):
            words.pop(0)
        if words[:1] == ["bash"]:
            assert (REPO / words[1]).is_file(), command
            checked += 1
        elif words[:1] == ["selective-offload"]:
            parser.parse_args(words[1:])  # SystemExit on an unknown option or command
            checked += 1
    assert checked >= 4


def test_ci_runs_the_readme_test_command():
    ci = (REPO / ".ci" / "run").read_text()
    assert "scripts/test.sh" in ci
    assert any(c.startswith("bash scripts/test.sh") for c in readme_commands())


def python_calls(page: Path) -> list[ast.Call]:
    """The ``selective_offload.X(...)`` calls in ``page``'s Python blocks (``...`` allowed)."""
    calls = []
    for block in re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.DOTALL):
        tree = ast.parse(block, filename=str(page))  # a block that does not parse fails here
        calls += [node for node in ast.walk(tree) if isinstance(node, ast.Call)
                  and isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name)
                  and node.func.value.id == "selective_offload"]
    return calls


@pytest.mark.parametrize("page", [README, REPO / "docs" / "usage" / "vllm.md"], ids=lambda p: p.name)
def test_the_python_shown_calls_what_the_package_exports_with_options_it_takes(page):
    calls = python_calls(page)
    assert {c.func.attr for c in calls} >= {"plan", "enable"}
    for call in calls:
        assert call.func.attr in selective_offload.__all__, f"{page.name}: selective_offload.{call.func.attr}"
        if call.func.attr == "plan":
            PlanOptions.from_keywords({k.arg: ast.literal_eval(k.value) for k in call.keywords})


def test_the_readme_runs_its_bundled_plan_and_quotes_what_it_prints(capsys):
    """The README's `plan` of the bundled reference runs as shown, and the output it quotes
    (the verdict line and the `next:` lines) is what that command prints today."""
    runnable = [shlex.split(c) for c in readme_commands()
                if c.startswith("selective-offload plan qwen3.8-27b-fp8") and " -o " not in c]
    assert runnable, "the README shows no plan of the bundled reference that runs here"
    for words in runnable:
        assert cli.main(words[1:]) == 0
    printed = capsys.readouterr().out.splitlines()
    quoted = re.search(r"```\n(qwen3\.8-27b-fp8 on a .*?)```", README.read_text(), flags=re.DOTALL)
    assert quoted, "the README quotes no plan output"
    shown = [line for line in quoted.group(1).splitlines() if line != "..."]
    assert shown[0] == printed[0]
    assert all(line in printed for line in shown), [line for line in shown if line not in printed]
