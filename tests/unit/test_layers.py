"""The CPU fast paths of the layers against their references."""
import pytest
import torch

from trellm.attention.torch_paged import (AttentionMetadata, DecodeGroup, TorchPagedAttention,
                                          decode_mask, paged_decode_reference)
from trellm.layers.norm_rope import RMSNorm, RotaryEmbedding, rms_norm_reference, rope_reference


@pytest.mark.parametrize("scaling", [None, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}])
def test_rope_roll_equals_rotate_half(scaling):
    torch.manual_seed(0)
    rope = RotaryEmbedding(64, 10000.0, scaling, max_positions=512)
    pos = torch.tensor([0, 1, 7, 200, 511])
    q, k = torch.randn(5, 9, 64), torch.randn(5, 3, 64)
    rq, rk = rope(q, k, rope.cos_sin(pos, torch.float32))
    # Same arithmetic up to a sign moved between factors: bit-identical.
    assert torch.equal(rq, rope_reference(q, pos, rope.inv_freq))
    assert torch.equal(rk, rope_reference(k, pos, rope.inv_freq))


@pytest.mark.parametrize("scaling", [None, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}])
def test_rope_rotation_matrices_equal_tables(scaling):
    """The decode path's batched matmul: two non-zero products per output, so it equals
    the reference up to one rounding of their sum (FMA or not)."""
    torch.manual_seed(0)
    rope = RotaryEmbedding(64, 10000.0, scaling, max_positions=512)
    pos = torch.tensor([0, 1, 7, 200, 511])
    q, k = torch.randn(5, 9, 64), torch.randn(5, 3, 64)
    rq, rk = rope(q, k, rope.cos_sin(pos, torch.float32), rope.rotation(pos))
    torch.testing.assert_close(rq, rope_reference(q, pos, rope.inv_freq), rtol=0, atol=1e-6)
    torch.testing.assert_close(rk, rope_reference(k, pos, rope.inv_freq), rtol=0, atol=1e-6)
    # Exactly two non-zeros per column: nothing else leaks into a rotated value.
    assert int((rope.rotation(pos)[1:] != 0).sum(dim=1).max()) == 2


@pytest.mark.parametrize("rows,width", [(1, 576), (8, 576), (3, 64), (130, 960)])
def test_rms_norm_cpu_equals_reference(rows, width):
    """The CPU float32 norm (||x||^2 / D instead of mean(x^2)) within a few ulps of
    transformers' arithmetic, at decode rows, batches and a prefill chunk; scales mixed
    across and within rows, so a badly rounded sum of squares would show. RMSNorm takes
    this path on a float32 CPU tensor."""
    from trellm.layers.norm_rope import rms_norm_cpu

    torch.manual_seed(rows)
    x = torch.randn(rows, width) * torch.logspace(-3, 3, rows)[:, None] * torch.logspace(-2, 2, width)[None, :]
    norm = RMSNorm(width, 1e-5, torch.float32)
    norm.weight.data.copy_(1 + 0.1 * torch.randn(width))
    out = norm(x)
    assert torch.equal(out, rms_norm_cpu(x, norm.weight, norm.eps_cpu))
    torch.testing.assert_close(out, rms_norm_reference(x, norm.weight, 1e-5), rtol=2e-6, atol=0)
    assert out.dtype == torch.float32


def test_rms_norm_bf16_keeps_the_reference_arithmetic():
    """A bf16 model normalizes in float32 and casts back before the weight, as transformers."""
    torch.manual_seed(0)
    xb = torch.randn(4, 64).to(torch.bfloat16)
    nb = RMSNorm(64, 1e-5, torch.bfloat16)
    nb.weight.data.copy_(1 + 0.1 * torch.randn(64))
    xf = xb.float()
    want = nb.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16)
    assert torch.equal(nb(xb), want)


def _pool(num_blocks=12, bs=4, hk=2, d=8):
    torch.manual_seed(1)
    return torch.randn(2, num_blocks, bs, hk, d)


@pytest.mark.parametrize("seq_len", [1, 4, 9])
def test_contiguous_decode_view_equals_gather(seq_len):
    kv, bs = _pool(), 4
    blocks = [3, 4, 5]
    q = torch.randn(1, 6, 8)
    table = torch.tensor([blocks])
    seq_lens = torch.tensor([seq_len])
    want = paged_decode_reference(q, kv, table, seq_lens, seq_len, 0.3)
    group = DecodeGroup(token_index=torch.tensor([0]), block_table=table, seq_lens=seq_lens,
                        max_seq_len=seq_len, attn_mask=None, contiguous_start=3)
    meta = AttentionMetadata(slot_mapping=torch.tensor([3 * bs + seq_len - 1]), decode=group,
                             prefills=[], block_size=bs)
    k_new, v_new = kv[0, 3 + (seq_len - 1) // bs, (seq_len - 1) % bs][None], kv[1, 3 + (seq_len - 1) // bs, (seq_len - 1) % bs][None]
    got = TorchPagedAttention().forward(q, k_new.clone(), v_new.clone(), kv, meta, 0.3)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_unmasked_equal_length_decode_equals_masked():
    kv = _pool()
    q = torch.randn(2, 6, 8)
    table = torch.tensor([[0, 7, 2], [5, 1, 9]])
    lens = torch.tensor([10, 10])
    masked = paged_decode_reference(q, kv, table, lens, 10, 0.3, decode_mask(lens, 10))
    unmasked = paged_decode_reference(q, kv, table, lens, 10, 0.3, None, masked=False)
    torch.testing.assert_close(unmasked, masked, rtol=1e-6, atol=1e-6)


def test_paged_decode_gather_equals_per_sequence_attention():
    """The flat-row gather (K rows then V rows of a [2 blocks, ...] view), shared by a
    step's layers through the DecodeGroup, against plain per-sequence softmax attention."""
    kv, bs = _pool(), 4
    q = torch.randn(3, 6, 8)
    table = torch.tensor([[0, 7, 2], [5, 1, 0], [11, 0, 0]])
    lens = torch.tensor([10, 6, 3])
    group = DecodeGroup(token_index=torch.arange(3), block_table=table, seq_lens=lens, max_seq_len=10,
                        attn_mask=decode_mask(lens, 10))
    for layer_kv in (kv, kv.flip(1).contiguous()):  # two layers' pools, one set of gather rows
        got = paged_decode_reference(q, layer_kv, table, lens, 10, 0.3, group.attn_mask, group=group)
        for b in range(3):
            keys = layer_kv[0, table[b]].reshape(-1, 2, 8)[: lens[b]]  # [L, Hk, D]
            vals = layer_kv[1, table[b]].reshape(-1, 2, 8)[: lens[b]]
            kh = keys.repeat_interleave(3, dim=1)  # 6 query heads over 2 KV heads
            vh = vals.repeat_interleave(3, dim=1)
            probs = torch.softmax(torch.einsum("hd,lhd->hl", q[b], kh) * 0.3, dim=-1)
            torch.testing.assert_close(got[b], torch.einsum("hl,lhd->hd", probs, vh), rtol=1e-5, atol=1e-6)
    assert group.kv_rows is not None and group.kv_rows[2].shape == (2 * 3 * 3,)
    # A strided pool (no flat view) takes the dim-1 gather: same result.
    big = torch.stack((kv, kv.flip(1)), dim=1)  # [2, 2 layers, blocks, ...]
    strided = big[:, 1]
    assert not strided.is_contiguous()
    torch.testing.assert_close(paged_decode_reference(q, strided, table, lens, 10, 0.3, group.attn_mask),
                               paged_decode_reference(q, strided.contiguous(), table, lens, 10, 0.3, group.attn_mask),
                               rtol=0, atol=0)


@pytest.mark.parametrize("hq", [2, 6])
def test_decode_query_heads_fold_equals_enable_gqa(hq):
    """The decode SDPA's G query heads as query rows of their KV head == SDPA's enable_gqa
    (query head h on KV head h // G), also with Hq == Hk and one sequence."""
    kv = _pool()
    for table, lens in ((torch.tensor([[4, 2, 9]]), torch.tensor([11])),
                        (torch.tensor([[0, 7, 2], [5, 1, 0]]), torch.tensor([10, 5]))):
        q = torch.randn(len(lens), hq, 8)
        mask = decode_mask(lens, int(lens.max()))
        got = paged_decode_reference(q, kv, table, lens, int(lens.max()), 0.3, mask)
        keys = kv[0][table].reshape(len(lens), -1, 2, 8)[:, : int(lens.max())].transpose(1, 2)
        vals = kv[1][table].reshape(len(lens), -1, 2, 8)[:, : int(lens.max())].transpose(1, 2)
        want = torch.nn.functional.scaled_dot_product_attention(
            q.unsqueeze(2), keys, vals, attn_mask=mask, scale=0.3, enable_gqa=hq != 2).squeeze(2)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_pinned_module_attributes_read_the_same_tensors():
    """builder._pin_module_attributes: plain-attribute reads return the module's own
    parameters, buffers and submodules; a Parameter assigned afterwards wins
    (Module.__setattr__ drops the pinned entry). Deleting or re-registering a buffer
    afterwards would go stale: the builder pins only a finished model."""
    import torch.nn.functional as F

    from trellm.worker.builder import _pin_module_attributes

    outer = torch.nn.Sequential(torch.nn.Linear(4, 3), RMSNorm(3, 1e-6, torch.float32))
    outer[0].register_buffer("table", torch.arange(3.0))
    _pin_module_attributes(outer)
    lin = outer[0]
    assert lin.__dict__["weight"] is lin._parameters["weight"] and lin.weight is lin._parameters["weight"]
    assert lin.__dict__["table"] is lin._buffers["table"]
    assert outer.__dict__["1"] is outer._modules["1"]
    new = torch.nn.Parameter(torch.ones(3, 4))
    lin.weight = new
    assert lin.weight is new and lin._parameters["weight"] is new
    x = torch.randn(1, 4)
    assert torch.equal(lin(x), F.linear(x, new, lin._parameters["bias"]))
