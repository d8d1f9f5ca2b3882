"""The CLI answers bad input with one line on stderr and exit code 1, never a traceback."""
from __future__ import annotations

import subprocess
import sys

import pytest

from trellm.entrypoints.cli import main


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith("trellm: error:")]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


@pytest.mark.parametrize("model, fragment", [
    ("/no/such/model.gguf", "no/such/model.gguf"),
    ("dummy:/no/such/config.json", "config.json"),
])
def test_unknown_model_path(capsys, model, fragment):
    code, _, err = run_cli(capsys, "generate", "hi", model)
    assert code == 1
    assert fragment in one_line_error(err)


def test_unreadable_or_unsupported_file(capsys, tmp_path):
    junk = tmp_path / "model.gguf"
    junk.write_bytes(b"not a gguf file at all" * 10)
    code, _, err = run_cli(capsys, "generate", "hi", str(junk))
    assert code == 1
    one_line_error(err)
    cfg = tmp_path / "cfg"
    cfg.mkdir()
    (cfg / "config.json").write_text(
        '{"architectures": ["MambaForCausalLM"], "vocab_size": 10, "hidden_size": 8, '
        '"intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2}')
    code, _, err = run_cli(capsys, "generate", "hi", str(cfg))
    assert code == 1
    assert "no model weights" in one_line_error(err)
    code, _, err = run_cli(capsys, "generate", "hi", f"dummy:{cfg / 'config.json'}")
    assert code == 1
    assert "unsupported architecture" in one_line_error(err)


def test_prompt_longer_than_context(capsys, default_gguf):
    code, _, err = run_cli(capsys, "generate", "word " * 200, default_gguf, "--max-model-len", "64",
                           "--max-tokens", "4")
    assert code == 1
    assert "context" in one_line_error(err)


@pytest.mark.parametrize("flags, field", [
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "1.5"], "top_p"),
    (["--max-tokens", "0"], "max_tokens"),
    (["--top-k", "-5"], "top_k"),
    (["--temperature", "nan"], "temperature"),
])
def test_invalid_sampling_values(capsys, default_gguf, flags, field):
    code, _, err = run_cli(capsys, "generate", "hi", default_gguf, *flags)
    assert code == 1
    assert field in one_line_error(err)


def test_generate_streams_text(capsys, default_gguf):
    code, out, err = run_cli(capsys, "generate", "The capital of France is", default_gguf,
                             "--max-tokens", "8", "--dtype", "float32")
    assert code == 0
    assert out.strip(), err


def test_chat_interactive_subprocess(default_gguf):
    proc = subprocess.run(
        [sys.executable, "-m", "trellm.entrypoints.cli", "chat", default_gguf, "--max-tokens", "12"],
        input="What is the capital of France?\n\n", capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "Paris" in proc.stdout
