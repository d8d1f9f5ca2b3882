#!/usr/bin/env bash
# The next device session's calls (issue 6), in two stages of under 10 minutes each:
#   a: the EXL3 kernel tests on the GPU (the fp16-transform prefill and the affine one-row
#      mode included), the one-row sweep (rounded vs affine), the 8k-token prefill profile;
#   b: the engine at 4.0 bpw (decode, 8k prefill, aggregate at 32) with the default one-row
#      kernel, and again with the affine one; int8 and bf16 beside them; then Nsight Compute
#      on the one-row kernel (scripts/gpu_ncu_exl3.sh).
#   c: exl3_mma (tensor-core mma on lane-decoded fragments): its kernel tests, then the
#      layer sweep at 1 / 8 / 32 rows against the row, split-dot and fused-Hadamard kernels;
#   d: the engine at 4.0 bpw with the default dispatch and with exl3_mma for 1-32 rows, bf16 beside.
#   e: c and d in one call (short budgets): mma tests, sweep, the engine with exl3_mma
#      (fused output transform unless the sweep's checks failed it).
#   f: exl3_mma with its K loop software-pipelined (prefetch): tests, sweep, engine.
#   g: programmatic dependent launch on / off: kernel tests, bf16 figures (issue 4);
#   h: the same for EXL3: layer sweep and engine at 4.0 bpw;
#   i: g and h in one call; j: i without the sweep; k: g's bf16 figures alone (~4 min).
#   l: the H200 record run: issue 4's full bench (checks, speed, transformers peer and copy
#      bandwidth) with the default PDL, Qwen3-0.6B again with PDL off, then issue 6's engine
#      figures (EXL3 2 / 3 / 4 bpw, int8) on the same machine. With PICK=1, under the launch
#      settings stage m picked (/tmp/trellm-pick.env, kept on a warm machine). SHORT=1 skips
#      the PDL-off Qwen3 run; EXL3_S / EXL3_ENGINES limit the EXL3 part.
#   o: m and l in one call (a scarce machine): the linears sweep, a three-variant A/B, the
#      pick, then issue 4's record run under it (no EXL3). p: o without the record run;
#      x: o without the linears sweep (~7 min).
#   q: the linears sweep alone (~1.5 min).
#   r: the EXL3 engine at 4.0 bpw and int8 with PDL on (TRELLM_PDL=1: the EXL3 and int8
#      kernels too), late and early trigger, then with PDL off.
#   y: EXL3 diagnostics (~9 min): the 8B decode graph at 4.0 bpw profiled kernel by kernel
#      (scripts/gpu_overhead.py --profile), the layer sweep with the pointer-carrying K loop,
#      the EXL3 kernel tests with PDL on, the engine at 4.0 bpw with PDL on and off.
#   n: the RMSNorm fused into the qkv / gate_up GEMV (TRELLM_GEMV_NORM): its GPU kernel tests
#      (and the decode attention / RoPE ones: metadata read before the PDL wait), issue 4's
#      correctness checks with it on, the whole-engine A/B base / norm-forcenorm (greedy
#      tokens compared with base's), then the int8 engine (the v1 / v2 candidates) (~9.5 min).
#   s: n cut to ~6.5 min for a short device budget: the GPU kernel tests of this session's
#      changes, the correctness checks with TRELLM_GEMV_NORM=1, the A/B base / norm-forcenorm.
#   t: s without the kernel tests (~4 min).
#   v: the bf16 decode graphs of Qwen3-0.6B and the 8B profiled kernel by kernel, defaults and
#      TRELLM_GEMV_NORM=1 (scripts/gpu_overhead.py --profile, ~4 min).
#   fx: exl3_mma with x in A-fragment order (FastConfig.frag_x) and with K 5-6 (the 6-bit head):
#      its GPU kernel tests, the layer sweep at 1 / 8 / 32 rows against the default, the engine
#      at 4.0 bpw (exl3_ab: defaults, --no-wide-mma, the fx / block_m 32 variant for 2-32 rows),
#      then int8's engine (v1 / v2).
#   fxs: fx cut to ~6 min (a shorter sweep, then exl3_ab). ab: exl3_ab alone (~4 min).
#   uss: the shortest u: issue 4's gpu_bench.py alone on an H200 (~5 min), else fis.
#   rf: exl3_row's fused output transform (the one-row default since 2026-12-07, eighth session)
#      and frag_x on the 2-32 row default: their GPU kernel tests, the layer sweep against the
#      unfused row kernel, the engine A/B new defaults / old (rf_ab, greedy tokens compared by
#      scripts/tokens_diff.py), then the 8B decode graph at 4.0 bpw profiled kernel by kernel
#      (~8.5 min). rfs: rf without the kernel tests and the profile (~5 min). rab: rf_ab alone.
#   fi: the input transform in the norm / SiLU-and-mul launch (FastDispatch.fuse_in, 2026-12-08):
#      its GPU kernel tests (and the row kernel's prefetch), the layer sweep of the row kernel
#      with prefetch / 8 warps, the engine A/B new / --no-fuse-in / --no-in-fwht / TRELLM_PDL=1
#      with greedy tokens compared (fi_ab) (~9 min). fis: the A/B alone (~5 min).
#   fiq: fi cut to ~4.5 min (fuse_in on / off, a 3-variant row sweep, the prologue tests).
#   fp: the 8B EXL3 decode graph at 4.0 bpw profiled kernel by kernel (~2 min).
#   u: l on an H200, fi on any other card. us: the short budget's u (l without the PDL-off
#      run and EXL3 at 4.0 bpw and int8 only, ~7 min; else fis).
#   z: l on an H200, y on any other card (a call that may get either); w: l on an H200, n on
#      any other card.
#   m: the early PDL trigger and the GEMV weight prefetch: a token's linears in one graph
#      (scripts/gpu_gemv_layers.py), then scripts/gpu_pdl_ab.py (whole-engine A/B, Qwen3-0.6B
#      and 8B single stream), then the GEMV kernel tests; writes the best env-settable
#      variant to /tmp/trellm-pick.env (stage l's engine checks then run under it).
# Usage: OUT=... [PICK=1] scripts/gpu_next.sh fi|fis|fiq|fp|a|b|c|d|e|f|g|h|i|j|k|l|m|n|o|p|q|r|s|t|u|v|w|x|y|z|fx|fxs|us|uss|ab|rf|rfs|rab
# Carry .whl (../shared/gpu/wheels.sh) and .gpu (../shared/gpu/configs/*.json copied in).
set -uo pipefail
out=${OUT:-/tmp/gpu-next}; mkdir -p "$out"
[ -d /tmp/site/fastapi ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
# PDL on / off (stages g-j): TRELLM_PDL is read once per process, so each run is its own.
pdl_bf16() {  # $1 $2: limits of the on (with the checks) and off runs
    mkdir -p "$out/pdl" "$out/nopdl"
    TRELLM_PDL=1 timeout "$1" python3 scripts/gpu_bench.py --configs .gpu --stages correctness,small,big \
        --out "$out/pdl" 2>&1 | tail -5
    TRELLM_PDL=0 timeout "$2" python3 scripts/gpu_bench.py --configs .gpu --stages small,big --out "$out/nopdl" \
        2>&1 | tail -3
}
pdl_exl3_engine() {  # $1: PDL 1 / 0; $2: the limit
    local tag; tag=$([ "$1" = 1 ] && echo pdl || echo nopdl); mkdir -p "$out/exl3-$tag"
    TRELLM_PDL=$1 timeout "$2" python3 scripts/gpu_exl3_check.py --out "$out/exl3-$tag" --stages engine \
        --budget $(( $2 - 5 )) --engines "exl3 4" 2>&1 | tail -2
}
pdl_exl3_sweep() {  # $1: PDL 1 / 0
    local tag; tag=$([ "$1" = 1 ] && echo pdl || echo nopdl); mkdir -p "$out/sweep-$tag"
    TRELLM_PDL=$1 timeout 120 python3 scripts/gpu_exl3_sweep.py --out "$out/sweep-$tag" --budget 110 \
        --combos 4:mul1 --layer-only --variants row-8x4-asm-aff,mma-8x2-aff-pps8-fo 2>&1 | grep -E "checks|best at"
}
norm_checks() {  # $1: kernel-test limit (0: none), $2: correctness limit, $3: A/B budget, $4: repeats, $5: -k
    mkdir -p "$out/ab" "$out/normcheck"
    [ "$1" = 0 ] || timeout "$1" python3 -m pytest -q -p no:cacheprovider tests/kernels/test_gemv.py \
        tests/kernels/test_paged_attention.py tests/kernels/test_norm_act_rope.py tests/kernels/test_int8_gemv.py \
        -k "$5" 2>&1 | tail -2
    TRELLM_GEMV_NORM=1 timeout "$2" python3 scripts/gpu_bench.py --configs .gpu --stages correctness \
        --out "$out/normcheck" 2>&1 | tail -4
    timeout $(( $3 + 10 )) python3 scripts/gpu_pdl_ab.py --configs .gpu --out "$out/ab" --budget "$3" --repeats "$4" \
        --variants base,norm-forcenorm 2>&1 | tail -5
}
engine_runs() {  # $1: limit per run, then "tag [gpu_exl3_check.py flags]" runs: the EXL3 4.0 bpw
    # engine once per run into $out/exl3-<tag> (tag pdl: with TRELLM_PDL=1, every kernel).
    local lim=$1 tag run pdl
    shift
    for run in "$@"; do
        set -- $run; tag=$1; shift
        pdl=$([ "$tag" = pdl ] && echo 1 || echo auto)
        mkdir -p "$out/exl3-$tag"
        TRELLM_PDL=$pdl timeout "$lim" python3 scripts/gpu_exl3_check.py --out "$out/exl3-$tag" --stages engine \
            --budget $((lim - 10)) --engines "exl3 4" "$@" 2>&1 | tail -2
    done
}
exl3_ab() {  # $1: limit per run. Defaults (the head on exl3_mma), the head and K 5-6 back on the
    # split kernels (--no-wide-mma), 2-32 rows on the fx / block_m 32 variant.
    engine_runs "$1" "default" "nowide --no-wide-mma" "fx32 --gemv mma-8x2-aff-pps8-bm32-fo-fx --gemv-max-rows 32"
}
rf_ab() {  # $1: limit per run. The defaults, the ones before the row kernel's fused output
    # transform, frag_x and the one-row input transform by butterflies (in_fwht), and the
    # defaults with only in_fwht off; then their greedy tokens compared.
    engine_runs "$1" "new" "old --one-row row-8x4-asm-aff --gemv mma-8x2-aff-pps8-fo --gemv-max-rows 32 --no-in-fwht" \
        "dot --no-in-fwht"
    python3 scripts/tokens_diff.py "$out"/exl3-{new,old,dot}/gpu-exl3.json 2>&1 | tail -14
}
fi_ab() {  # $1: limit per run. The defaults (the input transform in the norm / SiLU launch,
    # FastDispatch.fuse_in), fuse_in off, in_fwht off (the dot, which turns fuse_in off too),
    # then the defaults with PDL on for every kernel; their greedy tokens compared.
    if [ "${FI_SHORT:-0}" = 1 ]; then
        engine_runs "$1" "new" "nofuse --no-fuse-in"
    else
        engine_runs "$1" "new" "nofuse --no-fuse-in" "dot --no-in-fwht" "pdl"
    fi
    python3 scripts/tokens_diff.py "$out"/exl3-{new,nofuse,dot,pdl}/gpu-exl3.json 2>&1 | tail -24
}
rf_sweep() {  # $1: limit
    mkdir -p "$out/sweep"
    timeout "$1" python3 scripts/gpu_exl3_sweep.py --out "$out/sweep" --budget $(($1 - 10)) --combos 4:mul1 --layer-only \
        --variants row-8x4-asm-aff,row-8x4-asm-aff-fo,row-8x8-asm-aff-fo,mma-8x2-aff-pps8-fo,mma-8x2-aff-pps8-fo-fx \
        2>&1 | grep -E "checks|best at" | tail -4
}
pick_variant() {  # the best env-settable variant of $out/ab/gpu-pdl-ab.json -> /tmp/trellm-pick.env
    rm -f /tmp/trellm-pick.env
    python3 - "$out/ab/gpu-pdl-ab.json" <<'PY'
import json, sys
runs = {v: r for v, r in json.load(open(sys.argv[1]))["variants"].items() if "qwen3-0.6b" in r and "force" not in v and "floor" not in v}
base = runs.get("base")
if base:
    score = {v: sum(r[m]["median_tok_s"] / base[m]["median_tok_s"] for m in ("qwen3-0.6b", "llama-3.1-8b"))
             for v, r in runs.items()}
    best = max(score, key=score.get)
    tags = best.split("-")
    pre = next((t[3:] for t in tags if t.startswith("pre")), "0")
    with open("/tmp/trellm-pick.env", "w") as f:
        f.write(f"TRELLM_PDL_TRIGGER={'early' if 'early' in tags else 'late'}\nTRELLM_GEMV_PREFETCH={pre}\n"
                f"TRELLM_GEMV_NORM={int('norm' in tags)}\n")
    print("picked", best, {k: round(v, 3) for k, v in score.items()})
PY
}
stage=${1:-a}
if [ "$stage" = z ] || [ "$stage" = w ] || [ "$stage" = u ] || [ "$stage" = us ] || [ "$stage" = uss ]; then
    other=$(case $stage in z) echo y;; w) echo n;; u) echo fi;; us|uss) echo fis;; esac)
    if [ "$stage" = us ]; then export SHORT=1 EXL3_S=${EXL3_S:-110} EXL3_ENGINES=${EXL3_ENGINES:-"exl3 4,int8"}; fi
    if [ "$stage" = uss ]; then export SHORT=1 EXL3_S=0; fi
    stage=$(nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && echo l || echo "$other")
    echo "-> stage $stage"
fi
case "$stage" in
fx)
    mkdir -p "$out/sweep" "$out/int8"
    timeout 90 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_exl3_kernels.py \
        -k "fragment_order or (mma and plain and (4-mul1 or 6-mul1 or 5-mcg))" 2>&1 | tail -2
    timeout 120 python3 scripts/gpu_exl3_sweep.py --out "$out/sweep" --budget 110 --combos 4:mul1 --layer-only \
        --variants row-8x4-asm-aff,mma-8x2-aff-pps8-fo,mma-8x2-aff-pps8-fo-fx,mma-8x4-aff-fo-fx,mma-8x2-aff-bm32-fo-fx,mma-8x2-aff-pps8-bm32-fo-fx \
        2>&1 | grep -E "checks|best at" | tail -4
    exl3_ab 80
    timeout 75 python3 scripts/gpu_exl3_check.py --out "$out/int8" --stages engine --budget 65 --engines int8 2>&1 | tail -2
    ;;
ab)
    exl3_ab "${AB_LIM:-75}"
    ;;
rf)
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_exl3_kernels.py -x \
        -k "merged_parts_unpadded or fragment_order or (fast_every and (4-mul1 or 2-mcg or 6-mul1))" 2>&1 | tail -3
    rf_sweep 110
    rf_ab 80
    mkdir -p "$out/ovh"
    timeout 120 python3 scripts/gpu_overhead.py .gpu/llama-3.1-8b.json:1 --steps 50 --profile \
        --quantization exl3 --bits 4 --out "$out/ovh" 2>&1 | grep -E "^ +K " | head -12
    ;;
fiq)
    # the shortest fi (~4.5 min): fuse_in on / off with tokens compared, the row sweep, the prologue tests
    FI_SHORT=1 fi_ab "${AB_LIM:-65}"
    mkdir -p "$out/sweep"
    timeout 80 python3 scripts/gpu_exl3_sweep.py --out "$out/sweep" --budget 70 --combos 4:mul1 --layer-only \
        --variants row-8x4-asm-aff-fo,row-8x4-asm-aff-fo-pf-w8,row-8x4-asm-aff-fo-w8 2>&1 | grep -E "checks|best at" | tail -4
    timeout 60 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_exl3_prologue.py 2>&1 | tail -2
    ;;
fi|fis)
    # the A/B first: a call cut short by the device budget keeps the figures that matter most
    fi_ab "${AB_LIM:-70}"
    mkdir -p "$out/sweep"
    [ "$stage" = fis ] || timeout 95 python3 scripts/gpu_exl3_sweep.py --out "$out/sweep" --budget 85 --combos 4:mul1 \
        --layer-only --variants row-8x4-asm-aff-fo,row-8x4-asm-aff-fo-pf,row-8x4-asm-aff-fo-pf-w8,row-8x4-asm-aff-fo-w8 \
        2>&1 | grep -E "checks|best at" | tail -4
    [ "$stage" = fis ] || timeout 140 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_exl3_prologue.py \
        tests/kernels/test_triton_backend.py tests/kernels/test_paged_attention.py tests/kernels/test_exl3_kernels.py \
        -k "prologue or xform or transform or fragment_order or fast_groups or (fast_every and 4-mul1)" 2>&1 | tail -3
    ;;
fp)
    mkdir -p "$out/ovh"
    timeout 100 python3 scripts/gpu_overhead.py .gpu/llama-3.1-8b.json:1 --steps 50 --profile \
        --quantization exl3 --bits 4 --out "$out/ovh" 2>&1 | grep -E "^ +K " | head -14
    ;;
rfs)
    rf_sweep 90
    rf_ab 75
    ;;
rab)
    rf_ab "${AB_LIM:-75}"
    ;;
fxs)
    # fx for a short budget (~6 min): the sweep, then the engine A/B (exl3_ab).
    mkdir -p "$out/sweep"
    timeout 100 python3 scripts/gpu_exl3_sweep.py --out "$out/sweep" --budget 90 --combos 4:mul1 --layer-only \
        --variants mma-8x2-aff-pps8-fo,mma-8x2-aff-pps8-fo-fx,mma-8x2-aff-bm32-fo-fx,mma-8x2-aff-pps8-bm32-fo-fx \
        2>&1 | grep -E "checks|best at" | tail -4
    exl3_ab 80
    ;;
v)
    for norm in 0 1; do
        mkdir -p "$out/ovh-norm$norm"
        TRELLM_GEMV_NORM=$norm timeout 120 python3 scripts/gpu_overhead.py .gpu/qwen3-0.6b.json:1 .gpu/llama-3.1-8b.json:1 \
            --steps 50 --profile --out "$out/ovh-norm$norm" 2>&1 | grep -vE "^ +\{" | grep -E "K |tok_s|<-" | cut -c1-200 | tail -60
    done
    ;;
s|t)
    tests=$([ "$stage" = t ] && echo 0 || echo 110)
    norm_checks "$tests" 110 150 1 "(rms_norm and (bfloat16 or rejects)) or test_decode_fused or rope_with_fused or every_config"
    ;;
n)
    norm_checks 170 120 160 2 "rms_norm or norm_linear or pdl_mode or decode or rope or write_kv or int8"
    mkdir -p "$out/int8"
    timeout 100 python3 scripts/gpu_exl3_check.py --out "$out/int8" --stages engine --budget 90 --engines int8 \
        2>&1 | tail -3
    ;;
y)
    mkdir -p "$out/ovh" "$out/sweep"
    timeout 130 python3 scripts/gpu_overhead.py .gpu/llama-3.1-8b.json:1 --steps 50 --profile \
        --quantization exl3 --bits 4 --out "$out/ovh" 2>&1 | grep -vE "^ +\{" | tail -40
    timeout 100 python3 scripts/gpu_exl3_sweep.py --out "$out/sweep" --budget 90 --combos 4:mul1 --layer-only \
        --variants row-8x4-asm-aff,mma-8x2-aff-pps8-fo,mma-8x2-aff-pps8-fo-pf 2>&1 | tail -12
    TRELLM_PDL=1 timeout 140 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_exl3_kernels.py \
        -k "(mma and plain and (4-mul1 or 2-mul1 or 3-mcg or 4-3inst)) or (fast_every and 4-) or merged or dispatch" 2>&1 | tail -3
    pdl_exl3_engine 1 90; pdl_exl3_engine 0 90
    ;;
a)
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_exl3_kernels.py -x 2>&1 | tail -4
    mkdir -p "$out/sweep"
    timeout 120 python3 scripts/gpu_exl3_sweep.py --out "$out/sweep" --budget 100 --combos 4:mul1,2:mul1 --layer-only \
        --variants fma-8x4-split-asm,row-16x4-asm,row-16x4-asm-aff,row-8x4-asm-aff,row-8x4-asm-aff-pps8 2>&1 | tail -30
    timeout 120 python3 scripts/gpu_profile_prefill.py .gpu/llama-3.1-8b.json --quantization exl3 --bits 4 \
        --tokens 8192 --out "$out" 2>&1 | head -45
    ;;
b)
    mkdir -p "$out/default" "$out/affine"
    timeout 260 python3 scripts/gpu_exl3_check.py --out "$out/default" --stages engine --budget 240 \
        --engines "exl3 4,int8,bf16" 2>&1 | tail -14
    timeout 110 python3 scripts/gpu_exl3_check.py --out "$out/affine" --stages engine --budget 90 \
        --engines "exl3 4" --one-row row-8x4-asm-aff 2>&1 | tail -8
    OUT="$out" timeout 170 bash scripts/gpu_ncu_exl3.sh
    ;;
c)
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_exl3_kernels.py -k mma > "$out/pytest-mma.txt" 2>&1
    tail -3 "$out/pytest-mma.txt"
    mkdir -p "$out/sweep"
    timeout 300 python3 scripts/gpu_exl3_sweep.py --out "$out/sweep" --budget 280 --combos 4:mul1 --layer-only \
        --variants row-8x4-asm-aff,mma-8x4-aff,mma-8x4-aff-fo,mma-8x2-aff,mma-8x8-aff,mma-8x4-aff-w8,mma-8x4-aff-bm32,mma-8x4-aff-bm32-fo,dot-8x8-split-asm,mm-8x8-bm32-had-asm \
        2>&1 | tail -40
    tail -3 "$out/pytest-mma.txt"
    ;;
d)
    mkdir -p "$out/default" "$out/mma"
    timeout 250 python3 scripts/gpu_exl3_check.py --out "$out/mma" --stages engine --budget 240 --engines "exl3 4,bf16" \
        --one-row "${MMA_ONE:-mma-8x4-aff}" --gemv "${MMA_GEMV:-mma-8x4-aff}" --gemv-max-rows 32 2>&1 | tail -14
    timeout 150 python3 scripts/gpu_exl3_check.py --out "$out/default" --stages engine --budget 140 --engines "exl3 4" \
        2>&1 | tail -8
    ;;
e)
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_exl3_kernels.py -k mma > "$out/pytest-mma.txt" 2>&1
    tail -2 "$out/pytest-mma.txt"
    mkdir -p "$out/sweep" "$out/mma"
    timeout 200 python3 scripts/gpu_exl3_sweep.py --out "$out/sweep" --budget 185 --combos 4:mul1 --layer-only \
        --variants row-8x4-asm-aff,mma-8x4-aff,mma-8x4-aff-fo,mma-8x2-aff,mma-8x4-aff-w8,mma-8x4-aff-bm32,mma-8x4-aff-bm32-fo,dot-8x8-split-asm,mm-8x8-bm32-had-asm \
        2>&1 | tail -32
    fo=$(python3 -c "import json,sys; d=json.load(open('$out/sweep/gpu-exl3-sweep.json')); print('' if 'mma-8x4-aff-fo' in d['correctness'].get('failed_variants', []) else '-fo')" 2>/dev/null || echo "")
    echo "engine with mma-8x4-aff$fo"
    timeout 200 python3 scripts/gpu_exl3_check.py --out "$out/mma" --stages engine --budget 190 --engines "exl3 4" \
        --one-row "mma-8x4-aff$fo" --gemv "mma-8x4-aff-bm32$fo" --gemv-max-rows 32 2>&1 | tail -8
    tail -2 "$out/pytest-mma.txt"
    ;;
f)
    # exl3_mma's software-pipelined K loop (FastConfig.prefetch 1 / 2 steps ahead): its GPU
    # tests, the layer sweep against the defaults, then the engine with the sweep's picks.
    timeout 170 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_exl3_kernels.py -k "mma or prefetch" \
        > "$out/pytest-mma.txt" 2>&1
    tail -2 "$out/pytest-mma.txt"
    mkdir -p "$out/sweep" "$out/pf"
    timeout 230 python3 scripts/gpu_exl3_sweep.py --out "$out/sweep" --budget 215 --combos 4:mul1 --layer-only \
        --variants row-8x4-asm-aff,mma-8x2-aff-pps8-fo,mma-16x2-aff-fo,mma-8x2-aff-pps8-fo-pf,mma-8x2-aff-pps8-fo-pf2,mma-8x2-aff-pps12-fo-pf2,mma-8x2-aff-fo-pf2,mma-16x2-aff-fo-pf2,mma-8x2-aff-bm32-fo-pf2 \
        2>&1 | tail -36
    picks=$(python3 -c "import json; b=json.load(open('$out/sweep/gpu-exl3-sweep.json'))['best_by_rows_k4_mul1']; print(b['1'], b['8'])" 2>/dev/null)
    set -- $picks
    echo "engine with one-row ${1:-?} / 2-32 rows ${2:-?}"
    [ -n "${2:-}" ] && timeout 170 python3 scripts/gpu_exl3_check.py --out "$out/pf" --stages engine --budget 160 \
        --engines "exl3 4" --one-row "$1" --gemv "$2" --gemv-max-rows 32 2>&1 | tail -8
    tail -2 "$out/pytest-mma.txt"
    ;;
g)
    # Programmatic dependent launch (kernels/_triton.py, TRELLM_PDL=1): the GPU kernel tests
    # with it on, then issue 4's bf16 figures (gpu_bench.py: checks, Qwen3-0.6B and
    # Llama-3.1-8B speed) with it on and off on the same machine.
    TRELLM_PDL=1 timeout 100 python3 -m pytest -q -p no:cacheprovider tests/kernels -x -k "not exl3" \
        > "$out/pytest-pdl.txt" 2>&1
    tail -2 "$out/pytest-pdl.txt"
    pdl_bf16 170 120
    tail -2 "$out/pytest-pdl.txt"
    ;;
h)
    # The EXL3 side of g: the layer sweep (its checks, then CUDA-graph timings) and the 4.0 bpw
    # engine, each with PDL on and off.
    for v in 1 0; do pdl_exl3_sweep $v; pdl_exl3_engine $v 90; done
    ;;
i)
    # g and h in one call (when a machine is scarce): bf16 checks and figures with PDL on and
    # off, the EXL3 engine on and off, then the EXL3 layer sweep (checks + timings) with PDL on.
    pdl_bf16 150 100
    pdl_exl3_engine 1 70; pdl_exl3_engine 0 70
    pdl_exl3_sweep 1
    ;;
j)
    # i without the sweep, shorter limits (a session's last device minutes).
    pdl_bf16 130 90
    pdl_exl3_engine 1 60; pdl_exl3_engine 0 60
    ;;
k)
    # Issue 4's bf16 figures with PDL on and off, nothing else (the fewest device minutes).
    pdl_bf16 130 90
    ;;
l)
    if [ "${PICK:-0}" = 1 ] && [ -f /tmp/trellm-pick.env ]; then set -a; . /tmp/trellm-pick.env; set +a; fi
    env | grep -E "^TRELLM_" || echo "default launch settings"
    mkdir -p "$out/bench" "$out/nopdl" "$out/exl3"
    timeout 280 python3 scripts/gpu_bench.py --configs .gpu --out "$out/bench" 2>&1 | tail -6
    [ "${SHORT:-0}" = 1 ] || TRELLM_PDL=0 timeout 60 python3 scripts/gpu_bench.py --configs .gpu --stages small \
        --out "$out/nopdl" 2>&1 | tail -2
    if [ "${EXL3_S:-200}" -gt 0 ]; then
        timeout "${EXL3_S:-200}" python3 scripts/gpu_exl3_check.py --out "$out/exl3" --stages engine \
            --budget $(( ${EXL3_S:-200} - 10 )) --engines "${EXL3_ENGINES:-exl3,int8,bf16}" 2>&1 | tail -14
    fi
    ;;
q)
    mkdir -p "$out/layers"
    timeout 90 python3 scripts/gpu_gemv_layers.py --configs .gpu --out "$out/layers" --budget 65 \
        --variants cublas,ours,ours-late,ours-early,ours-pre2-early,ours-pre4-early,ours-n8-pre2-early 2>&1 | tail -26
    ;;
r)
    for trig in late early off; do
        mkdir -p "$out/exl3-$trig"
        TRELLM_PDL=$([ $trig = off ] && echo 0 || echo 1) TRELLM_PDL_TRIGGER=$([ $trig = off ] && echo late || echo $trig) \
            timeout 110 python3 scripts/gpu_exl3_check.py --out "$out/exl3-$trig" \
            --stages engine --budget 100 --engines "exl3 4,int8" 2>&1 | tail -3
    done
    ;;
o|p|x)
    mkdir -p "$out/layers" "$out/ab"
    [ "$stage" = x ] || timeout 100 python3 scripts/gpu_gemv_layers.py --configs .gpu --out "$out/layers" --budget 70 \
        --variants cublas,ours,ours-late,ours-early,ours-pre2-early,ours-pre4-early,ours-n8-pre2-early 2>&1 | tail -26
    timeout 200 python3 scripts/gpu_pdl_ab.py --configs .gpu --out "$out/ab" --budget 185 --repeats 2 \
        --variants base,early-pre2,norm,early-pre2-norm 2>&1 | tail -7
    pick_variant
    [ "$stage" = p ] || PICK=1 SHORT=1 EXL3_S=0 bash "$0" l
    ;;
m)
    mkdir -p "$out/layers" "$out/ab"
    timeout 110 python3 scripts/gpu_gemv_layers.py --configs .gpu --out "$out/layers" --budget 90 2>&1 | tail -34
    timeout 230 python3 scripts/gpu_pdl_ab.py --configs .gpu --out "$out/ab" --budget 220 \
        --variants base,early,early-pre2,early-pre2-force,early-pre2-floor256 2>&1 | tail -8
    timeout 60 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_gemv.py -k "prefetch or pdl_mode" \
        2>&1 | tail -2
    timeout 30 python3 -m pytest -q -p no:cacheprovider tests/unit/test_pdl.py 2>&1 | tail -2
    pick_variant
    ;;
esac
