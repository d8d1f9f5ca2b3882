"""GGUF Q4_0/Q4_1 linear weights kept packed (int4 matmul): exact decoding against
``gguf``, the layer against a dense matmul, the engine's choice, and the model end
to end against the float32 path."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from trellm.layers.linear import Linear, MergedLinear
from trellm.loader.checkpoint import open_checkpoint
from trellm.quant import gguf_int4
from trellm.quant.base import QUANT_METHODS, get_linear_method
from trellm.quant.gguf_int4 import GGUFQ4LinearMethod, Q4Tensor, dequantize_reference, q4_from_gguf


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit float32 equality (tells -0.0 from +0.0, unlike torch.equal)."""
    return a.dtype == b.dtype == torch.float32 and torch.equal(a.view(torch.int32), b.view(torch.int32))


def _gguf_dequantize(data: np.ndarray, qtype, shape: tuple[int, ...]) -> torch.Tensor:
    import gguf

    return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(data, qtype), np.float32).reshape(shape))


def _quantized(w: np.ndarray, type_name: str) -> Q4Tensor:
    """Quantize a float [N, K] array with gguf and decode it to a Q4Tensor."""
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    return q4_from_gguf(gguf.quants.quantize(w.astype(np.float32), qtype), type_name, w.shape)


# ---- decoding: exact against gguf ---------------------------------------------------------


def test_real_q4_1_tensors_decode_bit_exactly(default_gguf):
    import gguf

    reader = gguf.GGUFReader(default_gguf)
    raw = {t.name: t for t in reader.tensors}
    for name in ("blk.0.attn_q.weight", "blk.3.attn_v.weight", "blk.17.ffn_down.weight", "blk.29.ffn_up.weight"):
        t = raw[name]
        assert t.tensor_type.name == "Q4_1"
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        q4 = q4_from_gguf(t.data, "Q4_1", shape)
        assert q4.shape == shape and q4.q.dtype == torch.uint8 and int(q4.q.max()) <= 15
        assert q4.scale.shape == q4.zero.shape == (shape[0], shape[1] // 32)
        assert _bits_equal(q4.dequantize(), _gguf_dequantize(t.data, t.tensor_type, shape)), name


def test_loader_keeps_q4_only_for_linear_weights_and_unpermutes(default_gguf):
    # The first tensors of the file: the Q8_0 embedding, then layer 0 (q/k permuted).
    n = 12
    packed = dict(itertools.islice(open_checkpoint(default_gguf, keep_q4=True).tensors(), n))
    dense = dict(itertools.islice(open_checkpoint(default_gguf).tensors(), n))
    assert "model.layers.0.self_attn.q_proj.weight" in packed and "model.layers.0.self_attn.k_proj.weight" in packed
    for name, t in packed.items():
        if gguf_int4.is_linear_weight(name):
            assert isinstance(t, Q4Tensor), name
            assert _bits_equal(t.dequantize(), dense[name]), name
        else:  # embedding, norms
            assert isinstance(t, torch.Tensor) and torch.equal(t, dense[name]), name


def _write_llama_gguf(path, linear_type: str, odd_one: str | None = None) -> dict[str, np.ndarray]:
    """A tiny llama GGUF whose linear weights are ``linear_type`` (one of them F32 when
    ``odd_one`` names it); returns the float weights in HF names and layout."""
    import gguf

    from trellm.loader.gguf_loader import _GLOBAL_NAMES, _LAYER_NAMES

    rng = np.random.default_rng(5)
    hidden, heads, kv, hd, ffn, vocab = 64, 4, 2, 16, 96, 80
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    for i in range(2):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (heads * hd, hidden), p + "self_attn.k_proj.weight": (kv * hd, hidden),
                   p + "self_attn.v_proj.weight": (kv * hd, hidden), p + "self_attn.o_proj.weight": (hidden, heads * hd),
                   p + "mlp.gate_proj.weight": (ffn, hidden), p + "mlp.up_proj.weight": (ffn, hidden),
                   p + "mlp.down_proj.weight": (hidden, ffn), p + "input_layernorm.weight": (hidden,),
                   p + "post_attention_layernorm.weight": (hidden,)}
    state = {k: (rng.standard_normal(s) / (s[-1] ** 0.5 if len(s) == 2 else 1)).astype(np.float32)
             for k, s in shapes.items()}
    w = gguf.GGUFWriter(str(path), "llama")
    for add, v in ((w.add_block_count, 2), (w.add_context_length, 256), (w.add_embedding_length, hidden),
                   (w.add_feed_forward_length, ffn), (w.add_head_count, heads), (w.add_head_count_kv, kv),
                   (w.add_layer_norm_rms_eps, 1e-6), (w.add_vocab_size, vocab)):
        add(v)
    for name, arr in state.items():
        stem, _, kind = name.rpartition(".")
        gname = next((f"{g}.{kind}" for g, h in _GLOBAL_NAMES.items() if h == stem), None)
        if gname is None:
            _, _, layer, rest = stem.split(".", 3)
            gname = f"blk.{layer}.{next(g for g, h in _LAYER_NAMES.items() if h == rest)}.{kind}"
        if ".q_proj." in name or ".k_proj." in name:  # llama.cpp's converter permutes Q/K rows
            n = heads if ".q_proj." in name else kv
            arr = arr.reshape(n, 2, arr.shape[0] // n // 2, -1).swapaxes(1, 2).reshape(arr.shape)
        if gguf_int4.is_linear_weight(name) and name != odd_one:
            qtype = gguf.GGMLQuantizationType[linear_type]
            w.add_tensor(gname, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gname, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return state


def test_synthetic_q4_0_decodes_bit_exactly(tmp_path):
    import gguf

    path = tmp_path / "q4_0.gguf"
    _write_llama_gguf(path, "Q4_0")
    reader = gguf.GGUFReader(str(path))
    for t in reader.tensors:
        if t.tensor_type.name != "Q4_0":
            continue
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        q4 = q4_from_gguf(t.data, "Q4_0", shape)
        assert q4.zero is None and q4.offset == 8
        # Q4_0 scales can be negative, so d * (8 - 8) is -0.0: the bit check sees that.
        assert _bits_equal(q4.dequantize(), _gguf_dequantize(t.data, t.tensor_type, shape)), t.name
    ckpt = open_checkpoint(str(path), keep_q4=True)
    assert {ckpt.tensor_types[n] for n in ckpt.tensor_types if gguf_int4.is_linear_weight(n)} == {"Q4_0"}
    dense = dict(open_checkpoint(str(path)).tensors())
    for name, t in ckpt.tensors():
        assert isinstance(t, Q4Tensor) == gguf_int4.is_linear_weight(name), name
        got = t.dequantize() if isinstance(t, Q4Tensor) else t
        assert _bits_equal(got, dense[name]), name


# ---- the layer: int4 matmul against a dense one ------------------------------------------


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).norm() / ref.norm())


def _load(layer: Linear, parts: list[Q4Tensor], bias: torch.Tensor | None = None) -> None:
    if isinstance(layer, MergedLinear):
        for shard, part in enumerate(parts):
            layer.weight_loader("weight", part, shard)
    else:
        layer.weight_loader("weight", parts[0])
    if bias is not None:
        layer.weight_loader("bias", bias)
    layer.method.process_after_loading(layer)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1"])
@pytest.mark.parametrize("n, k", [(192, 576), (576, 1536), (64, 32)])
def test_int4_linear_matches_dense(type_name, n, k):
    rng = np.random.default_rng(n + k)
    q4 = _quantized(rng.standard_normal((n, k)) * 0.05 + 0.01, type_name)
    bias = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
    layer = Linear(k, n, True, get_linear_method({"quant_method": "gguf_q4"}), torch.float32)
    _load(layer, [q4], bias)
    assert getattr(layer, "weight", None) is None and not hasattr(layer, "q4_scale")  # staging freed
    assert layer.q4_packed.numel() * layer.q4_packed.element_size() == n * k // 2
    w = q4.dequantize()
    for shape in ((1, k), (3, k), (8, k), (2, 5, k)):
        x = torch.from_numpy(rng.standard_normal(shape).astype(np.float32))
        y = layer(x)
        assert y.dtype == torch.float32 and y.shape == (*shape[:-1], n)
        assert _rel_err(y, F.linear(x, w, bias)) < 1e-2, shape


def test_merged_linear_three_shards_mixed_types():
    rng = np.random.default_rng(0)
    sizes, k = [576, 192, 192], 576
    parts = [_quantized(rng.standard_normal((s, k)) * 0.05, t) for s, t in zip(sizes, ("Q4_1", "Q4_0", "Q4_1"))]
    layer = MergedLinear(k, sizes, False, GGUFQ4LinearMethod(), torch.float32)
    _load(layer, parts)
    w = torch.cat([p.dequantize() for p in parts])
    for m in (1, 3, 8):
        x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
        y = layer(x)
        assert _rel_err(y, F.linear(x, w)) < 1e-2, m
        for got, want in zip(layer.split(y), F.linear(x, w).split(sizes, dim=-1)):
            assert _rel_err(got, want) < 1e-2


def test_int4_linear_is_batch_invariant(default_gguf):
    # Each row's result must not depend on the rows beside it (bit for bit), so the
    # packed path adds no batch dependence of its own.
    t = next(t for t in open_checkpoint(default_gguf, keep_q4=True).tensors()
             if t[0] == "model.layers.0.mlp.down_proj.weight")[1]
    layer = Linear(t.shape[1], t.shape[0], False, GGUFQ4LinearMethod(), torch.float32)
    _load(layer, [t])
    x = torch.randn(40, t.shape[1], generator=torch.Generator().manual_seed(0))
    rows = torch.cat([layer(x[i:i + 1]) for i in range(len(x))])
    for m in (2, 3, 8, 16, 40):
        assert torch.equal(layer(x[:m]), rows[:m]), m


def test_shape_mismatch_and_dense_tensor_are_rejected():
    rng = np.random.default_rng(1)
    layer = MergedLinear(64, [32, 32], False, GGUFQ4LinearMethod(), torch.float32)
    with pytest.raises(ValueError, match="shape mismatch"):
        layer.weight_loader("weight", _quantized(rng.standard_normal((64, 64)), "Q4_1"), 0)
    with pytest.raises(ValueError, match="not a Q4Tensor"):
        layer.weight_loader("weight", torch.zeros(32, 64), 1)


def test_fallback_without_kernel_is_dense_and_exact(monkeypatch):
    monkeypatch.setattr(gguf_int4, "int4_kernel_available", lambda: False)
    rng = np.random.default_rng(2)
    q4 = _quantized(rng.standard_normal((96, 64)), "Q4_0")
    layer = Linear(64, 96, False, GGUFQ4LinearMethod(), torch.float32)
    _load(layer, [q4])
    assert layer.weight.dtype == torch.float32 and not hasattr(layer, "q4_packed")
    # Q4_0 has zero 0 in the kernel's convention, so the fallback reproduces gguf's values.
    assert torch.equal(layer.weight, q4.dequantize())
    x = torch.randn(4, 64)
    assert torch.equal(layer(x), F.linear(x, q4.dequantize()))


def test_reference_is_the_kernel_formula():
    q = torch.randint(0, 16, (64, 128), dtype=torch.int32)
    scale, zero = torch.rand(64, 4) * 0.1, torch.randn(64, 4) * 0.1
    sz = torch.stack([scale.t(), zero.t()], -1).to(torch.bfloat16).contiguous()
    x = torch.randn(5, 128).to(torch.bfloat16)
    y = torch._weight_int4pack_mm_for_cpu(x, torch._convert_weight_to_int4pack_for_cpu(q, 1), 32, sz)
    w = dequantize_reference(q, sz[..., 0].t().float(), sz[..., 1].t().float())
    assert _rel_err(y, x.float() @ w.t()) < 1e-2


def test_registered():
    assert isinstance(get_linear_method({"quant_method": "gguf_q4"}), GGUFQ4LinearMethod)
    assert QUANT_METHODS["gguf_q4"] is GGUFQ4LinearMethod


# ---- the engine's choice and the model end to end ----------------------------------------


def _built_method(path: str, **kw) -> str:
    from trellm.config import EngineConfig, ModelConfig
    from trellm.worker.builder import build_worker

    info = build_worker(EngineConfig(model=ModelConfig(model=path, device="cpu", **kw)))
    return (info.arch.quantization_config or {}).get("quant_method", "none")


def test_engine_keeps_q4_0_packed_and_falls_back_for_mixed_files(tmp_path):
    _write_llama_gguf(tmp_path / "q4_0.gguf", "Q4_0")
    assert _built_method(str(tmp_path / "q4_0.gguf")) == "gguf_q4"
    assert _built_method(str(tmp_path / "q4_0.gguf"), quantization="none") == "none"
    _write_llama_gguf(tmp_path / "mixed.gguf", "Q4_0", odd_one="model.layers.1.mlp.up_proj.weight")
    assert _built_method(str(tmp_path / "mixed.gguf")) == "none"  # loads: Q4 tensors dequantized


def test_quantization_is_validated():
    from trellm.config import EngineConfig, ModelConfig

    with pytest.raises(ValueError, match="--quantization"):
        EngineConfig(model=ModelConfig(quantization="int3")).validate()


PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea,",
    "Q: What is the boiling point of water in Celsius?\nA:",
    "The three laws of robotics state that",
    "In mathematics, a prime number is",
    "import numpy as np\n\ndef softmax(x):",
    "Water boils at",
    "To make a paper airplane, first",
    "Dear hiring manager, I am writing to",
    "Photosynthesis converts light energy into",
]


def _prompt_logits(llm, ids: list[int]) -> torch.Tensor:
    """Full next-token logits at every position of ``ids`` (one prefill, teacher forced)."""
    from trellm import SamplingParams

    model = llm.engine.worker.runner.model
    seen: list[torch.Tensor] = []
    original = model.compute_logits

    def recording(hidden: torch.Tensor) -> torch.Tensor:
        seen.append(original(hidden))
        return seen[-1]

    model.compute_logits = recording  # an instance attribute shadows the method
    try:
        llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))
    finally:
        del model.compute_logits
    return seen[0][: len(ids) - 1]


@pytest.mark.slow
def test_int4_model_close_to_float32(default_gguf):
    from trellm import LLM, SamplingParams

    fast = LLM(default_gguf, device="cpu", quantization="auto", kv_cache_memory=128 << 20)
    ref = LLM(default_gguf, device="cpu", quantization="none", dtype="float32", kv_cache_memory=128 << 20)
    assert fast.engine.worker.arch.quantization_config == {"quant_method": "gguf_q4"}
    assert ref.engine.worker.arch.quantization_config is None
    tok = ref.get_tokenizer()
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [tok.encode(p) for p in PROMPTS]
    ref_out = [o.outputs[0].token_ids for o in ref.generate([{"prompt_token_ids": p} for p in prompts], greedy)]
    fast_out = [o.outputs[0].token_ids for o in fast.generate([{"prompt_token_ids": p} for p in prompts], greedy)]
    # Teacher-force the float32 continuations through both and compare distributions.
    kls, tie_gaps = [], []
    for p, want, got in zip(prompts, ref_out, fast_out):
        ids = p + list(want)
        lp_ref = torch.log_softmax(_prompt_logits(ref, ids).float(), -1)
        lp_fast = torch.log_softmax(_prompt_logits(fast, ids).float(), -1)
        kls.append(F.kl_div(lp_fast, lp_ref, log_target=True, reduction="none").sum(-1))
        if want != got:  # how close float32's own choice was where the two first part
            i = next(j for j, (a, b) in enumerate(zip(want, got)) if a != b)
            row = lp_ref[len(p) - 1 + i]
            tie_gaps.append(float(row[want[i]] - row[got[i]]))
    kl = torch.cat(kls)
    same = len(PROMPTS) - len(tie_gaps)
    print(f"int4 vs float32: mean KL {float(kl.mean()):.5f} (max {float(kl.max()):.4f}) over {kl.numel()} "
          f"positions; greedy 24-token continuations equal on {same}/{len(PROMPTS)}; float32 log-prob "
          f"gaps where they part: {[round(g, 4) for g in tie_gaps]}")
    assert kl.numel() >= 100
    assert float(kl.mean()) < 0.01
    assert same >= len(PROMPTS) // 3  # int8 LM head: KL ~0.002, a few near-ties flip
    assert all(g < 0.5 for g in tie_gaps)  # they part only where float32 itself nearly tied
