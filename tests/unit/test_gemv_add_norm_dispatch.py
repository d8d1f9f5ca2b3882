"""The dispatch rule and the CPU fallback of the fused GEMV + residual add + RMSNorm
(kernels/gemv.py gemv_add_rms_norm, model/llama.py linear_add_norm): no Triton needed.
The kernel itself: tests/kernels/test_gemv.py."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from trellm.kernels.activation import silu_and_mul_ref
from trellm.kernels.gemv import GemvDispatch


class _RecordingOps:
    """FusedOps stand-in: counts the calls linear_add_norm makes, with reference values."""

    def __init__(self):
        self.calls = 0

    def silu_and_mul(self, x):
        self.calls += 1
        return silu_and_mul_ref(x)

    def fused_add_rms_norm(self, x, residual, weight, eps):
        from trellm.kernels.rmsnorm import fused_add_rms_norm_ref

        self.calls += 1
        return fused_add_rms_norm_ref(x, residual, weight, eps)


def _mlp(hidden: int = 32, inter: int = 48):
    from trellm.model.llama import MLP

    torch.manual_seed(0)
    mlp = MLP(SimpleNamespace(hidden_size=hidden, intermediate_size=inter, quantization_config=None), torch.float32)
    for p in mlp.parameters():
        p.data.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    return mlp


def test_dispatch_add_norm_only_where_calibration_picked_it():
    d = GemvDispatch(use_add_norm={(64, 32, 1, False): True, (64, 32, 2, True): True, (64, 32, 4, False): False})
    w = torch.zeros(64, 32)
    assert d.wants_add_norm(torch.zeros(1, 32), w)
    assert not d.wants_add_norm(torch.zeros(1, 64), w, glu=True)  # never timed with the GLU
    assert d.wants_add_norm(torch.zeros(2, 64), w, glu=True)
    assert not d.wants_add_norm(torch.zeros(2, 32), w, glu=True)  # not a [M, 2K] gate_up
    assert not d.wants_add_norm(torch.zeros(4, 32), w)  # timed slower
    assert not GemvDispatch().wants_add_norm(torch.zeros(1, 32), w)


def test_mlp_and_o_projection_add_norm_fall_back_to_the_unfused_kernels():
    """CPU, no dispatch (or one that did not pick the fused kernel): linear_add_norm runs
    the linear, then ops.fused_add_rms_norm, with the model's values."""
    from trellm.kernels.rmsnorm import fused_add_rms_norm_ref
    from trellm.model.llama import RMSNorm, linear_add_norm

    mlp, ops, x = _mlp(), _RecordingOps(), torch.randn(2, 32)
    norm, res = RMSNorm(32, 1e-5, torch.float32), torch.randn(2, 32)
    norm.weight.data.copy_(1 + 0.1 * torch.randn(32))
    want = fused_add_rms_norm_ref(mlp(x), res, norm.weight, 1e-5)
    for got in (mlp.forward_add_norm(x, res, norm, ops),
                linear_add_norm(mlp.down_proj, mlp.gate_up_proj(x), res, norm, ops, glu=True)):
        torch.testing.assert_close(got, want)
    mlp.down_proj.method.gemv_dispatch = GemvDispatch(use_add_norm={(32, 48, 1, True): True})  # other rows only
    torch.testing.assert_close(mlp.forward_add_norm(x, res, norm, ops), want)
    assert ops.calls == 6  # silu_and_mul + fused_add_rms_norm, three times
    h = torch.randn(2, 48)
    torch.testing.assert_close(linear_add_norm(mlp.down_proj, h, res, norm, ops),
                               fused_add_rms_norm_ref(mlp.down_proj(h), res, norm.weight, 1e-5))


