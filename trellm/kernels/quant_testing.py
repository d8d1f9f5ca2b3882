"""Kernel-vs-reference checks of the quantized linears (EXL3 trellis, int8), shared by
tests/kernels/ and scripts/gpu_exl3_check.py. Inputs are fresh seeded random data:
EXL3 weights from ``random_exl3_tensors`` (any bit pattern is a valid trellis; suh
scaled so outputs are O(1)), int8 weights quantized from Gaussian ones.

Tolerances: ``testing.quant_tolerance`` (the output dtype's, at least fp16's for paths
that round activations to fp16). The reconstruct kernel must be bit-exact.
"""
from __future__ import annotations

import torch

from trellm.kernels import exl3_decode, exl3_gemv, int8_gemv
from trellm.kernels.testing import EXACT, CheckResult, compare, quant_tolerance
from trellm.quant.exl3.loading import random_exl3_tensors
from trellm.quant.exl3.reference import forward_reference
from trellm.quant.exl3.weight import EXL3Weight
from trellm.quant.int8 import quantize_int8

EXL3_FP16_PATHS = ("gemm", "reconstruct")


def exl3_weight(in_f: int, out_f: int, bits: int, codebook: str, device: torch.device | str, seed: int = 0,
                bias: bool = False) -> EXL3Weight:
    """A random EXL3 projection on ``device`` (drawn there: large layers draw fast on a GPU)."""
    g = torch.Generator(device=device).manual_seed(seed)
    tensors = {k.rsplit(".", 1)[1]: v for k, v in random_exl3_tensors("w", in_f, out_f, bits, codebook, g, device)}
    if bias:
        tensors["bias"] = (0.1 * torch.randn(out_f, generator=g, device=device)).half()
    return EXL3Weight.from_tensors(tensors, in_f, out_f)


def _label(w: EXL3Weight, extra: str) -> str:
    return f"{w.in_features}x{w.out_features} K={w.bits:g} {w.codebook} {extra}"


def check_exl3_reconstruct(w: EXL3Weight, col_tiles: tuple[int, int] | None = None,
                           block: exl3_gemv.BlockConfig | None = None) -> CheckResult:
    """The decoded trellis, bit for bit (fp16), against the reference decoder."""
    got = exl3_decode.exl3_reconstruct(w, col_tiles, block=block)
    want = exl3_decode.exl3_reconstruct_ref(w, col_tiles)
    shape = _label(w, f"cols={col_tiles or 'all'}")
    return compare("exl3_reconstruct", shape, got, want.to(got.device), EXACT, torch.float16)


def check_exl3_matmul(w: EXL3Weight, rows: int | tuple[int, ...], dtype: torch.dtype, path: str,
                      dispatch: exl3_gemv.Dispatch | None = None, seed: int = 0) -> CheckResult:
    """``exl3_matmul`` on one path against ``forward_reference`` (float32), x of shape
    ``(*rows, in_features)``."""
    rows = (rows,) if isinstance(rows, int) else tuple(rows)
    device = w.trellis.device
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(*rows, w.in_features, generator=g, device=device).to(dtype)
    got = exl3_gemv.exl3_matmul(w, x, path, dispatch)
    want = forward_reference(w, x.float()).to(dtype)
    tol = quant_tolerance(dtype, path in EXL3_FP16_PATHS)
    return compare(f"exl3_{path}", _label(w, f"x={list(rows)}"), got, want, tol, dtype)


def int8_case(n: int, k: int, device: torch.device | str, seed: int = 0, bias: bool = False,
              dtype: torch.dtype = torch.float32
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(q int8 [n, k], scale float32 [n], bias or None) from a Gaussian weight with rows of
    different magnitudes (so the per-row scales matter)."""
    g = torch.Generator(device=device).manual_seed(seed)
    w = torch.randn(n, k, generator=g, device=device) / k ** 0.5
    w = w * torch.exp(torch.randn(n, 1, generator=g, device=device) * 0.5)
    q, scale = quantize_int8(w)
    b = (0.1 * torch.randn(n, generator=g, device=device)).to(dtype) if bias else None
    return q, scale, b


def check_int8(rows: int, n: int, k: int, dtype: torch.dtype, device: torch.device | str, path: str,
               seed: int = 0, bias: bool = False) -> CheckResult:
    """``int8_linear`` on one path against ``int8_linear_ref`` (float32)."""
    q, scale, b = int8_case(n, k, device, seed, bias, dtype)
    g = torch.Generator(device=device).manual_seed(seed + 1)
    x = torch.randn(rows, k, generator=g, device=device).to(dtype)
    got = int8_gemv.int8_linear(x, q, scale, b, path)
    want = int8_gemv.int8_linear_ref(x, q, scale, b)
    # The dequant path rounds the weight to the activation dtype before cuBLAS.
    tol = quant_tolerance(dtype, path == "dequant" and dtype != torch.float32)
    return compare(f"int8_{path}", f"M={rows} N={n} K={k}{' bias' if bias else ''}", got, want, tol, dtype)
