"""Shared fixtures. The embedded default model is loaded once per session per config."""
from __future__ import annotations

import os

import pytest

# Two cores: keep torch from oversubscribing when pytest runs alongside other work.
os.environ.setdefault("OMP_NUM_THREADS", "2")


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    from trellm import envs

    # Under Triton's interpreter the kernel tests run on the CPU (tests/kernels/conftest.py
    # skips them itself when even that is impossible).
    interpret = envs.triton_interpret()
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            if interpret and "tests/kernels/" in str(item.fspath).replace("\\", "/"):
                continue
            item.add_marker(skip)


@pytest.fixture(scope="session")
def default_gguf():
    from trellm.default_model import default_model_path

    return str(default_model_path())
