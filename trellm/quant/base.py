"""Quantization is a strategy owned by the linear layer.

A ``LinearMethod`` creates the layer's weights, post-processes them after loading,
and runs the forward. The unquantized method is the baseline and the reference;
later methods (int8 weight-only, EXL3 trellis) plug in through ``QUANT_METHODS``,
chosen from the checkpoint's ``quantization_config``, never from a file name.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


class LinearMethod:
    """Strategy interface for a linear layer's weights and matmul."""

    def create_weights(self, layer: torch.nn.Module, in_features: int, out_features: int,
                       bias: bool, dtype: torch.dtype) -> None:
        raise NotImplementedError

    def load_weight(self, layer: torch.nn.Module, param_name: str, tensor: object,
                    rows: tuple[int, int] | None) -> bool:
        """Store a checkpoint tensor that the method keeps in its own format (rows =
        (start, size) of a MergedLinear shard, None = all). False: the layer does a plain copy."""
        return False

    def process_after_loading(self, layer: torch.nn.Module) -> None:
        """Repack weights once they are loaded (no-op by default)."""

    def apply(self, layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class UnquantizedLinearMethod(LinearMethod):
    """Dense weights in the model dtype; ``F.linear`` (cuBLAS / oneDNN) does the work."""

    def create_weights(self, layer, in_features, out_features, bias, dtype):
        layer.weight = torch.nn.Parameter(
            torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        layer.bias = (torch.nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False)
                      if bias else None)

    def apply(self, layer, x):
        return F.linear(x, layer.weight, layer.bias)


QUANT_METHODS: dict[str, type[LinearMethod]] = {
    "none": UnquantizedLinearMethod,
}


def get_linear_method(quantization_config: dict | None) -> LinearMethod:
    """Pick the strategy from a checkpoint's ``quantization_config``."""
    _register_builtin_methods()
    method = (quantization_config or {}).get("quant_method", "none")
    cls = QUANT_METHODS.get(method)
    if cls is None:
        raise ValueError(f"unsupported quantization method {method!r} "
                         f"(supported: {', '.join(sorted(QUANT_METHODS))})")
    return cls()


def _register_builtin_methods() -> None:
    # Imported on first use: these modules subclass LinearMethod, so importing them
    # at the top of this one would be circular.
    if "gguf_q4" not in QUANT_METHODS:
        from trellm.quant.gguf_int4 import GGUFQ4LinearMethod

        QUANT_METHODS["gguf_q4"] = GGUFQ4LinearMethod
