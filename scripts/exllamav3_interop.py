#!/usr/bin/env python3
"""EXL3 files between exllamav3 and trellm (issue 6), on a CUDA machine with exllamav3.

1. writes a small random-weight Llama model as a Hugging Face directory (fp16
   safetensors, the tokenizer files copied from ``--tokenizer-dir``);
2. quantizes it with exllamav3's own converter (``exllamav3.conversion.convert_model``);
3. runs the same token ids through exllamav3 (its no-cache forward) and through trellm
   (the directory loaded by its EXL3 method), and compares the logits; the unquantized
   model's logits (trellm, fp16) are printed beside them as the scale of quantization error;
4. with ``--reverse``: quantizes the same model with ``trellm quantize`` and loads that
   directory in exllamav3, compared the same way.

The tokenizer directory is made on the CPU beforehand (it needs the embedded default model):

    python3 scripts/make_bench_model_dir.py ../shared/gpu/configs/qwen3-0.6b.json .gpu/ex3tok

Run (exllamav3 compiles its CUDA extension at first import; TORCH_EXTENSIONS_DIR keeps it):

    python3 scripts/exllamav3_interop.py --tokenizer-dir .gpu/ex3tok --work /tmp/ex3work --out $OUT
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 1024,
    "intermediate_size": 2816, "num_hidden_layers": 4, "num_attention_heads": 16,
    "num_key_value_heads": 8, "head_dim": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "max_position_embeddings": 4096, "vocab_size": 49152, "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float16", "hidden_act": "silu",
}


def write_random_model(path: Path, tokenizer_dir: Path, seed: int = 0) -> None:
    """Random fp16 weights of CONFIG's shape, HF names; linear weights ~ N(0, 1/in)."""
    from safetensors.torch import save_file

    c = CONFIG
    g = torch.Generator().manual_seed(seed)
    h, i, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d

    def lin(o: int, n: int) -> torch.Tensor:
        return (torch.randn(o, n, generator=g) / n ** 0.5).half()

    t = {"model.embed_tokens.weight": torch.randn(c["vocab_size"], h, generator=g).half(),
         "model.norm.weight": torch.ones(h).half(),
         # x5: logits of std ~5 rather than ~1, so the next-token distribution is peaked
         # enough for top-1 agreement and KL to mean something.
         "lm_head.weight": lin(c["vocab_size"], h) * 5}
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        t |= {p + "self_attn.q_proj.weight": lin(q, h), p + "self_attn.k_proj.weight": lin(kv, h),
              p + "self_attn.v_proj.weight": lin(kv, h), p + "self_attn.o_proj.weight": lin(h, q),
              p + "mlp.gate_proj.weight": lin(i, h), p + "mlp.up_proj.weight": lin(i, h),
              p + "mlp.down_proj.weight": lin(h, i),
              p + "input_layernorm.weight": (1 + 0.1 * torch.randn(h, generator=g)).half(),
              p + "post_attention_layernorm.weight": (1 + 0.1 * torch.randn(h, generator=g)).half()}
    path.mkdir(parents=True, exist_ok=True)
    save_file(t, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(c, indent=1))
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tokenizer_dir / name, path / name)


def exl3_convert(src: Path, dst: Path, work: Path, bits: float, log: Path) -> float:
    cmd = [sys.executable, "-m", "exllamav3.conversion.convert_model", "-i", str(src), "-o", str(dst),
           "-w", str(work), "-b", str(bits), "-hb", "6", "-cr", "32", "-cc", "1024"]
    t0 = time.perf_counter()
    with log.open("w") as f:
        subprocess.run(cmd, check=True, stdout=f, stderr=subprocess.STDOUT)
    return time.perf_counter() - t0


def exllamav3_logits(model_dir: Path, ids: torch.Tensor) -> torch.Tensor:
    from exllamav3 import Config, Model

    config = Config.from_directory(str(model_dir))
    model = Model.from_config(config)
    model.load(device="cuda:0", max_output_size=len(ids))
    try:
        out = model.forward(ids[None].cpu(), {"attn_mode": "flash_attn_nc"})
        return out[0, :, :CONFIG["vocab_size"]].float().cpu()
    finally:
        model.unload()


def trellm_logits(model_dir: Path, ids: torch.Tensor, quantization: str) -> torch.Tensor:
    from trellm.eval.kld import ModelSpec, load_model, window_logits

    m = load_model(ModelSpec(str(model_dir), quantization), device="cuda", dtype="float16",
                   context=len(ids))
    with torch.inference_mode():
        return window_logits(m, ids).cpu()


def compare(a: torch.Tensor, b: torch.Tensor) -> dict:
    """a = reference. Relative L2 error, max |diff|, top-1 agreement, mean KL(a || b)."""
    la, lb = torch.log_softmax(a, -1), torch.log_softmax(b, -1)
    kl = (la.exp() * (la - lb)).sum(-1)
    return {"rel_l2": ((a - b).norm() / a.norm()).item(), "max_abs": (a - b).abs().max().item(),
            "top1_agree": (a.argmax(-1) == b.argmax(-1)).float().mean().item(),
            "kl_mean": kl.mean().item(), "kl_max": kl.max().item()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer-dir", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=Path("/tmp/ex3work"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--bits", type=float, default=4.0)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--reverse", action="store_true", help="also: trellm quantize -> exllamav3")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict = {"command": " ".join(sys.argv), "config": CONFIG, "bits": args.bits, "torch": torch.__version__,
                    "device": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
    t0 = time.perf_counter()
    import exllamav3  # compiles the extension on first import
    report["exllamav3"] = getattr(exllamav3, "__version__", "?")
    report["exllamav3_import_s"] = round(time.perf_counter() - t0, 1)
    src, q_ex, q_tr = args.work / "fp16", args.work / "exl3-by-exllamav3", args.work / "exl3-by-trellm"
    write_random_model(src, args.tokenizer_dir)
    if not (q_ex / "config.json").exists():
        report["exllamav3_convert_s"] = round(exl3_convert(src, q_ex, args.work / "job", args.bits,
                                                           args.out / "exllamav3-convert.log"), 1)
    ids = torch.randint(100, CONFIG["vocab_size"], (args.tokens,), generator=torch.Generator().manual_seed(1))
    dense = trellm_logits(src, ids, "none")
    ex = exllamav3_logits(q_ex, ids)
    tr = trellm_logits(q_ex, ids, "auto")
    report["exllamav3_files"] = {"exllamav3_vs_trellm": compare(ex, tr), "exllamav3_vs_dense": compare(dense, ex),
                                 "trellm_vs_dense": compare(dense, tr)}
    if args.reverse:
        cmd = [sys.executable, "-m", "trellm", "quantize", str(src), "--bits", str(args.bits), "--out", str(q_tr)]
        with (args.out / "trellm-quantize.log").open("w") as f:
            subprocess.run(cmd, check=True, stdout=f, stderr=subprocess.STDOUT)
        ex2, tr2 = exllamav3_logits(q_tr, ids), trellm_logits(q_tr, ids, "auto")
        report["trellm_files"] = {"exllamav3_vs_trellm": compare(ex2, tr2), "exllamav3_vs_dense": compare(dense, ex2),
                                  "trellm_vs_dense": compare(dense, tr2)}
    (args.out / "exllamav3-interop.json").write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k != "config"}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
