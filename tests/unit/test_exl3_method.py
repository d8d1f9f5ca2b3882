"""The EXL3 linear method: merged layers, the kernel hook, HF-directory loading end to
end against the same model with the reconstructed dense weights, ``--quantization
none`` on an EXL3 checkpoint, and dummy EXL3 models."""
from __future__ import annotations

import argparse
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from trellm.layers.linear import Linear, MergedLinear
from trellm.loader.errors import ModelLoadError
from trellm.model.config import ArchConfig
from trellm.model.llama import dummy_weights
from trellm.quant.base import QUANT_METHODS, get_lm_head_method, get_linear_method
from trellm.quant.exl3 import method as exl3_method
from trellm.quant.exl3.loading import dummy_exl3_weights, random_exl3_tensors
from trellm.quant.exl3.method import EXL3Kernel, EXL3LinearMethod
from trellm.quant.exl3.reference import dense_weight, forward_reference
from trellm.quant.exl3.weight import EXL3Weight, padded
from trellm.quant.gguf_int4 import is_linear_weight

TINY = dict(vocab_size=300, hidden_size=160, intermediate_size=200, num_hidden_layers=2,
            num_attention_heads=5, num_key_value_heads=1, head_dim=32, max_position_embeddings=256,
            rms_norm_eps=1e-6, rope_theta=10000.0, bos_token_id=1, eos_token_id=2)
"""Every linear width (160, 32, 200, 300) needs padding to 128."""
ENGINE = dict(device="cpu", dtype="float32", kv_cache_memory=16 << 20, max_model_len=64)


def _projection(key: str, in_f: int, out_f: int, bits: float, codebook: str, g: torch.Generator
                ) -> dict[str, torch.Tensor]:
    return dict(random_exl3_tensors(key, in_f, out_f, bits, codebook, g))


def _weight(tensors: dict[str, torch.Tensor], in_f: int, out_f: int) -> EXL3Weight:
    return EXL3Weight.from_tensors({k.rsplit(".", 1)[1]: v for k, v in tensors.items()}, in_f, out_f)


# ---- the layer ---------------------------------------------------------------------------------------


def _merged_layer(g: torch.Generator) -> tuple[MergedLinear, list[torch.Tensor], list[torch.Tensor]]:
    layer = MergedLinear(160, [160, 32, 32], True, EXL3LinearMethod(), torch.float32)
    dense, biases = [], []
    for shard, (out_f, bits, codebook) in enumerate([(160, 4, "mul1"), (32, 2, "mcg"), (32, 3, "3inst")]):
        tensors = _projection("p", 160, out_f, bits, codebook, g)
        bias = torch.randn(padded(out_f), generator=g).half()  # the converter stores padded biases
        for name, t in [*tensors.items(), ("p.bias", bias)]:
            layer.weight_loader(name.rsplit(".", 1)[1], t, shard)
        dense.append(dense_weight(_weight(tensors, 160, out_f)))
        biases.append(bias[:out_f].float())
    layer.method.process_after_loading(layer)
    return layer, dense, biases


def test_merged_layer_concatenates_its_projections():
    layer, dense, biases = _merged_layer(torch.Generator().manual_seed(0))
    assert [p.bits for p in layer.exl3_parts] == [4, 2, 3]
    assert [p.codebook for p in layer.exl3_parts] == ["mul1", "mcg", "3inst"]
    x = torch.randn(5, 160)
    want = F.linear(x, torch.cat(dense), torch.cat(biases))
    got = layer(x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    assert [t.shape[-1] for t in layer.split(got)] == [160, 32, 32]


def test_layer_refuses_incomplete_or_wrong_tensors():
    g = torch.Generator().manual_seed(1)
    layer = MergedLinear(128, [128, 128], False, EXL3LinearMethod(), torch.float32)
    for name, t in _projection("p", 128, 128, 2, "mul1", g).items():
        layer.weight_loader(name.rsplit(".", 1)[1], t, 0)
    with pytest.raises(ValueError, match="given twice"):
        layer.weight_loader("suh", torch.ones(128, dtype=torch.float16), 0)
    with pytest.raises(ValueError, match="no EXL3 tensors for output rows 128:256"):
        layer.method.process_after_loading(layer)
    with pytest.raises(ValueError, match="dense 'weight'"):
        layer.weight_loader("weight", torch.zeros(128, 128), 1)
    single = Linear(128, 128, False, EXL3LinearMethod(), torch.float32)
    for name, t in _projection("p", 128, 128, 2, "mul1", g).items():
        single.weight_loader(name.rsplit(".", 1)[1], t)
    single.weight_loader("bias", torch.zeros(128, dtype=torch.float16))
    with pytest.raises(ValueError, match="bias present but the layer is without bias"):
        single.method.process_after_loading(single)


def test_registered_kernel_is_used_and_reference_is_the_fallback():
    g = torch.Generator().manual_seed(2)
    layer = Linear(128, 256, False, EXL3LinearMethod(), torch.float32)
    for name, t in _projection("p", 128, 256, 3, "mul1", g).items():
        layer.weight_loader(name.rsplit(".", 1)[1], t)
    layer.method.process_after_loading(layer)
    x = torch.randn(3, 128)
    calls = []

    def run(part, inp):
        calls.append(inp.shape[0])
        return forward_reference(part, inp)

    exl3_method.register_kernel(EXL3Kernel("fake", lambda part, inp: inp.shape[0] <= 2, run))
    try:
        torch.testing.assert_close(layer(x[:2]), forward_reference(layer.exl3_parts[0], x[:2]))
        assert calls == [2]
        layer(x)  # 3 rows: the fake kernel declines, the reference runs
        assert calls == [2]
    finally:
        exl3_method.unregister_kernel("fake")
    assert exl3_method.select_kernel(layer.exl3_parts[0], x[:1]) is forward_reference


def test_registry_and_head_method():
    qc = {"quant_method": "exl3", "bits": 4.0, "head_bits": 6, "codebook": "mcg"}
    method = get_linear_method(qc)
    assert isinstance(method, EXL3LinearMethod) and method.config.codebook == "mcg"
    assert QUANT_METHODS["exl3"] is EXL3LinearMethod
    assert isinstance(get_lm_head_method(qc), EXL3LinearMethod)
    assert get_lm_head_method({**qc, "head_bits": 16}) is None
    assert get_lm_head_method(None) is None
    with pytest.raises(ValueError, match="codebook"):
        get_linear_method({**qc, "codebook": "qtip9"})


# ---- an EXL3 HF directory, end to end ------------------------------------------------------------


def _write_models(tmp_path, arch_name: str, tie: bool, head_bits: int, codebook: str, bits: float,
                  legacy_signs: bool = False) -> tuple[str, str]:
    """A random EXL3 checkpoint, and the same model with the reconstructed dense weights."""
    cfg = {**TINY, "architectures": [arch_name], "tie_word_embeddings": tie}
    arch = ArchConfig.from_hf(cfg)
    g = torch.Generator().manual_seed(11)
    quantized, dense = {}, {}
    weights = dict(dummy_weights(arch, seed=5))
    if tie and head_bits < 16:
        weights["lm_head.weight"] = torch.empty(arch.vocab_size, arch.hidden_size)  # only its shape is used
    for name, t in weights.items():
        key = name.removesuffix(".weight")
        if is_linear_weight(name) or name == "lm_head.weight" and head_bits < 16:
            out_f, in_f = t.shape
            tensors = _projection(key, in_f, out_f, head_bits if key == "lm_head" else bits, codebook, g)
            if legacy_signs and key.endswith("down_proj"):
                tensors = _with_packed_signs(tensors, key)
            quantized.update(tensors)
            dense[name] = dense_weight(_weight(tensors, in_f, out_f))
        elif name.endswith("_proj.bias"):
            quantized[name] = F.pad(t.half(), (0, padded(t.shape[0]) - t.shape[0]))
            dense[name] = t.half().float()
        else:
            quantized[name] = dense[name] = t
    qdir, ddir = tmp_path / "exl3", tmp_path / "dense"
    qcfg = {"quant_method": "exl3", "version": "0.0.0", "bits": float(bits), "head_bits": head_bits,
            "codebook": codebook}
    for d, tensors, c in [(qdir, quantized, {**cfg, "quantization_config": qcfg}),
                          (ddir, dense, {**cfg, "tie_word_embeddings": tie and head_bits >= 16})]:
        d.mkdir()
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(d / "model.safetensors"))
        (d / "config.json").write_text(json.dumps(c))
    return str(qdir), str(ddir)


def _with_packed_signs(tensors: dict[str, torch.Tensor], key: str) -> dict[str, torch.Tensor]:
    """Legacy storage: suh/svh replaced by packed sign bits su/sv (bit set = -1)."""
    out = dict(tensors)
    for new, old in (("su", "suh"), ("sv", "svh")):
        negative = (out.pop(f"{key}.{old}") < 0).to(torch.int64).reshape(-1, 16)
        words = (negative << torch.arange(16)).sum(1)
        out[f"{key}.{new}"] = torch.where(words >= 1 << 15, words - (1 << 16), words).to(torch.int16)
    return out


def _prompt_logits(llm, ids: list[int]) -> torch.Tensor:
    """Next-token logits at every prompt position (one prefill)."""
    from trellm import SamplingParams

    model = llm.engine.worker.runner.model
    seen: list[torch.Tensor] = []
    original = model.compute_logits

    def recording(hidden: torch.Tensor) -> torch.Tensor:
        seen.append(original(hidden))
        return seen[-1]

    model.compute_logits = recording
    try:
        llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))
    finally:
        del model.compute_logits
    return seen[0][: len(ids) - 1]


@pytest.mark.parametrize("arch_name,tie,head_bits,codebook,bits,legacy", [
    ("LlamaForCausalLM", True, 6, "mul1", 3, False),     # tied embeddings, quantized head
    ("Qwen3ForCausalLM", False, 16, "3inst", 4, True),   # fp16 head, legacy su/sv on down_proj
    ("Qwen2ForCausalLM", False, 5, "mcg", 2, False),     # q/k/v biases (stored padded)
])
def test_exl3_checkpoint_matches_dense_reconstruction(tmp_path, arch_name, tie, head_bits, codebook, bits,
                                                      legacy):
    from trellm import LLM

    qdir, ddir = _write_models(tmp_path, arch_name, tie, head_bits, codebook, bits, legacy)
    ids = torch.randint(3, 300, (12,), generator=torch.Generator().manual_seed(0)).tolist()
    exl3 = LLM(qdir, **ENGINE)
    model = exl3.engine.worker.runner.model
    qkv = model.layers[0].self_attn.qkv_proj
    assert [(p.bits, p.codebook, p.out_features) for p in qkv.exl3_parts] == [(bits, codebook, 160),
                                                                             (bits, codebook, 32),
                                                                             (bits, codebook, 32)]
    assert (model.lm_head is not None and hasattr(model.lm_head, "exl3_parts")) == (head_bits < 16)
    got = _prompt_logits(exl3, ids)
    want = _prompt_logits(LLM(ddir, **ENGINE), ids)
    assert got.shape == (11, 300) and float(want.std()) > 0.1
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
    # --quantization none: the same tensors decoded once into dense weights.
    dense = LLM(qdir, quantization="none", **ENGINE)
    assert dense.engine.worker.arch.quantization_config["quant_method"] == "exl3_dense"
    torch.testing.assert_close(_prompt_logits(dense, ids), want, atol=1e-5, rtol=1e-5)


# ---- dummy EXL3 models and the flags --------------------------------------------------------------


@pytest.fixture()
def tiny_config(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**TINY, "architectures": ["LlamaForCausalLM"], "tie_word_embeddings": True}))
    return str(path)


def test_dummy_exl3_model_runs(tiny_config):
    from trellm import LLM, SamplingParams

    llm = LLM("dummy:" + tiny_config, quantization="exl3", bits=3, **ENGINE)
    model = llm.engine.worker.runner.model
    assert llm.engine.worker.arch.quantization_config == {"quant_method": "exl3", "bits": 3.0, "head_bits": 6,
                                                          "codebook": "mul1"}
    assert {p.bits for p in model.layers[1].mlp.gate_up_proj.exl3_parts} == {3}
    assert [p.bits for p in model.lm_head.exl3_parts] == [6]
    out = llm.generate({"prompt_token_ids": [5, 6, 7, 8]},
                       SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=0))[0]
    assert len(out.outputs[0].token_ids) == 4
    # Greedy picks the top token; random weights scaled like the dense dummy ones give finite,
    # better-than-uniform (log 1/300 = -5.7) distributions.
    assert all(lp.rank == 1 and -5.7 < lp.logprob <= 0 for lp in out.outputs[0].logprobs)


def test_dummy_exl3_weights_are_seeded(tiny_config):
    arch = ArchConfig.from_hf(json.loads(open(tiny_config).read()))
    qc = {"quant_method": "exl3", "bits": 2.5, "head_bits": 16, "codebook": "mul1"}
    from dataclasses import replace

    arch = replace(arch, quantization_config=qc)
    a = dict(dummy_exl3_weights(dummy_weights(arch, 0), arch, 0))
    b = dict(dummy_exl3_weights(dummy_weights(arch, 0), arch, 0))
    c = dict(dummy_exl3_weights(dummy_weights(arch, 0), arch, 1))
    key = "model.layers.1.mlp.down_proj"
    assert a[f"{key}.trellis"].shape == (padded(200) // 16, padded(160) // 16, 40)  # K = 2.5
    assert "lm_head.trellis" not in a and f"{key}.mul1" in a  # head_bits 16: the tied embedding
    assert torch.equal(a[f"{key}.trellis"], b[f"{key}.trellis"])
    assert not torch.equal(a[f"{key}.trellis"], c[f"{key}.trellis"])


def test_flags(tiny_config, tmp_path):
    from trellm import LLM
    from trellm.config import EngineConfig, ModelConfig
    from trellm.entrypoints.cli import add_engine_args, engine_kwargs
    from trellm.entrypoints.llm import engine_config_from_kwargs

    p = argparse.ArgumentParser()
    add_engine_args(p)
    args = p.parse_args(["dummy:" + tiny_config, "--quantization", "exl3", "--bits", "4"])
    mc = engine_config_from_kwargs(args.model, **engine_kwargs(args)).model
    assert (mc.quantization, mc.bits) == ("exl3", 4.0)
    with pytest.raises(ValueError, match="--bits needs --quantization exl3"):
        EngineConfig(model=ModelConfig(bits=3)).validate()
    with pytest.raises(ModelLoadError, match="needs --bits"):
        LLM("dummy:" + tiny_config, quantization="exl3", **ENGINE)
    with pytest.raises(ModelLoadError, match="1..8"):
        LLM("dummy:" + tiny_config, quantization="exl3", bits=9, **ENGINE)
    _, ddir = _write_models(tmp_path, "LlamaForCausalLM", False, 16, "mul1", 2)
    with pytest.raises(ModelLoadError, match="needs an EXL3 checkpoint"):
        LLM(ddir, quantization="exl3", **ENGINE)
