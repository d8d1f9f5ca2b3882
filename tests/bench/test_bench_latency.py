"""`trellm bench latency` at a tiny scale on the embedded default model: the JSON's
fields, positive figures, a grid consistent with itself, and the plot."""
from __future__ import annotations

import json

import pytest

from trellm.entrypoints.cli import main


def test_latency_with_grid_writes_consistent_json(tmp_path, default_gguf):
    out = tmp_path / "lat.json"
    rc = main(["bench", "latency", default_gguf, "--prompt-len", "16", "--gen-len", "6", "--prefill-len", "32",
               "--concurrency", "2", "--repeats", "1", "--max-model-len", "256",
               "--grid-prompt-lens", "8,24", "--grid-batch-sizes", "1,3", "--no-progress", "--out", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["command"].startswith("trellm bench latency") and data["trellm_version"]
    assert data["machine"]["threads"] >= 1 and data["model"] == default_gguf
    (row,) = data["results"]
    for key in ("ttft_ms", "decode_tok_s", "prefill_tok_s", "aggregate_tok_s", "aggregate_decode_tok_s"):
        assert row[key] > 0, key
    grid = data["grid"]
    assert [(c["prompt_len"], c["batch"]) for c in grid] == [(8, 1), (8, 3), (24, 1), (24, 3)]
    for c in grid:
        assert c["gen_len"] == 6 and c["wall_s"] > 0
        assert 0 < c["ttft_ms_mean"] <= c["ttft_ms_max"] <= c["wall_s"] * 1e3
        assert c["prefill_tok_s"] > 0 and c["decode_tok_s_per_stream"] > 0
        # Streams decoding together cannot beat each of them running flat out alone
        # by more than the batch size: aggregate <= batch x the fastest stream (with slack
        # for timer granularity), and a lone stream's aggregate is its own speed.
        assert 0 < c["aggregate_decode_tok_s"] <= 1.5 * c["batch"] * c["decode_tok_s_per_stream"]
    png = out.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_grid_flag_rejects_bad_lists(capsys, default_gguf):
    import pytest

    with pytest.raises(SystemExit):
        main(["bench", "latency", default_gguf, "--grid-prompt-lens", "8,x"])
    assert "comma-separated integers" in capsys.readouterr().err


class _FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class _FakeEngine:
    """Token-budget engine on a fake clock: each step costs 10 ms and processes at most
    ``budget`` tokens, prefill chunks first-come, so with long prompts early requests
    decode while later ones are still in prefill."""

    vocab_size = 1000

    def __init__(self, clock: _FakeClock, budget: int):
        self.clock, self.budget, self.reqs = clock, budget, []

    def add_request(self, rid, prompt, params, prompt_token_ids):
        self.reqs.append({"id": rid, "left": len(prompt_token_ids), "out": [], "max": params.max_tokens})

    def has_unfinished_requests(self):
        return any(len(r["out"]) < r["max"] for r in self.reqs)

    def step(self):
        from types import SimpleNamespace
        self.clock.t += 0.010
        budget, outs = self.budget, []
        for r in self.reqs:
            if len(r["out"]) >= r["max"] or budget <= 0:
                continue
            if r["left"]:
                take = min(r["left"], budget)
                r["left"] -= take
                budget -= take
                if r["left"]:
                    continue
            else:
                budget -= 1
            r["out"].append(7)
            outs.append(SimpleNamespace(request_id=r["id"], finished=len(r["out"]) >= r["max"],
                                        outputs=[SimpleNamespace(token_ids=list(r["out"]))]))
        self.reqs = [r for r in self.reqs if len(r["out"]) < r["max"]]
        return outs


def test_aggregate_decode_counts_only_tokens_inside_its_window(monkeypatch):
    # 8 prompts of 1024 tokens on a 2048-token budget: 4 prefill steps, and the first
    # requests decode while the last are still in prefill. The window runs from the last
    # first token to the end; only the tokens made in it may be counted.
    from types import SimpleNamespace

    from trellm.bench import latency, latency_grid
    clock = _FakeClock()
    monkeypatch.setattr(latency.time, "perf_counter", clock)
    eng = _FakeEngine(clock, budget=2048)
    run = latency._run_requests(SimpleNamespace(engine=eng), [[1] * 1024] * 8, 4)
    last_first = max(run.first)
    # Worked by hand: the last first token comes with step 5 (t = 50 ms), when 23 of
    # the 32 tokens exist; 9 more follow in 30 ms. Counting every token after each
    # request's first (24) over that window gave 800 tok/s.
    assert run.tokens == 32 and run.tokens_at_last_first == 23
    assert last_first == pytest.approx(0.05) and run.wall == pytest.approx(0.08)
    rate = (run.tokens - run.tokens_at_last_first) / (run.wall - last_first)
    assert rate == pytest.approx(300.0)
    eng = _FakeEngine(clock, budget=2048)
    cell = latency_grid._run_cell(SimpleNamespace(engine=eng), 1024, 8, 4, seed=0)
    assert cell.aggregate_decode_tok_s == pytest.approx(rate)


def test_best_of_takes_each_figure_on_its_own():
    from trellm.bench.latency import Figures, best_of
    a = Figures("x", ttft_ms=10, decode_tok_s=100, prefill_tok_s=5000, aggregate_tok_s=1, aggregate_decode_tok_s=2)
    b = Figures("x", ttft_ms=200, decode_tok_s=101, prefill_tok_s=2560, aggregate_tok_s=3, aggregate_decode_tok_s=1)
    assert best_of([a, b]) == Figures("x", 10, 101, 5000, 3, 2)


def _result_file(path, prompt_len: int, concurrency: int) -> str:
    spec = {"prompt_len": prompt_len, "gen_len": 8, "prefill_len": 64, "concurrency": concurrency, "repeats": 1}
    row = {"engine": "trellm", "ttft_ms": 10.0, "decode_tok_s": 50.0, "prefill_tok_s": 900.0,
           "aggregate_tok_s": 80.0, "aggregate_decode_tok_s": 90.0}
    path.write_text(json.dumps({"command": "trellm bench latency", "dtype": "float32", "label": str(path.name),
                                "spec": spec, "results": [row]}))
    return str(path)


def test_summarize_labels_come_from_the_runs_spec(tmp_path, capsys):
    a = _result_file(tmp_path / "a.json", prompt_len=32, concurrency=4)
    md = tmp_path / "s.md"
    assert main(["bench", "summarize", a, "--markdown", str(md), "--png", str(tmp_path / "s.png")]) == 0
    head = md.read_text().splitlines()[0]
    assert "(32-token prompt)" in head and "(64)" in head and "4 concurrent" in head
    b = _result_file(tmp_path / "b.json", prompt_len=128, concurrency=8)
    assert main(["bench", "summarize", a, b, "--markdown", str(md), "--png", str(tmp_path / "s.png")]) != 0
    assert "one bench spec at a time" in capsys.readouterr().err
