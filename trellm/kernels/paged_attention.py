"""Paged attention in Triton: decode (flash-decoding) and varlen prefill over the cache.

The KV cache of one layer is [2, num_blocks, block_size, kv_heads, head_dim]
(trellm/attention/torch_paged.py); a sequence's token i lives in block
``block_table[s, i // block_size]`` at offset ``i % block_size``. Both kernels read
every key and value from the cache, so the step's new K/V must be written first
(``rope_kv.write_kv`` or the fused ``rope_kv.rope_and_write_kv``).

GQA: one program serves a KV head and all the query heads that share it, packed
as rows of one tile, so each K/V tile is loaded once per group, not once per head.

Decode (one query token per sequence): the context is split into ``num_splits``
ranges handled by separate programs (split-K / flash-decoding), each writing a
partial output and its log-sum-exp. Two ways to combine them:
- the reference path, a second (reduce) kernel over every split;
- ``fused_reduce=True``, one launch: each non-empty split writes its partial, then
  counts itself in on a per-(sequence, kv head) int32 counter; the program that
  arrives last combines the partials and sets the counter back to 0, so one
  zeroed buffer serves every later launch and CUDA-graph replay. Under a graph the
  split count is fixed, so the reduce launch of the reference path always runs; this
  removes it. A sequence whose context fits one split writes its output directly.
With one split (``num_splits == 1``) both paths write the output directly.

Prefill (a chunk of q_len queries per sequence, at positions seq_len - q_len ..
seq_len - 1): flash-attention over the cached prefix plus the chunk, causal within
the chunk; one launch covers every prefill sequence of the step.

Softmax runs in base 2 (scale folded with log2 e); accumulation is float32.
"""
from __future__ import annotations

import math

import torch

from trellm.kernels._triton import tl, triton, pdl_begin, pdl_kwargs
from trellm.kernels.exl3_decode import _fwht128

_LOG2E = 1.4426950408889634
_MIN_TOKENS_PER_SPLIT = 256
_MAX_SPLITS = 64
_SPLITS_PER_SM = 4
"""Decode grids aim at this many programs per SM (see decode_num_splits)."""
# Measured on an H200 (bf16, 32 q / 8 kv heads, d 128, CUDA graph): 4.0 TB/s at
# 16 x 32k and 1 x 128k contexts, 2.8 TB/s at 1 x 33k; BLOCK_N 128 or 3 stages
# changed single cases by up to 10%, not all of them the same way.
_DECODE_WARPS, _DECODE_STAGES, _DECODE_BLOCK_N = 4, 2, 64
SPLIT_FLOOR_TOKENS = 0
"""Fewest context tokens a decode split takes (rounded up to BLOCK_N; 0: one BLOCK_N tile).
A module setting so scripts/gpu_pdl_ab.py can compare values in whole-engine runs."""
_COMBINE_TILE = 4096
"""Elements of a fused-combine step's [heads, splits, D] tile: 32 float32 registers a
thread at 4 warps, so the combine does not raise the split kernel's register count much."""


# ---- decode ------------------------------------------------------------------------

@triton.jit
def _store_out(out_ptr, xh_ptr, suh_ptr, row, heads, offs_d, val, mask, stride_ot, stride_oh, stride_xh,
               BM: tl.constexpr, HEAD_DIM: tl.constexpr, XFORM: tl.constexpr):
    """Store rows ``heads`` of the output; with XFORM also the next linear's input transform
    of them (exl3_prologue: had_r_128(out * suh), float32 math on the rounded output, as the
    transform's own launch computes it): a head's HEAD_DIM = 128 outputs are one block."""
    o = val.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_ot + heads[:, None] * stride_oh + offs_d[None, :], o, mask=mask)
    if XFORM:
        col = heads[:, None] * HEAD_DIM + offs_d[None, :]
        v = o.to(tl.float32) * tl.load(suh_ptr + col, mask=mask, other=0.0).to(tl.float32)
        h = _fwht128(v, BM) * 0.08838834764831845
        tl.store(xh_ptr + row * stride_xh + col, h.to(xh_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, block_table_ptr, seq_lens_ptr, token_index_ptr,
    out_ptr, part_out_ptr, part_lse_ptr,
    scale_log2,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_bt,
    stride_ot, stride_oh,
    stride_pb, stride_ph, stride_ps,
    stride_lb, stride_lh,
    num_splits, counter_ptr,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
    DIRECT: tl.constexpr, FUSED: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_H: tl.constexpr, CHUNK: tl.constexpr, PRECISION: tl.constexpr, SPLIT_FLOOR: tl.constexpr = 0,
    xh_ptr=None, suh_ptr=None, stride_xh=0, XFORM: tl.constexpr = False, PDL: tl.constexpr = False,
):
    # Before the wait for the previous kernel: the step's metadata (copied in before the
    # forward; no kernel of it writes them), so that only the q and K / V loads wait on it.
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    row = tl.load(token_index_ptr + b).to(tl.int64)
    # Splits cover whole BLOCK_N tiles, at least SPLIT_FLOOR tokens (a multiple of BLOCK_N)
    # each; trailing splits of a short sequence are empty. A graph's split count is fixed
    # for its longest context; the floor keeps a short context to a few splits, fewer
    # partials to combine. (A floor of at least BLOCK_N: no division by 0 at seq_len 0.)
    per_split = tl.maximum(tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N,
                           tl.maximum(SPLIT_FLOOR, BLOCK_N))
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)
    if FUSED:
        if start >= seq_len:
            return  # empty: the fused combine reads only the non-empty splits
    blk_next = tl.load(block_table_ptr + b * stride_bt + (start + tl.arange(0, BLOCK_N)) // PAGE,
                       mask=start + tl.arange(0, BLOCK_N) < end, other=0)
    pdl_begin(PDL)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_g
    q = tl.load(q_ptr + row * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        blk = blk_next  # this tile's pages, loaded a tile ahead (the first before the wait)
        blk_next = tl.load(block_table_ptr + b * stride_bt + (offs_n + BLOCK_N) // PAGE,
                           mask=offs_n + BLOCK_N < end, other=0)
        kv_off = blk.to(tl.int64) * stride_kb + (offs_n % PAGE) * stride_ks + kvh * stride_kh
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + kv_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        qk = tl.where(n_mask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + kv_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    out_mask = g_mask[:, None] & d_mask[None, :]
    part_rows = part_out_ptr + b * stride_pb + heads[:, None] * stride_ph + split * stride_ps + offs_d[None, :]
    lse_ptrs = part_lse_ptr + b * stride_lb + heads * stride_lh + split
    if DIRECT:
        _store_out(out_ptr, xh_ptr, suh_ptr, row, heads, offs_d, acc / l_i[:, None], out_mask, stride_ot, stride_oh,
                   stride_xh, BLOCK_G, HEAD_DIM, XFORM)
    elif FUSED:
        n_used = tl.cdiv(seq_len, per_split)  # the non-empty splits: exactly those with start < seq_len
        if n_used == 1:
            # The lone split's acc / l_i is what a reduce returns (its weight is exp2(0) = 1).
            _store_out(out_ptr, xh_ptr, suh_ptr, row, heads, offs_d, acc / l_i[:, None], out_mask, stride_ot,
                       stride_oh, stride_xh, BLOCK_G, HEAD_DIM, XFORM)
        else:
            tl.store(part_rows, acc / l_i[:, None], mask=out_mask)
            tl.store(lse_ptrs, m_i + tl.log2(l_i), mask=g_mask)
            _arrive_and_combine(part_out_ptr, part_lse_ptr, out_ptr, counter_ptr + b * tl.num_programs(1) + kvh,
                                row, b, kvh, n_used, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
                                stride_ot, stride_oh, xh_ptr, suh_ptr, stride_xh, GROUP=GROUP, HEAD_DIM=HEAD_DIM,
                                BLOCK_D=BLOCK_D, BLOCK_H=BLOCK_H, CHUNK=CHUNK, BLOCK_S=BLOCK_S, XFORM=XFORM)
    else:
        # An empty split leaves l_i == 0: store zeros and lse = -inf (weight 0 in the reduce).
        tl.store(part_rows, acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None], mask=out_mask)
        tl.store(lse_ptrs, m_i + tl.log2(l_i), mask=g_mask)


@triton.jit
def _arrive_and_combine(part_out_ptr, part_lse_ptr, out_ptr, counter, row, b, kvh, n_used,
                        stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ot, stride_oh,
                        xh_ptr, suh_ptr, stride_xh, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                        BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, CHUNK: tl.constexpr, BLOCK_S: tl.constexpr,
                        XFORM: tl.constexpr):
    """Count this split in; the last of the ``n_used`` arrivals combines them all.

    The pattern of CUTLASS's split-K semaphore: a CTA barrier (every thread's partial
    stores are done), then one acq_rel atomic at GPU scope (release: those stores
    happen-before the count; acquire, for the last arrival: every other split's
    released stores are visible to it); the partials are then read through L2 (.cg).
    The combine is the reduce kernel's arithmetic (weights exp2(lse - max) over their
    sum), summed over CHUNK splits per step: the loads of a chunk are in flight
    together, so a 64-split combine costs 64 / CHUNK L2 round trips, not 64. Rows are
    the group's heads (BLOCK_H, not the dot-padded BLOCK_G) to keep the tile small."""
    tl.debug_barrier()
    arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    if arrived == n_used - 1:
        offs_h = tl.arange(0, BLOCK_H)
        h_mask = offs_h < GROUP
        heads = kvh * GROUP + offs_h
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < HEAD_DIM
        offs_s = tl.arange(0, BLOCK_S)
        lse_rows = part_lse_ptr + b * stride_lb + heads * stride_lh
        lse = tl.load(lse_rows[:, None] + offs_s[None, :], mask=h_mask[:, None] & (offs_s < n_used)[None, :],
                      other=float("-inf"), cache_modifier=".cg")
        # Split 0 is non-empty, so m is finite on real rows; padding rows get weight 0.
        m = tl.where(h_mask, tl.max(lse, 1), 0.0)
        denom = tl.where(h_mask, tl.sum(tl.exp2(lse - m[:, None]), 1), 1.0)
        o_rows = part_out_ptr + b * stride_pb + heads * stride_ph
        res = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
        for s0 in range(0, n_used, CHUNK):
            offs_c = s0 + tl.arange(0, CHUNK)
            hc_mask = h_mask[:, None] & (offs_c < n_used)[None, :]
            lse_c = tl.load(lse_rows[:, None] + offs_c[None, :], mask=hc_mask, other=float("-inf"),
                            cache_modifier=".cg")
            w = tl.exp2(lse_c - m[:, None]) / denom[:, None]
            o = tl.load(o_rows[:, None, None] + offs_c[None, :, None] * stride_ps + offs_d[None, None, :],
                        mask=hc_mask[:, :, None] & d_mask[None, None, :], other=0.0, cache_modifier=".cg")
            res += tl.sum(o * w[:, :, None], 1)
        _store_out(out_ptr, xh_ptr, suh_ptr, row, heads, offs_d, res, h_mask[:, None] & d_mask[None, :], stride_ot,
                   stride_oh, stride_xh, BLOCK_H, HEAD_DIM, XFORM)
        # Every arrival has counted (this one was last): ready for the next launch or replay.
        tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")


@triton.jit
def _decode_reduce_kernel(
    part_out_ptr, part_lse_ptr, token_index_ptr, out_ptr,
    stride_pb, stride_ph, stride_ps,
    stride_lb, stride_lh,
    stride_ot, stride_oh,
    num_splits,
    BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    xh_ptr=None, suh_ptr=None, stride_xh=0, XFORM: tl.constexpr = False, PDL: tl.constexpr = False,
):
    pdl_begin(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    row = tl.load(token_index_ptr + b).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    d_mask = offs_d < HEAD_DIM
    lse = tl.load(part_lse_ptr + b * stride_lb + h * stride_lh + offs_s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)  # split 0 is never empty, so m is finite
    w = tl.exp2(lse - m)
    w = w / tl.sum(w, 0)
    o = tl.load(part_out_ptr + b * stride_pb + h * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :],
                mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    res = tl.sum(o * w[:, None], 0)
    heads = h + tl.zeros([1], tl.int32)
    _store_out(out_ptr, xh_ptr, suh_ptr, row, heads, offs_d, tl.reshape(res, (1, BLOCK_D)), d_mask[None, :],
               stride_ot, stride_oh, stride_xh, 1, HEAD_DIM, XFORM)


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: any small number exercises the split path
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


_SM_COUNTS: dict[int, int] = {}


def _sm_count(index: int) -> int:
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNTS[index]


def decode_num_splits(batch: int, kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """Splits per sequence so that batch * kv_heads * splits is about _SPLITS_PER_SM
    programs per SM, with at least _MIN_TOKENS_PER_SPLIT tokens each. A host-side function of host ints:
    under CUDA-graph capture pass a fixed ``num_splits`` per graph instead."""
    want = triton.cdiv(_SPLITS_PER_SM * _num_sms(device), max(batch * kv_heads, 1))
    useful = triton.cdiv(max_seq_len, _MIN_TOKENS_PER_SPLIT)
    return max(1, min(want, useful, _MAX_SPLITS))


def _dot_precision(dtype: torch.dtype) -> str:
    # float32 inputs would default to TF32 on the tensor cores (10-bit mantissa).
    return "ieee" if dtype == torch.float32 else "tf32"


def _check_cache(q: torch.Tensor, kv_cache: torch.Tensor) -> tuple[int, int, int, int]:
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError("kv_cache must be [2, num_blocks, block_size, kv_heads, head_dim], "
                         f"got {tuple(kv_cache.shape)}")
    _, _, page, hk, d = kv_cache.shape
    hq = q.shape[1]
    if q.shape[2] != d or hq % hk:
        raise ValueError(f"q {tuple(q.shape)} does not fit kv_cache {tuple(kv_cache.shape)}")
    if q.stride(2) != 1 or kv_cache.stride(4) != 1:
        raise ValueError("q and kv_cache need a contiguous last (head_dim) dimension")
    return page, hk, d, hq // hk


def paged_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, *, token_index: torch.Tensor | None = None,
                 out: torch.Tensor | None = None, max_seq_len: int | None = None,
                 num_splits: int | None = None, fused_reduce: bool = False,
                 counters: torch.Tensor | None = None,
                 xform: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """One query token per sequence attending over its paged context.

    q: [T, Hq, D]; sequence b's query is row ``token_index[b]`` (default: row b).
    block_table: [B, max_blocks] (int32 preferred); seq_lens: [B] context length
    including the new token (>= 1). The result goes to the same rows of ``out``
    (default: a new tensor like q; other rows are left alone). ``max_seq_len`` (a
    host int, an upper bound is fine) only sizes the split count; without it the
    table width bounds it. Never synchronizes with the device.

    ``fused_reduce``: combine the splits in the split kernel (one launch, see the
    module doc) instead of a reduce kernel. ``counters``: int32, >= B * kv_heads
    entries, all 0; the kernel leaves them 0, so pass a persistent buffer. None
    allocates zeros for this call (under a CUDA graph: a memset in every replay).

    ``xform`` (suh [Hq * D], xh [T, Hq * D]): also write ``had_r_128(out * suh)`` of the
    same rows to xh, the input transform of an EXL3 o_proj (exl3_prologue), so that it
    needs no launch of its own. D must be 128 (a head is one Hadamard block).
    """
    page, hk, d, group = _check_cache(q, kv_cache)
    xf = _check_xform(xform, q, d)
    bsz = block_table.shape[0]
    if token_index is None:
        token_index = torch.arange(bsz, device=q.device, dtype=torch.int32)
    if out is None:
        out = torch.empty_like(q)
    if bsz == 0:
        return out
    if num_splits is None:
        bound = max_seq_len if max_seq_len is not None else block_table.shape[1] * page
        num_splits = decode_num_splits(bsz, hk, bound, q.device)
    block_g = max(16, triton.next_power_of_2(group))
    block_d = max(16, triton.next_power_of_2(d))
    block_n = _DECODE_BLOCK_N if block_g <= 32 else 32
    direct = num_splits == 1
    part_out, part_lse, p_strides, l_strides = _partials(out, bsz, num_splits, d, direct)
    fused = fused_reduce and not direct
    if fused:
        counters = _check_counters(counters, bsz * hk, q.device)
    block_s, block_h = max(2, triton.next_power_of_2(num_splits)), max(2, triton.next_power_of_2(group))
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    _decode_split_kernel[(bsz, hk, num_splits)](
        q, k_cache, v_cache, block_table, seq_lens, token_index,
        out, part_out, part_lse,
        scale * _LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_table.stride(0),
        out.stride(0), out.stride(1),
        *p_strides, *l_strides,
        num_splits, counters if fused else seq_lens,
        GROUP=group, BLOCK_G=block_g, HEAD_DIM=d, BLOCK_D=block_d,
        PAGE=page, BLOCK_N=block_n, DIRECT=direct, FUSED=fused,
        BLOCK_S=block_s, BLOCK_H=block_h, CHUNK=max(2, min(block_s, _COMBINE_TILE // (block_h * block_d))),
        PRECISION=_dot_precision(q.dtype), SPLIT_FLOOR=triton.cdiv(SPLIT_FLOOR_TOKENS, block_n) * block_n,
        num_warps=_DECODE_WARPS, num_stages=_DECODE_STAGES, **xf, **pdl_kwargs(),
    )
    if not direct and not fused:
        _decode_reduce_kernel[(bsz, q.shape[1])](
            part_out, part_lse, token_index, out,
            *p_strides, *l_strides,
            out.stride(0), out.stride(1),
            num_splits,
            BLOCK_S=block_s, HEAD_DIM=d, BLOCK_D=block_d, num_warps=4, **xf, **pdl_kwargs(),
        )
    return out


def _check_xform(xform: tuple[torch.Tensor, torch.Tensor] | None, q: torch.Tensor, d: int) -> dict:
    """The kernels' XFORM arguments (none without ``xform``)."""
    if xform is None:
        return {}
    suh, xh = xform
    width = q.shape[1] * d
    if d != 128 or suh.shape != (width,) or xh.shape != (q.shape[0], width) or xh.stride(1) != 1 \
            or xh.device != q.device or suh.device != q.device:
        raise ValueError(f"xform needs head_dim 128, suh [{width}] and xh [{q.shape[0]}, {width}] (contiguous rows) "
                         f"on {q.device}; got head_dim {d}, suh {tuple(suh.shape)}, xh {tuple(xh.shape)}")
    return {"xh_ptr": xh, "suh_ptr": suh, "stride_xh": xh.stride(0), "XFORM": True}


def _partials(out: torch.Tensor, bsz: int, num_splits: int, d: int, direct: bool) -> tuple:
    """(part_out [B, Hq, S, D], part_lse [B, Hq, S], their strides) in float32; with one
    split the kernel writes ``out`` directly and these are unused placeholders."""
    if direct:
        return out, out, (0, 0, 0), (0, 0)
    part_out = torch.empty(bsz, out.shape[1], num_splits, d, dtype=torch.float32, device=out.device)
    part_lse = torch.empty(bsz, out.shape[1], num_splits, dtype=torch.float32, device=out.device)
    return part_out, part_lse, part_out.stride()[:3], part_lse.stride()[:2]


def _check_counters(counters: torch.Tensor | None, need: int, device: torch.device) -> torch.Tensor:
    if counters is None:
        return torch.zeros(need, dtype=torch.int32, device=device)
    if counters.dtype != torch.int32 or counters.numel() < need or not counters.is_contiguous() \
            or counters.device != device:
        raise ValueError(f"counters must be a contiguous int32 tensor of >= {need} entries on {device}, "
                         f"got {counters.dtype} {tuple(counters.shape)} on {counters.device}")
    return counters


def paged_decode_ref(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, *, token_index: torch.Tensor | None = None,
                     out: torch.Tensor | None = None, max_seq_len: int | None = None,
                     num_splits: int | None = None, fused_reduce: bool = False,
                     counters: torch.Tensor | None = None) -> torch.Tensor:
    """Reference for ``paged_decode`` (either reduce): gathers each sequence's K/V and
    attends in float32."""
    page, hk, d, group = _check_cache(q, kv_cache)
    bsz = block_table.shape[0]
    rows = list(range(bsz)) if token_index is None else token_index.tolist()
    if out is None:
        out = torch.empty_like(q)
    for b, (row, n) in enumerate(zip(rows, seq_lens.tolist())):
        keys, vals = _gather(kv_cache, block_table[b], n)
        out[row] = _attend_fp32(q[row][None], keys, vals, scale, group, causal_offset=None)[0].to(out.dtype)
    return out


# ---- prefill -----------------------------------------------------------------------

@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, block_table_ptr, q_start_ptr, q_len_ptr, seq_lens_ptr, out_ptr,
    scale_log2,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_bt,
    stride_ot, stride_oh,
    GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):
    q_tile = tl.program_id(0)
    kvh = tl.program_id(1)
    s = tl.program_id(2)
    q_len = tl.load(q_len_ptr + s)
    m_start = q_tile * BLOCK_Q  # first query token (within the chunk) of this tile
    if m_start >= q_len:
        return
    q_start = tl.load(q_start_ptr + s)
    seq_len = tl.load(seq_lens_ptr + s)
    ctx = seq_len - q_len  # tokens cached before the chunk

    # Row r of the tile is query token m_start + r // GROUP, head kvh * GROUP + r % GROUP.
    offs_r = tl.arange(0, BLOCK_M)
    tok = m_start + offs_r // GROUP
    heads = kvh * GROUP + offs_r % GROUP
    r_mask = (offs_r < BLOCK_Q * GROUP) & (tok < q_len)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q_rows = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=r_mask[:, None] & d_mask[None, :], other=0.0)
    qpos = ctx + tok

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # Keys below ctx + m_start are visible to every row of the tile: whole tiles of
    # them need no mask. The rest (up to the tile's last query) are masked causally.
    full_end = (ctx + m_start) // BLOCK_N * BLOCK_N
    end = ctx + tl.minimum(m_start + BLOCK_Q, q_len)
    for n0 in range(0, full_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        blk = tl.load(block_table_ptr + s * stride_bt + offs_n // PAGE)
        kv_off = blk.to(tl.int64) * stride_kb + (offs_n % PAGE) * stride_ks + kvh * stride_kh
        k = tl.load(k_ptr + kv_off[:, None] + offs_d[None, :], mask=d_mask[None, :], other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + kv_off[:, None] + offs_d[None, :], mask=d_mask[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    # The first masked tile holds key full_end, visible to every row: no row is all -inf.
    for n0 in range(full_end, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        blk = tl.load(block_table_ptr + s * stride_bt + offs_n // PAGE, mask=n_mask, other=0)
        kv_off = blk.to(tl.int64) * stride_kb + (offs_n % PAGE) * stride_ks + kvh * stride_kh
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + kv_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        visible = (offs_n[None, :] <= qpos[:, None]) & n_mask[None, :]
        qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + kv_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    o = acc / l_i[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=r_mask[:, None] & d_mask[None, :])


def _prefill_tiles(group: int, d: int, interpret: bool) -> tuple[int, int, int, int]:
    """(BLOCK_M rows = query tokens x group heads, BLOCK_N keys, warps, stages)."""
    if interpret:
        return max(16, triton.next_power_of_2(group)), 16, 4, 1
    block_m = 128 if d <= 128 else 64
    return max(block_m, triton.next_power_of_2(group)), 64 if d <= 128 else 32, 8 if d >= 128 else 4, 2


def paged_prefill(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                  q_start: torch.Tensor, q_lens: torch.Tensor, seq_lens: torch.Tensor,
                  max_q_len: int, scale: float, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of N query chunks over their paged contexts, in one launch.

    q: [T, Hq, D] flat; chunk s is rows q_start[s] .. q_start[s] + q_lens[s] - 1, at
    positions seq_lens[s] - q_lens[s] ... seq_lens[s] - 1 of its sequence, whose first
    seq_lens[s] tokens (chunk included) are in the cache under block_table[s].
    q_start, q_lens, seq_lens: [N] (int32 preferred); block_table: [N, max_blocks];
    ``max_q_len``: a host int >= every q_lens (sizes the grid). Writes those rows of
    ``out`` (default: a new tensor like q); never synchronizes with the device.
    """
    page, hk, d, group = _check_cache(q, kv_cache)
    n = block_table.shape[0]
    if out is None:
        out = torch.empty_like(q)
    if n == 0 or max_q_len == 0:
        return out
    from trellm import envs

    block_m, block_n, warps, stages = _prefill_tiles(group, d, q.device.type == "cpu" and envs.triton_interpret())
    block_q = block_m // group
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    grid = (triton.cdiv(max_q_len, block_q), hk, n)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_table, q_start, q_lens, seq_lens, out,
        scale * _LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_table.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m, HEAD_DIM=d,
        BLOCK_D=max(16, triton.next_power_of_2(d)), PAGE=page, BLOCK_N=block_n,
        PRECISION=_dot_precision(q.dtype),
        num_warps=warps, num_stages=stages,
    )
    return out


def paged_prefill_ref(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                      q_start: torch.Tensor, q_lens: torch.Tensor, seq_lens: torch.Tensor,
                      max_q_len: int, scale: float, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Reference for ``paged_prefill``: per chunk, gather the context and attend in float32."""
    page, hk, d, group = _check_cache(q, kv_cache)
    if out is None:
        out = torch.empty_like(q)
    for s, (qs, ql, n) in enumerate(zip(q_start.tolist(), q_lens.tolist(), seq_lens.tolist())):
        keys, vals = _gather(kv_cache, block_table[s], n)
        out[qs:qs + ql] = _attend_fp32(q[qs:qs + ql], keys, vals, scale, group, causal_offset=n - ql).to(out.dtype)
    return out


def _gather(kv_cache: torch.Tensor, blocks: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first n tokens of a sequence's K and V: [n, Hk, D] each."""
    page, hk, d = kv_cache.shape[2:]
    nblk = math.ceil(n / page)
    kv = kv_cache.index_select(1, blocks[:nblk].long()).reshape(2, nblk * page, hk, d)[:, :n]
    return kv[0], kv[1]


def _attend_fp32(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, scale: float, group: int,
                 causal_offset: int | None) -> torch.Tensor:
    """Plain softmax attention in float32. q: [L, Hq, D]; keys, vals: [n, Hk, D].
    ``causal_offset``: query i sits at position causal_offset + i (None: sees all keys)."""
    qf = q.float().transpose(0, 1)                                    # [Hq, L, D]
    kf = keys.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, n, D]
    vf = vals.float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = (qf @ kf.transpose(1, 2)) * scale                         # [Hq, L, n]
    if causal_offset is not None:
        qpos = causal_offset + torch.arange(q.shape[0], device=q.device)
        visible = torch.arange(keys.shape[0], device=q.device)[None, :] <= qpos[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ vf).transpose(0, 1)        # [L, Hq, D]
