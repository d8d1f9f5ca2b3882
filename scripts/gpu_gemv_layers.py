#!/usr/bin/env python3
"""One decode token's bf16 linears, layer after layer, in one CUDA graph: cuBLAS against our
skinny GEMM (trellm/kernels/gemv.py) under block, prefetch and PDL-trigger variants.

Every layer has its own weights (L2-cold, as in the engine), in the model's order (qkv, o,
gate_up, down; then the LM head), one activation row. The time of the whole sequence
over its bytes is the linears' share of a single-stream decode step and how near the copy
bandwidth they run; per-shape calibration (GemvDispatch) times one weight again and
again, which the L2 flatters for the small ones.

    python3 scripts/gpu_gemv_layers.py --configs .gpu --out $OUT [--models llama-3.1-8b,qwen3-0.6b]

Variant names: ``cublas``, or ``ours[-nN][-kK][-preP][-wW][-late|-early]`` (BLOCK_N, BLOCK_K,
up-front weight blocks, warps, PDL trigger; defaults from gemv._blocks, 4 warps, PDL off).
Writes ``gpu-gemv-layers.json``; prints a table per model.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_timing import bench_us  # noqa: E402

from trellm.kernels import gemv as g  # noqa: E402
from trellm.kernels._triton import triton  # noqa: E402

VARIANTS = ("cublas,ours,ours-late,ours-early,ours-pre2-early,ours-pre4-early,ours-n8-early,ours-n8-pre2-early,"
            "ours-n32-pre2-early,ours-w8-pre2-early,ours-n8-k1024-early")


def shapes(cfg: dict) -> tuple[list[tuple[str, int, int]], tuple[int, int]]:
    """[(name, out, in)] of one layer, and the head's (out, in)."""
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    return [("qkv", q + 2 * kv, h), ("o", h, q), ("gate_up", 2 * i, h), ("down", h, i)], (cfg["vocab_size"], h)


def parse(variant: str) -> dict:
    opts = {"n": None, "k": None, "pre": 0, "warps": 4, "pdl": 0}
    for tag in variant.split("-")[1:]:
        if tag in ("late", "early"):
            opts["pdl"] = 1 if tag == "late" else 2
        elif tag.startswith("pre") and tag[3:] in ("1", "2", "4", "8"):
            opts["pre"] = int(tag[3:])
        elif tag[0] in "nkw" and tag[1:].isdigit():
            opts[{"n": "n", "k": "k", "w": "warps"}[tag[0]]] = int(tag[1:])
        else:
            raise ValueError(f"unknown tag {tag!r} in {variant!r}")
    return opts


def launcher(variant: str):
    """fn(x, w) -> y for one variant."""
    if variant == "cublas":
        return lambda x, w: F.linear(x, w)
    o = parse(variant)
    pdl = {"PDL": o["pdl"], "launch_pdl": True} if o["pdl"] else {}

    def run(x, w):
        n, k = w.shape
        bm, bn, bk, _ = g._blocks(1, n, k)
        bn = o["n"] or bn
        bk = o["k"] or max(32, 4096 // (bm * bn))
        pre = min(triton.next_power_of_2(o["pre"] * bk), triton.next_power_of_2(k)) if o["pre"] else 0
        y = torch.empty(1, n, dtype=x.dtype, device=x.device)
        g._gemv_kernel[(triton.cdiv(n, bn),)](x, w, w, y, 1, n, k, x.stride(0), w.stride(0), y.stride(0),
                                               y, y, y, y, 0, 0, 0.0,
                                               BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, HAS_BIAS=False, GLU=False,
                                               PRE_K=pre, num_warps=o["warps"], **pdl)
        return y
    return run


def time_sequence(fn, layers, head, x_by_in) -> float:
    """Microseconds for one token's linears (every layer, then the head) in a graph."""
    def seq():
        for ws in layers:
            for w in ws:
                fn(x_by_in[w.shape[1]], w)
        fn(x_by_in[head.shape[1]], head)
    return bench_us([seq], torch.device("cuda"), target_s=0.05, min_reps=3)


def check(fn, w, x) -> float:
    """Largest error against float32 math, relative to the result's scale."""
    want = x.float() @ w.float().t()
    got = fn(x, w).float()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-6))


def copy_tbps() -> float:
    """A 1 GiB device copy (read + write) in a graph: a practical HBM peak."""
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    return 2 * a.numel() / bench_us([lambda: b.copy_(a)], a.device, target_s=0.05, min_reps=3) / 1e6


def one_model(cfg_path: str, variants: list[str], deadline: float) -> dict:
    cfg = json.load(open(cfg_path))
    layer, (hv, hk) = shapes(cfg)
    gen = torch.Generator(device="cuda").manual_seed(0)
    layers = [[torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) / k ** 0.5
               for _, n, k in layer] for _ in range(cfg["num_hidden_layers"])]
    head = torch.randn(hv, hk, device="cuda", dtype=torch.bfloat16, generator=gen) / hk ** 0.5
    x_by_in = {k: torch.randn(1, k, device="cuda", dtype=torch.bfloat16, generator=gen) for _, _, k in layer}
    if hk not in x_by_in:
        x_by_in[hk] = torch.randn(1, hk, device="cuda", dtype=torch.bfloat16)
    nbytes = sum(w.numel() * 2 for ws in layers for w in ws) + head.numel() * 2
    out = {"config": cfg_path, "weight_GB": round(nbytes / 1e9, 3), "variants": {}}
    print(f"\n### {os.path.basename(cfg_path)}: {nbytes / 1e9:.2f} GB of linears a token\n")
    print("| variant | us / token | TB/s | max rel err |\n|---|---|---|---|")
    for v in variants:
        if time.perf_counter() > deadline:
            out["variants"][v] = {"skipped": "time budget spent"}
            continue
        try:
            fn = launcher(v)
            err = max(check(fn, w, x_by_in[w.shape[1]]) for w in layers[0] + [head])
            us = time_sequence(fn, layers, head, x_by_in)
            r = {"us": round(us, 1), "TBps": round(nbytes / us / 1e6, 3), "max_rel_err": round(err, 5)}
        except Exception as e:  # one variant failing must not stop the others
            r = {"error": f"{type(e).__name__}: {e}"[:500]}
        out["variants"][v] = r
        print(f"| {v} | {r.get('us', r.get('error'))} | {r.get('TBps', '')} | {r.get('max_rel_err', '')} |",
              flush=True)
    del layers, head
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=".gpu")
    ap.add_argument("--models", default="llama-3.1-8b,qwen3-0.6b")
    ap.add_argument("--variants", default=VARIANTS)
    ap.add_argument("--budget", type=float, default=150.0)
    ap.add_argument("--out", default=".")
    a = ap.parse_args()
    deadline = time.perf_counter() + a.budget
    res = {"command": " ".join(sys.argv), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "copy_TBps": round(copy_tbps(), 3), "models": {}}
    print(f"{res['device']}: copy bandwidth {res['copy_TBps']} TB/s")
    os.makedirs(a.out, exist_ok=True)
    for m in a.models.split(","):
        res["models"][m] = one_model(os.path.join(a.configs, f"{m}.json"), a.variants.split(","), deadline)
        with open(os.path.join(a.out, "gpu-gemv-layers.json"), "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
