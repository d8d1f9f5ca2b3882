"""Architecture name (config.json ``architectures[0]``) -> model class."""
from __future__ import annotations

from trellm.loader.errors import ModelLoadError


def get_model_class(architecture: str):
    from trellm.model import llama

    if architecture in llama.ARCHITECTURES:
        return llama.LlamaForCausalLM
    raise ModelLoadError(f"unsupported architecture {architecture!r} "
                         f"(supported: {', '.join(llama.ARCHITECTURES)})")
