#!/usr/bin/env bash
# The test suite: sets up .venv (scripts/setup.sh), then runs pytest. Extra arguments go
# to pytest. Fails when a test fails and when no test ran (pytest's exit status 5).
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit $?
.venv/bin/python -m pytest "$@"
status=$?
if [ "$status" -eq 5 ]; then
    echo "test: pytest collected no tests; that is a failure" >&2
    exit 1
fi
exit "$status"
