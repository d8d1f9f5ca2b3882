"""Group-wise round-to-nearest weight quantization, as a fake-quant baseline for
``trellm eval kld --student-quantization rtn4`` (4 bits, groups of 32).

Per group of ``group`` consecutive input weights of one output row: asymmetric
min-max, ``scale = (max - min) / (2^b - 1)`` rounded to fp16, an integer zero point
``z = round(-min / scale)`` in 0..2^b - 1, ``q = clamp(round(w / scale) + z)``,
``w' = (q - z) * scale``. The weights are replaced in place by w' (the matmul stays
dense): it measures the rounding, not a kernel.

Bits per weight, as GPTQ/AWQ-style storage would count it: b bits per weight plus
an fp16 scale and a b-bit zero point per group, ``b + (16 + b) / group``; 4.625 for
rtn4 (g32). Only decoder linears are quantized (embeddings and the LM head stay as
loaded), as for the bits counted for EXL3 and INT8.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

_SPEC = re.compile(r"^rtn(\d)(?:g(\d+))?$")


@dataclass(frozen=True)
class RTNSpec:
    bits: int = 4
    group: int = 32

    @property
    def bpw(self) -> float:
        return self.bits + (16 + self.bits) / self.group

    @property
    def name(self) -> str:
        return f"rtn{self.bits}g{self.group}"


def parse_rtn(quantization: str) -> RTNSpec | None:
    """'rtn4' (group 32) or 'rtn4g128' -> RTNSpec; anything else -> None."""
    m = _SPEC.match(quantization)
    if not m:
        return None
    spec = RTNSpec(int(m.group(1)), int(m.group(2) or 32))
    if not 2 <= spec.bits <= 8 or spec.group < 2:
        raise ValueError(f"{quantization}: RTN needs 2..8 bits and a group of at least 2")
    return spec


def rtn_weight(w: torch.Tensor, spec: RTNSpec) -> torch.Tensor:
    """Quantize-dequantize an [out, in] weight (``in`` a multiple of the group)."""
    out_f, in_f = w.shape
    if in_f % spec.group:
        raise ValueError(f"RTN group {spec.group} does not divide the input width {in_f}")
    g = w.float().reshape(out_f, in_f // spec.group, spec.group)
    top = (1 << spec.bits) - 1
    # The grid must hold 0 (asymmetric round-to-nearest as GPTQ's): a group of all-positive
    # weights otherwise clamps its zero point and loses everything above the first step.
    lo = g.amin(dim=-1, keepdim=True).clamp(max=0.0)
    hi = g.amax(dim=-1, keepdim=True).clamp(min=0.0)
    scale = ((hi - lo) / top).half().float().clamp_min(torch.finfo(torch.float16).tiny)
    zero = torch.round(-lo / scale).clamp(0, top)
    q = torch.clamp(torch.round(g / scale) + zero, 0, top)
    return ((q - zero) * scale).reshape(out_f, in_f).to(w.dtype)


def apply_rtn(model: torch.nn.Module, spec: RTNSpec) -> int:
    """Replace every decoder linear's dense weight in place; returns how many."""
    count = 0
    with torch.no_grad():
        for layer in model.layers:
            for module in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                           layer.mlp.down_proj):
                weight = getattr(module, "weight", None)
                if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
                    raise ValueError("RTN needs dense decoder weights; load the student with quantization none")
                weight.copy_(rtn_weight(weight, spec))
                count += 1
    return count
