"""`trellm bench serve`: statistics, SSE parsing, metrics, and whole runs against a
live trellm server (default model) and a stricter fake OpenAI-compatible server."""
from __future__ import annotations

import asyncio
import json
import socket

import numpy as np
import pytest
from fake_openai import FAKE_MODEL, FAKE_WORDS
from server_helpers import API_KEY, MODEL_NAME

import trellm
from trellm.bench.client import MalformedStream, RequestResult, sse_data
from trellm.bench.report import run_header
from trellm.bench.serve_metrics import Slo, goodput, level_dict, measure
from trellm.bench.stats import percentile, summarize
from trellm.bench.tasks import CATEGORIES, TASKS
from trellm.entrypoints.cli import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["bench", "serve", *argv])
    out, err = capsys.readouterr()
    return code, out, err


# ---- pure parts -------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 7, 100])
def test_percentiles_match_numpy(n):
    values = np.random.default_rng(n).exponential(50.0, size=n).tolist()
    for q in (0, 1, 50, 90, 99, 99.9, 100):
        assert percentile(values, q) == pytest.approx(np.percentile(values, q), rel=1e-12, abs=1e-12)
    s = summarize(values)
    assert s.count == n and s.min == min(values) and s.max == max(values)
    assert s.mean == pytest.approx(np.mean(values), rel=1e-12)
    assert (s.p50, s.p90, s.p99) == pytest.approx(tuple(np.percentile(values, [50, 90, 99])), rel=1e-12)


def test_percentile_edges():
    assert summarize([]) is None
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


async def _events(lines: list[str]) -> list[str]:
    async def gen():
        for ln in lines:
            yield ln

    return [e async for e in sse_data(gen())]


def test_sse_data_events():
    lines = [": keep-alive", "", "data: {\"a\": 1}", "", "event: message", "data: x", "data: y", "",
             "data:[DONE]"]
    assert asyncio.run(_events(lines)) == ['{"a": 1}', "x\ny", "[DONE]"]
    with pytest.raises(MalformedStream):
        asyncio.run(_events(["data: ok", "", "<html>not an event stream</html>"]))


def test_request_metrics_and_goodput():
    ok = RequestResult(ok=True, e2e_s=0.25, chunk_times_s=(0.1, 0.15, 0.25), text="a b c", completion_tokens=3)
    m = measure(ok, count_tokens=lambda text: pytest.fail("usage was reported"))
    assert m.ttft_ms == pytest.approx(100) and m.e2e_ms == pytest.approx(250)
    assert m.tpot_ms == pytest.approx(75) and m.decode_tok_s == pytest.approx(1000 / 75)
    assert m.itl_ms == pytest.approx((50, 100))
    no_usage = measure(RequestResult(ok=True, e2e_s=0.1, chunk_times_s=(0.1,), text="hello"), lambda t: 1)
    assert no_usage.output_tokens == 1 and not no_usage.tokens_from_usage and no_usage.tpot_ms is None
    assert goodput([m], 1, 2.0, Slo()) is None
    assert goodput([m], 2, 2.0, Slo(ttft_ms=120, tpot_ms=80))["fraction"] == 0.5
    assert goodput([m], 1, 2.0, Slo(tpot_ms=70))["good_requests"] == 0
    failed = RequestResult(ok=False, e2e_s=0.01, status=500, error_kind="http_500", error="HTTP 500: boom")
    level = level_dict(4, [ok, failed], 2.0, lambda t: 0, Slo(ttft_ms=1000))
    assert level["completed"] == 1 and level["errors"]["by_kind"] == {"http_500": 1}
    assert level["goodput"]["fraction"] == 0.5 and level["aggregate_output_tok_s"] == pytest.approx(1.5)


def test_command_line_hides_the_api_key():
    cmd = run_header("serve", "m", ["bench", "serve", "--api-key", "s3cret", "--api-key=s3cret", "--model", "m"])["command"]
    assert "s3cret" not in cmd and cmd.startswith("trellm bench serve") and "--model m" in cmd


def test_task_prompts_cover_five_categories():
    assert CATEGORIES == ("coding", "prose", "reasoning", "summary", "format")
    for cat in CATEGORIES:
        assert sum(t.category == cat for t in TASKS) >= 3
    assert len({t.message for t in TASKS}) == len(TASKS)


# ---- whole runs -------------------------------------------------------------------------


def test_unreachable_server_is_one_line_error(capsys):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    code, out, err = run_cli(capsys, "--base-url", f"http://127.0.0.1:{port}")
    assert code == 1 and out == ""
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("trellm: error: cannot reach"), err
    assert "connection refused" in lines[0]


def test_sweep_against_live_trellm(capsys, tmp_path, bench_server):
    out = tmp_path / "serve.json"
    code, stdout, err = run_cli(
        capsys, "--base-url", f"{bench_server.url}/v1", "--api-key", API_KEY, "--model", MODEL_NAME,
        "--concurrency", "1,2", "--num-prompts", "3", "--input-len", "16", "--output-len", "8",
        "--slo-ttft-ms", "1e9", "--slo-tpot-ms", "1e9", "--out", str(out))
    assert code == 0, err
    text = out.read_text()
    assert API_KEY not in text
    data = json.loads(text)
    assert {"command", "date", "machine", "trellm_version", "server", "model", "config", "levels"} <= set(data)
    assert data["machine"]["cpu_count"] >= 1 and data["machine"]["platform"]
    assert data["trellm_version"] == trellm.__version__
    assert data["server"] == {"base_url": bench_server.url, "models": [MODEL_NAME]}
    assert data["model"] == MODEL_NAME and data["fixed_length"] == {"requested": True, "rejected_error": None}
    assert [lv["concurrency"] for lv in data["levels"]] == [1, 2]
    for lv in data["levels"]:
        check_level(lv, requests=3, output_len=8, input_len=16)
    c1 = data["levels"][0]
    # One request at a time: the level lasts at least as long as its requests did, added up.
    assert c1["wall_s"] >= c1["e2e_ms"]["mean"] * c1["completed"] / 1000 * (1 - 1e-9)
    assert "| 1 | 3 | 0 |" in stdout and "| 2 | 3 | 0 |" in stdout
    assert out.with_suffix(".png").read_bytes()[:8] == PNG_MAGIC


def check_level(lv: dict, requests: int, output_len: int, input_len: int) -> None:
    assert lv["num_requests"] == requests and lv["completed"] == requests and lv["errors"]["count"] == 0
    assert lv["fixed_length"] and not lv["retried_without_fixed_length"]
    assert lv["output_tokens_source"] == "usage"
    # ignore_eos + min_tokens pin every answer to exactly output_len tokens.
    assert lv["output_tokens"]["min"] == lv["output_tokens"]["max"] == output_len
    assert lv["total_output_tokens"] == requests * output_len
    assert lv["prompt_tokens"]["min"] == lv["prompt_tokens"]["max"] == input_len
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "stream_decode_tok_s"):
        assert lv[key]["min"] > 0, key
    assert lv["ttft_ms"]["max"] < lv["e2e_ms"]["max"] <= lv["wall_s"] * 1000
    assert lv["aggregate_output_tok_s"] * lv["wall_s"] == pytest.approx(lv["total_output_tokens"])
    assert lv["request_throughput_rps"] * lv["wall_s"] == pytest.approx(requests)
    # Per request, decode tok/s is 1000 / TPOT, so the fastest stream has the smallest TPOT.
    assert lv["stream_decode_tok_s"]["max"] == pytest.approx(1000 / lv["tpot_ms"]["min"])
    # One gap between consecutive text chunks; a chunk carries at least one token.
    assert lv["itl_ms"]["count"] == lv["total_text_chunks"] - requests
    assert requests <= lv["total_text_chunks"] <= lv["total_output_tokens"]
    assert lv["goodput"]["fraction"] == 1.0
    assert lv["goodput"]["rate_rps"] == pytest.approx(lv["request_throughput_rps"])


def test_task_table_has_five_categories(capsys, tmp_path, bench_server):
    out = tmp_path / "tasks.json"
    code, stdout, err = run_cli(capsys, "--base-url", bench_server.url, "--api-key", API_KEY, "--tasks-only",
                                "--output-len", "2", "--out", str(out))
    assert code == 0, err
    data = json.loads(out.read_text())
    assert data["levels"] == []
    assert [c["category"] for c in data["tasks"]] == list(CATEGORIES)
    for c in data["tasks"]:
        assert c["prompts"] == c["completed"] == 3 and c["errors"]["count"] == 0
        assert 1 <= c["output_tokens"]["min"] <= c["output_tokens"]["max"] <= 2
        assert c["ttft_ms"]["min"] > 0
        assert f"| {c['category']} | 3 | 0 |" in stdout
    assert not out.with_suffix(".png").exists()  # plots are of a sweep; there was none


def test_rejected_fixed_length_fields_are_retried_without(capsys, tmp_path, fake_server):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("alpha\nBROKEN\n\nbeta\nFAIL\n")
    out = tmp_path / "fake.json"
    code, stdout, err = run_cli(capsys, "--base-url", fake_server.url, "--prompt-file", str(prompts),
                                "--concurrency", "1,2", "--num-prompts", "4", "--warmup", "0",
                                "--output-len", "4", "--out", str(out))
    assert code == 0, err
    bodies = fake_server.bodies
    assert len(bodies) == 12  # 4 refused, the same 4 again without the fields, then 4 more
    assert all(b["ignore_eos"] is True and b["min_tokens"] == 4 for b in bodies[:4])
    assert not any("ignore_eos" in b or "min_tokens" in b for b in bodies[4:])
    assert all(b["model"] == FAKE_MODEL and b["stream_options"] == {"include_usage": True} for b in bodies)
    data = json.loads(out.read_text())
    assert "ignore_eos" in data["fixed_length"]["rejected_error"]
    first, second = data["levels"]
    assert first["retried_without_fixed_length"] and not first["fixed_length"]
    assert not second["retried_without_fixed_length"] and not second["fixed_length"]
    from trellm.bench.serve import TokenCounter

    expected = TokenCounter(None)("".join(FAKE_WORDS[:4]))
    for lv in (first, second):
        # The broken stream and the 500 are counted, not fatal; the rest were measured.
        assert lv["num_requests"] == 4 and lv["completed"] == 2
        assert lv["errors"]["count"] == 2 and lv["errors"]["by_kind"] == {"malformed_sse": 1, "http_500": 1}
        assert any("boom" in s for s in lv["errors"]["samples"])
        # The fake reports no usage: the local tokenizer counted the streamed text.
        assert lv["output_tokens_source"] == "tokenizer"
        assert lv["total_output_tokens"] == 2 * expected
    assert "refused ignore_eos/min_tokens" in stdout


def test_no_fixed_length_never_sends_the_fields(capsys, tmp_path, fake_server):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "alpha"}\n"beta"\n')
    out = tmp_path / "plain.json"
    code, _, err = run_cli(capsys, "--base-url", fake_server.url, "--prompt-file", str(prompts),
                           "--concurrency", "2", "--num-prompts", "2", "--no-fixed-length",
                           "--output-len", "2", "--out", str(out))
    assert code == 0, err
    sent = [b["prompt"] for b in fake_server.bodies]
    assert sent[0] == "alpha" and sorted(sent[1:]) == ["alpha", "beta"]  # the warmup, then the level
    assert not any("ignore_eos" in b or "min_tokens" in b for b in fake_server.bodies)
    data = json.loads(out.read_text())
    assert data["fixed_length"] == {"requested": False, "rejected_error": None}
    level = data["levels"][0]
    assert level["completed"] == 2 and not level["fixed_length"] and not level["retried_without_fixed_length"]
