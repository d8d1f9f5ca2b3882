"""INT8 weight-only linear (W8A16) in Triton: ``y = (x @ q^T) * scale (+ bias)``.

``q`` int8 [N, K] (F.linear's orientation), ``scale`` float32 [N] per output row
(absmax / 127, trellm/quant/int8.py), x [M, K] in the model dtype.

Two kernels, each a family of block configs (``CONFIGS``) picked per (N, K, rows) by
timing on the device (``Int8Dispatch.calibrate``), with shape-based defaults:

- ``_dot_kernel`` (any M): tensor cores. A program owns BN weight rows and a K range;
  each step cp.async-copies the int8 tile [BN, BK] (16-byte vectors, ``stages`` tiles
  in flight) and x [BM, BK] to shared memory, widens the weight to x's dtype in
  registers -- exact: |q| <= 127 fits bf16's 8-bit significand; Triton's packed
  conversion does two lanes an instruction -- and accumulates ``x @ w^T`` in float32.
  With BM = 16 (decode) that is mma.sync with the weight as the B operand, ~3.4
  instructions per weight byte in the sm_90 PTX (``swap=False`` configs); the
  ``swap`` variant puts the weight on wgmma's A operand instead (more shuffles; kept
  as a calibration candidate). Large BM (prefill) gets wgmma.
- ``_fma_kernel`` (M == 1): no tensor cores; the weight tile is viewed as
  [BN, BK/16, 16] so each thread's 16 bytes are widened and summed in-thread,
  x loaded once per K block for all BN rows.

Decode shapes have few N blocks, so both split K over about ``programs_per_sm`` x SMs
programs. Splits write float32 partials; the last program of an output tile to
arrive (an acq_rel counter) sums them in split order and applies the epilogue, so
the result is deterministic and there is one launch. That program resets the counter
(graph replays find it zero). Fallback without counters: a reduce kernel. The scale
(and bias) is applied once, to the float32 sum.

Accuracy: no weight is rounded (the old dequantize-to-bf16 path was, off by up to
0.125). For bf16/fp16 x every product x*q is exact in float32 (<= 19 significant
bits); for fp32 x each is rounded once. So the kernel's float32 sum differs from the
float32 reference ``int8_linear_ref_f32`` only by summation order and those product
roundings, <= (K + 2) * 2^-24 * sum_k |x_k q_k| * scale; rounding to x's dtype adds at
most half an ulp. tests/kernels/test_int8_gemv.py checks exactly that bound
(``int8_error_bound``).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from trellm.kernels._triton import tl, triton, pdl_begin, pdl_kwargs
# graph_time_us: scripts use it from here.
from trellm.kernels.gemv import _int8_to_f32, graph_time_us, l2_copies  # noqa: F401
from trellm.kernels.paged_attention import _num_sms

log = logging.getLogger("trellm")

LOCK_SLOTS = 1 << 16
"""Split-K counters per device: one per output tile of a launch (more tiles: the reduce kernel)."""


@dataclass(frozen=True)
class KernelConfig:
    name: str
    kind: str
    """'dot' (tensor cores, any M), 'fma' (M == 1 only) or 'gemv' (kernels/gemv.py's
    streaming kernel in its int8 mode, M <= gemv.MAX_ROWS: its own blocks, block_k a
    multiple of its K block, no split)."""
    block_n: int
    block_k: int
    block_m: int
    """Activation rows per program (dot: >= 16, the MMA's minimum; fma: 1)."""
    warps: int
    stages: int
    programs_per_sm: int
    """Split-K target: about this many programs per SM; 0 = never split."""
    swap: bool = True
    """dot: the weight tile is the MMA's A operand (wgmma, from registers); False: the B
    operand (mma.sync at 16-32 rows, widened into its registers; wgmma from shared
    memory at 64+)."""


def _cfg(name, kind, bn, bk, bm, warps, stages, pps, swap=True):
    return KernelConfig(name, kind, bn, bk, bm, warps, stages, pps, swap)


CONFIGS = {c.name: c for c in (
    # Decode (<= 16 rows), weight-streaming with split K. "n": the weight is the B operand
    # of mma.sync (x pads to 16 rows), widened two lanes an instruction straight into the
    # operand registers: ~3.4 PTX instructions per weight byte per thread in the loop
    # (sm_90, Triton 3.6), against ~6.9 for "s" (the weight on wgmma's A operand, more
    # shuffling) and ~5.9 for "f" (no tensor cores); all kept as calibration candidates.
    _cfg("n64k128", "dot", 64, 128, 16, 4, 4, 4, swap=False),
    _cfg("n64k256", "dot", 64, 256, 16, 4, 3, 3, swap=False),
    _cfg("n128k128", "dot", 128, 128, 16, 4, 4, 2, swap=False),
    _cfg("n128k256", "dot", 128, 256, 16, 8, 3, 2, swap=False),
    _cfg("n32k256", "dot", 32, 256, 16, 2, 4, 8, swap=False),
    _cfg("s64k128", "dot", 64, 128, 16, 4, 4, 4),
    _cfg("f16k512", "fma", 16, 512, 1, 4, 1, 6),
    _cfg("f32k512", "fma", 32, 512, 1, 4, 1, 4),
    # kernels/gemv.py's layout (the bf16 GEMV's: a program streams whole rows, no split, no
    # reduce, the next block loaded a step ahead under PDL); block_k: its K block x 1 or 2.
    _cfg("v1", "gemv", 0, 1, 1, 4, 1, 0),
    _cfg("v2", "gemv", 0, 2, 1, 4, 1, 0),
    # More rows: weight-bound up to ~100 rows on an H200, then compute-bound tiles (split
    # only while the tiles alone do not fill the SMs once).
    _cfg("m32k128", "dot", 64, 128, 32, 4, 4, 2, swap=False),
    _cfg("m64k64", "dot", 128, 64, 64, 4, 4, 1, swap=False),
    _cfg("g128k64", "dot", 128, 64, 128, 8, 3, 1, swap=False),
    _cfg("sg128k64", "dot", 128, 64, 128, 8, 3, 1),
)}
SKINNY_ROWS = 16
"""Rows up to which the decode configs are candidates."""


def candidates(rows: int) -> list[str]:
    """The config names worth timing at this row count."""
    if rows <= SKINNY_ROWS:
        names = [n for n, c in CONFIGS.items() if c.block_m <= 16 and _takes(c, rows)]
        return names + (["m32k128"] if rows > 8 else [])
    if rows <= 64:
        return ["m32k128", "m64k64", "n64k128", "g128k64"]
    return ["m64k64", "g128k64", "sg128k64"]


def _takes(cfg: KernelConfig, rows: int) -> bool:
    """Whether a config runs this many rows (fma: one; gemv: up to gemv.MAX_ROWS)."""
    from trellm.kernels.gemv import MAX_ROWS

    return cfg.kind == "dot" or rows == 1 or (cfg.kind == "gemv" and rows <= MAX_ROWS)


def default_config(rows: int) -> KernelConfig:
    """Before (or without) calibration: a shape-only guess."""
    return CONFIGS["n64k128" if rows <= SKINNY_ROWS else "m32k128" if rows <= 32
                   else "m64k64" if rows <= 64 else "g128k64"]


# ---- kernels ------------------------------------------------------------------------------------

@triton.jit
def _store_out(acc, n, m, nmask, mmask, scale_ptr, bias_ptr, out_ptr, stride_o, HAS_BIAS: tl.constexpr):
    """acc [BN, BM] float32 -> out[m, n] = acc * scale[n] (+ bias[n]), one rounding."""
    y = acc * tl.load(scale_ptr + n, mask=nmask, other=0.0)[:, None]
    if HAS_BIAS:
        y = y + tl.load(bias_ptr + n, mask=nmask, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + m[None, :].to(tl.int64) * stride_o + n[:, None], y.to(out_ptr.dtype.element_ty),
             mask=nmask[:, None] & mmask[None, :])


@triton.jit
def _finish(acc, n, m, nmask, mmask, M, N, splits, scale_ptr, bias_ptr, out_ptr, part_ptr, lock_ptr, stride_o,
            HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, SEM: tl.constexpr):
    """The epilogue, or (split K) this split's partial and, for the last to arrive, the sum."""
    if not SPLIT:
        _store_out(acc, n, m, nmask, mmask, scale_ptr, bias_ptr, out_ptr, stride_o, HAS_BIAS)
    else:
        tile = nmask[:, None] & mmask[None, :]
        offs = m[None, :].to(tl.int64) * N + n[:, None]
        plane = M.to(tl.int64) * N
        tl.store(part_ptr + tl.program_id(1) * plane + offs, acc, mask=tile)
        if SEM:
            # Every thread's partial is stored before one thread's release of the count.
            tl.debug_barrier()
            lock = lock_ptr + tl.program_id(2) * tl.num_programs(0) + tl.program_id(0)
            if tl.atomic_add(lock, 1, sem="acq_rel", scope="gpu") == splits - 1:
                total = tl.zeros_like(acc)
                for s in range(splits):  # split order, whoever came last: deterministic
                    total += tl.load(part_ptr + s * plane + offs, mask=tile, other=0.0, cache_modifier=".cg")
                _store_out(total, n, m, nmask, mmask, scale_ptr, bias_ptr, out_ptr, stride_o, HAS_BIAS)
                tl.atomic_xchg(lock, 0, sem="relaxed", scope="gpu")


@triton.jit(do_not_specialize=["M", "steps_per_split", "splits"])
def _dot_kernel(x_ptr, q_ptr, scale_ptr, bias_ptr, out_ptr, part_ptr, lock_ptr, M, N, KD, steps_per_split, splits,
                stride_x, stride_q, stride_o, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, SEM: tl.constexpr,
                PRECISION: tl.constexpr, SWAP: tl.constexpr, PDL: tl.constexpr = False):
    pdl_begin(PDL)
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    m = tl.program_id(2) * BM + tl.arange(0, BM)
    nmask = n < N
    mmask = m < M
    # A multiple of BK by construction: the loads below stay 16-byte vectors.
    k0 = tl.program_id(1) * steps_per_split * BK
    k = k0 + tl.arange(0, BK)
    q_ptrs = q_ptr + n[:, None].to(tl.int64) * stride_q + k[None, :]
    x_ptrs = x_ptr + m[None, :].to(tl.int64) * stride_x + k[:, None]  # x^T [BK, BM]
    acc = tl.zeros((BN, BM) if SWAP else (BM, BN), tl.float32)
    for kk in range(0, steps_per_split * BK, BK):
        if EVEN_K:
            w = tl.load(q_ptrs, mask=nmask[:, None], other=0)
            xt = tl.load(x_ptrs, mask=mmask[None, :], other=0.0)
        else:
            kmask = (k0 + kk + tl.arange(0, BK)) < KD
            w = tl.load(q_ptrs, mask=nmask[:, None] & kmask[None, :], other=0)
            xt = tl.load(x_ptrs, mask=mmask[None, :] & kmask[:, None], other=0.0)
        # Triton's int8 -> bf16/fp16 conversion is packed (two lanes an instruction) and exact.
        if SWAP:  # the weight is the MMA's A operand, widened in registers
            acc = tl.dot(w.to(xt.dtype), xt, acc, input_precision=PRECISION)
        else:  # the weight is the B operand, widened and staged through shared memory
            acc = tl.dot(tl.trans(xt), tl.trans(w.to(xt.dtype)), acc, input_precision=PRECISION)
        q_ptrs += BK
        x_ptrs += BK
    if not SWAP:
        acc = tl.trans(acc)
    _finish(acc, n, m, nmask, mmask, M, N, splits, scale_ptr, bias_ptr, out_ptr, part_ptr, lock_ptr, stride_o,
            HAS_BIAS, SPLIT, SEM)


@triton.jit(do_not_specialize=["M", "steps_per_split", "splits"])
def _fma_kernel(x_ptr, q_ptr, scale_ptr, bias_ptr, out_ptr, part_ptr, lock_ptr, M, N, KD, steps_per_split, splits,
                stride_x, stride_q, stride_o, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, SEM: tl.constexpr,
                PRECISION: tl.constexpr, SWAP: tl.constexpr, PDL: tl.constexpr = False):
    pdl_begin(PDL)
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    nmask = n < N
    k0 = tl.program_id(1) * steps_per_split * BK
    # [BK/16, 16]: a thread's 16 contiguous bytes sit on the last axis, summed in-thread.
    kofs = tl.arange(0, BK // 16)[:, None] * 16 + tl.arange(0, 16)[None, :]
    q_ptrs = q_ptr + n[:, None, None].to(tl.int64) * stride_q + (k0 + kofs)[None, :, :]
    # x as [1, BK/16, 16], broadcast over the BN rows: loaded once per K block.
    x_ptrs = x_ptr + k0 + kofs[None, :, :]
    acc = tl.zeros((BN, BK // 16), tl.float32)
    for kk in range(0, steps_per_split * BK, BK):
        if EVEN_K:
            w = tl.load(q_ptrs, mask=nmask[:, None, None], other=0)
            xv = tl.load(x_ptrs).to(tl.float32)
        else:
            kmask = ((k0 + kk + kofs) < KD)[None, :, :]
            w = tl.load(q_ptrs, mask=nmask[:, None, None] & kmask, other=0)
            xv = tl.load(x_ptrs, mask=kmask, other=0.0).to(tl.float32)
        acc += tl.sum(_int8_to_f32(w) * xv, axis=2)
        q_ptrs += BK
        x_ptrs += BK
    y = tl.sum(acc, axis=1)[:, None]  # [BN, 1]
    m = tl.arange(0, 1)
    _finish(y, n, m, nmask, m < M, M, N, splits, scale_ptr, bias_ptr, out_ptr, part_ptr, lock_ptr, stride_o,
            HAS_BIAS, SPLIT, SEM)


@triton.jit(do_not_specialize=["M", "splits"])
def _reduce_kernel(part_ptr, scale_ptr, bias_ptr, out_ptr, M, N, splits, stride_o,
                   BN: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr = False):
    """Fallback for launches with more output tiles than counters: sum the splits in order."""
    pdl_begin(PDL)
    row = tl.program_id(0)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    nmask = n < N
    acc = tl.zeros((BN,), tl.float32)
    for s in range(splits):
        acc += tl.load(part_ptr + (s * M + row).to(tl.int64) * N + n, mask=nmask, other=0.0)
    y = acc * tl.load(scale_ptr + n, mask=nmask, other=0.0)
    if HAS_BIAS:
        y = y + tl.load(bias_ptr + n, mask=nmask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row.to(tl.int64) * stride_o + n, y.to(out_ptr.dtype.element_ty), mask=nmask)


# ---- launch -------------------------------------------------------------------------------------

_LOCKS: dict[torch.device, torch.Tensor] = {}


def prepare(device: torch.device) -> torch.Tensor:
    """The device's split-K counters (zeros; each launch leaves them zero). Called at
    load time: allocating while a CUDA graph is captured would tie them to the graph."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _LOCKS:
        _LOCKS[device] = torch.zeros(LOCK_SLOTS, dtype=torch.int32, device=device)
    return _LOCKS[device]


def _locks(device: torch.device) -> torch.Tensor | None:
    """The counters, or None while a graph is captured before ``prepare`` ran (the
    reduce kernel then: counters allocated inside a capture would belong to it)."""
    locks = _LOCKS.get(device)
    if locks is None and not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        locks = prepare(device)
    return locks


def _split_plan(steps: int, tiles: int, cfg: KernelConfig, device: torch.device) -> tuple[int, int]:
    """(splits, K steps per split): about programs_per_sm x SMs programs, none empty."""
    if cfg.programs_per_sm <= 0:
        return 1, steps
    want = max(1, min(steps, triton.cdiv(cfg.programs_per_sm * _num_sms(device), tiles)))
    per = triton.cdiv(steps, want)
    return triton.cdiv(steps, per), per


def _precision(dtype: torch.dtype) -> str:
    # float32 activations would default to TF32 on the tensor cores (10-bit mantissa).
    return "ieee" if dtype == torch.float32 else "tf32"


def int8_linear_triton(x2: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                       config: KernelConfig | str | None = None, sem: bool = True) -> torch.Tensor:
    """x2 [M, K] (fp16 / bf16 / fp32, unit stride on K) -> [M, N] in x2.dtype."""
    m, kd = x2.shape
    n = q.shape[0]
    out = torch.empty(m, n, dtype=x2.dtype, device=x2.device)
    if m == 0 or n == 0:
        return out
    cfg = CONFIGS[config] if isinstance(config, str) else config or get_dispatch().config_for(n, kd, m)
    if not _takes(cfg, m):
        raise ValueError(f"config {cfg.name} takes {'one row' if cfg.kind == 'fma' else 'fewer rows'}, got {m}")
    if cfg.kind == "gemv":
        from trellm.kernels.gemv import gemv_int8

        return gemv_int8(x2, q, scale, bias, k_mult=cfg.block_k)
    n_tiles, m_tiles = triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m)
    steps = triton.cdiv(kd, cfg.block_k)
    splits, per = _split_plan(steps, n_tiles * m_tiles, cfg, x2.device)
    split = splits > 1
    locks = _locks(x2.device) if sem and split and n_tiles * m_tiles <= LOCK_SLOTS else None
    sem = locks is not None
    part = torch.empty(splits, m, n, dtype=torch.float32, device=x2.device) if split else out
    locks = part if locks is None else locks
    kernel = _dot_kernel if cfg.kind == "dot" else _fma_kernel
    bias_arg = bias if bias is not None else scale
    kernel[(n_tiles, splits, m_tiles)](
        x2, q, scale, bias_arg, out, part, locks, m, n, kd, per, splits,
        x2.stride(0), q.stride(0), out.stride(0), BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k,
        EVEN_K=kd % (per * cfg.block_k) == 0, HAS_BIAS=bias is not None, SPLIT=split, SEM=sem,
        PRECISION=_precision(x2.dtype), SWAP=cfg.swap, num_warps=cfg.warps, num_stages=cfg.stages,
        **pdl_kwargs())  # PDL by default: GPU-checked (docs/benchmarks/gpu/README.md, 2026-12-07 (fourth))
    if split and not sem:
        _reduce_kernel[(m, triton.cdiv(n, 256))](part, scale, bias_arg, out, m, n, splits, out.stride(0),
                                                BN=256, HAS_BIAS=bias is not None, num_warps=4, **pdl_kwargs())
    return out


def int8_linear_dequant(x2: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
                        ) -> torch.Tensor:
    """Baseline only (benchmarks): the weight dequantized into x2.dtype, then cuBLAS.
    Rounds w * scale to x2.dtype, so it is less accurate than the kernels."""
    w = (q.to(torch.float32) * scale[:, None]).to(x2.dtype)
    return F.linear(x2, w, None if bias is None else bias.to(x2.dtype))


def int8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                path: str | None = None) -> torch.Tensor:
    """The GPU op: x [..., K] -> [..., N]. ``path``: None / 'triton' (the kernels, config
    from the dispatch), 'dequant' (the baseline), or a ``CONFIGS`` name."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if path in (None, "triton"):
        y = int8_linear_triton(x2, q, scale, bias)
    elif path == "dequant":
        y = int8_linear_dequant(x2, q, scale, bias)
    elif path in CONFIGS:
        y = int8_linear_triton(x2, q, scale, bias, config=path)
    else:
        raise ValueError(f"unknown int8 path {path!r}")
    return y.reshape(*x.shape[:-1], q.shape[0])


def int8_linear_ref(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """The definition, in float32: ``(x @ q^T) * scale + bias``, cast to x.dtype."""
    return int8_linear_ref_f32(x, q, scale, bias).to(x.dtype)


def int8_linear_ref_f32(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
                        ) -> torch.Tensor:
    """``int8_linear_ref`` before the final rounding."""
    y = (x.float() @ q.float().t()) * scale.float()
    return y + bias.float() if bias is not None else y


_UNIT_ROUNDOFF = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


def int8_error_bound(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """Elementwise bound (float32 [M, N]) on |kernel - int8_linear_ref_f32|: float32
    accumulation in any order with exact or once-rounded products, (K + 2) u32 sum|x q|
    scale, doubled because tensor cores may truncate instead of round; plus the final
    rounding to x.dtype, half an ulp = u_dtype |y|; plus fp16's smallest subnormal."""
    mag = (x.float().abs() @ q.float().abs().t()) * scale.float()
    y = int8_linear_ref_f32(x, q, scale, bias).abs()
    acc = 2 * (q.shape[1] + 2) * 2.0 ** -24 * (mag + y)
    return acc + _UNIT_ROUNDOFF[x.dtype] * (y + acc) + 2.0 ** -24


# ---- dispatch and calibration -------------------------------------------------------------------

def _key(n: int, k: int, m: int) -> str:
    return f"{n}x{k}x{m}"  # a string: the dispatch is dumped to JSON


@dataclass
class Int8Dispatch:
    """Per (N, K, rows): the config that timed fastest here; ``default_config`` otherwise."""

    picks: dict[str, str] = field(default_factory=dict)
    timings_us: dict[str, dict[str, float]] = field(default_factory=dict)
    shapes: list[str] = field(default_factory=list)
    """"NxK" of every weight shape calibrated (or tried)."""
    rows: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 256)
    """Row counts calibrated; a call with other rows takes the next calibrated count up."""
    calibrate_on_load: bool = True
    """trellm/quant/int8.py calibrates each new weight shape as it is loaded (CUDA)."""

    def has_shape(self, n: int, k: int) -> bool:
        return f"{n}x{k}" in self.shapes

    def mark_shape(self, n: int, k: int) -> None:
        if not self.has_shape(n, k):
            self.shapes.append(f"{n}x{k}")

    def config_for(self, n: int, k: int, m: int) -> KernelConfig:
        # Pure Python on shapes: the same answer at capture and at replay.
        name = self.picks.get(_key(n, k, m))
        if name is None:
            up = [r for r in self.rows if r >= m]
            name = self.picks.get(_key(n, k, up[0])) if up else None
        cfg = CONFIGS.get(name) if name else None
        return cfg if cfg is not None and _takes(cfg, m) else default_config(m)

    def calibrate(self, weights: list[tuple[torch.Tensor, torch.Tensor]], rows: tuple[int, ...] | None = None,
                  names: list[str] | None = None) -> "Int8Dispatch":
        """Time the candidate configs on every distinct (q, scale) shape at each row count,
        in CUDA graphs; keep the fastest. A config that fails to build is skipped."""
        t0 = time.perf_counter()
        for q, scale in weights:
            if self.has_shape(*q.shape):
                continue
            self.mark_shape(*q.shape)
            copies = l2_copies(q, _random_int8)
            for m in rows or self.rows:
                x = torch.randn(m, q.shape[1], dtype=torch.bfloat16, device=q.device)
                times = time_configs(x, copies, scale, names or candidates(m))
                if times:
                    self.timings_us[_key(*q.shape, m)] = times
                    self.picks[_key(*q.shape, m)] = min(times, key=times.get)
            del copies
        log.info("int8 kernel calibration (%.1fs): %s", time.perf_counter() - t0, self.picks)
        return self


def _random_int8(q: torch.Tensor) -> torch.Tensor:
    return torch.randint(-127, 128, q.shape, dtype=torch.int8, device=q.device)


def time_configs(x: torch.Tensor, copies: list[torch.Tensor], scale: torch.Tensor, names: list[str]
                 ) -> dict[str, float]:
    """Microseconds per call of each config (cycling through ``copies``); failures skipped."""
    times = {}
    for name in names:
        if not _takes(CONFIGS[name], x.shape[0]):
            continue
        calls = [lambda w=w: int8_linear_triton(x, w, scale, None, config=name) for w in copies]
        try:
            times[name] = graph_time_us(calls)
        except Exception as e:  # noqa: BLE001 -- one config's build failure must not stop the rest
            log.warning("int8 config %s failed at %s: %s", name, _key(*copies[0].shape, x.shape[0]),
                        str(e).splitlines()[0] if str(e) else type(e).__name__)
    return times


def patch_interpreter_int_to_bf16() -> None:
    """Triton's CPU interpreter (3.9 at least) casts integers to bfloat16 by numpy's
    astype onto bf16's uint16 storage, i.e. the integer as raw bits; the GPU converts
    the value. Route such casts through float32 (exact for int8) so the interpreter
    computes what the GPU computes; the kernels are unchanged. For tests and --smoke."""
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.cast_impl, "_int8_patched", False):
        return
    orig = builder.cast_impl

    def cast_impl(self, src, dst_type):
        if dst_type.scalar == tl.bfloat16 and src.dtype.scalar.is_int():
            return orig(self, orig(self, src, tl.float32), dst_type)
        return orig(self, src, dst_type)

    cast_impl._int8_patched = True
    builder.cast_impl = cast_impl


_STATE = {"dispatch": Int8Dispatch()}


def set_dispatch(dispatch: Int8Dispatch) -> None:
    _STATE["dispatch"] = dispatch


def get_dispatch() -> Int8Dispatch:
    return _STATE["dispatch"]
