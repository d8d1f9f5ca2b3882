"""The W8A16 kernels (trellm/kernels/int8_gemv.py) against their pure-PyTorch reference.

Every config family (tensor-core decode tiles, the swapped-operand variant, the
no-tensor-core M == 1 kernel, the prefill tiles) on fresh random inputs at rows
1/3/8/16/33/128, with and without bias, on widths that are not multiples of the
blocks (N = 130) and a K that is not a multiple of 16 (700: unaligned rows, masked
tails), split K through the counter epilogue and through the reduce kernel.

Tolerance: ``int8_error_bound`` -- the float32 accumulation bound plus half an ulp
of the output dtype (see the module docstring), elementwise against the reference
before its final rounding. It holds because no weight is ever rounded: int8 values
are exact in bf16, products exact in float32, the scale applied to the float32 sum.
"""
import dataclasses
import json

import pytest
import torch

from trellm.kernels import int8_gemv as ig
from trellm.quant.int8 import quantize_int8

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _interpreter_int_casts(device):
    if device.type == "cpu":  # TRITON_INTERPRET=1 (conftest.py): int8 -> bf16 as the GPU does it
        ig.patch_interpreter_int_to_bf16()


def _case(rows, n, k, device, seed, bias, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    # Rows of different magnitudes, so the per-row scales matter.
    w = torch.randn(n, k, generator=g) / k ** 0.5 * torch.exp(0.5 * torch.randn(n, 1, generator=g))
    q, scale = quantize_int8(w)
    b = (0.1 * torch.randn(n, generator=g)).to(dtype) if bias else None
    x = torch.randn(rows, k, generator=g).to(dtype)
    return [t.to(device) if t is not None else None for t in (x, q, scale, b)]


def _check(got, x, q, scale, b):
    want = ig.int8_linear_ref_f32(x, q, scale, b)
    bound = ig.int8_error_bound(x, q, scale, b)
    assert got.dtype == x.dtype and got.shape == want.shape
    err = (got.float() - want).abs()
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"error {err.max().item():.3g} is {worst:.2f}x the bound"


def _configs(rows):
    return sorted(set(ig.candidates(rows)) | {ig.default_config(rows).name})


@pytest.mark.parametrize("rows", [1, 3, 8, 16, 33, 128])
def test_every_config_matches_reference(rows, device):
    for i, name in enumerate(_configs(rows)):
        # Odd N and K: partial N blocks, unaligned weight rows, a masked K tail.
        x, q, scale, b = _case(rows, 130, 700, device, seed=rows * 31 + i, bias=i % 2 == 0)
        _check(ig.int8_linear_triton(x, q, scale, b, config=name), x, q, scale, b)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 8, 16, 33, 128])
def test_dispatched_path(rows, bias, device):
    # Even shape: the unmasked (EVEN_K) loop, through int8_linear's default dispatch.
    x, q, scale, b = _case(rows, 96, 512, device, seed=rows, bias=bias)
    _check(ig.int8_linear(x, q, scale, b), x, q, scale, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("name", ["n64k128", "s64k128", "f32k512", "g128k64", "v2"])
def test_activation_dtypes(name, dtype, device):
    rows = 1 if ig.CONFIGS[name].kind == "fma" else 5
    x, q, scale, b = _case(rows, 70, 300, device, seed=7, bias=True, dtype=dtype)
    _check(ig.int8_linear_triton(x, q, scale, b, config=name), x, q, scale, b)


@pytest.mark.parametrize("name", ["n64k128", "f16k512"])
def test_split_k_counters_and_reduce_kernel_agree(name, device):
    # K = 1024 in steps of <= 512 over few N tiles: several splits on any device.
    x, q, scale, b = _case(1, 40, 1024, device, seed=3, bias=True)
    cfg = ig.CONFIGS[name]
    steps = -(-1024 // cfg.block_k)
    assert ig._split_plan(steps, 1, cfg, x.device)[0] > 1
    counters = ig.int8_linear_triton(x, q, scale, b, config=name, sem=True)
    reduced = ig.int8_linear_triton(x, q, scale, b, config=name, sem=False)
    _check(counters, x, q, scale, b)
    # Same partials summed in the same (split) order: bit-identical, and deterministic.
    assert torch.equal(counters, reduced)
    assert torch.equal(counters, ig.int8_linear_triton(x, q, scale, b, config=name))
    assert int(ig.prepare(x.device).abs().sum()) == 0, "a counter was left non-zero"


def test_fma_config_refuses_several_rows(device):
    x, q, scale, _ = _case(2, 16, 64, device, seed=0, bias=False)
    with pytest.raises(ValueError, match="takes one row"):
        ig.int8_linear_triton(x, q, scale, None, config="f16k512")
    x, q, scale, _ = _case(9, 16, 64, device, seed=0, bias=False)
    with pytest.raises(ValueError, match="takes fewer rows"):
        ig.int8_linear_triton(x, q, scale, None, config="v1")
    assert "v1" in ig.candidates(8) and "v1" not in ig.candidates(9)


def test_gemv_int8_rejects_other_weights(device):
    from trellm.kernels.gemv import gemv_int8

    x, q, scale, _ = _case(1, 16, 64, device, seed=0, bias=False)
    with pytest.raises(ValueError, match="gemv_int8"):
        gemv_int8(x, q.float(), scale)
    with pytest.raises(ValueError, match="gemv_int8"):
        gemv_int8(x, q, scale[:8])


def test_leading_dims_paths_and_dequant_baseline(device):
    x, q, scale, b = _case(6, 64, 128, device, seed=2, bias=True)
    x3 = x.reshape(2, 3, 128)
    got = ig.int8_linear(x3, q, scale, b)
    assert got.shape == (2, 3, 64)
    _check(got.reshape(6, 64), x, q, scale, b)
    _check(ig.int8_linear(x3, q, scale, b, path="m32k128").reshape(6, 64), x, q, scale, b)
    # The dequantize baseline rounds w * scale to bf16: only near the reference.
    base = ig.int8_linear(x3, q, scale, b, path="dequant").reshape(6, 64).float()
    assert (base - ig.int8_linear_ref_f32(x, q, scale, b)).abs().max() < 0.1
    with pytest.raises(ValueError, match="unknown int8 path"):
        ig.int8_linear(x3, q, scale, path="cublas")


def test_dispatch_lookup_is_shape_only_and_json_friendly():
    d = ig.Int8Dispatch(picks={"96x512x1": "f16k512", "96x512x8": "n128k128", "96x512x32": "m64k64"})
    assert d.config_for(96, 512, 1).name == "f16k512"
    assert d.config_for(96, 512, 5).name == "n128k128"  # the next calibrated row count up
    assert d.config_for(96, 512, 20).name == "m64k64"
    assert d.config_for(96, 512, 100).name == ig.default_config(100).name  # past the calibrated rows
    assert d.config_for(64, 64, 1).name == ig.default_config(1).name  # shape never calibrated
    d.picks["96x512x2"] = "f16k512"  # an M == 1 kernel is never used for more rows
    assert d.config_for(96, 512, 2).kind == "dot"
    d.picks["96x512x16"] = "v1"  # nor the GEMV's above its MAX_ROWS
    assert d.config_for(96, 512, 9).kind == "dot"
    json.dumps(dataclasses.asdict(d))  # scripts dump the dispatch as JSON


def test_error_bound_is_no_looser_than_the_bf16_tolerance(device):
    # The derived bound, at K = 1024, sits inside the project's bf16 kernel tolerance
    # (trellm/kernels/testing.py: 1.6e-2 + 1e-2 |y|), which the old dequantize path broke.
    x, q, scale, _ = _case(16, 256, 1024, device, seed=5, bias=False)
    y = ig.int8_linear_ref_f32(x, q, scale).abs()
    assert (ig.int8_error_bound(x, q, scale) <= 1.6e-2 + 1e-2 * y).all()
