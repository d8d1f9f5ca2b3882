"""EXL3 quantization of linear layers: what ExLlamaV3's converter does per tensor
(docs: quant-spec §1.5, steps 3-9), in vectorized torch.

For one weight W (spec orientation: in x out, ``y = x W``) with input Hessian
H = E[x^T x]:

1. H is damped (``+ 0.025 mean(diag H)`` on the diagonal), its inputs get random
   signs ``su0`` and the Hadamard-128 on both sides (incoherence), and is
   factored block-LDL (16x16 blocks): ``H = L D L^T``, L unit block-lower.
2. W is regularized: columns divided by their RMS (``sv``, with random signs),
   the output Hadamard, rows divided by their RMS over the codebook's scale
   (``su = su0 * rms / 1.2437``), the input Hadamard. A global scale g, searched
   on a sample of tiles, brings the result to the codebook's operating point.
3. LDLQ: 16-row blocks from the last to the first; each block's target is its
   rows plus the feedback ``L[c, b]^T (W_c - What_c)`` of the blocks already done,
   cut into 16x16 tiles, each encoded by the tail-biting Viterbi (``viterbi.py``).
   This minimizes ``tr(E^T H E)`` block by block, as GPTQ does column by column.
4. Pack: the low K bits of each state, MSB first, in 32-bit words stored as
   swapped 16-bit halves: exactly what ``reference.py`` decodes.

Several linears are quantized together: their row blocks go through the Viterbi in
one batch per LDLQ stage, so a GPU sees hundreds of tiles per call even though the
stages themselves are sequential.
"""
from __future__ import annotations

import logging
import math
import zlib
from dataclasses import dataclass, field
from typing import Callable

import torch

from trellm.quant.exl3.codebook import CODEBOOK_RMS, MCG_MUL, MUL1_MUL, codebook_table
from trellm.quant.exl3.hadamard import had_l_128, had_r_128
from trellm.quant.exl3.reference import TILE_POSITIONS
from trellm.quant.exl3.viterbi import Trellis, ViterbiOptions, tail_biting
from trellm.quant.exl3.weight import padded

log = logging.getLogger("trellm")

CODEBOOK_SCALE = 1.24371088
"""Rows are normalized to this RMS (3INST's RMS, spec §1.4) before the global scale."""
SIGMA_REG = 0.025
"""Hessian damping, as a fraction of its mean diagonal."""
BLOCK = 16
SCALE_GRID = (0.85, 0.92, 1.0, 1.08, 1.17)
"""Global-scale candidates, relative to the expected optimum (see ``_scale_center``)."""
SCALE_SHRINK = {1: 1.05, 2: 1.0, 3: 0.92, 4: 0.86, 5: 0.83, 6: 0.8, 7: 0.78, 8: 0.76}
"""Where the tile error is smallest, as a fraction of codebook RMS / target RMS, for
Gaussian targets; measured here with this Viterbi (MUL1 and 3INST agree): the higher
K, the more it pays to keep targets inside the dense middle of the codebook."""

# t -> row-major index r * 16 + c inside a tile (tensor-core order, reference.TILE_POSITIONS).
_T_ORDER = torch.tensor([r * BLOCK + c for r, c in TILE_POSITIONS])


@dataclass(frozen=True)
class LinearQuantOptions:
    bits: int
    """K, 1..8 (integer: half-integer rates are not produced here)."""
    codebook: str = "mul1"
    viterbi: ViterbiOptions = ViterbiOptions()
    scale_samples: int = 48
    """Tiles per linear in the global-scale search."""
    seed: int = 0

    def __post_init__(self):
        if not (1 <= self.bits <= 8 and float(self.bits).is_integer()):
            raise ValueError(f"the quantizer takes integer bits 1..8, got {self.bits}")


@dataclass(frozen=True)
class LinearToQuantize:
    key: str
    """HF module key, e.g. ``model.layers.0.self_attn.q_proj`` (tensor names derive from it)."""
    weight: torch.Tensor
    """[out, in] as ``F.linear`` takes it."""
    bias: torch.Tensor | None = None


@dataclass(frozen=True)
class PreparedHessian:
    """A captured input Hessian, averaged, damped and padded (original input basis)."""

    su0: torch.Tensor
    """+-1 [in_p]: random input signs, shared by the linears that read this input."""
    h: torch.Tensor | None
    """float64 [in_p, in_p]; None: no usable data (no feedback, no proxy error)."""


@dataclass(frozen=True)
class QuantizedLinear:
    key: str
    tensors: dict[str, torch.Tensor]
    """``<key>.trellis``, ``.suh``, ``.svh``, the codebook marker, ``.bias`` (CPU)."""
    scale: float
    """The global scale g that was chosen."""
    proxy_error: float
    """tr(E^T H E) / tr(W^T H W): the output error relative to the output, on the
    calibration inputs (damped); nan without a Hessian."""


def prepare_hessian(h_sum: torch.Tensor, count: int, seed: int) -> PreparedHessian:
    """Average a Hessian sum ``X^T X`` over ``count`` rows, damp its diagonal
    (``+ 0.025 mean(diag H)``), pad it to the Hadamard block, draw the input signs."""
    n = h_sum.shape[0]
    n_p = padded(n)
    device = h_sum.device
    g = torch.Generator(device="cpu").manual_seed(seed)
    su0 = (torch.randint(0, 2, (n_p,), generator=g) * 2 - 1).to(device=device, dtype=torch.float32)
    h = h_sum.double() / max(count, 1)
    diag_mean = float(h.diagonal().mean()) if count else 0.0
    if not math.isfinite(diag_mean) or diag_mean <= 1e-20:
        log.warning("Hessian without usable data (%d rows); quantizing without feedback", count)
        return PreparedHessian(su0, None)
    h = torch.nn.functional.pad(h, (0, n_p - n, 0, n_p - n))
    h.diagonal().add_(SIGMA_REG * diag_mean)
    return PreparedHessian(su0, h)


def rotated_hessian(hessian: PreparedHessian, su: torch.Tensor) -> torch.Tensor:
    """The Hessian of the rotated weight: ``W = diag(su) Hb Wq ...``, so an error E in
    Wq costs ``tr(E^T Hb diag(su) H diag(su) Hb E)``. The converter folds only the
    signs of su in; the row scales are folded in too here, which keeps LDLQ's weights
    right for outlier input channels (and makes the proxy error the relative output
    error under the damped Hessian)."""
    s = su.double()
    return had_l_128(had_r_128(hessian.h * s[:, None] * s[None, :]))


def block_ldl(h: torch.Tensor) -> torch.Tensor | None:
    """L of ``H = L D L^T`` (16x16 blocks, unit block-lower), diagonal blocks zeroed.
    Cholesky failures get more damping (up to 10 times), as the converter does."""
    n = h.shape[0]
    diag_mean = float(h.diagonal().mean())
    eye = torch.eye(n, dtype=h.dtype, device=h.device)
    for _ in range(10):
        chol, info = torch.linalg.cholesky_ex(h)
        if int(info) == 0:
            break
        h = h + eye * (2 * SIGMA_REG * diag_mean)
    else:
        log.warning("Hessian is not positive definite even after damping; quantizing without feedback")
        return None
    nb = n // BLOCK
    diag = chol.view(nb, BLOCK, nb, BLOCK).diagonal(dim1=0, dim2=2).permute(2, 0, 1)
    # C times the inverse of its diagonal blocks: unit diagonal blocks, D = C_bb C_bb^T.
    ldl = torch.einsum("rjb,jbk->rjk", chol.view(n, nb, BLOCK), torch.linalg.inv(diag)).reshape(n, n)
    ldl.view(nb, BLOCK, nb, BLOCK).diagonal(dim1=0, dim2=2).zero_()
    return ldl


# ---- tiles and packing ---------------------------------------------------------------------------


def rows_to_tiles(rows: torch.Tensor) -> torch.Tensor:
    """[16, out_p] -> [out_p/16, 256] tiles in sequence (t) order."""
    j = rows.shape[1] // BLOCK
    flat = rows.reshape(BLOCK, j, BLOCK).permute(1, 0, 2).reshape(j, BLOCK * BLOCK)
    return flat.index_select(1, _T_ORDER.to(rows.device))


def tiles_to_rows(tiles: torch.Tensor) -> torch.Tensor:
    """Inverse of ``rows_to_tiles``."""
    j = tiles.shape[0]
    flat = torch.empty_like(tiles)
    flat[:, _T_ORDER.to(tiles.device)] = tiles
    return flat.reshape(j, BLOCK, BLOCK).permute(1, 0, 2).reshape(BLOCK, j * BLOCK)


def pack_trellis(states: torch.Tensor, bits: int) -> torch.Tensor:
    """int64 states [..., 256] -> int16 trellis words [..., 16K]: the low K bits of each
    state, MSB first, as 32-bit words whose 16-bit halves are stored low half first."""
    lead = states.shape[:-1]
    symbols = states & ((1 << bits) - 1)
    down = torch.arange(bits - 1, -1, -1, device=states.device)
    stream = ((symbols[..., None] >> down) & 1).reshape(*lead, -1, 32)
    words = (stream << torch.arange(31, -1, -1, device=states.device)).sum(-1)
    halves = torch.stack([words & 0xFFFF, words >> 16], dim=-1).reshape(*lead, 16 * bits)
    return ((halves ^ 0x8000) - 0x8000).to(torch.int16)


class TileCoder:
    """Encodes tiles (t-order) as trellis states and decodes them, for one K and codebook."""

    def __init__(self, bits: int, codebook: str, device: torch.device, options: ViterbiOptions = ViterbiOptions()):
        self.bits = bits
        self.codebook = codebook
        self.table = codebook_table(codebook, str(device)).float()
        self.trellis = Trellis(bits)
        self.options = options

    def encode(self, tiles: torch.Tensor, on_chunk: Callable[[int], None] | None = None) -> torch.Tensor:
        return tail_biting(tiles, self.table, self.trellis, self.options, on_chunk)

    def decode(self, states: torch.Tensor) -> torch.Tensor:
        return self.table[states]


# ---- one linear: regularization ---------------------------------------------------------------


@dataclass
class _Job:
    """Work state of one linear through regularization and LDLQ."""

    source: LinearToQuantize
    hessian: PreparedHessian
    target: torch.Tensor
    """[in_p, out_p], rotated and scaled: what the tiles approximate."""
    su: torch.Tensor
    sv: torch.Tensor
    scale: float = 1.0
    h: torch.Tensor | None = None
    """float32 rotated Hessian (for the proxy error)."""
    ldl: torch.Tensor | None = None
    """float32 LDLQ feedback matrix; None: none."""
    quant: torch.Tensor = field(default=None)
    states: torch.Tensor = field(default=None)


def _signs(n: int, seed: int, device) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(seed)
    return (torch.randint(0, 2, (n,), generator=g) * 2 - 1).to(device=device, dtype=torch.float32)


def _regularize(item: LinearToQuantize, hessian: PreparedHessian, seed: int) -> _Job:
    """Column scales and signs (sv), output Hadamard, row scales (su), input Hadamard."""
    out_f, in_f = item.weight.shape
    in_p, out_p = padded(in_f), padded(out_f)
    device = hessian.su0.device
    w = torch.zeros(in_p, out_p, dtype=torch.float32, device=device)
    w[:in_f, :out_f] = item.weight.to(device=device, dtype=torch.float32).t()
    col = w.square().mean(0).sqrt()
    mean = col[:out_f].mean()
    col = col / mean if mean > 0 else torch.ones_like(col)
    sv = _signs(out_p, seed, device) * col  # zero (padding) columns keep sv = 0
    w = had_r_128(torch.where(sv != 0, w / sv.masked_fill(sv == 0, 1), 0.0))
    row = w.square().mean(1).sqrt()
    fill = row[:in_f][row[:in_f] > 0].mean() if bool((row[:in_f] > 0).any()) else torch.tensor(1.0)
    row = torch.where(row > 0, row, fill)
    su = hessian.su0 * row / CODEBOOK_SCALE
    w = had_l_128(w / su[:, None])
    job = _Job(item, hessian, w, su, sv)
    if hessian.h is not None:
        h = rotated_hessian(hessian, su)
        ldl = block_ldl(h)
        job.h, job.ldl = h.float(), None if ldl is None else ldl.float()
    return job


def _key_seed(seed: int, key: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(key.encode())) & 0x7FFFFFFF


# ---- the global scale --------------------------------------------------------------------------


def _scale_center(codebook: str, bits: int) -> float:
    return CODEBOOK_RMS[codebook] / CODEBOOK_SCALE * SCALE_SHRINK[bits]


def _sample_tiles(target: torch.Tensor, count: int) -> torch.Tensor:
    """Tiles on a wrapped diagonal (every tile row and column once) plus the highest-
    and lowest-RMS tiles (outlier channels), at most ``count``, in t-order."""
    ti, tj = target.shape[0] // BLOCK, target.shape[1] // BLOCK
    grid = target.reshape(ti, BLOCK, tj, BLOCK).permute(0, 2, 1, 3).reshape(ti * tj, BLOCK * BLOCK)
    diag = torch.arange(max(ti, tj))
    picks = (diag % ti) * tj + diag % tj
    rms = grid.square().mean(1)
    extremes = torch.cat([rms.topk(min(2, rms.numel())).indices.cpu(),
                          (-rms).topk(min(2, rms.numel())).indices.cpu()])
    picks = torch.unique(torch.cat([picks, extremes]))
    if picks.numel() > count:
        picks = picks[torch.linspace(0, picks.numel() - 1, count).long()]
    return grid[picks.to(target.device)][:, _T_ORDER.to(target.device)]


def _search_scales(jobs: list[_Job], coder: TileCoder, samples: int) -> None:
    """Pick each job's g on the grid around the expected optimum (one Viterbi batch for
    all jobs and candidates), refined by a parabola through the best point's neighbours."""
    center = _scale_center(coder.codebook, coder.bits)
    grid = [center * f for f in SCALE_GRID]
    sampled = [_sample_tiles(j.target, samples) for j in jobs]
    batch = torch.cat([s * g for s in sampled for g in grid])
    values = coder.decode(coder.encode(batch))
    offset = 0
    for job, s in zip(jobs, sampled):
        errors = []
        for g in grid:
            part = values[offset:offset + s.shape[0]]
            errors.append(float((part / g - s).square().mean()))
            offset += s.shape[0]
        job.scale = _parabola_min(grid, errors)
        job.target = job.target * job.scale
        job.su = job.su / job.scale


def _parabola_min(xs: list[float], ys: list[float]) -> float:
    best = min(range(len(xs)), key=ys.__getitem__)
    if best in (0, len(xs) - 1):
        return xs[best]
    y0, y1, y2 = ys[best - 1:best + 2]
    curve = y0 - 2 * y1 + y2
    step = xs[best + 1] - xs[best]
    shift = 0.5 * (y0 - y2) / curve if curve > 0 else 0.0
    return xs[best] + max(-0.5, min(0.5, shift)) * step


# ---- LDLQ ------------------------------------------------------------------------------------


def _ldlq(jobs: list[_Job], coder: TileCoder, on_chunk) -> None:
    """Row blocks from last to first; stage s takes block (nb - 1 - s) of every job that
    has one, so all jobs share each Viterbi batch."""
    errors = []
    for job in jobs:
        in_p, out_p = job.target.shape
        job.quant = torch.zeros_like(job.target)
        job.states = torch.zeros(in_p // BLOCK, out_p // BLOCK, 256, dtype=torch.int64, device=job.target.device)
        errors.append(torch.zeros_like(job.target))
    blocks = [job.target.shape[0] // BLOCK for job in jobs]
    for stage in range(max(blocks)):
        pieces = []
        for job, err, nb in zip(jobs, errors, blocks):
            if stage >= nb:
                continue
            b = nb - 1 - stage
            rows = slice(b * BLOCK, (b + 1) * BLOCK)
            x = job.target[rows]
            ldl = job.ldl
            if ldl is not None and b < nb - 1:
                rest = slice((b + 1) * BLOCK, None)
                x = x + ldl[rest, rows].t() @ err[rest]
            pieces.append((job, err, b, rows_to_tiles(x)))
        tiles = torch.cat([p[3] for p in pieces])
        states = coder.encode(tiles, on_chunk)
        values = coder.decode(states)
        offset = 0
        for job, err, b, t in pieces:
            n = t.shape[0]
            rows = slice(b * BLOCK, (b + 1) * BLOCK)
            job.states[b] = states[offset:offset + n]
            job.quant[rows] = tiles_to_rows(values[offset:offset + n])
            err[rows] = job.target[rows] - job.quant[rows]
            offset += n


def _proxy_error(job: _Job) -> float:
    h = job.h
    if h is None:
        return float("nan")
    e = job.quant - job.target
    den = float((job.target * (h @ job.target)).sum())
    return float((e * (h @ e)).sum()) / den if den > 0 else float("nan")


# ---- the entry point ---------------------------------------------------------------------------


def quantize_linears(items: list[tuple[LinearToQuantize, PreparedHessian]], options: LinearQuantOptions,
                     on_chunk: Callable[[int], None] | None = None) -> list[QuantizedLinear]:
    """Quantize several linears together (their tiles share the Viterbi batches)."""
    if not items:
        return []
    device = items[0][1].su0.device
    coder = TileCoder(options.bits, options.codebook, device, options.viterbi)
    jobs = [_regularize(item, hessian, _key_seed(options.seed, item.key)) for item, hessian in items]
    # Progress counts the LDLQ tiles only (the scale search's few are not in the total).
    _search_scales(jobs, coder, options.scale_samples)
    _ldlq(jobs, coder, on_chunk)
    return [_finish(job, options) for job in jobs]


def _finish(job: _Job, options: LinearQuantOptions) -> QuantizedLinear:
    key = job.source.key
    tensors = {
        f"{key}.trellis": pack_trellis(job.states, options.bits).cpu(),
        f"{key}.suh": job.su.half().cpu(),
        f"{key}.svh": job.sv.half().cpu(),
    }
    if options.codebook != "3inst":
        marker = MCG_MUL if options.codebook == "mcg" else MUL1_MUL
        # The multiplier's bit pattern as int32, as the converter stores it; only the name is read.
        tensors[f"{key}.{options.codebook}"] = torch.tensor(marker - (1 << 32), dtype=torch.int32)
    if job.source.bias is not None:
        out_f = job.source.bias.shape[0]
        bias = torch.nn.functional.pad(job.source.bias.float(), (0, padded(out_f) - out_f))
        tensors[f"{key}.bias"] = bias.half().cpu()  # stored padded, as the converter does
    return QuantizedLinear(key, tensors, job.scale, _proxy_error(job))


def tile_count(out_features: int, in_features: int) -> int:
    """Tiles of one linear (for progress totals), not counting the scale search."""
    return (padded(out_features) // BLOCK) * (padded(in_features) // BLOCK)
