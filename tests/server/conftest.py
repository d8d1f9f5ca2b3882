"""Server test fixtures.

``server`` is ONE live server for the whole session: the embedded default model
behind uvicorn on a free loopback port, in a thread of this process, so tests can
also reach the engine (between steps) to check KV-cache invariants. Fault tests
(engine death, queue full, shutdown) each get a throwaway server on a tiny
random-weight model that loads in well under a second.

``hostile`` is one tiny-model server for the hostile-input catalogue
(test_hostile_*.py), with short header and body deadlines; after every test that
uses it, a normal request must still succeed and the engine must hold nothing.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from server_helpers import API_KEY, MAX_MODEL_LEN, LiveServer, assert_still_serves, start_server

from trellm.config import ServerConfig
from trellm.engine.engine import Engine
from trellm.entrypoints.llm import engine_config_from_kwargs


@pytest.fixture(scope="session")
def server(default_gguf) -> LiveServer:
    engine = Engine(engine_config_from_kwargs(default_gguf, max_model_len=MAX_MODEL_LEN,
                                              kv_cache_memory=48 << 20, max_num_seqs=8))
    live = start_server(engine, ServerConfig(api_key=API_KEY, max_n=4))
    yield live
    live.stop()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, default_gguf) -> Path:
    """A 2-layer random-weight Llama with the default model's tokenizer and chat template."""
    from trellm.tokenizer.tokenizer import Tokenizer

    out = tmp_path_factory.mktemp("tiny-model")
    tok = Tokenizer.from_gguf(default_gguf)
    tok.hf.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": tok.bos_token, "eos_token": tok.eos_token, "chat_template": tok.chat_template}))
    (out / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": tok.vocab_size, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 256, "tie_word_embeddings": True,
        "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id}))
    return out


@pytest.fixture
def tiny_engine(tiny_model_dir):
    """A fresh tiny engine per test (fault tests break theirs)."""
    def make(**kw) -> Engine:
        args = dict(kv_cache_memory=8 << 20, max_num_seqs=4)
        args.update(kw)
        return Engine(engine_config_from_kwargs(f"dummy:{tiny_model_dir / 'config.json'}", **args))
    return make


@pytest.fixture
def tiny_server(tiny_engine):
    """Factory: a throwaway live server on the tiny model; stopped after the test."""
    started: list[LiveServer] = []

    def make(config: ServerConfig = ServerConfig(), engine_kw: dict | None = None, **async_kw) -> LiveServer:
        live = start_server(tiny_engine(**(engine_kw or {})), config, **async_kw)
        started.append(live)
        return live

    yield make
    for live in started:
        live.stop()


# 1 s header and body deadlines (defaults 10 s and 30 s) let the slow-sender tests
# finish in seconds; everything else is the default configuration.
HOSTILE_CONFIG = ServerConfig(api_key=API_KEY, max_n=4, request_header_timeout_s=1.0, request_body_timeout_s=1.0)


@pytest.fixture(scope="session")
def hostile(tiny_model_dir) -> LiveServer:
    engine = Engine(engine_config_from_kwargs(f"dummy:{tiny_model_dir / 'config.json'}",
                                              kv_cache_memory=8 << 20, max_num_seqs=4))
    live = start_server(engine, HOSTILE_CONFIG)
    yield live
    live.stop()


@pytest.fixture(autouse=True)
def _hostile_then_normal(request):
    """After each test on the ``hostile`` server: a normal request still succeeds."""
    live = request.getfixturevalue("hostile") if "hostile" in request.fixturenames else None
    yield
    if live is not None:
        assert_still_serves(live)
