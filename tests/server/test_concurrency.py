"""Concurrency and resources (reliability.md §2 F, #62-#70): more work than seats or KV
blocks, clients that leave, idle connections, deadlines. Throwaway tiny-model servers
with the limits each case needs; every test ends with the engine idle and every KV
block free."""
from __future__ import annotations

import concurrent.futures
import json
import random
import threading
import time

import httpx
import pytest
from server_helpers import (
    RawConnection,
    assert_openai_error,
    chat_body,
    completion_body,
    slow_steps,
    wait_engine_idle,
)

from trellm.config import ServerConfig

BLOCK_BYTES = 8192
"""KV bytes per 16-token block of the tiny model (2 layers x K,V x 2 heads x 16 dims x fp32)."""


def _assert_idle(live) -> dict:
    state = wait_engine_idle(live)
    assert not state["busy"] and state["free"] == state["total"], state
    return state


def _post(live, body: dict) -> httpx.Response:
    with live.client() as c:
        return c.post("/v1/completions", json=body)


def _tokens(r: httpx.Response) -> list[list[str]]:
    assert r.status_code == 200, r.text
    return [c["logprobs"]["tokens"] for c in r.json()["choices"]]


def test_62_more_requests_than_kv_and_seats_queue_preempt_or_503(tiny_server):
    """24 blocks (1.5 context-lengths of 256 tokens), 4 seats, 10 queue places; 24
    concurrent greedy requests of up to 100 tokens each. Every answer is a 200 equal to
    the request's batch-1 output, or a 503 queue_full with Retry-After."""
    live = tiny_server(ServerConfig(max_queued_requests=10, retry_after_s=3),
                       engine_kw={"kv_cache_memory": 24 * BLOCK_BYTES, "max_num_seqs": 4,
                                  "enable_prefix_caching": False})
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(60)] for _ in range(8)]
    body = dict(max_tokens=40, temperature=0, ignore_eos=True, logprobs=0)
    with live.client() as c:
        golden = [_tokens(c.post("/v1/completions", json=completion_body(prompt=p, **body)))[0] for p in prompts]

    def post(i: int) -> tuple[int, httpx.Response]:
        with live.client() as c:
            return i % 8, c.post("/v1/completions", json=completion_body(prompt=prompts[i % 8], **body))

    with concurrent.futures.ThreadPoolExecutor(24) as pool:
        results = list(pool.map(post, range(24)))
    ok = [(i, r) for i, r in results if r.status_code == 200]
    full = [r for _, r in results if r.status_code != 200]
    assert len(ok) >= 14, [r.status_code for _, r in results]
    for i, r in ok:
        assert _tokens(r)[0] == golden[i]
    for r in full:
        assert assert_openai_error(r, 503)["code"] == "queue_full" and r.headers["retry-after"] == "3"
    assert _assert_idle(live)["preemptions"] > 0  # the preemption path really ran


def test_63_request_larger_than_the_kv_pool_is_400_not_a_hang(tiny_server):
    # 10 blocks = 160 tokens: the context is capped to what the pool can ever hold.
    live = tiny_server(engine_kw={"kv_cache_memory": 10 * BLOCK_BYTES})
    with live.client() as c:
        assert c.get("/v1/models").json()["data"][0]["max_model_len"] == 160
        err = assert_openai_error(c.post("/v1/completions", json=completion_body(
            prompt=[7] * 100, max_tokens=100)), 400, "max_tokens")
        assert err["code"] == "context_length_exceeded"
        # Exactly the pool, twice over with n=2 (siblings take turns): finishes.
        t0 = time.monotonic()
        r = c.post("/v1/completions", json=completion_body(prompt=[7] * 100, max_tokens=60, n=2, ignore_eos=True,
                                                           temperature=1.0, seed=1))
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 120
        assert time.monotonic() - t0 < 30
    _assert_idle(live)


def test_64_stream_disconnect_frees_kv_and_leaves_other_streams_alone(hostile):
    body = completion_body(prompt="Tell me a story", max_tokens=60, temperature=0, ignore_eos=True)
    with hostile.client() as c:
        expected = c.post("/v1/completions", json=body).json()["choices"][0]["text"]
    other: list[str] = []

    def full_stream() -> None:
        with hostile.client() as c, c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    other.append(json.loads(line[6:])["choices"][0]["text"])

    t = threading.Thread(target=full_stream)
    t.start()
    with hostile.client() as c, c.stream("POST", "/v1/completions", json={**body, "max_tokens": 250,
                                                                          "stream": True}) as r:
        chunks = 0
        for line in r.iter_lines():
            chunks += line.startswith("data: {")
            if chunks == 2:
                break  # leaving the block drops the connection mid-stream
    t.join(30)
    assert "".join(other) == expected


def test_65_client_leaving_while_queued_is_never_run(tiny_server):
    live = tiny_server(engine_kw={"max_num_seqs": 1})
    scheduled: list[tuple[int, ...]] = []
    slow_steps(live, 0.02, seen=scheduled)
    first = completion_body(prompt=[11] * 8, max_tokens=60, ignore_eos=True)
    queued = completion_body(prompt=[22] * 8, max_tokens=5)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(_post, live, first)
        time.sleep(0.3)
        with live.client(timeout=0.3) as c, pytest.raises(httpx.ReadTimeout):
            c.post("/v1/completions", json=queued)
        assert running.result(30).status_code == 200
    _assert_idle(live)
    assert (11,) * 8 in scheduled and (22,) * 8 not in scheduled


def test_66_n4_stream_disconnect_aborts_every_sibling(tiny_server):
    live = tiny_server()
    slow_steps(live, 0.02)
    with live.client() as c, c.stream("POST", "/v1/chat/completions", json=chat_body(
            n=4, max_tokens=200, temperature=1.0, seed=2, ignore_eos=True, stream=True)) as r:
        chunks = 0
        for line in r.iter_lines():
            chunks += line.startswith("data: {")
            if chunks == 3:
                break
    t0 = time.monotonic()
    _assert_idle(live)
    assert time.monotonic() - t0 < 2.0  # 4 x 200 tokens at 20 ms a step would take 4 s more


def test_67_client_timeout_then_retry_of_the_same_body(tiny_server):
    live = tiny_server()
    slow_steps(live, 0.02)
    body = completion_body(prompt="Retry me", max_tokens=50, temperature=0, ignore_eos=True)
    with live.client(timeout=0.4) as c, pytest.raises(httpx.ReadTimeout):
        c.post("/v1/completions", json=body)
    with live.client() as c:
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 50
        metrics = c.get("/metrics").text
        assert 'trellm:request_finished_total{reason="abort"} 1.0' in metrics
        # The timed-out request is a client cancel (499), not a server error: the
        # completions route awaits an asyncio.gather, which once surfaced as a 500.
        assert 'route="/v1/completions",status="499"} 1.0' in metrics
        assert 'status="500"' not in metrics
    _assert_idle(live)


def test_68_hundreds_of_idle_connections_do_not_lock_others_out(hostile):
    conns = [RawConnection(hostile.port) for _ in range(300)]
    try:
        with hostile.client() as c:
            t0 = time.monotonic()
            assert c.get("/health").status_code == 200
            assert c.post("/v1/completions", json=completion_body(max_tokens=1)).status_code == 200
            assert time.monotonic() - t0 < 1.0
        # The header deadline (1 s here) closes every one of them.
        deadline = time.monotonic() + 5
        closed = sum(conn.closed_by_server(within=max(deadline - time.monotonic(), 0.01)) for conn in conns)
        assert closed == len(conns)
    finally:
        for conn in conns:
            conn.sock.close()


def test_69_identical_prompts_with_prefix_cache_give_identical_outputs(hostile):
    body = chat_body(content="The same question, asked eight times at once.", max_tokens=12, temperature=0,
                     ignore_eos=True)

    def post(_):
        with hostile.client() as c:
            return c.post("/v1/chat/completions", json=body).json()

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(post, range(8)))
    assert len({o["choices"][0]["message"]["content"] for o in outs}) == 1
    assert any(o["usage"]["prompt_tokens_details"]["cached_tokens"] > 0 for o in outs)
    # (The conftest then checks that every block's reference was released.)


def test_70_queue_wait_deadline_is_503_or_a_stream_error(tiny_server):
    live = tiny_server(ServerConfig(max_queue_wait_s=0.5, retry_after_s=2), engine_kw={"max_num_seqs": 1})
    slow_steps(live, 0.02)
    long = completion_body(prompt="first", max_tokens=100, ignore_eos=True)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        first = pool.submit(_post, live, long)
        time.sleep(0.3)
        with live.client() as c:
            t0 = time.monotonic()
            r = c.post("/v1/completions", json=completion_body(max_tokens=2))
            waited = time.monotonic() - t0
            err = assert_openai_error(r, 503)
            assert err["code"] == "queue_timeout" and r.headers["retry-after"] == "2"
            assert 0.4 < waited < 1.5
            with c.stream("POST", "/v1/chat/completions", json=chat_body(max_tokens=2, stream=True)) as s:
                assert s.status_code == 200  # the stream's header was out before the deadline
                events = [line for line in s.iter_lines() if line]
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2][6:])["error"]["code"] == "queue_timeout"
        assert first.result(30).json()["usage"]["completion_tokens"] == 100  # unaffected
    _assert_idle(live)


def test_68_in_flight_request_cap_is_503_and_health_is_exempt():
    """The app-level cap (uvicorn's own would count idle connections too): over the
    limit, 503 + Retry-After in the OpenAI shape; /health always answers."""
    import asyncio

    from trellm.server.middleware import ConcurrencyLimitMiddleware

    release = asyncio.Event()

    async def slow_app(scope, receive, send):
        await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    app = ConcurrencyLimitMiddleware(slow_app, limit=2, retry_after_s=4)

    async def run() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            held = [asyncio.create_task(c.get("/v1/models")) for _ in range(2)]
            await asyncio.sleep(0.05)
            over = await c.get("/v1/models")
            health = asyncio.create_task(c.get("/health"))  # exempt: waits for the app, not refused
            await asyncio.sleep(0.05)
            assert not health.done()
            release.set()
            return [over, *(await asyncio.gather(*held, health))]

    over, *rest = asyncio.run(run())
    err = assert_openai_error(over, 503)
    assert err["code"] == "too_many_requests" and over.headers["retry-after"] == "4"
    assert [r.status_code for r in rest] == [200, 200, 200] and app.in_flight == 0
