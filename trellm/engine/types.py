"""Typed contracts across the engine's boundaries. No torch here.

Scheduler -> runner: ``StepPlan``. Runner -> scheduler: ``StepResult``.
Scheduler -> output processor: ``EngineCoreOutput``. Engine -> user: ``RequestOutput``.

The runner keeps a persistent copy of each request's tokens (like vLLM's input
batch), so a plan sends a request's prompt once (``NewRequestData``) and only the
deltas afterwards (``CachedRequestData``). The runner appends the tokens it samples
to its own copy, so the scheduler never sends them back.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from trellm.sampling_params import SamplingParams


@dataclass(frozen=True)
class NewRequestData:
    """A request the runner has not seen (or must rebuild after preemption)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    """Tokens already generated (non-empty only when resuming after preemption)."""
    sampling_params: SamplingParams
    block_ids: tuple[int, ...]
    """The request's whole block table so far."""
    num_computed_tokens: int
    """Tokens whose KV is already in the cache (prefix-cache hits count)."""


@dataclass(frozen=True)
class CachedRequestData:
    """A request the runner already holds: only what changed."""

    request_id: str
    new_block_ids: tuple[int, ...]
    """Blocks appended to its block table this step."""
    num_computed_tokens: int


@dataclass(frozen=True)
class StepPlan:
    """What one step computes. For request r, the runner computes tokens
    ``all_tokens[num_computed : num_computed + num_scheduled_tokens[r]]``; if that
    reaches the end of its known tokens, the runner samples one next token."""

    step_id: int = 0
    """The scheduler's serial number of the step (update matches results to it)."""
    new_requests: tuple[NewRequestData, ...] = ()
    cached_requests: tuple[CachedRequestData, ...] = ()
    num_scheduled_tokens: Mapping[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    finished_request_ids: frozenset[str] = frozenset()
    """Requests that ended or were preempted since the last plan: the runner drops them."""

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probs at one position: the chosen token's and the top-N alternatives'."""

    token_id: int
    logprob: float
    rank: int
    """1 = most likely."""
    top: tuple[tuple[int, float], ...] = ()
    """(token id, log-prob) of the N most likely tokens, best first."""


@dataclass(frozen=True)
class StepResult:
    """What the runner computed for a plan."""

    sampled_token_ids: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    """Tokens sampled per request; empty for a request whose prefill chunk did not
    reach the end of its prompt."""
    logprobs: Mapping[str, tuple[TokenLogprobs, ...]] = field(default_factory=dict)
    """Per sampled token, for requests that asked for logprobs."""
    prompt_logprobs: Mapping[str, tuple[TokenLogprobs | None, ...]] = field(default_factory=dict)
    """For requests that asked for prompt logprobs: one entry per prompt position
    computed this step (the log-prob of the *next* prompt token); None for the
    first prompt token, which has no prediction."""


@dataclass(frozen=True)
class EngineCoreOutput:
    """Scheduler -> output processor: what happened to one request in a step."""

    request_id: str
    new_token_ids: tuple[int, ...]
    new_logprobs: tuple[TokenLogprobs, ...] = ()
    new_prompt_logprobs: tuple[TokenLogprobs | None, ...] = ()
    finish_reason: str | None = None
    """'stop', 'length' or 'abort' when the request ended this step."""
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0


@dataclass
class CompletionOutput:
    """One of the n completions of a request (vLLM's shape)."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """What the user gets for a request (vLLM's shape)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    finished: bool = False
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    """Timings in seconds: arrival, first_token, finished."""
