"""Skinny GEMM (a few activation rows times a dense weight) in Triton.

At decode batch sizes a linear layer is a read of its weight: the time is bytes over
bandwidth plus how well the launch fills the chip. cuBLAS's heuristics pick poorly
for some decode shapes (measured on the H200: 4096x4096 at 2.7 TB/s, 1024x2048 at
0.4 TB/s, against ~4 TB/s for the big MLP matrices). This kernel gives each program
a strip of ``BLOCK_N`` output features and streams their rows over K, keeping every
row in flight at once; products accumulate elementwise in float32 and are reduced
once at the end.

Whether it replaces cuBLAS for a (shape, rows) is decided by timing both on the
device (``GemvDispatch``), never assumed: the issue asks for cuBLAS unless ours is
measured faster.

``glu=True`` fuses the gated MLP's activation into the down projection: x is the
gate_up output [M, 2K] ([gate | up]) and the kernel multiplies by
``silu(gate) * up`` computed as it loads, with the arithmetic of
``activation.silu_and_mul`` (float32, rounded once to the activation dtype), so it
equals ``gemv(silu_and_mul(x), w)`` bit for bit and saves a launch and a round trip
of the activation. The dispatch times it against the unfused pair per (shape, rows).
"""
from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from trellm import envs
from trellm.kernels._triton import tl, triton, pdl_begin, pdl_kwargs

log = logging.getLogger("trellm")

MAX_ROWS = 8
"""Largest activation row count the kernel takes (it keeps all rows in registers)."""


@triton.jit
def _load_x(x_ptr, offs_m, offs_k, m_mask, k_mask, stride_xm, K, GLU: tl.constexpr):
    x_mask = m_mask[:, None] & k_mask[None, :]
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    if GLU:
        # activation._silu_and_mul_kernel's expression and rounding, so the product
        # sees the same activation values as the unfused path (masked: silu(0) * 0 = 0).
        gate = tl.load(x_ptrs, mask=x_mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptrs + K, mask=x_mask, other=0.0).to(tl.float32)
        return (gate / (1.0 + tl.exp(-gate)) * up).to(x_ptr.dtype.element_ty)
    return tl.load(x_ptrs, mask=x_mask, other=0.0)


@triton.jit
def _norm_x(x_ptr, res_ptr, nw_ptr, ro_ptr, offs_m, offs_k, m_mask, k_mask, stride_xm, stride_r, stride_ro,
            STORE, NORM: tl.constexpr):
    """One block of the NORM mode's input: s = x + residual (NORM 2; rounded to the
    residual's dtype, as rmsnorm._rms_norm_kernel rounds it; NORM 1: s = x), stored to
    ro where ``STORE`` (program 0 writes the new residual), and (s * norm weight, s) in
    float32: the product's operand, not yet scaled by 1 / rms, and the sum of squares' term."""
    mask = m_mask[:, None] & k_mask[None, :]
    s = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=mask, other=0.0)
    if NORM == 2:
        r = tl.load(res_ptr + offs_m[:, None] * stride_r + offs_k[None, :], mask=mask, other=0.0)
        s = (s.to(tl.float32) + r.to(tl.float32)).to(ro_ptr.dtype.element_ty)
        tl.store(ro_ptr + offs_m[:, None] * stride_ro + offs_k[None, :], s, mask=mask & STORE)
    sf = s.to(tl.float32)
    nw = tl.load(nw_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
    return sf * nw[None, :], sf


@triton.jit
def _int8_to_f32(q):
    # int8 -> float32 without the quarter-rate int-to-float conversion: the float32
    # with bits 0x4B000000 + (q + 128) is 2^23 + q + 128, exactly. (int8_gemv's kernels too.)
    return (q.to(tl.int32) + 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0


@triton.jit
def _w_f32(w, W_INT8: tl.constexpr):
    if W_INT8:
        return _int8_to_f32(w)
    return w.to(tl.float32)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                 res_ptr, nw_ptr, ro_ptr, stride_r, stride_ro, eps, scale_ptr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 HAS_BIAS: tl.constexpr, GLU: tl.constexpr, PRE_K: tl.constexpr = 0,
                 NORM: tl.constexpr = 0, W_INT8: tl.constexpr = False, PDL: tl.constexpr = False):
    """``PRE_K`` > 0: the first PRE_K columns of the program's weight rows in one load
    issued first (before the PDL wait, so it overlaps the kernels before this one), the
    rest streamed BLOCK_K at a time. The summation order depends on PRE_K, not on PDL.
    ``NORM`` 1 / 2: y = W rmsnorm(x) / W rmsnorm(x + residual) (``gemv_rms_norm``): every
    program sums the squares of the rows it streams anyway and scales its products by
    1 / rms at the end, so the norm costs no pass of its own and no launch.
    ``W_INT8``: w is int8 with a float32 scale per output row (W8A16, ``gemv_int8``),
    applied once to the float32 sum."""
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    n_mask = offs_n < N
    m_mask = offs_m < M
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    if PRE_K > 0:
        offs_p = tl.arange(0, PRE_K)
        w_pre = tl.load(w_rows + offs_p[None, :], mask=n_mask[:, None] & (offs_p < K)[None, :], other=0.0)
    if PDL:
        # The weight is never written during a forward: it is read before the wait for the
        # previous kernel (the PRE_K head and one block), each next block one step ahead.
        w_next = tl.load(w_rows + (PRE_K + tl.arange(0, BLOCK_K))[None, :],
                         mask=n_mask[:, None] & (PRE_K + tl.arange(0, BLOCK_K) < K)[None, :], other=0.0)
    pdl_begin(PDL)
    y = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    sq = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    if PRE_K > 0:
        # Its own names: Triton types a name once per loop, and the loop below reuses x.
        if NORM:
            x_pre, s_pre = _norm_x(x_ptr, res_ptr, nw_ptr, ro_ptr, offs_m, offs_p, m_mask, offs_p < K, stride_xm,
                                   stride_r, stride_ro, pid == 0, NORM)
            sq_pre = tl.sum(s_pre * s_pre, axis=1)
        else:
            x_pre = _load_x(x_ptr, offs_m, offs_p, m_mask, offs_p < K, stride_xm, K, GLU)
        y += tl.sum(x_pre.to(tl.float32)[:, None, :] * _w_f32(w_pre, W_INT8)[None, :, :], axis=2)
    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(PRE_K, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        if PDL:
            w = w_next
            w_next = tl.load(w_rows + (offs_k + BLOCK_K)[None, :],
                             mask=n_mask[:, None] & (offs_k + BLOCK_K < K)[None, :], other=0.0)
        else:
            w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        if NORM:
            x, s = _norm_x(x_ptr, res_ptr, nw_ptr, ro_ptr, offs_m, offs_k, m_mask, k_mask, stride_xm, stride_r,
                           stride_ro, pid == 0, NORM)
            sq += s * s
        else:
            x = _load_x(x_ptr, offs_m, offs_k, m_mask, k_mask, stride_xm, K, GLU)
        acc += x.to(tl.float32)[:, None, :] * _w_f32(w, W_INT8)[None, :, :]
    y += tl.sum(acc, axis=2)
    ss = tl.sum(sq, axis=1)
    if PRE_K > 0 and NORM:
        ss += sq_pre
    _epilogue(y, ss, offs_m, offs_n, m_mask, n_mask, K, eps, scale_ptr, b_ptr, y_ptr, stride_ym,
              HAS_BIAS, NORM, W_INT8)


@triton.jit
def _epilogue(y, ss, offs_m, offs_n, m_mask, n_mask, K, eps, scale_ptr, b_ptr, y_ptr, stride_ym,
              HAS_BIAS: tl.constexpr, NORM: tl.constexpr, W_INT8: tl.constexpr):
    """y [BLOCK_M, BLOCK_N] (float32 sums) -> y_ptr: times 1 / rms of each row (NORM; ss its
    sum of squares), times the int8 scale (W_INT8), plus the bias; one rounding."""
    if NORM:
        y = y * (1.0 / tl.sqrt(ss / K + eps))[:, None]
    if W_INT8:
        y = y * tl.load(scale_ptr + offs_n, mask=n_mask, other=0.0)[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


NORM = envs.gemv_norm()
"""Whether the engine calibrates ``gemv_rms_norm`` (the RMSNorm, with the residual add before
it, in the qkv / gate_up projection's GEMV) against the norm kernel then the linear, and uses
it where it wins: ``TRELLM_GEMV_NORM`` 1; off (0, the default) until measured in the engine
on a GPU."""

PREFETCH_BLOCKS = envs.gemv_prefetch_blocks()
"""Weight blocks (of BLOCK_K columns) a program loads up front, before the PDL wait
(``PRE_K``); 0: one block at a time. ``TRELLM_GEMV_PREFETCH``; scripts/gpu_pdl_ab.py
compares values in whole-engine runs."""


def _blocks(m: int, n: int, k: int, k_mult: int = 1) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, PRE_K) for x [m, k] and a weight [n, k]; ``k_mult``:
    BLOCK_K that many times wider (int8 weights: the same bytes a block)."""
    block_m = triton.next_power_of_2(max(m, 1))
    # Enough programs to cover the SMs a few times over; at least 4 rows per program.
    block_n = 16 if n >= 16 * 512 else 8 if n >= 8 * 256 else 4
    # Keep the per-program accumulator near 4k floats (registers, not spills).
    block_k = max(32, 4096 // (block_m * block_n)) * k_mult
    pre_k = 0
    if PREFETCH_BLOCKS:
        # A power of two (tl.arange), at most 4x the accumulator's floats in the head's
        # product (registers), no wider than K needs.
        pre_k = min(triton.next_power_of_2(PREFETCH_BLOCKS * block_k), 4 * block_k, triton.next_power_of_2(k))
    return block_m, block_n, block_k, pre_k


def _checked(x: torch.Tensor, weight: torch.Tensor, glu: bool) -> torch.Tensor:
    """x with unit column stride, once x and weight are shapes the kernel takes."""
    m, kx = x.shape
    k = weight.shape[1]
    if m > MAX_ROWS or kx != (2 * k if glu else k) or weight.stride(1) != 1:
        raise ValueError(f"gemv takes x [<= {MAX_ROWS}, K] (glu: [<= {MAX_ROWS}, 2K]) and a row-major "
                         f"weight [N, K]; got {tuple(x.shape)} and {tuple(weight.shape)}")
    return x if x.stride(1) == 1 else x.contiguous()


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         glu: bool = False) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for x [M, K] with M <= MAX_ROWS, weight [N, K].
    ``glu``: x is [M, 2K] = [gate | up] and the result is
    ``F.linear(silu_and_mul(x), weight, bias)`` in one launch."""
    x = _checked(x, weight, glu)
    y = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    _launch(x, weight, bias, y, glu)
    return y


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor, glu: bool,
            norm: tuple | None = None, scale: torch.Tensor | None = None, k_mult: int = 1) -> None:
    """_gemv_kernel into y; ``norm``: (residual or None, norm weight, new residual out, eps),
    its NORM mode; ``scale``: weight is int8 with this float32 scale per row (W_INT8)."""
    m, (n, k) = x.shape[0], weight.shape
    if m == 0 or n == 0:
        return
    res, nw, res_out, eps = norm if norm is not None else (None, y, y, 0.0)
    res = res if res is not None else res_out
    bm, bn, bk, pre = _blocks(m, n, k, k_mult)
    _gemv_kernel[(triton.cdiv(n, bn),)](
        x, weight, bias if bias is not None else y, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
        res, nw, res_out, res.stride(0), res_out.stride(0), eps, scale if scale is not None else y,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, HAS_BIAS=bias is not None, GLU=glu, PRE_K=pre,
        NORM=0 if norm is None else 1 if norm[0] is None else 2, W_INT8=scale is not None, num_warps=4,
        **pdl_kwargs())


def gemv_int8(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
              k_mult: int = 1) -> torch.Tensor:
    """W8A16 ``(x @ q^T) * scale (+ bias)`` for x [M <= MAX_ROWS, K], q int8 [N, K], scale
    float32 [N]: this kernel's streaming layout (a program per strip of rows, the whole K,
    no split and so no reduce) as a candidate of int8_gemv's calibration. ``k_mult``: the
    K block that many times the bf16 GEMV's (the same bytes per load at 2)."""
    x = _checked(x, q, False)
    if q.dtype != torch.int8 or scale.shape != (q.shape[0],) or scale.dtype != torch.float32:
        raise ValueError(f"gemv_int8 takes an int8 [N, K] weight and a float32 [N] scale; got {q.dtype} and "
                         f"{tuple(scale.shape)}/{scale.dtype}")
    y = torch.empty(x.shape[0], q.shape[0], dtype=x.dtype, device=x.device)
    _launch(x, q, bias, y, False, scale=scale, k_mult=k_mult)
    return y


def gemv_rms_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(F.linear(rms_norm(s), weight, bias), s)`` with s = x + residual (rounded to x's
    dtype; s = x where residual is None) in one launch: the decoder layer's
    ``h = h + out; normed = norm(h)`` folded into the next projection (qkv, gate_up). Why:
    that norm is a launch of its own before two of a layer's four GEMVs, ~1.5-2 us of a
    small model's ~4 us per kernel (docs/benchmarks/gpu). The normed activation is never
    rounded (float32 products, scaled by 1 / rms at the end): within the dtype's rounding
    of the norm kernel then gemv, not bit-equal to it."""
    m, k = x.shape
    if (weight.shape[1] != k or norm_weight.shape != (k,) or m > MAX_ROWS
            or (residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype))):
        raise ValueError(f"gemv_rms_norm: x {tuple(x.shape)}, residual "
                         f"{None if residual is None else (tuple(residual.shape), residual.dtype)}, norm "
                         f"{tuple(norm_weight.shape)} and weight {tuple(weight.shape)} do not fit (rows <= {MAX_ROWS})")
    x = _checked(x, weight, False)
    if residual is not None and residual.stride(1) != 1:
        residual = residual.contiguous()
    y = torch.empty(m, weight.shape[0], dtype=x.dtype, device=x.device)
    s = torch.empty_like(x, memory_format=torch.contiguous_format) if residual is not None else x
    _launch(x, weight, bias, y, False, (residual, norm_weight, s, eps))
    return y, s


def gemv_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
             glu: bool = False) -> torch.Tensor:
    """Reference: float32 math, rounded once to x's dtype. ``glu``: the activation
    first, in float32 and rounded once to x's dtype, as the kernels round it."""
    if glu:
        gate, up = x.float().chunk(2, dim=-1)
        x = (F.silu(gate) * up).to(x.dtype)
    y = x.float() @ weight.float().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def gemv_rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of ``gemv_rms_norm``: s = x + residual rounded to x's dtype, then float32
    math (the normed activation unrounded), the output rounded once to x's dtype."""
    s = x if residual is None else (x.float() + residual.float()).to(x.dtype)
    sf = s.float()
    normed = sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.float()
    y = normed @ weight.float().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype), s


def decide(candidate: Callable[[], float], baseline: Callable[[], float], margin: float,
           near: float = 0.03, rounds: int = 5) -> tuple[float, float, bool]:
    """(baseline µs, candidate µs, whether the candidate wins: time < margin * baseline's).
    Where one timing of each lands within ``near`` of the threshold, both are timed
    ``rounds`` times in all, alternating, and their medians decide: one noisy timing near
    the line flipped an 8B gate_up pick between processes (docs/benchmarks/gpu/README.md,
    2026-12-07), which moved the model's speed and its near-tie tokens."""
    base, cand = [baseline()], [candidate()]
    if abs(cand[0] / base[0] - margin) < near:
        for _ in range(rounds - 1):
            base.append(baseline())
            cand.append(candidate())
    b, c = statistics.median(base), statistics.median(cand)
    return b, c, c < margin * b


@dataclass
class GemvDispatch:
    """Per (N, K, rows): use ``gemv`` where it timed faster than cuBLAS on this device."""

    use_kernel: dict[tuple[int, int, int], bool] = field(default_factory=dict)
    timings_us: dict[tuple[int, int, int], tuple[float, float]] = field(default_factory=dict)
    """(cuBLAS, kernel) microseconds per call, for the log and benchmarks."""
    use_glu: dict[tuple[int, int, int], bool] = field(default_factory=dict)
    """Per down-projection (N, K, rows): the fused ``gemv(gate_up, w, glu=True)``."""
    glu_timings_us: dict[tuple[int, int, int], tuple[float, float]] = field(default_factory=dict)
    """(silu_and_mul + the linear ``wants`` picks, fused kernel) microseconds per call."""
    use_norm: dict[tuple[int, int, int], bool] = field(default_factory=dict)
    """Per (N, K, rows) of a projection after an RMSNorm (qkv, gate_up): ``gemv_rms_norm``."""
    norm_timings_us: dict[tuple[int, int, int], tuple[float, float]] = field(default_factory=dict)
    """(fused_add_rms_norm + the linear as ``wants`` picks it, gemv_rms_norm) microseconds per call."""

    def wants(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        m = x.shape[0] if x.dim() == 2 else -1
        return self.use_kernel.get((weight.shape[0], weight.shape[1], m), False)

    def wants_glu(self, gate_up: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether ``weight``'s projection of ``silu_and_mul(gate_up)`` should be the
        fused GEMV; False unless calibration timed it faster."""
        if gate_up.dim() != 2 or gate_up.shape[1] != 2 * weight.shape[1]:
            return False
        return self.use_glu.get((weight.shape[0], weight.shape[1], gate_up.shape[0]), False)

    def wants_norm(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether ``weight``'s projection of rms_norm(x + residual) should be one
        ``gemv_rms_norm``; False unless calibration timed it faster."""
        if x.dim() != 2 or x.shape[1] != weight.shape[1]:
            return False
        return self.use_norm.get((weight.shape[0], weight.shape[1], x.shape[0]), False)

    def calibrate(self, weights: list[torch.Tensor], rows: tuple[int, ...] = (1, 2, 4, 8),
                  margin: float = 0.98) -> "GemvDispatch":
        """Time both on every distinct weight shape, streaming from HBM as decode does (see
        ``l2_copies``); the kernel must win by 2%, by medians where it is close (``decide``).
        (It was 5% on single timings: the 8B gate_up GEMV, ours 80 µs against cuBLAS 81-84,
        then went either way, and the engine was 3% faster with ours: H100, 2026-12-07.)"""
        t0 = time.perf_counter()
        seen: set[tuple[int, int]] = set()
        for w in weights:
            shape = (w.shape[0], w.shape[1])
            if shape in seen or w.stride(1) != 1:
                continue
            seen.add(shape)
            ws = l2_copies(w)
            for m in rows:
                x = torch.randn(m, w.shape[1], dtype=w.dtype, device=w.device)
                key = (shape[0], shape[1], m)
                cublas, ours, self.use_kernel[key] = decide(
                    lambda: graph_time_us([lambda w=w: gemv(x, w) for w in ws], iters=30),
                    lambda: graph_time_us([lambda w=w: F.linear(x, w) for w in ws], iters=30), margin)
                self.timings_us[key] = (cublas, ours)
            del ws  # before the next shape's stand-ins: one set alive at a time
        torch.cuda.empty_cache()  # the stand-ins' blocks back to the device, not the cache
        picked = sorted(k for k, v in self.use_kernel.items() if v)
        log.info("skinny GEMM: Triton kernel for %d of %d (N, K, rows) cases (%.1fs): %s",
                 len(picked), len(self.use_kernel), time.perf_counter() - t0, picked)
        return self

    def calibrate_glu(self, weights: list[torch.Tensor], rows: tuple[int, ...] = (1, 2, 4, 8),
                      margin: float = 0.95) -> "GemvDispatch":
        """For each distinct down-projection shape in ``weights``: the fused GEMV against
        what the MLP runs otherwise, the silu_and_mul kernel then cuBLAS or our GEMV as
        ``wants`` picks (so run after ``calibrate``); both timed inside CUDA graphs, the
        fused one must win by 5%."""
        from trellm.kernels.activation import silu_and_mul

        t0 = time.perf_counter()
        by_shape: dict[tuple[int, int], torch.Tensor] = {}
        for w in weights:
            if w.stride(1) == 1:
                by_shape.setdefault((w.shape[0], w.shape[1]), w)
        for (n, k), w in sorted(by_shape.items(), key=lambda item: item[0]):
            ws = l2_copies(w)
            for m in rows:
                x = torch.randn(m, 2 * k, dtype=w.dtype, device=w.device)
                key = (n, k, m)
                linear = gemv if self.use_kernel.get(key, False) else F.linear
                unfused, fused, self.use_glu[key] = decide(
                    lambda: graph_time_us([lambda w=w: gemv(x, w, glu=True) for w in ws], iters=30),
                    lambda: graph_time_us([lambda w=w: linear(silu_and_mul(x), w) for w in ws], iters=30), margin)
                self.glu_timings_us[key] = (unfused, fused)
            del ws
        torch.cuda.empty_cache()
        picked = sorted(key for key, fused_wins in self.use_glu.items() if fused_wins)
        log.info("SiLU-and-mul fused into the down projection's GEMV for %d of %d (N, K, rows) cases "
                 "(%.1fs): %s", len(picked), len(self.use_glu), time.perf_counter() - t0, picked)
        return self


def calibrate_norm(d: GemvDispatch, weights: list[torch.Tensor], rows: tuple[int, ...] = (1, 2, 4, 8),
                   margin: float = 0.95) -> GemvDispatch:
    """For each distinct shape of ``weights`` (projections after an RMSNorm: qkv, gate_up):
    ``gemv_rms_norm`` against what runs otherwise (the fused_add_rms_norm kernel, then the
    linear as ``d`` picks it), both in CUDA graphs, streaming the weight from HBM; the fused
    one must win by 5%. Run after ``calibrate``."""
    from trellm.kernels.rmsnorm import fused_add_rms_norm

    t0 = time.perf_counter()
    by_shape = {(w.shape[0], w.shape[1]): w for w in weights if w.stride(1) == 1}
    for (n, k), w in sorted(by_shape.items(), key=lambda item: item[0]):
        ws = l2_copies(w)
        nw = torch.ones(k, dtype=w.dtype, device=w.device)
        for m in rows:
            x, res = (torch.randn(m, k, dtype=w.dtype, device=w.device) for _ in range(2))
            key = (n, k, m)
            linear = gemv if d.use_kernel.get(key, False) else F.linear

            before, fused, d.use_norm[key] = decide(
                lambda: graph_time_us([lambda w=w: gemv_rms_norm(x, w, None, res, nw, 1e-6) for w in ws], iters=30),
                lambda: graph_time_us([lambda w=w: linear(fused_add_rms_norm(x, res, nw, 1e-6)[0], w) for w in ws],
                                      iters=30), margin)
            d.norm_timings_us[key] = (before, fused)
        del ws
    torch.cuda.empty_cache()
    picked = sorted(key for key, wins in d.use_norm.items() if wins)
    log.info("residual add + RMSNorm fused into the next GEMV for %d of %d (N, K, rows) cases (%.1fs): %s",
             len(picked), len(d.use_norm), time.perf_counter() - t0, picked)
    return d


def l2_copies(w: torch.Tensor, make=torch.randn_like, total_bytes: int = 192 << 20) -> list[torch.Tensor]:
    """w and stand-ins of its shape (``make(w)``), together well past the L2 (50 MB on an
    H100 or H200): timed in turn, each call streams its weight from HBM, as in a decode
    step (every layer has its own weights). One weight timed over and over would sit in
    the L2 and flatter whichever kernel keeps fewer bytes in flight."""
    extra = min(63, max(0, -(-total_bytes // max(w.numel() * w.element_size(), 1)) - 1))
    return [w] + [make(w) for _ in range(extra)]


def graph_time_us(fns, iters: int = 20, warmup: int = 1) -> float:
    """CUDA-event time per call of ``iters`` calls (at least one per entry, cycling
    through ``fns``) captured in one CUDA graph, as decode runs them."""
    fns = list(fns) if isinstance(fns, (list, tuple)) else [fns]
    iters = max(iters, len(fns))
    side = torch.cuda.Stream()  # warm-up off the capture stream, as PyTorch advises (cuBLAS)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for fn in fns * warmup:
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(iters):
            fns[i % len(fns)]()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters
