"""Choosing the EXL3 path from ``--quantization`` / ``--bits``, and random EXL3 weights.

``dummy:<config.json> --quantization exl3 --bits K`` builds a model whose decoder
linears (and LM head, at the config's ``head_bits``) are seeded random trellises:
enough to measure kernel speed on real shapes without a converted checkpoint.
Random bits are valid EXL3: every bit pattern decodes, and uniform states give
near-Gaussian codebook values.
"""
from __future__ import annotations

from typing import Iterator

import torch

from trellm.quant.exl3.codebook import CODEBOOK_RMS, MCG_MUL, MUL1_MUL
from trellm.quant.exl3.method import DENSE_HEAD_BITS, EXL3Config
from trellm.quant.exl3.weight import check_bits, padded
from trellm.quant.gguf_int4 import is_linear_weight


def resolve_quantization_config(qc: dict | None, quantization: str, bits: float | None,
                                dummy: bool) -> dict | None:
    """The ``quantization_config`` the model is built with.

    * an EXL3 checkpoint: as is; with ``--quantization none`` the same tensors are
      decoded once into dense weights (``exl3_dense``);
    * a dummy model with ``--quantization exl3`` (or an EXL3 config): random EXL3
      weights of ``--bits`` (else the config's ``bits``) per weight; ``none``: dense;
    * anything else is left alone.

    Raises ValueError for combinations that cannot mean anything.
    """
    is_exl3 = (qc or {}).get("quant_method") == "exl3"
    if quantization == "exl3" and not (is_exl3 or dummy):
        raise ValueError("--quantization exl3 needs an EXL3 checkpoint (quantization_config.quant_method "
                         "'exl3') or a dummy: model; make one with `trellm quantize MODEL --bits B --out DIR`")
    if not dummy and bits is not None:
        raise ValueError("--bits only applies to dummy: models (a checkpoint's bits are its own)")
    if not is_exl3 and quantization != "exl3":
        return qc
    if quantization == "none":
        return None if dummy else {**qc, "quant_method": "exl3_dense"}
    if not dummy:
        return qc
    base = qc if is_exl3 else {}
    k = bits if bits is not None else base.get("bits")
    if k is None:
        raise ValueError("a dummy EXL3 model needs --bits K (1..8)")
    config = EXL3Config.from_dict({**base, "bits": k})
    check_bits(float(k), config.codebook)
    return {"quant_method": "exl3", "bits": float(k), "head_bits": config.head_bits,
            "codebook": config.codebook}


def random_exl3_tensors(key: str, in_features: int, out_features: int, bits: float, codebook: str,
                        generator: torch.Generator, device: torch.device | str = "cpu"
                        ) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint tensors of one random EXL3 projection, named ``<key>.trellis`` etc.

    suh = +-1 / (sqrt(in_p) * codebook RMS), svh = +-1: the Hadamards are orthonormal,
    so the weight's entries have RMS about 1/sqrt(in), as the dense dummy weights do.
    """
    check_bits(bits, codebook)
    in_p, out_p = padded(in_features), padded(out_features)

    def signs(n: int) -> torch.Tensor:
        return torch.randint(0, 2, (n,), generator=generator, device=device).float() * 2 - 1

    words = int(16 * bits)
    yield f"{key}.trellis", torch.randint(-32768, 32768, (in_p // 16, out_p // 16, words), generator=generator,
                                          device=device, dtype=torch.int16)
    yield f"{key}.suh", (signs(in_p) / (in_p ** 0.5 * CODEBOOK_RMS[codebook])).half()
    yield f"{key}.svh", signs(out_p).half()
    if codebook != "3inst":
        marker = MCG_MUL if codebook == "mcg" else MUL1_MUL
        # Stored as int32 (the multiplier's bit pattern); only the name matters when loading.
        yield f"{key}.{codebook}", torch.tensor(marker - (1 << 32), dtype=torch.int32, device=device)


def dummy_exl3_weights(dense: Iterator[tuple[str, torch.Tensor]], arch, seed: int,
                       device: torch.device | str = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """The model's dummy weights with every decoder linear weight (and the LM head unless
    ``head_bits`` is 16) replaced by a random EXL3 projection of the same shape."""
    config = EXL3Config.from_dict(arch.quantization_config or {})
    if config.bits is None:
        raise ValueError("dummy EXL3 weights need quantization_config['bits']")
    g = torch.Generator(device=device).manual_seed(seed + 1)
    head_quantized = config.head_bits < DENSE_HEAD_BITS
    for name, tensor in dense:
        if is_linear_weight(name) or (head_quantized and name == "lm_head.weight"):
            bits = config.bits if name != "lm_head.weight" else config.head_bits
            out_f, in_f = tensor.shape
            yield from random_exl3_tensors(name.removesuffix(".weight"), in_f, out_f, bits, config.codebook,
                                           g, device)
        else:
            yield name, tensor
    if head_quantized and arch.tie_word_embeddings:
        # The dense generator yields no head for tied embeddings, but a quantized head is its own tensor.
        yield from random_exl3_tensors("lm_head", arch.hidden_size, arch.vocab_size, config.head_bits,
                                       config.codebook, g, device)
