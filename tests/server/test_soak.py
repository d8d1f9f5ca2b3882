"""Bounded soak test (reliability.md §4.3): a real ``trellm serve`` process on the
default model, on loopback, under a seeded mix of 8 concurrent clients for at most
45 s / 120 requests, with a KV pool small enough to force preemption. Then an
overload burst. Shutdown and injected faults are test_faults.py's.

Invariants: no 5xx; greedy outputs (token by token) equal their batch-1 golden
outputs; streamed text equals it too; usage adds up; once idle, nothing runs or
waits and every KV block is free; preemption happened; /health p99 < 1 s during the
soak; RSS grew < 64 MB; a burst past the queue cap gets >= cap successes and
503 + Retry-After for the rest. Every loop is bounded by a count and a deadline.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx
import psutil
import pytest
from server_helpers import metric

pytestmark = pytest.mark.soak

KEY = "soak-key"
MAX_TOKENS = 16
SEATS = 4
QUEUE_CAP = 32
KV_BLOCKS = 8
"""128 tokens, one context's worth: four sequences of 31-39 tokens need up to 12 blocks,
so running requests keep preempting each other."""
BLOCK_BYTES = 2 * 30 * 16 * 3 * 64 * 4
"""SmolLM2-135M, float32: K and V x 30 layers x 16 tokens x 3 KV heads x 64 dims x 4 bytes."""
SOAK_S, SOAK_REQUESTS, WORKERS = 45.0, 120, 8
# Picked offline: at every greedy step the top-2 log-prob margin is >= 0.02, so
# batch shape and preemption cannot flip a near-tie (§3.2).
PROMPTS = [
    "The history of the printing press begins in the fifteenth century, when a goldsmith in Mainz",
    "In mathematics, a prime number is a natural number greater than one that has no divisors other than",
    "import numpy as np\n\ndef softmax(x):\n    \"\"\"Compute the softmax of a vector.\"\"\"\n",
    "My favourite recipe for pancakes needs flour, two eggs, a cup of milk and a pinch of",
    "Photosynthesis converts light energy into chemical energy, which plants store in the form of",
    "A long time ago in a galaxy far, far away, there lived a young farmer who dreamed of",
    "The three laws of robotics state that a robot may not injure a human being or, through inaction,",
    "The Fibonacci sequence starts with 0 and 1, and each following number is the sum of",
]
MIX = {"greedy": 50, "stream": 25, "disconnect": 8, "timeout": 5, "invalid": 7, "n2": 5}
INVALID = [  # (body or raw bytes, headers, expected status)
    ({"prompt": "x", "n": 0}, {}, 400),
    ({"prompt": "x", "model": "nope"}, {}, 404),
    ({"prompt": "x"}, {"Authorization": "Bearer wrong"}, 401),
    ({"prompt": "word " * 200}, {}, 400),
    ({"prompt": "x", "max_tokens": "10"}, {}, 400),
    (b'{"prompt": ', {}, 400),
]


@dataclass
class Golden:
    prompt: str
    text: str
    tokens: list[str]
    prompt_tokens: int
    margins: list[float]


@dataclass
class Tally:
    counts: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    n2_seen: dict[tuple[int, str], list[str]] = field(default_factory=dict)
    health_s: list[float] = field(default_factory=list)

    def count(self, outcome: str) -> None:
        self.counts[outcome] = self.counts.get(outcome, 0) + 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def soak_server(default_gguf):
    port = _free_port()
    argv = [sys.executable, "-m", "trellm.entrypoints.cli", "serve", default_gguf, "--port", str(port),
            "--api-key", KEY, "--quantization", "none", "--dtype", "float32", "--max-model-len", "128",
            "--max-num-seqs", str(SEATS), "--kv-cache-memory", str(KV_BLOCKS * BLOCK_BYTES),
            "--no-enable-prefix-caching", "--max-queued-requests", str(QUEUE_CAP), "--max-queue-wait", "20",
            "--max-n", "2", "--shutdown-timeout", "5"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # leave the client a core
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, proc.stderr.read()
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "trellm serve did not come up"
        time.sleep(0.2)
    yield proc, url
    proc.terminate()
    assert proc.wait(timeout=20) == 0


def _body(prompt: str, **kw) -> dict:
    return {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, **kw}


def _golden(client: httpx.Client) -> list[Golden]:
    out = []
    for p in PROMPTS:
        r = client.post("/v1/completions", json=_body(p, logprobs=2))
        assert r.status_code == 200, r.text
        choice, usage = r.json()["choices"][0], r.json()["usage"]
        margins = [sorted(t.values(), reverse=True)[0] - sorted(t.values(), reverse=True)[1]
                   for t in choice["logprobs"]["top_logprobs"]]
        out.append(Golden(p, choice["text"], choice["logprobs"]["tokens"], usage["prompt_tokens"], margins))
    return out


def _check_greedy(g: Golden, choice: dict, usage: dict | None, tally: Tally, kind: str) -> None:
    tokens = choice["logprobs"]["tokens"] if choice.get("logprobs") else None
    if choice["text"] != g.text or (tokens is not None and tokens != g.tokens):
        at = next((i for i, (a, b) in enumerate(zip(tokens or [], g.tokens)) if a != b), None)
        margin = g.margins[at] if at is not None else None
        tally.failures.append(f"{kind}: {g.prompt[:30]!r} diverged at token {at} (golden margin {margin}): "
                              f"{choice['text']!r} != {g.text!r}")
    if choice["finish_reason"] != "length":
        tally.failures.append(f"{kind}: finish_reason {choice['finish_reason']!r}")
    if usage is not None and (usage["completion_tokens"] != MAX_TOKENS or usage["prompt_tokens"] != g.prompt_tokens
                              or usage["total_tokens"] != g.prompt_tokens + MAX_TOKENS):
        tally.failures.append(f"{kind}: inconsistent usage {usage}")


async def _stream(client: httpx.AsyncClient, body: dict, stop_after: int | None = None) -> list[dict] | None:
    """The stream's JSON events, checked to end with [DONE]; None when cut on purpose."""
    events, done = [], False
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        if r.status_code != 200:
            raise AssertionError(f"stream status {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                events.append(json.loads(line[6:]))
                if stop_after is not None and len(events) == stop_after:
                    return None  # leaving the block drops the connection
    assert done, "the stream ended without [DONE]"
    return events


async def _one(client: httpx.AsyncClient, kind: str, rng: random.Random, golden: list[Golden], tally: Tally) -> None:
    g = rng.choice(golden)
    if kind == "greedy":
        r = await client.post("/v1/completions", json=_body(g.prompt, logprobs=0))
        assert r.status_code == 200, (r.status_code, r.text[:200])
        _check_greedy(g, r.json()["choices"][0], r.json()["usage"], tally, kind)
    elif kind == "stream":
        events = await _stream(client, _body(g.prompt, stream_options={"include_usage": True}))
        if any("error" in e for e in events):
            raise AssertionError(f"error event {events[-1]}")
        text = "".join(c["text"] for e in events for c in e["choices"])
        finish = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
        _check_greedy(g, {"text": text, "finish_reason": finish[-1] if finish else None}, events[-1]["usage"],
                      tally, kind)
    elif kind == "disconnect":
        await _stream(client, _body(g.prompt), stop_after=2)
    elif kind == "timeout":
        try:
            r = await client.post("/v1/completions", json=_body(g.prompt), timeout=0.3)
            _check_greedy(g, r.json()["choices"][0], r.json()["usage"], tally, kind)
        except httpx.TimeoutException:
            pass
    elif kind == "invalid":
        body, headers, status = rng.choice(INVALID)
        if isinstance(body, bytes):
            r = await client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
        else:
            r = await client.post("/v1/completions", json=body, headers=headers)
        assert r.status_code == status and set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text
    elif kind == "n2":
        seed = rng.choice((1, 2, 3))
        r = await client.post("/v1/completions", json=_body(g.prompt, n=2, temperature=0.8, seed=seed, max_tokens=6))
        texts = [c["text"] for c in r.json()["choices"]]
        assert r.status_code == 200 and len(texts) == 2, r.text[:200]
        first = tally.n2_seen.setdefault((seed, g.prompt), texts)
        if first != texts:  # a seeded request must repeat exactly, whatever ran beside it
            tally.failures.append(f"n2: seed {seed} gave {texts} after {first}")


async def _soak(url: str, golden: list[Golden]) -> Tally:
    rng = random.Random(7)
    plan = rng.choices(list(MIX), weights=list(MIX.values()), k=SOAK_REQUESTS)
    tally = Tally()
    deadline = time.monotonic() + SOAK_S
    stop = asyncio.Event()
    headers = {"Authorization": f"Bearer {KEY}"}

    async def worker(client: httpx.AsyncClient, wid: int) -> None:
        wrng = random.Random(wid)
        while plan and time.monotonic() < deadline:
            kind = plan.pop()
            try:
                await _one(client, kind, wrng, golden, tally)
                tally.count(kind)
            except Exception as e:  # noqa: BLE001 - every unexpected outcome is a recorded failure
                tally.failures.append(f"{kind}: {type(e).__name__}: {str(e)[:300]}")

    async def health(client: httpx.AsyncClient) -> None:
        while not stop.is_set():
            t0 = time.monotonic()
            r = await client.get("/health")
            tally.health_s.append(time.monotonic() - t0)
            if r.status_code != 200:
                tally.failures.append(f"/health answered {r.status_code}")
            await asyncio.sleep(0.25)

    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60) as client:
        poller = asyncio.create_task(health(client))
        await asyncio.gather(*(worker(client, w) for w in range(WORKERS)))
        stop.set()
        await poller
    return tally


def _engine_state(client: httpx.Client) -> dict[str, float]:
    text = client.get("/metrics").text
    return {k: metric(text, f"trellm:{k}") for k in ("num_requests_running", "num_requests_waiting",
                                                      "kv_cache_free_blocks", "kv_cache_total_blocks",
                                                      "num_preemptions_total")}


def _wait_idle(client: httpx.Client, within: float) -> dict[str, float]:
    deadline = time.monotonic() + within
    while True:
        s = _engine_state(client)
        idle = s["num_requests_running"] == s["num_requests_waiting"] == 0
        if (idle and s["kv_cache_free_blocks"] == s["kv_cache_total_blocks"]) or time.monotonic() > deadline:
            return s
        time.sleep(0.1)


async def _burst(url: str, n: int) -> list[httpx.Response]:
    limits = httpx.Limits(max_connections=n)
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                                 limits=limits) as client:
        body = {"prompt": "Hi there", "max_tokens": 2, "temperature": 0}
        return await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(n)))


def test_soak(soak_server):
    proc, url = soak_server
    timings: dict[str, float] = {}
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as client:
        t0 = time.monotonic()
        golden = _golden(client)
        timings["golden"] = time.monotonic() - t0
        rss_warm = psutil.Process(proc.pid).memory_info().rss

        t0 = time.monotonic()
        tally = asyncio.run(_soak(url, golden))
        timings["soak"] = time.monotonic() - t0
        t0 = time.monotonic()
        state = _wait_idle(client, within=2.0)
        timings["idle"] = time.monotonic() - t0
        rss_growth = psutil.Process(proc.pid).memory_info().rss - rss_warm

        t0 = time.monotonic()
        burst = asyncio.run(_burst(url, 2 * QUEUE_CAP))
        after_burst = _wait_idle(client, within=5.0)
        timings["burst"] = time.monotonic() - t0
    health = sorted(tally.health_s)
    p99 = health[min(len(health) - 1, int(0.99 * len(health)))]
    print(f"\nsoak timings {timings}; outcomes {tally.counts}; /health p99 {p99 * 1000:.0f} ms; "
          f"rss growth {rss_growth / 2**20:.1f} MiB; state {state}")

    assert not tally.failures, "\n".join(tally.failures[:20])
    assert sum(tally.counts.values()) >= 40 and tally.counts.get("greedy", 0) >= 10, tally.counts
    assert state["num_requests_running"] == state["num_requests_waiting"] == 0, state
    assert state["kv_cache_free_blocks"] == state["kv_cache_total_blocks"] == KV_BLOCKS, state
    assert state["num_preemptions_total"] > 0, "the soak never preempted: the KV pool is too large"
    assert p99 < 1.0, health[-5:]
    assert rss_growth < 64 << 20

    statuses = [r.status_code for r in burst]
    assert statuses.count(200) >= QUEUE_CAP and set(statuses) <= {200, 503}, statuses
    for r in burst:
        if r.status_code == 503:
            assert r.json()["error"]["code"] == "queue_full" and r.headers["retry-after"]
    assert after_burst["kv_cache_free_blocks"] == after_burst["kv_cache_total_blocks"], after_burst
