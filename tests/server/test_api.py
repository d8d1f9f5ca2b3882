"""HTTP behaviour of the live server beyond the SDK: auth, metrics, tokenizer routes,
error shapes, prompt log-probs for evaluation harnesses, and cancellation that
frees KV blocks."""
from __future__ import annotations

import codecs
import json
import time

import httpx
import pytest
from server_helpers import (
    MAX_MODEL_LEN,
    MODEL_NAME,
    assert_openai_error,
    chat_body,
    completion_body,
    metric,
    wait_engine_idle,
)

from trellm import LLM, SamplingParams


# ---- auth -----------------------------------------------------------------------------------


@pytest.mark.parametrize("method, path", [("GET", "/v1/models"), ("GET", f"/v1/models/{MODEL_NAME}"),
                                          ("GET", "/metrics"), ("POST", "/tokenize"),
                                          ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                                          ("GET", "/tokenizer_info"), ("GET", "/openapi.json"),
                                          ("GET", "/no/such/route")])
def test_every_route_but_health_needs_the_key(server, method, path):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {server.api_key}"},
                    {"Authorization": f"Bearer {server.api_key.upper()}"},
                    {"Authorization": f"Bearer {server.api_key[:-1]}"}):
        r = httpx.request(method, server.url + path, headers=headers, json={})
        err = assert_openai_error(r, 401)
        assert err["code"] == "invalid_api_key" and r.headers["www-authenticate"] == "Bearer"
    assert httpx.get(server.url + "/health").status_code == 200


def test_health_is_open_and_models_work_with_key(server):
    r = httpx.get(server.url + "/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    with server.client() as c:
        assert c.get("/v1/models").json()["data"][0]["max_model_len"] == MAX_MODEL_LEN
        card = c.get(f"/v1/models/{MODEL_NAME}").json()  # the SDK's models.retrieve
        assert card["id"] == MODEL_NAME and card["object"] == "model"
        assert_openai_error(c.get("/v1/models/no-such-model"), 404, "model")


# ---- metrics --------------------------------------------------------------------------------


def test_metrics_exposed(server):
    with server.client() as c:
        before = c.get("/metrics").text
        r = c.post("/v1/completions", json=completion_body(max_tokens=3, temperature=0, ignore_eos=True))
        assert r.status_code == 200
        c.post("/v1/completions", json=completion_body(n=0))  # a 400, counted by status
        m = c.get("/metrics")
    assert m.headers["content-type"].startswith("text/plain")
    text = m.text
    for name in ("trellm:num_requests_running", "trellm:num_requests_waiting", "trellm:kv_cache_usage_perc",
                 "trellm:prefix_cache_hit_rate", "trellm:num_preemptions_total",
                 "trellm:time_to_first_token_seconds_bucket", "trellm:inter_token_latency_seconds_bucket",
                 "trellm:e2e_request_latency_seconds_bucket"):
        assert name in text, name
    assert metric(text, "trellm:generation_tokens_total") - metric(before, "trellm:generation_tokens_total") == 3
    assert metric(text, "trellm:prompt_tokens_total") > metric(before, "trellm:prompt_tokens_total")
    assert metric(text, "trellm:time_to_first_token_seconds_count") >= 1
    assert metric(text, "trellm:request_finished_total", reason="length") >= 1
    assert metric(text, "trellm:http_requests_total", method="POST", route="/v1/completions", status="400") >= 1
    assert metric(text, "trellm:http_requests_total", method="POST", route="/v1/completions", status="200") >= 1


# ---- tokenizer routes (what lm-eval's remote tokenizer calls) -----------------------------


def test_tokenize_detokenize_tokenizer_info(server):
    with server.client() as c:
        info = c.get("/tokenizer_info").json()
        assert info["eos_token"] and info["chat_template"] and info["model_max_length"] == MAX_MODEL_LEN
        ids = c.post("/tokenize", json={"prompt": "Hello world", "add_special_tokens": False}).json()
        assert ids["count"] == len(ids["tokens"]) > 0 and ids["max_model_len"] == MAX_MODEL_LEN
        back = c.post("/detokenize", json={"tokens": ids["tokens"]}).json()
        assert back["prompt"] == "Hello world"
        eos = c.post("/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False}).json()
        assert eos["tokens"] == [info["eos_token_id"]]
        chat = c.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
        assert chat["count"] > 3
        assert_openai_error(c.post("/detokenize", json={"tokens": [10**9]}), 400, "tokens")
        assert_openai_error(c.post("/tokenize", json={"prompt": "x", "messages": [{"role": "user",
                                                                                     "content": "y"}]}), 400)


# ---- errors ---------------------------------------------------------------------------------


def test_error_shapes(server):
    with server.client() as c:
        err = assert_openai_error(c.post("/v1/completions", json=completion_body(model="nope")), 404, "model")
        assert err["code"] == "model_not_found"
        assert_openai_error(c.post("/v1/completions", json=completion_body(max_tokens="3")), 400, "max_tokens")
        assert_openai_error(c.post("/v1/completions", json=completion_body(n=True)), 400, "n")
        assert_openai_error(c.post("/v1/completions", json=completion_body(n=5)), 400, "n")  # server cap 4
        assert_openai_error(c.post("/v1/completions", json=completion_body(prompt="")), 400, "prompt")
        err = assert_openai_error(c.post("/v1/completions", json=completion_body(prompt=[[]])), 400)
        assert err["param"].startswith("prompt")
        assert_openai_error(c.post("/v1/completions", json=completion_body(prompt=[5, 10**8])), 400, "prompt")
        # More sequences than the server could ever admit at once: 400, not a 503 to retry.
        assert_openai_error(c.post("/v1/completions", json=completion_body(prompt=["x"] * 200, n=2)), 400,
                            "prompt")
        assert_openai_error(c.post("/v1/completions", json=completion_body(logit_bias={"99999999": 1})), 400,
                            "logit_bias")
        err = assert_openai_error(c.post("/v1/completions", json=completion_body(prompt="word " * 600)), 400)
        assert err["code"] == "context_length_exceeded"
        # The error names the field the client sent (max_completion_tokens, not max_tokens).
        err = assert_openai_error(c.post("/v1/chat/completions", json=chat_body(max_completion_tokens=MAX_MODEL_LEN)),
                                  400, "max_completion_tokens")
        assert err["code"] == "context_length_exceeded"
        assert_openai_error(c.post("/v1/chat/completions", json=chat_body(stream_options={"include_usage": True})),
                            400)
        assert_openai_error(c.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": []}), 400,
                            "messages")
        nan = c.post("/v1/completions", content=b'{"prompt": "x", "top_p": NaN}',
                     headers={"content-type": "application/json"})
        assert_openai_error(nan, 400, "top_p")
        bad = c.post("/v1/chat/completions", content=b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
                     headers={"content-type": "application/json"})
        assert_openai_error(bad, 400, "messages[0].content")
        r = c.get("/v1/chat/completions")
        assert_openai_error(r, 405)
        assert "POST" in r.headers["allow"]
        assert_openai_error(c.get("/v2/whatever"), 404)
        big = c.post("/v1/completions", content=b"x" * (3 << 20), headers={"content-type": "application/json"})
        assert_openai_error(big, 413)

        def chunks():
            for _ in range(40):
                yield b" " * (64 << 10)  # 2.5 MiB, chunked: no Content-Length to check up front
        assert_openai_error(c.post("/v1/completions", content=chunks(),
                                   headers={"content-type": "application/json"}), 413)
        # After all that, a normal request on the same connection still succeeds.
        assert c.post("/v1/completions", json=completion_body(max_tokens=1)).status_code == 200


# ---- evaluation harness path ----------------------------------------------------------------


@pytest.fixture(scope="module")
def offline_llm(default_gguf):
    return LLM(default_gguf, max_model_len=MAX_MODEL_LEN, kv_cache_memory=16 << 20)


def test_echo_prompt_logprobs_equal_offline_engine(server, offline_llm):
    import torch

    ids = offline_llm.get_tokenizer().encode("The quick brown fox jumps over the lazy dog")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the server's engine thread: same reduction order, same floats
    try:
        ref = offline_llm.generate({"prompt_token_ids": ids},
                                   SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))[0]
    finally:
        torch.set_num_threads(threads)
    with server.client() as c:
        r = c.post("/v1/completions", json=completion_body(prompt=ids, echo=True, logprobs=1, max_tokens=1,
                                                           temperature=0))
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    n = len(ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    got = lp["token_logprobs"][1:n]
    want = [e.logprob for e in ref.prompt_logprobs[1:]]
    assert got == pytest.approx(want, abs=1e-5)
    text_of = lambda t: offline_llm.get_tokenizer().decode([t], skip_special_tokens=False)  # noqa: E731
    assert lp["tokens"][:n] == [text_of(t) for t in ids]
    for k, entry in enumerate(ref.prompt_logprobs[1:], start=1):
        top = lp["top_logprobs"][k]
        (best_id, best_lp), = entry.top
        assert top[text_of(best_id)] == pytest.approx(best_lp, abs=1e-5)  # lm-eval's is_greedy input
    # max_tokens=0 with echo: only the prompt is scored and returned.
    with server.client() as c:
        r0 = c.post("/v1/completions", json=completion_body(prompt=ids, echo=True, logprobs=1, max_tokens=0))
    body = r0.json()
    assert r0.status_code == 200 and body["usage"]["completion_tokens"] == 0
    assert body["choices"][0]["logprobs"]["token_logprobs"][1:] == pytest.approx(want, abs=1e-5)


# ---- cancellation frees KV blocks -----------------------------------------------------------


def test_stream_disconnect_aborts_and_frees_kv(server):
    with server.client() as c:
        with c.stream("POST", "/v1/completions", json=completion_body(
                max_tokens=400, temperature=0, ignore_eos=True, stream=True)) as r:
            assert r.status_code == 200
            seen = 0
            for line in r.iter_lines():
                if line.startswith("data: "):
                    seen += 1
                    if seen == 3:
                        break  # leaving the block closes the connection mid-stream
        aborted_before = metric(c.get("/metrics").text, "trellm:request_finished_total", reason="abort")
    start = time.monotonic()
    state = wait_engine_idle(server)
    assert not state["busy"], "the disconnected request kept running"
    assert time.monotonic() - start < 10  # far sooner than 400 tokens would take
    assert state["free"] == state["total"]
    with server.client() as c:
        text = c.get("/metrics").text
        assert metric(text, "trellm:request_finished_total", reason="abort") >= max(aborted_before, 1)
        assert c.post("/v1/chat/completions", json=chat_body(max_tokens=2)).status_code == 200


def test_non_stream_client_timeout_aborts_and_frees_kv(server):
    with server.client(timeout=1.0) as c, pytest.raises(httpx.ReadTimeout):
        c.post("/v1/chat/completions", json=chat_body(max_tokens=400, ignore_eos=True, temperature=0))
    state = wait_engine_idle(server)
    assert not state["busy"] and state["free"] == state["total"]


def test_stream_sse_framing(server):
    with server.client() as c, c.stream("POST", "/v1/chat/completions",
                                        json=chat_body(max_tokens=3, stream=True)) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert all(p["object"] == "chat.completion.chunk" for p in payloads)
    assert payloads[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def _events(server, path: str, body: dict) -> list[dict]:
    with server.client() as c, c.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line.startswith("data: {")]
    return [json.loads(line[len("data: "):]) for line in lines]


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", chat_body(n=3, max_tokens=4, temperature=1.0, seed=3, stream=True,
                                       stream_options={"include_usage": True})),
    ("/v1/completions", completion_body(prompt="Hi", n=3, max_tokens=3, temperature=1.0, seed=3, stream=True,
                                        stream_options={"include_usage": True})),
])
def test_stream_n3_one_finish_per_choice_and_null_keys(server, path, body):
    # OpenAI's stream shape: exactly one finishing chunk per choice (a finished choice is
    # not repeated while its siblings go on), every choice object carries "finish_reason"
    # and "logprobs" (null until set), and with include_usage every chunk carries "usage".
    events = _events(server, path, body)
    finishes = [ch["index"] for e in events for ch in e["choices"] if ch.get("finish_reason")]
    assert sorted(finishes) == [0, 1, 2]
    for e in events:
        assert "usage" in e
        for ch in e["choices"]:
            assert "finish_reason" in ch and "logprobs" in ch
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] > 0


def test_echo_of_token_ids_keeps_special_tokens_and_offsets(server):
    # Prompt ids 1, 2, 3 are special tokens in SmolLM2's vocabulary: echo shows them as the
    # token list does, so every text_offset indexes the returned text.
    with server.client() as c:
        r = c.post("/v1/completions", json=completion_body(prompt=[1, 2, 3], echo=True, logprobs=1, max_tokens=2,
                                                           temperature=0))
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"].startswith("".join(lp["tokens"][:3]))
    for tok, off in zip(lp["tokens"], lp["text_offset"]):
        assert choice["text"][off:off + len(tok)] == tok or "\ufffd" in tok


def test_chat_logprob_bytes_of_partial_characters_rebuild_them(server):
    with server.client() as c:
        r = c.post("/v1/chat/completions", json=chat_body(
            "Repeat exactly: \U0001f600\U0001f603\U0001f604", max_tokens=24, temperature=0, logprobs=True))
    choice = r.json()["choices"][0]
    content, text = choice["logprobs"]["content"], choice["message"]["content"]
    # Strict: any invalid byte sequence raises; an unfinished last character is held back.
    dec = codecs.getincrementaldecoder("utf-8")("strict")
    joined = dec.decode(bytes(b for e in content for b in e["bytes"]), final=False)
    if dec.getstate()[0]:  # cut by max_tokens in mid-character: the text ends in U+FFFD there
        assert choice["finish_reason"] == "length" and text.endswith("\ufffd")
        text = text[:-1]
    # The listing may end with the stop token (EOS), which the message text leaves out.
    assert joined.startswith(text) and any("\ufffd" in e["token"] for e in content)
    assert all(e["bytes"] != [239, 191, 189] for e in content if "\ufffd" in e["token"])
