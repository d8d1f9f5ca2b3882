"""The EXL3 reference decoder against the format spec (quant-spec §1): the worked
example, the codebook formulas on every state, the bitstream conventions for every
K, the Hadamard transform, and reconstruct against the forward."""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from trellm.quant.exl3.codebook import decode_states, halves_bits, mul1_byte_sum
from trellm.quant.exl3.hadamard import had_l_128, had_r_128, hadamard_128
from trellm.quant.exl3.loading import random_exl3_tensors
from trellm.quant.exl3.reference import (TILE_POSITIONS, decode_inner, dense_weight, forward_reference,
                                         reconstruct, trellis_states)
from trellm.quant.exl3.weight import EXL3Weight, unpack_signs

HALF_BITS = (1.5, 2.5, 3.5, 4.5, 5.5, 6.5, 7.5)


# ---- independent spellings of the spec (python ints / numpy), used as oracles -----------------


def _to_int16(values: list[int]) -> torch.Tensor:
    return torch.tensor([v - 0x10000 if v >= 0x8000 else v for v in values], dtype=torch.int16)


def _stream_bits(words16: list[int]) -> list[int]:
    """The spec's practical rule: int16 pairs as little-endian uint32 words, bits MSB first."""
    w32 = [words16[2 * i] | (words16[2 * i + 1] << 16) for i in range(len(words16) // 2)]
    return [(w32[b // 32] >> (31 - b % 32)) & 1 for b in range(32 * len(w32))]


def _bits_per_weight(k: float) -> list[int]:
    """D(t): K new bits for every weight; half-integer K alternates K - .5 (even t) and K + .5."""
    if float(k).is_integer():
        return [int(k)] * 256
    return [int(k) + ((0xAAAA >> (t % 16)) & 1) for t in range(256)]


def _pack(symbols: list[int], k: float) -> list[int]:
    """Symbols concatenated MSB first, cut into 32-bit words stored as swapped uint16 halves."""
    stream = []
    for c, d in zip(symbols, _bits_per_weight(k)):
        stream.extend((c >> (d - 1 - i)) & 1 for i in range(d))
    out = []
    for i in range(0, len(stream), 32):
        word = int("".join(map(str, stream[i:i + 32])), 2)
        out.extend([word & 0xFFFF, word >> 16])
    return out


def _states_by_recurrence(symbols: list[int], k: float) -> list[int]:
    """s_t = ((s_{t-1} << D(t)) | c_t) & 0xFFFF, starting (tail-biting) from the last state,
    which is the ring's last 16 bits."""
    ring = [b for c, d in zip(symbols, _bits_per_weight(k)) for b in ((c >> (d - 1 - i)) & 1 for i in range(d))]
    s = int("".join(map(str, ring[-16:])), 2)
    out = []
    for c, d in zip(symbols, _bits_per_weight(k)):
        s = ((s << d) | c) & 0xFFFF
        out.append(s)
    assert out[-1] == int("".join(map(str, ring[-16:])), 2)  # the walk closes
    return out


def _np_codebook(codebook: str) -> np.ndarray:
    """fp16 values of all 2^16 states, straight from the spec's formulas in numpy."""
    s = np.arange(1 << 16, dtype=np.uint64)
    if codebook == "mul1":
        x = (s * np.uint64(0x83DCD12D)) & np.uint64(0xFFFFFFFF)
        b = sum((x >> np.uint64(8 * i)) & np.uint64(0xFF) for i in range(4)).astype(np.uint16)
        h = (np.uint16(0x6400) + b).view(np.float16)  # "fp16 with bits 0x6400 + B"
        k_inv = np.array([0x1EEE], np.uint16).view(np.float16)[0]
        k_bias = np.array([0xC931], np.uint16).view(np.float16)[0]
        return (h.astype(np.float32) * np.float32(k_inv) + np.float32(k_bias)).astype(np.float16)
    mul, add = {"3inst": (89226354, 64248484), "mcg": (0xCBAC1FED, 0)}[codebook]
    x = (s * np.uint64(mul) + np.uint64(add)) & np.uint64(0xFFFFFFFF)
    x = (x & np.uint64(0x8FFF8FFF)) ^ np.uint64(0x3B603B60)
    lo = (x & np.uint64(0xFFFF)).astype(np.uint16).view(np.float16)
    hi = (x >> np.uint64(16)).astype(np.uint16).view(np.float16)
    return (lo.astype(np.float32) + hi.astype(np.float32)).astype(np.float16)


# ---- the worked example (spec §1.7) -------------------------------------------------------------

EXAMPLE_WORDS = {0: 0xA955, 1: 0x3FFA, 2: 0xFAA9, 3: 0x003F, 30: 0xEAA5, 31: 0x00FF}
EXAMPLE_VALUES = {
    "3inst": [1.609375, 1.041016, 1.119141, 1.721680],
    "mcg": [-0.608398, 1.197266, 0.401367, -0.165039],
    "mul1": [0.458252, 0.309570, -0.272461, -0.875000],
}


def _example_tile() -> list[int]:
    return [EXAMPLE_WORDS.get(i, 0) for i in range(32)]  # K = 2; the other words do not matter


def test_worked_example_states_and_symbols():
    words = _example_tile()
    bits = _stream_bits(words)
    symbols = [bits[2 * t] * 2 + bits[2 * t + 1] for t in range(256)]
    assert symbols[:8] == [0, 3, 3, 3, 3, 3, 2, 2]
    assert symbols[248:] == [3, 2, 2, 2, 2, 2, 1, 1]
    states = trellis_states(_to_int16(words)[None])[0]
    assert [int(s) for s in states[:4]] == [0xAA94, 0xAA53, 0xA94F, 0xA53F]
    assert [int(s) for s in states] == _states_by_recurrence(symbols, 2)


def test_worked_example_codebook_values():
    s0 = torch.tensor([0xAA94])
    assert int(halves_bits(s0, "3inst")) == 0x38F43BEC
    assert int(halves_bits(s0, "mcg")) == 0x37D5BC64
    assert int(mul1_byte_sum(s0)) == 578
    states = torch.tensor([0xAA94, 0xAA53, 0xA94F, 0xA53F])
    for codebook, want in EXAMPLE_VALUES.items():
        got = decode_states(states, codebook).float()
        # The spec prints 6 decimals of fp16 values; fp16 steps here are >= 1.2e-4.
        assert torch.allclose(got, torch.tensor(want), atol=6e-7, rtol=0), codebook


@pytest.mark.parametrize("codebook", ["3inst", "mcg", "mul1"])
def test_worked_example_placement(codebook):
    # The example tile as tile (1, 2) of a 128x128 layer: t=0..3 at rows 0,1,8,9 of column 0,
    # t=4..7 at the same rows of column 8, t=8 at row 2 of column 0 (offsets inside the tile).
    trellis = torch.zeros(8, 8, 32, dtype=torch.int16)
    trellis[1, 2] = _to_int16(_example_tile())
    ones = torch.ones(128, dtype=torch.float16)
    inner = decode_inner(EXL3Weight(trellis, ones, ones, codebook, 128, 128))
    bits = _stream_bits(_example_tile())
    states = _states_by_recurrence([bits[2 * t] * 2 + bits[2 * t + 1] for t in range(256)], 2)
    values = _np_codebook(codebook).astype(np.float32)[states]
    where = [(0, 0), (1, 0), (8, 0), (9, 0), (0, 8), (1, 8), (8, 8), (9, 8), (2, 0)]
    for t, (r, c) in enumerate(where):
        assert float(inner[16 + r, 32 + c]) == values[t], t
    assert np.allclose(values[:4], EXAMPLE_VALUES[codebook], atol=6e-7, rtol=0)
    # Every one of the 256 weights lands where TILE_POSITIONS says, and the tile is a permutation.
    assert sorted(r * 16 + c for r, c in TILE_POSITIONS) == list(range(256))
    tile = inner[16:32, 32:48]
    assert all(float(tile[r, c]) == values[t] for t, (r, c) in enumerate(TILE_POSITIONS))


# ---- codebooks on all 65,536 states ---------------------------------------------------------------


@pytest.mark.parametrize("codebook,rms", [("3inst", 1.243711), ("mcg", 1.2441), ("mul1", 1.0003)])
def test_codebook_matches_spec_formula_on_every_state(codebook, rms):
    got = decode_states(torch.arange(1 << 16), codebook)
    want = _np_codebook(codebook)
    assert got.dtype == torch.float16
    assert np.array_equal(got.numpy().view(np.uint16), want.view(np.uint16))
    assert float(got.float().pow(2).mean().sqrt()) == pytest.approx(rms, abs=1e-4)
    if codebook == "mul1":  # the spec's count of distinct MUL1 values
        assert len(np.unique(want)) == 913


# ---- bitstream, for every K -----------------------------------------------------------------------


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 6, 7, 8, *HALF_BITS])
def test_bitstream_round_trip(bits):
    rng = np.random.default_rng(int(bits * 10))
    tiles, expected = [], []
    for _ in range(6):
        symbols = [int(rng.integers(0, 1 << d)) for d in _bits_per_weight(bits)]
        words = _pack(symbols, bits)
        assert len(words) == 16 * bits  # the loader derives K from the tile width
        tiles.append(words)
        expected.append(_states_by_recurrence(symbols, bits))
    trellis = torch.stack([_to_int16(w) for w in tiles]).reshape(2, 3, -1)
    got = trellis_states(trellis).reshape(6, 256)
    assert got.tolist() == expected


# ---- Hadamard ------------------------------------------------------------------------------------


def test_hadamard_128_is_sylvester_and_orthonormal():
    h = hadamard_128(dtype=torch.float64)
    want = torch.tensor([[(-1) ** bin(i & j).count("1") for j in range(128)] for i in range(128)],
                        dtype=torch.float64) / 128 ** 0.5
    assert torch.equal(h, want)
    assert torch.allclose(h @ h.t(), torch.eye(128, dtype=torch.float64), atol=1e-12)
    x = torch.randn(3, 384, dtype=torch.float64)
    blocks = torch.block_diag(h, h, h)
    assert torch.allclose(had_r_128(x), x @ blocks, atol=1e-12)
    assert torch.allclose(had_l_128(x.t()), blocks @ x.t(), atol=1e-12)
    assert torch.allclose(had_r_128(had_r_128(x)), x, atol=1e-12)  # its own inverse
    with pytest.raises(ValueError, match="divisible by 128"):
        had_r_128(torch.zeros(2, 100))


# ---- reconstruct vs forward, padding, legacy signs -----------------------------------------------------


def _random_weight(in_f: int, out_f: int, bits: float, codebook: str, seed: int = 0,
                   bias: bool = False) -> EXL3Weight:
    g = torch.Generator().manual_seed(seed)
    tensors = {k.rsplit(".", 1)[1]: v for k, v in random_exl3_tensors("w", in_f, out_f, bits, codebook, g)}
    if bias:
        tensors["bias"] = torch.randn(out_f, generator=g).half()
    return EXL3Weight.from_tensors(tensors, in_f, out_f)


@pytest.mark.parametrize("codebook,bits", [("3inst", 4), ("mcg", 2), ("mul1", 3.5)])
def test_reconstruct_is_the_spec_product_and_matches_forward(codebook, bits):
    w = _random_weight(200, 300, bits, codebook, bias=True)  # padded to 256 x 384
    assert (w.padded_in, w.padded_out, w.bits) == (256, 384, bits)
    inner = decode_inner(w).double()
    hb_in = torch.block_diag(*[hadamard_128(dtype=torch.float64)] * 2)
    hb_out = torch.block_diag(*[hadamard_128(dtype=torch.float64)] * 3)
    want = torch.diag(w.suh.double()) @ hb_in @ inner @ hb_out @ torch.diag(w.svh.double())
    assert torch.allclose(reconstruct(w).double(), want, atol=1e-6, rtol=1e-5)
    x = torch.randn(7, 200)
    dense = dense_weight(w)
    assert dense.shape == (300, 200)
    y = forward_reference(w, x)
    assert y.shape == (7, 300) and y.dtype == torch.float32
    torch.testing.assert_close(y, x @ dense.t() + w.bias.float(), atol=1e-5, rtol=1e-4)
    y16 = forward_reference(w, x.half())
    assert y16.dtype == torch.float16


def test_legacy_packed_signs():
    packed = _to_int16([0x0001, 0x8000, 0xFFFF, 0x1234])
    signs = unpack_signs(packed)
    want = [-1.0 if (v >> i) & 1 else 1.0 for v in (0x0001, 0x8000, 0xFFFF, 0x1234) for i in range(16)]
    assert signs.dtype == torch.float16 and signs.tolist() == want
    g = torch.Generator().manual_seed(3)
    su = torch.randint(-32768, 32768, (8,), dtype=torch.int16, generator=g)
    sv = torch.randint(-32768, 32768, (8,), dtype=torch.int16, generator=g)
    trellis = torch.randint(-32768, 32768, (8, 8, 48), dtype=torch.int16, generator=g)
    legacy = EXL3Weight.from_tensors({"trellis": trellis, "su": su, "sv": sv}, 128, 128)
    plain = EXL3Weight.from_tensors({"trellis": trellis, "suh": unpack_signs(su), "svh": unpack_signs(sv)},
                                    128, 128)
    assert legacy.codebook == "3inst" and legacy.bits == 3
    assert torch.equal(dense_weight(legacy), dense_weight(plain))


def test_bad_tensors_are_refused():
    w = _random_weight(128, 256, 2, "mcg")
    good = {"trellis": w.trellis, "suh": w.suh, "svh": w.svh, "mcg": torch.tensor(0, dtype=torch.int32)}
    with pytest.raises(ValueError, match="do not fit"):
        EXL3Weight.from_tensors(good, 128, 512)
    with pytest.raises(ValueError, match="half-integer"):
        EXL3Weight.from_tensors({**good, "trellis": torch.zeros(8, 16, 40, dtype=torch.int16)}, 128, 256)
    with pytest.raises(ValueError, match="both mcg and mul1"):
        EXL3Weight.from_tensors({**good, "mul1": torch.tensor(0, dtype=torch.int32)}, 128, 256)
    with pytest.raises(ValueError, match="missing EXL3 tensor 'svh'"):
        EXL3Weight.from_tensors({k: v for k, v in good.items() if k != "svh"}, 128, 256)
    with pytest.raises(ValueError, match="suh must be fp16"):
        EXL3Weight.from_tensors({**good, "suh": w.suh.float()}, 128, 256)
    with pytest.raises(ValueError, match="1..8"):
        EXL3Weight.from_tensors({**good, "trellis": torch.zeros(8, 16, 144, dtype=torch.int16)}, 128, 256)


def test_reconstruct_speed_576x1536():
    w = _random_weight(576, 1536, 4, "mul1")
    dense_weight(w)  # first call builds the lookup tables
    t0 = time.perf_counter()
    dense = dense_weight(w)
    elapsed = time.perf_counter() - t0
    assert dense.shape == (1536, 576)
    assert elapsed < 1.0, f"reconstructing 576x1536 took {elapsed:.2f}s"
