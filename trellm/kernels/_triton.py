"""Triton, or a stand-in when it is not installed.

Kernel modules decorate their kernels at import time; with the stand-in they still
import (so their PyTorch references stay usable on a CPU-only install) and only a
call into a kernel fails. Whether a kernel may run is ``trellm.kernels.triton_available``.
"""
from __future__ import annotations

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # CPU-only installs: PyTorch's CPU wheels do not bring Triton
    HAS_TRITON = False

    class _Missing:
        """Stands in for ``triton`` and ``triton.language``: decorators pass functions
        through; anything else raises when used."""

        @staticmethod
        def jit(fn=None, **_):
            return fn if fn is not None else (lambda f: f)

        @staticmethod
        def cdiv(a: int, b: int) -> int:
            return -(-a // b)

        @staticmethod
        def next_power_of_2(n: int) -> int:
            return 1 if n <= 1 else 1 << (n - 1).bit_length()

        def __getattr__(self, name: str):
            raise RuntimeError(f"triton is not installed (triton.{name} was used)")

    triton = _Missing()  # type: ignore[assignment]
    tl = _Missing()  # type: ignore[assignment]

__all__ = ["HAS_TRITON", "triton", "tl"]
