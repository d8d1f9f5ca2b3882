#!/usr/bin/env bash
# Nsight Compute on the EXL3 one-row kernel (issue 6): stall reasons, pipe use, occupancy of
# the four Llama-3.1-8B linears at K=4 MUL1 (scripts/gpu_ncu_exl3.py), plus the compact
# lines of the report. Usage on the device machine: OUT=... scripts/gpu_ncu_exl3.sh [KERNEL_REGEX]
set -uo pipefail
out=${OUT:-/tmp/ncu}; mkdir -p "$out"
[ -d /tmp/site/fastapi ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
kern=${1:-_split_kernel|_row_kernel}
timeout 150 ncu --clock-control none --target-processes all -k "regex:$kern" -c 4 --set full \
    -o "$out/exl3-one-row" python3 scripts/gpu_ncu_exl3.py --rows 1 --iters 2 --check > "$out/ncu-run.log" 2>&1
echo "ncu rc=$?"; tail -8 "$out/ncu-run.log"
ncu --import "$out/exl3-one-row.ncu-rep" --page details --print-units base > "$out/ncu-details.txt" 2>&1
ncu --import "$out/exl3-one-row.ncu-rep" --page raw --csv \
    --metrics regex:smsp__pcsamp_warps_issue_stalled_.*,smsp__inst_executed_pipe_.*,sm__inst_executed_pipe_.*,smsp__issue_active.avg.pct_of_peak_sustained_active \
    > "$out/ncu-raw.csv" 2>&1
grep -E "^  [a-z_]+\(|Duration|Registers Per|Achieved Occupancy|Theoretical Occupancy|Issue Slots Busy|Issued Ipc|Eligible Warps|Active Warps Per|No Eligible|Warp Cycles Per Issued|Memory Throughput|Compute \(SM\)|DRAM Throughput" "$out/ncu-details.txt" | head -60
grep -iE "stall|pipe" "$out/ncu-details.txt" | grep -v "^ *-" | head -40
