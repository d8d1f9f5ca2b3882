"""EXL3 in Triton, part 3: the decode in matrix order, one launch per merged layer.

Why (GPU measurements, docs/benchmarks/gpu/gpu-exl3.json): the exl3_gemv.py kernels
decode 32 static steps of [tiles, 8] values, load x with 32 strided loads per step
and run 3 launches per projection (9 for q/k/v); a 4096x14336 GEMV took 160 us
against 31 us for bf16 cuBLAS. This module decodes a whole [BK, BN] block of the
weight per K step in matrix order and feeds one ``tl.dot`` (or FMAs for one row).

Decode (exact, quant-spec §1.3-1.4). Cut each tile's 256 weights (sequence order t)
into groups of G consecutive t whose 16-bit windows all lie in one pair of 32-bit
words (``GROUP``: G = 8 for K <= 4, 4 for K = 5, 6, 8 and 2 for K = 7; checked over
every group by ``group_size``). Per group element the pair's word offsets and the
shift of its first window depend only on the element's place in the block, so they
are computed once per program (``_group_consts``). Per K step and group: two word
loads (2 / G loads per weight, L1 hits: a tile row of the block is TN * 32K
contiguous bytes), one 64-bit pair, and for each of the G weights a 64-bit shift by
(constant per element - j K), a mask, and the codebook. The G value tensors are
joined and permuted into natural [16 TK, 16 TN] order: t = 8 lane + j with lane =
4 c0 + q and j = rr0 + 2 rr3 + 4 cc3, where a tile row is 8 rr3 + 2 q + rr0 and a
column 8 cc3 + c0, so the permutation is a pure reordering of bit fields.

Ops per weight (MUL1, the default codebook): shift + and (state), multiply, byte sum
(and, shift, and, add, multiply, shift, add; ``asm=True``: one dp4a), float sub +
fma + cvt to fp16 (exact: B k_inv is exact in float32 and the bias add is exact),
then the mma (or a cvt + FMA for the one-row FMA variant). 3INST / MCG: multiply(-add),
lop3, two fp16 halves added. About 12 integer/float ops (7 with dp4a) + 2/G loads.

``split=True`` (``_split_kernel``) skips that reorder: each of the G value tensors meets the
x rows it belongs to (a gathered load of the transformed x) in its own dot / FMA; which
of the two the GPU prefers is for scripts/gpu_exl3_sweep.py to say.

Launches: parts of a merged layer (q/k/v, gate/up) with one K and codebook are one
``EXL3Fused``: their trellises concatenated along the output (the parts keep views,
so no memory is doubled), suh stacked, svh / bias concatenated. A program's column
block (BN <= 128 divides each part's 128-padded width) belongs to one part, found
in a tiny per-tile table. Per call: input transform for every part (one launch; or
fused into the main kernel with ``in_had``: each program Hadamards its own K slice
of x, a [BM, 128] x [128, 128] dot per 128 inputs) -> main kernel (split-K
partials) -> output transform for every part (one launch; scatters each part's
columns to its place in the unpadded output). 2-3 launches per layer, no host
syncs, no data-dependent Python branches: CUDA-graph safe. Prefill (``fast_prefill``,
from ``reconstruct_min_rows``) instead decodes W to fp16 in column slices for cuBLAS
and runs both transforms as fp16 GEMMs (``exl3_prefill.py``).
"""
from __future__ import annotations

import os

from dataclasses import dataclass

import torch

from trellm.kernels._triton import tl, triton, pdl_begin, pdl_kwargs
# re-exported: callers import them from here
from trellm.kernels.exl3_config import MMA_WIDE_BITS, FastConfig, FastDispatch, split_fallback  # noqa: F401
from trellm.kernels.exl3_decode import CODEBOOK_IDS, _inst_value, _out_kernel, kernel_bits
from trellm.kernels.exl3_prologue import fast_input_transform, x_layout  # noqa: F401 (re-exported)
from trellm.kernels.paged_attention import _num_sms
from trellm.quant.exl3.hadamard import HAD_SIZE
from trellm.quant.exl3.weight import EXL3Weight


def group_size(k: int) -> int:
    """Largest G in (8, 4, 2) such that every group of G consecutive weights (starting at
    a multiple of G) has its windows inside two words: offset + 16 + (G - 1) K <= 64."""
    ring = 256 * k
    for g in (8, 4, 2):
        if all(((t0 + 1) * k - 16) % ring % 32 + 16 + (g - 1) * k <= 64 for t0 in range(0, 256, g)):
            return g
    raise ValueError(f"no word-pair grouping for K={k}")


GROUP = {k: group_size(k) for k in range(1, 9)}


_STATE = {"dispatch": FastDispatch()}


def _use_asm(asm: bool, codebook: str) -> bool:
    """dp4a applies to MUL1 only, and inline PTX does not run in Triton's interpreter."""
    return asm and codebook == "mul1" and os.environ.get("TRITON_INTERPRET") != "1"


def set_dispatch(dispatch: FastDispatch) -> None:
    """Before any CUDA graph capture (the graphs keep the kernels they captured)."""
    _STATE["dispatch"] = dispatch


def get_dispatch() -> FastDispatch:
    return _STATE["dispatch"]


# ---- decode (jit) -----------------------------------------------------------------------------

@triton.jit
def _group_consts(pid_n, TJS, K: tl.constexpr, G: tl.constexpr, TK: tl.constexpr, TN: tl.constexpr):
    """Per group element of the program's TK x TN tile block: the word offsets of its pair
    (relative to the block's first tile row), the right shift (uint64) that brings its
    first window down from the 64-bit pair, and its tile row (for masks). Group rows are
    (tk, q) for G >= 4, (tk, rr3, q) for G = 2; group columns (tn, c0) for G = 8, else
    the natural columns (tn, cc3, c0)."""
    RG: tl.constexpr = 8 if G == 2 else 4
    CG: tl.constexpr = 8 if G == 8 else 16
    gr = tl.arange(0, TK * RG)
    gc = tl.arange(0, TN * CG)
    q = gr % 4
    c0 = gc % 8
    t0 = 8 * (4 * c0[None, :] + q[:, None])
    if G == 2:
        t0 = t0 + (2 * ((gr // 4) % 2))[:, None]  # rr3 is j's bit 1
    if G != 8:
        t0 = t0 + (4 * ((gc // 8) % 2))[None, :]  # cc3 is j's bit 2
    RING: tl.constexpr = 256 * K
    start = ((t0 + 1) * K + (RING - 16)) % RING
    word = start // 32
    tile = ((gr // RG)[:, None] * TJS + pid_n * TN + (gc // CG)[None, :]) * (8 * K)
    offa = tile + word
    offb = tile + (word + 1) % (8 * K)
    sh = (48 - start % 32).to(tl.uint64)
    return offa, offb, sh, gr // RG


@triton.jit
def _byte_sum(x, SCALE: tl.constexpr, BASE: tl.constexpr, ASM: tl.constexpr):
    """uint32 BASE + SCALE * (sum of x's 4 bytes), SCALE <= 255: one dp4a on the GPU
    (``ASM``), shifts and masks in the interpreter."""
    if ASM:
        return tl.inline_asm_elementwise(
            "dp4a.u32.u32 $0, $1, $2, $3;", "=r,r,r,r",
            [x, tl.full(x.shape, SCALE * 0x01010101, tl.uint32), tl.full(x.shape, BASE, tl.uint32)],
            dtype=tl.uint32, is_pure=True, pack=1)
    pairs = (x & 0x00FF00FF) + ((x >> 8) & 0x00FF00FF)
    return ((pairs * 0x10001) >> 16) * SCALE + BASE


@triton.jit
def _codebook(s, CB: tl.constexpr, ASM: tl.constexpr):
    """16-bit states (uint32) -> fp16 values, bit-exact (spec §1.4; see exl3_decode._decode).
    MUL1: 0x4B000000 + B is the float32 2^23 + B, so B = f - 2^23 exactly, B k_inv is exact
    (21 bits) and adding 1024 k_inv + k_bias = -3.453125 is exact: one rounding, to fp16."""
    if CB == 2:
        f = _byte_sum(s * 0x83DCD12D, 1, 0x4B000000, ASM)
        if ASM:  # one exact FFMA: f k_inv is 56768 + B k_inv, and -56768 - 3.453125 is exact in float32
            v = tl.fma(f.to(tl.float32, bitcast=True), 0.00676727294921875, -56771.453125).to(tl.float16)
        else:  # the interpreter's fma is not fused: subtract first (exact), then one rounding
            v = ((f.to(tl.float32, bitcast=True) - 8388608.0) * 0.00676727294921875 - 3.453125).to(tl.float16)
    else:
        v = _inst_value(s, CB)
    return v


@triton.jit
def _weight(p, sh, J: tl.constexpr, K: tl.constexpr, CB: tl.constexpr, ASM: tl.constexpr):
    """Value of weight J of each group: its window starts J K bits after the first."""
    return _codebook(((p >> (sh - J * K)) & 0xFFFF).to(tl.uint32), CB, ASM)


@triton.jit
def _load_pairs(wp, offa, offb, mask):
    """uint64 word pairs (first word high) of every group; ``wp``: the block's first word."""
    if mask is None:  # whole steps (EVEN_K): no mask instructions
        a = tl.load(wp + offa)
        b = tl.load(wp + offb)
    else:
        a = tl.load(wp + offa, mask=mask, other=0)
        b = tl.load(wp + offb, mask=mask, other=0)
    a = a.to(tl.uint32, bitcast=True).to(tl.uint64)
    return (a << 32) | b.to(tl.uint32, bitcast=True).to(tl.uint64)


@triton.jit
def _step_pairs(w_ptr, step, TI, TJS, offa, offb, gtk, K: tl.constexpr, TK: tl.constexpr, EVEN_K: tl.constexpr):
    """The word pairs of K step ``step`` (tile rows [TK step, TK (step + 1)))."""
    k0 = step * TK
    wmask = None
    if not EVEN_K:
        wmask = (k0 + gtk < TI)[:, None]
    return _load_pairs(w_ptr + k0.to(tl.int64) * TJS * (8 * K), offa, offb, wmask)


@triton.jit
def _decode_block(wp, offa, offb, sh, mask, K: tl.constexpr, CB: tl.constexpr, G: tl.constexpr,
                  TK: tl.constexpr, TN: tl.constexpr, ASM: tl.constexpr):
    """fp16 [16 TK, 16 TN] of the tile block whose first word is ``wp``, natural order."""
    p = _load_pairs(wp, offa, offb, mask)
    # j bit 0 (rr0) is the innermost join, then rr3, then cc3 (see the module docstring).
    v = tl.join(_weight(p, sh, 0, K, CB, ASM), _weight(p, sh, 1, K, CB, ASM))
    if G == 2:  # [(tk, rr3, q), n, rr0] -> rows 2 gr + rr0
        v = tl.reshape(tl.permute(v, 0, 2, 1), (TK * 16, TN * 16))
    else:
        v = tl.join(v, tl.join(_weight(p, sh, 2, K, CB, ASM), _weight(p, sh, 3, K, CB, ASM)))
        if G == 4:  # [(tk, q), n, rr0, rr3] -> (tk, rr3, q, rr0), n
            v = tl.reshape(v, (TK, 4, TN * 16, 2, 2))
            v = tl.reshape(tl.permute(v, 0, 4, 1, 3, 2), (TK * 16, TN * 16))
        else:  # G == 8: [(tk, q), (tn, c0), rr0, rr3, cc3] -> (tk, rr3, q, rr0), (tn, cc3, c0)
            hi = tl.join(tl.join(_weight(p, sh, 4, K, CB, ASM), _weight(p, sh, 5, K, CB, ASM)),
                         tl.join(_weight(p, sh, 6, K, CB, ASM), _weight(p, sh, 7, K, CB, ASM)))
            v = tl.reshape(tl.join(v, hi), (TK, 4, TN, 8, 2, 2, 2))
            v = tl.reshape(tl.permute(v, 0, 5, 1, 4, 2, 6, 3), (TK * 16, TN * 16))
    return v


# ---- kernels (jit) ----------------------------------------------------------------------------

@triton.jit
def _x_block(x_ptr, suh_ptr, had_ptr, m, M, k0, n_in, in_p, stride_xm, BM: tl.constexpr, BK: tl.constexpr,
             IN_HAD: tl.constexpr, EVEN_K: tl.constexpr):
    """fp16 [BM, BK] activations for K rows [16 k0, 16 k0 + BK) of the transformed x: read
    (x_ptr: the part's transformed x, in_p wide), or with IN_HAD computed from the raw x
    (x_ptr, n_in wide) and the part's suh: (x * suh) per 128 inputs times the +-1 table,
    / sqrt(128). Rows past in_p are zeros (the masked weights there decode to non-zeros)."""
    cols = k0 * 16 + tl.arange(0, BK)
    rmask = (m < M)[:, None]
    if IN_HAD:
        x = tl.load(x_ptr + m[:, None].to(tl.int64) * stride_xm + cols[None, :],
                    mask=rmask & (cols < n_in)[None, :], other=0.0).to(tl.float32)
        suh = tl.load(suh_ptr + cols, mask=cols < n_in, other=0.0).to(tl.float32)
        x = (x * suh[None, :]).to(tl.float16)
        idx = tl.arange(0, 128)
        h = tl.load(had_ptr + idx[:, None] * 128 + idx[None, :])
        xh = tl.dot(tl.reshape(x, (BM * (BK // 128), 128)), h) * 0.08838834764831845
        xb = tl.reshape(xh, (BM, BK)).to(tl.float16)
    else:
        if not EVEN_K:
            rmask = rmask & (cols < in_p)[None, :]
        xb = tl.load(x_ptr + m[:, None].to(tl.int64) * stride_xm + cols[None, :], mask=rmask, other=0.0)
    return xb


# M, the split length and the input width change per call / layer: not specialized on.
@triton.jit(do_not_specialize=["M", "per_split", "n_in"])
def _fast_kernel(x_ptr, suh_ptr, had_ptr, w_ptr, tile_part_ptr, out_ptr, M, TI, TJS, NP, n_in, per_split,
                 stride_xp, stride_xm, stride_sp,
                 K: tl.constexpr, CB: tl.constexpr, G: tl.constexpr, TK: tl.constexpr, TN: tl.constexpr,
                 BM: tl.constexpr, DOT: tl.constexpr, IN_HAD: tl.constexpr, EVEN_K: tl.constexpr,
                 ASM: tl.constexpr, PDL: tl.constexpr = False):
    """out[split, m, block] = xh[m, the split's K rows] @ Wq[those rows, block] (float32).
    Grid: (column blocks of 16 TN, splits, row blocks of BM)."""
    pdl_begin(PDL)
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    BK: tl.constexpr = TK * 16
    BN: tl.constexpr = TN * 16
    # One scalar load per program (not a constexpr switch: one compile serves 1 and n parts).
    part = tl.load(tile_part_ptr + pid_n * TN)
    x_ptr += part * stride_xp
    suh_ptr += part * stride_sp
    offa, offb, sh, gtk = _group_consts(pid_n, TJS, K, G, TK, TN)
    m = tl.program_id(2) * BM + tl.arange(0, BM)
    lo = pid_s * per_split
    hi = tl.minimum(lo + per_split, tl.cdiv(TI, TK))
    if DOT:
        acc = tl.zeros((BM, BN), tl.float32)
    else:
        acc = tl.zeros((BK, BN), tl.float32)
    for step in range(lo, hi):
        k0 = step * TK
        wmask = None
        if not EVEN_K:
            wmask = (k0 + gtk < TI)[:, None]
        v = _decode_block(w_ptr + k0.to(tl.int64) * TJS * (8 * K), offa, offb, sh, wmask, K, CB, G, TK, TN, ASM)
        if DOT:
            acc = tl.dot(_x_block(x_ptr, suh_ptr, had_ptr, m, M, k0, n_in, TI * 16, stride_xm, BM, BK,
                                          IN_HAD, EVEN_K), v, acc)
        else:  # one row, float32 x: rows past TI read the next part's x (or padding) times zero weights
            xr = tl.load(x_ptr + k0 * 16 + tl.arange(0, BK), mask=k0 * 16 + tl.arange(0, BK) < TI * 16, other=0.0)
            acc += xr[:, None] * v.to(tl.float32)
    if DOT:
        y = acc
    else:
        y = tl.sum(acc, 0)[None, :]
    cols = pid_n * BN + tl.arange(0, BN)
    out = out_ptr + pid_s.to(tl.int64) * M * NP + m[:, None].to(tl.int64) * NP + cols[None, :]
    tl.store(out, y, mask=(m < M)[:, None])


@triton.jit(do_not_specialize=["M", "per_split"])
def _split_kernel(x_ptr, w_ptr, tile_part_ptr, out_ptr, M, TI, TJS, NP, per_split, stride_xp, stride_xm,
                  K: tl.constexpr, CB: tl.constexpr, G: tl.constexpr, TK: tl.constexpr, TN: tl.constexpr,
                  BM: tl.constexpr, DOT: tl.constexpr, EVEN_K: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr = False):
    """_fast_kernel without reordering the decoded values (``split=True``): weight J of every
    group meets the x rows it belongs to (a gathered load of the transformed x), G dots (or
    FMAs) per step into two accumulators, for the columns with cc3 = 0 and 1 when G = 8."""
    pdl_begin(PDL)
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    RG: tl.constexpr = 8 if G == 2 else 4
    GC: tl.constexpr = TN * 8 if G == 8 else TN * 16
    x_ptr += tl.load(tile_part_ptr + pid_n * TN) * stride_xp
    offa, offb, sh, gtk = _group_consts(pid_n, TJS, K, G, TK, TN)
    gr = tl.arange(0, TK * RG)
    rbase = 16 * (gr // RG) + 2 * (gr % 4)
    if G == 2:
        rbase += 8 * ((gr // 4) % 2)
    m = tl.program_id(2) * BM + tl.arange(0, BM)
    if DOT:
        acc0 = tl.zeros((BM, GC), tl.float32)
    else:
        acc0 = tl.zeros((TK * RG, GC), tl.float32)
    acc1 = tl.zeros_like(acc0)
    for step in range(pid_s * per_split, tl.minimum((pid_s + 1) * per_split, tl.cdiv(TI, TK))):
        k0 = step * TK
        p = _step_pairs(w_ptr, step, TI, TJS, offa, offb, gtk, K, TK, EVEN_K)
        for J in tl.static_range(G):
            v = _weight(p, sh, J, K, CB, ASM)
            rows = k0 * 16 + rbase + (J % 2) + (8 * ((J // 2) % 2) if G != 2 else 0)
            if DOT:
                xj = tl.load(x_ptr + m[:, None].to(tl.int64) * stride_xm + rows[None, :],
                             mask=(m < M)[:, None] & (rows < TI * 16)[None, :], other=0.0)
                if G == 8 and J >= 4:
                    acc1 = tl.dot(xj, v, acc1)
                else:
                    acc0 = tl.dot(xj, v, acc0)
            else:
                prod = tl.load(x_ptr + rows, mask=rows < TI * 16, other=0.0)[:, None] * v.to(tl.float32)
                if G == 8 and J >= 4:
                    acc1 += prod
                else:
                    acc0 += prod
    _store_split(out_ptr, acc0, acc1, m, M, NP, pid_n, pid_s, G, TN, DOT)


@triton.jit
def _store_split(out_ptr, acc0, acc1, m, M, NP, pid_n, pid_s, G: tl.constexpr, TN: tl.constexpr,
                 DOT: tl.constexpr):
    if DOT:
        y0 = acc0
        y1 = acc1
    else:
        y0 = tl.sum(acc0, 0)[None, :]
        y1 = tl.sum(acc1, 0)[None, :]
    gc = tl.arange(0, TN * 8 if G == 8 else TN * 16)
    out = out_ptr + pid_s.to(tl.int64) * M * NP + m[:, None].to(tl.int64) * NP + pid_n * TN * 16
    if G == 8:  # group column (tn, c0): columns 16 tn + c0 (cc3 = 0) and + 8 (cc3 = 1)
        out = out + (16 * (gc // 8) + gc % 8)[None, :]
        tl.store(out, y0, mask=(m < M)[:, None])
        tl.store(out + 8, y1, mask=(m < M)[:, None])
    else:
        tl.store(out + gc[None, :], y0, mask=(m < M)[:, None])


@triton.jit
def _fast_reconstruct_kernel(w_ptr, out_ptr, TI, TJS, stride_o, K: tl.constexpr, CB: tl.constexpr,
                             G: tl.constexpr, TK: tl.constexpr, TN: tl.constexpr, ASM: tl.constexpr):
    """Wq as fp16 [16 TI, 16 TJ] through ``_decode_block`` (the tests' bit-exact check of the
    decode, and a faster reconstruct for prefill). Grid: (column blocks, K steps)."""
    pid_n = tl.program_id(0)
    k0 = tl.program_id(1) * TK
    offa, offb, sh, gtk = _group_consts(pid_n, TJS, K, G, TK, TN)
    wmask = (k0 + gtk < TI)[:, None]
    v = _decode_block(w_ptr + k0.to(tl.int64) * TJS * (8 * K), offa, offb, sh, wmask, K, CB, G, TK, TN, ASM)
    rows = k0 * 16 + tl.arange(0, TK * 16)
    cols = pid_n * TN * 16 + tl.arange(0, TN * 16)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_o + cols[None, :], v, mask=(rows < TI * 16)[:, None])


# Merged layers live in exl3_fused; re-exported here, where callers have always found them.
from trellm.kernels.exl3_fused import EXL3Fused, _had_table, fusable, fuse, fuse_groups  # noqa: E402,F401
from trellm.kernels.exl3_prefill import prefill_matmul  # noqa: E402


# ---- launches ---------------------------------------------------------------------------------

def _pow2(n: int) -> int:
    return max(1, triton.next_power_of_2(n))


def _tile_stride(trellis: torch.Tensor) -> int:
    """Tiles from one tile row to the next (a part's trellis may be a view of a fused one)."""
    return trellis.stride(0) // trellis.shape[2]


def _check(cfg: FastConfig, m: int) -> None:
    if cfg.tn not in (1, 2, 4, 8) or cfg.tk < 1 or cfg.tk & (cfg.tk - 1):
        raise ValueError(f"tn must be 1, 2, 4 or 8 and tk a power of 2, got {cfg}")
    if not cfg.dot and not cfg.mma and m != 1:
        raise ValueError(f"the FMA variant takes one row, got {m}")
    if cfg.dot and cfg.in_had and (cfg.tk * 16) % HAD_SIZE:
        raise ValueError(f"in_had needs 16 tk to be a multiple of 128, got tk={cfg.tk}")
    if cfg.split and cfg.dot and (cfg.tk < 4 or cfg.tn < 2):  # tl.dot's 16 x 16 minimum
        raise ValueError(f"the split dot needs tk >= 4 and tn >= 2, got {cfg}")
    if cfg.row and cfg.dot:
        raise ValueError(f"row is the one-row FMA kernel (dot=False), got {cfg}")
    if cfg.affine and not (cfg.row or cfg.mma):
        raise ValueError(f"affine is a mode of the row and mma kernels, got {cfg}")
    if cfg.fuse_out and not (cfg.mma or (cfg.row and not cfg.dot)):
        raise ValueError(f"fuse_out is a mode of the mma and row kernels, got {cfg}")
    if cfg.prefetch not in (0, 1, 2) or (cfg.prefetch and not (cfg.mma or (cfg.row and cfg.prefetch == 1))):
        raise ValueError(f"prefetch (0 / False, 1 / True or 2 steps) is a mode of the mma and row (1) kernels, "
                         f"got {cfg}")
    if cfg.frag_x and not cfg.mma:
        raise ValueError(f"frag_x is a mode of the mma kernel, got {cfg}")
    if cfg.mma and (cfg.dot or cfg.row or cfg.split or cfg.tk % cfg.warps):
        raise ValueError(f"mma is its own kernel (dot, row, split off; warps dividing tk), got {cfg}")


def fast_partials(f: EXL3Fused, x2: torch.Tensor, cfg: FastConfig, y: torch.Tensor | None = None,
                  xh: torch.Tensor | None = None) -> torch.Tensor:
    """Split-K partials [S, M, sum out_p] (float32) of every part's ``xh @ Wq``; x2 is the
    raw activations [M, in_features] (contiguous rows). ``y``: exl3_mma or exl3_row writes
    the transformed output there too (``_can_fuse``). ``xh``: x already transformed, as
    ``x_layout`` says (exl3_prologue: by the norm or SiLU-and-mul kernel before)."""
    from trellm.kernels import exl3_mma  # its module constants need Triton: imported on use

    m = x2.shape[0]
    _check(cfg, m)
    ti, tj, _ = f.trellis.shape
    layout = x_layout(f, cfg, m)
    mma = _mma_applies(f, cfg)
    if cfg.mma and not mma:  # K 7-8: the split dot kernel
        cfg = split_fallback(cfg)
    bm = 16 * exl3_mma.row_blocks(cfg, m) if mma else min(cfg.block_m, max(16, _pow2(m))) if cfg.dot else 1
    if layout is None:  # in_had: each program transforms its own slice of the raw x
        if xh is not None:
            raise ValueError(f"a pre-transformed x for {cfg}, whose main kernel transforms x itself")
        x, stride_xp, stride_xm = x2, 0, x2.stride(0)
    else:
        x = xh if xh is not None else fast_input_transform(f, x2, *layout)
        stride_xp, stride_xm = (layout[1] or m) * f.padded_in, f.padded_in
    steps, blocks_n, blocks_m = triton.cdiv(ti, cfg.tk), tj // cfg.tn, triton.cdiv(m, bm)
    want = triton.cdiv(cfg.programs_per_sm * _num_sms(x2.device), blocks_n * blocks_m)
    per = triton.cdiv(steps, max(1, min(steps, want)))
    splits = triton.cdiv(steps, per)
    out = torch.empty(splits, m, f.padded_out, dtype=torch.float32, device=x2.device)
    if mma:
        exl3_mma.mma_partials(f, x, m, cfg, splits, per, stride_xp, stride_xm, out, _use_asm(cfg.asm, f.codebook), y)
        return out
    if _row_applies(f, cfg):
        from trellm.kernels import exl3_row

        exl3_row.row_partials(f, x, cfg, splits, per, stride_xp, out, _use_asm(cfg.asm, f.codebook), y)
        return out
    consts = dict(K=f.bits, CB=CODEBOOK_IDS[f.codebook], G=GROUP[f.bits], TK=cfg.tk, TN=cfg.tn, BM=bm, DOT=cfg.dot,
                  EVEN_K=ti % cfg.tk == 0, ASM=_use_asm(cfg.asm, f.codebook), num_warps=cfg.warps,
                  num_stages=cfg.stages)
    if cfg.split or cfg.row:  # row where G != 8: the split kernel, as FastConfig.row says
        _split_kernel[(blocks_n, splits, blocks_m)](
            x, f.trellis.view(torch.int32), f.tile_part, out, m, ti, _tile_stride(f.trellis), f.padded_out, per,
            stride_xp, stride_xm, **consts, **pdl_kwargs(gpu_checked=False))
        return out
    _fast_kernel[(blocks_n, splits, blocks_m)](
        x, f.suh, f.had, f.trellis.view(torch.int32), f.tile_part, out, m, ti, _tile_stride(f.trellis),
        f.padded_out, f.in_features, per, stride_xp, stride_xm, f.suh.stride(0), IN_HAD=layout is None, **consts,
        **pdl_kwargs(gpu_checked=False))
    return out


def fast_output_transform(f: EXL3Fused, partials: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[S, M, sum out_p] -> [M, out_features]: per part ``had_r_128(sum) * svh (+ bias)``."""
    splits, m, n_p = partials.shape
    out = torch.empty(m, f.out_features, dtype=dtype, device=partials.device)
    bias = f.bias if f.bias is not None else f.svh
    _out_kernel[(triton.cdiv(m, 16), n_p // HAD_SIZE)](
        partials, f.svh, bias, f.dest, f.ncols, out, m, n_p, splits, out.stride(0), BM=16,
        HAS_BIAS=f.bias is not None, num_warps=8, **pdl_kwargs(gpu_checked=False))
    return out


def choose_config(m: int, d: FastDispatch | None = None, bits: int | None = None) -> FastConfig:
    """``FastDispatch.config_for`` of the dispatch in use (or ``d``)."""
    return (d or get_dispatch()).config_for(m, bits)


def fast_matmul(f: EXL3Fused, x: torch.Tensor, cfg: FastConfig | None = None,
                dispatch: FastDispatch | None = None) -> torch.Tensor:
    """``y = x @ W (+ bias)`` of all the fused parts, concatenated: x [..., in_features] ->
    [..., out_features] in x.dtype. ``cfg`` forces a variant (benchmarks, tests)."""
    d = dispatch or get_dispatch()
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1 or x2.stride(0) != x2.shape[1]:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if m == 0:
        return x.new_empty(*x.shape[:-1], f.out_features)
    if cfg is None and m >= d.reconstruct_min_rows:
        return fast_prefill(f, x2, d.reconstruct_cols, x.dtype).reshape(*x.shape[:-1], f.out_features)
    cfg = cfg or choose_config(m, d, f.bits)
    return fast_linear(f, cfg, x2, None, x.dtype).reshape(*x.shape[:-1], f.out_features)


def fast_linear(f: EXL3Fused, cfg: FastConfig, x2: torch.Tensor, xh: torch.Tensor | None,
                dtype: torch.dtype) -> torch.Tensor:
    """[M, out_features] in dtype: the main kernel, the output transform in it where it can
    (``_can_fuse``), else after it; ``xh`` as fast_partials'."""
    m = x2.shape[0]
    if _can_fuse(f, cfg, m):
        y = torch.empty(m, f.out_features, dtype=dtype, device=x2.device)
        fast_partials(f, x2, cfg, y, xh=xh)
        return y
    return fast_output_transform(f, fast_partials(f, x2, cfg, xh=xh), dtype)


def _mma_applies(f: EXL3Fused, cfg: FastConfig) -> bool:
    """exl3_mma runs where its config asks for it and a group's 8 weights lie in a word pair
    (K <= 4) or in three words (K 5-6, the usual 6-bit LM head: exl3_mma._wide)."""
    return cfg.mma and (GROUP[f.bits] == 8 or f.bits in MMA_WIDE_BITS)


def _row_applies(f: EXL3Fused, cfg: FastConfig) -> bool:
    """exl3_row runs a row config where a group's 8 weights share a word pair (else: split)."""
    return cfg.row and not cfg.dot and not cfg.mma and GROUP[f.bits] == 8


def _can_fuse(f: EXL3Fused, cfg: FastConfig, m: int) -> bool:
    """Whether the main kernel runs the output transform itself (``fuse_out``): exl3_mma
    (its counters: a row of them per row-block program) or exl3_row (one row)."""
    from trellm.kernels import exl3_mma

    if _mma_applies(f, cfg):
        return exl3_mma.can_fuse(f, cfg, m)
    return _row_applies(f, cfg) and cfg.fuse_out and m == 1 and f.counters is not None


def fast_prefill(f: EXL3Fused, x2: torch.Tensor, max_cols: int, dtype: torch.dtype) -> torch.Tensor:
    """Prefill (many rows): Wq decoded by the matrix-order kernel in column slices for
    cuBLAS, both transforms as fp16 GEMMs (``trellm/kernels/exl3_prefill.py``)."""
    return prefill_matmul(f, x2, max_cols, dtype, lambda w, cols: fast_reconstruct(w, cols=cols))


def fast_reconstruct(w: EXL3Weight | EXL3Fused, tk: int = 4, tn: int = 8, asm: bool = True,
                     cols: tuple[int, int] | None = None) -> torch.Tensor:
    """Wq (decoded trellis, rotated basis) as fp16 [in_p, out_p] through the matrix-order
    decode; ``cols``: only tile columns [c0, c1) (c1 - c0 a multiple of tn, or the end)."""
    ti, tj, _ = w.trellis.shape
    c0, c1 = cols or (0, tj)
    while (c1 - c0) % tn:
        tn //= 2
    trellis = w.trellis[:, c0:c1]
    k = kernel_bits(w) if isinstance(w, EXL3Weight) else w.bits
    out = torch.empty(ti * 16, (c1 - c0) * 16, dtype=torch.float16, device=w.trellis.device)
    _fast_reconstruct_kernel[((c1 - c0) // tn, triton.cdiv(ti, tk))](
        trellis.view(torch.int32), out, ti, _tile_stride(trellis), out.stride(0), K=k,
        CB=CODEBOOK_IDS[w.codebook], G=GROUP[k], TK=tk, TN=tn, ASM=_use_asm(asm, w.codebook))
    return out


# ---- registration with the EXL3 linear method ---------------------------------------------------

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True, eq=False)
class FusedLayer:
    """A layer's parts as fused groups (usually one: all of q/k/v or gate/up share K)."""

    groups: tuple[EXL3Fused | EXL3Weight, ...]
    in_features: int

    @property
    def parts(self) -> list[EXL3Weight]:
        return [p for g in self.groups for p in (g.parts if isinstance(g, EXL3Fused) else (g,))]


def prepare_layer(parts: list[EXL3Weight], force: bool = False) -> FusedLayer | None:
    """At load time: fuse a layer's parts when they live on CUDA and Triton runs there
    (``force``: on any device, for the interpreter tests)."""
    if not force and not (parts[0].trellis.is_cuda and _cuda_kernels()):
        return None
    if not any(kernel_bits(p) is not None for p in parts):
        return None
    return FusedLayer(tuple(fuse_groups(parts)), parts[0].in_features)


def layer_supports(layer: FusedLayer, x: torch.Tensor) -> bool:
    """Asked per forward: cheap checks only."""
    return x.is_cuda and x.dtype in _DTYPES and x.shape[-1] == layer.in_features


def run_layer(layer: FusedLayer, x: torch.Tensor) -> torch.Tensor:
    from trellm.quant.exl3.method import select_kernel

    ys = [fast_matmul(g, x) if isinstance(g, EXL3Fused) else select_kernel(g, x)(g, x) for g in layer.groups]
    return ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)


_CUDA_OK: dict[str, bool] = {}


def _cuda_kernels() -> bool:
    if "ok" not in _CUDA_OK:
        from trellm.kernels import kernel_supported

        _CUDA_OK["ok"] = kernel_supported("cuda")
    return _CUDA_OK["ok"]


def register() -> None:
    """Put the fused-layer kernels in front of the per-part ones (exl3_gemv.register)."""
    from trellm.quant.exl3.method import EXL3LayerKernel, register_layer_kernel, unregister_layer_kernel

    unregister_layer_kernel("triton-fast")
    from trellm.kernels import exl3_prologue as pro

    register_layer_kernel(EXL3LayerKernel("triton-fast", prepare_layer, layer_supports, run_layer,
                                          run_norm=pro.run_layer_norm, run_glu=pro.run_layer_glu,
                                          input_transform=pro.layer_input_transform,
                                          run_transformed=pro.run_layer_transformed))
