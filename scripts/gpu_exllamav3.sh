#!/usr/bin/env bash
# Build exllamav3's CUDA extension on the device machine (it compiles at first import:
# 177 .cu files), then, if it built, run scripts/exllamav3_interop.py.
# Usage, from the repo root, with .whl (scripts/../shared/gpu/wheels.sh), .whl-ex3 (exllamav3,
# marisa-trie, llguidance, pillow, ninja wheels) and .gpu/ex3tok carried:
#   scripts/gpu_exllamav3.sh BUILD_SECONDS [--build-only | interop args...]
# The object files stay in /tmp/ex3build, so a second call on the same (warm) machine resumes
# an unfinished build where the first stopped.
set -uo pipefail
budget=${1:-540}; shift || true
out=${OUT:-/tmp/ex3out}; mkdir -p "$out" /tmp/ex3build
[ -d /tmp/site/fastapi ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
[ -d /tmp/ex3site/exllamav3 ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/ex3site .whl-ex3/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:/tmp/ex3site:$PWD PYTHONUNBUFFERED=1 PATH=/tmp/ex3site/bin:$PATH
export TORCH_EXTENSIONS_DIR=/tmp/ex3build MAX_JOBS=${MAX_JOBS:-$(nproc)} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
echo "nvcc: $(command -v nvcc || ls /usr/local/cuda/bin/nvcc 2>/dev/null)  ninja: $(command -v ninja)  jobs: $MAX_JOBS"
# A build killed by the end of a call leaves torch's lock file behind, and the next
# import then waits on it forever (seen 2026-12-06): one build runs at a time here.
find /tmp/ex3build -name lock -delete 2>/dev/null
start=$(date +%s)
timeout "$budget" python3 -c "import exllamav3; print('exllamav3', exllamav3.__file__, 'imported')" > "$out/exllamav3-build.log" 2>&1
rc=$?
echo "build rc=$rc after $(( $(date +%s) - start )) s; objects: $(find /tmp/ex3build -name '*.o' | wc -l)"
tail -25 "$out/exllamav3-build.log"
# --build-only: compile and stop (a background build beside another GPU job).
[ "$rc" = 0 ] && [ "${1:-}" != "--build-only" ] && python3 scripts/exllamav3_interop.py --out "$out" "$@"
