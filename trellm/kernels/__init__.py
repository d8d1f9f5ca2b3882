"""GPU kernels (Triton), one op per file, each with its pure-PyTorch reference beside it.

| op | kernel | reference |
| --- | --- | --- |
| paged attention, decode (split-K, combined in-kernel or by a reduce) | ``paged_attention.paged_decode`` | ``paged_decode_ref`` |
| paged attention, varlen prefill over the cache | ``paged_attention.paged_prefill`` | ``paged_prefill_ref`` |
| residual add + RMSNorm | ``rmsnorm.fused_add_rms_norm`` | ``fused_add_rms_norm_ref`` |
| RMSNorm | ``rmsnorm.rms_norm`` | ``rms_norm_ref`` |
| RoPE + KV-cache write | ``rope_kv.rope_and_write_kv`` | ``rope_and_write_kv_ref`` |
| KV-cache write | ``rope_kv.write_kv`` | ``write_kv_ref`` |
| SiLU-and-mul | ``activation.silu_and_mul`` | ``silu_and_mul_ref`` |
| sampling (greedy / temperature, min-p, top-k, top-p) | ``sampling.sample`` | ``sample_ref`` |
| EXL3 trellis decode (fp16 Wq) | ``exl3_decode.exl3_reconstruct`` | ``exl3_reconstruct_ref`` |
| EXL3 ``x @ W`` (GEMV / GEMM / reconstruct + cuBLAS) | ``exl3_gemv.exl3_matmul`` | ``exl3_matmul_ref`` |
| int8 weight-only linear | ``int8_gemv.int8_linear`` | ``int8_linear_ref`` |

The quantized linears are not in ``OPS``: their layers' methods call them (the EXL3
kernel hook, ``Int8LinearMethod``).

A kernel runs where ``kernel_supported(device)`` says so: a CUDA tensor with Triton
importable, or a CPU tensor under Triton's interpreter (``TRITON_INTERPRET=1``, for the
kernel tests on machines without a GPU). ``get_op`` hands back the kernel there and the
reference elsewhere, so callers need no branch of their own.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

import torch

from trellm import envs


@dataclass(frozen=True)
class KernelOp:
    name: str
    module: str
    """Module under trellm.kernels holding both functions."""
    kernel: str
    reference: str


OPS: dict[str, KernelOp] = {op.name: op for op in (
    KernelOp("paged_decode", "paged_attention", "paged_decode", "paged_decode_ref"),
    KernelOp("paged_prefill", "paged_attention", "paged_prefill", "paged_prefill_ref"),
    KernelOp("fused_add_rms_norm", "rmsnorm", "fused_add_rms_norm", "fused_add_rms_norm_ref"),
    KernelOp("rms_norm", "rmsnorm", "rms_norm", "rms_norm_ref"),
    KernelOp("rope_and_write_kv", "rope_kv", "rope_and_write_kv", "rope_and_write_kv_ref"),
    KernelOp("write_kv", "rope_kv", "write_kv", "write_kv_ref"),
    KernelOp("silu_and_mul", "activation", "silu_and_mul", "silu_and_mul_ref"),
    KernelOp("sample", "sampling", "sample", "sample_ref"),
)}


def triton_importable() -> bool:
    from trellm.kernels._triton import HAS_TRITON

    return HAS_TRITON


def triton_available() -> bool:
    """Triton imports and can run here: a CUDA device is present, or the interpreter is on."""
    if not triton_importable():
        return False
    return envs.triton_interpret() or torch.cuda.is_available()


def kernel_supported(device: torch.device | str) -> bool:
    """Whether the Triton kernels can take tensors on ``device``."""
    device = torch.device(device)
    if not triton_importable():
        return False
    if envs.triton_interpret():
        # The interpreter runs kernels on CPU tensors (and only those).
        return device.type == "cpu"
    return device.type == "cuda" and torch.cuda.is_available()


def get_op(name: str, device: torch.device | str, prefer_reference: bool = False) -> Callable:
    """The kernel for ``name`` where it can run on ``device``, else its reference."""
    op = OPS[name]
    mod = importlib.import_module(f"trellm.kernels.{op.module}")
    use_kernel = not prefer_reference and kernel_supported(device)
    return getattr(mod, op.kernel if use_kernel else op.reference)


@dataclass(frozen=True)
class FusedOps:
    """The fused per-layer ops a model calls on its fused path (the GPU kernels, or
    their references for tests)."""

    rms_norm: Callable
    fused_add_rms_norm: Callable
    rope_and_write_kv: Callable
    silu_and_mul: Callable


def fused_ops(device: torch.device | str, prefer_reference: bool = False) -> FusedOps:
    return FusedOps(**{name: get_op(name, device, prefer_reference) for name in FusedOps.__dataclass_fields__})


__all__ = ["FusedOps", "fused_ops", "OPS", "KernelOp", "get_op", "kernel_supported", "triton_available", "triton_importable"]
