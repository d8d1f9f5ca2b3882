"""One EXL3-quantized projection as the checkpoint stores it (spec §1.1), checked.

Per HF module key (``model.layers.0.self_attn.q_proj``) a checkpoint holds
``.trellis`` (int16 [in_p/16, out_p/16, 16*K]), ``.suh`` (fp16 [in_p]) or the
legacy ``.su`` (int16 [in_p/16], packed signs), ``.svh`` / ``.sv`` likewise for the
output side, an optional fp16 ``.bias``, and a 0-dim int32 ``.mcg`` or ``.mul1``
whose mere presence selects that codebook (neither: 3INST). in_p and out_p are the
layer's sizes rounded up to 128 (the Hadamard block). K comes from the tile width.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

PAD = 128
TENSOR_NAMES = ("trellis", "suh", "svh", "su", "sv", "mcg", "mul1", "bias")
"""Everything an EXL3 projection may store under its module key."""


def padded(n: int) -> int:
    return (n + PAD - 1) // PAD * PAD


def check_bits(bits: float, codebook: str) -> None:
    """K must be 1..8, or a half-integer 1.5..7.5 with the MUL1 codebook."""
    if not (1 <= bits <= 8 and float(2 * bits).is_integer()):
        raise ValueError(f"EXL3 bits per weight must be 1..8 in steps of 0.5, got {bits}")
    if not float(bits).is_integer() and codebook != "mul1":
        raise ValueError(f"half-integer EXL3 bitrate {bits} needs the mul1 codebook, not {codebook}")


def unpack_signs(packed: torch.Tensor) -> torch.Tensor:
    """Legacy ``su`` / ``sv``: bit i (LSB first) of int16 word j is element 16 j + i;
    a set bit means -1. Returns fp16 [16 * len(packed)] of +-1."""
    bits = (packed.to(torch.int64)[:, None] >> torch.arange(16, device=packed.device)) & 1
    return (1 - 2 * bits).reshape(-1).to(torch.float16)


@dataclass(frozen=True)
class EXL3Weight:
    """A checked EXL3 projection: what the reference decoder and the kernels take."""

    trellis: torch.Tensor
    """int16 [in_p/16, out_p/16, 16*K], contiguous."""
    suh: torch.Tensor
    """fp16 [in_p]: input-side sign x scale (legacy ``su`` unpacked to +-1)."""
    svh: torch.Tensor
    """fp16 [out_p]: output-side sign x scale."""
    codebook: str
    """'3inst', 'mcg' or 'mul1'."""
    in_features: int
    """Unpadded input width: inputs are zero-extended to in_p."""
    out_features: int
    """Unpadded output width: outputs beyond it (padding columns) are dropped."""
    bias: torch.Tensor | None = None
    """[out_features] (a padded checkpoint bias is cut), or None."""

    @property
    def bits(self) -> float:
        """K, bits per weight: 16*K int16 words per 256-weight tile."""
        return self.trellis.shape[-1] / 16

    @property
    def padded_in(self) -> int:
        return self.trellis.shape[0] * 16

    @property
    def padded_out(self) -> int:
        return self.trellis.shape[1] * 16

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], in_features: int,
                     out_features: int) -> "EXL3Weight":
        """Check one projection's checkpoint tensors (names without the module key) against
        the layer's unpadded shape; ValueError names what is wrong."""
        unknown = sorted(set(tensors) - set(TENSOR_NAMES))
        if unknown:
            raise ValueError(f"unexpected EXL3 tensors {unknown}")
        in_p, out_p = padded(in_features), padded(out_features)
        trellis = _need(tensors, "trellis")
        if trellis.dtype != torch.int16 or trellis.dim() != 3 or trellis.shape[-1] % 8:
            raise ValueError(f"trellis must be int16 [in/16, out/16, 16*K], got {trellis.dtype} "
                             f"{tuple(trellis.shape)}")
        if tuple(trellis.shape[:2]) != (in_p // 16, out_p // 16):
            raise ValueError(f"trellis tiles {tuple(trellis.shape[:2])} do not fit a {in_features}x"
                             f"{out_features} layer padded to {in_p}x{out_p} (want {(in_p // 16, out_p // 16)})")
        if "mcg" in tensors and "mul1" in tensors:
            raise ValueError("both mcg and mul1 markers present")
        codebook = "mcg" if "mcg" in tensors else "mul1" if "mul1" in tensors else "3inst"
        check_bits(trellis.shape[-1] / 16, codebook)
        suh = _scales(tensors, "suh", "su", in_p)
        svh = _scales(tensors, "svh", "sv", out_p)
        bias = tensors.get("bias")
        if bias is not None:
            if bias.dim() != 1 or bias.shape[0] not in (out_features, out_p):
                raise ValueError(f"bias shape {tuple(bias.shape)}, want ({out_features},) or ({out_p},)")
            bias = bias[:out_features].contiguous()
        return cls(trellis.contiguous(), suh, svh, codebook, in_features, out_features, bias)

    def to(self, device: torch.device | str) -> "EXL3Weight":
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return EXL3Weight(move(self.trellis), move(self.suh), move(self.svh), self.codebook,
                          self.in_features, self.out_features, move(self.bias))


def _need(tensors: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in tensors:
        raise ValueError(f"missing EXL3 tensor {name!r} (have {sorted(tensors)})")
    return tensors[name]


def _scales(tensors: dict[str, torch.Tensor], name: str, legacy: str, size: int) -> torch.Tensor:
    """``suh`` (fp16 [size]) or the legacy packed ``su`` (int16 [size/16]), as fp16 [size]."""
    if name in tensors:
        t = tensors[name]
        if t.dtype != torch.float16 or tuple(t.shape) != (size,):
            raise ValueError(f"{name} must be fp16 ({size},), got {t.dtype} {tuple(t.shape)}")
        return t.contiguous()
    if legacy in tensors:
        t = tensors[legacy]
        if t.dtype != torch.int16 or tuple(t.shape) != (size // 16,):
            raise ValueError(f"{legacy} must be int16 ({size // 16},), got {t.dtype} {tuple(t.shape)}")
        return unpack_signs(t)
    raise ValueError(f"missing EXL3 tensor {name!r} (or legacy {legacy!r})")
