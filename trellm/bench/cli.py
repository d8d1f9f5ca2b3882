"""`trellm bench ...` subcommands."""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_bench_parser(sub) -> None:
    b = sub.add_parser("bench", help="measure speed")
    bsub = b.add_subparsers(dest="bench_command", required=True)
    lat = bsub.add_parser("latency", help="in-process TTFT, decode, prefill and aggregate tok/s")
    from trellm.entrypoints.cli import add_engine_args

    add_engine_args(lat)
    lat.add_argument("--prompt-len", type=int, default=128)
    lat.add_argument("--gen-len", type=int, default=128)
    lat.add_argument("--prefill-len", type=int, default=512)
    lat.add_argument("--concurrency", type=int, default=8)
    lat.add_argument("--repeats", type=int, default=2)
    lat.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    lat.add_argument("--compare-transformers", action="store_true",
                     help="also run transformers on the same weights in this process")
    lat.add_argument("--out", default=None, help="write JSON results here")
    lat.add_argument("--label", default=None, help="name of this trellm configuration in tables and plots")
    lat.add_argument("--grid-prompt-lens", type=_int_list, default=None,
                     help="also run a grid: these prompt lengths x --grid-batch-sizes at --gen-len")
    lat.add_argument("--grid-batch-sizes", type=_int_list, default=[1, 2, 4, 8])
    lat.add_argument("--png", default=None, help="the grid's plot (default: beside --out)")
    lat.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    lat.set_defaults(func=run_latency)
    summ = bsub.add_parser("summarize", help="merge latency JSON files into one markdown table and a PNG")
    summ.add_argument("results", nargs="+")
    summ.add_argument("--markdown", required=True)
    summ.add_argument("--png", required=True)
    summ.add_argument("--title", default="trellm vs transformers, same weights, same process run")
    summ.add_argument("--anchor", action="append", default=[],
                      help="extra row 'label:decode_tok_s:prefill_tok_s' quoted from elsewhere (not measured here)")
    summ.set_defaults(func=run_summarize)
    from trellm.bench.serve import add_serve_parser

    add_serve_parser(bsub)
    from trellm.bench.ladder import add_ladder_parser; add_ladder_parser(bsub)  # noqa: E702
    from trellm.bench.load import add_load_parser; add_load_parser(bsub)  # noqa: E702


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def run_latency(args: argparse.Namespace) -> int:
    import torch

    from trellm.bench.latency import BenchSpec, as_dict, bench_transformers, bench_trellm, figures_table
    from trellm.entrypoints.cli import engine_kwargs
    from trellm.entrypoints.llm import LLM

    if args.threads:
        torch.set_num_threads(args.threads)
    spec = BenchSpec(args.prompt_len, args.gen_len, args.prefill_len, args.concurrency, args.repeats)
    llm = LLM(args.model, **engine_kwargs(args))
    rows = [bench_trellm(llm, spec, progress=args.progress)]
    grid = None
    if args.grid_prompt_lens:
        from trellm.bench.latency_grid import grid_table, run_grid

        grid = run_grid(llm, args.grid_prompt_lens, args.grid_batch_sizes, args.gen_len, args.progress)
        print(grid_table(grid))
    dtype, device = llm.engine.worker.dtype, llm.engine.worker.device
    vocab = llm.engine.vocab_size
    del llm
    if args.compare_transformers:
        from trellm.bench.hf_peer import load_transformers_peer
        import transformers

        peer = load_transformers_peer(args.model, dtype, str(device), args.seed)
        rows.append(bench_transformers(peer, vocab, spec))
        peer_version = transformers.__version__
    table = figures_table(rows)
    print(table)
    if args.out:
        from trellm.bench.report import machine_info, run_header, write_json

        model = args.model or "embedded default (SmolLM2-135M-Instruct, Q4_1 GGUF)"
        result = {
            **run_header("latency", model, getattr(args, "argv", None)),
            "machine": {**machine_info(), "threads": torch.get_num_threads(), "torch": torch.__version__},
            "quantization": args.quantization,
            "dtype": str(dtype).removeprefix("torch."), "device": str(device),
            "spec": spec.__dict__,
            "label": args.label,
            "results": [as_dict(r) for r in rows],
            "transformers_version": peer_version if args.compare_transformers else None,
            "grid": None,
        }
        if grid is not None:
            from trellm.bench.latency_grid import as_dicts, plot_grid

            result["grid"] = as_dicts(grid)
            png = args.png or str(Path(args.out).with_suffix(".png"))
            plot_grid(grid, f"trellm bench latency: {result['model']}, {args.gen_len} new tokens", png)
            print(f"wrote {png}")
        write_json(args.out, result)
        print(f"wrote {args.out}")
    return 0


def run_summarize(args: argparse.Namespace) -> int:
    from trellm.bench.plots import plot_latency

    rows, lines, spec = [], [], None
    for path in args.results:
        data = json.loads(Path(path).read_text())
        keys = ("prompt_len", "prefill_len", "concurrency")
        this = {k: (data.get("spec") or {}).get(k) for k in keys}
        if spec is not None and this != spec:
            raise ValueError(f"{path} was run with {this}, the files before it with {spec}: "
                             f"summarize results of one bench spec at a time")
        spec = this
        for r in data["results"]:
            engine = r["engine"]
            label = f"trellm {data.get('label') or data['dtype']}" if engine == "trellm" else f"transformers {data['dtype']}"
            if any(x["label"] == label for x in rows):
                continue
            rows.append({"label": label, **r})
            lines.append((label, r, data["command"]))
    md = [f"| engine / weights | TTFT ms ({spec['prompt_len']}-token prompt) | decode tok/s, 1 stream "
          f"| prefill tok/s ({spec['prefill_len']}) | aggregate tok/s, {spec['concurrency']} concurrent "
          f"| aggregate decode tok/s | command |",
          "|---|---|---|---|---|---|---|"]
    for label, r, cmd in lines:
        md.append(f"| {label} | {r['ttft_ms']:.0f} | {r['decode_tok_s']:.1f} | {r['prefill_tok_s']:.0f} | "
                  f"{r['aggregate_tok_s']:.1f} | {r['aggregate_decode_tok_s']:.1f} | `{cmd}` |")
    for a in args.anchor:
        label, dec, pre = a.split(":")
        md.append(f"| {label} (quoted, not run here) | – | {dec} | {pre} | – | – | – |")
    Path(args.markdown).write_text("\n".join(md) + "\n")
    plot_latency(rows, args.title, args.png, spec)
    print("\n".join(md))
    print(f"wrote {args.markdown} and {args.png}")
    return 0
