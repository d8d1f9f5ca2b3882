"""RMSNorm and fused residual-add + RMSNorm in Triton.

Arithmetic follows transformers' LlamaRMSNorm (trellm/layers/norm_rope.py): the
residual sum is rounded to the activation dtype (as ``x + residual`` in PyTorch),
normalized in float32, cast back to the activation dtype, then multiplied by the
weight (product rounded to the promoted dtype). One program normalizes one row.
"""
from __future__ import annotations

import torch

from trellm.kernels._triton import tl, triton, pdl_begin, pdl_kwargs
from trellm.layers.norm_rope import rms_norm_reference


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    stride_x, stride_r, stride_o, stride_ro,
    n_cols, eps,
    BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, PDL: tl.constexpr = False,
):
    pdl_begin(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_ro + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / n_cols + eps)
    normed = (xf * rstd).to(x_ptr.dtype.element_ty)  # cast back before the weight
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    y = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x.reshape(-1, x.shape[-1])


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    n = x.shape[-1]
    if weight.shape != (n,):
        raise ValueError(f"weight {tuple(weight.shape)} does not match hidden size {n}")
    x2 = _rows(x)
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    out2 = out.view(-1, n)
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(f"residual {tuple(residual.shape)}/{residual.dtype} does not match x "
                             f"{tuple(x.shape)}/{x.dtype}")
        r2 = _rows(residual)
        res_out = torch.empty_like(x, memory_format=torch.contiguous_format)
        ro2 = res_out.view(-1, n)
    else:
        r2, ro2, res_out = x2, out2, None
    if x2.shape[0] == 0:
        return out, res_out
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(x2.shape[0],)](
        x2, r2, weight, out2, ro2,
        x2.stride(0), r2.stride(0), out2.stride(0), ro2.stride(0),
        n, eps,
        BLOCK=block, HAS_RESIDUAL=residual is not None,
        num_warps=min(max(block // 512, 1), 16), **pdl_kwargs(),
    )
    return out, res_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension of x (any leading shape)."""
    return _launch(x, None, weight, eps)[0]


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return rms_norm_reference(x, weight, eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual), x + residual) in one pass: the decoder layer's
    ``h = h + sublayer_out; normed = norm(h)``. Inputs are not modified."""
    out, res = _launch(x, residual, weight, eps)
    return out, res


def fused_add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    new_residual = x + residual
    return rms_norm_reference(new_residual, weight, eps), new_residual
