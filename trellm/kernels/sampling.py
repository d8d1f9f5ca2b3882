"""Next-token sampling on the GPU with no host synchronization.

Three steps, all on the device:

1. The candidates: ``torch.topk(max_top_k)`` of each row when every sampled row has
   a top_k <= ``max_top_k`` (a host int), else a full descending sort.
2. ``_threshold_kernel`` (Triton, one program a row) walks the sorted candidates and
   reduces the row's temperature, min_p, top_k and top_p to one *raw-logit cutoff*:
   the row keeps exactly the tokens whose logit is >= it (each filter keeps a prefix
   of the sorted row, so their composition is a prefix too).
3. ``_sample_kernel`` (Triton): one pass over the vocabulary, split in chunks across
   programs (then a first-max over the chunks' winners): an exponential race
   (Gumbel-max) ``argmax(logit / T - log q)`` over the kept tokens, q ~ Exp(1) from
   Philox keyed by the row's seed (or a given noise tensor, for tests). Greedy rows
   (temperature < 1e-5) take the argmax of the raw logits, ties going to the lowest
   id as in ``torch.argmax``. No softmax or [B, V] noise tensor is materialized.

About seven launches a call, whatever the filters; capturable in a CUDA graph. On an
H200 in a CUDA graph: B=1, V=128k: 16 us unfiltered, 77 us on the topk path (topk
is most of it), ~250 us on the sort path (the threshold kernel's single program per
row walks all 128k sorted logits twice); B=64, V=152k: 0.23 ms topk path, 1 ms sort.

Semantics are trellm/worker/sampler.py's (vLLM order: temperature, min_p, top_k,
top_p over the renormalized survivors, the most likely token always kept), except
that tokens *tied* with the cutoff logit are all kept (the sorted reference keeps
ties for top_k, and for top_p/min_p only those the sort happened to put first).
Penalties, logit bias and min_tokens are applied to the logits beforehand.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from trellm.kernels._triton import tl, triton

GREEDY_EPS = 1e-5
"""Temperatures below this are greedy (trellm/worker/sampler.py _SAMPLING_EPS)."""

_BLOCK_V = 1024
_BLOCKS_PER_CHUNK = 4
"""Each program scans 4 blocks of 1024 logits: a 150k vocabulary is ~37 programs a row."""


@dataclass
class SamplingTensors:
    """Per-row sampling parameters, on the logits' device, built once per step."""

    temperature: torch.Tensor
    """[B] float32; < GREEDY_EPS means greedy."""
    seeds: torch.Tensor
    """[B] int64 Philox key per row: derive it from (request seed, output position) for
    seeded requests and from a per-step random number for the others. Two rows with the
    same seed draw the same noise."""
    top_k: torch.Tensor | None = None
    """[B] int; <= 0 or >= vocab: no limit. None: no row limits."""
    top_p: torch.Tensor | None = None
    """[B] float32 in (0, 1]; 1: no limit. None: no row limits."""
    min_p: torch.Tensor | None = None
    """[B] float32 in [0, 1]; 0: no limit. None: no row limits."""
    max_top_k: int | None = None
    """Host int >= every sampled row's top_k when every non-greedy row has one: only the
    top max_top_k logits are then examined (torch.topk, no full sort). None: sort."""


@triton.jit
def _sample_kernel(
    logits_ptr, thr_ptr, temp_ptr, seeds_ptr, noise_ptr, part_v_ptr, part_i_ptr,
    vocab, stride_l, stride_n, num_chunks, greedy_eps,
    BLOCK: tl.constexpr, CHUNK: tl.constexpr, HAS_THR: tl.constexpr, HAS_NOISE: tl.constexpr,
):
    # Program (row, c) scans logits[row, c * CHUNK : (c + 1) * CHUNK] and writes its best
    # (score, id); the caller takes the first best chunk (lowest ids win ties).
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    t = tl.load(temp_ptr + row).to(tl.float32)
    greedy = t < greedy_eps
    inv_t = 1.0 / tl.maximum(t, greedy_eps)
    thr = float("-inf")
    if HAS_THR:
        thr = tl.load(thr_ptr + row)  # -inf on greedy rows
    seed = tl.load(seeds_ptr + row)
    best_v = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    best_i = tl.full([BLOCK], 2147483647, dtype=tl.int32)
    for v0 in range(c * CHUNK, tl.minimum((c + 1) * CHUNK, vocab), BLOCK):
        offs = v0 + tl.arange(0, BLOCK)
        m = offs < vocab
        x = tl.load(logits_ptr + row * stride_l + offs, mask=m, other=float("-inf")).to(tl.float32)
        if HAS_NOISE:
            q = tl.load(noise_ptr + row * stride_n + offs, mask=m, other=1.0).to(tl.float32)
        else:
            q = -tl.log(tl.rand(seed, offs))  # Exp(1); u == 0 gives q = inf: never picked
        score = tl.where(greedy, x, x * inv_t - tl.log(q))
        keep = m & (x >= thr)
        score = tl.where(keep, score, float("-inf"))
        upd = (score > best_v) | ((best_i == 2147483647) & m)  # strict: the lowest id wins within a lane
        best_v = tl.where(upd, score, best_v)
        best_i = tl.where(upd, offs, best_i)
    top = tl.max(best_v, 0)
    tok = tl.min(tl.where(best_v == top, best_i, 2147483647), 0)
    tl.store(part_v_ptr + row * num_chunks + c, top)
    tl.store(part_i_ptr + row * num_chunks + c, tok)


@triton.jit
def _threshold_kernel(
    vals_ptr, temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, thr_ptr,
    width, stride_v, greedy_eps,
    BLOCK: tl.constexpr, HAS_K: tl.constexpr, HAS_P: tl.constexpr, HAS_MIN_P: tl.constexpr,
):
    # vals: each row's candidates sorted descending. Filters in the engine sampler's
    # order: min_p (prob >= min_p * max prob), top_k of the survivors (ties with the k-th
    # kept), top_p over the renormalized survivors (a token goes once the mass strictly
    # before it reaches top_p; the first always stays).
    row = tl.program_id(0).to(tl.int64)
    base = vals_ptr + row * stride_v
    t = tl.load(temp_ptr + row).to(tl.float32)
    greedy = t < greedy_eps
    t = tl.maximum(t, greedy_eps)
    s0 = tl.load(base) / t
    kth = float("-inf")
    if HAS_K:
        k = tl.load(top_k_ptr + row).to(tl.int32)
        k = tl.where((k <= 0) | (k > width), width, k)
        kth = tl.load(base + k - 1)
        if HAS_MIN_P:  # fewer than k survive min_p: the k-th survivor is -inf
            mp = tl.load(min_p_ptr + row).to(tl.float32)
            kth = tl.where(tl.exp(kth / t - s0) < mp, float("-inf"), kth)
    mp = 0.0
    if HAS_MIN_P:
        mp = tl.load(min_p_ptr + row).to(tl.float32)
    # Pass 1: how many survive min_p and top_k, and their softmax normalizer.
    n_keep = 0
    z = 0.0
    for v0 in range(0, width, BLOCK):
        offs = v0 + tl.arange(0, BLOCK)
        v = tl.load(base + offs, mask=offs < width, other=float("-inf"))
        e = tl.exp(v / t - s0)
        keep = (v >= kth) & (e >= mp) & (v > float("-inf"))
        n_keep += tl.sum(keep.to(tl.int32), 0)
        z += tl.sum(tl.where(keep, e, 0.0), 0)
    if HAS_P:
        # Pass 2: the nucleus is the prefix whose mass strictly before each token is < top_p.
        top_p = tl.load(top_p_ptr + row).to(tl.float32)
        carry = 0.0
        n_nucleus = 0
        for v0 in range(0, width, BLOCK):
            offs = v0 + tl.arange(0, BLOCK)
            inside = offs < n_keep
            v = tl.load(base + offs, mask=inside, other=float("-inf"))
            p = tl.where(inside, tl.exp(v / t - s0) / z, 0.0)
            before = carry + tl.cumsum(p, 0) - p
            n_nucleus += tl.sum((inside & ((before < top_p) | (offs == 0))).to(tl.int32), 0)
            carry += tl.sum(p, 0)
        n_keep = n_nucleus
    n_keep = tl.maximum(n_keep, 1)
    thr = tl.load(base + n_keep - 1)
    tl.store(thr_ptr + row, tl.where(greedy, float("-inf"), thr))


def keep_threshold(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """[B] float32 raw-logit cutoff: a row keeps the tokens with logit >= it (-inf on
    greedy rows)."""
    x = logits if logits.dtype == torch.float32 else logits.float()
    bsz, vocab = x.shape
    if st.max_top_k is not None and st.max_top_k < vocab:
        vals = x.topk(max(st.max_top_k, 1), dim=-1).values  # sorted, descending
    else:
        vals = x.sort(dim=-1, descending=True).values
    thr = torch.empty(bsz, dtype=torch.float32, device=x.device)
    dummy = st.temperature
    _threshold_kernel[(bsz,)](
        vals, st.temperature, st.top_k if st.top_k is not None else dummy,
        st.top_p if st.top_p is not None else dummy, st.min_p if st.min_p is not None else dummy, thr,
        vals.shape[1], vals.stride(0), GREEDY_EPS,
        BLOCK=min(_BLOCK_V, triton.next_power_of_2(vals.shape[1])),
        HAS_K=st.top_k is not None, HAS_P=st.top_p is not None, HAS_MIN_P=st.min_p is not None,
        num_warps=4,
    )
    return thr


def sample(logits: torch.Tensor, st: SamplingTensors, noise: torch.Tensor | None = None) -> torch.Tensor:
    """One token id per row of ``logits`` [B, V] (any float dtype): [B] int64 on the device.
    ``noise``: optional [B, V] Exp(1) draws replacing the kernel's RNG (tests)."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [B, V], got {tuple(logits.shape)}")
    bsz, vocab = logits.shape
    if bsz == 0:
        return torch.empty(0, dtype=torch.long, device=logits.device)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    filtered = st.top_k is not None or st.top_p is not None or st.min_p is not None
    thr = keep_threshold(logits, st) if filtered else None
    if noise is not None and noise.stride(-1) != 1:
        noise = noise.contiguous()
    block = min(_BLOCK_V, triton.next_power_of_2(vocab))
    chunk = block * _BLOCKS_PER_CHUNK
    num_chunks = triton.cdiv(vocab, chunk)
    part_v = torch.empty(bsz, num_chunks, dtype=torch.float32, device=logits.device)
    part_i = torch.empty(bsz, num_chunks, dtype=torch.int32, device=logits.device)
    _sample_kernel[(bsz, num_chunks)](
        logits, thr if thr is not None else st.temperature, st.temperature, st.seeds,
        noise if noise is not None else logits, part_v, part_i,
        vocab, logits.stride(0), noise.stride(0) if noise is not None else 0, num_chunks, GREEDY_EPS,
        BLOCK=block, CHUNK=chunk, HAS_THR=thr is not None, HAS_NOISE=noise is not None,
        num_warps=4,
    )
    if num_chunks == 1:
        return part_i[:, 0].long()
    # argmax returns the first maximum: the lowest chunk, whose id is its lowest tied id.
    return part_i.gather(1, part_v.argmax(dim=1, keepdim=True))[:, 0].long()


def sample_ref(logits: torch.Tensor, st: SamplingTensors, noise: torch.Tensor | None = None) -> torch.Tensor:
    """Reference: the engine's CPU sampler arithmetic (sort-based top-k/top-p, softmax,
    exponential race argmax(p / q)), row by row. Without ``noise`` it draws its own."""
    from trellm.worker.sampler import _apply_min_p_, _apply_top_k_top_p

    x_all = logits.float()
    bsz, vocab = x_all.shape
    out = torch.empty(bsz, dtype=torch.long, device=logits.device)
    for i in range(bsz):
        t = float(st.temperature[i])
        if t < GREEDY_EPS:
            out[i] = x_all[i].argmax()
            continue
        x = x_all[i:i + 1] / t
        if st.min_p is not None and float(st.min_p[i]) > 0:
            _apply_min_p_(x, st.min_p[i:i + 1].float())
        k = int(st.top_k[i]) if st.top_k is not None else 0
        p = float(st.top_p[i]) if st.top_p is not None else 1.0
        if 0 < k < vocab or p < 1.0:
            kk = torch.tensor([k if 0 < k < vocab else vocab], device=x.device)
            pp = torch.tensor([p if p < 1.0 else 2.0], device=x.device)
            x = _apply_top_k_top_p(x, kk, pp)
        probs = torch.softmax(x, dim=-1)[0]
        q = noise[i].float() if noise is not None else torch.empty_like(probs).exponential_()
        out[i] = (probs / q).argmax()
    return out
