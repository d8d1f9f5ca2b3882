"""The Triton kernels against their references on a machine without a GPU.

The kernel tests (tests/kernels) need CUDA, or Triton's CPU interpreter, which must be on
(``TRITON_INTERPRET=1``) before Triton is first imported and which would also route the
engine tests' CPU models through the kernels. So here they run in a pytest of their own,
under the interpreter: every non-EXL3 kernel test, and of the EXL3 file (49 minutes in
full on 2 cores) the fused-layer kernel over every K and codebook, merged parts, the
dispatch, x in fragment order, and exl3_mma at K 4 (MUL1) and 6 (MCG). ``./setup.sh --dev`` installs Triton and
a numpy the interpreter works with (below 2.3) on machines without CUDA; on a GPU machine
tests/kernels runs on the GPU in the main pytest instead."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trellm.kernels import triton_importable

ROOT = Path(__file__).resolve().parent.parent
# ~6.5 minutes on 2 cores (2026-12-07); the whole EXL3 file's mma cases are for the GPU run.
SELECTION = ("not test_exl3_kernels or fast_every or fast_merged_parts or (dispatch and not mma_merged)"
             " or fragment_order or (mma_every and plain and (4-mul1 or 6-mcg))")


def _reason() -> str | None:
    if torch.cuda.is_available():
        return "a CUDA GPU is here: tests/kernels run on it in this pytest"
    if not triton_importable():
        return "triton is not installed (./setup.sh --dev installs it on machines without CUDA)"
    import numpy

    if tuple(int(p) for p in numpy.__version__.split(".")[:2]) >= (2, 3):
        return f"numpy {numpy.__version__}: Triton 3.6's interpreter needs numpy < 2.3 (./setup.sh --dev pins it)"
    return None


@pytest.mark.slow
@pytest.mark.skipif(_reason() is not None, reason=_reason() or "")
def test_kernels_match_references_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore::DeprecationWarning",
           "tests/kernels", "-k", SELECTION]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    tail = (p.stdout + p.stderr)[-6000:]
    assert p.returncode == 0, f"{' '.join(cmd)} failed:\n{tail}"
    last = tail.strip().splitlines()[-1]
    # Skips here are the kernels' own (32k+ contexts: too slow for the interpreter), with reasons.
    assert " passed" in last and "failed" not in last and "error" not in last, last
