#!/usr/bin/env python3
"""Where a steady decode step's time goes: host phases (schedule, prepare the batch,
launch the graph, sample + wait, update), the GPU-only time of the captured graph
replayed back to back, and cuBLAS GEMV/GEMM bandwidth at the model's linear shapes.

    python3 scripts/gpu_overhead.py .gpu/llama-3.1-8b.json:1,32 .gpu/qwen3-0.6b.json:1 --out $OUT

The difference between the step's wall time and the graph's GPU time is host time the
GPU spends idle: what overlapping step n+1's preparation with step n would win.
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from trellm import LLM, SamplingParams


PROFILE = False


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def phases(llm: LLM, batch: int, steps: int) -> dict:
    """Steady decode of ``batch`` streams: wall per step and host time per phase."""
    from trellm.worker.input_batch import build_batch

    e, r = llm.engine, llm.engine.worker.runner
    params = SamplingParams(temperature=0, max_tokens=3000, ignore_eos=True)
    for i in range(batch):
        e.add_request(f"s{i}", None, params, prompt_token_ids=[(100 + i + j) % 400 for j in range(128)])
    for _ in range(20):
        e.step()
    acc = dict.fromkeys(("schedule", "prepare", "launch", "sample_wait", "update"), 0.0)
    sync()
    t_all = time.perf_counter()
    for _ in range(steps):
        t0 = time.perf_counter()
        plan = e.scheduler.schedule()
        t1 = time.perf_counter()
        r._update_states(plan)
        b = build_batch(plan, r.states, r.block_size, r.device)
        t2 = time.perf_counter()
        if r.graphs is not None and r.graphs.can_run(b.meta, len(b.input_ids)):
            logits = r.graphs.run(b.input_ids, b.positions, b.meta)
        else:
            from trellm.worker.model_runner import ForwardContext

            h = r.model(b.input_ids, b.positions, ForwardContext(r.backend, r.kv_caches, b.meta, ops=r.ops))
            logits = r.model.compute_logits(h[b.logits_index])
        for rid, n in plan.num_scheduled_tokens.items():
            r.states[rid].num_computed_tokens += n
        t3 = time.perf_counter()
        res = r._sample(b, logits)
        t4 = time.perf_counter()
        e._update(plan, res)
        t5 = time.perf_counter()
        for k, a, z in (("schedule", t0, t1), ("prepare", t1, t2), ("launch", t2, t3),
                        ("sample_wait", t3, t4), ("update", t4, t5)):
            acc[k] += z - a
    sync()
    step_ms = (time.perf_counter() - t_all) / steps * 1e3
    out = {"batch": batch, "step_ms": step_ms, "tok_s": batch * 1e3 / step_ms,
           "host_ms": {k: v / steps * 1e3 for k, v in acc.items()}}
    out["graph_gpu_ms"] = graph_gpu_ms(r, batch)
    if PROFILE and r.graphs is not None and r.graphs.graphs:
        out["graph_kernels"] = graph_kernels(r, batch)
    e.abort_request([f"s{i}" for i in range(batch)])
    while e.has_unfinished_requests():
        e.step()
    return out


def engine_tok_s(llm: LLM, batch: int, steps: int) -> float:
    """Steady decode through ``Engine.step`` as configured (async scheduling included)."""
    e = llm.engine
    params = SamplingParams(temperature=0, max_tokens=3000, ignore_eos=True)
    for i in range(batch):
        e.add_request(f"e{i}", None, params, prompt_token_ids=[(100 + i + j) % 400 for j in range(128)])
    for _ in range(20):
        e.step()
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        e.step()
    sync()
    dt = time.perf_counter() - t0
    e.abort_request([f"e{i}" for i in range(batch)])
    while e.has_unfinished_requests():
        e.step()
    return batch * steps / dt


def graph_gpu_ms(runner, batch: int, n: int = 50) -> float | None:
    """GPU time of one replay of the bucket that holds ``batch`` (replays back to back)."""
    g = runner.graphs
    if g is None or not g.graphs:
        return None
    entry = g.graphs[next(s for s in sorted(g.graphs) if s >= batch)]
    entry.graph.replay()
    sync()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        entry.graph.replay()
    end.record()
    sync()
    return start.elapsed_time(end) / n


def graph_kernels(runner, batch: int, n: int = 5) -> list[dict]:
    """Per-kernel GPU time inside the bucket's graph (torch.profiler over ``n`` replays)."""
    import torch.profiler as tp

    entry = runner.graphs.graphs[next(s for s in sorted(runner.graphs.graphs) if s >= batch)]
    with tp.profile(activities=[tp.ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            entry.graph.replay()
        sync()
    rows = []
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if t:
            rows.append({"kernel": ev.key[:90], "calls_per_step": ev.count / n, "us_per_step": t / n})
    rows.sort(key=lambda r: -r["us_per_step"])
    for row in rows[:30]:
        print("   K %8.1f us  %6.1f calls  %s" % (row["us_per_step"], row["calls_per_step"], row["kernel"]))
    print("   K total %.1f us" % sum(r["us_per_step"] for r in rows))
    return rows


def linear_bw(cfg: dict, rows: int, device: str, n: int = 50) -> list[dict]:
    """cuBLAS time and bandwidth of each linear of one layer (and the LM head) at ``rows``."""
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    shapes = {"qkv": (q + 2 * kv, h), "o": (h, q), "gate_up": (2 * i, h), "down": (h, i),
              "lm_head": (cfg["vocab_size"], h)}
    out = []
    for name, (o, k) in shapes.items():
        w = torch.randn(o, k, dtype=torch.bfloat16, device=device)
        x = torch.randn(rows, k, dtype=torch.bfloat16, device=device)
        for _ in range(3):
            F.linear(x, w)
        sync()
        t0 = time.perf_counter()
        for _ in range(n):
            F.linear(x, w)
        sync()
        dt = (time.perf_counter() - t0) / n
        out.append({"linear": name, "rows": rows, "shape": [o, k], "us": dt * 1e6,
                    "gb_s": w.numel() * 2 / dt / 1e9})
        del w, x
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("specs", nargs="+", help="CONFIG.json:B1,B2,...")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--out", default=".")
    ap.add_argument("--profile", action="store_true", help="per-kernel times inside the graph")
    ap.add_argument("--quantization", default="none", help="none, int8 or exl3 (dummy weights)")
    ap.add_argument("--bits", type=float, help="EXL3 bits per weight (with --quantization exl3)")
    a = ap.parse_args()
    global PROFILE
    PROFILE = a.profile
    device = "cuda" if torch.cuda.is_available() else "cpu"
    results = []
    for spec in a.specs:
        path, _, bs = spec.partition(":")
        batches = [int(x) for x in (bs or "1").split(",")]
        cfg = json.load(open(path))
        llm = LLM(f"dummy:{path}", dtype="bfloat16" if device == "cuda" else "float32", device=device,
                  max_model_len=4096, kv_cache_memory=(8 << 30) if device == "cuda" else (64 << 20),
                  quantization=a.quantization, max_num_seqs=max(batches),
                  **({"bits": a.bits} if a.bits is not None else {}))
        gemv = getattr(llm.engine.worker.runner.model, "gemv_dispatch", None)
        if gemv is not None:
            print("gemv dispatch (N, K, rows): (cuBLAS us, ours us)", flush=True)
            for key, (cub, ours) in sorted(gemv.timings_us.items()):
                print(f"   {key}: {cub:.1f} / {ours:.1f}{'  <- ours' if gemv.use_kernel[key] else ''}", flush=True)
        for b in batches:
            llm.engine.async_scheduling = False  # phases() drives the synchronous loop by hand
            row = {"config": path, **phases(llm, b, a.steps)}
            for asy in (False, True):
                llm.engine.async_scheduling = asy
                row[f"engine_tok_s_async_{asy}"] = engine_tok_s(llm, b, a.steps)
            if device == "cuda":
                row["linears"] = linear_bw(cfg, b, device)
            results.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "linears"}), flush=True)
            for lin in row.get("linears", []):
                print("   ", lin, flush=True)
        del llm
        import gc

        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    json.dump(results, open(f"{a.out}/overhead.json", "w"), indent=1)


if __name__ == "__main__":
    main()
