#!/usr/bin/env python3
"""On a CUDA machine: every Triton kernel of trellm/kernels against its PyTorch
reference on fresh random inputs (the comparisons of tests/kernels/, plus large and
32k+-context shapes), with timings. Prints a table, writes JSON.

Two variants that remove a launch per layer have their own rows, timed inside CUDA
graphs as the decode step runs them (kernel_us: the fused variant, reference_us: the
launches it replaces):
- ``paged_decode_fused``: decode combining its splits in the split kernel (counters),
  against the float32 oracle; ``.repeat`` runs it again on the same counters after the
  timed graph replays (bit-equal, counters back at 0); reference_us = split + reduce.
- ``gemv_glu``: SiLU-and-mul fused into the skinny GEMV, against the references
  (reference_us = silu_and_mul + cuBLAS) and ``.vs_unfused`` bit for bit against
  silu_and_mul + our GEMV (reference_us = that pair).

    python scripts/gpu_kernel_check.py --out kernels.json [--quick] [--dtypes bfloat16,float16,float32]

A case that raises (a compile error, say) is recorded as failed with its error and
the run goes on. Exit status 1 if any case failed. Without a GPU, ``TRITON_INTERPRET=1
... --quick --dtypes float32`` runs the small cases in Triton's interpreter (a dry run).
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import traceback
from typing import Callable

import torch

from trellm import envs
from trellm.kernels import kernel_supported, testing as kt

DT = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _graph_us(fn: Callable[[], object]) -> float:
    """Per-call time inside a CUDA graph (as in the decode graphs); eager off CUDA."""
    if DEV.type != "cuda":
        return kt.time_us(fn, DEV, iters=2, warmup=1)
    from trellm.kernels.gemv import graph_time_us

    return graph_time_us(fn, iters=30)


def check_paged_decode_fused(seq_lens: list[int], hq: int, hk: int, d: int, dtype: torch.dtype,
                             num_splits: int | None = None, graph_max_len: int | None = None,
                             timing: bool = False, seed: int = 0) -> list[kt.CheckResult]:
    """``graph_max_len``: fix the split count as a decode graph does (from the context
    limit, not the real lengths), which leaves trailing splits empty."""
    from trellm.kernels import paged_attention as pa

    gen = torch.Generator().manual_seed(seed)
    kv, table = kt.paged_cache(seq_lens, 16, hk, d, dtype, DEV, gen)
    bsz = len(seq_lens)
    q = torch.randn(bsz, hq, d, generator=gen).to(dtype).to(DEV)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    if num_splits is None:
        num_splits = pa.decode_num_splits(bsz, hk, graph_max_len or max(seq_lens), DEV)
    counters = torch.zeros(bsz * hk, dtype=torch.int32, device=DEV)
    out = torch.zeros_like(q)
    rows = torch.arange(bsz, dtype=torch.int32, device=DEV)  # given, so no arange launch is timed
    kw = dict(token_index=rows, out=out, num_splits=num_splits)

    def fused():
        return pa.paged_decode(q, kv, table, lens, d ** -0.5, fused_reduce=True, counters=counters, **kw)

    def two_kernels():
        return pa.paged_decode(q, kv, table, lens, d ** -0.5, **kw)

    times = (_graph_us(fused), _graph_us(two_kernels)) if timing else (None, None)
    # Checked after the timed replays: counters they left non-zero would break these runs.
    out.zero_()
    first = fused().clone()
    again = fused().clone()
    want = pa.paged_decode_ref(q, kv, table, lens, d ** -0.5, out=torch.zeros(q.shape, device=DEV))
    shape = (f"B={bsz} lens={kt._short(seq_lens)} hq={hq} hk={hk} d={d} splits={num_splits}"
             f"{' (graph bound ' + str(graph_max_len) + ')' if graph_max_len else ''}")
    res = kt.compare("paged_decode_fused", shape, first, want, kt.TOLERANCES[dtype], dtype)
    res.kernel_us, res.ref_us = times
    rep = kt.compare("paged_decode_fused.repeat", shape, again, first, kt.EXACT, dtype)
    left = int(counters.count_nonzero())
    rep.passed = rep.passed and left == 0
    rep.shape += f" counters_left={left}"
    return [res, rep]


def check_gemv_glu(rows: int, n: int, k: int, dtype: torch.dtype, timing: bool = False,
                   seed: int = 0) -> list[kt.CheckResult]:
    import torch.nn.functional as F

    from trellm.kernels.activation import silu_and_mul, silu_and_mul_ref
    from trellm.kernels.gemv import gemv, gemv_ref

    gen = torch.Generator().manual_seed(seed)
    x = (2 * torch.randn(rows, 2 * k, generator=gen)).to(dtype).to(DEV)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype).to(DEV)
    got = gemv(x, w, glu=True)
    shape = f"M={rows} N={n} K={k} (x [M, 2K])"
    res = kt.compare("gemv_glu", shape, got, gemv_ref(silu_and_mul_ref(x.float()).to(dtype), w),
                     kt.TOLERANCES[dtype], dtype)
    exact = kt.compare("gemv_glu.vs_unfused", shape, got, gemv(silu_and_mul(x), w), kt.EXACT, dtype)
    if timing:
        res.kernel_us = exact.kernel_us = _graph_us(lambda: gemv(x, w, glu=True))
        res.ref_us = _graph_us(lambda: F.linear(silu_and_mul(x), w))
        exact.ref_us = _graph_us(lambda: gemv(silu_and_mul(x), w))
    return [res, exact]


def cases(dtypes: list[torch.dtype], quick: bool) -> list[tuple[str, Callable[[], list[kt.CheckResult]]]]:
    """(label, thunk) pairs; each thunk returns CheckResults. Small shapes first."""
    out: list[tuple[str, Callable]] = []

    def add(label: str, fn: Callable, *args, **kw):
        def thunk():
            r = fn(*args, **kw)
            return r if isinstance(r, list) else [r]
        out.append((label, thunk))

    main = dtypes[0]
    for dt in dtypes:
        # decode: (seq_lens, hq, hk, d)
        for lens, hq, hk, d in [([1], 4, 4, 64), ([37], 8, 2, 64), ([1, 17, 50], 8, 2, 128),
                                ([23, 40], 16, 2, 128), ([500] * 8, 32, 8, 128)]:
            add("paged_decode", kt.check_paged_decode, lens, hq, hk, d, dt, DEV, lead_rows=2, timing=True)
        # prefill: (chunks, hq, hk, d)
        for chunks, hq, hk, d in [([(7, 7)], 4, 4, 64), ([(5, 21)], 8, 2, 64),
                                  ([(3, 3), (17, 40), (1, 9), (16, 16)], 8, 2, 128),
                                  ([(9, 25), (2, 2)], 16, 2, 64), ([(512, 512)] * 4, 32, 8, 128)]:
            add("paged_prefill", kt.check_paged_prefill, chunks, hq, hk, d, dt, DEV, lead_rows=3, timing=True)
        for rows, hidden in [(1, 64), (7, 300), (1, 4096), (256, 4096), (64, 8192)]:
            add("fused_add_rms_norm", kt.check_fused_add_rms_norm, rows, hidden, dt, DEV, timing=True)
            add("rms_norm", kt.check_rms_norm, rows, hidden, dt, DEV, timing=True)
        for rows, inter in [(1, 64), (5, 1000), (1, 14336), (512, 14336)]:
            add("silu_and_mul", kt.check_silu_and_mul, rows, inter, dt, DEV, timing=True)
        for t, hq, hk, d in [(1, 4, 4, 64), (9, 8, 2, 64), (5, 6, 2, 96), (1, 32, 8, 128), (512, 32, 8, 128)]:
            for scaling in (None, kt.LLAMA3_SCALING):
                add("rope_and_write_kv", kt.check_rope_and_write_kv, t, hq, hk, d, dt, DEV, scaling=scaling, timing=True)
        add("rope_and_write_kv", kt.check_rope_and_write_kv, 5, 16, 8, 128, dt, DEV, qk_norm=True)
        add("rope_and_write_kv", kt.check_rope_and_write_kv, 11, 8, 2, 128, dt, DEV, kt.LLAMA3_SCALING,
            with_positions=False)
        for rows, n, k in [(1, 37, 300), (3, 130, 96), (1, 4096, 4096), (8, 6144, 4096), (1, 1024, 2048),
                           (4, 4096, 14336), (1, 128256, 4096)]:
            add("gemv", kt.check_gemv, rows, n, k, dt, DEV, bias=n % 2 == 1, timing=True)
        for t, hk, d, page in [(1, 1, 64, 16), (37, 2, 128, 16), (10, 4, 64, 8), (4096, 8, 128, 16)]:
            add("write_kv", kt.check_write_kv, t, hk, d, dt, DEV, page=page)
        # (seq_lens, hq, hk, d, num_splits, graph context bound); the last two: the
        # Qwen3-0.6B and Llama-3.1-8B decode graphs (buckets 1 and 4) at short contexts.
        for lens, hq, hk, d, splits, bound in [
                ([37], 8, 2, 64, 3, None), ([200], 8, 2, 64, 3, None), ([1, 17, 50, 300], 8, 2, 128, 7, None),
                ([77, 190], 4, 4, 64, 16, None), ([23, 400], 16, 2, 128, 4, None), ([500] * 8, 32, 8, 128, None, None),
                ([700], 16, 8, 128, None, 40960), ([700, 5, 2000, 64], 32, 8, 128, None, 131072)]:
            add("paged_decode_fused", check_paged_decode_fused, lens, hq, hk, d, dt, splits, bound, timing=True)
        # Down projections: small odd shapes, Qwen3-0.6B (1024 x 3072), Llama-3.1-8B (4096 x 14336).
        for rows, n, k in [(1, 37, 300), (3, 130, 96), (1, 1024, 3072), (4, 1024, 3072), (8, 1024, 3072),
                           (1, 4096, 14336), (8, 4096, 14336)]:
            add("gemv_glu", check_gemv_glu, rows, n, k, dt, timing=True)
    for dt in [d for d in dtypes if d != torch.float16]:
        for b, v in [(1, 100), (6, 3000), (4, 5003), (1, 128256), (64, 151936)]:
            for topk_path in (True, False):
                add("sample", kt.check_sample, b, v, dt, DEV, min_p=True, use_topk_path=topk_path, timing=True)
            add("sample", kt.check_sample, b, v, dt, DEV, top_k=False, top_p=True, use_topk_path=False, timing=True)
    if not quick:
        for lens in ([33000], [32768, 40001, 5], [32768] * 16, [131072]):
            add("paged_decode", kt.check_paged_decode, lens, 32, 8, 128, main, DEV, timing=True)
        add("paged_decode", kt.check_paged_decode, [65536], 64, 8, 128, main, DEV, timing=True)
        add("paged_decode", kt.check_paged_decode, [40000] * 4, 32, 8, 128, main, DEV, num_splits=1, timing=True)
        for lens in ([33000], [32768, 40001, 5], [32768] * 16, [131072]):
            add("paged_decode_fused", check_paged_decode_fused, lens, 32, 8, 128, main, timing=True)
        add("paged_decode_fused", check_paged_decode_fused, [65536], 64, 8, 128, main, timing=True)
        for chunks in ([(512, 33000)], [(2048, 2048), (300, 40000)], [(8192, 8192)], [(1024, 65536)]):
            add("paged_prefill", kt.check_paged_prefill, chunks, 32, 8, 128, main, DEV, timing=True)
    return out


def run(dtypes: list[torch.dtype], quick: bool, only: set[str]) -> list[dict]:
    rows: list[dict] = []
    for label, thunk in cases(dtypes, quick):
        if only and label not in only:
            continue
        try:
            new = [vars(r) | {"error": None} for r in thunk()]
        except Exception as e:  # record and go on: one broken kernel must not hide the others
            tb = traceback.format_exc(limit=3)
            new = [{"kernel": label, "shape": "?", "dtype": "?", "max_abs_err": float("nan"),
                    "atol": 0.0, "rtol": 0.0, "passed": False, "kernel_us": None, "ref_us": None,
                    "error": f"{type(e).__name__}: {e}\n{tb}"}]
        for r in new:
            _print_row(r)
        rows += new
        if DEV.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _fmt_us(x: float | None) -> str:
    return "-" if x is None else f"{x:,.1f}"


def _print_row(r: dict) -> None:
    status = "ok" if r["passed"] else "FAIL"
    print(f"{r['kernel']:<36} {r['dtype']:<9} {r['max_abs_err']:>10.3g} {r['atol']:>7g}/{r['rtol']:<7g} "
          f"{status:<5} {_fmt_us(r['kernel_us']):>12} {_fmt_us(r['ref_us']):>14}  {r['shape']}", flush=True)
    if r["error"]:
        print("    " + r["error"].replace("\n", "\n    "), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="JSON output path")
    ap.add_argument("--dtypes", default="bfloat16,float16,float32", help="comma list; the first is used for long contexts")
    ap.add_argument("--quick", action="store_true", help="skip the 32k+ context cases")
    ap.add_argument("--only", default="", help="comma list of kernel names to run (default: all)")
    args = ap.parse_args()
    global DEV
    DEV = torch.device("cpu" if envs.triton_interpret() else "cuda")
    if not kernel_supported(DEV):
        print("no CUDA GPU with triton here (or set TRITON_INTERPRET=1 for a CPU dry run)", file=sys.stderr)
        return 2
    if envs.triton_interpret():
        kt.patch_interpreter_bf16()
    dtypes = [DT[d.strip()] for d in args.dtypes.split(",") if d.strip()]
    import triton

    env = {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
           "device": torch.cuda.get_device_name(DEV) if DEV.type == "cuda" else "cpu (triton interpreter)",
           "interpret": envs.triton_interpret()}
    print(" ".join(f"{k}={v}" for k, v in env.items()))
    print(f"{'kernel':<36} {'dtype':<9} {'max_abs_err':>10} {'atol/rtol':>15} {'pass':<5} "
          f"{'kernel_us':>12} {'reference_us':>14}  shape")
    t0 = time.perf_counter()
    rows = run(dtypes, args.quick, {k.strip() for k in args.only.split(",") if k.strip()})
    failed = [r for r in rows if not r["passed"]]
    summary = {"cases": len(rows), "failed": len(failed), "seconds": round(time.perf_counter() - t0, 1)}
    print(f"\n{summary['cases'] - summary['failed']} passed, {summary['failed']} failed ({summary['seconds']} s)")
    with open(args.out, "w") as f:
        json.dump({"env": env, "summary": summary, "results": rows}, f, indent=1)
    return 1 if failed else 0


DEV = torch.device("cuda")

if __name__ == "__main__":
    sys.exit(main())
