"""KL divergence of a student model's next-token distributions from a teacher's.

Both models are loaded through the engine's own builder (so ``--quantization`` means
what it means everywhere in trellm) and run directly, one window of ``context``
tokens at a time, on a throwaway KV cache: ``LLM.generate(prompt_logprobs=...)``
would only return a few log-probs per position, and KL needs all of them.

Per scored position (each window predicts its own next tokens; the last position
of a window has no target and is not scored):

* ``KL(teacher || student) = sum_v p(v) (log p(v) - log q(v))``, from float32
  log-softmaxes, summed in float64;
* top-1 agreement: the two argmaxes are the same token;
* each model's negative log-likelihood of the actual next token (-> perplexity).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from trellm.eval.rtn import RTNSpec, apply_rtn, parse_rtn


@dataclass(frozen=True)
class ModelSpec:
    model: str
    """Anything trellm loads ('' = the embedded default)."""
    quantization: str = "none"
    """An engine ``--quantization`` value (none, auto, exl3, int8, ...) or rtnB[gG]."""
    label: str | None = None

    @property
    def name(self) -> str:
        if self.label:
            return self.label
        base = self.model.rstrip("/").rsplit("/", 1)[-1] or "default"
        return base if self.quantization in ("none", "auto") else f"{base} ({self.quantization})"


@dataclass(frozen=True)
class LoadedModel:
    spec: ModelSpec
    model: torch.nn.Module
    backend: object
    ops: object | None
    tokenizer: object | None
    device: torch.device
    dtype: torch.dtype
    method: str
    """What runs the decoder linears: 'dense', 'exl3', 'int8', 'rtn4g32', ..."""
    bpw: float | None
    """Decoder-linear bits per weight (see ``decoder_bpw``); None when unknown."""
    stored_bpw: float | None = None
    """The same with EXL3's padding to 128-wide blocks counted (equal for other methods)."""


@dataclass(frozen=True)
class KLDResult:
    teacher: str
    student: str
    student_model: str
    student_quantization: str
    method: str
    bpw: float | None
    stored_bpw: float | None
    tokens: int
    windows: int
    context: int
    kl_mean: float
    kl_median: float
    kl_p99: float
    kl_max: float
    top1_agreement: float
    ppl_teacher: float
    ppl_student: float
    seconds: float
    per_token_kl: torch.Tensor | None = field(default=None, repr=False, compare=False)

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "per_token_kl"}


def load_model(spec: ModelSpec, device: str = "auto", dtype: str = "float32", context: int = 512) -> LoadedModel:
    """Build the model as the engine would (KV pool kept minimal: the eval brings its own)."""
    from trellm.entrypoints.llm import engine_config_from_kwargs
    from trellm.worker.builder import build_worker

    rtn = parse_rtn(spec.quantization)
    quantization = "none" if rtn is not None else spec.quantization
    config = engine_config_from_kwargs(spec.model, device=device, dtype=dtype, quantization=quantization,
                                       max_model_len=max(context, 16), num_gpu_blocks_override=1,
                                       enforce_eager=True, max_num_batched_tokens=max(context, 16),
                                       prefill_weight_cache_memory=0)
    config.validate()
    worker = build_worker(config)
    model = worker.runner.model
    if rtn is not None:
        apply_rtn(model, rtn)
    method = _method(model, rtn)
    if quantization not in ("none", "auto") and method == "dense":
        raise ValueError(f"--quantization {quantization} left {spec.model or 'the model'} unquantized "
                         f"(no decoder linear uses a quantized method)")
    bpw = stored = decoder_bpw(model, method, rtn)
    if method == "exl3":
        # From the files: the same whether the trellises run as EXL3 or were decoded to dense.
        bpw, stored = exl3_checkpoint_bpw(spec.model, worker.arch)
    return LoadedModel(spec, model, worker.runner.backend, worker.runner.ops, worker.checkpoint.tokenizer,
                       worker.device, worker.dtype, method, bpw, stored)


def _decoder_linears(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for layer in model.layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                   layer.mlp.gate_up_proj, layer.mlp.down_proj)]


def _method(model: torch.nn.Module, rtn: RTNSpec | None) -> str:
    if rtn is not None:
        return rtn.name
    names = {type(m.method).__name__ for m in _decoder_linears(model)}
    known = {"UnquantizedLinearMethod": "dense", "EXL3LinearMethod": "exl3", "EXL3DenseLinearMethod": "exl3",
             "Int8LinearMethod": "int8", "GGUFQ4LinearMethod": "gguf_q4"}
    return "+".join(sorted(known.get(n, n) for n in names))


def decoder_bpw(model: torch.nn.Module, method: str, rtn: RTNSpec | None) -> float | None:
    """Bits per decoder-linear weight: INT8 8 bits + an fp16-sized scale per row; RTN by
    its formula; dense: the bits of the weights as run (32 in float32, whatever the file
    held: a GGUF Q4_1 loaded with ``none`` is dequantized); EXL3 see ``exl3_checkpoint_bpw``.
    The LM head and embeddings are not counted."""
    if rtn is not None:
        return rtn.bpw
    if method == "dense":
        weight = getattr(_decoder_linears(model)[0], "weight", None)
        return float(torch.finfo(weight.dtype).bits) if isinstance(weight, torch.Tensor) else None
    if method == "int8":
        linears = _decoder_linears(model)
        weights = sum(m.in_features * m.out_features for m in linears)
        return sum(m.in_features * m.out_features * 8 + m.out_features * 16 for m in linears) / weights
    return None


_SHAPES = {"q_proj": ("hidden", "q"), "k_proj": ("hidden", "kv"), "v_proj": ("hidden", "kv"),
           "o_proj": ("q", "hidden"), "gate_proj": ("hidden", "inter"), "up_proj": ("hidden", "inter"),
           "down_proj": ("inter", "hidden")}


def exl3_checkpoint_bpw(path: str, arch) -> tuple[float | None, float | None]:
    """EXL3 decoder bits per weight from the checkpoint's tensor shapes: K per weight plus
    the fp16 suh/svh, over the real weights (spec §1.1: ``K + 16 (in + out) / (in out)``);
    and the stored figure, whose trellis covers the sizes padded to 128."""
    from safetensors import safe_open

    from trellm.loader.hf_loader import weight_files

    dims = {"hidden": arch.hidden_size, "q": arch.num_heads * arch.head_dim,
            "kv": arch.num_kv_heads * arch.head_dim, "inter": arch.intermediate_size}
    shapes = {}
    for f in weight_files(Path(path)):
        with safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():
                if k.startswith("model.layers.") and k.endswith((".trellis", ".suh", ".svh")):
                    shapes[k] = sf.get_slice(k).get_shape()
    real = bits = stored = 0.0
    for key in {k.rsplit(".", 1)[0] for k in shapes if k.endswith(".trellis")}:
        ti, to, words = shapes[f"{key}.trellis"]
        in_f, out_f = (dims[d] for d in _SHAPES[key.rsplit(".", 1)[1]])
        real += in_f * out_f
        bits += words / 16 * in_f * out_f + 16 * (in_f + out_f)  # the spec's sizes, unpadded
        stored += ti * to * 256 * words / 16 + 16 * (shapes[f"{key}.suh"][0] + shapes[f"{key}.svh"][0])
    return (bits / real, stored / real) if real else (None, None)


# ---- the forward ---------------------------------------------------------------------------------


@torch.inference_mode()
def window_logits(m: LoadedModel, ids: torch.Tensor) -> torch.Tensor:
    """float32 logits [len(ids), vocab] of one window, through the model's own forward."""
    from trellm.attention.torch_paged import AttentionMetadata, PrefillSeq
    from trellm.worker.model_runner import ForwardContext

    n = ids.shape[0]
    block = 16
    blocks = -(-n // block)
    cfg = m.model.cfg
    kv = torch.zeros(2, blocks, block, cfg.num_kv_heads, cfg.head_dim, dtype=m.dtype, device=m.device)
    meta = AttentionMetadata(slot_mapping=torch.arange(n, device=m.device), decode=None, block_size=block,
                             prefills=[PrefillSeq(0, n, n, torch.arange(blocks, device=m.device))])
    ctx = ForwardContext(m.backend, [kv] * cfg.num_layers, meta, ops=m.ops)
    hidden = m.model(ids.to(m.device), torch.arange(n, device=m.device), ctx)
    return m.model.compute_logits(hidden).float()


def windows(ids: list[int], context: int, bos: int | None) -> list[torch.Tensor]:
    """Consecutive windows of ``context`` tokens (BOS first when the model expects one);
    a last partial window is kept when it scores at least a few positions."""
    body = context - (bos is not None)
    out = []
    for start in range(0, len(ids), body):
        chunk = ids[start:start + body]
        if len(chunk) < 8:
            break
        out.append(torch.tensor(([bos] if bos is not None else []) + chunk))
    return out


def check_same_tokenizer(teacher: LoadedModel, student: LoadedModel, text: str) -> None:
    t_vocab, s_vocab = teacher.model.cfg.vocab_size, student.model.cfg.vocab_size
    if t_vocab != s_vocab:
        raise ValueError(f"teacher and student vocabularies differ ({t_vocab} vs {s_vocab})")
    if teacher.tokenizer is not None and student.tokenizer is not None:
        sample = text[:4000]
        if teacher.tokenizer.encode(sample) != student.tokenizer.encode(sample):
            raise ValueError("teacher and student tokenize the text differently")


def compare(teacher: LoadedModel, student: LoadedModel, ids: list[int], context: int,
            progress: bool = True, keep_per_token: bool = False) -> KLDResult:
    """KL statistics of ``student`` against ``teacher`` over ``ids`` (teacher tokens)."""
    bos = teacher.tokenizer.bos_token_id if teacher.tokenizer is not None and teacher.tokenizer.add_bos_token else None
    chunks = windows(ids, context, bos)
    if not chunks:
        raise ValueError(f"the evaluation text has {len(ids)} tokens, too few for one window")
    t0 = time.perf_counter()
    kls, agree, nll_t, nll_s = [], 0, 0.0, 0.0
    for w in tqdm(chunks, desc=f"KL {student.spec.name}", unit="window", disable=not progress):
        lt = torch.log_softmax(window_logits(teacher, w)[:-1], dim=-1)
        ls = torch.log_softmax(window_logits(student, w)[:-1].to(lt.device), dim=-1)
        target = w[1:].to(lt.device)
        kls.append((lt.exp() * (lt - ls)).sum(dim=-1, dtype=torch.float64).cpu())
        agree += int((lt.argmax(-1) == ls.argmax(-1)).sum())
        nll_t -= float(lt.gather(1, target[:, None]).double().sum())
        nll_s -= float(ls.gather(1, target[:, None]).double().sum())
    kl = torch.cat(kls)
    n = kl.numel()
    return KLDResult(teacher=teacher.spec.name, student=student.spec.name, student_model=student.spec.model,
                     student_quantization=student.spec.quantization, method=student.method, bpw=student.bpw,
                     stored_bpw=student.stored_bpw,
                     tokens=n, windows=len(chunks), context=context, kl_mean=float(kl.mean()),
                     kl_median=float(kl.median()), kl_p99=float(torch.quantile(kl, 0.99)),
                     kl_max=float(kl.max()), top1_agreement=agree / n,
                     ppl_teacher=float(torch.exp(torch.tensor(nll_t / n))),
                     ppl_student=float(torch.exp(torch.tensor(nll_s / n))),
                     seconds=round(time.perf_counter() - t0, 3), per_token_kl=kl if keep_per_token else None)
