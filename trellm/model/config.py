"""The architecture description a model file builds from, read from an HF config dict."""
from __future__ import annotations

import math
from dataclasses import dataclass

_INT_LIMITS = {
    "vocab_size": (1, 1 << 22), "hidden_size": (1, 1 << 16), "intermediate_size": (1, 1 << 20),
    "num_layers": (1, 1024), "num_heads": (1, 1024), "num_kv_heads": (1, 1024), "head_dim": (1, 1024),
    "max_position_embeddings": (1, 1 << 26),
}
"""Bounds far above any real model (the largest today: ~260k vocab, ~26k hidden, ~130
layers, 10M context), low enough that a corrupt value cannot ask for petabytes."""
_HF_NAMES = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
             "num_kv_heads": "num_key_value_heads"}


@dataclass(frozen=True)
class ArchConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    """Qwen3 normalizes q and k per head before RoPE."""
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    quantization_config: dict | None

    def __post_init__(self) -> None:
        # Numbers from a model file are data: check them here, so a bad config is one
        # ValueError naming the field, not a traceback (or a memory bomb) while building.
        for name, (lo, hi) in _INT_LIMITS.items():
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
                raise ValueError(f"{_HF_NAMES.get(name, name)} must be an integer in "
                                 f"[{lo}, {hi}], got {v!r:.40}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads ({self.num_heads}) is not a multiple "
                             f"of num_key_value_heads ({self.num_kv_heads})")
        for name in ("rms_norm_eps", "rope_theta"):
            v = getattr(self, name)
            if not math.isfinite(v) or v <= 0:
                raise ValueError(f"{name} must be a positive number, got {v!r}")
        for name in ("rope_scaling", "quantization_config"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), dict):
                raise ValueError(f"{name} must be an object, got {getattr(self, name)!r:.40}")

    @classmethod
    def from_hf(cls, cfg: dict) -> "ArchConfig":
        archs = cfg.get("architectures") or [cfg.get("model_type", "?")]
        arch = archs[0]
        heads = _req(cfg, "num_attention_heads")
        hidden = _req(cfg, "hidden_size")
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        rope_scaling = cfg.get("rope_scaling")
        rope_theta = cfg.get("rope_theta")
        # transformers 5 moves rope settings under `rope_parameters`.
        rp = cfg.get("rope_parameters")
        if isinstance(rp, dict):
            rope_theta = rp.get("rope_theta") if rope_theta is None else rope_theta
            if rope_scaling is None and rp.get("rope_type", "default") != "default":
                rope_scaling = rp
        return cls(
            architecture=arch,
            vocab_size=_req(cfg, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_req(cfg, "intermediate_size"),
            num_layers=_req(cfg, "num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or _div(hidden, heads),
            rms_norm_eps=_float(cfg.get("rms_norm_eps", 1e-6), "rms_norm_eps"),
            rope_theta=_float(10000.0 if rope_theta is None else rope_theta, "rope_theta"),
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM")),
            qk_norm=arch in ("Qwen3ForCausalLM",),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            quantization_config=cfg.get("quantization_config"),
        )


def _req(cfg: dict, key: str):
    if key not in cfg:
        raise ValueError(f"model config is missing {key!r}")
    return cfg[key]


def _div(hidden, heads):
    """hidden // heads for head_dim's default; junk passes through to the checks."""
    ok = all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (hidden, heads))
    return hidden // heads if ok else None


def _float(v, name: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"{name} must be a number, got {v!r:.40}")
    return float(v)
