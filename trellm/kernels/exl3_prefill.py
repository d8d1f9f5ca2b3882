"""EXL3 prefill (many rows): cuBLAS on a reconstructed fp16 weight, both Hadamard
transforms as fp16 tensor-core GEMMs, each scale folded into a pass that runs anyway.

Why (H100, docs/benchmarks/gpu/README.md, 2026-12-05 (b)): with float32 transforms an
8,192-token Llama-3.1-8B prefill spent 145 ms in float32 SIMT GEMMs and ~250 ms in
elementwise passes (pad, casts, the suh / svh / 1/sqrt(128) multiplies, each over a
float32 [rows, out] copy of the accumulator), against 144 ms for the weight GEMMs.
Here every large tensor is fp16 and is read and written once per stage:

* input: ``xin = x * (suh * c)`` (one pass, all parts of a merged layer at once, into
  fp16), then ``xs = xin @ Hs`` with ``Hs = fp16(H / sqrt(128))`` (one batched GEMM);
* per column slice of the weight: ``acc = xs @ Wq`` (cuBLAS, fp16 out), ``t = acc @ Hs``
  (fp16 out), ``y = t * (svh * c) (+ bias)`` written straight into the output's columns.

``H / sqrt(128)`` is not exact in fp16, so ``Hs`` holds ``s16 = fp16(1/sqrt(128))`` and
``c = (1/sqrt(128)) / s16`` corrects it in the float32 suh / svh factors: the products
``x * s16`` are exact in the GEMMs' float32 accumulators, so the result is the float32
definition up to the fp16 roundings of xin, xs, acc and t (the decode path already
rounds xs and the weight to fp16). The tolerance tests are
tests/kernels/test_exl3_kernels.py's reconstruct-path tests, against the reference.
"""
from __future__ import annotations

from typing import Callable

import torch

from trellm.kernels.exl3_decode import _HAD_SCALE
from trellm.kernels.exl3_fused import EXL3Fused
from trellm.quant.exl3.hadamard import HAD_SIZE

_SCALED_HAD: dict[str, tuple[torch.Tensor, float]] = {}


def scaled_had(had: torch.Tensor) -> tuple[torch.Tensor, float]:
    """(fp16 H * s16, c) for the +-1 table ``had``: ``H / sqrt(128) = (H * s16) * c``."""
    key = str(had.device)
    if key not in _SCALED_HAD:
        s16 = torch.tensor(_HAD_SCALE, dtype=torch.float16)
        _SCALED_HAD[key] = ((had.float() * s16.float()).half(), _HAD_SCALE / float(s16))
    return _SCALED_HAD[key]


def input_transform(f: EXL3Fused, x2: torch.Tensor) -> torch.Tensor:
    """[parts, M, in_p] fp16: every part's ``H(x * suh) / sqrt(128)`` (zero padding)."""
    hs, c = scaled_had(f.had)
    m, parts, n_in = x2.shape[0], len(f.parts), f.in_features
    alloc = torch.zeros if n_in < f.padded_in else torch.empty
    xin = alloc(parts, m, f.padded_in, dtype=torch.float16, device=x2.device)
    # One pass for all parts: x read once, computed in float32, written as fp16.
    torch.mul(x2.unsqueeze(0), (f.suh[:, :n_in].float() * c).unsqueeze(1), out=xin[:, :, :n_in])
    return torch.matmul(xin.view(parts, -1, HAD_SIZE), hs).view(parts, m, f.padded_in)


def prefill_matmul(f: EXL3Fused, x2: torch.Tensor, max_cols: int, dtype: torch.dtype,
                   reconstruct: Callable[[EXL3Fused, tuple[int, int]], torch.Tensor]) -> torch.Tensor:
    """[M, out_features] in ``dtype``: each part's ``x @ W (+ bias)``, concatenated.
    ``reconstruct(f, (c0, c1))``: fp16 Wq of tile columns [c0, c1) (16 columns a tile);
    decoded in slices of at most ``max_cols`` columns (bounds the temporaries), never
    crossing a part (each has its own signs)."""
    if max_cols % HAD_SIZE:
        raise ValueError(f"max_cols must be a multiple of {HAD_SIZE}, got {max_cols}")
    hs, c = scaled_had(f.had)
    m = x2.shape[0]
    xs = input_transform(f, x2)
    y = torch.empty(m, f.out_features, dtype=dtype, device=x2.device)
    svh = f.svh.float() * c
    col = dest = 0
    for i, p in enumerate(f.parts):
        for c0 in range(0, p.padded_out, max_cols):
            c1 = min(p.padded_out, c0 + max_cols)
            acc = torch.matmul(xs[i], reconstruct(f, ((col + c0) // 16, (col + c1) // 16)))
            t = torch.matmul(acc.view(-1, HAD_SIZE), hs).view(m, c1 - c0)
            valid = min(c1, p.out_features) - c0  # the part's padding columns are dropped
            if valid <= 0:
                continue
            out = y[:, dest + c0:dest + c0 + valid]
            scale = svh[col + c0:col + c0 + valid]
            if f.bias is None:
                torch.mul(t[:, :valid], scale, out=out)
            else:
                torch.addcmul(f.bias[dest + c0:dest + c0 + valid].float(), t[:, :valid], scale, out=out)
        col, dest = col + p.padded_out, dest + p.out_features
    return y
