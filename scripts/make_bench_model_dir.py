#!/usr/bin/env python3
"""A random-weight model directory that takes text: a shape's config.json plus the
embedded default model's tokenizer (tokenizer.json, and tokenizer_config.json with its
chat template), for `trellm serve dummy:DIR` in server benchmarks.

    python3 scripts/make_bench_model_dir.py .gpu/llama-3.1-8b.json .gpu/llama8b-tok

The tokenizer's ids must fit the shape's vocabulary (SmolLM2's 49,152 do for Llama-3 and
Qwen3 shapes); the script refuses otherwise.
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from trellm.default_model import default_model_path
from trellm.tokenizer.tokenizer import Tokenizer


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__.strip().splitlines()[-4].strip(), file=sys.stderr)
        return 2
    config, out = Path(sys.argv[1]), Path(sys.argv[2])
    vocab = json.loads(config.read_text())["vocab_size"]
    tok = Tokenizer.load(default_model_path())
    if tok.vocab_size > vocab:
        print(f"error: the tokenizer has {tok.vocab_size} ids, the shape only {vocab}", file=sys.stderr)
        return 1
    out.mkdir(parents=True, exist_ok=True)
    tok.hf.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": tok.chat_template, "eos_token": tok.eos_token, "bos_token": tok.bos_token}))
    shutil.copyfile(config, out / "config.json")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
