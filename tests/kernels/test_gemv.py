"""The skinny-GEMM kernel against float32 math, its GLU (SiLU-and-mul fused) mode,
and the dispatch rules."""
from __future__ import annotations

import pytest
import torch

from trellm.kernels import testing as kt
from trellm.kernels.activation import silu_and_mul, silu_and_mul_ref
from trellm.kernels.gemv import MAX_ROWS, GemvDispatch, gemv, gemv_ref


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("rows,n,k", [(1, 64, 128), (1, 37, 300), (3, 130, 96), (8, 9, 1000), (5, 2048, 64)])
def test_gemv_matches_reference(rows, n, k, dtype, device):
    res = kt.check_gemv(rows, n, k, dtype, device, bias=n % 2 == 1)
    assert res.passed, str(res)


def test_gemv_rejects_wide_batches(device):
    x = torch.zeros(MAX_ROWS + 1, 16, device=device)
    with pytest.raises(ValueError, match="gemv takes"):
        gemv(x, torch.zeros(4, 16, device=device))


def _gate_up(rows: int, n: int, k: int, dtype: torch.dtype, device, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = (2 * torch.randn(rows, 2 * k, generator=gen)).to(dtype).to(device)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype).to(device)
    return x, w


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("rows", range(1, MAX_ROWS + 1))
def test_gemv_glu_matches_silu_and_mul_then_gemv(rows, dtype, device):
    """Against the references (silu_and_mul_ref, then gemv_ref) within the dtype's
    tolerance, and bit for bit against the unfused kernels (silu_and_mul, then gemv):
    same activation rounding, same summation order."""
    n, k = (37, 300) if rows % 2 else (130, 96)
    x, w = _gate_up(rows, n, k, dtype, device, seed=rows)
    got = gemv(x, w, glu=True)
    want = gemv_ref(silu_and_mul_ref(x.float()).to(dtype), w)
    res = kt.compare("gemv.glu", f"M={rows} N={n} K={k}", got, want, kt.TOLERANCES[dtype], dtype)
    assert res.passed, str(res)
    assert torch.equal(got, gemv(silu_and_mul(x), w))
    torch.testing.assert_close(gemv_ref(x, w, glu=True).float(), want.float(), atol=1e-2, rtol=1e-2)


def test_gemv_glu_with_bias_and_shape_check(device):
    x, w = _gate_up(2, 9, 64, torch.float32, device)
    b = torch.randn(9).to(device)
    torch.testing.assert_close(gemv(x, w, b, glu=True), gemv(silu_and_mul(x), w, b), atol=0, rtol=0)
    with pytest.raises(ValueError, match="gemv takes"):
        gemv(x[:, :64], w, glu=True)  # [M, K] is not a gate_up [M, 2K]


def test_dispatch_uses_the_kernel_only_where_it_won():
    d = GemvDispatch(use_kernel={(64, 32, 1): True, (64, 32, 2): False})
    w = torch.zeros(64, 32)
    assert d.wants(torch.zeros(1, 32), w)
    assert not d.wants(torch.zeros(2, 32), w)  # timed slower
    assert not d.wants(torch.zeros(4, 32), w)  # never timed
    assert not d.wants(torch.zeros(1, 32), torch.zeros(32, 32))


def test_dispatch_glu_only_where_calibration_picked_it():
    d = GemvDispatch(use_kernel={(64, 32, 1): True}, use_glu={(64, 32, 2): True, (64, 32, 4): False})
    w = torch.zeros(64, 32)
    assert not d.wants_glu(torch.zeros(1, 64), w)  # the plain GEMV won, the fused was never timed
    assert d.wants_glu(torch.zeros(2, 64), w)
    assert not d.wants_glu(torch.zeros(4, 64), w)  # timed slower
    assert not d.wants_glu(torch.zeros(2, 32), w)  # not a [M, 2K] gate_up
    assert not GemvDispatch().wants_glu(torch.zeros(1, 64), w)


def test_mlp_takes_the_fused_gemv_where_picked(small_mlp, recording_ops, device):
    mlp, ops, x = small_mlp.to(device), recording_ops, torch.randn(2, 32).to(device)
    want = mlp(x, ops)
    mlp.down_proj.method.gemv_dispatch = GemvDispatch(use_glu={(32, 48, 2): True})
    torch.testing.assert_close(mlp(x, ops), want, atol=1e-5, rtol=1e-5)
    assert ops.calls == 1  # only the unfused call above


@pytest.mark.parametrize("first", [False, True])
def test_norm_linear_takes_the_fused_gemv_where_picked(first, small_mlp, recording_ops, device):
    """With the dispatch's pick: one gemv_rms_norm launch, no ops call, the values of the
    unfused path (the new residual exactly, the output within float32 rounding);
    ``first``: no residual (the first layer's norm)."""
    from trellm.model.llama import RMSNorm, norm_linear

    mlp, ops = small_mlp.to(device), recording_ops
    x = torch.randn(2, 32).to(device)
    norm, res = RMSNorm(32, 1e-5, torch.float32).to(device), None if first else torch.randn(2, 32).to(device)
    norm.weight.data.copy_(1 + 0.1 * torch.randn(32))
    want = norm_linear(mlp.gate_up_proj, x, res, norm, ops)
    mlp.gate_up_proj.method.gemv_dispatch = GemvDispatch(use_norm={(96, 32, 2): True})
    got = norm_linear(mlp.gate_up_proj, x, res, norm, ops)
    assert ops.calls == 1  # only the unfused call above
    assert torch.equal(got[1], want[1])
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pre_blocks", [0, 2, 4])
@pytest.mark.parametrize("glu", [False, True])
@pytest.mark.parametrize("rows,n,k", [(1, 37, 200), (3, 64, 4096), (8, 129, 96), (2, 16, 32), (2, 16, 1000)])
def test_gemv_pdl_mode_equals_plain(rows, n, k, glu, pre_blocks, device, monkeypatch):
    """The PDL mode reads the weight a block ahead (its first block, and the PRE_K head,
    before the wait): the same products in the same order, so the same bits. The wait
    itself is PTX; in the interpreter it is stubbed out (on the GPU it runs, launched here
    without launch_pdl, so both trigger orders of pdl_begin compile)."""
    from trellm import envs
    from trellm.kernels import gemv as g
    from trellm.kernels._triton import tl, triton

    if envs.triton_interpret():
        monkeypatch.setattr(tl.extra.cuda, "gdc_wait", lambda *a, **kw: None)
        monkeypatch.setattr(tl.extra.cuda, "gdc_launch_dependents", lambda *a, **kw: None)
    gen = torch.Generator().manual_seed(rows * n + k)
    x = torch.randn(rows, 2 * k if glu else k, generator=gen).to(device)
    w = torch.randn(n, k, generator=gen).to(device)
    monkeypatch.setattr(g, "PREFETCH_BLOCKS", pre_blocks)
    bm, bn, bk, pre = g._blocks(rows, n, k)
    assert pre == (min(pre_blocks * bk, triton.next_power_of_2(k)) if pre_blocks else 0)
    assert pre & (pre - 1) == 0  # a power of two (or 0): tl.arange's range
    outs = []
    for pdl in (False, 1, 2):
        y = torch.empty(rows, n, device=device)
        g._gemv_kernel[(triton.cdiv(n, bn),)](x, w, w, y, rows, n, k, x.stride(0), w.stride(0), y.stride(0),
                                               y, y, y, 0, 0, 0.0, y,
                                               BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, HAS_BIAS=False, GLU=glu,
                                               PRE_K=pre, PDL=pdl)
        outs.append(y)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    assert torch.allclose(outs[1], gemv_ref(x, w, glu=glu), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("rows,n,k", [(1, 37, 300), (1, 2048, 1000), (4, 130, 4096), (8, 9, 64)])
def test_gemv_prefetched_head_matches_reference(rows, n, k, dtype, device, monkeypatch):
    """PREFETCH_BLOCKS > 0 (the weight's first PRE_K columns in one up-front load): the
    reference within the dtype's tolerance, the GLU mode too."""
    from trellm.kernels import gemv as g

    monkeypatch.setattr(g, "PREFETCH_BLOCKS", 2)
    assert g._blocks(rows, n, k)[3] > 0
    res = kt.check_gemv(rows, n, k, dtype, device, bias=n % 2 == 1)
    assert res.passed, str(res)
    x, w = _gate_up(rows, n, k, dtype, device, seed=rows + k)
    res = kt.compare("gemv.glu.pre", f"M={rows} N={n} K={k}", gemv(x, w, glu=True),
                     gemv_ref(x, w, glu=True), kt.TOLERANCES[dtype], dtype)
    assert res.passed, str(res)


@pytest.mark.parametrize("pre_blocks", [0, 2])
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("rows,n,k", [(1, 64, 128), (1, 37, 300), (3, 130, 96), (8, 1000, 64), (5, 2048, 40),
                                      (1, 24, 4096)])
def test_gemv_rms_norm_matches_the_reference_and_the_unfused_pair(rows, n, k, dtype, with_residual, pre_blocks,
                                                                  device, monkeypatch):
    """gemv_rms_norm against its float32 reference (the normed activation unrounded) within
    the dtype's tolerance; the new residual bit for bit against fused_add_rms_norm's; the
    output against what it replaces (the norm kernel, then gemv) within two roundings of
    the dtype (that path rounds the normed activation, this one does not)."""
    from trellm.kernels import gemv as g
    from trellm.kernels.rmsnorm import fused_add_rms_norm, rms_norm

    monkeypatch.setattr(g, "PREFETCH_BLOCKS", pre_blocks)
    gen = torch.Generator().manual_seed(rows * n + k + with_residual)
    x = (3 * torch.randn(rows, k, generator=gen)).to(dtype).to(device)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype).to(device)
    bias = torch.randn(n, generator=gen).to(dtype).to(device) if n % 2 else None
    res = torch.randn(rows, k, generator=gen).to(dtype).to(device) if with_residual else None
    nw = (1 + 0.1 * torch.randn(k, generator=gen)).to(dtype).to(device)
    y, s = g.gemv_rms_norm(x, w, bias, res, nw, 1e-5)
    ref_y, ref_s = g.gemv_rms_norm_ref(x, w, bias, res, nw, 1e-5)
    cmp = kt.compare("gemv.rms_norm", f"M={rows} N={n} K={k}", y, ref_y, kt.TOLERANCES[dtype], dtype)
    assert cmp.passed, str(cmp)
    if with_residual:
        normed, want_s = fused_add_rms_norm(x, res, nw, 1e-5)
        assert torch.equal(s, want_s) and torch.equal(s, ref_s)
    else:
        normed = rms_norm(x, nw, 1e-5)
        assert s is x
    unfused = gemv(normed, w, bias)
    ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -20
    torch.testing.assert_close(y.float(), unfused.float(), rtol=2 * ulp, atol=2 * ulp * float(unfused.abs().max()))


def test_gemv_rms_norm_rejects_mismatched_shapes(device):
    from trellm.kernels import gemv as g

    x, w, nw = torch.zeros(2, 16, device=device), torch.zeros(8, 16, device=device), torch.ones(16, device=device)
    with pytest.raises(ValueError, match="gemv_rms_norm"):
        g.gemv_rms_norm(x, w, None, torch.zeros(2, 9, device=device), nw, 1e-5)
    with pytest.raises(ValueError, match="gemv_rms_norm"):
        g.gemv_rms_norm(x, w, None, None, torch.ones(9, device=device), 1e-5)
    with pytest.raises(ValueError, match="gemv_rms_norm"):
        g.gemv_rms_norm(torch.zeros(MAX_ROWS + 1, 16, device=device), w, None, None, nw, 1e-5)


@pytest.mark.parametrize("blocks", [1, 2, 4, 8])
def test_prefetch_head_is_a_power_of_two_within_the_register_budget(blocks, monkeypatch):
    from trellm.kernels import gemv as g
    from trellm.kernels._triton import triton

    monkeypatch.setattr(g, "PREFETCH_BLOCKS", blocks)
    for rows, n, k in [(1, 28672, 4096), (1, 4096, 14336), (1, 1024, 3072), (8, 9, 1000), (3, 130, 96)]:
        bm, bn, bk, pre = g._blocks(rows, n, k)
        assert pre > 0 and pre & (pre - 1) == 0
        assert pre <= 4 * bk and pre <= triton.next_power_of_2(k)


_COMPILE_SCRIPT = """
import torch
from trellm.kernels import gemv as g
from trellm.kernels.compile_check import compile_launch, describe

x, w, y = torch.empty(1, 512, dtype=torch.bfloat16), torch.empty(64, 512, dtype=torch.bfloat16), torch.empty(1, 64)
r = torch.empty(1, 512, dtype=torch.bfloat16)
for pre, glu, norm in ((0, False, 0), (256, False, 0), (128, True, 0), (0, False, 2), (256, False, 2), (0, False, 1)):
    args = (x, w, w, y, 1, 64, 512, 512, 512, 64, r, w[0], r, 512, 512, 1e-5, y)
    consts = dict(BLOCK_M=1, BLOCK_N=16, BLOCK_K=128, HAS_BIAS=False, GLU=glu, PRE_K=pre, NORM=norm,
                  PDL=True, num_warps=4)
    err = compile_launch(describe(g._gemv_kernel.fn, args, consts).key())
    assert err is None, (pre, glu, norm, err)
q, s = torch.empty(64, 512, dtype=torch.int8), torch.empty(64)
for pre, k_block in ((0, 256), (256, 256)):
    args = (x, q, y, y, 1, 64, 512, 512, 512, 64, y, y, y, 64, 64, 0.0, s)
    consts = dict(BLOCK_M=1, BLOCK_N=16, BLOCK_K=k_block, HAS_BIAS=False, GLU=False, PRE_K=pre, W_INT8=True,
                  PDL=True, num_warps=4)
    err = compile_launch(describe(g._gemv_kernel.fn, args, consts).key())
    assert err is None, ("int8", pre, err)
print("compiled")
"""


def test_gemv_compiles_for_sm90():
    """The GEMV's modes (prefetched head, GLU, the fused norm, int8 weights, PDL) through Triton's compiler for
    sm_90, in a process without the interpreter: what the interpreter does not check (a
    loop-carried name retyped made the prefetch fail to compile on the GPU only)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0 and "compiled" in out.stdout, out.stderr[-2000:]


def test_fused_forward_with_the_norm_in_every_gemv_keeps_greedy_tokens(tmp_path, device):
    """A tiny random Llama (qkv bias, so the fused path's bias is covered), greedy decode
    through the model's fused path, first with the norm kernels (the kernels' references on
    the CPU), then with gemv_rms_norm picked for every qkv / gate_up shape at 1-8 rows
    (decode steps; prefill chunks stay unfused): the same tokens."""
    import json

    from trellm import LLM, SamplingParams
    from trellm.kernels import fused_ops

    cfg = {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 64, "intermediate_size": 96,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
           "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "torch_dtype": "float32"}
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(cfg))
    llm = LLM(f"dummy:{path}", dtype="float32", device=str(device), quantization="none", max_model_len=128,
              kv_cache_memory=16 << 20, enable_prefix_caching=False)
    runner = llm.engine.worker.runner
    runner.graphs = None  # eager steps: the dispatch below is read at each call
    runner.ops = fused_ops(device, prefer_reference=device.type == "cpu")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [[5, 17, 99, 3], [200, 1, 42]]

    def tokens():
        return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]

    want = tokens()
    model = runner.model
    d = GemvDispatch()
    for layer in model.layers:
        for lin in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj):
            d.use_norm.update({(lin.weight.shape[0], lin.weight.shape[1], m): True for m in range(1, 9)})
            lin.method.gemv_dispatch = d
    calls = []
    import trellm.model.llama as llama

    real = llama.gemv_rms_norm
    llama.gemv_rms_norm = lambda *a: calls.append(a[0].shape[0]) or real(*a)
    try:
        assert tokens() == want
    finally:
        llama.gemv_rms_norm = real
    assert calls and min(calls) <= 2, "decode steps did not take gemv_rms_norm"
