"""Kernel tests: run on a CUDA GPU, or on the CPU under Triton's interpreter
(``TRITON_INTERPRET=1``, small shapes only). Skipped with the reason otherwise."""
from __future__ import annotations

import pytest
import torch

from trellm import envs
from trellm.kernels import kernel_supported, triton_importable

INTERPRET = envs.triton_interpret()
DEVICE = torch.device("cpu" if INTERPRET else "cuda")


def _skip_reason() -> str | None:
    if not triton_importable():
        return "triton is not installed (GPU kernel tests need CUDA + triton, or TRITON_INTERPRET=1)"
    if not kernel_supported(DEVICE):
        return ("no CUDA GPU: tests/test_kernels_interpreted.py runs these under Triton's CPU interpreter "
                "(or set TRITON_INTERPRET=1)")
    return None


def pytest_collection_modifyitems(config, items):
    reason = _skip_reason()
    for item in items:
        if reason is not None and "tests/kernels/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture
def device() -> torch.device:
    return DEVICE


if INTERPRET and triton_importable():
    from trellm.kernels.testing import patch_interpreter_bf16, patch_interpreter_overflow_checks

    patch_interpreter_bf16()
    patch_interpreter_overflow_checks()
    if envs.record_launches_path():  # for scripts/compile_check.py (kernels/compile_check.py)
        from trellm.kernels.compile_check import record_launches

        record_launches(envs.record_launches_path())
