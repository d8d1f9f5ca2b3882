"""A tiny random-weight Llama as an HF directory, for smoke runs and tests.

Every linear is 128 wide (the Hadamard block), so it is the smallest model the EXL3
quantizer takes, with a 256-symbol byte-level tokenizer (any text encodes, one token
per UTF-8 byte) so calibration and evaluation text run through it unchanged.
"""
from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import save_file

TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256, "hidden_size": 128,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 32, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "tie_word_embeddings": True, "eos_token_id": 0, "hidden_act": "silu",
}


EMBED_SCALE = 0.15


def byte_tokenizer_json() -> str:
    """A byte-level BPE without merges: token i is byte i (GPT-2's byte-to-unicode map)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    extra = [b for b in range(256) if b not in printable]
    chars = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(extra)}
    tok = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok.to_str()


def write_tiny_model(path: str | Path, seed: int = 0, **overrides) -> Path:
    """config.json, model.safetensors (seeded random weights) and a byte tokenizer."""
    from trellm.model.config import ArchConfig
    from trellm.model.llama import dummy_weights

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = {**TINY_CONFIG, **overrides}
    arch = ArchConfig.from_hf(config)
    tensors = {name: t.contiguous() for name, t in dummy_weights(arch, seed)}
    # The tied embedding is also the head: at unit scale its logits are nearly one-hot, which
    # makes every KL 0; a smaller table gives spread distributions that quantization moves.
    tensors["model.embed_tokens.weight"] *= EMBED_SCALE
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config, indent=2))
    (path / "tokenizer.json").write_text(byte_tokenizer_json())
    (path / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": False, "eos_token": None}))
    return path
