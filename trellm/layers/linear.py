"""Linear layers that own their weights and delegate the matmul to a quant method.

``MergedLinear`` stacks several checkpoint projections (q/k/v, gate/up) into one
weight so a step runs one matmul instead of three; ``weight_loader`` copies each
checkpoint tensor into its slice at load time.
"""
from __future__ import annotations

import torch

from trellm.quant.base import LinearMethod


class Linear(torch.nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool,
                 method: LinearMethod, dtype: torch.dtype):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.method = method
        method.create_weights(self, in_features, out_features, bias, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)

    def weight_loader(self, param_name: str, tensor: torch.Tensor, shard: int | None = None) -> None:
        if self.method.load_weight(self, param_name, tensor, None):
            return  # the method keeps this tensor in its own format (e.g. packed int4)
        param = getattr(self, param_name)
        _copy_checked(param.data, tensor, f"{param_name}")


class MergedLinear(Linear):
    """Several output projections stacked along the output dimension."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool,
                 method: LinearMethod, dtype: torch.dtype):
        super().__init__(in_features, sum(out_sizes), bias, method, dtype)
        self.out_sizes = list(out_sizes)
        self.offsets = [sum(out_sizes[:i]) for i in range(len(out_sizes))]

    def weight_loader(self, param_name: str, tensor: torch.Tensor, shard: int | None = None) -> None:
        if shard is None:
            return super().weight_loader(param_name, tensor)
        start, size = self.offsets[shard], self.out_sizes[shard]
        if self.method.load_weight(self, param_name, tensor, (start, size)):
            return
        param = getattr(self, param_name).data
        _copy_checked(param.narrow(0, start, size), tensor, f"{param_name}[shard {shard}]")

    def split(self, y: torch.Tensor) -> list[torch.Tensor]:
        return list(y.split(self.out_sizes, dim=-1))


def _copy_checked(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"shape mismatch for {what}: checkpoint {tuple(src.shape)}, model {tuple(dst.shape)}")
    check_float(src, what, dst)
    dst.copy_(src.to(dst.dtype))


def check_float(src: torch.Tensor, what: str, dst: torch.Tensor) -> None:
    """An integer tensor where the model holds floats is a wrong or damaged file, not
    something to cast (int32 token-table bits would load as garbage weights)."""
    if dst.is_floating_point() and not src.is_floating_point():
        raise ValueError(f"{what}: checkpoint dtype {src.dtype} where the model expects floating point")
