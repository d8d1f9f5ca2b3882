"""Hugging Face model directories: config.json + safetensors shards + tokenizer.

Only safetensors are read. ``*.bin`` / ``*.pt`` files are pickles, which can run
arbitrary code when loaded, so a directory that has only those is refused.
Shards are read by a small thread pool (I/O and page faults overlap); at most
``load_workers`` shards are held in memory ahead of the consumer.
"""
from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from tqdm import tqdm

from trellm.loader.checkpoint import Checkpoint, hf_dir_tokenizer, read_json_object
from trellm.loader.errors import ModelLoadError, first_line

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")


def load_hf_dir(path: Path, load_workers: int = 4) -> Checkpoint:
    """Open an HF directory as a ``Checkpoint``; shard headers are checked now, data read lazily."""
    config = read_json_object(path / "config.json")
    gen_path = path / "generation_config.json"
    generation_config = read_json_object(gen_path) if gen_path.is_file() else {}
    files = weight_files(path)
    for f in files:
        _check_header(f)
    tokenizer = hf_dir_tokenizer(path, generation_config)
    workers = max(1, int(load_workers))

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        return read_shards(files, workers)

    return Checkpoint(hf_config=config, tensors=tensors, tokenizer=tokenizer,
                      generation_config=generation_config, source=str(path))


def weight_files(path: Path) -> list[Path]:
    """The safetensors files holding the weights, from the index when there is one."""
    index = path / INDEX_FILE
    if index.is_file():
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{index} has no weight_map")
        files = [path / name for name in sorted(set(_shard_names(weight_map, index)))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{path}: shard {missing[0]} listed in {INDEX_FILE} is missing "
                                 f"({len(missing)} of {len(files)} shards missing)")
        return files
    if (path / SINGLE_FILE).is_file():
        return [path / SINGLE_FILE]
    # Regular files only (is_file follows links): a FIFO or device named *.safetensors
    # would block or stream forever when opened.
    shards = sorted(f for f in path.glob("*.safetensors") if f.is_file())
    # Repos may add adapters or a "consolidated" copy beside the model-* shards.
    preferred = [f for f in shards if f.name.startswith("model")]
    if preferred or shards:
        return preferred or shards
    pickles = sorted(f.name for f in path.iterdir() if f.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise ModelLoadError(f"{path} has only PyTorch pickle weights ({pickles[0]}); pickle "
                             f"checkpoints are not loaded for safety, convert them to safetensors")
    raise ModelLoadError(f"{path} has no model weights (no *.safetensors files)")


def _shard_names(weight_map: dict, index: Path) -> list[str]:
    """The index's shard file names: plain relative names inside the model directory
    (an index is data from the model's author, not a licence to read any file)."""
    names = []
    for name in weight_map.values():
        if not isinstance(name, str) or not name:
            raise ModelLoadError(f"{index}: weight_map values must be shard file names, got {name!r:.60}")
        rel = Path(name)
        if rel.is_absolute() or ".." in rel.parts:
            raise ModelLoadError(f"{index}: shard {name!r:.80} is outside the model directory")
        names.append(name)
    return names


def _check_header(f: Path) -> None:
    # safe_open parses the header and checks it against the file size, so
    # truncated or garbage files fail here, before any model memory is allocated.
    try:
        with safe_open(str(f), framework="pt") as sf:
            sf.keys()
    except Exception as e:  # SafetensorError, OSError
        raise ModelLoadError(f"{f} is not a valid safetensors file: {first_line(e)}") from e


def _read_shard(f: Path) -> list[tuple[str, torch.Tensor]]:
    try:
        with safe_open(str(f), framework="pt") as sf:
            return [(name, sf.get_tensor(name)) for name in sf.keys()]
    except Exception as e:
        raise ModelLoadError(f"cannot read {f}: {first_line(e)}") from e


def read_shards(files: list[Path], workers: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield every tensor of ``files``, reading up to ``workers`` shards in parallel.

    Shards come out in file order (deterministic loads); a shard's tensors are
    yielded once it is fully read.
    """
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="trellm-load")
    pending: deque[Future] = deque()
    todo = iter(files)
    bar = tqdm(total=len(files), unit="shard", desc="Loading safetensors", disable=len(files) < 2)
    try:
        for f in todo:
            pending.append(pool.submit(_read_shard, f))
            if len(pending) >= workers:
                break
        while pending:
            shard = pending.popleft().result()
            nxt = next(todo, None)
            if nxt is not None:
                pending.append(pool.submit(_read_shard, nxt))
            bar.update(1)
            yield from shard
    finally:
        bar.close()
        # A consumer that stops early must not wait for shards it will never use.
        pool.shutdown(wait=False, cancel_futures=True)
