"""Wire types of the OpenAI-compatible API (pydantic v2), with every field bounded.

Validation rules (reliability.md §2, §5.2), applied here once for every route:
- integers and booleans are strict: ``"3"``, ``true`` or ``2.0`` are not an ``n``;
- floats are finite (``NaN`` / ``Infinity`` are rejected, never stored);
- strings must be encodable as UTF-8, so a lone surrogate is a 400, not a later 500;
- every list and every number has a hard cap, so no single request can ask for
  unbounded work; tighter, configurable caps (``ServerConfig``) and the checks that
  need the model (vocabulary, context length) are applied in ``serving_base``;
- unknown fields are ignored, as OpenAI does, because SDKs add fields over time;
  but fields that ask for something this server does not do (structured output,
  tools, a client chat template) are declared ``Unsupported`` and refused with a
  400, since ignoring them would return an answer the client did not ask for.
"""
from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from trellm.sampling_params import MAX_LOGPROBS, MAX_N, MAX_STOP_STRING_LEN, MAX_STOP_STRINGS

# ---- hard caps (absolute; ServerConfig may lower n and logprobs further) ----------------

MAX_PROMPTS = 256
"""Prompts in one /v1/completions request (evaluation harnesses batch them); the
engine's admission cap (max_num_seqs + max_queued_requests) bounds them further."""
MAX_MESSAGES = 1024
MAX_CONTENT_PARTS = 64
MAX_TOKEN_ID = 2**31 - 1
MAX_TOKENS = 2**31 - 1
"""Anything larger is a 400 here; smaller values are checked against the context."""
MAX_LOGIT_BIAS = 300
MAX_STOP_TOKEN_IDS = 64
MAX_NAME_LEN = 256
MAX_TOP_K = 1 << 20


def _utf8(s: str) -> str:
    # json.loads accepts "\ud800"; encoding it later would raise deep inside the server.
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("string is not valid Unicode (lone surrogate)") from None
    return s


Text = Annotated[str, AfterValidator(_utf8)]
NonEmptyText = Annotated[str, Field(min_length=1), AfterValidator(_utf8)]
Name = Annotated[str, Field(min_length=1, max_length=MAX_NAME_LEN), AfterValidator(_utf8)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_LEN), AfterValidator(_utf8)]
StrictBool = Annotated[bool, Field(strict=True)]
TokenId = Annotated[int, Field(strict=True, ge=0, le=MAX_TOKEN_ID)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]


Unsupported = Annotated[None, Field(description="Not supported by this server: omit it or send null.")]
"""A field refused with a 400 (``<field> is not supported``) unless absent or null."""


def _int(lo: int, hi: int) -> Any:
    return Annotated[int, Field(strict=True, ge=lo, le=hi)]


def _float(lo: float, hi: float, lo_open: bool = False) -> Any:
    bound = {"gt": lo} if lo_open else {"ge": lo}
    return Annotated[float, Field(strict=True, allow_inf_nan=False, le=hi, **bound)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Request):
    include_usage: StrictBool = False


class ResponseFormat(_Request):
    type: Literal["text"]
    """Structured output (json_object / json_schema) is not supported: a 400, not ignored."""


class SamplingFields(_Request):
    """Fields both generation routes share (OpenAI's plus vLLM's extensions)."""

    model: Name | None = Field(default=None, examples=["SmolLM2-135M-Instruct"])
    """Omitted = the served model. (The app puts the served names in the schema's examples.)"""
    n: _int(1, MAX_N) = 1
    temperature: _float(0.0, 2.0) | None = None
    top_p: _float(0.0, 1.0, lo_open=True) | None = None
    top_k: _int(-1, MAX_TOP_K) | None = None
    min_p: _float(0.0, 1.0) | None = None
    seed: _int(-(2**63), 2**63 - 1) | None = None
    presence_penalty: _float(-2.0, 2.0) | None = None
    frequency_penalty: _float(-2.0, 2.0) | None = None
    repetition_penalty: _float(0.0, 10.0, lo_open=True) | None = None
    logit_bias: Annotated[dict[str, _float(-100.0, 100.0)], Field(max_length=MAX_LOGIT_BIAS)] | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    max_tokens: _int(1, MAX_TOKENS) | None = None
    min_tokens: _int(0, MAX_TOKENS) = 0
    ignore_eos: StrictBool = False
    skip_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    response_format: ResponseFormat | None = None
    # Structured output and custom logits processors (vLLM's names): no grammar is
    # ever compiled here, so a hostile regex or schema cannot reach the engine.
    guided_json: Unsupported = None
    guided_regex: Unsupported = None
    guided_choice: Unsupported = None
    guided_grammar: Unsupported = None
    guided_decoding_backend: Unsupported = None
    structured_outputs: Unsupported = None
    logits_processors: Unsupported = None
    prompt_logprobs: Unsupported = None
    """Prompt log-probs come with ``echo`` + ``logprobs`` on /v1/completions."""

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v is not None:
            bad = [k for k in v if not (k.isascii() and k.isdigit() and len(k) <= 10)]
            if bad:
                raise ValueError(f"keys must be token ids written as decimal strings ({len(bad)} are not)")
        return v

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def logit_bias_ids(self) -> dict[int, float] | None:
        return {int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None


# ---- /v1/completions ------------------------------------------------------------------


PromptList = Annotated[list[NonEmptyText], Field(min_length=1, max_length=MAX_PROMPTS)]
TokenIdsList = Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)]


class CompletionRequest(SamplingFields):
    model_config = ConfigDict(json_schema_extra={"examples": [
        {"model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is", "max_tokens": 8,
         "temperature": 0}]})

    prompt: NonEmptyText | PromptList | TokenIds | TokenIdsList = Field(examples=["Hello, my name is"])
    echo: StrictBool = False
    logprobs: _int(0, MAX_LOGPROBS) | None = None
    suffix: Text | None = None
    best_of: _int(1, 1) | None = None
    """Legacy; only 1 (the default) is accepted, never a fan-out multiplier."""
    max_tokens: _int(0, MAX_TOKENS) | None = 16
    """OpenAI's default is 16. 0 is allowed with ``echo`` (score the prompt only)."""

    @model_validator(mode="after")
    def _checks(self):
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens may be 0 only with echo")
        return self


class CompletionLogprobs(_Response):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class PromptTokensDetails(_Response):
    cached_tokens: int = 0


class Usage(_Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


# ---- /v1/chat/completions -------------------------------------------------------------


class TextPart(_Request):
    type: Literal["text"]
    text: Text


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | Annotated[list[TextPart], Field(max_length=MAX_CONTENT_PARTS)] | None = None
    name: Name | None = None

    @model_validator(mode="after")
    def _content_required(self):
        # Only an assistant turn may be empty (e.g. a prefilled reply placeholder).
        if self.content is None and self.role != "assistant":
            raise ValueError(f"content is required for a {self.role} message")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p.text for p in self.content)


class TemplateKwargs(_Request):
    """The only template switches a client may set (CVE-2025-62426: client dicts are
    never splatted into the renderer); anything else is a 400."""

    model_config = ConfigDict(extra="forbid")
    enable_thinking: StrictBool | None = None


class ChatCompletionRequest(SamplingFields):
    model_config = ConfigDict(json_schema_extra={"examples": [
        {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Say hi."}],
         "max_tokens": 8, "temperature": 0}]})

    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: _int(1, MAX_TOKENS) | None = None
    logprobs: StrictBool = False
    top_logprobs: _int(0, MAX_LOGPROBS) | None = None
    tools: Annotated[list[dict[str, Any]], Field(max_length=0)] | None = None
    """Tool calling is not supported; an empty list (some clients send one) is fine."""
    tool_choice: Literal["none"] | None = None
    functions: Unsupported = None
    function_call: Unsupported = None
    chat_template: Unsupported = None
    """The model's own template is always used: a client template would be code."""
    chat_template_kwargs: TemplateKwargs | None = None
    add_generation_prompt: StrictBool = True

    @model_validator(mode="after")
    def _checks(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(_Response):
    content: list[TokenLogprob] | None = None


class ChatMessageOut(_Response):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(_Response):
    index: int
    message: ChatMessageOut
    logprobs: ChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaMessage(_Response):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(_Response):
    index: int
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


# ---- models, tokenizer, errors ------------------------------------------------------------


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "trellm"
    max_model_len: int | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(_Request):
    model_config = ConfigDict(json_schema_extra={"oneOf": [  # exactly one input (see _one_input)
        {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
        {"required": ["messages"], "properties": {"messages": {"type": "array"}}}]})

    model: Name | None = None
    prompt: Text | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)] | None = None
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(_Request):
    model: Name | None = None
    tokens: Annotated[list[TokenId], Field(max_length=1 << 20)]


class DetokenizeResponse(_Response):
    prompt: str


class TokenizerInfo(_Response):
    tokenizer_class: str = "trellm.Tokenizer"
    vocab_size: int
    model_max_length: int
    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    unk_token: str | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    add_bos_token: bool = False
    chat_template: str | None = None


class ErrorInfo(_Response):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Response):
    error: ErrorInfo


class HealthResponse(_Response):
    status: Literal["ok"] = "ok"
