#!/usr/bin/env bash
# Issue 5: trellm serve and llama.cpp's server (llama-cpp-python) on the same GGUF, same
# sweep, on this 2-core machine; then a third-party client (guidellm) against trellm.
set -u
# Prerequisite (outside the repo's install, built from source here):
#   python3 -m venv /tmp/llamacpp && /tmp/llamacpp/bin/pip install "llama-cpp-python[server]"
# llama-cpp-python serves one request at a time; --interrupt_requests False makes a new
# request wait instead of cutting the running one short (its default).
# Usage: scripts/cpu_side_by_side.sh ~/.cache/trellm/SmolLM2-135M-Instruct.Q4_1.gguf OUTDIR
GGUF=$1; OUT=$2; LLAMA_PY=${LLAMA_PY:-/tmp/llamacpp/bin/python}
PY=${PY:-.venv/bin/python}
mkdir -p "$OUT"
wait_up() { for _ in $(seq 1 300); do $PY -c "import urllib.request; urllib.request.urlopen('$1', timeout=2)" >/dev/null 2>&1 && return 0; sleep 1; done; return 1; }
SWEEP="--concurrency 1,2,4,8 --input-len 128 --output-len 64 --num-prompts 8 --no-progress"
$PY -m trellm serve "$GGUF" --port 8021 --served-model-name smollm2 --max-model-len 2048 >"$OUT/trellm-server.log" 2>&1 &
S=$!; wait_up http://127.0.0.1:8021/health || { tail "$OUT/trellm-server.log"; exit 1; }
$PY -m trellm bench serve --base-url http://127.0.0.1:8021 --model smollm2 $SWEEP --out "$OUT/trellm.json"
kill $S; wait $S 2>/dev/null
$LLAMA_PY -m llama_cpp.server --model "$GGUF" --port 8022 --n_threads 2 --n_ctx 2048 --model_alias smollm2 --interrupt_requests False >"$OUT/llamacpp-server.log" 2>&1 &
S=$!; wait_up http://127.0.0.1:8022/v1/models || { tail "$OUT/llamacpp-server.log"; exit 1; }
$PY -m trellm bench serve --base-url http://127.0.0.1:8022 --model smollm2 $SWEEP --out "$OUT/llamacpp.json"
kill $S; wait $S 2>/dev/null
