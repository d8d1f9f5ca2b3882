"""Async scheduling (step n+1 planned and launched before step n's result is applied)
must give exactly what the synchronous loop gives: greedy and seeded tokens, finish
reasons, stop strings, preemption, chunking, prefix hits, aborts, and the fallback
for requests that need the host (log-probs, penalties). Runs on the CPU, where the
same code paths run without the overlap."""
from __future__ import annotations

import pytest

from trellm import LLM, SamplingParams

PROMPTS = [
    "The history of the printing press begins",
    "In mathematics, a prime number is",
    "import numpy as np\n\ndef softmax(x):",
    "My favourite recipe for pancakes needs",
    "The quick brown fox",
]

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def make(default_gguf, asy: bool, **kw) -> LLM:
    kw.setdefault("kv_cache_memory", 128 << 20)
    return LLM(default_gguf, dtype="float32", device="cpu", quantization="none",
               async_scheduling=asy, **kw)


def outputs(llm: LLM, prompts, params) -> list[tuple]:
    outs = llm.generate(prompts, params)
    eng = llm.engine
    eng.check_invariants()
    assert not eng.has_unfinished_requests()
    assert eng.kv.num_free_blocks == eng.worker.num_blocks
    assert not eng.scheduler._inflight, "a planned step was never updated"
    return [(c.token_ids, c.finish_reason, c.text) for o in outs for c in o.outputs]


@pytest.fixture(scope="module")
def pair(default_gguf):
    return make(default_gguf, False), make(default_gguf, True)


def test_async_is_used(pair):
    sync, asy = pair
    assert not sync.engine.async_scheduling and asy.engine.async_scheduling
    launched = []
    runner = asy.engine.worker.runner
    orig = runner.launch
    runner.launch = lambda plan: launched.append(plan) or orig(plan)
    try:
        asy.generate(PROMPTS[:2], GREEDY)
    finally:
        runner.launch = orig
    # Every step of a plain greedy batch goes through launch: prefills and decodes.
    assert len(launched) >= GREEDY.max_tokens


@pytest.mark.parametrize("params", [
    GREEDY,
    SamplingParams(temperature=0.0, max_tokens=20, stop=["\n", "."]),  # EOS or a stop string
    SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=7, max_tokens=10),
    SamplingParams(temperature=0.0, max_tokens=8, repetition_penalty=1.3),  # host fallback
], ids=["greedy", "stop-strings", "seeded", "penalty"])
def test_async_equals_sync(pair, params):
    sync, asy = pair
    got = outputs(asy, PROMPTS, params)
    assert got == outputs(sync, PROMPTS, params)
    if params.stop:
        assert any(reason == "stop" for _, reason, _ in got), "no request ended on a stop string or EOS"


def test_mixed_batch_switches_between_modes(pair):
    """Requests that need the host and ones that do not, in one batch: the engine
    falls back to synchronous steps and back without losing a token."""
    sync, asy = pair
    mixed = [SamplingParams(temperature=0.0, max_tokens=6 + i, ignore_eos=True,
                            logprobs=1 if i % 2 == 0 else None) for i in range(len(PROMPTS))]
    def run(llm):
        outs = llm.generate(PROMPTS, mixed)
        llm.engine.check_invariants()
        return [o.outputs[0].token_ids for o in outs]
    assert run(asy) == run(sync)


def test_chunked_preempted_and_n4(default_gguf, pair):
    sync, _ = pair
    expected = outputs(sync, PROMPTS, GREEDY)
    chunked = make(default_gguf, True, max_num_batched_tokens=16, long_prefill_token_threshold=5)
    assert outputs(chunked, PROMPTS, GREEDY) == expected
    tiny = make(default_gguf, True, kv_cache_memory=None, num_gpu_blocks_override=8,
                enable_prefix_caching=False)
    assert outputs(tiny, PROMPTS, GREEDY) == expected
    assert tiny.engine.scheduler.num_preemptions > 0
    n4 = tiny.generate(PROMPTS[1], GREEDY.with_(n=4))[0]
    assert all(c.token_ids == expected[1][0] for c in n4.outputs)


def test_prefix_hit_equals_miss(pair):
    sync, asy = pair
    prefix = "You are a careful assistant. Answer briefly and precisely. " * 4
    prompts = [prefix + p for p in PROMPTS[:4]]
    cold = outputs(asy, prompts, GREEDY)
    warm = asy.generate(prompts, GREEDY)
    assert all(o.num_cached_tokens >= 32 for o in warm)
    assert [(c.token_ids, c.finish_reason, c.text) for o in warm for c in o.outputs] == cold
    assert cold == outputs(sync, prompts, GREEDY)


def test_abort_while_a_step_is_in_flight(pair):
    _, asy = pair
    eng = asy.engine
    for i, p in enumerate(PROMPTS[:3]):
        eng.add_request(f"ab{i}", p, GREEDY.with_(max_tokens=16))
    for _ in range(4):
        eng.step()
    assert eng._inflight is not None
    eng.abort_request("ab1")
    finished = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].finish_reason
    assert finished == {"ab0": "length", "ab1": "abort", "ab2": "length"}
    eng.check_invariants()
    assert eng.kv.num_free_blocks == eng.worker.num_blocks
