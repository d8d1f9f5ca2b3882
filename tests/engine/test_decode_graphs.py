"""The CUDA-graph decode path's buffer plumbing (persistent inputs, stale block-table
entries, the fixed context bound) must give the same greedy tokens as the normal path.
On the CPU the graphs are not captured (``capture=False``): the same buffers feed an
eager forward, which is what a replay computes."""
from __future__ import annotations

from test_invariance import PROMPTS, make, run
from trellm.worker.cuda_graph import DecodeGraphs


def test_graph_buffers_give_the_same_greedy_tokens(default_gguf):
    llm = make(default_gguf, enable_prefix_caching=False, max_model_len=256)
    prompts = PROMPTS[:6]
    want = run(llm, prompts)
    w = llm.engine.worker
    graphs = DecodeGraphs(w.runner.model, w.runner.backend, w.runner.kv_caches, w.block_size,
                          w.max_model_len, max_batch=8, device=w.device, capture=False)
    calls = []
    real_run = graphs.run
    graphs.run = lambda *a: calls.append(a[0].shape[0]) or real_run(*a)
    w.runner.graphs = graphs
    # Batch 6, then batch 1: the second run sees block-table rows left by the first.
    assert run(llm, prompts) == want
    assert run(llm, prompts[:1]) == want[:1]
    assert calls and max(calls) == 6 and min(calls) == 1, "decode steps did not take the graph path"


def test_fused_kernel_path_gives_the_same_greedy_tokens(default_gguf):
    """The model's fused path (residual folded into the norms, RoPE + KV write in one op,
    attention reading every key from the cache, SiLU-and-mul), run with the kernels'
    PyTorch references, against the plain path: prefill chunks and decode."""
    from trellm.kernels import fused_ops

    llm = make(default_gguf, enable_prefix_caching=False, max_num_batched_tokens=16)
    prompts = PROMPTS[:4]
    want = run(llm, prompts)
    llm.engine.worker.runner.ops = fused_ops("cpu", prefer_reference=True)
    assert run(llm, prompts) == want
