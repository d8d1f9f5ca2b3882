"""EXL3 in Triton, part 4: one activation row (decode at batch 1), with coalesced loads.

Why: exl3_fast's split FMA kernel holds its word pairs as [(tk, q), (tn, c0)] tensors,
and Triton lays those out with a warp's 32 threads down the rows: one load instruction
then touches 8 tiles (8 cache lines, 16 bytes of each). On an H100 every variant of it
ran a Llama-3.1-8B layer in ~145-150 us whatever K, block shape, occupancy or prefetch
(docs/benchmarks/gpu/README.md, 2026-12-05): not bound by DRAM, nor by instruction issue.

Here every tensor is [32, TK, TN]: axis 0 is the 32 groups (mma lanes) of a tile.
Triton's coalescing pass orders a load's axes by the contiguity it can prove and breaks
ties by axis number, so axis 0 goes to the warp's 32 threads: a load reads one tile's
consecutive words (one or two lines); the warps split the tile rows (tk) and each
thread's registers run over tn, whose tiles share their activations. Groups of G = 8
weights (K <= 4, where one word pair holds all 8 windows; exl3_fast.GROUP); other K keep
the split kernel. Measured (H100, 2026-12-05): as fast as the split kernel, no faster, so
coalescing was not what bounds it either; an opt-in variant (FastConfig.row), not the default.

Group e of a tile holds sequence positions t = 8 e + J, J < 8: mma lane e, element J,
so its weight J sits at tile row 8 ((J // 2) % 2) + 2 (e % 4) + J % 2 and column
8 (J // 4) + e // 4 (exl3_fast's module docstring). Decode and codebook: exl3_fast's.

``AFF`` (MUL1 only; ``FastConfig.affine``): MUL1's value is affine in the byte sum B of
s M, w = k_inv B + c0 (c0 = 1024 k_inv + k_bias), rounded once to fp16. Skipping that
rounding, a weight costs shift, mask, multiply, one dp4a and one FMA: the dp4a sums the
bytes times 255 onto the float32 bits of 1.0, giving v = 1 + 255 B / 2^23 exactly
(255 * 1020 < 2^23), and acc = sum x v. Then y = s (acc - X) + c0 X with s = k_inv 2^23 / 255
and X = sum x over the split's rows (every column sums every row). The SASS of the
rounded path spends 8.6 instructions per weight (an F2FP pack, an HADD2 unpack and the
affine FFMA on top of these); this one ~5. The price: weights off their fp16 values by up
to half an fp16 ulp (relative ~2.4e-4, random), and acc carries the constant 1 of each v,
~64 times the B part, which costs ~6 of float32's 24 bits in the sums (measured in the
tests: within fp16's tolerance, like the dot variants).
"""
from __future__ import annotations

import torch

from trellm.kernels._triton import tl, triton, pdl_begin, pdl_kwargs
from trellm.kernels.exl3_decode import CODEBOOK_IDS
from trellm.kernels.exl3_fast import _byte_sum, _tile_stride, _weight
from trellm.kernels.exl3_mma import _arrive_and_finish

K_INV = 0.00676727294921875  # fp16 0x1EEE
C0 = tl.constexpr(1024 * K_INV - 10.3828125)  # 1024 k_inv + k_bias (fp16 0xC931) = -3.453125, exact
AFF_SCALE = tl.constexpr(K_INV * 8388608.0 / 255.0)


@triton.jit
def _affine_v(p, sh, J: tl.constexpr, K: tl.constexpr, ASM: tl.constexpr):
    """float32 1 + 255 B / 2^23 of weight J of each group (MUL1; B = byte sum of s M)."""
    x = ((p >> (sh - J * K)) & 0xFFFF).to(tl.uint32) * 0x83DCD12D
    f = _byte_sum(x, 255, 0x3F800000, ASM)  # the float32 bits of 1.0 + 255 B
    return f.to(tl.float32, bitcast=True)


@triton.jit
def _words(w_ptr, step, TI, TJS, offa, offb, tk, K: tl.constexpr, TK: tl.constexpr, EVEN_K: tl.constexpr):
    """Step ``step``'s word pairs (a, b) [32, TK, TN] (rows past TI: zeros)."""
    k0 = step * TK
    wp = w_ptr + k0.to(tl.int64) * TJS * (8 * K)
    if EVEN_K:
        return tl.load(wp + offa), tl.load(wp + offb)
    wmask = k0 + tk < TI
    return tl.load(wp + offa, mask=wmask, other=0), tl.load(wp + offb, mask=wmask, other=0)


@triton.jit(do_not_specialize=["per_split"])
def _row_kernel(x_ptr, w_ptr, tile_part_ptr, out_ptr, TI, TJS, NP, per_split, stride_xp,
                y_ptr, svh_ptr, bias_ptr, dest_ptr, ncols_ptr, counter_ptr,
                K: tl.constexpr, CB: tl.constexpr, TK: tl.constexpr, TN: tl.constexpr,
                EVEN_K: tl.constexpr, ASM: tl.constexpr, AFF: tl.constexpr, FUSE: tl.constexpr = False,
                HAS_BIAS: tl.constexpr = False, PREFETCH: tl.constexpr = False, PDL: tl.constexpr = False):
    """out[split, 0, block] = xh[the split's K rows] @ Wq[those rows, block] (float32), one row.
    Grid: (column blocks of 16 TN, splits). x: the part's transformed x, float32.
    ``FUSE``: as exl3_mma's, the last program to finish a 128-column block runs the output
    transform for it into y (exl3_mma._arrive_and_finish): the 8B decode graph's separate
    output-transform launches were 684 of its 4,367 us a token (H100, 2026-12-07).
    ``PREFETCH`` (FastConfig.prefetch): the next step's words load before this step's
    decode, so their latency overlaps it (Nsight Compute on the split one-row kernel:
    long_scoreboard, waiting on loads, was 35-41% of the stall samples)."""
    pdl_begin(PDL)
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    x_ptr += tl.load(tile_part_ptr + pid_n * TN) * stride_xp
    RING: tl.constexpr = 256 * K
    e = tl.arange(0, 32)[:, None, None]
    tk = tl.arange(0, TK)[None, :, None]
    tn = tl.arange(0, TN)[None, None, :]
    start = ((8 * e + 1) * K + (RING - 16)) % RING  # first window of each group, ring bits
    word = start // 32
    tile = (tk * TJS + pid_n * TN + tn) * (8 * K)
    offa = tile + word
    offb = tile + (word + 1) % (8 * K)
    sh = (48 - start % 32).to(tl.uint64)
    xrow = 16 * tk + 2 * (e % 4)  # [32, TK, 1]: a group's x row within its tile, less J's part
    acc0 = tl.zeros((32, TK, TN), tl.float32)  # columns with J < 4 (cc3 = 0)
    acc1 = tl.zeros((32, TK, TN), tl.float32)  # J >= 4: 8 columns to the right
    xsum = tl.zeros((TK * 16,), tl.float32)  # AFF: the split's x, summed per place in a step
    lo = pid_s * per_split
    hi = tl.minimum(lo + per_split, tl.cdiv(TI, TK))
    if PREFETCH:  # the first step's words; each step then loads the next one's before decoding
        a_n, b_n = _words(w_ptr, lo, TI, TJS, offa, offb, tk, K, TK, EVEN_K)
    for step in range(lo, hi):
        k0 = step * TK
        if PREFETCH:  # past the split's last step: that step again (in bounds, no mask)
            a, b = a_n, b_n
            a_n, b_n = _words(w_ptr, tl.minimum(step + 1, hi - 1), TI, TJS, offa, offb, tk, K, TK, EVEN_K)
        else:
            a, b = _words(w_ptr, step, TI, TJS, offa, offb, tk, K, TK, EVEN_K)
        p = (a.to(tl.uint32, bitcast=True).to(tl.uint64) << 32) | b.to(tl.uint32, bitcast=True).to(tl.uint64)
        if AFF:
            xr = k0 * 16 + tl.arange(0, TK * 16)
            xsum += tl.load(x_ptr + xr, mask=xr < TI * 16, other=0.0)
        for J in tl.static_range(8):
            if AFF:
                v = _affine_v(p, sh, J, K, ASM)
            else:
                v = _weight(p, sh, J, K, CB, ASM).to(tl.float32)
            rows = k0 * 16 + xrow + ((J % 2) + 8 * ((J // 2) % 2))
            if EVEN_K:
                xv = tl.load(x_ptr + rows)
            else:  # rows past the weight's: x is zero there (masked words decode to non-zeros)
                xv = tl.load(x_ptr + rows, mask=rows < TI * 16, other=0.0)
            if J >= 4:
                acc1 += xv * v
            else:
                acc0 += xv * v
    # Column 16 tn + 8 cc3 + c0 sums its tile rows (tk) and lanes' q = e % 4 (e = 4 c0 + q).
    y0 = tl.sum(tl.sum(tl.reshape(acc0, (8, 4, TK, TN)), 2), 1)  # [8 (c0), TN]
    y1 = tl.sum(tl.sum(tl.reshape(acc1, (8, 4, TK, TN)), 2), 1)
    if AFF:
        xt = tl.sum(xsum, 0)
        y0 = AFF_SCALE * (y0 - xt) + C0 * xt
        y1 = AFF_SCALE * (y1 - xt) + C0 * xt
    cols = pid_n * TN * 16 + 16 * tl.arange(0, TN)[None, :] + tl.arange(0, 8)[:, None]
    out = out_ptr + pid_s.to(tl.int64) * NP + cols
    tl.store(out, y0)
    tl.store(out + 8, y1)
    if FUSE:
        blk = pid_n * TN * 16 // 128
        _arrive_and_finish(out_ptr, y_ptr, svh_ptr, bias_ptr, dest_ptr, ncols_ptr, counter_ptr + blk, 0, blk, 1, NP, 0,
                           tl.num_programs(1) * (128 // (16 * TN)), tl.num_programs(1), 8, HAS_BIAS)


def row_partials(f, x: torch.Tensor, cfg, splits: int, per: int, stride_xp: int, out: torch.Tensor, asm: bool,
                 y: torch.Tensor | None = None) -> None:
    """Launch over f (an EXL3Fused, K <= 4) with x the float32 transformed activations [parts,
    1, in_p]; ``out`` [splits, 1, padded_out] float32 partials. ``y`` [1, out_features]: also
    the output transform, fused (``FUSE``; exl3_fast._can_fuse)."""
    ti, tj, _ = f.trellis.shape
    fused = y is not None
    _row_kernel[(tj // cfg.tn, splits)](
        x, f.trellis.view(torch.int32), f.tile_part, out, ti, _tile_stride(f.trellis), f.padded_out, per,
        stride_xp, y if fused else out, f.svh, f.bias if f.bias is not None else f.svh, f.dest, f.ncols,
        f.counters if fused else f.tile_part, K=f.bits, CB=CODEBOOK_IDS[f.codebook], TK=cfg.tk, TN=cfg.tn,
        EVEN_K=ti % cfg.tk == 0, ASM=asm, AFF=cfg.affine and f.codebook == "mul1", FUSE=fused,
        HAS_BIAS=f.bias is not None, PREFETCH=bool(cfg.prefetch), num_warps=cfg.warps, num_stages=cfg.stages, **pdl_kwargs(gpu_checked=False))
