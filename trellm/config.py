"""Frozen configuration, one dataclass per concern, composed by ``EngineConfig``.

Nothing mutates a config after construction: derived values come from
``resolve()`` methods that return new objects.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModelConfig:
    """What to load and in which precision."""

    model: str = ""
    """GGUF file, Hugging Face directory, or 'dummy:<config.json>'; '' = embedded default."""
    dtype: str = "auto"
    """'auto' (float32 on CPU, bfloat16 on CUDA), 'float32', 'bfloat16' or 'float16'."""
    device: str = "auto"
    """'auto' (CUDA when available), 'cpu' or 'cuda'."""
    max_model_len: int | None = None
    """Context length; None = the model's own."""
    seed: int = 0
    """Seed for random ('dummy') weights."""
    load_workers: int = 4
    """Parallel readers for safetensors shards."""
    tokenizer: str | None = None
    """Tokenizer override (a Hugging Face directory or tokenizer.json)."""
    quantization: str = "auto"
    """'auto': on CPU keep GGUF Q4_0/Q4_1 linear weights packed (int4 matmul, bf16
    activations), run an EXL3 checkpoint as EXL3; 'none': dequantize everything to
    --dtype; 'exl3': an EXL3 checkpoint, or random EXL3 weights for a dummy: model;
    'int8': an unquantized model's linear weights quantized at load time to int8 with
    per-output-row scales (weight-only, W8A16)."""
    bits: float | None = None
    """Dummy EXL3 models: bits per weight of the random trellises (1..8; x.5 with the
    mul1 codebook). None = the dummy config's own ``quantization_config.bits``."""
    enforce_eager: bool = False
    """CUDA: run decode steps eagerly instead of replaying captured CUDA graphs."""
    prefill_weight_cache_memory: int = 1 << 30
    """CPU int4 path: keep float32 copies of the packed linear weights for prefill
    chunks (which run an fp32 GEMM) when they fit in this many bytes, instead of
    dequantizing them every prefill step; 0 = never."""


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache."""

    block_size: int = 16
    """Tokens per KV block."""
    kv_cache_memory: int | None = None
    """Bytes for the KV pool; None = derived from gpu_memory_utilization (CUDA) or a CPU default."""
    gpu_memory_utilization: float = 0.9
    """Fraction of GPU memory the engine may use (weights + activations + KV)."""
    num_gpu_blocks_override: int | None = None
    """Force the pool to this many blocks (tests use it to force preemption)."""
    enable_prefix_caching: bool = True
    """Reuse KV blocks of identical prompt prefixes across requests."""
    cpu_kv_cache_default: int = 1 << 30
    """KV bytes on CPU when nothing else is said."""


@dataclass(frozen=True)
class SchedulerConfig:
    """The token-budget scheduler."""

    max_num_batched_tokens: int = 2048
    """Token budget of one step (prefill chunks + decode tokens)."""
    max_num_seqs: int = 64
    """Most requests running at once."""
    long_prefill_token_threshold: int = 0
    """Most prompt tokens one request may take in one step; 0 = no cap."""
    enable_chunked_prefill: bool = True
    """Split a prompt over several steps when it exceeds the remaining budget."""
    async_scheduling: bool | None = None
    """Plan and prepare step n+1 while the device runs step n (tokens sampled on the
    device feed the next step directly). None = on for CUDA, off on the CPU (where the
    host is the device and nothing overlaps)."""


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def validate(self) -> None:
        s, c = self.scheduler, self.cache
        if s.max_num_batched_tokens < 1:
            raise ValueError("--max-num-batched-tokens must be >= 1")
        if s.max_num_seqs < 1:
            raise ValueError("--max-num-seqs must be >= 1")
        if s.long_prefill_token_threshold < 0:
            raise ValueError("--long-prefill-token-threshold must be >= 0")
        if c.block_size < 1 or c.block_size & (c.block_size - 1):
            raise ValueError("--block-size must be a power of two")
        if not 0.0 < c.gpu_memory_utilization <= 1.0:
            raise ValueError("--gpu-memory-utilization must be in (0, 1]")
        if self.model.max_model_len is not None and self.model.max_model_len < 2:
            raise ValueError("--max-model-len must be >= 2")
        if c.num_gpu_blocks_override is not None and c.num_gpu_blocks_override < 1:
            raise ValueError("the KV block count override must be >= 1")
        if c.kv_cache_memory is not None and c.kv_cache_memory <= 0:
            raise ValueError("--kv-cache-memory must be positive")
        if self.model.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"unsupported --dtype {self.model.dtype!r}")
        if self.model.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"unsupported --device {self.model.device!r}")
        if self.model.quantization not in ("auto", "none", "exl3", "int8"):
            raise ValueError(f"unsupported --quantization {self.model.quantization!r}")
        if self.model.bits is not None and self.model.quantization != "exl3":
            raise ValueError("--bits needs --quantization exl3")


@dataclass(frozen=True)
class ServerConfig:
    """The OpenAI-compatible HTTP server (``trellm serve``). The engine never reads it."""

    host: str = "127.0.0.1"
    """Interface to bind; loopback unless the operator opts in to exposure."""
    port: int = 8000
    served_model_names: tuple[str, ...] = ()
    """Names clients may put in ``model``; the first is reported. () = derived from the model path."""
    api_key: str | None = None
    """Bearer key every route but /health requires; None = no auth."""
    max_queued_requests: int = 256
    """Sequences that may wait for a free seat; beyond it new requests get 503 + Retry-After."""
    max_n: int = 8
    """Most completions per request (``n``)."""
    max_logprobs: int = 20
    """Most alternatives per position (``logprobs`` / ``top_logprobs``)."""
    max_request_body_bytes: int = 2 << 20
    """Largest request body accepted; larger ones get 413 before being read."""
    request_body_timeout_s: float = 30.0
    """Deadline for receiving a whole request body (slow senders get 408)."""
    shutdown_timeout_s: float = 30.0
    """On SIGTERM, how long in-flight requests may finish before they are ended with an error."""
    engine_step_timeout_s: float = 0.0
    """Watchdog: an engine step running longer than this kills the engine; 0 = off."""
    allowed_origins: tuple[str, ...] = ()
    """CORS origins allowed to call the API from a browser; () = no CORS headers."""
    retry_after_s: int = 1
    """Value of the Retry-After header on 503 answers."""
    allowed_hosts: tuple[str, ...] = ()
    """Host-header names accepted besides loopback's (DNS-rebinding guard); '*' = any.
    Enforced when bound to loopback, or whenever names are given."""
    request_header_timeout_s: float = 10.0
    """Deadline for receiving a request's headers (slowloris); the connection is closed."""
    max_queue_wait_s: float = 0.0
    """A request still waiting for its first seat after this long gets 503 + Retry-After; 0 = off."""
    tokenize_timeout_s: float = 10.0
    """Deadline for tokenizing / templating one request's input (400 beyond it)."""

    def validate(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError("--port must be in [0, 65535]")
        if self.max_queued_requests < 0:
            raise ValueError("--max-queued-requests must be >= 0")
        if not 1 <= self.max_n <= 64:
            raise ValueError("--max-n must be in [1, 64]")
        if not 0 <= self.max_logprobs <= 20:
            raise ValueError("--max-logprobs must be in [0, 20]")
        if self.max_request_body_bytes < 1024:
            raise ValueError("--max-request-body-bytes must be >= 1024")
        if min(self.request_body_timeout_s, self.request_header_timeout_s, self.tokenize_timeout_s) <= 0:
            raise ValueError("--request-body-timeout, --request-header-timeout and --tokenize-timeout "
                             "must be > 0")
        if min(self.shutdown_timeout_s, self.engine_step_timeout_s, self.max_queue_wait_s) < 0:
            raise ValueError("--shutdown-timeout, --engine-step-timeout and --max-queue-wait must be >= 0")
        for name in self.allowed_hosts:
            if not name or len(name) > 255 or any(c in name for c in "/?#@ "):
                raise ValueError(f"--allowed-hosts: {name[:80]!r} is not a host name")
        if self.api_key is not None and not self.api_key:
            raise ValueError("--api-key must not be empty")
        for name in self.served_model_names:
            if not name or len(name) > 256:
                raise ValueError("--served-model-name values must be 1..256 characters")
