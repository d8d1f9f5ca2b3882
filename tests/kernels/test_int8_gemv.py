"""The W8A16 Triton kernel (trellm/kernels/int8_gemv.py) and its dequantize + matmul
path against ``int8_linear_ref``: rows 1/3/16/33, widths that are not multiples of the
blocks, one split and several (the reduce kernel), bias, each activation dtype."""
import pytest
import torch

from trellm.kernels import int8_gemv
from trellm.kernels import quant_testing as qt

pytestmark = pytest.mark.gpu


def _ok(result):
    assert result.passed, str(result)


@pytest.mark.parametrize("rows,dtype", [(1, torch.float32), (3, torch.float32), (16, torch.float32),
                                        (33, torch.float32), (1, torch.bfloat16), (33, torch.bfloat16),
                                        (3, torch.float16), (16, torch.float16)], ids=str)
def test_triton_path(rows, dtype, device):
    # K = 700: 6 steps of 128, the last partial; N = 130: 3 blocks of 64, the last partial.
    _ok(qt.check_int8(rows, 130, 700, dtype, device, "triton", seed=rows, bias=rows % 2 == 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_dequant_path(dtype, device):
    _ok(qt.check_int8(40, 96, 200, dtype, device, "dequant", bias=True))


def test_one_split_writes_the_output_directly(device):
    # Many column blocks and a short K: one split, so the kernel's own epilogue runs.
    d = int8_gemv.Int8Dispatch(block_n=16, block_k=64)
    q, scale, bias = qt.int8_case(80, 64, device, seed=4, bias=True)
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(0)).to(device)
    got = int8_gemv.int8_linear_triton(x, q, scale, bias, dispatch=d)
    torch.testing.assert_close(got, int8_gemv.int8_linear_ref(x, q, scale, bias), atol=1e-4, rtol=1e-4)


def test_leading_dims_and_dispatch(device):
    q, scale, _ = qt.int8_case(64, 128, device, seed=2)
    x = torch.randn(2, 3, 128, generator=torch.Generator().manual_seed(0)).to(device)
    got = int8_gemv.int8_linear(x, q, scale)
    assert got.shape == (2, 3, 64)
    torch.testing.assert_close(got, int8_gemv.int8_linear_ref(x, q, scale), atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="unknown int8 path"):
        int8_gemv.int8_linear(x, q, scale, path="cublas")
