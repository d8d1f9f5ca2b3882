"""Rotary embedding fused with the KV-cache write, in Triton.

Rotate-half RoPE with the tables of trellm/layers/norm_rope.py: ``cos`` and a
*signed* ``sin`` (first half negated), so that for x = [x1, x2]
    out = [x1 * cos1 + x2 * sin1, x2 * cos2 + x1 * sin2].
Scaled RoPE (llama3, linear) only changes the tables. One program handles one token:
it rotates the token's q heads (into a new tensor) and k heads, and writes the
rotated k and the v to the cache slot ``slot_mapping[t]`` (a slot below 0 is skipped,
for padded CUDA-graph batches). ``write_kv`` is the same kernel without the rotation.

Tables are [T, D] (or [T, 1, D], as ``RotaryEmbedding.cos_sin`` returns them) per
token, or the whole [max_positions, D] tables plus ``positions`` to index them in
the kernel. Math is float32; each output is rounded once.

Qwen3's per-head q/k RMSNorm can ride along (``q_norm``/``k_norm`` = (weight, eps)):
the kernel already holds each head's row, so normalizing it there saves two launches
per layer; the unfused path rounds between norm and rotation, this one does not.
"""
from __future__ import annotations

import torch

from trellm.kernels._triton import tl, triton, pdl_begin, pdl_kwargs


@triton.jit
def _rope_kv_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr,
    k_cache_ptr, v_cache_ptr, q_out_ptr, qn_ptr, kn_ptr, q_eps, k_eps,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cos, stride_sin,
    stride_cb, stride_cs, stride_ch,
    stride_qot, stride_qoh,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, PAGE: tl.constexpr,
    HAS_ROPE: tl.constexpr, HAS_POS: tl.constexpr, HAS_QK_NORM: tl.constexpr, PDL: tl.constexpr = False,
):
    # Before the wait for the previous kernel: what no kernel of the forward writes (the
    # step's positions and slots, copied in before it; the tables), so only the q / k / v
    # loads wait on it. (The qkv projection's output is the one input it produces.)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_HALF)
    d_mask = offs < HALF
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if HAS_ROPE:
        row = t
        if HAS_POS:
            row = tl.load(pos_ptr + t).to(tl.int64)
        cos1 = tl.load(cos_ptr + row * stride_cos + offs, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        cos2 = tl.load(cos_ptr + row * stride_cos + HALF + offs, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        sin1 = tl.load(sin_ptr + row * stride_sin + offs, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        sin2 = tl.load(sin_ptr + row * stride_sin + HALF + offs, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    pdl_begin(PDL)
    hk = tl.arange(0, BLOCK_HK)
    k_mask = (hk < NUM_KV_HEADS)[:, None] & d_mask[None, :]
    k_row = k_ptr + t * stride_kt + hk[:, None] * stride_kh + offs[None, :]
    k1 = tl.load(k_row, mask=k_mask, other=0.0)
    k2 = tl.load(k_row + HALF, mask=k_mask, other=0.0)
    v_row = v_ptr + t * stride_vt + hk[:, None] * stride_vh + offs[None, :]
    v1 = tl.load(v_row, mask=k_mask, other=0.0)
    v2 = tl.load(v_row + HALF, mask=k_mask, other=0.0)
    if HAS_ROPE:
        hq = tl.arange(0, BLOCK_HQ)
        q_mask = (hq < NUM_Q_HEADS)[:, None] & d_mask[None, :]
        q_row = q_ptr + t * stride_qt + hq[:, None] * stride_qh + offs[None, :]
        q1 = tl.load(q_row, mask=q_mask, other=0.0).to(tl.float32)
        q2 = tl.load(q_row + HALF, mask=q_mask, other=0.0).to(tl.float32)
        if HAS_QK_NORM:
            q1, q2 = _head_rms_norm(q1, q2, qn_ptr, offs, d_mask, q_eps, HALF)
        out_row = q_out_ptr + t * stride_qot + hq[:, None] * stride_qoh + offs[None, :]
        odt = q_out_ptr.dtype.element_ty
        tl.store(out_row, (q1 * cos1 + q2 * sin1).to(odt), mask=q_mask)
        tl.store(out_row + HALF, (q2 * cos2 + q1 * sin2).to(odt), mask=q_mask)

        k1f = k1.to(tl.float32)
        k2f = k2.to(tl.float32)
        if HAS_QK_NORM:
            k1f, k2f = _head_rms_norm(k1f, k2f, kn_ptr, offs, d_mask, k_eps, HALF)
        k1 = k1f * cos1 + k2f * sin1
        k2 = k2f * cos2 + k1f * sin2

    if slot >= 0:
        cdt = k_cache_ptr.dtype.element_ty
        dst = (slot // PAGE) * stride_cb + (slot % PAGE) * stride_cs + hk[:, None] * stride_ch + offs[None, :]
        tl.store(k_cache_ptr + dst, k1.to(cdt), mask=k_mask)
        tl.store(k_cache_ptr + dst + HALF, k2.to(cdt), mask=k_mask)
        tl.store(v_cache_ptr + dst, v1.to(cdt), mask=k_mask)
        tl.store(v_cache_ptr + dst + HALF, v2.to(cdt), mask=k_mask)


@triton.jit
def _head_rms_norm(x1, x2, w_ptr, offs, d_mask, eps, HALF: tl.constexpr):
    """RMSNorm of each head row [H, half] + [H, half] with weight [2 * half]."""
    ms = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF)
    r = (1.0 / tl.sqrt(ms + eps))[:, None]
    w1 = tl.load(w_ptr + offs, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    w2 = tl.load(w_ptr + HALF + offs, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    return x1 * r * w1, x2 * r * w2


def _table_2d(t: torch.Tensor) -> torch.Tensor:
    t = t.reshape(t.shape[0], t.shape[-1]) if t.dim() == 3 else t
    return t if t.stride(-1) == 1 else t.contiguous()


def _launch(q: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor | None,
            sin: torch.Tensor | None, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
            positions: torch.Tensor | None, q_norm=None, k_norm=None) -> torch.Tensor | None:
    t, hk, d = k.shape
    if d % 2:
        raise ValueError(f"head_dim must be even, got {d}")
    if kv_cache.shape[0] != 2 or tuple(kv_cache.shape[3:]) != (hk, d) or kv_cache.stride(4) != 1:
        raise ValueError(f"kv_cache {tuple(kv_cache.shape)} does not fit k {tuple(k.shape)}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x is not None and x.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous last dimension")
    has_rope = q is not None
    if has_rope:
        cos, sin = _table_2d(cos), _table_2d(sin)
        q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    else:
        q, cos, sin, q_out = k, k, k, k  # placeholders, never read
    if t == 0:
        return q_out if has_rope else None
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    half = d // 2
    has_norm = q_norm is not None
    (qn, q_eps), (kn, k_eps) = (q_norm, k_norm) if has_norm else ((k, 0.0), (k, 0.0))
    _rope_kv_kernel[(t,)](
        q, k, v, cos, sin, positions if positions is not None else slot_mapping, slot_mapping,
        k_cache, v_cache, q_out, qn, kn, float(q_eps), float(k_eps),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos.stride(0), sin.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        q_out.stride(0), q_out.stride(1),
        NUM_Q_HEADS=q.shape[1], NUM_KV_HEADS=hk, HALF=half,
        BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_HQ=triton.next_power_of_2(q.shape[1]), BLOCK_HK=triton.next_power_of_2(hk),
        PAGE=kv_cache.shape[2], HAS_ROPE=has_rope, HAS_POS=positions is not None,
        HAS_QK_NORM=has_norm, num_warps=4, **pdl_kwargs(),
    )
    return q_out if has_rope else None


def rope_and_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      positions: torch.Tensor | None = None, q_norm: tuple | None = None,
                      k_norm: tuple | None = None) -> torch.Tensor:
    """Rotate q and k, write rotated k and v to the cache; returns the rotated q.
    ``q_norm``/``k_norm``: (weight [D], eps) of a per-head RMSNorm applied first (both or neither).

    q: [T, Hq, D], k, v: [T, Hk, D] (strided views of a qkv tensor are fine);
    cos, sin (signed): [T, D] / [T, 1, D], or [P, D] with ``positions`` [T];
    kv_cache: [2, num_blocks, block_size, Hk, D]; slot_mapping: [T] (< 0: skip).
    """
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm and k_norm come together")
    return _launch(q, k, v, cos, sin, kv_cache, slot_mapping, positions, q_norm, k_norm)


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write k and v [T, Hk, D] to the cache slots (< 0: skip)."""
    _launch(None, k, v, None, None, kv_cache, slot_mapping, None)


def _rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return xf * cos + xf.roll(x.shape[-1] // 2, dims=-1) * sin


def rope_and_write_kv_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                          sin: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                          positions: torch.Tensor | None = None, q_norm: tuple | None = None,
                          k_norm: tuple | None = None) -> torch.Tensor:
    """Reference: RotaryEmbedding.forward's arithmetic in float32, then write_kv_ref."""
    if q_norm is not None:
        q, k = _head_norm_ref(q, *q_norm), _head_norm_ref(k, *k_norm)
    cos, sin = _table_2d(cos).float(), _table_2d(sin).float()
    if positions is not None:
        cos, sin = cos[positions.long()], sin[positions.long()]
    cos, sin = cos[:, None, :], sin[:, None, :]
    write_kv_ref(_rotate_ref(k, cos, sin), v, kv_cache, slot_mapping)
    return _rotate_ref(q, cos, sin).to(q.dtype)


def _head_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


def write_kv_ref(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    _, nb, bs, hk, d = kv_cache.shape
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    kv_cache[0].view(nb * bs, hk, d).index_copy_(0, slots, k[keep].to(kv_cache.dtype))
    kv_cache[1].view(nb * bs, hk, d).index_copy_(0, slots, v[keep].to(kv_cache.dtype))
