"""The dispatch rules and the CPU fallbacks of the fused GEMVs (SiLU-and-mul; residual
add + RMSNorm: kernels/gemv.py gemv_add_rms_norm, model/llama.py linear_add_norm): no
Triton needed. The kernels themselves: tests/kernels/test_gemv.py."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from trellm.kernels.gemv import GemvDispatch


def test_dispatch_add_norm_only_where_calibration_picked_it():
    d = GemvDispatch(use_add_norm={(64, 32, 1, False): True, (64, 32, 2, True): True, (64, 32, 4, False): False})
    w = torch.zeros(64, 32)
    assert d.wants_add_norm(torch.zeros(1, 32), w)
    assert not d.wants_add_norm(torch.zeros(1, 64), w, glu=True)  # never timed with the GLU
    assert d.wants_add_norm(torch.zeros(2, 64), w, glu=True)
    assert not d.wants_add_norm(torch.zeros(2, 32), w, glu=True)  # not a [M, 2K] gate_up
    assert not d.wants_add_norm(torch.zeros(4, 32), w)  # timed slower
    assert not GemvDispatch().wants_add_norm(torch.zeros(1, 32), w)


def test_mlp_and_o_projection_add_norm_fall_back_to_the_unfused_kernels(small_mlp, recording_ops):
    """CPU, no dispatch (or one that did not pick the fused kernel): linear_add_norm runs
    the linear, then ops.fused_add_rms_norm, with the model's values."""
    from trellm.kernels.rmsnorm import fused_add_rms_norm_ref
    from trellm.model.llama import RMSNorm, linear_add_norm

    mlp, ops, x = small_mlp, recording_ops, torch.randn(2, 32)
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


def test_mlp_falls_back_to_silu_and_mul_without_a_glu_choice(small_mlp, recording_ops):
    """CPU: with no dispatch, or one whose calibration did not pick the fused GEMV for
    this (shape, rows), the MLP's fused-ops branch runs ops.silu_and_mul + down_proj."""
    mlp, ops, x = small_mlp, recording_ops, torch.randn(2, 32)
    gate, up = mlp.gate_up_proj.split(mlp.gate_up_proj(x))
    want = mlp.down_proj(F.silu(gate) * up)
    torch.testing.assert_close(mlp(x, ops), want)
    mlp.down_proj.method.gemv_dispatch = GemvDispatch(use_glu={(32, 48, 1): True})  # other rows only
    torch.testing.assert_close(mlp(x, ops), want)
    assert ops.calls == 2
