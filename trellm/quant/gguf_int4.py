"""GGUF Q4_0 / Q4_1 linear weights kept packed: torch's CPU int4 weight-only matmul.

Decode on CPU is memory-bandwidth bound, so reading 4-bit weights instead of
float32 ones is most of the speed. ``torch._weight_int4pack_mm_for_cpu`` computes
``x_bf16 @ w.T`` with ``w = (q - 8) * scale + zero`` per group of 32 input
elements, ``scale``/``zero`` in bfloat16. GGUF blocks are also 32 wide, so:

* Q4_0 (``w = d * (q - 8)``): scale = d, zero = 0;
* Q4_1 (``w = d * q + m``):   scale = d, zero = m + 8 d.

Exact up to bfloat16 rounding of scale, zero, the activations and the output.

Checkpoint tensors reach the layer as ``Q4Tensor`` (still quantized, in GGUF's
own form); the layer stages them in small buffers (MergedLinear shards fill their
row ranges) and packs once everything is loaded. Where the kernel is missing or
the weights are not on the CPU the method dequantizes at load time and behaves
as the unquantized one.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from trellm.quant.base import LinearMethod

GROUP = 32
"""Weights per GGUF block = per int4 scale/zero group."""
DENSE_MIN_ROWS = 64
"""From this many rows (prefill chunks) the int4 kernel, which re-expands the weights
for every row block, loses to dequantizing once and running an fp32 GEMM (measured on
a 2-core AVX2 machine: 3072x576 at 512 rows, 34 ms int4 vs 1.4 ms dequant + 15 ms fp32)."""
Q4_TYPES = ("Q4_0", "Q4_1")
"""GGUF tensor types this method keeps packed."""
_BLOCK_BYTES = {"Q4_0": 2 + 16, "Q4_1": 2 + 2 + 16}
_LINEAR_WEIGHT = re.compile(r"^model\.layers\.\d+\.(self_attn|mlp)\.[a-z_]+_proj\.weight$")


def is_linear_weight(hf_name: str) -> bool:
    """Whether an HF tensor name is a decoder-layer linear weight (q/k/v/o, gate/up/down):
    the tensors this method may keep packed. Embedding, LM head and norms are not."""
    return _LINEAR_WEIGHT.match(hf_name) is not None


@dataclass(frozen=True)
class Q4Tensor:
    """A still-quantized GGUF Q4_0 / Q4_1 weight in its own form.

    ``w[n, k] = (q[n, k] - offset) * scale[n, k // 32] (+ zero[n, k // 32])`` where
    ``offset`` is 8 for Q4_0 (``zero`` None) and 0 for Q4_1 (``zero`` = the block min):
    the very operations ``gguf.quants.dequantize`` does, so ``dequantize()`` matches
    it bit for bit.
    """

    q: torch.Tensor
    """uint8 [N, K], values 0..15."""
    scale: torch.Tensor
    """float32 [N, K / 32]: the block scale d."""
    zero: torch.Tensor | None
    """float32 [N, K / 32]: the block min m (Q4_1); None for Q4_0."""

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    @property
    def offset(self) -> int:
        return 8 if self.zero is None else 0

    def dequantize(self) -> torch.Tensor:
        return dequantize_reference(self.q, self.scale, self.zero, self.offset)

    def int4mm_zero(self) -> torch.Tensor:
        """The kernel's zero (float32): ``w = (q - 8) * scale + zero``."""
        shifted = (8 - self.offset) * self.scale
        return shifted if self.zero is None else shifted + self.zero


def dequantize_reference(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                         offset: int = 8) -> torch.Tensor:
    """Float32 ``(q - offset) * scale (+ zero)``, scale/zero broadcast over groups of 32.

    With ``offset=8`` this is what ``_weight_int4pack_mm_for_cpu`` computes from its
    (bf16-rounded) scale and zero; it is the fallback and the tests' reference.
    """
    s = scale.float().repeat_interleave(GROUP, dim=-1)
    w = (q.float() - offset) * s
    return w if zero is None else w + zero.float().repeat_interleave(GROUP, dim=-1)


def q4_from_gguf(data: np.ndarray, type_name: str, shape: tuple[int, int]) -> Q4Tensor:
    """Decode a GGUF Q4_0 / Q4_1 tensor (raw uint8 blocks) without dequantizing.

    A block is fp16 d (Q4_1: then fp16 m) and 16 bytes of nibbles; as in ggml, the
    low nibbles are elements 0..15 and the high nibbles elements 16..31.
    """
    n, k = shape
    if type_name not in _BLOCK_BYTES or k % GROUP:
        raise ValueError(f"not a Q4_0/Q4_1 tensor of K divisible by {GROUP}: {type_name} {shape}")
    blocks = np.asarray(data, dtype=np.uint8).reshape(n, k // GROUP, _BLOCK_BYTES[type_name])

    def half(col: int) -> np.ndarray:  # fp16 at byte `col` of each block -> float32 [N, K/32]
        return np.ascontiguousarray(blocks[..., col:col + 2]).view(np.float16)[..., 0].astype(np.float32)

    nib = blocks[..., -16:]
    q = np.concatenate([nib & 0x0F, nib >> 4], axis=-1).reshape(n, k)
    zero = torch.from_numpy(half(2)) if type_name == "Q4_1" else None
    return Q4Tensor(torch.from_numpy(np.ascontiguousarray(q)), torch.from_numpy(half(0)), zero)


def int4_kernel_available() -> bool:
    return hasattr(torch, "_weight_int4pack_mm_for_cpu") and hasattr(
        torch, "_convert_weight_to_int4pack_for_cpu")


class GGUFQ4LinearMethod(LinearMethod):
    """Packed int4 weights, bf16 activations (CPU); dense fallback elsewhere.

    Layer state: before ``process_after_loading`` the ``weight`` parameter is a uint8
    [N, K] staging buffer of q (one byte a weight, not four: it is all resident until
    packing) with float32 ``q4_scale`` / ``q4_zero`` [N, K/32] buffers in the kernel's
    convention; after it, ``q4_packed`` and bf16 ``q4_scales_and_zeros`` [K/32, N, 2]
    (or a dense ``weight`` on the fallback path).
    """

    def create_weights(self, layer, in_features, out_features, bias, dtype):
        if in_features % GROUP:
            raise ValueError(f"gguf_q4 needs in_features divisible by {GROUP}, got {in_features}")
        groups = in_features // GROUP
        layer.q4_dtype = dtype
        # Uninitialized: the model's loader fails unless every row is written.
        layer.weight = torch.nn.Parameter(torch.empty(out_features, in_features, dtype=torch.uint8),
                                          requires_grad=False)
        # Buffers, not parameters: the model's loader must only see `weight` (and bias).
        layer.register_buffer("q4_scale", torch.empty(out_features, groups), persistent=False)
        layer.register_buffer("q4_zero", torch.empty(out_features, groups), persistent=False)
        layer.bias = (torch.nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False)
                      if bias else None)

    def load_weight(self, layer, param_name, tensor, rows):
        if param_name != "weight":
            return False  # bias: a plain copy
        if not isinstance(tensor, Q4Tensor):
            raise ValueError(f"gguf_q4 layer got a {type(tensor).__name__} weight, not a Q4Tensor")
        start, size = rows if rows is not None else (0, layer.weight.shape[0])
        want = (size, layer.weight.shape[1])
        if tensor.shape != want:
            raise ValueError(f"shape mismatch for weight rows {start}:{start + size}: "
                             f"checkpoint {tensor.shape}, model {want}")
        layer.weight.data.narrow(0, start, size).copy_(tensor.q)
        layer.q4_scale.narrow(0, start, size).copy_(tensor.scale)
        layer.q4_zero.narrow(0, start, size).copy_(tensor.int4mm_zero())
        return True

    def process_after_loading(self, layer):
        q, scale, zero = layer.weight.data, layer.q4_scale, layer.q4_zero
        del layer.weight, layer.q4_scale, layer.q4_zero
        if q.device.type != "cpu" or not int4_kernel_available():
            dense = dequantize_reference(q, scale, zero).to(layer.q4_dtype)
            layer.weight = torch.nn.Parameter(dense, requires_grad=False)
            return
        packed = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
        layer.register_buffer("q4_packed", packed, persistent=False)
        sz = torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous()
        layer.register_buffer("q4_scales_and_zeros", sz, persistent=False)
        # Our own nibble copy (half a byte a weight) for the dense prefill path, with the
        # same bf16-rounded scale/zero so both paths use identical weights.
        half = q.shape[1] // 2
        layer.register_buffer("q4_nibbles", q[:, :half] | (q[:, half:] << 4), persistent=False)
        groups = q.shape[1] // GROUP
        layer.register_buffer("q4_dense_scale", sz[..., 0].t().float().reshape(-1, groups, 1).contiguous(),
                              persistent=False)
        layer.register_buffer("q4_dense_zero", (sz[..., 1].t().float() - 8 * sz[..., 0].t().float())
                              .reshape(-1, groups, 1).contiguous(), persistent=False)

    def apply(self, layer, x):
        if getattr(layer, "q4_packed", None) is None:
            return F.linear(x, layer.weight, layer.bias)
        x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        if x2.shape[0] >= DENSE_MIN_ROWS:
            # The kernel's roundings (bf16 activations in, bf16 out) around a float32 GEMM:
            # a prompt computed here and the same tokens computed by the kernel (the short
            # tail after a prefix-cache hit, a small chunk) then differ only in summation
            # order, not by bf16-vs-float32 activations, which flipped greedy choices.
            xb = x2.to(torch.bfloat16).float()
            y = F.linear(xb, dense_weight(layer)).to(torch.bfloat16).reshape(*x.shape[:-1], -1)
            return y if layer.bias is None else y + layer.bias
        if x2.dtype != torch.bfloat16:
            x2 = x2.to(torch.bfloat16)
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        y = torch._weight_int4pack_mm_for_cpu(x2, layer.q4_packed, GROUP, layer.q4_scales_and_zeros)
        # Left in the kernel's bf16: the consumers (residual add, RoPE with float32
        # tables, attention, the next int4 matmul) promote or cast anyway, so a cast
        # back here would be a wasted op per linear. The checks above and below skip
        # no-op dispatches: a decode step is ~2,300 small ops on the CPU, ~1 us each.
        if x.dim() != 2:
            y = y.reshape(*x.shape[:-1], y.shape[-1])
        return y if layer.bias is None else y + layer.bias


def cache_dense_weight(layer) -> int:
    """Keep the layer's float32 prefill weight resident (see ``ModelConfig.
    prefill_weight_cache_memory``); returns its size in bytes."""
    layer.q4_dense_cache = None
    layer.q4_dense_cache = dense_weight(layer)
    return layer.q4_dense_cache.numel() * 4


def dense_weight(layer) -> torch.Tensor:
    """Float32 [N, K] from the layer's nibble copy: ``q * scale + (zero - 8 * scale)``,
    the kernel's formula with its bf16-rounded scale and zero."""
    cached = getattr(layer, "q4_dense_cache", None)
    if cached is not None:
        return cached
    p = layer.q4_nibbles
    n, groups = p.shape[0], layer.q4_dense_scale.shape[1]
    q = torch.cat((p & 15, p >> 4), dim=1).view(n, groups, GROUP).float()
    return torch.addcmul(layer.q4_dense_zero, q, layer.q4_dense_scale).reshape(n, groups * GROUP)
