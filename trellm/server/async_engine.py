"""``AsyncEngine``: the engine on one background thread, the event loop never waits on it.

Threading contract (the one rule that keeps this file simple):
- only the engine thread touches the ``Engine``. The event loop sends it commands
  (add, abort, call) through a thread-safe queue, applied between two steps;
- the engine thread hands results back with ``loop.call_soon_threadsafe``, once per
  step, and never blocks on a consumer;
- per-request state (``RequestStream``) and the futures of pending commands live on
  the event loop only.

Failure contract (reliability.md §3): if the loop dies, every pending request gets
an ``EngineDeadError``, ``healthy`` turns false, new requests are refused, and the
``on_dead`` callback (the server: exit non-zero) runs. ``drain`` stops admissions,
lets in-flight requests finish up to a timeout and ends the rest with an error.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

from trellm.engine.types import RequestOutput
from trellm.sampling_params import SamplingParams

log = logging.getLogger("trellm.server")

_IDLE_POLL_S = 0.5
"""How long the idle engine thread blocks on the command queue before re-checking."""


class EngineDeadError(RuntimeError):
    """The engine loop failed; nothing more can be served by this process."""


class RequestAbortedError(RuntimeError):
    """The request was aborted (its client left) before it finished."""


class QueueFullError(RuntimeError):
    """Admitting the request would exceed the waiting-queue cap."""


class QueueTimeoutError(RuntimeError):
    """The request waited longer than ``max_queue_wait_s`` without ever being scheduled."""


class ServerStoppingError(RuntimeError):
    """The server is draining or stopped: no new requests, or this one was cut short."""


@dataclass(frozen=True)
class EngineStats:
    """A snapshot the engine thread publishes after each step (for /metrics and /health)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    num_free_blocks: int = 0
    num_blocks: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_steps: int = 0


class OutputListener(Protocol):
    """Observes request timing on the event loop (metrics)."""

    def on_first_token(self, ttft_s: float) -> None: ...
    def on_next_tokens(self, itl_s: float) -> None: ...
    def on_finished(self, out: RequestOutput, e2e_s: float) -> None: ...
    def on_ended(self, reason: str) -> None: ...
    """A request that ended without finishing: 'abort' (client left) or 'error'."""


class RequestStream:
    """The outputs of one request, read on the event loop with ``async for``.

    Outputs are cumulative (each holds the whole text so far), so only the newest
    one is kept: a slow reader costs no memory and misses nothing. An error ends the
    iteration by raising it.
    """

    def __init__(self, request_id: str):
        self.request_id = request_id
        self.arrival = time.monotonic()
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.num_tokens = 0
        self._latest: RequestOutput | None = None
        self._error: BaseException | None = None
        self._event = asyncio.Event()
        self._done = False

    @property
    def finished(self) -> bool:
        return self._done

    def _put(self, out: RequestOutput) -> None:
        self._latest = out
        self._event.set()

    def _fail(self, exc: BaseException) -> None:
        self._error = exc
        self._event.set()

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        while self._latest is None and self._error is None:
            self._event.clear()
            await self._event.wait()
        if self._error is not None:
            self._done = True
            raise self._error
        out, self._latest = self._latest, None
        if out.finished:
            self._done = True
        return out

    async def final(self) -> RequestOutput:
        """Wait for the finished output (non-streaming callers)."""
        last = None
        async for last in self:
            pass
        assert last is not None and last.finished
        return last


# ---- commands (event loop -> engine thread) ------------------------------------------------


@dataclass(frozen=True)
class NewRequest:
    """One engine request to admit (``AsyncEngine.add_requests``)."""

    request_id: str
    prompt: str | None
    params: SamplingParams
    prompt_token_ids: Sequence[int] | None = None


@dataclass
class _Add:
    """Requests admitted together or not at all (the prompts of one HTTP request)."""

    requests: list[NewRequest]
    future: asyncio.Future


@dataclass
class _Abort:
    request_ids: list[str]


@dataclass
class _Call:
    fn: Callable[[Any], Any]
    future: asyncio.Future


@dataclass
class _Stop:
    pass


class AsyncEngine:
    """Owns an ``Engine`` and drives it from one background thread.

    Args:
        engine: a ready ``trellm.engine.engine.Engine``; no one else may touch it afterwards.
        max_queued_requests: sequences allowed to wait for a free seat; more -> ``QueueFullError``.
        engine_step_timeout_s: watchdog; a step running longer kills the engine (0 = off).
        max_queue_wait_s: a request not yet scheduled after this long ends with
            ``QueueTimeoutError`` and is removed from the queue (0 = no deadline).
        on_dead: called once on the event loop when the engine dies (the server exits).
        listener: optional timing observer (metrics).
    """

    def __init__(self, engine: Any, *, max_queued_requests: int = 256, engine_step_timeout_s: float = 0.0,
                 max_queue_wait_s: float = 0.0, on_dead: Callable[[BaseException], None] | None = None,
                 listener: OutputListener | None = None):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len: int = engine.max_model_len
        self.vocab_size: int = engine.vocab_size
        self.max_queued_requests = max_queued_requests
        self.step_timeout_s = engine_step_timeout_s
        self.max_queue_wait_s = max_queue_wait_s
        self.on_dead = on_dead
        self.listener = listener
        self.max_num_seqs: int = engine.config.scheduler.max_num_seqs
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._pending: set[asyncio.Future] = set()
        """Futures of commands the engine thread has not answered yet (failed on death)."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._watchdog: asyncio.Task | None = None
        self._accepting = True
        self._dead: EngineDeadError | None = None
        self._step_started: float | None = None
        self._num_steps = 0
        self._ids = itertools.count()
        self.stats = self._snapshot()

    # ---- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        """Start the engine thread; call from the event loop that will serve requests."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="trellm-engine", daemon=True)
        self._thread.start()
        if self.step_timeout_s > 0:
            self._watchdog = asyncio.create_task(self._watch_steps())

    @property
    def healthy(self) -> bool:
        """Serving: the thread runs, the engine is alive and admissions are open."""
        return (self._dead is None and self._accepting and self._thread is not None
                and self._thread.is_alive())

    @property
    def dead(self) -> bool:
        return self._dead is not None

    @property
    def accepting(self) -> bool:
        return self._accepting and self._dead is None

    @property
    def num_in_flight(self) -> int:
        return len(self._streams) + len(self._pending)

    async def drain(self, timeout_s: float, force: Callable[[], bool] = lambda: False) -> int:
        """Stop admissions, wait up to ``timeout_s`` for in-flight requests, then end the
        rest with ``ServerStoppingError``. Returns how many were cut short."""
        self._accepting = False
        deadline = time.monotonic() + timeout_s
        while self.num_in_flight and time.monotonic() < deadline and not self.dead and not force():
            await asyncio.sleep(0.05)
        cut = list(self._streams.items())
        for rid, stream in cut:
            stream._fail(ServerStoppingError("the server is shutting down; the request was ended "
                                             "before it finished"))
            self._end(rid, "error")
        return len(cut)

    async def stop(self, join_timeout_s: float = 10.0) -> None:
        """Stop the engine thread (after ``drain``); safe to call twice."""
        self._accepting = False
        if self._watchdog is not None:
            self._watchdog.cancel()
        thread = self._thread
        if thread is None or not thread.is_alive():
            return
        self._commands.put(_Stop())
        await asyncio.get_running_loop().run_in_executor(None, thread.join, join_timeout_s)

    # ---- requests ----------------------------------------------------------------------

    def new_request_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}-{time.monotonic_ns() % 10**9}"

    async def add_request(self, request_id: str, prompt: str | None, params: SamplingParams,
                          prompt_token_ids: Sequence[int] | None = None) -> RequestStream:
        """Queue one request; see ``add_requests``."""
        (stream,) = await self.add_requests([NewRequest(request_id, prompt, params, prompt_token_ids)])
        return stream

    async def add_requests(self, requests: Sequence[NewRequest]) -> list[RequestStream]:
        """Queue requests all-or-nothing (one command, applied between two steps, so n
        prompts cost one round trip); returns their streams once the engine took them.

        Raises ValueError (invalid for this model), QueueFullError, ServerStoppingError
        or EngineDeadError, all before any output exists, so callers can answer 4xx/503.
        """
        self._check_accepting()
        ids = [r.request_id for r in requests]
        if len(set(ids)) != len(ids) or any(i in self._streams for i in ids):
            raise ValueError("request ids must be unique")
        streams = [RequestStream(i) for i in ids]
        self._streams.update(zip(ids, streams))
        fut = self._new_future()
        self._commands.put(_Add(list(requests), fut))
        try:
            await fut
        except BaseException as e:
            for i in ids:
                self._streams.pop(i, None)
            if isinstance(e, asyncio.CancelledError):
                # The caller left while the add was queued: the engine may still take it.
                self._commands.put(_Abort(ids))
            raise
        return streams

    def abort(self, request_id: str) -> None:
        """End a request the caller no longer wants (client disconnect); never blocks."""
        if request_id in self._streams:
            self._end(request_id, "abort")

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """Run ``fn(engine)`` on the engine thread between two steps (tests, invariants)."""
        if self._dead is not None:
            raise self._dead
        fut = self._new_future()
        self._commands.put(_Call(fn, fut))
        return await fut

    def _check_accepting(self) -> None:
        if self._dead is not None:
            raise self._dead
        if not self._accepting or self._thread is None:
            raise ServerStoppingError("the server is not accepting requests (starting or shutting down)")

    def _new_future(self) -> asyncio.Future:
        assert self._loop is not None, "AsyncEngine.start() was not called"
        fut = self._loop.create_future()
        self._pending.add(fut)
        fut.add_done_callback(self._pending.discard)
        return fut

    def _end(self, request_id: str, reason: str) -> None:
        """Forget a stream that will not finish normally, and abort it in the engine.
        Anyone still waiting on the stream is woken with an error, never left hanging."""
        stream = self._streams.pop(request_id, None)
        if stream is not None and stream._error is None:
            stream._fail(RequestAbortedError(f"request {request_id} was aborted"))
        if self.listener is not None:
            self.listener.on_ended(reason)
        if self._dead is None:
            self._commands.put(_Abort([request_id]))

    # ---- engine thread -----------------------------------------------------------------

    def _run(self) -> None:
        try:
            while self._dead is None:  # the watchdog may declare a hung step dead
                busy = self.engine.has_unfinished_requests()
                if self._apply_commands(block=not busy):
                    return
                if self.engine.has_unfinished_requests():
                    self._step()
                    if self.max_queue_wait_s > 0:
                        self._expire_waiting()
        except BaseException as e:  # the engine's state is unknown now: nothing may continue
            log.exception("the engine loop failed")
            self._post(self._on_failure, e)

    def _apply_commands(self, block: bool) -> bool:
        """Apply every queued command; returns True when told to stop."""
        try:
            cmd = self._commands.get(timeout=_IDLE_POLL_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return False
        stop = False
        while True:
            stop |= self._apply(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
        self._publish([])
        return stop

    def _apply(self, cmd: Any) -> bool:
        if isinstance(cmd, _Add):
            self._resolve(cmd.future, *self._try_add(cmd))
        elif isinstance(cmd, _Abort):
            self.engine.abort_request(cmd.request_ids)
        elif isinstance(cmd, _Call):
            try:
                self._resolve(cmd.future, cmd.fn(self.engine), None)
            except Exception as e:
                self._resolve(cmd.future, None, e)
        elif isinstance(cmd, _Stop):
            return True
        return False

    def _try_add(self, cmd: _Add) -> tuple[Any, BaseException | None]:
        if not self._accepting:  # drain began while this add was queued
            return None, ServerStoppingError("the server is shutting down")
        sched = self.engine.scheduler
        free_seats = max(self.max_num_seqs - sched.num_running, 0)
        wanted = sum(r.params.n for r in cmd.requests)
        if sched.num_waiting + wanted - free_seats > self.max_queued_requests:
            return None, QueueFullError(f"the request queue is full ({self.max_queued_requests} waiting)")
        added: list[str] = []
        try:
            for r in cmd.requests:
                self.engine.add_request(r.request_id, r.prompt, r.params,
                                        prompt_token_ids=None if r.prompt_token_ids is None
                                        else list(r.prompt_token_ids))
                added.append(r.request_id)
        except ValueError as e:
            self.engine.abort_request(added)  # all or nothing
            return None, e
        return True, None

    def _step(self) -> None:
        self._step_started = time.monotonic()
        outputs = self.engine.step()
        self._step_started = None
        self._num_steps += 1
        self._publish(outputs)

    def _expire_waiting(self) -> None:
        """Abort requests that have waited past the deadline without ever being
        scheduled (a preempted request was scheduled once and keeps its place)."""
        cutoff = time.monotonic() - self.max_queue_wait_s
        expired = sorted({r.group_id or r.request_id for r in self.engine.scheduler.waiting
                          if r.num_cached_tokens < 0 and r.arrival_time < cutoff})
        if expired:
            self.engine.abort_request(expired)
            self._post(self._fail_expired, expired)

    def _snapshot(self) -> EngineStats:
        sched = self.engine.scheduler
        kv = self.engine.kv
        pc = kv.prefix_cache_stats
        return EngineStats(sched.num_running, sched.num_waiting, kv.usage, kv.num_free_blocks,
                           kv.num_blocks, sched.num_preemptions, pc.queries, pc.hits, self._num_steps)

    def _publish(self, outputs: list[RequestOutput]) -> None:
        self._post(self._dispatch, outputs, self._snapshot())

    def _post(self, fn: Callable, *args: Any) -> None:
        loop = self._loop
        if loop is None:
            return
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass  # the loop is closed: the process is exiting and nobody is waiting

    def _resolve(self, fut: asyncio.Future, result: Any, exc: BaseException | None) -> None:
        self._post(_set_future, fut, result, exc)

    # ---- event loop side ---------------------------------------------------------------

    def _dispatch(self, outputs: list[RequestOutput], stats: EngineStats) -> None:
        self.stats = stats
        now = time.monotonic()
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # aborted: the engine's final 'abort' output is nobody's business
            self._observe(stream, out, now)
            stream._put(out)
            if out.finished:
                del self._streams[out.request_id]

    def _observe(self, stream: RequestStream, out: RequestOutput, now: float) -> None:
        num_tokens = sum(len(c.token_ids) for c in out.outputs)
        if num_tokens > stream.num_tokens:
            if self.listener is not None:
                if stream.first_token_time is None:
                    self.listener.on_first_token(now - stream.arrival)
                else:
                    self.listener.on_next_tokens(now - (stream.last_token_time or now))
            stream.first_token_time = stream.first_token_time or now
            stream.last_token_time = now
            stream.num_tokens = num_tokens
        if out.finished and self.listener is not None:
            self.listener.on_finished(out, now - stream.arrival)

    def _fail_expired(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            stream = self._streams.pop(rid, None)
            if stream is None:
                continue
            stream._fail(QueueTimeoutError(f"the request waited more than {self.max_queue_wait_s:g} s for "
                                           "a free seat; the server is overloaded"))
            if self.listener is not None:
                self.listener.on_ended("queue_timeout")

    def _on_failure(self, exc: BaseException) -> None:
        if self._dead is not None:
            return
        self._dead = EngineDeadError("the engine failed and cannot serve requests; the server is restarting")
        self._accepting = False
        for fut in list(self._pending):
            if not fut.done():
                fut.set_exception(self._dead)
        for rid, stream in list(self._streams.items()):
            stream._fail(self._dead)
            if self.listener is not None:
                self.listener.on_ended("error")
        self._streams.clear()
        if self.on_dead is not None:
            self.on_dead(exc)

    async def _watch_steps(self) -> None:
        period = min(1.0, self.step_timeout_s / 4)
        while self._dead is None:
            await asyncio.sleep(period)
            started = self._step_started
            if started is not None and time.monotonic() - started > self.step_timeout_s:
                log.error("an engine step has run for more than %.1f s: declaring the engine dead",
                          self.step_timeout_s)
                self._on_failure(TimeoutError(f"engine step exceeded {self.step_timeout_s} s"))


def _set_future(fut: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if fut.done():
        return  # the caller was cancelled (client left) or the engine died meanwhile
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)
