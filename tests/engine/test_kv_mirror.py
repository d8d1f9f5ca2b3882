"""The CPU decode K/V mirror (trellm/attention/kv_mirror.py) must change nothing: the
same tokens and bit-identical log-probs as gathering from the pool every step, through
requests joining and leaving the decode group, preemption, and sequences growing past
the mirror's length step (CAP_STEP)."""
from __future__ import annotations

import pytest
import torch

from trellm import LLM, SamplingParams
from trellm.attention.kv_mirror import CAP_STEP, DecodeKVMirror
from trellm.attention.torch_paged import DecodeGroup, _gather, paged_decode_reference

PROMPTS = ["The history of the printing press begins", "In mathematics, a prime number is",
           "import numpy as np\n\ndef softmax(x):", "Water boils at", "The quick brown fox",
           "A long time ago in a galaxy far, far away, there lived a young farmer who dreamed of"]


def _outputs(llm: LLM, mirror_on: bool):
    runner = llm.engine.worker.runner
    saved = runner.kv_mirror
    runner.kv_mirror = saved if mirror_on else None
    try:
        # Different lengths: requests finish at different steps, so the group changes;
        # 150 new tokens take the longest sequences past CAP_STEP (128).
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=2)
                  for n in (150, 12, 40, 7, 90, 25)]
        outs = llm.generate(PROMPTS, params)
    finally:
        runner.kv_mirror = saved
    llm.engine.check_invariants()
    return ([o.outputs[0].token_ids for o in outs],
            [list(o.outputs[0].logprobs) for o in outs])  # frozen dataclasses: exact ==


@pytest.mark.parametrize("quantization,blocks", [("none", None), ("auto", None),
                                                 ("none", 11)])  # 11 blocks of 16: preemptions
def test_mirror_equals_gather_bit_for_bit(default_gguf, quantization, blocks):
    assert CAP_STEP < 150
    llm = LLM(default_gguf, dtype="float32", device="cpu", kv_cache_memory=256 << 20,
              num_gpu_blocks_override=blocks, quantization=quantization,
              enable_prefix_caching=False)  # both runs start from the same empty pool
    mirror = llm.engine.worker.runner.kv_mirror
    assert isinstance(mirror, DecodeKVMirror)
    without = _outputs(llm, False)
    assert mirror.appends == 0
    with_mirror = _outputs(llm, True)
    assert mirror.appends > 1000 and mirror.rebuilds > 0  # it ran, and regathered on changes
    assert with_mirror[0] == without[0]
    assert with_mirror[1] == without[1]  # log-probs equal exactly, not just close
    if blocks:
        assert llm.engine.scheduler.num_preemptions > 0


def test_mirror_over_the_budget_falls_back_to_the_gather():
    torch.manual_seed(0)
    pool = torch.randn(2, 40, 16, 2, 8)
    table = torch.tensor([[3, 7, 9, 0], [11, 12, 30, 31]])
    d = DecodeGroup(token_index=torch.arange(2), block_table=table, seq_lens=torch.tensor([40, 64]),
                    max_seq_len=64)
    q = torch.randn(2, 4, 8)
    want = paged_decode_reference(q, pool, table, d.seq_lens, 64, 0.3)
    small = DecodeKVMirror(num_layers=1, budget_bytes=1000)
    assert small.kv(pool, 1, ("a", "b"), (40, 64), pool[0, 0, :2], pool[1, 0, :2],
                    lambda n: _gather(pool, table, n, d)) is None and not small.layers
    big = DecodeKVMirror(num_layers=1)
    kv = big.kv(pool, 1, ("a", "b"), (40, 64), pool[0, 0, :2], pool[1, 0, :2], lambda n: _gather(pool, table, n, d))
    mask = torch.arange(64)[None, None, None, :] < d.seq_lens[:, None, None, None]
    import torch.nn.functional as F
    got = F.scaled_dot_product_attention(q.reshape(2, 2, 2, 8), kv[0], kv[1], attn_mask=mask, scale=0.3)
    assert torch.equal(got.reshape(2, 4, 8), want)
