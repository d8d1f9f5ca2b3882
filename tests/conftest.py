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


class RecordingOps:
    """FusedOps stand-in for the model's fused-ops branch: counts its calls, answers with
    the kernels' references."""

    def __init__(self):
        self.calls = 0

    def silu_and_mul(self, x):
        from trellm.kernels.activation import silu_and_mul_ref

        self.calls += 1
        return silu_and_mul_ref(x)

    def fused_add_rms_norm(self, x, residual, weight, eps):
        from trellm.kernels.rmsnorm import fused_add_rms_norm_ref

        self.calls += 1
        return fused_add_rms_norm_ref(x, residual, weight, eps)

    def rms_norm(self, x, weight, eps):
        from trellm.kernels.rmsnorm import rms_norm_ref

        self.calls += 1
        return rms_norm_ref(x, weight, eps)


@pytest.fixture
def recording_ops():
    return RecordingOps()


@pytest.fixture
def small_mlp():
    """A float32 llama MLP (hidden 32, intermediate 48) with seeded random weights, on the CPU."""
    from types import SimpleNamespace

    import torch

    from trellm.model.llama import MLP

    torch.manual_seed(0)
    mlp = MLP(SimpleNamespace(hidden_size=32, intermediate_size=48, quantization_config=None), torch.float32)
    for p in mlp.parameters():
        p.data.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    return mlp
