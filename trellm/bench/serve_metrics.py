"""From streamed request results to the figures of `trellm bench serve`: per-request
TTFT / TPOT / ITL / end-to-end latency, per-level summaries, goodput under an SLO,
and the markdown tables."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from trellm.bench.client import RequestResult
from trellm.bench.stats import summary_dict


@dataclass(frozen=True)
class RequestMetrics:
    """One successful request's figures; times in milliseconds."""

    ttft_ms: float
    e2e_ms: float
    output_tokens: int
    tokens_from_usage: bool
    """True: the server's ``usage`` counted them; False: the local tokenizer did."""
    prompt_tokens: int | None
    itl_ms: tuple[float, ...]
    """Gaps between consecutive chunks that carried text (a chunk may hold several tokens)."""

    @property
    def tpot_ms(self) -> float | None:
        """Time per output token after the first; None for a one-token answer."""
        if self.output_tokens < 2:
            return None
        return (self.e2e_ms - self.ttft_ms) / (self.output_tokens - 1)

    @property
    def decode_tok_s(self) -> float | None:
        """This stream's decode speed, the first token (and so the prefill) excluded."""
        tpot = self.tpot_ms
        return 1000.0 / tpot if tpot else None


def measure(r: RequestResult, count_tokens: Callable[[str], int]) -> RequestMetrics:
    """The metrics of a successful result; ``count_tokens`` only when the server gave no usage."""
    if not r.ok or r.ttft_s is None:
        raise ValueError("measure() needs a successful result")
    from_usage = r.completion_tokens is not None
    tokens = r.completion_tokens if from_usage else count_tokens(r.text)
    times = r.chunk_times_s
    return RequestMetrics(ttft_ms=1000 * r.ttft_s, e2e_ms=1000 * r.e2e_s, output_tokens=tokens,
                          tokens_from_usage=from_usage, prompt_tokens=r.prompt_tokens,
                          itl_ms=tuple(1000 * (b - a) for a, b in zip(times, times[1:])))


@dataclass(frozen=True)
class Slo:
    """A service-level objective; an unset bound is not checked."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None

    @property
    def is_set(self) -> bool:
        return self.ttft_ms is not None or self.tpot_ms is not None

    def met(self, m: RequestMetrics) -> bool:
        if self.ttft_ms is not None and m.ttft_ms > self.ttft_ms:
            return False
        tpot = m.tpot_ms
        # A one-token answer has no TPOT, so it cannot miss that bound.
        return self.tpot_ms is None or tpot is None or tpot <= self.tpot_ms


def goodput(metrics: Sequence[RequestMetrics], num_requests: int, wall_s: float, slo: Slo) -> dict | None:
    """Requests that succeeded and met ``slo``: their fraction of all requests sent
    (failures count as misses) and their rate per second of the level's wall time."""
    if not slo.is_set:
        return None
    good = sum(slo.met(m) for m in metrics)
    return {"slo_ttft_ms": slo.ttft_ms, "slo_tpot_ms": slo.tpot_ms, "good_requests": good,
            "fraction": good / num_requests if num_requests else 0.0,
            "rate_rps": good / wall_s if wall_s > 0 else 0.0}


def token_source(metrics: Sequence[RequestMetrics]) -> str | None:
    sources = {"usage" if m.tokens_from_usage else "tokenizer" for m in metrics}
    return sources.pop() if len(sources) == 1 else ("mixed" if sources else None)


def error_dict(results: Sequence[RequestResult]) -> dict:
    """Failed requests: the count, the count per kind, and the first few messages."""
    failed = [r for r in results if not r.ok]
    kinds: dict[str, int] = {}
    for r in failed:
        kinds[r.error_kind or "unknown"] = kinds.get(r.error_kind or "unknown", 0) + 1
    samples = list(dict.fromkeys(f"{r.error_kind}: {r.error}" for r in failed))[:5]
    return {"count": len(failed), "by_kind": kinds, "samples": samples}


def level_dict(concurrency: int, results: Sequence[RequestResult], wall_s: float,
               count_tokens: Callable[[str], int], slo: Slo) -> dict:
    """Everything measured at one concurrency level, JSON-ready."""
    ms = [measure(r, count_tokens) for r in results if r.ok]
    total_out = sum(m.output_tokens for m in ms)
    prompt = [m.prompt_tokens for m in ms if m.prompt_tokens is not None]
    itl = [g for m in ms for g in m.itl_ms]
    return {
        "concurrency": concurrency,
        "num_requests": len(results),
        "completed": len(ms),
        "errors": error_dict(results),
        "wall_s": wall_s,
        "output_tokens_source": token_source(ms),
        "total_output_tokens": total_out,
        "total_prompt_tokens": sum(prompt) if prompt else None,
        "total_text_chunks": sum(len(m.itl_ms) + 1 for m in ms),
        "output_tokens": summary_dict(m.output_tokens for m in ms),
        "prompt_tokens": summary_dict(prompt),
        "ttft_ms": summary_dict(m.ttft_ms for m in ms),
        "tpot_ms": summary_dict(m.tpot_ms for m in ms if m.tpot_ms is not None),
        "itl_ms": summary_dict(itl),
        "e2e_ms": summary_dict(m.e2e_ms for m in ms),
        "stream_decode_tok_s": summary_dict(m.decode_tok_s for m in ms if m.decode_tok_s is not None),
        "aggregate_output_tok_s": total_out / wall_s if wall_s > 0 else 0.0,
        "request_throughput_rps": len(ms) / wall_s if wall_s > 0 else 0.0,
        "goodput": goodput(ms, len(results), wall_s, slo),
    }


def category_dict(category: str, results: Sequence[RequestResult], count_tokens: Callable[[str], int]) -> dict:
    """One task category's single-stream figures."""
    ms = [measure(r, count_tokens) for r in results if r.ok]
    return {
        "category": category,
        "prompts": len(results),
        "completed": len(ms),
        "errors": error_dict(results),
        "output_tokens_source": token_source(ms),
        "output_tokens": summary_dict(m.output_tokens for m in ms),
        "ttft_ms": summary_dict(m.ttft_ms for m in ms),
        "tpot_ms": summary_dict(m.tpot_ms for m in ms if m.tpot_ms is not None),
        "e2e_ms": summary_dict(m.e2e_ms for m in ms),
        "stream_decode_tok_s": summary_dict(m.decode_tok_s for m in ms if m.decode_tok_s is not None),
    }


def _f(summary: dict | None, key: str, scale: float = 1.0, digits: int = 1) -> str:
    return "–" if summary is None else f"{summary[key] * scale:.{digits}f}"


def _goodput_cell(good: dict | None) -> str:
    return "–" if good is None else f"{100 * good['fraction']:.0f}% ({good['rate_rps']:.2f}/s)"


def sweep_table(levels: Sequence[dict]) -> str:
    """The markdown table of a concurrency sweep, one row per level."""
    rows = ["| concurrency | requests | errors | TTFT ms mean / p50 / p99 | TPOT ms mean / p99 "
            "| ITL ms p50 / p99 | E2E s mean / p99 | tok/s per stream | aggregate out tok/s | req/s | goodput |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for lv in levels:
        t, tp, itl, e2e = lv["ttft_ms"], lv["tpot_ms"], lv["itl_ms"], lv["e2e_ms"]
        good = lv["goodput"]
        rows.append(
            f"| {lv['concurrency']} | {lv['num_requests']} | {lv['errors']['count']} "
            f"| {_f(t, 'mean', digits=0)} / {_f(t, 'p50', digits=0)} / {_f(t, 'p99', digits=0)} "
            f"| {_f(tp, 'mean')} / {_f(tp, 'p99')} | {_f(itl, 'p50')} / {_f(itl, 'p99')} "
            f"| {_f(e2e, 'mean', 1e-3, 2)} / {_f(e2e, 'p99', 1e-3, 2)} "
            f"| {_f(lv['stream_decode_tok_s'], 'mean')} | {lv['aggregate_output_tok_s']:.1f} "
            f"| {lv['request_throughput_rps']:.2f} "
            f"| {_goodput_cell(good)} |")
    return "\n".join(rows)


def tasks_table(categories: Sequence[dict]) -> str:
    """The markdown table of the per-category single-stream run."""
    rows = ["| category | prompts | errors | TTFT ms mean | tok/s per stream mean | output tokens mean "
            "| E2E s mean |", "|---|---|---|---|---|---|---|"]
    for c in categories:
        rows.append(f"| {c['category']} | {c['prompts']} | {c['errors']['count']} "
                    f"| {_f(c['ttft_ms'], 'mean', digits=0)} | {_f(c['stream_decode_tok_s'], 'mean')} | {_f(c['output_tokens'], 'mean')} "
                    f"| {_f(c['e2e_ms'], 'mean', 1e-3, 2)} |")
    return "\n".join(rows)
