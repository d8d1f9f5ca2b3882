"""Hostile input, auth, CORS and exposure (reliability.md §2 B, #14-#22). The key
checks that every route needs a key and that wrong keys fail are in test_api.py
(test_every_route_but_health_needs_the_key); these add the bypass attempts.
Server variants (CORS on, any Host) are the same app factory over the ``hostile``
server's engine, called in-process with no socket."""
from __future__ import annotations

import hashlib

import httpx
import pytest
from server_helpers import (
    API_KEY,
    MODEL_NAME,
    RawConnection,
    assert_openai_error,
    assert_raw_openai_error,
    completion_body,
)
from starlette.testclient import TestClient

from trellm.config import ServerConfig
from trellm.server import middleware
from trellm.server.api_server import build_app


def _variant(hostile, **config) -> TestClient:
    """The app with another config over the same engine (the routes tested here are
    answered before any engine work)."""
    # Not entered as a context manager: its lifespan would stop the shared engine.
    return TestClient(build_app(hostile.engine, ServerConfig(**config), (MODEL_NAME,)), base_url="http://testserver")


def _raw_auth(hostile, value: bytes) -> int:
    with RawConnection(hostile.port) as conn:
        conn.send(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: " + value + b"\r\n\r\n")
        return conn.read_response().status


def test_14_no_authorization_header_is_401(hostile):
    r = httpx.post(hostile.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    err = assert_openai_error(r, 401, None)
    assert err["code"] == "invalid_api_key" and r.headers["www-authenticate"] == "Bearer"


@pytest.mark.parametrize("value", [
    b"Bearer wrong", b"Basic " + API_KEY.encode(), b"Bearer " + API_KEY[:-1].encode(),
    b"Bearer " + API_KEY.upper().encode(), b"Bearer " + API_KEY.encode() + b"x",
    b"Bearer  " + API_KEY.encode(), b"Bearer " + API_KEY.encode() + b" x", b"Token " + API_KEY.encode(),
    b"Bearer", b"Bearer ", API_KEY.encode()])
def test_15_wrong_keys_are_401(hostile, value):
    assert _raw_auth(hostile, value) == 401


def test_15_control_bytes_in_the_key_never_authorize(hostile):
    # A NUL or CR in a header value is not HTTP: h11 refuses the request itself.
    for value in (b"Bearer " + API_KEY.encode() + b"\x00", b"Bearer \x00" + API_KEY.encode()):
        assert _raw_auth(hostile, value) == 400


def test_15_header_whitespace_and_scheme_case_follow_http(hostile):
    # RFC 9110 §5.5: whitespace around a field value is not part of it (h11 strips it
    # before the app sees the header), and §11.1: the auth scheme is case-insensitive.
    key = API_KEY.encode()
    assert _raw_auth(hostile, b"Bearer " + key + b" ") == 200
    assert _raw_auth(hostile, b"bearer " + key) == 200
    with RawConnection(hostile.port) as conn:  # two Authorization headers: ambiguous, refused
        conn.send(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " + key +
                  b"\r\nAuthorization: Bearer " + key + b"\r\n\r\n")
        assert conn.read_response().status == 401


def test_15_keys_are_compared_as_fixed_length_digests(monkeypatch):
    """Constant time (CVE-2025-59425): hmac.compare_digest over SHA-256 digests, so the
    time does not depend on where, or whether in length, the keys differ."""
    seen: list[tuple[bytes, bytes]] = []
    real = middleware.hmac.compare_digest

    def spy(a, b):
        seen.append((a, b))
        return real(a, b)

    monkeypatch.setattr(middleware.hmac, "compare_digest", spy)
    auth = middleware.AuthMiddleware(app=None, api_key=API_KEY)
    for token in (b"x", b"Bearer", API_KEY.encode() * 50, API_KEY.encode()):
        ok = auth._authorized({"headers": [(b"authorization", b"Bearer " + token)]})
        assert ok == (token == API_KEY.encode())
    assert len(seen) == 4 and all(len(a) == len(b) == 32 for a, b in seen)
    assert seen[-1] == (hashlib.sha256(API_KEY.encode()).digest(),) * 2


@pytest.mark.parametrize("path", [
    "//v1/chat/completions", "/v1/./chat/completions", "/V1/chat/completions", "/v1/chat/completions/",
    "/v1%2Fchat%2Fcompletions", "/v1/chat%2fcompletions", "/health/", "/health/../v1/models",
    "/./health", "/health%00", "/HEALTH", "/v1/models?/health", "/v1/models#/health", "/v2/chat/completions",
    "/inference/v1/generate", "/metrics", "/tokenize", "/openapi.json"])
def test_16_path_variants_without_a_key_are_never_served(hostile, path):
    body = b'{"prompt": "x", "max_tokens": 1}'
    for method in ("POST", "GET"):
        with RawConnection(hostile.port) as conn:
            r = conn.request(method, path, body if method == "POST" else b"", {"Content-Type": "application/json"})
        assert_raw_openai_error(r, 401)


def test_17_host_header_cannot_make_a_protected_path_public(hostile):
    # Loopback-bound: a Host that is no host name is refused outright ...
    with RawConnection(hostile.port) as conn:
        err = assert_raw_openai_error(conn.request("GET", "/v1/models", host="localhost/health?"), 421)
        assert err["code"] == "invalid_host"
    # ... and with any Host allowed, auth still looks at scope["path"], not the URL.
    client = _variant(hostile, api_key=API_KEY, allowed_hosts=("*",))
    if True:
        for host in ("localhost/health?", "x/health#", "localhost:1/health?a="):
            assert_openai_error(client.get("/v1/models", headers={"host": host}), 401)
            assert_openai_error(client.post("/v1/completions", json={}, headers={"host": host}), 401)


def test_18_every_route_but_health_is_denied_without_a_key(hostile):
    paths = {r.path for r in hostile.app.routes if hasattr(r, "path")}
    assert {"/v1/completions", "/tokenize", "/metrics", "/openapi.json"} <= paths
    with httpx.Client(base_url=hostile.url) as c:
        for route in hostile.app.routes:
            for method in getattr(route, "methods", None) or {"GET"}:
                r = c.request(method, route.path, json={} if method == "POST" else None)
                if route.path == "/health":
                    assert r.status_code == 200
                elif method == "HEAD":
                    assert r.status_code == 401
                else:
                    assert_openai_error(r, 401)


def test_19_preflight_needs_no_key_and_runs_nothing(hostile):
    steps = hostile.engine.stats.num_steps
    preflight = {"Origin": "http://app.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    # No CORS configured (the default): no key asked, no CORS grant, no inference.
    r = httpx.options(hostile.url + "/v1/chat/completions", headers=preflight)
    assert_openai_error(r, 405)
    assert "access-control-allow-origin" not in r.headers
    client = _variant(hostile, api_key=API_KEY, allowed_origins=("http://app.example",),
                      allowed_hosts=("testserver",))
    if True:
        r = client.options("/v1/chat/completions", headers=preflight)
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == "http://app.example"
        assert "POST" in r.headers["access-control-allow-methods"]
        assert "access-control-allow-credentials" not in r.headers
    assert hostile.engine.stats.num_steps == steps


def test_20_foreign_origins_get_no_cors_grant(hostile):
    evil = {"Origin": "http://evil.example"}
    with hostile.client() as c:
        r = c.post("/v1/completions", json=completion_body(max_tokens=1), headers=evil)
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    client = _variant(hostile, api_key=API_KEY, allowed_origins=("http://app.example",),
                      allowed_hosts=("testserver",))
    if True:
        r = client.get("/v1/models", headers={**evil, "Authorization": f"Bearer {API_KEY}"})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
        r = client.options("/v1/models", headers={**evil, "Access-Control-Request-Method": "GET"})
        err = assert_openai_error(r, 400)
        assert err["code"] == "cors_rejected" and "access-control-allow-origin" not in r.headers
        ok = client.get("/v1/models", headers={"Origin": "http://app.example", "Authorization": f"Bearer {API_KEY}"})
        assert ok.headers["access-control-allow-origin"] == "http://app.example"
        assert "access-control-allow-credentials" not in ok.headers  # never a wildcard with credentials


@pytest.mark.parametrize("host", ["attacker.example", "attacker.example:8000", "127.0.0.1.nip.io",
                                  "localhost.attacker.example", "0.0.0.0", "[::2]:80", "", "local host"])
def test_21_dns_rebinding_hosts_are_421(hostile, host):
    with RawConnection(hostile.port) as conn:
        for path in ("/health", "/v1/models"):
            r = conn.request("GET", path, headers={"Authorization": f"Bearer {API_KEY}"}, host=host)
            err = assert_raw_openai_error(r, 421)
            assert err["code"] == "invalid_host"


@pytest.mark.parametrize("host", ["localhost", "LOCALHOST:{port}", "127.0.0.1:{port}", "[::1]:{port}", "[::1]"])
def test_21_loopback_names_are_served(hostile, host):
    with RawConnection(hostile.port) as conn:
        r = conn.request("GET", "/v1/models", headers={"Authorization": f"Bearer {API_KEY}"},
                         host=host.format(port=hostile.port))
        assert r.status == 200, r.body


def test_21_allowlist_rules():
    allow = middleware.host_allowlist
    assert allow("127.0.0.1", ()) == {"localhost", "127.0.0.1", "::1"}
    assert allow("localhost", ("my.box",)) == {"localhost", "127.0.0.1", "::1", "my.box"}
    assert allow("0.0.0.0", ()) is None  # exposed on purpose: names unknown unless given
    assert allow("0.0.0.0", ("api.example",)) == {"localhost", "127.0.0.1", "::1", "api.example"}
    assert allow("10.1.2.3", ("api.example",)) == {"localhost", "127.0.0.1", "::1", "api.example", "10.1.2.3"}
    assert allow("127.0.0.1", ("*",)) is None


def test_22_default_bind_is_loopback():
    # The CLI side (flags, TRELLM_API_KEY) is in test_cli_serve.py.
    assert ServerConfig().host == "127.0.0.1"
    assert middleware.host_allowlist(ServerConfig().host, ()) is not None
