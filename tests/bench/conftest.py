"""Fixtures for the serving benchmark tests.

``bench_server``: the embedded default model behind trellm's own app and uvicorn
settings, started with the server tests' helper (tests/server/server_helpers.py).
``fake_server``: a stricter fake OpenAI-compatible server (fake_openai.py).
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
from fake_openai import FakeServer, start_fake_server

# The server tests' helpers live beside their tests, not in a package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from server_helpers import API_KEY, LiveServer, start_server  # noqa: E402


@pytest.fixture(scope="module")
def bench_server(default_gguf) -> LiveServer:
    from trellm.config import ServerConfig
    from trellm.engine.engine import Engine
    from trellm.entrypoints.llm import engine_config_from_kwargs

    engine = Engine(engine_config_from_kwargs(default_gguf, max_model_len=256, kv_cache_memory=16 << 20,
                                              max_num_seqs=4))
    live = start_server(engine, ServerConfig(api_key=API_KEY))
    yield live
    live.stop()


@pytest.fixture
def fake_server() -> FakeServer:
    fake = start_fake_server()
    yield fake
    fake.stop()
