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
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def default_gguf():
    from trellm.default_model import default_model_path

    return str(default_model_path())
