"""The skinny-GEMM kernel against float32 math, and its dispatch rule."""
from __future__ import annotations

import pytest
import torch

from trellm.kernels import testing as kt
from trellm.kernels.gemv import MAX_ROWS, GemvDispatch, gemv


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("rows,n,k", [(1, 64, 128), (1, 37, 300), (3, 130, 96), (8, 9, 1000), (5, 2048, 64)])
def test_gemv_matches_reference(rows, n, k, dtype, device):
    res = kt.check_gemv(rows, n, k, dtype, device, bias=n % 2 == 1)
    assert res.passed, str(res)


def test_gemv_rejects_wide_batches(device):
    x = torch.zeros(MAX_ROWS + 1, 16, device=device)
    with pytest.raises(ValueError, match="gemv takes"):
        gemv(x, torch.zeros(4, 16, device=device))


def test_dispatch_uses_the_kernel_only_where_it_won():
    d = GemvDispatch(use_kernel={(64, 32, 1): True, (64, 32, 2): False})
    w = torch.zeros(64, 32)
    assert d.wants(torch.zeros(1, 32), w)
    assert not d.wants(torch.zeros(2, 32), w)  # timed slower
    assert not d.wants(torch.zeros(4, 32), w)  # never timed
    assert not d.wants(torch.zeros(1, 32), torch.zeros(32, 32))
