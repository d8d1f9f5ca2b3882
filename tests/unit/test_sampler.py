"""Tests for trellm.worker.sampler (CPU, deterministic)."""
from __future__ import annotations

import pytest
import torch

from trellm.sampling_params import SamplingParams
from trellm.worker.sampler import (
    Sampler,
    SamplingRow,
    apply_penalties,
    compute_prompt_logprobs,
    make_generator,
)


def row(params: SamplingParams | None = None, prompt=(), output=(), eos=frozenset(),
        generator=None) -> SamplingRow:
    return SamplingRow(params or SamplingParams(), list(prompt), list(output), frozenset(eos),
                       generator)


def rand_logits(b: int, v: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, v, generator=g) * 3


GREEDY = SamplingParams(temperature=0.0)


def test_greedy_is_argmax():
    logits = rand_logits(6, 50)
    tokens, lps = Sampler()(logits, [row(GREEDY) for _ in range(6)])
    assert tokens == logits.argmax(-1).tolist()
    assert lps == [None] * 6


def test_empty_batch():
    assert Sampler()(torch.empty(0, 10), []) == ([], [])


def test_shape_mismatch_raises():
    with pytest.raises(ValueError):
        Sampler()(torch.zeros(2, 5), [row(GREEDY)])


def test_temperature_distribution_matches_softmax():
    torch.manual_seed(1234)
    base = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 2.0])
    temp = 0.7
    n = 30000
    logits = base.expand(n, -1).clone()
    tokens, _ = Sampler()(logits, [row(SamplingParams(temperature=temp))] * n)
    counts = torch.bincount(torch.tensor(tokens), minlength=6).double()
    expected = torch.softmax(base.double() / temp, -1) * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    # df = 5; P(chi2 > 20.5) ~ 0.001, and the seed is fixed so this is deterministic.
    assert chi2 < 20.5, (counts, expected)


def test_top_k_one_is_greedy():
    logits = rand_logits(8, 100, seed=3)
    tokens, _ = Sampler()(logits, [row(SamplingParams(top_k=1, temperature=1.5))] * 8)
    assert tokens == logits.argmax(-1).tolist()


def test_tiny_top_p_is_greedy():
    logits = rand_logits(8, 100, seed=4)
    tokens, _ = Sampler()(logits, [row(SamplingParams(top_p=1e-6))] * 8)
    assert tokens == logits.argmax(-1).tolist()


def test_top_k_restricts_support():
    torch.manual_seed(0)
    base = torch.tensor([3.0, 2.9, 2.8, 2.7, 2.6])
    tokens, _ = Sampler()(base.expand(2000, -1).clone(), [row(SamplingParams(top_k=2))] * 2000)
    assert set(tokens) == {0, 1}


def test_top_p_restricts_support():
    torch.manual_seed(0)
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(3000, -1).clone()
    # Mass before token 2 is 0.8 >= 0.75, so only tokens 0 and 1 survive.
    tokens, _ = Sampler()(logits, [row(SamplingParams(top_p=0.75))] * 3000)
    assert set(tokens) == {0, 1}


def test_min_p_restricts_support():
    torch.manual_seed(0)
    probs = torch.tensor([0.4, 0.3, 0.19, 0.11])
    logits = probs.log().expand(3000, -1).clone()
    # Threshold 0.5 * 0.4 = 0.2 keeps tokens 0 and 1 only.
    tokens, _ = Sampler()(logits, [row(SamplingParams(min_p=0.5))] * 3000)
    assert set(tokens) == {0, 1}


def test_mixed_batch_applies_per_row_params():
    torch.manual_seed(5)
    base = torch.tensor([3.0, 2.9, 2.8, 2.7, 2.6])
    rows = [row(SamplingParams(top_k=1)), row(GREEDY), row(SamplingParams(top_k=3)),
            row(SamplingParams(temperature=0.0, logit_bias={4: 100.0}))] * 300
    tokens, _ = Sampler()(base.expand(len(rows), -1).clone(), rows)
    assert set(tokens[0::4]) == {0}
    assert set(tokens[1::4]) == {0}
    assert set(tokens[2::4]) == {0, 1, 2}
    assert set(tokens[3::4]) == {4}


def test_logit_bias_forces_token():
    logits = rand_logits(4, 30, seed=7)
    low = int(logits[0].argmin())
    p_greedy = SamplingParams(temperature=0.0, logit_bias={low: 100.0})
    p_sample = SamplingParams(temperature=1.0, logit_bias={low: 100.0})
    tokens, _ = Sampler()(logits[:2], [row(p_greedy), row(p_sample)])
    assert tokens[0] == low
    assert tokens[1] == low  # +100 dwarfs any sampling noise


def test_repetition_penalty():
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5]])
    p = SamplingParams(repetition_penalty=2.0)
    out = apply_penalties(logits, [row(p, prompt=[0], output=[1, 1])])
    assert out.tolist() == [[1.0, -4.0, 1.0, -1.0, 0.5]]
    assert logits.tolist() == [[2.0, -2.0, 1.0, -1.0, 0.5]]  # input untouched


def test_repetition_penalty_that_underflows_still_samples_a_penalized_token():
    # 1e-300 is 0 in float32: every seen token with a positive logit goes to +inf. The
    # draw must pick among those (here 2 and 4), never fall back to token 0 through NaN.
    logits = torch.tensor([[-1.0, -2.0, 1.0, -1.0, 0.5, 3.0]])
    p = SamplingParams(temperature=1.0, repetition_penalty=1e-300, seed=1)
    rows = [row(p, prompt=[2, 4, 1], generator=make_generator(s, "cpu")) for s in range(8)]
    tokens, _ = Sampler()(logits.expand(8, -1).contiguous(), rows)
    assert set(tokens) == {2, 4}


def test_frequency_and_presence_penalties():
    logits = torch.zeros(1, 6)
    p = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    out = apply_penalties(logits, [row(p, prompt=[1, 2], output=[3, 3, 5])])
    expected = [0.0, 0.0, 0.0, -(2 * 0.5 + 0.25), 0.0, -(0.5 + 0.25)]
    assert out[0].tolist() == pytest.approx(expected)


def test_penalties_only_touch_their_rows():
    logits = rand_logits(3, 10, seed=9)
    rows = [row(), row(SamplingParams(repetition_penalty=1.5, frequency_penalty=1.0), prompt=[2],
                       output=[4]), row()]
    out = apply_penalties(logits, rows)
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    changed = (out[1] != logits[1]).nonzero().flatten().tolist()
    assert changed == [i for i in (2, 4) if logits[1, i] != 0]


def test_min_tokens_blocks_eos_and_stop_ids():
    logits = torch.tensor([[0.0, 1.0, 5.0, 4.0, 3.0]])
    p = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(3,))
    sampler = Sampler()
    tok, _ = sampler(logits, [row(p, output=[1], eos={2})])
    assert tok == [4]  # eos (2) and stop id (3) are masked
    tok, _ = sampler(logits, [row(p, output=[1, 1], eos={2})])
    assert tok == [2]  # min_tokens reached


def test_min_tokens_with_ignore_eos_leaves_eos():
    logits = torch.tensor([[0.0, 1.0, 5.0, 4.0]])
    p = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=(3,), ignore_eos=True)
    out = apply_penalties(logits, [row(p, eos={2})])
    assert out[0].tolist() == [0.0, 1.0, 5.0, float("-inf")]


def test_seeded_row_is_batch_independent():
    v = 64
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=20, seed=42)
    other = [SamplingParams(temperature=1.3), SamplingParams(temperature=0.0),
             SamplingParams(top_k=5, seed=7), SamplingParams(min_p=0.1)]
    g_alone, g_batch = make_generator(42, "cpu"), make_generator(42, "cpu")
    sampler = Sampler()
    alone_tokens, batch_tokens = [], []
    for step in range(20):
        logits = rand_logits(5, v, seed=100 + step)
        target = logits[3:4].clone()
        t, _ = sampler(target, [row(params, generator=g_alone)])
        alone_tokens.append(t[0])
        torch.manual_seed(step)  # perturb the global generator between calls
        rows = [row(other[0]), row(other[1]), row(other[2], generator=make_generator(7 + step, "cpu")),
                row(params, generator=g_batch), row(other[3])]
        t, _ = sampler(logits, rows)
        batch_tokens.append(t[3])
    assert alone_tokens == batch_tokens
    assert len(set(alone_tokens)) > 1  # it really sampled


def test_same_seed_same_tokens():
    logits = rand_logits(1, 100, seed=11)
    p = SamplingParams(temperature=1.0, seed=3)
    runs = []
    for _ in range(2):
        g = make_generator(3, "cpu")
        runs.append([Sampler()(logits, [row(p, generator=g)])[0][0] for _ in range(10)])
    assert runs[0] == runs[1]


def test_make_generator():
    assert make_generator(None, "cpu") is None
    g = make_generator(-1, "cpu")
    assert g.initial_seed() == 2**64 - 1


def _check_logprobs(lp, raw: torch.Tensor, token: int, n: int):
    ref = torch.log_softmax(raw.float(), -1)
    assert lp.token_id == token
    assert lp.logprob == pytest.approx(float(ref[token]), abs=1e-6)
    assert lp.rank == 1 + int((ref > ref[token]).sum())
    top_v, top_i = ref.topk(n) if n else (torch.empty(0), torch.empty(0, dtype=torch.long))
    assert [t for t, _ in lp.top] == top_i.tolist()
    assert [x for _, x in lp.top] == pytest.approx(top_v.tolist(), abs=1e-6)


def test_logprobs_of_raw_logits_rank_and_top():
    torch.manual_seed(2)
    logits = rand_logits(4, 40, seed=12)
    params = [SamplingParams(logprobs=3, temperature=2.0, repetition_penalty=1.3),
              SamplingParams(temperature=0.0),
              SamplingParams(logprobs=0, temperature=0.0, logit_bias={5: 50.0}),
              SamplingParams(logprobs=5, top_k=10)]
    rows = [row(p, prompt=[1, 2, 3]) for p in params]
    tokens, lps = Sampler()(logits, rows)
    assert lps[1] is None
    for i, n in ((0, 3), (2, 0), (3, 5)):
        _check_logprobs(lps[i], logits[i], tokens[i], n)
    assert tokens[2] == 5 and lps[2].top == ()
    assert lps[2].rank == 1 + int((logits[2] > logits[2, 5]).sum())


def test_greedy_fast_path_matches_slow_path():
    logits = rand_logits(7, 80, seed=13).to(torch.bfloat16)
    rows = [row(SamplingParams(temperature=0.0, logprobs=(i if i % 2 else None)))
            for i in range(7)]
    fast = Sampler()(logits, rows)
    slow = Sampler(force_slow_path=True)(logits, rows)
    assert fast == slow
    assert fast[0] == logits.float().argmax(-1).tolist()


def test_compute_prompt_logprobs():
    logits = rand_logits(5, 20, seed=14)
    targets = torch.tensor([3, 0, 19, 7, 7])
    entries = compute_prompt_logprobs(logits, targets, 4)
    assert len(entries) == 5
    for e, raw, t in zip(entries, logits, targets.tolist()):
        _check_logprobs(e, raw, t, 4)
    assert compute_prompt_logprobs(torch.empty(0, 20), torch.empty(0, dtype=torch.long), 2) == []


def test_no_nan_with_extreme_settings():
    torch.manual_seed(0)
    logits = rand_logits(3, 50, seed=15)
    rows = [row(SamplingParams(temperature=1e-3)), row(SamplingParams(top_p=0.01, top_k=1, min_p=1.0)),
            row(SamplingParams(temperature=5.0, logit_bias={0: -100.0}))]
    tokens, _ = Sampler()(logits, rows)
    assert tokens[0] == int(logits[0].argmax()) and tokens[1] == int(logits[1].argmax())
    assert all(0 <= t < 50 for t in tokens)
