"""`trellm bench latency`'s grid: prompt lengths x batch sizes at one output length,
in-process. Each cell runs ``batch`` requests of ``prompt_len`` random tokens together
and reports TTFT, decode tok/s per stream and in aggregate (each request's first token
excluded), and prefill tok/s (prompt tokens over the time to the last first token)."""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm.auto import tqdm

from trellm.bench.latency import synthetic_prompts
from trellm.entrypoints.llm import LLM
from trellm.sampling_params import SamplingParams


@dataclass(frozen=True)
class GridCell:
    prompt_len: int
    batch: int
    gen_len: int
    ttft_ms_mean: float
    ttft_ms_max: float
    prefill_tok_s: float
    decode_tok_s_per_stream: float
    """Mean over requests of (tokens - 1) / (finish - first token)."""
    aggregate_decode_tok_s: float
    """All tokens after each first one, over the time from the last first token to the end."""
    wall_s: float


def _run_cell(llm: LLM, prompt_len: int, batch: int, gen_len: int, seed: int) -> GridCell:
    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=gen_len, ignore_eos=True)
    prompts = synthetic_prompts(eng.vocab_size, batch, prompt_len, seed=seed)
    ids = [f"g{time.monotonic_ns()}-{i}" for i in range(batch)]
    t0 = time.perf_counter()
    for rid, p in zip(ids, prompts):
        eng.add_request(rid, None, params, prompt_token_ids=p)
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    tokens: dict[str, int] = {}
    at_last_first = None
    while eng.has_unfinished_requests():
        for out in eng.step():
            now = time.perf_counter() - t0
            tokens[out.request_id] = len(out.outputs[0].token_ids)
            if out.outputs[0].token_ids and out.request_id not in first:
                first[out.request_id] = now
            if out.finished:
                done[out.request_id] = now
        if at_last_first is None and len(first) == batch:
            # The aggregate window starts here: count only the tokens made inside it
            # (early requests decode while later prompts are still in prefill).
            at_last_first = sum(tokens.values())
    wall = time.perf_counter() - t0
    total = sum(tokens.values())
    in_window = total - (total if at_last_first is None else at_last_first)
    last_first = max(first.values())
    per_stream = [(gen_len - 1) / (done[r] - first[r]) for r in ids if done[r] > first[r]]
    return GridCell(
        prompt_len=prompt_len, batch=batch, gen_len=gen_len,
        ttft_ms_mean=sum(first.values()) / batch * 1e3, ttft_ms_max=last_first * 1e3,
        prefill_tok_s=prompt_len * batch / last_first,
        decode_tok_s_per_stream=sum(per_stream) / len(per_stream) if per_stream else 0.0,
        aggregate_decode_tok_s=in_window / (wall - last_first) if wall > last_first else 0.0,
        wall_s=wall)


def run_grid(llm: LLM, prompt_lens: list[int], batch_sizes: list[int], gen_len: int,
             progress: bool = True) -> list[GridCell]:
    cells = [(p, b) for p in prompt_lens for b in batch_sizes]
    out = []
    for i, (p, b) in enumerate(tqdm(cells, desc="latency grid", unit="cell", disable=not progress)):
        out.append(_run_cell(llm, p, b, gen_len, seed=1000 + i))
    return out


def grid_table(cells: list[GridCell]) -> str:
    lines = ["| prompt tokens | batch | TTFT ms (mean / last) | prefill tok/s | decode tok/s per stream "
             "| aggregate decode tok/s |", "|---|---|---|---|---|---|"]
    lines += [f"| {c.prompt_len} | {c.batch} | {c.ttft_ms_mean:.0f} / {c.ttft_ms_max:.0f} | "
              f"{c.prefill_tok_s:.0f} | {c.decode_tok_s_per_stream:.1f} | {c.aggregate_decode_tok_s:.1f} |"
              for c in cells]
    return "\n".join(lines)


def plot_grid(cells: list[GridCell], title: str, path: str | Path) -> None:
    """Decode tok/s per stream and in aggregate, and TTFT, against batch size, one line per prompt length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from trellm.bench.serve_plots import log2_count_axis

    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    panels = (("decode tok/s per stream", "decode_tok_s_per_stream"),
              ("aggregate decode tok/s", "aggregate_decode_tok_s"), ("TTFT ms (mean)", "ttft_ms_mean"))
    batches = sorted({c.batch for c in cells})
    for ax, (name, key) in zip(axes, panels):
        for p in sorted({c.prompt_len for c in cells}):
            row = sorted((c for c in cells if c.prompt_len == p), key=lambda c: c.batch)
            ax.plot([c.batch for c in row], [getattr(c, key) for c in row], "o-", label=f"{p}-token prompts")
        ax.set_title(name, fontsize=10)
        log2_count_axis(ax, batches, "batch size (concurrent requests)")
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def as_dicts(cells: list[GridCell]) -> list[dict]:
    return [asdict(c) for c in cells]
