#!/usr/bin/env bash
# The main job on the bundled defaults: plan the Qwen3.8-27B-FP8-shaped checkpoint for a
# 24 GiB card, next to vLLM's cpu_offload_gb=10 (the smallest that ran on the
# reference laptop); then run a tiny model through vLLM on this machine with a plan
# applied, and compare its tokens with plain vLLM. Sets up .venv first (scripts/setup.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
echo "== plan: bundled Qwen3.8-27B-FP8 (shape-alike manifest) on a 24 GiB card"
.venv/bin/selective-offload plan qwen3.8-27b-fp8 --device-memory 24GiB --cpu-offload-gb 10
echo
echo "== a tiny model through vLLM on this machine, with a plan applied"
.venv/bin/selective-offload demo --workdir .demo
