"""Greedy output must not depend on how the engine schedules the work:
chunked == unchunked, prefix hit == miss, batch 1 == batch 16, preempted == not,
n=4 greedy samples identical. KV invariants are checked after each run."""
from __future__ import annotations

import pytest

from trellm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

PROMPTS = [
    "The history of the printing press begins",
    "In mathematics, a prime number is",
    "import numpy as np\n\ndef softmax(x):",
    "My favourite recipe for pancakes needs",
    "The quick brown fox",
    "Photosynthesis converts light energy into",
    "A long time ago in a galaxy far, far away, there lived a young farmer who dreamed of",
    "SELECT name, age FROM users WHERE",
    "Water boils at",
    "The three laws of robotics state that",
    "Once there was a cat who",
    "To make a paper airplane, first",
    "The Fibonacci sequence starts with 0 and 1, and",
    "Dear hiring manager, I am writing to",
    "In 1969, astronauts",
    "Rain falls when",
]


def run(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    outs = llm.generate(prompts, params)
    llm.engine.check_invariants()
    assert not llm.engine.has_unfinished_requests()
    # Nothing may stay allocated once every request is done.
    assert llm.engine.kv.num_free_blocks == llm.engine.worker.num_blocks
    return [o.outputs[0].token_ids for o in outs]


# quantization="none": the packed int4 path rounds activations and outputs to bf16,
# which turns the batched decode attention's batch-dependent last-bit float32
# differences into ~1e-2 logit changes that flip near-tie greedy choices (measured:
# 14/16 prompts equal at batch 1 vs 16). Its linear is bitwise batch-invariant on its
# own (tests/unit/test_gguf_int4.py); the differences enter in the attention.
QUANT = "none"


def make(default_gguf, **kw) -> LLM:
    return LLM(default_gguf, dtype="float32", device="cpu", kv_cache_memory=256 << 20,
               quantization=QUANT, **kw)


@pytest.fixture(scope="module")
def baseline(default_gguf):
    llm = make(default_gguf, enable_prefix_caching=False)
    return llm, run(llm, PROMPTS)


def test_batch_1_equals_batch_16(baseline):
    llm, expected = baseline
    one_by_one = [run(llm, [p])[0] for p in PROMPTS]
    assert one_by_one == expected


def test_chunked_prefill_equals_unchunked(default_gguf, baseline):
    _, expected = baseline
    llm = make(default_gguf, enable_prefix_caching=False, max_num_batched_tokens=16,
               long_prefill_token_threshold=5)
    assert run(llm, PROMPTS) == expected


def test_prefix_cache_hit_equals_miss(default_gguf, baseline):
    _, expected = baseline
    llm = make(default_gguf, enable_prefix_caching=True)
    long_prefix = "You are a careful assistant. Answer briefly and precisely. " * 4
    prompts = [long_prefix + p for p in PROMPTS[:6]]
    cold = run(llm, prompts)
    outs = llm.generate(prompts, GREEDY)
    assert all(o.num_cached_tokens >= 32 for o in outs), [o.num_cached_tokens for o in outs]
    assert [o.outputs[0].token_ids for o in outs] == cold
    llm.engine.check_invariants()
    fresh = make(default_gguf, enable_prefix_caching=False)
    assert run(fresh, prompts) == cold


def test_preemption_equals_none(default_gguf, baseline):
    _, expected = baseline
    # 10 blocks of 16 tokens: far too few for 16 concurrent requests, so the
    # scheduler must preempt and recompute.
    llm = LLM(default_gguf, dtype="float32", device="cpu", num_gpu_blocks_override=10,
              enable_prefix_caching=False, quantization=QUANT)
    assert run(llm, PROMPTS) == expected
    assert llm.engine.scheduler.num_preemptions > 0


def test_n4_greedy_samples_identical(baseline):
    llm, expected = baseline
    hits_before = llm.engine.kv.prefix_cache_stats.hits
    out = llm.generate(PROMPTS[6], GREEDY.with_(n=4))[0]
    # Siblings 1..3 reuse sibling 0's full prompt blocks (even with prefix caching off).
    prompt_len = len(out.prompt_token_ids)
    assert prompt_len >= 16
    assert llm.engine.kv.prefix_cache_stats.hits - hits_before >= 3 * (prompt_len // 16) * 16
    assert len(out.outputs) == 4
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert all(c.token_ids == expected[6] for c in out.outputs)
    llm.engine.check_invariants()
