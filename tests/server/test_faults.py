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
from server_helpers import assert_openai_error, chat_body, completion_body, slow_steps

from trellm.config import ServerConfig


def test_queue_full_gives_503_with_retry_after(tiny_server):
    live = tiny_server(ServerConfig(max_queued_requests=1, retry_after_s=2), engine_kw={"max_num_seqs": 1})
    slow_steps(live, 0.05)
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
    slow_steps(live, 0.05)
    client = live.openai()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futs = [pool.submit(client.completions.create, model="smollm2", prompt="hi", max_tokens=6,
                            extra_body={"ignore_eos": True}) for _ in range(4)]
        errors = [f.exception() for f in futs]
    assert any(isinstance(e, openai.InternalServerError) and e.status_code == 503 for e in errors), errors


@pytest.mark.parametrize("fault", [RuntimeError, MemoryError])  # #73, and #75 (allocator failure)
def test_engine_death_fails_pending_requests_and_health(tiny_server, fault):
    deaths: list[BaseException] = []
    fail = threading.Event()
    live = tiny_server(on_dead=deaths.append)
    slow_steps(live, 0.02, fail, exc=fault("injected fault: secret internal detail"))
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
    assert len(deaths) == 1 and isinstance(deaths[0], fault) and "injected" in str(deaths[0])
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
import signal, sys, time
# Ctrl-C as from a terminal: a suite started in the background (bash '&') hands its children
# SIGINT ignored, and uvicorn restores that before re-raising the signal it caught, exit 0.
signal.signal(signal.SIGINT, signal.default_int_handler)
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


def _stream_lines(url: str, body: dict, lines: list[str], started: threading.Event | None = None) -> int:
    """POST a streaming request, collecting its non-empty lines; returns the status."""
    try:
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            if r.status_code != 200:
                lines.append(r.read().decode())
                return r.status_code
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                    if started is not None:
                        started.set()
            return 200
    except httpx.TransportError as e:  # the process went away mid-stream
        lines.append(f"transport error: {type(e).__name__}")
        return -1


def _ended_explicitly(status: int, lines: list[str], code: str) -> bool:
    """Reliability §3.1: an error before the header, or an error event then [DONE]."""
    if status != 200:
        return status in (500, 503) and json.loads(lines[-1])["error"]["code"] == code
    return lines[-1] == "data: [DONE]" and json.loads(lines[-2][6:]).get("error", {}).get("code") == code


def _children(pid: int) -> list[int]:
    import psutil

    return [c.pid for c in psutil.Process(pid).children(recursive=True)]


def test_engine_death_exits_non_zero(serve_process):
    """#73 in a real process: 4 streams in flight when a step raises. Each ends with an
    explicit error, /health turns 503 (or the port closes) within 2 s, new requests
    fail fast, and the process exits 1 within 5 s."""
    proc, url = serve_process("fault")
    body = completion_body(model=None, max_tokens=100, ignore_eos=True)
    results: list[tuple[int, list[str]]] = []
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futs = [(pool.submit(_stream_lines, url, body, lines), lines) for lines in ([], [], [], [])]
        results = [(f.result(timeout=30), lines) for f, lines in futs]
    t_end = time.monotonic()
    for status, lines in results:
        assert _ended_explicitly(status, lines, "engine_dead"), (status, lines[-2:])
    try:
        h = httpx.get(url + "/health", timeout=2)
        assert h.status_code == 503
        t0 = time.monotonic()
        late = httpx.post(url + "/v1/completions", json=completion_body(model=None, max_tokens=1), timeout=2)
        assert late.status_code == 503 and time.monotonic() - t0 < 1.0
    except httpx.TransportError:
        pass  # already gone: refused outright, which is failing fast too
    assert time.monotonic() - t_end < 2.0
    assert proc.wait(timeout=5) == 1
    assert "engine died" in proc.stdout.read()


def test_sigterm_drains_in_flight_then_exits_zero(serve_process):
    """#71: 4 streams in flight at SIGTERM finish; 3 requests sent after it get 503
    (or a refused connection); the process exits 0 and leaves no child process."""
    proc, url = serve_process("ok", "--shutdown-timeout", "20")
    children = _children(proc.pid)
    body = completion_body(model=None, max_tokens=40, ignore_eos=True)
    started = [threading.Event() for _ in range(4)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futs = [(pool.submit(_stream_lines, url, body, lines, ev), lines) for lines, ev in
                (([], e) for e in started)]
        assert all(e.wait(20) for e in started)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        # While draining the port stays open: health and new requests answer 503.
        assert httpx.get(url + "/health", timeout=5).status_code == 503
        for _ in range(3):
            late = httpx.post(url + "/v1/completions", json=completion_body(model=None, max_tokens=2), timeout=5)
            assert assert_openai_error(late, 503)["code"] == "shutting_down"
            assert late.headers.get("retry-after")
        for f, lines in futs:
            assert f.result(timeout=30) == 200
            assert lines[-1] == "data: [DONE]"
            finals = [json.loads(x[6:]) for x in lines[:-1]]
            assert finals[-1]["choices"][0]["finish_reason"] == "length"  # it finished, not cut
            assert sum(len(x["choices"][0]["text"]) > 0 for x in finals) > 0
    assert proc.wait(timeout=30) == 0
    assert not [pid for pid in children if _alive(pid)]


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _start_long_stream(url: str, lines: list[str]) -> threading.Thread:
    """A 240-token stream on a thread, returned once its first line has arrived."""
    started = threading.Event()
    t = threading.Thread(target=_stream_lines, args=(url, completion_body(model=None, max_tokens=240,
                                                                          ignore_eos=True), lines, started))
    t.start()
    assert started.wait(20)
    return t


def test_sigterm_timeout_ends_requests_with_an_error(serve_process):
    proc, url = serve_process("ok", "--shutdown-timeout", "0.5")
    lines: list[str] = []
    t = _start_long_stream(url, lines)
    proc.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    t.join(30)
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["error"]["code"] == "shutting_down"
    assert proc.wait(timeout=30) == 0
    assert time.monotonic() - t0 < 0.5 + 4.0  # shutdown timeout, plus a little


def test_second_sigint_during_drain_exits_at_once(serve_process):
    """#72: the first Ctrl-C drains (up to 60 s here); a second one stops now."""
    proc, url = serve_process("ok", "--shutdown-timeout", "60")
    lines: list[str] = []
    t = _start_long_stream(url, lines)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.5)
    assert proc.poll() is None and httpx.get(url + "/health", timeout=5).status_code == 503  # draining
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=10) == 130  # the shell's "ended by SIGINT"
    assert time.monotonic() - t0 < 5.0
    t.join(10)
    # The cut stream was told so, or lost its connection; it did not hang.
    assert not t.is_alive()
    assert lines[-1] == "data: [DONE]" or lines[-1].startswith("transport error")
