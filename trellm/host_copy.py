"""Host lists to device tensors without stalling the host."""
from __future__ import annotations

import torch


def device_tensor(data, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A host list on ``device``. On CUDA the copy starts from pinned memory and does not
    block: a copy from pageable memory can wait for the device to drain, which would
    stop the host preparing step n+1 while step n runs (torch's pinned allocator keeps
    the staging buffer alive until the copy has run)."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.tensor(data, dtype=dtype, device=device)
    return torch.tensor(data, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
