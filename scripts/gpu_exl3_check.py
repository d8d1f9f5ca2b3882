#!/usr/bin/env python3
"""Issue 6's GPU run in one command: the EXL3 and int8 kernels against their references,
their speed against bf16 cuBLAS, and a Llama-3.1-8B-shaped dummy model end to end.

    python3 scripts/gpu_exl3_check.py --out DIR [--config .gpu/llama-3.1-8b.json] [--stages ...]

Stages (each catches its own failure, records it and lets the rest run; JSON is
rewritten to DIR/gpu-exl3.json after every stage; a stage that would start past
--budget seconds is skipped and says so):

* correctness: every K 1..8 x codebook, 4096x4096 and 4096x14336, fresh random trellis:
  the decode bit-exact, GEMV at batch 1/4/16, GEMM at 16/64/256, reconstruct + cuBLAS
  at 64/256, each against the float32 reference. Run in parallel worker processes
  (Triton compiles dominate; they land in Triton's on-disk cache for the later stages).
* timing: CUDA-graph replays, weights rotated through enough copies to defeat the L2,
  every path vs bf16 cuBLAS at the same shape; effective GB/s of the packed weight;
  the best path per batch and the dispatch thresholds that follow.
* sweep: a few GEMV / GEMM block configurations at K=4.
* int8: the W8A16 kernel and dequant + cuBLAS, checked and timed the same way.
* The engine runs merged layers through the fused-layer kernel (trellm/kernels/exl3_fast.py,
  registered in trellm/quant/exl3/method.py); correctness and timing include it as path "fast"
  (one part, its default dispatch). scripts/gpu_exl3_sweep.py compares its variants.
* engine: dummy 8B with --quantization exl3 --bits 2/3/4, int8 and bf16: single-stream
  decode tok/s (128-token prompt, 256 new, greedy, ignore_eos), prefill tok/s of an
  8192-token prompt, and aggregate decode at 32 concurrent for 4.0 bpw.

``--smoke`` runs tiny shapes on the CPU (Triton's interpreter when TRITON_INTERPRET=1
and triton are there, else the kernel stages say they are skipped; the engine stage
uses the reference path): a check of this script, not a result.
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
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_timing import bench_us as _bench_us  # noqa: E402

CODEBOOKS = ("3inst", "mcg", "mul1")
GPU = dict(shapes=((4096, 4096), (4096, 14336)), bits=tuple(range(1, 9)), codebooks=CODEBOOKS,
           paths={"gemv": (1, 4, 16), "gemm": (16, 64, 256), "reconstruct": (64, 256)},
           timing_combos=((2, "mul1"), (3, "mul1"), (4, "mul1"), (4, "3inst"), (4, "mcg"), (8, "mul1")),
           timing_batches=(1, 4, 16, 64, 256), fine_combo=(4, "mul1"),
           fine_batches=(1, 2, 4, 8, 16, 32, 64, 128, 256), int8_batches=(1, 4, 16, 64, 256),
           l2_bytes=256 << 20, workers=12)
SMOKE = dict(shapes=((128, 256),), bits=(3,), codebooks=("mul1", "3inst"),
             paths={"gemv": (1, 4), "gemm": (16, 33), "reconstruct": (33,)},
             timing_combos=((3, "mul1"),), timing_batches=(1, 16), fine_combo=(3, "mul1"), fine_batches=(1, 16, 33),
             int8_batches=(1, 16), l2_bytes=1, workers=2)
ENGINE_RESERVE_S = 240
"""Seconds of --budget the correctness stage leaves to the engine stage after it."""
TINY_MODEL = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=300, hidden_size=128,
                  intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                  head_dim=32, max_position_embeddings=1024, rms_norm_eps=1e-5, rope_theta=10000.0,
                  tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


def log(msg: str) -> None:
    print(msg, flush=True)


def kernels_usable(device: torch.device) -> bool:
    from trellm.kernels import kernel_supported

    return kernel_supported(device)


def interpreter_patches() -> None:
    from trellm import envs

    if envs.triton_interpret():
        from trellm.kernels.testing import patch_interpreter_bf16, patch_interpreter_overflow_checks

        patch_interpreter_bf16()
        patch_interpreter_overflow_checks()


# ---- timing ---------------------------------------------------------------------------------

def bench_us(fns: list[Callable[[], object]], device: torch.device) -> float:
    """gpu_timing.bench_us replayed for ~50 ms (3 to 200 replays)."""
    return _bench_us(fns, device, target_s=0.05, min_reps=3, max_reps=200)


def copies_for(nbytes: int, cfg: dict) -> int:
    """Weight copies so that one pass over them streams past the L2."""
    return max(2, min(64, math.ceil(cfg["l2_bytes"] / max(nbytes, 1))))


# ---- stage: correctness (worker processes) -------------------------------------------------------

def _correct_job(job: tuple) -> list[dict]:
    """One (bits, codebook) on every shape: the checks of tests/kernels at full size."""
    bits, codebook, shapes, paths, device_name = job
    interpreter_patches()
    from trellm.kernels import quant_testing as qt

    device = torch.device(device_name)
    out = []
    for in_f, out_f in shapes:
        w = qt.exl3_weight(in_f, out_f, bits, codebook, device, seed=bits * 7 + CODEBOOKS.index(codebook))
        checks = [lambda w=w: qt.check_exl3_reconstruct(w)]
        for path, batches in paths.items():
            checks += [lambda w=w, p=path, b=b: qt.check_exl3_matmul(w, b, torch.bfloat16, p, seed=b)
                       for b in batches]
        # The engine's path (the fused-layer kernel, exl3_fast, default dispatch) at every batch.
        fast_batches = sorted({b for bs in paths.values() for b in bs})
        checks += [lambda w=w, b=b: check_fast(w, b) for b in fast_batches]
        for check in checks:
            try:
                out.append(dataclasses.asdict(check()))
            except Exception as e:  # a compile error: record it, go on
                out.append({"kernel": "error", "shape": f"{in_f}x{out_f} K={bits} {codebook}", "passed": False,
                            "error": f"{type(e).__name__}: {e}"[:2000]})
        del w
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def check_fast(w, rows: int):
    """exl3_fast.fast_matmul (what the engine runs through the layer-kernel registry) against
    the float32 reference, bf16 x; fp16-activation tolerance as the GEMM path's."""
    from trellm.kernels import exl3_fast
    from trellm.kernels.testing import compare, quant_tolerance
    from trellm.quant.exl3.reference import forward_reference

    x = torch.randn(rows, w.in_features, device=w.trellis.device,
                    generator=torch.Generator(w.trellis.device).manual_seed(rows)).bfloat16()
    got = exl3_fast.fast_matmul(exl3_fast.fuse([w]), x)
    want = forward_reference(w, x.float()).bfloat16()
    return compare("exl3_fast", f"{w.in_features}x{w.out_features} K={w.bits:g} {w.codebook} x={rows}", got, want,
                   quant_tolerance(torch.bfloat16, True), torch.bfloat16)


def stage_correctness(cfg: dict, device: torch.device, res: dict, deadline: float) -> None:
    if not kernels_usable(device):
        res["correctness"] = {"skipped": "Triton kernels cannot run here (no CUDA; TRITON_INTERPRET unset?)"}
        return
    jobs = [(b, cb, cfg["shapes"], cfg["paths"], str(device)) for b in cfg["bits"] for cb in cfg["codebooks"]]
    workers = min(cfg["workers"], len(jobs), max(1, (os.cpu_count() or 2) - 2))
    results: list[dict] = []
    missing = len(jobs)
    with mp.get_context("spawn").Pool(workers) as pool:
        it = pool.imap_unordered(_correct_job, jobs)
        try:
            for _ in jobs:  # a worker that dies (not an exception: those are recorded) must not hang the run
                results += it.next(timeout=max(10.0, deadline - time.perf_counter()))
                missing -= 1
        except mp.TimeoutError:
            pool.terminate()
    bad = [r for r in results if not r["passed"]]
    res["correctness"] = {"checks": len(results), "failed": len(bad), "failures": bad[:50],
                          "jobs_without_result": missing, "max_abs_err_by_kernel": _worst(results)}
    log(f"correctness: {len(results)} checks, {len(bad)} failed, {missing} (bits, codebook) jobs without a result")
    for r in bad[:20]:
        log(f"  FAIL {r.get('kernel')} {r.get('shape')}: {r.get('error') or r.get('max_abs_err')}")


def _worst(results: list[dict]) -> dict:
    worst: dict[str, float] = {}
    for r in results:
        if "max_abs_err" in r:
            worst[r["kernel"]] = max(worst.get(r["kernel"], 0.0), r["max_abs_err"])
    return worst


# ---- stage: timing -----------------------------------------------------------------------------

def _time_exl3(in_f: int, out_f: int, bits: int, codebook: str, batches, device, cfg: dict) -> list[dict]:
    from trellm.kernels import exl3_fast, exl3_gemv
    from trellm.kernels import quant_testing as qt

    w0 = qt.exl3_weight(in_f, out_f, bits, codebook, device)
    nbytes = w0.trellis.numel() * 2
    ws = [w0] + [qt.exl3_weight(in_f, out_f, bits, codebook, device, seed=i) for i in range(1, copies_for(nbytes, cfg))]
    dense = [torch.randn(out_f, in_f, device=device, dtype=torch.bfloat16)
             for _ in range(copies_for(out_f * in_f * 2, cfg))]
    rows = []
    for b in batches:
        x = torch.randn(b, in_f, device=device, dtype=torch.bfloat16)
        base = bench_us([lambda d=d: F.linear(x, d) for d in dense], device)
        for path in ("gemv", "gemm", "reconstruct"):
            if path == "gemv" and b > 16:
                continue
            us = bench_us([lambda w=w, p=path: exl3_gemv.exl3_matmul(w, x, p) for w in ws], device)
            rows.append({"shape": f"{in_f}x{out_f}", "bits": bits, "codebook": codebook, "batch": b, "path": path,
                         "us": round(us, 2), "packed_GB_s": round(nbytes / us / 1e3, 1),
                         "bf16_us": round(base, 2), "speedup_vs_bf16": round(base / us, 3)})
        # The engine's path: the fused-layer kernel with its default dispatch (exl3_fast).
        fused = [exl3_fast.fuse([w]) for w in ws]
        us = bench_us([lambda f=f: exl3_fast.fast_matmul(f, x) for f in fused], device)
        rows.append({"shape": f"{in_f}x{out_f}", "bits": bits, "codebook": codebook, "batch": b, "path": "fast",
                     "us": round(us, 2), "packed_GB_s": round(nbytes / us / 1e3, 1),
                     "bf16_us": round(base, 2), "speedup_vs_bf16": round(base / us, 3)})
    del ws, dense
    return rows


def best_paths(rows: list[dict]) -> dict:
    """Per (shape, bits, codebook, batch): the fastest path; then thresholds: the largest
    batch where the GEMV still wins everywhere it ran, the smallest from which
    reconstruct wins everywhere. The thresholds (exl3_gemv's Dispatch) leave out "fast",
    which has its own dispatch (exl3_fast.FastDispatch)."""
    best: dict[tuple, dict] = {}
    best_old: dict[tuple, dict] = {}
    for r in rows:
        key = (r["shape"], r["bits"], r["codebook"], r["batch"])
        for table in (best, best_old) if r["path"] != "fast" else (best,):
            if key not in table or r["us"] < table[key]["us"]:
                table[key] = r
    batches = sorted({k[3] for k in best_old})
    wins = {b: {r["path"] for k, r in best_old.items() if k[3] == b} for b in batches}
    gemv_max = max([b for b in batches if wins[b] == {"gemv"}], default=0)
    recon = [b for b in batches if all(wins[c] == {"reconstruct"} for c in batches if c >= b)]
    return {"best": [{"case": "/".join(map(str, k)), "path": r["path"], "us": r["us"],
                      "speedup_vs_bf16": r["speedup_vs_bf16"]} for k, r in sorted(best.items())],
            "winners_by_batch": {str(b): sorted(w) for b, w in wins.items()},
            "suggested": {"gemv_max_rows": gemv_max, "reconstruct_min_rows": min(recon) if recon else None}}


def stage_timing(cfg: dict, device: torch.device, res: dict) -> None:
    if not kernels_usable(device):
        res["timing"] = {"skipped": "Triton kernels cannot run here"}
        return
    rows: list[dict] = []
    res["timing"] = {"rows": rows}
    for in_f, out_f in cfg["shapes"]:
        for bits, codebook in cfg["timing_combos"]:
            # One combination at more batch sizes, for the thresholds.
            fine = (bits, codebook) == cfg["fine_combo"]
            batches = cfg["fine_batches"] if fine else cfg["timing_batches"]
            rows += _time_exl3(in_f, out_f, bits, codebook, batches, device, cfg)
            dump(res)
    res["timing"]["dispatch"] = best_paths(rows)
    print_rows("EXL3 kernels (CUDA-graph replays, weights rotated past the L2)", rows,
               ("shape", "bits", "codebook", "batch", "path", "us", "packed_GB_s", "bf16_us", "speedup_vs_bf16"))
    log(f"suggested dispatch: {res['timing']['dispatch']['suggested']}")


def stage_sweep(cfg: dict, device: torch.device, res: dict) -> None:
    """Block sizes of the GEMV (batch 1, 4) and GEMM (batch 64) at K = 4, mul1."""
    if not kernels_usable(device):
        res["sweep"] = {"skipped": "Triton kernels cannot run here"}
        return
    from trellm.kernels import exl3_gemv
    from trellm.kernels import quant_testing as qt
    from trellm.kernels.exl3_gemv import BlockConfig

    gemv = [BlockConfig(4, 8, 4), BlockConfig(2, 8, 4), BlockConfig(8, 8, 4), BlockConfig(4, 4, 2),
            BlockConfig(4, 8, 8), BlockConfig(8, 4, 4)]
    gemm = [BlockConfig(16, 8, 4), BlockConfig(16, 4, 4), BlockConfig(16, 8, 8), BlockConfig(32, 8, 8)]
    rows: list[dict] = []
    res["sweep"] = {"rows": rows}
    in_f, out_f = cfg["shapes"][-1]
    w0 = qt.exl3_weight(in_f, out_f, 4 if device.type == "cuda" else 3, "mul1", device)
    ws = [w0] + [qt.exl3_weight(in_f, out_f, int(w0.bits), "mul1", device, seed=i)
                 for i in range(1, copies_for(w0.trellis.numel() * 2, cfg))]
    for path, configs, batches in (("gemv", gemv, (1, 4)), ("gemm", gemm, (64,))):
        for c in configs if device.type == "cuda" else configs[:2]:
            d = dataclasses.replace(exl3_gemv.get_dispatch(), **{path: c})
            for b in batches:
                x = torch.randn(b, in_f, device=device, dtype=torch.bfloat16)
                try:
                    us = bench_us([lambda w=w: exl3_gemv.exl3_matmul(w, x, path, d) for w in ws], device)
                    rows.append({"path": path, "config": dataclasses.asdict(c), "batch": b, "us": round(us, 2)})
                except Exception as e:  # an invalid config (registers): record, go on
                    rows.append({"path": path, "config": dataclasses.asdict(c), "batch": b,
                                 "error": f"{type(e).__name__}: {e}"[:500]})
        dump(res)
    print_rows(f"block sweep at {in_f}x{out_f} K={int(w0.bits)} mul1", rows, ("path", "config", "batch", "us"))


# ---- stage: int8 ---------------------------------------------------------------------------------

def stage_int8(cfg: dict, device: torch.device, res: dict) -> None:
    if not kernels_usable(device):
        res["int8"] = {"skipped": "Triton kernels cannot run here"}
        return
    from trellm.kernels import int8_gemv
    from trellm.kernels import quant_testing as qt

    checks, rows = [], []
    res["int8"] = {"checks": checks, "rows": rows}
    for in_f, out_f in cfg["shapes"]:
        for b in cfg["int8_batches"]:
            for path in ("triton", "dequant"):
                checks.append(dataclasses.asdict(qt.check_int8(b, out_f, in_f, torch.bfloat16, device, path, seed=b)))
        ws = [qt.int8_case(out_f, in_f, device, seed=i) for i in range(copies_for(out_f * in_f, cfg))]
        dense = [torch.randn(out_f, in_f, device=device, dtype=torch.bfloat16)
                 for _ in range(copies_for(out_f * in_f * 2, cfg))]
        for b in cfg["int8_batches"]:
            x = torch.randn(b, in_f, device=device, dtype=torch.bfloat16)
            base = bench_us([lambda d=d: F.linear(x, d) for d in dense], device)
            for path in ("triton", "dequant"):
                us = bench_us([lambda q=q, s=s, p=path: int8_gemv.int8_linear(x, q, s, None, p) for q, s, _ in ws],
                              device)
                rows.append({"shape": f"{in_f}x{out_f}", "batch": b, "path": path, "us": round(us, 2),
                             "int8_GB_s": round(out_f * in_f / us / 1e3, 1), "bf16_us": round(base, 2),
                             "speedup_vs_bf16": round(base / us, 3)})
        del ws, dense
        dump(res)
    bad = [c for c in checks if not c["passed"]]
    res["int8"]["failed"] = len(bad)
    log(f"int8: {len(checks)} checks, {len(bad)} failed" + "".join(f"\n  FAIL {c['kernel']} {c['shape']}" for c in bad))
    print_rows("int8 W8A16 (CUDA-graph replays)", rows,
               ("shape", "batch", "path", "us", "int8_GB_s", "bf16_us", "speedup_vs_bf16"))


# ---- stage: engine ---------------------------------------------------------------------------------

ENGINE_FILTER: list[str] = []


def set_dispatch_from(one_row: str | None, gemv: str | None, gemv_max_rows: int | None = None,
                      wide_mma: bool = True, in_fwht: bool = True, fuse_in: bool = True) -> None:
    """The EXL3 dispatch with the named sweep variants in place of the defaults."""
    if not one_row and not gemv and gemv_max_rows is None and wide_mma and in_fwht and fuse_in:
        return
    from dataclasses import replace

    from gpu_exl3_sweep import VARIANTS
    from trellm.kernels import exl3_fast

    d = exl3_fast.get_dispatch()
    if one_row:
        d = replace(d, one_row=VARIANTS[one_row][0])
    if gemv:
        d = replace(d, gemv=VARIANTS[gemv][0])
    if gemv_max_rows is not None:
        d = replace(d, gemv_max_rows=gemv_max_rows)
    d = replace(d, wide_mma=wide_mma, in_fwht=in_fwht, fuse_in=fuse_in)
    exl3_fast.set_dispatch(d)
    log(f"EXL3 dispatch: {d}")


def _engine_runs() -> list[tuple[str, dict, bool]]:
    """(name, LLM kwargs, whether to measure 32 concurrent too)."""
    runs = [(f"exl3 {k}.0 bpw", {"quantization": "exl3", "bits": float(k)}, k == 4) for k in (2, 3, 4)]
    # bf16 at 32 concurrent too: issue 6 asks EXL3 4.0 bpw to match it there.
    runs += [("int8", {"quantization": "int8"}, False), ("bf16", {"quantization": "none"}, True)]
    return [r for r in runs if not ENGINE_FILTER or any(f in r[0] for f in ENGINE_FILTER)]


def _one_engine(cfg_path: str, device: str, kw: dict, concurrent: bool, smoke: bool) -> dict:
    from gpu_bench import free, prompts, run
    from trellm import LLM

    vocab = json.load(open(cfg_path))["vocab_size"]
    prefill_len, new, conc = (64, 8, 4) if smoke else (8192, 256, 32)
    t0 = time.perf_counter()
    memory = {"gpu_memory_utilization": 0.85} if device == "cuda" else {"kv_cache_memory": 64 << 20}
    llm = LLM(f"dummy:{cfg_path}", dtype="bfloat16" if device == "cuda" else "float32", device=device,
              max_model_len=prefill_len + 512, enable_prefix_caching=False,
              max_num_seqs=conc if concurrent else 4, max_num_batched_tokens=max(prefill_len, 2048), **memory, **kw)
    w = llm.engine.worker
    r = {"load_and_capture_s": round(time.perf_counter() - t0, 1), "cuda_graphs": w.runner.graphs is not None,
         "quant": (w.arch.quantization_config or {}).get("quant_method", "none")}
    if device == "cuda":
        r["weights_GiB"] = round(torch.cuda.memory_allocated() / 2**30, 2)
    run(llm, prompts(vocab, 1, 64, seed=1), 8)  # warm-up
    single = run(llm, prompts(vocab, 1, 16 if smoke else 128, seed=2), new)
    r["decode_tok_s"] = round(single["decode_tok_s"], 1)
    r["ttft_ms"] = round(single["ttft_ms"], 1)
    # greedy tokens, so runs under different dispatches can be compared (scripts/tokens_diff.py)
    r["single_token_ids"] = single["token_ids"][0]
    r.update(_margins(llm, prompts(vocab, 1, 16 if smoke else 128, seed=2), new, r["single_token_ids"]))
    walls = [run(llm, prompts(vocab, 1, prefill_len, seed=3 + i), 1)["wall_s"] for i in range(2)]
    r[f"prefill_{prefill_len}_tok_s"] = round(prefill_len / min(walls), 1)
    if concurrent:
        agg = run(llm, prompts(vocab, conc, 16 if smoke else 128, seed=9), new // 2)
        r[f"aggregate_{conc}"] = {"tok_s": round(agg["tokens"] / agg["wall_s"], 1),
                                  "decode_tok_s": round(agg["decode_tok_s"], 1), "new_per_request": new // 2}
        r[f"aggregate_{conc}_token_ids"] = agg["token_ids"]
    del llm, w
    free()
    return r


def _margins(llm, batch: list[list[int]], new: int, tokens: list[int]) -> dict:
    """The single stream again with top-2 log-probs: each step's margin (top-1 minus top-2
    log-prob), so tokens_diff.py can say whether two runs parted at a near-tie."""
    from trellm import SamplingParams

    out = llm.generate([{"prompt_token_ids": batch[0]}],
                       SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True, logprobs=2))[0].outputs[0]
    margins = [round(t.top[0][1] - t.top[1][1], 5) if len(t.top) > 1 else None for t in out.logprobs]
    return {"single_margins": margins, "single_margins_same_tokens": list(out.token_ids) == tokens}


def stage_engine(cfg_path: str, device: str, res: dict, smoke: bool, deadline: float) -> None:
    out = res.setdefault("engine", {})
    for name, kw, concurrent in _engine_runs():
        if time.perf_counter() > deadline:
            out[name] = {"skipped": "time budget spent"}
            continue
        try:
            out[name] = _one_engine(cfg_path, device, kw, concurrent, smoke)
        except Exception as e:  # one configuration failing must not stop the others
            traceback.print_exc()
            out[name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
        log(f"engine {name}: {out[name]}")
        dump(res)


# ---- output ----------------------------------------------------------------------------------------

OUT = {"dir": "."}


def dump(res: dict) -> None:
    with open(os.path.join(OUT["dir"], "gpu-exl3.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)


def print_rows(title: str, rows: list[dict], cols: tuple[str, ...]) -> None:
    log(f"\n## {title}\n| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in rows:
        log("| " + " | ".join(str(r.get(c, r.get("error", ""))) for c in cols) + " |")


def print_engine(res: dict) -> None:
    rows = [{"config": k, **{kk: (json.dumps(v) if isinstance(v, dict) else v) for kk, v in r.items()}}
            for k, r in res.get("engine", {}).items()]
    if not rows:
        return
    cols = ("config", "decode_tok_s", "prefill_8192_tok_s", "prefill_64_tok_s", "aggregate_32", "aggregate_4",
            "ttft_ms", "weights_GiB", "load_and_capture_s", "error", "skipped")
    print_rows("engine (dummy model)", rows, tuple(c for c in cols if any(c in r for r in rows)))


def header(device: torch.device) -> dict:
    from trellm.kernels import exl3_fast, exl3_gemv, int8_gemv

    h = {"command": " ".join(sys.argv), "date": time.strftime("%F %T"), "torch": torch.__version__,
         "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
         "exl3_dispatch": dataclasses.asdict(exl3_gemv.get_dispatch()),
         "exl3_fast_dispatch": dataclasses.asdict(exl3_fast.get_dispatch()),
         "int8_dispatch": dataclasses.asdict(int8_gemv.get_dispatch())}
    try:
        import triton

        h["triton"] = triton.__version__
    except ImportError:
        h["triton"] = None
    return h


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--config", default=".gpu/llama-3.1-8b.json")
    # The engine figures right after the checks: a run cut by the budget keeps them.
    ap.add_argument("--stages", default="correctness,engine,timing,int8,sweep")
    ap.add_argument("--budget", type=float, default=500.0,
                    help="seconds; a stage (or engine configuration) that would start later is skipped")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--engines", help="comma-separated substrings of the engine runs to keep, e.g. 'exl3 4,int8'")
    ap.add_argument("--one-row", help="a scripts/gpu_exl3_sweep.py variant for M = 1 (the dispatch's one_row)")
    ap.add_argument("--gemv", help="a scripts/gpu_exl3_sweep.py variant for 2..8 rows (the dispatch's gemv)")
    ap.add_argument("--no-wide-mma", action="store_true",
                    help="one row of K 5-6 (the 6-bit head) on the split kernel, as before FastDispatch.wide_mma")
    ap.add_argument("--gemv-max-rows", type=int, help="the most rows the gemv variant takes (default 8)")
    ap.add_argument("--no-in-fwht", action="store_true",
                    help="the input transform by the tf32x3 dot on 16-row blocks, as before FastDispatch.in_fwht")
    ap.add_argument("--no-fuse-in", action="store_true",
                    help="the input transform in a launch of its own, as before FastDispatch.fuse_in")
    a = ap.parse_args()
    set_dispatch_from(a.one_row, a.gemv, a.gemv_max_rows, not a.no_wide_mma, not a.no_in_fwht, not a.no_fuse_in)
    if a.engines:
        ENGINE_FILTER.extend(a.engines.split(","))
    os.makedirs(a.out, exist_ok=True)
    OUT["dir"] = a.out
    start = time.perf_counter()
    deadline = start + a.budget
    device = torch.device("cpu" if a.smoke else "cuda")
    cfg = SMOKE if a.smoke else GPU
    interpreter_patches()
    cfg_path = a.config
    if a.smoke:
        cfg_path = os.path.join(a.out, "tiny-llama.json")
        with open(cfg_path, "w") as f:
            json.dump(TINY_MODEL, f)
    res = header(device)
    # The checks stop early enough to leave the engine stage its time.
    checks_deadline = deadline - (0 if a.smoke else ENGINE_RESERVE_S)
    stages = {"correctness": lambda: stage_correctness(cfg, device, res, checks_deadline),
              "timing": lambda: stage_timing(cfg, device, res),
              "sweep": lambda: stage_sweep(cfg, device, res),
              "int8": lambda: stage_int8(cfg, device, res),
              "engine": lambda: stage_engine(cfg_path, device.type, res, a.smoke, deadline)}
    for name in a.stages.split(","):
        t = time.perf_counter()
        if t > deadline:
            res[f"{name}_skipped"] = "time budget spent"
            continue
        try:
            stages[name]()
        except Exception as e:  # keep what the other stages measure
            traceback.print_exc()
            res[f"{name}_error"] = f"{type(e).__name__}: {e}"[:2000]
        res[f"{name}_seconds"] = round(time.perf_counter() - t, 1)
        dump(res)
        log(f"== {name} done in {res[f'{name}_seconds']}s (total {time.perf_counter() - start:.0f}s)")
    print_engine(res)
    res["total_seconds"] = round(time.perf_counter() - start, 1)
    dump(res)


if __name__ == "__main__":
    main()
