#!/usr/bin/env python3
"""A fixed EXL3 workload for Nsight Compute: why the one-row kernel runs at ~1/4 of what
its bytes and instructions allow (docs/benchmarks/gpu/README.md, 2026-12-05).

Runs one Llama-3.1-8B layer's linears (qkv 4096x6144 as 3 parts, o 4096x4096, gate_up
4096x28672 as 2 parts, down 14336x4096) at K = 4 MUL1 for ``--rows`` rows, ``--iters``
times, eagerly (ncu profiles kernel launches, not graph replays), with the dispatch's
default variant or ``--variant``. On the device machine:

    ncu --target-processes all -k regex:'_split_kernel|_fast_kernel|_row_kernel' -c 4 \\
        --set full -o $OUT/exl3-one-row python3 scripts/gpu_ncu_exl3.py --rows 1
    ncu --import $OUT/exl3-one-row.ncu-rep --page details --print-units base | head -400

``--check``: also compare each output against the reference decoder (a small copy of the
shapes), so a profile is never of a wrong kernel.
"""
from __future__ import annotations

import argparse

import torch

from trellm.kernels import exl3_fast
from trellm.kernels import quant_testing as qt
from trellm.kernels.exl3_fast import FastConfig

SHAPES = {"qkv": (4096, [4096, 1024, 1024]), "o": (4096, [4096]), "gate_up": (4096, [14336, 14336]),
          "down": (14336, [4096])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--codebook", default="mul1")
    ap.add_argument("--variant", default=None, help="a FastConfig as k=v,k=v (e.g. tk=8,tn=4,split=True)")
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    dev = torch.device("cuda")
    cfg = None
    if args.variant:
        kw = dict(kv.split("=") for kv in args.variant.split(","))
        cfg = FastConfig(**{k: (v == "True") if v in ("True", "False") else int(v) for k, v in kw.items()})
    layers = {}
    for name, (n_in, widths) in SHAPES.items():
        parts = [qt.exl3_weight(n_in, w, args.bits, args.codebook, dev, seed=i) for i, w in enumerate(widths)]
        layers[name] = (exl3_fast.fuse(parts), parts)
    x = {n_in: torch.randn(args.rows, n_in, device=dev, dtype=torch.bfloat16) for n_in, _ in SHAPES.values()}
    if args.check:
        from trellm.quant.exl3.reference import forward_reference
        for name, (f, parts) in layers.items():
            xi = x[f.in_features][:, :]
            got = exl3_fast.fast_matmul(f, xi, cfg).float()
            want = torch.cat([forward_reference(p, xi.float()) for p in parts], -1)
            err = ((got - want).norm() / want.norm()).item()
            print(f"check {name}: relative error {err:.2e}", flush=True)
            if err > 2e-2:
                raise SystemExit(f"{name}: relative error {err:.2e} too large; not profiling a wrong kernel")
    for _ in range(args.iters):
        for f, _parts in layers.values():
            exl3_fast.fast_matmul(f, x[f.in_features], cfg)
    torch.cuda.synchronize()
    print(f"ran {args.iters} x {len(layers)} linears at {args.rows} rows", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
