"""RMSNorm (+ residual add), SiLU-and-mul, RoPE + KV write against their references.

Tolerances (trellm.kernels.testing.TOLERANCES): one rounding of the output dtype at
O(1) values; the residual sum and a plain KV write must be bit-exact."""
import pytest
import torch

from trellm.kernels import testing as kt

pytestmark = pytest.mark.gpu
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _assert_all(results):
    results = results if isinstance(results, list) else [results]
    bad = [str(r) for r in results if not r.passed]
    assert not bad, "; ".join(bad)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,hidden", [(1, 64), (7, 300), (3, 4096), (2, 5120)])
def test_fused_add_rms_norm(rows, hidden, dtype, device):
    _assert_all(kt.check_fused_add_rms_norm(rows, hidden, dtype, device))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,hidden", [(1, 128), (5, 100)])
def test_rms_norm(rows, hidden, dtype, device):
    _assert_all(kt.check_rms_norm(rows, hidden, dtype, device))


def test_rms_norm_leading_dims(device):
    # q/k norm (Qwen3) normalizes [T, H, D] per head.
    from trellm.kernels.rmsnorm import rms_norm, rms_norm_ref
    x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16).to(device)
    w = torch.ones(64, dtype=torch.bfloat16, device=device)
    torch.testing.assert_close(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), atol=1.6e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,inter", [(1, 64), (5, 1000), (3, 1500)])
def test_silu_and_mul(rows, inter, dtype, device):
    _assert_all(kt.check_silu_and_mul(rows, inter, dtype, device))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scaling", [None, kt.LLAMA3_SCALING], ids=["plain", "llama3"])
@pytest.mark.parametrize("tokens,hq,hk,d", [(1, 4, 4, 64), (9, 8, 2, 64), (13, 32, 4, 128), (5, 6, 2, 96)])
def test_rope_and_write_kv(tokens, hq, hk, d, scaling, dtype, device):
    _assert_all(kt.check_rope_and_write_kv(tokens, hq, hk, d, dtype, device, scaling=scaling))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens,hq,hk,d", [(1, 16, 8, 128), (7, 6, 2, 96)])
def test_rope_with_fused_qk_norm(tokens, hq, hk, d, dtype, device):
    _assert_all(kt.check_rope_and_write_kv(tokens, hq, hk, d, dtype, device, qk_norm=True))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_rope_per_token_tables(dtype, device):
    # Tables as RotaryEmbedding.cos_sin hands them to the model: [T, 1, D] in the model dtype.
    _assert_all(kt.check_rope_and_write_kv(11, 8, 2, 128, dtype, device, kt.LLAMA3_SCALING, with_positions=False))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens,hk,d,page", [(1, 1, 64, 16), (37, 2, 128, 16), (10, 4, 64, 8)])
def test_write_kv(tokens, hk, d, page, dtype, device):
    _assert_all(kt.check_write_kv(tokens, hk, d, dtype, device, page=page))
