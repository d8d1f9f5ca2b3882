"""The benchmark plots render to a PNG from the shapes the benches write."""
from trellm.bench.plots import plot_decode_vs_context


def test_decode_vs_context_png(tmp_path):
    ladder = {"1024": {"decode_tok_s": 189.0}, "8192": {"decode_tok_s": 173.5}, "131072": {"decode_tok_s": 98.5}}
    out = tmp_path / "ctx.png"
    plot_decode_vs_context(ladder, "test", out, roofline={"1024": 280.0, "131072": 220.0})
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
