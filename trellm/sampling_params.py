"""Per-request sampling parameters, in vLLM's shape so users can switch.

Validation happens at construction and raises ``ValueError`` with a message that
names the offending field; the CLI and server turn that into a one-line error.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

# Hard caps so a single request cannot ask for unbounded work.
MAX_N = 64
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LEN = 256


def _finite(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return float(value)


def _int(name: str, value: int | None, lo: int, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value}")


def _as_tuple(name: str, value) -> tuple:
    if value is None:
        return ()
    if isinstance(value, (str, bytes, dict)) or not hasattr(value, "__iter__"):
        raise ValueError(f"{name} must be a list, got {type(value).__name__}")
    return tuple(value)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request. Defaults follow vLLM."""

    n: int = 1
    """Number of independent completions for the prompt (they share its KV blocks)."""
    temperature: float = 1.0
    """0 means greedy (argmax)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability sums to top_p."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 or -1 disables."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the top token's."""
    seed: int | None = None
    """Per-request seed: the same seed gives the same tokens whatever the batch."""
    presence_penalty: float = 0.0
    """Subtracted once from the logit of every token already generated."""
    frequency_penalty: float = 0.0
    """Subtracted per occurrence from the logit of every token already generated."""
    repetition_penalty: float = 1.0
    """CTRL-style: logits of prompt and generated tokens divided (if >0) or multiplied (if <0)."""
    logit_bias: dict[int, float] | None = None
    """Token id -> value added to its logit before sampling."""
    max_tokens: int | None = 16
    """Most tokens to generate; None means up to the context length."""
    min_tokens: int = 0
    """EOS and stop token ids are suppressed until this many tokens are generated."""
    stop: tuple[str, ...] = ()
    """Strings that end generation; not included in the output text."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end generation in addition to EOS."""
    ignore_eos: bool = False
    """Keep going past EOS (benchmarks)."""
    logprobs: int | None = None
    """Return the sampled token's log-prob and this many top alternatives."""
    prompt_logprobs: int | None = None
    """Return the log-prob of every prompt token (and this many top alternatives)."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the detokenized text."""
    include_stop_str_in_output: bool = False
    """Keep the matched stop string at the end of the text."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", _as_tuple("stop", self.stop))
        object.__setattr__(self, "stop_token_ids", _as_tuple("stop_token_ids", self.stop_token_ids))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        self._validate()

    def _validate(self) -> None:
        _int("n", self.n, 1)
        if self.n > MAX_N:
            raise ValueError(f"n must be <= {MAX_N}, got {self.n}")
        t = _finite("temperature", self.temperature)
        if t < 0:
            raise ValueError(f"temperature must be >= 0, got {t}")
        p = _finite("top_p", self.top_p)
        if not 0.0 < p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {p}")
        _int("top_k", self.top_k, 0)
        mp = _finite("min_p", self.min_p)
        if not 0.0 <= mp <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {mp}")
        if self.seed is not None:
            _int("seed", self.seed, -(2**63))
        for name in ("presence_penalty", "frequency_penalty"):
            v = _finite(name, getattr(self, name))
            if not -2.0 <= v <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {v}")
        rp = _finite("repetition_penalty", self.repetition_penalty)
        if rp <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {rp}")
        self._validate_lists()

    def _validate_lists(self) -> None:
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError("logit_bias must be a mapping of token id to bias")
            for k, v in self.logit_bias.items():
                _int("logit_bias key", k, 0)
                b = _finite("logit_bias value", v)
                if not -100.0 <= b <= 100.0:
                    raise ValueError(f"logit_bias values must be in [-100, 100], got {b}")
        _int("max_tokens", self.max_tokens, 1, allow_none=True)
        _int("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError("stop strings must be non-empty strings")
            if len(s) > MAX_STOP_STRING_LEN:
                raise ValueError(f"stop strings must be at most {MAX_STOP_STRING_LEN} characters")
        for t in self.stop_token_ids:
            _int("stop_token_ids entry", t, 0)
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            _int(name, v, 0, allow_none=True)
            if v is not None and v > MAX_LOGPROBS:
                raise ValueError(f"{name} must be <= {MAX_LOGPROBS}, got {v}")

    def with_(self, **changes) -> "SamplingParams":
        """A copy with some fields changed (configs and params are never mutated)."""
        return replace(self, **changes)

    def validate_vocab(self, vocab_size: int) -> None:
        """Checks that need the model: token ids must exist in its vocabulary."""
        for t in self.stop_token_ids:
            if t >= vocab_size:
                raise ValueError(f"stop_token_ids entry {t} is outside the vocabulary (size {vocab_size})")
        for k in self.logit_bias or {}:
            if k >= vocab_size:
                raise ValueError(f"logit_bias key {k} is outside the vocabulary (size {vocab_size})")

