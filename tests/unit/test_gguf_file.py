"""The lean GGUF parser agrees with the gguf package's reader field for field and
byte for byte, and rejects damaged files with a clear message."""
from __future__ import annotations

import numpy as np
import pytest

from trellm.loader.gguf_file import GGUFFormatError, read_gguf


def test_matches_gguf_reader(default_gguf):
    import gguf

    ours = read_gguf(default_gguf)
    ref = gguf.GGUFReader(default_gguf)
    for key, field in ref.fields.items():
        if key.startswith("GGUF."):
            continue
        expected = field.contents()
        got = ours.fields[key]
        if isinstance(expected, float):
            assert got == pytest.approx(expected, rel=1e-7), key
        else:
            assert got == expected, key
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ref.tensors, ours.tensors):
        assert tuple(a.shape) == tuple(b.shape) and a.tensor_type == b.tensor_type, a.name
        assert np.array_equal(np.asarray(a.data), b.data), a.name


def test_rejects_damaged_files(tmp_path, default_gguf):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + b"\0" * 64)
    with pytest.raises(GGUFFormatError, match="magic"):
        read_gguf(bad)
    truncated = tmp_path / "truncated.gguf"
    with open(default_gguf, "rb") as f:
        truncated.write_bytes(f.read(5_000_000))
    with pytest.raises(GGUFFormatError, match="past the end"):
        read_gguf(truncated)
    header_only = tmp_path / "header.gguf"
    with open(default_gguf, "rb") as f:
        header_only.write_bytes(f.read(1000))
    with pytest.raises(GGUFFormatError):
        read_gguf(header_only)


def test_bf16_and_f16_tensors_load(tmp_path):
    """Plain-float GGUF types come out equal to what was written (BF16 goes through
    gguf's own converter, which needs the raw bytes view)."""
    import gguf
    import torch

    from trellm.loader.gguf_loader import _dequantize  # noqa: F401  (the loader's path)

    path = tmp_path / "t.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    a = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    bf = torch.from_numpy(a).bfloat16()
    w.add_tensor("bf", bf.view(torch.int16).numpy().view(np.uint16), raw_shape=(4, 64),
                 raw_dtype=gguf.GGMLQuantizationType.BF16)
    w.add_tensor("f16", a.astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    f = read_gguf(path)
    t = {x.name: x for x in f.tensors}
    got = gguf.quants.dequantize(t["bf"].data, t["bf"].tensor_type)
    assert np.array_equal(got, bf.float().numpy())
    assert np.array_equal(gguf.quants.dequantize(t["f16"].data, t["f16"].tensor_type), a.astype(np.float16).astype(np.float32))
