"""The ``trellm`` command: generate, chat, serve, bench, quantize, eval.

Every user error ends as one line on stderr ("trellm: error: ...") and exit code 1,
never a traceback.
"""
from __future__ import annotations

import argparse
import logging
import sys

from trellm.loader.errors import ModelLoadError


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine flags, named as vLLM names them so users can switch."""
    p.add_argument("model", nargs="?", default="",
                   help="GGUF file, Hugging Face directory or dummy:<config.json> (default: embedded SmolLM2-135M)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--quantization", default="auto", choices=["auto", "none", "exl3", "int8"],
                   help="auto: on CPU keep GGUF Q4_0/Q4_1 linear weights packed (int4 matmul, "
                        "bf16 activations), EXL3 checkpoints as EXL3; none: dequantize everything "
                        "to --dtype; exl3: with a dummy: model, random EXL3 weights of --bits; "
                        "int8: quantize an unquantized model's linear weights to int8 at load time")
    p.add_argument("--bits", type=float, default=None,
                   help="dummy EXL3 models: bits per weight (1..8)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--long-prefill-token-threshold", type=int, default=0)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-memory", type=int, default=None, help="bytes for the KV cache")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0, help="seed for dummy weights")
    p.add_argument("--load-workers", type=int, default=4)
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="prepare step n+1 while the GPU runs step n (default: on for CUDA, off on CPU)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="CUDA: no CUDA graphs (decode steps run eagerly)")
    p.add_argument("--prefill-weight-cache-memory", type=int, default=1 << 30,
                   help="CPU int4 path: bytes of float32 weight copies kept for prefill (0: none)")


def engine_kwargs(a: argparse.Namespace) -> dict:
    return dict(dtype=a.dtype, device=a.device, quantization=a.quantization, bits=a.bits,
                max_model_len=a.max_model_len,
                max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
                long_prefill_token_threshold=a.long_prefill_token_threshold,
                enable_prefix_caching=a.enable_prefix_caching, block_size=a.block_size,
                kv_cache_memory=a.kv_cache_memory, gpu_memory_utilization=a.gpu_memory_utilization,
                seed=a.seed, load_workers=a.load_workers,
                prefill_weight_cache_memory=a.prefill_weight_cache_memory, enforce_eager=a.enforce_eager,
                async_scheduling=a.async_scheduling)


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--sampling-seed", type=int, default=None)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--stop", action="append", default=[])


def sampling_params(a: argparse.Namespace):
    from trellm.sampling_params import SamplingParams

    return SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p,
                          top_k=a.top_k, min_p=a.min_p, seed=a.sampling_seed,
                          repetition_penalty=a.repetition_penalty, stop=tuple(a.stop))


def add_server_args(p: argparse.ArgumentParser) -> None:
    """Server flags, named as ``vllm serve`` names them where the meaning is the same."""
    from trellm.config import ServerConfig

    d = ServerConfig()
    p.add_argument("--host", default=d.host, help="interface to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=d.port)
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients use in 'model' (default: the model argument)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health "
                        "(default: $TRELLM_API_KEY; unset = no auth)")
    p.add_argument("--max-queued-requests", type=int, default=d.max_queued_requests,
                   help="sequences allowed to wait for a seat; beyond it requests get 503 + Retry-After")
    p.add_argument("--max-n", type=int, default=d.max_n, help="largest n per request")
    p.add_argument("--max-logprobs", type=int, default=d.max_logprobs)
    p.add_argument("--max-request-body-bytes", type=int, default=d.max_request_body_bytes)
    p.add_argument("--shutdown-timeout", type=float, default=d.shutdown_timeout_s,
                   help="seconds in-flight requests may finish after SIGTERM")
    p.add_argument("--engine-step-timeout", type=float, default=d.engine_step_timeout_s,
                   help="watchdog: a step longer than this kills the engine (0 = off)")
    p.add_argument("--allowed-origins", nargs="*", default=[], help="CORS origins (default: none)")
    p.add_argument("--allowed-hosts", nargs="*", default=[],
                   help="Host-header names to accept besides localhost/127.0.0.1/[::1] (DNS-rebinding "
                        "guard, on when bound to loopback or when names are given; '*' = any)")
    p.add_argument("--request-header-timeout", type=float, default=d.request_header_timeout_s,
                   help="seconds a client may take to send a request's headers (slowloris)")
    p.add_argument("--request-body-timeout", type=float, default=d.request_body_timeout_s,
                   help="seconds a client may take to send a request body (408 beyond)")
    p.add_argument("--max-queue-wait", type=float, default=d.max_queue_wait_s,
                   help="seconds a request may wait for a seat before a 503 + Retry-After (0 = no limit)")
    p.add_argument("--tokenize-timeout", type=float, default=d.tokenize_timeout_s,
                   help="seconds to template and tokenize one request's input (400 beyond)")


def server_config(a: argparse.Namespace):
    from trellm import envs
    from trellm.config import ServerConfig

    return ServerConfig(host=a.host, port=a.port, served_model_names=tuple(a.served_model_name or ()),
                        api_key=a.api_key if a.api_key is not None else envs.api_key(),
                        max_queued_requests=a.max_queued_requests, max_n=a.max_n,
                        max_logprobs=a.max_logprobs, max_request_body_bytes=a.max_request_body_bytes,
                        shutdown_timeout_s=a.shutdown_timeout, engine_step_timeout_s=a.engine_step_timeout,
                        allowed_origins=tuple(a.allowed_origins), allowed_hosts=tuple(a.allowed_hosts),
                        request_header_timeout_s=a.request_header_timeout,
                        request_body_timeout_s=a.request_body_timeout, max_queue_wait_s=a.max_queue_wait,
                        tokenize_timeout_s=a.tokenize_timeout)


def run_serve(args: argparse.Namespace) -> int:
    from trellm.entrypoints.llm import engine_config_from_kwargs
    from trellm.server.api_server import default_model_names, run_server

    config = server_config(args)
    config.validate()  # bad flags fail before the model loads
    engine_config = engine_config_from_kwargs(args.model, **engine_kwargs(args))
    return run_server(engine_config, config, default_model_names(args.model))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trellm", description="LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="complete one prompt, streaming to the terminal")
    g.add_argument("prompt")
    g.add_argument("--model", dest="model_flag", default=None)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    add_engine_args(g)
    add_sampling_args(g)
    c = sub.add_parser("chat", help="interactive chat in the terminal")
    c.add_argument("--model", dest="model_flag", default=None)
    c.add_argument("--system", default=None, help="system prompt")
    add_engine_args(c)
    add_sampling_args(c)
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_args(s)
    add_server_args(s)
    s.set_defaults(func=run_serve)
    from trellm.bench.cli import add_bench_parser

    add_bench_parser(sub)
    from trellm.quant.exl3.quantize_cli import add_quantize_parser; add_quantize_parser(sub)  # noqa: E702
    from trellm.eval.cli import add_eval_parser; add_eval_parser(sub)  # noqa: E702
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what the results files record
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s", stream=sys.stderr)
    if getattr(args, "model_flag", None):
        args.model = args.model_flag
    try:
        return args.func(args) if hasattr(args, "func") else _dispatch(args)
    except (ModelLoadError, ValueError) as e:
        print(f"trellm: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


def _dispatch(args: argparse.Namespace) -> int:
    from trellm.entrypoints import interactive

    if args.command == "generate":
        return interactive.run_generate(args)
    if args.command == "chat":
        return interactive.run_chat(args)
    raise ValueError(f"unknown command {args.command}")


if __name__ == "__main__":
    sys.exit(main())
