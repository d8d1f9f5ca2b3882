"""``trellm quantize``: the command line of the EXL3 quantizer (``quantize.py``)."""
from __future__ import annotations

import argparse
import json
import os
import sys


def add_quantize_parser(sub) -> None:
    q = sub.add_parser("quantize", help="quantize a model to EXL3 (ExLlamaV3's format)",
                       description="Quantize a dense model (HF directory or GGUF file) to an EXL3 directory "
                                   "that trellm and ExLlamaV3 both load. Interrupted runs resume: rerun the "
                                   "same command.")
    q.add_argument("model", nargs="?", default="",
                   help="GGUF file or Hugging Face directory (default: the embedded SmolLM2-135M)")
    q.add_argument("--bits", type=int, required=True, help="decoder bits per weight, 1..8")
    q.add_argument("--head-bits", type=int, default=6, help="LM head bits per weight (16: keep it fp16)")
    q.add_argument("--out", required=True, help="output directory (empty, or an unfinished run to resume)")
    q.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    q.add_argument("--codebook", default="mul1", choices=["mul1", "mcg", "3inst"])
    q.add_argument("--calibration", default=None, help="calibration text file (default: the shipped one)")
    q.add_argument("--calib-rows", type=int, default=32)
    q.add_argument("--calib-cols", type=int, default=512)
    q.add_argument("--seed", type=int, default=0)
    q.add_argument("--scale-samples", type=int, default=48, help="tiles per linear in the global-scale search")
    q.add_argument("--wrap-window", type=int, default=64, help="steps of the Viterbi's wrap-finding pass")
    q.add_argument("--cost-dtype", default="auto", choices=["auto", "float32", "float16"],
                   help="Viterbi path costs (auto: float16 on CUDA, float32 on the CPU)")
    q.add_argument("--viterbi-memory", type=int, default=None,
                   help="MiB for one batch of tiles' Viterbi buffers (default: a tenth of the GPU, at most "
                        "8192; 256 on the CPU)")
    q.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="fuse each Viterbi step with torch.compile (default: on for CUDA); falls back to "
                        "the eager step if compiling fails")
    q.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (a shared or busy CPU is often fastest with 1)")
    q.add_argument("--quiet", action="store_true", help="no progress bar")
    q.set_defaults(func=run_quantize)


def options_from_args(a: argparse.Namespace):
    import torch

    from trellm.quant.exl3.quantize import QuantizeOptions
    from trellm.quant.exl3.viterbi import ViterbiOptions

    cuda = a.device == "cuda" or (a.device == "auto" and torch.cuda.is_available())
    viterbi = ViterbiOptions(
        wrap_window=a.wrap_window,
        cost_dtype=None if a.cost_dtype == "auto" else getattr(torch, a.cost_dtype),
        memory_bytes=None if a.viterbi_memory is None else a.viterbi_memory << 20,
        compile=cuda if a.compile is None else a.compile)
    return QuantizeOptions(bits=a.bits, head_bits=a.head_bits, codebook=a.codebook, calibration=a.calibration,
                           calib_rows=a.calib_rows, calib_cols=a.calib_cols, seed=a.seed, device=a.device,
                           scale_samples=a.scale_samples, viterbi=viterbi, progress=not a.quiet)


def run_quantize(a: argparse.Namespace) -> int:
    from trellm.quant.exl3.quantize import quantize_model

    import torch

    if a.wrap_window < 2 or a.scale_samples < 1:
        raise ValueError("--wrap-window must be >= 2 and --scale-samples >= 1")
    if os.path.exists(a.out) and not os.path.isdir(a.out):
        raise ValueError(f"--out {a.out} exists and is not a directory")
    if a.threads is not None:
        torch.set_num_threads(max(1, a.threads))
    result = quantize_model(a.model, a.out, options_from_args(a))
    summary = {"out": str(result.out_dir), "seconds": result.seconds, "resumed_parts": result.resumed_parts}
    print(json.dumps(summary), file=sys.stdout)
    return 0
