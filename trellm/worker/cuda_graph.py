"""CUDA graphs for decode steps: one graph per batch-size bucket, replayed on
persistent input buffers, so a decode step costs a few copies and one replay instead
of a few thousand kernel launches.

A decode-only step (every request adds one token, no prefill chunk) of B requests runs
in the smallest captured bucket >= B: the step's inputs are copied into the first B rows
of the buffers, the other rows are padding (slot -1: the KV write skips them; context
length 1). The graph covers the model forward and the LM head; sampling stays outside.

Attention inside a graph must not depend on host values that change per step, so the
decode split count is fixed per bucket from the context limit (the kernel divides each
sequence's actual length among the splits on the device). Only the Triton backend is
captured: the pure-PyTorch one sizes its gathers from a host max length.

``capture=False`` runs the same buffer plumbing eagerly with no padding: the CPU tests
use it to check that the persistent buffers give the same tokens as the normal path.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from trellm.attention.torch_paged import AttentionMetadata, DecodeGroup, decode_mask

log = logging.getLogger("trellm")

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)
"""Batch sizes captured (up to the largest the scheduler can form)."""


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph | None
    logits: torch.Tensor | None
    """[bucket, vocab] float32, written by every replay."""
    meta: AttentionMetadata


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, backend, kv_caches: list[torch.Tensor], block_size: int,
                 max_model_len: int, max_batch: int, device: torch.device, capture: bool = True,
                 ops=None):
        self.model, self.backend, self.kv_caches, self.ops = model, backend, kv_caches, ops
        self.block_size, self.max_len, self.device = block_size, max_model_len, device
        self.capture_enabled = capture
        self.buckets = [b for b in BUCKETS if b < max_batch] + [max_batch] if capture else []
        self.max_batch = max_batch
        width = (max_model_len + block_size - 1) // block_size
        self.input_ids = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.slots = torch.full((max_batch,), -1, dtype=torch.long, device=device)
        self.block_table = torch.zeros(max_batch, width, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(max_batch, dtype=torch.int32, device=device)
        self.rows = torch.arange(max_batch, dtype=torch.int32, device=device)
        self.graphs: dict[int, _Graph] = {}

    # ---- capture -------------------------------------------------------------------

    def capture(self) -> "DecodeGraphs":
        """Capture every bucket, largest first, sharing one memory pool."""
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for b in sorted(self.buckets, reverse=True):
            entry = _Graph(torch.cuda.CUDAGraph(), None, self._meta(b))
            self._forward(b, entry.meta)  # warm-up: Triton compiles, RoPE tables fill
            torch.cuda.synchronize(self.device)
            with torch.cuda.graph(entry.graph, pool=pool):
                entry.logits = self._forward(b, entry.meta)
            self.graphs[b] = entry
        torch.cuda.synchronize(self.device)
        log.info("captured %d decode CUDA graphs (batch %d..%d) in %.1fs", len(self.graphs),
                 min(self.buckets), max(self.buckets), time.perf_counter() - t0)
        return self

    def _meta(self, b: int, attn_mask: torch.Tensor | None = None) -> AttentionMetadata:
        decode = DecodeGroup(token_index=self.rows[:b], block_table=self.block_table[:b],
                             seq_lens=self.seq_lens[:b], max_seq_len=self.max_len, attn_mask=attn_mask)
        return AttentionMetadata(slot_mapping=self.slots[:b], decode=decode, prefills=[],
                                 block_size=self.block_size)

    def _forward(self, b: int, meta: AttentionMetadata) -> torch.Tensor:
        from trellm.worker.model_runner import ForwardContext

        ctx = ForwardContext(self.backend, self.kv_caches, meta, ops=self.ops)
        hidden = self.model(self.input_ids[:b], self.positions[:b], ctx)
        return self.model.compute_logits(hidden)

    # ---- replay --------------------------------------------------------------------

    def can_run(self, meta: AttentionMetadata, num_tokens: int) -> bool:
        d = meta.decode
        return (d is not None and not meta.prefills and num_tokens <= self.max_batch
                and d.block_table.shape[1] <= self.block_table.shape[1])

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Logits [B, vocab] of a decode-only step whose flat batch is given."""
        n = input_ids.shape[0]
        d = meta.decode
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slots[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.block_table[:n, : d.block_table.shape[1]].copy_(d.block_table, non_blocking=True)
        self.seq_lens[:n].copy_(d.seq_lens, non_blocking=True)
        if not self.capture_enabled:
            return self._forward(n, self._meta(n, decode_mask(self.seq_lens[:n], self.max_len)))
        b = next(size for size in sorted(self.graphs) if size >= n)
        if b > n:  # padding rows: no KV write, a one-token context
            self.slots[n:b].fill_(-1)
            self.seq_lens[n:b].fill_(1)
            self.input_ids[n:b].zero_()
            self.positions[n:b].zero_()
        entry = self.graphs[b]
        entry.graph.replay()
        return entry.logits[:n]
