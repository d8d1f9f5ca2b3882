"""EXL3's procedural codebooks: a 16-bit trellis state -> one fp16 weight value.

Three codes (docs: quant-spec §1.4), all with products taken mod 2^32:

* ``3inst`` (QTIP's code): ``x = s * 89226354 + 64248484``, then
  ``x = (x & 0x8FFF8FFF) ^ 0x3B603B60``; the two 16-bit halves read as fp16 and
  summed. The mask keeps sign, the low two exponent bits and the mantissa; the XOR
  pins the exponent so each half lies in +-[0.125, 2).
* ``mcg``: ``x = s * 0xCBAC1FED`` (no add), then the same mask, XOR and sum.
* ``mul1`` (the converter's default): ``x = s * 0x83DCD12D``; ``B`` = the sum of x's
  four bytes; value = fp16((1024 + B) * k_inv + k_bias) with fp16 constants
  k_inv = 0x1EEE and k_bias = 0xC931 (an Irwin-Hall approximation of a Gaussian).

Everything is computed in float32 and rounded once to fp16, which is bit-exact with
the CUDA code: the sum of two fp16 halves is exact in float32, and so are
``(1024 + B) * k_inv`` (11 x 11 significant bits) and the add of k_bias.

The tensors here are int64 holding unsigned values (torch has no uint32
arithmetic); a 16-bit state times a 32-bit constant stays below 2^48.
"""
from __future__ import annotations

import struct
from functools import lru_cache

import torch

CODEBOOKS = ("3inst", "mcg", "mul1")
"""Codebook names as the checkpoint's ``quantization_config['codebook']`` spells them."""
NUM_STATES = 1 << 16

INST3_MUL, INST3_ADD = 89226354, 64248484
MCG_MUL = 0xCBAC1FED
MUL1_MUL = 0x83DCD12D
HALVES_MASK, HALVES_XOR = 0x8FFF8FFF, 0x3B603B60
_U32 = 0xFFFFFFFF


def _fp16_from_bits(bits: int) -> float:
    return struct.unpack("<e", bits.to_bytes(2, "little"))[0]


MUL1_K_INV = _fp16_from_bits(0x1EEE)
"""0.00676727294921875, about 1/147.77."""
MUL1_K_BIAS = _fp16_from_bits(0xC931)
"""-10.3828125."""
CODEBOOK_RMS = {"3inst": 1.24371088, "mcg": 1.2441, "mul1": 1.0003}
"""RMS over all 2^16 states (spec §1.4; the test recomputes them). 3INST's value is the
quantizer's ``codebook_scale``; the dummy weights use these to keep activations O(1)."""


def halves_bits(states: torch.Tensor, codebook: str) -> torch.Tensor:
    """3INST / MCG: the masked 32-bit word whose two halves are the fp16 addends."""
    if codebook == "3inst":
        x = (states * INST3_MUL + INST3_ADD) & _U32
    elif codebook == "mcg":
        x = (states * MCG_MUL) & _U32
    else:
        raise ValueError(f"{codebook!r} is not a two-halves codebook")
    return (x & HALVES_MASK) ^ HALVES_XOR


def mul1_byte_sum(states: torch.Tensor) -> torch.Tensor:
    """MUL1: the sum of the four bytes of ``s * 0x83DCD12D mod 2^32`` (0..1020)."""
    x = (states * MUL1_MUL) & _U32
    return (x & 0xFF) + ((x >> 8) & 0xFF) + ((x >> 16) & 0xFF) + (x >> 24)


def _half_from_u16(bits: torch.Tensor) -> torch.Tensor:
    """Reinterpret unsigned 16-bit values (in int64) as fp16."""
    # Map 0..65535 onto the int16 range first: casting an out-of-range int64 is not portable.
    return ((bits ^ 0x8000) - 0x8000).to(torch.int16).view(torch.float16)


def decode_states(states: torch.Tensor, codebook: str) -> torch.Tensor:
    """fp16 codebook values of int64 16-bit ``states`` (any shape), by the formulas above."""
    states = states.to(torch.int64)
    if codebook == "mul1":
        h = (1024 + mul1_byte_sum(states)).to(torch.float32)
        return (h * MUL1_K_INV + MUL1_K_BIAS).to(torch.float16)
    if codebook not in CODEBOOKS:
        raise ValueError(f"unknown EXL3 codebook {codebook!r} (known: {', '.join(CODEBOOKS)})")
    x = halves_bits(states, codebook)
    lo = _half_from_u16(x & 0xFFFF).to(torch.float32)
    hi = _half_from_u16(x >> 16).to(torch.float32)
    return (lo + hi).to(torch.float16)


@lru_cache(maxsize=16)
def codebook_table(codebook: str, device: str = "cpu") -> torch.Tensor:
    """All 2^16 values of a codebook (fp16), indexed by state: decoding is then one gather."""
    return decode_states(torch.arange(NUM_STATES, device=device), codebook)
