"""In-process speed: TTFT, decode tok/s with the first token excluded, prefill
tok/s, aggregate decode at N concurrent requests; optionally beside transformers
on the same weights in the same process run."""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch
from tqdm.auto import tqdm

from trellm.entrypoints.llm import LLM
from trellm.sampling_params import SamplingParams


@dataclass(frozen=True)
class BenchSpec:
    prompt_len: int = 128
    gen_len: int = 128
    prefill_len: int = 512
    concurrency: int = 8
    repeats: int = 2


@dataclass(frozen=True)
class Figures:
    engine: str
    ttft_ms: float
    decode_tok_s: float
    """Single stream, first token excluded."""
    prefill_tok_s: float
    aggregate_tok_s: float
    """All generated tokens of N concurrent requests over the wall time (prefill included)."""
    aggregate_decode_tok_s: float
    """Tokens after each request's first, over the time from the last first token to the end."""


def synthetic_prompts(vocab: int, n: int, length: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # Stay clear of the special tokens at the low end of most vocabularies.
    return torch.randint(100, vocab, (n, length), generator=g).tolist()


def _run_requests(llm: LLM, prompts: list[list[int]], gen_len: int):
    """Returns (wall seconds, per-request first-token time, total tokens)."""
    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=gen_len, ignore_eos=True)
    ids = [f"b{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    t0 = time.perf_counter()
    for rid, p in zip(ids, prompts):
        eng.add_request(rid, None, params, prompt_token_ids=p)
    first: dict[str, float] = {}
    tokens: dict[str, int] = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            n = len(out.outputs[0].token_ids)
            if n and out.request_id not in first:
                first[out.request_id] = time.perf_counter() - t0
            tokens[out.request_id] = n
    return time.perf_counter() - t0, [first[i] for i in ids], sum(tokens.values())


def bench_trellm(llm: LLM, spec: BenchSpec, progress: bool = False) -> Figures:
    vocab = llm.engine.vocab_size
    _run_requests(llm, synthetic_prompts(vocab, 1, 32, seed=99), 8)  # warm-up
    best = None
    for r in tqdm(range(spec.repeats), desc="latency repeats", unit="repeat", disable=not progress):
        single = synthetic_prompts(vocab, 1, spec.prompt_len, seed=10 + r)
        wall, first, ntok = _run_requests(llm, single, spec.gen_len)
        prefill_wall, _, _ = _run_requests(llm, synthetic_prompts(vocab, 1, spec.prefill_len, seed=20 + r), 1)
        many = synthetic_prompts(vocab, spec.concurrency, spec.prompt_len, seed=30 + r)
        agg_wall, agg_first, agg_tok = _run_requests(llm, many, spec.gen_len)
        fig = Figures(
            engine="trellm",
            ttft_ms=first[0] * 1e3,
            decode_tok_s=(ntok - 1) / (wall - first[0]),
            prefill_tok_s=spec.prefill_len / prefill_wall,
            aggregate_tok_s=agg_tok / agg_wall,
            aggregate_decode_tok_s=(agg_tok - spec.concurrency) / (agg_wall - max(agg_first)),
        )
        best = fig if best is None or fig.decode_tok_s > best.decode_tok_s else best
    return best


def bench_transformers(model, vocab: int, spec: BenchSpec) -> Figures:
    """transformers' own generate (eager, its default cache), greedy, fixed lengths."""
    def gen(ids: torch.Tensor, n: int) -> float:
        t = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                       do_sample=False, pad_token_id=0)
        return time.perf_counter() - t

    def prefill(ids: torch.Tensor) -> float:
        t = time.perf_counter()
        model(ids)
        return time.perf_counter() - t

    with torch.inference_mode():
        gen(torch.tensor(synthetic_prompts(vocab, 1, 32, seed=99)), 8)
        best = None
        for r in range(spec.repeats):
            single = torch.tensor(synthetic_prompts(vocab, 1, spec.prompt_len, seed=10 + r))
            ttft = gen(single, 1)
            total = gen(single, spec.gen_len)
            pre = prefill(torch.tensor(synthetic_prompts(vocab, 1, spec.prefill_len, seed=20 + r)))
            many = torch.tensor(synthetic_prompts(vocab, spec.concurrency, spec.prompt_len, seed=30 + r))
            agg_ttft = gen(many, 1)
            agg = gen(many, spec.gen_len)
            fig = Figures(
                engine="transformers",
                ttft_ms=ttft * 1e3,
                decode_tok_s=(spec.gen_len - 1) / (total - ttft),
                prefill_tok_s=spec.prefill_len / pre,
                aggregate_tok_s=spec.concurrency * spec.gen_len / agg,
                aggregate_decode_tok_s=spec.concurrency * (spec.gen_len - 1) / (agg - agg_ttft),
            )
            best = fig if best is None or fig.decode_tok_s > best.decode_tok_s else best
    return best


def figures_table(rows: list[Figures]) -> str:
    head = ("| engine | TTFT ms | decode tok/s (1 stream) | prefill tok/s | aggregate tok/s "
            "| aggregate decode tok/s |\n|---|---|---|---|---|---|\n")
    return head + "\n".join(
        f"| {f.engine} | {f.ttft_ms:.1f} | {f.decode_tok_s:.1f} | {f.prefill_tok_s:.0f} | "
        f"{f.aggregate_tok_s:.1f} | {f.aggregate_decode_tok_s:.1f} |" for f in rows)


def as_dict(f: Figures) -> dict:
    return asdict(f)
