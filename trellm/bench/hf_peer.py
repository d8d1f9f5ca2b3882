"""transformers on the same weights, for comparisons (tests and benchmarks only;
transformers is never a runtime dependency of the engine)."""
from __future__ import annotations

from pathlib import Path

import torch

from trellm.default_model import default_model_path
from trellm.loader.checkpoint import open_checkpoint
from trellm.model.config import ArchConfig


def load_transformers_peer(model: str, dtype: torch.dtype, device: str = "cpu", seed: int = 0):
    """Load the model `model` names (as trellm resolves it) into transformers."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(model) if model else default_model_path()
    if str(model).startswith("dummy:"):
        ckpt = open_checkpoint(model)
        from trellm.model.llama import dummy_weights

        cfg = AutoConfig.for_model(**{k: v for k, v in ckpt.hf_config.items()
                                      if k not in ("architectures", "transformers_version")},
                                   architectures=ckpt.hf_config.get("architectures"))
        with torch.device(device):
            hf = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
        state = {k: v.to(dtype) for k, v in dummy_weights(ArchConfig.from_hf(ckpt.hf_config), seed, device)}
        if cfg.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        missing, unexpected = hf.load_state_dict(state, strict=False)
        missing = [m for m in missing if not m.endswith("lm_head.weight") or not cfg.tie_word_embeddings]
        if missing or unexpected:
            raise RuntimeError(f"dummy weights do not fit transformers: {missing[:3]} {unexpected[:3]}")
        return hf.eval()
    if path.is_file():
        hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    else:
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return hf.to(device).eval()
