"""The CPU int8 LM head (two int8 activation parts through torch._int_mm)."""
import pytest
import torch

from trellm.layers.int8_head import Int8Head, int8_head_available

pytestmark = pytest.mark.skipif(not int8_head_available(), reason="this torch has no torch._int_mm")


def _hidden(rows: int, width: int, seed: int) -> torch.Tensor:
    """Rows like a final hidden state: mostly N(0, 1), a few channels ~10x larger."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=g)
    x[:, torch.randperm(width, generator=g)[:4]] *= 12.0
    return x


@pytest.mark.parametrize("rows", [1, 3, 8, 17])
def test_int8_head_close_to_its_float_activation_reference(rows):
    g = torch.Generator().manual_seed(0)
    head = Int8Head.from_weight(torch.randn(1000, 576, generator=g) * 0.05)
    x = _hidden(rows, 576, rows)
    got, want = head(x), head.reference(x)
    assert got.dtype == torch.float32 and got.shape == (rows, 1000)
    # The two activation parts leave an error of at most max|x| / 127 / 508 per element:
    # summed over 576 inputs against |w| <= max scale * 127, far below a logit's scale.
    err = (got - want).abs().max()
    bound = float(x.abs().max() / 127 / 508 * 576 * head.scale.max() * 127)
    assert err <= bound, (err, bound)
    assert err < 2e-3 * want.abs().max()


def test_int8_head_rows_do_not_depend_on_the_batch():
    head = Int8Head.from_weight(torch.randn(300, 64) * 0.1)
    x = _hidden(9, 64, 5)
    together = head(x)
    for i in range(9):
        assert torch.equal(head(x[i:i + 1])[0], together[i])


def test_int8_head_weights_round_per_row():
    w = torch.randn(50, 32)
    w[7] *= 1000.0  # one huge row must not coarsen the others
    head = Int8Head.from_weight(w)
    deq = head.q.float() * head.scale[:, None]
    assert ((deq - w).abs() <= head.scale[:, None] / 2 + 1e-6).all()
    assert int(head.q.abs().max()) == 127 and head.q.dtype == torch.int8


def test_int8_head_extreme_rows_stay_in_range():
    """Rows of one repeated value (the residual is ~0), zeros, and huge values: no int8
    wrap-around (a q2 of 128 would flip to -128)."""
    head = Int8Head.from_weight(torch.randn(40, 16))
    x = torch.stack([torch.full((16,), 3.0), torch.zeros(16), torch.linspace(-1e4, 1e4, 16),
                     torch.tensor([1.0, -1.0] * 8) * (127.5 / 127)])
    got, want = head(x), head.reference(x)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3 * float(want.abs().max()))
