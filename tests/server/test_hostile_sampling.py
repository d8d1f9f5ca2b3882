"""Hostile input, sampling parameters (reliability.md §2 D, #34-#52), against the
tiny ``hostile`` server. Out-of-range values are 400 with ``param`` naming the
field; structured output and tools, which this server does not support, are a 400
too (never silently ignored), so no grammar or schema ever reaches the engine."""
from __future__ import annotations

import time

import pytest
from server_helpers import MODEL_NAME, assert_openai_error, chat_body, completion_body

CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
CTX = 256  # the tiny model's context


def _post(live, path: str, body):
    with live.client() as c:
        if isinstance(body, bytes):
            return c.post(path, content=body, headers={"content-type": "application/json"})
        return c.post(path, json=body)


def _raw_cmpl(field: str, value: str) -> bytes:
    return f'{{"model": "{MODEL_NAME}", "prompt": "Hi", "max_tokens": 2, "{field}": {value}}}'.encode()


def _greedy_text(live, **kw) -> str:
    r = _post(live, CMPL, completion_body(prompt="Once upon a time", max_tokens=12, ignore_eos=True, **kw))
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


@pytest.mark.parametrize("value", [0, -1])
def test_34_max_tokens_below_one_is_400(hostile, value):
    assert_openai_error(_post(hostile, CHAT, chat_body(max_tokens=value)), 400, "max_tokens")
    assert_openai_error(_post(hostile, CHAT, chat_body(max_completion_tokens=value)), 400,
                        "max_completion_tokens")
    assert_openai_error(_post(hostile, CMPL, completion_body(max_tokens=value)), 400,
                        "max_tokens" if value < 0 else None)


@pytest.mark.parametrize("raw", [str(10**9), str(2**31), str(2**63), "9" * 400, "9" * 5000, "1e9", "-" + "9" * 30])
def test_35_huge_max_tokens_is_400_without_overflow(hostile, raw):
    err = assert_openai_error(_post(hostile, CMPL, _raw_cmpl("max_tokens", raw)), 400)
    if raw == str(10**9):
        assert err["code"] == "context_length_exceeded" and err["param"] == "max_tokens"
        assert "256" in err["message"] and str(10**9) in err["message"]


def test_36_omitted_max_tokens_fills_the_context(hostile):
    r = _post(hostile, CHAT, chat_body(temperature=0, ignore_eos=True))
    u = r.json()["usage"]
    assert r.status_code == 200 and u["prompt_tokens"] + u["completion_tokens"] == CTX
    assert r.json()["choices"][0]["finish_reason"] == "length"
    # /v1/completions keeps OpenAI's default of 16; null means "the rest of the context".
    body = completion_body(temperature=0, ignore_eos=True)
    assert _post(hostile, CMPL, body).json()["usage"]["completion_tokens"] == 16
    assert _post(hostile, CMPL, {**body, "max_tokens": None}).json()["usage"]["total_tokens"] == CTX


@pytest.mark.parametrize("raw", ["-0.1", "2.5", "NaN", "Infinity", "-Infinity", "1e308", "1e999", '"0.5"', "true",
                                 "null0"])
def test_37_bad_temperature_is_400(hostile, raw):
    err = assert_openai_error(_post(hostile, CMPL, _raw_cmpl("temperature", raw)), 400)
    assert err["param"] in ("temperature", None)  # None: not JSON at all ("null0")
    assert raw == "null0" or err["param"] == "temperature"


def test_38_temperature_zero_is_greedy_and_deterministic(hostile):
    a = _greedy_text(hostile, temperature=0)
    assert a == _greedy_text(hostile, temperature=0) == _greedy_text(hostile, temperature=0, seed=5)
    assert a == _greedy_text(hostile, temperature=0.7, top_k=1)


@pytest.mark.parametrize("value", [0, -1, 1.5, "0.5"])
def test_39_top_p_out_of_range_is_400(hostile, value):
    assert_openai_error(_post(hostile, CMPL, completion_body(top_p=value)), 400, "top_p")


def test_39_tiny_top_p_keeps_the_top_token_like_greedy(hostile):
    assert _greedy_text(hostile, temperature=1.0, top_p=1e-12, seed=1) == _greedy_text(hostile, temperature=0)


@pytest.mark.parametrize("value", [-5, -2, 10**9, 2.0, "5"])
def test_40_bad_top_k_is_400(hostile, value):
    assert_openai_error(_post(hostile, CMPL, completion_body(top_k=value)), 400, "top_k")


def test_40_top_k_off_values_and_above_vocab_are_accepted(hostile):
    # -1 and 0 mean "off"; a k above the vocabulary keeps every token (no clamp needed).
    greedy = _greedy_text(hostile, temperature=0)
    for k in (-1, 0, 10**6):
        assert _greedy_text(hostile, temperature=0, top_k=k) == greedy


@pytest.mark.parametrize("field, raw", [("presence_penalty", "5"), ("presence_penalty", "-2.5"),
                                        ("frequency_penalty", "-3"), ("frequency_penalty", "NaN"),
                                        ("repetition_penalty", "0"), ("repetition_penalty", "-1"),
                                        ("repetition_penalty", "NaN"), ("repetition_penalty", "1e9"),
                                        ("min_p", "1.5"), ("min_p", "-0.1")])
def test_41_penalties_out_of_range_are_400(hostile, field, raw):
    assert_openai_error(_post(hostile, CMPL, _raw_cmpl(field, raw)), 400, field)


@pytest.mark.parametrize("n", [0, -1, 5, 1000, 10**6, 10**18])
def test_42_n_out_of_range_is_400_at_once(hostile, n):
    t0 = time.monotonic()
    assert_openai_error(_post(hostile, CMPL, completion_body(n=n)), 400, "n")
    assert_openai_error(_post(hostile, CHAT, chat_body(n=n, stream=True)), 400, "n")
    assert time.monotonic() - t0 < 1.0  # refused before any fan-out


@pytest.mark.parametrize("value", [1000, 2, 0, -1])
def test_43_best_of_other_than_one_is_400(hostile, value):
    assert_openai_error(_post(hostile, CMPL, completion_body(best_of=value)), 400, "best_of")


def test_43_best_of_one_is_the_default(hostile):
    assert _post(hostile, CMPL, completion_body(best_of=1, max_tokens=1)).status_code == 200


@pytest.mark.parametrize("path, body, param", [
    (CHAT, chat_body(logprobs=True, top_logprobs=100000), "top_logprobs"),
    (CHAT, chat_body(logprobs=True, top_logprobs=21), "top_logprobs"),
    (CHAT, chat_body(logprobs=True, top_logprobs=-1), "top_logprobs"),
    (CHAT, chat_body(top_logprobs=2), None),  # top_logprobs without logprobs
    (CMPL, completion_body(logprobs=-1), "logprobs"),
    (CMPL, completion_body(logprobs=21), "logprobs"),
    (CMPL, completion_body(logprobs=True), "logprobs"),
    (CMPL, completion_body(prompt_logprobs=-1), "prompt_logprobs"),
    (CMPL, completion_body(prompt_logprobs=5), "prompt_logprobs"),
    (CHAT, chat_body(prompt_logprobs=1), "prompt_logprobs"),
])
def test_44_log_prob_counts_are_capped(hostile, path, body, param):
    assert_openai_error(_post(hostile, path, body), 400, param)


def test_44_server_cap_is_lower_than_the_schema_cap(hostile):
    # The hostile server runs with the default --max-logprobs 20; 20 is accepted.
    r = _post(hostile, CHAT, chat_body(max_tokens=2, logprobs=True, top_logprobs=20))
    assert r.status_code == 200 and len(r.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 20


@pytest.mark.parametrize("stop", ["", [""], ["ok", ""], ["s"] * 10_000, "x" * (1 << 20), [1, 2], [None], {"a": 1},
                                  ["s"] * 17, "x" * 257])
def test_45_bad_stop_is_400(hostile, stop):
    err = assert_openai_error(_post(hostile, CMPL, completion_body(stop=stop)), 400)
    assert err["param"].startswith("stop"), err  # "stop" or the item, "stop[1]"


def test_46_stop_strings_match_literally(hostile):
    text = _greedy_text(hostile, temperature=0)
    literal = [".*", "\\d+", "^", "$", "(", "[a-z]", "<|im_end|>", "<|endoftext|>", "{{", "%s"]
    cut = _post(hostile, CMPL, completion_body(prompt="Once upon a time", max_tokens=12, ignore_eos=True,
                                               temperature=0, stop=[s for s in literal if s not in text][:16]))
    assert cut.json()["choices"][0]["text"] == text  # none of them occurs literally: nothing cut
    for stop in text[3:6], text[5:7]:  # and a piece of the text, metacharacters or not, does cut
        if stop:
            r = _post(hostile, CMPL, completion_body(prompt="Once upon a time", max_tokens=12, ignore_eos=True,
                                                     temperature=0, stop=stop))
            assert r.json()["choices"][0]["text"] == text[: text.index(stop)]
            assert r.json()["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("bias", [{"49152": 1}, {"99999999999": 1}, {"-1": 1}, {"abc": 1}, {"1.5": 1},
                                  {"5": "x"}, {"5": 1e9}, {"5": -101}, {"5": None},
                                  {str(i): 1 for i in range(100_000)}, [1, 2], {"٣": 1}])
def test_47_bad_logit_bias_is_400(hostile, bias):
    err = assert_openai_error(_post(hostile, CMPL, completion_body(logit_bias=bias)), 400)
    assert err["param"] is not None and err["param"].startswith("logit_bias"), err


def test_47_logit_bias_lists_every_out_of_vocab_key(hostile):
    err = assert_openai_error(_post(hostile, CMPL, completion_body(logit_bias={"49152": 1, "50000": 2, "7": 3})),
                              400, "logit_bias")
    assert "49152" in err["message"] and "50000" in err["message"] and "7," not in err["message"]


def test_47_logit_bias_and_nan_values(hostile):
    assert_openai_error(_post(hostile, CMPL, _raw_cmpl("logit_bias", '{"5": NaN}')), 400)
    r = _post(hostile, CMPL, completion_body(max_tokens=4, logit_bias={"5": 100}, logprobs=0))
    tokens = r.json()["choices"][0]["logprobs"]["tokens"]
    five = hostile.engine.tokenizer.decode([5], skip_special_tokens=False)
    assert tokens == [five] * 4  # a +100 bias wins every step


@pytest.mark.parametrize("raw", [str(2**63), str(2**70), "-" + str(2**63 + 1), "1.5", '"7"', "true"])
def test_48_seed_out_of_range_is_400(hostile, raw):
    assert_openai_error(_post(hostile, CMPL, _raw_cmpl("seed", raw)), 400, "seed")


def test_48_negative_seeds_are_valid_and_deterministic(hostile):
    texts = {_greedy_text(hostile, temperature=1.0, seed=s) for s in (-1, -1)}
    assert len(texts) == 1
    assert _greedy_text(hostile, temperature=1.0, seed=-(2**63)) is not None


@pytest.mark.parametrize("body, param", [
    (completion_body(stream="yes"), "stream"), (completion_body(stream=1), "stream"),
    (chat_body(stream_options={"include_usage": True}), None),
    (chat_body(stream=True, stream_options={"include_usage": "yes"}), "stream_options.include_usage"),
])
def test_49_stream_flags_are_strict(hostile, body, param):
    path = CHAT if "messages" in body else CMPL
    assert_openai_error(_post(hostile, path, body), 400, param)


@pytest.mark.parametrize("fmt", [{"type": "json_schema"}, {"type": "json_object"},
                                 {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}},
                                 {"type": "regex"}, "json", None])
def test_50_response_format_other_than_text_is_400(hostile, fmt):
    for path, body in ((CHAT, chat_body(response_format=fmt)), (CMPL, completion_body(response_format=fmt))):
        if fmt is None:
            assert _post(hostile, path, {**body, "max_tokens": 1}).status_code == 200
        else:
            err = assert_openai_error(_post(hostile, path, body), 400)
            assert err["param"].startswith("response_format"), err
            assert err["message"].startswith("structured output"), err
    assert _post(hostile, CHAT, chat_body(max_tokens=1, response_format={"type": "text"})).status_code == 200


def _nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize("field, value", [
    ("guided_regex", "foo**"), ("guided_regex", "(a+)+$"),
    ("guided_json", {"enum": [str(i) for i in range(10_000)]}),
    ("guided_json", {"$ref": "#/definitions/a", "definitions": {"a": {"$ref": "#/definitions/a"}}}),
    ("guided_json", _nested(200)),
    ("guided_choice", ["a", "b"]), ("guided_grammar", "root ::= root"), ("structured_outputs", {"regex": "a"}),
    ("guided_decoding_backend", "outlines"), ("logits_processors", ["pkg.mod:cls"]),
])
def test_51_grammars_and_schemas_are_400_at_once(hostile, field, value):
    t0 = time.monotonic()
    for path, body in ((CHAT, chat_body(**{field: value})), (CMPL, completion_body(**{field: value}))):
        err = assert_openai_error(_post(hostile, path, body), 400, field)
        assert err["message"] == f"{field} is not supported by this server"
    assert time.monotonic() - t0 < 2.0


@pytest.mark.parametrize("field, value", [
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                              "pattern": "(a+)+$"}}}]),
    ("tools", [{"type": "function", "function": {"name": f"f{i}"}} for i in range(10_000)]),
    ("tools", [{}]), ("tools", "all"), ("tool_choice", "auto"), ("tool_choice", "required"),
    ("tool_choice", {"type": "function", "function": {"name": "f"}}),
    ("functions", [{"name": "f"}]), ("function_call", "auto"),
])
def test_52_tools_are_400(hostile, field, value):
    err = assert_openai_error(_post(hostile, CHAT, chat_body(**{field: value})), 400)
    assert err["param"].startswith(field), err
    # Say what was asked for, not pydantic's "List should have at most 0 items".
    assert "not supported by this server" in err["message"], err


def test_52_empty_tools_and_tool_choice_none_are_accepted(hostile):
    assert _post(hostile, CHAT, chat_body(max_tokens=1, tools=[], tool_choice="none")).status_code == 200
