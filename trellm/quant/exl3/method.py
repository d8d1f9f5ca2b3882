"""EXL3 linear layers: the ``LinearMethod`` for checkpoints whose
``quantization_config.quant_method`` is ``"exl3"``.

Merged layers (q/k/v -> qkv_proj, gate/up -> gate_up_proj) keep one ``EXL3Weight``
per checkpoint projection and concatenate the outputs. The projections cannot be
stacked into one trellis: each has its own input scales ``suh`` (so the input
Hadamard differs), its own output Hadamard over its own 128-blocks and its own K,
and the smaller ones (k/v of a GQA model) may be padded to 128 columns. A future
kernel may still fuse them (one launch over several parts); the layout leaves that
open since the parts are a list in output order.

Forward: a layer kernel (``register_layer_kernel``) may take the whole layer: at load
time its ``prepare`` gets the parts and returns its own state (or None to decline),
and the parts are replaced by the state's (trellm/kernels/exl3_fast.py concatenates
the trellises of parts that share K and codebook, the parts keep views, and runs the
layer in 2-3 launches). Otherwise, per part, the first registered kernel
(``register_kernel``) that says it supports a part and an input runs it; else the
pure-PyTorch reference (``reference.py``), which is the CPU path. The Triton kernels
(trellm/kernels/exl3_gemv.py, exl3_fast.py) register themselves below; they take
CUDA tensors of integer-K parts only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from trellm.quant.base import LinearMethod
from trellm.quant.exl3.codebook import CODEBOOKS
from trellm.quant.exl3.reference import dense_weight, forward_reference
from trellm.quant.exl3.weight import TENSOR_NAMES, EXL3Weight

DENSE_HEAD_BITS = 16
"""``head_bits`` meaning "the LM head is kept in fp16" (converter flag ``-hb 16``)."""


@dataclass(frozen=True)
class EXL3Config:
    """The checkpoint's ``quantization_config`` as far as loading needs it. Each tensor's
    own K comes from its trellis and its codebook from its marker tensor; these say
    what the converter aimed for (and what dummy weights use)."""

    bits: float | None = None
    """Average decoder bits per weight (may be fractional: K is per tensor)."""
    head_bits: int = 6
    """The LM head's K; 16 = an unquantized head. 6 is the converter's default."""
    codebook: str = "mul1"
    """'mul1' (the converter's default), 'mcg' or '3inst'."""

    @classmethod
    def from_dict(cls, qc: dict) -> "EXL3Config":
        codebook = str(qc.get("codebook", "mul1")).lower()
        if codebook not in CODEBOOKS:
            raise ValueError(f"unknown EXL3 codebook {codebook!r} (known: {', '.join(CODEBOOKS)})")
        bits = qc.get("bits")
        return cls(bits=None if bits is None else float(bits), head_bits=int(qc.get("head_bits", 6)),
                   codebook=codebook)


@dataclass(frozen=True)
class EXL3Kernel:
    """A faster implementation of ``forward_reference`` for some parts and inputs."""

    name: str
    supports: Callable[[EXL3Weight, torch.Tensor], bool]
    """(part, x) -> whether ``run`` handles it (device, K, codebook, rows, ...)."""
    run: Callable[[EXL3Weight, torch.Tensor], torch.Tensor]
    """(part, x [..., in]) -> y [..., out_features] in x.dtype, bias included."""


@dataclass(frozen=True)
class EXL3LayerKernel:
    """A kernel for all the parts of a (merged) layer at once."""

    name: str
    prepare: Callable[[list[EXL3Weight]], Any]
    """(parts) at load time -> a state with a ``parts`` attribute (the parts to keep, e.g.
    views into a fused trellis), or None to leave the layer to the per-part kernels."""
    supports: Callable[[Any, torch.Tensor], bool]
    """(state, x) -> whether ``run`` handles x; asked per forward, so cheap."""
    run: Callable[[Any, torch.Tensor], torch.Tensor]
    """(state, x [..., in]) -> y [..., out_features] (all parts, bias included)."""
    run_norm: Callable[..., Any] | None = None
    """(state, x, residual, norm weight, eps) -> (linear(RMSNorm(x + residual)), x + residual)
    with the norm in the kernel's own launches, or None where it takes no part
    (LinearMethod.apply_norm)."""
    run_glu: Callable[..., Any] | None = None
    """(state, gate_up) -> linear(silu(gate) * up), or None (LinearMethod.apply_glu)."""
    input_transform: Callable[..., Any] | None = None
    """(state, rows) -> quant.base.InputTransform or None (LinearMethod.input_transform)."""
    run_transformed: Callable[..., Any] | None = None
    """(state, x, xh) -> y (LinearMethod.apply_transformed)."""


_LAYER_KERNELS: list[EXL3LayerKernel] = []
"""Registered layer kernels, most recently registered first."""


def register_layer_kernel(kernel: EXL3LayerKernel) -> None:
    _LAYER_KERNELS.insert(0, kernel)


def unregister_layer_kernel(name: str) -> None:
    _LAYER_KERNELS[:] = [k for k in _LAYER_KERNELS if k.name != name]


def prepare_layer_kernel(parts: list[EXL3Weight]) -> tuple[EXL3LayerKernel, Any] | None:
    """The first layer kernel that takes these parts, with its state."""
    for kernel in _LAYER_KERNELS:
        state = kernel.prepare(parts)
        if state is not None:
            return kernel, state
    return None


_KERNELS: list[EXL3Kernel] = []
"""Registered kernels, most recently registered first; the reference is the fallback."""


def register_kernel(kernel: EXL3Kernel) -> None:
    """Add a kernel; it is tried before those registered earlier."""
    _KERNELS.insert(0, kernel)


def unregister_kernel(name: str) -> None:
    _KERNELS[:] = [k for k in _KERNELS if k.name != name]


def select_kernel(part: EXL3Weight, x: torch.Tensor) -> Callable[[EXL3Weight, torch.Tensor], torch.Tensor]:
    """The first registered kernel that supports (part, x), else ``forward_reference``."""
    for kernel in _KERNELS:
        if kernel.supports(part, x):
            return kernel.run
    return forward_reference


class EXL3LinearMethod(LinearMethod):
    """Trellis-coded weights, decoded by a registered kernel or the reference.

    Layer state: while loading, ``exl3_staging`` maps each projection's output rows
    (start, size) to its checkpoint tensors; after ``process_after_loading``,
    ``exl3_parts`` is the list of checked ``EXL3Weight`` in output order, on the
    layer's device. They are plain attributes, not buffers: the model is built on
    its device and never moved, and the kernels take the frozen ``EXL3Weight``.
    """

    dense = False
    """Subclass flag: decode once at load time and run a dense matmul."""

    def __init__(self, config: EXL3Config | None = None):
        self.config = config or EXL3Config()

    @classmethod
    def from_config(cls, quantization_config: dict) -> "EXL3LinearMethod":
        return cls(EXL3Config.from_dict(quantization_config))

    @classmethod
    def for_lm_head(cls, quantization_config: dict) -> "EXL3LinearMethod | None":
        # The converter quantizes the head at head_bits, and stores it as lm_head.*
        # even when the embeddings are tied; 16 keeps it an ordinary fp16 weight.
        method = cls.from_config(quantization_config)
        return None if method.config.head_bits >= DENSE_HEAD_BITS else method

    def create_weights(self, layer, in_features, out_features, bias, dtype):
        layer.exl3_has_bias = bias
        layer.exl3_dtype = dtype
        layer.exl3_device = torch.empty(0).device  # the device the model is being built on
        layer.exl3_staging = {}
        layer.exl3_parts = []
        layer.exl3_layer_kernel = None
        layer.bias = None

    def checkpoint_names(self, layer):
        # 'weight' and the legacy 'scale' are accepted only to be refused with a clear message.
        return TENSOR_NAMES + ("weight", "scale")

    def load_weight(self, layer, param_name, tensor, rows):
        if param_name == "weight":
            raise ValueError("a dense 'weight' for an EXL3 layer: mixed dense/EXL3 projections "
                             "are not supported")
        if param_name == "scale":
            raise ValueError("legacy EXL3 global 'scale' tensors are not supported (re-convert the model)")
        key = rows if rows is not None else (0, layer.out_features)
        part = layer.exl3_staging.setdefault(key, {})
        if param_name in part:
            raise ValueError(f"EXL3 tensor {param_name!r} for rows {key[0]}:{sum(key)} given twice")
        part[param_name] = tensor
        return True

    def process_after_loading(self, layer):
        staged, layer.exl3_staging = layer.exl3_staging, {}
        sizes = getattr(layer, "out_sizes", [layer.out_features])
        expected = [(sum(sizes[:i]), s) for i, s in enumerate(sizes)]
        missing = [k for k in expected if k not in staged]
        if missing:
            start, size = missing[0]
            raise ValueError(f"no EXL3 tensors for output rows {start}:{start + size}")
        parts = []
        for start, size in expected:
            part = EXL3Weight.from_tensors(staged[(start, size)], layer.in_features, size)
            if (part.bias is not None) != layer.exl3_has_bias:
                raise ValueError(f"rows {start}:{start + size}: bias {'present' if part.bias is not None else 'missing'}"
                                 f" but the layer is {'with' if layer.exl3_has_bias else 'without'} bias")
            parts.append(part.to(layer.exl3_device))
        if self.dense:
            self._densify(layer, parts)
            return
        layer.exl3_layer_kernel = prepare_layer_kernel(parts)
        if layer.exl3_layer_kernel is not None:
            parts = list(layer.exl3_layer_kernel[1].parts)  # e.g. views of a fused trellis
        layer.exl3_parts = parts

    @staticmethod
    def _densify(layer, parts: list[EXL3Weight]) -> None:
        weight = torch.cat([dense_weight(p) for p in parts]).to(layer.exl3_dtype)
        layer.weight = torch.nn.Parameter(weight, requires_grad=False)
        if layer.exl3_has_bias:
            bias = torch.cat([p.bias for p in parts]).to(layer.exl3_dtype)
            layer.bias = torch.nn.Parameter(bias, requires_grad=False)

    def apply(self, layer, x):
        if self.dense:
            return F.linear(x, layer.weight, layer.bias)
        prepared = getattr(layer, "exl3_layer_kernel", None)
        if prepared is not None and prepared[0].supports(prepared[1], x):
            return prepared[0].run(prepared[1], x)
        ys = [select_kernel(p, x)(p, x) for p in layer.exl3_parts]
        return ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)


    def _fused(self, layer, x, which: str):
        prepared = None if self.dense else getattr(layer, "exl3_layer_kernel", None)
        if prepared is None or getattr(prepared[0], which) is None or not prepared[0].supports(prepared[1], x):
            return None
        return prepared

    def apply_norm(self, layer, x, residual, weight, eps):
        prepared = self._fused(layer, x, "run_norm")
        return None if prepared is None else prepared[0].run_norm(prepared[1], x, residual, weight, eps)

    def input_transform(self, layer, rows, dtype, device):
        prepared = None if self.dense else getattr(layer, "exl3_layer_kernel", None)
        if prepared is None or prepared[0].input_transform is None or prepared[0].run_transformed is None:
            return None
        spec = prepared[0].input_transform(prepared[1], rows)
        # the layer kernel must take such an x at all, as apply asks it (a 0-row stand-in)
        if spec is None or not prepared[0].supports(prepared[1], torch.empty(0, layer.in_features, dtype=dtype,
                                                                              device=device)):
            return None
        return spec

    def apply_transformed(self, layer, x, xh):
        prepared = layer.exl3_layer_kernel
        return prepared[0].run_transformed(prepared[1], x, xh)

    def apply_glu(self, layer, gate_up):
        # supports() checks x's width against the layer's: gate_up is twice that
        prepared = self._fused(layer, gate_up[..., : gate_up.shape[-1] // 2], "run_glu")
        return None if prepared is None else prepared[0].run_glu(prepared[1], gate_up)


class EXL3DenseLinearMethod(EXL3LinearMethod):
    """``--quantization none`` on an EXL3 checkpoint: the same loading, then the weights
    are reconstructed once (in --dtype) and run as a dense matmul."""

    dense = True


def _register_triton_kernels() -> None:
    # Importing the module needs no GPU (nor Triton): its kernels decline CPU inputs.
    from trellm.kernels import exl3_fast, exl3_gemv

    exl3_gemv.register()
    exl3_fast.register()


_register_triton_kernels()
