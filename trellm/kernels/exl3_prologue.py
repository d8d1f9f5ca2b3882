"""EXL3's input transform run by the kernel before the linear: RMSNorm (with the residual
add) or SiLU-and-mul, then ``had_r_128(y * suh[part])`` of each 128-input block.

Why: at decode every EXL3 linear ran its input transform as a launch of its own
(exl3_decode._in_kernel): 129 launches a token on the 8B shape, 548 of its 4,367 us
(H100, 2026-12-07, scripts/gpu_overhead.py --profile), most of it launch and memory
latency, not work. The norm before qkv / gate_up and the SiLU-and-mul before down already
read those activations; here they write the transformed parts themselves, so a linear
takes two launches instead of three (exl3_fast.run_layer_norm / run_layer_glu).

Arithmetic: bit for bit the unfused kernels'. The norm's rstd is summed as
rmsnorm._rms_norm_kernel sums it (the whole row in one tensor of the same block, on the
same number of warps, so the same reduction order), the normed value and the SiLU product
are rounded to the activation dtype as there, then _in_kernel's butterflies
(exl3_decode._fwht128; FastDispatch.in_fwht). A program takes one row, one 128-block and
one part; the norm's programs each sum their row again (a 4096-wide row is 8 KB, read
from L2) rather than wait for one another.
"""
from __future__ import annotations

import torch

from trellm.kernels._triton import tl, triton, pdl_begin, pdl_kwargs
from trellm.kernels.exl3_decode import _fwht128, _in_kernel
from trellm.quant.exl3.hadamard import HAD_SIZE, had_r_128

_HAD_SCALE = 0.08838834764831845  # 1 / sqrt(128), as _in_kernel


@triton.jit
def _transform_store(y, suh_ptr, out_ptr, part, row, cols, in_p, rows_p):
    """out[part, row, cols] = had_r_128(y * suh[part, cols]) for one 128-block (y float32 [128])."""
    v = y * tl.load(suh_ptr + part * in_p + cols).to(tl.float32)
    h = tl.reshape(_fwht128(tl.reshape(v, (1, 128)), 1), (128,)) * 0.08838834764831845
    tl.store(out_ptr + (part * rows_p + row) * in_p + cols, h.to(out_ptr.dtype.element_ty))


@triton.jit
def _norm_in_kernel(x_ptr, res_ptr, w_ptr, suh_ptr, out_ptr, res_out_ptr, stride_x, stride_r, stride_ro,
                    n_cols, in_p, rows_p, eps, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                    PDL: tl.constexpr = False):
    """Grid (rows, in_p / 128, parts). Part 0's programs also store the residual sum."""
    pdl_begin(PDL)
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    part = tl.program_id(2)
    # rstd exactly as _rms_norm_kernel computes it: same loads, same [BLOCK] sum
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / n_cols + eps)
    # this program's block, elementwise as there (padding past n_cols: zeros)
    cols = blk * 128 + tl.arange(0, 128)
    cmask = cols < n_cols
    xb = tl.load(x_ptr + row * stride_x + cols, mask=cmask, other=0.0)
    if HAS_RESIDUAL:
        rb = tl.load(res_ptr + row * stride_r + cols, mask=cmask, other=0.0)
        xb = (xb.to(tl.float32) + rb.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_ro + cols, xb, mask=cmask & (part == 0))
    normed = (xb.to(tl.float32) * rstd).to(x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0)
    y = (w.to(tl.float32) * normed.to(tl.float32)).to(x_ptr.dtype.element_ty)
    _transform_store(y.to(tl.float32), suh_ptr, out_ptr, part, row, cols, in_p, rows_p)


@triton.jit
def _glu_in_kernel(x_ptr, suh_ptr, out_ptr, stride_x, n_cols, in_p, rows_p, PDL: tl.constexpr = False):
    """Grid (rows, in_p / 128, parts): silu(gate) * up of x [rows, 2 n_cols], as
    activation._silu_and_mul_kernel computes it, then the transform."""
    pdl_begin(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * 128 + tl.arange(0, 128)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    y = (gate / (1.0 + tl.exp(-gate)) * up).to(x_ptr.dtype.element_ty)
    _transform_store(y.to(tl.float32), suh_ptr, out_ptr, tl.program_id(2), row, cols, in_p, rows_p)


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def norm_input_transform(suh: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                         eps: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(had_r_128(pad(RMSNorm(x + residual)) * suh[p]) [parts, M, in_p] in ``dtype``, x + residual).
    suh [parts, in_p]; x, residual [..., n] in one dtype, the norm weight too."""
    n = x.shape[-1]
    if weight.shape != (n,) or weight.dtype != x.dtype:
        raise ValueError(f"norm weight {tuple(weight.shape)}/{weight.dtype} for x [..., {n}]/{x.dtype}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual {tuple(residual.shape)}/{residual.dtype} does not match x {tuple(x.shape)}")
    parts, in_p = suh.shape
    x2 = _rows(x)
    m = x2.shape[0]
    out = torch.empty(parts, m, in_p, dtype=dtype, device=x.device)
    res_out = torch.empty_like(x, memory_format=torch.contiguous_format) if residual is not None else None
    r2 = _rows(residual) if residual is not None else x2
    ro2 = res_out.view(-1, n) if res_out is not None else x2
    if m:
        block = triton.next_power_of_2(n)
        _norm_in_kernel[(m, in_p // HAD_SIZE, parts)](
            x2, r2, weight, suh, out, ro2, x2.stride(0), r2.stride(0), ro2.stride(0), n, in_p, m, eps,
            BLOCK=block, HAS_RESIDUAL=residual is not None,
            num_warps=min(max(block // 512, 1), 16),  # rmsnorm._launch's: the same reduction order
            **pdl_kwargs(gpu_checked=False))
    return out, res_out


def glu_input_transform(suh: torch.Tensor, gate_up: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """had_r_128(pad(silu(gate) * up) * suh[p]) [parts, M, in_p] for gate_up [..., 2 n]."""
    if gate_up.shape[-1] % 2:
        raise ValueError(f"last dimension must be even (gate | up), got {gate_up.shape[-1]}")
    n = gate_up.shape[-1] // 2
    parts, in_p = suh.shape
    x2 = _rows(gate_up)
    m = x2.shape[0]
    out = torch.empty(parts, m, in_p, dtype=dtype, device=gate_up.device)
    if m:
        _glu_in_kernel[(m, in_p // HAD_SIZE, parts)](x2, suh, out, x2.stride(0), n, in_p, m, num_warps=1,
                                                     **pdl_kwargs(gpu_checked=False))
    return out


def fast_input_transform(f, x2: torch.Tensor, dtype: torch.dtype, frag_rows: int = 0) -> torch.Tensor:
    """The transform on its own (exl3_decode._in_kernel), for an exl3_fused.EXL3Fused f: x2
    [M, in_features] -> [parts, M, in_p], ``had_r_128(pad(x2) * suh[part])``, one launch.
    ``frag_rows`` (a multiple of 16, >= M): [parts, frag_rows, in_p] holding each part's
    rows in mma A-fragment order instead (exl3_decode.fragment_order_ref), rows past M zero."""
    from trellm.kernels.exl3_fast import get_dispatch

    m = x2.shape[0]
    rows = frag_rows or m
    if frag_rows and (frag_rows % 16 or frag_rows < m or dtype != torch.float16):
        raise ValueError(f"fragment order takes fp16 and whole 16-row blocks, got {frag_rows} rows for {m}, {dtype}")
    out = torch.empty(len(f.parts), rows, f.padded_in, dtype=dtype, device=x2.device)
    # FastDispatch.in_fwht: the Hadamard by butterflies, one row on one warp a 128-block
    fwht = get_dispatch().in_fwht
    bm, warps = (1, 1) if rows == 1 and fwht else (16, 8)
    grid = (triton.cdiv(rows, bm), f.padded_in // HAD_SIZE, len(f.parts))
    _in_kernel[grid](x2, f.suh, out, m, f.in_features, f.padded_in, x2.stride(0), rows, BM=bm, FRAG=frag_rows > 0,
                     FWHT=fwht, num_warps=warps, **pdl_kwargs(gpu_checked=False))
    return out


def _fused_plan(layer, m: int, n_in: int):
    """(f, cfg, dtype) where the layer's linear can take x transformed by the kernel before
    it, else None: one fused group, the decode dispatch (not prefill's reconstruct), a main
    kernel that reads the plain transformed layout, butterflies on (FastDispatch.fuse_in)."""
    from trellm.kernels import exl3_fast

    d = exl3_fast.get_dispatch()
    if not d.fuse_in or not d.in_fwht or len(layer.groups) != 1 or not 0 < m < d.reconstruct_min_rows:
        return None
    f = layer.groups[0]
    if not isinstance(f, exl3_fast.EXL3Fused) or f.in_features != n_in:
        return None
    cfg = exl3_fast.choose_config(m, d, f.bits)
    dtype = exl3_fast.plain_x_dtype(f, cfg)
    return None if dtype is None else (f, cfg, dtype)


def _linear(f, cfg, x2: torch.Tensor, xh: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    from trellm.kernels import exl3_fast

    m = x2.shape[0]
    if exl3_fast._can_fuse(f, cfg, m):
        y = torch.empty(m, f.out_features, dtype=dtype, device=x2.device)
        exl3_fast.fast_partials(f, x2, cfg, y, xh=xh)
        return y
    return exl3_fast.fast_output_transform(f, exl3_fast.fast_partials(f, x2, cfg, xh=xh), dtype)


def run_layer_norm(layer, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """(linear(RMSNorm(x + residual)), x + residual) with the transform in the norm's launch
    (residual None: x is the residual), or None where the plain path must run."""
    plan = _fused_plan(layer, _nrows(x), x.shape[-1])
    if plan is None or weight.dtype != x.dtype:
        return None
    f, cfg, xdt = plan
    xh, res = norm_input_transform(f.suh, x, residual, weight, eps, xdt)
    y = _linear(f, cfg, _rows(x), xh, x.dtype)
    return y.reshape(*x.shape[:-1], f.out_features), (x if residual is None else res)


def run_layer_glu(layer, gate_up: torch.Tensor):
    """linear(silu(gate) * up) with the transform in the SiLU-and-mul launch, or None."""
    plan = _fused_plan(layer, _nrows(gate_up), gate_up.shape[-1] // 2)
    if plan is None or gate_up.shape[-1] % 2:
        return None
    f, cfg, xdt = plan
    xh = glu_input_transform(f.suh, gate_up, xdt)
    y = _linear(f, cfg, _rows(gate_up), xh, gate_up.dtype)
    return y.reshape(*gate_up.shape[:-1], f.out_features)


def layer_input_transform(layer, rows: int):
    """quant.base.InputTransform for the kernel before a one-part layer (o_proj: the decode
    attention, paged_decode's ``xform``), or None."""
    from trellm.quant.base import InputTransform

    plan = _fused_plan(layer, rows, layer.in_features)
    if plan is None or len(plan[0].parts) != 1:
        return None
    return InputTransform(plan[0].suh[0], plan[2])


def run_layer_transformed(layer, x: torch.Tensor, xh: torch.Tensor) -> torch.Tensor:
    """The layer's output from x [..., in] and xh [rows, in_p] as layer_input_transform
    asked for it."""
    f, cfg, _ = _fused_plan(layer, _nrows(x), x.shape[-1])
    x2 = _rows(x)
    y = _linear(f, cfg, x2, xh.view(1, x2.shape[0], f.padded_in), x.dtype)
    return y.reshape(*x.shape[:-1], f.out_features)


def _nrows(x: torch.Tensor) -> int:
    return x.numel() // max(1, x.shape[-1])


def _transform_ref(suh: torch.Tensor, y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    y2 = y.reshape(-1, y.shape[-1]).float()
    yp = torch.nn.functional.pad(y2, (0, suh.shape[1] - y2.shape[1]))
    return torch.stack([had_r_128(yp * s.float()) for s in suh]).to(dtype)


def norm_input_transform_ref(suh, x, residual, weight, eps, dtype):
    from trellm.layers.norm_rope import rms_norm_reference

    h = x if residual is None else x + residual
    return _transform_ref(suh, rms_norm_reference(h, weight, eps), dtype), (None if residual is None else h)


def glu_input_transform_ref(suh, gate_up, dtype):
    gate, up = gate_up.chunk(2, dim=-1)
    return _transform_ref(suh, (torch.nn.functional.silu(gate.float()) * up.float()).to(gate_up.dtype), dtype)
