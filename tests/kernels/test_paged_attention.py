"""Paged attention kernels (decode split-K + reduce kernel, decode with the splits
combined in the split kernel, varlen prefill) against their float32 references.
Tolerances: trellm.kernels.testing.TOLERANCES (bf16: atol 1.6e-2, rtol 1e-2 against
float32 math on the same bf16 inputs)."""
import pytest
import torch

from trellm import envs
from trellm.kernels import paged_attention, testing as kt

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


# ---- decode with the splits combined in the split kernel (no reduce launch) -------------

def _decode_inputs(lens, hq, hk, d, dtype, device, page=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    kv, table = kt.paged_cache(lens, page, hk, d, dtype, device, gen)
    bsz = len(lens)
    q = torch.randn(2 + bsz, hq, d, generator=gen).to(dtype).to(device)
    token_index = torch.arange(bsz + 1, 1, -1, dtype=torch.int32, device=device)  # after 2 rows, reversed
    return q, kv, table, torch.tensor(lens, dtype=torch.int32, device=device), token_index


def _decode(inputs, **kw):
    q, kv, table, lens, token_index = inputs
    return paged_attention.paged_decode(q, kv, table, lens, q.shape[-1] ** -0.5, token_index=token_index,
                                        out=torch.zeros_like(q), **kw)


def _check_fused(lens, hq, hk, d, dtype, device, num_splits, page=16):
    """The fused combine against the float32 oracle, twice on one counter buffer (the
    first launch must leave it at 0 for the second to combine at all)."""
    inputs = _decode_inputs(lens, hq, hk, d, dtype, device, page)
    q, kv, table, seq_lens, token_index = inputs
    counters = torch.zeros(len(lens) * hk + 5, dtype=torch.int32, device=device)  # spare entries
    first = _decode(inputs, num_splits=num_splits, fused_reduce=True, counters=counters)
    assert not counters.any(), "counters must be back at 0 after the launch"
    again = _decode(inputs, num_splits=num_splits, fused_reduce=True, counters=counters)
    assert torch.equal(first, again)
    want = paged_attention.paged_decode_ref(q, kv, table, seq_lens, d ** -0.5, token_index=token_index,
                                            out=torch.zeros(q.shape, dtype=torch.float32, device=device))
    rows = token_index.long()
    shape = f"lens={lens} hq={hq} hk={hk} d={d} splits={num_splits}"
    _assert(kt.compare("paged_decode.fused", shape, first[rows], want[rows], kt.TOLERANCES[dtype], dtype))
    assert not first[:2].any(), "rows that are not decode rows must be left alone"
    return inputs, first


# (seq_lens, hq, hk, head_dim, num_splits). BLOCK_N is 64 here (32 for GQA 64), so a
# split covers whole 64-token tiles: "needs" = the non-empty splits of the longest.
FUSED_CASES = {
    "batch1_two_used": ([200], 8, 2, 64, 3),         # 2 of 3 splits used
    "batch1_odd_many_splits": ([131], 8, 2, 64, 16),  # 3 of 16 used: trailing splits empty
    "mixed_lens": ([1, 20, 100, 130, 257], 8, 2, 64, 4),  # per sequence: 1, 1, 2, 3, 4 used
    "gqa1": ([77, 190], 4, 4, 64, 3),
    "gqa4": ([77, 190], 16, 4, 128, 5),
    "gqa8": ([77, 190], 16, 2, 64, 2),
    "gqa8_seven_splits": ([300, 65], 16, 2, 64, 7),
    "ten_used_two_chunks": ([600, 130], 16, 2, 64, 16),  # the combine steps 8 splits at a time here
}


@pytest.mark.parametrize("dtype", [BF16, FP32], ids=str)
@pytest.mark.parametrize("case", list(FUSED_CASES))
def test_decode_fused_reduce(case, dtype, device):
    lens, hq, hk, d, splits = FUSED_CASES[case]
    _check_fused(lens, hq, hk, d, dtype, device, splits)


@pytest.mark.parametrize("floor", [100, 128, 256])
@pytest.mark.parametrize("fused", [False, True])
def test_decode_split_floor(floor, fused, device, monkeypatch):
    """SPLIT_FLOOR_TOKENS (each split at least that many tokens, rounded up to a tile):
    fewer, longer splits at short contexts, the same attention; 100 rounds up to 128."""
    monkeypatch.setattr(paged_attention, "SPLIT_FLOOR_TOKENS", floor)
    lens = [1, 70, 129, 300, 600]
    if fused:
        _check_fused(lens, 16, 4, 128, BF16, device, num_splits=8)
    else:
        _assert(kt.check_paged_decode(lens, 16, 4, 128, BF16, device, num_splits=8))


def test_decode_fused_reduce_page_8_fp16(device):
    _check_fused([9, 150, 70], 8, 2, 64, FP16, device, 3, page=8)


def test_decode_fused_single_used_split_is_the_reference_path_bitwise(device):
    # Every sequence fits one 64-token tile: each writes acc / l, as the reduce would.
    inputs, fused = _check_fused([1, 37, 64], 8, 2, 64, BF16, device, num_splits=6)
    assert torch.equal(fused, _decode(inputs, num_splits=6))


def test_decode_fused_one_split_and_own_counters(device):
    # num_splits == 1 takes the direct path (no counters); counters=None allocates zeros.
    inputs = _decode_inputs([45, 300], 8, 2, 64, BF16, device)
    ref_path = _decode(inputs, num_splits=3)
    assert torch.equal(_decode(inputs, num_splits=1, fused_reduce=True), _decode(inputs, num_splits=1))
    torch.testing.assert_close(_decode(inputs, num_splits=3, fused_reduce=True), ref_path, atol=8e-3, rtol=0)


def test_decode_fused_rejects_a_short_counter_buffer(device):
    inputs = _decode_inputs([200, 200], 8, 2, 64, BF16, device)
    with pytest.raises(ValueError, match="counters"):
        _decode(inputs, num_splits=3, fused_reduce=True, counters=torch.zeros(3, dtype=torch.int32))


def test_backend_owns_counters_across_steps(device):
    """TritonPagedAttention.attend, fused by default, over three steps: batch 1 (two
    splits: the combine runs), 33 x 8 kv heads (one split here, but 264 counters: it grows,
    the outgrown one is kept), batch 1 again on the new buffer; all counters end at 0."""
    from trellm.attention.torch_paged import AttentionMetadata, DecodeGroup
    from trellm.attention.triton_paged import TritonPagedAttention

    backend = TritonPagedAttention()
    assert backend.fused_decode_reduce
    for lens, hk in (([300], 2), ([300] + [17] * 32, 8), ([300], 2)):
        q, kv, table, seq_lens, _ = _decode_inputs(lens, 8, hk, 64, BF16, device)
        rows = torch.arange(len(lens), dtype=torch.int32, device=device)
        meta = AttentionMetadata(slot_mapping=torch.zeros(len(lens), dtype=torch.long), block_size=16,
                                 decode=DecodeGroup(rows, table, seq_lens, max(lens)), prefills=[])
        got = backend.attend(q[:len(lens)], kv, meta, 64 ** -0.5)
        want = paged_attention.paged_decode_ref(q[:len(lens)], kv, table, seq_lens, 64 ** -0.5)
        _assert(kt.compare("attend", str(len(lens)), got, want, kt.TOLERANCES[BF16], BF16))
    assert backend._counters.numel() >= 264 and len(backend._retired) == 1
    assert not backend._counters.any() and not backend._retired[0].any()


@pytest.mark.parametrize("num_splits,fused", [(1, False), (3, False), (3, True), (5, True)],
                         ids=["direct", "reduce", "fused", "fused5"])
def test_decode_writes_the_next_linears_input_transform(num_splits, fused, device):
    # xform: besides out, had_r_128(out * suh) of the decode rows, bit for bit what the
    # transform's own launch (exl3_prologue.fast_input_transform, butterflies) makes of out.
    from types import SimpleNamespace

    from trellm.kernels import exl3_prologue

    lens, hq, hk = [1, 90, 200], 4, 2  # 200 tokens: several splits used; 1: one
    inputs = _decode_inputs(lens, hq, hk, 128, BF16, device)
    q, token_index = inputs[0], inputs[4]
    suh = torch.where(torch.rand(hq * 128, generator=torch.Generator().manual_seed(3)) < 0.5, -1.0, 1.0)
    suh = suh.half().to(device)
    xh = torch.full((q.shape[0], hq * 128), 7.0, device=device)
    out = _decode(inputs, num_splits=num_splits, fused_reduce=fused, xform=(suh, xh))
    assert torch.equal(out, _decode(inputs, num_splits=num_splits, fused_reduce=fused))
    f = SimpleNamespace(parts=(None,), padded_in=hq * 128, in_features=hq * 128, suh=suh[None])
    rows = token_index.long()
    want = exl3_prologue.fast_input_transform(f, out.reshape(q.shape[0], -1)[rows], torch.float32)[0]
    assert torch.equal(xh[rows], want)
    assert (xh[:2] == 7.0).all(), "rows that are not decode rows must be left alone"
    with pytest.raises(ValueError, match="xform"):
        _decode(_decode_inputs([5], 4, 2, 64, BF16, device), xform=(suh[:256], xh[:, :256]))
