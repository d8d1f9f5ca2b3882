"""Pure-PyTorch paged attention: always available, the CPU path and the oracle
for the GPU kernels.

The KV cache of one layer is a tensor [2, num_blocks, block_size, kv_heads, head_dim].
A step's tokens are flattened into one batch; requests whose query is one token
(decode) are attended together in one padded SDPA call, each longer query
(prefill chunk) in its own call so no request pays for another's padding.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from trellm.attention.kv_mirror import DecodeKVMirror


@dataclass
class DecodeGroup:
    token_index: torch.Tensor
    """[B] positions of the decode tokens in the flat batch."""
    block_table: torch.Tensor
    """[B, max_blocks] block ids (padding: 0, masked out by seq_lens)."""
    seq_lens: torch.Tensor
    """[B] context length including the new token."""
    max_seq_len: int
    attn_mask: torch.Tensor | None = None
    """[B, 1, 1, max_seq_len] True where a key is inside the sequence; built once per step.
    None when every sequence has max_seq_len tokens (no padding to mask)."""
    contiguous_start: int | None = None
    """First block id when there is one sequence and its blocks are consecutive ids:
    its K/V is then a view of the pool, with no gather (the common single-stream case)."""
    mirror: "DecodeKVMirror | None" = None
    """CPU: the runner's contiguous copy of the group's K/V (kv_mirror.py), used where the
    step's fresh K/V are at hand; with it, ``step`` (the runner's step counter),
    ``request_ids`` and ``lens`` (seq_lens as ints) say whether last step's copy continues."""
    step: int = 0
    request_ids: tuple[str, ...] = ()
    lens: tuple[int, ...] = ()
    kv_rows: tuple[int, int, torch.Tensor] | None = None
    """(nblk, num_blocks, rows): the gather's rows [2 B nblk] of the pool viewed as
    [2 num_blocks, block], K rows then V rows. CPU block tables only: built by a step's
    first layer (``rows_for``), reused by the rest (every layer's pool has one shape)."""

    def rows_for(self, nblk: int, kv_cache: torch.Tensor) -> torch.Tensor:
        num_blocks = kv_cache.shape[1]
        # Not cached off the CPU: a CUDA graph replays one DecodeGroup with new block
        # tables, so there the rows must be recomputed inside the captured work.
        if self.block_table.device.type != "cpu":
            return gather_rows(self.block_table, nblk, num_blocks)
        if self.kv_rows is None or self.kv_rows[:2] != (nblk, num_blocks):
            self.kv_rows = (nblk, num_blocks, gather_rows(self.block_table, nblk, num_blocks))
        return self.kv_rows[2]


@dataclass
class PrefillSeq:
    q_start: int
    q_len: int
    seq_len: int
    """Context length including this chunk (the chunk's first token is at seq_len - q_len)."""
    block_ids: torch.Tensor
    """[num_blocks] the request's blocks covering seq_len tokens."""


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor
    """[T] flat slot (block * block_size + offset) each new token's K/V is written to."""
    decode: DecodeGroup | None
    prefills: list[PrefillSeq]
    block_size: int


class TorchPagedAttention:
    """Registry entry 'torch': works on any device and dtype."""

    name = "torch"

    @staticmethod
    def supports(device: torch.device, dtype: torch.dtype) -> bool:
        return True

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hk, D]; returns [T, Hq, D]."""
        kv = write_kv(kv_cache, k, v, meta.slot_mapping)
        if meta.decode is not None and not meta.prefills:  # decode-only: the rows are the group's, in order
            return _decode(q, kv_cache, meta.decode, scale, k, v, kv)
        return _attend(q, k, v, kv_cache, meta, scale)

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
               scale: float) -> torch.Tensor:
        """Attention for a step whose K/V are already in the cache (a model that wrote
        them itself): every key, the chunk's own included, is read from the cache."""
        return _attend(q, None, None, kv_cache, meta, scale)


def _attend(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, kv_cache: torch.Tensor,
            meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Decode group and prefill chunks of one step; k/v None: read the chunks' own keys from the cache."""
    if meta.decode is not None and not meta.prefills:
        return _decode(q, kv_cache, meta.decode, scale, k, v)  # decode-only step: rows already in order
    out = torch.empty_like(q)
    if meta.decode is not None:
        d = meta.decode
        fresh = (None, None) if k is None else (k[d.token_index], v[d.token_index])
        out[d.token_index] = _decode(q[d.token_index], kv_cache, d, scale, *fresh)
    for p in meta.prefills:
        sl = slice(p.q_start, p.q_start + p.q_len)
        fresh = (None, None) if k is None else (k[sl], v[sl])
        out[sl] = prefill_reference(q[sl], *fresh, kv_cache, p, scale)
    return out


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Writes the step's K/V rows into the pool; returns them as [2, T, Hk, D] in its dtype."""
    _, nb, bs, hk, d = kv_cache.shape
    # K and V in one index_copy_ (the pool's K and V halves are one tensor): half the
    # dispatches of two copies, which is what a decode step's write costs on the CPU.
    # stack promotes to the wider dtype exactly, so one cast after it rounds each value
    # as a cast of k and v apiece would (and none is dispatched when the dtypes agree).
    kv = torch.stack((k, v))
    if kv.dtype != kv_cache.dtype:
        kv = kv.to(kv_cache.dtype)
    kv_cache.view(2, nb * bs, hk, d).index_copy_(1, slots, kv)
    return kv


def _decode(q: torch.Tensor, kv_cache: torch.Tensor, d: DecodeGroup, scale: float,
            k_new: torch.Tensor | None = None, v_new: torch.Tensor | None = None,
            new_kv: torch.Tensor | None = None) -> torch.Tensor:
    """``new_kv``: k_new / v_new as write_kv returned them (saves the mirror a stack)."""
    if d.contiguous_start is None and d.mirror is not None and k_new is not None:
        kv = d.mirror.kv(kv_cache, d.step, d.request_ids, d.lens, k_new, v_new,
                         lambda length: _gather(kv_cache, d.block_table, length, d), new_kv)
        if kv is not None:
            return _sdpa_decode(q, kv[0], kv[1], d.attn_mask, scale)
    if d.contiguous_start is None:
        return paged_decode_reference(q, kv_cache, d.block_table, d.seq_lens, d.max_seq_len, scale,
                                      d.attn_mask, masked=d.attn_mask is not None, group=d)
    # One sequence on consecutive blocks: attend over a view of the pool (no copy, no mask).
    bs, hk, dim = kv_cache.shape[2], kv_cache.shape[3], kv_cache.shape[4]
    nblk = (d.max_seq_len + bs - 1) // bs
    kv = kv_cache[:, d.contiguous_start:d.contiguous_start + nblk].reshape(2, 1, nblk * bs, hk, dim)
    kv = kv[:, :, :d.max_seq_len].transpose(2, 3)
    return _sdpa_decode(q, kv[0], kv[1], None, scale)


def _gather(kv_cache: torch.Tensor, block_table: torch.Tensor, length: int,
            group: DecodeGroup | None = None) -> torch.Tensor:
    """[2, B, >= length, Hk, D]: each sequence's first ``length`` positions, from the pool.
    ``group``: the step's DecodeGroup (``block_table`` must be its table), whose gather
    rows the layers share."""
    bs = kv_cache.shape[2]
    nblk = (length + bs - 1) // bs
    if kv_cache.is_contiguous():
        rows = gather_rows(block_table, nblk, kv_cache.shape[1]) if group is None else group.rows_for(nblk, kv_cache)
        # One gather for K and V, along dim 0 of a 2-D view: index_select's contiguous-row
        # path, ~3x faster on the CPU than along the pool's block dim (dim 1 of 5).
        kv = kv_cache.view(2 * kv_cache.shape[1], -1).index_select(0, rows)
    else:  # a strided pool (a view of a bigger one) has no flat view: gather along dim 1
        kv = kv_cache.index_select(1, block_table[:, :nblk].reshape(-1))
    return kv.reshape(2, block_table.shape[0], nblk * bs, *kv_cache.shape[3:])


def gather_rows(block_table: torch.Tensor, nblk: int, num_blocks: int) -> torch.Tensor:
    """Rows of the pool viewed as [2 num_blocks, ...] holding the first nblk blocks of
    every sequence: all K rows, then all V rows."""
    table = block_table[:, :nblk].reshape(-1)
    return torch.cat((table, table + num_blocks))


def decode_mask(seq_lens: torch.Tensor, max_seq_len: int) -> torch.Tensor:
    mask = torch.arange(max_seq_len, device=seq_lens.device)[None, :] < seq_lens[:, None]
    return mask[:, None, None, :]


def paged_decode_reference(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                           seq_lens: torch.Tensor, max_seq_len: int, scale: float,
                           mask: torch.Tensor | None = None, masked: bool = True,
                           group: DecodeGroup | None = None) -> torch.Tensor:
    """One query token per sequence over its paged context. q: [B, Hq, D].
    ``masked=False`` promises every sequence is max_seq_len long (nothing to mask).
    ``group``: the step's DecodeGroup (``block_table`` must be its table), whose gather
    rows the layers share."""
    # [2, B, nblk bs, Hk, D] -> [2, B, Hk, L, D]
    kv = _gather(kv_cache, block_table, max_seq_len, group)[:, :, :max_seq_len].transpose(2, 3)
    if mask is None and masked:
        mask = decode_mask(seq_lens, max_seq_len)
    return _sdpa_decode(q, kv[0], kv[1], mask, scale)


def _sdpa_decode(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, mask: torch.Tensor | None,
                 scale: float) -> torch.Tensor:
    """q: [B, Hq, D]; keys, vals: [B, Hk, L, D]."""
    # CPU SDPA is slow in bf16/fp16 (no native units here): attend in float32 there.
    cdt = torch.float32 if q.device.type == "cpu" else q.dtype
    b, hq, d = q.shape
    hk = keys.shape[1]
    # The G = Hq / Hk query heads of a KV head (consecutive, as enable_gqa pairs them) go
    # in as G query rows of that head: one token's rows attend independently, so this is
    # the same attention, without SDPA expanding K/V to Hq heads (2x faster on the CPU).
    qg = q.reshape(b, hk, hq // hk, d)
    if q.dtype != cdt or keys.dtype != cdt:  # skip three no-op casts' dispatch (CPU float32)
        qg, keys, vals = qg.to(cdt), keys.to(cdt), vals.to(cdt)
    out = F.scaled_dot_product_attention(qg, keys, vals, attn_mask=mask, scale=scale).reshape(b, hq, d)
    return out if out.dtype == q.dtype else out.to(q.dtype)


def prefill_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                      p: PrefillSeq, scale: float) -> torch.Tensor:
    """Causal attention of a chunk of queries over the cached prefix plus itself."""
    hq, hk = q.shape[1], kv_cache.shape[3]
    start = p.seq_len - p.q_len
    if start == 0 and k is not None:
        # Nothing cached before this chunk: attend to the fresh K/V directly.
        keys, vals = k, v
    else:
        bs, d = kv_cache.shape[2], kv_cache.shape[4]
        kv = kv_cache.index_select(1, p.block_ids).reshape(2, -1, hk, d)[:, : p.seq_len].to(q.dtype)
        keys, vals = kv[0], kv[1]
    cdt = torch.float32 if q.device.type == "cpu" else q.dtype
    # 4-D [1, H, L, D]: with 3-D inputs the CPU picks the slow math kernel.
    qh, kh, vh = (t.transpose(0, 1).unsqueeze(0).to(cdt) for t in (q, keys, vals))
    if start == 0:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=hq != hk)
    else:
        qpos = torch.arange(start, p.seq_len, device=q.device)
        mask = torch.arange(p.seq_len, device=q.device)[None, :] <= qpos[:, None]
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=hq != hk)
    return out.squeeze(0).transpose(0, 1).to(q.dtype)
