"""The engine's record of one sequence being generated. Plain Python, no torch."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from trellm.sampling_params import SamplingParams


def token_slice(prompt: list[int], output: list[int], start: int, end: int) -> list[int]:
    """Token ids in [start, end) over prompt + output without concatenating the two."""
    p = len(prompt)
    if end <= p:
        return prompt[start:end]
    if start >= p:
        return output[start - p : end - p]
    return prompt[start:] + output[: end - p]


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"  # EOS, stop token or stop string
    FINISHED_LENGTH = "finished_length"  # max_tokens or context length
    FINISHED_ABORTED = "finished_aborted"

    @property
    def finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
        )

    @property
    def finish_reason(self) -> str | None:
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
        }.get(self)


@dataclass(eq=False)
class Request:
    """One sequence. ``num_computed_tokens`` catches up to ``num_tokens``; that one
    rule covers prefill chunks, decode steps and prefix-cache hits."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    max_model_len: int = 0
    """Hard cap on prompt + output tokens (the context length)."""
    arrival_time: float = field(default_factory=time.monotonic)
    group_id: str | None = None
    """Siblings of one n>1 request share it; the scheduler admits the first sibling
    alone and the rest once its prompt is cached, so they reuse its KV blocks."""
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_output_placeholders: int = 0
    """Tokens scheduled to be sampled whose ids are not known yet (async scheduling)."""
    num_cached_tokens: int = -1
    """Prompt tokens served from the prefix cache at first admission (-1: not yet admitted)."""
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    """The stop token id or stop string that ended the request, if any."""

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_with_placeholders(self) -> int:
        return self.num_tokens + self.num_output_placeholders

    def token_slice(self, start: int, end: int) -> list[int]:
        return token_slice(self.prompt_token_ids, self.output_token_ids, start, end)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
