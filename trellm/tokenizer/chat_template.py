"""Rendering chat templates the way transformers does.

Templates come from model files, so they are untrusted code: they run in
jinja2's immutable sandbox, with the same environment transformers builds
(trim/lstrip blocks, loop controls, a non-escaping ``tojson``, ``raise_exception``
and ``strftime_now``), so a prompt rendered here equals the reference's.
"""
from __future__ import annotations

import json
import sys
import time
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja's own tojson HTML-escapes ('<' -> '\u003c'), which would change prompts.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


MAX_REPEAT = 1 << 20
"""Largest sequence a template may build with ``*`` (``'a' * 10**10`` would ask for 10 GB)."""


class _Sandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox with ``*`` and ``**`` bounded (``range`` already is)."""

    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context, operator, left, right):
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > MAX_REPEAT:
                    raise jinja2.exceptions.SecurityError(f"sequence repetition longer than {MAX_REPEAT}")
        if operator == "**" and isinstance(right, int) and abs(right) > 1024:
            raise jinja2.exceptions.SecurityError("exponent too large")
        return super().call_binop(context, operator, left, right)


MAX_RENDER_SECONDS = 5.0
"""A render running longer is stopped: Jinja has no ``while``, but nested loops over
``range`` (100,000 each, the sandbox's bound) or over a long message's characters would
otherwise hold a server worker for hours. Real templates render in milliseconds."""


class RenderTimeout(Exception):
    pass


def _deadline_tracer(deadline: float):
    """A trace function that checks the clock on every line of template code (compiled
    Jinja's frames, file name ``<template>``) and no other frame, so only the template
    pays for it (~1 us a line); raising inside the trace stops the render there."""
    def line(frame, event, arg):
        if time.monotonic() > deadline:
            raise RenderTimeout(f"the chat template ran longer than {MAX_RENDER_SECONDS:g} s")
        return line

    def call(frame, event, arg):
        return line if frame.f_code.co_filename == "<template>" else None
    return call


def _render_with_deadline(template: jinja2.Template, **context: Any) -> str:
    previous = sys.gettrace()  # a debugger's or coverage's, restored after
    sys.settrace(_deadline_tracer(time.monotonic() + MAX_RENDER_SECONDS))
    try:
        return template.render(**context)
    finally:
        sys.settrace(previous)


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """Compile once per distinct template text (servers render the same one per request)."""
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def normalize_messages(messages: list[dict]) -> list[dict]:
    """Copies of the messages with list-of-parts content flattened to a string.

    OpenAI clients may send ``content`` as ``[{"type": "text", "text": ...}, ...]``;
    most templates concatenate ``message['content']`` as a string, so the text
    parts are joined with newlines (vLLM's "string" content format). Non-text parts
    are dropped: trellm serves text-only models.
    """
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"chat message {i} must be a dict, got {type(message).__name__}")
        content = message.get("content")
        if isinstance(content, list):
            texts = [p.get("text", "") for p in content
                     if isinstance(p, dict) and p.get("type", "text") == "text"]
            message = {**message, "content": "\n".join(texts)}
        else:
            message = dict(message)
        out.append(message)
    return out


def render_chat_template(source: str | None, messages: list[dict], *,
                         add_generation_prompt: bool = True, **variables: Any) -> str:
    """Render ``source`` for ``messages``; ValueError for a missing or failing template."""
    if not source:
        raise ValueError("this model has no chat template; send a plain prompt (completions API) "
                         "or provide a chat template")
    try:
        template = compile_template(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ValueError(f"the chat template is not valid Jinja (line {e.lineno}): {e.message}") from e
    # transformers always passes these (None when unused); templates test them.
    variables.setdefault("tools", None)
    variables.setdefault("documents", None)
    try:
        return _render_with_deadline(template, messages=normalize_messages(messages),
                                     add_generation_prompt=add_generation_prompt, **variables)
    except RenderTimeout as e:
        raise ValueError(f"{e}; it is stopped (a loop without a practical end?)") from e
    except jinja2.exceptions.TemplateError as e:
        raise ValueError(f"the chat template rejected the conversation: {e}") from e
    except Exception as e:  # RecursionError and MemoryError included
        # A template that indexes a missing key, concatenates None, divides by zero or
        # recurses without end fails with a Python error: the model file's or the
        # caller's problem, reported as such, never an engine crash.
        msg = str(e).splitlines()[0][:200] if str(e) else ""
        raise ValueError(f"the chat template failed on this conversation: {type(e).__name__}: {msg}") from e
