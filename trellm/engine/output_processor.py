"""Turns the scheduler's per-step ``EngineCoreOutput``s into user-facing ``RequestOutput``s.

Responsibilities: incremental detokenization (never exposing half a UTF-8
character), stop strings (which the scheduler cannot see, since it only has token
ids), logprob accumulation, and folding the n children of a request into one
output. Outputs are cumulative (vLLM's default): every ``RequestOutput`` carries
the whole text and token list so far, and the visible ``text`` only ever grows by
appending, so a streaming server can send ``text[len(previous):]``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol, Sequence

from trellm.engine.types import CompletionOutput, EngineCoreOutput, RequestOutput, TokenLogprobs
from trellm.sampling_params import SamplingParams

# Prompt tokens kept as the decoder's left context for the first output token (as
# vLLM): decoders such as SentencePiece's strip a leading space at the start of a
# sequence, so the first generated word would lose its space without context.
_INITIAL_CONTEXT = 5

# Once this many ids lie before the decode window, drop them so the per-request id
# buffer stays bounded instead of holding the whole output a second time.
_TRIM_AT = 256

_REPLACEMENT_CHAR = "\ufffd"


class TokenizerLike(Protocol):
    """The part of a tokenizer the output processor uses (``tokenizers.Tokenizer`` fits)."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Decodes one sequence token by token in O(new tokens) per step.

    vLLM's prefix/read window: ``ids[prefix_offset:read_offset]`` is a few tokens of
    already-emitted context and ``ids[read_offset:]`` the not-yet-emitted tail.
    Decoding the window with and without the tail and taking the difference gives the
    new text with the right spacing, and a tail that decodes to a trailing U+FFFD is
    an incomplete UTF-8 character, so it is held until more bytes arrive (or flush()).
    """

    def __init__(self, tokenizer: TokenizerLike, prompt_token_ids: Sequence[int],
                 skip_special_tokens: bool) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_token_ids[-_INITIAL_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def add(self, token_id: int) -> str:
        """Append a token; returns the newly completed text (may be empty)."""
        self._ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """Whatever is still held back (e.g. a partial character at the very end)."""
        if self._read_offset >= len(self._ids):
            return ""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        p, r = self._prefix_offset, self._read_offset
        prefix_text = self._decode(self._ids[p:r])
        new_text = self._decode(self._ids[p:])
        if len(new_text) <= len(prefix_text):
            return ""  # e.g. a skipped special token: nothing visible yet
        if not final and new_text.endswith(_REPLACEMENT_CHAR):
            return ""  # the tail ends inside a multi-byte character
        self._prefix_offset, self._read_offset = r, len(self._ids)
        if self._prefix_offset >= _TRIM_AT:
            del self._ids[:self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return new_text[len(prefix_text):]


@dataclass
class _Completion:
    """Mutable state of one child sequence."""

    child_id: str
    index: int
    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    cumulative_logprob: float | None = None
    text: str = ""
    """All detokenized text so far (already cut at a matched stop string)."""
    visible_len: int = 0
    """How much of ``text`` has been returned; never decreases."""
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class _RequestState:
    """One user request and its children."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    children: list[_Completion]
    prompt_logprobs: list[TokenLogprobs | None] | None
    prompt_logprobs_from: str | None = None
    """The child whose prompt logprobs are used (siblings may report them too)."""
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.children)


def _find_stop(text: str, start_len: int, stops: Sequence[str]) -> tuple[int, str] | None:
    """The earliest stop string that ends after ``start_len`` (i.e. in new text).

    Only the new text plus ``len(stop) - 1`` chars before it can hold a match that
    was not already found, so the search is O(new text) per step.
    """
    best: tuple[int, str] | None = None
    for s in stops:
        j = text.find(s, max(0, start_len - len(s) + 1))
        if j != -1 and (best is None or j < best[0]):
            best = (j, s)
    return best


class OutputProcessor:
    """Detokenizes, applies stop strings and aggregates children into RequestOutputs."""

    def __init__(self, tokenizer: TokenizerLike) -> None:
        self.tokenizer = tokenizer
        self._requests: dict[str, _RequestState] = {}
        self._children: dict[str, tuple[str, _Completion]] = {}
        """child id -> (parent id, child state); a plain request is its own child."""

    # ------------------------------------------------------------------ registry
    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, child_ids: list[str] | None = None,
                    arrival_time: float | None = None) -> None:
        """Track a request. For n > 1 the engine passes the ids of its children; their
        outputs are reported together under ``request_id`` (outputs[i] = child i)."""
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already being processed")
        ids = list(child_ids) if child_ids else [request_id]
        for cid in ids:
            if cid in self._children:
                raise ValueError(f"child id {cid!r} is already in use")
        children = [
            _Completion(
                child_id=cid, index=i,
                detok=IncrementalDetokenizer(self.tokenizer, prompt_token_ids,
                                             params.skip_special_tokens),
                logprobs=[] if params.logprobs is not None else None,
                cumulative_logprob=0.0 if params.logprobs is not None else None,
            )
            for i, cid in enumerate(ids)
        ]
        self._requests[request_id] = _RequestState(
            request_id=request_id, prompt=prompt, prompt_token_ids=list(prompt_token_ids),
            params=params, children=children,
            prompt_logprobs=[] if params.prompt_logprobs is not None else None,
            metrics={"arrival": time.monotonic() if arrival_time is None else arrival_time},
        )
        for c in children:
            self._children[c.child_id] = (request_id, c)

    def has_request(self, request_id: str) -> bool:
        """Whether ``request_id`` (a request or one of its children) is tracked."""
        return request_id in self._requests or request_id in self._children

    def abort(self, request_id: str) -> list[str]:
        """Forget a request (given its id or a child's); returns the ids of its
        children that had not finished, which the scheduler must abort."""
        entry = self._children.get(request_id)
        req = self._requests.get(entry[0] if entry else request_id)
        if req is None:
            return []
        self._forget(req)
        return [c.child_id for c in req.children if not c.finished]

    # ------------------------------------------------------------------ per step
    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Fold one step's outputs in. Returns the RequestOutputs of the requests that
        changed (in first-seen order) and the child ids the scheduler must stop
        because a stop string matched."""
        changed: dict[str, _RequestState] = {}
        to_stop: list[str] = []
        now = time.monotonic()
        for out in outputs:
            entry = self._children.get(out.request_id)
            if entry is None:
                continue  # aborted, or its request already finished
            parent, child = entry
            req = self._requests[parent]
            if child.finished:
                continue  # in-flight tokens after a stop-string finish are dropped
            if not (out.new_token_ids or out.new_prompt_logprobs or out.finish_reason):
                continue
            self._absorb_prompt_logprobs(req, out)
            if out.num_cached_tokens:
                req.num_cached_tokens = max(req.num_cached_tokens, out.num_cached_tokens)
            if out.new_token_ids and "first_token" not in req.metrics:
                req.metrics["first_token"] = now
            if self._update_child(req.params, child, out):
                to_stop.append(child.child_id)
            changed.setdefault(parent, req)
        results = []
        for req in changed.values():
            if req.finished:
                req.metrics["finished"] = now
                self._forget(req)
            results.append(self._make_output(req))
        return results, to_stop

    def _forget(self, req: _RequestState) -> None:
        self._requests.pop(req.request_id, None)
        for c in req.children:
            self._children.pop(c.child_id, None)

    @staticmethod
    def _absorb_prompt_logprobs(req: _RequestState, out: EngineCoreOutput) -> None:
        if req.prompt_logprobs is None or not out.new_prompt_logprobs:
            return
        # n > 1 siblings share one prompt; take it from the first child that reports.
        if req.prompt_logprobs_from is None:
            req.prompt_logprobs_from = out.request_id
        if req.prompt_logprobs_from == out.request_id:
            req.prompt_logprobs.extend(out.new_prompt_logprobs)

    def _update_child(self, params: SamplingParams, c: _Completion, out: EngineCoreOutput) -> bool:
        """Apply one output to a child. Returns True when a stop string ended it here
        and the scheduler still has to be told (it did not finish the child itself)."""
        # EOS / stop-token text is not part of the output unless asked for (as vLLM);
        # its id still goes into token_ids.
        stop_token_end = out.finish_reason == "stop" and not isinstance(out.stop_reason, str)
        skip_last_text = stop_token_end and not params.include_stop_str_in_output
        n = len(out.new_token_ids)
        for i, tok in enumerate(out.new_token_ids):
            c.token_ids.append(tok)
            if c.logprobs is not None and i < len(out.new_logprobs):
                lp = out.new_logprobs[i]
                c.logprobs.append(lp)
                c.cumulative_logprob = (c.cumulative_logprob or 0.0) + lp.logprob
            if skip_last_text and i == n - 1:
                break
            if self._append_text(params, c, c.detok.add(tok)):
                # Tokens after the one completing the stop string are dropped; the
                # scheduler is told to stop unless it has ended the request anyway.
                return out.finish_reason is None
        if out.finish_reason is not None:
            # Release any partial character; it may even complete a stop string.
            if not self._append_text(params, c, c.detok.flush()):
                c.finish_reason, c.stop_reason = out.finish_reason, out.stop_reason
        return False

    @staticmethod
    def _append_text(params: SamplingParams, c: _Completion, delta: str) -> bool:
        """Append decoded text and check stop strings; True if one matched."""
        if not delta:
            return False
        start = len(c.text)
        c.text += delta
        # As vLLM: stop strings only count once more than min_tokens tokens exist.
        if not params.stop or len(c.token_ids) <= params.min_tokens:
            return False
        hit = _find_stop(c.text, start, params.stop)
        if hit is None:
            return False
        j, s = hit
        c.text = c.text[: j + len(s) if params.include_stop_str_in_output else j]
        c.finish_reason, c.stop_reason = "stop", s
        return True

    @staticmethod
    def _visible_text(params: SamplingParams, c: _Completion) -> str:
        """The text to return: everything once finished; otherwise all but the last
        ``max_stop_len - 1`` chars, which might be the start of a stop string."""
        if c.finished:
            c.visible_len = len(c.text)
            return c.text
        hold = 0
        if params.stop and not params.include_stop_str_in_output:
            # With include_stop_str_in_output a stop string's start is output anyway.
            hold = max(len(s) for s in params.stop) - 1
        c.visible_len = max(c.visible_len, len(c.text) - hold)
        return c.text if c.visible_len == len(c.text) else c.text[:c.visible_len]

    def _make_output(self, req: _RequestState) -> RequestOutput:
        # Lists are copied so an output already handed out is a stable snapshot.
        outs = [
            CompletionOutput(
                index=c.index,
                text=self._visible_text(req.params, c),
                token_ids=list(c.token_ids),
                logprobs=list(c.logprobs) if c.logprobs is not None else None,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
                cumulative_logprob=c.cumulative_logprob,
            )
            for c in req.children
        ]
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=outs,
            prompt_logprobs=list(req.prompt_logprobs) if req.prompt_logprobs is not None else None,
            finished=req.finished,
            num_cached_tokens=req.num_cached_tokens,
            metrics=dict(req.metrics),
        )
