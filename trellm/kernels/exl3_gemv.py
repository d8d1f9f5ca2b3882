"""EXL3 in Triton, part 2: ``y = x @ W`` with the trellis decoded in registers.

Three paths over one layer (``exl3_matmul`` picks by the number of rows M):

* GEMV, M <= ``Dispatch.gemv_max_rows``: float32 FMAs on the CUDA cores, no tensor
  cores and no shared memory. A program owns TN x 16 output columns and a split of
  the input rows; per step it decodes TK x TN tiles (exl3_decode.py: 32 static
  steps, each one row and 8 columns of every tile) and multiplies them into
  per-row accumulators. Activations are the float32 transformed x, so this path
  is the reference's arithmetic up to summation order.
* GEMM, up to ``Dispatch.reconstruct_min_rows``: the same decode, but each of the
  32 steps is a ``tl.dot`` of [BM, TK=16 tiles] fp16 activations (tile row ROW of
  16 tiles) by the [16, TN*8] fp16 values, float32 accumulation; the tensor cores
  do the multiply and the decode is shared by BM rows.
* Reconstruct: decode Wq once into an fp16 buffer (in column slices, so the LM
  head does not need a gigabyte) and let cuBLAS run ``xh @ Wq``: for prefill.

Every path is input transform -> main kernel (split-K partials, float32) ->
output transform (sums the splits, Hadamard, svh, bias, cast): three launches
without host syncs, data-dependent Python branches or per-call host copies, so
they capture into CUDA graphs. fp16 activations (GEMM / reconstruct) follow
ExLlamaV3, which runs in fp16 throughout: the transformed x must fit fp16.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from trellm.kernels._triton import tl, triton
from trellm.kernels.exl3_decode import (CODEBOOK_IDS, _decode, _group_words, _integer_bits, exl3_input_transform,
                                        exl3_output_transform, exl3_reconstruct, kernel_bits, tile_stride,
                                        trellis_words)
from trellm.kernels.paged_attention import _num_sms
from trellm.quant.exl3.reference import forward_reference
from trellm.quant.exl3.weight import EXL3Weight

_PROGRAMS_PER_SM = 4
"""Split-K aims at this many programs per SM (a GEMV of one 4096-wide layer has only
32 column blocks of 128)."""


@dataclass(frozen=True)
class BlockConfig:
    """Tiles per program step: TK tile rows (16 input rows each) x TN tile columns."""

    tk: int
    tn: int
    warps: int = 4


@dataclass(frozen=True)
class Dispatch:
    """Which path runs for M rows; the thresholds come from GPU measurements
    (scripts/gpu_exl3_check.py reports the crossovers)."""

    gemv_max_rows: int = 8
    """M <= this: the FMA GEMV."""
    reconstruct_min_rows: int = 256
    """M >= this: reconstruct + cuBLAS; in between the tl.dot GEMM."""
    reconstruct_cols: int = 16384
    """Output columns decoded per slice on the reconstruct path (bounds its buffer)."""
    gemv: BlockConfig = BlockConfig(tk=4, tn=8)
    gemm: BlockConfig = BlockConfig(tk=16, tn=8, warps=8)
    reconstruct: BlockConfig = BlockConfig(tk=4, tn=8)


DISPATCH = Dispatch()
_STATE = {"dispatch": DISPATCH}


def set_dispatch(dispatch: Dispatch) -> None:
    """Replace the thresholds / block sizes (GPU sweeps; before any CUDA graph capture)."""
    _STATE["dispatch"] = dispatch


def get_dispatch() -> Dispatch:
    return _STATE["dispatch"]


# ---- GEMV: float32 FMAs ------------------------------------------------------------------

# M and the split length change with the batch and the layer: not specialized on, so one
# compiled kernel per (K, codebook, block sizes) serves every call.
@triton.jit(do_not_specialize=["M", "steps_per_split"])
def _gemv_kernel(x_ptr, w_ptr, part_ptr, M, TI, TJ, TJS, out_p, steps_per_split, stride_x,
                 K: tl.constexpr, CB: tl.constexpr, BM: tl.constexpr, TK: tl.constexpr, TN: tl.constexpr):
    """partial[split, m, :] = xh[m, rows of the split] @ Wq[those rows, the program's columns]."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    tn = pid_n * TN + tl.arange(0, TN)
    m = tl.arange(0, BM)
    g = tl.arange(0, 8)
    mmask = m < M
    acc0 = tl.zeros((BM, TK, TN, 8), tl.float32)  # columns g of each tile (COL8 = 0)
    acc1 = tl.zeros((BM, TK, TN, 8), tl.float32)  # columns 8 + g
    for step in range(pid_s * steps_per_split, (pid_s + 1) * steps_per_split):
        tk = step * TK + tl.arange(0, TK)
        tmask = tk < TI
        mask = tmask[:, None] & (tn[None, :] < TJ)
        tile = (tk[:, None].to(tl.int64) * TJS + tn[None, :]) * (8 * K)  # TJS: tile row stride
        prev, w0, w1, w2, w3, w4, w5, w6, w7 = _group_words(w_ptr, tile, mask, K)
        x_row = x_ptr + m[:, None].to(tl.int64) * stride_x + tk[None, :] * 16
        xmask = mmask[:, None] & tmask[None, :]
        for i in tl.static_range(32):
            ROW = 2 * (i // 8) + (i % 2) + 8 * ((i // 2) % 2)
            v = _decode(i, K, CB, prev, w0, w1, w2, w3, w4, w5, w6, w7).to(tl.float32)
            xi = tl.load(x_row + ROW, mask=xmask, other=0.0)
            prod = xi[:, :, None, None] * v[None, :, :, :]
            if (i % 8) // 4 == 0:
                acc0 += prod
            else:
                acc1 += prod
    y0 = tl.sum(acc0, axis=1)
    y1 = tl.sum(acc1, axis=1)
    cols = tn[None, :, None] * 16 + g[None, None, :]
    out = part_ptr + pid_s.to(tl.int64) * M * out_p + m[:, None, None].to(tl.int64) * out_p + cols
    omask = mmask[:, None, None] & (tn < TJ)[None, :, None]
    tl.store(out, y0, mask=omask)
    tl.store(out + 8, y1, mask=omask)


def _splits(steps: int, blocks: int, device: torch.device) -> tuple[int, int]:
    """(splits, steps per split): about _PROGRAMS_PER_SM programs per SM in all."""
    want = max(1, min(steps, triton.cdiv(_PROGRAMS_PER_SM * _num_sms(device), blocks)))
    per = triton.cdiv(steps, want)
    return triton.cdiv(steps, per), per


def exl3_gemv(w: EXL3Weight, xh: torch.Tensor, cfg: BlockConfig | None = None) -> torch.Tensor:
    """Split-K partials [S, M, out_p] (float32) of ``xh @ Wq``; xh float32 [M, in_p], M <= 16."""
    cfg = cfg or get_dispatch().gemv
    m = xh.shape[0]
    if m > 16 or xh.dtype != torch.float32:
        raise ValueError(f"the EXL3 GEMV takes float32 activations and at most 16 rows, got {xh.dtype} x {m}")
    ti, tj, _ = w.trellis.shape
    steps = triton.cdiv(ti, cfg.tk)
    blocks = triton.cdiv(tj, cfg.tn)
    splits, per = _splits(steps, blocks, xh.device)
    part = torch.empty(splits, m, w.padded_out, dtype=torch.float32, device=xh.device)
    _gemv_kernel[(blocks, splits)](xh, trellis_words(w), part, m, ti, tj, tile_stride(w), w.padded_out, per,
                                   xh.stride(0),
                                   K=_integer_bits(w), CB=CODEBOOK_IDS[w.codebook], BM=_pow2(m),
                                   TK=cfg.tk, TN=cfg.tn, num_warps=cfg.warps)
    return part


# ---- GEMM: tl.dot per decode step --------------------------------------------------------

@triton.jit(do_not_specialize=["M", "steps_per_split"])
def _gemm_kernel(x_ptr, w_ptr, part_ptr, M, TI, TJ, TJS, out_p, steps_per_split, stride_x,
                 K: tl.constexpr, CB: tl.constexpr, BM: tl.constexpr, TK: tl.constexpr, TN: tl.constexpr):
    """As _gemv_kernel for BM rows per program (grid axis 2), with one [BM, TK] x [TK, TN*8]
    fp16 dot per decode step. TK >= 16 (tl.dot's K)."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    m = tl.program_id(2) * BM + tl.arange(0, BM)
    tn = pid_n * TN + tl.arange(0, TN)
    mmask = m < M
    acc0 = tl.zeros((BM, TN * 8), tl.float32)
    acc1 = tl.zeros((BM, TN * 8), tl.float32)
    for step in range(pid_s * steps_per_split, (pid_s + 1) * steps_per_split):
        tk = step * TK + tl.arange(0, TK)
        tmask = tk < TI
        mask = tmask[:, None] & (tn[None, :] < TJ)
        tile = (tk[:, None].to(tl.int64) * TJS + tn[None, :]) * (8 * K)  # TJS: tile row stride
        prev, w0, w1, w2, w3, w4, w5, w6, w7 = _group_words(w_ptr, tile, mask, K)
        x_row = x_ptr + m[:, None].to(tl.int64) * stride_x + tk[None, :] * 16
        xmask = mmask[:, None] & tmask[None, :]
        for i in tl.static_range(32):
            ROW = 2 * (i // 8) + (i % 2) + 8 * ((i // 2) % 2)
            v = tl.reshape(_decode(i, K, CB, prev, w0, w1, w2, w3, w4, w5, w6, w7), (TK, TN * 8))
            xi = tl.load(x_row + ROW, mask=xmask, other=0.0)
            if (i % 8) // 4 == 0:
                acc0 = tl.dot(xi, v, acc0)
            else:
                acc1 = tl.dot(xi, v, acc1)
    c = tl.arange(0, TN * 8)
    cols = (pid_n * TN + c // 8) * 16 + c % 8
    out = part_ptr + pid_s.to(tl.int64) * M * out_p + m[:, None].to(tl.int64) * out_p + cols[None, :]
    omask = mmask[:, None] & (cols < TJ * 16)[None, :]
    tl.store(out, acc0, mask=omask)
    tl.store(out + 8, acc1, mask=omask)


def exl3_gemm(w: EXL3Weight, xh: torch.Tensor, cfg: BlockConfig | None = None, block_m: int | None = None
              ) -> torch.Tensor:
    """Split-K partials [S, M, out_p] (float32) of ``xh @ Wq``; xh fp16 [M, in_p]."""
    cfg = cfg or get_dispatch().gemm
    m = xh.shape[0]
    if xh.dtype != torch.float16 or cfg.tk < 16:
        raise ValueError(f"the EXL3 GEMM takes fp16 activations and tk >= 16, got {xh.dtype}, tk {cfg.tk}")
    bm = block_m or min(64, max(16, _pow2(m)))
    ti, tj, _ = w.trellis.shape
    steps = triton.cdiv(ti, cfg.tk)
    blocks = triton.cdiv(tj, cfg.tn) * triton.cdiv(m, bm)
    splits, per = _splits(steps, blocks, xh.device)
    part = torch.empty(splits, m, w.padded_out, dtype=torch.float32, device=xh.device)
    grid = (triton.cdiv(tj, cfg.tn), splits, triton.cdiv(m, bm))
    _gemm_kernel[grid](xh, trellis_words(w), part, m, ti, tj, tile_stride(w), w.padded_out, per,
                       xh.stride(0),
                       K=_integer_bits(w), CB=CODEBOOK_IDS[w.codebook], BM=bm, TK=cfg.tk, TN=cfg.tn,
                       num_warps=cfg.warps)
    return part


# ---- reconstruct + cuBLAS ---------------------------------------------------------------

def exl3_reconstruct_matmul(w: EXL3Weight, xh: torch.Tensor, dispatch: Dispatch | None = None) -> torch.Tensor:
    """``xh @ Wq`` as [1, M, out_p] fp16 (one "split"), Wq decoded slice by slice into a
    temporary fp16 buffer; xh fp16 [M, in_p]."""
    d = dispatch or get_dispatch()
    tj = w.trellis.shape[1]
    per = max(1, d.reconstruct_cols // 16)
    out = torch.empty(1, xh.shape[0], w.padded_out, dtype=torch.float16, device=xh.device)
    for t0 in range(0, tj, per):
        t1 = min(tj, t0 + per)
        wq = exl3_reconstruct(w, (t0, t1), block=d.reconstruct)
        torch.matmul(xh, wq, out=out[0, :, t0 * 16:t1 * 16])
    return out


# ---- the whole layer ------------------------------------------------------------------------

def exl3_matmul(w: EXL3Weight, x: torch.Tensor, path: str | None = None, dispatch: Dispatch | None = None
                ) -> torch.Tensor:
    """``y = x @ W (+ bias)`` for x [..., in_features] -> [..., out_features] in x.dtype.
    ``path``: 'gemv', 'gemm' or 'reconstruct' to force one (benchmarks, tests); None =
    by rows. ``dispatch``: thresholds and block sizes (None = the module's)."""
    d = dispatch or get_dispatch()
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if m == 0:
        return x.new_empty(*x.shape[:-1], w.out_features)
    path = path or choose_path(m, d)
    if path == "gemv":
        part = exl3_gemv(w, exl3_input_transform(w, x2, torch.float32), d.gemv)
    elif path == "gemm":
        part = exl3_gemm(w, exl3_input_transform(w, x2, torch.float16), d.gemm)
    elif path == "reconstruct":
        part = exl3_reconstruct_matmul(w, exl3_input_transform(w, x2, torch.float16), d)
    else:
        raise ValueError(f"unknown EXL3 path {path!r}")
    return exl3_output_transform(w, part, x.dtype).reshape(*x.shape[:-1], w.out_features)


def exl3_matmul_ref(w: EXL3Weight, x: torch.Tensor) -> torch.Tensor:
    return forward_reference(w, x)


def choose_path(m: int, dispatch: Dispatch | None = None) -> str:
    d = dispatch or get_dispatch()
    if m <= min(d.gemv_max_rows, 16):
        return "gemv"
    return "gemm" if m < d.reconstruct_min_rows else "reconstruct"


def _pow2(n: int) -> int:
    return max(1, triton.next_power_of_2(n))


# ---- registration with the EXL3 linear method -------------------------------------------------

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_CUDA_OK: dict[str, bool] = {}


def supports(w: EXL3Weight, x: torch.Tensor) -> bool:
    """CUDA tensors with Triton, integer K, a float activation dtype (the reference takes
    everything else: CPU, half-integer K). Asked per projection per forward: cheap checks."""
    return (x.is_cuda and _cuda_kernels() and w.trellis.is_cuda and kernel_bits(w) is not None
            and x.dtype in _DTYPES and x.shape[-1] == w.in_features)


def _cuda_kernels() -> bool:
    if "ok" not in _CUDA_OK:
        from trellm.kernels import kernel_supported

        _CUDA_OK["ok"] = kernel_supported("cuda")
    return _CUDA_OK["ok"]


def register() -> None:
    """Put the Triton path in front of the reference in the EXL3 method's kernel registry."""
    from trellm.quant.exl3.method import EXL3Kernel, register_kernel, unregister_kernel

    unregister_kernel("triton")
    register_kernel(EXL3Kernel("triton", supports, exl3_matmul))
