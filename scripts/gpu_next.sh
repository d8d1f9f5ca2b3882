#!/usr/bin/env bash
# The next device session's first call (issue 6), one command, ~9 minutes:
#   1. the EXL3 kernel tests on the GPU (the new fp16-transform prefill included);
#   2. the 8k-token EXL3 prefill profile (kernel table head);
#   3. the engine at 4.0 bpw (decode, 8k prefill, aggregate at 32) and int8 / bf16 beside it.
# Carry .whl (../shared/gpu/wheels.sh) and .gpu (../shared/gpu/configs/*.json copied in).
set -uo pipefail
out=${OUT:-/tmp/gpu-next}; mkdir -p "$out"
[ -d /tmp/site/fastapi ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_exl3_kernels.py -x 2>&1 | tail -4
timeout 120 python3 scripts/gpu_profile_prefill.py .gpu/llama-3.1-8b.json --quantization exl3 --bits 4 \
    --tokens 8192 --out "$out" 2>&1 | head -45
timeout 290 python3 scripts/gpu_exl3_check.py --out "$out" --stages engine --budget 270 \
    --engines "exl3 4,int8,bf16" 2>&1 | tail -25
