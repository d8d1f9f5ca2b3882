"""Engine-level behaviour through the offline API: abort, stop strings, seeds,
max_tokens / finish reasons, and validation of requests."""
from __future__ import annotations

import pytest

from trellm import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(default_gguf):
    return LLM(default_gguf, kv_cache_memory=128 << 20)


def test_abort_frees_blocks_and_reports(llm):
    eng = llm.engine
    eng.add_request("abort-me", "Tell me a long story about a dragon.",
                    SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
    for _ in range(3):
        eng.step()
    eng.abort_request("abort-me")
    final = [o for o in eng.step() if o.request_id == "abort-me"]
    assert final and final[-1].finished and final[-1].outputs[0].finish_reason == "abort"
    while eng.has_unfinished_requests():
        eng.step()
    eng.check_invariants()
    assert eng.kv.num_free_blocks == eng.worker.num_blocks


def test_stop_string_cuts_text_exactly(llm):
    base = llm.generate("Count: one, two, three,", SamplingParams(temperature=0.0, max_tokens=24))[0]
    text = base.outputs[0].text
    assert len(text) > 6
    stop = text[3:6]
    cut = llm.generate("Count: one, two, three,",
                       SamplingParams(temperature=0.0, max_tokens=24, stop=[stop]))[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == text[: text.index(stop)]
    incl = llm.generate("Count: one, two, three,", SamplingParams(
        temperature=0.0, max_tokens=24, stop=[stop], include_stop_str_in_output=True))[0].outputs[0]
    assert incl.text == text[: text.index(stop) + len(stop)]


@pytest.fixture(scope="module")
def llm_fp32(default_gguf):
    # Unquantized: the packed int4 path's bf16 roundings turn the batched attention's
    # last-bit float32 differences into logit changes that can move a sampled token
    # (see test_invariance.py); what is under test here is the per-request random stream.
    return LLM(default_gguf, kv_cache_memory=64 << 20, quantization="none")


def test_seeded_sampling_is_reproducible_and_batch_independent(llm_fp32):
    llm = llm_fp32
    p = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=1234, ignore_eos=True)
    alone = llm.generate("Once upon a time", p)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    batch = llm.generate(["Hello there", "Once upon a time", "Why is the sky blue?"], [others, p, others])
    assert batch[1].outputs[0].token_ids == alone
    other_seed = llm.generate("Once upon a time", p.with_(seed=99))[0].outputs[0].token_ids
    assert other_seed != alone


def test_max_tokens_and_finish_reasons(llm):
    out = llm.generate("Hi", SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"
    eos = llm.get_tokenizer().eos_token_id
    forced = llm.generate("Hi", SamplingParams(temperature=0.0, max_tokens=10, logit_bias={eos: 100.0}))[0]
    assert forced.outputs[0].finish_reason == "stop" and forced.outputs[0].token_ids == [eos]
    delayed = llm.generate("Hi", SamplingParams(temperature=0.0, max_tokens=10, min_tokens=3,
                                                logit_bias={eos: 100.0}))[0].outputs[0]
    assert len(delayed.token_ids) == 4 and delayed.token_ids[-1] == eos


def test_logprobs_and_n(llm):
    out = llm.generate("The sky is", SamplingParams(temperature=0.8, max_tokens=6, n=3, seed=5,
                                                    logprobs=3, ignore_eos=True))[0]
    assert len(out.outputs) == 3
    for c in out.outputs:
        assert len(c.logprobs) == 6
        for lp in c.logprobs:
            assert len(lp.top) == 3 and lp.rank >= 1 and lp.logprob <= 0.0
            assert lp.top[0][1] >= lp.logprob


@pytest.mark.parametrize("kwargs, match", [
    (dict(prompt_token_ids=[]), "empty"),
    (dict(prompt_token_ids=[10**9]), "vocabulary"),
    (dict(prompt_token_ids=[1] * 9000), "context"),
])
def test_invalid_requests_raise_clear_errors(llm, kwargs, match):
    with pytest.raises(ValueError, match=match):
        llm.engine.add_request("bad", None, SamplingParams(max_tokens=4), **kwargs)
    assert not llm.engine.has_unfinished_requests()


def test_invalid_sampling_params():
    for bad in (dict(temperature=-0.1), dict(top_p=0.0), dict(n=0), dict(max_tokens=0),
                dict(logprobs=100), dict(stop=[""]), dict(min_tokens=5, max_tokens=2)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
