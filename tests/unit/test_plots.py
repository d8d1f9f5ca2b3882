"""The benchmark plots render to a PNG from the shapes the benches write."""
from trellm.bench.plots import plot_decode_vs_context


def test_decode_vs_context_png(tmp_path):
    ladder = {"1024": {"decode_tok_s": 189.0}, "8192": {"decode_tok_s": 173.5}, "131072": {"decode_tok_s": 98.5}}
    out = tmp_path / "ctx.png"
    plot_decode_vs_context(ladder, "test", out, roofline={"1024": 280.0, "131072": 220.0})
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_serve_compare_png(tmp_path):
    from trellm.bench.serve_plots import plot_serve_compare

    def level(c, agg):
        return {"concurrency": c, "aggregate_output_tok_s": agg, "stream_decode_tok_s": {"mean": agg / c},
                "ttft_ms": {"p50": 100.0 * c}}

    out = tmp_path / "cmp.png"
    plot_serve_compare({"a": [level(1, 20.0), level(2, 35.0)], "b": [level(1, 60.0), level(2, 50.0)]},
                       "t", out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
