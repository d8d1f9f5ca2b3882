"""INT8 weight-only linear layers (W8A16): ``--quantization int8`` on an unquantized model.

The layer loads its dense weight as the unquantized method does (same parameter
names, so every loader and MergedLinear's shards work unchanged), then
``process_after_loading`` quantizes it per output row: ``scale = absmax / 127``,
``q = round(w / scale)`` in -127..127 (symmetric: no zero point), and drops the dense
weight. Decode reads 1 byte per weight instead of 2 (bf16).

Forward: on CUDA with Triton, ``trellm/kernels/int8_gemv.py`` (Triton kernels for every
batch size, int8 tiles widened in registers, never a dequantized weight); the first
layer of each weight shape times the kernel configs on the device while the model
loads (``Int8Dispatch.calibrate``) and keeps the fastest per row count. On the CPU
``torch._weight_int8pack_mm`` where it exists; else the pure-PyTorch reference
``int8_linear_ref`` (the definition, in float32, beside the kernel). The LM head stays dense.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from trellm.kernels.int8_gemv import int8_linear_ref
from trellm.quant.base import LinearMethod, UnquantizedLinearMethod

QMAX = 127
log = logging.getLogger("trellm")


@dataclass(frozen=True)
class Int8Weight:
    """One quantized layer: what the kernels and the reference take."""

    q: torch.Tensor
    """int8 [out, in]."""
    scale: torch.Tensor
    """float32 [out]: w ~= q * scale[:, None]."""
    bias: torch.Tensor | None
    """[out] in the model dtype, or None."""


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric int8: (q int8 [out, in], scale float32 [out])."""
    w = weight.detach().float()
    # A zero row gets scale 1 (q all zero) instead of dividing by zero.
    absmax = w.abs().amax(dim=1)
    scale = torch.where(absmax > 0, absmax / QMAX, torch.ones_like(absmax))
    q = torch.round(w / scale[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale


def int8_quantization_config(qc: dict | None) -> dict:
    """The ``quantization_config`` for ``--quantization int8``: only an unquantized
    checkpoint (GGUF tensors arrive dequantized) can be re-quantized."""
    method = (qc or {}).get("quant_method")
    if method not in (None, "none"):
        raise ValueError(f"--quantization int8 needs an unquantized checkpoint; this one is {method!r}")
    return {"quant_method": "int8"}


class Int8LinearMethod(LinearMethod):
    """Weight-only int8 with per-output-row scales."""

    def create_weights(self, layer, in_features, out_features, bias, dtype):
        UnquantizedLinearMethod().create_weights(layer, in_features, out_features, bias, dtype)

    def process_after_loading(self, layer):
        q, scale = quantize_int8(layer.weight)
        del layer.weight  # the dense copy is what int8 saves: free it
        layer.register_buffer("qweight", q, persistent=False)
        layer.register_buffer("weight_scale", scale, persistent=False)
        bias = layer.bias.detach() if layer.bias is not None else None
        layer.int8 = Int8Weight(q, scale, bias)
        if q.is_cuda and _cuda_kernels():
            _prepare_cuda(q, scale)

    def apply(self, layer, x):
        return int8_forward(layer.int8, x)


def int8_forward(w: Int8Weight, x: torch.Tensor) -> torch.Tensor:
    """The Triton path on CUDA, torch's int8 CPU kernel on the CPU, else the reference."""
    if x.is_cuda and _cuda_kernels():
        from trellm.kernels.int8_gemv import int8_linear

        return int8_linear(x, w.q, w.scale, w.bias)
    if x.device.type == "cpu" and hasattr(torch, "_weight_int8pack_mm") and x.dtype in _CPU_DTYPES:
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        y = torch._weight_int8pack_mm(x2, w.q, w.scale.to(x.dtype))
        if w.bias is not None:
            y = y + w.bias
        return y.reshape(*x.shape[:-1], w.q.shape[0])
    return int8_linear_ref(x, w.q, w.scale, w.bias)


def _prepare_cuda(q: torch.Tensor, scale: torch.Tensor) -> None:
    """Load time, before any CUDA graph: the split-K counters, and the kernel configs
    timed on a new weight shape. A failure leaves the shape-based defaults."""
    from trellm.kernels import int8_gemv

    int8_gemv.prepare(q.device)
    dispatch = int8_gemv.get_dispatch()
    if not dispatch.calibrate_on_load or dispatch.has_shape(*q.shape):
        return
    try:
        dispatch.calibrate([(q, scale)])
    except Exception as e:  # noqa: BLE001 -- timing is an optimization; the defaults still run
        log.warning("int8 kernel calibration failed for %s (%s); using default configs",
                    tuple(q.shape), str(e).splitlines()[0] if str(e) else type(e).__name__)
        dispatch.mark_shape(*q.shape)


_CPU_DTYPES = (torch.float32, torch.bfloat16)
"""Activation dtypes given to torch's CPU int8 kernel (scales cast to the same dtype)."""


_CUDA_OK: dict[str, bool] = {}


def _cuda_kernels() -> bool:
    """Whether the Triton kernels can run on CUDA here (asked once: this is per forward)."""
    if "ok" not in _CUDA_OK:
        from trellm.kernels import kernel_supported

        _CUDA_OK["ok"] = kernel_supported("cuda")
    return _CUDA_OK["ok"]
