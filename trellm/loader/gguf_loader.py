"""GGUF files: llama.cpp metadata -> HF config, GGUF tensors -> HF-named float32 tensors.

Quantized tensors are dequantized with the ``gguf`` package (every type it
implements); the engine then treats them as a dense checkpoint. With ``keep_q4``
the decoder-layer linear weights of type Q4_0 / Q4_1 come out still quantized, as
``Q4Tensor`` (for the packed int4 matmul, ``trellm.quant.gguf_int4``).

Two conversions are not plain renames:

* ``llama`` files: llama.cpp's converter permutes the rows of Q and K (per head,
  from HF's half-split rotary layout to interleaved pairs). We undo it, exactly
  as transformers' GGUF loader does, so the weights work with rotate-half RoPE.
  Qwen2/Qwen3 files are written unpermuted.
* Llama 3.1-style RoPE scaling is stored as a ``rope_freqs.weight`` tensor of
  per-frequency divisors, not as metadata. We fit the llama3 parameters that
  reproduce it (checked to 1e-3) and put them in ``rope_scaling``; the tensor
  itself is not yielded.
"""
from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from trellm.loader.checkpoint import Checkpoint
from trellm.loader.errors import ModelLoadError, first_line
from trellm.quant.gguf_int4 import Q4_TYPES, Q4Tensor, is_linear_weight, q4_from_gguf

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
# Tensors that carry no model parameter: RoPE tables the engine recomputes.
_IGNORED = re.compile(r"^(rope_freqs\.weight|blk\.\d+\.attn_rot_embd(\.weight)?)$")
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_DEFAULT_LLAMA3_ORIGINAL_CONTEXT = 8192


def load_gguf(path: Path, keep_q4: bool = False) -> Checkpoint:
    """Open a GGUF file as a ``Checkpoint`` (tensors are read lazily); ``keep_q4``:
    yield Q4_0/Q4_1 decoder-layer linear weights as ``Q4Tensor`` (never the embedding,
    the LM head or norms)."""
    import gguf

    from trellm.tokenizer.tokenizer import Tokenizer

    from trellm.loader.gguf_file import GGUFReaderView

    try:
        reader = GGUFReaderView(path)
    except Exception as e:  # damaged files raise ValueError/IndexError/struct errors
        raise ModelLoadError(f"cannot read GGUF file {path}: {first_line(e)}") from e
    config = gguf_hf_config(reader, source=str(path))
    names = {t.name: hf_tensor_name(t.name) for t in reader.tensors}
    unknown = [n for n, hf in names.items() if hf is None and not _IGNORED.match(n)]
    if unknown:
        raise ModelLoadError(f"{path}: GGUF tensor {unknown[0]!r} has no Hugging Face equivalent "
                             f"({len(unknown)} such tensors)")
    try:
        tokenizer = Tokenizer.from_gguf(reader) if "tokenizer.ggml.model" in reader.fields else None
    except ModelLoadError:
        raise
    except Exception as e:  # malformed vocabulary / merges / token types
        raise ModelLoadError(f"{path}: cannot build the tokenizer from the GGUF metadata: {first_line(e)}") from e
    generation_config = {k: config[k] for k in ("bos_token_id", "eos_token_id") if config.get(k) is not None}
    unpermute = config["model_type"] == "llama"
    types = {hf: t.tensor_type.name for t in reader.tensors if (hf := names[t.name]) is not None}

    def tensors() -> Iterator[tuple[str, torch.Tensor | Q4Tensor]]:
        for t in reader.tensors:
            hf_name = names[t.name]
            if hf_name is None:
                continue
            if keep_q4 and types[hf_name] in Q4_TYPES and is_linear_weight(hf_name):
                yield hf_name, _q4_tensor(t, config, unpermute)
            else:
                yield hf_name, _dequantize(t, config, unpermute, source=str(path))

    return Checkpoint(hf_config=config, tensors=tensors, tokenizer=tokenizer,
                      generation_config=generation_config, source=str(path), tensor_types=types)


def hf_tensor_name(name: str) -> str | None:
    """The HF parameter name of a GGUF tensor, or None when it has none."""
    stem, _, kind = name.rpartition(".")
    if stem in _GLOBAL_NAMES and kind in ("weight", "bias"):
        return f"{_GLOBAL_NAMES[stem]}.{kind}"
    m = _LAYER_RE.match(name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    return None


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (rows of each head: interleaved pairs
    -> first half / second half), transformers' ``_reverse_permute_weights``.

    llama.cpp wrote ``w.reshape(n_head, 2, dim // 2, ...).swapaxes(1, 2)``; this
    reshapes to ``(n_head, dim // 2, 2, ...)`` and swaps back. Works for weights and biases.
    """
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _dequantize(t: Any, config: dict, unpermute: bool, source: str) -> torch.Tensor:
    import gguf

    try:
        arr = gguf.quants.dequantize(t.data, t.tensor_type)
    except NotImplementedError as e:
        raise ModelLoadError(f"{source}: tensor {t.name} has GGUF type {t.tensor_type.name}, "
                             f"which cannot be dequantized") from e
    # GGUF lists dims fastest-first; reversed they are the row-major (HF) shape.
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    arr = np.ascontiguousarray(arr, dtype=np.float32).reshape(shape)
    heads = _permuted_heads(t.name, config, unpermute)
    if heads:
        arr = unpermute_qk(arr, heads)
    if not arr.flags.writeable or not arr.flags.c_contiguous:
        arr = arr.copy()  # F32 tensors come back as read-only views of the memory map
    return torch.from_numpy(arr)


def _q4_tensor(t: Any, config: dict, unpermute: bool) -> Q4Tensor:
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    q4 = q4_from_gguf(t.data, t.tensor_type.name, shape)
    heads = _permuted_heads(t.name, config, unpermute)
    if not heads:
        return q4

    # The permutation moves whole rows, so it applies to q, scale and zero alike.
    def rows(x: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(unpermute_qk(x.numpy(), heads)))

    return Q4Tensor(rows(q4.q), rows(q4.scale), None if q4.zero is None else rows(q4.zero))


def _permuted_heads(gguf_name: str, config: dict, unpermute: bool) -> int:
    """Heads to un-permute the rows of ``gguf_name`` by (llama Q/K), else 0."""
    if unpermute and ".attn_q." in gguf_name:
        return config["num_attention_heads"]
    if unpermute and ".attn_k." in gguf_name:
        return config["num_key_value_heads"]
    return 0


# ---- metadata -> config ----------------------------------------------------------------


def gguf_hf_config(reader: Any, source: str = "GGUF") -> dict:
    """A Hugging Face config.json-style dict from a GGUF's metadata."""
    arch = _get(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(f"{source}: unsupported GGUF architecture {arch!r} "
                             f"(supported: {', '.join(ARCHITECTURES)})")

    def a(key: str, default: Any = None) -> Any:
        return _scalar(_get(reader, f"{arch}.{key}", default), f"{arch}.{key}", source)

    hidden, heads = a("embedding_length"), a("attention.head_count")
    if hidden is None or heads is None or a("block_count") is None:
        raise ModelLoadError(f"{source}: GGUF metadata lacks {arch}.embedding_length, "
                             f"block_count or attention.head_count")
    for key, value in (("embedding_length", hidden), ("attention.head_count", heads),
                       ("block_count", a("block_count"))):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ModelLoadError(f"{source}: GGUF {arch}.{key} must be a positive integer, got {value!r:.40}")
    tensor_names = {t.name for t in reader.tensors}
    tokens = _get(reader, "tokenizer.ggml.tokens")
    config = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": a("feed_forward_length"),
        "num_hidden_layers": a("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": a("attention.head_count_kv", heads),
        "head_dim": a("attention.key_length", hidden // heads),
        "rms_norm_eps": float(a("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(a("rope.freq_base", 10000.0)),
        "max_position_embeddings": a("context_length", 4096),
        "vocab_size": a("vocab_size", len(tokens) if tokens else None),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": arch == "qwen2" or "blk.0.attn_q.bias" in tensor_names,
        "bos_token_id": _get(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _get(reader, "tokenizer.ggml.eos_token_id"),
        "rope_scaling": None,
    }
    if config["vocab_size"] is None:
        raise ModelLoadError(f"{source}: GGUF has neither {arch}.vocab_size nor a token list")
    config["rope_scaling"] = _rope_scaling(reader, arch, config, source)
    return config


def _rope_scaling(reader: Any, arch: str, config: dict, source: str) -> dict | None:
    kind = _get(reader, f"{arch}.rope.scaling.type")
    factor = _get(reader, f"{arch}.rope.scaling.factor")
    original = _get(reader, f"{arch}.rope.scaling.original_context_length")
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:
        factors = np.asarray(freqs.data, dtype=np.float64).reshape(-1)
        dim = _get(reader, f"{arch}.rope.dimension_count", config["head_dim"])
        fitted = llama3_scaling_from_factors(factors, config["rope_theta"], int(dim),
                                             int(original or _DEFAULT_LLAMA3_ORIGINAL_CONTEXT))
        if fitted is None and factors.max() > 1.0 + 1e-6:
            raise ModelLoadError(f"{source}: rope_freqs.weight does not follow Llama 3 RoPE "
                                 f"scaling; this scaling is not supported")
        return fitted
    if kind in (None, "none") or factor is None:
        return None
    scaling = {"rope_type": kind, "factor": float(factor)}
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling


def llama3_scaling_from_factors(factors: np.ndarray, theta: float, dim: int,
                                original: int) -> dict | None:
    """Llama 3 ``rope_scaling`` whose per-frequency divisors equal ``factors``.

    llama.cpp stores divisor 1 for short wavelengths, ``factor`` for long ones and
    ``1 / ((1 - s) / factor + s)`` between, with ``s = (original / wavelen - low)
    / (high - low)``. ``s`` is linear in ``1 / wavelen``, so the band fixes only two
    numbers; taking ``original`` as given, ``low`` and ``high`` follow. Returns None
    when no parameters reproduce ``factors`` (or there is no scaling at all).
    """
    inv = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    factor = float(factors.max()) if factors.size else 1.0
    if factors.shape != inv.shape or factor <= 1.0 + 1e-6:
        return None
    for low, high in _llama3_band_candidates(factors, 2 * math.pi / inv, factor, original):
        params = {"rope_type": "llama3", "factor": factor, "low_freq_factor": float(low),
                  "high_freq_factor": float(high), "original_max_position_embeddings": original}
        if np.allclose(llama3_factors(params, theta, dim), factors, rtol=1e-3, atol=1e-6):
            return params
    return None


def _llama3_band_candidates(factors: np.ndarray, wavelen: np.ndarray, factor: float,
                            original: int) -> Iterator[tuple[float, float]]:
    """(low_freq_factor, high_freq_factor) guesses; the caller keeps the first that fits."""
    medium = (factors > 1.0 + 1e-4) & (factors < factor * (1 - 1e-4))
    s = (1.0 / factors - 1.0 / factor) / (1.0 - 1.0 / factor)  # 0 kept .. 1 fully scaled
    if medium.sum() >= 2:
        slope, intercept = np.polyfit(1.0 / wavelen[medium], s[medium], 1)
        yield -intercept * original / slope, (1 - intercept) * original / slope
        return
    keep, scaled = wavelen[factors <= 1.0 + 1e-4], wavelen[factors >= factor * (1 - 1e-4)]
    if not len(keep) or not len(scaled) or keep.max() >= scaled.min():
        return
    w0, w1 = keep.max(), scaled.min()
    if medium.sum() == 1:
        # One band point fixes one equation: try Meta's low_freq_factor=1, then a
        # low edge halfway to the first scaled wavelength.
        wm, sm = wavelen[medium][0], s[medium][0]
        for low in (1.0, original / ((wm + w1) / 2)):
            yield low, low + (original / wm - low) / sm  # from s = (original/wm - low)/(high - low)
        return
    # No band point: put both band edges between the last kept and first scaled wavelength.
    yield original / (w0 + 2 * (w1 - w0) / 3), original / (w0 + (w1 - w0) / 3)


def llama3_factors(params: dict, theta: float, dim: int) -> np.ndarray:
    """The divisors llama.cpp's converter writes to ``rope_freqs.weight`` for ``params``."""
    inv = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    wavelen = 2 * math.pi / inv
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    original = params["original_max_position_embeddings"]
    s = (original / wavelen - low) / (high - low)
    between = 1.0 / ((1 - s) / factor + s)
    return np.where(wavelen < original / high, 1.0, np.where(wavelen > original / low, factor, between))


def _get(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _scalar(value: Any, key: str, source: str) -> Any:
    # Some files store per-layer arrays (e.g. head_count_kv); uniform ones collapse.
    if isinstance(value, list):
        if value and all(v == value[0] for v in value):
            return value[0]
        raise ModelLoadError(f"{source}: per-layer values for {key} are not supported")
    return value
