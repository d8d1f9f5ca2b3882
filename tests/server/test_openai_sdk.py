"""The real ``openai`` SDK against the live server: chat and completions, streaming
and not, n=2, stop, logprobs, usage; greedy streamed text equals non-streamed text."""
from __future__ import annotations

import openai
import pytest
from server_helpers import MODEL_NAME

MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name three colors."}]
PROMPT = "The capital of France is"


def _err(exc: openai.APIStatusError) -> dict:
    # SDK versions differ: body is the whole JSON, or already its "error" member.
    body = exc.body
    return body.get("error", body) if isinstance(body, dict) else {}


@pytest.fixture(scope="module")
def client(server):
    return server.openai()


def test_models_list(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]


def test_chat_non_stream_usage(client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=8, temperature=0)
    assert r.object == "chat.completion" and r.model == MODEL_NAME
    (choice,) = r.choices
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    u = r.usage
    assert 0 < u.completion_tokens <= 8 and u.prompt_tokens > 10
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details is not None and u.prompt_tokens_details.cached_tokens >= 0
    # The same conversation again: its full prompt blocks come from the prefix cache.
    # (Its text is not compared: on the default packed-int4 CPU path a hit's attention
    # differs from a miss's in the last float32 bits, which bf16 roundings can turn into
    # a different greedy token; hit == miss is tested unquantized in test_invariance.py.)
    again = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=8, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens >= 16
    assert again.usage.prompt_tokens == u.prompt_tokens and again.choices[0].message.content


def test_chat_stream_equals_non_stream(client):
    kw = dict(model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=10, temperature=0)
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_completion_stream_equals_non_stream(client):
    kw = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=10, temperature=0)
    whole = client.completions.create(**kw)
    assert whole.object == "text_completion" and whole.choices[0].text
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens


def test_n2_completions_and_chat(client):
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, n=2, temperature=0.9,
                                  seed=7)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert r.usage.completion_tokens == 12 or all(c.finish_reason for c in r.choices)
    again = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, n=2, temperature=0.9,
                                      seed=7)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]  # seeded: reproducible
    chat = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=4, n=2,
                                          temperature=0)
    assert len(chat.choices) == 2 and chat.choices[0].message.content == chat.choices[1].message.content
    streamed = list(client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=4, n=2,
                                                   temperature=0, stream=True))
    for i in (0, 1):
        text = "".join(ch.delta.content or "" for c in streamed for ch in c.choices if ch.index == i)
        assert text == chat.choices[i].message.content


def test_stop_strings(client):
    base = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0)
    text = base.choices[0].text
    assert len(text) > 4
    stop = text[2:4]
    cut = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.index(stop)]
    streamed = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0,
                                         stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == cut.choices[0].text


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=5, temperature=0,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.logprob <= 0.0
        # Greedy: the chosen token is the most likely one.
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-5)
    visible = r.choices[0].message.content
    assert "".join(e.token for e in content).startswith(visible) or r.choices[0].finish_reason == "stop"


def test_completion_logprobs_and_token_prompts(client, server):
    ids = server.engine.tokenizer.encode(PROMPT)
    r = client.completions.create(model=MODEL_NAME, prompt=[ids, ids[:-1]], max_tokens=4, temperature=0,
                                  logprobs=2)
    assert [c.index for c in r.choices] == [0, 1]
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert 1 <= len(lp.tokens) <= 4
    assert all(len(t) >= 1 for t in lp.top_logprobs)
    assert lp.text_offset == sorted(lp.text_offset)
    text = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0)
    assert r.choices[0].text == text.choices[0].text  # token ids == the same text prompt


def test_sdk_error_classes(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=2)
    assert _err(e.value)["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2, n=0)
    assert _err(e.value)["param"] == "n"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=100_000)
    assert _err(e.value)["code"] == "context_length_exceeded"
    wrong = openai.OpenAI(base_url=client.base_url, api_key="wrong-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        wrong.models.list()
    assert _err(e.value)["code"] == "invalid_api_key"
    # And the server still serves.
    assert client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=1).choices[0].text is not None
