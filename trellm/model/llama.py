"""The Llama family in one file: Llama 2/3 (llama3 RoPE scaling), Mistral,
Qwen2 (qkv bias), Qwen3 (per-head q/k RMSNorm), SmolLM; tied or untied embeddings.

Checkpoint q/k/v and gate/up projections are stacked into one weight each at load
time (``STACKED``), so a layer runs four matmuls.

Submodules are run through ``.forward``, not called: ``Module.__call__`` checks for hooks
on every call (~2.5 us), and a CPU decode step of the default model makes ~270 such calls,
~5% of the step (median 13.0 vs 13.7 ms, scripts/cpu_decode_ab.py). Module hooks are
therefore not run inside the model.
"""
from __future__ import annotations

from typing import Iterable, Iterator

import torch
import torch.nn.functional as F

from trellm.kernels.gemv import gemv, gemv_rms_norm
from trellm.layers.int8_head import Int8Head, int8_head_available
from trellm.layers.linear import Linear, MergedLinear, check_float
from trellm.layers.norm_rope import RMSNorm, RotaryEmbedding
from trellm.model.config import ArchConfig
from trellm.quant.base import get_lm_head_method, get_linear_method

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")

ROTATION_MAX_TOKENS = 16
"""Steps of at most this many tokens apply RoPE as a batched matmul on the CPU (float32):
fewer ops per layer for decode; longer prefill chunks keep the elementwise tables, whose
cost grows with T while the matrices' grows with T * D."""

# checkpoint name fragment -> (fused module name, shard index)
STACKED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


class Attention(torch.nn.Module):
    def __init__(self, cfg: ArchConfig, layer_idx: int, rope: RotaryEmbedding, dtype: torch.dtype):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.scale = self.head_dim ** -0.5
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        method = get_linear_method(cfg.quantization_config)
        self.qkv_proj = MergedLinear(cfg.hidden_size, [q, kv, kv], cfg.attention_bias, method, dtype)
        self.o_proj = Linear(q, cfg.hidden_size, False, get_linear_method(cfg.quantization_config), dtype)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.rope = rope

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        return self.o_proj.forward(self.attend(x, positions, ctx))

    def attend(self, x: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        """The attention heads' output [T, heads * head_dim]: o_proj's input."""
        return self.attend_qkv(self.qkv_proj.forward(x), positions, ctx)

    def attend_qkv(self, qkv: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        """``attend`` from the qkv projection's output [T, (heads + 2 kv heads) * head_dim]."""
        t = qkv.shape[0]
        kv_cache = ctx.kv_caches[self.layer_idx]
        if ctx.ops is None and self.q_norm is None and ctx.rope_rotation is not None:
            # CPU decode: q and k are adjacent columns, so they rotate as one view (no
            # split, no cat); the values are those of the general path below.
            hq, hk, d = self.num_heads, self.num_kv_heads, self.head_dim
            qk = self.rope.rotate_rows(qkv[:, :(hq + hk) * d].view(t, hq + hk, d), ctx.rope_rotation)
            q, k, v = qk[:, :hq], qk[:, hq:], qkv[:, (hq + hk) * d:].view(t, hk, d)
        elif ctx.ops is not None:
            q, kv_cache = self._fused_q(qkv, positions, ctx)
            return ctx.backend.attend(q, kv_cache, ctx.meta, self.scale).reshape(t, -1)
        else:
            q, k, v = self._heads(qkv)
            if self.q_norm is not None:
                q, k = self.q_norm.forward(q), self.k_norm.forward(k)
            q, k = self.rope.forward(q, k, ctx.cos_sin, ctx.rope_rotation)
        return ctx.backend.forward(q, k, v, kv_cache, ctx.meta, self.scale).reshape(t, -1)

    def _heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t = qkv.shape[0]
        q, k, v = self.qkv_proj.split(qkv)
        return (q.view(t, self.num_heads, self.head_dim), k.view(t, self.num_kv_heads, self.head_dim),
                v.view(t, self.num_kv_heads, self.head_dim))

    def _fused_q(self, qkv: torch.Tensor, positions: torch.Tensor, ctx) -> tuple[torch.Tensor, torch.Tensor]:
        """Fused path (GPU kernels): q/k norm, RoPE and the KV write in one kernel; (q, kv cache)."""
        q, k, v = self._heads(qkv)
        kv_cache = ctx.kv_caches[self.layer_idx]
        norms = {}
        if self.q_norm is not None:
            norms = {"q_norm": (self.q_norm.weight, self.q_norm.eps), "k_norm": (self.k_norm.weight, self.k_norm.eps)}
        cos, sin = self.rope.tables(q.device)
        q = ctx.ops.rope_and_write_kv(q, k, v, cos, sin, kv_cache, ctx.meta.slot_mapping, positions, **norms)
        return q, kv_cache

    def project(self, qkv: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        """o_proj(attend_qkv(qkv)) with the GPU kernels (ctx.ops). Where o_proj wants its input
        transformed first (EXL3) and the backend can do it as it stores the heads' output
        (decode-only steps), the attention kernel writes that too and o_proj skips its pass."""
        t = qkv.shape[0]
        spec = self.o_proj.method.input_transform(self.o_proj, t, qkv.dtype, qkv.device)
        attend_xform = getattr(ctx.backend, "attend_xform", None)
        if spec is None or attend_xform is None:
            return self.o_proj.forward(self.attend_qkv(qkv, positions, ctx))
        q, kv_cache = self._fused_q(qkv, positions, ctx)
        done = attend_xform(q, kv_cache, ctx.meta, self.scale, spec)
        if done is None:
            return self.o_proj.forward(ctx.backend.attend(q, kv_cache, ctx.meta, self.scale).reshape(t, -1))
        return self.o_proj.method.apply_transformed(self.o_proj, *done)


class MLP(torch.nn.Module):
    def __init__(self, cfg: ArchConfig, dtype: torch.dtype):
        super().__init__()
        i = cfg.intermediate_size
        self.gate_up_proj = MergedLinear(cfg.hidden_size, [i, i], False, get_linear_method(cfg.quantization_config), dtype)
        self.down_proj = Linear(i, cfg.hidden_size, False, get_linear_method(cfg.quantization_config), dtype)

    def forward(self, x: torch.Tensor, ops=None) -> torch.Tensor:
        if ops is not None:
            return glu_linear(self.down_proj, self.gate_up_proj.forward(x), ops)
        gate, up = self.gate_up_proj.split(self.gate_up_proj.forward(x))
        return self.down_proj.forward(F.silu(gate) * up)


def norm_linear(linear: Linear, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm, ops
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(norm(x + residual)), x + residual) with the GPU kernels; residual None: x is
    the residual itself (the first layer's embeddings). One launch (gemv_rms_norm) where the
    dense layer's calibrated dispatch picked it, else ops.fused_add_rms_norm (ops.rms_norm)
    then the linear as the dispatch picks it."""
    fused = linear.method.apply_norm(linear, x, residual, norm.weight, norm.eps)
    if fused is not None:  # e.g. EXL3: its input transform in the norm's launch
        return fused
    d = getattr(linear.method, "gemv_dispatch", None)
    if d is not None and d.wants_norm(x, linear.weight):
        return gemv_rms_norm(x, linear.weight, linear.bias, residual, norm.weight, norm.eps)
    if residual is None:
        return linear.forward(ops.rms_norm(x, norm.weight, norm.eps)), x
    normed, residual = ops.fused_add_rms_norm(x, residual, norm.weight, norm.eps)
    return linear.forward(normed), residual


def glu_linear(linear: Linear, gate_up: torch.Tensor, ops) -> torch.Tensor:
    """linear(silu_and_mul(gate_up)) with the GPU kernels. Dense down projections carry the
    calibrated GEMV dispatch (worker/builder.py); it picks the GEMV with SiLU-and-mul
    fused in only where that timed faster."""
    fused = linear.method.apply_glu(linear, gate_up)
    if fused is not None:
        return fused
    d = getattr(linear.method, "gemv_dispatch", None)
    if d is not None and d.wants_glu(gate_up, linear.weight):
        return gemv(gate_up, linear.weight, linear.bias, glu=True)
    return linear.forward(ops.silu_and_mul(gate_up))


class DecoderLayer(torch.nn.Module):
    def __init__(self, cfg: ArchConfig, idx: int, rope: RotaryEmbedding, dtype: torch.dtype):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = Attention(cfg, idx, rope, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = MLP(cfg, dtype)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        x = x + self.self_attn.forward(self.input_layernorm.forward(x), positions, ctx)
        return x + self.mlp.forward(self.post_attention_layernorm.forward(x))


class LlamaForCausalLM(torch.nn.Module):
    def __init__(self, cfg: ArchConfig, dtype: torch.dtype, max_positions: int):
        super().__init__()
        self.cfg = cfg
        # _weight: skip the random init of a table the loader overwrites anyway.
        self.embed_tokens = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                               _weight=torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype))
        self.embed_tokens.weight.requires_grad_(False)
        rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling,
                               max_positions)
        self.layers = torch.nn.ModuleList(DecoderLayer(cfg, i, rope, dtype) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = None
        self.lm_head_int8: Int8Head | None = None
        self.gemv_dispatch = None
        """trellm.kernels.gemv.GemvDispatch (CUDA): the LM head's skinny GEMM choice."""
        head_method = get_lm_head_method(cfg.quantization_config)
        if head_method is not None:
            # A quantized head is its own tensor even when the embeddings are tied (EXL3).
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, False, head_method, dtype)
        elif not cfg.tie_word_embeddings:
            self.lm_head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype)
            self.lm_head.weight.requires_grad_(False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        """input_ids, positions: [T]; returns final hidden states [T, hidden]."""
        x = self.embed_tokens.forward(input_ids)
        if ctx.ops is not None:
            return self._forward_fused(x, positions, ctx)
        rope = self.layers[0].self_attn.rope
        ctx.cos_sin = rope.cos_sin(positions, x.dtype)
        if x.device.type == "cpu" and x.dtype == torch.float32 and len(positions) <= ROTATION_MAX_TOKENS:
            ctx.rope_rotation = rope.rotation(positions)
        for layer in self.layers:
            x = layer.forward(x, positions, ctx)
        return self.norm.forward(x)

    def _forward_fused(self, x: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        """The same layers as the GPU kernels want them: each sublayer's output waits, with
        the residual, for the next norm, which runs with the residual add as one kernel or
        inside the next projection's GEMV (``norm_linear``)."""
        ops = ctx.ops
        out, residual = x, None
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv, residual = norm_linear(attn.qkv_proj, out, residual, layer.input_layernorm, ops)
            out = attn.project(qkv, positions, ctx)
            gate_up, residual = norm_linear(mlp.gate_up_proj, out, residual, layer.post_attention_layernorm, ops)
            out = glu_linear(mlp.down_proj, gate_up, ops)
        return ops.fused_add_rms_norm(out, residual, self.norm.weight, self.norm.eps)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head_int8 is not None:
            return self.lm_head_int8(hidden)
        if isinstance(self.lm_head, Linear):
            return self.lm_head.forward(hidden).float()
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        if self.gemv_dispatch is not None and self.gemv_dispatch.wants(hidden, weight):
            return gemv(hidden, weight).float()
        return F.linear(hidden, weight).float()

    def use_int8_lm_head(self) -> None:
        """CPU fast path: an int8 copy of the LM head (layers/int8_head.py). The head is
        ~a fifth of the weights read per token; int8 quarters its bytes."""
        if int8_head_available():
            self.lm_head_int8 = Int8Head.from_weight(
                self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight)

    # ---- loading -------------------------------------------------------------------

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (HF names) into the model; every parameter must be set."""
        targets = self._load_targets()
        loaded: set[str] = set()
        for name, tensor in tensors:
            if name.endswith("rotary_emb.inv_freq"):
                continue
            if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
                continue
            key, shard = _map_name(name)
            if key not in targets:
                raise ValueError(f"checkpoint tensor {name!r} has no place in {self.cfg.architecture}")
            module, pname = targets[key]
            if hasattr(module, "weight_loader"):
                module.weight_loader(pname, tensor, shard)
            else:
                param = getattr(module, pname)
                if tuple(param.shape) != tuple(tensor.shape):
                    raise ValueError(f"shape mismatch for {name}: checkpoint {tuple(tensor.shape)}, "
                                     f"model {tuple(param.shape)}")
                check_float(tensor, name, param)
                param.data.copy_(tensor.to(param.dtype))
            loaded.add(f"{key}#{shard}")
        self._check_all_loaded(loaded)
        for mname, m in self.named_modules():
            if hasattr(m, "method"):
                try:
                    m.method.process_after_loading(m)
                except ValueError as e:
                    raise ValueError(f"{mname}: {e}") from None

    def _load_targets(self) -> dict[str, tuple[torch.nn.Module, str]]:
        out: dict[str, tuple[torch.nn.Module, str]] = {}
        for mname, module in self.named_modules():
            for pname in _checkpoint_names(module) or [p for p, _ in module.named_parameters(recurse=False)]:
                out[f"model.{mname}.{pname}" if mname != "lm_head" else f"lm_head.{pname}"] = (module, pname)
        return out

    def _check_all_loaded(self, loaded: set[str]) -> None:
        expected: set[str] = set()
        for key, (module, _) in self._load_targets().items():
            if _checkpoint_names(module) is not None:
                continue  # the layer's quant method checks its own tensors after loading
            if isinstance(module, MergedLinear):
                expected |= {f"{key}#{s}" for s in range(len(module.out_sizes))}
            else:
                expected.add(f"{key}#None")
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[0].split('#')[0]}")


def _checkpoint_names(module: torch.nn.Module) -> tuple[str, ...] | None:
    method = getattr(module, "method", None)
    return None if method is None else method.checkpoint_names(module)


def _map_name(name: str) -> tuple[str, int | None]:
    """HF checkpoint name -> (our parameter key, shard)."""
    for frag, (fused, shard) in STACKED.items():
        if f".{frag}." in name:
            return name.replace(f".{frag}.", f".{fused}."), shard
    return name, None


def dummy_weights(cfg: ArchConfig, seed: int, device: str | torch.device = "cpu"
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """Seeded random weights in HF names, scaled so activations stay O(1) and the
    logits are peaked (random weights with tiny logits would make every greedy
    comparison a near-tie). Yielded in float32 on ``device``, one tensor at a time."""
    g = torch.Generator(device=device).manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=g, device=device)  # noqa: E731
    h, i, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd

    def lin(out_f: int, in_f: int) -> torch.Tensor:
        return randn(out_f, in_f) / in_f ** 0.5

    def norm(n: int) -> torch.Tensor:
        return 1.0 + 0.1 * randn(n)

    yield "model.embed_tokens.weight", randn(cfg.vocab_size, h)
    for li in range(cfg.num_layers):
        p = f"model.layers.{li}."
        yield p + "input_layernorm.weight", norm(h)
        yield p + "post_attention_layernorm.weight", norm(h)
        for name, shape in (("q_proj", (q, h)), ("k_proj", (kv, h)), ("v_proj", (kv, h)), ("o_proj", (h, q))):
            yield p + f"self_attn.{name}.weight", lin(*shape)
            if cfg.attention_bias and name != "o_proj":
                yield p + f"self_attn.{name}.bias", 0.1 * randn(shape[0])
        if cfg.qk_norm:
            yield p + "self_attn.q_norm.weight", norm(hd)
            yield p + "self_attn.k_norm.weight", norm(hd)
        yield p + "mlp.gate_proj.weight", lin(i, h)
        yield p + "mlp.up_proj.weight", lin(i, h)
        yield p + "mlp.down_proj.weight", lin(h, i)
    yield "model.norm.weight", norm(h)
    if not cfg.tie_word_embeddings:
        yield "lm_head.weight", lin(cfg.vocab_size, h)
