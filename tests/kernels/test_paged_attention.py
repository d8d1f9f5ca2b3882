"""Paged attention kernels (decode split-K + reduce, varlen prefill) against their
float32 references. Tolerances: trellm.kernels.testing.TOLERANCES (bf16: atol 1.6e-2,
rtol 1e-2 against float32 math on the same bf16 inputs)."""
import pytest
import torch

from trellm import envs
from trellm.kernels import testing as kt

pytestmark = pytest.mark.gpu
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
long_context = pytest.mark.skipif(envs.triton_interpret(),
                                  reason="32k+ contexts: real GPU only (too slow for the interpreter)")

# (seq_lens, hq, hk, head_dim)
DECODE_CASES = {
    "batch1_len1": ([1], 4, 4, 64),
    "batch1_odd": ([37], 8, 2, 64),
    "mixed_lens": ([1, 17, 50], 8, 2, 128),
    "gqa1": ([23, 40], 4, 4, 64),
    "gqa4": ([23, 40], 8, 2, 64),
    "gqa8": ([23, 40], 16, 2, 128),
    "page_multiples": ([32, 16], 8, 1, 64),
}


def _assert(res):
    assert res.passed, str(res)


@pytest.mark.parametrize("dtype", [BF16, FP16, FP32], ids=str)
@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_decode(case, dtype, device):
    lens, hq, hk, d = DECODE_CASES[case]
    _assert(kt.check_paged_decode(lens, hq, hk, d, dtype, device, lead_rows=2))


@pytest.mark.parametrize("num_splits", [1, 3, 7])
def test_decode_forced_splits(num_splits, device):
    # 7 splits of 16-token tiles leave trailing splits empty for the short sequences.
    _assert(kt.check_paged_decode([1, 20, 100], 8, 2, 64, BF16, device, num_splits=num_splits))


def test_decode_page_8(device):
    _assert(kt.check_paged_decode([9, 30], 8, 2, 64, BF16, device, page=8))


@long_context
@pytest.mark.parametrize("lens", [[33000], [32768, 40001, 5]])
def test_decode_long_context(lens, device):
    _assert(kt.check_paged_decode(lens, 32, 8, 128, BF16, device))


# (chunks as (q_len, seq_len), hq, hk, head_dim)
PREFILL_CASES = {
    "single_no_prefix": ([(7, 7)], 4, 4, 64),
    "chunk_over_prefix": ([(5, 21)], 8, 2, 64),
    "many_seqs": ([(3, 3), (17, 40), (1, 9), (16, 16)], 8, 2, 128),
    "page_boundaries": ([(16, 32), (15, 31), (17, 33)], 8, 1, 64),
    "gqa1": ([(9, 25)], 4, 4, 128),
    "gqa8": ([(9, 25), (2, 2)], 16, 2, 64),
}


@pytest.mark.parametrize("dtype", [BF16, FP16, FP32], ids=str)
@pytest.mark.parametrize("case", list(PREFILL_CASES))
def test_prefill(case, dtype, device):
    chunks, hq, hk, d = PREFILL_CASES[case]
    _assert(kt.check_paged_prefill(chunks, hq, hk, d, dtype, device, lead_rows=3))


def test_prefill_page_8(device):
    _assert(kt.check_paged_prefill([(11, 30), (4, 4)], 8, 2, 64, BF16, device, page=8))


@long_context
@pytest.mark.parametrize("chunks", [[(512, 33000)], [(2048, 2048), (300, 40000)]])
def test_prefill_long_context(chunks, device):
    _assert(kt.check_paged_prefill(chunks, 32, 8, 128, BF16, device))
