"""``trellm bench load``: model load time against reading the same bytes from disk.

Three stages, each with a cold and a warm page cache:

* raw read: plain sequential ``read()`` of the model files, one thread, 16 MiB
  buffer: what the disk (or the page cache) gives;
* checkpoint read: ``open_checkpoint`` and every tensor iterated, as the engine's
  load consumes them (parse, dequantize or unpack), but no model built;
* model load: ``Engine(config)``: the checkpoint read, building the model and
  preparing its weights (int4 packing on the CPU), a small KV pool, no CUDA graphs.

"Cold" drops the files from the page cache first with
``posix_fadvise(POSIX_FADV_DONTNEED)`` per file. That needs no root but is best
effort: pages still mapped by a process (or dirty) stay. How much of the files was
resident right after the drop is measured (``mincore``) and reported beside it.
"""
from __future__ import annotations

import argparse
import gc
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from trellm.bench.report import emit, fmt, markdown_table, run_header

READ_BUFFER = 16 << 20
CACHE_DROP_NOTE = ("cold = posix_fadvise(POSIX_FADV_DONTNEED) on each file before the run: best effort, "
                   "no root needed (dirty pages are written back first); pages another process maps may stay resident "
                   "(resident fraction measured with mincore right after the drop)")


@dataclass(frozen=True)
class ModelFiles:
    kind: str
    """'gguf', 'hf' or 'dummy'."""
    files: tuple[Path, ...]
    """What the loader reads from disk; () for dummy (random weights, no disk read)."""

    @property
    def total_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.files)


@dataclass(frozen=True)
class Row:
    stage: str
    """'raw read', 'checkpoint read' or 'model load'."""
    cache: str
    """'cold', 'warm', or 'n/a' (dummy: nothing on disk)."""
    workers: int | None
    """Shard reader threads; None where they play no part."""
    seconds: float
    """Best of the samples."""
    samples: tuple[float, ...]
    gb_s: float | None
    """Model file bytes / seconds (1 GB = 1e9 bytes); None without a disk read."""
    resident_before: float | None
    """Fraction of the files in the page cache when the run started (None: unknown)."""


def model_files(model: str) -> ModelFiles:
    from trellm.loader.checkpoint import DUMMY_PREFIX, GGUF_MAGIC
    from trellm.loader.errors import ModelLoadError

    if model.startswith(DUMMY_PREFIX):
        return ModelFiles("dummy", ())
    if model == "":
        from trellm.default_model import default_model_path

        model = str(default_model_path())
    path = Path(model).expanduser()
    if path.is_dir():
        from trellm.loader.hf_loader import weight_files

        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} is a directory without config.json")
        weights = weight_files(path)
        extra = [f for f in sorted(path.glob("*.json")) if f not in weights]
        return ModelFiles("hf", tuple(weights + extra))
    if path.is_file():
        with open(path, "rb") as f:
            if f.read(4) == GGUF_MAGIC:
                return ModelFiles("gguf", (path,))
    raise ModelLoadError(f"{path} is not a GGUF file, a Hugging Face directory or dummy:<config.json>")


# ---- the page cache -----------------------------------------------------------------------


def drop_page_cache(files: tuple[Path, ...]) -> None:
    """Ask the kernel to forget the files' cached pages (best effort; see the module doc)."""
    gc.collect()  # memory maps of an earlier load keep their pages resident until closed
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            # Dirty pages (a model just downloaded or written) are kept until written back.
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident_fraction(files: tuple[Path, ...]) -> float | None:
    """Share of the files' pages in the page cache (mincore over a fresh mapping, which
    reads nothing); None where mincore is not available."""
    import ctypes
    import mmap

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    except (OSError, AttributeError):
        return None
    page = mmap.PAGESIZE
    resident = total = 0
    for f in files:
        size = f.stat().st_size
        if size == 0:
            continue
        pages = (size + page - 1) // page
        fd = os.open(f, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                return None
            try:
                vec = (ctypes.c_ubyte * pages)()
                if libc.mincore(addr, size, vec) != 0:
                    return None
                resident += sum(b & 1 for b in vec)
            finally:
                libc.munmap(addr, size)
        finally:
            os.close(fd)
        total += pages
    return resident / total if total else None


# ---- the stages ---------------------------------------------------------------------------


def raw_read(files: tuple[Path, ...]) -> float:
    """Seconds to read every byte of ``files`` in order, unbuffered, one thread."""
    buf = memoryview(bytearray(READ_BUFFER))
    t0 = time.perf_counter()
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass
    return time.perf_counter() - t0


def checkpoint_read(model: str, workers: int, keep_q4: bool) -> float:
    from trellm.loader.checkpoint import open_checkpoint

    t0 = time.perf_counter()
    ckpt = open_checkpoint(model, load_workers=workers, keep_q4=keep_q4)
    for _name, _tensor in ckpt.tensors():
        pass
    seconds = time.perf_counter() - t0
    del ckpt
    return seconds


def model_load(model: str, engine_kw: dict) -> float:
    from trellm.engine.engine import Engine
    from trellm.entrypoints.llm import engine_config_from_kwargs

    config = engine_config_from_kwargs(model, **engine_kw)
    t0 = time.perf_counter()
    engine = Engine(config)
    seconds = time.perf_counter() - t0
    del engine
    gc.collect()
    _empty_cuda_cache()
    return seconds


def _empty_cuda_cache() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@dataclass(frozen=True)
class LoadSpec:
    model: str
    workers: tuple[int, ...]
    repeats: int
    engine_kw: dict
    """dtype, device, quantization, kv_cache_memory, enforce_eager (load_workers is set per run)."""


def _measure(stage: str, cache: str, workers: int | None, run: Callable[[], float], mf: ModelFiles,
             repeats: int) -> Row:
    samples, resident = [], []
    for _ in range(repeats):
        if cache == "cold":
            drop_page_cache(mf.files)
        resident.append(resident_fraction(mf.files) if mf.files else None)
        samples.append(run())
    best = min(samples)
    gb_s = mf.total_bytes / best / 1e9 if mf.files else None
    known = [r for r in resident if r is not None]
    return Row(stage, cache, workers, best, tuple(samples), gb_s, max(known) if known else None)


def plan(spec: LoadSpec, mf: ModelFiles) -> list[tuple[str, str, int | None, Callable[[], float]]]:
    """The runs in order: raw reads, then per worker count checkpoint read and model load,
    each cold then warm (the cold run itself warms the cache for the warm one)."""
    from trellm.worker.builder import resolve_device

    keep_q4 = spec.engine_kw.get("quantization", "auto") == "auto" and \
        resolve_device(spec.engine_kw.get("device", "auto")).type == "cpu"
    # Only HF safetensors shards go through the parallel reader; one run covers the rest.
    workers = spec.workers if mf.kind == "hf" else spec.workers[:1]
    caches = ("cold", "warm") if mf.files else ("n/a",)
    runs: list = []
    if mf.files:
        runs += [("raw read", c, None, lambda: raw_read(mf.files)) for c in caches]
    for w in workers:
        kw = {**spec.engine_kw, "load_workers": w}
        shown = w if mf.kind == "hf" else None
        if mf.files:
            runs += [("checkpoint read", c, shown, lambda w=w: checkpoint_read(spec.model, w, keep_q4))
                     for c in caches]
        runs += [("model load", c, shown, lambda kw=kw: model_load(spec.model, kw)) for c in caches]
    return runs


def _import_loaders() -> None:
    """Import what a load imports lazily, so the first (cold) run does not also pay
    for importing torch and the model code (seconds on a busy machine)."""
    import trellm.engine.engine  # noqa: F401
    import trellm.loader.gguf_loader  # noqa: F401
    import trellm.loader.hf_loader  # noqa: F401
    import trellm.tokenizer.tokenizer  # noqa: F401
    import trellm.worker.builder  # noqa: F401


def run_load(spec: LoadSpec) -> dict:
    """Every run of ``plan``; the result dict without the run header."""
    from tqdm import tqdm

    mf = model_files(spec.model)
    _import_loaders()
    runs = plan(spec, mf)
    rows: list[Row] = []
    with tqdm(total=len(runs), desc="load", unit="run") as bar:
        for stage, cache, workers, fn in runs:
            bar.set_postfix(stage=stage, cache=cache, workers=workers)
            rows.append(_measure(stage, cache, workers, fn, mf, spec.repeats))
            bar.update(1)
    notes = [CACHE_DROP_NOTE] if mf.files else ["dummy model: random weights, no disk read"]
    stuck = [r.resident_before for r in rows if r.cache == "cold" and (r.resident_before or 0) > 0.5]
    if stuck:
        notes.append(f"the cache drop did not take: up to {max(stuck):.0%} of the files stayed resident, so "
                     f"'cold' rows are warm here (another process maps them, or the files live in tmpfs)")
    if mf.kind == "gguf":
        notes.append("--workers applies to Hugging Face safetensors shards only; a GGUF is one memory-mapped "
                     "file, so it was loaded once")
    return {"format": mf.kind, "files": [{"path": str(f), "bytes": f.stat().st_size} for f in mf.files],
            "total_bytes": mf.total_bytes, "workers": list(spec.workers), "repeats": spec.repeats,
            "engine_args": spec.engine_kw, "rows": [asdict(r) for r in rows], "notes": notes}


def load_markdown(result: dict) -> str:
    rows = [[r["stage"], r["workers"] if r["workers"] is not None else "–", r["cache"],
             "–" if r["resident_before"] is None else f"{r['resident_before']:.0%}",
             fmt(r["seconds"], 3), fmt(r["gb_s"], 2)] for r in result["rows"]]
    table = markdown_table(["stage", "workers", "page cache", "resident at start", "seconds", "GB/s"], rows)
    size = f"{result['total_bytes'] / 1e9:.3f} GB in {len(result['files'])} file(s)" if result["files"] else "no files"
    return "\n".join([table, "", f"model {result['model']} ({result['format']}, {size}); GB/s = file bytes / "
                      f"seconds, best of {result['repeats']}"] + [f"- {n}" for n in result["notes"]])


def plot_load(result: dict, path: str | Path) -> None:
    """Horizontal bars: seconds per stage and cache state, labelled with GB/s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    colors = {"raw read": "#718096", "checkpoint read": "#63b3ed", "model load": "#2b6cb0"}
    labels = [r["stage"] + ("" if r["workers"] is None else f" w={r['workers']}") + f" ({r['cache']})" for r in rows]
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(rows) + 1.5))
    bars = ax.barh(range(len(rows)), [r["seconds"] for r in rows], color=[colors[r["stage"]] for r in rows],
                   hatch=None)
    for bar, r in zip(bars, rows):
        if r["cache"] == "cold":
            bar.set_hatch("//")
    ax.bar_label(bars, [f"{r['seconds']:.2f} s" + ("" if r["gb_s"] is None else f"  {r['gb_s']:.2f} GB/s")
                        for r in rows], fontsize=8, padding=3)
    ax.set_yticks(range(len(rows)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("seconds (hatched: cold page cache, best effort)")
    ax.margins(x=0.3)
    ax.set_title(f"load vs raw read: {Path(result['model']).name or result['model']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- the command --------------------------------------------------------------------------


def _workers(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text!r}") from e
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError("worker counts are integers >= 1, e.g. 1,2,4,8")
    return vals


def add_load_parser(bsub) -> None:
    p = bsub.add_parser("load", help="model load time (cold and warm page cache) against a raw read of its files")
    p.add_argument("model", nargs="?", default="",
                   help="GGUF file, Hugging Face directory or dummy:<config.json> (default: embedded SmolLM2-135M)")
    p.add_argument("--workers", type=_workers, default=(4,),
                   help="safetensors shard reader threads, one or a list, e.g. 1,2,4,8 (default 4)")
    p.add_argument("--repeats", type=int, default=1, help="runs per row; the best is reported")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--quantization", default="auto", choices=["auto", "none"])
    p.add_argument("--kv-cache-memory", type=int, default=64 << 20,
                   help="bytes for the KV pool of each load (small: the bench is about weights)")
    p.add_argument("--out", default=None, help="write JSON results here")
    p.add_argument("--png", default=None, help="write the plot here (default: beside --out, .png)")
    p.set_defaults(func=run_load_command)


def run_load_command(args: argparse.Namespace) -> int:
    if args.repeats < 1:
        raise ValueError("--repeats must be >= 1")
    engine_kw = {"dtype": args.dtype, "device": args.device, "quantization": args.quantization,
                 "kv_cache_memory": args.kv_cache_memory, "enforce_eager": True}
    spec = LoadSpec(args.model, args.workers, args.repeats, engine_kw)
    result = run_load(spec)
    model = args.model or "embedded default (SmolLM2-135M-Instruct, Q4_1 GGUF)"
    result = {**run_header("load", model, getattr(args, "argv", None)), **result}
    emit(result, load_markdown(result), args.out, args.png, plot_load)
    return 0
