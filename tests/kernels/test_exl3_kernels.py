"""The EXL3 Triton kernels (trellm/kernels/exl3_decode.py, exl3_gemv.py) against the
reference decoder: the decode bit-exact for every K and codebook, each matmul path
within ``testing.quant_tolerance``, rows 1/3/16/33, widths that are multiples of 128
but not of the kernels' blocks. Under the interpreter the block sizes are raised
(fewer programs, same code) except in the tests of the GPU's own block sizes."""
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
    try:
        x = torch.randn(2, 128, generator=g, device=device)
        got = layer(x)
    finally:
        exl3_method.unregister_kernel("test")
    assert calls == [3]
    want = torch.cat([forward_reference(p, x) for p in layer.exl3_parts], dim=-1)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
