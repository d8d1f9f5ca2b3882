#!/usr/bin/env bash
# Issue 5 on the GPU: `trellm bench serve` (concurrency sweep) and `trellm bench ladder`
# (context ladder with needles) against a live `trellm serve` of a random-weight model.
#
#   python3 scripts/make_bench_model_dir.py .gpu/llama-3.1-8b.json .gpu/llama8b-tok   # here, once
#   scripts/gpu_serve_bench.sh .gpu/llama8b-tok $OUT                                   # there
#
# MODEL_DIR holds the shape's config.json plus a tokenizer (tokenizer.json and
# tokenizer_config.json with a chat template): random weights cannot read text, but the
# server needs a tokenizer to take text prompts. Needle hits from random weights are
# meaningless (expect misses); TTFT, hit TTFT and decode speed are the figures.
# Env: CONCURRENCY (default 1,2,4,8,16,32,64), CONTEXTS (default 1024,4096,16384,65536,131072),
# MAX_LEN (131072), INPUT_LEN (512), OUTPUT_LEN (128), PYTHON (python3).
set -u
MODEL_DIR=$1; OUT=$2
PY=${PYTHON:-python3}
PORT=${PORT:-8011}
URL=http://127.0.0.1:$PORT
mkdir -p "$OUT"
$PY -m trellm serve "dummy:$MODEL_DIR" --port "$PORT" --max-model-len "${MAX_LEN:-131072}" \
    --max-num-seqs 64 --served-model-name bench ${SERVE_ARGS:-} >"$OUT/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null' EXIT
for _ in $(seq 1 600); do
    $PY -c "import urllib.request; urllib.request.urlopen(\"$URL/health\", timeout=2)" >/dev/null 2>&1 && break
    kill -0 $SERVER 2>/dev/null || { echo "server exited:"; tail -20 "$OUT/server.log"; exit 1; }
    sleep 1
done
$PY -m trellm bench serve --base-url "$URL" --model bench --tokenizer "$MODEL_DIR" \
    --concurrency "${CONCURRENCY:-1,2,4,8,16,32,64}" --input-len "${INPUT_LEN:-512}" \
    --output-len "${OUTPUT_LEN:-128}" --no-progress --out "$OUT/bench-serve.json"
$PY -m trellm bench ladder --base-url "$URL" --model bench --tokenizer "$MODEL_DIR" \
    --contexts "${CONTEXTS:-1024,4096,16384,65536,131072}" --gen-tokens 128 \
    --out "$OUT/bench-ladder.json"
tail -5 "$OUT/server.log"
