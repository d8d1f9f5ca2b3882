"""``--quantization int8``: per-row int8 weights quantized at load time. The quantizer,
the layer (plain and merged, with bias), the CPU forward against the float32
definition, and a tiny model end to end against the same model unquantized."""
from __future__ import annotations

import argparse
import json

import pytest
import torch
import torch.nn.functional as F

from trellm.kernels.int8_gemv import int8_linear_ref
from trellm.layers.linear import Linear, MergedLinear
from trellm.loader.errors import ModelLoadError
from trellm.quant.base import QUANT_METHODS, get_linear_method
from trellm.quant.int8 import Int8LinearMethod, int8_forward, int8_quantization_config, quantize_int8

TINY = dict(vocab_size=300, hidden_size=160, intermediate_size=200, num_hidden_layers=2,
            num_attention_heads=5, num_key_value_heads=1, head_dim=32, max_position_embeddings=256,
            rms_norm_eps=1e-6, rope_theta=10000.0, bos_token_id=1, eos_token_id=2,
            architectures=["Qwen2ForCausalLM"], tie_word_embeddings=False)
"""Qwen2: q/k/v carry biases, so the merged layer's bias path runs too."""
ENGINE = dict(device="cpu", dtype="float32", kv_cache_memory=16 << 20, max_model_len=64)


def test_quantize_per_row():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 50, generator=g) * torch.tensor([1e-3, 1.0, 30.0, 1.0, 1.0, 1.0])[:, None]
    w[3] = 0.0  # an all-zero row: scale 1, q 0, no division by zero
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32
    assert int(q.abs().max()) == 127 and int(q[3].abs().max()) == 0 and float(scale[3]) == 1.0
    # Each row's error is at most half its own step: the small row is not crushed by the big one.
    err = (q.float() * scale[:, None] - w).abs().amax(dim=1)
    assert bool((err <= scale / 2 + 1e-7).all())
    assert float(scale[0]) < 1e-4 < float(scale[2])


def test_layers_quantize_after_loading_and_match_the_definition():
    g = torch.Generator().manual_seed(1)
    layer = MergedLinear(64, [48, 16], True, Int8LinearMethod(), torch.float32)
    dense = []
    for shard, rows in enumerate((48, 16)):
        w, b = torch.randn(rows, 64, generator=g), torch.randn(rows, generator=g)
        layer.weight_loader("weight", w, shard)
        layer.weight_loader("bias", b, shard)
        dense.append((w, b))
    layer.method.process_after_loading(layer)
    assert not hasattr(layer, "weight") and layer.qweight.dtype == torch.int8
    x = torch.randn(2, 5, 64, generator=g)
    got = layer(x)
    want = int8_linear_ref(x, layer.int8.q, layer.int8.scale, layer.int8.bias)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # ... and close to the dense layer: about 1% of the weight's RMS per element.
    full = F.linear(x, torch.cat([w for w, _ in dense]), torch.cat([b for _, b in dense]))
    assert float((got - full).pow(2).mean().sqrt()) < 0.02 * float(full.pow(2).mean().sqrt())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_cpu_forward_dtypes(dtype):
    layer = Linear(96, 40, False, Int8LinearMethod(), dtype)
    layer.weight_loader("weight", torch.randn(40, 96, generator=torch.Generator().manual_seed(2)))
    layer.method.process_after_loading(layer)
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(3)).to(dtype)
    got = int8_forward(layer.int8, x)
    assert got.dtype == dtype
    want = int8_linear_ref(x, layer.int8.q, layer.int8.scale)
    tol = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}[dtype]  # bf16 scales: 8 bits
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_registry_and_config():
    assert isinstance(get_linear_method({"quant_method": "int8"}), Int8LinearMethod)
    assert QUANT_METHODS["int8"] is Int8LinearMethod
    assert int8_quantization_config(None) == {"quant_method": "int8"}
    with pytest.raises(ValueError, match="needs an unquantized checkpoint"):
        int8_quantization_config({"quant_method": "exl3", "bits": 4})


@pytest.fixture()
def tiny_config(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))
    return str(path)


def _logits_and_tokens(llm, ids: list[int]) -> tuple[torch.Tensor, list[int]]:
    """Next-token logits at every prompt position (one prefill), then 16 greedy tokens."""
    from trellm import SamplingParams

    model = llm.engine.worker.runner.model
    seen: list[torch.Tensor] = []
    original = model.compute_logits
    model.compute_logits = lambda hidden: seen.append(original(hidden)) or seen[-1]
    try:
        llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))
    finally:
        del model.compute_logits
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    return seen[0][: len(ids) - 1], out[0].outputs[0].token_ids


def test_tiny_model_end_to_end(tiny_config):
    from trellm import LLM

    ids = torch.randint(3, 300, (24,), generator=torch.Generator().manual_seed(0)).tolist()
    llm = LLM("dummy:" + tiny_config, quantization="int8", **ENGINE)
    assert llm.engine.worker.arch.quantization_config == {"quant_method": "int8"}
    qkv = llm.engine.worker.runner.model.layers[0].self_attn.qkv_proj
    assert qkv.qweight.dtype == torch.int8 and qkv.int8.bias is not None
    got, got_tokens = _logits_and_tokens(llm, ids)
    want, want_tokens = _logits_and_tokens(LLM("dummy:" + tiny_config, quantization="none", **ENGINE), ids)
    # int8 rounding is about 1% of each weight row's RMS; through two layers the logits move
    # by a few percent of their spread, far less than the gap between top tokens.
    rel = float((got - want).pow(2).mean().sqrt() / want.std())
    assert 0 < rel < 0.05, rel
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9
    assert sum(a == b for a, b in zip(got_tokens, want_tokens)) >= 12


def test_flags_and_refusals(tiny_config, tmp_path):
    from trellm import LLM
    from trellm.config import EngineConfig, ModelConfig
    from trellm.entrypoints.cli import add_engine_args, engine_kwargs
    from trellm.entrypoints.llm import engine_config_from_kwargs

    p = argparse.ArgumentParser()
    add_engine_args(p)
    args = p.parse_args(["dummy:" + tiny_config, "--quantization", "int8"])
    assert engine_config_from_kwargs(args.model, **engine_kwargs(args)).model.quantization == "int8"
    EngineConfig(model=ModelConfig(quantization="int8")).validate()
    with pytest.raises(ValueError, match="--bits needs --quantization exl3"):
        EngineConfig(model=ModelConfig(quantization="int8", bits=4)).validate()
    exl3 = {**TINY, "quantization_config": {"quant_method": "exl3", "bits": 3}}
    (tmp_path / "exl3.json").write_text(json.dumps(exl3))
    with pytest.raises(ModelLoadError, match="needs an unquantized checkpoint"):
        LLM("dummy:" + str(tmp_path / "exl3.json"), quantization="int8", **ENGINE)
