"""`trellm bench serve`: a concurrency sweep against any OpenAI-compatible server.

For each concurrency level C, N streamed requests go out with at most C in
flight (a closed loop: a new request starts when one ends). Each request is
timed chunk by chunk (``client.py``); ``serve_metrics.py`` turns the results
into TTFT / TPOT / ITL / end-to-end percentiles, per-stream and aggregate tok/s,
request throughput and goodput. ``--tasks`` adds a single-stream table over the
built-in prompt categories (``tasks.py``). Output: a markdown table on stdout,
optional JSON and PNG plots.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from trellm.bench.client import RequestResult, RequestSpec, ServerUnreachable, StreamingClient
from trellm.bench.report import run_header, write_json
from trellm.bench.serve_metrics import Slo, category_dict, level_dict, sweep_table, tasks_table
from trellm.bench.tasks import CATEGORIES, TASKS, task_words

MIN_PROMPTS = 8
"""Fewest requests per level when --num-prompts is not given (4 x concurrency otherwise)."""


@dataclass(frozen=True)
class ServeBenchConfig:
    """What `trellm bench serve` runs; built once from the command line."""

    base_url: str
    model: str | None
    """None: the first model the server lists."""
    api_key: str | None
    concurrency: tuple[int, ...]
    num_prompts: int | None
    """Requests per level; None: max(4 x concurrency, MIN_PROMPTS)."""
    input_len: int
    output_len: int
    chat: bool
    fixed_length: bool
    """Send ignore_eos + min_tokens (dropped for the rest of the run if the server answers 400)."""
    slo: Slo
    tokenizer: str | None
    """Model path for the local tokenizer; None: the embedded default model."""
    prompt_file: str | None
    sweep: bool
    tasks: bool
    warmup: int
    timeout_s: float
    seed: int
    progress: bool

    def prompts_at(self, concurrency: int) -> int:
        return self.num_prompts or max(4 * concurrency, MIN_PROMPTS)


def parse_concurrency(text: str) -> tuple[int, ...]:
    try:
        levels = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text!r}") from None
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(f"concurrency levels must be positive integers: {text!r}")
    return levels


def _positive(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {text}")
    return n


def add_serve_parser(bsub) -> None:
    p = bsub.add_parser("serve", help="concurrency sweep against an OpenAI-compatible server (trellm, llama.cpp, vLLM)")
    p.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000 (a trailing /v1 is fine)")
    p.add_argument("--model", default=None, help="model name to request (default: the first one the server lists)")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'; never written to the results")
    p.add_argument("--concurrency", type=parse_concurrency, default=(1, 2, 4, 8, 16, 32),
                   help="comma-separated in-flight request counts (default 1,2,4,8,16,32)")
    p.add_argument("--num-prompts", type=_positive, default=None,
                   help=f"requests per level (default max(4 x concurrency, {MIN_PROMPTS}))")
    p.add_argument("--input-len", type=_positive, default=256, help="synthetic prompt length in tokens")
    p.add_argument("--output-len", type=_positive, default=128, help="max_tokens (and min_tokens) per request")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions",
                   help="/v1/completions or /v1/chat/completions (one user message) for the sweep")
    p.add_argument("--tokenizer", default=None,
                   help="GGUF file or HF directory whose tokenizer sizes synthetic prompts and counts output "
                        "tokens when the server reports no usage (default: the embedded default model)")
    p.add_argument("--prompt-file", default=None,
                   help="prompts instead of synthetic ones: .jsonl ({'prompt': ...} or a string per line) "
                        "or plain text, one prompt per non-empty line")
    p.add_argument("--no-fixed-length", dest="fixed_length", action="store_false",
                   help="never send ignore_eos / min_tokens (outputs may then stop early at EOS)")
    p.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput: TTFT bound in ms")
    p.add_argument("--slo-tpot-ms", type=float, default=None, help="goodput: TPOT bound in ms")
    p.add_argument("--tasks", action="store_true",
                   help="also run the built-in task prompts (5 categories) one at a time via chat completions")
    p.add_argument("--tasks-only", action="store_true", help="run the task table and skip the sweep")
    p.add_argument("--warmup", type=int, default=1, help="untimed requests before the sweep (default 1)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds a request may wait for its next bytes (default 600)")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic prompts")
    p.add_argument("--out", default=None, help="write JSON results here (and a PNG beside it)")
    p.add_argument("--plot", default=None, help="PNG path for the plots (default: --out with .png)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    p.set_defaults(func=run_bench_serve)


def config_from_args(args: argparse.Namespace) -> ServeBenchConfig:
    return ServeBenchConfig(
        base_url=args.base_url, model=args.model, api_key=args.api_key, concurrency=tuple(args.concurrency),
        num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len,
        chat=args.endpoint == "chat", fixed_length=args.fixed_length,
        slo=Slo(args.slo_ttft_ms, args.slo_tpot_ms), tokenizer=args.tokenizer, prompt_file=args.prompt_file,
        sweep=not args.tasks_only, tasks=args.tasks or args.tasks_only, warmup=max(0, args.warmup),
        timeout_s=args.timeout, seed=args.seed, progress=args.progress)


def run_bench_serve(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    # httpx logs every request at INFO, which the CLI's logging setup would print.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        report = asyncio.run(bench(cfg))
    except ServerUnreachable as e:
        print(f"trellm: error: {e}", file=sys.stderr)
        return 1
    report = {**run_header("serve", report["model"], getattr(args, "argv", None)), **report}
    print(markdown_report(report))
    if args.out:
        write_json(args.out, report)
        print(f"wrote {args.out}")
    plot = args.plot or (str(Path(args.out).with_suffix(".png")) if args.out else None)
    if plot and report["levels"]:
        from trellm.bench.serve_plots import plot_serve_sweep

        plot_serve_sweep(report["levels"], f"{report['model']} at {report['server']['base_url']}", plot)
        print(f"wrote {plot}")
    runs = report["levels"] + (report["tasks"] or [])
    if not any(r["completed"] for r in runs):
        print("trellm: error: every request failed (see the errors in the results)", file=sys.stderr)
        return 1
    return 0


class TokenCounter:
    """The local tokenizer, loaded on first use: it sizes synthetic prompts and counts
    output tokens only when a server reports no usage."""

    def __init__(self, path: str | None):
        self.path = path
        self._tok = None

    @property
    def tokenizer(self):
        if self._tok is None:
            from trellm.tokenizer.tokenizer import Tokenizer

            path = self.path
            if not path:
                from trellm.default_model import default_model_path

                path = str(default_model_path())
            self._tok = Tokenizer.load(path)
        return self._tok

    def __call__(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))


def synthetic_prompts(counter: TokenCounter, n: int, input_len: int, seed: int) -> list[str]:
    """``n`` distinct prompts of ``input_len`` tokens each (by the local tokenizer):
    random words of the task prompts, cut at the token length. Distinct openings keep
    a server's prefix cache from sharing work between requests."""
    tok = counter.tokenizer
    rng = random.Random(seed)
    words = task_words()
    prompts = []
    for _ in range(n):
        # Every space-led word is at least one token, so input_len words are enough.
        text = " ".join(rng.choice(words) for _ in range(input_len + 1))
        ids = tok.encode(text, add_special_tokens=False)[:input_len]
        prompt = tok.decode(ids)
        # Decoding then re-encoding can merge differently at the cut; trim until it fits.
        while len(ids) > 1 and counter(prompt) > input_len:
            ids = ids[:-1]
            prompt = tok.decode(ids)
        prompts.append(prompt)
    return prompts


def file_prompts(path: str) -> list[str]:
    """Prompts from a .jsonl file ({"prompt"|"text": str} or a JSON string per line) or a text file
    (one per non-empty line). ValueError with one line on anything else."""
    p = Path(path)
    try:
        lines = [ln for ln in p.read_text(encoding="utf-8").splitlines() if ln.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read prompt file {path}: {e}") from e
    prompts = lines
    if p.suffix == ".jsonl":
        prompts = []
        for i, ln in enumerate(lines, 1):
            try:
                item = json.loads(ln)
            except ValueError:
                raise ValueError(f"{path}:{i}: not JSON") from None
            text = item if isinstance(item, str) else (item.get("prompt") or item.get("text")
                                                       if isinstance(item, dict) else None)
            if not isinstance(text, str) or not text:
                raise ValueError(f"{path}:{i}: expected a string or an object with a 'prompt' or 'text' string")
            prompts.append(text)
    if not prompts:
        raise ValueError(f"prompt file {path} holds no prompts")
    return prompts


async def run_level(client: StreamingClient, specs: Sequence[RequestSpec], concurrency: int,
                    desc: str, progress: bool) -> tuple[list[RequestResult], float]:
    """Send ``specs`` with at most ``concurrency`` in flight; (results in order, wall seconds)."""
    from tqdm import tqdm

    sem = asyncio.Semaphore(concurrency)
    # disable=None: the bar shows on a terminal only, so logs and pipes stay clean.
    bar = tqdm(total=len(specs), desc=desc, unit="req", file=sys.stderr, disable=None if progress else True)

    async def one(spec: RequestSpec) -> RequestResult:
        async with sem:
            r = await client.stream(spec)
        bar.update(1)
        return r

    t0 = time.perf_counter()
    results = await asyncio.gather(*(one(s) for s in specs))
    wall = time.perf_counter() - t0
    bar.close()
    return list(results), wall


async def sweep(client: StreamingClient, cfg: ServeBenchConfig, model: str, prompts: Sequence[str],
                counter: TokenCounter) -> tuple[list[dict], str | None]:
    """Every concurrency level; (level dicts, the 400 message that made it drop the fixed-length fields)."""
    fixed, rejected, levels = cfg.fixed_length, None, []
    start = cfg.warmup
    for c in cfg.concurrency:
        n = cfg.prompts_at(c)
        texts = [prompts[(start + i) % len(prompts)] for i in range(n)]
        start += n

        def specs(fixed_length: bool) -> list[RequestSpec]:
            return [RequestSpec(model, t, cfg.output_len, chat=cfg.chat, fixed_length=fixed_length) for t in texts]

        results, wall = await run_level(client, specs(fixed), c, f"concurrency {c}", cfg.progress)
        retried = False
        if fixed and any(r.status == 400 for r in results):
            # ignore_eos / min_tokens are not OpenAI fields; a strict server refuses them.
            rejected = next(r.error for r in results if r.status == 400)
            fixed, retried = False, True
            results, wall = await run_level(client, specs(False), c, f"concurrency {c} (retry)", cfg.progress)
        levels.append({**level_dict(c, results, wall, counter, cfg.slo), "fixed_length": fixed,
                       "retried_without_fixed_length": retried})
    return levels, rejected


async def run_tasks(client: StreamingClient, cfg: ServeBenchConfig, model: str, counter: TokenCounter) -> list[dict]:
    """The built-in prompts one at a time (chat, greedy, natural endings capped at output_len)."""
    specs = [RequestSpec(model, t.message, cfg.output_len, chat=True) for t in TASKS]
    results, _ = await run_level(client, specs, 1, "tasks", cfg.progress)
    return [category_dict(cat, [r for t, r in zip(TASKS, results) if t.category == cat], counter)
            for cat in CATEGORIES]


async def bench(cfg: ServeBenchConfig) -> dict:
    """Check the server, build prompts, warm up, sweep, run tasks; the results (no command line)."""
    async with StreamingClient(cfg.base_url, cfg.api_key, cfg.timeout_s, max(cfg.concurrency)) as client:
        models = await client.list_models()
        model = cfg.model or (models[0] if models else None)
        if model is None:
            raise ServerUnreachable(f"{client.root} lists no models; pass --model")
        if model not in models:
            print(f"trellm: warning: {model!r} is not among the server's models {models}", file=sys.stderr)
        counter = TokenCounter(cfg.tokenizer)
        total = cfg.warmup + sum(cfg.prompts_at(c) for c in cfg.concurrency)
        if cfg.prompt_file:
            prompts, source = file_prompts(cfg.prompt_file), f"file {cfg.prompt_file}"
        else:
            prompts = synthetic_prompts(counter, total, cfg.input_len, cfg.seed) if cfg.sweep else []
            source = "synthetic"
        for text in prompts[: cfg.warmup] if cfg.sweep else ():
            await client.stream(RequestSpec(model, text, cfg.output_len, chat=cfg.chat))
        levels, rejected = await sweep(client, cfg, model, prompts, counter) if cfg.sweep else ([], None)
        tasks = await run_tasks(client, cfg, model, counter) if cfg.tasks else None
    return {
        "server": {"base_url": client.root, "models": models},
        "model": model,
        "config": {"concurrency": list(cfg.concurrency), "num_prompts": cfg.num_prompts,
                   "input_len": cfg.input_len if source == "synthetic" else None, "output_len": cfg.output_len,
                   "endpoint": "chat" if cfg.chat else "completions", "prompt_source": source,
                   "tokenizer": cfg.tokenizer or "embedded default model", "warmup": cfg.warmup,
                   "seed": cfg.seed, "temperature": 0.0},
        "fixed_length": {"requested": cfg.fixed_length, "rejected_error": rejected},
        "levels": levels,
        "tasks": tasks,
    }


def markdown_report(report: dict) -> str:
    c = report["config"]
    fixed = report["fixed_length"]
    if not fixed["requested"]:
        length = "not fixed (--no-fixed-length)"
    elif fixed["rejected_error"]:
        length = f"not fixed: the server refused ignore_eos/min_tokens ({fixed['rejected_error']})"
    else:
        length = "fixed with ignore_eos + min_tokens"
    lines = [f"## trellm bench serve: {report['model']} at {report['server']['base_url']}", ""]
    if report["levels"]:
        prompt = f"{c['input_len']}-token synthetic prompts" if c["input_len"] else c["prompt_source"]
        path = "/v1/chat/completions" if c["endpoint"] == "chat" else "/v1/completions"
        lines += [f"{prompt}, {c['output_len']} output tokens ({length}), {path}, greedy, streamed", "",
                  sweep_table(report["levels"]), ""]
    if report["tasks"] is not None:
        lines += [f"### Task prompts, one stream, chat, max_tokens {c['output_len']}", "",
                  tasks_table(report["tasks"]), ""]
    return "\n".join(lines)
