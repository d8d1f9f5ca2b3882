"""EXL3 in Triton, part 5: tensor-core mma on trellis values decoded in registers (1-32 rows).

Why: the one-row kernels (exl3_row, exl3_fast's split FMA) spend one FMA per weight and
per activation row, and their cost grows with the rows; the dot kernels reorder the
decoded values into Triton's dot layout through shared memory, which for 2-32 rows made
a Llama-3.1-8B layer 3-4x slower than one row (H100, docs/benchmarks/gpu/README.md).

EXL3's tile layout *is* mma's: weight J of group e of a 16 x 16 tile sits at tile row
8 ((J // 2) % 2) + 2 (e % 4) + J % 2, column 8 (J // 4) + e // 4, which is element J of
lane e's B fragments for the two m16n8k16 halves (columns 0-7: J < 4, 8-15: J >= 4). So
each lane decodes its own 8 weights, packs them as fp16 pairs and issues ``mma.sync``
itself (inline PTX): no shuffle, no shared memory, no FMA per weight. Every tensor is
[32, WARPS, TN] with axis 0 on the warp's 32 lanes: Triton 3.6 gives the mma operands
the layout threadsPerWarp [32, 1, 1], warpsPerCTA [1, WARPS, 1] (seen in the TTGIR
compiled for sm_90); the GPU tests, which compare with the reference decoder, fail on
any other lane mapping. A program covers TN tile columns and WARPS tile rows at a
time, TK // WARPS times per K step. One m16n8k16 takes 16 activation rows for the cost of one: 1..16 rows decode
once; more rows take more programs (grid axis 2).

MUL1 (``AFF``): lane e packs H = 1024 + B (B: the byte sum of s M) as fp16 with one
dp4a onto 0x6400 (exact: 1024 <= H < 2048 has unit ulp). The weight is
k_inv H + k_bias exactly, so y = k_inv (x . H) + k_bias sum(x), and sum(x) comes from one
more mma per tile row against a B of ones. Like exl3_row's AFF, the weights are not
rounded to fp16 (within half an fp16 ulp of the reference's). Other codebooks (and
``AFF`` off) pack the reference's fp16 values, bit-exact weights.

K = 4 extracts two states per 32-bit shift: windows J and J + 4 are 16 bits apart.
K = 5-6 (the usual 6-bit LM head): a group's windows span 7 K + 16 <= 58 bits, which can
cross into a third word; each lane loads three and aligns the 64 bits from its first
window (``_wide``), then extracts with constant shifts (7.0 SASS instructions a weight at
one row against the split kernel's 9.95). K 7-8 (65 and 72 bits) take the split kernel.

SASS (sm_90, K = 4, MUL1, TK 8 x TN 4, 4 warps, compiled on the CPU): 349 loop
instructions per 64 weights a thread (5.45 a weight; 338 with 16 live rows), 72
registers, against exl3_row's affine loop at 399 (6.2) for one row and 80 registers.
Per weight: 1 multiply, 1 dp4a, 1.4 shift / mask, 0.5 pack, 0.28 mma, 0.3 loads.

In Triton's interpreter (no PTX) the mma is emulated on whole tensors by the fragment
definitions of the PTX ISA (``_mma_emul``): the CPU tests check the decode, the
packing and the fragment bookkeeping; the GPU tests check the hardware's agreement.
"""
from __future__ import annotations

import os

import torch

from trellm.kernels._triton import tl, triton, pdl_begin, pdl_kwargs
from trellm.kernels.exl3_decode import CODEBOOK_IDS, _fwht128
from trellm.kernels.exl3_fast import _byte_sum, _weight

K_INV = tl.constexpr(0.00676727294921875)  # fp16 0x1EEE
K_BIAS = tl.constexpr(-10.3828125)  # fp16 0xC931
ONES = tl.constexpr(0x3C003C00)  # two fp16 1.0


@triton.jit
def _halves(r):
    """uint32 of two fp16 -> (low, high) as float32."""
    lo = (r & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = (r >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def _frag(r0, r1, WARPS: tl.constexpr, TN: tl.constexpr):
    """Two fragment registers of every lane -> float32 [8 (g), 4 (t), WARPS, TN, 2 (i), 2 (r1?)]:
    element (g, t, ., ., i, h) is r_h's half i at lane 4 g + t."""
    l0, h0 = _halves(r0)
    l1, h1 = _halves(r1)
    v = tl.join(tl.join(l0, h0), tl.join(l1, h1))  # [32, WARPS, TN, 2, 2]
    return tl.reshape(v, (8, 4, WARPS, TN, 2, 2))


@triton.jit
def _mma_rows(a_lo, a_hi, bf, c0, c1, WARPS: tl.constexpr, TN: tl.constexpr):
    """8 rows of C += A B (rows g of A: registers a_lo (k = 2t + i) and a_hi (k = 8 + 2t + i))."""
    af = _frag(a_lo, a_hi, WARPS, TN)
    prod = tl.expand_dims(af, 1) * tl.expand_dims(bf, 0)  # [8 (g), 8 (n), 4 (t), W, TN, 2, 2]
    cm = tl.sum(tl.sum(tl.sum(prod, 6), 5), 2)  # [8 (g), 8 (n = 2t' + i'), W, TN]
    cm = tl.permute(tl.reshape(cm, (8, 4, 2, WARPS, TN)), 0, 1, 3, 4, 2)
    d0, d1 = tl.split(cm)
    return c0 + tl.reshape(d0, (32, WARPS, TN)), c1 + tl.reshape(d1, (32, WARPS, TN))


@triton.jit
def _mma_emul(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, WARPS: tl.constexpr, TN: tl.constexpr):
    """mma.m16n8k16 (f16 in, f32 accumulate) by the PTX ISA's fragment layouts, on whole
    [32, WARPS, TN] tensors (lane = axis 0, g = lane // 4, t = lane % 4): A rows g / g + 8
    are a0, a2 / a1, a3; B column g is b0 (k = 2t + i) and b1 (k = 8 + 2t + i); C row g
    holds c0, c1 at columns 2t + i, row g + 8 holds c2, c3. The interpreter's stand-in."""
    z = tl.zeros((32, WARPS, TN), tl.uint32)
    bf = _frag(b0 + z, b1 + z, WARPS, TN)
    c0, c1 = _mma_rows(a0 + z, a2 + z, bf, c0, c1, WARPS, TN)
    c2, c3 = _mma_rows(a1 + z, a3 + z, bf, c2, c3, WARPS, TN)
    return c0, c1, c2, c3


@triton.jit
def _mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, PTX: tl.constexpr, WARPS: tl.constexpr, TN: tl.constexpr):
    if PTX:
        return tl.inline_asm_elementwise(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {$0, $1, $2, $3}, {$4, $5, $6, $7}, "
            "{$8, $9}, {$10, $11, $12, $13};",
            "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", [a0, a1, a2, a3, b0, b1, c0, c1, c2, c3],
            dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)
    return _mma_emul(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, WARPS, TN)


@triton.jit
def _states(p, sh, K: tl.constexpr):
    """The 8 16-bit states (uint32) of every group, J = 0..7."""
    if K == 4:  # windows J and J + 4 are 16 bits apart: one shift gives both
        u0 = (p >> (sh - 16)).to(tl.uint32)
        u1 = (p >> (sh - 20)).to(tl.uint32)
        u2 = (p >> (sh - 24)).to(tl.uint32)
        u3 = (p >> (sh - 28)).to(tl.uint32)
        return u0 >> 16, u1 >> 16, u2 >> 16, u3 >> 16, u0 & 0xFFFF, u1 & 0xFFFF, u2 & 0xFFFF, u3 & 0xFFFF
    return (_state(p, sh, 0, K), _state(p, sh, 1, K), _state(p, sh, 2, K), _state(p, sh, 3, K),
            _state(p, sh, 4, K), _state(p, sh, 5, K), _state(p, sh, 6, K), _state(p, sh, 7, K))


@triton.jit
def _state(p, sh, J: tl.constexpr, K: tl.constexpr):
    return ((p >> (sh - J * K)) & 0xFFFF).to(tl.uint32)


@triton.jit
def _pack_h(sa, sb, ASM: tl.constexpr):
    """MUL1: fp16 pair (1024 + B(sa), 1024 + B(sb)), B = byte sum of s * 0x83DCD12D (exact)."""
    lo = _byte_sum(sa * 0x83DCD12D, 1, 0x64006400, ASM)
    hi = _byte_sum(sb * 0x83DCD12D, 1, 0, ASM)
    return lo + (hi << 16)


@triton.jit
def _pack_v(p, sh, Ja: tl.constexpr, Jb: tl.constexpr, K: tl.constexpr, CB: tl.constexpr, ASM: tl.constexpr):
    """The reference's fp16 values of weights Ja, Jb as one pair (bit-exact weights)."""
    va = _weight(p, sh, Ja, K, CB, ASM).to(tl.uint16, bitcast=True).to(tl.uint32)
    vb = _weight(p, sh, Jb, K, CB, ASM).to(tl.uint16, bitcast=True).to(tl.uint32)
    return va | (vb << 16)


@triton.jit
def _b_regs(p, sh, K: tl.constexpr, CB: tl.constexpr, ASM: tl.constexpr, AFF: tl.constexpr):
    """Lane e's B registers: (J 0-1, J 2-3) for columns 0-7, (J 4-5, J 6-7) for 8-15."""
    if AFF:
        s0, s1, s2, s3, s4, s5, s6, s7 = _states(p, sh, K)
        return _pack_h(s0, s1, ASM), _pack_h(s2, s3, ASM), _pack_h(s4, s5, ASM), _pack_h(s6, s7, ASM)
    return (_pack_v(p, sh, 0, 1, K, CB, ASM), _pack_v(p, sh, 2, 3, K, CB, ASM),
            _pack_v(p, sh, 4, 5, K, CB, ASM), _pack_v(p, sh, 6, 7, K, CB, ASM))


@triton.jit
def _word_pointers(w_ptr, pid_n, TJS, K: tl.constexpr, TN: tl.constexpr, WARPS: tl.constexpr):
    """Per lane and warp the pointers to its group's words (a pair; K 5-6 three, ``_wide``)
    in the first tile row of the block (step offsets are added per step); tile column tn is
    a constant offset (``tno``, an LDG immediate); ``sh`` brings the group's first window
    down from the 64-bit pair (K 5-6: the window's bit offset in the first word)."""
    RING: tl.constexpr = 256 * K
    e = tl.arange(0, 32)[:, None, None]
    w = tl.arange(0, WARPS)[None, :, None]
    tn = tl.arange(0, TN)[None, None, :]
    start = ((8 * e + 1) * K + (RING - 16)) % RING  # first window of each group, ring bits
    word = start // 32
    row0 = (w * TJS + pid_n * TN) * (8 * K)
    if K > 4:
        sh = (start % 32).to(tl.uint64)
    else:
        sh = (48 - start % 32).to(tl.uint64)
    return (w_ptr + row0 + word, w_ptr + row0 + (word + 1) % (8 * K), w_ptr + row0 + (word + 2) % (8 * K),
            tn * (8 * K), sh)


@triton.jit(do_not_specialize=["M", "per_split"])
def _mma_kernel(x_ptr, w_ptr, tile_part_ptr, out_ptr, M, TI, TJS, NP, per_split, stride_xp, stride_xm,
                y_ptr, svh_ptr, bias_ptr, dest_ptr, ncols_ptr, counter_ptr, stride_y,
                K: tl.constexpr, CB: tl.constexpr, TK: tl.constexpr, TN: tl.constexpr, WARPS: tl.constexpr,
                ROWS16: tl.constexpr, MB: tl.constexpr, EVEN_K: tl.constexpr, ASM: tl.constexpr,
                AFF: tl.constexpr, PTX: tl.constexpr, FUSE: tl.constexpr, HAS_BIAS: tl.constexpr,
                PF: tl.constexpr, FRAG: tl.constexpr = False, PDL: tl.constexpr = False):
    """out[split, m, block] = xh[m, the split's K rows] @ Wq[those rows, block] (float32) for
    16 MB rows m per program (MB 1 or 2 row blocks sharing each decode; ``ROWS16`` False:
    only the first 8 can be live). x: the part's transformed x as int32 words (fp16
    pairs); strides in words. Grid: (column blocks of 16 TN, splits, row blocks of 16 MB).
    ``FUSE``: the last program to finish a 128-column block also runs the output transform
    for it (``_arrive_and_finish``) into y, so no output-transform launch follows. ``PF`` > 0:
    the K loop software-pipelined, loading PF steps ahead (``_pf_loop``). ``FRAG``: x in
    A-fragment order (exl3_decode._frag_offsets; stride_xm unused), whole row blocks."""
    pdl_begin(PDL)
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    x_ptr += tl.load(tile_part_ptr + pid_n * TN) * stride_xp
    pa, pb, pc, tno, sh = _word_pointers(w_ptr, pid_n, TJS, K, TN, WARPS)
    e = tl.arange(0, 32)[:, None, None]
    w = tl.arange(0, WARPS)[None, :, None]
    m = tl.program_id(2) * (16 * MB) + e // 4  # [32, 1, 1]: lane's A row g (and g + 8; + 16 with MB 2)
    if FRAG:  # the lane's a0 word of tile row 0 of its row block
        xrow = x_ptr + (tl.program_id(2) * MB).to(tl.int64) * TI * 128 + e
    else:
        xrow = x_ptr + m.to(tl.int64) * stride_xm + e % 4  # word 8 tk + t of row g
    zero = tl.zeros((32, WARPS, 1), tl.uint32)
    ones = zero + ONES
    lo = pid_s * per_split
    if PF:  # step + PF's loads issued before this step's decode
        acc, xs = _pf_loop(pa, pb, pc, tno, sh, xrow, m, M, w, TI, TJS, stride_xm, lo, per_split, zero, ones,
                           K, CB, TK, TN, WARPS, ROWS16, MB, EVEN_K, ASM, AFF, PTX, PF, FRAG)
    else:
        acc, xs = _k_loop(pa, pb, pc, tno, sh, xrow, m, M, w, TI, TJS, stride_xm, lo, per_split, zero, ones,
                          K, CB, TK, TN, WARPS, ROWS16, MB, EVEN_K, ASM, AFF, PTX, FRAG)
    acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, acc8, acc9, acc10, acc11, acc12, acc13, acc14, acc15 = acc
    xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7 = xs
    _store(out_ptr, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, xs0, xs2, m, M, NP, pid_n, pid_s,
           TN, ROWS16, AFF)
    if MB == 2:
        _store(out_ptr, acc8, acc9, acc10, acc11, acc12, acc13, acc14, acc15, xs4, xs6, m + 16, M, NP, pid_n,
               pid_s, TN, True, AFF)
    if FUSE:
        blk = pid_n * TN * 16 // 128
        _arrive_and_finish(out_ptr, y_ptr, svh_ptr, bias_ptr, dest_ptr, ncols_ptr,
                           counter_ptr + tl.program_id(2) * (NP // 128) + blk, tl.program_id(2) * (16 * MB),
                           blk, M, NP, stride_y, tl.num_programs(1) * (128 // (16 * TN)), tl.num_programs(1),
                           16 * MB if ROWS16 else 8, HAS_BIAS)


@triton.jit
def _k_loop(pa, pb, pc, tno, sh, xrow, m, M, w, TI, TJS, stride_xm, lo, per_split, zero, ones, K: tl.constexpr,
            CB: tl.constexpr, TK: tl.constexpr, TN: tl.constexpr, WARPS: tl.constexpr, ROWS16: tl.constexpr,
            MB: tl.constexpr, EVEN_K: tl.constexpr, ASM: tl.constexpr, AFF: tl.constexpr, PTX: tl.constexpr,
            FRAG: tl.constexpr):
    """_mma_kernel's K loop: per K step and slice of WARPS tile rows, its loads (``_pf_load``),
    then its decode and mmas (``_pf_mma``). Returns (the 16 C tensors: columns 0-7 rows g
    (0, 1) and g + 8 (2, 3), columns 8-15 (4-7), MB 2's second row block (8-15); the 8 x
    sums of AFF: rows g (0), g + 8 (2), MB 2's (4, 6))."""
    z = tl.zeros((32, WARPS, TN), tl.float32)
    zs = tl.zeros((32, WARPS, 1), tl.float32)
    acc = (z, z, z, z, z, z, z, z, z, z, z, z, z, z, z, z)
    xs = (zs, zs, zs, zs, zs, zs, zs, zs)
    # The step's word and x pointers advance by a constant stride (carried, one 64-bit add
    # each a step) instead of being recomputed from the step index: the 64-bit multiplies
    # were ~13% of the loop's instructions (scripts/sass_stats.py, sm_90).
    row_words = TJS.to(tl.int64) * (8 * K)
    pa_s = pa + lo.to(tl.int64) * (TK * row_words)
    pb_s = pb + lo.to(tl.int64) * (TK * row_words)
    pc_s = pc + lo.to(tl.int64) * (TK * row_words)
    XT: tl.constexpr = 128 if FRAG else 8  # x words from one tile row to the next
    xp_s = xrow + XT * (w + lo * TK)
    for step in range(lo, tl.minimum(lo + per_split, tl.cdiv(TI, TK))):
        for i in tl.static_range(TK // WARPS):
            so = (i * WARPS) * row_words
            ld = _slice_load(pa_s + so, pb_s + so, pc_s + so, tno, xp_s + XT * i * WARPS, step * TK + i * WARPS + w, m, M, TI,
                             stride_xm, zero, K, ROWS16, MB, EVEN_K, FRAG)
            acc, xs = _pf_mma(ld, acc, xs, sh, ones, K, CB, TN, WARPS, MB, ASM, AFF, PTX)
        pa_s += TK * row_words
        pb_s += TK * row_words
        pc_s += TK * row_words
        xp_s += XT * TK
    return acc, xs


@triton.jit
def _pf_loop(pa, pb, pc, tno, sh, xrow, m, M, w, TI, TJS, stride_xm, lo, per_split, zero, ones, K: tl.constexpr,
             CB: tl.constexpr, TK: tl.constexpr, TN: tl.constexpr, WARPS: tl.constexpr, ROWS16: tl.constexpr,
             MB: tl.constexpr, EVEN_K: tl.constexpr, ASM: tl.constexpr, AFF: tl.constexpr, PTX: tl.constexpr,
             PF: tl.constexpr, FRAG: tl.constexpr):
    """_mma_kernel's K loop, software-pipelined: the word pairs and A fragments of step + PF
    (PF 1 or 2 steps ahead) are loaded (``_pf_step``) before step's are decoded and mma'd
    (``_pf_mma``), carried through the loop as a tuple of PF steps of one tuple per slice
    (any TK // WARPS). Past the split's last step the prefetch is clamped to it (a redundant
    load, never out of bounds). ptxas (sm_90) sinks the loads below the step's mmas, to the
    loop's end: with PF 1 they land just before their use, with PF 2 a step ahead of it.
    Returns (the 16 C tensors, the 8 x sums)."""
    hi = tl.minimum(lo + per_split, tl.cdiv(TI, TK))
    z = tl.zeros((32, WARPS, TN), tl.float32)
    zs = tl.zeros((32, WARPS, 1), tl.float32)
    acc = (z, z, z, z, z, z, z, z, z, z, z, z, z, z, z, z)
    xs = (zs, zs, zs, zs, zs, zs, zs, zs)
    pipe = ()
    for d in tl.static_range(PF):
        pipe = pipe + (_pf_step(pa, pb, pc, tno, xrow, m, M, w, TI, TJS, stride_xm, tl.minimum(lo + d, hi - 1), zero,
                                K, TK, WARPS, ROWS16, MB, EVEN_K, FRAG),)
    for step in range(lo, hi):
        new = _pf_step(pa, pb, pc, tno, xrow, m, M, w, TI, TJS, stride_xm, tl.minimum(step + PF, hi - 1), zero,
                       K, TK, WARPS, ROWS16, MB, EVEN_K, FRAG)
        for i in tl.static_range(TK // WARPS):
            acc, xs = _pf_mma(pipe[0][i], acc, xs, sh, ones, K, CB, TN, WARPS, MB, ASM, AFF, PTX)
        pipe = pipe[1:] + (new,)
    return acc, xs


@triton.jit
def _pf_step(pa, pb, pc, tno, xrow, m, M, w, TI, TJS, stride_xm, step, zero, K: tl.constexpr, TK: tl.constexpr,
             WARPS: tl.constexpr, ROWS16: tl.constexpr, MB: tl.constexpr, EVEN_K: tl.constexpr, FRAG: tl.constexpr):
    """Every slice's loads of K step ``step`` (``_pf_load``), one tuple per slice."""
    ld = ()
    for i in tl.static_range(TK // WARPS):
        ld = ld + (_pf_load(pa, pb, pc, tno, xrow, m, M, w, TI, TJS, stride_xm, step, i, zero,
                            K, TK, WARPS, ROWS16, MB, EVEN_K, FRAG),)
    return ld


@triton.jit
def _pf_load(pa, pb, pc, tno, xrow, m, M, w, TI, TJS, stride_xm, step, i: tl.constexpr, zero, K: tl.constexpr,
             TK: tl.constexpr, WARPS: tl.constexpr, ROWS16: tl.constexpr, MB: tl.constexpr, EVEN_K: tl.constexpr,
             FRAG: tl.constexpr):
    """Slice i of K step ``step``: its word pair and A fragments (MB 2: and rows 16-31's, else
    zero), the loads and masks of _mma_kernel's loop body."""
    tr = step * TK + i * WARPS  # first tile row of this slice
    so = tr.to(tl.int64) * TJS * (8 * K)
    tk = tr + w  # [1, WARPS, 1]
    XT: tl.constexpr = 128 if FRAG else 8
    return _slice_load(pa + so, pb + so, pc + so, tno, xrow + XT * tk, tk, m, M, TI, stride_xm, zero, K, ROWS16, MB,
                       EVEN_K, FRAG)


@triton.jit
def _slice_load(pa_r, pb_r, pc_r, tno, xp, tk, m, M, TI, stride_xm, zero, K: tl.constexpr, ROWS16: tl.constexpr,
                MB: tl.constexpr, EVEN_K: tl.constexpr, FRAG: tl.constexpr):
    """_pf_load's loads once its pointers are placed: the word pair at pa_r / pb_r (+ tno, per
    tile column), the A fragments at xp (x row g's word of tile row tk; FRAG: the lane's a0
    word of it); tk masks the rows past the weight's unless EVEN_K. K 5-6: a third word
    (pc_r), else ``zero``."""
    a = _ld(pa_r + tno, tk < TI, EVEN_K)
    b = _ld(pb_r + tno, tk < TI, EVEN_K)
    c = zero
    if K > 4:
        c = _ld(pc_r + tno, tk < TI, EVEN_K)
    c0, c1, c2, c3 = zero, zero, zero, zero
    if FRAG:  # rows past M are zeros in x: only K's edge is masked
        a0, a1, a2, a3 = _a_frags_frag(xp, tk, TI, zero, ROWS16, EVEN_K)
        if MB == 2:  # rows 16-31: the next row block, TI tile rows further on
            c0, c1, c2, c3 = _a_frags_frag(xp + TI.to(tl.int64) * 128, tk, TI, zero, True, EVEN_K)
        return c, a, b, a0, a1, a2, a3, c0, c1, c2, c3
    xm0 = m < M
    if not EVEN_K:
        xm0 = xm0 & (tk < TI)
    a0, a1, a2, a3 = _a_frags(xp, xm0, m, M, stride_xm, ROWS16, zero)
    if MB == 2:  # rows 16-31
        c0, c1, c2, c3 = _a_frags(xp + 16 * stride_xm, xm0 & (m + 16 < M), m + 16, M, stride_xm, True, zero)
    return c, a, b, a0, a1, a2, a3, c0, c1, c2, c3


@triton.jit
def _a_frags_frag(xp, tk, TI, zero, ROWS16: tl.constexpr, EVEN_K: tl.constexpr):
    """_a_frags with x in fragment order: register r of every lane is the 32 consecutive
    words at xp + 32 r (a1 / a3, rows g + 8, zero unless ROWS16)."""
    a0 = _ld(xp, tk < TI, EVEN_K).to(tl.uint32, bitcast=True)
    a2 = _ld(xp + 64, tk < TI, EVEN_K).to(tl.uint32, bitcast=True)
    a1, a3 = zero, zero
    if ROWS16:
        a1 = _ld(xp + 32, tk < TI, EVEN_K).to(tl.uint32, bitcast=True)
        a3 = _ld(xp + 96, tk < TI, EVEN_K).to(tl.uint32, bitcast=True)
    return a0, a1, a2, a3


@triton.jit
def _ld(ptr, mask, EVEN_K: tl.constexpr):
    """An unmasked load where K is even, else masked with zeros."""
    if EVEN_K:
        v = tl.load(ptr)
    else:
        v = tl.load(ptr, mask=mask, other=0)
    return v


@triton.jit
def _pf_mma(ld, acc, xs, sh, ones, K: tl.constexpr, CB: tl.constexpr, TN: tl.constexpr, WARPS: tl.constexpr,
            MB: tl.constexpr, ASM: tl.constexpr, AFF: tl.constexpr, PTX: tl.constexpr):
    """One slice's decode and mmas on its loads ``ld`` (``_pf_load``): the rest of _mma_kernel's
    loop body. acc: its acc0..acc15, xs: its xs0..xs7; returns both updated."""
    w3, a, b, a0, a1, a2, a3, c0, c1, c2, c3 = ld
    p = (a.to(tl.uint32, bitcast=True).to(tl.uint64) << 32) | b.to(tl.uint32, bitcast=True).to(tl.uint64)
    if K > 4:  # the window aligned to the top of p: constant shifts from here on
        p = _wide(p, w3, sh)
        sh = tl.full(sh.shape, 48, tl.uint64)
    b01, b23, b45, b67 = _b_regs(p, sh, K, CB, ASM, AFF)
    d0, d1, d2, d3 = _mma(a0, a1, a2, a3, b01, b23, acc[0], acc[1], acc[2], acc[3], PTX, WARPS, TN)
    d4, d5, d6, d7 = _mma(a0, a1, a2, a3, b45, b67, acc[4], acc[5], acc[6], acc[7], PTX, WARPS, TN)
    s0, s1, s2, s3, s4, s5, s6, s7 = xs
    if AFF:  # without ROWS16, a1 = a3 = 0
        s0, s1, s2, s3 = _mma(a0, a1, a2, a3, ones, ones, s0, s1, s2, s3, PTX, WARPS, 1)
    d8, d9, d10, d11 = acc[8], acc[9], acc[10], acc[11]
    d12, d13, d14, d15 = acc[12], acc[13], acc[14], acc[15]
    if MB == 2:  # rows 16-31: the same B registers
        d8, d9, d10, d11 = _mma(c0, c1, c2, c3, b01, b23, d8, d9, d10, d11, PTX, WARPS, TN)
        d12, d13, d14, d15 = _mma(c0, c1, c2, c3, b45, b67, d12, d13, d14, d15, PTX, WARPS, TN)
        if AFF:
            s4, s5, s6, s7 = _mma(c0, c1, c2, c3, ones, ones, s4, s5, s6, s7, PTX, WARPS, 1)
    return (d0, d1, d2, d3, d4, d5, d6, d7, d8, d9, d10, d11, d12, d13, d14, d15), (s0, s1, s2, s3, s4, s5, s6, s7)


@triton.jit
def _wide(p, w3, off):
    """K 5-6: a group's 8 windows span 7 K + 16 <= 58 bits from bit ``off`` (< 32) of its
    first word, so within its three words (p: the first two, w3: the third): the 64 bits
    from there as one uint64, the first window's top bit at bit 63."""
    third = w3.to(tl.uint32, bitcast=True).to(tl.uint64)
    return (p << off) | ((third << off) >> 32)


@triton.jit
def _arrive_and_finish(part_ptr, y_ptr, svh_ptr, bias_ptr, dest_ptr, ncols_ptr, counter, row0, blk, M, NP,
                       stride_y, n_used, splits, BM: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Count this program in on its 128-column block; the last of ``n_used`` arrivals sums
    the splits (in split order: deterministic), applies exl3_decode._out_kernel's transform
    (Hadamard, / sqrt(128), * svh, + bias) and writes the block's real columns; then sets
    the counter back to 0. The pattern of paged_attention._arrive_and_combine: a CTA
    barrier, one acq_rel atomic at GPU scope, the partials read through L2 (.cg)."""
    tl.debug_barrier()
    arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    if arrived == n_used - 1:
        j = tl.arange(0, 128)
        scale = tl.load(svh_ptr + blk * 128 + j).to(tl.float32) * 0.08838834764831845
        dest = tl.load(dest_ptr + blk) + j
        cmask = j < tl.load(ncols_ptr + blk)
        for r in tl.static_range(BM // 8):  # 8 rows at a time: few registers on top of the main loop's
            rows = row0 + 8 * r + tl.arange(0, 8)
            rmask = (rows < M)[:, None]
            offs = rows[:, None].to(tl.int64) * NP + blk * 128 + j[None, :]
            acc = tl.zeros((8, 128), tl.float32)
            for s in range(splits):
                acc += tl.load(part_ptr + s * M * NP + offs, mask=rmask, other=0.0, cache_modifier=".cg")
            y = _fwht128(acc, 8) * scale[None, :]
            if HAS_BIAS:
                y = y + tl.load(bias_ptr + dest, mask=cmask, other=0.0).to(tl.float32)[None, :]
            tl.store(y_ptr + rows[:, None].to(tl.int64) * stride_y + dest[None, :], y.to(y_ptr.dtype.element_ty),
                     mask=rmask & cmask[None, :])
        tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")


@triton.jit
def _a_frags(xp, xm0, m, M, stride_xm, ROWS16: tl.constexpr, zero):
    """Lane (g, t)'s A registers for one tile row: x rows g (a0, a2) and g + 8 (a1, a3), words
    t and 4 + t of the tile row (``xp``: row g's word 8 tk + t); rows g + 8 zero unless ROWS16."""
    a0 = tl.load(xp, mask=xm0, other=0).to(tl.uint32, bitcast=True)
    a2 = tl.load(xp + 4, mask=xm0, other=0).to(tl.uint32, bitcast=True)
    if ROWS16:
        xm1 = xm0 & (m + 8 < M)
        a1 = tl.load(xp + 8 * stride_xm, mask=xm1, other=0).to(tl.uint32, bitcast=True)
        a3 = tl.load(xp + 8 * stride_xm + 4, mask=xm1, other=0).to(tl.uint32, bitcast=True)
    else:
        a1, a3 = zero, zero
    return a0, a1, a2, a3


@triton.jit
def _store_c(base, y, xs, row, col, M, NP, AFF: tl.constexpr):
    """One C register of every lane: y [32, WARPS, TN] summed over the warps' tile rows."""
    y = tl.sum(y, 1)
    if AFF:
        y = K_INV * y + K_BIAS * tl.reshape(tl.sum(xs, 1), (32, 1))
    tl.store(base + row.to(tl.int64) * NP + col, y, mask=row < M)


@triton.jit
def _store(out_ptr, a0, a1, a2, a3, a4, a5, a6, a7, xs0, xs2, m, M, NP, pid_n, pid_s, TN: tl.constexpr,
           ROWS16: tl.constexpr, AFF: tl.constexpr):
    """Lane (g, t)'s C fragments -> out[split, row g (a0, a1, a4, a5) or g + 8, column
    16 tn + 8 half + 2 t + i] (half 1: a4-a7)."""
    e = tl.arange(0, 32)[:, None]
    col = pid_n * TN * 16 + 16 * tl.arange(0, TN)[None, :] + 2 * (e % 4)
    row = tl.reshape(m, (32, 1))
    base = out_ptr + pid_s.to(tl.int64) * M * NP
    _store_c(base, a0, xs0, row, col, M, NP, AFF)
    _store_c(base, a1, xs0, row, col + 1, M, NP, AFF)
    _store_c(base, a4, xs0, row, col + 8, M, NP, AFF)
    _store_c(base, a5, xs0, row, col + 9, M, NP, AFF)
    if ROWS16:
        _store_c(base, a2, xs2, row + 8, col, M, NP, AFF)
        _store_c(base, a3, xs2, row + 8, col + 1, M, NP, AFF)
        _store_c(base, a6, xs2, row + 8, col + 8, M, NP, AFF)
        _store_c(base, a7, xs2, row + 8, col + 9, M, NP, AFF)


def mma_partials(f, x: torch.Tensor, m: int, cfg, splits: int, per: int, stride_xp: int, stride_xm: int,
                 out: torch.Tensor, asm: bool, y: torch.Tensor | None = None) -> None:
    """Launch over f (an EXL3Fused, K <= 6) with x the fp16 transformed activations
    [parts, m, in_p]; ``out`` [splits, m, padded_out] float32 partials. ``y`` [m,
    out_features]: also the output transform, fused (``can_fuse``)."""
    ti, tj, _ = f.trellis.shape
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    if f.bits > 6:  # 7 K + 16 > 64 bits of windows: _wide would drop some
        raise ValueError(f"exl3_mma takes K <= 6, not {f.bits}")
    if cfg.tk % cfg.warps:
        raise ValueError(f"mma needs warps to divide tk, got {cfg}")
    mb = row_blocks(cfg, m)
    fused = y is not None
    _mma_kernel[(tj // cfg.tn, splits, triton.cdiv(m, 16 * mb))](
        x.view(torch.int32), f.trellis.view(torch.int32), f.tile_part, out, m, ti, f.trellis.stride(0) // f.trellis.shape[2],
        f.padded_out, per, stride_xp // 2, stride_xm // 2,
        y if fused else out, f.svh, f.bias if f.bias is not None else f.svh, f.dest, f.ncols,
        f.counters if fused else f.tile_part, y.stride(0) if fused else 0,
        K=f.bits, CB=CODEBOOK_IDS[f.codebook], TK=cfg.tk, TN=cfg.tn, WARPS=cfg.warps, ROWS16=m > 8, MB=mb,
        EVEN_K=ti % cfg.tk == 0, ASM=asm, AFF=cfg.affine and f.codebook == "mul1", PTX=not interp,
        FUSE=fused, HAS_BIAS=f.bias is not None, PF=int(cfg.prefetch), FRAG=cfg.frag_x, num_warps=cfg.warps,
        num_stages=cfg.stages,
        **pdl_kwargs(gpu_checked=False))


def row_blocks(cfg, m: int) -> int:
    """16-row blocks per program: 2 with block_m >= 32 (and more than 16 rows)."""
    return 2 if cfg.block_m >= 32 and m > 16 else 1


def can_fuse(f, cfg, m: int) -> bool:
    """The fused output transform needs its counters: one row of them per row-block program."""
    return cfg.fuse_out and f.counters is not None and triton.cdiv(m, 16 * row_blocks(cfg, m)) <= f.counters.shape[0]
