"""Offline API in vLLM's shape: ``LLM(model=...)``, ``generate``, ``chat``."""
from __future__ import annotations

import itertools
from typing import Any, Sequence

from tqdm.auto import tqdm

from trellm.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from trellm.engine.engine import Engine
from trellm.engine.types import RequestOutput
from trellm.sampling_params import SamplingParams

PromptType = str | dict[str, Any]


def engine_config_from_kwargs(model: str = "", **kw: Any) -> EngineConfig:
    """Build an EngineConfig from flat vLLM-style keyword arguments."""
    groups = {ModelConfig: {}, CacheConfig: {}, SchedulerConfig: {}}
    for key, value in kw.items():
        for cls, bucket in groups.items():
            if key in cls.__dataclass_fields__:
                bucket[key] = value
                break
        else:
            raise TypeError(f"unknown engine argument {key!r}")
    return EngineConfig(model=ModelConfig(model=model, **groups[ModelConfig]),
                        cache=CacheConfig(**groups[CacheConfig]),
                        scheduler=SchedulerConfig(**groups[SchedulerConfig]))


class LLM:
    def __init__(self, model: str = "", **kwargs: Any):
        self.engine = Engine(engine_config_from_kwargs(model, **kwargs))
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Run prompts (strings or {"prompt_token_ids": [...]}) to completion, in input order."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError("sampling_params must be one value or one per prompt")
        ids: list[str] = []
        try:
            for prompt, p in zip(prompts, params_list):
                rid = str(next(self._ids))
                text, token_ids = _split_prompt(prompt)
                self.engine.add_request(rid, text, p, prompt_token_ids=token_ids)
                ids.append(rid)
        except Exception:
            # One bad prompt rejects the call: leave nothing of it queued in the engine.
            self.engine.abort_request(ids)
            while self.engine.has_unfinished_requests():
                self.engine.step()
            raise
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = False, add_generation_prompt: bool = True,
             literal_content: bool = True) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate.

        ``literal_content``: special-token text inside messages (``<|im_end|>``) is
        tokenized as ordinary text, so message content cannot forge turns; False
        parses it into control tokens as a plain template-then-tokenize would.
        """
        tok = self.engine.tokenizer
        if tok is None:
            raise ValueError("this model has no tokenizer and so no chat template")
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [{"prompt_token_ids": tok.encode_chat(c, add_generation_prompt=add_generation_prompt,
                                                        literal_content=literal_content)}
                   for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generating", disable=not use_tqdm)
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    final[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [final[i] for i in ids]


def _split_prompt(prompt: PromptType) -> tuple[str | None, list[int] | None]:
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return prompt["prompt"], None
    raise ValueError("a prompt must be a string or a dict with 'prompt' or 'prompt_token_ids'")
