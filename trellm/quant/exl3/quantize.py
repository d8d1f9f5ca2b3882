"""``trellm quantize``: a dense model (HF directory or GGUF) -> an EXL3 directory.

The model runs layer by layer on calibration text (trellm's own model code, in
float32). For each decoder layer:

1. one forward over all calibration rows captures the input Hessians
   ``H = X^T X`` of its four input groups (q/k/v share one, gate/up share one);
2. its seven projections are quantized together (``quantize_linear.py``);
3. the result is saved to the work directory, decoded back into the dense model,
   and the calibration states are advanced through the *quantized* layer, so each
   layer is quantized against what its quantized predecessors actually produce
   (as ExLlamaV3 does).

Then the head (at ``head_bits``, unless 16), from the final norm's outputs. A restart
replays the saved layers (decode, advance) instead of quantizing them again; every
random choice is seeded per layer, so the result is the same as an uninterrupted run.
"""
from __future__ import annotations

import hashlib
import logging
import time
import zlib
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from trellm import __version__
from trellm.attention.torch_paged import AttentionMetadata, PrefillSeq, TorchPagedAttention
from trellm.loader.checkpoint import open_checkpoint
from trellm.model.config import ArchConfig
from trellm.model.llama import LlamaForCausalLM
from trellm.quant.exl3.codebook import CODEBOOKS
from trellm.quant.exl3.method import DENSE_HEAD_BITS
from trellm.quant.exl3.quantize_io import WorkDir, storable, unquantized_tensors, write_model
from trellm.quant.exl3.quantize_linear import (LinearQuantOptions, LinearToQuantize, prepare_hessian,
                                               quantize_linears, tile_count)
from trellm.quant.exl3.reference import dense_weight
from trellm.quant.exl3.viterbi import ViterbiOptions
from trellm.quant.exl3.weight import EXL3Weight

log = logging.getLogger("trellm")

KV_BLOCK = 16
TOKENS_PER_FORWARD = 16384
"""Calibration rows run through a layer in groups of about this many tokens."""


@dataclass(frozen=True)
class QuantizeOptions:
    bits: int
    """Decoder bits per weight, 1..8."""
    head_bits: int = 6
    """The LM head's K; 16 keeps it fp16."""
    codebook: str = "mul1"
    """ExLlamaV3's default (spec §1.5); 'mcg' and '3inst' also load."""
    calibration: str | None = None
    """Calibration text file; None: trellm/data/calibration.txt."""
    calib_rows: int = 32
    calib_cols: int = 512
    seed: int = 0
    device: str = "auto"
    scale_samples: int = 48
    viterbi: ViterbiOptions = ViterbiOptions()
    progress: bool = True

    def validate(self) -> None:
        if not (1 <= self.bits <= 8 and float(self.bits).is_integer()):
            raise ValueError(f"--bits must be an integer 1..8, got {self.bits}")
        if not (1 <= self.head_bits <= 8 or self.head_bits == DENSE_HEAD_BITS):
            raise ValueError(f"--head-bits must be 1..8 or 16 (fp16 head), got {self.head_bits}")
        if self.codebook not in CODEBOOKS:
            raise ValueError(f"--codebook must be one of {', '.join(CODEBOOKS)}")
        if self.calib_rows < 1 or self.calib_cols < 16:
            raise ValueError("--calib-rows must be >= 1 and --calib-cols >= 16")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"--device must be auto, cpu or cuda, got {self.device!r}")

    def linear(self, bits: int) -> LinearQuantOptions:
        return LinearQuantOptions(bits=bits, codebook=self.codebook, viterbi=self.viterbi,
                                  scale_samples=self.scale_samples, seed=self.seed)


@dataclass(frozen=True)
class QuantizeResult:
    out_dir: Path
    seconds: float
    resumed_parts: int
    """Layers (and head) taken from an earlier, interrupted run."""
    stats: dict = field(repr=False)


def calibration_text(path: str | None) -> str:
    if path is None:
        from trellm.data import data_path

        return data_path("calibration.txt").read_text(encoding="utf-8")
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read calibration text {path}: {e}") from None


def calibration_ids(tokenizer, text: str, rows: int, cols: int) -> torch.Tensor:
    """[rows, cols] token ids: rows of consecutive tokens spread evenly over ``text``
    (so they sample all of it, prose and code), fewer rows if it is short."""
    ids = torch.tensor(tokenizer.encode(text, add_special_tokens=False))
    have = ids.numel() // cols
    if have == 0:
        raise ValueError(f"the calibration text has {ids.numel()} tokens, fewer than one row of {cols}")
    if have < rows:
        log.warning("calibration text gives %d rows of %d tokens (asked for %d)", have, cols, rows)
    rows = min(rows, have)
    starts = torch.linspace(0, ids.numel() - cols, rows).long() if rows > 1 else torch.zeros(1, dtype=torch.long)
    return torch.stack([ids[s:s + cols] for s in starts.tolist()])


def _manifest(options: QuantizeOptions, source: str, text: str) -> dict:
    """What determines the output: a restart must match it exactly."""
    v = options.viterbi
    return {"trellm": __version__, "source": source, "bits": options.bits, "head_bits": options.head_bits,
            "codebook": options.codebook, "calib_rows": options.calib_rows, "calib_cols": options.calib_cols,
            "calibration_sha256": hashlib.sha256(text.encode()).hexdigest(), "seed": options.seed,
            "scale_samples": options.scale_samples, "wrap_window": v.wrap_window,
            "normalize_every": v.normalize_every, "cost_dtype": str(v.cost_dtype)}


def _seed(base: int, name: str) -> int:
    return (base * 1_000_003 + zlib.crc32(name.encode())) & 0x7FFFFFFF


# ---- the calibration forward ---------------------------------------------------------------------


class Calibration:
    """Hidden states of all calibration rows ([rows * cols, hidden], float32) and the
    forward of one decoder layer over them with a throwaway paged KV cache."""

    def __init__(self, model: LlamaForCausalLM, ids: torch.Tensor, device: torch.device):
        self.model = model
        self.rows, self.cols = ids.shape
        self.device = device
        self.backend = TorchPagedAttention()
        with torch.inference_mode():
            self.x = model.embed_tokens(ids.to(device).reshape(-1)).float()
        self.group = max(1, TOKENS_PER_FORWARD // self.cols)
        cfg = model.cfg
        self.blocks_per_row = -(-self.cols // KV_BLOCK)
        self.cache = torch.zeros(2, self.group * self.blocks_per_row, KV_BLOCK, cfg.num_kv_heads, cfg.head_dim,
                                 device=device)

    @torch.inference_mode()
    def forward(self, layer: torch.nn.Module) -> torch.Tensor:
        """The layer's output for every row (the states are not changed)."""
        from trellm.worker.model_runner import ForwardContext

        out = torch.empty_like(self.x)
        for first in range(0, self.rows, self.group):
            n = min(self.group, self.rows - first)
            tokens = slice(first * self.cols, (first + n) * self.cols)
            positions = torch.arange(self.cols, device=self.device).repeat(n)
            meta = AttentionMetadata(
                slot_mapping=torch.cat([r * self.blocks_per_row * KV_BLOCK + torch.arange(self.cols, device=self.device)
                                        for r in range(n)]),
                decode=None, block_size=KV_BLOCK,
                prefills=[PrefillSeq(r * self.cols, self.cols, self.cols,
                                     torch.arange(r * self.blocks_per_row, (r + 1) * self.blocks_per_row,
                                                  device=self.device)) for r in range(n)])
            ctx = ForwardContext(self.backend, [self.cache] * len(self.model.layers), meta)
            ctx.cos_sin = layer.self_attn.rope.cos_sin(positions, self.x.dtype)
            out[tokens] = layer(self.x[tokens], positions, ctx)
        return out

    def advance(self, layer: torch.nn.Module) -> None:
        self.x = self.forward(layer)

    def hessians(self, modules: dict[str, torch.nn.Module], run: Callable[[], object]) -> dict:
        """Sum of x^T x over the inputs each module sees while ``run()`` executes. Each
        module's ``forward`` is shadowed by an instance attribute that records, not hooked:
        the model runs its submodules through ``.forward`` (model/llama.py), so hooks of
        ``Module.__call__`` would never fire."""
        acc = {name: [torch.zeros(m.in_features, m.in_features, device=self.device), 0]
               for name, m in modules.items()}
        for name, m in modules.items():
            m.forward = partial(_recording, acc[name], type(m).forward.__get__(m))
        try:
            run()
        finally:
            for m in modules.values():
                del m.forward
        return acc


def _recording(slot: list, forward: Callable, x: torch.Tensor) -> torch.Tensor:
    _accumulate(slot, x)
    return forward(x)


def _accumulate(slot: list, x: torch.Tensor) -> None:
    x = x.reshape(-1, x.shape[-1]).float()
    finite = torch.isfinite(x).all(dim=1)
    if not bool(finite.all()):
        x = x[finite]  # a non-finite row would poison the whole Hessian
    slot[0].addmm_(x.t(), x)
    slot[1] += x.shape[0]


# ---- one decoder layer ----------------------------------------------------------------------------


def _projections(model: LlamaForCausalLM, i: int) -> list[tuple[str, torch.nn.Module, int | None, str]]:
    """(HF module key, trellm module, shard in a merged module, Hessian group)."""
    attn, mlp = model.layers[i].self_attn, model.layers[i].mlp
    p = f"model.layers.{i}."
    return [(p + "self_attn.q_proj", attn.qkv_proj, 0, "qkv"), (p + "self_attn.k_proj", attn.qkv_proj, 1, "qkv"),
            (p + "self_attn.v_proj", attn.qkv_proj, 2, "qkv"), (p + "self_attn.o_proj", attn.o_proj, None, "o"),
            (p + "mlp.gate_proj", mlp.gate_up_proj, 0, "gate_up"), (p + "mlp.up_proj", mlp.gate_up_proj, 1, "gate_up"),
            (p + "mlp.down_proj", mlp.down_proj, None, "down")]


def _rows(module: torch.nn.Module, shard: int | None) -> slice:
    if shard is None:
        return slice(0, module.out_features)
    return slice(module.offsets[shard], module.offsets[shard] + module.out_sizes[shard])


def quantize_layer(model: LlamaForCausalLM, i: int, calib: Calibration, options: QuantizeOptions,
                   on_chunk: Callable[[int], None] | None) -> tuple[dict[str, torch.Tensor], dict]:
    layer = model.layers[i]
    groups = {"qkv": layer.self_attn.qkv_proj, "o": layer.self_attn.o_proj,
              "gate_up": layer.mlp.gate_up_proj, "down": layer.mlp.down_proj}
    sums = calib.hessians(groups, lambda: calib.forward(layer))
    prepared = {name: prepare_hessian(h, count, _seed(options.seed, f"{i}.{name}"))
                for name, (h, count) in sums.items()}
    items = []
    for key, module, shard, group in _projections(model, i):
        rows = _rows(module, shard)
        bias = None if module.bias is None else module.bias.detach()[rows]
        items.append((LinearToQuantize(key, module.weight.detach()[rows], bias), prepared[group]))
    results = quantize_linears(items, options.linear(options.bits), on_chunk)
    tensors = {name: t for r in results for name, t in r.tensors.items()}
    stats = {r.key: {"scale": r.scale, "proxy_error": r.proxy_error} for r in results}
    return tensors, stats


def apply_layer(model: LlamaForCausalLM, i: int, tensors: dict[str, torch.Tensor]) -> None:
    """Decode a layer's EXL3 tensors into the dense model's weights (and fp16 biases)."""
    device = model.embed_tokens.weight.device
    for key, module, shard, _ in _projections(model, i):
        parts = {n.removeprefix(key + "."): t.to(device) for n, t in tensors.items() if n.startswith(key + ".")}
        rows = _rows(module, shard)
        w = EXL3Weight.from_tensors(parts, module.in_features, rows.stop - rows.start)
        with torch.no_grad():
            module.weight[rows] = dense_weight(w).to(module.weight.dtype)
            if w.bias is not None:
                module.bias[rows] = w.bias.to(module.bias.dtype)


# ---- the whole model ------------------------------------------------------------------------------


def _dense_model(ckpt, arch: ArchConfig, device: torch.device, cols: int) -> LlamaForCausalLM:
    from trellm.model.registry import get_model_class

    cls = get_model_class(arch.architecture)
    with torch.device(device):
        model = cls(arch, torch.float32, cols)
    try:
        model.load_weights(ckpt.tensors())
    except ValueError as e:
        raise ValueError(f"cannot load weights from {ckpt.source}: {e}") from None
    return model.eval()


def _open(model: str):
    from trellm.loader.errors import ModelLoadError

    ckpt = open_checkpoint(model, keep_q4=False)
    if ckpt.dummy:
        raise ModelLoadError(f"{ckpt.source} has no weights to quantize")
    arch = ArchConfig.from_hf(ckpt.hf_config)
    if arch.quantization_config:
        raise ModelLoadError(f"{ckpt.source} is already quantized "
                             f"({arch.quantization_config.get('quant_method')}); quantize a dense model")
    if ckpt.tokenizer is None:
        raise ModelLoadError(f"{ckpt.source} has no tokenizer (needed for the calibration text)")
    return ckpt, arch


def quantize_model(model: str, out_dir: str | Path, options: QuantizeOptions,
                   on_layer_done: Callable[[int, bool], None] | None = None) -> QuantizeResult:
    """Quantize ``model`` ('' = the embedded default) into ``out_dir``. ``on_layer_done(i,
    resumed)`` runs after decoder layer i is saved (or replayed from an earlier run)."""
    from trellm.worker.builder import resolve_device

    options.validate()
    t0 = time.perf_counter()
    out = Path(out_dir)
    ckpt, arch = _open(model)
    source = str(Path(ckpt.source).resolve())  # the manifest must match however the path is spelled
    text = calibration_text(options.calibration)
    work = WorkDir(out)
    resuming = work.open(_manifest(options, source, text))
    device = resolve_device(options.device)
    net = _dense_model(ckpt, arch, device, options.calib_cols)
    calib = Calibration(net, calibration_ids(ckpt.tokenizer, text, options.calib_rows, options.calib_cols), device)
    log.info("quantizing %s to %d bits (head %d) on %s: %d calibration rows of %d tokens%s", source, options.bits,
             options.head_bits, device, calib.rows, calib.cols, "; resuming" if resuming else "")
    bar = _progress(net, options, work)
    stats: dict = {"options": _manifest(options, source, text), "layers": {}}
    resumed = 0
    try:
        for i in range(len(net.layers)):
            name = f"layer-{i:03d}"
            was_done = work.has(name)
            if was_done:
                tensors, stats["layers"][i] = work.load(name)
                resumed += 1
            else:
                t = time.perf_counter()
                tensors, layer_stats = quantize_layer(net, i, calib, options, bar.update)
                stats["layers"][i] = {**layer_stats, "seconds": round(time.perf_counter() - t, 3)}
                work.save(name, tensors, stats["layers"][i])
            apply_layer(net, i, tensors)
            calib.advance(net.layers[i])
            if on_layer_done is not None:
                on_layer_done(i, was_done)
        head, stats["head"], head_resumed = _head(net, calib, options, work, bar)
        resumed += head_resumed
    finally:
        bar.close()
    tensors = _collect(net, work, options, head)
    stats["seconds"] = round(time.perf_counter() - t0, 3)
    qc = {"quant_method": "exl3", "version": __version__, "bits": float(options.bits),
          "head_bits": options.head_bits, "calibration": {"rows": calib.rows, "cols": calib.cols},
          "out_scales": "always", "codebook": options.codebook, "quantizer": "trellm"}
    write_model(out, tensors, ckpt, source, qc, stats)
    work.remove()
    return QuantizeResult(out, stats["seconds"], resumed, stats)


def _progress(net: LlamaForCausalLM, options: QuantizeOptions, work: WorkDir) -> tqdm:
    total = done = 0
    for i, layer in enumerate(net.layers):
        tiles = sum(tile_count(r.stop - r.start, m.in_features)
                    for _, m, s, _ in _projections(net, i) for r in [_rows(m, s)])
        total += tiles
        done += tiles if work.has(f"layer-{i:03d}") else 0
    if options.head_bits < DENSE_HEAD_BITS:
        tiles = tile_count(net.cfg.vocab_size, net.cfg.hidden_size)
        total += tiles
        done += tiles if work.has("head") else 0
    return tqdm(total=total, initial=done, unit="tile", desc="EXL3 quantize", disable=not options.progress,
                smoothing=0.05)


def _head(net: LlamaForCausalLM, calib: Calibration, options: QuantizeOptions, work: WorkDir, bar: tqdm):
    """The LM head's EXL3 tensors (None at 16 bits), its stats, and whether they were resumed."""
    if options.head_bits >= DENSE_HEAD_BITS:
        return None, None, 0
    if work.has("head"):
        tensors, stats = work.load("head")
        return tensors, stats, 1
    with torch.inference_mode():
        normed = net.norm(calib.x)
        h = normed.t() @ normed
    weight = net.embed_tokens.weight if net.lm_head is None else net.lm_head.weight
    prepared = prepare_hessian(h, normed.shape[0], _seed(options.seed, "head"))
    (result,) = quantize_linears([(LinearToQuantize("lm_head", weight.detach()), prepared)],
                                 options.linear(options.head_bits), bar.update)
    stats = {"lm_head": {"scale": result.scale, "proxy_error": result.proxy_error}}
    work.save("head", result.tensors, stats)
    return result.tensors, stats, 0


def _collect(net: LlamaForCausalLM, work: WorkDir, options: QuantizeOptions, head: dict | None) -> dict:
    """Every output tensor on the CPU: the layers' EXL3 tensors, the dense rest."""
    tensors: dict[str, torch.Tensor] = {}
    for i in range(len(net.layers)):
        tensors.update(work.load(f"layer-{i:03d}")[0])
    dense_head = options.head_bits >= DENSE_HEAD_BITS
    for name, t in unquantized_tensors(net, dense_head):
        tensors[name] = storable(t.detach().cpu())
    if head is not None:
        tensors.update(head)
    return tensors


def options_dict(options: QuantizeOptions) -> dict:
    """For reports: the options as plain JSON values."""
    d = asdict(options)
    d["viterbi"] = {k: str(v) if isinstance(v, torch.dtype) else v for k, v in d["viterbi"].items()}
    return d
