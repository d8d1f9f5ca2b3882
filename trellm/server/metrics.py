"""Prometheus metrics (prometheus-client), one ``CollectorRegistry`` per app.

A registry per app (not the global default) lets tests and several in-process
apps coexist. Names follow vLLM's (``vllm:`` -> ``trellm:``) so dashboards carry over.
Request timings come from ``AsyncEngine`` (``OutputListener``); engine state
(running, waiting, KV usage, prefix cache, preemptions) is read from the engine
thread's last snapshot at scrape time, so a scrape never touches the engine.
"""
from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from trellm.engine.types import RequestOutput
from trellm.server.async_engine import EngineStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0)


class _EngineCollector(Collector):
    """Gauges and counters read from the latest ``EngineStats`` at scrape time."""

    def __init__(self, stats: Callable[[], EngineStats], healthy: Callable[[], bool]):
        self._stats = stats
        self._healthy = healthy

    def collect(self) -> Iterator:
        s = self._stats()
        yield _gauge("trellm:num_requests_running", "Sequences in the running batch.", s.num_running)
        yield _gauge("trellm:num_requests_waiting", "Sequences waiting for a seat.", s.num_waiting)
        yield _gauge("trellm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1).", s.kv_usage)
        yield _gauge("trellm:kv_cache_free_blocks", "Free KV-cache blocks.", s.num_free_blocks)
        yield _gauge("trellm:kv_cache_total_blocks", "KV-cache blocks in the pool.", s.num_blocks)
        rate = s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0
        yield _gauge("trellm:prefix_cache_hit_rate", "Prompt tokens served from the prefix cache / looked up.",
                     rate)
        yield _counter("trellm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                       s.prefix_cache_queries)
        yield _counter("trellm:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                       s.prefix_cache_hits)
        yield _counter("trellm:num_preemptions", "Sequences preempted (KV freed, recomputed later).",
                       s.num_preemptions)
        yield _counter("trellm:engine_steps", "Engine steps run.", s.num_steps)
        yield _gauge("trellm:engine_healthy", "1 while the engine serves, 0 when draining or dead.",
                     1.0 if self._healthy() else 0.0)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


class ServerMetrics:
    """All the server's metrics; also the ``OutputListener`` the AsyncEngine reports to."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.http_requests = Counter("trellm:http_requests", "HTTP requests by route and status.",
                                     ["method", "route", "status"], registry=r)
        self.finished = Counter("trellm:request_finished", "Requests ended, by reason.", ["reason"], registry=r)
        self.prompt_tokens = Counter("trellm:prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter("trellm:generation_tokens", "Generated tokens of finished requests.",
                                         registry=r)
        self.ttft = Histogram("trellm:time_to_first_token_seconds", "Time to first token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("trellm:inter_token_latency_seconds", "Time between token deliveries.",
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("trellm:e2e_request_latency_seconds", "Arrival to last token.",
                             buckets=_LATENCY_BUCKETS, registry=r)

    def attach_engine(self, stats: Callable[[], EngineStats], healthy: Callable[[], bool]) -> None:
        self.registry.register(_EngineCollector(stats, healthy))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # ---- OutputListener ----------------------------------------------------------------

    def on_first_token(self, ttft_s: float) -> None:
        self.ttft.observe(ttft_s)

    def on_next_tokens(self, itl_s: float) -> None:
        self.itl.observe(itl_s)

    def on_finished(self, out: RequestOutput, e2e_s: float) -> None:
        self.e2e.observe(e2e_s)
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        self.generation_tokens.inc(sum(len(c.token_ids) for c in out.outputs))
        for c in out.outputs:
            self.finished.labels(reason=c.finish_reason or "unknown").inc()

    def on_ended(self, reason: str) -> None:
        self.finished.labels(reason=reason).inc()


class RequestCounterMiddleware:
    """Counts every HTTP answer by method, route template and status (bounded labels:
    unknown paths are 'other', so probing random URLs cannot grow the metric set)."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics, routes: frozenset[str]):
        self.app = app
        self.metrics = metrics
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def counting_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            route = scope["path"] if scope["path"] in self.routes else "other"
            method = scope["method"] if scope["method"] in ("GET", "POST", "OPTIONS") else "other"
            self.metrics.http_requests.labels(method=method, route=route, status=str(status)).inc()
