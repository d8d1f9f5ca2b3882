"""SiLU-and-mul (the gated MLP's ``silu(gate) * up``) in Triton.

Input is the merged gate_up projection output [..., 2 * I] laid out [gate | up]
(trellm/layers/linear.py MergedLinear); output [..., I]. Math in float32, rounded
once (PyTorch rounds after the SiLU and again after the product: within one ulp).
The skinny GEMV's ``glu`` mode (trellm/kernels/gemv.py) computes the same expression
while loading the down projection's input, so the two must stay identical.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from trellm.kernels._triton import tl, triton, pdl_begin, pdl_kwargs

_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, n_cols, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_begin(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_cols
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n_cols + offs, mask=mask, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up  # mirrored in gemv._gemv_kernel (GLU): change both
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :I]) * x[..., I:] for x [..., 2I]."""
    if x.shape[-1] % 2:
        raise ValueError(f"last dimension must be even (gate | up), got {x.shape[-1]}")
    n = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1]) if x.stride(-1) == 1 else x.contiguous().reshape(-1, x.shape[-1])
    out = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    out2 = out.view(-1, n)
    if x2.shape[0] and n:
        block = min(_BLOCK, triton.next_power_of_2(n))
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(n, block))](
            x2, out2, x2.stride(0), out2.stride(0), n, BLOCK=block, num_warps=4, **pdl_kwargs())
    return out


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """The model's MLP arithmetic (trellm/model/llama.py MLP.forward)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
