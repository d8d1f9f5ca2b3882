#!/usr/bin/env python3
"""CPU decode A/B of two checkouts on the embedded default model: aten ops dispatched per
decode step (counted under a TorchDispatchMode), the median and 10th-percentile time of
one-stream decode forwards (ModelRunner._forward, 384 steps: steadier than tok/s on a
shared machine) and greedy tok/s at 1 and 8 streams (64 new tokens, best of 3, prefill
included). Run it once per checkout, in the same minutes:

    PYTHONPATH=/path/to/old/checkout python3 scripts/cpu_decode_ab.py
    python3 scripts/cpu_decode_ab.py            # --ops-only: the count alone
"""
from __future__ import annotations

import statistics
import sys
import time

from torch.utils._python_dispatch import TorchDispatchMode

import trellm
from trellm import LLM, SamplingParams
from trellm.worker import model_runner


class _Count(TorchDispatchMode):
    n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        _Count.n += 1
        return func(*args, **(kwargs or {}))


def main() -> None:
    print(trellm.__file__)
    llm = LLM()

    def run(n: int, toks: int):
        prompts = [{"prompt_token_ids": list(range(100 + 7 * i, 228 + 7 * i))} for i in range(n)]
        return llm.generate(prompts, SamplingParams(temperature=0, max_tokens=toks, ignore_eos=True))

    run(1, 4)
    print("aten ops per decode step:", _ops(lambda: run(1, 3)) - _ops(lambda: run(1, 2)))
    if "--ops-only" in sys.argv:
        return
    steps = _step_times(lambda: run(1, 65), 6)
    print(f"decode forward: median {statistics.median(steps) * 1e3:.2f} ms, "
          f"p10 {steps[len(steps) // 10] * 1e3:.2f} ms ({len(steps)} steps)")
    for n in (1, 8):
        run(n, 8)
        best = min(_timed(lambda: run(n, 64)) for _ in range(3))
        print(f"{n} streams: {64 * n / best:.1f} tok/s (best of 3, prefill included)")


def _ops(fn) -> int:
    """aten ops dispatched by fn() (its prompt cached: the same prefill tail every call)."""
    _Count.n = 0
    with _Count():
        fn()
    return _Count.n


def _step_times(fn, repeats: int) -> list[float]:
    """Sorted seconds of each decode forward of ``repeats`` calls of fn (prefills dropped)."""
    times, orig = [], model_runner.ModelRunner._forward

    def timed(self, plan):
        t = time.perf_counter()
        out = orig(self, plan)
        if plan.total_num_scheduled_tokens == 1:
            times.append(time.perf_counter() - t)
        return out

    model_runner.ModelRunner._forward = timed
    try:
        for _ in range(repeats):
            fn()
    finally:
        model_runner.ModelRunner._forward = orig
    return sorted(times)


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


if __name__ == "__main__":
    main()
