"""The dispatch rules and the CPU fallbacks of the fused GEMVs (SiLU-and-mul; the RMSNorm
before a projection: kernels/gemv.py gemv_rms_norm, model/llama.py norm_linear): no
Triton needed. The kernels themselves: tests/kernels/test_gemv.py."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from trellm.kernels.gemv import GemvDispatch


def test_dispatch_norm_only_where_calibration_picked_it():
    d = GemvDispatch(use_norm={(64, 32, 1): True, (64, 32, 2): True, (64, 32, 4): False})
    w = torch.zeros(64, 32)
    assert d.wants_norm(torch.zeros(1, 32), w)
    assert d.wants_norm(torch.zeros(2, 32), w)
    assert not d.wants_norm(torch.zeros(4, 32), w)  # timed slower
    assert not d.wants_norm(torch.zeros(8, 32), w)  # never timed
    assert not d.wants_norm(torch.zeros(1, 64), w)  # not the weight's input width
    assert not GemvDispatch().wants_norm(torch.zeros(1, 32), w)


def test_norm_linear_falls_back_to_the_norm_kernels(small_mlp, recording_ops):
    """CPU, no dispatch (or one that did not pick the fused kernel for these rows):
    norm_linear runs ops.fused_add_rms_norm (ops.rms_norm without a residual), then the
    linear, with the model's values; the residual it returns is x + residual (x itself)."""
    from trellm.kernels.rmsnorm import fused_add_rms_norm_ref, rms_norm_ref
    from trellm.model.llama import RMSNorm, norm_linear

    mlp, ops, x = small_mlp, recording_ops, torch.randn(2, 32)
    norm, res = RMSNorm(32, 1e-5, torch.float32), torch.randn(2, 32)
    norm.weight.data.copy_(1 + 0.1 * torch.randn(32))
    normed, new_res = fused_add_rms_norm_ref(x, res, norm.weight, 1e-5)
    want = (mlp.gate_up_proj(normed), new_res)
    want_first = (mlp.gate_up_proj(rms_norm_ref(x, norm.weight, 1e-5)), x)
    for dispatch in (None, GemvDispatch(use_norm={(96, 32, 1): True})):  # the pick is for other rows
        mlp.gate_up_proj.method.gemv_dispatch = dispatch
        torch.testing.assert_close(norm_linear(mlp.gate_up_proj, x, res, norm, ops), want)
        got = norm_linear(mlp.gate_up_proj, x, None, norm, ops)
        torch.testing.assert_close(got[0], want_first[0])
        assert got[1] is x
    assert ops.calls == 4


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


def _timer(values):
    it = iter(values)
    return lambda: next(it)


def test_calibration_decides_near_ties_by_medians():
    from trellm.kernels.gemv import decide

    # Clear cases: one timing each (a second call would exhaust the iterators).
    assert decide(_timer([50.0]), _timer([100.0]), 0.95) == (100.0, 50.0, True)
    assert decide(_timer([99.0]), _timer([100.0]), 0.95) == (100.0, 99.0, False)
    # Near the line: five timings each, medians. The first pair alone (80 vs 84.5: 0.947)
    # would pick the candidate at 0.95; the medians (80 vs 82: 0.976) do not; at 0.98 they do.
    cand, base = [80.0, 81.0, 79.0, 80.0, 90.0], [84.5, 82.0, 81.0, 82.0, 83.0]
    assert decide(_timer(cand), _timer(base), 0.95) == (82.0, 80.0, False)
    base[0] = 83.5  # 0.958 alone; retimed at 0.98 too
    assert decide(_timer(cand), _timer(base), 0.98) == (82.0, 80.0, True)
    # A clear win is not retimed even where one of the medians would differ.
    assert decide(_timer([80.0, 200.0]), _timer([86.0, 10.0]), 0.98) == (86.0, 80.0, True)
