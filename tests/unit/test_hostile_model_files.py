"""Hostile model files (reliability.md: model inputs are data): each case is one clear
error, never a traceback, a hang, an allocation the size of the disk, or a file read
from outside the model directory."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from trellm.loader.checkpoint import open_checkpoint, read_json_object
from trellm.loader.errors import ModelLoadError
from trellm.loader.hf_loader import weight_files
from trellm.model.config import ArchConfig
from trellm.tokenizer.chat_template import render_chat_template

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512, "hidden_size": 64,
          "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "max_position_embeddings": 256}


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this OS")
def test_fifo_shard_and_fifo_config_are_refused_without_blocking(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    os.mkfifo(tmp_path / "model-00001-of-00001.safetensors")
    with pytest.raises(ModelLoadError, match="no model weights"):
        weight_files(tmp_path)
    fifo_dir = tmp_path / "sub"
    fifo_dir.mkdir()
    os.mkfifo(fifo_dir / "config.json")
    with pytest.raises(ModelLoadError, match="not a regular file"):
        read_json_object(fifo_dir / "config.json")


@pytest.mark.parametrize("name,match", [("../outside.safetensors", "outside the model directory"),
                                        ("/etc/passwd", "outside the model directory"),
                                        (5, "must be shard file names"), (["a"], "must be shard file names")])
def test_shard_index_cannot_name_files_outside_the_directory(tmp_path, name, match):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": name}}))
    with pytest.raises(ModelLoadError, match=match):
        weight_files(tmp_path)


def test_deeply_nested_json_is_one_error(tmp_path):
    p = tmp_path / "config.json"
    p.write_text("[" * 100000 + "]" * 100000)
    with pytest.raises(ModelLoadError, match="nested too deeply|not valid JSON"):
        read_json_object(p)


@pytest.mark.parametrize("key,value,match", [
    ("hidden_size", -64, "hidden_size must be an integer"),
    ("hidden_size", "64", "hidden_size must be an integer"),
    ("hidden_size", 64.5, "hidden_size must be an integer"),
    ("vocab_size", 10 ** 12, "vocab_size must be an integer"),
    ("num_hidden_layers", 10 ** 9, "num_hidden_layers must be an integer"),
    ("num_hidden_layers", -1, "num_hidden_layers must be an integer"),
    ("max_position_embeddings", -1, "max_position_embeddings must be an integer"),
    ("num_key_value_heads", 3, "not a multiple of num_key_value_heads"),
    ("rope_theta", 0, "rope_theta must be a positive number"),
    ("rope_theta", "x", "rope_theta must be a number"),
    ("quantization_config", "x", "quantization_config must be an object"),
    ("rope_scaling", "yarn", "rope_scaling must be an object"),
])
def test_config_numbers_are_checked(key, value, match):
    with pytest.raises(ValueError, match=match):
        ArchConfig.from_hf({**CONFIG, key: value})


@pytest.mark.parametrize("scaling,match", [
    ({"rope_type": "linear", "factor": 0}, "factor must be a positive number"),
    ({"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8192}, "low_freq_factor must be a positive number"),
])
def test_bad_rope_scaling_is_a_load_error(tmp_path, scaling, match):
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({**CONFIG, "rope_scaling": scaling}))
    from trellm.entrypoints.llm import LLM
    with pytest.raises(ModelLoadError, match=match):
        LLM(f"dummy:{cfg}", device="cpu", dtype="float32", kv_cache_memory=1 << 20)


def test_max_model_len_past_the_model_context_is_refused(tmp_path):
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps(CONFIG))
    from trellm.entrypoints.llm import LLM
    with pytest.raises(ModelLoadError, match="exceeds the model's context length 256"):
        LLM(f"dummy:{cfg}", device="cpu", dtype="float32", kv_cache_memory=1 << 20, max_model_len=10 ** 12)


@pytest.mark.parametrize("template,match", [
    ("{{ 1/0 }}", "ZeroDivisionError"),
    ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "RecursionError"),
    ("{{ range(10**12) }}", "OverflowError"),
    ("{{ 'a' * 10000000000 }}", "repetition longer than"),
    ("{{ 2 ** 100000000 }}", "exponent too large"),
])
def test_hostile_chat_templates_are_one_error(template, match):
    with pytest.raises(ValueError, match=match):
        render_chat_template(template, [{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("template,content", [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "hi"),
    # Quadratic in the caller's message: slow only for some requests.
    ("{% for m in messages %}{% for c in m.content %}{% for d in m.content %}{{ '' }}{% endfor %}"
     "{% endfor %}{% endfor %}", "x" * 100000),
])
def test_endless_chat_template_is_stopped_with_one_error(template, content, monkeypatch):
    import sys
    import time
    from trellm.tokenizer import chat_template
    monkeypatch.setattr(chat_template, "MAX_RENDER_SECONDS", 0.3)
    before = sys.gettrace()
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="ran longer than 0.3 s"):
        render_chat_template(template, [{"role": "user", "content": content}])
    assert time.monotonic() - t0 < 5
    assert sys.gettrace() is before  # a coverage tracer, if any, is back
    # The deadline is per render: a normal template right after renders.
    assert render_chat_template("{{ messages[0].content[:2] }}", [{"role": "user", "content": content}]) == content[:2]


def test_gguf_with_bad_alignment_is_refused(tmp_path):
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "a.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_int32("general.alignment", -32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match="alignment"):
        open_checkpoint(str(path))


def test_quantize_out_that_is_a_file_is_one_error(tmp_path, capsys):
    from trellm.entrypoints.cli import main
    out = tmp_path / "file"
    out.write_text("x")
    assert main(["quantize", str(tmp_path), "--bits", "4", "--out", str(out)]) != 0
    err = capsys.readouterr().err
    assert "exists and is not a directory" in err and "Traceback" not in err
    assert Path(out).read_text() == "x"


def test_integer_weights_where_floats_belong_are_refused():
    import torch

    from trellm.layers.linear import check_float
    with pytest.raises(ValueError, match="expects floating point"):
        check_float(torch.zeros(2, 2, dtype=torch.int32), "model.embed_tokens.weight", torch.zeros(2, 2))
    check_float(torch.zeros(2, 2, dtype=torch.float16), "ok", torch.zeros(2, 2))  # floats of any width load
