"""The CPU LM head in int8: per-row int8 weights, activations split into two int8 parts.

Why: the head is ~a fifth of the bytes a CPU decode step of the default model reads, and
``torch._weight_int8pack_mm`` (int8 weights, bf16 activations) converts every weight to
float for each activation row: on the 2-core AVX-512 machine [49152 x 576] took 1.9 ms at
1 row and 6.0 ms at 8. ``torch._int_mm`` multiplies int8 by int8 into int32 (VNNI): 0.8
ms at 1 row, 1.9 ms at 8, 2.8 ms at 17 (weights as the transposed view of [N, K]).

One int8 part per activation row loses too much: the final hidden state has outliers
(max |x| ~ 10x its RMS on the default model), and per-row int8 activations raised the
head's mean KL to float32 from 0.0016 (bf16 activations) to 0.0057. So each row x is
split as x = s (q1 + q2 / 254) + e: q1 = round(x / s) with s = max|x| / 127, then the
residual (within s / 2) rounded on a 254x finer grid. Both parts go through one
``_int_mm`` as extra rows; the int32 sums are exact and each row uses only its own
scale, so a row's logits do not depend on the rest of the batch. Measured on 240
positions of the default model: mean KL to the float32 head 0.00118, the same as int8
weights with float32 activations (0.00118), and below the bf16-activation head's 0.00155.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from trellm.quant.int8 import quantize_int8

FINE = 254.0
"""The residual's grid is this much finer than the first part's: |x - s q1| <= s / 2
rounds onto [-127, 127] steps of s / 254."""


@functools.cache
def int8_head_available() -> bool:
    """``torch._int_mm`` through oneDNN, and exact on full-range inputs. Without oneDNN
    the CPU ``_int_mm`` is plain loops (~10x slower than the bf16-activation head it
    replaces); a CPU without VNNI may saturate int16 partial sums. Checked once."""
    if not (hasattr(torch, "_int_mm") and torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
        return False
    a = torch.tensor([[127, -127] * 32, [-127] * 64, [127] * 64], dtype=torch.int8)
    b = torch.tensor([[127] * 16, [-127] * 16] * 32, dtype=torch.int8)
    return torch.equal(torch._int_mm(a, b).long(), a.long() @ b.long())


@dataclass(frozen=True, eq=False)
class Int8Head:
    """An LM head quantized per output row: W ~= q * scale[:, None]."""

    q: torch.Tensor
    """int8 [vocab, hidden]."""
    scale: torch.Tensor
    """float32 [vocab]."""

    @classmethod
    def from_weight(cls, weight: torch.Tensor) -> "Int8Head":
        return cls(*quantize_int8(weight))

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [M, vocab] of hidden [M, K] (any float dtype)."""
        m = hidden.shape[0]
        x = hidden.float()
        s = x.abs().amax(dim=-1, keepdim=True).clamp_min_(1e-30) / 127.0
        q1 = torch.round(x / s)
        # |residual| <= s / 2 up to float rounding (seen: 127.0008 at most), so q2 fits;
        # the clamp is defensive, an int8 cast would wrap a 128 to -128.
        q2 = torch.round((x - q1 * s) * (FINE / s)).clamp_(-127, 127)
        acc = torch._int_mm(torch.cat((q1, q2)).to(torch.int8), self.q.t())
        # One float [M, vocab] result: prompt log-probs send thousands of rows.
        return acc[:m].float().add_(acc[m:], alpha=1.0 / FINE).mul_(s).mul_(self.scale)

    def reference(self, hidden: torch.Tensor) -> torch.Tensor:
        """The arithmetic it approximates: the int8 weights against float32 activations."""
        return hidden.float() @ (self.q.float() * self.scale[:, None]).t()
