"""EXL3 fused-layer kernel variants (``FastConfig``) and which one runs for how many rows
(``FastDispatch``): plain dataclasses, importable without Triton; exl3_fast re-exports them."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FastConfig:
    """One variant of the main kernel. BK = 16 tk input rows and BN = 16 tn output columns
    per step; tn in (1, 2, 4, 8) so a block never straddles two parts."""

    tk: int = 8
    tn: int = 4
    warps: int = 4
    stages: int = 1
    dot: bool = True
    """tl.dot on fp16 activations (rows padded to block_m >= 16); False: float32 FMAs, one row."""
    in_had: bool = False
    """Fuse the input Hadamard into the main kernel (dot only; 16 tk a multiple of 128)."""
    asm: bool = False
    """MUL1's byte sum as one dp4a (inline PTX: GPU only, not the interpreter)."""
    split: bool = False
    """Skip the reorder of the decoded values to matrix order: G dots / FMAs per step with
    gathered x rows instead (``_split_kernel``; not with in_had; dot needs tk >= 4, tn >= 2)."""
    row: bool = False
    """One row (FMA) only: exl3_row's coalesced kernel where G = 8 (K <= 4), else the split one."""
    affine: bool = False
    """With row, MUL1: weights not rounded to fp16 (exl3_row's AFF: ~5 instead of 8.6
    instructions per weight; fp16-class tolerance instead of bit-exact weights)."""
    mma: bool = False
    """exl3_mma's kernel (K <= 6; K 7-8 fall back to the split dot kernel): lanes decode
    their own mma B fragments, 1-16 rows for the decode of one; with affine (MUL1) the
    weights are 1024 + B in fp16 and the affine map is applied to the sums. block_m 32:
    two 16-row blocks share each decode."""
    fuse_out: bool = False
    """With mma or row (one row, K <= 4): the last program of each 128-column block runs the
    output transform (no output-transform launch)."""
    prefetch: int = 0
    """With row (exl3_row, any truthy value): the next step's words load before this step's
    decode. With mma: the next K step's weight words and x A-fragments are loaded before the
    current step is decoded (software-pipelined K loop, carried through it per slice).
    True or 1: one step ahead; 2: two steps ahead (ptxas sinks the loads to the loop's end,
    so only 2 keeps a whole step between load and use; more registers); 0 / False: off."""
    frag_x: bool = False
    """With mma: the input transform writes x in mma A-fragment order ([row block, tile row,
    register, lane] words, rows past M zero), so a warp's A loads are 128 contiguous bytes
    each instead of 8 rows' 16 bytes (one L1 wavefront instead of eight); no row masks."""
    programs_per_sm: int = 4
    block_m: int = 16
    """Rows per program for the dot (16..64; M above it takes several row blocks)."""


MMA_WIDE_BITS = (5, 6)
"""K where exl3_mma reads three words a group (7 K + 16 <= 64 bits of windows)."""


def split_fallback(cfg: FastConfig) -> FastConfig:
    """The split dot kernel in place of an mma config, for K it does not take."""
    return FastConfig(tk=cfg.tk, tn=max(cfg.tn, 2), asm=cfg.asm, split=True)


@dataclass(frozen=True)
class FastDispatch:
    """Which FastConfig runs for M rows. Defaults: the picks of scripts/gpu_exl3_sweep.py
    at the Llama-3.1-8B shapes, K=4 mul1 (docs/benchmarks/gpu/exl3-sweep-*.json): for one
    row the coalesced row kernel in its affine MUL1 mode (H100, 2026-12-06: 119 us a layer
    against 143 for the split fma kernel, the H200 pick before it; other codebooks and
    K > 4 take its exact paths); 2-32 rows exl3_mma with its fused output transform (H100,
    2026-12-06, exl3-sweep-h100-2026-12-06-mma*.json: 127 us a layer at 8 rows against 237
    for the split dot kernel before it, 259 at 32 against 553 for the fused-Hadamard dot
    kernel; K 7-8 fall back to the split dot kernel, K 5-6 too without ``wide_mma``); the
    dot kernel with the input Hadamard fused above 32 rows; cuBLAS on reconstructed
    weights from 256."""

    one_row: FastConfig | None = FastConfig(tk=8, tn=4, dot=False, asm=True, row=True, affine=True, fuse_out=True)
    """M == 1 (None: the gemv config). fuse_out: the 8B decode graph at 4.0 bpw spent 684 of
    its 4,367 us a token in the separate output-transform launches (H100, 2026-12-07,
    scripts/gpu_overhead.py --profile); fused, 108 against 120 us a layer and the engine
    233 against 214 tok/s (H100, gpu-exl3-engine-h100-2026-12-07-rowfuse-*.json)."""
    gemv: FastConfig = FastConfig(tk=8, tn=2, dot=False, asm=True, mma=True, affine=True, programs_per_sm=8,
                                  fuse_out=True, frag_x=True)
    """2-32 rows. frag_x: 249 against 277 us a layer at 32 rows, 126 against 129 at 8 (H100,
    2026-12-07 sweep, exl3-sweep-h100-2026-12-07-fx.json; with the row kernel's fuse_out,
    aggregate decode at 32 concurrent 3,350 against 3,076 tok/s)."""
    gemv_max_rows: int = 32
    wide_mma: bool = True
    """K 5-6 (the 6-bit LM head) take exl3_mma (three words a group): at one row the gemv
    config where it is mma, instead of one_row's split-kernel fallback (7.0 against 9.95
    SASS instructions a weight, sm_90, compiled on the CPU; not yet timed), and at 2-32 rows
    the gemv config itself instead of the split dot kernel. False: both as before."""
    in_fwht: bool = True
    """The input transform (exl3_decode._in_kernel) by butterflies in registers instead of a
    tf32x3 dot against the sign matrix, which each program builds and stages through 64 KB
    of shared memory. One row on one warp a 128-block: 200 SASS instructions, against
    1,832 on each of 8 warps; a 16-row block: 360 on each of 8 (sm_90). The 8B decode
    graph spent 548 of its 4,367 us a token in the input transforms (H100, 2026-12-07).
    Not yet timed. False: the dot, as before."""
    fuse_in: bool = True
    """With in_fwht, where the main kernel reads a transformed x (not in_had: 1-32 rows and
    their fallbacks): the transform runs in the launch before the linear, the RMSNorm before
    qkv / gate_up or the SiLU-and-mul before down, in plain rows or exl3_mma's fragment
    order (exl3_prologue), and at one row the decode attention before o_proj; not in a
    launch of its own. Not yet timed. False: a launch of its own, as before."""
    gemm: FastConfig = FastConfig(tk=8, tn=8, in_had=True, asm=True, block_m=32)
    reconstruct_min_rows: int = 256
    """M >= this: decode to fp16 (``fast_reconstruct``) + cuBLAS, per part."""
    reconstruct_cols: int = 16384
    """Output columns decoded per slice on that path (bounds its temporary)."""

    def config_for(self, m: int, bits: int | None = None) -> FastConfig:
        """The config for m rows of a K = ``bits`` weight. K 5-6 (the 6-bit head) take
        exl3_mma (three words a group) with ``wide_mma``, else as before it: one row the row
        config's split-kernel fallback, 2-32 rows the split dot kernel."""
        wide = bits in MMA_WIDE_BITS
        if m == 1 and self.one_row is not None:
            if wide and self.wide_mma and self.one_row.row and self.gemv.mma:
                return self.gemv  # the row kernel needs K <= 4 and would take the split one
            return self.one_row
        cfg = self.gemv if m <= self.gemv_max_rows else self.gemm
        if wide and cfg.mma and not self.wide_mma:
            return split_fallback(cfg)
        return cfg if cfg.dot or cfg.mma or m == 1 else FastConfig(**{**cfg.__dict__, "dot": True})
