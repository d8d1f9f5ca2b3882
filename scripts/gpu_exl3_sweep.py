#!/usr/bin/env python3
"""EXL3 kernel variants on the GPU in one command: correctness, then speed at the
Llama-3.1-8B linear shapes beside bf16 cuBLAS, and the per-token linear time that follows.

    python3 scripts/gpu_exl3_sweep.py --out DIR [--budget 230] [--smoke]

1. correctness (spawned worker processes, which also fill Triton's on-disk cache for
   step 2): per (K, codebook) the matrix-order decode bit-exact against the reference
   (with and without the dp4a asm), then every variant (trellm/kernels/exl3_fast.py
   FastConfig) and the old per-part kernels (exl3_gemv) against ``forward_reference``
   on a small merged layer (1024 -> 256 + 128 + 128, bias) and a single part, bf16 x.
   A variant that fails anywhere is left out of the "best" picks.
2. timing: CUDA-graph replays (the weights rotated through enough copies to stream past
   the 50 MB L2, as in decode), CUDA events, per (shape, K/codebook, rows, variant), and
   bf16 F.linear at the same shape. Shapes (in x out): qkv 4096x6144 as one part and as
   q/k/v (3 parts, one launch each), o 4096x4096, gate_up 4096x28672 as 2 parts, down
   14336x4096. K = 4, 2, 3 mul1 (the converter's default), then 4 mcg / 3inst; rows 1, 8, 32.
3. report: a markdown table, the best variant per rows, the per-token linear time of the
   8B (32 x (qkv + o + gate_up + down)) per K with the best single variant and with the
   best per shape, against bf16 and the old kernels; JSON in DIR/gpu-exl3-sweep.json
   (rewritten as results come in).

Progress lines are flushed; a step that would start after --budget seconds is skipped
(the report always prints). ``--smoke``: tiny shapes on the CPU (TRITON_INTERPRET=1),
eager timing: a check of the script, not a measurement.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import multiprocessing as mp
import os
import sys
import time
import traceback

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_timing import bench_us  # noqa: E402
from trellm.kernels.exl3_fast import FastConfig  # noqa: E402

LAYERS = 32
COMBOS = ((4, "mul1"), (2, "mul1"), (3, "mul1"), (4, "mcg"), (4, "3inst"))
SHAPES = {  # name -> (in, [part widths]); the 8B's decoder linears
    "qkv3": (4096, [4096, 1024, 1024]),
    "o": (4096, [4096]),
    "gate_up2": (4096, [14336, 14336]),
    "down": (14336, [4096]),
    "qkv1": (4096, [6144]),
}
LAYER_SHAPES = ("qkv3", "o", "gate_up2", "down")
"""One decoder layer as the engine runs it (merged projections as fused parts)."""
ROWS = (1, 8, 32)

# name -> (config, rows it runs at). Dot variants pad rows to block_m (>= 16).
VARIANTS: dict[str, tuple[FastConfig, tuple[int, ...]]] = {
    "fma-8x4": (FastConfig(tk=8, tn=4, dot=False), (1,)),
    "fma-16x4-w8": (FastConfig(tk=16, tn=4, warps=8, dot=False), (1,)),
    "fma-8x4-asm": (FastConfig(tk=8, tn=4, dot=False, asm=True), (1,)),
    "fma-8x4-split": (FastConfig(tk=8, tn=4, dot=False, split=True), (1,)),
    "fma-8x4-split-asm": (FastConfig(tk=8, tn=4, dot=False, split=True, asm=True), (1,)),
    "dot-8x4": (FastConfig(tk=8, tn=4), (1, 8, 32)),
    "dot-8x8": (FastConfig(tk=8, tn=8), (1, 8)),
    "dot-16x4": (FastConfig(tk=16, tn=4), (1, 8)),
    "dot-4x8": (FastConfig(tk=4, tn=8), (1, 8)),
    "dot-8x4-pps8": (FastConfig(tk=8, tn=4, programs_per_sm=8), (1, 8)),
    "dot-8x4-s2": (FastConfig(tk=8, tn=4, stages=2), (1, 8)),
    "dot-8x4-had": (FastConfig(tk=8, tn=4, in_had=True), (1, 8, 32)),
    "dot-8x4-asm": (FastConfig(tk=8, tn=4, asm=True), (1, 8, 32)),
    "dot-8x4-split": (FastConfig(tk=8, tn=4, split=True), (1, 8, 32)),
    "dot-8x8-split-asm": (FastConfig(tk=8, tn=8, split=True, asm=True), (1, 8, 32)),
    "fma-8x4-split-asm-pps6": (FastConfig(tk=8, tn=4, dot=False, split=True, asm=True, programs_per_sm=6), (1,)),
    "fma-8x4-split-asm-pps12": (FastConfig(tk=8, tn=4, dot=False, split=True, asm=True, programs_per_sm=12), (1,)),
    "row-8x4-asm": (FastConfig(tk=8, tn=4, dot=False, asm=True, row=True), (1,)),
    "row-8x2-asm": (FastConfig(tk=8, tn=2, dot=False, asm=True, row=True), (1,)),
    "row-4x4-asm": (FastConfig(tk=4, tn=4, dot=False, asm=True, row=True), (1,)),
    "row-16x4-asm": (FastConfig(tk=16, tn=4, dot=False, asm=True, row=True), (1,)),
    "row-8x4-asm-w8": (FastConfig(tk=8, tn=4, warps=8, dot=False, asm=True, row=True), (1,)),
    "row-8x4-asm-pps8": (FastConfig(tk=8, tn=4, dot=False, asm=True, row=True, programs_per_sm=8), (1,)),
    # MUL1 weights not rounded to fp16 (exl3_row's AFF): ~6.2 instead of 8.6 instructions per weight.
    "row-8x4-asm-aff": (FastConfig(tk=8, tn=4, dot=False, asm=True, row=True, affine=True), (1,)),
    "row-16x4-asm-aff": (FastConfig(tk=16, tn=4, dot=False, asm=True, row=True, affine=True), (1,)),
    # the output transform run by the last program of each 128-column block (no out launch)
    "row-8x4-asm-aff-fo": (FastConfig(tk=8, tn=4, dot=False, asm=True, row=True, affine=True, fuse_out=True), (1,)),
    "row-8x4-asm-aff-fo-pf": (FastConfig(tk=8, tn=4, dot=False, asm=True, row=True, affine=True, fuse_out=True,
                                         prefetch=1), (1,)),
    "row-8x4-asm-aff-fo-pf-w8": (FastConfig(tk=8, tn=4, warps=8, dot=False, asm=True, row=True, affine=True,
                                            fuse_out=True, prefetch=1), (1,)),
    "row-8x4-asm-aff-fo-w8": (FastConfig(tk=8, tn=4, warps=8, dot=False, asm=True, row=True, affine=True,
                                         fuse_out=True), (1,)),
    "row-8x8-asm-aff-fo": (FastConfig(tk=8, tn=8, dot=False, asm=True, row=True, affine=True, fuse_out=True), (1,)),
    "row-8x4-asm-aff-pps8": (FastConfig(tk=8, tn=4, dot=False, asm=True, row=True, affine=True,
                                        programs_per_sm=8), (1,)),
    # exl3_mma: lanes decode their own mma B fragments (1-16 rows per program for one decode).
    "mma-8x4-aff": (FastConfig(tk=8, tn=4, dot=False, asm=True, mma=True, affine=True), (1, 8, 32)),
    "mma-8x4": (FastConfig(tk=8, tn=4, dot=False, asm=True, mma=True), (1, 8, 32)),
    "mma-8x2-aff": (FastConfig(tk=8, tn=2, dot=False, asm=True, mma=True, affine=True), (1, 8, 32)),
    "mma-8x8-aff": (FastConfig(tk=8, tn=8, dot=False, asm=True, mma=True, affine=True), (1, 8, 32)),
    "mma-8x4-aff-w8": (FastConfig(tk=8, tn=4, warps=8, dot=False, asm=True, mma=True, affine=True), (1, 8, 32)),
    "mma-16x4-aff-w8": (FastConfig(tk=16, tn=4, warps=8, dot=False, asm=True, mma=True, affine=True), (1, 8, 32)),
    "mma-8x4-aff-pps8": (FastConfig(tk=8, tn=4, dot=False, asm=True, mma=True, affine=True, programs_per_sm=8),
                         (1, 8, 32)),
    "mma-8x4-aff-fo": (FastConfig(tk=8, tn=4, dot=False, asm=True, mma=True, affine=True, fuse_out=True), (1, 8, 32)),
    "mma-8x4-aff-bm32-fo": (FastConfig(tk=8, tn=4, dot=False, asm=True, mma=True, affine=True, block_m=32,
                                       fuse_out=True), (32,)),
    "mma-8x2-aff-fo": (FastConfig(tk=8, tn=2, dot=False, asm=True, mma=True, affine=True, fuse_out=True), (1, 8, 32)),
    "mma-8x2-aff-bm32-fo": (FastConfig(tk=8, tn=2, dot=False, asm=True, mma=True, affine=True, block_m=32,
                                       fuse_out=True), (32,)),
    "mma-8x1-aff-fo": (FastConfig(tk=8, tn=1, dot=False, asm=True, mma=True, affine=True, fuse_out=True), (1, 8, 32)),
    "mma-8x2-aff-w2-fo": (FastConfig(tk=8, tn=2, warps=2, dot=False, asm=True, mma=True, affine=True, fuse_out=True),
                          (1, 8, 32)),
    "mma-16x2-aff-fo": (FastConfig(tk=16, tn=2, dot=False, asm=True, mma=True, affine=True, fuse_out=True), (1, 8, 32)),
    "mma-8x2-aff-pps8-fo": (FastConfig(tk=8, tn=2, dot=False, asm=True, mma=True, affine=True, programs_per_sm=8,
                                       fuse_out=True), (1, 8, 32)),
    # prefetch: the next K step's word pairs and A fragments loaded before this step's decode.
    "mma-8x2-aff-pps8-fo-pf": (FastConfig(tk=8, tn=2, dot=False, asm=True, mma=True, affine=True, programs_per_sm=8,
                                          fuse_out=True, prefetch=True), (1, 8, 32)),
    "mma-8x2-aff-fo-pf": (FastConfig(tk=8, tn=2, dot=False, asm=True, mma=True, affine=True, fuse_out=True,
                                     prefetch=True), (1, 8, 32)),
    "mma-16x2-aff-fo-pf": (FastConfig(tk=16, tn=2, dot=False, asm=True, mma=True, affine=True, fuse_out=True,
                                      prefetch=True), (1, 8, 32)),
    "mma-8x4-aff-fo-pf": (FastConfig(tk=8, tn=4, dot=False, asm=True, mma=True, affine=True, fuse_out=True,
                                     prefetch=True), (1, 8, 32)),
    # two steps ahead: ptxas sinks the loads to the loop's end, so only this keeps a step between load and use.
    "mma-8x2-aff-pps8-fo-pf2": (FastConfig(tk=8, tn=2, dot=False, asm=True, mma=True, affine=True, programs_per_sm=8,
                                           fuse_out=True, prefetch=2), (1, 8, 32)),
    "mma-8x2-aff-fo-pf2": (FastConfig(tk=8, tn=2, dot=False, asm=True, mma=True, affine=True, fuse_out=True,
                                      prefetch=2), (1, 8, 32)),
    "mma-8x2-aff-pps12-fo-pf2": (FastConfig(tk=8, tn=2, dot=False, asm=True, mma=True, affine=True,
                                            programs_per_sm=12, fuse_out=True, prefetch=2), (1, 8, 32)),
    "mma-16x2-aff-fo-pf2": (FastConfig(tk=16, tn=2, dot=False, asm=True, mma=True, affine=True, fuse_out=True,
                                       prefetch=2), (1, 8, 32)),
    "mma-8x2-aff-bm32-fo-pf2": (FastConfig(tk=8, tn=2, dot=False, asm=True, mma=True, affine=True, block_m=32,
                                           fuse_out=True, prefetch=2), (32,)),
    "mma-8x2-aff-s2-fo": (FastConfig(tk=8, tn=2, stages=2, dot=False, asm=True, mma=True, affine=True, fuse_out=True),
                          (1, 8, 32)),
    # frag_x: x written in A-fragment order by the input transform (coalesced A loads).
    "mma-8x2-aff-pps8-fo-fx": (FastConfig(tk=8, tn=2, dot=False, asm=True, mma=True, affine=True, programs_per_sm=8,
                                          fuse_out=True, frag_x=True), (1, 8, 32)),
    "mma-16x2-aff-fo-fx": (FastConfig(tk=16, tn=2, dot=False, asm=True, mma=True, affine=True, fuse_out=True,
                                      frag_x=True), (1, 8, 32)),
    "mma-8x4-aff-fo-fx": (FastConfig(tk=8, tn=4, dot=False, asm=True, mma=True, affine=True, fuse_out=True,
                                     frag_x=True), (1, 8, 32)),
    "mma-8x2-aff-bm32-fo-fx": (FastConfig(tk=8, tn=2, dot=False, asm=True, mma=True, affine=True, block_m=32,
                                          fuse_out=True, frag_x=True), (32,)),
    "mma-8x2-aff-pps8-bm32-fo-fx": (FastConfig(tk=8, tn=2, dot=False, asm=True, mma=True, affine=True, block_m=32,
                                               programs_per_sm=8, fuse_out=True, frag_x=True), (8, 32)),
    "mma-8x4-aff-bm32-fo-fx": (FastConfig(tk=8, tn=4, dot=False, asm=True, mma=True, affine=True, block_m=32,
                                          fuse_out=True, frag_x=True), (32,)),
    "mma-8x4-aff-bm32": (FastConfig(tk=8, tn=4, dot=False, asm=True, mma=True, affine=True, block_m=32), (32,)),
    "mma-8x2-aff-bm32": (FastConfig(tk=8, tn=2, dot=False, asm=True, mma=True, affine=True, block_m=32), (32,)),
    "mm-8x8-bm32": (FastConfig(tk=8, tn=8, block_m=32), (32,)),
    "mm-8x8-bm32-w8": (FastConfig(tk=8, tn=8, warps=8, block_m=32), (32,)),
    "mm-4x8-bm32": (FastConfig(tk=4, tn=8, block_m=32), (32,)),
    "mm-8x8-bm32-had-asm": (FastConfig(tk=8, tn=8, block_m=32, in_had=True, asm=True), (32,)),
    "mm-8x8-bm32-split": (FastConfig(tk=8, tn=8, block_m=32, split=True), (32,)),
}
OLD = "old"
"""exl3_gemv.exl3_matmul per part (3 launches each): the baseline."""
SMOKE_SHAPES = {"qkv3": (256, [256, 128, 128]), "o": (256, [256]), "gate_up2": (256, [384, 384]),
                "down": (384, [256]), "qkv1": (256, [512])}
SMOKE_VARIANTS = ("fma-8x4", "fma-8x4-split", "dot-8x4", "dot-8x4-had", "dot-8x4-split", "mm-8x8-bm32")
OUT: dict[str, str] = {}
FILTER: dict[str, list] = {}
"""--variants / --combos / --shapes: a shorter run (the defaults: everything above)."""


def log(msg: str) -> None:
    print(msg, flush=True)


def dump(res: dict) -> None:
    with open(os.path.join(OUT["dir"], "gpu-exl3-sweep.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)


def variants_for(codebook: str, smoke: bool) -> dict[str, tuple[FastConfig, tuple[int, ...]]]:
    names = SMOKE_VARIANTS if smoke else (FILTER.get("variants") or VARIANTS)
    # asm only changes MUL1 (dp4a); elsewhere it would compile the same kernel again.
    return {n: VARIANTS[n] for n in names if codebook == "mul1" or not VARIANTS[n][0].asm}


def run_variant(name: str, f, parts, x: torch.Tensor):
    """One call of a variant (or the old per-part path) on fused layer ``f``."""
    from trellm.kernels import exl3_fast, exl3_gemv

    if name == OLD:
        path = "gemv" if x.shape[0] <= 8 else "gemm"
        ys = [exl3_gemv.exl3_matmul(p, x, path) for p in parts]
        return ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)
    return exl3_fast.fast_matmul(f, x, VARIANTS[name][0])


def make_layer(in_f: int, widths: list[int], bits: int, codebook: str, device, seed: int, bias: bool = False):
    """(fused, the original parts): random EXL3 parts as the dummy models draw them."""
    from trellm.kernels import exl3_fast
    from trellm.kernels import quant_testing as qt

    parts = [qt.exl3_weight(in_f, w, bits, codebook, device, seed=seed + 7 * i, bias=bias)
             for i, w in enumerate(widths)]
    return exl3_fast.fuse(parts), parts


# ---- step 1: correctness (worker processes) ----------------------------------------------------

def _interpreter_patches() -> None:
    from trellm import envs

    if envs.triton_interpret():
        from trellm.kernels.testing import patch_interpreter_bf16, patch_interpreter_overflow_checks

        patch_interpreter_bf16()
        patch_interpreter_overflow_checks()


def _check_job(job: tuple) -> list[dict]:
    """One (K, codebook, variant): the checks, each caught (a compile error is a result)."""
    bits, codebook, name, smoke, device_name = job
    _interpreter_patches()
    from trellm.kernels import exl3_decode, exl3_fast
    from trellm.kernels.testing import EXACT, compare, quant_tolerance
    from trellm.quant.exl3.reference import forward_reference

    device = torch.device(device_name)
    out = []

    def record(kind: str, fn) -> None:
        try:
            r = dataclasses.asdict(fn())
        except Exception as e:  # compile / launch errors: record, go on
            r = {"passed": False, "error": f"{type(e).__name__}: {e}"[:1500]}
        out.append({"bits": bits, "codebook": codebook, "variant": name, "check": kind, **r})

    in_f = 256 if smoke else 1024
    layers = {"parts": make_layer(in_f, [256, 128, 128], bits, codebook, device, seed=bits, bias=True),
              "single": make_layer(in_f, [256], bits, codebook, device, seed=bits + 1)}
    if name == "decode":
        w = layers["single"][1][0]
        want = exl3_decode.exl3_reconstruct_ref(w).to(device)
        for asm in (False,) if smoke else (False, True):
            record(f"reconstruct asm={asm}", lambda asm=asm: compare(
                "fast_reconstruct", f"asm={asm}", exl3_fast.fast_reconstruct(w, asm=asm), want, EXACT, torch.float16))
        return out
    rows = (1, 8, 32) if name == OLD else VARIANTS[name][1]
    dot = name == OLD or VARIANTS[name][0].dot or VARIANTS[name][0].mma or VARIANTS[name][0].affine
    for label, (f, parts) in layers.items():
        for m in rows:
            x = torch.randn(m, in_f, device=device, generator=torch.Generator(device).manual_seed(m)).bfloat16()
            want = torch.cat([forward_reference(p, x.float()) for p in parts], dim=-1).bfloat16()
            tol = quant_tolerance(torch.bfloat16, dot and name != OLD)
            record(f"{label} rows={m}", lambda f=f, parts=parts, x=x, want=want, tol=tol: compare(
                name, f"{label} x={m}", run_variant(name, f, parts, x), want, tol, torch.bfloat16))
    return out


def step_correctness(smoke: bool, device: torch.device, res: dict, deadline: float) -> set[str]:
    """Runs the checks; returns the variants that failed anywhere."""
    jobs = []
    for bits, cb in _combos(smoke):
        names = ["decode", OLD, *variants_for(cb, smoke)]
        jobs += [(bits, cb, n, smoke, str(device)) for n in names]
    workers = max(1, min(len(jobs), 14 if not smoke else 1, (os.cpu_count() or 2) - 1))
    results, missing = [], len(jobs)
    log(f"correctness: {len(jobs)} jobs on {workers} workers (compiles fill the Triton cache)")
    if workers == 1:
        for j in jobs:
            results += _check_job(j)
            missing -= 1
    else:
        with mp.get_context("spawn").Pool(workers) as pool:
            it = pool.imap_unordered(_check_job, jobs)
            try:
                for _ in jobs:
                    results += it.next(timeout=max(5.0, deadline - time.perf_counter()))
                    missing -= 1
                    if missing % 10 == 0:
                        log(f"  {len(jobs) - missing}/{len(jobs)} jobs done")
            except mp.TimeoutError:
                pool.terminate()
    bad = [r for r in results if not r["passed"]]
    # A variant without any result (its job cut by the deadline) is not timed either: it
    # is unchecked, and its compiles would land on the timing's clock.
    failed = {r["variant"] for r in bad} | ({j[2] for j in jobs} - {r["variant"] for r in results})
    res["correctness"] = {"checks": len(results), "failed": len(bad), "jobs_without_result": missing,
                          "failed_variants": sorted(failed), "failures": bad[:60],
                          "max_abs_err": _worst(results)}
    log(f"correctness: {len(results)} checks, {len(bad)} failed ({sorted(failed) or 'none'}), "
        f"{missing} jobs without a result")
    for r in bad[:15]:
        log(f"  FAIL {r['variant']} K={r['bits']} {r['codebook']} {r['check']}: "
            f"{r.get('error') or r.get('max_abs_err')}")
    return failed


def _worst(results: list[dict]) -> dict:
    worst: dict[str, float] = {}
    for r in results:
        if "max_abs_err" in r:
            worst[r["variant"]] = max(worst.get(r["variant"], 0.0), r["max_abs_err"])
    return worst


# ---- step 2: timing ------------------------------------------------------------------------------

def _combos(smoke: bool) -> tuple[tuple[int, str], ...]:
    return COMBOS[:1] if smoke else tuple(FILTER.get("combos") or COMBOS)


def _copies(nbytes: int, smoke: bool) -> int:
    """Enough copies that one pass streams past the L2 (50 MB on an H200)."""
    return 1 if smoke else max(2, min(32, math.ceil((128 << 20) / max(nbytes, 1))))


def _time_shape(shape: str, bits: int, cb: str, names: list[str], device, smoke: bool, deadline: float
                ) -> list[dict]:
    in_f, widths = (SMOKE_SHAPES if smoke else SHAPES)[shape]
    out_f = sum(widths)
    nbytes = in_f * out_f * bits // 8
    layers = [make_layer(in_f, widths, bits, cb, device, seed=100 * i) for i in range(_copies(nbytes, smoke))]
    dense = [torch.randn(out_f, in_f, device=device, dtype=torch.bfloat16)
             for _ in range(_copies(in_f * out_f * 2, smoke))]
    rows = []
    for m in ROWS:
        x = torch.randn(m, in_f, device=device, dtype=torch.bfloat16)
        base = bench_us([lambda d=d: F.linear(x, d) for d in dense], device)
        for name in names:
            if name != OLD and m not in VARIANTS[name][1]:
                continue
            if time.perf_counter() > deadline:
                return rows
            try:
                us = bench_us([lambda f=f, p=p: run_variant(name, f, p, x) for f, p in layers], device)
                rows.append({"shape": shape, "in": in_f, "out": out_f, "bits": bits, "codebook": cb, "rows": m,
                             "variant": name, "us": round(us, 2), "bf16_us": round(base, 2),
                             "vs_bf16": round(base / us, 3), "weight_GB_s": round(nbytes / us / 1e3, 1)})
            except Exception as e:  # registers / shared memory: record, go on
                rows.append({"shape": shape, "bits": bits, "codebook": cb, "rows": m, "variant": name,
                             "error": f"{type(e).__name__}: {e}"[:800]})
    del layers, dense
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def step_timing(smoke: bool, device, res: dict, failed: set[str], deadline: float) -> list[dict]:
    rows: list[dict] = []
    res["timing"] = rows
    for bits, cb in _combos(smoke):
        names = [OLD, *[n for n in variants_for(cb, smoke) if n not in failed]]
        # mcg / 3inst: only the layer's shapes (the qkv-as-one comparison is done at mul1).
        shapes = list(SHAPES) if cb == "mul1" and not FILTER.get("layer_only") else list(LAYER_SHAPES)
        for shape in shapes:
            if time.perf_counter() > deadline:
                log(f"timing: budget spent before K={bits} {cb} {shape}")
                res["timing_cut"] = True
                return rows
            t = time.perf_counter()
            new = _time_shape(shape, bits, cb, names, device, smoke, deadline)
            rows += new
            best = {m: min((r for r in new if r["rows"] == m and "us" in r), key=lambda r: r["us"], default=None)
                    for m in ROWS}
            log(f"timing K={bits} {cb} {shape}: " + ", ".join(
                f"rows {m}: {b['variant']} {b['us']}us (bf16 {b['bf16_us']})" for m, b in best.items() if b)
                + f"  [{time.perf_counter() - t:.1f}s]")
            dump(res)
    return rows


# ---- step 3: report ------------------------------------------------------------------------------

def _us(rows: list[dict]) -> dict[tuple, float]:
    return {(r["shape"], r["bits"], r["codebook"], r["rows"], r["variant"]): r["us"] for r in rows if "us" in r}


def best_single(rows: list[dict], bits: int, cb: str, m: int, fast_only: bool = False,
                dot_only: bool = False) -> tuple[str | None, float | None]:
    """The variant with the least summed time over one layer's shapes (all measured)."""
    us = _us(rows)
    names = {r["variant"] for r in rows if r["bits"] == bits and r["codebook"] == cb and r["rows"] == m}
    if fast_only or dot_only:
        names.discard(OLD)
    if dot_only:
        names = {n for n in names if VARIANTS[n][0].dot or VARIANTS[n][0].mma}
    sums = {n: sum(us.get((s, bits, cb, m, n), math.inf) for s in LAYER_SHAPES) for n in names}
    sums = {n: v for n, v in sums.items() if v < math.inf}
    if not sums:
        return None, None
    name = min(sums, key=sums.get)
    return name, sums[name]


def per_token(rows: list[dict], res: dict) -> None:
    """32 layers of (qkv + o + gate_up + down) at one row: linears' time per token."""
    us = _us(rows)
    bf16 = {r["shape"]: r["bf16_us"] for r in rows if "bf16_us" in r and r["rows"] == 1}
    out = []
    for bits, cb in COMBOS:
        name, total = best_single(rows, bits, cb, 1)
        if name is None:
            continue
        per_shape = sum(min((v for k, v in us.items() if k[:4] == (s, bits, cb, 1) and k[4] != OLD),
                            default=math.inf) for s in LAYER_SHAPES)
        old = sum(us.get((s, bits, cb, 1, OLD), math.inf) for s in LAYER_SHAPES)
        dense = sum(bf16.get(s, math.inf) for s in LAYER_SHAPES)
        e = {"bits": bits, "codebook": cb, "best_variant": name, "linears_ms_per_token": round(LAYERS * total / 1e3, 3),
             "tok_s_bound": round(1e6 / (LAYERS * total), 1), "best_per_shape_ms": round(LAYERS * per_shape / 1e3, 3),
             "old_ms": round(LAYERS * old / 1e3, 3), "bf16_ms": round(LAYERS * dense / 1e3, 3)}
        out.append(e)
    res["per_token"] = out
    log("\n### Llama-3.1-8B linears per token (rows 1, 32 layers; LM head, attention, norms not included)\n")
    print_table(out, ("bits", "codebook", "best_variant", "linears_ms_per_token", "tok_s_bound",
                      "best_per_shape_ms", "old_ms", "bf16_ms"))


def suggest(rows: list[dict], res: dict) -> None:
    """A FastDispatch from the K=4 mul1 winners (the default the engine will run)."""
    picks = {m: best_single(rows, 4, "mul1", m) for m in ROWS}
    fast = {m: best_single(rows, 4, "mul1", m, fast_only=True) for m in ROWS}
    res["best_by_rows_k4_mul1"] = {m: p[0] for m, p in picks.items()}
    if any(p[0] is None for p in fast.values()):
        return
    gemv = fast[8][0] if VARIANTS[fast[8][0]][0].dot or VARIANTS[fast[8][0]][0].mma else best_single(rows, 4, "mul1", 8, dot_only=True)[0]
    one = fast[1][0]
    code = (f"FastDispatch(one_row={VARIANTS[one][0]!r},\n             gemv={VARIANTS[gemv][0]!r},\n"
            f"             gemm={VARIANTS[fast[32][0]][0]!r})")
    res["suggested_dispatch"] = code
    log(f"\nbest at K=4 mul1 by rows (summed over one layer): { {m: p for m, p in picks.items()} }")
    for m in ROWS:
        if picks[m][0] == OLD:
            log(f"  rows {m}: the old kernels win ({picks[m][1]:.1f} us vs {fast[m][1]:.1f} us)")
    log(f"suggested (trellm/kernels/exl3_fast.py FastDispatch):\n{code}")


def print_table(rows: list[dict], cols: tuple[str, ...]) -> None:
    log("| " + " | ".join(cols) + " |")
    log("|" + "---|" * len(cols))
    for r in rows:
        log("| " + " | ".join(str(r.get(c, "")) for c in cols) + " |")


def report(res: dict) -> None:
    rows = res.get("timing") or []
    if rows:
        log("\n### EXL3 variants vs bf16 (CUDA-graph replays, weights past the L2; best 4 per case + old)\n")
        shown = []
        for key in sorted({(r["shape"], r["bits"], r["codebook"], r["rows"]) for r in rows}):
            case = sorted((r for r in rows if (r["shape"], r["bits"], r["codebook"], r["rows"]) == key and "us" in r),
                          key=lambda r: r["us"])
            shown += case[:4] + [r for r in case[4:] if r["variant"] == OLD]
        print_table(shown, ("shape", "bits", "codebook", "rows", "variant", "us", "bf16_us", "vs_bf16",
                            "weight_GB_s"))
        per_token(rows, res)
        suggest(rows, res)
    errors = [r for r in rows if "error" in r]
    if errors:
        log(f"\n{len(errors)} timing errors, first: {errors[0]}")
    dump(res)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--budget", type=float, default=230.0, help="seconds for the whole run")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (TRITON_INTERPRET=1)")
    ap.add_argument("--variants", help="comma-separated variant names (default: all)")
    ap.add_argument("--combos", help="comma-separated K:codebook, e.g. 4:mul1,2:mul1 (default: all)")
    ap.add_argument("--layer-only", action="store_true", help="only the shapes of one layer (no qkv as one part)")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    OUT["dir"] = a.out
    if a.variants:
        unknown = [n for n in a.variants.split(",") if n not in VARIANTS]
        if unknown:
            ap.error(f"unknown variants {unknown}")
        FILTER["variants"] = a.variants.split(",")
    if a.combos:
        FILTER["combos"] = [(int(c.split(":")[0]), c.split(":")[1]) for c in a.combos.split(",")]
    FILTER["layer_only"] = a.layer_only
    start = time.perf_counter()
    deadline = start + a.budget - (2 if a.smoke else 8)  # the report's seconds
    device = torch.device("cpu" if a.smoke else "cuda")
    _interpreter_patches()
    res = {"command": " ".join(sys.argv), "date": time.strftime("%F %T"), "torch": torch.__version__,
           "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
           "variants": {n: dataclasses.asdict(c) | {"rows": r} for n, (c, r) in VARIANTS.items()}}
    try:
        import triton

        res["triton"] = triton.__version__
    except ImportError:
        res["triton"] = None
    failed: set[str] = set()
    try:
        # The checks may use at most 45% of the budget: the timing is the point of the run.
        failed = step_correctness(a.smoke, device, res, start + 0.45 * a.budget)
        log(f"== correctness done at {time.perf_counter() - start:.0f}s")
        step_timing(a.smoke, device, res, failed, deadline)
        log(f"== timing done at {time.perf_counter() - start:.0f}s")
    except Exception as e:  # report what was measured
        traceback.print_exc()
        res["error"] = f"{type(e).__name__}: {e}"[:2000]
    report(res)
    res["total_seconds"] = round(time.perf_counter() - start, 1)
    dump(res)
    log(f"== total {res['total_seconds']}s, JSON in {os.path.join(a.out, 'gpu-exl3-sweep.json')}")


if __name__ == "__main__":
    main()
