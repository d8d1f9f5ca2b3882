#!/usr/bin/env python3
"""Where a decode step's time goes on the GPU: host time per phase (schedule, execute,
update) and the device kernels of a few steps (torch.profiler), for a dummy model.

    python3 scripts/gpu_profile_step.py .gpu/qwen3-0.6b.json --out $OUT
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import torch.profiler as tp

from trellm import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("configs", nargs="+")
    ap.add_argument("--out", default=".")
    a = ap.parse_args()
    for cfg in a.configs:
        llm = LLM(f"dummy:{cfg}", dtype="bfloat16", device="cuda", max_model_len=4096,
                  kv_cache_memory=4 << 30, quantization="none", max_num_seqs=32)
        e = llm.engine
        e.add_request("a", None, SamplingParams(temperature=0, max_tokens=3000, ignore_eos=True),
                      prompt_token_ids=list(range(100, 228)))
        for _ in range(20):
            e.step()
        phases = {"schedule": 0.0, "execute": 0.0, "update": 0.0}
        n = 200
        torch.cuda.synchronize()
        t_all = time.perf_counter()
        for _ in range(n):
            t0 = time.perf_counter()
            plan = e.scheduler.schedule()
            t1 = time.perf_counter()
            res = e.worker.runner.execute(plan)
            t2 = time.perf_counter()
            e._update(plan, res)
            t3 = time.perf_counter()
            phases["schedule"] += t1 - t0
            phases["execute"] += t2 - t1
            phases["update"] += t3 - t2
        step_ms = (time.perf_counter() - t_all) / n * 1e3
        print(cfg, "step ms %.3f" % step_ms, {k: round(v / n * 1e3, 3) for k, v in phases.items()})
        with tp.profile(activities=[tp.ProfilerActivity.CPU, tp.ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                e.step()
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=60))
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
        name = cfg.split("/")[-1].replace(".json", "")
        prof.export_chrome_trace(f"{a.out}/trace-{name}.json")
        json.dump({"step_ms": step_ms, "phases_ms": {k: v / n * 1e3 for k, v in phases.items()}},
                  open(f"{a.out}/phases-{name}.json", "w"))
        e.abort_request("a")
        while e.has_unfinished_requests():
            e.step()
        del llm, e
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
