"""`trellm bench ladder`: the haystack and needle pieces, the context plan, and whole
runs on the embedded default model, in-process and through --base-url."""
from __future__ import annotations

import json
import random
import re
import socket
import sys

import pytest

from trellm.bench.ladder import in_process_server, plan_contexts
from trellm.bench.needle import Needle, filler, make_needle, plant, user_message
from trellm.entrypoints.cli import main
from trellm.tokenizer.tokenizer import Tokenizer

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def tok(default_gguf) -> Tokenizer:
    return Tokenizer.from_gguf(default_gguf)


# ---- pure parts -------------------------------------------------------------------------


@pytest.mark.parametrize("target", [50, 300, 2000])
def test_filler_length_and_determinism(tok, target):
    text = filler(tok, target, seed=7)
    assert abs(len(tok.encode(text, add_special_tokens=False)) - target) <= 3
    assert filler(tok, target, seed=7) == text
    assert filler(tok, target, seed=8) != text


def test_filler_is_varied_prose_without_competing_facts(tok):
    text = filler(tok, 3000, seed=1)
    sentences = [s for s in re.split(r"(?<=\.)\s+", text) if s]
    # Not one sentence repeated: most sentences are distinct.
    assert len(set(sentences)) > 0.8 * len(sentences)
    assert not re.search(r"\d", text)
    assert "door" not in text and "code" not in text


@pytest.mark.parametrize("depth", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_plant_puts_the_fact_near_its_depth(tok, depth):
    text = filler(tok, 1000, seed=3)
    fact = "The secret code of the blue door is 4817."
    planted = plant(text, fact, depth)
    assert planted.count(fact) == 1
    assert planted.replace(" " + fact, "", 1) == text or planted.replace(fact + " ", "", 1) == text
    where = planted.index(fact) / len(text)
    assert abs(where - depth) < 0.1


def test_needle_question_and_judging():
    n = make_needle(random.Random(5))
    assert re.fullmatch(r"\d{4}", n.code) and n.color in n.fact and n.code in n.fact
    assert n.code not in n.question and n.color in n.question
    assert n.found_in(f"The code is {n.code}.") and not n.found_in("I do not know.")
    # A whole number only: the code inside a longer one is not a retrieval.
    assert not n.found_in(f"The code is 9{n.code}.") and not n.found_in(f"{n.code}7")
    msg = user_message("amber-onyx-lark", "hay " + n.fact + " stack", n)
    assert msg.startswith("Document amber-onyx-lark.") and msg.endswith(n.question)
    assert Needle("blue", "4817").fact == "The secret code of the blue door is 4817."


def test_plan_contexts():
    # Default ladder: 1k, 4k, 16k, ... below the limit, then the limit.
    assert plan_contexts(None, 8192, 200, None) == ([1024, 4096, 7992], [])
    assert plan_contexts(None, 131072, 72, None) == ([1024, 4096, 16384, 65536, 131000], [])
    assert plan_contexts(None, 600, 100, None) == ([500], [])
    # A server that does not say: --max-context caps, else a fixed ladder.
    assert plan_contexts(None, None, 100, 5000) == ([1024, 4096, 4900], [])
    assert plan_contexts(None, None, 100, None) == ([1024, 4096, 16384, 65536], [])
    assert plan_contexts((512, 1024, 4096), 2048, 100, None) == ([512, 1024], [4096])


def test_bad_lists_are_one_line_errors(capsys):
    for argv in (["--contexts", "1k"], ["--contexts", "0"], ["--depths", "1.5"], ["--depths", "x"]):
        with pytest.raises(SystemExit) as e:
            main(["bench", "ladder", *argv])
        assert e.value.code == 2
        assert "Traceback" not in capsys.readouterr().err


# ---- whole runs -------------------------------------------------------------------------


def _check_result(data: dict, contexts: list[int], depths: list[float]) -> None:
    for key in ("command", "date", "model", "trellm_version", "base_url", "served_model", "tokenizer"):
        assert data[key], key
    assert data["command"].startswith("trellm bench ladder")
    assert data["machine"]["platform"] and data["machine"]["cpu_count"] >= 1
    assert data["spec"]["contexts"] == contexts and data["spec"]["depths"] == depths
    cells = data["cells"]
    assert [(c["context"], c["depth"]) for c in cells] == [(c, d) for c in contexts for d in depths]
    for c in cells:
        assert c["cold_ttft_ms"] > 0 and c["hit_ttft_ms"] > 0, c
        assert c["decode_tok_s"] > 0 and c["decode_tokens"] >= 2, c
        assert abs(c["filler_tokens"] - c["filler_target"]) <= 3, c
        # The server's own count of the first prompt lands on the context asked for.
        assert abs(c["prompt_tokens"] - c["context"]) <= 4, c
        # The second turn repeats the first, so its prompt holds all of it and more.
        assert c["hit_prompt_tokens"] > c["prompt_tokens"], c
        assert c["needle_found"], c
    assert data["needle_hits"] == data["needle_cells"] == len(cells)
    assert set(data["by_context"]) == {str(c) for c in contexts}


def run_cli(monkeypatch, *argv: str) -> int:
    # The result records the command line as typed, from sys.argv.
    monkeypatch.setattr(sys, "argv", ["trellm", *argv])
    return main(list(argv))


def test_ladder_in_process(tmp_path, capsys, monkeypatch):
    out = tmp_path / "ladder.json"
    code = run_cli(monkeypatch, "bench", "ladder", "--contexts", "256,512", "--depths", "0.1,0.9",
                   "--answer-tokens", "20", "--gen-tokens", "8", "--max-model-len", "1024",
                   "--kv-cache-memory", str(64 << 20), "--out", str(out))
    stdout = capsys.readouterr().out
    assert code == 0
    data = json.loads(out.read_text())
    _check_result(data, [256, 512], [0.1, 0.9])
    assert data["engine_version"] == data["trellm_version"]
    assert data["server_max_model_len"] == 1024
    assert "| context | depth |" in stdout and "needle found in 4 of 4 cells" in stdout
    assert out.with_suffix(".png").read_bytes()[:8] == PNG_MAGIC


def test_ladder_against_base_url(tmp_path, capsys, monkeypatch, default_gguf):
    """Any OpenAI-compatible server: here trellm's app, reached only over HTTP, with the
    model name taken from /v1/models and a local tokenizer given by path."""
    out = tmp_path / "remote.json"
    with in_process_server(default_gguf, {"max_model_len": 1024, "kv_cache_memory": 64 << 20}) as target:
        code = run_cli(monkeypatch, "bench", "ladder", "--base-url", target.base_url + "/v1",
                       "--api-key", "sk-secret", "--tokenizer", default_gguf, "--contexts", "300,4000",
                       "--depths", "0.5", "--answer-tokens", "20", "--gen-tokens", "8", "--out", str(out),
                       "--png", str(tmp_path / "p.png"))
    assert code == 0
    data = json.loads(out.read_text())
    assert data["served_model"] == target.model and data["tokenizer"] == default_gguf
    assert "sk-secret" not in out.read_text() and "--api-key '***'" in data["command"]
    assert data["skipped_contexts"] == [4000]  # over the server's 1024
    _check_result(data, [300], [0.5])
    assert (tmp_path / "p.png").read_bytes()[:8] == PNG_MAGIC
    assert "skipped" in capsys.readouterr().out


def test_unreachable_server_is_a_one_line_error(capsys, default_gguf):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = main(["bench", "ladder", "--base-url", f"http://127.0.0.1:{port}", "--model", "m",
                 "--tokenizer", default_gguf, "--contexts", "256"])
    err = capsys.readouterr().err
    assert code == 1
    lines = [ln for ln in err.splitlines() if ln.startswith("trellm: error:")]
    assert len(lines) == 1 and f"127.0.0.1:{port}" in lines[0] and "Traceback" not in err


def test_stream_chunk_reports_a_finish_without_text():
    # An EOS-ended turn's last chunk has no text but a finish_reason: the ladder's decode
    # window must run to it, since the server's usage counts that token.
    from trellm.bench.ladder import _chunk
    assert _chunk('{"choices": [{"delta": {}, "finish_reason": "stop"}]}') == ("", None, True)
    assert _chunk('{"choices": [{"delta": {"content": "a"}, "finish_reason": null}]}') == ("a", None, False)
