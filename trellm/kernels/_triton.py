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

__all__ = ["HAS_TRITON", "triton", "tl", "pdl_begin", "pdl_enabled", "pdl_kwargs"]


# ---- programmatic dependent launch (sm_90+) -------------------------------------------------
# A decode step is hundreds of small kernels in one CUDA graph; between two of them the GPU
# drains one grid, then launches and ramps up the next. With PDL a kernel launched with
# ``launch_pdl`` may start while its predecessor's CTAs still run: it waits (``gdc_wait``)
# before it reads or writes anything the predecessor may touch, so the data dependencies
# are those of serial launches. Its successor may launch once every CTA of it has called
# ``gdc_launch_dependents`` (or exited). ``late`` trigger: right after the wait, so only
# the next kernel's launch overlaps. ``early``: before the wait, so a chain of kernels
# launches as fast as the SMs have room for their CTAs, and a kernel that reads its
# weight before the wait (gemv) streams it while the kernels ahead of it still run. A
# grid's successor launches only once all its CTAs are resident (each calls the trigger
# first), so waiting CTAs never take the room of a grid that still has to start some.

_PDL: dict[str, object] = {}


def _pdl_decision() -> tuple[bool, str, str]:
    if "ok" not in _PDL:
        from trellm import envs

        ok = HAS_TRITON and not envs.triton_interpret()
        if ok:
            import torch

            ok = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
        _PDL["ok"], _PDL["mode"], _PDL["trigger"] = ok, envs.pdl_mode(), envs.pdl_trigger()
    return bool(_PDL["ok"]), str(_PDL["mode"]), str(_PDL["trigger"])


def pdl_enabled(gpu_checked: bool = True) -> bool:
    """Whether a kernel launches with PDL: on a CUDA device of compute capability 9.0 or
    more, with Triton, not in Triton's interpreter, and as ``TRELLM_PDL`` says
    (envs.pdl_mode: by default for ``gpu_checked`` kernels, the ones whose engine-level
    checks ran with PDL on the GPU). Decided once per process."""
    ok, mode, _ = _pdl_decision()
    return ok and (mode == "all" or (mode == "auto" and gpu_checked))


def pdl_kwargs(gpu_checked: bool = True) -> dict:
    """Launch keywords for a kernel with a ``PDL`` constexpr that calls ``pdl_begin(PDL)``:
    PDL = 1 triggers the successor after the wait, 2 before it (``TRELLM_PDL_TRIGGER``).
    ``gpu_checked=False``: a kernel whose PDL mode no GPU run has checked yet (EXL3, int8):
    only with ``TRELLM_PDL=1``."""
    if not pdl_enabled(gpu_checked):
        return {}
    return {"PDL": 2 if _pdl_decision()[2] == "early" else 1, "launch_pdl": True}


if HAS_TRITON:
    @triton.jit
    def pdl_begin(PDL: tl.constexpr):
        """With PDL, wait for the predecessor grid's completion (and memory) and allow the
        successor's launch, in the order PDL says (1: wait first, 2: allow first). Only
        reads of what no kernel of the forward writes may come before it: weights, tables,
        and the step's metadata (positions, slots, block tables, context lengths), which
        are copied in before the forward's first kernel starts."""
        if PDL:
            if PDL == 2:
                tl.extra.cuda.gdc_launch_dependents()
                tl.extra.cuda.gdc_wait()
            else:
                tl.extra.cuda.gdc_wait()
                tl.extra.cuda.gdc_launch_dependents()
else:
    def pdl_begin(PDL):  # the stand-in: kernels never run without Triton
        raise RuntimeError("triton is not installed")
