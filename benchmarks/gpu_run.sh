#!/usr/bin/env bash
# The first GPU run in one command: the probe, the pre-flight (gpt-oss's experts as vLLM
# allocates them on this card, its free memory after the CUDA context, the reference plans'
# verdicts there), the mechanism check, the gather and UVA-read
# benchmarks and the host-compute layers, each under its own time limit, into one results directory
# ($OUT when set) with a summary of the headline ratios. See benchmarks/gpu/__init__.py.
#
#   bash benchmarks/gpu_run.sh            # full sizes (on a GPU: about 4 to 6 minutes, at most 8)
#   bash benchmarks/gpu_run.sh --small    # the same path, small sizes: well under a minute on a CPU
#
# Runs from the working tree without installing anything: the interpreter is $PYTHON, else
# this checkout's .venv/bin/python, else (in a git worktree) the main checkout's, else
# python3 (a GPU image's own); the tree goes on PYTHONPATH. No vLLM is imported on this
# path (each section runs with `import vllm` blocked).
set -u
cd "$(dirname "$0")/.." || exit 2
if [ -z "${PYTHON:-}" ]; then
    common=$(git rev-parse --git-common-dir 2>/dev/null) && main=$(cd "$common/.." 2>/dev/null && pwd) || main=
    for candidate in .venv/bin/python "${main:+$main/.venv/bin/python}"; do
        if [ -n "$candidate" ] && [ -x "$candidate" ]; then PYTHON=$candidate; break; fi
    done
    PYTHON=${PYTHON:-python3}
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
exec "$PYTHON" -m benchmarks.gpu "$@"
