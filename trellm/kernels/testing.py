"""Kernel-vs-reference checks shared by tests/kernels/ and scripts/gpu_kernel_check.py.

Each ``check_*`` builds seeded random inputs of the given shape, runs the kernel and
its reference, and returns a ``CheckResult`` (optionally with timings). References
run in float32 on the same (rounded) inputs unless the op's reference *is* the
model's rounded arithmetic (norm, residual), which the kernel reproduces.

Tolerances: |kernel - ref| <= atol + rtol * |ref| elementwise, per dtype
(``TOLERANCES``): about one rounding of the output dtype at O(1) values (bf16 has
8 mantissa bits: half an ulp at 2..4 is 0.0078), fp32 loose enough for
approximate exp2/rsqrt and a different summation order.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

import torch

from trellm.kernels import activation, paged_attention, rmsnorm, rope_kv, sampling


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float


TOLERANCES = {
    torch.float32: Tolerance(1e-4, 1e-4),
    torch.float16: Tolerance(4e-3, 2e-3),
    torch.bfloat16: Tolerance(1.6e-2, 1e-2),
}
EXACT = Tolerance(0.0, 0.0)


def quant_tolerance(dtype: torch.dtype, fp16_operands: bool) -> Tolerance:
    """Quantized linears (EXL3, int8; trellm/kernels/quant_testing.py): the output dtype's
    tolerance, at least fp16's where a path rounds its activations to fp16 (EXL3's
    GEMM and reconstruct paths, as ExLlamaV3 does) or multiplies in bf16/fp16."""
    tol = TOLERANCES[dtype]
    if not fp16_operands:
        return tol
    fp16 = TOLERANCES[torch.float16]
    return Tolerance(max(tol.atol, fp16.atol), max(tol.rtol, fp16.rtol))


@dataclass
class CheckResult:
    kernel: str
    shape: str
    dtype: str
    max_abs_err: float
    """For sampling: the number of rows whose token differs."""
    atol: float
    rtol: float
    passed: bool
    kernel_us: float | None = None
    ref_us: float | None = None

    def __str__(self) -> str:
        return (f"{self.kernel} {self.shape} {self.dtype}: max abs err {self.max_abs_err:.3g} "
                f"(atol {self.atol:g}, rtol {self.rtol:g}) {'ok' if self.passed else 'FAIL'}")


def compare(kernel: str, shape: str, got: torch.Tensor, want: torch.Tensor, tol: Tolerance,
            dtype: torch.dtype) -> CheckResult:
    got, want = got.float(), want.float()
    if got.shape != want.shape:
        raise ValueError(f"{kernel}: shape {tuple(got.shape)} vs reference {tuple(want.shape)}")
    err = (got - want).abs()
    finite = torch.isfinite(got) == torch.isfinite(want)
    ok = bool(finite.all()) and bool((err <= tol.atol + tol.rtol * want.abs()).all()) if err.numel() else True
    max_err = float(err[torch.isfinite(err)].max()) if err.numel() and torch.isfinite(err).any() else 0.0
    return CheckResult(kernel, shape, str(dtype).removeprefix("torch."), max_err, tol.atol, tol.rtol, ok)


def time_us(fn: Callable[[], object], device: torch.device, iters: int = 20, warmup: int = 3) -> float:
    """Mean wall time of fn in microseconds (CUDA events on a GPU)."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) * 1000.0 / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) * 1e6 / iters


def _timed(res: CheckResult, kernel: Callable, ref: Callable, device: torch.device, timing: bool,
           ref_iters: int = 3) -> CheckResult:
    if timing:
        res.kernel_us = time_us(kernel, device)
        res.ref_us = time_us(ref, device, iters=ref_iters, warmup=1)
    return res


# ---- paged attention -----------------------------------------------------------------

def paged_cache(seq_lens: list[int], page: int, hk: int, d: int, dtype: torch.dtype, device: torch.device,
                gen: torch.Generator, spare_blocks: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """A random KV cache and a block table giving each sequence distinct, shuffled blocks
    (int32 [B, max_blocks], padded with 0)."""
    need = [math.ceil(n / page) for n in seq_lens]
    num_blocks = sum(need) + spare_blocks
    # Drawn on the device (32k+ contexts make CPU draws slow), seeded from gen.
    dev_gen = torch.Generator(device=device).manual_seed(int(torch.randint(2**62, (1,), generator=gen)))
    kv = torch.randn(2, num_blocks, page, hk, d, generator=dev_gen, device=device).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros(len(seq_lens), max(need + [1]), dtype=torch.int32)
    used = 0
    for i, n in enumerate(need):
        table[i, :n] = perm[used:used + n]
        used += n
    return kv, table.to(device)


def check_paged_decode(seq_lens: list[int], hq: int, hk: int, d: int, dtype: torch.dtype,
                       device: torch.device, page: int = 16, num_splits: int | None = None,
                       lead_rows: int = 0, seed: int = 0, timing: bool = False) -> CheckResult:
    """Decode rows placed after ``lead_rows`` other rows of a flat batch, in reverse order."""
    gen = torch.Generator().manual_seed(seed)
    kv, table = paged_cache(seq_lens, page, hk, d, dtype, device, gen)
    bsz = len(seq_lens)
    q = torch.randn(lead_rows + bsz, hq, d, generator=gen).to(dtype).to(device)
    token_index = torch.arange(lead_rows + bsz - 1, lead_rows - 1, -1, dtype=torch.int32, device=device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    scale = d ** -0.5
    out = torch.zeros_like(q)

    def kernel():
        return paged_attention.paged_decode(q, kv, table, lens, scale, token_index=token_index, out=out,
                                            max_seq_len=max(seq_lens), num_splits=num_splits)

    def ref():
        return paged_attention.paged_decode_ref(q, kv, table, lens, scale, token_index=token_index,
                                                out=torch.zeros(q.shape, dtype=torch.float32, device=device))

    got, want = kernel(), ref()
    rows = token_index.long()
    shape = f"B={bsz} lens={_short(seq_lens)} hq={hq} hk={hk} d={d} page={page} splits={num_splits or 'auto'}"
    res = compare("paged_decode", shape, got[rows], want[rows], TOLERANCES[dtype], dtype)
    return _timed(res, kernel, ref, device, timing)


def check_paged_prefill(chunks: list[tuple[int, int]], hq: int, hk: int, d: int, dtype: torch.dtype,
                        device: torch.device, page: int = 16, lead_rows: int = 0, seed: int = 0,
                        timing: bool = False) -> CheckResult:
    """``chunks``: (q_len, seq_len) per sequence; chunks follow ``lead_rows`` other rows."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [s for _, s in chunks]
    kv, table = paged_cache(seq_lens, page, hk, d, dtype, device, gen)
    starts, pos = [], lead_rows
    for ql, _ in chunks:
        starts.append(pos)
        pos += ql
    q = torch.randn(pos, hq, d, generator=gen).to(dtype).to(device)
    i32 = dict(dtype=torch.int32, device=device)
    q_start = torch.tensor(starts, **i32)
    q_lens = torch.tensor([ql for ql, _ in chunks], **i32)
    lens = torch.tensor(seq_lens, **i32)
    max_q = max(ql for ql, _ in chunks)
    scale = d ** -0.5
    out = torch.zeros_like(q)

    def kernel():
        return paged_attention.paged_prefill(q, kv, table, q_start, q_lens, lens, max_q, scale, out=out)

    def ref():
        return paged_attention.paged_prefill_ref(q, kv, table, q_start, q_lens, lens, max_q, scale,
                                                 out=torch.zeros(q.shape, dtype=torch.float32, device=device))

    got, want = kernel(), ref()
    shape = f"N={len(chunks)} (q_len,seq_len)={_short(chunks)} hq={hq} hk={hk} d={d} page={page}"
    res = compare("paged_prefill", shape, got[lead_rows:], want[lead_rows:], TOLERANCES[dtype], dtype)
    return _timed(res, kernel, ref, device, timing)


def _short(xs: list) -> str:
    s = ",".join(str(x).replace(" ", "") for x in xs)
    return f"[{s}]" if len(s) <= 60 else f"[{s[:57]}...]"


# ---- norm, activation ----------------------------------------------------------------

def check_fused_add_rms_norm(rows: int, hidden: int, dtype: torch.dtype, device: torch.device,
                             seed: int = 0, timing: bool = False) -> list[CheckResult]:
    """Normed output vs the model's rounded arithmetic; the residual sum must be exact."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=gen).to(dtype).to(device)
    res = torch.randn(rows, hidden, generator=gen).to(dtype).to(device)
    w = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype).to(device)
    eps = 1e-6
    got, got_res = rmsnorm.fused_add_rms_norm(x, res, w, eps)
    want, want_res = rmsnorm.fused_add_rms_norm_ref(x, res, w, eps)
    shape = f"rows={rows} hidden={hidden}"
    out = compare("fused_add_rms_norm", shape, got, want, TOLERANCES[dtype], dtype)
    exact = compare("fused_add_rms_norm.residual", shape, got_res, want_res, EXACT, dtype)
    _timed(out, lambda: rmsnorm.fused_add_rms_norm(x, res, w, eps),
           lambda: rmsnorm.fused_add_rms_norm_ref(x, res, w, eps), device, timing, ref_iters=10)
    return [out, exact]


def check_rms_norm(rows: int, hidden: int, dtype: torch.dtype, device: torch.device, seed: int = 0,
                   timing: bool = False) -> CheckResult:
    gen = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(rows, hidden, generator=gen)).to(dtype).to(device)
    w = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype).to(device)
    got = rmsnorm.rms_norm(x, w, 1e-5)
    want = rmsnorm.rms_norm_ref(x, w, 1e-5)
    res = compare("rms_norm", f"rows={rows} hidden={hidden}", got, want, TOLERANCES[dtype], dtype)
    return _timed(res, lambda: rmsnorm.rms_norm(x, w, 1e-5), lambda: rmsnorm.rms_norm_ref(x, w, 1e-5),
                  device, timing, ref_iters=10)


def check_gemv(rows: int, n: int, k: int, dtype: torch.dtype, device: torch.device, bias: bool = False,
               seed: int = 0, timing: bool = False) -> CheckResult:
    """The skinny GEMM against float32 math; inputs scaled so outputs stay O(1)."""
    from trellm.kernels import gemv as g

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen).to(dtype).to(device)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype).to(device)
    b = torch.randn(n, generator=gen).to(dtype).to(device) if bias else None
    res = compare("gemv", f"M={rows} N={n} K={k}{' bias' if bias else ''}", g.gemv(x, w, b),
                  g.gemv_ref(x, w, b), TOLERANCES[dtype], dtype)
    _timed(res, lambda: g.gemv(x, w, b), lambda: g.gemv_ref(x, w, b), device, timing)
    return res


def check_silu_and_mul(rows: int, inter: int, dtype: torch.dtype, device: torch.device, seed: int = 0,
                       timing: bool = False) -> CheckResult:
    gen = torch.Generator().manual_seed(seed)
    x = (2 * torch.randn(rows, 2 * inter, generator=gen)).to(dtype).to(device)
    got = activation.silu_and_mul(x)
    want = activation.silu_and_mul_ref(x.float())
    res = compare("silu_and_mul", f"rows={rows} inter={inter}", got, want, TOLERANCES[dtype], dtype)
    return _timed(res, lambda: activation.silu_and_mul(x), lambda: activation.silu_and_mul_ref(x),
                  device, timing, ref_iters=10)


# ---- rope + kv write -----------------------------------------------------------------

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def rope_tables(d: int, max_pos: int, scaling: dict | None, device: torch.device
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(inv_freq, cos [P, D], signed sin [P, D]) in float32, as RotaryEmbedding builds them."""
    from trellm.layers.norm_rope import _cos_sin, rope_inv_freq

    inv = rope_inv_freq(d, 500000.0, scaling)
    c, s = _cos_sin(torch.outer(torch.arange(max_pos, dtype=torch.float32), inv))
    cos = torch.cat((c, c), dim=-1)
    sin = torch.cat((-s, s), dim=-1)
    return inv, cos.to(device), sin.to(device)


def check_rope_and_write_kv(tokens: int, hq: int, hk: int, d: int, dtype: torch.dtype, device: torch.device,
                            scaling: dict | None = None, with_positions: bool = True, page: int = 16,
                            skip_some_slots: bool = True, seed: int = 0, timing: bool = False,
                            qk_norm: bool = False) -> list[CheckResult]:
    """q out and the written cache vs the float32 reference; q (float32 inputs) also
    against trellm.layers.norm_rope.rope_reference (transformers' arithmetic)."""
    from trellm.layers.norm_rope import rope_reference

    gen = torch.Generator().manual_seed(seed)
    max_pos = 40000
    inv, cos_all, sin_all = rope_tables(d, max_pos, scaling, device)
    positions = torch.randint(0, max_pos, (tokens,), generator=gen).to(device)
    qkv = torch.randn(tokens, (hq + 2 * hk) * d, generator=gen).to(dtype).to(device)
    q, k, v = (t.view(tokens, -1, d) for t in qkv.split([hq * d, hk * d, hk * d], dim=-1))  # strided views
    num_blocks = tokens // page + 2
    slots = torch.randperm(num_blocks * page, generator=gen)[:tokens]
    if skip_some_slots and tokens > 2:
        slots[1] = -1  # a padded row: must not be written
    slots = slots.to(device)
    cache_k = torch.zeros(2, num_blocks, page, hk, d, dtype=dtype, device=device)
    cache_r = cache_k.clone()
    if with_positions:
        args = (cos_all, sin_all, positions)
    else:
        args = (cos_all[positions][:, None, :].to(dtype), sin_all[positions][:, None, :].to(dtype), None)
    norms = {}
    if qk_norm:  # Qwen3's per-head q/k RMSNorm, fused in
        norms = {"q_norm": ((1 + 0.1 * torch.randn(d, generator=gen)).to(dtype).to(device), 1e-6),
                 "k_norm": ((1 + 0.1 * torch.randn(d, generator=gen)).to(dtype).to(device), 1e-6)}
    got_q = rope_kv.rope_and_write_kv(q, k, v, args[0], args[1], cache_k, slots, positions=args[2], **norms)
    want_q = rope_kv.rope_and_write_kv_ref(q, k, v, args[0], args[1], cache_r, slots, positions=args[2], **norms)
    tol = TOLERANCES[dtype]
    shape = (f"T={tokens} hq={hq} hk={hk} d={d} {'llama3' if scaling else 'plain'}"
             f"{' positions' if with_positions else ' per-token tables'}{' qk-norm' if qk_norm else ''}")
    results = [compare("rope_and_write_kv.q", shape, got_q, want_q, tol, dtype),
               compare("rope_and_write_kv.cache", shape, cache_k, cache_r, tol, dtype)]
    if dtype == torch.float32 and with_positions and not qk_norm:
        oracle = rope_reference(q.cpu(), positions.cpu(), inv).to(device)
        results.append(compare("rope_and_write_kv.q_vs_transformers", shape, got_q, oracle,
                               Tolerance(1e-5, 1e-5), dtype))
    _timed(results[0], lambda: rope_kv.rope_and_write_kv(q, k, v, args[0], args[1], cache_k, slots, positions=args[2]),
           lambda: rope_kv.rope_and_write_kv_ref(q, k, v, args[0], args[1], cache_r, slots, positions=args[2]),
           device, timing, ref_iters=10)
    return results


def check_write_kv(tokens: int, hk: int, d: int, dtype: torch.dtype, device: torch.device, page: int = 16,
                   seed: int = 0) -> CheckResult:
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(tokens, hk, d, generator=gen).to(dtype).to(device)
    v = torch.randn(tokens, hk, d, generator=gen).to(dtype).to(device)
    num_blocks = tokens // page + 2
    slots = torch.randperm(num_blocks * page, generator=gen)[:tokens]
    if tokens > 2:
        slots[-1] = -1
    slots = slots.to(device)
    a = torch.zeros(2, num_blocks, page, hk, d, dtype=dtype, device=device)
    b = a.clone()
    rope_kv.write_kv(k, v, a, slots)
    rope_kv.write_kv_ref(k, v, b, slots)
    return compare("write_kv", f"T={tokens} hk={hk} d={d} page={page}", a, b, EXACT, dtype)


# ---- sampling --------------------------------------------------------------------------

def sampling_case(bsz: int, vocab: int, device: torch.device, gen: torch.Generator, *, greedy_rows: int = 1,
                  top_k: bool = True, top_p: bool = True, min_p: bool = False,
                  ) -> sampling.SamplingTensors:
    """Mixed rows: the first ``greedy_rows`` greedy, the rest with random parameters."""
    temp = 0.3 + 1.2 * torch.rand(bsz, generator=gen)
    temp[:greedy_rows] = 0.0
    ks = torch.randint(1, min(vocab, 50) + 1, (bsz,), generator=gen) if top_k else None
    ps = (0.5 + 0.5 * torch.rand(bsz, generator=gen)) if top_p else None
    if ps is not None and bsz > greedy_rows + 1:
        ps[-1] = 1.0  # a row without a nucleus
    mps = (0.2 * torch.rand(bsz, generator=gen)) if min_p else None
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    return sampling.SamplingTensors(
        temperature=temp.to(device), seeds=torch.randint(0, 2**62, (bsz,), generator=gen).to(device),
        top_k=to(ks), top_p=to(ps), min_p=to(mps), max_top_k=int(ks.max()) if ks is not None else None)


def _without_ties(logits: torch.Tensor) -> torch.Tensor:
    """Each row's repeated values (common in bf16) set to -inf but the first: the kernel
    keeps every token tied with a cutoff, the sorted reference only some, by design."""
    vals, idx = logits.float().sort(dim=-1)
    dup = torch.zeros_like(vals, dtype=torch.bool)
    dup[:, 1:] = vals[:, 1:] == vals[:, :-1]
    out = torch.empty_like(vals).scatter_(1, idx, vals.masked_fill(dup, float("-inf")))
    return out.to(logits.dtype)


def check_sample(bsz: int, vocab: int, dtype: torch.dtype, device: torch.device, *, top_k: bool = True,
                 top_p: bool = True, min_p: bool = False, use_topk_path: bool = True, seed: int = 0,
                 timing: bool = False) -> CheckResult:
    """Tokens with shared Exp(1) noise must equal the sorted reference's exactly
    (on logits without ties, see ``_without_ties``)."""
    gen = torch.Generator().manual_seed(seed)
    logits = _without_ties((3 * torch.randn(bsz, vocab, generator=gen)).to(dtype)).to(device)
    st = sampling_case(bsz, vocab, device, gen, top_k=top_k, top_p=top_p, min_p=min_p)
    if not use_topk_path:
        st.max_top_k = None
    noise = torch.empty(bsz, vocab).exponential_(generator=gen).to(device)
    got = sampling.sample(logits, st, noise)
    want = sampling.sample_ref(logits, st, noise)
    bad = int((got != want).sum())
    shape = (f"B={bsz} V={vocab} top_k={top_k} top_p={top_p} min_p={min_p} "
             f"{'topk' if st.max_top_k is not None else 'sort'}")
    res = CheckResult("sample", shape, str(dtype).removeprefix("torch."), float(bad), 0.0, 0.0, bad == 0)
    return _timed(res, lambda: sampling.sample(logits, st), lambda: sampling.sample_ref(logits, st),
                  device, timing, ref_iters=2)


# ---- Triton interpreter ------------------------------------------------------------------

def patch_interpreter_bf16() -> None:
    """Two bfloat16 gaps of Triton's interpreter (3.9 at least), patched so it computes
    what the GPU computes; the kernel code is unchanged:
    - tl.dot on bf16 operands multiplies their raw uint16 storage: widen them to
      float32 first (exact: bf16 -> f32 is a shift);
    - float32 -> bf16 casts truncate, where the GPU rounds to nearest even: round
      with PyTorch's conversion (which is round-to-nearest-even)."""
    import numpy as np
    from triton import language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.create_dot, "_trellm_patched", False):
        return
    orig = builder.create_dot

    def widen(h):
        if h.dtype == tl.bfloat16:
            return interpreter.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
        return h

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return orig(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    create_dot._trellm_patched = True
    builder.create_dot = create_dot

    orig_cast = builder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            f32 = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32))
            bits = f32.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
            return interpreter.TensorHandle(bits, tl.bfloat16)
        return orig_cast(self, src, dst_type)

    builder.cast_impl = cast_impl


def patch_interpreter_overflow_checks() -> None:
    """Triton's interpreter checks every 32-bit integer add/mul for overflow (the GPU
    compiles that check only with debug=True) and its assert never fires (it tests a
    handle object, always true): pure cost, ~4 ms a call, and the EXL3 codebooks
    multiply mod 2^32 on purpose 32 times a decode step. Turned off."""
    from triton.language import semantic

    cls = getattr(semantic, "TritonSemantic", None)
    if cls is None or getattr(cls.binary_op_sanitize_overflow_impl, "_trellm_patched", False):
        return

    def no_check(self, lhs, rhs, binary_op):
        return None

    no_check._trellm_patched = True
    cls.binary_op_sanitize_overflow_impl = no_check
