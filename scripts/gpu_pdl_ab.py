#!/usr/bin/env python3
"""Whole-engine A/B of the decode graph's launch settings (issue 4), on one GPU in one call.

Each variant runs in its own process (the PDL decision is made once per process):

* ``base``: the defaults (PDL as ``TRELLM_PDL`` says, late trigger, the calibrated GEMV
  dispatch, no up-front weight prefetch);
* ``early``: ``TRELLM_PDL_TRIGGER=early`` (kernels/_triton.py);
* ``preN``: ``kernels.gemv.PREFETCH_BLOCKS = N`` (the weight head loaded before the wait);
* ``force``: our GEMV for every dense shape at 1-8 rows, whatever the calibration timed;
* ``forcenorm`` (with ``norm``): gemv_rms_norm for every qkv / gate_up shape at 1-8 rows;
* ``norm``: ``TRELLM_GEMV_NORM=1`` (the qkv / gate_up GEMV takes the RMSNorm before it and
  its residual add where calibration timed that faster: kernels/gemv.py gemv_rms_norm);
* ``floorN``: ``kernels.paged_attention.SPLIT_FLOOR_TOKENS = N`` (decode splits of at least
  N context tokens).

Tags combine with ``-``: ``early-pre2-force``. Per variant: Qwen3-0.6B and Llama-3.1-8B
shapes (random weights, bf16, the engine settings of scripts/gpu_bench.py), a warm-up,
then ``--repeats`` single-stream runs (128-token prompt, 256 new tokens), the decode tok/s
of each, and the greedy tokens of the first run, compared with the first variant's.

    python3 scripts/gpu_pdl_ab.py --configs .gpu --out $OUT --variants base,early,early-pre2

Writes ``gpu-pdl-ab.json`` under --out after each variant and prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

MODELS = (("qwen3-0.6b", "qwen3-0.6b.json"), ("llama-3.1-8b", "llama-3.1-8b.json"))


def apply_variant(tags: list[str]) -> dict:
    """Module settings of a variant, applied in this (child) process before any engine."""
    from trellm.kernels import gemv as g
    from trellm.kernels import paged_attention

    applied = {}
    for tag in tags:
        if tag.startswith("floor"):
            paged_attention.SPLIT_FLOOR_TOKENS = int(tag[5:])
            applied["paged_attention.SPLIT_FLOOR_TOKENS"] = paged_attention.SPLIT_FLOOR_TOKENS
        if tag.startswith("pre"):
            if tag[3:] not in ("1", "2", "4", "8"):
                raise ValueError(f"{tag!r}: the prefetch takes 1, 2, 4 or 8 blocks")
            g.PREFETCH_BLOCKS = int(tag[3:])
            applied["gemv.PREFETCH_BLOCKS"] = g.PREFETCH_BLOCKS
        elif tag == "force":
            calibrate = g.GemvDispatch.calibrate

            def forced(self, weights, rows=(1, 2, 4, 8), margin=0.95):
                calibrate(self, weights, rows, margin)  # keeps the timings for the record
                self.use_kernel = {key: True for key in self.use_kernel}
                return self

            g.GemvDispatch.calibrate = forced
            applied["gemv"] = "forced"
        elif tag == "forcenorm":
            calibrate_norm = g.calibrate_norm

            def forced_norm(d, weights, rows=(1, 2, 4, 8), margin=0.95):
                calibrate_norm(d, weights, rows, margin)
                d.use_norm = {key: True for key in d.use_norm}
                return d

            g.calibrate_norm = forced_norm  # worker/builder.py calls it through the module
            applied["gemv_rms_norm"] = "forced"
        elif not tag.startswith("floor"):
            raise ValueError(f"unknown variant tag {tag!r}")
    return applied


def _smoke_config(path: str, out_dir: str) -> str:
    """A toy copy of a config (2 layers, width 64) for --smoke on the CPU."""
    cfg = json.load(open(path))
    cfg.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, vocab_size=512, max_position_embeddings=1024)
    cfg.pop("rope_scaling", None)
    dst = os.path.join(out_dir, "smoke-" + os.path.basename(path))
    with open(dst, "w") as f:
        json.dump(cfg, f)
    return dst


def child(variant: str, configs: str, repeats: int, smoke: bool = False) -> dict:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import torch
    from gpu_bench import free, prompts, run, tokens_of

    from trellm import LLM
    from trellm.kernels import _triton

    res = {"variant": variant,
           "applied": apply_variant([t for t in variant.split("-") if t not in ("base", "early", "norm")])}
    new = 16 if smoke else 256
    for name, file in MODELS:
        path = os.path.join(configs, file)
        if smoke:
            path = _smoke_config(path, configs)
        cfg = json.load(open(path))
        small = name.startswith("qwen") or smoke
        t0 = time.perf_counter()
        llm = LLM(f"dummy:{path}", dtype="float32" if smoke else "bfloat16", device="cpu" if smoke else "cuda",
                  quantization="none", max_model_len=1024 if smoke else 4096 if small else cfg["max_position_embeddings"],
                  **({"kv_cache_memory": (64 << 20) if smoke else 2 << 30, "max_num_seqs": 32} if small else
                     {"gpu_memory_utilization": 0.9, "max_num_seqs": 256, "max_num_batched_tokens": 8192}))
        r = {"load_and_capture_s": round(time.perf_counter() - t0, 1)}
        d = getattr(llm.engine.worker.runner.model, "gemv_dispatch", None)
        if d is not None:
            r["gemv_kernel_shapes_rows1"] = sorted(f"{n}x{k}" for (n, k, m), v in d.use_kernel.items() if v and m == 1)
            r["gemv_us_rows1"] = {f"{n}x{k}": [round(t, 2) for t in ts] for (n, k, m), ts in d.timings_us.items()
                                  if m == 1}
            r["glu_rows1"] = [f"{n}x{k}" for (n, k, m), v in d.use_glu.items() if v and m == 1]
            r["norm_us_rows1"] = {f"{n}x{k}": [round(t, 2) for t in ts]
                                  for (n, k, m), ts in d.norm_timings_us.items() if m == 1}
            r["norm_rows1"] = sorted(f"{n}x{k}" for (n, k, m), v in d.use_norm.items() if v and m == 1)
        vocab = cfg["vocab_size"]
        run(llm, prompts(vocab, 1, 64, seed=1), 8)
        speeds = []
        for i in range(repeats):
            p = prompts(vocab, 1, 128, seed=10)
            if i == 0:
                r["tokens"] = tokens_of(llm, p, new)[0]
            speeds.append(round(run(llm, p, new)["decode_tok_s"], 1))
        r["decode_tok_s"] = speeds
        r["median_tok_s"] = statistics.median(speeds)
        res[name] = r
        del llm, d
        free()
    res["pdl"] = {k: v for k, v in _triton._PDL.items()}
    res["device"] = "cpu (smoke)" if smoke else torch.cuda.get_device_name()
    return res


def env_for(variant: str) -> dict:
    """The variant's launch settings, whatever the caller's environment holds (a preN tag
    then sets the prefetch in the child)."""
    env = dict(os.environ)
    env["TRELLM_PDL_TRIGGER"] = "early" if "early" in variant.split("-") else "late"
    env["TRELLM_GEMV_PREFETCH"] = "0"
    env["TRELLM_GEMV_NORM"] = "1" if "norm" in variant.split("-") else "0"
    return env


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=".gpu")
    ap.add_argument("--out", default=".")
    ap.add_argument("--variants", default="base,early,early-pre2,early-pre2-force")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--budget", type=float, default=540.0, help="seconds; later variants are skipped")
    ap.add_argument("--smoke", action="store_true", help="toy shapes on the CPU: a check of this script")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print("RESULT " + json.dumps(child(a.child, a.configs, a.repeats, a.smoke)), flush=True)
        return
    os.makedirs(a.out, exist_ok=True)
    t0 = time.perf_counter()
    res = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M:%S"), "variants": {}}
    first_s = None  # the first variant's duration: a later one that cannot fit is skipped
    for v in a.variants.split(","):
        left = a.budget - (time.perf_counter() - t0)
        if left < max(30.0, 1.1 * (first_s or 0.0)):
            res["variants"][v] = {"skipped": "time budget spent"}
            continue
        t_v = time.perf_counter()
        try:
            p = subprocess.run([sys.executable, __file__, "--child", v, "--configs", a.configs,
                                "--repeats", str(a.repeats)] + (["--smoke"] if a.smoke else []),
                               env=env_for(v), capture_output=True, text=True, timeout=left)
            line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
            res["variants"][v] = json.loads(line[7:]) if line else {"error": (p.stderr or p.stdout)[-3000:]}
        except subprocess.TimeoutExpired:
            res["variants"][v] = {"error": "timed out"}
        first_s = first_s or time.perf_counter() - t_v
        report(res)
        with open(os.path.join(a.out, "gpu-pdl-ab.json"), "w") as f:
            json.dump(res, f, indent=1)


def report(res: dict) -> None:
    runs = res["variants"]
    name, base = next(((v, r) for v, r in runs.items() if "error" not in r and "skipped" not in r), (None, None))
    print(f"\n| variant | {' | '.join(m for m, _ in MODELS)} | greedy tokens equal to {name} |")
    print("|---|---|---|---|")
    for v, r in runs.items():
        if "error" in r or "skipped" in r:
            print(f"| {v} | {str(r.get('error', r.get('skipped')))[-300:]!r} | | |")
            continue
        cells = [f"{r[m]['median_tok_s']} ({', '.join(map(str, r[m]['decode_tok_s']))})" for m, _ in MODELS]
        same = [f"{sum(a == b for a, b in zip(r[m]['tokens'], base[m]['tokens']))}/{len(base[m]['tokens'])}"
                for m, _ in MODELS]
        print(f"| {v} | {' | '.join(cells)} | {' / '.join(same)} |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
