"""CPU decode: the running sequences' K/V kept contiguous between steps (no per-step gather).

Why: a CPU decode step of several sequences attends over their paged K/V, and the
pure-PyTorch path gathers every sequence's blocks into one padded tensor per layer and
step (``paged_decode_reference``). At 8 sequences of ~200 tokens on the 2-core machine
that gather is ~85 us a layer against ~57 us for the attention itself, a tenth of the
step. Between two decode steps of the same sequences only one token per sequence is
new, so each layer keeps the last gather (a *mirror*: [2, B, cap, Hk, D]) and appends
the step's new K/V rows to it; a step whose decode group differs (a request joined,
left or was preempted; the previous step was not this group's) gathers afresh.

The mirror holds exact copies of the pool's values (the same float32 rows the step
writes into the pool), so attention over it equals attention over a gather, bit for bit
(tests/engine/test_kv_mirror.py). It costs memory beside the pool, bounded by
``budget_bytes`` over all layers; past that, steps gather as before.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

CAP_STEP = 128
"""Mirror length granularity (tokens): a sequence past the mirror's length regathers
once per this many tokens."""


@dataclass
class _LayerMirror:
    step: int
    request_ids: tuple[str, ...]
    lens: tuple[int, ...]
    buf: torch.Tensor
    """[2, B, cap, Hk, D]: K then V, sequence b's first lens[b] positions valid."""


class DecodeKVMirror:
    """Per layer (keyed by its pool tensor) the last decode group's contiguous K/V."""

    def __init__(self, num_layers: int, budget_bytes: int = 512 << 20):
        self.num_layers = num_layers
        self.budget_bytes = budget_bytes
        self.layers: dict[int, _LayerMirror] = {}
        self._rows: tuple[int, int, torch.Tensor] | None = None
        """(step, cap, rows): the append rows, the same for every layer of a step."""
        self.appends = 0
        self.rebuilds = 0
        """Layer-steps that appended / regathered (tests and profiles read them)."""

    def kv(self, kv_cache: torch.Tensor, step: int, request_ids: tuple[str, ...], lens: tuple[int, ...],
           k_new: torch.Tensor, v_new: torch.Tensor, gather, new: torch.Tensor | None = None) -> torch.Tensor | None:
        """[2, B, Hk, L, D] K/V of the decode group (L = max(lens)), the new rows
        (k_new/v_new [B, Hk, D], this step's token of each sequence) included, or None
        when the mirror would exceed its budget (the caller gathers). ``gather(L)``
        returns the group's K/V from the pool as [2, B, >= L, Hk, D]; ``new``: k_new and
        v_new already stacked in the pool's dtype (torch_paged.write_kv's), or None."""
        b, length = len(request_ids), max(lens)
        key = kv_cache.data_ptr()
        m = self.layers.get(key)
        if m is not None and self._continues(m, step, request_ids, lens, kv_cache):
            cap = m.buf.shape[2]
            if self._rows is None or self._rows[:2] != (step, cap):
                self._rows = (step, cap, torch.tensor([i * cap + n - 1 for i, n in enumerate(lens)]))
            rows = self._rows[2]
            if new is None or new.dtype != m.buf.dtype:
                new = torch.stack((k_new, v_new)).to(m.buf.dtype)
            m.buf.view(2, b * cap, *m.buf.shape[3:]).index_copy_(1, rows, new)
            self.appends += 1
        else:
            m = self._rebuild(key, m, kv_cache, b, length, gather)
            if m is None:
                return None
            self.rebuilds += 1
        m.step, m.request_ids, m.lens = step, request_ids, lens
        return m.buf[:, :, :length].transpose(2, 3)

    @staticmethod
    def _continues(m: _LayerMirror, step: int, request_ids, lens, kv_cache) -> bool:
        """The previous step was this layer's last decode of the same sequences, in the
        same order, and each is exactly one token longer: only the new rows are missing."""
        return (m.step == step - 1 and m.request_ids == request_ids and max(lens) <= m.buf.shape[2]
                and all(a + 1 == n for a, n in zip(m.lens, lens))
                and m.buf.dtype == kv_cache.dtype and m.buf.shape[3:] == kv_cache.shape[3:])

    def _rebuild(self, key: int, m: _LayerMirror | None, kv_cache: torch.Tensor, b: int, length: int,
                 gather) -> _LayerMirror | None:
        cap = -(-length // CAP_STEP) * CAP_STEP
        shape = (2, b, cap, *kv_cache.shape[3:])
        per_layer = kv_cache.element_size() * torch.Size(shape).numel()
        if per_layer * self.num_layers > self.budget_bytes:
            self.layers.clear()  # beyond the budget: free what is held and gather
            return None
        if m is None or m.buf.shape != shape or m.buf.dtype != kv_cache.dtype:
            # Zeros: rows past a shorter sequence's end are masked, and a masked NaN would
            # still poison the weighted sum (0 * NaN).
            buf = torch.zeros(shape, dtype=kv_cache.dtype, device=kv_cache.device)
        else:
            buf = m.buf
        buf[:, :, :length] = gather(length)[:, :, :length]
        m = _LayerMirror(-1, (), (), buf)
        self.layers[key] = m
        return m
