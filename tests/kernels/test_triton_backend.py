"""The 'triton' attention backend against the 'torch' one on the same step metadata:
mixed decode rows and prefill chunks (with and without a cached prefix)."""
import pytest
import torch

from trellm.attention.torch_paged import AttentionMetadata, DecodeGroup, PrefillSeq, TorchPagedAttention, decode_mask
from trellm.attention.triton_paged import TritonPagedAttention
from trellm.kernels.rope_kv import write_kv

pytestmark = pytest.mark.gpu


def _step(device, page=4, hq=8, hk=2, d=64, dtype=torch.float32):
    """Two decode rows (context 6 and 13), then a fresh prefill of 5 tokens and a chunk
    of 3 tokens over a 7-token cached prefix. Blocks are shuffled; the cache holds random
    prior context."""
    g = torch.Generator().manual_seed(0)
    num_blocks = 24
    kv = torch.randn(2, num_blocks, page, hk, d, generator=g).to(dtype).to(device)
    blocks = torch.randperm(num_blocks, generator=g).tolist()
    seqs = {"d0": (6, 1), "d1": (13, 1), "p0": (5, 5), "p1": (10, 3)}  # (seq_len, new tokens)
    tables, used = {}, 0
    for name, (n, _) in seqs.items():
        nb = -(-n // page)
        tables[name] = blocks[used:used + nb]
        used += nb
    slots = []
    for name, (n, new) in seqs.items():
        slots += [tables[name][p // page] * page + p % page for p in range(n - new, n)]
    t = len(slots)
    lens = torch.tensor([6, 13], device=device)
    width = max(len(tables["d0"]), len(tables["d1"]))
    table = torch.zeros(2, width, dtype=torch.long)
    for i, name in enumerate(("d0", "d1")):
        table[i, :len(tables[name])] = torch.tensor(tables[name])
    decode = DecodeGroup(token_index=torch.tensor([0, 1], device=device), block_table=table.to(device),
                         seq_lens=lens, max_seq_len=13, attn_mask=decode_mask(lens, 13))
    prefills = [PrefillSeq(q_start=2, q_len=5, seq_len=5, block_ids=torch.tensor(tables["p0"], device=device)),
                PrefillSeq(q_start=7, q_len=3, seq_len=10, block_ids=torch.tensor(tables["p1"], device=device))]
    meta = AttentionMetadata(slot_mapping=torch.tensor(slots, device=device), decode=decode, prefills=prefills,
                             block_size=page)
    q = torch.randn(t, hq, d, generator=g).to(dtype).to(device)
    k = torch.randn(t, hk, d, generator=g).to(dtype).to(device)
    v = torch.randn(t, hk, d, generator=g).to(dtype).to(device)
    return q, k, v, kv, meta


def test_forward_matches_torch_backend(device):
    q, k, v, kv, meta = _step(device)
    kv_torch, kv_triton = kv.clone(), kv.clone()
    want = TorchPagedAttention().forward(q, k, v, kv_torch, meta, 0.125)
    got = TritonPagedAttention().forward(q, k, v, kv_triton, meta, 0.125)
    assert torch.equal(kv_triton, kv_torch)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_attend_after_external_write(device):
    q, k, v, kv, meta = _step(device)
    kv2 = kv.clone()
    backend = TritonPagedAttention()
    want = backend.forward(q, k, v, kv, meta, 0.125)
    write_kv(k, v, kv2, meta.slot_mapping)  # what rope_and_write_kv does inside a fused model
    got = backend.attend(q, kv2, meta, 0.125)
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_decode_only_and_prefill_only_steps(device):
    q, k, v, kv, meta = _step(device)
    dec = AttentionMetadata(slot_mapping=meta.slot_mapping[:2], decode=meta.decode, prefills=[], block_size=4)
    pre = AttentionMetadata(slot_mapping=meta.slot_mapping[2:], decode=None, block_size=4,
                            prefills=[PrefillSeq(p.q_start - 2, p.q_len, p.seq_len, p.block_ids) for p in meta.prefills])
    for m, sl in ((dec, slice(0, 2)), (pre, slice(2, None))):
        a, b = kv.clone(), kv.clone()
        want = TorchPagedAttention().forward(q[sl], k[sl], v[sl], a, m, 0.125)
        got = TritonPagedAttention().forward(q[sl].contiguous(), k[sl], v[sl], b, m, 0.125)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_attend_xform_on_decode_only_steps(device):
    # The decode kernel also writes o_proj's input transform (quant.base.InputTransform);
    # None where it cannot: prefill rows in the step, or head_dim != 128.
    from types import SimpleNamespace

    from trellm.kernels import exl3_prologue
    from trellm.quant.base import InputTransform

    q, k, v, kv, meta = _step(device, d=128, dtype=torch.bfloat16)
    write_kv(k, v, kv, meta.slot_mapping)
    suh = torch.where(torch.arange(8 * 128) % 3 == 0, -1.0, 1.0).half().to(device)
    spec = InputTransform(suh, torch.float32)
    backend = TritonPagedAttention()
    assert backend.attend_xform(q, kv, meta, 0.125, spec) is None  # prefill rows in the step
    dec = AttentionMetadata(slot_mapping=meta.slot_mapping[:2], decode=meta.decode, prefills=[], block_size=4)
    out, xh = backend.attend_xform(q[:2].contiguous(), kv, dec, 0.125, spec)
    assert torch.equal(out, backend.attend(q[:2].contiguous(), kv, dec, 0.125).reshape(2, -1))
    f = SimpleNamespace(parts=(None,), padded_in=8 * 128, in_features=8 * 128, suh=suh[None])
    assert torch.equal(xh, exl3_prologue.fast_input_transform(f, out, torch.float32)[0])
    q64, _, _, kv64, meta64 = _step(device)
    dec64 = AttentionMetadata(slot_mapping=meta64.slot_mapping[:2], decode=meta64.decode, prefills=[], block_size=4)
    assert backend.attend_xform(q64[:2].contiguous(), kv64, dec64, 0.125, InputTransform(suh[:512], torch.float32)) \
        is None
