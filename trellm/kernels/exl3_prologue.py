"""EXL3's input transform run by the kernel before the linear: RMSNorm (with the residual
add) or SiLU-and-mul, then ``had_r_128(y * suh[part])`` of each 128-input block.

Why: at decode every EXL3 linear ran its input transform as a launch of its own
(exl3_decode._in_kernel): 129 launches a token on the 8B shape, 548 of its 4,367 us
(H100, 2026-12-07, scripts/gpu_overhead.py --profile), most of it launch and memory
latency, not work. The norm before qkv / gate_up and the SiLU-and-mul before down already
read those activations; here they write the transformed parts themselves, in the layout the
main kernel reads (x_layout: plain rows for one row, exl3_mma's fragment order for
2-32), so a linear takes two launches instead of three (run_layer_norm / run_layer_glu; the
decode attention does the same for o_proj at one row, paged_attention's ``xform``).

Arithmetic: bit for bit the unfused kernels'. The norm's rstd is summed as
rmsnorm._rms_norm_kernel sums it (the whole row in one tensor of the same block, on the
same number of warps, so the same reduction order), the normed value and the SiLU product
are rounded to the activation dtype as there, then _in_kernel's butterflies
(exl3_decode._fwht128; FastDispatch.in_fwht). A program takes one row and one 128-block
(the norm's: of every part); the norm's programs each sum their row again (a 4096-wide
row is 8 KB, read from L2) rather than wait for one another.
"""
from __future__ import annotations

import torch

from trellm.kernels._triton import tl, triton, pdl_begin, pdl_kwargs
from trellm.kernels.exl3_decode import _frag_elems, _fwht128, _in_kernel
from trellm.quant.exl3.hadamard import HAD_SIZE, had_r_128

@triton.jit
def _transform_store(y, suh_ptr, out_ptr, part, row, blk, in_p, rows_p, FRAG: tl.constexpr):
    """Row ``row`` of block ``blk`` of part ``part``: had_r_128(y * suh[part, block]) (y float32
    [128]), at out[part, row, block], or with FRAG where exl3_decode._frag_offsets puts it."""
    c = tl.arange(0, 128)
    v = y * tl.load(suh_ptr + part * in_p + blk * 128 + c).to(tl.float32)
    h = (tl.reshape(_fwht128(tl.reshape(v, (1, 128)), 1), (128,)) * 0.08838834764831845).to(out_ptr.dtype.element_ty)
    base = out_ptr + (part * rows_p).to(tl.int64) * in_p
    if FRAG:
        tl.store(base + _frag_elems(row, c, blk, in_p), h)
    else:
        tl.store(base + row * in_p + blk * 128 + c, h)


@triton.jit
def _norm_in_kernel(x_ptr, res_ptr, w_ptr, suh_ptr, out_ptr, res_out_ptr, stride_x, stride_r, stride_ro,
                    M, n_cols, in_p, rows_p, parts, eps, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                    FRAG: tl.constexpr = False, PDL: tl.constexpr = False):
    """Grid (rows_p, in_p / 128): a program sums its row once and writes its block of every
    part (a program a part would read the row once a part: at 32 rows of qkv, 3 x 1,024 row
    reads). Rows past M (FRAG's padding to whole row blocks) store zeros."""
    pdl_begin(PDL)
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    live = row < M
    # rstd exactly as _rms_norm_kernel computes it: same loads, same [BLOCK] sum
    offs = tl.arange(0, BLOCK)
    mask = (offs < n_cols) & live
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / n_cols + eps)
    # this program's block, elementwise as there (padding past n_cols: zeros)
    cols = blk * 128 + tl.arange(0, 128)
    cmask = (cols < n_cols) & live
    xb = tl.load(x_ptr + row * stride_x + cols, mask=cmask, other=0.0)
    if HAS_RESIDUAL:
        rb = tl.load(res_ptr + row * stride_r + cols, mask=cmask, other=0.0)
        xb = (xb.to(tl.float32) + rb.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_ro + cols, xb, mask=cmask)
    normed = (xb.to(tl.float32) * rstd).to(x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0)
    y = (w.to(tl.float32) * normed.to(tl.float32)).to(x_ptr.dtype.element_ty)
    y = tl.where(cmask, y.to(tl.float32), 0.0)  # a padding row's rstd may be inf (eps 0): 0, not NaN
    for part in range(parts):
        _transform_store(y, suh_ptr, out_ptr, part, row, blk, in_p, rows_p, FRAG)


@triton.jit
def _glu_in_kernel(x_ptr, suh_ptr, out_ptr, stride_x, M, n_cols, in_p, rows_p, FRAG: tl.constexpr = False,
                   PDL: tl.constexpr = False):
    """Grid (rows_p, in_p / 128, parts): silu(gate) * up of x [M, 2 n_cols], as
    activation._silu_and_mul_kernel computes it, then the transform (rows past M: zeros)."""
    pdl_begin(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * 128 + tl.arange(0, 128)
    mask = (cols < n_cols) & (row < M)
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    y = (gate / (1.0 + tl.exp(-gate)) * up).to(x_ptr.dtype.element_ty)
    _transform_store(y.to(tl.float32), suh_ptr, out_ptr, tl.program_id(2), row, tl.program_id(1), in_p, rows_p, FRAG)


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def norm_input_transform(suh: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                         eps: float, dtype: torch.dtype, frag_rows: int = 0
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(had_r_128(pad(RMSNorm(x + residual)) * suh[p]) [parts, M, in_p] in ``dtype``, x + residual).
    suh [parts, in_p]; x, residual [..., n] in one dtype, the norm weight too. ``frag_rows``:
    [parts, frag_rows, in_p] in fragment order instead (as fast_input_transform's)."""
    n = x.shape[-1]
    if weight.shape != (n,) or weight.dtype != x.dtype:
        raise ValueError(f"norm weight {tuple(weight.shape)}/{weight.dtype} for x [..., {n}]/{x.dtype}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual {tuple(residual.shape)}/{residual.dtype} does not match x {tuple(x.shape)}")
    parts, in_p = suh.shape
    x2 = _rows(x)
    m = x2.shape[0]
    rows = _check_frag(frag_rows, m, dtype)
    out = torch.empty(parts, rows, in_p, dtype=dtype, device=x.device)
    res_out = torch.empty_like(x, memory_format=torch.contiguous_format) if residual is not None else None
    r2 = _rows(residual) if residual is not None else x2
    ro2 = res_out.view(-1, n) if res_out is not None else x2
    if m:
        block = triton.next_power_of_2(n)
        _norm_in_kernel[(rows, in_p // HAD_SIZE)](
            x2, r2, weight, suh, out, ro2, x2.stride(0), r2.stride(0), ro2.stride(0), m, n, in_p, rows, parts, eps,
            BLOCK=block, HAS_RESIDUAL=residual is not None, FRAG=frag_rows > 0,
            num_warps=min(max(block // 512, 1), 16),  # rmsnorm._launch's: the same reduction order
            **pdl_kwargs(gpu_checked=False))
    return out, res_out


def glu_input_transform(suh: torch.Tensor, gate_up: torch.Tensor, dtype: torch.dtype,
                        frag_rows: int = 0) -> torch.Tensor:
    """had_r_128(pad(silu(gate) * up) * suh[p]) [parts, M, in_p] for gate_up [..., 2 n]
    (``frag_rows``: as norm_input_transform's)."""
    if gate_up.shape[-1] % 2:
        raise ValueError(f"last dimension must be even (gate | up), got {gate_up.shape[-1]}")
    n = gate_up.shape[-1] // 2
    parts, in_p = suh.shape
    x2 = _rows(gate_up)
    m = x2.shape[0]
    rows = _check_frag(frag_rows, m, dtype)
    out = torch.empty(parts, rows, in_p, dtype=dtype, device=gate_up.device)
    if m:
        _glu_in_kernel[(rows, in_p // HAD_SIZE, parts)](x2, suh, out, x2.stride(0), m, n, in_p, rows,
                                                        FRAG=frag_rows > 0, num_warps=1,
                                                        **pdl_kwargs(gpu_checked=False))
    return out


def _check_frag(frag_rows: int, m: int, dtype: torch.dtype) -> int:
    """The rows a part takes: m, or frag_rows (whole 16-row blocks of fp16, as exl3_mma reads them)."""
    if frag_rows and (frag_rows % 16 or frag_rows < m or dtype != torch.float16):
        raise ValueError(f"fragment order takes fp16 and whole 16-row blocks, got {frag_rows} rows for {m}, {dtype}")
    return frag_rows or m


def fast_input_transform(f, x2: torch.Tensor, dtype: torch.dtype, frag_rows: int = 0) -> torch.Tensor:
    """The transform on its own (exl3_decode._in_kernel), for an exl3_fused.EXL3Fused f: x2
    [M, in_features] -> [parts, M, in_p], ``had_r_128(pad(x2) * suh[part])``, one launch.
    ``frag_rows`` (a multiple of 16, >= M): [parts, frag_rows, in_p] holding each part's
    rows in mma A-fragment order instead (exl3_decode.fragment_order_ref), rows past M zero."""
    from trellm.kernels.exl3_fast import get_dispatch

    m = x2.shape[0]
    rows = _check_frag(frag_rows, m, dtype)
    out = torch.empty(len(f.parts), rows, f.padded_in, dtype=dtype, device=x2.device)
    # FastDispatch.in_fwht: the Hadamard by butterflies, one row on one warp a 128-block
    fwht = get_dispatch().in_fwht
    bm, warps = (1, 1) if rows == 1 and fwht else (16, 8)
    grid = (triton.cdiv(rows, bm), f.padded_in // HAD_SIZE, len(f.parts))
    _in_kernel[grid](x2, f.suh, out, m, f.in_features, f.padded_in, x2.stride(0), rows, BM=bm, FRAG=frag_rows > 0,
                     FWHT=fwht, num_warps=warps, **pdl_kwargs(gpu_checked=False))
    return out


def x_layout(f, cfg, m: int) -> tuple[torch.dtype, int] | None:
    """How cfg's main kernel reads the transformed x of m rows: (dtype, frag rows), [parts, M,
    in_p] for 0 frag rows, else [parts, frag rows, in_p] in fragment order (frag_x); None: it
    transforms the raw x itself (in_had)."""
    from trellm.kernels import exl3_mma
    from trellm.kernels.exl3_fast import _mma_applies, split_fallback

    mma = _mma_applies(f, cfg)
    if cfg.dot and cfg.in_had and not cfg.split:
        return None
    if mma and cfg.frag_x:  # whole row-block programs: rows rounded up to 16 per row block
        bm = 16 * exl3_mma.row_blocks(cfg, m)
        return torch.float16, bm * triton.cdiv(m, bm)
    return (torch.float16 if mma or (split_fallback(cfg) if cfg.mma else cfg).dot else torch.float32), 0


def _fused_plan(layer, m: int, n_in: int):
    """(f, cfg, dtype, frag rows) where the layer's linear can take x transformed by the kernel
    before it (x_layout), else None: one fused group, the decode dispatch (not
    prefill's reconstruct), a main kernel that reads a transformed x (not in_had), butterflies
    on (FastDispatch.fuse_in)."""
    from trellm.kernels import exl3_fast

    d = exl3_fast.get_dispatch()
    if not d.fuse_in or not d.in_fwht or len(layer.groups) != 1 or not 0 < m < d.reconstruct_min_rows:
        return None
    f = layer.groups[0]
    if not isinstance(f, exl3_fast.EXL3Fused) or f.in_features != n_in:
        return None
    cfg = exl3_fast.choose_config(m, d, f.bits)
    layout = x_layout(f, cfg, m)
    return None if layout is None else (f, cfg, *layout)


def run_layer_norm(layer, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """(linear(RMSNorm(x + residual)), x + residual) with the transform in the norm's launch
    (residual None: x is the residual), or None where the plain path must run."""
    from trellm.kernels import exl3_fast

    plan = _fused_plan(layer, _nrows(x), x.shape[-1])
    if plan is None or weight.dtype != x.dtype:
        return None
    f, cfg, xdt, frag = plan
    xh, res = norm_input_transform(f.suh, x, residual, weight, eps, xdt, frag)
    y = exl3_fast.fast_linear(f, cfg, _rows(x), xh, x.dtype)
    return y.reshape(*x.shape[:-1], f.out_features), (x if residual is None else res)


def run_layer_glu(layer, gate_up: torch.Tensor):
    """linear(silu(gate) * up) with the transform in the SiLU-and-mul launch, or None."""
    from trellm.kernels import exl3_fast

    plan = _fused_plan(layer, _nrows(gate_up), gate_up.shape[-1] // 2)
    if plan is None or gate_up.shape[-1] % 2:
        return None
    f, cfg, xdt, frag = plan
    xh = glu_input_transform(f.suh, gate_up, xdt, frag)
    y = exl3_fast.fast_linear(f, cfg, _rows(gate_up), xh, gate_up.dtype)
    return y.reshape(*gate_up.shape[:-1], f.out_features)


def layer_input_transform(layer, rows: int):
    """quant.base.InputTransform for the kernel before a one-part layer (o_proj: the decode
    attention, paged_decode's ``xform``), or None."""
    from trellm.quant.base import InputTransform

    plan = _fused_plan(layer, rows, layer.in_features)
    if plan is None or len(plan[0].parts) != 1 or plan[3]:  # the attention writes no fragment order
        return None
    return InputTransform(plan[0].suh[0], plan[2])


def run_layer_transformed(layer, x: torch.Tensor, xh: torch.Tensor) -> torch.Tensor:
    """The layer's output from x [..., in] and xh [rows, in_p] as layer_input_transform
    asked for it."""
    from trellm.kernels import exl3_fast

    f, cfg, _, _ = _fused_plan(layer, _nrows(x), x.shape[-1])
    x2 = _rows(x)
    y = exl3_fast.fast_linear(f, cfg, x2, xh.view(1, x2.shape[0], f.padded_in), x.dtype)
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
