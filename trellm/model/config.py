"""The architecture description a model file builds from, read from an HF config dict."""
from __future__ import annotations

from dataclasses import dataclass


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
            rope_theta = rope_theta or rp.get("rope_theta")
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
            head_dim=cfg.get("head_dim") or hidden // heads,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta or 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
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
