"""The quantizer's files: the resumable work directory and the finished EXL3 model.

Work directory (``OUT/.trellm-quant/``): ``manifest.json`` (the options, so a
restart with different ones is refused rather than mixed), then one safetensors
file per finished decoder layer (``layer-000.safetensors``) and ``head.safetensors``,
each written to a temporary name and renamed, so a crash leaves either a whole file
or none. A restart skips the layers that have a file.

Finished model (ExLlamaV3's layout, spec §1.5 step 10): ``model.safetensors`` (or
``model-0000i-of-0000n.safetensors`` shards + ``model.safetensors.index.json``),
``config.json`` with ``quantization_config`` and ``tie_word_embeddings: false`` (the
head is always stored, as the converter does), ``quantization_config.json``
(``tensor_storage`` per module), the tokenizer files and ``generation_config.json``.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Iterable

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from trellm.loader.checkpoint import Checkpoint
from trellm.quant.exl3.codebook import MCG_MUL, MUL1_MUL

WORK_DIR = ".trellm-quant"
MANIFEST = "manifest.json"
STATS_FILE = "trellm_quantize_stats.json"
SHARD_BYTES = 8 << 30
_PICKLES = (".bin", ".pt", ".pth", ".ckpt")
_SKIPPED = {"config.json", "model.safetensors.index.json", "quantization_config.json", STATS_FILE}


class WorkDir:
    """Per-layer results of a run in progress."""

    def __init__(self, out_dir: Path):
        self.out = out_dir
        self.path = out_dir / WORK_DIR

    def open(self, manifest: dict) -> bool:
        """Create the work directory, or check an existing one against ``manifest``.
        True: resuming. Refuses a non-empty output that is not an unfinished run."""
        existing = self.path / MANIFEST
        if existing.is_file():
            old = json.loads(existing.read_text())
            if old != manifest:
                diff = sorted(k for k in set(old) | set(manifest) if old.get(k) != manifest.get(k))
                raise ValueError(f"{self.out} holds an unfinished quantization with other settings "
                                 f"({', '.join(diff)} differ); finish it with the same options or "
                                 f"choose another --out")
            return True
        if self.out.exists() and any(self.out.iterdir()):
            raise ValueError(f"output directory {self.out} is not empty (and holds no unfinished run)")
        self.path.mkdir(parents=True, exist_ok=True)
        _write_text(existing, json.dumps(manifest, indent=2, sort_keys=True))
        return False

    def part(self, name: str) -> Path:
        return self.path / f"{name}.safetensors"

    def has(self, name: str) -> bool:
        return self.part(name).is_file()

    def save(self, name: str, tensors: dict[str, torch.Tensor], stats: dict) -> None:
        tmp = self.part(name).with_suffix(".tmp")
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp),
                  metadata={"stats": json.dumps(stats)})
        os.replace(tmp, self.part(name))

    def load(self, name: str) -> tuple[dict[str, torch.Tensor], dict]:
        with safe_open(str(self.part(name)), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
            stats = json.loads((f.metadata() or {}).get("stats", "{}"))
        return tensors, stats

    def remove(self) -> None:
        shutil.rmtree(self.path)


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def storable(t: torch.Tensor) -> torch.Tensor:
    """An unquantized tensor as the converter stores it: fp16, or bf16 when fp16 would overflow."""
    if not t.is_floating_point():
        return t
    if t.dtype in (torch.float16, torch.bfloat16):
        return t
    return t.half() if bool(t.abs().max() <= 65504) else t.bfloat16()


def write_model(out: Path, tensors: dict[str, torch.Tensor], ckpt: Checkpoint, source: str,
                quantization_config: dict, stats: dict) -> None:
    """Write the finished model next to the work directory (which the caller removes)."""
    out.mkdir(parents=True, exist_ok=True)
    _write_shards(out, tensors)
    _copy_side_files(out, ckpt, source)
    config = {k: v for k, v in ckpt.hf_config.items() if k != "quantization_config"}
    config.update(tie_word_embeddings=False, torch_dtype="float16", quantization_config=quantization_config)
    _write_text(out / "config.json", json.dumps(config, indent=2))
    storage = tensor_storage(tensors)
    _write_text(out / "quantization_config.json",
                json.dumps({**quantization_config, "tensor_storage": storage}, indent=2))
    _write_text(out / STATS_FILE, json.dumps(stats, indent=2))


def _write_shards(out: Path, tensors: dict[str, torch.Tensor]) -> None:
    """One file, or shards of at most ``SHARD_BYTES`` (a module's tensors stay together)."""
    groups: list[list[str]] = [[]]
    size = 0
    for module, names in _by_module(tensors).items():
        nbytes = sum(tensors[n].numel() * tensors[n].element_size() for n in names)
        if size and size + nbytes > SHARD_BYTES:
            groups.append([])
            size = 0
        groups[-1].extend(names)
        size += nbytes
    weight_map = {}
    for i, names in enumerate(groups):
        name = "model.safetensors" if len(groups) == 1 else f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tmp = out / (name + ".tmp")
        save_file({n: tensors[n].contiguous() for n in names}, str(tmp))
        os.replace(tmp, out / name)
        weight_map.update(dict.fromkeys(names, name))
    if len(groups) > 1:
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        _write_text(out / "model.safetensors.index.json",
                    json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


def _by_module(tensors: dict[str, torch.Tensor]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for name in tensors:
        out.setdefault(name.rsplit(".", 1)[0], []).append(name)
    return out


def tensor_storage(tensors: dict[str, torch.Tensor]) -> dict:
    """``quantization_config.json``'s per-module map, as ExLlamaV3's converter writes it."""
    storage = {}
    for module, names in _by_module(tensors).items():
        entry = {"stored_tensors": {n: {"shape": list(tensors[n].shape),
                                        "n_bytes": tensors[n].numel() * tensors[n].element_size(),
                                        "dtype": str(tensors[n].dtype).removeprefix("torch.")}
                                    for n in names}}
        trellis = tensors.get(f"{module}.trellis")
        if trellis is not None:
            bits = trellis.shape[-1] / 16
            entry.update(quant_format="exl3", bits_per_weight=int(bits) if bits.is_integer() else bits)
            if f"{module}.mul1" in tensors:
                entry["mul1_multiplier"] = MUL1_MUL
            if f"{module}.mcg" in tensors:
                entry["mcg_multiplier"] = MCG_MUL
        storage[module] = entry
    return storage


def _copy_side_files(out: Path, ckpt: Checkpoint, source: str) -> None:
    """Tokenizer and generation files: copied from an HF directory (everything but
    weights and configs), or written from what a GGUF embeds."""
    src = Path(source)
    if src.is_dir():
        for f in sorted(src.iterdir()):
            if (f.is_file() and f.suffix != ".safetensors" and f.suffix not in _PICKLES
                    and f.name not in _SKIPPED and not f.name.startswith(".")):
                shutil.copyfile(f, out / f.name)
        return
    if ckpt.generation_config:
        _write_text(out / "generation_config.json", json.dumps(ckpt.generation_config, indent=2))
    tok = ckpt.tokenizer
    if tok is None:
        return
    _write_text(out / "tokenizer.json", tok.hf.to_str())
    cfg = {"bos_token": tok.bos_token, "eos_token": tok.eos_token,
           "unk_token": _token(tok, tok.unk_token_id), "pad_token": _token(tok, tok.pad_token_id),
           "add_bos_token": tok.add_bos_token, "add_eos_token": False}
    if tok.chat_template:
        cfg["chat_template"] = tok.chat_template
    _write_text(out / "tokenizer_config.json", json.dumps({k: v for k, v in cfg.items() if v is not None}, indent=2))


def _token(tok, token_id: int | None) -> str | None:
    return None if token_id is None else tok.convert_ids_to_tokens(token_id)


def unquantized_tensors(model: torch.nn.Module, head_bits_dense: bool) -> Iterable[tuple[str, torch.Tensor]]:
    """The model's tensors that stay dense, in HF names: embeddings, norms (and the
    head when it is not quantized; for tied embeddings a copy, since the output
    config unties them)."""
    yield "model.embed_tokens.weight", model.embed_tokens.weight
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", layer.input_layernorm.weight
        yield p + "post_attention_layernorm.weight", layer.post_attention_layernorm.weight
        if layer.self_attn.q_norm is not None:
            yield p + "self_attn.q_norm.weight", layer.self_attn.q_norm.weight
            yield p + "self_attn.k_norm.weight", layer.self_attn.k_norm.weight
    yield "model.norm.weight", model.norm.weight
    if head_bits_dense:
        head = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
        yield "lm_head.weight", head
