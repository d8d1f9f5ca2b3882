"""Turns a batch of next-token logits into sampled token ids (and their logprobs).

Processing order follows vLLM: min_tokens, logit_bias, repetition penalty,
frequency/presence penalties; then greedy rows take the argmax and the others go
through temperature, min_p, top_k, top_p and a draw from the softmax.

Every step is vectorized across the rows that use it (per-row parameters become
small tensors) and skipped entirely when no row does, so a batch of plain greedy
rows costs one argmax.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from trellm.engine.types import TokenLogprobs
from trellm.host_copy import device_tensor
from trellm.sampling_params import SamplingParams

# Temperatures below this are treated as greedy: dividing by them would overflow
# float32 logits and the distribution is an argmax in all but name (vLLM does the same).
_SAMPLING_EPS = 1e-5

_NEG_INF = float("-inf")


@dataclass
class SamplingRow:
    """Everything the sampler needs to know about one row of the logits."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    """Tokens generated so far (for penalties and min_tokens)."""
    eos_token_ids: frozenset[int]
    generator: torch.Generator | None
    """Per-request generator, seeded when ``params.seed`` is set."""


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    """A generator on ``device`` seeded with ``seed``; None when no seed is set."""
    if seed is None:
        return None
    g = torch.Generator(device=device)
    # Seeds may be negative (vLLM accepts any int64); map them onto uint64 explicitly
    # rather than relying on torch's implicit wrap-around.
    g.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)
    return g


def _is_greedy(params: SamplingParams) -> bool:
    return params.temperature < _SAMPLING_EPS


def _min_tokens_blocked(row: SamplingRow) -> set[int]:
    """Token ids to suppress for ``row`` because it has not reached min_tokens."""
    p = row.params
    if p.min_tokens <= 0 or len(row.output_token_ids) >= p.min_tokens:
        return set()
    ids = set(p.stop_token_ids)
    if not p.ignore_eos:  # with ignore_eos, EOS does not end the request, so leave it alone
        ids |= row.eos_token_ids
    return ids


def _needs_processing(rows: Sequence[SamplingRow]) -> bool:
    """Whether any row uses a logits processor (the fast path must not skip it)."""
    for row in rows:
        p = row.params
        if (p.logit_bias or p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0
                or p.presence_penalty != 0.0 or _min_tokens_blocked(row)):
            return True
    return False


def is_device_only(params: SamplingParams) -> bool:
    """The row can be sampled without the host: no log-probs to return and no
    processor that reads the tokens generated so far (async scheduling needs this)."""
    return (params.logprobs is None and params.prompt_logprobs is None and not params.logit_bias
            and params.repetition_penalty == 1.0 and params.frequency_penalty == 0.0
            and params.presence_penalty == 0.0 and params.min_tokens == 0)


def _padded(seqs: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    """Right-pad token lists into a [len(seqs), max_len] long tensor."""
    width = max((len(s) for s in seqs), default=0)
    data = [s + [pad] * (width - len(s)) for s in seqs]
    return device_tensor(data, device, torch.long).reshape(len(seqs), width)


def _apply_min_tokens_(x: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    vocab = x.shape[-1]
    r_idx: list[int] = []
    t_idx: list[int] = []
    for i, row in enumerate(rows):
        for t in _min_tokens_blocked(row):
            if 0 <= t < vocab:
                r_idx.append(i)
                t_idx.append(t)
    if r_idx:
        dev = x.device
        x[device_tensor(r_idx, dev), device_tensor(t_idx, dev)] = _NEG_INF


def _apply_logit_bias_(x: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    vocab = x.shape[-1]
    r_idx: list[int] = []
    t_idx: list[int] = []
    vals: list[float] = []
    for i, row in enumerate(rows):
        for t, b in (row.params.logit_bias or {}).items():
            if 0 <= t < vocab:  # out-of-vocab ids are rejected at admission; never index past V
                r_idx.append(i)
                t_idx.append(t)
                vals.append(b)
    if r_idx:
        dev = x.device
        x.index_put_((device_tensor(r_idx, dev), device_tensor(t_idx, dev)),
                     device_tensor(vals, dev, x.dtype), accumulate=True)


def _apply_repetition_penalty_(x: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    sel = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
    if not sel:
        return
    dev, vocab = x.device, x.shape[-1]
    seqs = [list(rows[i].prompt_token_ids) + list(rows[i].output_token_ids) for i in sel]
    # Pad with an extra column V so padding scatters into a slot that is then dropped.
    toks = _padded(seqs, vocab, dev).clamp_(0, vocab)
    seen = torch.zeros(len(sel), vocab + 1, dtype=torch.bool, device=dev)
    seen.scatter_(1, toks, True)
    seen = seen[:, :vocab]
    idx = device_tensor(sel, dev)
    pen = device_tensor([rows[i].params.repetition_penalty for i in sel], dev, x.dtype)[:, None]
    sub = x[idx]
    penalized = torch.where(sub > 0, sub / pen, sub * pen)
    x[idx] = torch.where(seen, penalized, sub)


def _apply_freq_presence_(x: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    sel = [i for i, r in enumerate(rows)
           if (r.params.frequency_penalty != 0.0 or r.params.presence_penalty != 0.0)
           and len(r.output_token_ids) > 0]
    if not sel:
        return
    dev, vocab = x.device, x.shape[-1]
    toks = _padded([list(rows[i].output_token_ids) for i in sel], vocab, dev).clamp_(0, vocab)
    counts = torch.zeros(len(sel), vocab + 1, dtype=x.dtype, device=dev)
    counts.scatter_add_(1, toks, torch.ones_like(toks, dtype=x.dtype))
    counts = counts[:, :vocab]
    freq = device_tensor([rows[i].params.frequency_penalty for i in sel], dev, x.dtype)
    pres = device_tensor([rows[i].params.presence_penalty for i in sel], dev, x.dtype)
    idx = device_tensor(sel, dev)
    x[idx] = x[idx] - freq[:, None] * counts - pres[:, None] * (counts > 0).to(x.dtype)


def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """The logits after min_tokens, logit_bias and the repetition, frequency and
    presence penalties, as a new float32 tensor (``logits`` is not modified)."""
    x = logits.to(torch.float32, copy=True)
    _apply_min_tokens_(x, rows)
    _apply_logit_bias_(x, rows)
    _apply_repetition_penalty_(x, rows)
    _apply_freq_presence_(x, rows)
    return x


def _apply_min_p_(x: torch.Tensor, min_p: torch.Tensor) -> None:
    """Mask tokens whose probability is below min_p times the row's top probability."""
    probs = torch.softmax(x, dim=-1)
    top = probs.amax(dim=-1, keepdim=True)
    x.masked_fill_(probs < min_p[:, None] * top, _NEG_INF)


def _apply_top_k_top_p(x: torch.Tensor, top_k: torch.Tensor | None,
                       top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask everything outside each row's top-k and nucleus, with one sort.

    ``top_k`` holds V for rows without a limit; ``top_p`` holds a value > 1 for rows
    without one, so the masks are no-ops there. Ties with the k-th logit are kept.
    """
    sorted_x, order = x.sort(dim=-1, descending=True)
    if top_k is not None:
        kth = sorted_x.gather(1, (top_k - 1).clamp(min=0)[:, None])
        sorted_x = sorted_x.masked_fill(sorted_x < kth, _NEG_INF)
    if top_p is not None:
        probs = torch.softmax(sorted_x, dim=-1)
        # Drop a token once the mass strictly before it already reaches top_p; the
        # most likely token is always kept so no row can end up all -inf.
        before = probs.cumsum(dim=-1) - probs
        drop = before >= top_p[:, None]
        drop[:, 0] = False
        sorted_x = sorted_x.masked_fill(drop, _NEG_INF)
    return torch.empty_like(x).scatter_(1, order, sorted_x)


def _exponential_race(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """Sample one index per row: argmax(p / q) with q ~ Exp(1) is a draw from p.

    Seeded rows draw their noise alone from their own generator, so their token
    depends only on their own probabilities and seed, not on the batch around them.
    """
    out = torch.empty(probs.shape[0], dtype=torch.long, device=probs.device)
    free = [i for i, g in enumerate(generators) if g is None]
    if free:
        if len(free) == probs.shape[0]:
            q = torch.empty_like(probs).exponential_()
            return (probs / q).argmax(dim=-1)
        idx = device_tensor(free, probs.device)
        p = probs[idx]
        out[idx] = (p / torch.empty_like(p).exponential_()).argmax(dim=-1)
    for i, g in enumerate(generators):
        if g is not None:
            q = torch.empty_like(probs[i]).exponential_(generator=g)
            out[i] = (probs[i] / q).argmax()
    return out


def _sample_random(x: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Temperature, min_p, top_k, top_p and a draw for non-greedy rows ([b, V] float32)."""
    dev, vocab = x.device, x.shape[-1]
    params = [r.params for r in rows]
    temps = device_tensor([p.temperature for p in params], dev, x.dtype)
    # +inf logits (a repetition penalty that rounds to 0 in float32 divides a positive
    # logit by it) become the largest finite value: softmax over inf gives NaN, and the
    # draw would then always return token 0. Tied maxima keep equal chances.
    x = torch.nan_to_num(x / temps[:, None], nan=_NEG_INF, posinf=torch.finfo(x.dtype).max, neginf=_NEG_INF)
    if any(p.min_p > 0.0 for p in params):
        _apply_min_p_(x, device_tensor([p.min_p for p in params], dev, x.dtype))
    use_k = any(0 < p.top_k < vocab for p in params)
    use_p = any(p.top_p < 1.0 for p in params)
    if use_k or use_p:
        k = device_tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params],
                          dev) if use_k else None
        tp = device_tensor([p.top_p if p.top_p < 1.0 else 2.0 for p in params],
                           dev, x.dtype) if use_p else None
        x = _apply_top_k_top_p(x, k, tp)
    probs = torch.softmax(x, dim=-1)
    return _exponential_race(probs, [r.generator for r in rows])


def _logprob_entries(logprobs: torch.Tensor, targets: torch.Tensor,
                     num_top: Sequence[int]) -> list[TokenLogprobs]:
    """TokenLogprobs for each row of ``logprobs`` [N, V] (already log-softmaxed)."""
    chosen = logprobs.gather(1, targets[:, None])
    # Rank counts strictly better tokens, so tied tokens share the better rank.
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    n = min(max(num_top, default=0), logprobs.shape[-1])
    top_v: list[list[float]] = [[] for _ in num_top]
    top_i: list[list[int]] = [[] for _ in num_top]
    if n > 0:
        v, i = logprobs.topk(n, dim=-1)
        top_v, top_i = v.tolist(), i.tolist()
    result = []
    for row, (tok, lp, rank) in enumerate(zip(targets.tolist(), chosen[:, 0].tolist(), ranks.tolist())):
        k = num_top[row]
        top = tuple(zip(top_i[row][:k], top_v[row][:k]))
        result.append(TokenLogprobs(token_id=tok, logprob=lp, rank=rank, top=top))
    return result


def compute_prompt_logprobs(logits: torch.Tensor, target_ids: torch.Tensor,
                            num_top: int) -> list[TokenLogprobs]:
    """Log-prob, rank and top-``num_top`` of each target under its row of ``logits`` [T, V]."""
    if logits.shape[0] == 0:
        return []
    lp = torch.log_softmax(logits.to(torch.float32), dim=-1)
    targets = target_ids.to(device=lp.device, dtype=torch.long)
    return _logprob_entries(lp, targets, [num_top] * lp.shape[0])


class Sampler:
    """Picks the next token for every row of a [B, V] logits tensor.

    ``force_slow_path`` disables the all-greedy shortcut (tests compare the two).
    """

    def __init__(self, force_slow_path: bool = False) -> None:
        self.force_slow_path = force_slow_path

    def __call__(self, logits: torch.Tensor,
                 rows: Sequence[SamplingRow]) -> tuple[list[int], list[TokenLogprobs | None]]:
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(rows)} rows")
        if not rows:
            return [], []
        all_greedy = all(_is_greedy(r.params) for r in rows)
        if all_greedy and not self.force_slow_path and not _needs_processing(rows):
            # Common case: argmax is order-preserving, so the dtype cast is unnecessary.
            tokens = logits.argmax(dim=-1)
        else:
            tokens = self._pick(apply_penalties(logits, rows), rows)
        return tokens.tolist(), self._sampled_logprobs(logits, tokens, rows)

    def sample_on_device(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """Token ids [B] left on the device, for rows that pass ``is_device_only``."""
        if all(_is_greedy(r.params) for r in rows) and not self.force_slow_path:
            return logits.argmax(dim=-1)
        return self._pick(logits, rows)

    @staticmethod
    def _pick(x: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        greedy = [i for i, r in enumerate(rows) if _is_greedy(r.params)]
        if len(greedy) == len(rows):
            return x.argmax(dim=-1)
        if not greedy:
            return _sample_random(x, rows)
        dev = x.device
        out = torch.empty(len(rows), dtype=torch.long, device=dev)
        g_idx = device_tensor(greedy, dev)
        out[g_idx] = x[g_idx].argmax(dim=-1)
        rand = [i for i, r in enumerate(rows) if not _is_greedy(r.params)]
        r_idx = device_tensor(rand, dev)
        out[r_idx] = _sample_random(x[r_idx], [rows[i] for i in rand])
        return out

    @staticmethod
    def _sampled_logprobs(logits: torch.Tensor, tokens: torch.Tensor,
                          rows: Sequence[SamplingRow]) -> list[TokenLogprobs | None]:
        """Logprobs of the sampled tokens under the RAW logits (vLLM's default), only
        for rows that asked for them."""
        result: list[TokenLogprobs | None] = [None] * len(rows)
        want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        if not want:
            return result
        if len(want) == len(rows):
            raw, targets = logits, tokens
        else:
            idx = device_tensor(want, logits.device)
            raw, targets = logits[idx], tokens[idx]
        lp = torch.log_softmax(raw.to(torch.float32), dim=-1)
        entries = _logprob_entries(lp, targets, [rows[i].params.logprobs or 0 for i in want])
        for i, e in zip(want, entries):
            result[i] = e
        return result
