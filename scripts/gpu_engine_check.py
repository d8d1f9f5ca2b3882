#!/usr/bin/env python3
"""On a CUDA machine: random-weight model of a given shape through trellm and
through transformers on the same weights; greedy tokens and log-probs compared by
teacher forcing our continuation through transformers. Prints a table, writes JSON.

    python scripts/gpu_engine_check.py CONFIG.json --out result.json [--dtypes bfloat16,float32]
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from trellm import LLM, SamplingParams
from trellm.bench.hf_peer import load_transformers_peer

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def compare(llm: LLM, hf, prompts: list[list[int]], gen: int, tie: float) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    agree = total = ties = bad = 0
    max_lp_err = 0.0
    worst_gap = 0.0
    for p, o in zip(prompts, outs):
        c = o.outputs[0]
        ids = torch.tensor([p + c.token_ids], device=DEVICE)
        with torch.inference_mode():
            lps = torch.log_softmax(hf(ids).logits[0].float(), dim=-1)
        for i, tok in enumerate(c.token_ids):
            row = lps[len(p) - 1 + i]
            total += 1
            max_lp_err = max(max_lp_err, abs(c.logprobs[i].logprob - float(row[tok])))
            if int(row.argmax()) == tok:
                agree += 1
                continue
            gap = float(row.max() - row[tok])
            worst_gap = max(worst_gap, gap)
            ties += gap < tie
            bad += gap >= tie
    return {"positions": total, "agree": agree, "near_ties": ties, "divergent": bad,
            "worst_gap": worst_gap, "max_logprob_err": max_lp_err, "tie_threshold": tie}


def decode_speed(llm: LLM, vocab: int, prompt_len: int = 128, gen: int = 128) -> dict:
    g = torch.Generator().manual_seed(1)
    p = torch.randint(0, vocab, (prompt_len,), generator=g).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=True)
    llm.generate({"prompt_token_ids": p[:16]}, params.with_(max_tokens=8))
    eng = llm.engine
    eng.add_request("speed", None, params, prompt_token_ids=p)
    t0 = time.perf_counter()
    first = None
    n = 0
    while eng.has_unfinished_requests():
        for out in eng.step():
            n = len(out.outputs[0].token_ids)
            if n and first is None:
                sync()
                first = time.perf_counter() - t0
    sync()
    wall = time.perf_counter() - t0
    return {"ttft_ms": first * 1e3, "decode_tok_s": (n - 1) / (wall - first)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("--out", required=True)
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--gen", type=int, default=32)
    args = ap.parse_args()
    cfg = json.load(open(args.config))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg["vocab_size"], (n,), generator=g).tolist() for n in (7, 16, 33, 64)]
    results = {"config": args.config, "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
               "torch": torch.__version__}
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        llm = LLM(f"dummy:{args.config}", dtype=name, device=DEVICE, max_model_len=4096,
                  gpu_memory_utilization=0.45, quantization="none")
        hf = load_transformers_peer(f"dummy:{args.config}", dtype, DEVICE)
        tie = 1e-3 if dtype == torch.float32 else 0.1  # bf16 logits carry ~1e-2 rounding
        r = compare(llm, hf, prompts, args.gen, tie)
        r.update(decode_speed(llm, cfg["vocab_size"]))
        r["kv_capacity_tokens"] = llm.engine.worker.kv_capacity_tokens
        results[name] = r
        del llm, hf
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    json.dump(results, open(args.out, "w"), indent=2)
    print("| dtype | positions | agree | near-ties | divergent | worst gap | max |dlogprob| | TTFT ms | decode tok/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.dtypes.split(","):
        r = results[name]
        print(f"| {name} | {r['positions']} | {r['agree']} | {r['near_ties']} | {r['divergent']} | "
              f"{r['worst_gap']:.3g} | {r['max_logprob_err']:.3g} | {r['ttft_ms']:.1f} | {r['decode_tok_s']:.1f} |")


if __name__ == "__main__":
    main()
