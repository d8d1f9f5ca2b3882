"""The EXL3 Triton kernels (trellm/kernels/exl3_decode.py, exl3_gemv.py) against the
reference decoder: the decode bit-exact for every K and codebook, each matmul path
within ``testing.quant_tolerance``, rows 1/3/16/33, widths that are multiples of 128
but not of the kernels' blocks. Under the interpreter the block sizes are raised
(fewer programs, same code) except in the tests of the GPU's own block sizes."""
import dataclasses

import pytest
import torch

from trellm.kernels import exl3_gemv
from trellm.kernels import quant_testing as qt
from trellm.kernels.exl3_gemv import BlockConfig, Dispatch
from trellm.quant.exl3.codebook import CODEBOOKS
from trellm.quant.exl3.reference import forward_reference

pytestmark = pytest.mark.gpu

# 128 x 384: 8 x 24 tiles; TN = 16 and 32 leave a partial column block, the GEMM's TK = 16 a
# partial row block.
BIG = Dispatch(gemv=BlockConfig(tk=8, tn=16), gemm=BlockConfig(tk=16, tn=16),
               reconstruct=BlockConfig(tk=8, tn=32), reconstruct_cols=256)
ONE = Dispatch(gemv=BlockConfig(tk=8, tn=32), reconstruct=BlockConfig(tk=8, tn=32))
"""One program covers a 128 x 384 layer (a partial block of 32 tile columns)."""


def _ok(result):
    assert result.passed, str(result)


@pytest.mark.parametrize("codebook", CODEBOOKS)
@pytest.mark.parametrize("bits", range(1, 9))
def test_decode_and_gemv_every_k_and_codebook(bits, codebook, device):
    w = qt.exl3_weight(128, 384, bits, codebook, device, seed=10 * bits + CODEBOOKS.index(codebook))
    _ok(qt.check_exl3_reconstruct(w, block=ONE.reconstruct))
    _ok(qt.check_exl3_matmul(w, 1, torch.float32, "gemv", ONE, seed=bits))


@pytest.mark.parametrize("bits,codebook,rows,path", [
    (3, "3inst", 3, "gemv"),
    (4, "mul1", 16, "gemv"),
    (2, "mcg", 16, "gemm"),
    (6, "mul1", 33, "gemm"),
    (5, "3inst", 33, "reconstruct"),
])
def test_paths_over_rows(bits, codebook, rows, path, device):
    w = qt.exl3_weight(384, 256, bits, codebook, device, seed=rows, bias=True)
    _ok(qt.check_exl3_matmul(w, rows, torch.float32, path, BIG, seed=rows))


def test_gpu_block_sizes_on_odd_shapes(device):
    # The default (GPU) blocks: 128 inputs = 8 tile rows (the GEMM steps 16), 384 outputs =
    # 24 tile columns (3 GEMV / GEMM blocks of 8), reconstruct in column slices of 256.
    w = qt.exl3_weight(128, 384, 4, "mul1", device, seed=3, bias=True)
    d = Dispatch(reconstruct_cols=256)
    _ok(qt.check_exl3_matmul(w, 1, torch.float32, "gemv", d))
    _ok(qt.check_exl3_matmul(w, 16, torch.float32, "gemm", d))
    _ok(qt.check_exl3_matmul(w, 20, torch.float32, "reconstruct", d))
    _ok(qt.check_exl3_reconstruct(w, col_tiles=(3, 13)))


def test_gemm_several_row_blocks(device):
    w = qt.exl3_weight(128, 256, 3, "mcg", device, seed=7)
    x = torch.randn(40, 128, generator=torch.Generator().manual_seed(1)).to(device)
    xh = exl3_gemv.exl3_input_transform(w, x, torch.float16)
    part = exl3_gemv.exl3_gemm(w, xh, BIG.gemm, block_m=16)  # 3 row blocks, the last partial
    got = exl3_gemv.exl3_output_transform(w, part, torch.float32)
    want = forward_reference(w, x)
    torch.testing.assert_close(got, want, atol=4e-3, rtol=2e-3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_model_dtypes_and_leading_dims(dtype, device):
    # x [2, 3, in] in the model dtype, bias, unpadded widths: the layer's view of the kernel.
    w = qt.exl3_weight(200, 300, 4, "mul1", device, seed=5, bias=True)
    _ok(qt.check_exl3_matmul(w, (2, 3), dtype, "gemv", BIG))
    _ok(qt.check_exl3_matmul(w, (2, 9), dtype, "gemm", BIG))


def test_dispatch_by_rows():
    d = Dispatch(gemv_max_rows=4, reconstruct_min_rows=64)
    assert [exl3_gemv.choose_path(m, d) for m in (1, 4, 5, 63, 64, 1000)] == \
        ["gemv", "gemv", "gemm", "gemm", "reconstruct", "reconstruct"]
    # The GEMV holds at most 16 rows whatever the threshold says.
    assert exl3_gemv.choose_path(17, Dispatch(gemv_max_rows=64)) == "gemm"


def test_registered_for_cuda_only(device):
    from trellm.quant.exl3.method import select_kernel

    w = qt.exl3_weight(128, 128, 2, "mul1", device)
    x = torch.randn(1, 128, device=device)
    want = exl3_gemv.exl3_matmul if device.type == "cuda" else forward_reference
    assert select_kernel(w, x) is want
    half = qt.exl3_weight(128, 128, 2, "mul1", "cpu")
    assert not exl3_gemv.supports(half, x.cpu())


def test_layer_routes_each_part(device):
    # A merged layer through the method's hook, with the kernel admitted on this device
    # (the registered "triton" entry takes CUDA only): integer-K parts run the kernel, the
    # half-integer one falls back to the reference; outputs concatenate in order.
    from trellm.layers.linear import MergedLinear
    from trellm.quant.exl3 import method as exl3_method
    from trellm.quant.exl3.loading import random_exl3_tensors

    g = torch.Generator(device=device).manual_seed(0)
    layer = MergedLinear(128, [128, 32], False, exl3_method.EXL3LinearMethod(), torch.float32)
    layer.exl3_device = device
    for shard, (out_f, bits) in enumerate([(128, 3), (32, 2.5)]):
        for name, t in random_exl3_tensors("p", 128, out_f, bits, "mul1", g, device):
            layer.weight_loader(name.rsplit(".", 1)[1], t, shard)
    layer.method.process_after_loading(layer)
    calls = []

    def run(part, x):
        calls.append(part.bits)
        return exl3_gemv.exl3_matmul(part, x, dispatch=ONE)

    exl3_method.register_kernel(exl3_method.EXL3Kernel(
        "test", lambda part, x: exl3_gemv.kernel_bits(part) is not None, run))
    layer.exl3_layer_kernel = None  # on CUDA the fused-layer kernel would take the layer first
    try:
        x = torch.randn(2, 128, generator=g, device=device)
        got = layer(x)
    finally:
        exl3_method.unregister_kernel("test")
    assert calls == [3]
    want = torch.cat([forward_reference(p, x) for p in layer.exl3_parts], dim=-1)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


# ---- exl3_fast: matrix-order decode, fused parts ------------------------------------------------
#
# Tolerances: the decode is bit-exact (EXACT: fp16 bit patterns). The dot variants round the
# transformed activations to fp16 before the tensor-core product (as ExLlamaV3 and the GEMM
# path do), so they get ``quant_tolerance(dtype, True)`` (fp16's 4e-3 + 2e-3 |y| at least;
# measured max error ~1e-3 at |y| ~ 4 for 384 inputs); the one-row FMA variant keeps float32
# activations and float32 sums, so float32's 1e-4 (measured ~2e-6) — its only difference
# from the reference is the summation order.

from trellm.kernels import exl3_decode, exl3_fast  # noqa: E402
from trellm.kernels.exl3_fast import FastConfig  # noqa: E402
from trellm.kernels.testing import EXACT, compare, quant_tolerance  # noqa: E402

# 384 inputs = 24 tile rows: tk=16 leaves a partial last step (masked), tk=8 divides it.
# 256 outputs: tn=4 gives 4 column blocks, tn=8 two. The interpreter's 4 "SMs" make split-K.
# Every row count runs on both main kernels (_fast_kernel, and _split_kernel: split=True).
FAST_ROWS = [
    (1, FastConfig(tk=16, tn=8, dot=False)),  # FMA, uneven K
    (1, FastConfig(tk=8, tn=4, dot=False, split=True)),
    (1, FastConfig(tk=16, tn=4, dot=False, row=True)),  # exl3_row (G = 8: K <= 4), uneven K
    (1, FastConfig(tk=8, tn=2, dot=False, row=True)),
    (1, FastConfig(tk=16, tn=4, dot=False, row=True, affine=True)),  # MUL1 unrounded (others: exact path)
    (1, FastConfig(tk=8, tn=2, dot=False, row=True, affine=True, asm=True)),
    # fuse_out: the last program of each 128-column block runs the output transform (K > 4:
    # the split kernel, unfused); tn 8: one program a block per split, uneven K
    (1, FastConfig(tk=16, tn=4, dot=False, row=True, affine=True, asm=True, fuse_out=True)),
    (1, FastConfig(tk=16, tn=8, dot=False, row=True, fuse_out=True)),
    # prefetch: the next step's words loaded a step ahead (uneven K: the masked last step)
    (1, FastConfig(tk=16, tn=4, dot=False, row=True, affine=True, fuse_out=True, prefetch=1)),
    (1, FastConfig(tk=8, tn=2, dot=False, row=True, prefetch=1)),
    (3, FastConfig(tk=8, tn=4)),  # dot, 3 splits of one step
    (3, FastConfig(tk=8, tn=4, split=True)),
    (8, FastConfig(tk=8, tn=8, in_had=True)),  # input Hadamard fused
    (8, FastConfig(tk=16, tn=8, split=True)),
    (16, FastConfig(tk=16, tn=8, block_m=16)),  # uneven K
    (16, FastConfig(tk=8, tn=4, split=True, block_m=16)),
    (33, FastConfig(tk=16, tn=8, block_m=64, in_had=True)),  # one row block of 64, 256-wide Hadamard steps
    (33, FastConfig(tk=16, tn=8, block_m=64, split=True)),
]


def _check_fast(f, rows, cfg, dtype=torch.float32, seed=0, want_parts=None):
    x = torch.randn(rows, f.in_features, generator=torch.Generator().manual_seed(seed)).to(f.trellis.device)
    x = x.to(dtype)
    got = exl3_fast.fast_matmul(f, x, cfg)
    want = torch.cat([forward_reference(p, x.float()) for p in (want_parts or f.parts)], dim=-1).to(dtype)
    tol = quant_tolerance(dtype, cfg.dot or cfg.affine or cfg.mma)  # mma: fp16 activations
    _ok(compare(f"exl3_fast {cfg}", f"x={rows}", got, want, tol, dtype))


@pytest.mark.parametrize("codebook", CODEBOOKS)
@pytest.mark.parametrize("bits", range(1, 9))
def test_fast_every_k_codebook_and_rows(bits, codebook, device):
    w = qt.exl3_weight(384, 256, bits, codebook, device, seed=100 + 10 * bits + CODEBOOKS.index(codebook))
    got = exl3_fast.fast_reconstruct(w, tk=4, tn=8)
    _ok(compare("exl3_fast_reconstruct", str(bits), got, exl3_decode.exl3_reconstruct_ref(w).to(got.device),
                EXACT, torch.float16))
    f = exl3_fast.fuse([w])
    for rows, cfg in FAST_ROWS:
        _check_fast(f, rows, cfg, seed=rows)


# exl3_mma (K <= 6, K 5-6 in three words a group; K = 7 takes the split dot kernel): one row; 3 rows on an uneven last step
# (tk 16 of 24 tile rows) with bit-exact weights; 16 rows (rows g + 8 live) on 2 warps; 33 rows
# in three row blocks, 1 warp; 40 rows in two programs of 32 (two row blocks sharing a decode).
# fuse_out: the output transform run by the last program of each 128-column block.
MMA_ROWS = [
    (1, FastConfig(tk=8, tn=4, dot=False, mma=True, affine=True, asm=True)),
    (1, FastConfig(tk=8, tn=4, dot=False, mma=True, affine=True, fuse_out=True)),
    (16, FastConfig(tk=16, tn=8, warps=2, dot=False, mma=True, fuse_out=True)),
    (3, FastConfig(tk=16, tn=2, dot=False, mma=True)),
    (16, FastConfig(tk=8, tn=4, warps=2, dot=False, mma=True, affine=True)),
    (33, FastConfig(tk=4, tn=8, warps=1, dot=False, mma=True, affine=True)),
    (40, FastConfig(tk=8, tn=2, warps=2, dot=False, mma=True, affine=True, block_m=32)),
    (40, FastConfig(tk=8, tn=2, warps=2, dot=False, mma=True, affine=True, block_m=32, fuse_out=True)),
    # frag_x: x in A-fragment order (rows past M zero, no row masks)
    (1, FastConfig(tk=8, tn=4, dot=False, mma=True, affine=True, asm=True, frag_x=True)),
    (3, FastConfig(tk=16, tn=2, dot=False, mma=True, frag_x=True)),
    (16, FastConfig(tk=8, tn=4, warps=2, dot=False, mma=True, affine=True, frag_x=True)),
    (33, FastConfig(tk=4, tn=8, warps=1, dot=False, mma=True, affine=True, frag_x=True)),
    (40, FastConfig(tk=8, tn=2, warps=2, dot=False, mma=True, affine=True, block_m=32, fuse_out=True, frag_x=True)),
]


# prefetch (exl3_mma's software-pipelined K loop; the interpreter has 4 SMs, so programs_per_sm
# sets the steps a split runs, 24 tile rows here): 1 row affine over 3 steps of two slices; 8
# rows fused, splits of 2 and 1 steps; 16 rows exact, one slice, 3 splits of 2 steps; 3 rows on
# an uneven last step with 4 and (8 warps) 2 slices, its last slice all past K; 40 rows, two
# row blocks sharing each decode (4 slices of 2 warps); two steps ahead (prefetch=2) on 1 row
# over 3 steps and 3 rows over 2 uneven ones (both prologue loads, the second clamped).
MMA_PF_ROWS = [
    (1, FastConfig(tk=8, tn=4, dot=False, mma=True, affine=True, asm=True, programs_per_sm=1, prefetch=True)),
    (8, FastConfig(tk=8, tn=2, dot=False, mma=True, affine=True, fuse_out=True, prefetch=True)),
    (16, FastConfig(tk=4, tn=4, dot=False, mma=True, prefetch=True)),
    (3, FastConfig(tk=16, tn=2, dot=False, mma=True, programs_per_sm=1, prefetch=True)),
    (3, FastConfig(tk=16, tn=2, warps=8, dot=False, mma=True, affine=True, programs_per_sm=1, prefetch=True)),
    (40, FastConfig(tk=8, tn=2, warps=2, dot=False, mma=True, affine=True, block_m=32, prefetch=True)),
    (1, FastConfig(tk=8, tn=4, dot=False, mma=True, affine=True, programs_per_sm=1, prefetch=2)),
    (3, FastConfig(tk=16, tn=2, dot=False, mma=True, programs_per_sm=1, prefetch=2)),
    (40, FastConfig(tk=8, tn=2, warps=2, dot=False, mma=True, affine=True, block_m=32, prefetch=True, frag_x=True)),
    (3, FastConfig(tk=16, tn=2, dot=False, mma=True, programs_per_sm=1, prefetch=2, frag_x=True)),
]


@pytest.mark.parametrize("cases", [MMA_ROWS, MMA_PF_ROWS], ids=["plain", "prefetch"])
@pytest.mark.parametrize("codebook", CODEBOOKS)
@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 6, 7])
def test_mma_every_codebook_and_rows(bits, codebook, cases, device):
    w = qt.exl3_weight(384, 256, bits, codebook, device, seed=200 + 10 * bits + CODEBOOKS.index(codebook))
    f = exl3_fast.fuse([w])
    for rows, cfg in cases:
        _check_fast(f, rows, cfg, seed=rows)


@pytest.mark.parametrize("rows", [1, 16, 21])
def test_input_transform_in_fragment_order(rows, device):
    # Two parts (suh differ), 200 inputs padded to 256: each part's rows, rounded up to 16
    # and in _frag_offsets' order, equal the plain transform's (rows past M zero).
    parts = [qt.exl3_weight(200, o, 4, "mul1", device, seed=o) for o in (256, 128)]
    f = exl3_fast.fuse(parts)
    x = torch.randn(rows, 200, generator=torch.Generator().manual_seed(rows)).to(device)
    padded = 16 * -(-rows // 16)
    got = exl3_fast.fast_input_transform(f, x, torch.float16, padded)
    # the plain transform of the rows padded with zeros: the same 16-row dot (one row alone
    # takes the butterflies, rounded differently)
    xz = torch.zeros(padded, 200, device=device)
    xz[:rows] = x
    plain = exl3_fast.fast_input_transform(f, xz, torch.float16)
    assert got.shape == (2, padded, f.padded_in)
    for p in range(2):
        assert torch.equal(got[p].reshape(-1), exl3_decode.fragment_order_ref(plain[p]))
    # one row: the butterflies (_in_kernel's FWHT) against the reference transform
    one = exl3_fast.fast_input_transform(f, x[:1], torch.float32)
    for p, part in enumerate(f.parts):
        torch.testing.assert_close(one[p], exl3_decode.exl3_input_transform_ref(part, x[:1], torch.float32),
                                   rtol=1e-5, atol=1e-6)
    # FastDispatch.in_fwht off: the tf32x3 dot, one row bit for bit as in a 16-row block,
    # and within float32 rounding of the butterflies
    d = exl3_fast.get_dispatch()
    try:
        exl3_fast.set_dispatch(dataclasses.replace(d, in_fwht=False))
        dot = exl3_fast.fast_input_transform(f, x[:1], torch.float16)
        dot_block = exl3_fast.fast_input_transform(f, xz, torch.float16)
        dot_frag = exl3_fast.fast_input_transform(f, x, torch.float16, padded)
    finally:
        exl3_fast.set_dispatch(d)
    assert torch.equal(dot[:, 0], dot_block[:, 0])
    for p in range(2):
        assert torch.equal(dot_frag[p].reshape(-1), exl3_decode.fragment_order_ref(dot_block[p]))
    torch.testing.assert_close(dot_block.float(), plain.float(), rtol=1e-3, atol=1e-3)


def test_mma_merged_parts_and_dispatch(device):
    parts = [qt.exl3_weight(200, o, 4, "mul1", device, seed=o, bias=True) for o in (256, 100, 130)]
    f = exl3_fast.fuse(parts)
    for dtype in (torch.bfloat16, torch.float32):
        _check_fast(f, 5, FastConfig(tk=4, tn=2, dot=False, mma=True, affine=True), dtype, want_parts=parts)
        for _ in range(2):  # the counters are back at 0 after each call
            _check_fast(f, 5, FastConfig(tk=4, tn=2, dot=False, mma=True, affine=True, fuse_out=True), dtype,
                        want_parts=parts)
        assert int(f.counters.abs().sum()) == 0
    # x in fragment order with three parts: each part's rows rounded up to whole row blocks
    # (21: two blocks of 16, the second partial; 40: two programs of 32, block_m 32).
    _check_fast(f, 21, FastConfig(tk=4, tn=2, dot=False, mma=True, affine=True, frag_x=True), want_parts=parts)
    _check_fast(f, 40, FastConfig(tk=4, tn=2, warps=2, dot=False, mma=True, block_m=32, fuse_out=True, frag_x=True),
                want_parts=parts)
    with pytest.raises(ValueError, match="fragment order"):
        exl3_fast.fast_input_transform(f, torch.zeros(17, 200, device=device), torch.float16, 24)
    # More row blocks than counters: the separate output transform.
    _check_fast(f, 16 * f.counters.shape[0] + 1, FastConfig(tk=4, tn=2, dot=False, mma=True, fuse_out=True),
                want_parts=parts)
    cfg = FastConfig(tk=8, tn=4, dot=False, mma=True, affine=True)
    d = exl3_fast.FastDispatch(one_row=cfg, gemv=cfg, gemv_max_rows=32)
    assert exl3_fast.choose_config(1, d) is cfg and exl3_fast.choose_config(32, d) is cfg
    assert exl3_fast.choose_config(33, d) is d.gemm
    with pytest.raises(ValueError, match="mma"):
        exl3_fast.fast_matmul(f, torch.zeros(1, 200, device=device), FastConfig(tk=4, warps=8, dot=False, mma=True))
    with pytest.raises(ValueError, match="prefetch"):
        exl3_fast.fast_matmul(f, torch.zeros(1, 200, device=device), FastConfig(tk=4, dot=False, prefetch=True))
    with pytest.raises(ValueError, match="prefetch"):
        exl3_fast.fast_matmul(f, torch.zeros(1, 200, device=device), FastConfig(tk=4, dot=False, mma=True, prefetch=3))
    with pytest.raises(ValueError, match="frag_x"):
        exl3_fast.fast_matmul(f, torch.zeros(1, 200, device=device), FastConfig(tk=4, dot=False, frag_x=True))


def test_fast_merged_parts_unpadded_bias_dtypes(device):
    # q/k/v-like parts of different, unpadded widths (200 inputs, 256 + 100 + 130 outputs):
    # one launch each, part lookup per column block, scattered unpadded output with bias.
    parts = [qt.exl3_weight(200, o, 3, "mul1", device, seed=o, bias=True) for o in (256, 100, 130)]
    f = exl3_fast.fuse(parts)
    assert f.trellis.shape[1] == 16 + 8 + 16 and f.parts[1].trellis.data_ptr() != parts[1].trellis.data_ptr()
    for dtype in (torch.bfloat16, torch.float32):
        _check_fast(f, 5, FastConfig(tk=4, tn=4), dtype, want_parts=parts)
        _check_fast(f, 5, FastConfig(tk=8, tn=8, in_had=True), dtype, want_parts=parts)
    _check_fast(f, 1, FastConfig(tk=8, tn=2, dot=False), want_parts=parts)
    _check_fast(f, 4, FastConfig(tk=4, tn=4, split=True), torch.bfloat16, want_parts=parts)
    _check_fast(f, 1, FastConfig(tk=4, tn=2, dot=False, row=True), want_parts=parts)  # part lookup
    _check_fast(f, 1, FastConfig(tk=4, tn=2, dot=False, row=True, affine=True), want_parts=parts)
    # The row kernel's fused output transform over three parts with bias: twice (the
    # counters are back at 0 after each call), and within float32 rounding of the separate
    # output-transform launch (a Hadamard by butterflies there, by a tf32x3 dot here).
    fused = FastConfig(tk=4, tn=2, dot=False, row=True, affine=True, fuse_out=True)
    for _ in range(2):
        _check_fast(f, 1, fused, want_parts=parts)
    assert int(f.counters.abs().sum()) == 0
    x = torch.randn(1, 200, generator=torch.Generator().manual_seed(7)).to(device)
    one = exl3_fast.fast_matmul(f, x, fused)
    sep = exl3_fast.fast_output_transform(f, exl3_fast.fast_partials(f, x, fused), torch.float32)
    torch.testing.assert_close(one, sep, rtol=1e-5, atol=1e-5)
    # The parts are views of the fused trellis now; the per-part kernels still read them.
    _ok(qt.check_exl3_matmul(f.parts[2], 3, torch.float32, "gemv", BIG))
    _ok(qt.check_exl3_reconstruct(f.parts[1], block=ONE.reconstruct))


def test_fast_groups_and_layer_hook(device):
    # Parts of different K become separate groups; a half-integer part stays with the
    # reference. Through MergedLinear with the fused-layer kernel admitted on this device.
    from trellm.layers.linear import MergedLinear
    from trellm.quant.exl3 import method as exl3_method
    from trellm.quant.exl3.loading import random_exl3_tensors

    g = torch.Generator(device=device).manual_seed(0)
    sizes = [(128, 3), (128, 3), (32, 2.5), (256, 2)]
    layer = MergedLinear(128, [s for s, _ in sizes], False, exl3_method.EXL3LinearMethod(), torch.float32)
    layer.exl3_device = device
    for shard, (out_f, bits) in enumerate(sizes):
        for name, t in random_exl3_tensors("p", 128, out_f, bits, "mul1", g, device):
            layer.weight_loader(name.rsplit(".", 1)[1], t, shard)
    kernel = exl3_method.EXL3LayerKernel("test-fast", lambda parts: exl3_fast.prepare_layer(parts, force=True),
                                         lambda state, x: True, exl3_fast.run_layer)
    exl3_method.register_layer_kernel(kernel)
    try:
        layer.method.process_after_loading(layer)
        x = torch.randn(1, 128, generator=g, device=device)
        got = layer(x)
    finally:
        exl3_method.unregister_layer_kernel("test-fast")
    groups = layer.exl3_layer_kernel[1].groups
    assert [len(gr.parts) if isinstance(gr, exl3_fast.EXL3Fused) else 0 for gr in groups] == [2, 0, 1]
    want = torch.cat([forward_reference(p, x) for p in layer.exl3_parts], dim=-1)
    _ok(compare("exl3_fast layer", "x=1", got, want, quant_tolerance(torch.float32, True), torch.float32))


def test_fast_several_row_blocks_and_dispatch(device):
    w = qt.exl3_weight(128, 256, 2, "3inst", device, seed=9)
    f = exl3_fast.fuse([w])
    _check_fast(f, 40, FastConfig(tk=8, tn=8, block_m=16))  # 3 row blocks, the last partial
    d = exl3_fast.FastDispatch(gemv_max_rows=4)
    assert exl3_fast.choose_config(1, d) is d.one_row
    assert exl3_fast.choose_config(4, d) is d.gemv and exl3_fast.choose_config(5, d) is d.gemm
    # One row of K 5-6 (the 6-bit head): the gemv's mma kernel, not the row config's split fallback.
    assert d.one_row.row and d.gemv.mma
    assert exl3_fast.choose_config(1, d, 6) is d.gemv and exl3_fast.choose_config(1, d, 5) is d.gemv
    assert exl3_fast.choose_config(1, d, 4) is d.one_row and exl3_fast.choose_config(1, d, 7) is d.one_row
    from dataclasses import replace
    nowide = replace(d, wide_mma=False)
    assert exl3_fast.choose_config(1, nowide, 6) is d.one_row
    assert exl3_fast.choose_config(3, d, 6) is d.gemv and exl3_fast.choose_config(3, nowide, 4) is d.gemv
    assert exl3_fast.choose_config(3, nowide, 6) == exl3_fast.split_fallback(d.gemv)
    assert exl3_fast.group_size(4) == 8 and exl3_fast.group_size(5) == 4 and exl3_fast.group_size(7) == 2


def test_fast_reconstruct_path_merged_parts_in_column_slices(device):
    # Prefill's path: decode Wq to fp16 in slices of 128 columns (so the 256-wide part takes
    # two, the others one each), cuBLAS per part on its own input signs, both Hadamard
    # transforms as fp16 GEMMs (exl3_prefill.py); against the reference, and the slice decode bit-exact
    # against the whole.
    parts = [qt.exl3_weight(200, o, 4, "mul1", device, seed=o, bias=True) for o in (256, 100, 130)]
    f = exl3_fast.fuse(parts)
    d = exl3_fast.FastDispatch(reconstruct_min_rows=4, reconstruct_cols=128)
    x = torch.randn(6, 200, generator=torch.Generator().manual_seed(3)).to(f.trellis.device)
    got = exl3_fast.fast_matmul(f, x, dispatch=d)
    want = torch.cat([forward_reference(p, x) for p in parts], dim=-1)
    _ok(compare("exl3_fast reconstruct path", "x=6", got, want, quant_tolerance(torch.float32, True), torch.float32))
    whole = exl3_fast.fast_reconstruct(f)
    assert torch.equal(exl3_fast.fast_reconstruct(f, cols=(8, 24)), whole[:, 8 * 16:24 * 16])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fast_reconstruct_path_half_inputs_unpadded(device, dtype):
    # The same path with half-precision activations, no input padding (256 = 2 x 128,
    # so the fp16 input buffer is not zero-filled), no bias, one slice per part.
    parts = [qt.exl3_weight(256, o, 3, "mcg", device, seed=o) for o in (128, 384)]
    f = exl3_fast.fuse(parts)
    d = exl3_fast.FastDispatch(reconstruct_min_rows=4, reconstruct_cols=16384)
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(5)).to(f.trellis.device)
    got = exl3_fast.fast_matmul(f, x.to(dtype), dispatch=d)
    assert got.dtype == dtype
    want = torch.cat([forward_reference(p, x.to(dtype).float()) for p in parts], dim=-1)
    _ok(compare("exl3_fast reconstruct path", f"x=9 {dtype}", got, want, quant_tolerance(dtype, True), dtype))
    with pytest.raises(ValueError, match="multiple of 128"):
        exl3_fast.fast_prefill(f, x.to(dtype), 100, dtype)
