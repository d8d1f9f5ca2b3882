"""Pure-PyTorch EXL3 decoder: the oracle for any kernel, and the CPU path.

A weight (spec §1.1-1.3, orientation in x out, ``y = x @ W``) is

    W = diag(suh) @ Hb @ Wq @ Hb @ diag(svh)

with ``Hb`` the block-diagonal normalized Hadamard-128 and ``Wq`` the decoded
trellis: tile (i, j) of ``trellis`` (int16, [in_p/16, out_p/16, 16*K]) is a ring of
256*K bits holding 256 weights of ``Wq[16i:16i+16, 16j:16j+16]``:

1. Bitstream: the int16 array read as little-endian uint32 words; bit b of the
   ring is ``(w32[b // 32] >> (31 - b % 32)) & 1`` (MSB first; in memory the two
   16-bit halves of each word are swapped, which this reading undoes).
2. States: weight t's 16-bit state is the ring bits [S(t) - 16, S(t)) taken
   cyclically (tail-biting), S(t) = (t + 1) * K for integer K. Half-integer K
   (MUL1 only, spec §1.7b) alternates K - 0.5 and K + 0.5 new bits per weight.
3. Codebook: state -> fp16 value (``codebook.py``).
4. Placement: t runs in tensor-core (mma B-fragment) order, ``TILE_POSITIONS``.

Everything is float32 here; the decoded values and suh/svh are fp16, so they are
exact, and only the Hadamards and products round (GPU kernels accumulate in fp16/fp32).
"""
from __future__ import annotations

from functools import lru_cache

import torch

from trellm.quant.exl3.codebook import codebook_table
from trellm.quant.exl3.hadamard import had_l_128, had_r_128
from trellm.quant.exl3.weight import EXL3Weight

TILE = 16
TILE_WEIGHTS = TILE * TILE
_STATES_PER_CHUNK = 1 << 22
"""Tiles are decoded in slices of about this many states (32 MiB of int64 per
temporary), so a large layer does not need gigabytes of scratch."""


def _tile_positions() -> list[tuple[int, int]]:
    """(row, col) inside the 16x16 tile of sequence index t = 8 * lane + j: the per-lane
    B-operand layout of two mma.m16n8k16 fragments (row = input offset, col = output)."""
    offsets = [(0, 0), (1, 0), (8, 0), (9, 0), (0, 8), (1, 8), (8, 8), (9, 8)]
    out = []
    for lane in range(32):
        r0, c0 = 2 * (lane % 4), lane // 4
        out.extend((r0 + dr, c0 + dc) for dr, dc in offsets)
    return out


TILE_POSITIONS: tuple[tuple[int, int], ...] = tuple(_tile_positions())


@lru_cache(maxsize=None)
def _row_major_order() -> torch.Tensor:
    """Index t for each row-major slot r * 16 + c: ``tile_flat = values[..., order]``."""
    order = [0] * TILE_WEIGHTS
    for t, (r, c) in enumerate(TILE_POSITIONS):
        order[r * TILE + c] = t
    return torch.tensor(order)


def window_ends(bits: float) -> list[int]:
    """S(t): the ring bit just after weight t's state, for t = 0..255."""
    if float(bits).is_integer():
        k = int(bits)
        return [(t + 1) * k for t in range(TILE_WEIGHTS)]
    ka = int(bits)
    # Even t take KA new bits, odd t KA + 1 (0xAAAA has the odd bits set): 16 weights = 16 KA + 8 bits.
    steps = [ka + ((0xAAAA >> j) & 1) for j in range(16)]
    per_run = sum(steps)
    return [(t // 16) * per_run + sum(steps[: t % 16 + 1]) for t in range(TILE_WEIGHTS)]


@lru_cache(maxsize=32)
def _state_gather(bits: float) -> tuple[torch.Tensor, torch.Tensor]:
    """For each t: the word holding the first bit of the state's 16-bit window, and the
    right shift that brings the window down from that word's 48-bit pair (the word and
    the top half of the next one, cyclically: 16 bits never span more than two words)."""
    words = int(TILE_WEIGHTS * bits) // 32
    ring = words * 32
    first, shift = [], []
    for end in window_ends(bits):
        start = (end - 16) % ring
        first.append(start // 32)
        shift.append(32 - start % 32)
    return torch.tensor(first), torch.tensor(shift)


def trellis_words(trellis: torch.Tensor) -> torch.Tensor:
    """int16 [..., 16K] -> the uint32 words (in int64) [..., 8K], little-endian pairs."""
    halves = trellis.to(torch.int64) & 0xFFFF
    halves = halves.reshape(*trellis.shape[:-1], trellis.shape[-1] // 2, 2)
    return (halves[..., 1] << 16) | halves[..., 0]


def _states(trellis: torch.Tensor, first: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    words = trellis_words(trellis)
    # Each word with the top half of its successor appended: one gather per state, not two.
    pairs = (words << 16) | (torch.roll(words, -1, dims=-1) >> 16)
    # index_select, not pairs[..., first]: several times faster on the CPU.
    return (pairs.index_select(-1, first) >> shift) & 0xFFFF


def trellis_states(trellis: torch.Tensor) -> torch.Tensor:
    """int16 [..., 16K] tiles -> int64 16-bit states [..., 256] in sequence (t) order."""
    return _states(trellis, *_gather_tables(trellis.shape[-1] / 16, str(trellis.device), False))


@lru_cache(maxsize=64)
def _gather_tables(bits: float, device: str, row_major: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``_state_gather`` on ``device`` (cached there: no host copy per call, which CUDA graph
    capture would refuse), permuted so the states come out in row-major tile order."""
    first, shift = _state_gather(bits)
    if row_major:
        order = _row_major_order()
        first, shift = first[order], shift[order]
    return first.to(device), shift.to(device)


def decode_tiles(trellis: torch.Tensor, codebook: str) -> torch.Tensor:
    """int16 [I, J, 16K] -> float32 [I, J, 16, 16] row-major tiles of codebook values."""
    table = codebook_table(codebook, str(trellis.device))
    states = _states(trellis, *_gather_tables(trellis.shape[-1] / 16, str(trellis.device)))
    return table.index_select(0, states.reshape(-1)).float().reshape(*trellis.shape[:-1], TILE, TILE)


def decode_inner(w: EXL3Weight) -> torch.Tensor:
    """Wq: the decoded trellis, float32 [in_p, out_p] (the rotated-basis weight)."""
    ti, tj, _ = w.trellis.shape
    out = torch.empty(ti * TILE, tj * TILE, dtype=torch.float32, device=w.trellis.device)
    rows = max(1, _STATES_PER_CHUNK // (tj * TILE_WEIGHTS))
    for i in range(0, ti, rows):
        tiles = decode_tiles(w.trellis[i:i + rows], w.codebook)  # [r, J, 16, 16]
        out[i * TILE:(i + tiles.shape[0]) * TILE] = tiles.permute(0, 2, 1, 3).reshape(-1, tj * TILE)
    return out


def reconstruct(w: EXL3Weight) -> torch.Tensor:
    """W = diag(suh) Hb Wq Hb diag(svh), float32 [in_p, out_p] (spec orientation, padded)."""
    rotated = had_r_128(had_l_128(decode_inner(w)))
    return w.suh.float()[:, None] * rotated * w.svh.float()[None, :]


def dense_weight(w: EXL3Weight) -> torch.Tensor:
    """The layer's weight as ``F.linear`` takes it: float32 [out_features, in_features]."""
    return reconstruct(w)[: w.in_features, : w.out_features].t().contiguous()


def forward_reference(w: EXL3Weight, x: torch.Tensor) -> torch.Tensor:
    """``y = x @ W (+ bias)`` as the kernels run it, in float32: scale x by suh, then the
    input Hadamard; times Wq; then the output Hadamard, scaled by svh. ``x`` [..., in]
    (zero-extended to in_p, as the padding rows of W are never used); returns
    [..., out_features] in x.dtype."""
    if x.shape[-1] != w.in_features:
        raise ValueError(f"input width {x.shape[-1]}, layer takes {w.in_features}")
    xf = torch.nn.functional.pad(x.float(), (0, w.padded_in - w.in_features))
    xh = had_r_128(xf * w.suh.float())
    y = had_r_128(xh @ decode_inner(w)) * w.svh.float()
    y = y[..., : w.out_features]
    if w.bias is not None:
        y = y + w.bias.float()
    return y.to(x.dtype)
