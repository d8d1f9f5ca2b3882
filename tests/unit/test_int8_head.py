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
    """A vocabulary not a multiple of 16 and up to 33 rows (vector tails, threaded paths):
    each row's logits are the same bits alone and in any batch."""
    head = Int8Head.from_weight(torch.randn(32003, 96) * 0.1)
    x = _hidden(33, 96, 5)
    together = head(x)
    for i in (0, 7, 16, 32):
        assert torch.equal(head(x[i:i + 1])[0], together[i])
    assert torch.equal(head(x[3:20]), together[3:20])


def test_int8_head_weights_round_per_row():
    w = torch.randn(50, 32)
    w[7] *= 1000.0  # one huge row must not coarsen the others
    head = Int8Head.from_weight(w)
    deq = head.q.float() * head.scale[:, None]
    assert ((deq - w).abs() <= head.scale[:, None] / 2 + 1e-6).all()
    assert int(head.q.abs().max()) == 127 and head.q.dtype == torch.int8


def test_int8_head_extreme_rows_stay_in_range():
    """Rows of one repeated value (the residual is ~0), zeros, huge values, and exact half
    steps (s = 1: residuals of +-0.5, q2 = +-127): no int8 wrap-around."""
    head = Int8Head.from_weight(torch.randn(40, 16))
    x = torch.stack([torch.full((16,), 3.0), torch.zeros(16), torch.linspace(-1e4, 1e4, 16),
                     torch.tensor([127.0, 0.5, 1.5, -2.5, -0.5, 126.5] + [0.0] * 10)])
    got, want = head(x), head.reference(x)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3 * float(want.abs().max()))
    torch.testing.assert_close(got[3], want[3], rtol=0, atol=1e-4 * float(want[3].abs().max()))


def test_not_offered_without_onednn(monkeypatch):
    """Without oneDNN the CPU _int_mm is plain loops: the model keeps the dense head."""
    int8_head_available.cache_clear()
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)
    try:
        assert not int8_head_available()
    finally:
        int8_head_available.cache_clear()
