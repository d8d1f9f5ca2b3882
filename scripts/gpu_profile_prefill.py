#!/usr/bin/env python3
"""Where a long prefill's time goes on the GPU: one warm prefill of N tokens of a dummy
model (any --quantization), torch.profiler's kernel and host tables, and the wall time.

    python3 scripts/gpu_profile_prefill.py .gpu/llama-3.1-8b.json --quantization exl3 --bits 4 --tokens 8192 --out $OUT
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import torch.profiler as tp

from trellm import LLM, SamplingParams


def prefill(llm: LLM, vocab: int, n: int, seed: int) -> float:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (n,), generator=g).tolist()
    torch.cuda.synchronize()
    t = time.perf_counter()
    llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    torch.cuda.synchronize()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("--quantization", default="none")
    ap.add_argument("--bits", type=float, default=4.0)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--out", default=".")
    a = ap.parse_args()
    kw = {"bits": a.bits} if a.quantization == "exl3" else {}
    llm = LLM(f"dummy:{a.config}", dtype="bfloat16", device="cuda", max_model_len=a.tokens + 64,
              kv_cache_memory=8 << 30, quantization=a.quantization, enable_prefix_caching=False,
              max_num_batched_tokens=a.tokens, **kw)
    vocab = json.load(open(a.config))["vocab_size"]
    walls = [prefill(llm, vocab, a.tokens, s) for s in range(3)]
    print("prefill walls s", [round(w, 3) for w in walls], "tok/s %.0f" % (a.tokens / min(walls)), flush=True)
    with tp.profile(activities=[tp.ProfilerActivity.CPU, tp.ProfilerActivity.CUDA]) as prof:
        prefill(llm, vocab, a.tokens, 9)
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=20, max_name_column_width=70))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=70))
    json.dump({"walls_s": walls, "tok_s": a.tokens / min(walls), "argv": vars(a)},
              open(f"{a.out}/prefill-profile-{a.quantization}.json", "w"))


if __name__ == "__main__":
    main()
