#!/usr/bin/env bash
# The first GPU run in one command: the probe, the mechanism check, the decode emulation
# and the gather benchmark, each under its own time limit, into one results directory
# ($OUT when set) with a summary of the headline ratios. See benchmarks/gpu_run.py.
#
#   bash benchmarks/gpu_run.sh            # full sizes (on a GPU: about 4 to 6 minutes, at most 8)
#   bash benchmarks/gpu_run.sh --small    # the same path, small sizes: well under a minute on a CPU
#
# Runs from the working tree without installing anything: the interpreter is $PYTHON, else
# this checkout's .venv/bin/python, else python3 (a GPU image's own); the tree goes on
# PYTHONPATH. No vLLM is imported on this path (each section runs with `import vllm` blocked).
set -u
cd "$(dirname "$0")/.." || exit 2
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
exec "$PYTHON" benchmarks/gpu_run.py "$@"
