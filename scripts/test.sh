#!/usr/bin/env bash
# The test suite: sets up .venv (scripts/setup.sh), runs ruff (pyproject.toml's [tool.ruff])
# on the code, then pytest. Extra arguments go to pytest. Fails when ruff finds a problem,
# when a test fails and when no test ran (pytest's exit status 5).
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit $?
.venv/bin/ruff check --no-cache --quiet selective_offload benchmarks tests scripts
lint=$?
if [ "$lint" -ne 0 ]; then
    echo "test: ruff check found the problems above (.venv/bin/ruff check --fix mends import order and unused imports)" >&2
fi
.venv/bin/python -m pytest "$@"
status=$?
if [ "$status" -eq 5 ]; then
    echo "test: pytest collected no tests; that is a failure" >&2
    exit 1
fi
if [ "$status" -eq 0 ] && [ "$lint" -ne 0 ]; then
    exit 1
fi
exit "$status"
