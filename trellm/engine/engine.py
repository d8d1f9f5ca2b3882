"""The engine: ``step()`` is schedule -> execute -> update; everything else is a helper."""
from __future__ import annotations

import logging
import operator
from typing import Sequence

from trellm.config import EngineConfig
from trellm.engine.kv_manager import KVCacheManager
from trellm.engine.output_processor import OutputProcessor
from trellm.engine.request import Request, RequestStatus
from trellm.engine.scheduler import Scheduler
from trellm.engine.types import EngineCoreOutput, RequestOutput, StepPlan, StepResult
from trellm.sampling_params import SamplingParams

log = logging.getLogger("trellm")


class Engine:
    def __init__(self, config: EngineConfig):
        from trellm.worker.builder import build_worker  # torch stays out of engine/ imports

        config.validate()
        self.config = config
        self.worker = build_worker(config)
        self.tokenizer = self.worker.checkpoint.tokenizer
        self.max_model_len = self.worker.max_model_len
        self.vocab_size = self.worker.arch.vocab_size
        self.eos_token_ids = self.worker.runner.eos_token_ids
        salt = f"{config.model.model}|{self.worker.dtype}".encode()
        self.kv = KVCacheManager(self.worker.num_blocks, self.worker.block_size,
                                 config.cache.enable_prefix_caching, hash_salt=salt)
        self.scheduler = Scheduler(config.scheduler, self.kv, self.worker.block_size, self.max_model_len)
        self.output_processor = OutputProcessor(self.tokenizer or _NoText())
        self._aborted: list[EngineCoreOutput] = []
        self._children: dict[str, list[str]] = {}
        asy = config.scheduler.async_scheduling
        self.async_scheduling = self.worker.device.type == "cuda" if asy is None else asy
        self._inflight: tuple[StepPlan, object] | None = None
        """Async scheduling: the step launched last, whose result is not applied yet."""

    # ---- the loop ------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule()
        if not self.async_scheduling:
            return self._update(plan, self.worker.runner.execute(plan))
        return self._step_async(plan)

    def _step_async(self, plan: StepPlan) -> list[RequestOutput]:
        """Launch step n, then apply step n-1's result while the device runs step n.
        A plan the device cannot sample alone (log-probs, penalties) waits for the
        step in flight and runs synchronously."""
        runner = self.worker.runner
        if not runner.can_launch(plan):
            outputs = self._resolve_inflight()
            return outputs + self._update(plan, runner.execute(plan))
        launched = runner.launch(plan)
        outputs = self._resolve_inflight()
        self._inflight = (plan, launched)
        return outputs

    def _resolve_inflight(self) -> list[RequestOutput]:
        if self._inflight is None:
            return []
        plan, launched = self._inflight
        self._inflight = None
        return self._update(plan, self.worker.runner.resolve(launched))

    def _update(self, plan: StepPlan, result: StepResult) -> list[RequestOutput]:
        core_outputs = self._aborted + self.scheduler.update(plan, result)
        self._aborted = []
        outputs, to_stop = self.output_processor.process(core_outputs)
        if to_stop:
            self.scheduler.finish_requests(to_stop, RequestStatus.FINISHED_STOPPED)
        for out in outputs:
            if out.finished:
                self._children.pop(out.request_id, None)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._aborted) or self._inflight is not None

    # ---- requests ------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | None, params: SamplingParams,
                    prompt_token_ids: Sequence[int] | None = None) -> None:
        """Validate and queue a request; raises ValueError with a user-facing message."""
        if request_id in self._children or self.output_processor.has_request(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = self._prompt_ids(prompt, prompt_token_ids)
        params.validate_vocab(self.vocab_size)
        if params.max_tokens is not None and len(ids) + params.max_tokens > self.max_model_len:
            # Like vLLM: ask for a shorter output rather than silently truncating.
            raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                             f"context length {self.max_model_len}")
        n = params.n
        child_ids = [request_id] if n == 1 else [f"{request_id}#{i}" for i in range(n)]
        self.output_processor.add_request(request_id, prompt, list(ids), params,
                                          child_ids=child_ids if n > 1 else None)
        self._children[request_id] = child_ids
        for i, cid in enumerate(child_ids):
            # Only the first sibling computes prompt log-probs: they are the same for all,
            # and without them the others can reuse its prompt blocks.
            child_params = params if n == 1 else params.with_(
                n=1, seed=None if params.seed is None else params.seed + i,
                prompt_logprobs=params.prompt_logprobs if i == 0 else None)
            self.scheduler.add_request(Request(
                request_id=cid, prompt_token_ids=list(ids), sampling_params=child_params,
                eos_token_ids=self.eos_token_ids, max_model_len=self.max_model_len,
                group_id=request_id if n > 1 else None))

    def _prompt_ids(self, prompt: str | None, prompt_token_ids: Sequence[int] | None) -> list[int]:
        if prompt_token_ids is None:
            if prompt is None:
                raise ValueError("a prompt (text or token ids) is required")
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompt_token_ids")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = []
            for t in prompt_token_ids:
                try:  # numpy and torch integers are fine; floats and bools are not
                    tid = operator.index(t) if not isinstance(t, bool) else None
                except TypeError:
                    tid = None
                if tid is None or not 0 <= tid < self.vocab_size:
                    raise ValueError(f"prompt token id {t!r} is not a token of the vocabulary "
                                     f"(integers 0..{self.vocab_size - 1})")
                ids.append(tid)
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"the prompt is {len(ids)} tokens, longer than the context length "
                             f"{self.max_model_len} allows (it must leave room for one generated token)")
        return ids

    def abort_request(self, request_ids: str | Sequence[str]) -> None:
        """Abort requests; their final RequestOutput (finish_reason 'abort') comes with the next step."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for rid in request_ids:
            children = self._children.get(rid)
            if not children:
                continue
            live = [c for c in children if self.scheduler.has_request(c)]
            self.scheduler.finish_requests(live, RequestStatus.FINISHED_ABORTED)
            self._aborted.extend(EngineCoreOutput(request_id=c, new_token_ids=(), finish_reason="abort")
                                 for c in live)

    def check_invariants(self) -> None:
        self.kv.check_invariants()


class _NoText:
    """Detokenizer for a model without a tokenizer (random-weight benchmarks): token ids only."""

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return ""
