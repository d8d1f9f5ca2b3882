"""Quantization is a strategy owned by the linear layer.

A ``LinearMethod`` creates the layer's weights, post-processes them after loading,
and runs the forward. The unquantized method is the baseline and the reference;
later methods (int8 weight-only, EXL3 trellis) plug in through ``QUANT_METHODS``,
chosen from the checkpoint's ``quantization_config``, never from a file name.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from trellm.kernels.gemv import gemv


@dataclass(frozen=True, eq=False)
class InputTransform:
    """The pass a linear makes over its input first, for the kernel before it to make instead
    (LinearMethod.input_transform): ``had_r_128(x * suh)`` of each 128-input block, stored
    in ``dtype`` as [rows, suh.numel()] (EXL3's input transform, exl3_prologue)."""

    suh: torch.Tensor
    """[padded_in] (+-1, fp16)."""
    dtype: torch.dtype


class LinearMethod:
    """Strategy interface for a linear layer's weights and matmul."""

    @classmethod
    def from_config(cls, quantization_config: dict) -> "LinearMethod":
        """The method for a checkpoint's ``quantization_config`` (methods that read it override)."""
        return cls()

    @classmethod
    def for_lm_head(cls, quantization_config: dict) -> "LinearMethod | None":
        """The method for the LM head, or None: the head stays a plain (or tied) weight."""
        return None

    def create_weights(self, layer: torch.nn.Module, in_features: int, out_features: int,
                       bias: bool, dtype: torch.dtype) -> None:
        raise NotImplementedError

    def load_weight(self, layer: torch.nn.Module, param_name: str, tensor: object,
                    rows: tuple[int, int] | None) -> bool:
        """Store a checkpoint tensor that the method keeps in its own format (rows =
        (start, size) of a MergedLinear shard, None = all). False: the layer does a plain copy."""
        return False

    def checkpoint_names(self, layer: torch.nn.Module) -> tuple[str, ...] | None:
        """The tensor names (after the module key) the layer takes from a checkpoint when
        they are not its parameters, e.g. EXL3's ``trellis``/``suh``/...; the method then
        checks in ``process_after_loading`` that what arrived is complete. None: the
        layer's parameters, every one required (the model checks)."""
        return None

    def process_after_loading(self, layer: torch.nn.Module) -> None:
        """Repack weights once they are loaded (no-op by default)."""

    def apply(self, layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def apply_norm(self, layer: torch.nn.Module, x: torch.Tensor, residual: torch.Tensor | None,
                   weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(apply(RMSNorm(x + residual)), x + residual) in the method's own launches (residual
        None: x is the residual), or None: the caller runs the norm, then ``apply``. For a
        method whose input needs its own pass (EXL3's input transform) to do it in the norm's."""
        return None

    def apply_glu(self, layer: torch.nn.Module, gate_up: torch.Tensor) -> torch.Tensor | None:
        """apply(silu(gate) * up) of gate_up [..., 2 I] in the method's own launches, or None."""
        return None

    def input_transform(self, layer: torch.nn.Module, rows: int, dtype: torch.dtype,
                        device: torch.device) -> InputTransform | None:
        """The transform ``apply_transformed`` wants done by the kernel before it to an input
        of ``rows`` rows in ``dtype`` on ``device``, or None (the usual: ``apply`` takes x as
        it is)."""
        return None

    def apply_transformed(self, layer: torch.nn.Module, x: torch.Tensor, xh: torch.Tensor) -> torch.Tensor:
        """``apply(x)`` given also xh, x as ``input_transform`` asked for it."""
        raise NotImplementedError(f"{type(self).__name__} takes no pre-transformed input")


class UnquantizedLinearMethod(LinearMethod):
    """Dense weights in the model dtype; ``F.linear`` (cuBLAS / oneDNN) does the work."""

    gemv_dispatch = None
    """trellm.kernels.gemv.GemvDispatch on CUDA: our skinny GEMM where it timed faster."""

    def create_weights(self, layer, in_features, out_features, bias, dtype):
        layer.weight = torch.nn.Parameter(
            torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        layer.bias = (torch.nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False)
                      if bias else None)

    def apply(self, layer, x):
        if self.gemv_dispatch is not None and self.gemv_dispatch.wants(x, layer.weight):
            return gemv(x, layer.weight, layer.bias)
        return F.linear(x, layer.weight, layer.bias)


QUANT_METHODS: dict[str, type[LinearMethod]] = {
    "none": UnquantizedLinearMethod,
}


def get_linear_method(quantization_config: dict | None) -> LinearMethod:
    """Pick the strategy from a checkpoint's ``quantization_config``."""
    return _method_class(quantization_config).from_config(quantization_config or {})


def get_lm_head_method(quantization_config: dict | None) -> LinearMethod | None:
    """The LM head's strategy when the checkpoint quantizes it, else None (dense or tied)."""
    return _method_class(quantization_config).for_lm_head(quantization_config or {})


def _method_class(quantization_config: dict | None) -> type[LinearMethod]:
    _register_builtin_methods()
    method = (quantization_config or {}).get("quant_method", "none")
    cls = QUANT_METHODS.get(method)
    if cls is None:
        raise ValueError(f"unsupported quantization method {method!r} "
                         f"(supported: {', '.join(sorted(QUANT_METHODS))})")
    return cls


def _register_builtin_methods() -> None:
    # Imported on first use: these modules subclass LinearMethod, so importing them
    # at the top of this one would be circular.
    if "gguf_q4" not in QUANT_METHODS:
        from trellm.quant.gguf_int4 import GGUFQ4LinearMethod

        QUANT_METHODS["gguf_q4"] = GGUFQ4LinearMethod
    if "exl3" not in QUANT_METHODS:
        from trellm.quant.exl3.method import EXL3DenseLinearMethod, EXL3LinearMethod

        QUANT_METHODS["exl3"] = EXL3LinearMethod
        # Not a checkpoint's method: what the builder picks for --quantization none on an
        # EXL3 checkpoint (same tensors, decoded once into dense weights).
        QUANT_METHODS["exl3_dense"] = EXL3DenseLinearMethod
    if "int8" not in QUANT_METHODS:
        from trellm.quant.int8 import Int8LinearMethod

        # Not a checkpoint's method either: --quantization int8 (weights quantized at load time).
        QUANT_METHODS["int8"] = Int8LinearMethod
