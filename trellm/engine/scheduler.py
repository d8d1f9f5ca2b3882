"""Token-budget scheduler (vLLM v1 design). Plain Python, no torch.

The scheduler schedules *tokens*, not phases: each step every request gets some
number of tokens so that its ``num_computed_tokens`` catches up with its
``num_tokens``. A prompt chunk, a whole prompt, a decode step and a recompute
after preemption are all the same thing.

One step:
  1. running requests first, in order; when the KV pool runs dry the last running
     request is preempted (recompute later) until the current one fits;
  2. then waiting requests in FCFS order, unless something was preempted;
  3. the plan sends requests the runner does not hold in full, others as deltas;
  4. ``num_computed_tokens`` advances at once, and a request that will sample gets an
     output placeholder, so the next ``schedule`` may run before this step's ``update``
     (async scheduling: the runner feeds the placeholder's token from the device).
``update`` then caches full blocks, turns placeholders into sampled tokens and checks
the stop conditions. Results of a step planned before a request was preempted are
dropped (the recompute produces them again).
"""
from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass
from typing import Iterable

from trellm.config import SchedulerConfig
from trellm.engine.kv_manager import KVCacheManager
from trellm.engine.request import Request, RequestStatus
from trellm.engine.types import (
    CachedRequestData,
    EngineCoreOutput,
    NewRequestData,
    StepPlan,
    StepResult,
    TokenLogprobs,
)


@dataclass(frozen=True)
class SchedulerStats:
    """A snapshot for metrics."""

    num_running: int
    num_waiting: int
    kv_usage: float
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, block_size: int, max_model_len: int):
        self.config = config
        self.kv = kv
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._finished_ids: set[str] = set()
        """Finished, aborted or preempted since the last plan: the runner drops them."""
        self._runner_known: set[str] = set()
        """Requests whose full state the runner holds (sent as NewRequestData)."""
        self._step_ids = itertools.count(1)
        self._inflight: dict[int, dict[str, tuple[int, int]]] = {}
        """Per planned step not yet updated: request -> (preemption count when planned,
        computed tokens after the step)."""
        self._plp_emitted: dict[str, int] = {}
        self._plp_seen: dict[str, int] = {}
        """Prompt-logprob entries emitted / received since the runner (re)started the
        request: a recompute after preemption replays them, and we drop the replay."""

    # ---- requests ----------------------------------------------------------------------

    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already scheduled")
        req.status = RequestStatus.WAITING
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def has_request(self, request_id: str) -> bool:
        return request_id in self.requests

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> None:
        """End requests from outside (abort, stop string). Unknown ids are ignored,
        so a request that already finished on its own is left alone."""
        assert status.finished, f"{status} is not a finished status"
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            req.status = status
            self._retire(req)

    def _retire(self, req: Request) -> None:
        """Forget a finished request and release its blocks."""
        rid = req.request_id
        self.kv.free(req)
        del self.requests[rid]
        self._finished_ids.add(rid)
        self._runner_known.discard(rid)
        self._plp_emitted.pop(rid, None)
        self._plp_seen.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def stats(self) -> SchedulerStats:
        pc = self.kv.prefix_cache_stats
        return SchedulerStats(len(self.running), len(self.waiting), self.kv.usage,
                              self.num_preemptions, pc.queries, pc.hits)

    # ---- schedule ----------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, int] = {}
        new_blocks: dict[str, list[int]] = {}
        budget, preempted = self._schedule_running(budget, scheduled, new_blocks)
        if not preempted:
            self._schedule_waiting(budget, scheduled, new_blocks)
        return self._build_plan(scheduled, new_blocks)

    def _cap(self, num_new: int, budget: int) -> int:
        """Apply the long-prefill cap and the step budget. A decode step is one token,
        so the cap only ever bites on prompt chunks and recomputes after preemption
        (vLLM applies it the same way)."""
        threshold = self.config.long_prefill_token_threshold
        if 0 < threshold < num_new:
            num_new = threshold
        return min(num_new, budget)

    def _schedule_running(self, budget: int, scheduled: dict[str, int],
                          new_blocks: dict[str, list[int]]) -> tuple[int, bool]:
        """Running requests in order; returns the budget left and whether anything
        was preempted."""
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = self._cap(req.num_tokens_with_placeholders - req.num_computed_tokens, budget)
            if num_new <= 0 or self._ends_with_placeholder(req):
                i += 1
                continue
            blocks = self.kv.allocate_slots(req, num_new)
            while blocks is None:
                # Requests before i are already scheduled this step, so the last
                # one is never among them: at worst it is req itself.
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
                blocks = self.kv.allocate_slots(req, num_new)
            if blocks is None:
                break
            scheduled[req.request_id] = num_new
            new_blocks[req.request_id] = blocks
            budget -= num_new
            i += 1
        return budget, preempted

    def _ends_with_placeholder(self, req: Request) -> bool:
        """The token in flight surely ends the request (max_tokens or context length):
        computing past it would be wasted."""
        if not req.num_output_placeholders:
            return False
        sp, max_len = req.sampling_params, req.max_model_len or self.max_model_len
        n_out = req.num_output_tokens + req.num_output_placeholders
        return (sp.max_tokens is not None and n_out >= sp.max_tokens) or (
            0 < max_len <= req.num_tokens_with_placeholders)

    def _preempt(self, req: Request) -> None:
        """Recompute-style preemption: drop its KV, resend it to the runner later."""
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_output_placeholders = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        self._finished_ids.add(req.request_id)
        self._runner_known.discard(req.request_id)

    def _schedule_waiting(self, budget: int, scheduled: dict[str, int],
                          new_blocks: dict[str, list[int]]) -> None:
        """Admit waiting requests FCFS while budget and seats last. The queue never
        skips ahead except for siblings held back by the n>1 rule."""
        blocked_groups = {r.group_id for r in self.running
                          if r.group_id is not None and r.num_computed_tokens < r.num_prompt_tokens}
        skipped: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if req.group_id in blocked_groups:
                # Wait until the sibling admitted first has cached the prompt.
                skipped.append(self.waiting.popleft())
                continue
            admitted = self._try_admit(req, budget)
            if admitted is None:
                break
            num_new, blocks = admitted
            self.waiting.popleft()
            self.running.append(req)
            scheduled[req.request_id] = num_new
            new_blocks[req.request_id] = blocks
            budget -= num_new
            if req.group_id is not None:
                blocked_groups.add(req.group_id)
        self.waiting.extendleft(reversed(skipped))

    def _try_admit(self, req: Request, budget: int) -> tuple[int, list[int]] | None:
        """Look up the prefix cache and allocate; on success the request is RUNNING
        and the (tokens scheduled, blocks appended) pair is returned."""
        if req.sampling_params.prompt_logprobs is not None:
            # Every prompt position needs its logits: nothing may come from the cache.
            hit_blocks, num_cached = [], 0
        else:
            hit_blocks, num_cached = self.kv.get_computed_blocks(req, allow_lookup=req.group_id is not None)
        num_new = req.num_tokens - num_cached
        if not self.config.enable_chunked_prefill:
            # No chunking wanted, so the long-prefill cap (a chunking rule) is ignored.
            if num_new > budget and budget < self.config.max_num_batched_tokens:
                return None
            # A request larger than a whole step's budget could otherwise never be
            # admitted: let it chunk rather than hang the queue.
            num_new = min(num_new, budget)
        else:
            num_new = self._cap(num_new, budget)
        blocks = self.kv.allocate_slots(req, num_new, hit_blocks)
        if blocks is None:
            return None
        req.num_computed_tokens = num_cached
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = num_cached
        req.status = RequestStatus.RUNNING
        return num_new, blocks

    def _build_plan(self, scheduled: dict[str, int], new_blocks: dict[str, list[int]]) -> StepPlan:
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        for rid in scheduled:
            req = self.requests[rid]
            if rid in self._runner_known:
                cached_reqs.append(CachedRequestData(rid, tuple(new_blocks[rid]), req.num_computed_tokens))
                continue
            self._runner_known.add(rid)
            self._plp_seen[rid] = 0
            new_reqs.append(NewRequestData(
                request_id=rid,
                prompt_token_ids=tuple(req.prompt_token_ids),
                output_token_ids=tuple(req.output_token_ids),
                sampling_params=req.sampling_params,
                block_ids=tuple(self.kv.get_block_ids(rid)),
                num_computed_tokens=req.num_computed_tokens,
            ))
        finished, self._finished_ids = frozenset(self._finished_ids), set()
        step_id = next(self._step_ids)
        self._inflight[step_id] = self._advance(scheduled)
        return StepPlan(
            step_id=step_id,
            new_requests=tuple(new_reqs),
            cached_requests=tuple(cached_reqs),
            num_scheduled_tokens=scheduled,
            total_num_scheduled_tokens=sum(scheduled.values()),
            finished_request_ids=finished,
        )

    def _advance(self, scheduled: dict[str, int]) -> dict[str, tuple[int, int]]:
        """Count the scheduled tokens as computed and give each request that reaches
        the end of its tokens a placeholder for the token it will sample."""
        snapshot: dict[str, tuple[int, int]] = {}
        for rid, n in scheduled.items():
            req = self.requests[rid]
            req.num_computed_tokens += n
            if req.num_computed_tokens == req.num_tokens_with_placeholders:
                req.num_output_placeholders += 1
            snapshot[rid] = (req.num_preemptions, req.num_computed_tokens)
        return snapshot

    # ---- update ------------------------------------------------------------------------

    def update(self, plan: StepPlan, result: StepResult) -> list[EngineCoreOutput]:
        """Apply a step's result; returns one output per request that produced
        tokens or logprobs, or finished."""
        outputs: list[EngineCoreOutput] = []
        finished: list[Request] = []
        snapshot = self._inflight.pop(plan.step_id, {})
        for rid in plan.num_scheduled_tokens:
            req = self.requests.get(rid)
            if req is None or req.status != RequestStatus.RUNNING or rid not in snapshot:
                continue  # aborted or stopped from outside while the step ran
            preemptions, computed = snapshot[rid]
            if req.num_preemptions != preemptions:
                continue  # planned before a preemption: the recompute redoes it
            sampled = result.sampled_token_ids.get(rid, ())
            req.num_output_placeholders = max(0, req.num_output_placeholders - len(sampled))
            self.kv.cache_full_blocks(req, min(computed, req.num_tokens))
            new_tokens = self._append_tokens(req, sampled)
            logprobs = tuple(result.logprobs.get(rid, ()))[: len(new_tokens)]
            prompt_lps = self._new_prompt_logprobs(rid, result.prompt_logprobs.get(rid, ()))
            if req.is_finished:
                finished.append(req)
            if new_tokens or logprobs or prompt_lps or req.is_finished:
                outputs.append(EngineCoreOutput(
                    request_id=rid,
                    new_token_ids=tuple(new_tokens),
                    new_logprobs=logprobs,
                    new_prompt_logprobs=prompt_lps,
                    finish_reason=req.status.finish_reason,
                    stop_reason=req.stop_reason,
                    num_cached_tokens=max(req.num_cached_tokens, 0),
                ))
        if finished:
            done = {id(r) for r in finished}
            self.running = [r for r in self.running if id(r) not in done]
            for req in finished:
                self._retire(req)
        return outputs

    def _append_tokens(self, req: Request, sampled: Iterable[int]) -> list[int]:
        """Append sampled tokens until one ends the request; later ones are dropped."""
        appended: list[int] = []
        for tok in sampled:
            req.append_output_token(tok)
            appended.append(tok)
            if self._check_stop(req, tok):
                break
        return appended

    def _check_stop(self, req: Request, tok: int) -> bool:
        """Set a finished status if ``tok`` (just appended) ends the request."""
        sp = req.sampling_params
        if req.num_output_tokens >= sp.min_tokens:
            if tok in req.eos_token_ids and not sp.ignore_eos:
                req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, None
                return True
            if tok in sp.stop_token_ids:
                req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, tok
                return True
        max_len = req.max_model_len or self.max_model_len
        if (sp.max_tokens is not None and req.num_output_tokens >= sp.max_tokens) or (
                0 < max_len <= req.num_tokens):
            req.status = RequestStatus.FINISHED_LENGTH
            return True
        return False

    def _new_prompt_logprobs(self, rid: str, entries: Iterable[TokenLogprobs | None]
                             ) -> tuple[TokenLogprobs | None, ...]:
        """Pass on prompt-logprob entries not emitted before (see ``_plp_seen``)."""
        kept: list[TokenLogprobs | None] = []
        emitted = self._plp_emitted.get(rid, 0)
        seen = self._plp_seen.get(rid, 0)
        for entry in entries:
            if seen >= emitted:
                kept.append(entry)
                emitted += 1
            seen += 1
        if kept or seen:
            self._plp_emitted[rid] = emitted
            self._plp_seen[rid] = seen
        return tuple(kept)
