"""EXL3 in Triton, part 1: the trellis decode (shared by every EXL3 kernel), the
reconstruct kernel, and the two Hadamard-128 transforms on the activations.

Format: quant-spec §1 and trellm/quant/exl3/reference.py (the oracle). Tile (i, j) of
the int16 trellis [in_p/16, out_p/16, 16K] is read here as 8K int32 words (a free
view: a little-endian int16 pair *is* the uint32 word the spec reads), a ring of
256K bits, MSB first. Weight t's 16-bit state is ring bits [(t+1)K - 16, (t+1)K).

Decoding in registers, integer K only (half-integer K stays on the reference):
cut a tile's 256 weights (sequence order t) into 8 groups of 32, g = t // 32 and
i = t % 32. Group g's 32 windows lie in its own K words plus the word before it
(cyclically), at offsets that depend on i and K alone. So a kernel loads, per tile,
8 x (K + 1) words (``_group_words``) and then, for each i in a static loop of 32,
extracts one state per group with *compile-time* shifts (``_decode``), maps it
through the codebook arithmetic (3INST / MCG / MUL1 exactly as the
spec, one fp16 rounding of the exact value) and gets a [tiles..., 8] block of values.
Those 8 values of one i sit in one tile row and 8 consecutive columns: t = 32g + i
is lane 4g + i // 8, element i % 8 of the mma B-fragment layout, so

    row = 2 (i // 8) + (i % 2) + 8 ((i // 2) % 2),   column = g + 8 ((i % 8) // 4)

(``ROW``/``COL8`` below). Loads are (K + 1) / 32 per weight and coalesce within a
tile; all index arithmetic but the tile base is constant.

Transforms (cheap: they touch the activations only): ``exl3_input_transform`` is
``had_r_128(pad(x) * suh)``, ``exl3_output_transform`` sums split-K partials, then
``had_r_128(y') * svh (+ bias)``. The 128x128 sign matrix is generated in the
kernel (parity of popcount(i & j)), so no constant table ever crosses to the device.
"""
from __future__ import annotations

import math

import torch

from trellm.kernels._triton import tl, triton, pdl_begin, pdl_kwargs
from trellm.quant.exl3.hadamard import HAD_SIZE, had_r_128
from trellm.quant.exl3.reference import decode_inner
from trellm.quant.exl3.weight import EXL3Weight

CODEBOOK_IDS = {"3inst": 0, "mcg": 1, "mul1": 2}
"""The ``CB`` constexpr of the kernels."""
MUL1_K_INV = 0.00676727294921875  # fp16 0x1EEE, exact in float32
MUL1_K_BIAS = -10.3828125  # fp16 0xC931
_HAD_SCALE = 1.0 / math.sqrt(HAD_SIZE)
_TRANSFORM_ROWS = 16
"""Rows per program of the transform kernels (tl.dot needs 16)."""
_TRANSFORM_WARPS = 8
"""The sign matrix is 128 x 128 float32 in registers: spread it over 256 threads."""
# The transforms' dot is input_precision="tf32x3" (a literal in each kernel: a module-level
# tl.constexpr would need Triton at import time): three TF32 tensor-core products. The
# +-1 matrix is exact in TF32, so this is x split into two TF32 halves (~22 significant bits) times exact signs. The
# fp32 "ieee" dot it replaces ran on FMAs, and for the input transforms ptxas (sm_90,
# Triton 3.6) held it in 32 registers with ~1,100 local-memory spills per program (SASS
# compiled on the CPU); tf32x3 compiles to half the instructions and no spills.


def kernel_bits(w: EXL3Weight) -> int | None:
    """K as the kernels take it, or None where they do not apply (half-integer K)."""
    return int(w.bits) if float(w.bits).is_integer() and 1 <= w.bits <= 8 else None


def trellis_words(w: EXL3Weight) -> torch.Tensor:
    """int32 [in_p/16, out_p/16, 8K]: a view of the int16 trellis, no copy."""
    return w.trellis.view(torch.int32)


def tile_stride(w: EXL3Weight) -> int:
    """Tiles from one tile row of the trellis to the next: out_p/16, or more where the
    trellis is a column slice of a merged layer's (exl3_fast.fuse keeps the parts as views)."""
    return w.trellis.stride(0) // w.trellis.shape[2]


# ---- decode helpers (jit) ----------------------------------------------------------------

@triton.jit
def _group_words(w_ptr, tile, mask, K: tl.constexpr):
    """For tiles whose first words are at int64 offsets ``tile`` [A, B] (``mask`` [A, B]):
    each of the 8 groups' preceding word (cyclic: group 0 takes the tile's last) and its
    K words, as uint32 [A, B, 8]. Words past K repeat ``prev`` (never picked)."""
    RING: tl.constexpr = 8 * K
    g = tl.arange(0, 8)
    base = w_ptr + tile[:, :, None] + (g * K)[None, None, :]
    m = mask[:, :, None]
    prev = tl.load(w_ptr + tile[:, :, None] + ((g * K + RING - 1) % RING)[None, None, :], mask=m, other=0)
    prev = prev.to(tl.uint32, bitcast=True)
    w0 = tl.load(base, mask=m, other=0).to(tl.uint32, bitcast=True)
    w1 = prev
    w2 = prev
    w3 = prev
    w4 = prev
    w5 = prev
    w6 = prev
    w7 = prev
    if K > 1:
        w1 = tl.load(base + 1, mask=m, other=0).to(tl.uint32, bitcast=True)
    if K > 2:
        w2 = tl.load(base + 2, mask=m, other=0).to(tl.uint32, bitcast=True)
    if K > 3:
        w3 = tl.load(base + 3, mask=m, other=0).to(tl.uint32, bitcast=True)
    if K > 4:
        w4 = tl.load(base + 4, mask=m, other=0).to(tl.uint32, bitcast=True)
    if K > 5:
        w5 = tl.load(base + 5, mask=m, other=0).to(tl.uint32, bitcast=True)
    if K > 6:
        w6 = tl.load(base + 6, mask=m, other=0).to(tl.uint32, bitcast=True)
    if K > 7:
        w7 = tl.load(base + 7, mask=m, other=0).to(tl.uint32, bitcast=True)
    return prev, w0, w1, w2, w3, w4, w5, w6, w7


@triton.jit
def _decode(I: tl.constexpr, K: tl.constexpr, CB: tl.constexpr, prev, w0, w1, w2, w3, w4, w5, w6, w7):
    """fp16 values of weight I of every group of the loaded tiles. One function, not
    three: Triton's interpreter pays for every nested jit call, and this runs 32 times a step.

    State: ring bits [START, START + 16) relative to the group's first word, START =
    (I + 1) K - 16 (>= -15: at worst it starts in the word before), from words D and
    D + 1 (-1 = ``prev``) with compile-time shifts. Codebook: quant-spec §1.4, products
    mod 2^32, one fp16 rounding of the exact value (bit-exact with ExLlamaV3)."""
    START: tl.constexpr = (I + 1) * K - 16
    # Floor division of a possibly negative constexpr, spelled without negative operands.
    D: tl.constexpr = (START + 32) // 32 - 1
    OFF: tl.constexpr = START - 32 * D
    a = prev
    b = w0
    if D == 0:
        a = w0
        b = w1
    if D == 1:
        a = w1
        b = w2
    if D == 2:
        a = w2
        b = w3
    if D == 3:
        a = w3
        b = w4
    if D == 4:
        a = w4
        b = w5
    if D == 5:
        a = w5
        b = w6
    if D == 6:
        a = w6
        b = w7
    if D == 7:
        a = w7
    if OFF <= 16:
        s = (a >> (16 - OFF)) & 0xFFFF
    else:
        s = ((a << (OFF - 16)) | (b >> (48 - OFF))) & 0xFFFF
    # No int -> float conversions (a quarter-rate pipe on the GPU): values are built as
    # fp16 bit patterns. 3INST/MCG add their two fp16 halves in fp16 (the exact sum,
    # rounded once); MUL1's 1024 + B is the fp16 with bits 0x6400 + B (B < 1024), and
    # its affine map is exact in float32 before the one rounding to fp16.
    if CB == 2:  # mul1: the byte sum of s * 0x83DCD12D, then an affine map
        x = s * 0x83DCD12D
        pairs = (x & 0x00FF00FF) + ((x >> 8) & 0x00FF00FF)  # two 16-bit sums of two bytes
        total = (pairs + (pairs << 16)) >> 16  # their sum, in the top half (no carry: < 2^16)
        h = (total + 0x6400).to(tl.uint16).to(tl.float16, bitcast=True)
        v = (h.to(tl.float32) * 0.00676727294921875 - 10.3828125).to(tl.float16)
    else:  # 3inst / mcg: the masked word's two fp16 halves, summed
        v = _inst_value(s, CB)
    return v


@triton.jit
def _inst_value(s, CB: tl.constexpr):
    """3INST (CB 0) / MCG (CB 1): 16-bit states -> fp16, the masked LCG word's two fp16
    halves summed in fp16 (exact sum, one rounding); shared with exl3_fast."""
    if CB == 0:
        x = s * 89226354 + 64248484
    else:
        x = s * 0xCBAC1FED
    x = (x & 0x8FFF8FFF) ^ 0x3B603B60
    lo = x.to(tl.uint16).to(tl.float16, bitcast=True)
    hi = (x >> 16).to(tl.uint16).to(tl.float16, bitcast=True)
    return lo + hi


# ---- reconstruct --------------------------------------------------------------------------

@triton.jit
def _reconstruct_kernel(w_ptr, out_ptr, TI, TJ, tj0, n_tiles, stride_o,
                        K: tl.constexpr, CB: tl.constexpr, TK: tl.constexpr, TN: tl.constexpr):
    """Wq[:, 16 tj0 : 16 (tj0 + n_tiles)] as fp16, row-major: one program per TK x TN tiles
    (TJ: tiles from one tile row to the next, for addressing; more than the trellis' tile
    columns when it is a view of a merged layer's, exl3_fast.fuse)."""
    tk = tl.program_id(1) * TK + tl.arange(0, TK)
    tn = tl.program_id(0) * TN + tl.arange(0, TN)  # relative to tj0
    mask = (tk[:, None] < TI) & (tn[None, :] < n_tiles)
    tile = (tk[:, None].to(tl.int64) * TJ + tj0 + tn[None, :]) * (8 * K)
    prev, w0, w1, w2, w3, w4, w5, w6, w7 = _group_words(w_ptr, tile, mask, K)
    g = tl.arange(0, 8)
    m3 = mask[:, :, None]
    for i in tl.static_range(32):
        ROW = 2 * (i // 8) + (i % 2) + 8 * ((i // 2) % 2)
        COL8 = 8 * ((i % 8) // 4)
        v = _decode(i, K, CB, prev, w0, w1, w2, w3, w4, w5, w6, w7)
        rows = tk.to(tl.int64) * 16 + ROW
        cols = tn * 16 + COL8
        ptrs = out_ptr + rows[:, None, None] * stride_o + cols[None, :, None] + g[None, None, :]
        tl.store(ptrs, v, mask=m3)


def exl3_reconstruct(w: EXL3Weight, col_tiles: tuple[int, int] | None = None,
                     out: torch.Tensor | None = None, block=None) -> torch.Tensor:
    """Wq (the decoded trellis, rotated basis) as fp16 [in_p, out_p], or only the output
    tiles [start, stop) of ``col_tiles`` (16 columns each), into ``out`` if given.
    ``block``: an exl3_gemv.BlockConfig (tiles per program; default 4 x 8)."""
    k = _integer_bits(w)
    ti, tj_all, _ = w.trellis.shape
    t0, t1 = col_tiles or (0, tj_all)
    cols = (t1 - t0) * 16
    if out is None:
        out = torch.empty(ti * 16, cols, dtype=torch.float16, device=w.trellis.device)
    if tuple(out.shape) != (ti * 16, cols) or out.dtype != torch.float16 or out.stride(1) != 1:
        raise ValueError(f"out must be fp16 [{ti * 16}, {cols}] with unit column stride")
    tk_blk, tn_blk, warps = (block.tk, block.tn, block.warps) if block is not None else (4, 8, 4)
    grid = (triton.cdiv(t1 - t0, tn_blk), triton.cdiv(ti, tk_blk))
    _reconstruct_kernel[grid](trellis_words(w), out, ti, tile_stride(w), t0, t1 - t0, out.stride(0),
                              K=k, CB=CODEBOOK_IDS[w.codebook], TK=tk_blk, TN=tn_blk, num_warps=warps)
    return out


def exl3_reconstruct_ref(w: EXL3Weight, col_tiles: tuple[int, int] | None = None) -> torch.Tensor:
    t0, t1 = col_tiles or (0, w.trellis.shape[1])
    return decode_inner(w)[:, t0 * 16:t1 * 16].half()


def _integer_bits(w: EXL3Weight) -> int:
    k = kernel_bits(w)
    if k is None:
        raise ValueError(f"the EXL3 kernels take integer K in 1..8, not {w.bits} (use the reference)")
    return k


# ---- Hadamard transforms --------------------------------------------------------------------

@triton.jit
def _hadamard_signs():
    """The 128x128 Sylvester matrix (+-1, float32): (-1)^popcount(i & j)."""
    idx = tl.arange(0, 128)
    v = idx[:, None] & idx[None, :]
    v = v ^ (v >> 4)
    v = v ^ (v >> 2)
    v = v ^ (v >> 1)
    return 1.0 - 2.0 * (v & 1).to(tl.float32)


@triton.jit
def _fwht128(v, BM: tl.constexpr):
    """v [BM, 128] times the 128 x 128 Sylvester matrix (unscaled): seven constant-geometry
    butterflies; each takes (j, j + 64) to (2 j, 2 j + 1) = (sum, difference), so index bit
    6 is transformed and rotated to bit 0, and after seven every bit is, in place."""
    for _ in tl.static_range(7):
        a, b = tl.split(tl.permute(tl.reshape(v, (BM, 2, 64)), 0, 2, 1))
        v = tl.reshape(tl.join(a + b, a - b), (BM, 128))
    return v


@triton.jit(do_not_specialize=["M"])
def _input_transform_kernel(x_ptr, suh_ptr, out_ptr, M, n_in, stride_x, stride_o, BM: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * 128 + tl.arange(0, 128)
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + cols[None, :],
                mask=(rows[:, None] < M) & (cols[None, :] < n_in), other=0.0).to(tl.float32)
    x = x * tl.load(suh_ptr + cols).to(tl.float32)[None, :]
    y = tl.dot(x, _hadamard_signs(), input_precision="tf32x3") * 0.08838834764831845
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_o + cols[None, :], y.to(out_ptr.dtype.element_ty),
             mask=rows[:, None] < M)


def exl3_input_transform(w: EXL3Weight, x2: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x2 [M, in_features] -> ``had_r_128(pad(x2) * suh)`` [M, in_p] in ``dtype``."""
    m = x2.shape[0]
    out = torch.empty(m, w.padded_in, dtype=dtype, device=x2.device)
    if m:
        grid = (triton.cdiv(m, _TRANSFORM_ROWS), w.padded_in // HAD_SIZE)
        _input_transform_kernel[grid](x2, w.suh, out, m, w.in_features, x2.stride(0), out.stride(0),
                                      BM=_TRANSFORM_ROWS, num_warps=_TRANSFORM_WARPS)
    return out


def exl3_input_transform_ref(w: EXL3Weight, x2: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    xf = torch.nn.functional.pad(x2.float(), (0, w.padded_in - w.in_features))
    return had_r_128(xf * w.suh.float()).to(dtype)


@triton.jit(do_not_specialize=["M", "splits"])
def _output_transform_kernel(p_ptr, svh_ptr, bias_ptr, out_ptr, M, n_out, out_p, splits, stride_s, stride_o,
                             BM: tl.constexpr, HAS_BIAS: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * 128 + tl.arange(0, 128)
    rmask = rows[:, None] < M
    offs = rows[:, None].to(tl.int64) * out_p + cols[None, :]
    acc = tl.zeros((BM, 128), tl.float32)
    for s in range(splits):
        acc += tl.load(p_ptr + s * stride_s + offs, mask=rmask, other=0.0).to(tl.float32)
    y = tl.dot(acc, _hadamard_signs(), input_precision="tf32x3") * 0.08838834764831845
    cmask = cols < n_out
    y = y * tl.load(svh_ptr + cols).to(tl.float32)[None, :]
    if HAS_BIAS:
        y = y + tl.load(bias_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_o + cols[None, :], y.to(out_ptr.dtype.element_ty),
             mask=rmask & cmask[None, :])


def exl3_output_transform(w: EXL3Weight, partials: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """partials [S, M, out_p] (split-K sums of ``xh @ Wq``, any float dtype) ->
    ``(had_r_128(sum) * svh)[:, :out_features] (+ bias)`` [M, out_features] in ``dtype``."""
    splits, m, out_p = partials.shape
    out = torch.empty(m, w.out_features, dtype=dtype, device=partials.device)
    if m:
        grid = (triton.cdiv(m, _TRANSFORM_ROWS), out_p // HAD_SIZE)
        bias = w.bias if w.bias is not None else w.svh
        _output_transform_kernel[grid](partials, w.svh, bias, out, m, w.out_features, out_p, splits,
                                       partials.stride(0), out.stride(0), BM=_TRANSFORM_ROWS,
                                       HAS_BIAS=w.bias is not None, num_warps=_TRANSFORM_WARPS)
    return out


def exl3_output_transform_ref(w: EXL3Weight, partials: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    y = had_r_128(partials.float().sum(0)) * w.svh.float()
    y = y[:, : w.out_features]
    if w.bias is not None:
        y = y + w.bias.float()
    return y.to(dtype)


# ---- the same for all parts of a merged layer at once (exl3_fast.EXL3Fused) ---------------------

@triton.jit(do_not_specialize=["M", "n_in", "rows_p"])
def _in_kernel(x_ptr, suh_ptr, out_ptr, M, n_in, in_p, stride_x, rows_p, BM: tl.constexpr, FRAG: tl.constexpr = False,
               FWHT: tl.constexpr = False, PDL: tl.constexpr = False):
    """out[part, m, :] = had_r_128(pad(x[m]) * suh[part]) for rows_p rows a part (M, or with
    FRAG a multiple of 16: rows past M zero, every 16 x 128 block stored in mma A-fragment
    order, ``_frag_offsets``; BM 16). Grid: (row blocks, in_p / 128, parts). ``FWHT``: the
    Hadamard by butterflies in registers (``_fwht128``) instead of a tf32x3 dot against the
    128 x 128 sign matrix, which each program builds and stages through 64 KB of shared
    memory: at decode's few rows that staging is most of the kernel."""
    pdl_begin(PDL)
    part = tl.program_id(2)
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * 128 + tl.arange(0, 128)
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + cols[None, :],
                mask=(rows[:, None] < M) & (cols[None, :] < n_in), other=0.0).to(tl.float32)
    x = x * tl.load(suh_ptr + part * in_p + cols).to(tl.float32)[None, :]
    if FWHT:
        y = _fwht128(x, BM) * 0.08838834764831845
    else:
        y = tl.dot(x, _hadamard_signs(), input_precision="tf32x3") * 0.08838834764831845
    out = out_ptr + (part * rows_p).to(tl.int64) * in_p
    if FRAG:
        tl.store(out + _frag_offsets(tl.program_id(0), tl.program_id(1), in_p), y.to(out_ptr.dtype.element_ty))
    else:
        out += rows[:, None].to(tl.int64) * in_p + cols[None, :]
        tl.store(out, y.to(out_ptr.dtype.element_ty), mask=rows[:, None] < M)


@triton.jit
def _frag_offsets(rb, cb, in_p):
    """Element offsets [16, 128] of rows 16 rb.. and columns 128 cb.. of x in mma A-fragment
    order: x[16 rb + 8 h + g, 16 tk + 2 (4 q + t) + i] (fp16; word 4 q + t of the tile row)
    goes to word ((rb TI + tk) 4 + h + 2 q) 32 + 4 g + t, half i (TI = in_p / 16 tile rows):
    register a0..a3 (h + 2 q) of lane 4 g + t, so a warp reads each register as 128
    contiguous bytes (exl3_mma's FRAG loads)."""
    return _frag_elems(16 * rb + tl.arange(0, 16)[:, None], tl.arange(0, 128)[None, :], cb, in_p)


@triton.jit
def _frag_elems(row, c, cb, in_p):
    """``_frag_offsets``' element offsets for rows ``row`` and columns ``c`` (< 128) of 128-column
    block cb, any shapes that broadcast (exl3_prologue stores one row at a time)."""
    r = row % 16
    wd = (c % 16) // 2
    word = (((row // 16) * (in_p // 16) + cb * 8 + c // 16) * 4 + r // 8 + 2 * (wd // 4)) * 32 + 4 * (r % 8) + wd % 4
    return word.to(tl.int64) * 2 + c % 2


def fragment_order_ref(x: torch.Tensor) -> torch.Tensor:
    """x [rows (a multiple of 16), in_p] -> the same values in _frag_offsets' order, flat."""
    rows, in_p = x.shape
    v = x.reshape(rows // 16, 2, 8, in_p // 16, 2, 4, 2)  # rb, h, g, tk, q, t, i
    return v.permute(0, 3, 4, 1, 2, 5, 6).reshape(-1)  # rb, tk, q, h, g, t, i


@triton.jit(do_not_specialize=["M", "splits"])
def _out_kernel(p_ptr, svh_ptr, bias_ptr, dest_ptr, ncols_ptr, out_ptr, M, NP, splits, stride_o,
                BM: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr = False):
    """Sum the splits, Hadamard, * svh, + bias, and write 128-column block b's first
    ncols[b] columns at output column dest[b]. Grid: (row blocks, NP / 128)."""
    pdl_begin(PDL)
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    blk = tl.program_id(1)
    j = tl.arange(0, 128)
    rmask = rows[:, None] < M
    offs = rows[:, None].to(tl.int64) * NP + blk * 128 + j[None, :]
    acc = tl.zeros((BM, 128), tl.float32)
    for s in range(splits):
        acc += tl.load(p_ptr + s * M * NP + offs, mask=rmask, other=0.0)
    y = tl.dot(acc, _hadamard_signs(), input_precision="tf32x3") * 0.08838834764831845
    y = y * tl.load(svh_ptr + blk * 128 + j).to(tl.float32)[None, :]
    dest = tl.load(dest_ptr + blk) + j
    cmask = j < tl.load(ncols_ptr + blk)
    if HAS_BIAS:
        y = y + tl.load(bias_ptr + dest, mask=cmask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_o + dest[None, :], y.to(out_ptr.dtype.element_ty),
             mask=rmask & cmask[None, :])
