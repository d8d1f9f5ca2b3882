"""`trellm bench latency` at a tiny scale on the embedded default model: the JSON's
fields, positive figures, a grid consistent with itself, and the plot."""
from __future__ import annotations

import json

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
