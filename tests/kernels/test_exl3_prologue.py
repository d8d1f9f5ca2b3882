"""EXL3's input transform in the norm / SiLU-and-mul launch (trellm/kernels/exl3_prologue.py)
against the two launches it replaces (bit for bit: the fused path must not change a token)
and against the PyTorch reference; then through the layer hook (LinearMethod.apply_norm /
apply_glu), where it must fall back for the layouts it does not write."""
import dataclasses

import pytest
import torch

from trellm.kernels import exl3_fast, exl3_prologue
from trellm.kernels import quant_testing as qt
from trellm.kernels.activation import silu_and_mul
from trellm.kernels.rmsnorm import fused_add_rms_norm, rms_norm

pytestmark = pytest.mark.gpu


def _fused(in_f: int, outs: tuple[int, ...], device, bias: bool = False):
    return exl3_fast.fuse([qt.exl3_weight(in_f, o, 4, "mul1", device, seed=o, bias=bias) for o in outs])


def _randn(*shape, seed, device, dtype):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device, dtype)


@pytest.mark.parametrize("in_f,rows,residual,act,out,frag", [
    (200, 1, True, torch.bfloat16, torch.float32, 0),   # padded to 256; the row kernel's layout
    (384, 3, True, torch.float16, torch.float16, 0),    # several rows; the dot kernels' dtype
    (256, 1, False, torch.bfloat16, torch.float32, 0),  # the first layer: x is the residual
    (200, 3, True, torch.bfloat16, torch.float16, 16),  # exl3_mma's fragment order, 13 padding rows
    (256, 17, False, torch.bfloat16, torch.float16, 32),
], ids=["pad-bf16", "rows3-fp16", "nores", "frag3", "frag17"])
def test_norm_transform_equals_the_two_launches(in_f, rows, residual, act, out, frag, device):
    f = _fused(in_f, (128, 256), device)
    x = _randn(rows, in_f, seed=1, device=device, dtype=act) * 3
    res = _randn(rows, in_f, seed=2, device=device, dtype=act) if residual else None
    w = (1 + 0.1 * _randn(in_f, seed=3, device=device, dtype=torch.float32)).to(act)
    got, got_res = exl3_prologue.norm_input_transform(f.suh, x, res, w, 1e-5, out, frag)
    normed, want_res = fused_add_rms_norm(x, res, w, 1e-5) if residual else (rms_norm(x, w, 1e-5), None)
    want = exl3_fast.fast_input_transform(f, normed, out, frag)
    assert got.shape == (2, frag or rows, f.padded_in) and got.dtype == out
    assert torch.equal(got, want)
    if residual:
        assert torch.equal(got_res, want_res)
    else:
        assert got_res is None
    if not frag:
        ref, ref_res = exl3_prologue.norm_input_transform_ref(f.suh, x, res, w, 1e-5, out)
        torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=2e-2)  # bf16 rounding of the norm


@pytest.mark.parametrize("in_f,rows", [(200, 1), (256, 2)])
def test_glu_transform_equals_the_two_launches(in_f, rows, device):
    f = _fused(in_f, (128,), device)
    gate_up = _randn(rows, 2 * in_f, seed=4, device=device, dtype=torch.bfloat16) * 2
    got = exl3_prologue.glu_input_transform(f.suh, gate_up, torch.float32)
    want = exl3_fast.fast_input_transform(f, silu_and_mul(gate_up), torch.float32)
    assert torch.equal(got, want)
    frag = exl3_prologue.glu_input_transform(f.suh, gate_up, torch.float16, 16)
    assert torch.equal(frag, exl3_fast.fast_input_transform(f, silu_and_mul(gate_up), torch.float16, 16))
    ref = exl3_prologue.glu_input_transform_ref(f.suh, gate_up, torch.float32)
    torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2)


def test_bad_shapes_are_refused(device):
    f = _fused(128, (128,), device)
    x = torch.zeros(1, 128, device=device, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="norm weight"):
        exl3_prologue.norm_input_transform(f.suh, x, None, torch.ones(64, device=device, dtype=torch.bfloat16),
                                           1e-5, torch.float32)
    with pytest.raises(ValueError, match="residual"):
        exl3_prologue.norm_input_transform(f.suh, x, x[:, :64], torch.ones(128, device=device, dtype=torch.bfloat16),
                                           1e-5, torch.float32)
    with pytest.raises(ValueError, match="even"):
        exl3_prologue.glu_input_transform(f.suh, torch.zeros(1, 5, device=device), torch.float32)
    with pytest.raises(ValueError, match="fragment order"):
        exl3_prologue.glu_input_transform(f.suh, torch.zeros(3, 256, device=device), torch.float16, 8)


def _layer(f):
    return exl3_fast.FusedLayer((f,), f.in_features)


def test_layer_norm_and_glu_hooks_equal_the_plain_path(device):
    # One row on the default dispatch: the row kernel with its fused output transform reads
    # the norm's / SiLU's transformed x; outputs and residual bit for bit the plain path's.
    f = _fused(256, (128, 256), device, bias=True)
    layer = _layer(f)
    x = _randn(1, 256, seed=5, device=device, dtype=torch.bfloat16)
    res = _randn(1, 256, seed=6, device=device, dtype=torch.bfloat16)
    w = (1 + 0.1 * _randn(256, seed=7, device=device, dtype=torch.float32)).to(torch.bfloat16)
    y, r = exl3_prologue.run_layer_norm(layer, x, res, w, 1e-6)
    normed, want_r = fused_add_rms_norm(x, res, w, 1e-6)
    assert torch.equal(r, want_r)
    assert torch.equal(y, exl3_fast.fast_matmul(f, normed))
    y0, r0 = exl3_prologue.run_layer_norm(layer, x, None, w, 1e-6)
    assert r0 is x and torch.equal(y0, exl3_fast.fast_matmul(f, rms_norm(x, w, 1e-6)))
    down = _layer(_fused(128, (256,), device))
    gate_up = _randn(1, 256, seed=8, device=device, dtype=torch.bfloat16)
    assert torch.equal(exl3_prologue.run_layer_glu(down, gate_up),
                       exl3_fast.fast_matmul(down.groups[0], silu_and_mul(gate_up)))
    # 5 rows: exl3_mma (the gemv default) reads x in fragment order, written by the norm / SiLU
    x5 = _randn(5, 256, seed=12, device=device, dtype=torch.bfloat16)
    y5, r5 = exl3_prologue.run_layer_norm(layer, x5, x5, w, 1e-6)
    normed5, want_r5 = fused_add_rms_norm(x5, x5, w, 1e-6)
    assert torch.equal(r5, want_r5) and torch.equal(y5, exl3_fast.fast_matmul(f, normed5))
    gu5 = _randn(5, 256, seed=13, device=device, dtype=torch.bfloat16)
    assert torch.equal(exl3_prologue.run_layer_glu(down, gu5), exl3_fast.fast_matmul(down.groups[0], silu_and_mul(gu5)))


def test_hooks_fall_back_where_the_layout_differs(device):
    f = _fused(128, (128,), device)
    layer = _layer(f)
    w = torch.ones(128, device=device, dtype=torch.bfloat16)
    x = torch.zeros(1, 128, device=device, dtype=torch.bfloat16)
    # 33-255 rows: the dot kernel transforms its slice of the raw x itself (in_had)
    assert exl3_prologue.run_layer_norm(layer, x.expand(40, 128), None, w, 1e-6) is None
    assert exl3_prologue.run_layer_norm(layer, x, None, w.float(), 1e-6) is None  # weight dtype
    d = exl3_fast.get_dispatch()
    for off in (dict(fuse_in=False), dict(in_fwht=False)):
        exl3_fast.set_dispatch(dataclasses.replace(d, **off))
        try:
            assert exl3_prologue.run_layer_norm(layer, x, None, w, 1e-6) is None
            assert exl3_prologue.run_layer_glu(layer, torch.zeros(1, 256, device=device)) is None
        finally:
            exl3_fast.set_dispatch(d)
    # two groups (parts of different K): the plain path
    two = exl3_fast.FusedLayer((f, _fused(128, (128,), device)), 128)
    assert exl3_prologue.run_layer_norm(two, x, None, w, 1e-6) is None


def test_method_hooks_through_merged_linear(device):
    # LinearMethod.apply_norm / apply_glu on an EXL3 MergedLinear with the fused-layer kernel
    # admitted on this device; a dense method declines (None: the model runs the norm).
    from trellm.layers.linear import Linear, MergedLinear
    from trellm.quant.base import UnquantizedLinearMethod
    from trellm.quant.exl3 import method as exl3_method
    from trellm.quant.exl3.loading import random_exl3_tensors

    g = torch.Generator(device=device).manual_seed(0)
    layer = MergedLinear(128, [128, 256], False, exl3_method.EXL3LinearMethod(), torch.bfloat16)
    layer.exl3_device = device
    for shard, out_f in enumerate((128, 256)):
        for name, t in random_exl3_tensors("p", 128, out_f, 4, "mul1", g, device):
            layer.weight_loader(name.rsplit(".", 1)[1], t, shard)
    kernel = exl3_method.EXL3LayerKernel(
        "test-fast", lambda parts: exl3_fast.prepare_layer(parts, force=True),
        lambda state, x: x.shape[-1] == state.in_features, exl3_fast.run_layer, run_norm=exl3_prologue.run_layer_norm,
        run_glu=exl3_prologue.run_layer_glu, input_transform=exl3_prologue.layer_input_transform,
        run_transformed=exl3_prologue.run_layer_transformed)
    exl3_method.register_layer_kernel(kernel)
    try:
        layer.method.process_after_loading(layer)
    finally:
        exl3_method.unregister_layer_kernel("test-fast")
    x = _randn(1, 128, seed=9, device=device, dtype=torch.bfloat16)
    w = torch.ones(128, device=device, dtype=torch.bfloat16)
    got, res = layer.method.apply_norm(layer, x, None, w, 1e-6)
    assert res is x and torch.equal(got, layer(rms_norm(x, w, 1e-6)))
    gate_up = _randn(1, 256, seed=10, device=device, dtype=torch.bfloat16)
    assert torch.equal(layer.method.apply_glu(layer, gate_up), layer(silu_and_mul(gate_up)))
    assert layer.method.apply_glu(layer, torch.zeros(1, 384, device=device, dtype=torch.bfloat16)) is None
    # a one-part layer (o_proj) hands its transform out; apply_transformed takes it
    one = Linear(128, 256, False, exl3_method.EXL3LinearMethod(), torch.bfloat16)
    one.exl3_device = device
    for name, t in random_exl3_tensors("o", 128, 256, 4, "mul1", g, device):
        one.weight_loader(name.rsplit(".", 1)[1], t)
    exl3_method.register_layer_kernel(kernel)
    try:
        one.method.process_after_loading(one)
    finally:
        exl3_method.unregister_layer_kernel("test-fast")
    spec = one.method.input_transform(one, 1, x.dtype, x.device)
    xh = exl3_fast.fast_input_transform(one.exl3_layer_kernel[1].groups[0], x, spec.dtype)[0]
    assert torch.equal(one.method.apply_transformed(one, x, xh), one(x))
    dense = Linear(128, 64, False, UnquantizedLinearMethod(), torch.bfloat16)
    assert dense.method.apply_norm(dense, x, None, w, 1e-6) is None
    assert dense.method.apply_glu(dense, torch.zeros(1, 128)) is None
    assert dense.method.input_transform(dense, 1, x.dtype, x.device) is None
    assert layer.method.input_transform(layer, 1, x.dtype, x.device) is None  # two parts: none handed out



def test_transform_handed_to_the_kernel_before(device):
    # layer_input_transform: what the decode attention writes for a one-part layer (o_proj);
    # run_layer_transformed takes it: bit for bit the plain path.
    from trellm.quant.base import InputTransform

    f = _fused(256, (384,), device, bias=True)
    layer = _layer(f)
    spec = exl3_prologue.layer_input_transform(layer, 1)
    assert isinstance(spec, InputTransform) and spec.dtype == torch.float32 and torch.equal(spec.suh, f.suh[0])
    x = _randn(1, 256, seed=11, device=device, dtype=torch.bfloat16)
    xh = exl3_fast.fast_input_transform(f, x, spec.dtype)[0]
    assert torch.equal(exl3_prologue.run_layer_transformed(layer, x, xh), exl3_fast.fast_matmul(f, x))
    assert exl3_prologue.layer_input_transform(layer, 4) is None  # 2-32 rows: fragment order
    with pytest.raises(ValueError, match="pre-transformed"):  # a main kernel that transforms x itself
        exl3_fast.fast_partials(f, x.expand(40, 256).contiguous(), exl3_fast.choose_config(40), xh=xh)
    assert exl3_prologue.layer_input_transform(_layer(_fused(256, (128, 256), device)), 1) is None  # two parts
