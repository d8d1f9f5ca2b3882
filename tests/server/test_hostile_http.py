"""Hostile input, HTTP and transport (reliability.md §2 A, #1-#13), against the tiny
``hostile`` server. Each test asserts the exact status and OpenAI error shape; the
conftest then checks that a normal request still succeeds and nothing leaked.
Raw sockets send what httpx will not: header floods, slow senders, bad framing."""
from __future__ import annotations

import concurrent.futures
import select
import threading
import time

import httpx
import psutil
import pytest
from server_helpers import (
    RawConnection,
    assert_openai_error,
    assert_raw_openai_error,
    completion_body,
    http_request,
)

JSON = {"content-type": "application/json"}


def _post(live, body: bytes, path: str = "/v1/chat/completions", headers: dict | None = None) -> httpx.Response:
    with live.client() as c:
        return c.post(path, content=body, headers=JSON if headers is None else headers)


@pytest.mark.parametrize("body", [b'{"model":', b'{"messages": [{"role": "user", "content": "hi"}]',
                                  b"{'model': 'x'}", b'{"a": 1,}'])
def test_1_truncated_or_malformed_json_is_400(hostile, body):
    err = assert_openai_error(_post(hostile, body), 400, None)
    assert err["type"] == "invalid_request_error" and "not valid JSON" in err["message"]


@pytest.mark.parametrize("body", [b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', b"\xc3\x28"])
def test_2_invalid_utf8_is_400_in_openai_shape(hostile, body):
    assert_openai_error(_post(hostile, body), 400, None)


def test_2_utf8_encoded_surrogate_is_400_for_its_field(hostile):
    # json.loads decodes bytes with 'surrogatepass': ED A0 80 becomes a lone surrogate,
    # which the string validator must refuse (it would crash .encode() later).
    body = b'{"model": "smollm2", "prompt": "a\xed\xa0\x80b"}'
    assert_openai_error(_post(hostile, body, "/v1/completions"), 400, "prompt")


@pytest.mark.parametrize("body", [b"[]", b"42", b"null", b'"s"', b"[1, 2]", b"true"])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/tokenize"])
def test_3_top_level_not_an_object_is_400(hostile, body, path):
    err = assert_openai_error(_post(hostile, body, path), 400, None)
    assert err["message"] == "the request body must be a JSON object"


def test_4_empty_body_and_non_json_content_types(hostile):
    err = assert_openai_error(_post(hostile, b""), 400, None)
    assert err["message"] == "the request body is missing"
    valid = b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}'
    for headers in ({}, {"content-type": "text/plain"}, {"content-type": "application/x-www-form-urlencoded"},
                    {"content-type": "multipart/form-data; boundary=x"}):
        err = assert_openai_error(_post(hostile, valid, headers=headers), 415, None)
        assert err["code"] == "unsupported_media_type"
    ok = _post(hostile, valid, headers={"content-type": "application/json; charset=utf-8"})
    assert ok.status_code == 200, ok.text


def test_5_deeply_nested_json_is_400_without_recursion_error(hostile):
    deep = b'{"model": "smollm2", "extra": ' + b"[" * 5000 + b"]" * 5000 + b', "messages": []}'
    assert_openai_error(_post(hostile, deep), 400, None)
    deep_obj = b'{"x": ' + b'{"a": ' * 3000 + b"1" + b"}" * 3000 + b"}"
    assert_openai_error(_post(hostile, deep_obj), 400, None)


def test_6_declared_body_over_the_limit_is_413_before_reading_it(hostile):
    # Content-Length says 50 MB but only the head is sent: the answer cannot have
    # waited for the body.
    with RawConnection(hostile.port) as conn:
        conn.send(http_request("POST", "/v1/completions", headers={
            "Content-Length": str(50 << 20), "Content-Type": "application/json",
            "Authorization": f"Bearer {hostile.api_key}"}))
        r = conn.read_response()
    assert_raw_openai_error(r, 413)
    assert r.headers["connection"] == "close"


def test_6_chunked_body_over_the_limit_is_413_while_streaming(hostile):
    """No Content-Length: the limit is enforced as chunks arrive, and the server stops
    reading long before the client would stop sending (nothing is buffered whole)."""
    chunk = b" " * (256 << 10)
    framed = f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
    sent = 0
    with RawConnection(hostile.port) as conn:
        conn.send(http_request("POST", "/v1/completions", headers={
            "Transfer-Encoding": "chunked", "Content-Type": "application/json",
            "Authorization": f"Bearer {hostile.api_key}"}))
        conn.sock.setblocking(False)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and sent < (200 << 20):
            readable, writable, _ = select.select([conn.sock], [conn.sock], [], 1.0)
            if readable:
                break
            if writable:
                try:
                    sent += conn.sock.send(framed)
                except (BlockingIOError, BrokenPipeError, ConnectionResetError):
                    break
        conn.sock.setblocking(True)
        r = conn.read_response()
    assert_raw_openai_error(r, 413)
    assert sent < (40 << 20), f"the server read {sent} bytes of an over-limit body"


@pytest.mark.parametrize("head", [
    b"X-Big: " + b"a" * 100_000 + b"\r\n",
    b"".join(b"X-H%d: v\r\n" % i for i in range(10_000)),
], ids=["100KB-header", "10k-headers"])
def test_7_header_flood_is_431_connection_closed_memory_flat(hostile, head):
    def flood() -> None:
        with RawConnection(hostile.port) as conn:
            conn.send(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n" + head + b"\r\n")
            r = conn.read_response()
            err = assert_raw_openai_error(r, 431)
            assert err["code"] == "headers_too_large" and r.headers["connection"] == "close"
            assert conn.closed_by_server(within=3.0)

    flood()
    rss = psutil.Process().memory_info().rss
    for _ in range(30):
        flood()
    assert psutil.Process().memory_info().rss - rss < 32 << 20


def test_7_header_flood_sent_slowly_is_also_refused(hostile):
    with RawConnection(hostile.port) as conn:
        conn.send(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        for _ in range(40):  # 40 x 1 KB writes: the head never completes
            try:
                conn.send(b"X-A: " + b"a" * 1019 + b"\r\n")
            except (BrokenPipeError, ConnectionResetError):
                break
        assert_raw_openai_error(conn.read_response(), 431)


def test_7_unparsable_request_line_is_400(hostile):
    with RawConnection(hostile.port) as conn:
        conn.send(b"GARBAGE\r\n\r\n")
        err = assert_raw_openai_error(conn.read_response(), 400)
        assert err["code"] == "bad_http_request"
        assert conn.closed_by_server(within=3.0)


def _slowloris(port: int, stop: threading.Event, t_closed: list[float], sent_bytes: list[int]) -> None:
    """Send a request head one byte every 0.1 s until the server closes the connection."""
    head = http_request("GET", "/health", host=f"127.0.0.1:{port}") + b"X-Pad: " + b"a" * 200
    with RawConnection(port) as conn:
        t0 = time.monotonic()
        for i, byte in enumerate(head):
            if stop.is_set():
                return
            try:
                conn.send(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                break
            sent_bytes[0] = i + 1
            if conn.closed_by_server(within=0.1):
                break
        t_closed.append(time.monotonic() - t0)
        if conn._buf:  # a partial head is told why: 408 in the OpenAI shape
            r = conn.read_response()
            assert_raw_openai_error(r, 408)


def test_8_slowloris_is_cut_at_the_header_deadline_and_others_are_unaffected(hostile):
    stop = threading.Event()
    closed: list[float] = []
    sent = [[0] for _ in range(16)]
    latencies: list[float] = []
    with concurrent.futures.ThreadPoolExecutor(17) as pool:
        slow = [pool.submit(_slowloris, hostile.port, stop, closed, s) for s in sent]
        time.sleep(0.3)
        with hostile.client() as c:
            for _ in range(5):  # other clients are served promptly meanwhile
                t0 = time.monotonic()
                assert c.post("/v1/completions", json=completion_body(max_tokens=1)).status_code == 200
                latencies.append(time.monotonic() - t0)
        for f in slow:
            f.result(timeout=15)
        stop.set()
    assert len(closed) == 16
    # Deadline 1 s: each connection was cut after ~10 bytes, never allowed to finish.
    assert all(0.9 <= t < 3.0 for t in closed), closed
    assert all(s[0] < 40 for s in sent), sent
    assert max(latencies) < 2.0, latencies


def test_8_idle_connection_is_closed_silently_after_the_header_deadline(hostile):
    with RawConnection(hostile.port) as conn:
        t0 = time.monotonic()
        assert conn.closed_by_server(within=3.0)
        assert 0.9 <= time.monotonic() - t0 < 3.0
        assert conn._buf == b""  # no stray response an unaware client could misread


def test_8_keep_alive_connection_trickling_its_next_head_is_cut(hostile):
    with RawConnection(hostile.port) as conn:
        assert conn.request("GET", "/health").status == 200
        t0 = time.monotonic()
        for byte in b"GET /health HTTP/1.1\r\nX-A: bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb":
            try:
                conn.send(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                break
            if conn.closed_by_server(within=0.1):
                break
        assert time.monotonic() - t0 < 3.0
        assert_raw_openai_error(conn.read_response(), 408)


def test_9_slow_body_is_408_and_never_reaches_the_engine(hostile):
    steps = hostile.engine.stats.num_steps
    body = completion_body(max_tokens=1)
    raw = httpx.Request("POST", "/", json=body).content
    with RawConnection(hostile.port) as conn:
        conn.send(http_request("POST", "/v1/completions", headers={
            "Content-Length": str(len(raw)), "Content-Type": "application/json",
            "Authorization": f"Bearer {hostile.api_key}"}))
        t0 = time.monotonic()
        try:
            for byte in raw:
                conn.send(bytes([byte]))
                if conn.closed_by_server(within=0.2):
                    break
        except (BrokenPipeError, ConnectionResetError):
            pass
        err = assert_raw_openai_error(conn.read_response(), 408)
    assert err["code"] == "request_timeout" and time.monotonic() - t0 < 3.0
    assert hostile.engine.stats.num_steps == steps  # nothing was scheduled


@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE", "PATCH", "TRACE"])
def test_10_wrong_method_is_405_with_allow(hostile, method):
    with hostile.client() as c:
        r = c.request(method, "/v1/chat/completions")
    err = assert_openai_error(r, 405, None)
    assert err["code"] == "method_not_allowed" and r.headers["allow"] == "POST"
    with hostile.client() as c:
        r = c.post("/v1/models", json={})
    assert_openai_error(r, 405)
    assert r.headers["allow"] == "GET"


@pytest.mark.parametrize("path", ["/v2/chat/completions", "/v1/engines", "/admin", "/docs", "/redoc",
                                  "/v1/chat/completions/x", "/%00"])
def test_11_unknown_path_is_404_in_openai_shape(hostile, path):
    with hostile.client() as c:
        err = assert_openai_error(c.get(path), 404, None)
    assert err["code"] == "not_found"


def test_12_duplicate_json_keys_last_wins_and_caps_still_apply(hostile):
    base = b'"model": "smollm2", "prompt": "Hello", "temperature": 0'
    err = assert_openai_error(_post(hostile, b'{' + base + b', "max_tokens": 1, "max_tokens": 9999}',
                                    "/v1/completions"), 400, "max_tokens")
    assert err["code"] == "context_length_exceeded"
    ok = _post(hostile, b'{' + base + b', "max_tokens": 9999, "max_tokens": 2, "ignore_eos": true}',
               "/v1/completions")
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    assert_openai_error(_post(hostile, b'{' + base + b', "n": 1, "n": 1000}', "/v1/completions"), 400, "n")


def test_13_keep_alive_connection_serves_a_valid_request_after_errors(hostile):
    auth = {"Authorization": f"Bearer {hostile.api_key}", "Content-Type": "application/json"}
    valid = httpx.Request("POST", "/", json=completion_body(max_tokens=1)).content
    with RawConnection(hostile.port) as conn:
        assert_raw_openai_error(conn.request("POST", "/v1/completions", b'{"model":', auth), 400)
        assert_raw_openai_error(conn.request("POST", "/v1/completions", b'{"n": 0, "prompt": "x"}', auth), 400)
        assert_raw_openai_error(conn.request("GET", "/nope", headers=auth), 404)
        r = conn.request("POST", "/v1/completions", valid, auth)
        assert r.status == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")
        # A chunked body just over the limit is read to its end and refused; the
        # connection stays usable.
        size = (2 << 20) + 1024
        conn.send(http_request("POST", "/v1/completions", headers={**auth, "Transfer-Encoding": "chunked"})
                  + f"{size:x}\r\n".encode() + b" " * size + b"\r\n0\r\n\r\n")
        assert_raw_openai_error(conn.read_response(), 413)
        r = conn.request("POST", "/v1/completions", valid, auth)
        assert r.status == 200, r.body
