"""Triton paged attention: the GPU backend (registry name 'triton').

Same contract as TorchPagedAttention: ``forward(q, k, v, kv_cache, meta, scale)``
writes the step's K/V to the cache slots and attends. A model that writes the
cache itself (the fused ``trellm.kernels.rope_kv.rope_and_write_kv``) calls
``attend(q, kv_cache, meta, scale)`` instead: the KV-already-written entry point.
We chose a second entry point over a flag in AttentionMetadata because whether
K/V are written is a property of the model code calling the backend, not of the
step; a flag would let one layer's choice leak to another's.

Both kernels read every key and value from the cache (the chunk's own included),
so the write must precede them; decode rows and prefill chunks share one output
tensor and each kernel writes only its rows.

Decode combines its splits inside the split kernel (``fused_decode_reduce``, the
default): it needs one zeroed int32 counter per (sequence, kv head), which the
backend owns and reuses across layers, steps and graph replays (each launch leaves
the counters at 0). ``fused_decode_reduce = False`` selects the reference two-kernel
path (split kernel + reduce kernel).

The kernels want per-step int32 device tensors that AttentionMetadata does not
carry yet (``TritonStepMetadata``). ``prepare`` derives them from the metadata on
the first layer of a step and caches them for the other layers (keyed on the
metadata object's identity); build_batch can later fill them directly instead.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from trellm.attention.torch_paged import AttentionMetadata
from trellm.host_copy import device_tensor


@dataclass
class TritonStepMetadata:
    """Device tensors the Triton kernels read, derived once per step."""

    decode_token_index: torch.Tensor | None
    """[B] int32 rows of the decode tokens in the flat batch."""
    decode_block_table: torch.Tensor | None
    """[B, max_blocks] int32."""
    decode_seq_lens: torch.Tensor | None
    """[B] int32, the new token included."""
    decode_max_seq_len: int
    """Host int: sizes the split count (fix num_splits instead under CUDA-graph capture)."""
    prefill_q_start: torch.Tensor | None
    """[N] int32 first row of each prefill chunk in the flat batch."""
    prefill_q_lens: torch.Tensor | None
    """[N] int32 chunk lengths."""
    prefill_seq_lens: torch.Tensor | None
    """[N] int32 context lengths, the chunk included."""
    prefill_block_table: torch.Tensor | None
    """[N, max_blocks] int32, rows padded with 0 (never read past seq_len)."""
    prefill_max_q_len: int
    """Host int: sizes the prefill grid."""


def prepare(meta: AttentionMetadata, device: torch.device) -> TritonStepMetadata:
    """TritonStepMetadata from the torch backend's metadata, with no device sync: the
    prefill ints are host values; the block tables are padded on the device."""
    d = meta.decode
    dec = (None, None, None, 0)
    if d is not None:
        dec = (d.token_index.to(device=device, dtype=torch.int32),
               d.block_table.to(device=device, dtype=torch.int32).contiguous(),
               d.seq_lens.to(device=device, dtype=torch.int32), d.max_seq_len)
    pre = (None, None, None, None, 0)
    if meta.prefills:
        ps = meta.prefills
        ints = device_tensor([[p.q_start for p in ps], [p.q_len for p in ps], [p.seq_len for p in ps]],
                             device, torch.int32)
        table = torch.nn.utils.rnn.pad_sequence([p.block_ids.to(device) for p in ps], batch_first=True)
        pre = (ints[0], ints[1], ints[2], table.to(torch.int32).contiguous(), max(p.q_len for p in ps))
    return TritonStepMetadata(*dec, *pre)


class TritonPagedAttention:
    """Registry entry 'triton': CUDA tensors of bf16/fp16/fp32, Triton importable."""

    name = "triton"
    fused_decode_reduce = True
    """Decode in one launch per layer (split kernel combining its own splits); False:
    the reference split + reduce kernels. A class default, so a benchmark can flip it
    before the engine builds its backend."""

    def __init__(self) -> None:
        self._step: tuple[AttentionMetadata, TritonStepMetadata] | None = None
        self._counters: torch.Tensor | None = None
        self._retired: list[torch.Tensor] = []
        """Outgrown counter buffers, kept alive: a captured CUDA graph may still point
        at one (and resets it itself), so freeing it would let the graph write into
        memory handed out again."""

    @staticmethod
    def supports(device: torch.device, dtype: torch.dtype) -> bool:
        if torch.device(device).type != "cuda" or dtype not in (torch.bfloat16, torch.float16, torch.float32):
            return False
        from trellm.kernels import triton_available

        return triton_available()

    def step_metadata(self, meta: AttentionMetadata, device: torch.device) -> TritonStepMetadata:
        # Holding the last metadata object keeps its id from being reused by a later step.
        if self._step is None or self._step[0] is not meta:
            self._step = (meta, prepare(meta, device))
        return self._step[1]

    def decode_counters(self, n: int, device: torch.device) -> torch.Tensor:
        """At least n zeroed int32 counters. Grown outside graph capture in practice:
        every capture is preceded by an eager warm-up of the same batch."""
        c = self._counters
        if c is None or c.numel() < n or c.device != device:
            if c is not None:
                self._retired.append(c)
            self._counters = torch.zeros(max(256, 1 << (n - 1).bit_length()), dtype=torch.int32, device=device)
        return self._counters

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hk, D]; returns [T, Hq, D]."""
        from trellm.kernels.rope_kv import write_kv

        write_kv(k, v, kv_cache, meta.slot_mapping)
        return self.attend(q, kv_cache, meta, scale)

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
               scale: float) -> torch.Tensor:
        """Attention for a step whose K/V are already in the cache. q: [T, Hq, D]."""
        return self._attend(q, kv_cache, meta, scale, None)[0]

    def attend_xform(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                     transform) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(``attend``'s output [T, Hq * D], its input transform for the next linear [T, Hq * D]
        as ``transform`` (quant.base.InputTransform) asks), written by the decode kernel as it
        stores its output; None where it cannot (prefill rows in the step, D != 128)."""
        sm = self.step_metadata(meta, q.device)
        if q.shape[-1] != 128 or transform.suh.shape != (q.shape[1] * 128,) or sm.prefill_q_start is not None \
                or sm.decode_token_index is None:
            return None
        out, xh = self._attend(q, kv_cache, meta, scale, transform)
        return out.reshape(q.shape[0], -1), xh

    def _attend(self, q, kv_cache, meta, scale, transform):
        from trellm.kernels.paged_attention import paged_decode, paged_prefill

        if q.stride(2) != 1:
            q = q.contiguous()
        sm = self.step_metadata(meta, q.device)
        out = torch.empty_like(q)
        xh = None
        if sm.decode_token_index is not None:
            fused = self.fused_decode_reduce
            counters = self.decode_counters(sm.decode_seq_lens.shape[0] * kv_cache.shape[3], q.device) \
                if fused else None
            if transform is not None:
                xh = torch.empty(q.shape[0], q.shape[1] * q.shape[2], dtype=transform.dtype, device=q.device)
            paged_decode(q, kv_cache, sm.decode_block_table, sm.decode_seq_lens, scale,
                         token_index=sm.decode_token_index, out=out, max_seq_len=sm.decode_max_seq_len,
                         fused_reduce=fused, counters=counters,
                         xform=None if xh is None else (transform.suh, xh))
        if sm.prefill_q_start is not None:
            paged_prefill(q, kv_cache, sm.prefill_block_table, sm.prefill_q_start, sm.prefill_q_lens,
                          sm.prefill_seq_lens, sm.prefill_max_q_len, scale, out=out)
        return out, xh
