"""``trellm bench ladder``: a context ladder with a needle.

For each context length and needle depth, two streamed greedy chat turns go to an
OpenAI-compatible server (``--base-url``, or trellm's own app started in this
process on a free loopback port, so both paths are measured the same way):

1. the haystack with the needle and a question: cold TTFT (a unique nonce opens
   the prompt, so no earlier request shares a cached prefix with it beyond the
   chat template's first tokens) and whether the answer holds the code;
2. the same conversation, the answer, and a follow-up asking for a few
   sentences: TTFT with the first turn's prefix cached (where the server has a
   prefix cache), and decode tok/s with the first token excluded.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import secrets
import socket
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Iterator

import httpx

from trellm.bench.client import api_root, error_message, sse_data
from trellm.bench.needle import Needle, TextTokenizer, filler, make_needle, nonce, plant, user_message
from trellm.bench.report import emit, fmt, markdown_table, run_header
from trellm.bench.stats import summarize
from trellm.loader.errors import first_line

DEFAULT_DEPTHS = (0.1, 0.5, 0.9)
FIRST_CONTEXT = 1024
FOLLOW_UP_TOKENS = 64
"""Room for the follow-up question and its template tokens in the second turn."""
MIN_FILLER = 16


class LadderError(ValueError):
    """A one-line reason the ladder cannot go on (the CLI prints it)."""


@dataclass(frozen=True)
class LadderSpec:
    contexts: tuple[int, ...]
    depths: tuple[float, ...]
    answer_tokens: int = 24
    """max_tokens of the needle answer."""
    gen_tokens: int = 128
    """max_tokens of the follow-up turn, which gives decode tok/s."""
    seed: int = 0
    """Picks the needles and the haystack text: the same for a seed."""
    run_id: str = ""
    """Picks the nonces: differs per run, so a rerun against a long-lived server
    does not find its earlier prompts in the prefix cache."""


@dataclass(frozen=True)
class Turn:
    """One streamed chat turn; times in seconds from sending the request."""

    text: str
    ttft_s: float
    last_token_s: float
    completion_tokens: int
    prompt_tokens: int | None

    @property
    def decode_tok_s(self) -> float | None:
        span = self.last_token_s - self.ttft_s
        return (self.completion_tokens - 1) / span if self.completion_tokens >= 2 and span > 0 else None


@dataclass(frozen=True)
class Cell:
    """The figures of one context x depth."""

    context: int
    depth: float
    prompt_tokens: int | None
    """The first turn's prompt as the server counted it (usage); None if it did not say."""
    filler_tokens: int
    """The haystack without the needle, by the local tokenizer."""
    filler_target: int
    cold_ttft_ms: float
    hit_ttft_ms: float
    hit_prompt_tokens: int | None
    decode_tok_s: float | None
    decode_tokens: int
    needle_code: str
    needle_found: bool
    answer: str


# ---- the HTTP side ----------------------------------------------------------------------


class ChatClient:
    """Streamed greedy chat completions from one server, one request at a time."""

    def __init__(self, base_url: str, model: str, api_key: str | None, timeout_s: float):
        self.root = api_root(base_url)
        self.model = model
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.AsyncClient(base_url=self.root, headers=headers,
                                      timeout=httpx.Timeout(timeout_s, connect=10.0))

    async def chat(self, messages: list[dict], max_tokens: int) -> Turn:
        body = {"model": self.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
                "stream": True, "stream_options": {"include_usage": True}}
        t0 = time.perf_counter()
        times: list[float] = []
        end = 0.0
        parts: list[str] = []
        usage: dict = {}
        try:
            async with self.http.stream("POST", "/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    raise LadderError(f"{self.root}: {error_message(r.status_code, await r.aread())}")
                async for data in sse_data(r.aiter_lines()):
                    if data.strip() == "[DONE]":
                        break
                    text, chunk_usage, finished = _chunk(data)
                    usage = chunk_usage or usage
                    if text:
                        times.append(time.perf_counter() - t0)
                        parts.append(text)
                    elif finished and times:
                        # A turn ending on EOS: that token has no text, but usage counts
                        # it, so its time belongs in the decode window too.
                        end = time.perf_counter() - t0
        except httpx.HTTPError as e:
            raise LadderError(f"{self.root}: {type(e).__name__}: {first_line(e)}") from e
        if not times:
            raise LadderError(f"{self.root}: a chat stream carried no text (max_tokens={max_tokens})")
        # Servers that send no usage: one chunk per token is the best guess left.
        n = usage.get("completion_tokens") if isinstance(usage.get("completion_tokens"), int) else len(times)
        prompt = usage.get("prompt_tokens") if isinstance(usage.get("prompt_tokens"), int) else None
        return Turn("".join(parts), times[0], max(times[-1], end), n, prompt)

    async def max_model_len(self) -> int | None:
        """What GET /v1/models says of the model's context (vLLM and trellm do), else None."""
        try:
            r = await self.http.get("/v1/models", timeout=10.0)
            cards = r.json().get("data", []) if r.status_code == 200 else []
        except (httpx.HTTPError, ValueError):
            return None
        lens = [c.get("max_model_len") for c in cards if isinstance(c, dict) and c.get("id") == self.model]
        return lens[0] if lens and isinstance(lens[0], int) else None

    async def aclose(self) -> None:
        await self.http.aclose()


def _chunk(data: str) -> tuple[str, dict | None, bool]:
    """(text, usage, whether a choice finished) of one stream chunk."""
    try:
        chunk = json.loads(data)
    except ValueError as e:
        raise LadderError(f"the server sent a stream chunk that is not JSON: {data[:80]!r}") from e
    if not isinstance(chunk, dict):
        raise LadderError("the server sent a stream chunk that is not a JSON object")
    if "error" in chunk:
        err = chunk["error"]
        msg = err.get("message", err) if isinstance(err, dict) else err
        raise LadderError(f"the server ended a stream with an error: {msg}")
    text, finished = "", False
    for choice in chunk.get("choices") or ():
        delta = (choice or {}).get("delta") or {}
        text += (delta.get("reasoning_content") or "") + (delta.get("content") or "")
        finished = finished or bool((choice or {}).get("finish_reason"))
    usage = chunk.get("usage")
    return text, usage if isinstance(usage, dict) else None, finished


@dataclass(frozen=True)
class Target:
    """The server a ladder runs against."""

    base_url: str
    model: str
    engine_version: str | None
    tokenizer: Any
    tokenizer_source: str


@contextlib.contextmanager
def in_process_server(model: str, engine_kw: dict) -> Iterator[Target]:
    """trellm's own app (``trellm serve``'s, default settings) on a free loopback port,
    in a thread of this process; stopped on exit."""
    import uvicorn

    import trellm
    from trellm.config import ServerConfig
    from trellm.engine.engine import Engine
    from trellm.entrypoints.llm import engine_config_from_kwargs
    from trellm.server.api_server import build_app, default_model_names
    from trellm.server.async_engine import AsyncEngine
    from trellm.server.transport import uvicorn_config

    engine = Engine(engine_config_from_kwargs(model, **engine_kw))
    if engine.tokenizer is None:
        raise LadderError("the model has no tokenizer, so no chat template: the ladder needs chat")
    # Long haystacks: larger bodies and a longer tokenize deadline than a public server's.
    config = ServerConfig(max_request_body_bytes=256 << 20, tokenize_timeout_s=600.0)
    names = default_model_names(model)
    app = build_app(AsyncEngine(engine), config, names)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn_config(app, host="127.0.0.1", port=port, log_level="warning",
                                           header_timeout_s=config.request_header_timeout_s,
                                           shutdown_timeout_s=5.0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="ladder-server")
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise LadderError("the in-process server did not start")
            time.sleep(0.02)
        yield Target(f"http://127.0.0.1:{port}", names[0], trellm.__version__, engine.tokenizer,
                     f"the model's own ({model or 'embedded default'})")
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


@contextlib.contextmanager
def remote_server(base_url: str, model: str | None, tokenizer: str | None) -> Iterator[Target]:
    from trellm.tokenizer.tokenizer import Tokenizer

    if tokenizer:
        tok, source = Tokenizer.load(tokenizer), tokenizer
    else:
        from trellm.default_model import default_model_path

        # Only sizes the filler; the prompt length the server reports is recorded beside it.
        tok, source = Tokenizer.from_gguf(default_model_path()), "embedded default's (approximate)"
    yield Target(base_url, model or "", None, tok, source)


# ---- the ladder ---------------------------------------------------------------------------


def plan_contexts(requested: tuple[int, ...] | None, max_len: int | None, headroom: int,
                  max_context: int | None) -> tuple[list[int], list[int]]:
    """(contexts to run, requested ones skipped because prompt + answers would not fit).

    The default ladder is 1k, 4k, 16k, ... below the limit, then the limit itself.
    """
    cap = max_len if max_len is not None else max_context
    limit = cap - headroom if cap is not None else None
    if requested:
        keep = [c for c in requested if limit is None or c <= limit]
        return keep, [c for c in requested if c not in keep]
    if limit is None:
        return [1024, 4096, 16384, 65536], []
    ladder, c = [], FIRST_CONTEXT
    while c < limit:
        ladder.append(c)
        c *= 4
    return ladder + [limit], []


def prompt_overhead(tok: Any, tag: str, needle: Needle) -> int:
    """Tokens of the first turn's prompt besides the filler (template, instructions, needle)."""
    user = user_message(tag, needle.fact, needle)
    try:
        return len(tok.encode_chat([{"role": "user", "content": user}]))
    except (ValueError, AttributeError):  # no chat template here: the server adds a few
        return len(tok.encode(user, add_special_tokens=False))


def follow_up(needle: Needle) -> str:
    return f"Thank you. Now describe in a few sentences what the {needle.color} door might look like."


async def run_cell(client: ChatClient, tok: TextTokenizer, spec: LadderSpec, context: int, depth: float) -> Cell:
    needle = make_needle(random.Random(f"{spec.seed}:{context}:{depth}"))
    tag = nonce(random.Random(f"{spec.run_id}:{context}:{depth}"))
    target = context - prompt_overhead(tok, tag, needle)
    if target < MIN_FILLER:
        raise LadderError(f"context {context} is too short for the ladder prompt ({context - target} tokens "
                          f"without filler)")
    text = filler(tok, target, seed=spec.seed * 1_000_003 + context)
    user = user_message(tag, plant(text, needle.fact, depth), needle)
    first_msgs = [{"role": "user", "content": user}]
    first = await client.chat(first_msgs, spec.answer_tokens)
    second = await client.chat(first_msgs + [{"role": "assistant", "content": first.text},
                                             {"role": "user", "content": follow_up(needle)}], spec.gen_tokens)
    return Cell(context=context, depth=depth, prompt_tokens=first.prompt_tokens,
                filler_tokens=len(tok.encode(text, add_special_tokens=False)), filler_target=target,
                cold_ttft_ms=first.ttft_s * 1e3, hit_ttft_ms=second.ttft_s * 1e3,
                hit_prompt_tokens=second.prompt_tokens, decode_tok_s=second.decode_tok_s,
                decode_tokens=second.completion_tokens, needle_code=needle.code,
                needle_found=needle.found_in(first.text), answer=first.text)


async def run_ladder_on(target: Target, spec: LadderSpec, max_context: int | None,
                        timeout_s: float, api_key: str | None = None) -> dict:
    """Run every cell against ``target``; the result dict (without the run header)."""
    from tqdm import tqdm

    client = ChatClient(target.base_url, target.model, api_key, timeout_s)
    try:
        if not client.model:
            client.model = await _first_model(client)
        max_len = await client.max_model_len()
        headroom = spec.answer_tokens + spec.gen_tokens + FOLLOW_UP_TOKENS
        contexts, skipped = plan_contexts(spec.contexts or None, max_len, headroom, max_context)
        if not contexts:
            raise LadderError(f"no context fits: the server's limit is {max_len or max_context} tokens and "
                              f"each cell needs {headroom} beyond its context")
        await client.chat([{"role": "user", "content": "Hello!"}], 4)  # warm-up: one-time costs stay out
        cells: list[Cell] = []
        with tqdm(total=len(contexts) * len(spec.depths), desc="ladder", unit="cell") as bar:
            for context in contexts:
                for depth in spec.depths:
                    bar.set_postfix(context=context, depth=depth)
                    cells.append(await run_cell(client, target.tokenizer, spec, context, depth))
                    bar.update(1)
    finally:
        await client.aclose()
    return {"base_url": target.base_url, "served_model": client.model, "server_max_model_len": max_len,
            "engine_version": target.engine_version, "tokenizer": target.tokenizer_source,
            "spec": {**asdict(spec), "contexts": contexts, "depths": list(spec.depths)},
            "skipped_contexts": skipped, "cells": [asdict(c) for c in cells],
            "by_context": by_context(cells),
            "needle_hits": sum(c.needle_found for c in cells), "needle_cells": len(cells)}


async def _first_model(client: ChatClient) -> str:
    try:
        r = await client.http.get("/v1/models", timeout=10.0)
        return str(r.json()["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as e:
        raise LadderError(f"{client.root}: no --model given and GET /v1/models named none ({e})") from e


def by_context(cells: list[Cell]) -> dict[str, dict]:
    """Means per context over its depths (decode tok/s only where a cell measured one)."""
    out: dict[str, dict] = {}
    for ctx in sorted({c.context for c in cells}):
        row = [c for c in cells if c.context == ctx]

        def mean(vals: list[float]) -> float | None:
            s = summarize(vals)
            return s.mean if s else None

        out[str(ctx)] = {"cold_ttft_ms": mean([c.cold_ttft_ms for c in row]),
                         "hit_ttft_ms": mean([c.hit_ttft_ms for c in row]),
                         "decode_tok_s": mean([c.decode_tok_s for c in row if c.decode_tok_s is not None]),
                         "needle_hits": sum(c.needle_found for c in row), "cells": len(row)}
    return out


def ladder_markdown(result: dict) -> str:
    rows = [[c["context"], f"{c['depth']:.2f}", c["prompt_tokens"] or "–",
             f"{c['filler_tokens']}/{c['filler_target']}", fmt(c["cold_ttft_ms"], 0), fmt(c["hit_ttft_ms"], 0), fmt(c["decode_tok_s"]),
             "found" if c["needle_found"] else f"MISSED ({c['needle_code']})"]
            for c in result["cells"]]
    table = markdown_table(["context", "depth", "prompt tokens", "filler/target", "cold TTFT ms",
                            "prefix-hit TTFT ms", "decode tok/s", "needle"], rows)
    lines = [table, "", f"needle found in {result['needle_hits']} of {result['needle_cells']} cells; "
             f"decode tok/s excludes the first token; model {result['served_model']} at {result['base_url']}"]
    if result["skipped_contexts"]:
        lines.append(f"skipped (prompt + answers over the server's limit): {result['skipped_contexts']}")
    return "\n".join(lines)


# ---- the command --------------------------------------------------------------------------


def _ints(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text!r}") from e
    if not vals or min(vals) <= 0:
        raise argparse.ArgumentTypeError("give positive integers, e.g. 1024,4096")
    return tuple(dict.fromkeys(vals))  # a repeated cell would share its nonce, so its prefix


def _depths(text: str) -> tuple[float, ...]:
    try:
        vals = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of numbers: {text!r}") from e
    if not vals or not all(0.0 <= v <= 1.0 for v in vals):
        raise argparse.ArgumentTypeError("depths are fractions of the haystack in [0, 1], e.g. 0.1,0.5,0.9")
    return tuple(dict.fromkeys(vals))


def add_ladder_parser(bsub) -> None:
    from trellm.entrypoints.cli import add_engine_args

    p = bsub.add_parser("ladder", help="context ladder: cold and prefix-hit TTFT, decode tok/s, needle recall")
    add_engine_args(p)  # the model and engine flags of the in-process server
    p.add_argument("--model", dest="model_flag", default=None,
                   help="with --base-url: the served model name (default: the first /v1/models lists)")
    p.add_argument("--base-url", default=None,
                   help="an OpenAI-compatible server, http://host:port[/v1] (default: trellm in this process)")
    p.add_argument("--api-key", default=None, help="bearer key for --base-url (default: $TRELLM_API_KEY)")
    p.add_argument("--tokenizer", default=None,
                   help="with --base-url: a local GGUF, HF directory or tokenizer.json to size the filler")
    p.add_argument("--contexts", type=_ints, default=None,
                   help="prompt lengths in tokens, e.g. 1024,4096 (default: 1k, 4k, 16k, ... to the max context)")
    p.add_argument("--depths", type=_depths, default=DEFAULT_DEPTHS, help="needle depths (default 0.1,0.5,0.9)")
    p.add_argument("--max-context", type=int, default=None,
                   help="cap for the default ladder when the server does not report max_model_len")
    p.add_argument("--answer-tokens", type=int, default=24)
    p.add_argument("--gen-tokens", type=int, default=128, help="max tokens of the follow-up turn (decode tok/s)")
    p.add_argument("--needle-seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=1800.0)
    p.add_argument("--out", default=None, help="write JSON results here")
    p.add_argument("--png", default=None, help="write the plot here (default: beside --out, .png)")
    p.set_defaults(func=run_ladder_command)


def run_ladder_command(args: argparse.Namespace) -> int:
    import logging

    from trellm import envs
    from trellm.bench.ladder_plots import plot_ladder
    from trellm.entrypoints.cli import engine_kwargs

    if args.answer_tokens < 1 or args.gen_tokens < 2:
        raise LadderError("--answer-tokens must be >= 1 and --gen-tokens >= 2 (decode excludes the first token)")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request otherwise
    spec = LadderSpec(contexts=args.contexts or (), depths=args.depths, answer_tokens=args.answer_tokens,
                      gen_tokens=args.gen_tokens, seed=args.needle_seed, run_id=secrets.token_hex(8))
    if args.base_url:
        server = remote_server(args.base_url, args.model or None, args.tokenizer)
    else:
        server = in_process_server(args.model, engine_kwargs(args))
    with server as target:
        result = asyncio.run(run_ladder_on(target, spec, args.max_context, args.request_timeout,
                                           args.api_key or (envs.api_key() if args.base_url else None)))
    model = args.model or ("embedded default (SmolLM2-135M-Instruct, Q4_1 GGUF)" if not args.base_url else "")
    result = {**run_header("ladder", model or result["served_model"], getattr(args, "argv", None)), **result}
    emit(result, ladder_markdown(result), args.out, args.png, plot_ladder)
    return 0
