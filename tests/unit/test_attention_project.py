"""model/llama.py Attention.project: o_proj's input transform handed to the attention
backend (LinearMethod.input_transform / apply_transformed, backend.attend_xform), and the
plain path wherever one side declines. Stand-ins for the GPU ops and backend, on the CPU."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from trellm.layers.norm_rope import RotaryEmbedding
from trellm.model.llama import Attention
from trellm.quant.base import InputTransform, UnquantizedLinearMethod


class _Ops:
    def rope_and_write_kv(self, q, k, v, cos, sin, kv_cache, slots, positions, **norms):
        return q * 2  # marks q as having passed here


class _Backend:
    def __init__(self, xform_result: bool):
        self.xform_result, self.calls = xform_result, []

    def attend(self, q, kv_cache, meta, scale):
        self.calls.append("attend")
        return q + 1

    def attend_xform(self, q, kv_cache, meta, scale, spec):
        self.calls.append(("xform", spec))
        if not self.xform_result:
            return None
        return (q + 1).reshape(q.shape[0], -1), torch.full((q.shape[0], q.shape[1] * q.shape[2]), 5.0)


class _TransformingMethod(UnquantizedLinearMethod):
    """Dense weights, but asks for its input transformed (as EXL3 does)."""

    def __init__(self, spec):
        self.spec, self.seen = spec, None

    def input_transform(self, layer, rows, dtype, device):
        return self.spec

    def apply_transformed(self, layer, x, xh):
        self.seen = (x, xh)
        return self.apply(layer, x)


def _attention():
    cfg = SimpleNamespace(num_heads=2, num_kv_heads=1, head_dim=8, hidden_size=16, attention_bias=False,
                          quantization_config=None, qk_norm=False, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    attn = Attention(cfg, 0, RotaryEmbedding(8, 10000.0, None, 64), torch.float32)
    for p in attn.parameters():
        p.data.copy_(torch.randn_like(p))
    return attn


def _ctx(backend):
    return SimpleNamespace(ops=_Ops(), backend=backend, kv_caches=[None], meta=SimpleNamespace(slot_mapping=None),
                           rope_rotation=None)


def test_project_hands_the_transform_to_the_backend():
    attn = _attention()
    spec = InputTransform(torch.ones(16), torch.float32)
    method = _TransformingMethod(spec)
    method.create_weights(attn.o_proj, 16, 16, False, torch.float32)  # o_proj keeps its own weight
    attn.o_proj.weight = torch.nn.Parameter(torch.randn(16, 16), requires_grad=False)
    attn.o_proj.method = method
    qkv = torch.randn(3, 32)
    backend = _Backend(True)
    got = attn.project(qkv, torch.arange(3), _ctx(backend))
    assert backend.calls == [("xform", spec)]
    x, xh = method.seen
    assert torch.equal(xh, torch.full((3, 16), 5.0))
    want_x = (qkv[:, :16].reshape(3, 2, 8) * 2 + 1).reshape(3, 16)
    assert torch.equal(x, want_x) and torch.equal(got, attn.o_proj.forward(want_x))
    # the backend declines (a prefill row in the step): the plain attend, then o_proj
    backend = _Backend(False)
    method.seen = None
    got = attn.project(qkv, torch.arange(3), _ctx(backend))
    assert backend.calls == [("xform", spec), "attend"] and method.seen is None
    assert torch.equal(got, attn.o_proj.forward(want_x))


def test_project_without_a_transform_is_the_plain_path():
    attn = _attention()
    qkv = torch.randn(2, 32)
    backend = _Backend(True)
    got = attn.project(qkv, torch.arange(2), _ctx(backend))
    assert backend.calls == ["attend"]  # a dense o_proj asks for nothing
    assert torch.equal(got, attn.o_proj.forward(attn.attend_qkv(qkv, torch.arange(2), _ctx(_Backend(True)))))
