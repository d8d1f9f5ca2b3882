"""Overload and failure behaviour, each on a throwaway server with a tiny
random-weight model: queue full -> 503 + Retry-After; engine death -> every
pending request gets an error, /health turns 503, new requests are refused;
in a real ``trellm serve`` process: death exits non-zero, SIGTERM drains and exits 0."""
from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from server_helpers import assert_openai_error, chat_body, completion_body

from trellm.config import ServerConfig


def _slow_steps(live, seconds: float, fail: threading.Event | None = None) -> None:
    """Make every engine step take ``seconds`` (and raise once ``fail`` is set)."""
    runner = live.engine.engine.worker.runner
    original = runner.execute

    def execute(plan):
        time.sleep(seconds)
        if fail is not None and fail.is_set():
            raise RuntimeError("injected fault: secret internal detail")
        return original(plan)

    runner.execute = execute


def test_queue_full_gives_503_with_retry_after(tiny_server):
    live = tiny_server(ServerConfig(max_queued_requests=1, retry_after_s=2), engine_kw={"max_num_seqs": 1})
    _slow_steps(live, 0.05)
    body = completion_body(max_tokens=8, ignore_eos=True, temperature=0)

    def post(_):
        with live.client() as c:
            return c.post("/v1/completions", json=body)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(post, range(8)))
    statuses = sorted(r.status_code for r in results)
    assert set(statuses) <= {200, 503}, statuses
    full = [r for r in results if r.status_code == 503]
    assert full and statuses.count(200) >= 2, statuses
    for r in full:
        assert assert_openai_error(r, 503)["code"] == "queue_full"
        assert r.headers["retry-after"] == "2"
    with live.client() as c:  # capacity comes back once the queue drains
        assert c.post("/v1/completions", json=body).status_code == 200
        assert c.get("/metrics").status_code == 200


def test_openai_sdk_sees_503_as_internal_server_error(tiny_server):
    import openai

    live = tiny_server(ServerConfig(max_queued_requests=0), engine_kw={"max_num_seqs": 1})
    _slow_steps(live, 0.05)
    client = live.openai()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futs = [pool.submit(client.completions.create, model="smollm2", prompt="hi", max_tokens=6,
                            extra_body={"ignore_eos": True}) for _ in range(4)]
        errors = [f.exception() for f in futs]
    assert any(isinstance(e, openai.InternalServerError) and e.status_code == 503 for e in errors), errors


def test_engine_death_fails_pending_requests_and_health(tiny_server):
    deaths: list[BaseException] = []
    fail = threading.Event()
    live = tiny_server(on_dead=deaths.append)
    _slow_steps(live, 0.02, fail)
    stream_lines: list[str] = []
    got_chunk = threading.Event()

    def stream():
        with live.client() as c, c.stream("POST", "/v1/chat/completions", json=chat_body(
                max_tokens=200, ignore_eos=True, stream=True)) as r:
            for line in r.iter_lines():
                if line:
                    stream_lines.append(line)
                    if len(stream_lines) >= 3:
                        got_chunk.set()

    def non_stream():
        with live.client() as c:
            return c.post("/v1/completions", json=completion_body(max_tokens=200, ignore_eos=True))

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        s = pool.submit(stream)
        ns = pool.submit(non_stream)
        assert got_chunk.wait(20)
        fail.set()
        s.result(timeout=20)
        r = ns.result(timeout=20)
    # The stream had its 200 header: it ends with an error event, then [DONE].
    assert stream_lines[-1] == "data: [DONE]"
    err = json.loads(stream_lines[-2][len("data: "):])["error"]
    assert err["code"] == "engine_dead" and "secret" not in err["message"]
    # The non-streamed request gets a 500 without internals.
    e = assert_openai_error(r, 500)
    assert e["code"] == "engine_dead" and "secret" not in r.text
    assert len(deaths) == 1 and "injected" in str(deaths[0])
    h = httpx.get(live.url + "/health")
    assert_openai_error(h, 503)
    assert "retry-after" in h.headers
    with live.client() as c:
        assert_openai_error(c.post("/v1/chat/completions", json=chat_body(max_tokens=2)), 503)
        assert "trellm:engine_healthy 0.0" in c.get("/metrics").text


def test_watchdog_declares_a_hung_step_dead(tiny_server):
    deaths: list[BaseException] = []
    live = tiny_server(ServerConfig(engine_step_timeout_s=0.5), on_dead=deaths.append)
    runner = live.engine.engine.worker.runner
    original = runner.execute

    def hang(plan):
        time.sleep(3.0)
        return original(plan)

    runner.execute = hang
    t0 = time.monotonic()
    with live.client() as c:
        r = c.post("/v1/completions", json=completion_body(max_tokens=2))
    assert time.monotonic() - t0 < 2.5  # answered by the watchdog, not by the step
    assert assert_openai_error(r, 500)["code"] == "engine_dead"
    assert len(deaths) == 1 and isinstance(deaths[0], TimeoutError)
    assert httpx.get(live.url + "/health").status_code == 503


# ---- a real `trellm serve` process -----------------------------------------------------------


_LAUNCHER = """
import sys, time
from trellm.worker import model_runner
original = model_runner.ModelRunner.execute
calls = 0
def execute(self, plan):
    global calls
    calls += 1
    time.sleep(0.02)  # slow enough for requests to be in flight
    if sys.argv[1] == "fault" and calls > 20:
        raise RuntimeError("injected fault")
    return original(self, plan)
model_runner.ModelRunner.execute = execute
from trellm.entrypoints.cli import main
sys.exit(main(sys.argv[2:]))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def serve_process(tiny_model_dir):
    procs: list[subprocess.Popen] = []

    def start(mode: str, *flags: str) -> tuple[subprocess.Popen, str]:
        port = _free_port()
        argv = [sys.executable, "-c", _LAUNCHER, mode, "serve", f"dummy:{tiny_model_dir / 'config.json'}",
                "--port", str(port), "--kv-cache-memory", str(8 << 20), "--max-num-seqs", "4", *flags]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TRELLM_API_KEY": ""}
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        procs.append(proc)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    return proc, url
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "trellm serve did not come up"
            time.sleep(0.1)

    yield start
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_engine_death_exits_non_zero(serve_process):
    proc, url = serve_process("fault")
    r = httpx.post(url + "/v1/completions", json=completion_body(model=None, max_tokens=100, ignore_eos=True),
                   timeout=30)
    assert_openai_error(r, 500)
    assert proc.wait(timeout=30) == 1
    out = proc.stdout.read()
    assert "engine died" in out


def test_sigterm_drains_in_flight_then_exits_zero(serve_process):
    proc, url = serve_process("ok", "--shutdown-timeout", "20")
    lines: list[str] = []
    started = threading.Event()

    def stream():
        with httpx.stream("POST", url + "/v1/completions", timeout=60, json=completion_body(
                model=None, max_tokens=60, ignore_eos=True, stream=True)) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                    started.set()

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(20)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    # While draining the port stays open: health and new requests answer 503.
    assert httpx.get(url + "/health", timeout=5).status_code == 503
    late = httpx.post(url + "/v1/completions", json=completion_body(model=None, max_tokens=2), timeout=5)
    assert assert_openai_error(late, 503)["code"] == "shutting_down"
    assert late.headers.get("retry-after")
    t.join(30)
    assert lines[-1] == "data: [DONE]"
    finals = [json.loads(x[6:]) for x in lines[:-1]]
    assert finals[-1]["choices"][0]["finish_reason"] == "length"  # it finished, not cut
    assert proc.wait(timeout=30) == 0


def test_sigterm_timeout_ends_requests_with_an_error(serve_process):
    proc, url = serve_process("ok", "--shutdown-timeout", "0.5")
    lines: list[str] = []
    started = threading.Event()

    def stream():
        with httpx.stream("POST", url + "/v1/completions", timeout=60, json=completion_body(
                model=None, max_tokens=240, ignore_eos=True, stream=True)) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                    started.set()

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(20)
    proc.send_signal(signal.SIGTERM)
    t.join(30)
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["error"]["code"] == "shutting_down"
    assert proc.wait(timeout=30) == 0
