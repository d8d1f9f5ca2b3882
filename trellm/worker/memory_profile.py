"""How much GPU memory one full step needs beside the weights and the KV pool,
measured by running it once at start-up (a profiling forward), so the pool can take
the rest of ``--gpu-memory-utilization`` without a guess."""
from __future__ import annotations

import logging

import torch

from trellm.attention.torch_paged import AttentionMetadata, PrefillSeq

log = logging.getLogger("trellm")


def profile_step_bytes(model: torch.nn.Module, backend, ops, num_tokens: int, block_size: int,
                       kv_heads: int, head_dim: int, num_layers: int, dtype: torch.dtype,
                       device: torch.device, max_len: int) -> int:
    """Peak bytes allocated by a prefill step of ``num_tokens`` tokens plus the LM head
    on every row (a prompt-logprobs step can ask for all of them), on a throwaway
    cache just large enough for the chunk."""
    from trellm.worker.model_runner import ForwardContext

    nblk = -(-num_tokens // block_size)
    kv = [torch.zeros((2, nblk, block_size, kv_heads, head_dim), dtype=dtype, device=device) for _ in range(num_layers)]
    meta = AttentionMetadata(
        slot_mapping=torch.arange(num_tokens, device=device), decode=None,
        prefills=[PrefillSeq(0, num_tokens, num_tokens, torch.arange(nblk, device=device))],
        block_size=block_size)
    ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    positions = torch.arange(num_tokens, device=device) % max_len
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    with torch.inference_mode():
        hidden = model(ids, positions, ForwardContext(backend, kv, meta, ops=ops))
        model.compute_logits(hidden)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del kv, hidden
    torch.cuda.empty_cache()
    log.info("profiling forward (%d tokens): %.2f GiB of activations at peak", num_tokens, peak / 2**30)
    return int(peak)
