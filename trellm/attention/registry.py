"""Attention backends plug in here; the pure-PyTorch one is always the fallback.

A backend declares ``supports(device, dtype)``; ``get_attention_backend`` returns
the first registered backend that accepts, or the one named explicitly.
"""
from __future__ import annotations

import torch

from trellm.attention.torch_paged import TorchPagedAttention
from trellm.attention.triton_paged import TritonPagedAttention

_BACKENDS: list[type] = []


def register_backend(cls: type) -> type:
    """Register a backend class; later registrations take precedence."""
    _BACKENDS.insert(0, cls)
    return cls


register_backend(TorchPagedAttention)
register_backend(TritonPagedAttention)  # CUDA + Triton only; Triton is imported on first use


def available_backends() -> list[str]:
    return [b.name for b in _BACKENDS]


def get_attention_backend(device: torch.device, dtype: torch.dtype, name: str | None = None):
    for cls in _BACKENDS:
        if name is not None and cls.name != name:
            continue
        if cls.supports(device, dtype):
            return cls()
    if name is not None:
        raise ValueError(f"attention backend {name!r} is unknown or does not support "
                         f"{device.type}/{dtype} (available: {', '.join(available_backends())})")
    return TorchPagedAttention()
