"""RMSNorm and rotary embeddings (Llama layout, llama3 frequency scaling).

Both follow transformers' arithmetic (norm in float32, cast back before the
weight; rotate-half RoPE) so logits match the reference closely; the RoPE tables are
the correctly rounded float32 cos/sin (within an ulp of transformers' float32 ones).
"""
from __future__ import annotations

import math

import torch

from trellm.layers.linear import check_float


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm arithmetic: normalize in float32, cast back, then scale."""
    dtype = x.dtype
    if dtype == torch.float32:  # the casts are no-ops: skip their dispatch (CPU decode)
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """The float32 RMSNorm in five ops that each cost ~1.5 us on a decode row, where
    the reference's pow and mean take ~3 us apiece and ``+ eps`` wraps a Python float in
    a tensor every call (14.5 vs 8.5 us a 576-wide row, 2-core AVX-512 machine).
    mean(x^2) + eps = ||x||^2 / D + eps: the norm's square rounds within an ulp or two
    of the reference's sum (x, logits: ~1e-7 relative, far inside the transformers
    tolerance). ``eps``: a 0-dim float32 tensor."""
    n = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    return torch.mul(x, torch.rsqrt(torch.addcmul(eps, n, n, value=1.0 / x.shape[-1]))).mul_(weight)


class RMSNorm(torch.nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self.eps = eps
        self.eps_cpu = torch.tensor(eps, dtype=torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Not F.rms_norm: on the CPU it is a composite of the same ops plus dtype
        # bookkeeping, measured ~1.5x slower on a 576-wide decode row (2-core AVX2).
        if x.dtype == torch.float32 and x.device.type == "cpu" and self.weight.dtype == torch.float32:
            return rms_norm_cpu(x, self.weight, self.eps_cpu)
        return rms_norm_reference(x, self.weight, self.eps)

    def weight_loader(self, param_name: str, tensor: torch.Tensor, shard: int | None = None) -> None:
        if tuple(tensor.shape) != tuple(self.weight.shape):
            raise ValueError(f"shape mismatch for norm weight: {tuple(tensor.shape)} vs {tuple(self.weight.shape)}")
        check_float(tensor, "norm weight", self.weight)
        self.weight.data.copy_(tensor.to(self.weight.dtype))


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies, with llama3-style scaling when the config asks for it."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
    if kind in (None, "default"):
        return inv
    if kind == "linear":
        return inv / _positive(scaling, "factor")
    if kind == "llama3":
        for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            _positive(scaling, key)
        if float(scaling["high_freq_factor"]) <= float(scaling["low_freq_factor"]):
            raise ValueError("rope_scaling: high_freq_factor must be above low_freq_factor")
        return _llama3_inv_freq(inv, scaling)
    raise ValueError(f"unsupported rope_scaling type {kind!r}")


def _positive(scaling: dict, key: str) -> float:
    """scaling[key] as a float, or a ValueError naming it (model configs are data)."""
    v = scaling.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise ValueError(f"rope_scaling: {key} must be a positive number, got {v!r:.40}")
    return float(v)


def _llama3_inv_freq(inv: torch.Tensor, s: dict) -> torch.Tensor:
    # Long wavelengths are divided by `factor`, short ones kept, the band between
    # smoothly interpolated (Meta's Llama 3.1 recipe, as in transformers).
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(torch.nn.Module):
    """Applies rotate-half RoPE to q and k at given absolute positions."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None, max_positions: int):
        super().__init__()
        self.head_dim = head_dim
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta, scaling), persistent=False)
        self.max_positions = max_positions
        self._cache: tuple[torch.Tensor, torch.Tensor] | None = None

    def tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole float32 [max_positions, D] cos and signed sin tables, built once
        (fused kernels index them by position themselves)."""
        if self._cache is None or self._cache[0].device != device:
            t = torch.arange(self.max_positions, dtype=torch.float32, device=device)
            cos, sin = _cos_sin(torch.outer(t, self.inv_freq.to(device)))
            # sin with the first half negated: rotate_half(x) * sin == roll(x, D/2) * this,
            # exactly (a sign flip commutes with rounding), in one op instead of four.
            self._cache = (torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1))
        return self._cache

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, 1, D] cos and signed sin for these positions; computed once per forward, shared by all layers."""
        cos_all, sin_all = self.tables(positions.device)
        return cos_all[positions].unsqueeze(1).to(dtype), sin_all[positions].unsqueeze(1).to(dtype)

    def rotation(self, positions: torch.Tensor) -> torch.Tensor:
        """float32 [T, D, D] matrices R with ``x @ R`` equal to this RoPE at each position.

        R = diag(cos) plus the signed sin at (k + D/2 mod D, k): a decode step then
        rotates q and k of every head in one batched matmul, where the elementwise form
        is six small ops per layer whose dispatch costs more than their arithmetic on
        the CPU. Only two products per output are non-zero, so the result equals the
        elementwise form up to the rounding of one add (FMA or not)."""
        cos_all, sin_all = self.tables(positions.device)
        cos, sin = cos_all[positions], sin_all[positions]
        d = self.head_dim
        k = torch.arange(d, device=positions.device)
        rot = torch.diag_embed(cos)
        rot[:, (k + d // 2) % d, k] = sin
        return rot

    @staticmethod
    def rotate_rows(qk: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
        """[T, H, D] heads (q's then k's) rotated by this step's ``rotation``, float32."""
        return torch.bmm(qk.float(), rotation)

    def forward(self, q: torch.Tensor, k: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                rotation: torch.Tensor | None = None):
        """q: [T, Hq, D], k: [T, Hk, D]; returns rotated (q, k) (dtype: promoted with the tables').
        ``rotation``: this step's ``rotation(positions)``, used instead of the tables."""
        hq = q.shape[1]
        if rotation is not None:
            qk = self.rotate_rows(torch.cat((q, k), dim=1), rotation)
            return qk[:, :hq], qk[:, hq:]
        cos, signed_sin = cos_sin
        # Rotate q and k together: one set of elementwise ops instead of two.
        qk = torch.cat((q, k), dim=1).to(cos.dtype)  # one cast, not one per product
        qk = qk * cos + qk.roll(self.head_dim // 2, dims=-1) * signed_sin
        return qk[:, :hq], qk[:, hq:]


def _cos_sin(freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of float32 angles, through float64: the correctly rounded float32 values,
    the same in every process. In float32, on this project's 2-core CI-class machine, the
    tables differed between processes (one element's cos at ~500 rad by 3e-4, in ~1 run
    of 4 of tests/unit/test_layers.py; not reproduced on every machine), which made a
    bit-identity test flaky."""
    f = freqs.double()
    return f.cos().float(), f.sin().float()


def rope_reference(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """transformers' rotate-half RoPE on x [T, H, D] (float32 tables): the test oracle."""
    cos, sin = _cos_sin(torch.outer(positions.float(), inv_freq))
    cos, sin = torch.cat((cos, cos), dim=-1)[:, None, :], torch.cat((sin, sin), dim=-1)[:, None, :]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
