"""Scheduler: token budget, chunking, FCFS, prefix caching, preemption, stops,
n>1 siblings, aborts. No model: ``FakeRunner`` plays the runner."""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable

import pytest

from trellm.config import SchedulerConfig
from trellm.engine.kv_manager import KVCacheManager
from trellm.engine.request import Request, RequestStatus
from trellm.engine.scheduler import Scheduler
from trellm.engine.types import EngineCoreOutput, StepPlan, StepResult, TokenLogprobs
from trellm.sampling_params import SamplingParams

BS = 16
TOKEN = 7  # what the fake runner samples unless told otherwise
EOS = 2


@dataclass
class RunnerState:
    tokens: list[int]
    num_prompt: int
    blocks: list[int]
    num_computed: int


@dataclass
class FakeRunner:
    """Mirrors the real runner's bookkeeping and checks every plan against the
    scheduler's view; samples ``sample(request_id, num_outputs)`` for each request
    whose scheduled tokens reach the end of its known tokens."""

    sched: Scheduler
    sample: Callable[[str, int], int] = lambda rid, n: TOKEN
    states: dict[str, RunnerState] = field(default_factory=dict)
    plans: list[StepPlan] = field(default_factory=list)

    def execute(self, plan: StepPlan) -> StepResult:
        self.plans.append(plan)
        for rid in plan.finished_request_ids:
            self.states.pop(rid, None)
        for new in plan.new_requests:
            assert new.request_id not in self.states, f"{new.request_id} re-sent while still held"
            req = self.sched.requests[new.request_id]
            assert list(new.output_token_ids) == req.output_token_ids
            self.states[new.request_id] = RunnerState(
                list(new.prompt_token_ids) + list(new.output_token_ids), len(new.prompt_token_ids),
                list(new.block_ids), new.num_computed_tokens)
        for cached in plan.cached_requests:
            st = self.states[cached.request_id]
            st.blocks.extend(cached.new_block_ids)
            assert st.num_computed == cached.num_computed_tokens
        assert plan.total_num_scheduled_tokens == sum(plan.num_scheduled_tokens.values())
        sampled: dict[str, tuple[int, ...]] = {}
        prompt_lps: dict[str, tuple[TokenLogprobs | None, ...]] = {}
        for rid, n in plan.num_scheduled_tokens.items():
            st = self.states[rid]
            assert n > 0
            assert st.blocks == self.sched.kv.get_block_ids(rid), f"{rid}: block tables diverged"
            end = st.num_computed + n
            assert end <= len(st.tokens) and len(st.blocks) * BS >= end
            req = self.sched.requests[rid]
            if req.sampling_params.prompt_logprobs is not None and st.num_computed < st.num_prompt:
                prompt_lps[rid] = self._prompt_logprobs(st, end)
            st.num_computed = end
            if end == len(st.tokens):
                tok = self.sample(rid, len(st.tokens) - st.num_prompt)
                st.tokens.append(tok)
                sampled[rid] = (tok,)
        return StepResult(sampled_token_ids=sampled, prompt_logprobs=prompt_lps)

    @staticmethod
    def _prompt_logprobs(st: RunnerState, end: int) -> tuple[TokenLogprobs | None, ...]:
        """One entry per prompt position (None for the first), like the real runner."""
        first = st.num_computed
        entries: list[TokenLogprobs | None] = [None] if first == 0 else []
        # Position i's logits predict prompt token i+1: a chunk [first, end) covers
        # prompt positions first+1 .. end (the first token itself has no prediction).
        for pos in range(first + 1, min(end + 1, st.num_prompt)):
            entries.append(TokenLogprobs(st.tokens[pos], -float(pos), 1))
        return tuple(entries)


def make(num_blocks: int = 64, caching: bool = True, max_model_len: int = 4096, **cfg) -> tuple[Scheduler, FakeRunner]:
    kv = KVCacheManager(num_blocks, BS, enable_caching=caching, hash_salt=b"test")
    sched = Scheduler(SchedulerConfig(**cfg), kv, BS, max_model_len)
    return sched, FakeRunner(sched)


def req(rid: str, prompt: int | list[int], group_id: str | None = None, max_model_len: int = 4096,
        **params) -> Request:
    ids = list(range(1000, 1000 + prompt)) if isinstance(prompt, int) else list(prompt)
    params.setdefault("max_tokens", 4)
    return Request(rid, ids, SamplingParams(**params), eos_token_ids=frozenset({EOS}),
                   max_model_len=max_model_len, group_id=group_id)


def step(sched: Scheduler, runner: FakeRunner) -> tuple[StepPlan, list[EngineCoreOutput]]:
    plan = sched.schedule()
    sched.kv.check_invariants()
    outs = sched.update(plan, runner.execute(plan))
    sched.kv.check_invariants()
    return plan, outs


def run_all(sched: Scheduler, runner: FakeRunner, max_steps: int = 10_000) -> dict[str, list[EngineCoreOutput]]:
    """Step until done; returns each request's outputs. Checks nothing leaks."""
    outs: dict[str, list[EngineCoreOutput]] = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            break
        _, step_outs = step(sched, runner)
        for o in step_outs:
            outs.setdefault(o.request_id, []).append(o)
    assert not sched.has_unfinished_requests(), "did not finish"
    assert sched.kv.num_free_blocks == sched.kv.num_blocks, "leaked blocks"
    return outs


def tokens_of(outs: list[EngineCoreOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


# ---- basics ---------------------------------------------------------------------------

def test_single_request_prefill_then_decode():
    sched, runner = make()
    sched.add_request(req("a", 10, max_tokens=5))
    plan, outs = step(sched, runner)
    assert [n.request_id for n in plan.new_requests] == ["a"] and plan.num_scheduled_tokens == {"a": 10}
    assert outs[0].new_token_ids == (TOKEN,) and outs[0].finish_reason is None
    for i in range(4):
        plan, outs = step(sched, runner)
        assert plan.num_scheduled_tokens == {"a": 1} and not plan.new_requests
        assert [c.request_id for c in plan.cached_requests] == ["a"]
    assert outs[0].finish_reason == "length"
    assert not sched.has_unfinished_requests() and sched.kv.num_free_blocks == 64
    plan, _ = step(sched, runner)
    assert plan.is_empty and plan.finished_request_ids == {"a"}


def test_budget_splits_long_prompt_into_chunks():
    sched, runner = make(max_num_batched_tokens=16)
    sched.add_request(req("a", 40, max_tokens=2))
    sizes = []
    outs_all = []
    while sched.has_unfinished_requests():
        plan, outs = step(sched, runner)
        sizes.append(plan.num_scheduled_tokens["a"])
        outs_all += outs
    assert sizes == [16, 16, 8, 1]
    assert tokens_of(outs_all) == [TOKEN, TOKEN]
    # Chunks before the end of the prompt sample nothing, so produce no output.
    assert len(outs_all) == 2


def test_long_prefill_threshold_caps_prompt_while_decode_runs():
    sched, runner = make(max_num_batched_tokens=100, long_prefill_token_threshold=8)
    sched.add_request(req("d", 4, max_tokens=10))
    step(sched, runner)  # d prefilled, now decoding
    sched.add_request(req("p", 20, max_tokens=1))
    seen = []
    for _ in range(3):
        plan, _ = step(sched, runner)
        seen.append(dict(plan.num_scheduled_tokens))
    assert seen == [{"d": 1, "p": 8}, {"d": 1, "p": 8}, {"d": 1, "p": 4}]


def test_max_num_seqs_limits_admission():
    sched, runner = make(max_num_seqs=2)
    for rid, mt in (("a", 1), ("b", 3), ("c", 1)):
        sched.add_request(req(rid, 5, max_tokens=mt))
    plan, _ = step(sched, runner)
    assert set(plan.num_scheduled_tokens) == {"a", "b"} and sched.num_waiting == 1
    plan, _ = step(sched, runner)  # a finished last step, so c takes its seat
    assert plan.num_scheduled_tokens == {"b": 1, "c": 5}
    assert plan.finished_request_ids == {"a"}
    run_all(sched, runner)


def test_fcfs_head_blocks_queue_on_budget():
    sched, runner = make(max_num_batched_tokens=16, enable_chunked_prefill=False)
    sched.add_request(req("a", 8))
    sched.add_request(req("b", 12))
    sched.add_request(req("c", 2))
    plan, _ = step(sched, runner)
    assert plan.num_scheduled_tokens == {"a": 8}  # c would fit but must not jump b
    plan, _ = step(sched, runner)
    assert plan.num_scheduled_tokens == {"a": 1, "b": 12, "c": 2}
    run_all(sched, runner)


def test_fcfs_head_blocks_queue_on_kv():
    sched, runner = make(num_blocks=4)
    sched.add_request(req("a", 30, max_tokens=3))  # 2 blocks, then a third at 33
    sched.add_request(req("b", list(range(40))))  # needs 3 blocks: does not fit next to a
    sched.add_request(req("c", list(range(50, 53))))  # fits, but FCFS
    plan, _ = step(sched, runner)
    assert plan.num_scheduled_tokens == {"a": 30}
    plan, _ = step(sched, runner)
    assert plan.num_scheduled_tokens == {"a": 1}
    assert sched.num_waiting == 2
    outs = run_all(sched, runner)
    assert len(tokens_of(outs["b"])) == 4 and len(tokens_of(outs["c"])) == 4


def test_chunked_prefill_disabled_still_admits_oversized_prompt():
    sched, runner = make(max_num_batched_tokens=16, enable_chunked_prefill=False)
    sched.add_request(req("a", 40, max_tokens=1))
    plan, _ = step(sched, runner)
    assert plan.num_scheduled_tokens == {"a": 16}
    run_all(sched, runner)


# ---- prefix caching ---------------------------------------------------------------------

def test_prefix_cache_hit_for_same_prompt():
    sched, runner = make()
    prompt = list(range(500, 540))
    sched.add_request(req("a", prompt, max_tokens=1))
    run_all(sched, runner)
    sched.add_request(req("b", prompt, max_tokens=1))
    plan, outs = step(sched, runner)
    assert plan.num_scheduled_tokens == {"b": 8}
    assert plan.new_requests[0].num_computed_tokens == 32
    assert outs[0].num_cached_tokens == 32 and outs[0].finish_reason == "length"
    assert sched.stats().prefix_cache_hits == 32


def test_fully_cached_prompt_still_computes_a_token():
    sched, runner = make()
    prompt = list(range(500, 532))  # exactly 2 blocks
    sched.add_request(req("a", prompt, max_tokens=2))
    run_all(sched, runner)
    sched.add_request(req("b", prompt, max_tokens=1))
    plan, outs = step(sched, runner)
    assert plan.num_scheduled_tokens == {"b": 16} and outs[0].num_cached_tokens == 16
    assert outs[0].new_token_ids == (TOKEN,)


def test_no_hit_for_different_prompt_or_disabled_cache():
    sched, runner = make()
    sched.add_request(req("a", list(range(500, 540)), max_tokens=1))
    run_all(sched, runner)
    sched.add_request(req("b", [1] + list(range(501, 540)), max_tokens=1))
    plan, _ = step(sched, runner)
    assert plan.num_scheduled_tokens == {"b": 40}
    sched, runner = make(caching=False)
    for rid in "ab":
        sched.add_request(req(rid, list(range(500, 540)), max_tokens=1))
        plan, _ = step(sched, runner)
        assert plan.num_scheduled_tokens == {rid: 40}


def test_prompt_logprobs_skips_cache_lookup():
    sched, runner = make()
    prompt = list(range(500, 540))
    sched.add_request(req("a", prompt, max_tokens=1))
    run_all(sched, runner)
    queries = sched.kv.prefix_cache_stats.queries
    sched.add_request(req("b", prompt, max_tokens=1, prompt_logprobs=1))
    plan, outs = step(sched, runner)
    assert plan.num_scheduled_tokens == {"b": 40}
    assert outs[0].num_cached_tokens == 0 and sched.kv.prefix_cache_stats.queries == queries
    assert len(outs[0].new_prompt_logprobs) == 40 and outs[0].new_prompt_logprobs[0] is None


# ---- preemption -------------------------------------------------------------------------

def test_preemption_under_tiny_pool():
    sched, runner = make(num_blocks=6, caching=False)
    expected = {f"r{i}": 12 + 3 * i for i in range(4)}
    for i, (rid, mt) in enumerate(expected.items()):
        sched.add_request(req(rid, list(range(100 * i, 100 * i + 20)), max_tokens=mt))
    outs = run_all(sched, runner)
    assert sched.num_preemptions > 0
    for rid, mt in expected.items():
        assert len(tokens_of(outs[rid])) == mt and outs[rid][-1].finish_reason == "length"
    # Every preempted request was dropped via finished_request_ids, then re-sent in
    # full with the outputs it had (FakeRunner checks the outputs match).
    resent = [n for p in runner.plans for n in p.new_requests if n.output_token_ids]
    assert resent
    for i, p in enumerate(runner.plans):
        for n in p.new_requests:
            if n.output_token_ids:
                earlier = set().union(*(q.finished_request_ids for q in runner.plans[: i + 1]))
                assert n.request_id in earlier


@pytest.mark.parametrize("num_blocks", [2, 3])
def test_preemption_picks_last_running_and_requeues_at_front(num_blocks):
    sched, runner = make(num_blocks=num_blocks, caching=False)
    sched.add_request(req("a", 16, max_tokens=16))
    sched.add_request(req("b", list(range(16)), max_tokens=16))
    sched.add_request(req("c", list(range(20, 40)), max_tokens=1))  # 2 blocks
    step(sched, runner)  # a and b: one full block each; no room left for c
    # Both need a second block at token 17. With 2 blocks, a preempts b (the last
    # running) to get one; with 3, a takes the spare and b preempts itself.
    plan, _ = step(sched, runner)
    assert plan.num_scheduled_tokens == {"a": 1}
    assert plan.finished_request_ids == {"b"} and sched.num_preemptions == 1
    assert [r.request_id for r in sched.running] == ["a"]
    assert [r.request_id for r in sched.waiting] == ["b", "c"]
    assert sched.waiting[0].status == RequestStatus.PREEMPTED
    assert sched.waiting[0].num_computed_tokens == 0 and sched.waiting[0].num_output_tokens == 1
    outs = run_all(sched, runner)
    assert len(tokens_of(outs["b"])) == 16 - 1 and len(tokens_of(outs["c"])) == 1
    resent = [n for p in runner.plans for n in p.new_requests if n.request_id == "b"]
    assert len(resent) == 2 and resent[1].output_token_ids == (TOKEN,)


def test_prompt_logprobs_not_repeated_after_preemption():
    sched, runner = make(num_blocks=4, caching=False)
    sched.add_request(req("a", 20, max_tokens=30))
    sched.add_request(req("b", 20, max_tokens=20, prompt_logprobs=0))
    outs = run_all(sched, runner)
    assert sched.num_preemptions > 0
    plps = [e for o in outs["b"] for e in o.new_prompt_logprobs]
    assert len(plps) == 20 and plps[0] is None
    assert [e.token_id for e in plps[1:]] == list(range(1001, 1020))


# ---- stops --------------------------------------------------------------------------------

def run_one(sample: Callable[[str, int], int], max_model_len: int = 4096, **params) -> EngineCoreOutput:
    sched, runner = make(max_model_len=max_model_len)
    runner.sample = sample
    sched.add_request(req("a", 5, max_model_len=0, **params))
    outs = run_all(sched, runner)["a"]
    last = outs[-1]
    return EngineCoreOutput("a", tuple(tokens_of(outs)), finish_reason=last.finish_reason,
                            stop_reason=last.stop_reason)


def test_eos_stops():
    out = run_one(lambda rid, n: EOS if n == 2 else TOKEN, max_tokens=10)
    assert out.new_token_ids == (TOKEN, TOKEN, EOS) and out.finish_reason == "stop" and out.stop_reason is None


def test_stop_token_ids():
    out = run_one(lambda rid, n: 42 if n == 1 else TOKEN, max_tokens=10, stop_token_ids=(42,))
    assert out.new_token_ids == (TOKEN, 42) and out.finish_reason == "stop" and out.stop_reason == 42


def test_min_tokens_suppresses_stop():
    out = run_one(lambda rid, n: EOS, max_tokens=10, min_tokens=3)
    assert out.new_token_ids == (EOS, EOS, EOS) and out.finish_reason == "stop"


def test_ignore_eos():
    out = run_one(lambda rid, n: EOS, max_tokens=6, ignore_eos=True)
    assert len(out.new_token_ids) == 6 and out.finish_reason == "length"


def test_max_model_len_caps_to_length():
    out = run_one(lambda rid, n: TOKEN, max_model_len=9, max_tokens=None)
    assert len(out.new_token_ids) == 4 and out.finish_reason == "length"


# ---- aborts -------------------------------------------------------------------------------

def test_abort_running_and_waiting_frees_blocks():
    sched, runner = make(num_blocks=8, max_num_seqs=1)
    sched.add_request(req("a", 40, max_tokens=50))
    sched.add_request(req("b", 10))
    step(sched, runner)
    assert sched.kv.num_free_blocks == 5
    sched.finish_requests(["a", "b", "unknown"], RequestStatus.FINISHED_ABORTED)
    sched.kv.check_invariants()
    assert sched.kv.num_free_blocks == 8 and not sched.has_unfinished_requests()
    plan, outs = step(sched, runner)
    assert plan.finished_request_ids == {"a", "b"} and plan.is_empty and outs == []


def test_abort_between_schedule_and_update():
    sched, runner = make()
    sched.add_request(req("a", 10, max_tokens=5))
    sched.add_request(req("b", 10, max_tokens=5))
    plan = sched.schedule()
    result = runner.execute(plan)
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    outs = sched.update(plan, result)
    sched.kv.check_invariants()
    assert [o.request_id for o in outs] == ["b"]
    run_all(sched, runner)


def test_stop_string_finish_after_update():
    sched, runner = make()
    sched.add_request(req("a", 10, max_tokens=5))
    step(sched, runner)
    sched.finish_requests(["a"], RequestStatus.FINISHED_STOPPED)
    assert not sched.has_request("a")
    run_all(sched, runner)


# ---- n > 1 siblings -----------------------------------------------------------------------

@pytest.mark.parametrize("caching", [True, False])
def test_siblings_share_prompt_blocks(caching):
    sched, runner = make(max_num_batched_tokens=16, caching=caching)
    prompt = list(range(300, 340))
    for i in range(2):
        sched.add_request(req(f"g#{i}", prompt, group_id="g", max_tokens=3))
    sched.add_request(req("x", 4, max_tokens=3))
    plan, _ = step(sched, runner)
    # g#1 is held back without blocking x (the budget is used up by g#0 here).
    assert plan.num_scheduled_tokens == {"g#0": 16}
    plan, _ = step(sched, runner)
    assert plan.num_scheduled_tokens == {"g#0": 16}
    plan, _ = step(sched, runner)  # g#0 finishes its prompt; g#1 still held this step
    assert plan.num_scheduled_tokens == {"g#0": 8, "x": 4}
    plan, _ = step(sched, runner)
    assert plan.num_scheduled_tokens == {"g#0": 1, "x": 1, "g#1": 8}
    g1 = next(n for n in plan.new_requests if n.request_id == "g#1")
    assert g1.num_computed_tokens == 32
    assert g1.block_ids[:2] == tuple(sched.kv.get_block_ids("g#0")[:2])
    outs = run_all(sched, runner)
    assert outs["g#1"][-1].num_cached_tokens == 32


# ---- stats ------------------------------------------------------------------------------

def test_stats():
    sched, runner = make()
    sched.add_request(req("a", 10))
    sched.add_request(req("b", 10))
    step(sched, runner)
    s = sched.stats()
    assert (s.num_running, s.num_waiting, s.num_preemptions) == (2, 0, 0)
    assert 0 < s.kv_usage <= 1 and s.prefix_cache_hit_rate == 0.0


# ---- random operations ----------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(8))
def test_random_operations(seed):
    rng = random.Random(seed)
    num_blocks = rng.choice([6, 10, 40])
    sched, runner = make(num_blocks=num_blocks, caching=rng.random() < 0.7,
                         max_num_batched_tokens=rng.choice([8, 32, 256]),
                         max_num_seqs=rng.choice([2, 4, 16]),
                         long_prefill_token_threshold=rng.choice([0, 0, 5]),
                         enable_chunked_prefill=rng.random() < 0.8,
                         max_model_len=num_blocks * BS)
    runner.sample = lambda rid, n: rng.choice([TOKEN, TOKEN, TOKEN, EOS, 11])
    prefixes = [[rng.randrange(50) for _ in range(40)] for _ in range(3)]
    expected_max: dict[str, int] = {}
    aborted: set[str] = set()
    outs: dict[str, list[EngineCoreOutput]] = {}
    next_id = 0
    for _ in range(300):
        op = rng.random()
        if op < 0.25:
            plen = rng.randint(1, 60)
            prompt = (rng.choice(prefixes) + [rng.randrange(50) for _ in range(60)])[:plen]
            n = rng.choice([1, 1, 1, 3])
            mt = rng.randint(1, 20)
            params = dict(max_tokens=mt, prompt_logprobs=rng.choice([None, None, 1]),
                          stop_token_ids=(11,) if rng.random() < 0.3 else ())
            for i in range(n):
                rid = f"r{next_id}" + (f"#{i}" if n > 1 else "")
                sched.add_request(req(rid, prompt, group_id=f"r{next_id}" if n > 1 else None,
                                      max_model_len=num_blocks * BS, **params))
                expected_max[rid] = mt
            next_id += 1
        elif op < 0.3 and sched.requests:
            rid = rng.choice(sorted(sched.requests))
            sched.finish_requests([rid], RequestStatus.FINISHED_ABORTED)
            aborted.add(rid)
            sched.kv.check_invariants()
        else:
            _, step_outs = step(sched, runner)
            for o in step_outs:
                outs.setdefault(o.request_id, []).append(o)
    for o_list in run_all(sched, runner).values():
        for o in o_list:
            outs.setdefault(o.request_id, []).append(o)
    for rid, mt in expected_max.items():
        if rid in aborted:
            continue
        toks = tokens_of(outs[rid])
        assert outs[rid][-1].finish_reason in ("stop", "length")
        assert 1 <= len(toks) <= mt
        if outs[rid][-1].finish_reason == "length":
            assert len(toks) == mt
        assert all(o.finish_reason is None for o in outs[rid][:-1])
    assert sched.kv.num_free_blocks == num_blocks
