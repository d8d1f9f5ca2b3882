"""Rendering chat templates the way transformers does.

Templates come from model files, so they are untrusted code: they run in
jinja2's immutable sandbox, with the same environment transformers builds
(trim/lstrip blocks, loop controls, a non-escaping ``tojson``, ``raise_exception``
and ``strftime_now``), so a prompt rendered here equals the reference's.
"""
from __future__ import annotations

import json
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
        return template.render(messages=normalize_messages(messages),
                               add_generation_prompt=add_generation_prompt, **variables)
    except jinja2.exceptions.TemplateError as e:
        raise ValueError(f"the chat template rejected the conversation: {e}") from e
    except Exception as e:  # RecursionError and MemoryError included
        # A template that indexes a missing key, concatenates None, divides by zero or
        # recurses without end fails with a Python error: the model file's or the
        # caller's problem, reported as such, never an engine crash.
        msg = str(e).splitlines()[0][:200] if str(e) else ""
        raise ValueError(f"the chat template failed on this conversation: {type(e).__name__}: {msg}") from e
