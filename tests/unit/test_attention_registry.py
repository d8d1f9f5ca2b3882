"""The attention registry: the Triton backend is registered but never chosen on the CPU."""
import torch

from trellm.attention.registry import available_backends, get_attention_backend
from trellm.attention.triton_paged import TritonPagedAttention


def test_cpu_always_gets_torch_backend():
    assert "triton" in available_backends()
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert get_attention_backend(torch.device("cpu"), dtype).name == "torch"
        assert not TritonPagedAttention.supports(torch.device("cpu"), dtype)
