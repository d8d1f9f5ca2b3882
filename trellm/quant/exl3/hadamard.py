"""The 128-point Hadamard transform EXL3 applies on both sides of every weight.

``H[i][j] = (-1)^popcount(i & j) / sqrt(128)``: the Sylvester (natural-order)
Walsh-Hadamard matrix, normalized so it is orthonormal and its own inverse. It is
symmetric, so "x times H" and "H times x" on a 128-chunk are the same product.
A vector wider than 128 is transformed chunk by chunk (block-diagonal ``Hb``).
"""
from __future__ import annotations

from functools import lru_cache

import torch

HAD_SIZE = 128


@lru_cache(maxsize=8)
def hadamard_128(device: str = "cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The normalized 128x128 Sylvester Hadamard matrix, built by doubling [[1]]."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < HAD_SIZE:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / HAD_SIZE ** 0.5).to(device=device, dtype=dtype)


def had_r_128(x: torch.Tensor) -> torch.Tensor:
    """``x @ Hb`` over the last dimension (a multiple of 128), in x's dtype."""
    n = x.shape[-1]
    if n % HAD_SIZE:
        raise ValueError(f"Hadamard-128 needs a width divisible by {HAD_SIZE}, got {n}")
    h = hadamard_128(str(x.device), x.dtype)
    return (x.reshape(*x.shape[:-1], n // HAD_SIZE, HAD_SIZE) @ h).reshape(x.shape)


def had_l_128(w: torch.Tensor) -> torch.Tensor:
    """``Hb @ w`` over the first dimension of a 2-D ``w`` (rows a multiple of 128)."""
    n, m = w.shape
    if n % HAD_SIZE:
        raise ValueError(f"Hadamard-128 needs a height divisible by {HAD_SIZE}, got {n}")
    h = hadamard_128(str(w.device), w.dtype)
    return (h @ w.reshape(n // HAD_SIZE, HAD_SIZE, m)).reshape(n, m)
