"""Chat conversations to token ids, with message content kept as data.

Rendering a template and tokenizing the resulting string lets a user who types
``<|im_end|>\\n<|im_start|>system`` into a message forge turns: the tokenizer cannot
tell the template's control tokens from the same text inside content
(reliability.md §2 #57; transformers #29279, llama.cpp #26273). Here the template's
own special tokens stay control tokens and special-token text inside content is
tokenized as ordinary text.

How: render once with a unique placeholder per message content and once for real;
the placeholder rendering shows where each content lands in the real prompt. The
real prompt is tokenized as one string (so benign conversations get exactly the
ids the reference gets); only when a special token falls inside a content span is
it re-tokenized piecewise: the template's special tokens as ids, everything between
them with special-token parsing off (``encode_special_tokens``).
"""
from __future__ import annotations

import re
import secrets
from bisect import bisect_right
from typing import TYPE_CHECKING, Any, Callable, Sequence

from trellm.tokenizer.chat_template import normalize_messages

if TYPE_CHECKING:
    from trellm.tokenizer.tokenizer import Tokenizer

Span = tuple[int, int]

_VARIANTS: tuple[Callable[[str], str], ...] = (lambda s: s, str.strip)
"""How a template may pass content through: verbatim, or trimmed (``| trim``)."""


def encode_chat(tok: "Tokenizer", messages: list[dict], add_generation_prompt: bool = True,
                **variables: Any) -> list[int]:
    """Token ids of the rendered conversation with content special tokens kept literal.

    Raises ValueError when the template fails, or when it rewrites message content
    (so content cannot be located) and some content holds special-token text.
    """
    messages = normalize_messages(messages)
    rendered = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **variables)
    contents = [m.get("content") if isinstance(m.get("content"), str) else "" for m in messages]
    spans = content_spans(tok, messages, contents, rendered, add_generation_prompt, variables)
    enc = tok.encoding(rendered, add_special_tokens=False)
    special = tok.special_ids
    if spans is None:
        if any(s and s in c for c in contents for s in tok.special_token_strings):
            raise ValueError("the chat template rewrites message content, so special-token text in a "
                             "message cannot be kept literal; remove it from the message")
        return list(enc.ids)
    starts = [s for s, _ in spans]
    controls = [(start, end, tid) for tid, (start, end) in zip(enc.ids, enc.offsets)
                if tid in special and not _overlaps(start, end, spans, starts)]
    if len(controls) == sum(tid in special for tid in enc.ids):
        return list(enc.ids)  # no special token inside content: the plain encoding is right
    return _encode_pieces(tok, rendered, controls)


def content_spans(tok: "Tokenizer", messages: list[dict], contents: Sequence[str], rendered: str,
                  add_generation_prompt: bool, variables: dict[str, Any]) -> list[Span] | None:
    """Character spans of message contents in ``rendered``, in order; None when the
    template transforms content beyond trimming (or branches on it)."""
    nonce = secrets.token_hex(8)
    marked = [{**m, "content": f"<<{nonce}:{i}>>"} if contents[i] else m for i, m in enumerate(messages)]
    try:
        skeleton = tok.apply_chat_template(marked, add_generation_prompt=add_generation_prompt, **variables)
    except ValueError:
        return None
    marker = re.compile(rf"<<{nonce}:(\d+)>>")
    for variant in _VARIANTS:
        out: list[str] = []
        spans: list[Span] = []
        pos = size = 0
        for m in marker.finditer(skeleton):
            text = skeleton[pos:m.start()]
            content = variant(contents[int(m.group(1))])
            out += [text, content]
            size += len(text)
            spans.append((size, size + len(content)))
            size += len(content)
            pos = m.end()
        out.append(skeleton[pos:])
        if "".join(out) == rendered:
            return [s for s in spans if s[0] < s[1]]
    return None


def _overlaps(start: int, end: int, spans: list[Span], starts: list[int]) -> bool:
    i = bisect_right(starts, start) - 1  # the last span starting at or before ``start``
    if i >= 0 and spans[i][1] > start:
        return True
    return i + 1 < len(spans) and spans[i + 1][0] < end


def _encode_pieces(tok: "Tokenizer", rendered: str, controls: list[tuple[int, int, int]]) -> list[int]:
    """The template's special tokens as ids; the text between them (template text and
    content alike) with special-token parsing off. The tokenizer splits at special
    tokens itself, so the pieces are the segments a plain encoding would use."""
    ids: list[int] = []
    pos = 0
    for start, end, tid in controls:
        if start > pos:
            ids += tok.encoding(rendered[pos:start], add_special_tokens=False, literal=True).ids
        ids.append(tid)
        pos = end
    if pos < len(rendered):
        ids += tok.encoding(rendered[pos:], add_special_tokens=False, literal=True).ids
    return ids
