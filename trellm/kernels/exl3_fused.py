"""EXL3 merged layers: the parts of one layer (q/k/v, gate/up) with one K and codebook
as one ``EXL3Fused``, so exl3_fast runs each of its three steps in one launch for all of
them (the module docstring of exl3_fast.py says how the kernels use the tables here)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from trellm.kernels.exl3_decode import kernel_bits
from trellm.quant.exl3.hadamard import HAD_SIZE
from trellm.quant.exl3.weight import EXL3Weight


@dataclass(frozen=True, eq=False)
class EXL3Fused:
    """Consecutive parts of one layer with one K and codebook, ready for one launch each of
    the input transform, the main kernel and the output transform. Built once at load time
    (``fuse``); every table lives on the device, so a call copies nothing from the host."""

    parts: tuple[EXL3Weight, ...]
    """The parts, their trellises now views of ``trellis``."""
    trellis: torch.Tensor
    """int16 [in_p/16, sum out_p/16, 16 K]."""
    suh: torch.Tensor
    """fp16 [parts, in_p]."""
    svh: torch.Tensor
    """fp16 [sum out_p]."""
    bias: torch.Tensor | None
    """[out_features] (the parts' unpadded biases concatenated) or None."""
    tile_part: torch.Tensor
    """int32 [sum out_p / 16]: the part of each 16-column tile."""
    dest: torch.Tensor
    """int32 [sum out_p / 128]: the output column of each 128-block's first column."""
    ncols: torch.Tensor
    """int32 [sum out_p / 128]: how many of the block's columns are real (not padding)."""
    had: torch.Tensor
    """fp16 [128, 128]: the +-1 Sylvester matrix (for ``in_had``)."""
    bits: int
    codebook: str
    in_features: int
    out_features: int
    counters: torch.Tensor | None = None
    """int32 [COUNTER_ROW_BLOCKS, sum out_p / 128], zeros between launches: the arrival
    counts of exl3_mma's fused output transform (the last program of a block finishes it)."""

    @property
    def padded_in(self) -> int:
        return self.trellis.shape[0] * 16

    @property
    def padded_out(self) -> int:
        return self.trellis.shape[1] * 16


def fusable(parts: list[EXL3Weight]) -> bool:
    """One K (integer), codebook, input width and device, and all or none with a bias."""
    first = parts[0]
    return (kernel_bits(first) is not None
            and all(p.bits == first.bits and p.codebook == first.codebook and p.in_features == first.in_features
                    and p.trellis.device == first.trellis.device and (p.bias is None) == (first.bias is None)
                    for p in parts))


COUNTER_ROW_BLOCKS = 16
"""Row blocks (16 or 32 rows each) exl3_mma's fused output transform keeps counters for."""


def fuse(parts: list[EXL3Weight]) -> EXL3Fused:
    """Concatenate ``fusable`` parts; a single part keeps its own trellis (no copy)."""
    if not parts or not fusable(parts):
        raise ValueError("fuse takes parts of one integer K, codebook, input width and device")
    dev = parts[0].trellis.device
    trellis = parts[0].trellis if len(parts) == 1 else torch.cat([p.trellis for p in parts], dim=1)
    views, tile_part, dest, ncols, t0, col = [], [], [], [], 0, 0
    for i, p in enumerate(parts):
        tj = p.trellis.shape[1]
        views.append(EXL3Weight(trellis[:, t0:t0 + tj], p.suh, p.svh, p.codebook, p.in_features,
                                p.out_features, p.bias))
        tile_part += [i] * tj
        for b in range(tj // 8):  # 128-column blocks
            dest.append(col + 128 * b)
            ncols.append(max(0, min(128, p.out_features - 128 * b)))
        t0, col = t0 + tj, col + p.out_features
    i32 = dict(dtype=torch.int32, device=dev)
    bias = None if parts[0].bias is None else torch.cat([p.bias for p in parts]).contiguous()
    return EXL3Fused(tuple(views), trellis, torch.stack([p.suh for p in parts]).contiguous(),
                     torch.cat([p.svh for p in parts]).contiguous(), bias, torch.tensor(tile_part, **i32),
                     torch.tensor(dest, **i32), torch.tensor(ncols, **i32), _had_table(dev),
                     int(parts[0].bits), parts[0].codebook, parts[0].in_features, col,
                     torch.zeros(COUNTER_ROW_BLOCKS, trellis.shape[1] // 8, **i32))


def fuse_groups(parts: list[EXL3Weight]) -> list[EXL3Fused | EXL3Weight]:
    """Maximal runs of consecutive fusable parts, fused; a part the kernels do not take
    (half-integer K) stays an EXL3Weight."""
    groups: list[list[EXL3Weight]] = []
    for p in parts:
        if kernel_bits(p) is not None and groups and kernel_bits(groups[-1][0]) and fusable(groups[-1] + [p]):
            groups[-1].append(p)
        else:
            groups.append([p])
    return [fuse(g) if kernel_bits(g[0]) is not None else g[0] for g in groups]


_HAD: dict[str, torch.Tensor] = {}


def _had_table(device: torch.device) -> torch.Tensor:
    key = str(device)
    if key not in _HAD:
        i = torch.arange(HAD_SIZE)
        bits = i[:, None] & i[None, :]
        parity = torch.zeros_like(bits)
        for b in range(7):
            parity ^= (bits >> b) & 1
        _HAD[key] = (1 - 2 * parity).to(torch.float16).to(device)
    return _HAD[key]
