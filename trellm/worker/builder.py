"""Load a model, size the KV pool from the memory budget, build the runner."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

import torch

from trellm.attention.registry import get_attention_backend
from trellm.config import EngineConfig
from trellm.kernels import fused_ops
from trellm.loader.checkpoint import Checkpoint, open_checkpoint
from trellm.loader.errors import ModelLoadError
from trellm.model.config import ArchConfig
from trellm.model.registry import get_model_class
from trellm.quant.exl3.loading import dummy_exl3_weights, resolve_quantization_config
from trellm.quant.gguf_int4 import Q4_TYPES, Q4Tensor, cache_dense_weight, is_linear_weight
from trellm.quant.int8 import int8_quantization_config
from trellm.worker.cuda_graph import BUCKETS, DecodeGraphs
from trellm.worker.memory_profile import profile_step_bytes
from trellm.worker.model_runner import ModelRunner

log = logging.getLogger("trellm")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class WorkerInfo:
    """What the engine needs to know about the loaded model and its cache."""

    runner: ModelRunner
    checkpoint: Checkpoint
    arch: ArchConfig
    max_model_len: int
    num_blocks: int
    block_size: int
    device: torch.device
    dtype: torch.dtype
    load_seconds: float

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("--device cuda was asked for but no CUDA GPU is available")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


def build_worker(config: EngineConfig) -> WorkerInfo:
    t0 = time.perf_counter()
    mc, cc = config.model, config.cache
    device = resolve_device(mc.device)
    dtype = resolve_dtype(mc.dtype, device)
    # The int4 kernel is CPU-only; elsewhere Q4 weights are dequantized as before.
    keep_q4 = mc.quantization == "auto" and device.type == "cpu"
    ckpt = open_checkpoint(mc.model, load_workers=mc.load_workers, keep_q4=keep_q4)
    try:
        arch = ArchConfig.from_hf(ckpt.hf_config)
    except ValueError as e:
        raise ModelLoadError(f"invalid model config: {e}") from None
    try:
        arch = replace(arch, quantization_config=resolve_quantization_config(
            arch.quantization_config, mc.quantization, mc.bits, ckpt.dummy))
        if mc.quantization == "int8":
            arch = replace(arch, quantization_config=int8_quantization_config(arch.quantization_config))
    except ValueError as e:
        raise ModelLoadError(f"{ckpt.source}: {e}") from None
    packed = keep_q4 and _all_linears_q4(ckpt)
    if packed:
        arch = replace(arch, quantization_config={"quant_method": "gguf_q4"})
    if mc.max_model_len is not None and mc.max_model_len > arch.max_position_embeddings:
        # As vLLM: positions past the trained context are not something to run silently.
        raise ModelLoadError(f"--max-model-len {mc.max_model_len} exceeds the model's context length "
                             f"{arch.max_position_embeddings} (max_position_embeddings in {ckpt.source})")
    max_len = mc.max_model_len or arch.max_position_embeddings
    model = _load_model(ckpt, arch, dtype, device, max_len, mc.seed, dequantize_q4=keep_q4 and not packed)
    if packed:
        # The int4 linears already take bf16 activations; the LM head follows in int8.
        model.use_int8_lm_head()
        _cache_prefill_weights(model, mc.prefill_weight_cache_memory)
    backend = get_attention_backend(device, dtype)
    # CUDA + Triton: the model's fused-kernel path, then decode graphs.
    ops = fused_ops(device) if backend.name == "triton" else None
    num_blocks = _num_blocks(config, arch, dtype, device,
                             lambda: profile_step_bytes(model, backend, ops, config.scheduler.max_num_batched_tokens,
                                                        cc.block_size, arch.num_kv_heads, arch.head_dim,
                                                        arch.num_layers, dtype, device, max_len))
    shape = (2, num_blocks, cc.block_size, arch.num_kv_heads, arch.head_dim)
    try:
        kv_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(arch.num_layers)]
    except (RuntimeError, MemoryError) as e:  # torch raises RuntimeError (or OutOfMemoryError) when it cannot
        raise ModelLoadError(f"cannot allocate the KV cache ({num_blocks} blocks of "
                             f"{_bytes_per_block(config, arch, dtype) / 2**20:.2f} MiB): "
                             f"{str(e).splitlines()[0]}; lower --kv-cache-memory") from None
    eos = frozenset(arch.eos_token_ids) | (ckpt.tokenizer.eos_token_ids if ckpt.tokenizer else frozenset())
    if device.type == "cpu":
        _pin_module_attributes(model)
    runner = ModelRunner(model, backend, kv_caches, cc.block_size, eos, device)
    # A request must fit in the pool on its own, or it could never be scheduled.
    max_len = min(max_len, num_blocks * cc.block_size)
    if ops is not None:
        runner.ops = ops
        _calibrate_gemv(model)
        if not mc.enforce_eager:
            runner.graphs = DecodeGraphs(model, backend, kv_caches, cc.block_size, max_len,
                                         min(config.scheduler.max_num_seqs, BUCKETS[-1]), device,
                                         ops=runner.ops).capture()
    info = WorkerInfo(runner, ckpt, arch, max_len, num_blocks, cc.block_size, device, dtype,
                      time.perf_counter() - t0)
    log.info("loaded %s (%s, %s, %s%s) in %.1fs; KV cache: %d blocks = %d tokens; context %d",
             ckpt.source, arch.architecture, device.type, str(dtype).removeprefix("torch."),
             ", int4 linear weights" if packed else _quant_note(arch), info.load_seconds, num_blocks,
             info.kv_capacity_tokens, max_len)
    return info


def _pin_module_attributes(model: torch.nn.Module) -> None:
    """Each module's parameters, buffers and submodules also as plain instance attributes.

    Why: ``self.weight`` on a Module misses the instance dict and runs
    ``Module.__getattr__`` (~0.5 us); a CPU decode step of the default model reads ~700
    of them, ~0.5 ms of a ~14 ms step (median step time, scripts/cpu_decode_ab.py).
    Called once the model is final (loaded, repacked): assigning a new Parameter or
    submodule later drops the pinned copy (Module.__setattr__ clears the instance dict's
    entry), but a deleted or reassigned buffer would leave it stale, so nothing may."""
    for module in model.modules():
        for table in (module._parameters, module._buffers, module._modules):
            module.__dict__.update((k, v) for k, v in table.items() if v is not None)


def _calibrate_gemv(model: torch.nn.Module) -> None:
    """CUDA: time our skinny-GEMM kernel against cuBLAS on each dense weight shape at
    decode row counts, and let the linears (and the LM head) use it where it wins."""
    from trellm.kernels.gemv import GemvDispatch
    from trellm.quant.base import UnquantizedLinearMethod

    # Exactly the dense method: subclasses may keep other weight formats.
    linears = [m for m in model.modules() if type(getattr(m, "method", None)) is UnquantizedLinearMethod]
    head = model.lm_head.weight if isinstance(model.lm_head, torch.nn.Linear) else (
        model.embed_tokens.weight if model.lm_head is None else None)
    weights = [m.weight for m in linears] + ([head] if head is not None else [])
    if not weights:
        return
    try:
        dispatch = GemvDispatch().calibrate(weights)
    except Exception as e:  # a kernel that fails to build must not stop the engine: cuBLAS it is
        log.warning("skinny-GEMM kernel unavailable (%s); using cuBLAS", str(e).splitlines()[0])
        return
    # Gated MLPs (a merged gate_up, then down_proj) whose down projection is dense: the
    # candidates for SiLU-and-mul fused into the down projection's GEMV.
    dense = {id(m) for m in linears}
    down = [m.down_proj.weight for m in model.modules()
            if hasattr(m, "gate_up_proj") and id(getattr(m, "down_proj", None)) in dense]
    try:
        dispatch.calibrate_glu(down)
    except Exception as e:  # the fused variant failing must not cost the plain GEMV choices
        log.warning("fused SiLU-and-mul GEMV unavailable (%s); unfused MLP", str(e).splitlines()[0])
        dispatch.use_glu.clear()
    _calibrate_norm(model, dispatch, dense)
    for m in linears:
        m.method.gemv_dispatch = dispatch
    model.gemv_dispatch = dispatch


def _calibrate_norm(model: torch.nn.Module, dispatch, dense: set[int]) -> None:
    """TRELLM_GEMV_NORM=1: the dense qkv and gate_up projections' candidates for the
    RMSNorm before them (and its residual add) fused into their GEMV (model/llama.py,
    norm_linear)."""
    from trellm.kernels import gemv as g

    if not g.NORM:
        return
    cases = [m.qkv_proj.weight for m in model.modules() if id(getattr(m, "qkv_proj", None)) in dense]
    cases += [m.gate_up_proj.weight for m in model.modules() if id(getattr(m, "gate_up_proj", None)) in dense]
    try:
        g.calibrate_norm(dispatch, cases)
    except Exception as e:  # as for the GLU variant: the plain choices stand
        log.warning("GEMV with the RMSNorm fused in unavailable (%s); unfused", str(e).splitlines()[0])
        dispatch.use_norm.clear()


def _quant_note(arch: ArchConfig) -> str:
    method = (arch.quantization_config or {}).get("quant_method")
    return f", {method} linear weights" if method else ""


def _cache_prefill_weights(model: torch.nn.Module, budget: int) -> None:
    """Float32 copies of the int4 linears for prefill, if all of them fit the budget:
    a prefill step then skips dequantizing the whole model (~a fifth of a 128-token
    prompt's time for the default model)."""
    layers = [m for m in model.modules() if getattr(m, "q4_nibbles", None) is not None]
    need = sum(m.q4_nibbles.numel() * 2 * 4 for m in layers)
    if not layers or need > budget:
        return
    for m in layers:
        cache_dense_weight(m)
    log.info("prefill: float32 copies of the int4 linear weights kept (%.0f MiB)", need / 2**20)


def _step_bytes(config: EngineConfig, arch: ArchConfig, profile_step) -> int:
    """Memory a full step needs beside weights and KV: measured by a profiling forward,
    or (if that fails) a rough bound: float32 logits plus a few hidden-sized buffers
    per batched token."""
    try:
        return profile_step()
    except (RuntimeError, ValueError) as e:  # e.g. out of memory: fall back, say so
        log.warning("profiling forward failed (%s); estimating activation memory", str(e).splitlines()[0])
        torch.cuda.empty_cache()
        return config.scheduler.max_num_batched_tokens * (arch.vocab_size * 4 + arch.intermediate_size * 12)


def _all_linears_q4(ckpt: Checkpoint) -> bool:
    """Whether every decoder-layer linear weight of the file is Q4_0/Q4_1 (so all of
    them can be kept packed). Mixed files fall back to dense weights, for simplicity."""
    linear = {t for n, t in ckpt.tensor_types.items() if is_linear_weight(n)}
    if not linear:
        return False  # not a GGUF (no recorded types): nothing to keep packed
    other = sorted(linear - set(Q4_TYPES))
    if other:
        log.info("quantization auto: %s has %s linear weights, not only Q4_0/Q4_1; "
                 "dequantizing all of them", ckpt.source, ", ".join(other))
    return not other


def _load_model(ckpt: Checkpoint, arch: ArchConfig, dtype, device, max_len: int, seed: int,
                dequantize_q4: bool = False):
    cls = get_model_class(arch.architecture)
    try:
        with torch.device(device):
            model = cls(arch, dtype, max_len)
    except ValueError as e:  # e.g. a rope_scaling the model cannot use
        raise ModelLoadError(f"{ckpt.source}: {e}") from None
    except (RuntimeError, MemoryError) as e:  # torch's allocation failures (OutOfMemoryError included)
        raise ModelLoadError(f"{ckpt.source}: not enough memory to build the model on {device}: "
                             f"{str(e).splitlines()[0][:160]}") from None
    try:
        if ckpt.dummy:
            from trellm.model.llama import dummy_weights
            weights = dummy_weights(arch, seed, device)
            if (arch.quantization_config or {}).get("quant_method") == "exl3":
                weights = dummy_exl3_weights(weights, arch, seed, device)
            model.load_weights(weights)
        elif dequantize_q4:
            model.load_weights((n, t.dequantize() if isinstance(t, Q4Tensor) else t)
                               for n, t in ckpt.tensors())
        else:
            model.load_weights(ckpt.tensors())
    except ValueError as e:
        raise ModelLoadError(f"cannot load weights from {ckpt.source}: {e}") from None
    return model.eval()


def _bytes_per_block(config: EngineConfig, arch: ArchConfig, dtype: torch.dtype) -> int:
    elem = torch.tensor([], dtype=dtype).element_size()
    return 2 * arch.num_layers * config.cache.block_size * arch.num_kv_heads * arch.head_dim * elem


def _num_blocks(config: EngineConfig, arch: ArchConfig, dtype, device, profile_step) -> int:
    cc = config.cache
    if cc.num_gpu_blocks_override is not None:
        return cc.num_gpu_blocks_override
    per_block = _bytes_per_block(config, arch, dtype)
    if cc.kv_cache_memory is not None:
        budget = cc.kv_cache_memory
    elif device.type == "cuda":
        act = _step_bytes(config, arch, profile_step)
        free, total = torch.cuda.mem_get_info(device)
        budget = int(total * cc.gpu_memory_utilization) - (total - free) - act
    else:
        budget = cc.cpu_kv_cache_default
    blocks = budget // per_block
    if blocks < 1:
        raise ModelLoadError(f"no memory left for the KV cache (budget {budget / 2**20:.0f} MiB, "
                             f"{per_block / 2**20:.2f} MiB per block); lower the context or raise the budget")
    return int(blocks)
