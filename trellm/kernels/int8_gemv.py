"""INT8 weight-only linear (W8A16) in Triton: ``y = (x @ q^T) * scale (+ bias)``.

``q`` int8 [N, K] (F.linear's orientation), ``scale`` float32 [N] per output row
(absmax / 127, trellm/quant/int8.py). The activations stay in the model dtype; int8
values are exact in bf16/fp16/tf32, so the kernel converts the weight tile in
registers and the tensor cores multiply ``[BM, BK] x [BK, BN]``, float32
accumulation, the per-row scale applied once at the end.

Small M (decode) is memory bound: a program owns BN output rows and a split of K
(split-K, about _PROGRAMS_PER_SM programs per SM); the splits' float32 partials are
summed, scaled and cast by ``_reduce_kernel``, or, with one split, the main kernel
does the epilogue itself. Large M (prefill) dequantizes the weight into a temporary
in the activation dtype and hands it to cuBLAS (``int8_linear_dequant``);
``Int8Dispatch.triton_max_rows`` is the crossover, to be set from GPU measurements.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from trellm.kernels._triton import tl, triton
from trellm.kernels.paged_attention import _num_sms

_PROGRAMS_PER_SM = 4


@dataclass(frozen=True)
class Int8Dispatch:
    triton_max_rows: int = 128
    """M <= this: the Triton kernel; above: dequantize + cuBLAS."""
    block_n: int = 64
    block_k: int = 128
    warps: int = 4


_STATE = {"dispatch": Int8Dispatch()}


def set_dispatch(dispatch: Int8Dispatch) -> None:
    _STATE["dispatch"] = dispatch


def get_dispatch() -> Int8Dispatch:
    return _STATE["dispatch"]


@triton.jit(do_not_specialize=["M", "steps_per_split"])
def _int8_kernel(x_ptr, q_ptr, scale_ptr, bias_ptr, out_ptr, part_ptr, M, N, KD, steps_per_split,
                 stride_x, stride_q, stride_o,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DIRECT: tl.constexpr,
                 HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    m = tl.program_id(2) * BM + tl.arange(0, BM)
    n = pid_n * BN + tl.arange(0, BN)
    mmask = m < M
    nmask = n < N
    acc = tl.zeros((BM, BN), tl.float32)
    for step in range(pid_s * steps_per_split, (pid_s + 1) * steps_per_split):
        k = step * BK + tl.arange(0, BK)
        kmask = k < KD
        x = tl.load(x_ptr + m[:, None].to(tl.int64) * stride_x + k[None, :],
                    mask=mmask[:, None] & kmask[None, :], other=0.0)
        q = tl.load(q_ptr + n[:, None].to(tl.int64) * stride_q + k[None, :],
                    mask=nmask[:, None] & kmask[None, :], other=0)
        # int8 -> float without the GPU's quarter-rate int-to-float conversion: the float32
        # with bits 0x4B000000 + (q + 128) is 2^23 + q + 128, exactly.
        w = ((q.to(tl.int32) + 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0).to(x.dtype)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    if DIRECT:
        y = acc * tl.load(scale_ptr + n, mask=nmask, other=0.0)[None, :]
        if HAS_BIAS:
            y = y + tl.load(bias_ptr + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + m[:, None].to(tl.int64) * stride_o + n[None, :], y.to(out_ptr.dtype.element_ty),
                 mask=mmask[:, None] & nmask[None, :])
    else:
        part = part_ptr + (pid_s.to(tl.int64) * M + m[:, None]) * N + n[None, :]
        tl.store(part, acc, mask=mmask[:, None] & nmask[None, :])


@triton.jit(do_not_specialize=["M", "splits"])
def _reduce_kernel(part_ptr, scale_ptr, bias_ptr, out_ptr, M, N, splits, stride_o,
                   BN: tl.constexpr, HAS_BIAS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    nmask = n < N
    acc = tl.zeros((BN,), tl.float32)
    for s in range(splits):
        acc += tl.load(part_ptr + (s * M + row) * N + n, mask=nmask, other=0.0)
    y = acc * tl.load(scale_ptr + n, mask=nmask, other=0.0)
    if HAS_BIAS:
        y = y + tl.load(bias_ptr + n, mask=nmask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + n, y.to(out_ptr.dtype.element_ty), mask=nmask)


def _precision(dtype: torch.dtype) -> str:
    # float32 activations would default to TF32 on the tensor cores (10-bit mantissa).
    return "ieee" if dtype == torch.float32 else "tf32"


def int8_linear_triton(x2: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                       block_m: int | None = None, dispatch: Int8Dispatch | None = None) -> torch.Tensor:
    """x2 [M, K] (fp16 / bf16 / fp32) -> [M, N] in x2.dtype, by the Triton kernel."""
    d = dispatch or get_dispatch()
    m, kd = x2.shape
    n = q.shape[0]
    out = torch.empty(m, n, dtype=x2.dtype, device=x2.device)
    if m == 0:
        return out
    bm = block_m or min(64, max(16, triton.next_power_of_2(m)))
    blocks = triton.cdiv(n, d.block_n) * triton.cdiv(m, bm)
    steps = triton.cdiv(kd, d.block_k)
    want = max(1, min(steps, triton.cdiv(_PROGRAMS_PER_SM * _num_sms(x2.device), blocks)))
    per = triton.cdiv(steps, want)
    splits = triton.cdiv(steps, per)
    direct = splits == 1
    part = out if direct else torch.empty(splits, m, n, dtype=torch.float32, device=x2.device)
    bias_arg = bias if bias is not None else scale
    grid = (triton.cdiv(n, d.block_n), splits, triton.cdiv(m, bm))
    _int8_kernel[grid](x2, q, scale, bias_arg, out, part, m, n, kd, per, x2.stride(0), q.stride(0), out.stride(0),
                       BM=bm, BN=d.block_n, BK=d.block_k, DIRECT=direct, HAS_BIAS=bias is not None,
                       PRECISION=_precision(x2.dtype), num_warps=d.warps)
    if not direct:
        bn = 256
        _reduce_kernel[(m, triton.cdiv(n, bn))](part, scale, bias_arg, out, m, n, splits, out.stride(0),
                                               BN=bn, HAS_BIAS=bias is not None, num_warps=4)
    return out


def int8_linear_dequant(x2: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
                        ) -> torch.Tensor:
    """Large M: the weight dequantized into x2.dtype (a temporary), then cuBLAS."""
    w = (q.to(torch.float32) * scale[:, None]).to(x2.dtype)
    return F.linear(x2, w, None if bias is None else bias.to(x2.dtype))


def int8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                path: str | None = None) -> torch.Tensor:
    """The GPU op: x [..., K] -> [..., N]. ``path``: 'triton' or 'dequant' to force one."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    path = path or ("triton" if x2.shape[0] <= get_dispatch().triton_max_rows else "dequant")
    if path == "triton":
        y = int8_linear_triton(x2, q, scale, bias)
    elif path == "dequant":
        y = int8_linear_dequant(x2, q, scale, bias)
    else:
        raise ValueError(f"unknown int8 path {path!r}")
    return y.reshape(*x.shape[:-1], q.shape[0])


def int8_linear_ref(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """The definition, in float32: ``(x @ q^T) * scale + bias``, cast to x.dtype."""
    y = (x.float() @ q.float().t()) * scale.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
