"""`trellm bench load`: page-cache control, and whole runs on the embedded GGUF, a
sharded Hugging Face directory (random weights) and a dummy config."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from trellm.bench.load import drop_page_cache, model_files, raw_read, resident_fraction
from trellm.entrypoints.cli import main
from trellm.tokenizer.tokenizer import Tokenizer

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 64, 2, 4, 2, 128


def run_cli(monkeypatch, *argv: str) -> int:
    monkeypatch.setattr(sys, "argv", ["trellm", *argv])
    return main(list(argv))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, default_gguf) -> Path:
    """A 2-layer random Llama as an HF directory: two safetensors shards with an index,
    the default model's tokenizer and chat template."""
    out = tmp_path_factory.mktemp("hf-tiny")
    tok = Tokenizer.from_gguf(default_gguf)
    tok.hf.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": tok.bos_token, "eos_token": tok.eos_token, "chat_template": tok.chat_template}))
    (out / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": tok.vocab_size, "hidden_size": HIDDEN,
        "intermediate_size": FFN, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "max_position_embeddings": 256, "tie_word_embeddings": True,
        "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id}))
    g = torch.Generator().manual_seed(0)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.02

    kv = HIDDEN // HEADS * KV_HEADS
    shards = [{"model.embed_tokens.weight": w(tok.vocab_size, HIDDEN), "model.norm.weight": torch.ones(HIDDEN)}]
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shards.append({p + "self_attn.q_proj.weight": w(HIDDEN, HIDDEN), p + "self_attn.k_proj.weight": w(kv, HIDDEN),
                       p + "self_attn.v_proj.weight": w(kv, HIDDEN), p + "self_attn.o_proj.weight": w(HIDDEN, HIDDEN),
                       p + "mlp.gate_proj.weight": w(FFN, HIDDEN), p + "mlp.up_proj.weight": w(FFN, HIDDEN),
                       p + "mlp.down_proj.weight": w(HIDDEN, FFN), p + "input_layernorm.weight": torch.ones(HIDDEN),
                       p + "post_attention_layernorm.weight": torch.ones(HIDDEN)})
    weight_map = {}
    for n, shard in enumerate(shards, 1):
        name = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out


def _fs_type(path: Path) -> str:
    best, kind = "", ""
    for line in Path("/proc/mounts").read_text().splitlines():
        _dev, mount, fs = line.split()[:3]
        if str(path).startswith(mount) and len(mount) > len(best):
            best, kind = mount, fs
    return kind


def test_page_cache_drop_and_residency(tmp_path):
    f = tmp_path / "blob.bin"
    f.write_bytes(torch.randint(0, 255, (8 << 20,), dtype=torch.uint8).numpy().tobytes())
    raw_read((f,))
    assert resident_fraction((f,)) == 1.0  # just read: every page is cached
    if _fs_type(tmp_path) in ("tmpfs", "ramfs", "overlay"):
        pytest.skip(f"{tmp_path} is on {_fs_type(tmp_path)}, whose pages fadvise cannot drop")
    drop_page_cache((f,))
    assert resident_fraction((f,)) < 0.5
    raw_read((f,))
    assert resident_fraction((f,)) == 1.0


def test_model_files(hf_dir, default_gguf):
    hf = model_files(str(hf_dir))
    names = [f.name for f in hf.files]
    assert hf.kind == "hf" and names[:3] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert "tokenizer.json" in names and hf.total_bytes > 0
    assert model_files(default_gguf).kind == "gguf" and model_files("").files == (Path(default_gguf),)
    assert model_files("dummy:/anything/config.json").files == ()


def _rows(data: dict) -> dict[tuple, dict]:
    return {(r["stage"], r["cache"], r["workers"]): r for r in data["rows"]}


def _check_header(data: dict) -> None:
    for key in ("command", "date", "model", "trellm_version", "format", "notes"):
        assert data[key], key
    assert data["command"].startswith("trellm bench load")
    assert data["machine"]["platform"] and data["machine"]["cpu_count"] >= 1


def test_load_gguf(tmp_path, capsys, monkeypatch, default_gguf):
    out = tmp_path / "load.json"
    assert run_cli(monkeypatch, "bench", "load", "--workers", "1,2", "--out", str(out)) == 0
    stdout = capsys.readouterr().out
    data = json.loads(out.read_text())
    _check_header(data)
    assert data["format"] == "gguf" and data["workers"] == [1, 2]
    assert data["total_bytes"] == Path(default_gguf).stat().st_size
    # One GGUF is one mapped file: the worker count plays no part, so it runs once.
    assert set(_rows(data)) == {(s, c, None) for s in ("raw read", "checkpoint read", "model load")
                                for c in ("cold", "warm")}
    for r in data["rows"]:
        assert r["seconds"] > 0 and r["gb_s"] > 0 and len(r["samples"]) == 1, r
        assert r["resident_before"] is None or 0.0 <= r["resident_before"] <= 1.0
    assert any("GGUF" in n for n in data["notes"]) and any("best effort" in n for n in data["notes"])
    assert "| stage | workers | page cache |" in stdout and "| raw read | – | cold |" in stdout
    assert out.with_suffix(".png").read_bytes()[:8] == PNG_MAGIC


def test_load_hf_dir_workers(tmp_path, monkeypatch, hf_dir):
    out = tmp_path / "hf.json"
    assert run_cli(monkeypatch, "bench", "load", str(hf_dir), "--workers", "1,3", "--kv-cache-memory",
                   str(1 << 20), "--out", str(out), "--png", str(tmp_path / "hf.png")) == 0
    data = json.loads(out.read_text())
    _check_header(data)
    assert data["format"] == "hf" and data["workers"] == [1, 3] and data["engine_args"]["enforce_eager"]
    rows = _rows(data)
    assert set(rows) == ({("raw read", c, None) for c in ("cold", "warm")}
                         | {(s, c, w) for s in ("checkpoint read", "model load") for c in ("cold", "warm")
                            for w in (1, 3)})
    for r in data["rows"]:
        assert r["seconds"] > 0 and r["gb_s"] == pytest.approx(data["total_bytes"] / r["seconds"] / 1e9), r
    assert (tmp_path / "hf.png").read_bytes()[:8] == PNG_MAGIC


def test_load_dummy(tmp_path, capsys, monkeypatch, hf_dir):
    out = tmp_path / "dummy.json"
    assert run_cli(monkeypatch, "bench", "load", f"dummy:{hf_dir / 'config.json'}", "--workers", "2",
                   "--repeats", "2", "--kv-cache-memory", str(1 << 20), "--out", str(out)) == 0
    data = json.loads(out.read_text())
    assert data["format"] == "dummy" and data["files"] == [] and data["total_bytes"] == 0
    assert [(r["stage"], r["cache"]) for r in data["rows"]] == [("model load", "n/a")]
    row = data["rows"][0]
    assert len(row["samples"]) == 2 and row["seconds"] == min(row["samples"]) > 0 and row["gb_s"] is None
    assert any("no disk read" in n for n in data["notes"])
    assert "no disk read" in capsys.readouterr().out


def test_bad_workers_are_refused(capsys):
    for bad in ("0", "two", ""):
        with pytest.raises(SystemExit) as e:
            main(["bench", "load", "--workers", bad])
        assert e.value.code == 2
        assert "worker" in capsys.readouterr().err
